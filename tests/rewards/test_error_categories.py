"""Each error category, on hand-edited copies of a real axial_stress level 3 reference solution (t = 0.002 m):
    A = pi*(30^2 - (30 - 2*(0.002*1000))^2)/4 = 175.9 mm^2 / sigma = 21000/175.9 = 119.4 MPa / SF = 240/119.4 = 2.011 / SAFE."""
import pytest

from cohortrl import tasks
from cohortrl.rewards.error_categories import CATEGORIES, categorize

FAMILY = tasks.get("axial_stress")
SAMPLE = FAMILY.sample(1, 0, 3)[0]
REF = SAMPLE.reference_solution


def failed(text: str) -> str:
    """``text`` with a wrong ANSWER: strict outcome grades only the committed answer and verdict, so a wrong step
    with the right answer is still correct, and only a failed response has an error category."""
    return text.replace("ANSWER: 2.011", "ANSWER: 1.8")


def test_the_sample_is_the_one_the_edits_were_written_for():
    assert REF.splitlines()[:3] == ["A = pi*(30^2 - (30 - 2*(0.002*1000))^2)/4 = 175.9 mm^2", "sigma = 21000/175.9 = 119.4 MPa", "SF = 240/119.4 = 2.011"]


@pytest.mark.parametrize("edit, category", [
    (lambda t: t, "correct"),
    (lambda t: t.replace("ANSWER: 2.011\n", ""), "format"),
    (lambda t: t.replace("ANSWER: 2.011", "ANSWER: 2.011\nANSWER: 3"), "format"),  # two answers commit to none
    (lambda t: failed(t).replace("A = pi*(30^2 - (30 - 2*(0.002*1000))^2)/4 = 175.9 mm^2\n", ""), "missing_step"),
    (lambda t: failed(t).replace("sigma = 21000/175.9 = 119.4 MPa", "sigma = -21000/175.9 = -119.4 MPa"), "sign"),
    (lambda t: failed(t).replace("= 175.9 mm^2", "= 0.0001759 mm^2"), "unit"),  # the m^2 value written in mm^2
    (lambda t: failed(t).replace("sigma = 21000/175.9 = 119.4 MPa", "sigma = 21000/175.9 = 112.4 MPa"), "arithmetic"),
    (lambda t: failed(t).replace("A = pi*(30^2 - (30 - 2*(0.002*1000))^2)/4 = 175.9", "A = pi*30^2/4 = 706.9"), "formula"),  # solid, not hollow
    (failed, "answer"),
    (lambda t: t.replace("VERDICT: SAFE", "VERDICT: FAIL"), "verdict"),
])
def test_categorize_names_the_first_error(edit, category):
    text = edit(REF)
    assert text != REF or category == "correct"
    assert categorize(FAMILY, SAMPLE, text) == category
    assert category in CATEGORIES


def test_a_wrong_value_without_an_expression_is_a_formula_error_not_arithmetic():
    assert categorize(FAMILY, SAMPLE, failed(REF).replace("A = pi*(30^2 - (30 - 2*(0.002*1000))^2)/4 = 175.9", "A = 150")) == "formula"


def test_a_rendered_calculator_call_is_read_like_a_written_line():
    from cohortrl.tools import render, with_calculator

    assert categorize(FAMILY, SAMPLE, render(with_calculator(REF))) == "correct"
    assert categorize(FAMILY, SAMPLE, render(with_calculator(failed(REF).replace("(30^2 - (30 - 2*(0.002*1000))^2)", "30^2")))) == "formula"


def test_a_wrong_step_with_the_right_answer_is_unsupported_not_an_error():
    assert categorize(FAMILY, SAMPLE, REF.replace("= 119.4 MPa", "= 12 MPa")) == "unsupported"
    assert categorize(FAMILY, SAMPLE, "ANSWER: 2.011\nVERDICT: SAFE") == "unsupported"  # no method at all


def test_row_category_reads_gym_rows_of_keyed_families_only():
    from cohortrl.rewards.error_categories import row_category

    assert row_category({"prompt": "p", "sample": SAMPLE.to_dict()}, failed(REF)) == "answer"
    assert row_category({"prompt": "p", "answer": "3"}, "ANSWER: 3") is None
    code = tasks.get("python_function").sample(1, 0, 1)[0]
    assert row_category({"prompt": "p", "sample": code.to_dict()}, "ANSWER: 3") is None


def test_training_steps_log_the_sampled_responses_categories():
    """`trainers.metrics.error_categories`: the fractions a step's row carries, over gym rows only, with a grader
    that raises counted nowhere (reported as a grader error, never fatal)."""
    from types import SimpleNamespace

    from cohortrl.distributed import Dist
    from cohortrl.rewards import grader_errors
    from cohortrl.trainers.metrics import error_categories

    gym = {"prompt": SAMPLE.prompt, "sample": SAMPLE.to_dict()}
    hack = REF.replace("SF = 240/119.4 = 2.011", "SF = 240/119.4 = 2.5")  # right ANSWER, a wrong required step
    rollout = SimpleNamespace(rows=[gym, gym, gym, gym, {"prompt": "2+2?", "answer": "4"}],
                              completions=[REF, hack, "no idea", failed(REF).replace("-119.4", "119.4"), "4"])
    got = error_categories(Dist(), rollout)
    assert got["unsupported_correct"] == 0.25 and got["error/format"] == 0.25  # of the 4 gym rows; "correct" is 1
    assert sum(got[f"error/{k}"] for k in CATEGORIES[2:]) == 0.5
    assert error_categories(Dist(), SimpleNamespace(rows=[{"prompt": "2+2?"}], completions=["4"])) == {}

    grader_errors.drain()
    broken = SimpleNamespace(rows=[gym, {"prompt": "p", "sample": {**SAMPLE.to_dict(), "target": "not a number"}}],
                             completions=[REF, REF])
    got = error_categories(Dist(), broken)  # one row graded (correct), the broken one counted nowhere
    assert got == {"unsupported_correct": 0.0, **{f"error/{k}": 0.0 for k in CATEGORIES[2:]}}
    (record,) = grader_errors.drain()
    assert record["reward"] == "error_categories" and record["prompt"] == "p"


@pytest.mark.parametrize("value", ["1e400", "-1e400", "9" * 400])
def test_an_overflowing_written_value_is_categorised_not_raised(value):
    """Issue 50: the arithmetic check compared in floats, and a value past float range raised OverflowError."""
    text = failed(REF).replace("sigma = 21000/175.9 = 119.4 MPa", f"sigma = 21000/175.9 = {value} MPa")
    assert categorize(FAMILY, SAMPLE, text) == "arithmetic"
