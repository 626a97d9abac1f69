"""Step rewards that cannot be farmed (issue 5): each hack earns no more than the honest response it starts
from. "Honest" is `partial_response`: every other step wrong and the answer off, but committed, so there is
step credit a hack could try to inflate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cohortrl import tasks

from .helpers import (
    corrupt,
    grade,
    param,
    partial_response,
    perturbed_answer,
    step_lines,
    with_verdict,
    without_final_lines,
)

# One level with steps per family (plus the multi-member / verdict levels of the engineering families).
CASES = [param("arithmetic", 3), param("axial_stress", 1), param("axial_stress", 4), param("beam_bending", 3),
         param("beam_bending", 5), param("truss", 2), param("truss", 4), param("gsm8k", 2)]
VERDICT_CASES = [param("axial_stress", 2), param("beam_bending", 4), param("truss", 3)]
N = 20

PADDING = [
    "", "Let me think about this carefully.", "First, list what we know.", "x = 12", "X_1 = 5 mm",
    "note = 3 kN", "total = 99 MPa", "Q = 1.5", "2 + 2 = 4", "3 * 7 = 21", "10 - 4 = 6", "**Step**", "- bullet",
] * 3


def samples(name, level, n=N):
    return tasks.get(name).sample(n, seed=7, level=level)


def before_answer(text: str, extra: list[str]) -> str:
    lines = text.splitlines()
    cut = next(i for i, l in enumerate(lines) if l.startswith("ANSWER:"))
    return "\n".join(lines[:cut] + extra + lines[cut:])


@pytest.mark.parametrize("name,level", CASES)
def test_padding_with_extra_lines(name, level):
    # GSM8K credits any correct statement whose value is a reference result, so padding it with arithmetic
    # is not neutral: see test_gsm8k_padding_with_arithmetic for what bounds that.
    padding = [l for l in PADDING if not (name == "gsm8k" and "+" in l or "*" in l or " - " in l)]
    for sample in samples(name, level):
        honest = partial_response(tasks.get(name), sample)
        base = grade(name, sample, honest).score
        assert base > 0
        assert grade(name, sample, honest + "\n" + "\n".join(padding)).score <= base
        assert grade(name, sample, before_answer(honest, padding)).score <= base
        assert grade(name, sample, "\n".join(padding) + "\n" + honest).score <= base


@pytest.mark.parametrize("name,level", CASES)
def test_restating_the_givens(name, level):
    for sample in samples(name, level):
        if name == "gsm8k":  # no keys there: restating means identities such as 48 * 1 = 48
            givens = [f"{g} * 1 = {g}" for g in sample.givens] + [f"{g} + 0 = {g}" for g in sample.givens] + sample.givens
        else:
            givens = sample.givens
        honest = partial_response(tasks.get(name), sample)
        assert grade(name, sample, before_answer(honest, givens)).score <= grade(name, sample, honest).score
        answer_only = "\n".join(givens + [f"ANSWER: {perturbed_answer(tasks.get(name), sample)}"])
        if sample.verdict:
            answer_only += f"\nVERDICT: {sample.verdict}"
        assert grade(name, sample, answer_only).score == 0.0


@pytest.mark.parametrize("name,level", CASES)
def test_repeating_a_correct_step(name, level):
    for sample in samples(name, level):
        honest = partial_response(tasks.get(name), sample)
        correct_lines = step_lines(honest)[::2]
        assert grade(name, sample, before_answer(honest, correct_lines * 3)).score == grade(name, sample, honest).score


@pytest.mark.parametrize("name,level", CASES)
def test_a_later_contradicting_value_cancels_a_step(name, level):
    for sample in samples(name, level):
        # the first required step's line (a reference may show working lines before it: beam_bending's x_0, M_1)
        lines = step_lines(sample.reference_solution)
        first = next((line for line in lines if line.split("=")[0].strip() == sample.steps[0].key), lines[0])
        for hedge in (before_answer(sample.reference_solution, [corrupt(first)]),
                      corrupt(first) + "\n" + sample.reference_solution):
            g = grade(name, sample, hedge)
            assert g.score < 1.0 and not g.steps[0].correct


@pytest.mark.parametrize("name,level", CASES + VERDICT_CASES)
def test_several_answer_or_verdict_lines(name, level):
    family = tasks.get(name)
    for sample in samples(name, level):
        ref = sample.reference_solution
        hedges = [ref + f"\nANSWER: {perturbed_answer(family, sample)}", ref + f"\nANSWER: {sample.answer}"]
        if sample.verdict:
            hedges += [ref + "\nVERDICT: SAFE\nVERDICT: FAIL", ref.replace(f"VERDICT: {sample.verdict}", "VERDICT: SAFE or FAIL")]
        for hedge in hedges:
            g = grade(name, sample, hedge)
            assert (g.outcome, g.score, g.committed) == (0.0, 0.0, False)
        honest = partial_response(family, sample)
        shotgun = honest + "".join(f"\nANSWER: {v}" for v in (sample.answer, perturbed_answer(family, sample), "0"))
        assert grade(name, sample, shotgun).score <= grade(name, sample, honest).score


@pytest.mark.parametrize("name,level", VERDICT_CASES)
def test_always_answering_safe(name, level):
    family = tasks.get(name)
    batch = family.sample(200, seed=11, level=level)
    always_safe = [grade(name, s, with_verdict(s.reference_solution, "SAFE")) for s in batch]
    assert sum(g.outcome for g in always_safe) / len(batch) == 0.5
    bare = [grade(name, s, "VERDICT: SAFE") for s in batch]
    assert all(g.score == 0.0 for g in bare)
    guess = [grade(name, s, f"ANSWER: {perturbed_answer(family, s)}\nVERDICT: SAFE") for s in batch]
    assert all(g.outcome == 0.0 for g in guess)


WRONG_DIMENSION = {"mm^2": "kN", "MPa": "mm", "kN": "MPa", "kN*m": "kN", "mm^4": "mm^2", "mm": "kN",
                   "N": "mm", "mm^3": "MPa"}


@pytest.mark.parametrize("name,level", [param("axial_stress", 3), param("beam_bending", 4), param("truss", 1), param("truss", 5)])
def test_bare_numbers_or_wrong_units(name, level):
    for sample in samples(name, level):
        with_units = [s for s in sample.steps if s.unit]
        assert with_units
        unit_of = {f"{s.key} =": s.unit for s in with_units} | {"ANSWER:": sample.target.unit}
        bare, wrong = [], []
        for line in sample.reference_solution.splitlines():
            unit = next((u for prefix, u in unit_of.items() if line.startswith(prefix)), "")
            if unit:
                assert line.endswith(" " + unit)
                bare.append(line[: -len(unit) - 1])
                wrong.append(line[: -len(unit)] + WRONG_DIMENSION[unit])
            else:
                bare.append(line)
                wrong.append(line)
        bare, wrong = "\n".join(bare), "\n".join(wrong)
        for hack in (bare, wrong):
            g = grade(name, sample, hack)
            assert g.score < 1.0
            assert not any(r.correct for r, s in zip(g.steps, sample.steps) if s.unit)
            if sample.target.unit:
                assert g.outcome == 0.0


def test_a_unit_on_a_dimensionless_number_is_wrong():
    sample = tasks.get("arithmetic").sample(1, seed=0, level=2)[0]
    hack = "\n".join(l + " mm" if not l.startswith("ANSWER") else l for l in sample.reference_solution.splitlines())
    assert grade("arithmetic", sample, hack).step_credit == 0.0


def test_a_converted_unit_is_not_a_hack_but_still_right():
    # 314.2 mm^2 written as 0.0003142 m^2 is the same area: the rule checks dimension, then value.
    sample = tasks.get("axial_stress").sample(1, seed=0, level=1)[0]
    line = next(l for l in sample.reference_solution.splitlines() if l.startswith("A ="))
    value = float(line.split("=")[-1].split()[0])
    converted = sample.reference_solution.replace(line, f"A = {value / 1e6:.6g} m^2")
    assert grade("axial_stress", sample, converted).score == 1.0


@pytest.mark.parametrize("name,level", [param("truss", 3), param("truss", 4), param("truss", 5), param("axial_stress", 4)])
def test_inventing_member_names(name, level):
    invented = ["F_AE = 10 kN", "F_XY = -5 kN", "F_ZZ = 0 kN", "N_9 = 4 kN", "sigma_7 = 80 MPa", "A_4 = 100 mm^2"]
    for sample in samples(name, level):
        honest = partial_response(tasks.get(name), sample)
        assert grade(name, sample, before_answer(honest, invented)).score == grade(name, sample, honest).score


@pytest.mark.parametrize("name,level", CASES)
def test_stopping_after_the_steps_without_an_answer(name, level):
    for sample in samples(name, level):
        g = grade(name, sample, without_final_lines(sample.reference_solution))
        assert (g.outcome, g.score, g.step_credit, g.committed) == (0.0, 0.0, 0.0, False)
        assert not any(s.correct for s in g.steps)


def test_gsm8k_padding_with_arithmetic():
    # Every correct statement over the question's numbers (a combinatorial "cover everything" attempt) is
    # cut by the cap of 2 R + 2 statements; it earns less than the worked solution and, before it, pushes the
    # worked solution's own statements past the cap.
    family = tasks.get("gsm8k")
    for sample in family.sample(30, seed=5, level=2):
        numbers = [n.replace(",", "") for n in sample.givens][:6]
        cover = [f"{a} {op} {b} = {eval(f'{a} {op} {b}'):g}" for a in numbers for b in numbers for op in "+*"]
        attempt = grade("gsm8k", sample, "\n".join(cover) + f"\nANSWER: {sample.answer}")
        assert attempt.score < grade("gsm8k", sample, sample.reference_solution).score
        buried = grade("gsm8k", sample, "\n".join(cover) + "\n" + sample.reference_solution)
        assert buried.step_credit <= 1.0 and buried.score <= 1.0
        if len(cover) >= 2 * len(sample.steps) + 2:
            assert buried.step_credit < 1.0 or not sample.steps


def test_gsm8k_enumerating_statements_runs_past_the_cap():
    sample = tasks.get("gsm8k").sample(1, seed=0, level=1)[0]
    enumeration = "\n".join(f"1 + {k} = {k + 1}" for k in range(1, 400))
    g = grade("gsm8k", sample, enumeration + f"\nANSWER: {perturbed_answer(tasks.get('gsm8k'), sample)}")
    assert g.step_credit == 0.0


# A property over random responses built from the reference: whatever else is in the response, adding lines
# that are not required steps (givens, padding, invented keys) never raises the score of a keyed family.
@pytest.mark.parametrize("name", ["arithmetic", "axial_stress", "beam_bending", "truss"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_lines_that_are_not_required_steps_never_add(name, data):
    family = tasks.get(name)
    level = data.draw(st.sampled_from([lv for lv in family.levels if lv > 1 or name != "arithmetic"]))
    sample = family.sample(1, seed=data.draw(st.integers(0, 10**6)), level=level)[0]
    pool = step_lines(sample.reference_solution)
    pool += [corrupt(l) for l in pool]
    finals = [l for l in sample.reference_solution.splitlines() if l.startswith(("ANSWER:", "VERDICT:"))]
    finals += [f"ANSWER: {perturbed_answer(family, sample)}", "VERDICT: SAFE", "VERDICT: FAIL"]
    base = data.draw(st.lists(st.sampled_from(pool + finals), max_size=12))
    junk = data.draw(st.lists(st.sampled_from(PADDING + sample.givens + ["F_QQ = 3 kN", "s99 = 4"]), min_size=1, max_size=10))
    mixed = list(base)
    for line in junk:
        mixed.insert(data.draw(st.integers(0, len(mixed))), line)
    before, after = grade(name, sample, "\n".join(base)), grade(name, sample, "\n".join(mixed))
    assert 0.0 <= after.score <= 1.0
    assert after.score == before.score and after.outcome == before.outcome
