"""Why a gym response failed: one error category per response, for the families graded by ``KEY = ... = value
unit`` steps (axial_stress, beam_bending, truss). Evaluation counts them (``eval/error/<category>``), so a run
that does not improve can say what its model still gets wrong.

The first thing that went wrong decides the category, read in solution order:

* ``format``: no single readable ``ANSWER`` (and ``VERDICT``) line, so nothing was committed;
* ``missing_step``: a required quantity is never stated (the method skips or renames it);
* at the first required step stated with a wrong value:
  ``sign`` (right magnitude, wrong sign), ``unit`` (right digits, off by a power of 1,000: mm for m, N for kN,
  mm^2 for m^2), ``arithmetic`` (the line's own expression does not evaluate to the value written after it),
  else ``formula`` (the expression is computed right but is the wrong expression or has the wrong inputs);
* every step right: ``answer`` (the ANSWER line does not carry the result) or ``verdict`` (SAFE/FAIL wrong).

A response can be wrong in several ways; this names the earliest, which is the one that made the rest wrong.
A right response is ``correct``, or ``unsupported`` when a required step is missing or wrong: the strict
outcome pays for it all the same, so a rising share of these is what gaming an outcome reward looks like.
"""

from __future__ import annotations

from fractions import Fraction

from cohortrl import tasks
from cohortrl.grading.answer_format import commitment, normalize_key, parse_response
from cohortrl.tasks.base import Sample, Step, TaskFamily
from cohortrl.tools import render
from cohortrl.tools.calculator import CalculatorError, evaluate

CATEGORIES = ("correct", "unsupported", "format", "missing_step", "sign", "unit", "arithmetic", "formula", "answer", "verdict")

# Unit slips the gym's units make possible: kN/N, mm/m, MPa/GPa (10^3); mm^2/m^2, MPa/Pa (10^6); mm^4/m^4 ...
_UNIT_SLIPS = [Fraction(10) ** (3 * k) for k in (-4, -3, -2, -1, 1, 2, 3, 4)]


def category_fractions(categories: list[str]) -> dict[str, float]:
    """The share of each failure category (``error/<category>``) among ``categories`` (one per response, none
    None), and ``unsupported_correct``, the share right by the outcome with a required step missing or wrong:
    what evaluation (``eval/`` before each) and training steps log."""
    n = len(categories)
    return {**{f"error/{kind}": categories.count(kind) / n for kind in CATEGORIES[2:]},
            "unsupported_correct": categories.count("unsupported") / n}


def row_category(row: dict, completion: str) -> str | None:
    """The category of ``completion`` (as generated: tool calls are rendered here) to a dataset row, or None when
    the row is not a gym problem of a family graded by keyed steps."""
    sample = row.get("sample")
    if not isinstance(sample, dict) or sample.get("family") not in tasks.names():
        return None
    family = tasks.get(sample["family"])
    if type(family).grade is not TaskFamily.grade:  # graded another way (code, controllers, GSM8K's answer)
        return None
    return categorize(family, family.sample_from_dict(sample), render(completion))


def categorize(family: TaskFamily, sample: Sample, text: str) -> str:
    """The category (one of :data:`CATEGORIES`) of ``text``, a response as graders read it (tool calls rendered
    by ``cohortrl.tools.render``), to ``sample`` of ``family``."""
    grade = family.grade(sample, text)
    if grade.outcome >= 1.0:
        return "correct" if grade.supported else "unsupported"
    parsed = parse_response(text)
    commit = commitment(parsed, needs_verdict=sample.verdict is not None)
    if not commit.committed:
        return "format"
    stated: dict[str, list] = {}
    for line in parsed.steps:
        stated.setdefault(normalize_key(line.key), []).append(line)
    for step in sample.steps:
        lines = stated.get(normalize_key(step.key), [])
        if not lines:
            return "missing_step"
        wrong = [line for line in lines if not step.matches(line.value, line.unit, family.rel_tol)]
        if wrong:
            line = wrong[0]
            return _slip(step, line.value, line.unit, family.rel_tol) or _computed(text[line.span[0]:line.span[1]], line.value)
    answer = commit.answer
    if not family.answer_ok(sample, answer.value, answer.unit):
        return _slip(sample.target, answer.value, answer.unit, family.rel_tol) or "answer"
    return "verdict"


def _slip(step: Step, value: Fraction | None, unit: str, rel_tol: float) -> str | None:
    """``sign`` or ``unit`` when ``value`` is the step's value but for its sign or a power of 1,000."""
    if value is None:
        return None
    if value != 0 and step.matches(-value, unit, rel_tol):
        return "sign"
    if any(step.matches(value * scale, unit, rel_tol) for scale in _UNIT_SLIPS):
        return "unit"
    return None


def _computed(line: str, written: Fraction | None) -> str:
    """``arithmetic`` when the line's last expression (``KEY = EXPR = VALUE``) evaluates to something other
    than the value written after it, else ``formula``."""
    parts = line.split("=")
    if written is None or len(parts) < 3:
        return "formula"
    try:
        exact = evaluate(parts[-2])
    except (CalculatorError, ValueError, ArithmeticError):
        return "formula"  # not an expression the calculator reads: nothing to check the arithmetic against
    # in exact fractions: a written value such as 1e400 does not fit a float (OverflowError, #50)
    tolerance = Fraction(1, 100) * max(abs(written), Fraction(1, 10**12))
    return "arithmetic" if abs(Fraction(exact) - written) > tolerance else "formula"
