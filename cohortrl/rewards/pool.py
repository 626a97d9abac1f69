"""Scoring in a pool of worker processes, so verifiers (and the sandbox they drive) run beside generation.

The trainer submits each group's responses as soon as they are generated and collects the scores after the
last group: scoring overlaps generation instead of following it. Workers are started by a fork server (a
clean process, not a fork of the trainer with its model and threads) and load the reward functions by their
config names (``resolve``), so only names, prompts, completions and dataset columns cross the process
boundary.

Faults are never silent. A worker that dies (killed, segfault, out of memory) gets the pool restarted and
the batch retried ``retries`` times; if it fails again the run stops with a ``RewardFunctionError`` that
names the functions, the batch and what happened. A batch that does not finish within ``timeout_s`` gets its
worker killed (with the pool, which is restarted: this also stops a function holding the interpreter lock,
which no thread can interrupt) and is scored again one completion at a time; a completion that times out
alone scores 0 for every function and is recorded as a grader error (``grader_errors.timed_out``), as
in-process scoring does: the run goes on. An exception raised by a reward function is not retried (it is the
function's answer, and deterministic code would raise again): it is reported exactly as in-process scoring
reports it.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from cohortrl.rewards import grader_errors
from cohortrl.rewards.scoring import RewardFunctionError, _sample

# Reward functions resolved once per worker process: (name, sorted kwargs) -> function.
_WORKER_FUNCTIONS: dict = {}


def _score_in_worker(specs: list[tuple[str, dict]], prompts, completions, columns) -> dict[str, list]:
    from cohortrl.rewards.scoring import _call, resolve

    out = {}
    for name, kwargs in specs:
        key = (name, tuple(sorted(kwargs.items())))
        if key not in _WORKER_FUNCTIONS:
            _WORKER_FUNCTIONS[key] = resolve(name, kwargs)
        out[name] = list(_call(_WORKER_FUNCTIONS[key], name, prompts, completions, columns))
    out[grader_errors.POOL_KEY] = grader_errors.drain()  # built-in graders' failures, for the trainer's log
    return out


@dataclass
class _Job:
    args: tuple
    future: cf.Future


class RewardPool:
    """``submit(prompts, completions, columns)`` now, ``result(job)`` later: each function's raw values."""

    def __init__(self, specs: list[tuple[str, dict]], workers: int, timeout_s: float | None = None, retries: int = 1):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.specs, self.workers, self.timeout_s, self.retries = specs, workers, timeout_s or None, retries
        self.restarts = 0
        self._pending: list[_Job] = []  # submitted, result not collected yet
        self._pool = self._start()

    def _start(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("forkserver"))

    def _restart(self) -> None:
        # Kill what is left (a hung worker never returns), then start afresh.
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._start()
        self.restarts += 1
        for job in self._pending:  # the old pool's jobs died with it, finished or not: run them again
            job.future = self._pool.submit(_score_in_worker, *job.args)

    def submit(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> _Job:
        args = (self.specs, list(prompts), list(completions), columns)
        try:
            future = self._pool.submit(_score_in_worker, *args)
        # A worker died since the last submit: replace the pool (re-running its jobs). Before the executor has
        # noticed the death, its attempt to spawn a replacement can fail on the dead worker's closed pipe (OSError).
        except (BrokenProcessPool, OSError):
            self._restart()
            future = self._pool.submit(_score_in_worker, *args)
        job = _Job(args, future)
        self._pending.append(job)
        return job

    def result(self, job: _Job) -> dict[str, list]:
        names = ", ".join(name for name, _ in self.specs)
        for attempt in range(self.retries + 1):
            try:
                values = job.future.result(timeout=self.timeout_s)
                self._pending.remove(job)
                for entry in values.pop(grader_errors.POOL_KEY, []):  # kept in this process, as if scored here
                    grader_errors.record(entry)
                return values
            except RewardFunctionError:
                self._pending.remove(job)
                raise
            except BrokenProcessPool:
                what = "a reward worker process died (killed, crashed or out of memory)"
            except cf.TimeoutError:
                self._pending.remove(job)
                self._restart()  # kills the worker; every other pending job runs again
                return self._one_at_a_time(job)
            if attempt == self.retries:
                self._pending.remove(job)
            self._restart()  # resubmits this job (unless out of retries) and every other pending one
        raise RewardFunctionError(
            f"scoring {len(job.args[1])} completions with reward function(s) {names} failed: {what}; "
            f"the pool was restarted and the batch retried {self.retries} time(s). The first prompt of the batch: "
            f"{job.args[1][0][:200]!r}"
        )

    def _one_at_a_time(self, job: _Job) -> dict[str, list]:
        """The values of a batch that timed out, from its completions scored one per job; a completion that
        times out alone scores 0 for every function, as a grader error."""
        specs, prompts, completions, columns = job.args
        if len(prompts) == 1:
            for name, _ in specs:
                grader_errors.timed_out(name, prompts[0], completions[0], self.timeout_s)
            return {name: [0.0] for name, _ in specs}
        parts = [self.submit(prompts[i : i + 1], completions[i : i + 1], _sample(columns, i)) for i in range(len(prompts))]
        values = [self.result(part) for part in parts]
        return {name: [v for part in values for v in part[name]] for name, _ in specs}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
