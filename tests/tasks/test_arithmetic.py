from fractions import Fraction

import pytest

from cohortrl import tasks
from cohortrl.grading.answer_format import evaluate, format_exact
from cohortrl.tasks.arithmetic import LEVELS, acceptable, evaluate_steps, render

F = Fraction


def test_render_keeps_only_needed_brackets():
    assert render(("+", F(3), ("*", F(4), F(5)))) == "3 + 4 * 5"
    assert render(("*", ("+", F(3), F(4)), F(5))) == "(3 + 4) * 5"
    assert render(("-", F(9), ("-", F(4), F(2)))) == "9 - (4 - 2)"  # not 9 - 4 - 2
    assert render(("-", ("-", F(9), F(4)), F(2))) == "9 - 4 - 2"
    assert render(("+", F(-4), F("2.5"))) == "(-4) + 2.5"


def test_steps_follow_evaluation_order():
    # 3 * 4 + 5 * 6: s1 = 3 * 4 = 12, s2 = 5 * 6 = 30, s3 = 12 + 30 = 42
    steps = []
    assert evaluate_steps(("+", ("*", F(3), F(4)), ("*", F(5), F(6))), steps) == 42
    assert steps == [("3 * 4", 12), ("5 * 6", 30), ("12 + 30", 42)]


def test_only_exact_short_divisions_are_drawn():
    knobs = LEVELS[4]
    steps = []
    evaluate_steps(("/", F(7), F(2)), steps)
    assert acceptable(steps, knobs)  # 3.5
    steps = []
    evaluate_steps(("/", F(7), F(3)), steps)
    assert not acceptable(steps, knobs)  # 2.333... has no finite decimal
    for divisor in (F(0), F(1), F(-1)):  # impossible, or no step at all
        with pytest.raises(ValueError):
            evaluate_steps(("/", F(7), divisor), [])


@pytest.mark.parametrize("level", list(LEVELS))
def test_generated_expressions_match_an_independent_evaluator(level):
    # The prompt's expression, parsed by the grader's evaluator, gives the answer the tree gave.
    knobs = LEVELS[level]
    for s in tasks.get("arithmetic").sample(300, seed=1, level=level):
        expression = s.prompt.split("?")[0].removeprefix("What is ") if level == 1 else s.prompt.split("\n")[0][8:-1]
        value, operands = evaluate(expression)
        assert value == F(s.answer)
        assert knobs.n_ops[0] <= len(operands) - 1 <= knobs.n_ops[1]
        assert all(2 <= abs(o) <= knobs.operand_max for o in operands)
        assert ("(" in expression) <= knobs.brackets
        assert all(o > 0 for o in operands) or knobs.negatives


def test_grading_is_exact():
    sample = tasks.get("arithmetic").sample(1, seed=0, level=2)[0]
    family = tasks.get("arithmetic")
    exact = sample.reference_solution.replace(f"ANSWER: {sample.answer}", f"ANSWER: {sample.answer}.00")
    assert family.grade(sample, exact).outcome == 1.0
    near = sample.reference_solution.replace(f"ANSWER: {sample.answer}", f"ANSWER: {format_exact(F(sample.answer) + F(1, 1000))}")
    assert family.grade(sample, near).outcome == 0.0
