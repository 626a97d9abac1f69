"""One run per run directory: a new run never writes over another's files, and two processes never train into
the same directory.

``claim(path, resume=..., overwrite=...)`` is called before a trainer loads anything:

* a directory that holds a run (any of :data:`RUN_FILES`) is refused unless the run is being resumed, or
  ``overwrite`` asks to start over, in which case that run's files are deleted first (other files are left);
* ``resume`` is safe to repeat in every state, so a pre-emption wrapper can run the same command until it
  succeeds: a directory that is missing or holds no run starts one, and a run that stopped before its first
  checkpoint (nothing to resume from) starts again from step 0, its files deleted first
  (:attr:`RunDirectory.resumes` says which it is);
* an exclusive lock (``flock`` on :data:`LOCK_FILE`) is held while the trainer trains, so a second process
  is refused at once with the holder's pid;
* a start that fails removes the directory again if this claim created it, so no empty run directory is left.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from cohortrl.trainers.checkpoint import step_dirs
from cohortrl.trainers.evaluate import EVAL_ROWS

log = logging.getLogger("cohortrl")

# What a run writes into its directory; their presence means "this directory holds a run".
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "curves.png", "tensorboard", "wandb", "nonfinite",
             EVAL_ROWS)
LOCK_FILE = ".cohortrl.lock"


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used as asked (it holds another run, or another process uses it)."""


def run_files(path: Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``path``."""
    return [name for name in RUN_FILES if (path / name).exists()]


class RunDirectory:
    """A claimed run directory: the lock while it is held, and whether the claim created the directory."""

    def __init__(self, path: Path, created: bool, main: bool = True, resumes: bool = False):
        self.path, self.created = path, created
        self.main = main  # False on torchrun's other ranks: rank 0 holds the lock for the whole job
        self.resumes = resumes  # a checkpoint is there to continue from; False: the run starts at step 0
        self._fd: int | None = None

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirectoryError` naming the process that holds it."""
        if self._fd is not None or not self.main:
            return
        lock = self.path / LOCK_FILE
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirectoryError(
                f"{self.path} is in use by another cohortrl process (pid {holder}); wait for it to finish, or use "
                "another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self, failed: bool = False) -> None:
        """Let the lock go. ``failed``: the start failed, so a directory this claim created is removed again
        (everything in it was written by this start; the lock is still held while it is removed)."""
        if failed and self.created and self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def claim(path: str | Path, *, resume: bool = False, overwrite: bool = False, main: bool = True) -> RunDirectory:
    """Make ``path`` ready for a run and lock it (see the module docstring). ``main``: False on the other ranks
    of a torchrun job, which only make sure the directory exists (rank 0 claims it for all)."""
    path = Path(path)
    if resume and overwrite:
        raise RunDirectoryError("--resume continues the run in the directory and --overwrite deletes it: give one of them")
    if path.exists() and not path.is_dir():
        raise RunDirectoryError(f"run directory {path} is a file; give a directory (new or holding a run)")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    # Decided from the step_* directories alone, which nothing here changes: every rank of a job decides alike.
    run = RunDirectory(path, created, main, resumes=resume and bool(step_dirs(path)))
    if not main:
        return run
    run.acquire()
    try:
        found = run_files(path)
        if resume and not run.resumes and found:
            log.warning("--resume: %s stopped before its first checkpoint (it holds %s and no checkpoint); starting "
                        "the run again from step 0", path, ", ".join(found))
            _delete(path, found)
        elif found and not resume:
            if not overwrite:
                raise RunDirectoryError(
                    f"{path} already holds a run ({', '.join(found)}); continue it with --resume (resume=True), or "
                    "start over with --overwrite (overwrite=True), which deletes that run's files first; or give another "
                    "--run-dir"
                )
            _delete(path, found)
    except BaseException:
        run.release(failed=True)
        raise
    return run


def _delete(path: Path, names: list[str]) -> None:
    for name in names:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
