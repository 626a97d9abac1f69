"""The gym's unit-aware comparison probed exactly at its edges (``grading/units.py``, read through
``answer_format.py`` as a response is graded): the tolerance is inclusive and relative to the EXPECTED value
(exactly ±rel_tol passes, a hair beyond fails, on both sides), every SI prefix scales by its own power of ten,
and a wrong dimension fails even when the numbers agree (units of scale 1, dimensionless expected values).

All values are exact fractions, so "a hair" is a millionth of the tolerance and nothing rounds."""

from fractions import Fraction as F

import pytest

from cohortrl.grading.answer_format import parse_response
from cohortrl.tasks.base import Step
from cohortrl.grading.units import parse_unit, quantity_matches

HAIR = F(1, 10**6)  # of the tolerance band


def edges(expected: F, rel_tol: str) -> dict[str, F]:
    """The written values at and around both edges of the band |w − e| <= rel_tol·|e|."""
    band = F(rel_tol) * abs(expected)
    return {
        "upper edge": expected + band, "lower edge": expected - band,
        "inside upper": expected + band * (1 - HAIR), "inside lower": expected - band * (1 - HAIR),
        "outside upper": expected + band * (1 + HAIR), "outside lower": expected - band * (1 + HAIR),
    }


@pytest.mark.parametrize("rel_tol", ["0.01", "0.05", "0.001"])
@pytest.mark.parametrize("expected, unit", [(F("314.16"), "mm^2"), (F("-6.25"), "kN"), (F("1.571"), ""), (F(250), "MPa")])
def test_tolerance_is_inclusive_and_relative_to_the_expected_value(rel_tol, expected, unit):
    for where, written in edges(expected, rel_tol).items():
        want = not where.startswith("outside")
        assert quantity_matches(written, unit, expected, unit, float(rel_tol)) is want, (where, written)


def test_the_band_is_the_expected_values_not_the_written_ones():
    """At 10%: 90 is exactly 10% below 100 (passes, although 10 is 11% of 90); 110.001 is beyond 10% of 100
    (fails, although 10.001 is within 10% of 110.001)."""
    assert quantity_matches(F(90), "m", F(100), "m", 0.1)
    assert not quantity_matches(F("110.001"), "m", F(100), "m", 0.1)
    assert quantity_matches(F(110), "m", F(100), "m", 0.1)
    assert not quantity_matches(F("89.999"), "m", F(100), "m", 0.1)


@pytest.mark.parametrize("rel_tol", ["0.01", "0.001"])
def test_the_edges_hold_after_converting_units(rel_tol):
    """Expected 314.16 mm², written in m² and cm²: the band is still ±rel_tol of 314.16 mm²."""
    expected = F("314.16")
    for where, written_mm2 in edges(expected, rel_tol).items():
        want = not where.startswith("outside")
        assert quantity_matches(written_mm2 / 10**6, "m^2", expected, "mm^2", float(rel_tol)) is want, where
        assert quantity_matches(written_mm2 / 100, "cm²", expected, "mm^2", float(rel_tol)) is want, where


PREFIXES = {"": F(1), "k": F(10**3), "M": F(10**6), "G": F(10**9), "c": F(1, 100), "m": F(1, 1000)}


@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("base", ["m", "N", "Pa"])
def test_every_si_prefix_scales_by_its_power_of_ten(prefix, base):
    scale = PREFIXES[prefix]
    unit = parse_unit(prefix + base)
    assert unit is not None and unit.scale == scale
    assert parse_unit(f"{prefix}{base}^2").scale == scale**2
    # 3 <prefix><base> is exactly 3·scale <base>; with rel_tol 0 a hair off is wrong.
    assert quantity_matches(F(3), prefix + base, 3 * scale, base, 0.0)
    assert quantity_matches(3 * scale, base, F(3), prefix + base, 0.0)
    assert not quantity_matches(F(3) * (1 + HAIR), prefix + base, 3 * scale, base, 0.0)
    # ... and at the edge of a 1% band expressed in the other unit
    assert quantity_matches(F("3.03"), prefix + base, 3 * scale, base, 0.01)
    assert not quantity_matches(F("3.03") + HAIR, prefix + base, 3 * scale, base, 0.01)


def test_prefixes_against_each_other():
    assert quantity_matches(F(1), "cm", F(10), "mm", 0.0)  # centi is 1/100, milli 1/1000
    assert not quantity_matches(F(1), "cm", F(100), "mm", 0.01)  # what a centi of 1/10 would make of it
    assert quantity_matches(F(1), "GPa", F(1000), "MPa", 0.0)
    assert quantity_matches(F(1), "MN", F(1000), "kN", 0.0)
    assert quantity_matches(F(1), "cm^2", F(100), "mm^2", 0.0)
    assert quantity_matches(F(1), "kN*m", F(10**6), "N*mm", 0.0)


# Units of scale 1 and distinct dimensions: the numbers always agree, only the dimension can tell them apart.
UNSCALED = ["", "m", "m^2", "N", "Pa", "N*m", "N/m"]


@pytest.mark.parametrize("written", UNSCALED)
@pytest.mark.parametrize("expected", UNSCALED)
def test_a_wrong_dimension_fails_even_when_the_numbers_agree(written, expected):
    assert parse_unit(written).scale == 1 and parse_unit(expected).scale == 1
    assert quantity_matches(F("2.5"), written, F("2.5"), expected, 0.01) is (written == expected), (written, expected)


def test_the_same_dimension_written_differently_matches():
    assert quantity_matches(F(7), "N/m^2", F(7), "Pa", 0.0)  # dimensions are compared, not strings
    assert quantity_matches(F(7), "N/mm^2", F(7), "MPa", 0.0)


def test_absolute_tolerance_edge_is_inclusive_and_in_the_expected_unit():
    assert quantity_matches(F("0.1"), "kN", F(0), "kN", 0.01, abs_tol=0.1)
    assert quantity_matches(F(100), "N", F(0), "kN", 0.01, abs_tol=0.1)
    assert not quantity_matches(F("100.0001"), "N", F(0), "kN", 0.01, abs_tol=0.1)
    assert not quantity_matches(F("-0.1000001"), "kN", F(0), "kN", 0.01, abs_tol=0.1)


@pytest.mark.parametrize("answer, right", [
    ("ANSWER: 101 kN", True), ("ANSWER: 99 kN", True), ("ANSWER: 0.101 MN", True), ("ANSWER: 101,000 N", True),
    ("ANSWER: 101.0001 kN", False), ("ANSWER: 98.9999 kN", False), ("ANSWER: 101000.1 N", False),
    ("ANSWER: 100", False), ("ANSWER: 100 kPa", False), ("ANSWER: 100 kN*m", False),
])
def test_a_graded_answer_line_at_the_edges(answer, right):
    """Through the response parser, as a family grades its ANSWER line (1% of 100 kN)."""
    (line,) = parse_response(f"F = 2 * 50 = 100 kN\n{answer}").answers
    assert Step("F", "100", "kN").matches(line.value, line.unit, 0.01) is right


@pytest.mark.parametrize("answer, right", [
    ("ANSWER: 1.5", True), ("ANSWER: 1.515", True), ("ANSWER: 1.5151", False),
    ("ANSWER: 1.5 m", False), ("ANSWER: 1.5 N", False), ("ANSWER: 1.5 Pa", False),
])
def test_a_dimensionless_answer_must_be_written_without_a_dimension(answer, right):
    (line,) = parse_response(answer).answers
    assert Step("SF", "1.5").matches(line.value, line.unit, 0.01) is right
