"""[truss] 1-D spring chains and small 2-D pin-jointed trusses, solved exactly by the stiffness method.

Levels:
  1  a chain of 2-3 springs from a wall A to a free end, pulled at the free end: R_A (N),
     spring forces F_i (N), node displacements u_i (mm); ANSWER the free end's displacement
  2  a chain of 2-3 springs between walls A and B, loaded at one inner node (statically indeterminate):
     R_A, R_B, F_i, u_i; ANSWER the loaded node's displacement
  3  a triangle truss (3 members) on a pin and a roller, loaded at its apex: reactions R_Ax, R_Ay, R_By (kN),
     member forces F_XY (kN), sigma_max = max |F| / A (MPa); ANSWER sigma_max, VERDICT against an allowable
  4  as 3 on a braced rectangle (5 members) or a two-panel Warren truss (7 members)
  5  as 3 on a rectangle braced by both diagonals (6 members, statically indeterminate)

Signs: x to the right, y up; reactions and displacements positive along +x / +y; member (spring) forces
positive in tension. The truth is K u = f solved with numpy: each member adds its stiffness k (EA/L for a
bar, along its direction cosines) to K; supported degrees of freedom are removed; reactions are K u - f at
the supports and member forces k (e . (u_j - u_i)). Forces may be zero (zero-force members), so they are
graded to 1% of themselves or of the largest applied load, whichever is larger.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

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


@dataclass
class Structure:
    nodes: dict[str, tuple[float, float]]  # name → (x, y)
    members: list[tuple[str, str, float]]  # (node i, node j, axial stiffness k = EA / L)
    supports: dict[str, str]  # name → restrained directions, "xy", "x" or "y"
    loads: dict[str, tuple[float, float]]  # name → (fx, fy)


def solve(s: Structure) -> tuple[dict[str, float], dict[str, float], dict[str, tuple[float, float]]]:
    """(member forces, reactions keyed "R_<node><dir>", displacements) from K u = f."""
    names = list(s.nodes)
    index = {name: i for i, name in enumerate(names)}
    stiffness = np.zeros((2 * len(names), 2 * len(names)))
    directions = []
    for a, b, k in s.members:
        (xa, ya), (xb, yb) = s.nodes[a], s.nodes[b]
        length = math.hypot(xb - xa, yb - ya)
        e = np.array([(xa - xb) / length, (ya - yb) / length, (xb - xa) / length, (yb - ya) / length])
        dofs = [2 * index[a], 2 * index[a] + 1, 2 * index[b], 2 * index[b] + 1]
        stiffness[np.ix_(dofs, dofs)] += k * np.outer(e, e)
        directions.append((dofs, e))
    force = np.zeros(2 * len(names))
    for name, (fx, fy) in s.loads.items():
        force[2 * index[name]] += fx
        force[2 * index[name] + 1] += fy
    fixed = [2 * index[n] + (0 if d == "x" else 1) for n, dirs in s.supports.items() for d in dirs]
    free = [d for d in range(len(force)) if d not in fixed]
    u = np.zeros(len(force))
    u[free] = np.linalg.solve(stiffness[np.ix_(free, free)], force[free])
    reaction = stiffness @ u - force
    # Clean floating-point dust so that a zero-force member is written as 0, not 1e-15.
    scale = max(abs(f) for f in force)
    clean = lambda v: 0.0 if abs(v) < 1e-9 * scale else float(v)  # noqa: E731
    forces = {f"F_{a}{b}": clean(k * e @ u[dofs]) for (a, b, k), (dofs, e) in zip(s.members, directions)}
    reactions = {f"R_{n}{d}": clean(reaction[2 * index[n] + (0 if d == "x" else 1)]) for n, dirs in s.supports.items() for d in dirs}
    displacements = {n: (float(u[2 * index[n]]), float(u[2 * index[n] + 1])) for n in names}
    return forces, reactions, displacements


# ---------------------------------------------------------------------------------------------------------
# Levels 1-2: spring chains along x (every node restrained in y, so the 2-D solver serves unchanged).


def chain(rng: random.Random, level: int):
    n = rng.randint(2, 3)
    ks = [float(rng.choice([50, 100, 150, 200, 250, 300, 400, 500])) for _ in range(n)]  # N/mm
    inner = [str(i) for i in range(1, n if level == 2 else n + 1)]
    names = ["A"] + inner + (["B"] if level == 2 else [])
    loaded = inner[-1] if level == 1 else rng.choice(inner)
    load = float(rng.choice([-1, 1]) * rng.randint(2, 40) * 50) if level == 2 else float(rng.randint(2, 40) * 50)
    structure = Structure(
        nodes={name: (float(i), 0.0) for i, name in enumerate(names)},
        members=[(names[i], names[i + 1], ks[i]) for i in range(n)],  # k in N/mm: u comes out in mm
        supports={name: "xy" if name in ("A", "B") else "y" for name in names},
        loads={loaded: (load, 0.0)},
    )
    forces, reactions, disp = solve(structure)
    label = lambda name: f"wall {name}" if name in ("A", "B") else f"node {name}"  # noqa: E731
    springs = " - ".join(f"spring {i + 1} (k = {format_sig(k)} N/mm) - {label(names[i + 1])}" for i, k in enumerate(ks))
    text = (
        f"Springs in a line along x: wall A - {springs}{' (free end)' if level == 1 else ''}. "
        f"A force of {format_sig(abs(load))} N acts on node {loaded} in {'+x' if load > 0 else '-x'}. "
        f"Reactions and displacements are positive in +x; spring forces are positive in tension."
    )
    u = {name: disp[name][0] for name in names}
    steps = [(f"R_{w}", reactions[f"R_{w}x"], "N", None) for w in ("A", "B") if w in names]
    steps += [(f"F_{i + 1}", forces[f"F_{names[i]}{names[i + 1]}"], "N",
               f"{format_sig(ks[i])}*({format_sig(u[names[i + 1]])} - {format_sig(u[names[i]])})") for i in range(n)]
    steps += [(f"u_{name}", u[name], "mm", None) for name in inner]
    answer_key = f"u_{loaded}"
    steps.append(steps.pop(next(i for i, st in enumerate(steps) if st[0] == answer_key)))  # the answer last
    givens = [f"k_{i + 1} = {format_sig(k)} N/mm" for i, k in enumerate(ks)] + [f"P = {format_sig(load)} N"]
    return text, givens, steps, abs(load), None


# ---------------------------------------------------------------------------------------------------------
# Levels 3-5: 2-D trusses, lengths in m, loads in kN, areas in mm^2, E in GPa (so EA / L is in kN/m).


def geometry(rng: random.Random, level: int):
    """(nodes, members, supports) for one truss shape of the level."""
    width, height = float(rng.randint(3, 6)), float(rng.randint(2, 4))
    if level == 3:
        apex = rng.choice([w / 2 for w in range(1, int(2 * width))])
        return {"A": (0.0, 0.0), "B": (width, 0.0), "C": (apex, height)}, ["AB", "AC", "BC"], {"A": "xy", "B": "y"}
    rectangle = {"A": (0.0, 0.0), "B": (width, 0.0), "C": (width, height), "D": (0.0, height)}
    if level == 5:
        return rectangle, ["AB", "BC", "CD", "AD", "AC", "BD"], {"A": "xy", "B": "y"}
    if rng.random() < 0.5:
        return rectangle, ["AB", "BC", "CD", "AD", rng.choice(["AC", "BD"])], {"A": "xy", "B": "y"}
    panel = width / 2
    nodes = {"A": (0.0, 0.0), "B": (2 * panel, 0.0), "C": (4 * panel, 0.0), "D": (panel, height), "E": (3 * panel, height)}
    return nodes, ["AB", "BC", "AD", "BD", "BE", "CE", "DE"], {"A": "xy", "C": "y"}


def load_text(name: str, fx: float, fy: float) -> str:
    parts = ([f"{format_sig(abs(fy))} kN {'down' if fy < 0 else 'up'}"] if fy else []) + \
            ([f"{format_sig(abs(fx))} kN to the {'right' if fx > 0 else 'left'}"] if fx else [])
    return f"{' and '.join(parts)} at {name}"


def plane_truss(rng: random.Random, level: int, safe: bool):
    nodes, members, supports = geometry(rng, level)
    top = [n for n, (_, y) in nodes.items() if y > 0]
    loaded = rng.sample(top, rng.randint(1, len(top)))
    loads = {n: (float(rng.choice([0, 0, -1, 1]) * rng.randint(1, 6) * 5), -float(rng.randint(1, 12) * 5)) for n in loaded}
    e_gpa, allow = 200.0, float(rng.choice([100, 120, 150, 165]))
    # Equal EA for every member: determinate forces do not depend on it, indeterminate ones only on ratios.
    structure = Structure(nodes, [(m[0], m[1], e_gpa * 1000 / math.dist(nodes[m[0]], nodes[m[1]])) for m in members],
                          supports, loads)
    forces, reactions, _ = solve(structure)
    biggest = max(abs(f) for f in forces.values())
    area = round_nice(biggest * 1000 / (target_utilisation(rng, safe) * allow), 2)
    sigma_max = biggest * 1000 / area
    if not clear_of_threshold(sigma_max / allow) or (sigma_max <= allow) != safe:
        return None  # rounding the area moved it too far: draw again
    coords = ", ".join(f"{n}({format_sig(x)}, {format_sig(y)})" for n, (x, y) in nodes.items())
    roller = next(n for n, d in supports.items() if d == "y")
    text = (
        f"A plane pin-jointed truss has nodes {coords} (m), a pin at A and a roller at {roller} (vertical reaction "
        f"only). Members {', '.join(members)}, each of area {format_sig(area)} mm^2 and E = {format_sig(e_gpa)} GPa. "
        f"Loads: {'; '.join(load_text(n, *f) for n, f in loads.items())}. Allowable stress {format_sig(allow)} MPa. "
        f"Reactions are positive along +x and +y; member forces are positive in tension."
    )
    # Reactions and member forces come from joint equilibrium (or compatibility); the reference states them
    # as "KEY = value unit" rather than spelling out the equations.
    steps = [(key, value, "kN", None) for key, value in reactions.items()]
    steps += [(key, value, "kN", None) for key, value in forces.items()]
    steps.append(("sigma_max", sigma_max, "MPa", f"{format_sig(biggest)}*1000/{format_sig(area)}"))
    givens = [f"{n}_x = {format_sig(x)} m" for n, (x, _) in nodes.items()] + [f"A = {format_sig(area)} mm^2"]
    givens += [f"P_{n} = {format_sig(fy)} kN" for n, (_, fy) in loads.items()] + [f"sigma_allow = {format_sig(allow)} MPa"]
    max_load = max(max(abs(fx), abs(fy)) for fx, fy in loads.values())
    return text, givens, steps, max_load, "SAFE" if sigma_max <= allow else "FAIL"


@register
@dataclass(frozen=True)
class Truss(TaskFamily):
    name = "truss"
    levels = (1, 2, 3, 4, 5)

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        built = None
        while built is None:
            built = chain(rng, level) if level <= 2 else plane_truss(rng, level, wants_safe(seed, index))
        text, givens, steps, max_load, verdict = built
        answer_key, answer_value, answer_unit, _ = steps[-1]
        prompt = f"{text}\n{format_instructions([(k, u) for k, _, u, _ in steps], answer_key, verdict=verdict is not None)}"
        lines = [f"{key} = {expr + ' = ' if expr else ''}{format_sig(value)} {unit}" for key, value, unit, expr in steps]
        answer = f"{format_sig(answer_value)} {answer_unit}"
        reference = "\n".join(lines + [f"ANSWER: {answer}"] + ([f"VERDICT: {verdict}"] if verdict else []))
        # Forces and reactions may be exactly zero: grade them to 1% of the largest load as well.
        force_unit = "N" if level <= 2 else "kN"
        required = [Step(key, repr(value), unit, abs_tol=self.rel_tol * max_load if unit == force_unit else 0.0)
                    for key, value, unit, _ in steps]
        return Sample(self.name, level, seed, index, prompt, answer, reference, target=required[-1],
                      steps=required, verdict=verdict, givens=givens)
