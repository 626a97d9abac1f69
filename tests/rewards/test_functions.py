import math

import pytest

from cohortrl.grading.answers import extract_answer
from cohortrl.rewards.functions import make_accuracy, make_format, make_overlong
from cohortrl.rewards.scoring import RewardFunctionError, WeightedReward, resolve, score


def test_doctests_of_the_builtins():
    import doctest

    import cohortrl.grading.answers
    import cohortrl.rewards.functions

    for mod in (cohortrl.rewards.functions, cohortrl.grading.answers):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, mod.__name__


@pytest.mark.parametrize(
    "completion, mode, expected",
    [
        ("7 + 5 = 12\nANSWER: 12", "answer_line", "12"),
        ("ANSWER: 12\nANSWER: 13", "answer_line", None),  # hedging between answers commits to nothing
        ("ANSWER: 12\nanswer: 12", "answer_line", None),  # the gym's rule: exactly one line commits, even if they agree
        ("- **ANSWER:** 12 kN", "answer_line", "12 kN"),  # decoration ignored, the unit kept for the comparison
        ("ANSWER: F = <12>", "answer_line", "12"),  # a named quantity and the template's brackets read as the gym does
        ("The answer is 12.", "answer_line", None),
        ("7 + 5 = 12. So 12", "last_number", "12"),
        ("**ANSWER**: 1,234", "last_number", "1,234"),
        ("no number here", "last_number", None),
    ],
)
def test_extract_answer(completion, mode, expected):
    assert extract_answer(completion, mode) == expected


def test_accuracy_numeric_symbolic_and_not_applicable():
    acc = make_accuracy(mode="last_number")
    completions = ["so 12", "ANSWER: 12.0", "about 1,000", "ANSWER: 1/2", "x", "12"]
    answers = ["12", "12", "1000", "0.5", "3", None]
    assert acc([""] * 6, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, None]
    with pytest.raises(KeyError, match="accuracy needs the dataset column 'answer'; columns are \\['solution'\\]"):
        acc(["q"], ["1"], solution=["1"])
    with pytest.raises(ValueError, match="accuracy mode must be"):
        make_accuracy(mode="first_number")


def test_format_reward():
    fmt = make_format()
    assert fmt([""] * 4, ["ANSWER: 5", "ANSWER: five", "ANSWER: 5\nANSWER: 6", "5"]) == [1.0, 0.0, 0.0, 0.0]
    # The gym's reading (grading.answer_format): a named quantity or "$" still commits; two agreeing lines don't.
    assert fmt([""] * 3, ["ANSWER: x = 5", "ANSWER: $1,250", "ANSWER: 5\nANSWER: 5"]) == [1.0, 1.0, 0.0]


def test_overlong_penalty_matches_dapo():
    # L_max = 10, cache 4: free up to 6 tokens; 8 tokens -> (6 - 8) / 4 = -0.5; 10 -> -1.0; beyond -> -1
    fn = make_overlong(cache_length=4)
    out = fn([""] * 4, [""] * 4, completion_lengths=[5, 8, 10, 11], max_new_tokens=[10] * 4)
    assert out == pytest.approx([0.0, -0.5, -1.0, -1.0])


def test_weighted_total_skips_functions_that_do_not_apply():
    def half(prompts, completions, **c):
        return [0.5, None]

    def one(prompts, completions, **c):
        return [1.0, 1.0]

    totals, per_fn = score([WeightedReward("half", half, 2.0), WeightedReward("one", one, 0.5)], ["a", "b"], ["x", "y"], {})
    assert totals == [2.0 * 0.5 + 0.5 * 1.0, 0.5 * 1.0]
    assert per_fn == {"half": [0.5, None], "one": [1.0, 1.0]}


@pytest.mark.parametrize(
    "values, message",
    [
        ([1.0, math.inf], r"reward function 'f' returned inf for sample 1 \(prompt: 'q1'\); rewards must be finite"),
        ([1.0, "1"], r"reward function 'f' returned '1' \(str\) for sample 1 \(prompt: 'q1'\); rewards must be numbers or None"),
        ([1.0], r"reward function 'f' returned 1 values for 2 completions"),
        (3.0, r"reward function 'f' returned float; it must return a list"),
    ],
)
def test_bad_return_values(values, message):
    with pytest.raises(RewardFunctionError, match=message):
        score([WeightedReward("f", lambda prompts, completions, **k: values)], ["q0", "q1"], ["a", "b"], {})


def test_resolve_user_code_and_unknown_names(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    fn = resolve(f"{path}:length")
    assert fn([""], ["abc"]) == [3.0]
    with pytest.raises(RewardFunctionError, match="unknown reward function 'acuracy'"):
        resolve("acuracy")
    with pytest.raises(RewardFunctionError, match="reward function file not found"):
        resolve(str(tmp_path / "nope.py") + ":f")
    with pytest.raises(RewardFunctionError, match="has no 'missing' \\(from reward function"):
        resolve(f"{path}:missing")
    with pytest.raises(RewardFunctionError, match="cannot import module 'no_such_mod_xyz'"):
        resolve("no_such_mod_xyz:f")


def test_symbolic_answers_are_checked_off_the_main_thread():
    """reward.timeout_s runs reward functions in a thread; math-verify's own timeout (signal.alarm) cannot run
    there, and used to raise on the first answer that was not a plain number (found by a demo run, seed 1)."""
    import threading

    from cohortrl.grading.answers import answers_match

    out = {}

    def check():
        try:
            out["value"] = (answers_match("1/2", "0.5"), answers_match("1/3", "0.5"))
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    thread = threading.Thread(target=check)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    assert out["value"] == (True, False)
    assert answers_match("1/2", "0.5") and not answers_match("1/3", "0.5")  # and on the main thread, as before
