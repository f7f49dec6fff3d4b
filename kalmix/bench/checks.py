"""Checks the benchmarks and ``kalmix generate`` make before any work: a device this machine has, an op backend
that runs on it, models that build, an output that can be written; and pydantic errors as readable lines."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import torch
from pydantic import ValidationError

from kalmix.ops.common.checks import device_refusal


def read_jsonl_rows(path, keys: Sequence[str], what: str, unreadable: str | None = None) -> list[dict]:
    """The rows of the JSONL file ``path`` (blank lines skipped): a ValueError naming the file and line for a line
    that is not JSON or not an object with every key of ``keys`` ("PATH:N: {what} (it lacks ...)"). A file that
    cannot be read raises its OSError, or with ``unreadable`` a ValueError "PATH: why; {unreadable}"."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        if unreadable is None:
            raise
        raise ValueError(f"{path}: {e.strerror}; {unreadable}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            missing = [k for k in keys if k not in row] if isinstance(row, dict) else list(keys)
            if missing:
                raise ValueError(f"{path}:{n}: {what} (it lacks {', '.join(missing)})")
            rows.append(row)
    return rows


def check_given_once(paths: Sequence[str], what: str, why: str) -> None:
    """A ValueError naming a path of ``paths`` given twice, under any spelling (``what``: what a path is, e.g.
    "results file"; ``why``: what giving it twice would do)."""
    seen = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            same = "" if seen[real] == path else f" (as {seen[real]!r})"
            raise ValueError(f"{what} {path!r} is given twice{same}: {why}; give each {what.split()[-1]} once")
        seen[real] = path


def check_impl(impl: str | None, device: torch.device) -> None:
    """A ValueError when the kalmix op backend ``impl`` (None: triton on CUDA, torch otherwise) cannot run on
    ``device``, saying why."""
    why = device_refusal(impl or ("triton" if device.type == "cuda" else "torch"), device)
    if why is not None:
        raise ValueError(why)


def check_builds(build: Callable[[], object], what: str) -> None:
    """Run ``build`` (a constructor call) on the meta device: no memory, no initialisation time. Its own
    ValueError (e.g. heads that do not divide the width) passes through; sizes torch cannot take become a
    ValueError naming ``what``."""
    try:
        with torch.device("meta"):
            build()
    except (TypeError, OverflowError, RuntimeError) as e:
        raise ValueError(f"{what} does not build: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def check_model(make_config: Callable[[], object], what: str) -> None:
    """Build the ``KalmixForCausalLM`` of the ``KalmixConfig`` that ``make_config()`` returns on the meta device
    (``check_builds``; ``what`` names it), so that a model that cannot be made is refused before any data is made
    or any other model trained."""
    from kalmix.models import KalmixForCausalLM
    check_builds(lambda: KalmixForCausalLM(make_config()), what)


def check_out(path: str, folder: bool = False, append: bool = False) -> None:
    """A ValueError unless ``path`` can be written as a file (``folder``: made as a folder): not empty, not
    something of the other kind, under a writable folder; ``append`` (JSONL rows added to the file): a file there
    must end with a whole line, or the first row would join its last. Nothing is created (the writer makes the
    folders)."""
    kind = "folder" if folder else "file"
    if not path:
        raise ValueError(f"the output {kind} is an empty path")
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise ValueError(f"output {kind} {path!r} is a {'file' if folder else 'folder'}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"output {kind} {path!r}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"output {kind} {path!r}: the folder {parent} is not writable")
    if append and os.path.isfile(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                raise ValueError(f"output file {path!r} ends in a cut-off line (no newline after it), which the "
                                 "rows appended would join; complete or remove that line")


def _key(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def validation_lines(err: ValidationError, key: Callable[[tuple], str] = _key) -> list[str]:
    """One ``key: message`` line per error of ``err``; ``key`` names a location (default: the dotted path, list
    indices in brackets). Built-in messages say the input they got; messages of our own validators name it
    already. A list too short only because its items failed is not reported twice."""
    errors = err.errors(include_url=False)
    lines = []
    for e in errors:
        if e["type"] == "too_short" and any(o["loc"][:len(e["loc"])] == e["loc"] and len(o["loc"]) > len(e["loc"])
                                            for o in errors):
            continue                                    # a list left empty by items already reported
        msg = e["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        if e["type"] not in ("value_error", "assertion_error", "missing") and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        where = key(e["loc"])
        lines.append(f"{where}: {msg}" if where else msg)
    return lines
