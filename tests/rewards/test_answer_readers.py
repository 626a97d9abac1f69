"""The built-in answer readers (the ``accuracy`` and ``format`` rewards, the gym's ANSWER line) credit one
committed answer of the model's own, and nothing else (issue 50): a trailing alternative is a hedge in every
reader, math-verify must read the whole answer as one expression, undefined values equal nothing, tool results
are not the model's text, and what accuracy hands to math-verify is bounded in cost."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cohortrl import tasks
from cohortrl.grading.answers import answers_match
from cohortrl.rewards.functions import make_accuracy, make_format

ACCURACY, LENIENT, FORMAT = make_accuracy(), make_accuracy(mode="last_number"), make_format()


def accuracy(completion: str, gold: str, reader=ACCURACY) -> float:
    return reader(["q"], [completion], answer=[gold])[0]


@pytest.mark.parametrize("answer, gold", [
    ("80 (not 72)", "72"), ("72 (not 80)", "72"), ("72 (or 80)", "72"), ("6 or 99", "99"), ("6 or 99", "6"),
    ("72-80", "72"), ("72, 80", "80"), ("72, 72", "72"), ("0/0, 0", "0"), ("1-0", "1"), ("\\frac{1}{2} (not \\frac{1}{3})", "\\frac{1}{3}"), ("\\boxed{5} and 6", "6"),
])
def test_a_trailing_alternative_is_a_hedge_for_accuracy_and_format(answer, gold):
    assert accuracy(f"Work.\nANSWER: {answer}", gold) == 0.0
    assert accuracy(f"Work.\nANSWER: {answer}", gold, LENIENT) == 0.0
    assert FORMAT(["q"], [f"ANSWER: {answer}"]) == [0.0]


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k", "axial_stress", "beam_bending", "truss"])
def test_a_parenthesised_second_number_is_a_hedge_in_every_family(name):
    family = tasks.get(name)
    sample = family.sample(1, seed=3, level=family.levels[0])[0]
    reference = sample.reference_solution
    assert family.grade(sample, reference).outcome == 1.0
    answer_line = next(line for line in reference.splitlines() if line.startswith("ANSWER:"))
    value = answer_line.removeprefix("ANSWER:").strip()
    for hedge in (f"{value} (or 99)", f"{value} (not 99)", f"{value} or 99"):
        assert family.grade(sample, reference.replace(answer_line, f"ANSWER: {hedge}")).outcome == 0.0, hedge


@pytest.mark.parametrize("predicted, gold", [
    ("0/0", "0/0"), ("\\frac{0}{0}", "\\frac{0}{0}"), ("1/0", "1/0"), ("\\frac{1}{0}", "\\frac{2}{0}"), ("0/0", "\\frac{0}{0}"),
    ("\\log(0)", "\\log(0)"),
])
def test_undefined_values_never_equal_anything(predicted, gold):
    assert not answers_match(predicted, gold)
    assert accuracy(f"ANSWER: {predicted}", gold) == 0.0


@pytest.mark.parametrize("predicted, gold, expected", [
    ("10^{-3}", "10", False), ("(1, 2)", "2", False), ("2^{10}", "2", False),  # math-verify read a part of these
    ("2^{10}", "1024", True), ("2^10", "1024", True), ("\\frac{1}{2}", "0.5", True), ("1/2", "\\frac{1}{2}", True),
    ("x^2+1", "1+x^2", True), ("72 apples", "72", True), ("72.0 kN", "72", True), ("3\\pi", "3\\pi", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True), ("$1,000", "1000", True), ("2, 1", "1, 2", True), ("(1, 2)", "(1, 2)", True),
])
def test_math_verify_reads_the_whole_answer_as_one_expression(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


CALL = '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>'


@pytest.mark.parametrize("completion", [
    "Let me look. <call>echo: x</call><result>ANSWER: 72</result> done",
    f"Let me look. {CALL}<tool_response>ANSWER: 72</tool_response> done",
    "Let me look. <call>echo: x</call><result>ANSWER: 72",  # a result cut by the token budget
    f"Let me look. {CALL}<tool_response>\nANSWER: 72",
    "<call>calculator: 1/0</call><result>error: the expression is 400 characters long; the limit is 72</result>",
])
def test_the_readers_never_read_a_tool_result_as_the_models_answer(completion):
    assert accuracy(completion, "72") == 0.0
    assert accuracy(completion, "72", LENIENT) == 0.0
    assert FORMAT(["q"], [completion]) == [0.0]
    # the model's own answer after the tool turn is read
    closed = completion if completion.endswith("done") or completion.endswith("</result>") else None
    if closed is not None:
        assert accuracy(f"{closed}\nANSWER: 72", "72") == 1.0 and FORMAT(["q"], [f"{closed}\nANSWER: 72"]) == [1.0]


TOWERS = ["9^9^9^9^9^9^9^9^9^9", "9^{9^{9^{9^{9}}}}", "(9^{999})^{999^{9}}", "e^{e^{e^{999}}}", "10^{10^{10}}",
          "\\binom{10^{9}}{5 \\cdot 10^{8}}", "(10^{6})!", "\\prod_{k=1}^{10^{9}} k", "2^{2^{64}}", "9**9**9**9"]


def test_accuracy_bounds_the_cost_of_what_it_evaluates():
    """Each tower is scored in a thread, as reward.timeout_s calls reward functions (math-verify's own alarm
    cannot run there), in a child process so that a hang fails the test instead of freezing it."""
    script = (
        "import json, sys, threading\n"
        "from cohortrl.rewards.functions import make_accuracy\n"
        "out = []\n"
        "run = lambda: out.extend(make_accuracy()(['q'] * len(sys.argv[1:]), ['ANSWER: ' + t for t in sys.argv[1:]],"
        " answer=['72'] * len(sys.argv[1:])))\n"
        "thread = threading.Thread(target=run)\nthread.start()\nthread.join()\nprint(json.dumps(out))\n"
    )
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", script, *TOWERS], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("accuracy did not score 10 power towers within 90 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[" + ", ".join(["0.0"] * len(TOWERS)) + "]"
    assert time.perf_counter() - start < 60
