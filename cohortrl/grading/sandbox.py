"""Running untrusted, model-written Python out of process, with limits.

Model text never runs in the trainer's process. A `Sandbox` starts a small fork server
(`cohortrl/grading/sandbox_server.py`) as a fresh interpreter through ``subprocess`` (fork+exec: it never
inherits the trainer's threads or torch, so it may be started at any time; starting it early only moves
its ~0.1 s start-up out of the first reward call). The server forks one child per job; the child sets up
its limits, compiles the model's code, calls one function once per argument list and sends the return
values back over a pipe as JSON. What each layer does is in the server's docstring; what is active on a
machine is in `Sandbox.isolation` (and docs/sandbox.md):

    from cohortrl.grading import sandbox

    box = sandbox.shared()                 # one per process, started on first use, stopped at exit
    result = box.run("def f(x):\\n    return 2 * x", "f", [[1], [2.5]], timeout_s=1.0)
    result.ok, result.reason               # True, ""
    [c.value for c in result.calls]        # [2, 5.0]
    box.run_many([sandbox.Job(code, "f", [[1]]), ...])   # many jobs at once, results in order

A job fails with one clear ``reason``: a timeout (wall clock or CPU), the memory limit, a forbidden system
call (killed by seccomp), a crash, too much output, code that does not compile or defines no such
function, or the first call that raised (``call 2 raised ZeroDivisionError: division by zero (line 3)``).
Per-call outcomes are in ``calls`` whenever the job ran to its end. Every reply is checked before it becomes
a `JobResult` (a malformed one is a failed job), and if the server crashes with jobs in flight, they run
once more on a new server.

Where seccomp is unavailable the sandbox still runs, with a warning logged once and
``seccomp_active=False`` on every result; the other layers (rlimits, own uid, network namespace) remain.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

SERVER = Path(__file__).with_name("sandbox_server.py")
MAX_CODE_CHARS = 100_000  # a longer "function" is refused before it reaches the server
MAX_ATTEMPTS = 2  # a job in flight when the server crashes runs once more, on a new server


@dataclass(frozen=True)
class Job:
    """One piece of code and the calls to make: ``func_name(*args)`` for each ``args`` in ``calls``."""

    code: str
    func_name: str
    calls: Sequence[Sequence[Any]]  # each a list of JSON-serialisable positional arguments
    timeout_s: float = 2.0  # wall clock for the whole job; CPU time to the next whole second (sandbox_server.cpu_limit)
    memory_mb: int = 256  # address space the job may add to the interpreter's own


@dataclass(frozen=True)
class CallResult:
    ok: bool  # the call returned (rather than raised)
    value: Any = None  # the return value as JSON data: tuples come back as lists, NaN as nan
    error: str = ""  # "ZeroDivisionError: division by zero (line 3)" when it raised


@dataclass(frozen=True)
class JobResult:
    ok: bool  # the job ran to its end and every call returned
    reason: str  # "" when ok, else one line saying why not
    calls: list[CallResult] = field(default_factory=list)  # one per call when the job ran to its end
    output: str = ""  # what the code printed (stdout and stderr), at most the sandbox's output_limit bytes
    seconds: float = 0.0  # wall time of the job's process
    seccomp_active: bool = False  # the seccomp filter was loaded for this job
    queued_s: float = 0.0  # time the job waited in the server for a start slot


@dataclass(frozen=True)
class Isolation:
    """What the sandbox server reported about this machine when it started."""

    seccomp: bool
    seccomp_error: str  # why seccomp is off ("" when on)
    network: str  # how the network is cut off besides seccomp, e.g. "network namespace (no interfaces up)"
    own_uid_per_job: bool  # each job runs as a uid of its own (the server runs as root)
    chroot: bool  # each job's root directory is its own empty directory (the server runs as root)
    rlimits: list[str]


_warned_no_seccomp = False


class Sandbox:
    """A client of one fork server. Thread-safe: several threads may call `run_many` at once.

    ``max_workers`` jobs start in parallel (each keeps its start slot for its first ``fast_s`` seconds);
    ``max_children`` bounds live children, so a batch takes at most ``max_children * memory_mb``.
    ``output_limit`` caps stdout+stderr per job (more kills the job). ``seccomp=False`` is for testing the
    fallback a machine without seccomp gets.
    """

    GUARD_BASE_S = 10.0  # the wedged-server guard's fixed part, before the jobs' own limits (run_many)

    def __init__(self, max_workers: int = 2, max_children: int = 32, output_limit: int = 65536,
                 fast_s: float = 0.02, seccomp: bool = True) -> None:
        self.config = {"max_workers": max_workers, "max_children": max_children, "output_limit": output_limit,
                       "fast_s": fast_s, "seccomp": seccomp}
        self._lock = threading.Lock()  # guards starting/stopping and writes to the server
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, dict] = {}  # id -> a slot: {"event", "result", "proc", "attempts", "crash"}
        self._ids = itertools.count()
        self.isolation: Isolation | None = None

    # -- life cycle --------------------------------------------------------------------------------------
    def start(self) -> Sandbox:
        """Start the server if it is not running; returns self. Called by `run_many` as needed."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self
            # -I -S: no site-packages, no PYTHON* variables, no user directory; a minimal environment, so the
            # model's code cannot read the trainer's tokens from os.environ.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(SERVER), json.dumps(self.config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # a Ctrl-C for the trainer is not delivered to the server directly
            )
            hello = json.loads(self._proc.stdout.readline() or "null")
            if not isinstance(hello, dict) or "hello" not in hello:
                raise RuntimeError(f"the sandbox server did not start (exit code {self._proc.poll()})")
            info = hello["hello"]
            self.isolation = Isolation(info["seccomp"], info["seccomp_error"], info["network"],
                                       info["own_uid_per_job"], info["chroot"], info["rlimits"])
            global _warned_no_seccomp
            if not info["seccomp"] and not _warned_no_seccomp:
                _warned_no_seccomp = True
                log.warning("sandbox: seccomp is NOT active (%s); model code still runs with rlimits, %s, "
                            "network: %s", info["seccomp_error"],
                            "its own uid in an empty chroot" if info["chroot"] else "the trainer's uid, seeing its files",
                            info["network"])
            threading.Thread(target=self._read_results, args=(self._proc,), daemon=True,
                             name="sandbox-reader").start()
            return self

    @property
    def server_pid(self) -> int | None:
        """The fork server's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def close(self, reason: str = "the sandbox was closed") -> None:
        """Stop the server; its children are killed with it. Pending jobs fail with ``reason``."""
        with self._lock:
            proc, self._proc = self._proc, None
            for job_id, slot in list(self._pending.items()):
                if slot["proc"] is proc:  # failed here, so that the reader does not take the exit for a crash
                    del self._pending[job_id]
                    slot["result"] = {"ok": False, "reason": reason}
                    slot["event"].set()
        if proc is not None:
            proc.stdin.close()  # the server's loop ends on EOF and kills its children
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _read_results(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                message = json.loads(line)
                slot = self._pending.pop(message.get("id"), None)
                result = message.get("result") or {"ok": False, "reason": str(message.get("error", "?"))}
            except Exception:  # noqa: BLE001  (never expected: the server checks what it sends; the reader must live)
                log.exception("sandbox: unreadable line from the server, ignored (its job fails at the wait guard)")
                continue
            if slot is not None:
                slot["result"] = result
                slot["event"].set()
        # EOF: the server crashed (a deliberate close has already failed its jobs). Whatever it still owed is
        # run again once on a new server (`_wait`), rather than failed: an honest job did nothing wrong.
        code = proc.wait()
        with self._lock:
            for job_id, slot in list(self._pending.items()):
                if slot["proc"] is proc:
                    del self._pending[job_id]
                    slot["crash"] = f"the sandbox server exited (code {code})"
                    slot["event"].set()

    # -- running -----------------------------------------------------------------------------------------
    def run(self, code: str, func_name: str, calls: Sequence[Sequence[Any]], timeout_s: float = 2.0,
            memory_mb: int = 256) -> JobResult:
        """Call ``func_name(*args)`` for every ``args`` in ``calls``, in one sandboxed process."""
        return self.run_many([Job(code, func_name, calls, timeout_s, memory_mb)])[0]

    def run_many(self, jobs: Sequence[Job]) -> list[JobResult]:
        """Run every job (at most ``max_workers`` starting at once); results in the order of ``jobs``.

        If the server crashes while a job is in flight, the job runs once more on a new server; a second
        crash fails it, with the reason."""
        self.start()
        slots: list[dict | JobResult] = []
        for job in jobs:
            refused = self._refuse(job)
            slots.append(JobResult(False, refused) if refused else {"event": threading.Event(), "result": None,
                                                                      "proc": None, "attempts": 0, "crash": ""})
        self._submit([(job, slot) for job, slot in zip(jobs, slots) if isinstance(slot, dict)])
        # A guard against a wedged server, never reached in normal operation: every job, one start slot
        # at a time, at its full limit, twice over (afresh for a job run again after a crash).
        guard = self.GUARD_BASE_S + 2 * sum(job.timeout_s for job in jobs) / self.config["max_workers"]
        deadline = time.monotonic() + guard
        results = []
        for job, slot in zip(jobs, slots):
            if isinstance(slot, dict):
                slot = self._wait(job, slot, deadline, guard)
            results.append(slot)
        return results

    def _submit(self, pairs: list[tuple[Job, dict]]) -> None:
        """Send each job to the server (started if it is not running); a job that cannot be sent is marked
        as crashed, which `_wait` handles."""
        if not pairs:
            return
        self.start()
        with self._lock:
            proc = self._proc
            for job, slot in pairs:
                job_id = next(self._ids)
                slot["event"].clear()
                slot.update(proc=proc, attempts=slot["attempts"] + 1, crash="")
                self._pending[job_id] = slot
                request = {"id": job_id, "code": job.code, "func": job.func_name, "calls": [list(a) for a in job.calls],
                           "timeout_s": float(job.timeout_s), "memory_mb": int(job.memory_mb)}
                try:
                    proc.stdin.write((json.dumps(request) + "\n").encode())
                except (BrokenPipeError, ValueError, AttributeError):
                    self._pending.pop(job_id, None)
                    slot["crash"] = "the sandbox server is not running"
                    slot["event"].set()
            try:
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, AttributeError):
                pass  # the reader sees the server's exit and marks what it still owed

    def _wait(self, job: Job, slot: dict, deadline: float, guard: float) -> JobResult:
        while True:
            if not slot["event"].wait(max(0.0, deadline - time.monotonic())):
                self.close(f"the sandbox server did not answer within {guard:.0f} s")  # start afresh next time
                slot["event"].wait(1.0)  # close() has failed the job, unless the server answered meanwhile
                return _job_result(slot["result"] or {"ok": False, "reason": f"the sandbox server did not answer within {guard:.0f} s"})
            if not slot["crash"]:
                return _job_result(slot["result"])
            if slot["attempts"] >= MAX_ATTEMPTS:
                return JobResult(False, f"{slot['crash']} while this job ran, {slot['attempts']} times; the job was not graded")
            log.warning("sandbox: %s with a job in flight; running it again on a new server", slot["crash"])
            self._submit([(job, slot)])
            deadline = time.monotonic() + guard

    @staticmethod
    def _refuse(job: Job) -> str:
        if len(job.code) > MAX_CODE_CHARS:
            return f"the code is longer than {MAX_CODE_CHARS} characters"
        if not (0 < job.timeout_s <= 600 and math.isfinite(job.timeout_s)):
            return f"timeout_s must be in (0, 600], not {job.timeout_s}"
        return ""


def _job_result(data: dict) -> JobResult:
    """The server's reply as a `JobResult`, checked once more (the server checks what its children write):
    a reply of the wrong shape is a failed job, never an exception in the grader."""
    try:
        calls = [_call_result(c) for c in data.get("calls") or []]
        return JobResult(data.get("ok") is True, _text(data.get("reason")), calls, _text(data.get("output")),
                         float(data.get("seconds") or 0.0), data.get("seccomp") is True, float(data.get("queued_s") or 0.0))
    except (AttributeError, TypeError, ValueError) as e:
        return JobResult(False, f"the sandbox server's reply was malformed ({type(e).__name__}: {str(e)[:200]})")


def _call_result(data: dict) -> CallResult:
    if type(data) is not dict or type(data.get("ok")) is not bool:
        raise TypeError("a call's result is not an object with a boolean 'ok'")
    value = data.get("value")
    if not _plain(value):
        raise ValueError("a call's value is not plain JSON data nested at most 32 deep")
    return CallResult(data["ok"], value, _text(data.get("error")))


def _plain(value: Any, depth: int = 0) -> bool:
    """Plain JSON data (exact types) nested at most 32 deep; checked without deeper recursion than that."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if depth >= 32:
        return False
    if type(value) is list:
        return all(_plain(v, depth + 1) for v in value)
    return type(value) is dict and all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())


def _text(value: Any) -> str:
    if value is not None and type(value) is not str:
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value or ""


_shared: Sandbox | None = None
_shared_pid = 0
_shared_lock = threading.Lock()


def shared() -> Sandbox:
    """The process's sandbox, started on first use and stopped at interpreter exit. A process forked from
    one that had it (a ``fork`` multiprocessing worker) gets its own: the inherited one's reader thread
    did not survive the fork, and its server belongs to the parent."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared, _shared_pid = Sandbox(), os.getpid()
            atexit.register(_shared.close)
        return _shared.start()
