"""The one tolerance-and-units rule every gym family grades numbers with.

A written quantity is correct when its unit has the expected *dimension* and its value, converted to SI,
is within the tolerance of the expected value:

    |written_si - expected_si| <= max(rel_tol * |expected_si|, abs_tol_si)

So ``0.3142 m^2`` answers a question about ``314159 mm^2`` as well as ``314159 mm^2`` does, while a bare
number, a wrong dimension (``kN`` where ``MPa`` is expected) or a unit we cannot read is wrong. Dimensionless
quantities (safety factors, plain numbers) must be written without a unit. ``rel_tol = 0`` means exact,
which the arithmetic family uses: values are `Fraction`s throughout, so exactness is real, not float-ish.

The unit grammar is written by hand because it is tiny: factors ``[prefix]base[exponent]`` joined by
``*``, ``·``, ``-``, a space or nothing, and one ``/`` after which every factor is in the denominator.
Bases: ``m``, ``N``, ``Pa``; prefixes: ``k M G c m``; exponents ``^2``, ``2`` or ``²``. Examples:
``mm^2``, ``N/mm²``, ``kN*m``, ``kNm``, ``kN/m``, ``GPa``, ``mm4``. (A units library such as pint would
do this and far more, but costs an import of several hundred milliseconds in every grading worker.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

# Dimensions as exponents of (mass, length, time); a newton is kg·m·s⁻².
Dim = tuple[int, int, int]
DIMENSIONLESS: Dim = (0, 0, 0)

_BASES: dict[str, Dim] = {"m": (0, 1, 0), "N": (1, 1, -2), "Pa": (1, -1, -2)}
_PREFIXES: dict[str, Fraction] = {
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "c": Fraction(1, 100),
    "m": Fraction(1, 1000),
}
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
# Longest alternatives first so "mm" is milli-metre and "Pa" is not "P" + "a".
_FACTOR = re.compile(r"(?P<prefix>[kMGcm]?)(?P<base>Pa|N|m)(?:\^?(?P<exp>-?\d))?")
_SEPARATORS = " *·.-"


@dataclass(frozen=True)
class Unit:
    """A parsed unit: multiply a value by ``scale`` to get SI; ``dim`` is its dimension."""

    scale: Fraction
    dim: Dim


@lru_cache(maxsize=4096)
def parse_unit(text: str) -> Unit | None:
    """Parse a unit string; ``None`` if it is not one we can read. The empty string is dimensionless."""
    text = text.strip().translate(_SUPERSCRIPTS)
    numerator, slash, denominator = text.partition("/")
    if "/" in denominator or (slash and not denominator.strip()):
        return None  # "N/mm/s" and "N/" are not units we read
    scale, dim = Fraction(1), [0, 0, 0]
    for part, sign in ((numerator, 1), (denominator, -1)):
        pos = 0
        while pos < len(part):
            if part[pos] in _SEPARATORS:
                pos += 1
                continue
            match = _FACTOR.match(part, pos)
            if match is None:
                return None
            # "m" alone is a metre, not a milli-prefix waiting for a base: the regex backtracks to that.
            exp = int(match["exp"] or 1) * sign
            scale *= _PREFIXES[match["prefix"]] ** exp
            for i, d in enumerate(_BASES[match["base"]]):
                dim[i] += d * exp
            pos = match.end()
    return Unit(scale, (dim[0], dim[1], dim[2]))


def to_si(value: Fraction, unit_text: str) -> tuple[Fraction, Dim] | None:
    """``value unit`` in SI with its dimension, or ``None`` if the unit is unreadable."""
    unit = parse_unit(unit_text)
    if unit is None:
        return None
    return value * unit.scale, unit.dim


def within_tolerance(written: Fraction, expected: Fraction, rel_tol: float, abs_tol: Fraction = Fraction(0)) -> bool:
    """The tolerance half of the rule, on numbers already in the same unit."""
    bound = max(Fraction(str(rel_tol)) * abs(expected), abs_tol)
    return abs(written - expected) <= bound


def quantity_matches(
    written_value: Fraction | None,
    written_unit: str,
    expected_value: Fraction,
    expected_unit: str,
    rel_tol: float,
    abs_tol: float = 0.0,
) -> bool:
    """The whole rule: dimension must match, then the SI values must agree within tolerance.

    ``abs_tol`` is in ``expected_unit`` (it exists for quantities that may be zero, e.g. a zero-force member,
    where a relative tolerance would demand an exact 0).
    """
    if written_value is None:
        return False
    written = to_si(written_value, written_unit)
    expected = to_si(expected_value, expected_unit)
    if written is None or expected is None or written[1] != expected[1]:
        return False
    expected_scale = parse_unit(expected_unit).scale  # type: ignore[union-attr]  # parsed just above
    return within_tolerance(written[0], expected[0], rel_tol, Fraction(str(abs_tol)) * expected_scale)
