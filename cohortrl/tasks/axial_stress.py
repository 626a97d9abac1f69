"""[axial_stress] Bars under axial load: area, stress, safety factor against yield (and buckling), SAFE/FAIL.

Levels:
  1  solid round bar in tension, load in N, sizes in mm: steps A (mm^2), sigma (MPa), SF; ANSWER SF
  2  + hollow round and rectangular sections, load in kN
  3  + unit conversions: sizes in mm or m, loads in N or kN, strength in MPa, N/mm^2 or GPa
  4  several members: a stepped bar of 2-3 segments with a load at the end of each; per segment
     N_i (kN), A_i (mm^2), sigma_i (MPa); SF against the most stressed segment
  5  Euler buckling of a strut (four end conditions): A, sigma, SF_y, I (mm^4), P_cr (kN), SF_b; SF = min

Formulas (consistent units N, mm, MPa = N/mm^2):
  A = pi d^2 / 4 (solid), pi (D^2 - d^2) / 4 (hollow, d = D - 2t), b h (rectangle)
  sigma = N / A,  SF_y = sigma_y / sigma
  I = pi d^4 / 64, pi (D^4 - d^4) / 64, or b h^3 / 12 about the weak axis (h the smaller side)
  P_cr = pi^2 E I / (K L)^2 with K = 1 pinned-pinned, 2 fixed-free, 0.5 fixed-fixed, 0.7 fixed-pinned
  SF_b = P_cr / N,  SF = min(SF_y, SF_b);  VERDICT SAFE iff SF >= the required safety factor.
Generated loads put SF / SF_required at least 10% from 1, and SAFE/FAIL alternate.
Reference expressions use only the given quantities as the prompt states them: a hollow section's inner
diameter is written (D - 2*t) and each unit conversion in the expression (180 kN as 180*1000, 0.065 m as
(0.065*1000), 0.355 GPa as 0.355*1000), not worked out beforehand, so a solution learned from them leaves no
arithmetic to be done in the head (warm starts on references with either done beforehand never learned the
hole, and wrote 180 kN as 1800000 N: docs/engineering.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cohortrl.grading.answer_format import format_instructions, format_sig
from cohortrl.tasks.base import (
    Sample,
    Step,
    TaskFamily,
    clear_of_threshold,
    register,
    rng_for,
    round_nice,
    target_utilisation,
    wants_safe,
)

MATERIALS = [  # (name, yield strength MPa, Young's modulus GPa)
    ("steel", 250, 200),
    ("steel", 355, 210),
    ("aluminium", 150, 70),
    ("aluminium", 240, 70),
    ("brass", 200, 100),
]
END_CONDITIONS = [  # (description, effective-length factor K)
    ("pinned at both ends", 1.0),
    ("fixed at one end and free at the other", 2.0),
    ("fixed at both ends", 0.5),
    ("fixed at one end and pinned at the other", 0.7),
]


# ---------------------------------------------------------------------------------------------------------
# Sections: dicts of sizes in mm, so they serialise as they are.


def draw_section(rng: random.Random, shapes: tuple[str, ...]) -> dict:
    shape = rng.choice(shapes)
    if shape == "solid":
        return {"shape": "solid", "d": rng.randint(10, 50)}
    if shape == "hollow":
        outer = 5 * rng.randint(6, 24)
        return {"shape": "hollow", "D": outer, "t": rng.randint(2, outer // 5)}
    width = 5 * rng.randint(2, 12)
    return {"shape": "rect", "b": width, "h": 5 * rng.randint(width // 5, 3 * width // 5)}


def area(s: dict) -> float:
    if s["shape"] == "solid":
        return math.pi * s["d"] ** 2 / 4
    if s["shape"] == "hollow":
        return math.pi * (s["D"] ** 2 - (s["D"] - 2 * s["t"]) ** 2) / 4
    return s["b"] * s["h"]


def second_moment(s: dict) -> float:
    """The smallest second moment of area (mm^4): a strut buckles about its weak axis."""
    if s["shape"] == "solid":
        return math.pi * s["d"] ** 4 / 64
    if s["shape"] == "hollow":
        return math.pi * (s["D"] ** 4 - (s["D"] - 2 * s["t"]) ** 4) / 64
    long, short = max(s["b"], s["h"]), min(s["b"], s["h"])
    return long * short**3 / 12


def area_expression(s: dict, written: dict[str, str] | None = None) -> str:
    """The area's arithmetic from the sizes as the prompt states them (``written``: a size given in m is
    ``(0.065*1000)``; by default each size is its number of mm)."""
    w = {name: str(value) for name, value in s.items() if name != "shape"} | (written or {})
    if s["shape"] == "solid":
        return f"pi*{w['d']}^2/4"
    if s["shape"] == "hollow":
        return f"pi*({w['D']}^2 - ({w['D']} - 2*{w['t']})^2)/4"  # d = D - 2t written out (module doc)
    return f"{w['b']}*{w['h']}"


def section_givens(s: dict, suffix: str = "") -> list[str]:
    return [f"{name}{suffix} = {value} mm" for name, value in s.items() if name != "shape"]


def inertia_expression(s: dict) -> str:
    if s["shape"] == "solid":
        return f"pi*{s['d']}^4/64"
    if s["shape"] == "hollow":
        return f"pi*({s['D']}^4 - ({s['D']} - 2*{s['t']})^4)/64"
    return f"{max(s['b'], s['h'])}*{min(s['b'], s['h'])}^3/12"


# Each quantity as the prompt states it and as a reference's arithmetic uses it: the conversion to N, mm and
# MPa is written in the expression (180 kN is 180*1000, 0.065 m is (0.065*1000), 0.355 GPa is 0.355*1000),
# never done beforehand (module doc).


def length_text(mm: float, rng: random.Random, convert: bool) -> tuple[str, str]:
    if convert and rng.random() < 0.5:
        return f"{format_sig(mm / 1000, 6)} m", f"({format_sig(mm / 1000, 6)}*1000)"
    return f"{format_sig(mm, 6)} mm", format_sig(mm, 6)


def describe(s: dict, rng: random.Random, convert: bool) -> tuple[str, dict[str, str]]:
    """The section in words, and each size as the reference's arithmetic writes it."""
    written = {}

    def size(name: str) -> str:
        text, written[name] = length_text(s[name], rng, convert)
        return text

    if s["shape"] == "solid":
        return f"a solid round section of diameter {size('d')}", written
    if s["shape"] == "hollow":
        return f"a hollow round section of outer diameter {size('D')} and wall thickness {size('t')}", written
    return f"a rectangular section {size('b')} x {size('h')}", written


def force_text(kN: float, newtons: bool) -> tuple[str, str]:
    if newtons:
        return f"{format_sig(kN * 1000, 6)} N", format_sig(kN * 1000, 6)
    return f"{format_sig(kN, 6)} kN", f"{format_sig(kN, 6)}*1000"


def strength_text(mpa: float, rng: random.Random, convert: bool) -> tuple[str, str]:
    pick = rng.choice(["MPa", "N/mm^2", "GPa"]) if convert else "MPa"
    if pick == "GPa":
        return f"{format_sig(mpa / 1000, 6)} GPa", f"{format_sig(mpa / 1000, 6)}*1000"
    return f"{mpa} {pick}", str(mpa)


# ---------------------------------------------------------------------------------------------------------
# One solver per problem shape: steps as (key, value, unit, expression) and the utilisation SF_req / SF
# (above 1 fails). `build` draws a problem of a level; `make_sample` scales its load to hit the verdict.


def single_bar(section: dict, load_kN: float, sy: float, sf_req: float, written: dict[str, str] | None = None):
    """``written``: the sizes, ``F`` and ``sigma_y`` as the reference's arithmetic writes them (`describe`;
    by default mm, kN and MPa)."""
    written = {"F": force_text(load_kN, newtons=False)[1], "sigma_y": str(sy)} | (written or {})
    a = area(section)
    sigma = load_kN * 1000 / a
    sf = sy / sigma
    steps = [
        ("A", a, "mm^2", area_expression(section, written)),
        ("sigma", sigma, "MPa", f"{written['F']}/{format_sig(a)}"),
        ("SF", sf, "", f"{written['sigma_y']}/{format_sig(sigma)}"),
    ]
    return steps, sf_req / sf


def stepped_bar(sections: list[dict], loads_kN: list[float], sy: float, sf_req: float):
    steps, sigmas = [], []
    for i, section in enumerate(sections):
        n = sum(loads_kN[i:])  # a segment carries every load applied beyond it
        a = area(section)
        sigma = n * 1000 / a
        sigmas.append(sigma)
        steps += [
            (f"N_{i + 1}", n, "kN", " + ".join(format_sig(p) for p in loads_kN[i:]) if i < len(sections) - 1 else f"P_{i + 1}"),
            (f"A_{i + 1}", a, "mm^2", area_expression(section)),
            (f"sigma_{i + 1}", sigma, "MPa", f"{format_sig(n)}*1000/{format_sig(a)}"),
        ]
    sf = sy / max(sigmas)
    steps.append(("SF", sf, "", f"{sy}/{format_sig(max(sigmas))}"))
    return steps, sf_req / sf


def strut(section: dict, load_kN: float, sy: float, e_gpa: float, length_m: float, k: float, sf_req: float):
    a, i = area(section), second_moment(section)
    sigma = load_kN * 1000 / a
    p_cr = math.pi**2 * (e_gpa * 1000) * i / (k * length_m * 1000) ** 2 / 1000  # N/mm^2 * mm^4 / mm^2 → N → kN
    sf_y, sf_b = sy / sigma, p_cr / load_kN
    steps = [
        ("A", a, "mm^2", area_expression(section)),
        ("sigma", sigma, "MPa", f"{format_sig(load_kN)}*1000/{format_sig(a)}"),
        ("SF_y", sf_y, "", f"{sy}/{format_sig(sigma)}"),
        ("I", i, "mm^4", inertia_expression(section)),
        ("P_cr", p_cr, "kN", f"pi^2*{e_gpa}*1000*{format_sig(i)}/({k}*{format_sig(length_m)}*1000)^2/1000"),
        ("SF_b", sf_b, "", f"{format_sig(p_cr)}/{format_sig(load_kN)}"),
        ("SF", min(sf_y, sf_b), "", f"min({format_sig(sf_y)}, {format_sig(sf_b)})"),
    ]
    return steps, sf_req / min(sf_y, sf_b)


def build(rng: random.Random, level: int, scale: float):
    """The level's problem with its load(s) proportional to ``scale`` (kN): (statement, givens, steps,
    utilisation). Deterministic given the RNG state, so it can be redrawn with another scale."""
    material, sy, e_gpa = rng.choice(MATERIALS)
    sf_req = rng.choice([1.5, 2.0, 2.5])
    need = f"Yield strength {sy} MPa; required safety factor {sf_req}."
    if level <= 3:
        section = draw_section(rng, ("solid",) if level == 1 else ("solid", "hollow", "rect"))
        load = round_nice(scale, 2)
        convert = level == 3
        # The random draws in the order the problems were always drawn: strength, sizes, load unit.
        strength, strength_written = strength_text(sy, rng, convert)
        section_text, written = describe(section, rng, convert)
        force, force_written = force_text(load, newtons=level == 1 or (convert and rng.random() < 0.5))
        text = (
            f"A {material} bar with {section_text} carries an axial tensile load of {force}. "
            f"Yield strength {strength}; required safety factor {sf_req}."
        )
        givens = section_givens(section) + [f"F = {format_sig(load)} kN", f"sigma_y = {sy} MPa", f"SF_req = {sf_req}"]
        written |= {"F": force_written, "sigma_y": strength_written}
        return text, givens, *single_bar(section, load, sy, sf_req, written)
    if level == 4:
        n = rng.randint(2, 3)
        sections = [draw_section(rng, ("solid", "hollow", "rect")) for _ in range(n)]
        loads = [round_nice(scale * rng.uniform(0.3, 1.0), 2) for _ in range(n)]
        parts = "; ".join(f"{i + 1}: {describe(s, rng, False)[0][2:]}" for i, s in enumerate(sections))
        text = (
            f"A stepped {material} bar is fixed at its left end and has {n} segments in a row ({parts}). "
            f"At the right end of each segment an axial load pulls to the right: "
            f"{', '.join(f'{format_sig(p)} kN' for p in loads)} (segments 1 to {n}). {need}"
        )
        givens = [g for i, s in enumerate(sections) for g in section_givens(s, f"_{i + 1}")]
        givens += [f"P_{i + 1} = {format_sig(p)} kN" for i, p in enumerate(loads)] + [f"sigma_y = {sy} MPa"]
        return text, givens, *stepped_bar(sections, loads, sy, sf_req)
    section = draw_section(rng, ("solid", "hollow", "rect"))
    length = rng.choice([1.0, 1.5, 2.0, 2.5, 3.0, 4.0])
    ends, k = rng.choice(END_CONDITIONS)
    load = round_nice(scale, 2)
    text = (
        f"A {material} strut of length {length} m with {describe(section, rng, False)[0]} is {ends} and carries "
        f"an axial compressive load of {format_sig(load)} kN. E = {e_gpa} GPa. {need} "
        f"sigma is the stress magnitude."
    )
    givens = section_givens(section) + [f"L = {length} m", f"F = {format_sig(load)} kN", f"E = {e_gpa} GPa", f"K = {k}"]
    return text, givens, *strut(section, load, sy, e_gpa, length, k, sf_req)


@register
@dataclass(frozen=True)
class AxialStress(TaskFamily):
    name = "axial_stress"
    levels = (1, 2, 3, 4, 5)

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        safe = wants_safe(seed, index)
        while True:
            # Build once at unit load, scale the load so the utilisation hits a target on the wanted side,
            # rebuild from the same RNG state with the rounded load, and keep it if still clear of 1.
            state = rng.getstate()
            *_, u_per_kN = build(rng, level, 1.0)
            wanted = target_utilisation(rng, safe)
            after = rng.getstate()
            rng.setstate(state)
            text, givens, steps, u = build(rng, level, wanted / u_per_kN)
            rng.setstate(after)
            if clear_of_threshold(u) and (u <= 1) == safe:
                break
        verdict = "SAFE" if u <= 1 else "FAIL"
        keys = [(key, unit) for key, _, unit, _ in steps]
        prompt = f"{text}\n{format_instructions(keys, 'SF', verdict=True)}"
        lines = [f"{key} = {expr} = {format_sig(value)}{' ' + unit if unit else ''}" for key, value, unit, expr in steps]
        answer = format_sig(steps[-1][1])
        reference = "\n".join(lines + [f"ANSWER: {answer}", f"VERDICT: {verdict}"])
        required = [Step(key, repr(value), unit) for key, value, unit, _ in steps]
        return Sample(self.name, level, seed, index, prompt, answer, reference, target=required[-1],
                      steps=required, verdict=verdict, givens=givens)
