from decimal import Decimal

import pytest

from cohortrl import tasks
from cohortrl.tasks.beam_bending import Beam, max_deflection, max_moment, reactions


def test_simply_supported_central_load_by_hand():
    # L = 4 m, P = 10 kN at 2 m: R_A = R_B = 5 kN, M_max = P L / 4 = 10 kN*m.
    beam = Beam("simple", 4.0, [(10.0, 2.0)])
    assert {k: v for k, (v, _) in reactions(beam).items()} == {"R_A": 5.0, "R_B": 5.0}
    assert max_moment(beam)[0] == pytest.approx(10.0)
    # b = 100, h = 200 mm: I = 100 * 200^3 / 12 = 6.667e7 mm^4; sigma = 10e6 N*mm * 100 / 6.667e7 = 15 MPa.
    # E = 200 GPa: delta = P L^3 / (48 E I) = 10,000 * 4000^3 / (48 * 200,000 * 6.667e7) = 6.4e14 / 6.4e14 = 1 mm.
    inertia = 100 * 200**3 / 12
    assert 10e6 * 100 / inertia == pytest.approx(15.0)
    assert max_deflection(beam, 200, inertia)[0] == pytest.approx(1.0)


def test_off_centre_and_udl_by_hand():
    # L = 6 m, P = 12 kN at 2 m: R_A = 12 * 4 / 6 = 8, R_B = 4; M_max = 8 * 2 = 16 kN*m under the load.
    beam = Beam("simple", 6.0, [(12.0, 2.0)])
    assert reactions(beam)["R_A"][0] == pytest.approx(8.0) and reactions(beam)["R_B"][0] == pytest.approx(4.0)
    assert max_moment(beam)[0] == pytest.approx(16.0)
    # UDL w = 2 kN/m over L = 6 m: R = 6 kN each; M_max = w L^2 / 8 = 9 kN*m at midspan.
    assert max_moment(Beam("simple", 6.0, [], 2.0))[0] == pytest.approx(9.0)


def test_superposition_maximum_between_loads():
    # L = 10, P = 10 kN at 8 m, w = 2 kN/m: R_A = 10 * 2 / 10 + 2 * 10 / 2 = 12 kN. Shear 12 - 2x is zero at
    # x = 6 m (< 8, before the point load): M(6) = 12 * 6 - 2 * 36 / 2 = 36 kN*m, above M(8) = 96 - 64 = 32.
    assert max_moment(Beam("simple", 10.0, [(10.0, 8.0)], 2.0))[0] == pytest.approx(36.0)
    # L = 8, P = 50 kN at 2.5 m, w = 3 kN/m: R_A = 50 * 5.5 / 8 + 12 = 46.375 kN; the shear changes sign under
    # the load, so M_max = 46.375 * 2.5 - 3 * 2.5^2 / 2 = 106.5625 kN*m.
    assert max_moment(Beam("simple", 8.0, [(50.0, 2.5)], 3.0))[0] == pytest.approx(106.5625)


def test_cantilever_by_hand():
    # L = 2 m, P = 5 kN at the tip: R_A = 5 kN, M_max = 10 kN*m at A; delta = P L^3 / (3 E I) with
    # E = 200 GPa, I = 6.667e7 mm^4: 5000 * 2000^3 / (3 * 200,000 * 6.667e7) = 4e13 / 4e13 = 1 mm.
    beam = Beam("cantilever", 2.0, [(5.0, 2.0)])
    assert reactions(beam)["R_A"][0] == 5.0 and max_moment(beam)[0] == 10.0
    assert max_deflection(beam, 200, 100 * 200**3 / 12)[0] == pytest.approx(1.0)
    # UDL 3 kN/m: R_A = 6 kN, M_max = 3 * 4 / 2 = 6 kN*m.
    udl = Beam("cantilever", 2.0, [], 3.0)
    assert reactions(udl)["R_A"][0] == 6.0 and max_moment(udl)[0] == 6.0


def test_inverse_design_is_checked_by_plugging_back():
    family = tasks.get("beam_bending")
    sample = family.sample(1, seed=0, level=5)[0]
    m, b, allow = (sample.extra[k] for k in ("moment_Nmm", "width_mm", "sigma_allow_MPa"))
    h = (6 * m / (b * allow)) ** 0.5  # sigma = 6 M / (b h^2) = allow
    head = sample.reference_solution.rsplit("ANSWER:", 1)[0]
    assert family.grade(sample, f"{head}ANSWER: {h:.5g} mm").outcome == 1.0
    assert family.grade(sample, f"{head}ANSWER: {h / 1000:.5g} m").outcome == 1.0
    assert family.grade(sample, f"{head}ANSWER: {h * 1.004:.5g} mm").outcome == 1.0  # within tolerance
    assert family.grade(sample, f"{head}ANSWER: {h * 0.98:.5g} mm").outcome == 0.0  # overstressed by 4%
    assert family.grade(sample, f"{head}ANSWER: {h * 1.05:.5g} mm").outcome == 0.0  # safe, but not the smallest
    assert family.grade(sample, f"{head}ANSWER: {h:.5g}").outcome == 0.0  # no unit
    assert family.grade(sample, f"{head}ANSWER: {h:.5g} kN").outcome == 0.0


@pytest.mark.parametrize("index", range(3))
def test_inverse_design_band_holds_at_both_edges(index):
    """The depth's band, rel_tol = 1%: sigma = 6 M / (b h^2) within [allow / 1.01^2, allow * 1.01], i.e.
    h within [h* / sqrt(1.01), 1.01 h*] for h* = sqrt(6 M / (b allow)). A millionth inside each edge passes and a
    millionth beyond fails (28 significant digits, so the written value is the intended one)."""
    family = tasks.get("beam_bending")
    sample = family.sample(3, seed=0, level=5)[index]
    m, b, allow = (Decimal(str(sample.extra[k])) for k in ("moment_Nmm", "width_mm", "sigma_allow_MPa"))
    h_star = (6 * m / (b * allow)).sqrt()
    slack, eps = Decimal("1.01"), Decimal("1e-6")
    shallowest, deepest = h_star / slack.sqrt(), h_star * slack
    head = sample.reference_solution.rsplit("ANSWER:", 1)[0]

    def outcome(h: Decimal) -> float:
        return family.grade(sample, f"{head}ANSWER: {h:.28g} mm").outcome

    assert outcome(shallowest * (1 + eps)) == 1.0 and outcome(deepest * (1 - eps)) == 1.0
    assert outcome(shallowest * (1 - eps)) == 0.0  # overstressed by just over 1%
    assert outcome(deepest * (1 + eps)) == 0.0  # just over 1% deeper than needed


def test_references_write_the_choices_as_calculator_expressions():
    """M_max as max() of the candidates the reference wrote, and the verdict's comparison as SF (SAFE iff
    SF >= 1): the two decisions a warm start got wrong when the references made them in the head."""
    from cohortrl.tools.calculator import evaluate

    family = tasks.get("beam_bending")
    seen_max = 0
    for level in (2, 3, 4):
        for sample in family.sample(40, seed=3, level=level):
            lines = dict(line.split(" = ", 1) for line in sample.reference_solution.splitlines() if " = " in line)
            expr, value = lines["SF"].rsplit(" = ", 1)
            assert evaluate(expr) == pytest.approx(float(value), rel=1e-3)
            assert (float(value) >= 1) == (sample.verdict == "SAFE")
            m_expr, m_value = lines["M_max"].rsplit(" = ", 1)
            if m_expr.startswith("max("):
                seen_max += 1
                candidates = [lines[k].rsplit(" = ", 1)[1].split()[0] for k in lines if k.startswith("M_") and k != "M_max"]
                assert m_expr == f"max({', '.join(candidates)})"
                assert float(m_value.split()[0]) == pytest.approx(max(map(float, candidates)), rel=1e-3)
    assert seen_max > 5  # level 3's simply supported beams have several candidates
