"""``cohortrl sweep CONFIG --out DIR --grid KEY=V1,V2 --seeds 0,1,2``: a config × a grid of overrides × seeds,
each (arm, seed) an ordinary run directory ``DIR/ARM/seedK`` trained by the ordinary command (``train`` or
``sft``) in a child process. Algorithms are arms like any setting: ``--grid algorithm.name=grpo,rft``.

A sweep can be stopped at any moment (Ctrl-C, a kill, a lost machine) and started again with the same command:
a run that finished (its ``final/`` intact) is skipped, one with an intact checkpoint is resumed from it (the
trainer's resume is exact, so the results are those of an uninterrupted sweep), and one that died before its
first checkpoint starts again from step 0. ``DIR/sweep.json`` holds the sweep's definition (a second start with
another definition is refused rather than mixed in); ``DIR/sweep.jsonl`` one line per attempt at a run, with its
wall and CPU time (the child's and its waited-for descendants', from ``wait4``), which the report sums per run,
the machine it ran on (``machine.describe``: the same seed rounds differently on another machine) and the code
the child started with (``code_version``: the checkout's commit, and whether it had uncommitted changes).

Runs go one at a time unless ``--jobs N`` asks for N at once (each child then gets ``OMP_NUM_THREADS`` =
cores / N unless the environment sets it). ``{seed}`` in an override's value is the run's seed, so each seed of
an RL arm can start from the same seed's warm start: ``model.init=runs/ws/base/seed{seed}/final``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cohortrl import machine
from cohortrl.config import ConfigError
from cohortrl.trainers import checkpoint
from cohortrl.trainers.run_dir import run_files

def code_version() -> dict:
    """The code a child run imports: the commit of the checkout cohortrl is imported from and whether tracked files
    differ from it, or, installed from a package, its version."""
    source = Path(__file__).resolve().parent.parent  # the directory that holds the cohortrl package
    git = ["git", "--no-optional-locks", "-C", str(source)]  # reading the version never writes the index
    try:
        head = subprocess.run([*git, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, timeout=30)
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        head = None
    # an installed package inside some other checkout (a .venv in a repository) is not that checkout's code
    lines = head.stdout.split() if head is not None and head.returncode == 0 and changed.returncode == 0 else []
    if len(lines) != 2 or Path(lines[0]).resolve() != source:
        return {"version": _package_version()}
    return {"commit": lines[1], "uncommitted_changes": bool(changed.stdout.strip())}


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("cohortrl")
    except metadata.PackageNotFoundError:
        return "unknown"


SPEC = "sweep.json"
ATTEMPTS = "sweep.jsonl"
COMMANDS = ("train", "sft")


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    overrides: tuple[str, ...]  # the arm's overrides and train.seed, {seed} filled in
    path: Path


def read_attempts(out: Path) -> list[dict]:
    """The lines of a sweep's ``sweep.jsonl``, one per attempt at a run; a torn last line (a kill mid-write has
    no newline) is left out."""
    path = Path(out) / ATTEMPTS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def split_values(text: str) -> list[str]:
    """``"1,2"`` -> ["1", "2"]; commas inside brackets belong to a value (``[1,2],[3,4]`` is two lists)."""
    values, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            values.append(text[start:i])
            start = i + 1
    values.append(text[start:])
    return [v.strip() for v in values]


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["algorithm.group_size=2,4", ...]`` -> {"algorithm.group_size": ["2", "4"], ...}, in the given order."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not key or not values:
            raise ConfigError(f"--grid {item!r}: write KEY=VALUE1,VALUE2 (e.g. --grid algorithm.group_size=2,4,8)")
        if key in grid:
            raise ConfigError(f"--grid names {key} twice: give all its values in one --grid {key}=V1,V2")
        grid[key] = split_values(values)
        if len(set(grid[key])) != len(grid[key]) or "" in grid[key]:
            raise ConfigError(f"--grid {item!r}: each value once and none empty")
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in split_values(text)]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: write whole numbers separated by commas (e.g. --seeds 0,1,2)") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: each seed once")
    return seeds


def arms(grid: dict[str, list[str]]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, overrides) of each point of the grid, in product order; the name is the overrides joined with
    '+' ('base' for an empty grid), so a run directory says what it ran."""
    if not grid:
        return [("base", ())]
    out = []
    for values in itertools.product(*grid.values()):
        overrides = tuple(f"{k}={v}" for k, v in zip(grid, values))
        out.append(("+".join(o.replace("/", "_") for o in overrides), overrides))
    return out


class Sweep:
    """The runs of one sweep directory and their state on disk."""

    def __init__(self, out: Path, config: str, command: str, grid: dict[str, list[str]], seeds: list[int],
                 overrides: list[str]):
        if command not in COMMANDS:
            raise ConfigError(f"--command {command!r}: use one of {', '.join(COMMANDS)}")
        if not seeds:
            raise ConfigError("--seeds is empty: give at least one seed")
        self.out, self.command = Path(out), command
        self.spec = {"config": config, "command": command, "grid": grid, "seeds": seeds, "overrides": list(overrides)}
        self.runs = [
            Run(name, seed, tuple(o.replace("{seed}", str(seed)) for o in (*overrides, *arm_overrides, f"train.seed={seed}")),
                self.out / name / f"seed{seed}")
            for name, arm_overrides in arms(grid) for seed in seeds
        ]
        self._lock = threading.Lock()
        self._stopping = False  # set on an interrupt: no further child is started
        self.machine = machine.describe()

    def claim(self) -> None:
        """Write the definition, or check it against the directory's (a restart). A restart may add seeds or grid
        values (the finished runs are kept); any other difference is another sweep and is refused."""
        path = self.out / SPEC
        if path.is_file():
            old = json.loads(path.read_text())
            if old == self.spec:
                return
            if not _extends(old, self.spec):
                raise ConfigError(
                    f"{self.out} holds another sweep ({path}: {json.dumps(old)}); give the same command to continue "
                    "it (more seeds or grid values may be added), or another --out for this one"
                )
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(SPEC + ".tmp")
        tmp.write_text(json.dumps(self.spec, indent=1) + "\n")
        os.replace(tmp, path)

    def finished(self, run: Run, attempts: list[dict]) -> bool:
        """The run ended with rc 0 (in ``attempts``, the sweep's log) and its final/ is intact."""
        ok = any(a["arm"] == run.arm and a["seed"] == run.seed and a["rc"] == 0 for a in attempts)
        return ok and (run.path / "final").is_dir() and checkpoint.verify(run.path / "final") is None

    def command_line(self, run: Run) -> tuple[list[str], str]:
        """The child's command and what it does: 'start', 'resume' (an intact checkpoint) or 'restart' (run
        files but no checkpoint: it died before its first one)."""
        base = [sys.executable, "-m", "cohortrl", self.command]
        if checkpoint.find_intact(run.path).path is not None or (run.path / "final").is_dir():
            return [*base, "--run-dir", str(run.path), "--resume"], "resume"
        fresh = [*base, self.spec["config"], "--run-dir", str(run.path), *run.overrides]
        if run.path.is_dir() and run_files(run.path):
            return [*fresh, "--overwrite"], "restart"
        return fresh, "start"

    def execute(self, run: Run, env: dict, children: set) -> int:
        cmd, kind = self.command_line(run)
        run.path.parent.mkdir(parents=True, exist_ok=True)
        print(f"sweep: {kind} {run.path}", flush=True)
        code = code_version()  # when the child starts: the code a long sweep runs may change between its runs
        started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
        with open(run.path.parent / f"seed{run.seed}.log", "a") as log_file:
            with self._lock:
                if self._stopping:
                    return 130
                child = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
                children.add(child)
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            with self._lock:
                children.discard(child)
        record = {"run": str(run.path), "arm": run.arm, "seed": run.seed, "attempt": kind, "rc": child.returncode,
                  "wall_s": round(time.perf_counter() - wall0, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                  "started": started, "machine": self.machine, "code": code}
        with self._lock, open(self.out / ATTEMPTS, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"sweep: {run.path} rc {child.returncode} ({record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} s CPU)", flush=True)
        return child.returncode

    def run(self, jobs: int = 1) -> int:
        """Every run not yet finished, ``jobs`` at a time; 0 when all have finished, else 1 (the failed runs'
        logs are named). A second call continues where the first stopped."""
        self.claim()
        attempts = read_attempts(self.out)
        todo = [r for r in self.runs if not self.finished(r, attempts)]
        done = len(self.runs) - len(todo)
        print(f"sweep: {len(self.runs)} runs in {self.out}, {done} finished, {len(todo)} to run", flush=True)
        env = dict(os.environ)
        if jobs > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
        children: set = set()
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a kill of the sweep ends its children too
        pool = ThreadPoolExecutor(max_workers=max(1, jobs))
        try:
            futures = [pool.submit(self.execute, r, env, children) for r in todo]
            codes = [f.result() for f in futures]
        except KeyboardInterrupt:
            with self._lock:
                self._stopping = True  # no thread starts another child
            pool.shutdown(wait=False, cancel_futures=True)
            _end(children)
            pool.shutdown(wait=True)
            print(f"sweep: interrupted; the same command continues it ({len(self.runs)} runs in {self.out})", file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        pool.shutdown()
        failed = [r for r, rc in zip(todo, codes) if rc != 0]
        for r in failed:
            print(f"sweep: FAILED {r.path} (see {r.path.parent / f'seed{r.seed}.log'}); the same command retries it",
                  file=sys.stderr)
        return 1 if failed else 0


def _extends(old: dict, new: dict) -> bool:
    """``new`` is ``old`` with more seeds or more values on its grid's axes, nothing else changed."""
    same = all(old[k] == new[k] for k in ("config", "command", "overrides")) and list(old["grid"]) == list(new["grid"])
    return same and set(old["seeds"]) <= set(new["seeds"]) and all(
        set(values) <= set(new["grid"][key]) for key, values in old["grid"].items())


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _end(children: set) -> None:
    for child in list(children):
        child.terminate()
    deadline = time.monotonic() + 10
    for child in list(children):
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
