"""Every built-in grader returns a grade for any string and never raises (issue 27): each finding of the
issue, reproduced through the public ``grade`` API (the sandbox server's own findings are in
tests/rewards/test_sandbox_robustness.py), and the feedback a grade carries is bounded and printable."""

from __future__ import annotations

import time
import unicodedata

import pytest

from cohortrl import tasks
from cohortrl.rewards import grader_errors
from cohortrl.rewards.functions import make_accuracy, make_format
from cohortrl.tasks.python_function import matches, short_repr

PYTHON = tasks.get("python_function", timeout_s=1.0)
CONTROLLER = tasks.get("controller")
ESCAPE = ("_os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close')"
          ".__init__.__globals__\n")


def py(code: str) -> str:
    return f"```python\n{code}```"


def axial_sample():
    return next(s for s in PYTHON.sample(20, seed=0, level=1) if s.extra["function"] == "axial_stress")


def assert_clean(text: str | None, limit: int = 600) -> None:
    """Feedback safe to print, log and encode: bounded, no control, format or surrogate characters."""
    if text is None:
        return
    assert len(text) <= limit, len(text)
    text.encode("utf-8")  # raises on a lone surrogate
    bad = [c for c in text if c not in "\t\n" and unicodedata.category(c) in ("Cc", "Cf", "Cs")]
    assert not bad, [hex(ord(c)) for c in bad]


def assert_graded(grade, steps: int) -> None:
    assert grade.outcome in (0.0, 1.0) and 0.0 <= grade.score <= 1.0 and len(grade.steps) == steps
    for step in grade.steps:
        assert_clean(step.written)


def deep(frames: int, fn):
    """``fn()`` called ``frames`` Python frames deep, as a grader may be inside a trainer's stack."""
    return fn() if frames == 0 else deep(frames - 1, fn)


# ---------------------------------------------------------------------------------------------------------
# python_function


def test_an_int_subclass_whose_abs_is_zero_and_value_10_pow_400_fails_the_sample():
    # It passed the size guard through __abs__; the client's math.isfinite then raised OverflowError.
    code = "class Big(int):\n    def __abs__(self):\n        return 0\n\ndef axial_stress(f, a):\n    return Big(10**400)\n"
    grade = PYTHON.grade(axial_sample(), py(code))
    assert_graded(grade, PYTHON.tests)
    assert grade.outcome == 0.0 and "integer too large" in grade.steps[0].written


def test_an_integer_beyond_a_float_is_simply_wrong():
    assert matches(10**400, 1.0, 0.01) is False and matches([10**400], [1.0], 0.01) is False
    assert matches(True, 1.0, 0.01) is False and matches(1, 1.0, 0.01) is True


def test_a_forged_result_whose_calls_are_not_objects_fails_the_sample():
    # It made the client call .get on an int (AttributeError).
    code = ESCAPE + "def axial_stress(f, a):\n    _os['write'](3, b'{\"calls\": [1, 2, 3, 4, 5, 6, 7, 8]}')\n    _os['_exit'](0)\n"
    grade = PYTHON.grade(axial_sample(), py(code))
    assert_graded(grade, PYTHON.tests)
    assert grade.outcome == 0.0 and "malformed" in grade.steps[0].written


@pytest.mark.parametrize("frames", [0, 700])
def test_a_forged_value_nested_1000_deep_fails_the_sample_at_any_stack_depth(frames):
    # Its repr in the failure message raised RecursionError, depending on the caller's stack depth.
    value = "'[' * 1000 + ']' * 1000"
    code = ESCAPE + ("def axial_stress(f, a):\n    v = " + value + "\n"
                     "    calls = ','.join(['{\"ok\": true, \"value\": ' + v + '}'] * 8)\n"
                     "    _os['write'](3, ('{\"calls\": [' + calls + ']}').encode())\n    _os['_exit'](0)\n")
    grade = deep(frames, lambda: PYTHON.grade(axial_sample(), py(code)))
    assert_graded(grade, PYTHON.tests)
    assert grade.outcome == 0.0 and "malformed" in grade.steps[0].written


def test_a_value_nested_a_thousand_deep_is_shown_in_a_bounded_repr():
    value: list = []
    inner = value
    for _ in range(3000):
        inner.append([])
        inner = inner[0]
    assert deep(900, lambda: short_repr(value)) == "[[[[...]]]]"
    assert len(short_repr("x" * 10**6)) < 100 and len(short_repr(list(range(10**5)))) < 100


def test_a_huge_exception_message_becomes_bounded_feedback():
    code = "def axial_stress(f, a):\n    raise ValueError('x' * 900000)\n"
    grade = PYTHON.grade(axial_sample(), py(code))
    assert_graded(grade, PYTHON.tests)
    assert grade.steps[0].written.startswith("ValueError: xxx") and grade.steps[0].written.endswith("more characters)")


def test_lone_surrogates_bidi_overrides_and_nuls_in_an_error_are_replaced():
    code = "def axial_stress(f, a):\n    raise ValueError('\\ud800 \\u202e \\x00 \\u200b end')\n"
    grade = PYTHON.grade(axial_sample(), py(code))
    assert_graded(grade, PYTHON.tests)
    assert grade.steps[0].written == "ValueError: \ufffd \ufffd \ufffd \ufffd end (line 2)"


# ---------------------------------------------------------------------------------------------------------
# controller (Structured Text)


def st(program: str) -> str:
    return f"```st\n{program}\n```"


def test_a_time_literal_with_a_lone_point_is_a_parse_failure():
    # T#1s.s reached float('.') (ValueError).
    sample = CONTROLLER.sample(1, seed=0, level=1)[0]
    grade = CONTROLLER.grade(sample, st("VAR t : TON; END_VAR\nt(IN := TRUE, PT := T#1s.s);\npump := 0.5;"))
    assert_graded(grade, 4)
    assert grade.outcome == 0.0 and "'T#1s.s' is not a TIME literal" in grade.steps[0].written


@pytest.mark.parametrize("space, name", [("\u00a0", "NO-BREAK SPACE"), ("\u2003", "EM SPACE"), ("\u3000", "IDEOGRAPHIC SPACE")])
def test_a_unicode_space_in_a_program_is_named(space, name):
    # The error explainer called .group on None (AttributeError); a model pasting a no-break space is enough.
    sample = CONTROLLER.sample(1, seed=0, level=1)[0]
    grade = CONTROLLER.grade(sample, sample.reference_solution.replace("e := ", f"e{space}:= ", 1))
    assert_graded(grade, 4)
    assert grade.outcome == 0.0 and f"({name})" in grade.steps[0].written


def test_lone_surrogates_bidi_and_nul_in_a_program_give_clean_feedback():
    sample = CONTROLLER.sample(1, seed=0, level=1)[0]
    for odd in ("\ud800", "\u202e", "\x00", "\x1b[2J"):
        grade = CONTROLLER.grade(sample, st(f"pump := 0.5;{odd}"))
        assert_graded(grade, 4)
        assert grade.outcome == 0.0


@pytest.mark.parametrize("frames", [0, 600])
def test_deep_nesting_is_judged_the_same_at_any_stack_depth(frames):
    sample = CONTROLLER.sample(1, seed=0, level=1)[0]
    ifs = 30
    deep_ifs = st("IF level < 9.0 THEN\n" * ifs + "pump := 0.5;\n" + "END_IF;\n" * ifs)
    deep_expr = st("pump := " + "ABS(" * 100 + "0.5" + ")" * 100 + ";")
    within = st("IF level < 9.0 THEN\n" * 15 + "pump := " + "ABS(" * 60 + "0.5" + ")" * 60 + ";\n" + "END_IF;\n" * 15)
    for program, reason in ((deep_ifs, "IF statements are nested more than 16 deep"),
                            (deep_expr, "nested more than 64 deep"), (within, None)):
        grade = deep(frames, lambda: CONTROLLER.grade(sample, program))
        assert_graded(grade, 4)
        if reason:
            assert reason in grade.steps[0].written
        else:
            assert grade.steps[0].correct  # it parses, and then runs (and fails on performance)


# ---------------------------------------------------------------------------------------------------------
# The answer format every keyed family and GSM8K read


KEYED = ["arithmetic", "axial_stress", "beam_bending", "truss", "gsm8k"]


@pytest.mark.parametrize("name", KEYED)
def test_odd_characters_in_a_step_line_reach_no_written_text(name):
    family = tasks.get(name)
    sample = family.sample(1, seed=0, level=2)[0]  # level 2: every family has steps
    key = sample.steps[0].key
    odd = "\ud800\u202e\x00\u2066"
    grade = family.grade(sample, f"{key} = 5 kN{odd}\n{key} = 1{odd * 300}\nANSWER: 5{odd}")
    assert_graded(grade, len(sample.steps))
    if name != "gsm8k":  # GSM8K's steps are arithmetic statements, whose written text is a number
        assert "\ufffd" in grade.steps[0].written  # the odd characters were there, and were replaced


@pytest.mark.parametrize("name", KEYED)
@pytest.mark.parametrize("text", [
    "ANSWER: 1e999999999",  # Fraction() would build a billion-digit integer
    "ANSWER: 1e" + "9" * 5000,
    "x = " + "(" * 5000 + "1 + 1" + ")" * 5000 + " = 2",  # the statement evaluator recursed per bracket
    "x = " + "-" * 5000 + "1 + 1 = 2",
    "F = 1" + " " * 50000 + "kN (",  # the trailing-remark regex backtracked quadratically
    "1" * 50000 + "=",  # the statement search backtracked quadratically
    "```" + " " * 50000 + "x",  # the code-fence regex too
])
def test_pathological_answers_are_graded_quickly(name, text):
    family = tasks.get(name)
    sample = family.sample(1, seed=0, level=1)[0]
    start = time.perf_counter()
    grade = family.grade(sample, text)
    assert time.perf_counter() - start < 2.0
    assert_graded(grade, len(sample.steps))
    assert grade.outcome == 0.0


# ---------------------------------------------------------------------------------------------------------
# The built-in reward functions


def test_the_format_reward_reads_an_empty_answer_line():
    # "ANSWER: " captured a lone space, whose first word did not exist (IndexError).
    grader_errors.drain()
    assert make_format()(["q"] * 3, ["ANSWER: ", "ANSWER:\u00a0", "ANSWER: 5"]) == [0.0, 0.0, 1.0]
    assert grader_errors.drain() == []  # read, not a contained failure


def test_the_accuracy_reward_reads_odd_answers():
    grader_errors.drain()
    odd = ["ANSWER: \ud800", "ANSWER: 1e999999", "ANSWER: " + "(" * 500, "ANSWER: \x00"]
    assert make_accuracy()(["q"] * len(odd), odd, answer=["5"] * len(odd)) == [0.0] * len(odd)
    assert grader_errors.drain() == []
