"""Counting host reads: the calls that bring a tensor's values to the host, each of which waits for the device on a
GPU (a synchronisation). On the CPU nothing waits, so the tests count the calls: ``with HostReads() as reads:`` …
``reads.count``. A read of a host copy already made (``cpu()``, ``numpy()``) is not counted again."""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

# value reads, and ops whose output size depends on the values (the host waits for it)
_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
          "unique", "unique_consecutive", "masked_select", "equal", "allclose", "bincount"}

_FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "linspace", "eye"}


def _moves(args: tuple, kwargs: dict) -> bool:
    """A ``to`` call names a device."""
    return isinstance(kwargs.get("device", args[1] if len(args) > 1 else None), (str, torch.device))


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _READS:
        return True
    if name == "to":                                        # .to("cpu"), .to(torch.device("cpu"))
        return _moves(args, kwargs) and torch.device(kwargs.get("device", args[1] if len(args) > 1 else None)).type \
            == "cpu"
    if name == "repeat_interleave":                         # without output_size its size comes from the values
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
            and kwargs.get("output_size") is None
    if name in ("__getitem__", "__setitem__"):              # boolean-mask indexing: a nonzero inside
        index = args[1] if len(args) > 1 else None
        index = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostReads(TorchFunctionMode):
    """Records every host read made inside the ``with`` block: ``count`` and ``where`` (a stack line each).

    Tensors made on the host (by a factory naming no device, or copied there by a read) are read for free; moving
    one with ``to`` is a copy to the device (on a GPU), whose result is a device tensor again."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []
        self._host: dict[int, torch.Tensor] = {}             # host tensors made inside the block, by id

    @property
    def count(self) -> int:
        return len(self.where)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        first = args[0] if args else None
        on_host = id(first) in self._host
        if name in _FACTORIES and kwargs.get("device") is None:     # made on the host (no device named)
            self._host[id(out)] = out
        elif name == "to" and on_host and _moves(args, kwargs):     # host -> device
            out = out.clone() if out is first else out
        elif name == "to" and on_host:                      # a cast on the host
            self._host[id(out)] = out
        elif _is_read(name, args, kwargs) and not on_host:
            frame = traceback.extract_stack(limit=2)[0]
            self.where.append(f"{name} at {frame.filename}:{frame.lineno}")
            if name in ("cpu", "to"):                       # on the CPU a copy to the host is the tensor itself
                out = out.clone() if out is first else out
                self._host[id(out)] = out
        else:                                               # computed from host tensors only: on the host too
            flat = [y for x in (*args, *kwargs.values()) for y in (x if isinstance(x, (tuple, list)) else (x,))]
            given = [x for x in flat if isinstance(x, torch.Tensor)]
            if given and all(id(x) in self._host for x in given):
                for y in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(y, torch.Tensor):
                        self._host[id(y)] = y
        return out
