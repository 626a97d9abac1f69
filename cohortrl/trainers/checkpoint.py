"""Atomic, exact checkpoints that load no code.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_000012/`` holding the trainable weights (the LoRA
adapter or all weights; PPO's critic too) as safetensors files, and ``state.pt`` with the optimiser,
scheduler, RNG states, data position and step. It is written into a temporary directory and renamed into
place, so a checkpoint directory either exists complete or not at all; a crash mid-write leaves only a
``.tmp-*`` directory, which loading ignores and the next save removes. Old checkpoints are renamed away
before they are deleted, for the same reason.

Loading executes nothing: weights are safetensors (no pickle at all) and ``state.pt`` is read with
``torch.load(weights_only=True)``, which refuses any pickled object other than tensors and plain data.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cohortrl.trainers import faults

KEEP_LAST = 2
# Entries of the state that are a model's weights (name -> tensor): stored as safetensors, not pickled.
WEIGHT_KEYS = ("model", "critic")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, or that must not be read."""


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
    """Write ``state`` for ``step`` atomically; keep the last ``KEEP_LAST`` checkpoints. An OS error (disk
    full, permissions) leaves the previous checkpoints as they were and raises :class:`CheckpointError`."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:06d}"
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        _write(tmp, {**state, "step": step})
        faults.point("checkpoint-write")
        if final.exists():
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest(run_dir)
        raise CheckpointError(
            f"could not write the checkpoint of step {step} in {root}: {e}. "
            f"The previous checkpoint ({previous.name if previous else 'none'}) is untouched; free disk space "
            "(or fix the directory's permissions) and continue with --resume"
        ) from e
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("step_*"))[:-KEEP_LAST]:
        _discard(old)
    return final


def write_dir(final: Path, write) -> None:
    """Call ``write(tmp_dir)`` and rename the result to ``final`` (replacing it): ``final`` holds either the
    old complete contents or the new ones, never a mix, even if the process dies half way."""
    final = Path(final)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        write(tmp)
        if final.exists():
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(directory: Path, state: dict) -> None:
    rest = {k: v for k, v in state.items() if k not in WEIGHT_KEYS}
    for key in WEIGHT_KEYS:
        if key in state:
            save_file(state[key], str(directory / f"{key}.safetensors"))
            _fsync_file(directory / f"{key}.safetensors")
    with open(directory / "state.pt", "wb") as f:
        torch.save(rest, f)
        f.flush()
        os.fsync(f.fileno())


def _discard(path: Path) -> None:
    """Remove a checkpoint directory: renamed to ``.tmp-*`` first (atomic), so a crash mid-delete never
    leaves a ``step_*`` directory with some of its files."""
    doomed = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=path.parent))
    os.replace(path, doomed / path.name)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
    """A checkpoint's state, with its weights. Refuses (:class:`CheckpointError`) a ``state.pt`` holding any
    pickled object beyond tensors and plain data: unpickling such an object can run arbitrary code."""
    path = Path(path)
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path / 'state.pt'}: it holds pickled Python objects other than tensors and plain "
            f"data, which could run code when loaded (torch.load weights_only=True said: {str(e).splitlines()[0]}). "
            "Only resume from checkpoints cohortrl wrote"
        ) from None
    for key in WEIGHT_KEYS:
        if (path / f"{key}.safetensors").is_file():
            state[key] = load_file(str(path / f"{key}.safetensors"))
    return state
