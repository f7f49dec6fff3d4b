"""The data side of `kalmix train`: document sources, tokenizers, prepared token shards, packed rows and
deterministic loaders. Names are imported on first use, so ``import kalmix.train`` stays light."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "DataConfig": "data", "iter_documents": "data", "resolve_format": "data", "source_fingerprint": "data",
    "prepare": "data", "PackedDataset": "data", "collate": "data", "cu_seqlens_from_doc_pos": "data",
    "Loader": "data", "val_batches": "data",
    "EOS_TOKEN": "tokenizer", "train_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "tokenizer_fingerprint": "tokenizer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
