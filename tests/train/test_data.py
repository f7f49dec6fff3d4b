"""kalmix.train's data side: sources, tokenizer, prepared shards, packing, collation and the resumable loader."""
import itertools
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kalmix.train import data
from kalmix.train.data import (
    DataConfig,
    Loader,
    PackedDataset,
    collate,
    cu_seqlens_from_doc_pos,
    iter_documents,
    prepare,
    val_batches,
)
from kalmix.train.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer

WORDS = ["the", "state", "of", "a", "filter", "is", "matrix", "that", "every", "token", "updates", "with", "gain",
         "and", "decay", "while", "query", "reads", "it", "back", "def", "return", "for", "in", "if", "else", "class",
         "import", "kalman", "attention"]


def make_docs(n=40, seed=0):
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    docs[3] = "héllo wörld 😀 naïve café\n\tΣ → ∞"
    docs[5] = "def f(x):\n    return x + 1\n\n\nprint(f(2))\n"
    docs[7] = f"a document that mentions {EOS_TOKEN} in its text stays one document"
    docs[9] = "x"
    return docs


DOCS = make_docs()
ROOT = Path(__file__).resolve().parents[2]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path, docs, field="text"):
    return write(path, "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def read(**kw):
    return list(iter_documents(DataConfig(**kw)))


def decode(tok, ids):
    return tok.decode(ids, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(DOCS, 300, out, progress=False)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("prepared")
    cfg = DataConfig(source=write_jsonl(root / "corpus.jsonl", DOCS), val_fraction=0.1, seed=1)
    meta = prepare(cfg, tok, root / "shards", progress=False)
    return cfg, root / "shards", meta


def split_docs(split_dir, tok):
    meta = json.loads((split_dir / "meta.json").read_text())
    tokens = np.fromfile(split_dir / "tokens.bin", dtype=meta["dtype"])
    offsets = np.fromfile(split_dir / "offsets.bin", dtype=np.int64)
    return [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]


# ------------------------------------------------------------------------------------------------ sources


def test_text_file_whole_and_blocks(tmp_path):
    f = write(tmp_path / "a.txt", "first line\nsecond line\n\n\n  indented block\n   \t \nlast\n")
    assert read(source=f) == ["first line\nsecond line\n\n\n  indented block\n   \t \nlast\n"]
    assert read(source=f, text_docs="blocks") == ["first line\nsecond line", "  indented block", "last"]
    assert read(source=write(tmp_path / "crlf.txt", "a\r\n\r\nb\r\n"), text_docs="blocks") == ["a", "b"]


def test_text_directory_sorted_recursive_skips_hidden_and_empty(tmp_path):
    write(tmp_path / "b.txt", "B")
    write(tmp_path / "a.txt", "A")
    write(tmp_path / "sub" / "c.txt", "C")
    write(tmp_path / "empty.txt", " \n\n")
    write(tmp_path / ".hidden.txt", "H")
    write(tmp_path / ".git" / "x.txt", "G")
    write(tmp_path / "notes.md", "M")
    assert read(source=tmp_path) == ["A", "B", "C"]
    assert read(source=str(tmp_path), format="text", max_docs=2) == ["A", "B"]


def test_jsonl_custom_field(tmp_path):
    f = write(tmp_path / "c.jsonl", json.dumps({"content": "alpha", "n": 1}) + "\n\n"
              + json.dumps({"content": "beta\nwith a newline"}) + "\n")
    assert read(source=f, text_field="content") == ["alpha", "beta\nwith a newline"]
    assert read(source=write_jsonl(tmp_path / "dir" / "x.jsonl", ["y"])) == ["y"]   # a directory of *.jsonl


@pytest.mark.parametrize("line,match", [
    ('{"text": "a"', r"bad\.jsonl:3: invalid JSON"),
    ('["a"]', r"bad\.jsonl:3: expected a JSON object, got list"),
    ('{"body": "a"}', r"bad\.jsonl:3: no field 'text' \(fields: \['body'\]\); set text_field"),
    ('{"text": 5}', r"bad\.jsonl:3: field 'text' is int, not a string"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, match):
    f = write(tmp_path / "bad.jsonl", '{"text": "a"}\n{"text": "b"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read(source=f)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"body": ["one", "", "two"], "n": [1, 2, 3]}), tmp_path / "p" / "b.parquet")
    pq.write_table(pa.table({"body": ["zero"], "n": [0]}), tmp_path / "p" / "a.parquet")
    assert read(source=tmp_path / "p", text_field="body") == ["zero", "one", "two"]
    assert read(source=tmp_path / "p" / "b.parquet", format="parquet", text_field="body") == ["one", "two"]
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'text' \(columns: \['body', 'n'\]\)"):
        iter_documents(DataConfig(source=tmp_path / "p"))                   # checked before any document is read
    with pytest.raises(ValueError, match=r"column 'n' has type int64, not string"):
        iter_documents(DataConfig(source=tmp_path / "p", text_field="n"))
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet: row 1 of column 'text' is null"):
        read(source=tmp_path / "null.parquet")


def test_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["d0", "d1", " "]}).save_to_disk(tmp_path / "ds")
    assert read(source=tmp_path / "ds", text_field="body") == ["d0", "d1"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t0", "t1"]}),
                          "validation": datasets.Dataset.from_dict({"text": ["v0"]})}).save_to_disk(tmp_path / "dd")
    assert read(source=tmp_path / "dd") == ["t0", "t1"]
    assert read(source=tmp_path / "dd", format="datasets", split="validation") == ["v0"]
    with pytest.raises(ValueError, match=r"no split 'test' \(splits: \['train', 'validation'\]\); set split"):
        iter_documents(DataConfig(source=tmp_path / "dd", split="test"))
    with pytest.raises(ValueError, match=r"ds: no column 'text' \(columns: \['body'\]\)"):
        iter_documents(DataConfig(source=tmp_path / "ds"))
    with pytest.raises(ValueError, match="not a directory written by datasets' save_to_disk"):
        iter_documents(DataConfig(source=tmp_path, format="datasets"))


def test_optional_packages_are_imported_only_when_needed(tmp_path, monkeypatch):
    code = ("import sys, kalmix.train.data, kalmix.train.tokenizer; "
            "print(sorted({'pyarrow', 'datasets'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    (tmp_path / "x.parquet").write_bytes(b"")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    for name in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)                         # as if not installed
    with pytest.raises(ImportError, match="reading parquet needs pyarrow: pip install pyarrow"):
        iter_documents(DataConfig(source=tmp_path / "x.parquet"))
    with pytest.raises(ImportError, match="needs datasets: pip install datasets"):
        iter_documents(DataConfig(source=tmp_path / "ds"))


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data source not found: .*missing\.txt"):
        iter_documents(DataConfig(source=tmp_path / "missing.txt"))          # raised at the call, not later
    with pytest.raises(ValueError, match=r"holds no non-empty documents"):
        read(source=write(tmp_path / "blank.txt", " \n\t\n"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.txt files under .*nothing"):
        read(source=tmp_path / "nothing", format="text")
    with pytest.raises(ValueError, match=r"cannot infer the format of .*nothing: it holds no \*\.txt"):
        read(source=tmp_path / "nothing")
    write(tmp_path / "mixed" / "a.txt", "a")
    write_jsonl(tmp_path / "mixed" / "b.jsonl", ["b"])
    with pytest.raises(ValueError, match=r"files of several formats \['text', 'jsonl'\]; set format"):
        read(source=tmp_path / "mixed")
    with pytest.raises(ValueError, match=r"from its suffix '\.csv'"):
        read(source=write(tmp_path / "t.csv", "a,b"))
    assert read(source=tmp_path / "t.csv", format="text") == ["a,b"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8 text"):
        read(source=tmp_path / "latin1.txt")


def test_data_config_is_strict(tmp_path):
    with pytest.raises(ValidationError, match="bogus"):
        DataConfig(bogus=1)
    with pytest.raises(ValidationError, match="source 'stdlib' is read as Python files"):
        DataConfig(format="jsonl")
    for bad in ({"val_fraction": 0.0}, {"val_fraction": 1.0}, {"format": "csv"}, {"max_docs": 0}, {"seed": -1}):
        with pytest.raises(ValidationError):
            DataConfig(**bad)
    assert DataConfig(source=tmp_path).source == str(tmp_path)             # a Path is taken as its string


def test_stdlib_source():
    files = data._stdlib_files()
    assert len(files) > 500 and not any("site-packages" in f.parts for f in files) and files == sorted(files)
    docs = list(itertools.islice(iter_documents(DataConfig()), 600))
    assert len(docs) == 600 and all(isinstance(d, str) and d.strip() for d in docs)
    assert read(max_docs=5) == docs[:5]


def test_stdlib_prepare_a_handful(tmp_path, tok):
    meta = prepare(DataConfig(max_docs=6), tok, tmp_path, progress=False)
    assert meta["splits"]["train"]["num_docs"] + meta["splits"]["val"]["num_docs"] == 6
    assert meta["format"] == "stdlib" and meta["splits"]["val"]["num_docs"] == 1


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id is not None and 257 <= len(tok) <= 300
    for doc in DOCS:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        assert decode(tok, ids) == doc
    assert tok(EOS_TOKEN, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]
    assert load_tokenizer(tok_dir).eos_token_id == tok.eos_token_id


def test_tokenizer_errors(tmp_path, tok_dir):
    with pytest.raises(FileExistsError, match="already exists and is not an empty directory"):
        train_tokenizer(DOCS, 300, tok_dir, progress=False)
    with pytest.raises(ValueError, match="a vocabulary of 256 is too small: a byte-level BPE needs at least 257"):
        train_tokenizer(DOCS, 256, tmp_path / "small", progress=False)
    with pytest.raises(ValueError, match="no documents"):
        train_tokenizer([], 300, tmp_path / "none", progress=False)
    assert not (tmp_path / "none").exists() and not list(tmp_path.iterdir())   # nothing half-written
    (tmp_path / "empty").mkdir()
    train_tokenizer(DOCS[:5], 280, tmp_path / "empty", progress=False)    # an empty directory is fine
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "blank").mkdir()
    with pytest.raises(ValueError, match=r"blank is not a Hugging Face tokenizer directory: it holds no "
                       r"tokenizer.json or tokenizer_config.json \(save_pretrained writes them\)$"):
        load_tokenizer(tmp_path / "blank")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"tokenizer directory {tmp_path / 'file'} is a file, not a folder"):
        load_tokenizer(tmp_path / "file")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad is not a Hugging Face tokenizer directory: ") as e:
        load_tokenizer(tmp_path / "bad")
    assert "\n" not in str(e.value)                     # one line, whatever transformers says
    no_eos = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(tok_dir).backend_tokenizer)
    no_eos.save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match="has no eos token; set eos_token"):
        load_tokenizer(tmp_path / "no_eos")


# ------------------------------------------------------------------------------------------------ prepare


def test_prepare_round_trips_documents(prepared, tok):
    cfg, shards, meta = prepared
    eos = tok.eos_token_id
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(tok) and meta["eos_token_id"] == eos
    assert meta["data_config"] == cfg.model_dump() and meta["format"] == "jsonl"
    got = {}
    for split in ("train", "val"):
        split_meta = json.loads((shards / split / "meta.json").read_text())
        assert split_meta["split"] == split and split_meta["fingerprint"] == meta["fingerprint"]
        assert (shards / split / "tokens.bin").stat().st_size == 2 * split_meta["num_tokens"]
        docs = split_docs(shards / split, tok)
        assert all(d[-1] == eos and eos not in d[:-1] for d in docs)      # eos only where prepare put it
        assert max(max(d) for d in docs) == split_meta["max_token_id"] < split_meta["vocab_size"]
        got[split] = [decode(tok, d[:-1]) for d in docs]
        assert got[split] == list(iter_documents(cfg, split=split))       # the split a tokenizer would train on
    assert len(got["val"]) == round(0.1 * len(DOCS))
    assert sorted(got["train"] + got["val"]) == sorted(DOCS)
    assert got["train"] == [d for d in DOCS if d in got["train"]]          # source order kept within a split
    assert not [p for p in shards.rglob("*") if p.name.endswith(".tmp")]


def test_prepare_reuses_same_fingerprint(prepared, tok, monkeypatch):
    cfg, shards, meta = prepared
    mtime = (shards / "train" / "tokens.bin").stat().st_mtime_ns

    def no_tokenising(*args, **kwargs):
        raise AssertionError("re-tokenised")
    monkeypatch.setattr(data, "_tokenize", no_tokenising)
    again = load_tokenizer(tok.name_or_path)
    again(DOCS[:2], truncation=True, max_length=4)     # transformers leaves truncation set on the backend
    assert prepare(cfg, again, shards, progress=False) == meta
    same = DataConfig(source=cfg.source, format="jsonl", val_fraction=0.1, seed=1)   # 'auto' resolved alike
    assert prepare(same, tok, shards, progress=False) == meta
    assert (shards / "train" / "tokens.bin").stat().st_mtime_ns == mtime


def test_prepare_refuses_another_fingerprint(prepared, tok, tmp_path):
    cfg, shards, _ = prepared
    with pytest.raises(ValueError, match="different fingerprint: the data config changed; delete it, or prepare into"):
        prepare(cfg.model_copy(update={"seed": 2}), tok, shards, progress=False)
    other = train_tokenizer(DOCS[:10], 270, tmp_path / "other", progress=False)
    with pytest.raises(ValueError, match="different fingerprint: the tokenizer changed"):
        prepare(cfg, other, shards, progress=False)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:4])
    small = DataConfig(source=src)
    prepare(small, tok, tmp_path / "s", progress=False)
    write_jsonl(src, DOCS[:5])
    with pytest.raises(ValueError, match=r"the source files \(paths, sizes or modification times\) changed"):
        prepare(small, tok, tmp_path / "s", progress=False)


def test_prepare_errors_leave_nothing_behind(tmp_path, tok):
    with pytest.raises(ValueError, match="holds 1 document; a train / validation split needs at least 2"):
        prepare(DataConfig(source=write(tmp_path / "one.txt", "only")), tok, tmp_path / "out", progress=False)
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(ValueError, match="holds 1 document"):
        list(iter_documents(DataConfig(source=tmp_path / "one.txt"), split="train"))


def test_prepare_damaged_shard_is_detected(prepared, tok, tmp_path):
    cfg, shards, _ = prepared
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    with open(copy / "val" / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"val/tokens\.bin is damaged: 10 bytes"):
        PackedDataset(copy / "val", 4)
    with pytest.raises(ValueError, match="is damaged"):
        prepare(cfg, tok, copy, progress=False)


def test_prepare_ignores_truncation_in_tokenizer_json(tmp_path, tok_dir):
    truncating = load_tokenizer(tok_dir)
    truncating.backend_tokenizer.enable_truncation(3)
    cfg = DataConfig(source=write_jsonl(tmp_path / "c.jsonl", DOCS[:8]), val_fraction=0.5)
    prepare(cfg, truncating, tmp_path / "out", progress=False)
    got = [decode(truncating, d[:-1]) for s in ("train", "val") for d in split_docs(tmp_path / "out" / s, truncating)]
    assert sorted(got) == sorted(DOCS[:8])
    assert truncating.backend_tokenizer.truncation["max_length"] == 3     # the caller's tokenizer is left alone


def test_prepare_uint32_for_large_vocabularies(tmp_path, tok):
    class Large:                                  # the trained tokenizer, claiming more ids than uint16 holds
        def __len__(self):
            return 70_000

        def __getattr__(self, name):
            return getattr(tok, name)
    cfg = DataConfig(source=write_jsonl(tmp_path / "c.jsonl", DOCS[:6]))
    meta = prepare(cfg, Large(), tmp_path / "out", progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    prepare(cfg, tok, tmp_path / "out16", progress=False)
    assert split_docs(tmp_path / "out" / "train", tok) == split_docs(tmp_path / "out16" / "train", tok)


# ------------------------------------------------------------------------------------------------ packing


def expected_starts(stream, lo, T, eos):
    """Segment starts in the row [lo, lo + T): its first token and every token after an eos."""
    return [0] + [t for t in range(1, T) if stream[lo + t - 1] == eos]


@pytest.mark.parametrize("T", [1, 7, 16, 64])
def test_packed_rows(prepared, tok, T):
    _, shards, _ = prepared
    ds = PackedDataset(shards / "train", T)
    stream = np.fromfile(shards / "train" / "tokens.bin", dtype=np.uint16).astype(np.int64)
    assert len(ds) == len(stream) // T and ds.vocab_size == len(tok) and ds.eos_token_id == tok.eos_token_id
    rows = [ds[i] for i in range(len(ds))]
    assert torch.equal(torch.cat([r["input_ids"] for r in rows]), torch.from_numpy(stream[:len(ds) * T]))
    for i, r in enumerate(rows):
        assert r["input_ids"].dtype == r["labels"].dtype == torch.int64 and r["doc_pos"].dtype == torch.int32
        starts = expected_starts(stream, i * T, T, tok.eos_token_id)
        assert (r["doc_pos"] == 0).nonzero().squeeze(1).tolist() == starts
        steps = r["doc_pos"][1:] - r["doc_pos"][:-1]
        assert ((steps == 1) | (r["doc_pos"][1:] == 0)).all()
        assert (r["labels"] == -100).nonzero().squeeze(1).tolist() == starts[1:]
        kept = r["labels"] != -100
        assert torch.equal(r["labels"][kept], r["input_ids"][kept])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_collate_cu_seqlens(prepared, tok):
    _, shards, _ = prepared
    T = 16
    ds = PackedDataset(shards / "train", T)
    rows = [ds[i] for i in (3, 0, 5)]
    b = collate(rows)
    assert b["input_ids"].shape == b["labels"].shape == b["doc_pos"].shape == (3, T)
    cu = b["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * T and (cu[1:] > cu[:-1]).all()
    flat_starts = [k * T + t for k, r in enumerate(rows) for t in (r["doc_pos"] == 0).nonzero().squeeze(1).tolist()]
    assert cu[:-1].tolist() == flat_starts
    assert set(range(0, 3 * T, T)) <= set(cu.tolist())                      # every row starts a segment


@pytest.mark.parametrize("doc_pos,cu", [
    ([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]], [0, 3, 5, 7, 10]),                  # row 2 continues a document
    ([[0, 0, 0]], [0, 1, 2, 3]),
    ([[5, 6, 7]], [0, 3]),
    ([[0], [0]], [0, 1, 2]),
])
def test_cu_seqlens_from_doc_pos(doc_pos, cu):
    doc_pos = torch.tensor(doc_pos, dtype=torch.int32)
    out = cu_seqlens_from_doc_pos(doc_pos)
    assert out.dtype == torch.int32 and out.tolist() == cu
    assert doc_pos.tolist() == doc_pos.clone().tolist()                    # the input is not modified


def test_cu_seqlens_edge_cases():
    assert cu_seqlens_from_doc_pos(torch.zeros(0, 4, dtype=torch.int32)).tolist() == [0]
    with pytest.raises(ValueError, match=r"doc_pos must be \[B, T\]"):
        cu_seqlens_from_doc_pos(torch.zeros(4, dtype=torch.int32))


def test_packed_dataset_pickles_without_tokens(prepared):
    _, shards, _ = prepared
    ds = PackedDataset(shards / "train", 8)
    first = ds[2]
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 4096 and all(torch.equal(first[k], copy[2][k]) for k in first)
    with pytest.raises(ValueError, match="fewer than one row of seq_len"):
        PackedDataset(shards / "val", 10**6)
    with pytest.raises(ValueError, match="is a prepared dataset, not one of its splits: pass .*train or .*val"):
        PackedDataset(shards, 8)
    with pytest.raises(FileNotFoundError, match="no prepared split in .*shards.train.train"):
        PackedDataset(shards / "train" / "train", 8)


# ------------------------------------------------------------------------------------------------- loader


class Rows:
    """A dataset whose row i is filled with i, so batches show which rows they hold."""
    seq_len = 3

    def __init__(self, n, fingerprint="rows"):
        self.n, self.fingerprint = n, fingerprint

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.full((self.seq_len,), i)
        return {"input_ids": ids, "labels": ids.clone(), "doc_pos": torch.arange(self.seq_len, dtype=torch.int32)}


def row_ids(batch):
    return batch["input_ids"][:, 0].tolist()


def take(loader, n):
    return [row_ids(next(loader)) for _ in range(n)]


def test_loader_is_deterministic_and_covers_each_epoch():
    a, b = Loader(Rows(10), 4, seed=3), Loader(Rows(10), 4, seed=3)
    steps = take(a, 6)
    assert steps == take(b, 6) and a.steps_per_epoch == 2
    for epoch in range(3):
        seen = steps[2 * epoch] + steps[2 * epoch + 1]
        assert len(set(seen)) == 8                                          # 2 of 10 rows dropped per epoch
    assert steps[:2] != steps[2:4] and a.epoch == 2 and a.step == 2
    assert take(Loader(Rows(10), 4, seed=4), 2) != steps[:2]
    assert take(Loader(Rows(10), 4, shuffle=False), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_loader_ranks_split_the_same_global_batch():
    one = Loader(Rows(23), 4, seed=7)
    ranks = [Loader(Rows(23), 2, rank=r, world_size=2, seed=7) for r in range(2)]
    for _ in range(13):                                                     # more than two epochs of 5 steps
        assert row_ids(next(one)) == row_ids(next(ranks[0])) + row_ids(next(ranks[1]))


@pytest.mark.parametrize("k", [1, 2, 5, 6])                                  # mid-epoch and at an epoch's end
def test_loader_resumes_at_the_next_batch(k):
    a = Loader(Rows(13), 2, seed=5)                                          # 6 steps per epoch
    take(a, k)
    state = json.loads(json.dumps(a.state_dict()))                           # survives a JSON round trip
    b = Loader(Rows(13), 2, seed=0)                                          # the saved seed wins
    b.load_state_dict(state)
    assert take(b, 8) == take(a, 8)


def test_loader_resumes_with_another_world_size():
    a = Loader(Rows(16), 4, seed=1)
    take(a, 3)
    state = a.state_dict()
    ranks = [Loader(Rows(16), 2, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for _ in range(4):
        assert row_ids(next(a)) == row_ids(next(ranks[0])) + row_ids(next(ranks[1]))
    odd = Loader(Rows(16), 3, seed=1)
    with pytest.raises(ValueError, match="took 12 rows of epoch 0, not a multiple of this loader's global batch 9"):
        Loader(Rows(16), 9).load_state_dict(odd.state_dict() | {"step": 4})


def test_loader_state_errors():
    state = Loader(Rows(10), 2).state_dict()
    with pytest.raises(ValueError, match="saved for another dataset.*num_rows"):
        Loader(Rows(11), 2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved for another dataset.*data"):
        Loader(Rows(10, fingerprint="other"), 2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with shuffle=True"):
        Loader(Rows(10), 2, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"not a Loader state: missing \['step'\]"):
        Loader(Rows(10), 2).load_state_dict({k: v for k, v in state.items() if k != "step"})
    with pytest.raises(ValueError, match="fewer than one global batch of 2 x 2 = 4 rows"):
        Loader(Rows(3), 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        Loader(Rows(10), 2, rank=2, world_size=2)


def test_loader_on_packed_rows(prepared):
    _, shards, _ = prepared
    ds = PackedDataset(shards / "train", 8)
    first = next(Loader(ds, 4, shuffle=False))
    ref = collate([ds[i] for i in range(4)])
    assert first.keys() == ref.keys() and all(torch.equal(first[k], ref[k]) for k in ref)
    a = Loader(ds, 4, seed=2)
    next(a)
    with pytest.raises(ValueError, match="saved for another dataset.*seq_len"):
        Loader(PackedDataset(shards / "train", 16), 4).load_state_dict(a.state_dict())


def test_val_batches():
    batches = [row_ids(b) for b in val_batches(Rows(10), 4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [row_ids(b) for b in val_batches(Rows(10), 4, max_rows=5)] == [[0, 1, 2, 3], [4]]
    assert [row_ids(b) for b in val_batches(Rows(10), 4)] == batches
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        val_batches(Rows(10), 0)


def test_package_exports_lazily():
    from kalmix import train
    assert train.Loader is Loader and train.EOS_TOKEN == EOS_TOKEN and "prepare" in train.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr(train, "nothing")  # noqa: B009


def test_python_source_is_the_stdlib_then_installed_packages():
    stdlib = DataConfig(source="stdlib", max_docs=3)
    python = DataConfig(source="python", max_docs=3)
    assert list(iter_documents(python)) == list(iter_documents(stdlib))
    assert data.source_fingerprint(python) != data.source_fingerprint(stdlib)
    with pytest.raises(ValueError, match="leave format 'auto'"):
        DataConfig(source="python", format="text")
