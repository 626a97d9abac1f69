"""Atomic, verified checkpoints that load no code.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_000012/`` holding the trainable weights (the LoRA
adapter or all weights; PPO's critic too) as safetensors files, ``state.pt`` with the optimiser, scheduler,
RNG states, data position and step, and ``cohortrl_manifest.json``: each file's size and SHA-256, the step,
the library version and the hash of the config it was written under. ``RUN_DIR/final/`` carries the same
manifest. Any trainer uses a handful of functions:

- ``write_dir(path, write, step=...)``: ``write(tmp)`` fills a temporary directory; the manifest is written
  last, then the directory is renamed into place, so ``path`` holds the old complete contents or the new
  ones, never a mix. A failed write (disk full, permissions, I/O) removes the temporary directory and raises
  :class:`CheckpointError` with one line: the file, the OS's reason, the space needed and free.
- ``save(run_dir, step, state)``: a training state written as a checkpoint, then older checkpoints beyond
  ``keep`` deleted (only now: the new one is complete).
- ``verify(path)``: None, or one line naming the first file that does not match the manifest.
- ``find_intact(run_dir)``: the newest checkpoint that verifies, and the newer ones that did not.
- ``load(path)``: the state of a checkpoint.

A directory without a complete manifest is not a checkpoint: the manifest is the last thing written, so its
absence means that the write, or a copy of the run, did not finish. A crash mid-write leaves only a
``.tmp-*`` directory, which nothing reads and the next write of that directory removes.

Loading executes nothing: weights are safetensors (no pickle at all) and ``state.pt`` is read with
``torch.load(weights_only=True)``, which refuses any pickled object other than tensors and plain data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cohortrl import __version__
from cohortrl.models import FINAL_MARKER, MANIFEST, final_marker, manifest_sha256
from cohortrl.trainers import faults

log = logging.getLogger("cohortrl")
KEEP_LAST = 2  # train.keep_checkpoints' default
MANIFEST_FORMAT = 1
# Entries of the state that are a model's weights (name -> tensor): stored as safetensors, not pickled.
WEIGHT_KEYS = ("model", "critic")
REJECTED = "rejected"  # checkpoints/rejected/: damaged checkpoints set aside by a resume, kept for inspection
# MANIFEST: every saved directory's file hashes. FINAL_MARKER: written into RUN_DIR/final/ with the step it was
# saved at (a resume can tell a finished run from one killed between its last checkpoint and its final save)
# and, for an adapter, the weights it was trained on. Named in models.py, which reads both when it loads one.


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, or that must not be read."""


@dataclass
class Found:
    """What ``find_intact`` saw: the newest intact checkpoint (None if there is none) and every newer
    checkpoint that failed verification, newest first, each with its one-line problem."""

    path: Path | None
    rejected: list[tuple[Path, str]] = field(default_factory=list)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters the optimiser updates (an adapter's, or all), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    """torch's CPU generator, Python's, and on a GPU machine each visible GPU's (dropout and any sampling on the
    GPU draw from those)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # one state per visible GPU
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])  # torch.load gives back the tuples random.getstate() made
    # A checkpoint written without a GPU (or before GPU states were kept) has none; resumed on a machine with
    # another number of GPUs, the GPUs both runs had get theirs back.
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a nest of dicts, lists and tuples: about what writing ``obj`` takes on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# ---------------------------------------------------------------------------------------------- writing
def save(run_dir: Path, step: int, state: dict, *, config_hash: str = "", keep: int = KEEP_LAST) -> Path:
    """Write ``state`` as the checkpoint of ``step``, then delete all but the newest ``keep`` checkpoints up
    to it (0: keep all). A failed write raises :class:`CheckpointError` and leaves the others as they were."""
    for stale in checkpoint_dir(run_dir).glob(".tmp-*"):  # any write or delete a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    path = write_dir(
        checkpoint_dir(run_dir) / f"step_{step:06d}", lambda tmp: _write_state(tmp, {**state, "step": step}),
        step=step, config_hash=config_hash, needed_bytes=tensor_bytes(state),
    )
    older = [p for p in step_dirs(run_dir) if _step_of(p) < step]
    for old in older[: max(0, len(older) - (keep - 1))] if keep else []:
        try:
            _discard(old)
        except OSError as e:  # the new checkpoint is complete: a stale old one costs space, not correctness
            log.warning("could not delete the old checkpoint %s (%s); delete it by hand", old, e.strerror or e)
    return path


def write_dir(path: Path, write, *, step: int, config_hash: str = "", needed_bytes: int = 0) -> Path:
    """Call ``write(tmp_dir)``, add the manifest and rename the result to ``path`` (replacing it): ``path``
    holds either the old complete contents or the new ones, never a mix, even if the process dies half way.
    ``needed_bytes`` (an estimate of the contents' size) goes into the error message of a failed write."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in [*path.parent.glob(f".tmp-{path.name}-*"), *path.parent.glob(f".tmp-old-{path.name}-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-write
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the checkpoint gets an ordinary directory's mode
        write(tmp)
        faults.point("checkpoint-manifest")
        _write_manifest(tmp, step, config_hash)
        faults.point("checkpoint-write")
        swap_in(tmp, path)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        error = _os_error(e)
        if error is None:
            raise
        raise CheckpointError(_write_failure(path, tmp, error, needed_bytes)) from e
    return path


def _write_state(directory: Path, state: dict) -> None:
    for key in WEIGHT_KEYS:
        if key in state:
            _write_file(directory / f"{key}.safetensors", lambda p, tensors=state[key]: save_file(tensors, str(p)))
    rest = {k: v for k, v in state.items() if k not in WEIGHT_KEYS}
    _write_file(directory / "state.pt", lambda p: _torch_save(rest, p))


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:  # a file object: a failed write surfaces as the OSError behind torch's RuntimeError
        torch.save(obj, f)


def _write_manifest(directory: Path, step: int, config_hash: str) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    if directory / MANIFEST in files:
        raise CheckpointError(f"{directory / MANIFEST}: written by the checkpoint's contents; that name is the manifest's")
    manifest = {
        "format": MANIFEST_FORMAT, "step": step, "cohortrl_version": __version__, "config_hash": config_hash,
        "files": {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p, sync=True)}
                  for p in files},
    }
    _write_file(directory / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))


def _write_file(path: Path, write) -> None:
    """``write(path)``, then flush the file to disk. Every file this module writes goes through here, so a
    failed write is reported as an OSError naming the file, whichever library wrote it."""
    try:
        write(path)
        _fsync(path)
    except Exception as e:
        error = _os_error(e)
        if error is None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from e


def swap_in(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``. An old ``path`` is renamed aside first and put back if the rename fails;
    a crash between the two renames leaves no ``path`` at all, never a mix."""
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{path.name}-", dir=path.parent))
        os.replace(path, old / path.name)
    try:
        os.replace(tmp, path)
    except OSError:
        if old is not None:
            os.replace(old / path.name, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync(path.parent)


def _discard(path: Path) -> None:
    """Remove a checkpoint directory: renamed to ``.tmp-*`` first (atomic), so a crash mid-delete never
    leaves a ``step_*`` directory with some of its files."""
    doomed = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=path.parent))
    os.replace(path, doomed / path.name)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(exc: BaseException) -> OSError | None:
    """The operating system's error behind ``exc``, if it is one: ``exc`` itself, an error it was raised from
    or while handling (torch.save reports a failed write as a RuntimeError raised while handling the
    OSError), or the ``os error N`` that safetensors' Rust writer puts in its message. Never for Ctrl-C or an
    exit: Python handles errors inside the libraries (``Path.mkdir(exist_ok=True)`` catches a FileExistsError),
    and a KeyboardInterrupt that lands in such a handler carries that error as its context."""
    if not isinstance(exc, Exception):
        return None
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        found = re.search(r"\(os error (\d+)\)", str(seen)) if type(seen).__name__ == "SafetensorError" else None
        if found:
            return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
        seen = seen.__cause__ or seen.__context__
    return None


def _write_failure(path: Path, tmp: Path | None, error: OSError, needed_bytes: int) -> str:
    """One line: which file, the OS's reason, the space needed and free."""
    what = path
    if error.filename and tmp is not None and Path(error.filename).is_relative_to(tmp):
        what = path / Path(error.filename).relative_to(tmp)  # the file's name once in place, not the temporary one
    reason = f"[Errno {error.errno}] {error.strerror}" if error.errno else (error.strerror or str(error))
    try:
        free = f"{_human(shutil.disk_usage(path.parent).free)} free"
    except OSError:
        free = "free space unknown"
    need = f"needs about {_human(needed_bytes)}, " if needed_bytes else ""
    return f"could not write {what}: {reason} ({need}{free} on that filesystem); nothing partial was left behind"


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"


def space_warning(directory: Path, per_copy_bytes: int, copies: int = 2, final_bytes: int = 0) -> str | None:
    """One line if ``directory``'s filesystem has less room than ``copies`` checkpoints of ``per_copy_bytes``
    (the most that exist at once: a new one is written beside the kept ones before the oldest is deleted) and
    a ``final/`` of ``final_bytes``, else None."""
    free = shutil.disk_usage(directory).free
    if free >= copies * per_copy_bytes + final_bytes:
        return None
    final = f" and final/ (about {_human(final_bytes)})" if final_bytes else ""
    return (
        f"{directory} has {_human(free)} free, less than {copies} checkpoints (about {_human(per_copy_bytes)} "
        f"each){final} need: a checkpoint write may fail with a full disk; free space or use another --run-dir"
    )


# ---------------------------------------------------------------------------------------------- checking
def step_dirs(run_dir: Path) -> list[Path]:
    """The ``step_*`` directories, oldest first (by step number, not by name)."""
    found = [p for p in checkpoint_dir(run_dir).glob("step_*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def _step_of(path: Path) -> int | None:
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def verify(path: Path, config_hash: str | tuple[str, ...] | None = None) -> str | None:
    """None if every file of ``path`` matches its manifest (and, if given, the config hash is the one, or one of
    the ones, given), else one line naming the first file that does not and why."""
    path = Path(path)
    manifest, problem = _read_manifest(path)
    if problem:
        return problem
    step = _step_of(path)
    if step is not None and manifest["step"] != step:
        return f"{path / MANIFEST}: says step {manifest['step']}, the directory is step {step} (renamed or copied into place)"
    accepted = (config_hash,) if isinstance(config_hash, str) else tuple(config_hash or ())
    if any(accepted) and manifest["config_hash"] not in accepted:
        return (f"{path / MANIFEST}: written under another config (hash {manifest['config_hash'][:12]}, this run's "
                f"is {accepted[0][:12]}): copied from another run?")
    for name, want in manifest["files"].items():
        problem = _check_file(path / name, want)
        if problem:
            return problem
    extra = sorted(p for p in path.rglob("*") if p.is_file() and p.relative_to(path).as_posix() not in manifest["files"])
    extra = [p for p in extra if p.name != MANIFEST or p.parent != path]
    if extra:
        return f"{extra[0]}: not in the manifest (added after the checkpoint was written)"
    return None


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, f"{path}: no {MANIFEST}, which is written last: the write or a copy of it did not finish"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{manifest_path}: unreadable ({getattr(e, 'strerror', None) or e})"
    missing = _manifest_problem(manifest)
    if missing:
        return None, f"{manifest_path}: incomplete ({missing})"
    return manifest, None


def _manifest_problem(m) -> str | None:
    if not isinstance(m, dict):
        return "not a JSON object"
    for key, kind in (("step", int), ("cohortrl_version", str), ("config_hash", str), ("files", dict)):
        if not isinstance(m.get(key), kind):
            return f"'{key}' missing or not a {kind.__name__}"
    for name, entry in m["files"].items():
        escapes = Path(name).is_absolute() or ".." in Path(name).parts
        if escapes or not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            return f"bad entry for {name!r}"
    return None


def _check_file(file: Path, want: dict) -> str | None:
    try:
        size = file.stat().st_size
        if size != want["size"]:
            return f"{file}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _sha256(file) != want["sha256"]:
            return f"{file}: SHA-256 differs from the manifest (changed after it was written: bit rot, a bad copy or an edit)"
    except FileNotFoundError:
        return f"{file}: missing (listed in the manifest)"
    except OSError as e:
        return f"{file}: unreadable ({e.strerror or e})"
    return None


def _sha256(path: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        if sync:  # files a library wrote (save_pretrained) reach the disk before the manifest vouches for them
            os.fsync(f.fileno())
    return digest.hexdigest()


def check_saved(path: str | Path, what: str) -> None:
    """Before ``path`` is loaded as a model (``what``: the setting that names it, e.g. ``model.init``): if it is a
    directory cohortrl saved (a ``final/`` or a checkpoint: it has a manifest, or the final marker a manifest
    goes with), raise :class:`CheckpointError` naming the first file that does not match the manifest. Any
    other path (a hub id, a model saved by another library) has nothing to check against and is left alone."""
    path = Path(path)
    if not path.is_dir() or not ((path / MANIFEST).is_file() or (path / FINAL_MARKER).is_file()):
        return
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"{what} {path} is damaged, not loaded: {problem}")


def init_record(init: str | Path) -> dict:
    """What a LoRA ``final/`` records of the weights its adapter was trained on (its run's ``model.init``, taken
    when the run loads it): the path as the config gave it, the same path made absolute, and the SHA-256 of that
    directory's manifest (None when it has none), so that a later run starting from this ``final/`` can put
    the same weights under it."""
    init = Path(init)
    return {"path": str(init), "absolute": str(init.resolve()), "manifest_sha256": manifest_sha256(init)}


def init_chain(path: str | Path, what: str = "model.init", _seen: frozenset = frozenset()) -> list[str]:
    """The directories to merge, in order, before the adapter in ``path``: a LoRA ``final/`` of a run that
    itself started from ``model.init`` Y holds an adapter trained on Y's weights, not on the base model's
    (``init_record`` in its final marker), so loading it needs Y (and whatever Y was trained on) first.
    ``path`` and each link are verified against their manifests before their markers are read
    (:func:`check_saved`). A link is looked for at its path as recorded (relative to the working directory
    when the config gave it so), then at its absolute path; it must be the directory the adapter was trained
    on (the same manifest), else :class:`CheckpointError` in one line. [] for anything else."""
    path = Path(path)
    check_saved(path, what)
    parent = final_marker(path).get("init")
    if parent is None:
        return []
    candidates = [Path(parent["path"]), *([Path(parent["absolute"])] if parent.get("absolute") else [])]
    found = [c for c in candidates if c.is_dir()]
    if not found:
        raise CheckpointError(
            f"{what} {path} is a LoRA adapter trained on top of {parent['path']} (its run's model.init), which is not "
            f"there from {Path.cwd()}: run from the directory that run ran in, or put {parent['path']} back")
    where = next((c for c in found if manifest_sha256(c) == parent["manifest_sha256"]), None)
    if where is None:
        raise CheckpointError(
            f"{what} {path} is a LoRA adapter trained on top of {parent['path']}, which has changed since (its "
            f"manifest differs): the adapter no longer fits it; train again from the new {parent['path']}")
    key = str(where.resolve())
    if key in _seen:
        raise CheckpointError(f"{what} {path}: its chain of model.init directories comes back to {where}")
    return [*init_chain(where, what, _seen | {key}), str(where)]


def find_intact(run_dir: Path, config_hash: str | tuple[str, ...] | None = None) -> Found:
    """The newest checkpoint that verifies, and the newer ones that did not (newest first)."""
    found = Found(None)
    for path in reversed(step_dirs(run_dir)):
        problem = verify(path, config_hash)
        if problem is None:
            found.path = path
            break
        found.rejected.append((path, problem))
    return found


def latest(run_dir: Path) -> Path | None:
    """The newest intact checkpoint directory, or None."""
    return find_intact(run_dir).path


def set_aside(paths: list[Path]) -> list[Path]:
    """Move damaged checkpoints to ``checkpoints/rejected/`` (kept for inspection, out of every search);
    returns where each went."""
    moved = []
    for path in paths:
        target_dir = path.parent / REJECTED
        target, n = target_dir / path.name, 1
        while target.exists():  # the same step damaged again after an earlier resume
            target, n = target_dir / f"{path.name}.{n}", n + 1
        try:
            target_dir.mkdir(exist_ok=True)
            os.replace(path, target)
        except OSError as e:
            raise CheckpointError(f"could not move the damaged checkpoint {path} to {target} ({e.strerror or e}); "
                                  "move or delete it by hand, then resume again") from None
        moved.append(target)
    return moved


# ---------------------------------------------------------------------------------------------- reading
def load(path: Path) -> dict:
    """A checkpoint's state, with its weights. Refuses (:class:`CheckpointError`) a ``state.pt`` holding any
    pickled object beyond tensors and plain data: unpickling such an object can run arbitrary code."""
    path = Path(path)
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        reason = _unpickling_reason(text)
        if "GLOBAL" not in text:  # no object refused: damaged bytes, or a type that needs a module imported first
            raise CheckpointError(f"could not read {path / 'state.pt'}: torch.load could not unpickle it ({reason})") from None
        raise CheckpointError(
            f"refusing to load {path / 'state.pt'}: it holds pickled Python objects other than tensors and plain "
            f"data, which could run code when loaded (torch.load weights_only=True said: {reason}). "
            "Only resume from checkpoints cohortrl wrote"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:  # a file that passed no verification (or changed since)
        reason = str(e).splitlines()[0] if str(e) else f"{type(e).__name__}: the file ends too early"
        raise CheckpointError(f"could not read {path / 'state.pt'}: {reason}") from None
    for key in WEIGHT_KEYS:
        file = path / f"{key}.safetensors"
        if file.is_file():
            try:
                state[key] = load_file(str(file))
            except Exception as e:  # SafetensorError has no public base class to name
                raise CheckpointError(f"could not read {file}: {str(e).splitlines()[0]}") from None
    return state


def _unpickling_reason(text: str) -> str:
    """torch's own reason in a ``weights_only`` load's error: the text after "WeightsUnpickler error:" where
    it gives one, else its first line that is not its general advice (which names ``weights_only``), less the
    "Weights only load failed." that opens it (a blocked module such as os.system, a type that needs an
    import); an error of one line that did not come through torch's wrapper is its own reason."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if found:
        return found.group(1).strip()
    lines = [line.strip() for line in text.replace("Weights only load failed.", "", 1).splitlines()]
    return next((line for line in lines if line and "weights_only" not in line), "torch gave no reason")
