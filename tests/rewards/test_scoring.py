"""Reward calls that hang are timed out: the completion they hang on scores 0 as a grader error; fast ones are
unaffected."""

import threading

import pytest

from cohortrl.rewards import grader_errors
from cohortrl.rewards.scoring import RewardFunctionError, WeightedReward, score

PROMPTS, COMPLETIONS = ["What is 1 + 1?", "What is 2 + 2?"], ["2", "4"]


def test_a_reward_past_its_time_scores_that_completion_failed_and_the_run_goes_on():
    """Issue 50: the batch times out, is scored again one completion at a time, and only the completion the
    function hangs on scores 0, recorded as a grader error; the others keep their values."""
    release = threading.Event()

    def hangs_on_4(prompts, completions, **columns):
        if "4" in completions:
            release.wait(10)  # released below, so the abandoned threads end with the test
        return [float(len(c)) + 1.0 for c in completions]

    grader_errors.drain()
    try:
        totals, per_fn = score([WeightedReward("hangs_on_4", hangs_on_4, timeout_s=0.2)], PROMPTS, COMPLETIONS, {})
    finally:
        release.set()
    assert totals == [2.0, 0.0] and per_fn == {"hangs_on_4": [2.0, 0.0]}
    errors = grader_errors.drain()
    assert [(e["reward"], e["prompt"], e["completion"], e["error"]) for e in errors] == [
        ("hangs_on_4", "What is 2 + 2?", "4", "RewardTimeoutError: no result within reward.timeout_s=0.2 s")]


@pytest.mark.parametrize("timeout_s", [None, 0, 5.0])
def test_results_and_errors_pass_through_the_timeout_unchanged(timeout_s):
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    def fails_on_4(prompts, completions, **columns):
        if "4" in completions:
            raise ValueError("no fours")
        return [0.0] * len(completions)

    totals, _ = score([WeightedReward("length", length, timeout_s=timeout_s)], PROMPTS, COMPLETIONS, {"name": ["x", "y"]})
    assert totals == [1.0, 1.0]
    with pytest.raises(RewardFunctionError, match=r"^reward function 'fails_on_4' raised ValueError: no fours at tests/rewards/test_scoring.py:\d+ \(in fails_on_4\) on sample 1 "):
        score([WeightedReward("fails_on_4", fails_on_4, timeout_s=timeout_s)], PROMPTS, COMPLETIONS, {})
