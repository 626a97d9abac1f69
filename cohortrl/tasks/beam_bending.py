"""[beam_bending] Simply supported and cantilever beams under point and distributed loads.

Levels:
  1  one load case (simply supported: point load anywhere or full UDL; cantilever: tip load or full UDL):
     steps R_A (and R_B) in kN, M_max in kN*m; ANSWER M_max
  2  + a rectangular section b x h: I (mm^4) and sigma = M c / I (MPa); VERDICT against an allowable stress
  3  superposition: two point loads, or a point load plus a UDL, on either support; as level 2
  4  deflection: symmetric simply supported (central point load and/or UDL) or cantilever (tip load
     and/or UDL), E given; steps add delta (mm); SAFE iff sigma <= allowable and delta <= span / limit
  5  inverse design: the smallest depth h of a b-wide rectangle so that sigma <= allowable;
     steps M_max, Z (mm^3), h (mm); ANSWER h, checked by plugging it back into sigma = 6 M / (b h^2):
     it must meet the allowable stress and be at most the tolerance deeper than needed

Conventions: x from A; loads act downward; reactions positive upward; M_max is the largest bending
moment magnitude (hogging at a cantilever's fixed end A). Units: kN, m, kN/m (= N/mm), mm, MPa, GPa.
Formulas:
  simply supported: R_A = sum P (L - a) / L + w L / 2,  R_B = sum P a / L + w L / 2; M_max where the shear
    changes sign: at a point load or at x = (R_A - loads left of x) / w
  cantilever fixed at A: R_A = sum P + w L,  M_max = sum P a + w L^2 / 2
  I = b h^3 / 12,  sigma = M_max (h / 2) / I
  delta: P L^3 / (48 E I) + 5 w L^4 / (384 E I) at midspan; P L^3 / (3 E I) + w L^4 / (8 E I) at a tip
  inverse: Z = M_max / sigma_allow,  h = sqrt(6 Z / b)
Reference solutions show how a simply supported beam's M_max is found when it has several candidates: a line
x_0 = shear / w per zero-shear point and M_1, M_2, ... per candidate, then M_max = max(M_1, M_2, ...); and they
write the verdict's comparison as SF = sigma_allow / sigma (the smaller with the deflection's at level 4),
SAFE iff SF >= 1. A response need not write these lines; a solution learned from them chooses from values it
wrote, not in its head (docs/engineering.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from fractions import Fraction

from cohortrl.grading.answer_format import format_instructions, format_sig
from cohortrl.tasks.base import Sample, Step, TaskFamily, clear_of_threshold, register, rng_for, target_utilisation, wants_safe
from cohortrl.grading.units import to_si


@dataclass
class Beam:
    support: str  # "simple" (pin at A, roller at B) or "cantilever" (fixed at A, free at B)
    span: float  # m
    points: list[tuple[float, float]] = field(default_factory=list)  # (P kN, a m from A)
    udl: float = 0.0  # kN/m over the whole span


def reactions(beam: Beam) -> dict[str, tuple[float, str]]:
    """Support reactions (kN) with the arithmetic that gives them."""
    f, span, w = format_sig, beam.span, beam.udl
    if beam.support == "cantilever":
        terms = [f(p) for p, _ in beam.points] + ([f"{f(w)}*{f(span)}"] if w else [])
        return {"R_A": (sum(p for p, _ in beam.points) + w * span, " + ".join(terms))}
    udl_term = [f"{f(w)}*{f(span)}/2"] if w else []
    return {
        "R_A": (sum(p * (span - a) / span for p, a in beam.points) + w * span / 2,
                " + ".join([f"{f(p)}*({f(span)} - {f(a)})/{f(span)}" for p, a in beam.points] + udl_term)),
        "R_B": (sum(p * a / span for p, a in beam.points) + w * span / 2,
                " + ".join([f"{f(p)}*{f(a)}/{f(span)}" for p, a in beam.points] + udl_term)),
    }


def moment_at(beam: Beam, x: float, r_a: float) -> tuple[float, str]:
    """Sagging moment of a simply supported beam at x (kN*m), with its arithmetic."""
    f = format_sig
    value = r_a * x - beam.udl * x * x / 2 - sum(p * (x - a) for p, a in beam.points if a < x)
    terms = [f"{f(r_a)}*{f(x)}"] + ([f"{f(beam.udl)}*{f(x)}^2/2"] if beam.udl else [])
    terms += [f"{f(p)}*({f(x)} - {f(a)})" for p, a in beam.points if a < x]
    return value, " - ".join(terms)


def max_moment(beam: Beam) -> tuple[float, str, list[tuple[str, float, str, str]]]:
    """The largest bending moment magnitude (kN*m), with its arithmetic and the working that picks it: where
    a simply supported beam's maximum has several candidates (each point load, a zero-shear point), one line
    per zero-shear position ``x_0`` and per candidate moment ``M_1, M_2, ...``, so that a reference shows how
    its M_max was found instead of choosing the point in its head (docs/engineering.md: a warm start cannot
    learn a step it never sees)."""
    if beam.support == "cantilever":
        f = format_sig
        terms = [f"{f(p)}*{f(a)}" for p, a in beam.points] + ([f"{f(beam.udl)}*{f(beam.span)}^2/2"] if beam.udl else [])
        return sum(p * a for p, a in beam.points) + beam.udl * beam.span**2 / 2, " + ".join(terms), []
    r_a = reactions(beam)["R_A"][0]
    candidates = [a for _, a in beam.points]
    working = []
    if beam.udl > 0:
        # In each stretch between point loads the shear R_A - w x - (loads passed) falls linearly;
        # where it crosses zero the moment peaks.
        edges = [0.0] + sorted(a for _, a in beam.points) + [beam.span]
        for left, right in zip(edges, edges[1:]):
            passed = sum(p for p, a in beam.points if a <= left)
            x = (r_a - passed) / beam.udl
            if left <= x <= right:
                candidates.append(x)
                shear = f"({format_sig(r_a)} - {format_sig(passed)})" if passed else format_sig(r_a)
                working.append(("x_0", x, "m", f"{shear}/{format_sig(beam.udl)}"))
    moments = [moment_at(beam, x, r_a) for x in candidates]
    best = max(moments, key=lambda m: m[0])
    if len(moments) == 1:
        return best[0], best[1], []
    working += [(f"M_{i + 1}", value, "kN*m", expr) for i, (value, expr) in enumerate(moments)]
    # The choice itself goes to the calculator too: a warm start that wrote the candidates right took a
    # smaller one for M_max about half the time (docs/engineering.md).
    return best[0], f"max({', '.join(format_sig(value) for value, _ in moments)})", working


def max_deflection(beam: Beam, e_gpa: float, inertia: float) -> tuple[float, str]:
    """Largest deflection (mm) for the level-4 cases: symmetric simply supported loads, or cantilever tip
    loads; kN, m, GPa converted to N, mm, N/mm^2 (a kN/m is a N/mm)."""
    e, span = e_gpa * 1000, beam.span * 1000
    p = sum(load for load, _ in beam.points) * 1000
    w = beam.udl
    f = format_sig
    if beam.support == "simple":
        value = p * span**3 / (48 * e * inertia) + 5 * w * span**4 / (384 * e * inertia)
        terms = [f"{f(p)}*{f(span)}^3/(48*{f(e)}*{f(inertia)})"] * (p > 0)
        terms += [f"5*{f(w)}*{f(span)}^4/(384*{f(e)}*{f(inertia)})"] * (w > 0)
    else:
        value = p * span**3 / (3 * e * inertia) + w * span**4 / (8 * e * inertia)
        terms = [f"{f(p)}*{f(span)}^3/(3*{f(e)}*{f(inertia)})"] * (p > 0)
        terms += [f"{f(w)}*{f(span)}^4/(8*{f(e)}*{f(inertia)})"] * (w > 0)
    return value, " + ".join(terms)


# ---------------------------------------------------------------------------------------------------------
# Drawing problems.


def draw_beam(rng: random.Random, level: int) -> Beam:
    support = rng.choice(["simple", "cantilever"])
    span = rng.choice([2.0, 3.0, 4.0, 5.0, 6.0, 8.0]) if support == "simple" else rng.choice([1.5, 2.0, 2.5, 3.0, 4.0])
    point = lambda: float(rng.randint(2, 30) * 2)  # noqa: E731  (kN)
    udl = lambda: float(rng.randint(2, 40) / 2)  # noqa: E731  (kN/m)
    if level == 4:  # the cases with closed-form deflections
        where = span / 2 if support == "simple" else span
        case = rng.choice(["point", "udl", "both"])
        return Beam(support, span, [(point(), where)] if case != "udl" else [], udl() if case != "point" else 0.0)
    # Point loads sit on a 0.5 m grid strictly inside the span (at the tip for a level-1 cantilever).
    positions = [x / 2 for x in range(1, int(span * 2))] + ([span] if support == "cantilever" else [])
    cases = ["point", "udl"] if level <= 2 else ["two points", "point and udl"]
    case = rng.choice(cases + (["point", "udl"] if level == 5 else []))
    if case == "point":
        return Beam(support, span, [(point(), span if support == "cantilever" and level == 1 else rng.choice(positions))])
    if case == "udl":
        return Beam(support, span, [], udl())
    if case == "two points":
        first, second = sorted(rng.sample(positions, 2))
        return Beam(support, span, [(point(), first), (point(), second)])
    return Beam(support, span, [(point(), rng.choice(positions))], udl())


def describe(beam: Beam) -> str:
    if beam.support == "simple":
        text = f"A simply supported beam AB of span {format_sig(beam.span)} m (pin at A, roller at B) carries"
    else:
        text = f"A cantilever AB of length {format_sig(beam.span)} m, fixed at A and free at B, carries"
    loads = [f"a point load of {format_sig(p)} kN at {format_sig(a)} m from A" for p, a in beam.points]
    if beam.udl:
        loads.append(f"a uniformly distributed load of {format_sig(beam.udl)} kN/m over the whole span")
    return f"{text} {' and '.join(loads)}."


def build(rng: random.Random, level: int, safe: bool):
    """(statement, givens, steps, working, checks, verdict, extra) for one problem of the level, or None when
    no depth on the grid puts the verdict clear of its threshold (the caller draws again). ``working``: the
    reference's extra lines before M_max (`max_moment`); ``checks``: its safety-factor line before the verdict;
    neither is required of a response."""
    beam = draw_beam(rng, level)
    steps = [(key, value, "kN", expr) for key, (value, expr) in reactions(beam).items()]
    m, m_expr, working = max_moment(beam)
    steps.append(("M_max", m, "kN*m", m_expr))
    text = describe(beam) + " Reactions are upward; M_max is the largest bending moment magnitude."
    givens = [f"L = {format_sig(beam.span)} m"] + [f"P_{i + 1} = {format_sig(p)} kN" for i, (p, _) in enumerate(beam.points)]
    givens += [f"w = {format_sig(beam.udl)} kN/m"] if beam.udl else []
    if level == 1:
        return text, givens, steps, working, [], None, {}
    allow = rng.choice([120, 150, 165, 200])
    width = 10 * rng.randint(5, 20)
    if level == 5:
        z = m * 1e6 / allow  # N*mm / MPa → mm^3
        h = math.sqrt(6 * z / width)
        steps = steps[-1:] + [("Z", z, "mm^3", f"{format_sig(m * 1e6)}/{allow}"),
                              ("h", h, "mm", f"sqrt(6*{format_sig(z)}/{width})")]
        text += f" The section is a rectangle {width} mm wide; allowable bending stress {allow} MPa. Find the smallest depth h."
        extra = {"moment_Nmm": m * 1e6, "width_mm": width, "sigma_allow_MPa": allow}
        return text, givens + [f"b = {width} mm", f"sigma_allow = {allow} MPa"], steps, working, [], None, extra
    e_gpa, limit = rng.choice([70, 200, 210]), rng.choice([250, 360])
    deflection_times_inertia = max_deflection(beam, e_gpa, 1.0)[0] if level == 4 else 0.0  # delta ~ 1 / I

    def utilisation(depth: float) -> float:
        inertia = width * depth**3 / 12
        stress_ratio = m * 1e6 * (depth / 2) / inertia / allow
        return max(stress_ratio, deflection_times_inertia / inertia / (beam.span * 1000 / limit))

    # Loads stay textbook-sized; the depth (whole centimetres, between half and four times the width)
    # is what puts the verdict where we want it.
    wanted = target_utilisation(rng, safe)
    depths = range(max(20, width // 20 * 10), 4 * width + 10, 10)
    depth = min(depths, key=lambda h: abs(math.log(utilisation(h) / wanted)))
    if not clear_of_threshold(utilisation(depth)) or (utilisation(depth) <= 1) != safe:
        return None
    inertia = width * depth**3 / 12
    sigma = m * 1e6 * (depth / 2) / inertia
    steps += [("I", inertia, "mm^4", f"{width}*{depth}^3/12"),
              # the kN*m -> N*mm factor and c = h/2 written out, not worked in the head: a warm start
              # copied a wrong c when the reference gave only its value (docs/engineering.md)
              ("sigma", sigma, "MPa", f"{format_sig(m)}*10^6*({depth}/2)/{format_sig(inertia)}")]
    text += f" The section is a rectangle b = {width} mm wide and h = {depth} mm deep; allowable bending stress {allow} MPa."
    givens += [f"b = {width} mm", f"h = {depth} mm", f"sigma_allow = {allow} MPa"]
    ratios = [(allow / sigma, f"{allow}/{format_sig(sigma)}")]  # capacity / demand, one per criterion
    if level == 4:
        delta, delta_expr = max_deflection(beam, e_gpa, inertia)
        steps.append(("delta", delta, "mm", delta_expr))
        text += f" E = {e_gpa} GPa; deflection limit span/{limit}."
        givens += [f"E = {e_gpa} GPa"]
        allowed_delta = beam.span * 1000 / limit
        ratios.append((allowed_delta / delta, f"{format_sig(allowed_delta)}/{format_sig(delta)}"))
    # The verdict's comparison written as a safety factor (SAFE iff SF >= 1), as axial_stress's references
    # do: a warm start without this line wrote FAIL for every problem (docs/engineering.md).
    sf_expr = ratios[0][1] if len(ratios) == 1 else f"min({', '.join(expr for _, expr in ratios)})"
    checks = [("SF", min(value for value, _ in ratios), "", sf_expr)]
    return text, givens, steps, working, checks, "SAFE" if safe else "FAIL", {}


@register
@dataclass(frozen=True)
class BeamBending(TaskFamily):
    name = "beam_bending"
    levels = (1, 2, 3, 4, 5)

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        while (built := build(rng, level, wants_safe(seed, index))) is None:
            pass
        text, givens, steps, working, checks, verdict, extra = built
        answer_key, answer_value, answer_unit, _ = steps[-1]
        keys = [(key, unit) for key, _, unit, _ in steps]
        prompt = f"{text}\n{format_instructions(keys, answer_key, verdict=verdict is not None)}"
        at = next(i for i, (key, *_) in enumerate(steps) if key == "M_max")
        lines = [f"{key} = {expr} = {format_sig(value)} {unit}".rstrip()
                 for key, value, unit, expr in steps[:at] + working + steps[at:] + checks]
        answer = f"{format_sig(answer_value)} {answer_unit}"
        reference = "\n".join(lines + [f"ANSWER: {answer}"] + ([f"VERDICT: {verdict}"] if verdict else []))
        required = [Step(key, repr(value), unit) for key, value, unit, _ in steps]
        return Sample(self.name, level, seed, index, prompt, answer, reference, target=required[-1],
                      steps=required, verdict=verdict, givens=givens, extra=extra)

    def answer_ok(self, sample: Sample, value: Fraction | None, unit: str) -> bool:
        if "moment_Nmm" not in sample.extra:
            return super().answer_ok(sample, value, unit)
        # Inverse design: plug the depth back in. It must meet the allowable stress (within the tolerance)
        # and be no more than the tolerance deeper than needed: sigma ~ 1 / h^2, so that is
        # allow / (1 + tol)^2 <= sigma(h) <= allow * (1 + tol).
        depth = to_si(value, unit) if value is not None else None
        if depth is None or depth[1] != (0, 1, 0) or depth[0] <= 0:
            return False
        depth_mm = depth[0] * 1000
        stress = 6 * Fraction(sample.extra["moment_Nmm"]) / (sample.extra["width_mm"] * depth_mm**2)
        allow, slack = Fraction(sample.extra["sigma_allow_MPa"]), 1 + Fraction(str(self.rel_tol))
        return allow / slack**2 <= stress <= allow * slack
