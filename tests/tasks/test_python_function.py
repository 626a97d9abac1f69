"""[python_function]: references pass their hidden tests, wrong functions fail them, and hostile responses
end as failed samples with a clear reason (the code runs only in the sandbox)."""

from __future__ import annotations

import math
import os

import pytest

from cohortrl import tasks
from cohortrl.tasks.python_function import PROBLEMS, matches

FAMILY = tasks.get("python_function", timeout_s=1.0)


def py(text: str) -> str:
    return f"```python\n{text}\n```"


@pytest.mark.parametrize("level", FAMILY.levels)
def test_references_pass_every_hidden_test(level):
    for sample in FAMILY.sample(25, seed=5, level=level):
        grade = FAMILY.grade(sample, sample.reference_solution)
        assert grade.outcome == 1.0 and grade.score == 1.0, (sample.id, [s.written for s in grade.steps if not s.correct])
        assert len(grade.steps) == FAMILY.tests


def test_every_problem_appears_and_its_raising_case_is_hidden():
    seen = {s.extra["function"] for level in FAMILY.levels for s in FAMILY.sample(60, seed=0, level=level)}
    assert seen == {p.name for problems in PROBLEMS.values() for p in problems}
    for sample in FAMILY.sample(20, seed=1, level=4):
        raising = [t for t in sample.extra["tests"] if isinstance(t["expected"], dict)]
        assert len(raising) == (1 if sample.extra["function"] in ("point_load_reactions",) else 0)


def test_worked_values():
    # 10 kN over 100 mm^2 = 10,000 N / 100 mm^2 = 100 MPa; 14.7 psi = 14.7 * 6894.757 Pa = 101.353 kPa;
    # UDL 10 kN/m on 4 m: R = 10 * 4 / 2 = 20 kN, M = 10 * 16 / 8 = 20 kN*m; springs 100 and 100 N/mm in
    # series: 50 N/mm, 500 N stretch them 10 mm.
    from cohortrl.tasks import python_function as pf

    assert pf.axial_stress(10.0, 100.0) == 100.0
    assert pf.convert_pressure(14.7, "psi", "kPa") == pytest.approx(101.3530, rel=1e-6)
    assert pf.udl_beam(4.0, 10.0) == (20.0, 20.0)
    assert pf.springs_in_series([100.0, 100.0], 500.0) == (50.0, 10.0)
    # M = 10 kN * 2 m / 4 = 5 kN*m = 5e6 N*mm; stress = 6 * 5e6 / (100 * 200^2) = 7.5 MPa.
    assert pf.beam_bending_check(2.0, 10.0, 100.0, 200.0, 10.0) == ("SAFE", 7.5)
    assert pf.beam_bending_check(2.0, 10.0, 100.0, 200.0, 7.0) == ("FAIL", 7.5)
    with pytest.raises(ValueError):
        pf.hollow_area(50.0, 25.0)


def test_matching_rule():
    assert matches(101.0, 100.0, 0.01) and not matches(101.5, 100.0, 0.01)
    assert matches([1.0, "SAFE"], [1.005, "SAFE"], 0.01) and not matches([1.0], [1.0, 2.0], 0.01)
    assert not matches(True, 1.0, 0.01) and not matches(math.nan, 1.0, 0.01) and not matches("1.0", 1.0, 0.01)


def test_a_wrong_formula_fails_and_a_near_miss_within_tolerance_passes():
    sample = next(s for s in FAMILY.sample(20, seed=0, level=1) if s.extra["function"] == "axial_stress")
    wrong = FAMILY.grade(sample, py("def axial_stress(force_kN, area_mm2):\n    return force_kN / area_mm2\n"))
    assert wrong.outcome == 0 and wrong.score == 0 and "expected" in wrong.steps[0].written
    close = FAMILY.grade(sample, py("def axial_stress(force_kN, area_mm2):\n    return 1004.0 * force_kN / area_mm2\n"))
    assert close.outcome == 1


def test_constant_answers_fail():
    # A constant number matches no case; always SAFE (or FAIL) matches exactly half of a verdict problem's.
    for level in (2, 5):
        for sample in FAMILY.sample(10, seed=3, level=level):
            name = sample.extra["function"]
            for constant in ("1.0", "'SAFE'", "'FAIL'", "('SAFE', 1.0)", "(0.0, 0.0)"):
                grade = FAMILY.grade(sample, py(f"def {name}(*args):\n    return {constant}\n"))
                assert grade.outcome == 0 and grade.step_credit <= 0.5, (sample.id, constant)
    verdicts = [t["expected"] for s in FAMILY.sample(20, seed=0, level=2) if s.extra["function"] == "bar_verdict"
                for t in s.extra["tests"]]
    assert verdicts and verdicts.count("SAFE") == verdicts.count("FAIL")


def test_forgetting_the_value_error_fails_only_that_test():
    sample = next(s for s in FAMILY.sample(20, seed=2, level=3) if s.extra["function"] == "convert_length")
    lenient = ("def convert_length(value, from_unit, to_unit):\n"
               "    metres = {'mm': 0.001, 'cm': 0.01, 'm': 1.0, 'km': 1000.0, 'in': 0.0254, 'ft': 0.3048}\n"
               "    return value * metres.get(from_unit, 1.0) / metres.get(to_unit, 1.0)\n")
    grade = FAMILY.grade(sample, py(lenient))
    assert grade.outcome == 0 and grade.step_credit == (FAMILY.tests - 1) / FAMILY.tests
    assert any("expected ValueError" in (s.written or "") for s in grade.steps)


def test_tuples_may_come_back_as_lists_but_not_as_other_shapes():
    sample = next(s for s in FAMILY.sample(20, seed=0, level=4) if s.extra["function"] == "udl_beam")
    as_list = FAMILY.grade(sample, py("def udl_beam(span_m, load_kN_m):\n    return [load_kN_m * span_m / 2, load_kN_m * span_m ** 2 / 8]\n"))
    as_dict = FAMILY.grade(sample, py("def udl_beam(span_m, load_kN_m):\n    return {'R': load_kN_m * span_m / 2}\n"))
    assert as_list.outcome == 1 and as_dict.outcome == 0


def test_no_code_block_is_not_a_commitment():
    sample = FAMILY.sample(1, seed=0, level=1)[0]
    grade = FAMILY.grade(sample, "The stress is force over area.")
    assert not grade.committed and grade.score == 0


HOSTILE_RESPONSES = [
    ("while True:\n    pass\n", "timeout"),
    ("import time\ntime.sleep(60)\n", "timeout"),
    ("_os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close').__init__.__globals__\n"
     "_os['system']('touch pwned')\n", "forbidden system call"),
    ("print(open('/etc/passwd').read())\n", "NameError"),
    ("for _ in range(10 ** 6):\n    print('spam' * 1000)\n", "output too large"),
    ("x = bytearray(10 * 1024 ** 3)\n", "MemoryError"),
]


@pytest.mark.parametrize("body,reason", HOSTILE_RESPONSES)
def test_hostile_responses_fail_with_the_sandbox_reason(body, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # had the code run here, in the trainer, "pwned" would appear in this dir
    sample = FAMILY.sample(1, seed=0, level=1)[0]
    name = sample.extra["function"]
    # The attack runs when the module is executed, before the function is ever called.
    grade = FAMILY.grade(sample, py(f"{body}\ndef {name}(*args):\n    return 0.0\n"))
    assert grade.outcome == 0 and grade.score == 0 and grade.committed
    assert reason in grade.steps[0].written, grade.steps[0].written
    assert not os.listdir(tmp_path)
