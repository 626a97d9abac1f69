import math

import pytest

from cohortrl import tasks
from cohortrl.tasks.truss import Structure, solve


def test_spring_chain_fixed_at_one_end_by_hand():
    # Wall A - k1 = 100 N/mm - node 1 - k2 = 200 N/mm - node 2, 600 N pulling node 2:
    # both springs carry 600 N; u1 = 600 / 100 = 6 mm, u2 = 6 + 600 / 200 = 9 mm; R_A = -600 N.
    chain = Structure({"A": (0.0, 0.0), "1": (1.0, 0.0), "2": (2.0, 0.0)}, [("A", "1", 100.0), ("1", "2", 200.0)],
                      {"A": "xy", "1": "y", "2": "y"}, {"2": (600.0, 0.0)})
    forces, reactions, disp = solve(chain)
    assert forces == pytest.approx({"F_A1": 600.0, "F_12": 600.0})
    assert disp["1"][0] == pytest.approx(6.0) and disp["2"][0] == pytest.approx(9.0)
    assert reactions["R_Ax"] == pytest.approx(-600.0)


def test_spring_chain_between_walls_by_hand():
    # Wall A - k1 = 100 - node 1 - k2 = 200 - wall B, 300 N on node 1: u1 = 300 / (100 + 200) = 1 mm;
    # spring 1 stretches (+100 N), spring 2 is squeezed (-200 N); R_A = -100 N, R_B = -200 N (sum with the
    # load: -100 - 200 + 300 = 0).
    chain = Structure({"A": (0.0, 0.0), "1": (1.0, 0.0), "B": (2.0, 0.0)}, [("A", "1", 100.0), ("1", "B", 200.0)],
                      {"A": "xy", "1": "y", "B": "xy"}, {"1": (300.0, 0.0)})
    forces, reactions, disp = solve(chain)
    assert disp["1"][0] == pytest.approx(1.0)
    assert forces == pytest.approx({"F_A1": 100.0, "F_1B": -200.0})
    assert reactions["R_Ax"] == pytest.approx(-100.0) and reactions["R_Bx"] == pytest.approx(-200.0)


def test_triangle_by_hand():
    # A(0, 0) pin, B(6, 0) roller, C(3, 4); 10 kN down at C. By symmetry R_Ay = R_By = 5 kN, R_Ax = 0.
    # Joint C: 2 F (4/5) = -10 → F_AC = F_BC = -6.25 kN (compression). Joint A: F_AB + F_AC (3/5) = 0 →
    # F_AB = 3.75 kN (tension).
    nodes = {"A": (0.0, 0.0), "B": (6.0, 0.0), "C": (3.0, 4.0)}
    members = [(a, b, 200e3 / math.dist(nodes[a], nodes[b])) for a, b in ("AB", "AC", "BC")]
    forces, reactions, _ = solve(Structure(nodes, members, {"A": "xy", "B": "y"}, {"C": (0.0, -10.0)}))
    assert forces == pytest.approx({"F_AB": 3.75, "F_AC": -6.25, "F_BC": -6.25})
    assert reactions == pytest.approx({"R_Ax": 0.0, "R_Ay": 5.0, "R_By": 5.0})


@pytest.mark.parametrize("level", [3, 4, 5])
def test_generated_trusses_are_in_equilibrium(level):
    # Independent of the stiffness solve: at every node, member forces + reactions + loads sum to zero.
    for s in tasks.get("truss").sample(30, seed=4, level=level):
        text = s.prompt
        nodes = {}
        for part in text.split("nodes ")[1].split(" (m)")[0].split("), "):
            name, xy = part.split("(")
            x, y = xy.rstrip(")").split(", ")
            nodes[name.strip()] = (float(x), float(y))
        values = {step.key: float(step.value) for step in s.steps}
        net = {n: [0.0, 0.0] for n in nodes}
        for key, force in values.items():
            if key.startswith("F_"):
                a, b = key[2], key[3]
                (xa, ya), (xb, yb) = nodes[a], nodes[b]
                length = math.dist(nodes[a], nodes[b])
                ex, ey = (xb - xa) / length, (yb - ya) / length
                net[a][0] += force * ex; net[a][1] += force * ey  # tension pulls node a towards b
                net[b][0] -= force * ex; net[b][1] -= force * ey
            elif key.startswith("R_"):
                net[key[2]][0 if key[3] == "x" else 1] += force
        for load in text.split("Loads: ")[1].split(". Allowable")[0].split("; "):
            amounts, node = load.rsplit(" at ", 1)
            for amount in amounts.split(" and "):
                kn, _, direction = amount.split(" ", 2)
                sign = {"down": (1, -1), "up": (1, 1), "to the right": (0, 1), "to the left": (0, -1)}[direction]
                net[node][sign[0]] += sign[1] * float(kn)
        for n, (fx, fy) in net.items():
            assert abs(fx) < 1e-6 and abs(fy) < 1e-6, (s.id, n, fx, fy)


def test_zero_force_members_are_graded_with_an_absolute_floor():
    family = tasks.get("truss")
    samples = [s for s in family.sample(60, seed=0, level=4) if any(float(st.value) == 0 for st in s.steps)]
    assert samples
    for s in samples:
        zero = next(st for st in s.steps if float(st.value) == 0)
        assert zero.abs_tol > 0
        dusty = s.reference_solution.replace(f"{zero.key} = 0 kN", f"{zero.key} = {zero.abs_tol / 2:.3g} kN")
        assert family.grade(s, dusty).steps[s.steps.index(zero)].correct
