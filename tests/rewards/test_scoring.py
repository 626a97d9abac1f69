"""Reward calls that hang are timed out with an error naming the function; fast ones are unaffected."""

import threading

import pytest

from cohortrl.rewards.scoring import RewardFunctionError, RewardTimeoutError, WeightedReward, score

PROMPTS, COMPLETIONS = ["What is 1 + 1?", "What is 2 + 2?"], ["2", "4"]


def test_a_hung_reward_function_is_timed_out_by_name():
    release = threading.Event()

    def hangs(prompts, completions, **columns):
        release.wait(10)  # released below, so the abandoned thread ends with the test
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardTimeoutError) as err:
            score([WeightedReward("hangs", hangs, timeout_s=0.2)], PROMPTS, COMPLETIONS, {})
    finally:
        release.set()
    assert str(err.value) == (
        "reward function 'hangs' did not return within reward.timeout_s=0.2 s on 2 sample(s); it may hang "
        "(its thread is left running in the background). Fix the function or raise reward.timeout_s"
    )
    assert isinstance(err.value, RewardFunctionError)


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
