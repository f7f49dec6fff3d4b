"""Fast decoding: a static cache and one CUDA graph per decode step.

On the GPU hosts kalmix targets, launching a kernel costs tens of microseconds of host time, so a decode step
of a few hundred small kernels is host-bound however fast each kernel is. ``Decoder`` prefills eagerly into a
``KalmixCache(static=True)`` (fixed-address states, attention's KV preallocated for ``max_length`` tokens, a
device-side position), captures one model step in a CUDA graph, and replays it once per token.
"""
from __future__ import annotations

import numbers
import os
import time

import torch

from kalmix.layers.cache import KalmixCache
from kalmix.layers.common import check_int, check_real, describe, is_integer
from kalmix.ops.common.checks import check_device


def check_sampling(name: str, max_new_tokens, do_sample, temperature, top_k, top_p=None,
                   length_optional: bool = False) -> None:
    """Decoding arguments, each refused with a ValueError naming it: max_new_tokens an int >= 1 (or None with
    ``length_optional``: the caller has another length), do_sample a bool (or None: greedy), temperature > 0 when
    sampling, top_k None (no top-k filtering) or an int >= 1, top_p None (no nucleus filtering) or in (0, 1]."""
    if max_new_tokens is not None or not length_optional:
        check_int(name, "max_new_tokens", max_new_tokens)
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{name}: `do_sample` must be True or False, got {do_sample!r}")
    if do_sample and temperature is not None:
        check_real(name, "temperature", temperature, note=" when sampling (greedy decoding: do_sample=False)")
    if top_k is not None:
        check_int(name, "top_k", top_k, note=" (or None: no top-k filtering)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"{name}: `top_p` must be a number in (0, 1] (None: no nucleus filtering), got {top_p!r}")


class Decoder:
    """Greedy or sampled decoding of a ``KalmixForCausalLM`` for a fixed batch size and length budget.

    Args:
        model: a ``KalmixForCausalLM`` (its device and dtype are used as they are).
        batch_size: B of every prompt batch decoded with this object.
        max_length: the most tokens (prompt + generated) a sequence may reach.
        graph: capture the step in a CUDA graph (default: on CUDA). False runs the same static-cache step
            eagerly, the path CPU tests check.
        compile: run the step through ``torch.compile`` (inductor fuses its elementwise work) before capturing.

    The graph is captured after the first prefill and replayed for every later prompt of the same batch size.
    """

    def __init__(self, model, batch_size: int, max_length: int, graph: bool | None = None, compile: bool = False):
        check_int("Decoder", "batch_size", batch_size)
        check_int("Decoder", "max_length", max_length, 2, " (a prompt token and a new one)")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.graph_wanted = self.device.type == "cuda" if graph is None else graph
        if self.graph_wanted and self.device.type != "cuda":
            raise ValueError("Decoder: graph=True needs a model on CUDA")
        self.batch_size, self.max_length = batch_size, max_length
        self.cache = KalmixCache(static=True, capacity=max_length)
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.length = 0
        self._step = torch.compile(self._forward_step) if compile else self._forward_step

    def _forward_step(self) -> torch.Tensor:
        return self.model(self.tokens, cache=self.cache, use_cache=True).logits[:, -1]

    @torch.no_grad()
    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the prompts input_ids [B, T] (left-padded where ``attention_mask`` [B, T] has zeros) into the
        cache; returns the last position's logits [B, vocab]."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer(input_ids) \
                or input_ids.shape[1] == 0:
            raise ValueError(f"Decoder: prompts `input_ids` must be an integer tensor [B, T] with T >= 1, got "
                             f"{describe(input_ids)}")
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"Decoder: built for batch size {self.batch_size}, got prompts of batch {B}")
        if T >= self.max_length:
            raise ValueError(f"Decoder: a prompt of {T} tokens leaves no room within max_length = {self.max_length}")
        self.cache.reset()
        out = self.model(input_ids.to(self.device), cache=self.cache, use_cache=True, logits_to_keep=1,
                         attention_mask=None if attention_mask is None else attention_mask.to(self.device))
        self.length = T
        if self.graph_wanted and self.graph is None:
            self._capture()
        return out.logits[:, -1]

    def _capture(self) -> None:
        """Warm up and capture one step; the cache's states and position are restored afterwards."""
        snap = self.cache.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
        self.cache.restore(snap)

    @torch.no_grad()
    def step(self, tokens: torch.LongTensor) -> torch.Tensor:
        """Feed one token per sequence, tokens [B]; returns the next logits [B, vocab] (a buffer the next step
        overwrites when graphed)."""
        if self.length >= self.max_length:
            raise ValueError(f"Decoder: the sequences reached max_length = {self.max_length}")
        if not isinstance(tokens, torch.Tensor) or not is_integer(tokens) or tokens.numel() != self.batch_size:
            raise ValueError(f"Decoder: `tokens` must be an integer tensor [B] = [{self.batch_size}] (one token per "
                             f"sequence), got {describe(tokens)}")
        self.tokens.copy_(tokens.view(self.batch_size, 1))
        self.length += 1
        if self.graph is None:
            return self._step()
        self.graph.replay()
        self.cache.count_seen(1)
        return self.logits

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.LongTensor:
        """Prompts [B, T] -> [B, T + max_new_tokens]: greedy, or sampled at ``temperature`` from the ``top_k``
        most likely tokens. Nothing is read back to the host until the end."""
        check_sampling("Decoder", max_new_tokens, do_sample, temperature, top_k)
        if input_ids.shape[1] + max_new_tokens > self.max_length:
            raise ValueError(f"Decoder: {input_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed "
                             f"max_length = {self.max_length}")
        logits = self.prefill(input_ids, attention_mask)
        new = self.decode(logits, max_new_tokens, do_sample, temperature, top_k, generator)
        return torch.cat([input_ids.to(self.device), new], 1)

    @torch.no_grad()
    def decode(self, logits: torch.Tensor, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
               top_k: int | None = None, generator: torch.Generator | None = None) -> torch.LongTensor:
        """From the prefill's logits [B, vocab], choose and feed ``max_new_tokens`` tokens -> [B, max_new_tokens]."""
        check_sampling("Decoder", max_new_tokens, do_sample, temperature, top_k)
        out = []
        for i in range(max_new_tokens):
            nxt = self._choose(logits, do_sample, temperature, top_k, generator)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self.step(nxt)
        return torch.stack(out, 1)

    @staticmethod
    def _choose(logits, do_sample, temperature, top_k, generator):
        if not do_sample:
            return logits.argmax(-1)
        logits = logits.float() / temperature
        if top_k is not None:                                   # top_k >= vocab: no filtering
            kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

    @torch.no_grad()
    def time_step(self, n: int = 50) -> float:
        """Milliseconds per decode step, the mean over ``n`` steps after a prefill (device-synchronised)."""
        tok = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.step(tok)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step(tok)
        sync()
        return (time.perf_counter() - t0) / n * 1e3


def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 64, tokenizer: str | None = None,
                  device: str | None = None, dtype: str = "auto", graph: bool | None = None, do_sample: bool = False,
                  temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> dict:
    """Load a saved ``KalmixForCausalLM`` (and the tokenizer saved beside it, or ``tokenizer``), decode
    ``prompt`` with ``Decoder``; returns {"text", "new_tokens", "prefill_s", "decode_s", "tokens_per_s"}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kalmix.models  # noqa: F401  (registers the Auto classes)

    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"generate: `prompt` must be a non-empty string, got {prompt!r}")
    check_sampling("generate", max_new_tokens, do_sample, temperature, top_k)
    device = _device("generate", device)
    dtypes = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"generate: dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"generate: {model_dir!r} is not a saved model (a folder of save_pretrained, with its "
                         f"config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer or model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"generate: no tokenizer could be loaded from {tokenizer or model_dir!r} "
                         f"({str(e).splitlines()[0]}); save the tokenizer beside the model or name its folder with "
                         f"`tokenizer`") from e
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtypes[dtype]).to(device)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] == 0:
        raise ValueError("generate: the prompt tokenises to no tokens")
    dec = Decoder(model, 1, ids.shape[1] + max_new_tokens, graph=graph)
    gen = torch.Generator(device=device).manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dec.prefill(ids)                                         # compiles kernels and captures the graph
    sync()
    t0 = time.perf_counter()
    logits = dec.prefill(ids)
    sync()
    t1 = time.perf_counter()
    new = dec.decode(logits, max_new_tokens, do_sample, temperature, top_k, gen)[0].tolist()
    t2 = time.perf_counter()
    return {"text": tok.decode(new), "new_tokens": new, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "tokens_per_s": max_new_tokens / (t2 - t1), "graph": dec.graph is not None}


def _device(name: str, device: str | None) -> torch.device:
    """``device`` ("cpu", "cuda" or "cuda:N"; None: CUDA where there is a GPU) as a torch.device that exists here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return check_device(device)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
