"""The decoding cache every kalmix layer reads and writes: recurrent and convolution states, attention's KV."""
from __future__ import annotations

import torch


def _map(fn, x):
    """Apply ``fn`` to every tensor of a nested tuple/list (None and ints pass through)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, y) for y in x)
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


class KalmixCache:
    """Per-layer decoding state of a model (or of stand-alone layers), indexed by ``layer_idx``.

    A recurrent layer stores ``{"recurrent_state": tensor or tuple of tensors [B, H, ...], "conv_state": tuple of
    [B, C, kernel - 1]}``; an attention layer stores its keys and values in buffers [B, capacity, H, D] that grow
    by doubling (``context_kv``), so a decode step writes one row instead of concatenating the whole context.
    Every entry also records how many tokens the layer has seen. All states share the batch size of the first
    write; a call with another batch size raises.

    With ``static=True`` every later ``update`` writes into the tensors already stored (``copy_``), so the state
    keeps fixed addresses: what a captured CUDA graph needs.
    """

    def __init__(self, static: bool = False):
        self.static = static
        self.layers: dict[int, dict] = {}
        self.batch_size: int | None = None
        self.has_padding = False                   # whether the cached context holds padding (set by the model)

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def get(self, layer_idx: int, batch_size: int | None = None) -> dict | None:
        """This layer's entry, or None before its first write; checks ``batch_size`` against the cache's."""
        if batch_size is not None and self.batch_size is not None and batch_size != self.batch_size:
            raise ValueError(f"KalmixCache holds the states of {self.batch_size} sequences, but layer {layer_idx} was "
                             f"called with a batch of {batch_size}; start a new cache for a new batch")
        return self.layers.get(layer_idx)

    def __getitem__(self, layer_idx: int) -> dict:
        return self.layers[layer_idx]

    def _check_batch(self, layer_idx: int, states: dict) -> None:
        for t in _tensors(list(states.values())):
            self.get(layer_idx, t.shape[0])
            if self.batch_size is None:
                self.batch_size = t.shape[0]

    def update(self, layer_idx: int, seen: int, **states) -> None:
        """Store the layer's states after it consumed ``seen`` more tokens."""
        self._check_batch(layer_idx, states)
        entry = self.layers.setdefault(layer_idx, {"seen": 0})
        for name, value in states.items():
            old = entry.get(name)
            if self.static and old is not None:
                for dst, src in zip(_tensors(old), _tensors(value)):
                    if dst is not src:
                        dst.copy_(src)
            else:
                entry[name] = value
        entry["seen"] += seen

    def context_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, store: bool = True):
        """The whole context's (k, v) [B, S, H, D]: the cached rows followed by k, v [B, T, H, D], which are
        appended to the layer's KV buffers when ``store``."""
        B, T = k.shape[:2]
        self._check_batch(layer_idx, {"k": k})
        entry = self.layers.get(layer_idx) or {"seen": 0}
        start = entry["seen"]
        buf = entry.get("kv")
        if not store:
            if buf is None:
                return k, v
            return torch.cat([buf[0][:, :start], k], 1), torch.cat([buf[1][:, :start], v], 1)
        self.layers[layer_idx] = entry
        if buf is None or buf[0].shape[1] < start + T or buf[0].dtype != k.dtype:
            cap = max(start + T, 2 * (buf[0].shape[1] if buf is not None else 0), 16)
            new = tuple(x.new_empty(B, cap, *x.shape[2:]) for x in (k, v))
            if buf is not None:
                for dst, src in zip(new, buf):
                    dst[:, :start] = src[:, :start]
            entry["kv"] = buf = new
        buf[0][:, start:start + T] = k
        buf[1][:, start:start + T] = v
        entry["seen"] = start + T
        return buf[0][:, :start + T], buf[1][:, :start + T]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer ``layer_idx`` (0 before its first call)."""
        entry = self.layers.get(layer_idx)
        return entry["seen"] if entry else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select (and repeat) sequences along the batch: every state becomes state[beam_idx]."""
        for entry in self.layers.values():
            for name, value in entry.items():
                if name != "seen":
                    entry[name] = _map(lambda t: t.index_select(0, beam_idx.to(t.device)), value)
        self.batch_size = beam_idx.numel() if self.layers else self.batch_size

    def nbytes(self) -> int:
        """Bytes held by every state and buffer of the cache."""
        return sum(t.numel() * t.element_size() for e in self.layers.values() for t in _tensors(list(e.values())))
