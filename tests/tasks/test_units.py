from fractions import Fraction

import pytest

from cohortrl.grading.units import parse_unit, quantity_matches, within_tolerance

F = Fraction


@pytest.mark.parametrize("text,scale,dim", [
    ("", 1, (0, 0, 0)),
    ("m", 1, (0, 1, 0)),
    ("mm", F(1, 1000), (0, 1, 0)),
    ("mm^2", F(1, 10**6), (0, 2, 0)),
    ("mm2", F(1, 10**6), (0, 2, 0)),
    ("mm²", F(1, 10**6), (0, 2, 0)),
    ("mm^4", F(1, 10**12), (0, 4, 0)),
    ("N", 1, (1, 1, -2)),
    ("kN", 1000, (1, 1, -2)),
    ("MPa", 10**6, (1, -1, -2)),
    ("N/mm^2", 10**6, (1, -1, -2)),  # the same as MPa
    ("GPa", 10**9, (1, -1, -2)),
    ("kN*m", 1000, (1, 2, -2)),
    ("kN·m", 1000, (1, 2, -2)),
    ("kNm", 1000, (1, 2, -2)),
    ("kN-m", 1000, (1, 2, -2)),
    ("kN/m", 1000, (1, 0, -2)),  # = N/mm
    ("N/mm", 1000, (1, 0, -2)),
])
def test_parse_unit(text, scale, dim):
    unit = parse_unit(text)
    assert unit is not None and unit.scale == scale and unit.dim == dim


@pytest.mark.parametrize("text", ["apples", "kN/", "N/mm/s", "MPa!", "m^", "kg"])
def test_unreadable_units(text):
    assert parse_unit(text) is None


def test_quantity_rule():
    # 314.16 mm^2 expected; 1% tolerance is 3.14 mm^2.
    assert quantity_matches(F("314.2"), "mm^2", F("314.16"), "mm^2", 0.01)
    assert quantity_matches(F("0.0003142"), "m^2", F("314.16"), "mm^2", 0.01)  # converted: same area
    assert quantity_matches(F("317"), "mm^2", F("314.16"), "mm^2", 0.01)  # 0.9% off
    assert not quantity_matches(F("318"), "mm^2", F("314.16"), "mm^2", 0.01)  # 1.2% off
    assert not quantity_matches(F("314.2"), "", F("314.16"), "mm^2", 0.01)  # bare number
    assert not quantity_matches(F("314.2"), "kN", F("314.16"), "mm^2", 0.01)  # wrong dimension
    assert not quantity_matches(F("2.5"), "MPa", F("2.5"), "", 0.01)  # a unit on a dimensionless number
    assert not quantity_matches(None, "mm^2", F("314.16"), "mm^2", 0.01)


def test_exact_and_absolute_tolerance():
    assert within_tolerance(F("3.5"), F("3.50"), 0.0)
    assert not within_tolerance(F("3.499"), F("3.5"), 0.0)
    # A zero-force member: relative tolerance alone would demand exactly 0; abs_tol 0.1 kN allows dust.
    assert not quantity_matches(F("0.05"), "kN", F(0), "kN", 0.01)
    assert quantity_matches(F("0.05"), "kN", F(0), "kN", 0.01, abs_tol=0.1)
    assert quantity_matches(F("50"), "N", F(0), "kN", 0.01, abs_tol=0.1)  # abs_tol is in the step's unit
