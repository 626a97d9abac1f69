"""Atomic, exact checkpoints.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_000012/state.pt`` holding the trainable weights (the
LoRA adapter or all weights), optimiser, scheduler, RNG states, data position and step. It is written into a
temporary directory and renamed into place, so a checkpoint directory either exists complete or not at all;
a crash mid-write leaves only a ``.tmp-*`` directory, which loading ignores and the next save removes.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

KEEP_LAST = 2


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters the optimiser updates (an adapter's, or all), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(_tuplify(state["python"])))


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def save(run_dir: Path, step: int, state: dict) -> Path:
    """Write ``state`` for ``step`` atomically; keep the last ``KEEP_LAST`` checkpoints."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        with open(tmp / "state.pt", "wb") as f:
            torch.save({**state, "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("step_*"))[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = sorted(p for p in checkpoint_dir(run_dir).glob("step_*") if (p / "state.pt").is_file())
    return found[-1] if found else None


def load(path: Path) -> dict:
    # Our own file: tensors, numbers, strings, lists, dicts and tuples only, so the safe loader suffices.
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)
