"""Tokenizers for `kalmix train`: a byte-level BPE trained locally, or any local Hugging Face tokenizer directory."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
_BYTES = 256  # a byte-level BPE starts from every byte, so any text encodes without an unknown token
# the largest vocabulary trained: the token shards hold uint32 ids. (The BPE trainer reserves ~45 bytes per entry up
# front: a mistyped 99999999999 aborted the process with Rust's out-of-memory trace.)
MAX_VOCAB_SIZE = 1 << 32


def train_tokenizer(documents: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
                    eos_token: str = EOS_TOKEN, min_frequency: int = 2,
                    progress: bool = True) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2's pre-tokenisation) on ``documents`` and save it to ``out_dir``.

    The vocabulary holds the 256 bytes, ``eos_token`` and at most ``vocab_size`` − 257 merges (fewer when the
    corpus has no more pairs seen ``min_frequency`` times). ``out_dir`` must not exist or be empty; the tokenizer
    is saved to a temporary sibling and renamed, so an interrupted run leaves no partial directory. Returns the
    tokenizer, which ``AutoTokenizer.from_pretrained(out_dir)`` loads back with the same eos token.
    """
    if vocab_size < _BYTES + 1:
        raise ValueError(f"a vocabulary of {vocab_size} is too small: a byte-level BPE needs at least {_BYTES + 1} "
                         f"(256 bytes + {eos_token})")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"a vocabulary of {vocab_size:,} is too large: at most {MAX_VOCAB_SIZE:,} entries (2**32: "
                         f"the token shards hold uint32 ids)")
    out = Path(out_dir)
    _check_free(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = 0

    def counted():
        nonlocal seen
        for doc in tqdm(documents, desc="training tokenizer", unit="doc", disable=not progress):
            seen += 1
            yield doc

    tok.train_from_iterator(counted(), trainer)
    if seen == 0:
        raise ValueError("train_tokenizer: no documents to train on")
    # byte-level BPE decodes losslessly; no clean-up of spaces before punctuation
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, clean_up_tokenization_spaces=False)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    try:
        fast.save_pretrained(tmp)
        _check_free(out)  # another process may have created it while this one trained
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return fast


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a local Hugging Face tokenizer directory; it must be a fast (tokenizers-backed) one with an eos token,
    which ``prepare`` appends to every document."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"tokenizer directory {p} is a file, not a folder")
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {p}")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{p} is not a Hugging Face tokenizer directory: it holds no tokenizer.json or "
                         "tokenizer_config.json (save_pretrained writes them)")
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{p} is not a Hugging Face tokenizer directory: {' '.join(str(e).split())}") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer at {p} is not a fast (tokenizers-backed) tokenizer; kalmix needs its "
                         f"tokenizer.json")
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {p} has no eos token; set eos_token in its tokenizer_config.json")
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """A hash of what the tokenizer maps text to (its tokenizer.json, eos id, size), not of where it is stored."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    # transformers sets these on the backend whenever it is called with padding / truncation; prepare ignores them
    spec.pop("truncation", None)
    spec.pop("padding", None)
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(f"\0{tokenizer.eos_token_id}\0{len(tokenizer)}".encode())
    return h.hexdigest()


def _check_free(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory; load the tokenizer there with "
                              f"load_tokenizer, or write the new one to another folder")
