"""[python_function] Write a small Python function for an engineering computation; hidden test cases grade it.

Levels:
  1  one formula: axial stress, circle area, hydrostatic pressure, kinetic energy
  2  two steps or a decision: safety factor of a round bar, SAFE/FAIL verdict (hidden cases alternate
     SAFE and FAIL), flow velocity in a pipe, hollow-section area (ValueError for an impossible wall)
  3  unit conversion chains between named units (pressure, length, flow), ValueError for unknown units
  4  beam reactions and moments: simply supported with a point load (ValueError off the span),
     simply supported with a distributed load, cantilever with both; tuples of results
  5  multi-step checks: bending check of a rectangular beam (verdict and stress), Euler buckling load,
     springs in series (stiffness and extension)

The prompt gives the signature, what it returns in which units, and two worked examples; the grade comes
from ``tests`` further cases, hidden, drawn from the same ranges. Each hidden test is one step (passes:
the returned value equals the reference within ``rel_tol``, strings and verdicts exactly, or it raises the
same exception type); outcome = 1 only when every test passes.

The model's code runs only in the sandbox (`cohortrl.grading.sandbox`): a separate, limited process with
no network and no files, killed at ``timeout_s``. A sandbox failure (timeout, memory, forbidden system
call, no such function, syntax error) fails every test, with the sandbox's reason as the first step's
``written``. The reference implementations below compute the expected values here, in-process: they are
our code, not the model's.
"""

from __future__ import annotations

import functools
import inspect
import math
import random
import reprlib
from dataclasses import dataclass
from typing import Any, Callable

from cohortrl.grading import sandbox
from cohortrl.tasks.base import Grade, Sample, Step, StepResult, TaskFamily, make_grade, register, rng_for
from cohortrl.tasks.code_blocks import extract_code


# ---------------------------------------------------------------------------------------------------------
# Reference implementations: each is shown verbatim as the reference solution, so each imports what it uses.


def axial_stress(force_kN, area_mm2):
    return force_kN * 1000.0 / area_mm2


def circle_area(diameter_mm):
    import math

    return math.pi * diameter_mm**2 / 4.0


def hydrostatic_pressure(depth_m, density_kg_m3):
    return density_kg_m3 * 9.81 * depth_m / 1000.0


def kinetic_energy(mass_kg, speed_km_h):
    speed = speed_km_h / 3.6
    return 0.5 * mass_kg * speed**2 / 1000.0


def bar_safety_factor(force_kN, diameter_mm, yield_MPa):
    import math

    stress = force_kN * 1000.0 / (math.pi * diameter_mm**2 / 4.0)
    return yield_MPa / stress


def bar_verdict(force_kN, diameter_mm, yield_MPa, required_sf):
    import math

    stress = force_kN * 1000.0 / (math.pi * diameter_mm**2 / 4.0)
    return "SAFE" if yield_MPa / stress >= required_sf else "FAIL"


def pipe_velocity(flow_L_min, diameter_mm):
    import math

    flow = flow_L_min / 1000.0 / 60.0
    area = math.pi * (diameter_mm / 1000.0) ** 2 / 4.0
    return flow / area


def hollow_area(outer_mm, wall_mm):
    import math

    if wall_mm <= 0 or 2 * wall_mm >= outer_mm:
        raise ValueError("the wall must be positive and thinner than half the outer diameter")
    inner = outer_mm - 2 * wall_mm
    return math.pi * (outer_mm**2 - inner**2) / 4.0


def convert_pressure(value, from_unit, to_unit):
    pascals = {"Pa": 1.0, "kPa": 1e3, "MPa": 1e6, "bar": 1e5, "psi": 6894.757293168}
    if from_unit not in pascals or to_unit not in pascals:
        raise ValueError("unknown unit")
    return value * pascals[from_unit] / pascals[to_unit]


def convert_length(value, from_unit, to_unit):
    metres = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048}
    if from_unit not in metres or to_unit not in metres:
        raise ValueError("unknown unit")
    return value * metres[from_unit] / metres[to_unit]


def convert_flow(value, from_unit, to_unit):
    cubic_metres_per_second = {"m3/s": 1.0, "L/s": 1e-3, "L/min": 1e-3 / 60, "m3/h": 1 / 3600.0,
                               "gpm": 3.785411784e-3 / 60}
    if from_unit not in cubic_metres_per_second or to_unit not in cubic_metres_per_second:
        raise ValueError("unknown unit")
    return value * cubic_metres_per_second[from_unit] / cubic_metres_per_second[to_unit]


def point_load_reactions(span_m, load_kN, position_m):
    if not 0 <= position_m <= span_m:
        raise ValueError("the load must be on the span")
    right = load_kN * position_m / span_m
    return (load_kN - right, right)


def udl_beam(span_m, load_kN_m):
    reaction = load_kN_m * span_m / 2.0
    return (reaction, load_kN_m * span_m**2 / 8.0)


def cantilever_moment(length_m, load_kN_m, tip_load_kN):
    return load_kN_m * length_m**2 / 2.0 + tip_load_kN * length_m


def beam_bending_check(span_m, load_kN, width_mm, depth_mm, allowable_MPa):
    moment = load_kN * span_m / 4.0 * 1e6
    stress = 6.0 * moment / (width_mm * depth_mm**2)
    return ("SAFE" if stress <= allowable_MPa else "FAIL", stress)


def euler_buckling_load(modulus_GPa, diameter_mm, length_m, k_factor):
    import math

    inertia = math.pi * diameter_mm**4 / 64.0
    effective = k_factor * length_m * 1000.0
    return math.pi**2 * modulus_GPa * 1000.0 * inertia / effective**2 / 1000.0


def springs_in_series(stiffnesses_N_mm, force_N):
    if not stiffnesses_N_mm or min(stiffnesses_N_mm) <= 0:
        raise ValueError("stiffnesses must be positive")
    total = 1.0 / sum(1.0 / k for k in stiffnesses_N_mm)
    return (total, force_N / total)


# ---------------------------------------------------------------------------------------------------------
# The problems: signature and wording for the prompt, the reference, and how to draw arguments.


@dataclass(frozen=True)
class Problem:
    reference: Callable[..., Any]
    returns: str  # what the function returns, in words with units
    draw: Callable[[random.Random], tuple]  # one argument tuple
    errors: tuple[tuple, ...] = ()  # argument tuples that must raise; one goes into the hidden tests
    # For SAFE/FAIL problems, demand / capacity of a case (above 1 fails): hidden cases alternate SAFE and
    # FAIL and keep 5% from the threshold, so always answering SAFE passes half and rounding flips none.
    utilisation: Callable[..., float] | None = None

    @property
    def name(self) -> str:
        return self.reference.__name__

    def signature(self) -> str:
        return f"{self.name}{_signature(self.reference)}"


@functools.cache  # read once per function: parsing the source was a third of drawing a sample
def _source(reference: Callable) -> str:
    return inspect.getsource(reference)


@functools.cache
def _signature(reference: Callable) -> str:
    return str(inspect.signature(reference))


def u(rng: random.Random, lo: float, hi: float, digits: int = 1) -> float:
    return round(rng.uniform(lo, hi), digits)


PROBLEMS = {
    1: [
        Problem(axial_stress, "the axial stress in MPa of a bar carrying force_kN kilonewtons over area_mm2 mm^2",
                lambda r: (u(r, 1, 500), u(r, 20, 5000))),
        Problem(circle_area, "the area in mm^2 of a solid circular section of diameter diameter_mm millimetres",
                lambda r: (u(r, 2, 300),)),
        Problem(hydrostatic_pressure, "the gauge pressure in kPa at depth_m metres below the surface of a liquid "
                "of density density_kg_m3 (g = 9.81 m/s^2)", lambda r: (u(r, 0.5, 80), float(r.choice([800, 1000, 1025, 1260, 13600])))),
        Problem(kinetic_energy, "the kinetic energy in kJ of a mass of mass_kg kilograms moving at speed_km_h km/h",
                lambda r: (u(r, 1, 5000), u(r, 5, 250))),
    ],
    2: [
        Problem(bar_safety_factor, "the safety factor against yield (yield strength / axial stress) of a solid "
                "round bar of diameter diameter_mm mm carrying force_kN kN", lambda r: (u(r, 5, 300), u(r, 10, 60), float(r.choice([235, 250, 275, 355])))),
        Problem(bar_verdict, "'SAFE' if the safety factor against yield of a solid round bar (diameter_mm mm, "
                "force_kN kN) is at least required_sf, else 'FAIL'",
                lambda r: (u(r, 5, 300), u(r, 10, 60), float(r.choice([235, 250, 275, 355])), r.choice([1.5, 2.0, 2.5])),
                utilisation=lambda f, d, y, sf: sf / bar_safety_factor(f, d, y)),
        Problem(pipe_velocity, "the mean velocity in m/s of a flow of flow_L_min litres per minute in a pipe of "
                "inner diameter diameter_mm mm", lambda r: (u(r, 5, 3000), u(r, 10, 200))),
        Problem(hollow_area, "the area in mm^2 of a hollow circular section (outer diameter outer_mm, wall "
                "thickness wall_mm, both mm); raise ValueError unless 0 < wall_mm < outer_mm / 2",
                lambda r: (u(r, 20, 300), u(r, 1, 9)), errors=((50.0, 25.0), (40.0, 0.0), (30.0, 20.0))),
    ],
    3: [
        Problem(convert_pressure, "value converted from from_unit to to_unit; units 'Pa', 'kPa', 'MPa', 'bar', "
                "'psi' (1 psi = 6894.757 Pa); raise ValueError for any other unit",
                lambda r: (u(r, 0.1, 1000, 3), *r.sample(["Pa", "kPa", "MPa", "bar", "psi"], 2)),
                errors=((1.0, "atm", "Pa"), (2.0, "bar", "mmHg"))),
        Problem(convert_length, "value converted from from_unit to to_unit; units 'mm', 'cm', 'm', 'km', 'in', "
                "'ft' (1 in = 25.4 mm, 1 ft = 12 in); raise ValueError for any other unit",
                lambda r: (u(r, 0.1, 1000, 3), *r.sample(["mm", "cm", "m", "km", "in", "ft"], 2)),
                errors=((1.0, "yd", "m"), (3.0, "m", "mile"))),
        Problem(convert_flow, "value converted from from_unit to to_unit; units 'm3/s', 'L/s', 'L/min', 'm3/h', "
                "'gpm' (US gallons per minute, 1 US gal = 3.785411784 L); raise ValueError for any other unit",
                lambda r: (u(r, 0.1, 1000, 3), *r.sample(["m3/s", "L/s", "L/min", "m3/h", "gpm"], 2)),
                errors=((1.0, "cfm", "L/s"),)),
    ],
    4: [
        Problem(point_load_reactions, "the support reactions (left, right) in kN of a simply supported beam of "
                "span span_m m with a point load load_kN kN at position_m m from the left support; raise "
                "ValueError if the load is off the span",
                lambda r: (lambda L: (L, u(r, 1, 200), u(r, 0, L)))(u(r, 1, 12)), errors=((5.0, 10.0, 6.0), (4.0, 3.0, -1.0))),
        Problem(udl_beam, "(reaction, maximum moment) in kN and kN*m of a simply supported beam of span span_m m "
                "carrying a uniform load of load_kN_m kN/m; the two reactions are equal", lambda r: (u(r, 1, 15), u(r, 0.5, 60))),
        Problem(cantilever_moment, "the moment in kN*m at the fixed end of a cantilever of length length_m m "
                "carrying a uniform load load_kN_m kN/m and a tip load tip_load_kN kN", lambda r: (u(r, 0.5, 6), u(r, 0, 30), u(r, 0, 80))),
    ],
    5: [
        Problem(beam_bending_check, "(verdict, stress): the maximum bending stress in MPa of a simply supported "
                "rectangular beam (span span_m m, central point load load_kN kN, width width_mm mm, depth "
                "depth_mm mm; M = P L / 4, stress = 6 M / (b h^2)) and 'SAFE' if it is at most allowable_MPa, "
                "else 'FAIL'", lambda r: (u(r, 1, 8), u(r, 1, 80), float(r.randint(5, 30) * 10), float(r.randint(10, 60) * 10), float(r.choice([10, 12, 165, 235]))),
                utilisation=lambda *a: beam_bending_check(*a)[1] / a[4]),
        Problem(euler_buckling_load, "the Euler buckling load in kN of a solid round strut (Young's modulus "
                "modulus_GPa GPa, diameter diameter_mm mm, length length_m m, effective-length factor "
                "k_factor): P = pi^2 E I / (K L)^2 with I = pi d^4 / 64",
                lambda r: (float(r.choice([70, 100, 200, 210])), u(r, 10, 80), u(r, 0.5, 5, 2), r.choice([0.5, 0.7, 1.0, 2.0]))),
        Problem(springs_in_series, "(stiffness in N/mm, extension in mm) of springs with the stiffnesses in the "
                "list stiffnesses_N_mm (N/mm) joined in series and pulled by force_N N; raise ValueError if the "
                "list is empty or a stiffness is not positive",
                lambda r: ([u(r, 1, 500) for _ in range(r.randint(1, 5))], u(r, 1, 5000)), errors=(([], 10.0), ([5.0, 0.0], 3.0))),
    ],
}


def expected_of(problem: Problem, args: tuple) -> Any:
    """The reference's answer as JSON data; a raised exception becomes {"raises": "ValueError"}."""
    try:
        value = problem.reference(*args)
    except ValueError:
        return {"raises": "ValueError"}
    return list(value) if isinstance(value, tuple) else value


def matches(value: Any, expected: Any, rel_tol: float) -> bool:
    """Does a returned ``value`` (JSON data) equal ``expected``: strings exactly, numbers within ``rel_tol``?
    Only exact ``str``/``int``/``float``/``list`` count, so no subclass's ``__eq__`` or ``__abs__`` is consulted,
    and an integer too large for a float is simply wrong (``math.isfinite`` raised OverflowError on it)."""
    if isinstance(expected, str):
        return type(value) is str and value == expected
    if isinstance(expected, list):
        return type(value) is list and len(value) == len(expected) and all(
            matches(v, e, rel_tol) for v, e in zip(value, expected))
    number = as_float(value)
    if number is None or not math.isfinite(number):
        return False
    return abs(number - expected) <= rel_tol * abs(expected) + 1e-9


def as_float(value: Any) -> float | None:
    """An exact int or float as a float; None for anything else (bools, subclasses, ints beyond a float)."""
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return None
    return None


# Returned values are the model's: shown in feedback at most a few levels deep and a few hundred characters.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 3, 8, 8, 80, 40, 80


def short_repr(value: Any) -> str:
    """``repr`` bounded in depth and length (`reprlib`), so a value nested a thousand deep or a megabyte
    long cannot raise RecursionError or flood the feedback."""
    try:
        return _SHORT.repr(value)
    except (RecursionError, ValueError) as e:  # ValueError: an int past Python's digit limit for str()
        return f"<a {type(value).__name__} that cannot be shown: {type(e).__name__}>"


def show(value: Any, lists_as_tuples: bool = True) -> str:
    """A value as the prompt and the diagnostics write it: floats to 6 significant figures; a returned
    list is the tuple the reference returned (JSON has no tuples)."""
    if isinstance(value, dict):
        return f"raises {value['raises']}"
    if isinstance(value, list):
        inner = ", ".join(show(v, False) for v in value)
        if not lists_as_tuples:
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


@register
@dataclass(frozen=True)
class PythonFunction(TaskFamily):
    name = "python_function"
    levels = (1, 2, 3, 4, 5)
    tests: int = 8  # hidden test cases per sample
    timeout_s: float = 2.0  # wall clock for the whole sandboxed run of a sample's tests
    memory_mb: int = 256

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        problem = PROBLEMS[level][rng.randrange(len(PROBLEMS[level]))]
        examples = [problem.draw(rng) for _ in range(2)]
        hidden = [self.draw_case(problem, rng, i) for i in range(self.tests - (1 if problem.errors else 0))]
        if problem.errors:  # one hidden case checks the required ValueError
            hidden.insert(rng.randrange(len(hidden) + 1), rng.choice(problem.errors))
        cases = [{"args": list(args), "expected": expected_of(problem, args)} for args in hidden]
        shown = "\n".join(f"    {problem.name}({', '.join(show(x, False) for x in a)}) -> {show(expected_of(problem, a))}"
                           for a in examples)
        prompt = (f"Write a Python function\n\n    def {problem.signature()}:\n\nthat returns {problem.returns}.\n"
                  f"Examples:\n{shown}\nIt is tested on hidden cases (numbers within {100 * self.rel_tol:g}% "
                  f"relative, strings exactly); tuples may also be returned as lists. Use only the standard "
                  f"library (import math if needed); no input or output.\n"
                  f"Answer with the function in one ```python code block.")
        reference = f"```python\n{_source(problem.reference)}```"
        steps = [Step(f"test_{i + 1}", "1") for i in range(len(cases))]
        return Sample(self.name, level, seed, index, prompt, answer=problem.signature(),
                      reference_solution=reference, target=steps[-1], steps=steps,
                      extra={"function": problem.name, "tests": cases})

    @staticmethod
    def draw_case(problem: Problem, rng: random.Random, i: int) -> tuple:
        if problem.utilisation is None:
            return problem.draw(rng)
        while True:
            args = problem.draw(rng)
            used = problem.utilisation(*args)
            if abs(used - 1) >= 0.05 and (used <= 1) == (i % 2 == 0):
                return args

    def grade(self, sample: Sample, completion: str) -> Grade:
        found = extract_code(completion, marker="def ")
        cases = sample.extra["tests"]
        if found is None:
            results = [StepResult(s.key, False, None) for s in sample.steps]
            return make_grade(0.0, results, False, self.step_weight)
        code, span = found
        job = sandbox.shared().run(code, sample.extra["function"], [c["args"] for c in cases],
                                   timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        results = []
        for i, (step, case) in enumerate(zip(sample.steps, cases)):
            passed, why = self.check(job, i, case["expected"])
            results.append(StepResult(step.key, passed, span, None if passed else why))
        outcome = 1.0 if all(r.correct for r in results) else 0.0
        return make_grade(outcome, results, True, self.step_weight)

    def check(self, job: sandbox.JobResult, i: int, expected: Any) -> tuple[bool, str]:
        """Did call ``i`` give ``expected``? And if not, why, in words."""
        if i >= len(job.calls):
            return False, job.reason  # the job did not run to its end: the sandbox says why
        call = job.calls[i]
        if isinstance(expected, dict):
            raised = call.error.split(":", 1)[0].split(" ", 1)[0]
            if not call.ok and raised == expected["raises"]:
                return True, ""
            return False, f"expected {expected['raises']}, got " + (call.error if not call.ok else short_repr(call.value))
        if not call.ok:
            return False, call.error
        if matches(call.value, expected, self.rel_tol):
            return True, ""
        return False, f"returned {short_repr(call.value)}, expected {show(expected)}"
