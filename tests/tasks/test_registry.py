"""The contract other code relies on: one test iterates every registered family."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from cohortrl import tasks
from cohortrl.tasks import Grade, Sample, StepResult

from .helpers import CODE_FAMILIES, FAMILIES


def test_names():
    assert tasks.names() == ["arithmetic", "axial_stress", "beam_bending", "controller", "gsm8k",
                             "python_function", "truss"]


def test_unknown_name_suggests_the_nearest():
    with pytest.raises(KeyError, match="did you mean 'truss'"):
        tasks.get("trusss")


def test_knobs_override_a_copy():
    loose = tasks.get("axial_stress", rel_tol=0.05, step_weight=0.5)
    assert (loose.rel_tol, loose.step_weight) == (0.05, 0.5)
    assert tasks.get("axial_stress").rel_tol == 0.01


@pytest.mark.parametrize("name", FAMILIES)
def test_family_contract(name):
    family = tasks.get(name)
    assert family.levels == tuple(range(1, len(family.levels) + 1))
    doc = sys.modules[type(family).__module__].__doc__
    assert f"[{name}]" in doc and "Levels" in doc
    for level in family.levels:
        batch = family.sample(4, seed=5, level=level)
        assert [s.to_dict() for s in batch] == [s.to_dict() for s in family.sample(4, seed=5, level=level)]
        assert batch[2].to_dict() == family.sample(3, seed=5, level=level)[2].to_dict()  # prefix-stable
        assert [s.prompt for s in batch] != [s.prompt for s in family.sample(4, seed=6, level=level)]
        for s in batch:
            assert (s.family, s.level, s.seed) == (name, level, 5) and s.id
            # The answer-format families ask for an ANSWER line, the code families for a code block.
            assert isinstance(s.prompt, str) and ("ANSWER" in s.prompt if name not in CODE_FAMILIES else "```" in s.prompt)
            # A dataset row: every field, as dataclasses.asdict writes it (to_dict spells the fields out for speed),
            # through JSON and back, and it still grades the same.
            row = s.to_dict()
            assert row == dataclasses.asdict(s) and list(row) == list(dataclasses.asdict(s)) and row["extra"] is not s.extra
            row = json.loads(json.dumps(row))
            back = family.sample_from_dict(row)
            assert back == s == Sample.from_dict(row)
            g = family.grade(back, s.reference_solution)
            assert isinstance(g, Grade) and all(isinstance(r, StepResult) for r in g.steps)
            assert g.outcome == 1.0 and len(g.steps) == len(s.steps)
    with pytest.raises(ValueError):
        family.sample(1, seed=0, level=99)


def test_a_sample_id_names_the_problem_it_was_made_as():
    """``tasks.sample_from_id`` makes a committed answer's problem again from its id alone (how ``cohortrl report
    --answer-checks`` grades old answers); ids that name no family are not gym problems."""
    for name in tasks.names():
        family = tasks.get(name)
        for level in family.levels:
            s = family.sample(4, seed=1000003, level=level)[3]
            assert tasks.sample_from_id(s.id) == s
    for other in ("sha1:0123456789abcdef", "nosuchfamily/L1/s0/0", "arithmetic/L1/s0", "arithmetic/L1/s0/0/extra"):
        assert tasks.sample_from_id(other) is None


def test_a_sample_of_another_family_is_refused():
    row = tasks.get("arithmetic").sample(1)[0].to_dict()
    with pytest.raises(ValueError):
        tasks.get("truss").sample_from_dict(row)


def test_lowest_arithmetic_level_is_short_and_small():
    # SmolLM2-135M must succeed sometimes here: one operation on single digits, format asked in the prompt.
    for s in tasks.get("arithmetic").sample(200, seed=0, level=1):
        assert len(s.prompt) < 80 and s.steps == []
        assert s.prompt.startswith("What is ") and "ANSWER: <number>" in s.prompt
        assert s.reference_solution == f"ANSWER: {s.answer}"
