"""Training data for `kalmix train`: documents from a local source, tokenised once into memory-mapped shards,
packed into rows of ``seq_len`` tokens and dealt out as deterministic, resumable micro-batches.

``prepare`` writes ``out_dir`` as::

    meta.json           written last: the dataset is complete once it exists
    train/, val/        one directory per split, each holding
        tokens.bin      every document's token ids followed by eos, end to end (raw uint16, or uint32 when the
                        tokenizer has more than 65536 ids)
        offsets.bin     raw int64 [num_docs + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
        meta.json       dtype, counts, vocab size, eos id, largest id, fingerprints, the data config

Every file is written under a temporary name in its directory, synced and renamed into place.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import site
import sysconfig
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

import numpy as np
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from kalmix.layers.documents import cu_seqlens_from_positions
from kalmix.train.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

STDLIB = "stdlib"
PYTHON = "python"       # the standard library and every installed package's sources: a larger local corpus
_BUILTIN = (STDLIB, PYTHON)
SPLITS = ("train", "val")
FORMAT_VERSION = 1
_SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
_COPY_TOKENS = 1 << 24  # tokens per chunk when prepare copies documents into their split


class StaleDataset(ValueError):
    """``prepare``'s folder holds a dataset prepared from other source files, data config or tokenizer."""


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _number_text(value):
    # YAML 1.1 reads a float without a dot (1e-3) as a string; that spelling is taken as the number it shows
    return float(value) if isinstance(value, str) and _NUMBER.fullmatch(value.strip()) else value


Float = Annotated[float, BeforeValidator(_number_text)]
"""A config float: an int or a float, or a string that spells one (``"1e-3"``); never a bool, inf or nan."""


class StrictConfig(BaseModel):
    """Base of the training configs: unknown keys are errors, and values keep their types (an int field takes
    only ints, not ``true`` or ``3.0``; a str field only strings; a ``Float`` field ints, floats and their
    spellings as strings; inf and nan nowhere)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DataConfig(StrictConfig):
    """Where the documents come from and how they are split into train / validation."""

    model_config = ConfigDict(frozen=True)

    source: str = Field(STDLIB, min_length=1, description="'stdlib' (the Python standard library's *.py files), 'python' (those "
                                            "and every installed package's *.py files) or a path: a file "
                                            "or a directory of *.txt / *.jsonl / *.parquet files, or a "
                                            "datasets.save_to_disk directory")
    format: Literal["auto", "text", "jsonl", "parquet", "datasets"] = Field(
        "auto", description="how to read source; 'auto' infers it from the path")
    text_field: str = Field("text", min_length=1, description="jsonl field / parquet or datasets column holding the text")
    split: str = Field("train", min_length=1, description="split of a saved datasets.DatasetDict (not the train / val split, "
                                            "which prepare makes)")
    text_docs: Literal["file", "blocks"] = Field(
        "file", description="text sources: one document per file, or per block of lines between blank lines")
    max_docs: int | None = Field(None, gt=0, description="read only the first max_docs documents")
    val_fraction: Float = Field(0.01, gt=0, lt=1, description="fraction of documents held out for validation "
                                                              "(at least one in each split)")
    seed: int = Field(0, ge=0, description="seed of the train / validation assignment of documents")

    @field_validator("source", mode="before")
    @classmethod
    def _path_to_str(cls, v):
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @model_validator(mode="after")
    def _stdlib_is_auto(self):
        if self.source in _BUILTIN and self.format != "auto":
            raise ValueError(f"source {self.source!r} is read as Python files; leave format 'auto' (got "
                             f"{self.format!r}), or write './{self.source}' for a path of that name")
        return self


# ---------------------------------------------------------------------------------------------- sources


def resolve_format(cfg: DataConfig) -> str:
    """'stdlib' / 'python', or the format ``cfg.source`` is read as ('auto' inferred from the path)."""
    if cfg.source in _BUILTIN:
        return cfg.source
    path = _source_path(cfg)
    if cfg.format != "auto":
        return cfg.format
    if path.is_dir():
        if is_saved_dataset(path):
            return "datasets"
        found = [fmt for fmt, suffix in _SUFFIXES.items() if _files_under(path, suffix)]
        if len(found) != 1:
            what = "no *.txt, *.jsonl or *.parquet files" if not found else f"files of several formats {found}"
            raise ValueError(f"cannot infer the format of {path}: it holds {what}; set format")
        return found[0]
    for fmt, suffix in _SUFFIXES.items():
        if path.suffix == suffix:
            return fmt
    raise ValueError(f"cannot infer the format of {path} from its suffix {path.suffix!r} (.txt, .jsonl, .parquet "
                     f"are known); set format")


def iter_documents(cfg: DataConfig, split: Literal["train", "val"] | None = None) -> Iterator[str]:
    """The documents (str) of ``cfg.source`` in a fixed order, at most ``cfg.max_docs``; empty and whitespace-only
    ones are skipped. ``split`` keeps only the documents ``prepare`` assigns to that split (this reads the source
    twice: once to count the documents). The source is checked before this returns (missing path, no files, missing
    column or split); a source without a single document raises ValueError once exhausted.

    'stdlib': one document per ``*.py`` file under the standard library (site-packages skipped; the few files that
    are not UTF-8 skipped), in sorted path order. 'python': those, then every ``*.py`` file of the site-packages
    folders, in sorted path order (what is installed decides the corpus). text: one per file (UTF-8), or per block
    with text_docs='blocks' (blocks are separated by lines holding only whitespace; their surrounding newlines are
    removed). jsonl: one per line, the string in ``text_field`` (blank lines skipped). parquet / datasets: one per
    row of ``text_field``. Directories are read in sorted path order, recursively, skipping hidden files and
    directories.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    docs = _documents(cfg)
    if split is None:
        return docs
    is_val = _validation_mask(sum(1 for _ in docs), cfg)
    return itertools.compress(_documents(cfg), is_val if split == "val" else ~is_val)


def source_fingerprint(cfg: DataConfig) -> str:
    """A hash of the paths, sizes and modification times of every file ``cfg.source`` reads."""
    fmt = resolve_format(cfg)
    if fmt in _BUILTIN:
        files = _python_files(fmt)
    elif fmt == "datasets":
        files = _files_under(_source_path(cfg), "")
    else:
        files = _source_files(_source_path(cfg), _SUFFIXES[fmt])
    return files_fingerprint(files)


def files_fingerprint(files: Iterable[Path]) -> str:
    """A hash of the files' resolved paths, sizes and modification times (cheap: no file is read)."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _documents(cfg: DataConfig) -> Iterator[str]:
    fmt = resolve_format(cfg)
    if fmt in _BUILTIN:
        docs = _read_stdlib(_python_files(fmt))
    elif fmt == "datasets":
        docs = _read_saved_dataset(_source_path(cfg), cfg.text_field, cfg.split)
    else:
        files = _source_files(_source_path(cfg), _SUFFIXES[fmt])
        if fmt == "text":
            docs = _read_text(files, blocks=cfg.text_docs == "blocks")
        elif fmt == "jsonl":
            docs = _read_jsonl(files, cfg.text_field)
        else:
            docs = _read_parquet(files, cfg.text_field)
    return _non_empty(docs, cfg)


def _source_path(cfg: DataConfig) -> Path:
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data source not found: {path}")
    return path


def is_saved_dataset(path: Path) -> bool:
    # what datasets' save_to_disk writes: dataset_dict.json for a DatasetDict, state.json for a Dataset
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _files_under(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _source_files(path: Path, suffix: str) -> list[Path]:
    if path.is_file():
        return [path]
    files = _files_under(path, suffix)
    if not files:
        raise ValueError(f"no *{suffix} files under {path}")
    return files


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def _python_files(which: str) -> list[Path]:
    files = _stdlib_files()
    if which == PYTHON:
        roots = sorted({Path(p) for key in ("purelib", "platlib") for p in [sysconfig.get_paths()[key]]} |
                       {Path(p) for p in site.getsitepackages()})
        seen = set(files)
        for root in roots:
            if root.is_dir():
                extra = sorted(p for p in root.rglob("*.py") if p.is_file() and p not in seen)
                seen.update(extra)
                files += extra
    return files


def _non_empty(docs: Iterable[str], cfg: DataConfig) -> Iterator[str]:
    n = 0
    for doc in docs:
        if doc.strip():
            yield doc
            n += 1
            if n == cfg.max_docs:
                return
    if n == 0:
        raise ValueError(f"data source {cfg.source!r} holds no non-empty documents")


def _read_stdlib(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of test modules are deliberately Latin-1 / KOI8-R or broken


def _read_text(files: list[Path], blocks: bool) -> Iterator[str]:
    for f in files:
        with open(f, encoding="utf-8") as fh:
            try:
                if not blocks:
                    yield fh.read()
                    continue
                lines: list[str] = []
                for line in fh:  # streamed, so a large file of short blocks is never held whole
                    if line.strip():
                        lines.append(line)
                    elif lines:
                        yield "".join(lines).strip("\n")
                        lines = []
                if lines:
                    yield "".join(lines).strip("\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{f}: not UTF-8 text ({e})") from e


def _read_jsonl(files: list[Path], field: str) -> Iterator[str]:
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{lineno}: invalid JSON: {e}") from e
                if not isinstance(obj, dict):
                    # ValueError like every other bad input, which callers report without a traceback
                    raise ValueError(f"{f}:{lineno}: expected a JSON object, got {type(obj).__name__}")  # noqa: TRY004
                if field not in obj:
                    raise ValueError(f"{f}:{lineno}: no field {field!r} (fields: {sorted(obj)}); set text_field")
                text = obj[field]
                if not isinstance(text, str):
                    kind = type(text).__name__
                    raise ValueError(f"{f}:{lineno}: field {field!r} is {kind}, not a string")  # noqa: TRY004
                yield text


def _read_parquet(files: list[Path], column: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from e
    opened = []
    for f in files:  # every schema is checked up front, before any tokenising
        try:
            pf = pq.ParquetFile(f)
        except pa.ArrowInvalid as e:
            raise ValueError(f"{f}: not a parquet file ({e}); set format to how it is written") from None
        schema = pf.schema_arrow
        if column not in schema.names:
            raise ValueError(f"{f}: no column {column!r} (columns: {schema.names}); set text_field")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise ValueError(f"{f}: column {column!r} has type {kind}, not string")
        opened.append((f, pf))

    def rows():
        for f, pf in opened:
            row = 0
            for batch in pf.iter_batches(columns=[column]):
                for text in batch.column(0).to_pylist():
                    if text is None:
                        raise ValueError(f"{f}: row {row} of column {column!r} is null")
                    yield text
                    row += 1
    return rows()


def _read_saved_dataset(path: Path, column: str, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading a datasets.save_to_disk directory needs datasets: pip install datasets") from e
    if not is_saved_dataset(path):
        raise ValueError(f"{path} is not a directory written by datasets' save_to_disk (no state.json or "
                         f"dataset_dict.json)")
    ds = datasets.load_from_disk(str(path))
    where = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (splits: {sorted(ds)}); set split")
        ds, where = ds[split], f"{path} split {split!r}"
    if column not in ds.column_names:
        raise ValueError(f"{where}: no column {column!r} (columns: {ds.column_names}); set text_field")
    if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"{where}: column {column!r} is {ds.features[column]}, not string")

    def rows():
        row = 0
        for batch in ds.select_columns([column]).iter(batch_size=1024):
            for text in batch[column]:
                if text is None:
                    raise ValueError(f"{where}: row {row} of column {column!r} is null")
                yield text
                row += 1
    return rows()


# ---------------------------------------------------------------------------------------------- prepare


def prepare(cfg: DataConfig, tokenizer, out_dir: str | os.PathLike, *, batch_size: int = 1024,
            progress: bool = True) -> dict[str, Any]:
    """Tokenise every document of ``cfg`` once into ``out_dir`` (layout in the module docstring); returns the
    dataset's metadata (the contents of ``out_dir/meta.json``).

    ``tokenizer``: a fast Hugging Face tokenizer with an eos token (``load_tokenizer`` / ``train_tokenizer``).
    Documents are encoded ``batch_size`` at a time without the tokenizer's own special tokens, and special-token
    text inside a document is encoded as plain text, so eos occurs only where ``prepare`` appends it: at the end of
    every document. Documents are assigned to validation by a seeded hash of their index (round(val_fraction · N),
    at least 1 and at most N − 1) and keep their source order within each split.

    When ``out_dir`` already holds a dataset with the same fingerprint (source files, data config, tokenizer) it is
    reused as it is; one with another fingerprint raises StaleDataset (a ValueError) rather than being overwritten.
    """
    out = Path(out_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError("prepare: the tokenizer has no eos token to end documents with")
    fingerprint = {"source": source_fingerprint(cfg), "config": _config_fingerprint(cfg),
                   "tokenizer": tokenizer_fingerprint(tokenizer)}
    fingerprint["dataset"] = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    if (out / "meta.json").exists():
        return _reuse(out, fingerprint)
    vocab_size = len(tokenizer)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    out.mkdir(parents=True, exist_ok=True)
    all_tokens = out / f".all-tokens.{uuid.uuid4().hex}.tmp"
    try:
        offsets = _tokenize(cfg, tokenizer, all_tokens, dtype, batch_size, progress)
        val = _validation_mask(len(offsets) - 1, cfg)
        tokens = np.memmap(all_tokens, dtype=dtype, mode="r")
        common = {"version": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": vocab_size,
                  "eos_token_id": tokenizer.eos_token_id, "tokenizer": str(tokenizer.name_or_path),
                  "fingerprint": fingerprint, "data_config": cfg.model_dump(), "format": resolve_format(cfg)}
        splits = {split: _write_split(out / split, tokens, offsets, mask, common)
                  for split, mask in (("train", ~val), ("val", val))}
        del tokens  # the memmap holds the file open
    finally:
        all_tokens.unlink(missing_ok=True)
    meta = {**common, "splits": splits}
    atomic_write(out / "meta.json", lambda f: f.write(json.dumps(meta, indent=2).encode()))
    return meta


def _config_fingerprint(cfg: DataConfig) -> str:
    # the resolved format and path, so 'auto' and the format it means (or two spellings of a path) agree
    fmt = resolve_format(cfg)
    source = cfg.source if fmt in _BUILTIN else str(Path(cfg.source).expanduser().resolve())
    spec = cfg.model_dump() | {"source": source, "format": fmt}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _reuse(out: Path, fingerprint: dict[str, str]) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{out} holds a dataset of format version {meta.get('version')}, this kalmix writes "
                         f"{FORMAT_VERSION}; delete it, or prepare into another folder")
    old = meta["fingerprint"]
    changed = [k for k in ("source", "config", "tokenizer") if old.get(k) != fingerprint[k]]
    if changed:
        what = {"source": "source files (paths, sizes or modification times)", "config": "data config",
                "tokenizer": "tokenizer"}
        raise StaleDataset(f"{out} already holds a dataset prepared with a different fingerprint: the "
                           f"{', '.join(what[k] for k in changed)} changed; delete it, or prepare into another "
                           f"folder")
    for split in SPLITS:
        _read_split_meta(out / split)  # checks that the shards are whole
    log.info("reusing the dataset prepared in %s", out)
    return meta


def _tokenize(cfg: DataConfig, tokenizer, path: Path, dtype: np.dtype, batch_size: int, progress: bool) -> np.ndarray:
    """Write every document's ids + eos to ``path``; returns the int64 offsets [N + 1]."""
    # a copy, so the caller's tokenizer keeps its settings; a tokenizer.json may ship with truncation (e.g. to 512)
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    eos, vocab_size = tokenizer.eos_token_id, len(tokenizer)
    lengths: list[int] = []
    total = 0
    docs = iter_documents(cfg)
    with open(path, "wb") as f, tqdm(desc="tokenising", unit="doc", disable=not progress) as bar:
        while batch := list(itertools.islice(docs, batch_size)):
            ids: list[int] = []
            for enc in backend.encode_batch_fast(batch, add_special_tokens=False):
                ids += enc.ids
                ids.append(eos)
                lengths.append(len(enc.ids) + 1)
            flat = np.asarray(ids, dtype=np.int64)
            if flat.max() >= vocab_size:
                raise ValueError(f"the tokenizer produced id {flat.max()} >= its vocabulary size {vocab_size}")
            f.write(flat.astype(dtype).tobytes())
            total += len(flat)
            bar.update(len(batch))
            bar.set_postfix(tokens=total, refresh=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _validation_mask(n: int, cfg: DataConfig) -> np.ndarray:
    """bool [n]: which of the n documents are held out: the round(val_fraction · n) (clamped to [1, n − 1]) of
    smallest hash(seed, index). A hash rather than an RNG permutation, so the split never depends on a library's
    generator."""
    if n < 2:
        raise ValueError(f"data source {cfg.source!r} holds {n} document; a train / validation split needs at least 2")
    keys = np.array([int.from_bytes(hashlib.blake2b(f"{cfg.seed}:{i}".encode(), digest_size=8).digest(), "little")
                     for i in range(n)], dtype=np.uint64)
    n_val = min(max(1, round(cfg.val_fraction * n)), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[np.argsort(keys, kind="stable")[:n_val]] = True
    return mask


def _write_split(split_dir: Path, tokens: np.ndarray, offsets: np.ndarray, mask: np.ndarray,
                 common: dict[str, Any]) -> dict[str, Any]:
    split_dir.mkdir(exist_ok=True)
    lengths = np.diff(offsets)
    split_offsets = np.zeros(int(mask.sum()) + 1, dtype=np.int64)
    np.cumsum(lengths[mask], out=split_offsets[1:])
    max_id = -1

    def write_tokens(f: BinaryIO) -> None:
        nonlocal max_id
        a = 0
        while a < len(lengths):  # whole documents, about _COPY_TOKENS tokens at a time
            b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + _COPY_TOKENS, side="right")) - 1)
            chunk = tokens[offsets[a]:offsets[b]][np.repeat(mask[a:b], lengths[a:b])]
            if chunk.size:
                max_id = max(max_id, int(chunk.max()))
                f.write(chunk.tobytes())
            a = b

    atomic_write(split_dir / "tokens.bin", write_tokens)
    atomic_write(split_dir / "offsets.bin", lambda f: f.write(split_offsets.tobytes()))
    counts = {"num_docs": len(split_offsets) - 1, "num_tokens": int(split_offsets[-1]), "max_token_id": max_id}
    meta = {**common, "split": split_dir.name, **counts}
    atomic_write(split_dir / "meta.json", lambda f: f.write(json.dumps(meta, indent=2).encode()))
    return counts


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``path`` through a temporary file in its directory, synced, then renamed over it: a reader sees the
    old file or the whole new one, never a partial one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_split_meta(split_dir: Path) -> dict[str, Any]:
    meta_path = split_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"no prepared split in {split_dir} (missing meta.json); run prepare first")
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{split_dir} has format version {meta.get('version')}, this kalmix reads {FORMAT_VERSION}")
    if "split" not in meta:
        raise ValueError(f"{split_dir} is a prepared dataset, not one of its splits: pass "
                         f"{' or '.join(str(split_dir / s) for s in SPLITS)}")
    for name, size in (("tokens.bin", meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize),
                       ("offsets.bin", (meta["num_docs"] + 1) * 8)):
        f = split_dir / name
        if not f.is_file() or f.stat().st_size != size:
            found = f"{f.stat().st_size} bytes" if f.is_file() else "missing"
            raise ValueError(f"{f} is damaged: {found}, meta.json says {size} bytes; delete {split_dir.parent} "
                             f"and prepare again")
    return meta


# ---------------------------------------------------------------------------------------------- packing


class PackedDataset:
    """Rows of ``seq_len`` tokens cut from one prepared split (e.g. ``out_dir/train``).

    The split's documents, each ending in eos, lie end to end as one token stream; row i is tokens
    [i·T, (i + 1)·T). The last partial row is dropped, so ``len`` = num_tokens // T. A document that continues
    from the previous row starts a new segment at the row's first token: no state crosses rows.

    ``ds[i]`` is a dict of
      input_ids [T] int64;
      doc_pos   [T] int32, each token's position within its segment (0 at each segment start);
      labels    [T] int64, input_ids with −100 where a segment starts at t > 0: the model scores logits[t − 1]
                against labels[t], and a document's first token is not predicted from the one before it.
    ``vocab_size``, ``eos_token_id`` and ``max_token_id`` come from the split's metadata (``meta``); compare them
    with the model's vocabulary before training.
    """

    def __init__(self, split_dir: str | os.PathLike, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split_dir = Path(split_dir)
        self.seq_len = seq_len
        self.meta = _read_split_meta(self.split_dir)
        self.num_tokens, self.num_docs = self.meta["num_tokens"], self.meta["num_docs"]
        self.vocab_size, self.eos_token_id = self.meta["vocab_size"], self.meta["eos_token_id"]
        self.max_token_id = self.meta["max_token_id"]
        self.fingerprint = f"{self.meta['split']}:{self.meta['fingerprint']['dataset']}"
        if self.num_tokens < seq_len:
            raise ValueError(f"{self.split_dir} holds {self.num_tokens} tokens, fewer than one row of seq_len "
                             f"{seq_len}")
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        tokens, offsets = self._open()
        T = self.seq_len
        lo, hi = i * T, (i + 1) * T
        input_ids = torch.from_numpy(tokens[lo:hi].astype(np.int64))
        # documents starting strictly inside the row; offsets rise strictly (every document holds its eos)
        inside = slice(np.searchsorted(offsets, lo, side="right"), np.searchsorted(offsets, hi, side="left"))
        starts = np.asarray(offsets[inside]) - lo
        seg_start = np.zeros(T, dtype=np.int64)
        seg_start[starts] = starts
        doc_pos = np.arange(T) - np.maximum.accumulate(seg_start)
        labels = input_ids.clone()
        labels[torch.from_numpy(starts)] = -100
        return {"input_ids": input_ids, "labels": labels, "doc_pos": torch.from_numpy(doc_pos.astype(np.int32))}

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        # opened on first use and dropped when pickled, so DataLoader workers map the files instead of copying them
        if self._tokens is None:
            self._tokens = np.memmap(self.split_dir / "tokens.bin", dtype=self.meta["dtype"], mode="r")
            self._offsets = np.memmap(self.split_dir / "offsets.bin", dtype=np.int64, mode="r")
        return self._tokens, self._offsets

    def __getstate__(self):
        return self.__dict__ | {"_tokens": None, "_offsets": None}


def cu_seqlens_from_doc_pos(doc_pos: torch.Tensor) -> torch.Tensor:
    """doc_pos [B, T] -> cu_seqlens int32 [N + 1]: the segment boundaries over the flattened B·T tokens, where a
    segment starts at every doc_pos 0 and at every row start; strictly increasing from 0 to B·T."""
    if doc_pos.dim() != 2:
        raise ValueError(f"doc_pos must be [B, T], got shape {tuple(doc_pos.shape)}")
    return cu_seqlens_from_positions(doc_pos)


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows of ``PackedDataset`` -> input_ids [B, T] int64, labels [B, T] int64, doc_pos [B, T] int32 and
    cu_seqlens int32 [N + 1] (``cu_seqlens_from_doc_pos``)."""
    if not rows:
        raise ValueError("collate: no rows")
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "doc_pos")}
    batch["cu_seqlens"] = cu_seqlens_from_doc_pos(batch["doc_pos"])
    return batch


class Loader:
    """Endless micro-batches (``collate`` dicts) of ``dataset``'s rows for one rank of ``world_size``.

    Each epoch orders the rows by a permutation drawn from a torch.Generator seeded with seed + epoch (in order
    with shuffle=False). Global micro-step s takes rows [s·G, (s + 1)·G) of that order, G = micro_batch_size ·
    world_size, and rank r takes its slice [r·mbs, (r + 1)·mbs) of them: the global order does not depend on
    world_size, so 2 ranks × mbs 2 see at each step the rows 1 rank × mbs 4 sees. The rows left after the last
    whole global batch of an epoch are skipped. ``state_dict`` / ``load_state_dict`` save and restore the position.
    """

    def __init__(self, dataset: PackedDataset, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= rank < world_size, got micro_batch_size "
                             f"{micro_batch_size}, rank {rank}, world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset, self.micro_batch_size, self.rank, self.world_size = dataset, micro_batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch_size = micro_batch_size * world_size
        self.steps_per_epoch = len(dataset) // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"the dataset has {len(dataset)} rows of {dataset.seq_len} tokens, fewer than one global "
                             f"batch of {micro_batch_size} x {world_size} = {self.global_batch_size} rows")
        self.epoch = 0
        self.step = 0  # global micro-steps taken in this epoch
        self._order: tuple[int, torch.Tensor] | None = None

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        epoch, step = self.epoch, self.step
        if step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        start = step * self.global_batch_size + self.rank * self.micro_batch_size
        rows = self._epoch_order(epoch)[start:start + self.micro_batch_size].tolist()
        batch = collate([self.dataset[i] for i in rows])
        self.epoch, self.step = epoch, step + 1  # only once the batch exists, so a failed read leaves no gap
        return batch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)) if self.shuffle
                     else torch.arange(n))
            self._order = (epoch, order)
        return self._order[1]

    def _fingerprint(self) -> dict[str, Any]:
        return {"num_rows": len(self.dataset), "seq_len": self.dataset.seq_len,
                "data": getattr(self.dataset, "fingerprint", None)}

    def state_dict(self) -> dict[str, Any]:
        """{"epoch", "step" (global micro-steps taken in the epoch), "seed", "shuffle", "global_batch_size",
        "dataset" (row count, seq_len and the data's fingerprint)}."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "dataset": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch the saved loader gave, with its seed. A different micro batch or
        world size is accepted when the rows taken so far in the epoch fill whole global batches of the new size."""
        missing = {"epoch", "step", "seed", "shuffle", "global_batch_size", "dataset"} - set(state)
        if missing:
            raise ValueError(f"not a Loader state: missing {sorted(missing)}")
        if state["dataset"] != self._fingerprint():
            diff = {k: (v, state["dataset"].get(k)) for k, v in self._fingerprint().items()
                    if state["dataset"].get(k) != v}
            raise ValueError(f"the loader state was saved for another dataset; (now, saved): {diff}")
        if state["shuffle"] != self.shuffle:
            raise ValueError(f"the loader state was saved with shuffle={state['shuffle']}, this loader has "
                             f"shuffle={self.shuffle}")
        rows = state["step"] * state["global_batch_size"]
        if rows % self.global_batch_size:
            raise ValueError(f"cannot resume: the saved loader took {rows} rows of epoch {state['epoch']}, not a "
                             f"multiple of this loader's global batch {self.global_batch_size}")
        self.seed, self.epoch, self.step = state["seed"], state["epoch"], rows // self.global_batch_size


def val_batches(dataset: PackedDataset, micro_batch_size: int,
                max_rows: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The first min(len(dataset), max_rows) rows in order as ``collate`` batches of micro_batch_size rows (the
    last one may be smaller): the same batches on every call."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    n = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    return (collate([dataset[i] for i in range(a, min(a + micro_batch_size, n))])
            for a in range(0, n, micro_batch_size))
