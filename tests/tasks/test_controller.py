"""[controller] acceptance (issue 6): reference controllers pass every scenario; deliberately bad ones fail
at the right stage; each hack block has a test; grades are deterministic and carry the reason."""

from __future__ import annotations

import dataclasses

import pytest

from cohortrl import tasks
from cohortrl.tasks.code_blocks import extract_code
from cohortrl.tasks.controller import STAGES
from cohortrl.tasks.plants import PLANTS
from cohortrl.tasks.st import compile_program

FAMILY = tasks.get("controller")
N = 60  # samples per level for the reference test (about 20 ms each)


def st(text: str) -> str:
    return f"Here is my controller.\n```st\n{text}\n```\n"


def reference_body(sample) -> str:
    return extract_code(sample.reference_solution, marker=":=")[0]


def evaluate_all(level: int, make, n: int = 12, seed: int = 3):
    """(sample, evaluation) for n samples of a level, the controller written by make(sample)."""
    return [(s, FAMILY.evaluate(s, st(make(s)))) for s in FAMILY.sample(n, seed=seed, level=level)]


@pytest.mark.parametrize("level", FAMILY.levels)
def test_reference_controllers_pass_every_scenario(level):
    for sample in FAMILY.sample(N, seed=11, level=level):
        grade = FAMILY.grade(sample, sample.reference_solution)
        assert grade.outcome == 1.0 and grade.score == 1.0, (sample.id, FAMILY.evaluate(sample, sample.reference_solution).reason)
        assert [s.key for s in grade.steps] == list(STAGES) and all(s.correct for s in grade.steps)


def test_scenarios_include_hidden_ones_that_the_prompt_does_not_describe():
    for level in FAMILY.levels:
        sample = FAMILY.sample(1, seed=0, level=level)[0]
        names = [s["name"] for s in sample.extra["scenarios"]]
        assert names == ["visible 1", "hidden 1", "hidden 2", "hidden 3"]
        assert "3 hidden ones" in sample.prompt and sample.prompt.count("\n  - ") == 1


# ---------------------------------------------------------------------------------------------------------
# Bad controllers, each failing at its stage. ``passed`` is the list of stages passed before the failure.


def test_no_control_fails_at_run():
    for level, text in ((1, "pump := 0.0;"), (2, "pump := 0.55;"), (3, "heater := 0.0;"),
                        (4, "pump := FALSE; valve := FALSE;")):
        for sample, ev in evaluate_all(level, lambda s: text, n=8):
            assert ev.passed == ["parse"], (sample.id, ev)
            assert "never came within half the step" in ev.reason or "the pump never ran" in ev.reason


def test_bang_bang_that_ignores_the_valve_interlock_fails_at_safety():
    def bang_bang(sample):
        lo, hi = sample.extra["params"]["band"]
        return f"valve := TRUE;\nIF level < {lo:g} THEN pump := TRUE; ELSIF level > {hi:g} THEN pump := FALSE; END_IF;"

    for sample, ev in evaluate_all(4, bang_bang):
        assert ev.passed == ["parse", "run"] and "the inlet valve was not fully open" in ev.reason, (sample.id, ev)


def test_ignoring_the_high_high_switch_fails_at_safety_when_the_transmitter_sticks():
    for sample, ev in evaluate_all(4, lambda s: reference_body(s).replace(" AND NOT high_high", "")):
        assert ev.passed == ["parse", "run"] and "high-high switch was tripped" in ev.reason, (sample.id, ev)
        assert "hidden" in ev.reason  # the stuck transmitter is in a hidden scenario


def test_the_emergency_stop_must_latch_until_reset():
    no_latch = lambda s: (reference_body(s).replace("valve := NOT stopped.Q1;", "valve := NOT estop;")  # noqa: E731
                          .replace(" AND NOT stopped.Q1", " AND NOT estop"))
    for sample, ev in evaluate_all(5, no_latch):
        assert ev.passed == ["parse", "run"] and "emergency stop was latched" in ev.reason, (sample.id, ev)


def test_restarting_the_pump_too_soon_breaks_the_minimum_off_time():
    # The rule bites where the high-high switch cycles the pump (the stuck transmitter) or after an
    # emergency stop; in the few samples where neither makes the pump restart early, nothing was broken.
    results = evaluate_all(5, lambda s: reference_body(s).replace(" AND rested.Q", ""), n=20)
    broken = [ev for _, ev in results if "minimum off time" in ev.reason]
    assert len(broken) >= 15 and all(ev.passed == ["parse", "run"] for ev in broken)


def test_overfilling_first_fails_at_safety():
    def brim_first(sample):
        body = reference_body(sample).replace("VAR\n", "VAR\n    brimmed : BOOL;\n", 1)
        body = body.replace("END_VAR\n", "END_VAR\nIF level > 2.05 THEN brimmed := TRUE; END_IF;\n", 1)
        body = body.replace("pump := LIMIT(", "IF brimmed THEN pump := LIMIT(")
        return f"{body}\nELSE pump := 1.0; END_IF;"

    for sample, ev in evaluate_all(1, brim_first):
        assert ev.passed == ["parse", "run"] and "above the overflow limit" in ev.reason, (sample.id, ev)


def test_oscillating_controllers_fail_at_performance():
    # Integral action alone, far too strong: safe, but it overshoots and rings.
    for level, out in ((1, 1.0), (2, 0.9)):
        text = f"pump := LIMIT(0.0, pump + 0.3 * DT * (setpoint - level), {out});"
        for sample, ev in evaluate_all(level, lambda s: text):
            assert ev.passed == ["parse", "run", "safety"] and "overshoot" in ev.reason, (sample.id, ev)


def test_chattering_fails_at_performance():
    def no_hysteresis(sample):
        lo, hi = sample.extra["params"]["band"]
        return f"valve := TRUE; pump := valve_open AND NOT high_high AND level < {(lo + hi) / 2:g};"

    for sample, ev in evaluate_all(4, no_hysteresis):
        assert ev.passed == ["parse", "run", "safety"] and "pump starts" in ev.reason, (sample.id, ev)
    for sample, ev in evaluate_all(1, lambda s: "IF level < setpoint THEN pump := 1.0; ELSE pump := 0.0; END_IF;"):
        assert ev.outcome == 0 and any("jumped by more than half its range" in f for f in ev.failures), sample.id


# ---------------------------------------------------------------------------------------------------------
# The hack blocks.


@pytest.mark.parametrize("text,reason", [
    ("pump := SQRT(level - 100.0);", "pump = nan: outputs must be finite"),
    ("pump := 1.0 / (level - level);", "pump = inf: outputs must be finite"),
    ("pump := LIMIT(0.0, 5.0 * (setpoint - level) + 0.5, 1.5);", "beyond the actuator's range [0, 1]"),
    ("pump := (setpoint - level) * 0.0 - 0.1;", "pump = -0.1 is beyond the actuator's range [0, 1]"),
])
def test_nan_inf_and_outputs_beyond_the_limits_fail_at_run(text, reason):
    for sample, ev in evaluate_all(1, lambda s: text, n=4):
        assert ev.passed == ["parse"] and reason in ev.reason, (sample.id, ev)


def test_do_nothing_controllers_earn_only_the_parse_step():
    for sample in FAMILY.sample(4, seed=1, level=1):
        grade = FAMILY.grade(sample, st("pump := 0.0;"))
        assert grade.outcome == 0 and [s.correct for s in grade.steps] == [True, False, False, False]
        assert grade.score == FAMILY.step_weight * 0.25


def timetable(sample, resolution: float = 1.0) -> str:
    """An open-loop schedule: the reference's output on the visible scenario, replayed against a clock."""
    extra = sample.extra
    plant_class = PLANTS[extra["plant"]]
    program = compile_program(reference_body(sample), plant_class.interface(extra["params"]))
    plant = plant_class(extra["params"], extra["scenarios"][0], extra["dt"])
    program.reset()
    plant.run(program)
    every = max(1, round(resolution / extra["dt"]))
    branches = [f"IF t < {resolution:g} THEN pump := {plant.u[0]:.4f};"]
    for i in range(every, plant.n, every):
        branches.append(f"ELSIF t < {(i // every + 1) * resolution:g} THEN pump := {plant.u[i]:.4f};")
    return "VAR t : REAL; END_VAR\n" + "\n".join(branches) + f"\nELSE pump := {plant.u[-1]:.4f}; END_IF;\nt := t + DT;"


def test_open_loop_timetables_fail_on_the_hidden_scenarios():
    # Fitted to the visible scenario, a timetable can pass it; the hidden scenarios have other setpoints
    # and event times (and plant parameters), so it cannot pass them.
    family = dataclasses.replace(FAMILY, max_nodes=100_000)
    passed_visible = 0
    for sample in FAMILY.sample(10, seed=2, level=1):
        schedule = st(timetable(sample, resolution=0.5))
        only_visible = dataclasses.replace(sample, extra=dict(sample.extra, scenarios=sample.extra["scenarios"][:1]))
        fits_visible = family.evaluate(only_visible, schedule).outcome == 1
        passed_visible += fits_visible
        ev = family.evaluate(sample, schedule)
        assert ev.outcome == 0 and (not fits_visible or "hidden" in ev.reason), (sample.id, ev)
    assert passed_visible >= 5  # so it is the hidden scenarios that block it
    # A feedforward from the setpoint alone (the plant model, no feedback) also fails on them.
    for sample, ev in evaluate_all(1, lambda s: f"pump := {s.extra['params']['k'] / s.extra['params']['q']:.4f} * SQRT(setpoint);"):
        assert ev.outcome == 0, sample.id


# ---------------------------------------------------------------------------------------------------------
# Parsing, the grade's shape, determinism.


@pytest.mark.parametrize("completion,reason", [
    ("I would use a PI controller.", "no code block found"),
    (st("WHILE level < setpoint DO pump := 1.0; END_WHILE;"), "WHILE loops: not in the supported"),
    (st("pump := 1.0"), "ends too early"),
    (st("valve := TRUE; pump := 0.5;"), "'valve' is not declared"),
    (st("level := 0.5; pump := 0.5;"), "'level' is an input"),
    (st("x := 1.0;"), "'x' is not declared"),
    (st("VAR x : REAL; END_VAR x := 1.0;"), "never assigns the output 'pump'"),
])
def test_parse_failures_have_a_clear_reason(completion, reason):
    sample = FAMILY.sample(1, seed=0, level=1)[0]
    grade = FAMILY.grade(sample, completion)
    assert grade.outcome == 0 and not any(s.correct for s in grade.steps)
    assert reason in grade.steps[0].written
    assert grade.committed == ("```" in completion)


def test_steps_carry_the_code_span_and_the_failing_stage_its_reason():
    sample = FAMILY.sample(1, seed=0, level=1)[0]
    completion = st("pump := SQRT(level - 100.0);")
    grade = FAMILY.grade(sample, completion)
    code_start = completion.index("pump")
    assert grade.steps[0].correct and grade.steps[0].span[0] == code_start
    assert grade.steps[1].span == grade.steps[0].span and "must be finite" in grade.steps[1].written
    assert grade.steps[2].span is None and grade.steps[3].span is None


def test_grading_is_deterministic_and_survives_json():
    import json

    for level in FAMILY.levels:
        sample = FAMILY.sample(1, seed=4, level=level)[0]
        back = FAMILY.sample_from_dict(json.loads(json.dumps(sample.to_dict())))
        bad = st(reference_body(sample).replace("0.0", "0.1", 1))
        assert FAMILY.evaluate(sample, bad) == FAMILY.evaluate(back, bad)


def test_tightness_knob_makes_the_spec_stricter():
    loose, tight = FAMILY.sample(1, seed=0, level=2)[0], tasks.get("controller", tightness=0.5).sample(1, seed=0, level=2)[0]
    assert tight.extra["spec"]["settle"] == loose.extra["spec"]["settle"] / 2
    assert tight.extra["scenarios"] == loose.extra["scenarios"]
