"""Shared helpers for the gym tests: which families/levels exist, and ways to alter a reference solution."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from cohortrl import tasks
from cohortrl.grading.answer_format import format_sig


def param(name: str, *rest):
    """A pytest param for a family test, named after its family and arguments."""
    return pytest.param(name, *rest, id="-".join(map(str, (name, *rest))))


# The code families answer with programs, not KEY = value lines: they have their own tests
# (test_controller.py, test_python_function.py); the answer-format tests below skip them.
CODE_FAMILIES = ("controller", "python_function")
FAMILY_LEVELS = [param(name, level) for name in tasks.names() if name not in CODE_FAMILIES
                 for level in tasks.get(name).levels]
FAMILIES = [param(name) for name in tasks.names()]

_LAST_VALUE = re.compile(r"(=\s*|ANSWER:\s*)(-?\$?[\d,]*\.?\d+)(?=[^=]*$)")


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(("ANSWER:", "VERDICT:"))]


def replace_value(line: str, new) -> str:
    """Replace the graded number of a line (after its last '=' or 'ANSWER:'), keeping its unit."""
    return _LAST_VALUE.sub(lambda m: f"{m[1]}{new}", line, count=1)


def value_of(line: str) -> Fraction:
    return Fraction(_LAST_VALUE.search(line)[2].replace(",", "").replace("$", ""))


def corrupt(line: str) -> str:
    """A value far outside any tolerance (and off any exact answer), unit kept."""
    return replace_value(line, format_sig(float(value_of(line) * Fraction(3, 2) + Fraction("7.31")), 6))


def perturbed_answer(family, sample) -> str:
    """The ANSWER value moved beyond tolerance: +1 where grading is exact, else by 5 tolerances."""
    value = Fraction(sample.answer.split()[0])
    if family.rel_tol == 0 or family.name == "gsm8k":
        return format_sig(float(value + 1), 12)
    return format_sig(float(value * Fraction(1 + 5 * family.rel_tol).limit_denominator(10**6)), 6)


def with_answer(text: str, value: str) -> str:
    return "\n".join(replace_value(l, value) if l.startswith("ANSWER:") else l for l in text.splitlines())


def with_verdict(text: str, verdict: str) -> str:
    return "\n".join(f"VERDICT: {verdict}" if l.startswith("VERDICT:") else l for l in text.splitlines())


def without_final_lines(text: str) -> str:
    return "\n".join(step_lines(text))


def partial_response(family, sample) -> str:
    """An honest but imperfect attempt: every other step wrong and the answer off; it still commits."""
    lines = [corrupt(l) if i % 2 else l for i, l in enumerate(step_lines(sample.reference_solution))]
    final = [l for l in sample.reference_solution.splitlines() if l.startswith(("ANSWER:", "VERDICT:"))]
    return with_answer("\n".join(lines + final), perturbed_answer(family, sample))


def grade(name: str, sample, completion: str):
    return tasks.get(name).grade(sample, completion)
