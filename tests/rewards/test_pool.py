"""The reward pool: the same scores as in-process scoring, a worker killed mid-batch is replaced and its batch
retried, an always-dying batch fails with a clear error, a hung completion scores 0 as a grader error, a function's own exception is reported as is."""

import textwrap

import pytest

from cohortrl.rewards import grader_errors
from cohortrl.rewards.pool import RewardPool
from cohortrl.rewards.scoring import RewardFunctionError, _call, resolve


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "pool_fns.py"
    marker = tmp_path / "killed-once"
    path.write_text(textwrap.dedent(f"""
        import os, signal, time

        def length(prompts, completions, **columns):
            return [float(len(c)) for c in completions]

        def dies_once(prompts, completions, **columns):
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return [1.0] * len(completions)

        def always_dies(prompts, completions, **columns):
            os.kill(os.getpid(), signal.SIGKILL)

        def holds_the_lock_on_bb(prompts, completions, **columns):
            return [float(sum(range(10**12)) if c == "bb" else 1.0) for c in completions]

        def raises(prompts, completions, **columns):
            raise ValueError("bad completion " + completions[0])
    """))
    return path


PROMPTS, COMPLETIONS = ["q0", "q1", "q2"], ["a", "bb", "ANSWER: 3"]
COLUMNS = {"answer": ["1", "2", "3"]}


def test_pool_scores_equal_in_process_scores(fns):
    specs = [(f"{fns}:length", {}), ("accuracy", {"mode": "last_number"})]
    pool = RewardPool(specs, workers=2)
    try:
        jobs = [pool.submit(PROMPTS, COMPLETIONS, COLUMNS) for _ in range(3)]
        results = [pool.result(job) for job in jobs]
    finally:
        pool.close()
    expected = {name: _call(resolve(name, kw), name, PROMPTS, COMPLETIONS, COLUMNS) for name, kw in specs}
    assert results == [expected] * 3


def test_a_worker_killed_mid_batch_is_replaced_and_the_batch_retried(fns):
    pool = RewardPool([(f"{fns}:dies_once", {})], workers=1)
    try:
        first, second = pool.submit(PROMPTS, COMPLETIONS, COLUMNS), pool.submit(PROMPTS, COMPLETIONS, COLUMNS)
        assert pool.result(first) == {f"{fns}:dies_once": [1.0, 1.0, 1.0]}
        assert pool.result(second) == {f"{fns}:dies_once": [1.0, 1.0, 1.0]}  # lost with the pool, run again
        assert pool.restarts == 1
    finally:
        pool.close()


def test_a_batch_that_always_kills_its_worker_fails_clearly(fns):
    pool = RewardPool([(f"{fns}:always_dies", {})], workers=1, retries=1)
    try:
        with pytest.raises(RewardFunctionError) as err:
            pool.result(pool.submit(PROMPTS, COMPLETIONS, COLUMNS))
    finally:
        pool.close()
    assert str(err.value) == (
        f"scoring 3 completions with reward function(s) {fns}:always_dies failed: a reward worker process died "
        "(killed, crashed or out of memory); the pool was restarted and the batch retried 1 time(s). "
        "The first prompt of the batch: 'q0'"
    )


def test_a_batch_past_its_time_kills_the_worker_and_scores_only_the_slow_completion_failed(fns):
    """Issue 50: the function holds the interpreter lock on one completion (a C loop no thread can interrupt);
    the worker is killed, the completions are scored one at a time, and only that one scores 0 (for every
    function of the batch), as a grader error."""
    grader_errors.drain()
    pool = RewardPool([(f"{fns}:holds_the_lock_on_bb", {}), (f"{fns}:length", {})], workers=1, timeout_s=1.0, retries=0)
    try:
        values = pool.result(pool.submit(PROMPTS, COMPLETIONS, COLUMNS))
        assert pool.restarts == 2  # the batch's worker, then the one that ran "bb" alone
    finally:
        pool.close()
    assert values == {f"{fns}:holds_the_lock_on_bb": [1.0, 0.0, 1.0], f"{fns}:length": [1.0, 0.0, 9.0]}
    errors = grader_errors.drain()
    assert [(e["reward"], e["completion"]) for e in errors] == [(f"{fns}:holds_the_lock_on_bb", "bb"), (f"{fns}:length", "bb")]
    assert all(e["error"] == "RewardTimeoutError: no result within reward.timeout_s=1 s" for e in errors)


def test_an_exception_in_the_function_is_reported_not_retried(fns):
    pool = RewardPool([(f"{fns}:raises", {})], workers=1)
    try:
        with pytest.raises(RewardFunctionError, match=r"^reward function '.*:raises' raised ValueError: bad completion a at .*pool_fns.py:\d+ \(in raises\) on sample 0 \(prompt: 'q0'\)$"):
            pool.result(pool.submit(PROMPTS, COMPLETIONS, COLUMNS))
        assert pool.restarts == 0
    finally:
        pool.close()
