"""Training checkpoints (model, optimizer, data position and RNG states of every process) of ``kalmix train`` and of
the runs of ``kalmix bench run`` recipes, and the lock by which a run owns its run directory.

Layout of ``RUN/checkpoints/step_NNNNNNN/``: ``meta.pt`` (step, loader, config, data folder, whether the run was
complete, format tag), ``rng_rank{r}.pt`` per process, and either ``train_state.pt`` (the model and optimizer of a
single process or DDP, whose replicas are equal) or ``dcp/`` (FSDP2's shards, through
``torch.distributed.checkpoint``). A checkpoint is written into a temporary folder beside it and renamed when every
file is in place, so a kill mid-write leaves the previous checkpoint as the newest; a failed write removes its
temporary folder, and the next run removes those a killed process left. Files are loaded with
``weights_only=True``. The learning rate is not saved: it is a function of the step and the config.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "kalmix-train-1"
_STEP_DIR = re.compile(r"^step_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: unreadable, foreign, or of another configuration."""


class RunDirInUse(RuntimeError):
    """Another live process holds the lock of the run directory."""


class DirLock:
    """An advisory lock on a folder: ``fcntl.flock`` on ``DIR/.lock``, which holds the owner's pid, host and start
    time while it is held. The operating system releases a flock when its process dies, so the lock of a killed
    process is free: the next owner takes it over (and says so). Release removes the lock file, and the folder too
    when this lock created it and nothing else was written there.

    ``wait=False``: a held lock raises RunDirInUse at once, naming the owner. ``wait=True``: wait for it (saying
    whom for). Use as a context manager, or ``acquire()`` / ``release()``.
    """

    def __init__(self, folder: str | os.PathLike, wait: bool = False, what: str = "run_dir"):
        self.folder, self.wait, self.what = Path(folder), wait, what
        self.path = self.folder / ".lock"
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> DirLock:
        """Take the lock (making the folder if need be); a ValueError naming ``what`` when the folder, or a folder
        above it, is a file."""
        above = self.folder.absolute()
        while not above.exists() and above != above.parent:
            above = above.parent
        if above.exists() and not above.is_dir():
            where = "" if above == self.folder.absolute() else f": {above}"
            raise ValueError(f"{self.what} '{self.folder}'{where} is a file, not a folder")
        while True:         # the previous owner may remove the file (and an empty folder) between open and flock
            if not self.folder.exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                self._created = True
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue
            try:
                self._flock(fd)
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            except BaseException:
                os.close(fd)
                self._remove_folder_if_created()
                raise
            if same:
                break
            os.close(fd)
        stale = _owner(fd)
        if stale:
            print(f"{self.what} {self.folder}: taking over the lock of {stale}, which is no longer running",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd
        return self

    def _flock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        owner = _owner(fd) or "another process"
        if not self.wait:
            raise RunDirInUse(f"{self.what} {self.folder} is in use by {owner}; wait for it to finish, stop it, "
                              f"or choose another {self.what}")
        print(f"{self.what} {self.folder} is in use by {owner}; waiting for it", file=sys.stderr)
        fcntl.flock(fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)       # while still held: a waiter then sees another inode and retries
        os.close(self._fd)
        self._fd = None
        self._remove_folder_if_created()

    def _remove_folder_if_created(self) -> None:
        if self._created:
            try:
                self.folder.rmdir()             # only if empty
            except OSError:
                pass

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _owner(fd: int) -> str:
    """'pid N on HOST (since TIME)' of the lock file's content, or '' when it holds none."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {info['pid']} on {info['host']} (since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return ""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (temporary folders of interrupted writes are not listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: str | Path, step: int, model, optimizer, loader_state: dict, config: dict, sharded: bool,
         keep: int, data_dir: str | None = None, complete: bool = False) -> Path:
    """Write the checkpoint of ``step`` (every process calls this) and remove all but the newest ``keep``.

    ``loader_state``: what else the loop needs to continue (``kalmix train``: its loader's position; a recipe
    run: its batches' position, history and best weights; tensors, numbers, strings, lists and dicts of them);
    ``data_dir``: the folder of the tokenizer and shards the run trains on (a resumed run keeps reading it);
    ``complete``: the run's last step, its model exported. When the checkpoint of ``step`` exists already (a run
    resumed from it that trained no further step), only its ``meta.pt`` is replaced: the state is the same."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    world = dist.get_world_size() if dist.is_initialized() else 1
    meta = {"format": FORMAT, "step": step, "world_size": world, "sharded": sharded, "loader": loader_state,
            "config": config, "data_dir": data_dir, "complete": complete}
    if final.is_dir():
        if _rank() == 0:
            tmp = final / f".meta.pt.{uuid.uuid4().hex}.tmp"
            try:
                torch.save(meta, tmp)
                os.replace(tmp, final / "meta.pt")
            finally:
                tmp.unlink(missing_ok=True)
        _barrier()
        return final
    tmp_name = [f".tmp_step_{step:07d}_{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_name, src=0)
    tmp = root / tmp_name[0]
    try:
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        _barrier()
        if sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        elif _rank() == 0:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp / "train_state.pt")
        torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            torch.save(meta, tmp / "meta.pt")
            os.replace(tmp, final)                  # the checkpoint exists only once it is whole
    finally:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no temporary folder
    if _rank() == 0:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def remove_stale_writes(run_dir: str | Path) -> None:
    """Remove the temporary folders of checkpoint writes a killed process left (call with the run's lock held)."""
    for stale in (Path(run_dir) / "checkpoints").glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def _load(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete or not kalmix's")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from None


def read_meta(ckpt: str | Path) -> dict:
    """The checkpoint's metadata; a CheckpointError if it is not a kalmix training checkpoint."""
    meta = _load(Path(ckpt) / "meta.pt")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt} is not a kalmix training checkpoint (format {FORMAT!r})")
    return meta


def load(ckpt: str | Path, model, optimizer, sharded: bool) -> dict:
    """Restore model, optimizer and this process's RNG state from ``ckpt``; returns its metadata (step, loader
    state, config, data folder). Every process calls this."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if meta["sharded"] != sharded:
        kind = {True: "FSDP2 (sharded)", False: "single-process/DDP"}
        raise CheckpointError(f"{ckpt} holds a {kind[meta['sharded']]} checkpoint; this run is "
                              f"{kind[sharded]} (train.parallel)")
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the sharded checkpoint {ckpt / 'dcp'}: {type(e).__name__}: {e}") \
                from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = _load(ckpt / "train_state.pt")
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{ckpt} does not fit this model and optimizer: {e}") from None
    rng = ckpt / f"rng_rank{_rank()}.pt"
    if meta["world_size"] == world and rng.is_file():
        _set_rng_state(_load(rng))
    return meta
