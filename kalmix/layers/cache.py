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

    A recurrent layer stores ``{"recurrent_state": tensor or tuple of tensors [B, H, ...], "conv_state":
    [B, C, kernel - 1]}``; an attention layer stores its keys and values in buffers [B, capacity, H, D] that grow
    by doubling (``context_kv``), so a decode step writes one row instead of concatenating the whole context.
    Every entry also records how many tokens the layer has seen. All states share the batch size of the first
    write; a call with another batch size raises.

    With ``static=True`` every later ``update`` writes into the tensors already stored (``copy_``), so the state
    keeps fixed addresses, and attention's buffers are allocated once for ``capacity`` tokens: what a captured
    CUDA graph needs. A static cache also counts the tokens seen in a device tensor (``position``, advanced by
    the model), from which attention's single-token steps address their KV row and positions with no host value.
    """

    def __init__(self, static: bool = False, capacity: int | None = None):
        if static and not capacity:
            raise ValueError("KalmixCache: a static cache needs `capacity`, the most tokens it will hold")
        self.static = static
        self.capacity = capacity
        self.layers: dict[int, dict] = {}
        self.batch_size: int | None = None
        self.has_padding = False                   # whether the cached context holds padding (set by the model)
        self.position: torch.Tensor | None = None  # static: tokens seen, [1] int64 on the states' device
        self.key_mask: torch.Tensor | None = None  # static: [B, capacity] bool, False at padded context rows
        self.pad_count: torch.Tensor | None = None  # static: [B] int64, padded rows of each sequence

    def reset(self) -> None:
        """Forget the context but keep every buffer (a static cache is reused by the next prompt)."""
        for entry in self.layers.values():
            entry["seen"] = 0
        self.has_padding = False
        if self.position is not None:
            self.position.zero_()
            self.key_mask.fill_(True)
            self.pad_count.zero_()

    def advance(self, n: int, device: torch.device, batch_size: int) -> None:
        """Count ``n`` more tokens in ``position`` (static caches; created on first use)."""
        if self.position is None:
            self.position = torch.zeros(1, dtype=torch.long, device=device)
            self.key_mask = torch.ones(batch_size, self.capacity, dtype=torch.bool, device=device)
            self.pad_count = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.position.add_(n)

    def mark_padding(self, attention_mask: torch.Tensor, start: int) -> None:
        """Record a prefill's padding [B, T] at context rows start.. (static caches)."""
        T = attention_mask.shape[1]
        self.key_mask[:, start:start + T] = attention_mask.bool()
        self.pad_count += (attention_mask == 0).sum(1)

    def snapshot(self) -> dict:
        """Copies of the recurrent and convolution states, counters and position (KV rows are not copied:
        rows past ``position`` are never read before they are written)."""
        return {"layers": {i: {n: (v if n == "seen" else _map(torch.clone, v)) for n, v in e.items() if n != "kv"}
                           for i, e in self.layers.items()},
                "position": None if self.position is None else self.position.clone()}

    def restore(self, snap: dict) -> None:
        """Write a ``snapshot`` back into the same tensors."""
        for i, saved in snap["layers"].items():
            for name, value in saved.items():
                if name == "seen":
                    self.layers[i]["seen"] = value
                else:
                    for dst, src in zip(_tensors(self.layers[i][name]), _tensors(value)):
                        dst.copy_(src)
        if snap["position"] is not None:
            self.position.copy_(snap["position"])

    def count_seen(self, n: int) -> None:
        """Add ``n`` to every layer's host token count (after graph replays, which run no Python)."""
        for entry in self.layers.values():
            entry["seen"] += n

    def __len__(self) -> int:
        """1 + the highest layer index stored (fla's layers read ``len(cache) > layer_idx`` as "has state")."""
        return max(self.layers, default=-1) + 1

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

    def update(self, layer_idx: int, seen: int | None = None, *, offset: int | None = None, **states) -> None:
        """Store the layer's states after it consumed ``seen`` more tokens (``offset``: fla's layers' name)."""
        seen = offset if seen is None else seen
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
        if self.static and start + T > self.capacity:
            raise ValueError(f"KalmixCache: a static cache holds at most {self.capacity} tokens; layer {layer_idx} "
                             f"would hold {start + T}")
        if buf is None or buf[0].shape[1] < start + T or buf[0].dtype != k.dtype:
            cap = self.capacity if self.static else max(start + T, 2 * (buf[0].shape[1] if buf is not None else 0), 16)
            # zeros: a static step reads every row (masked), and 0 · NaN of stale memory would be NaN
            new = tuple((x.new_zeros if self.static else x.new_empty)(B, cap, *x.shape[2:]) for x in (k, v))
            if buf is not None:
                for dst, src in zip(new, buf):
                    dst[:, :start] = src[:, :start]
            entry["kv"] = buf = new
        buf[0][:, start:start + T] = k
        buf[1][:, start:start + T] = v
        entry["seen"] = start + T
        return buf[0][:, :start + T], buf[1][:, :start + T]

    def write_kv_at_position(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Static caches, one token: write k, v [B, 1, H, D] at row ``position``; returns the whole buffers
        [B, capacity, H, D] and the mask of the rows a query may see [B, capacity] (the context and itself)."""
        entry = self.layers[layer_idx]
        kb, vb = entry["kv"]
        kb.index_copy_(1, self.position, k)
        vb.index_copy_(1, self.position, v)
        entry["seen"] += 1
        rows = torch.arange(self.capacity, device=k.device)
        return kb, vb, self.key_mask & (rows <= self.position)[None]

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
