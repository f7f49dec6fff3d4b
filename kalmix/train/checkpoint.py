"""Training checkpoints: model, optimizer, scheduler, data position and RNG states of every process.

Layout of ``RUN/checkpoints/step_NNNNNNN/``: ``meta.pt`` (step, scheduler, loader, config, format tag),
``rng_rank{r}.pt`` per process, and either ``train_state.pt`` (the model and optimizer of a single process or
DDP, whose replicas are equal) or ``dcp/`` (FSDP2's shards, through ``torch.distributed.checkpoint``). A
checkpoint is written into a temporary folder beside it and renamed when every file is in place, so a kill
mid-write leaves the previous checkpoint as the newest; files are loaded with ``weights_only=True``.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "kalmix-train-1"
_STEP_DIR = re.compile(r"^step_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: unreadable, foreign, or of another configuration."""


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


def save(run_dir: str | Path, step: int, model, optimizer, scheduler, loader_state: dict, config: dict,
         sharded: bool, keep: int) -> Path:
    """Write the checkpoint of ``step`` (every process calls this) and remove all but the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp_name = [f".tmp_step_{step:07d}_{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_name, src=0)
    tmp = root / tmp_name[0]
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
        world = dist.get_world_size() if dist.is_initialized() else 1
        torch.save({"format": FORMAT, "step": step, "world_size": world, "sharded": sharded,
                    "scheduler": scheduler.state_dict(), "loader": loader_state, "config": config},
                   tmp / "meta.pt")
        os.replace(tmp, final)                      # the checkpoint exists only once it is whole
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp_step_*"):      # interrupted writes of earlier processes
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


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


def load(ckpt: str | Path, model, optimizer, scheduler, sharded: bool) -> dict:
    """Restore model, optimizer, scheduler and this process's RNG state from ``ckpt``; returns its metadata
    (step, loader state, config). Every process calls this."""
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
    scheduler.load_state_dict(meta["scheduler"])
    rng = ckpt / f"rng_rank{_rank()}.pt"
    if meta["world_size"] == world and rng.is_file():
        _set_rng_state(_load(rng))
    return meta
