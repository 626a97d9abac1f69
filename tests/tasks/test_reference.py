"""Acceptance (issue 5): for 1,000 samples per family and level, the reference solution earns outcome 1 and
every step, and a final value moved beyond tolerance earns outcome 0. Verdicts are balanced SAFE/FAIL."""

from __future__ import annotations

from fractions import Fraction

import pytest

from cohortrl import tasks
from cohortrl.grading.answer_format import format_sig

from .helpers import FAMILY_LEVELS, perturbed_answer, with_answer, with_verdict

N = 1000


@pytest.mark.parametrize("name,level", FAMILY_LEVELS)
def test_reference_earns_everything_and_a_perturbed_answer_nothing(name, level):
    family = tasks.get(name)
    samples = family.sample(N, seed=0, level=level)
    for sample in samples:
        grade = family.grade(sample, sample.reference_solution)
        assert grade.outcome == 1.0 and grade.committed, (sample.id, sample.reference_solution)
        assert all(step.correct for step in grade.steps), (sample.id, [s for s in grade.steps if not s.correct])
        assert grade.score == 1.0

        off = family.grade(sample, with_answer(sample.reference_solution, perturbed_answer(family, sample)))
        assert off.outcome == 0.0, (sample.id, perturbed_answer(family, sample))

        if sample.verdict is not None:
            flipped = with_verdict(sample.reference_solution, "FAIL" if sample.verdict == "SAFE" else "SAFE")
            assert family.grade(sample, flipped).outcome == 0.0

    if samples[0].verdict is not None:
        assert sum(s.verdict == "SAFE" for s in samples) == N // 2  # balanced, so always-SAFE scores 50%


@pytest.mark.parametrize("name", ["axial_stress", "beam_bending", "truss"])
def test_an_answer_within_tolerance_still_counts(name):
    family = tasks.get(name)
    for level in family.levels:
        for sample in family.sample(50, seed=3, level=level):
            value = Fraction(sample.answer.split()[0]) * Fraction(1 + family.rel_tol / 2).limit_denominator(10**6)
            grade = family.grade(sample, with_answer(sample.reference_solution, format_sig(float(value), 8)))
            assert grade.outcome == 1.0, sample.id
