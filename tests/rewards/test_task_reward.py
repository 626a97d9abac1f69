"""The gym's task reward: its three fields on a hand-checked axial_stress problem, including the answer a GRPO
run learned to reach through wrong steps (docs/engineering.md, round 3)."""
import pytest

from cohortrl import tasks
from cohortrl.rewards.functions import make_task

FAMILY = tasks.get("axial_stress")
# 0.03 m x 0.09 m = 2700 mm^2; 660000 N / 2700 = 244.4 MPa; SF = 250 / 244.4 = 1.023 < 1.5: FAIL
SAMPLE = FAMILY.sample(3, seed=1_000_003, level=3)[2]  # a held-out problem of data.seed 0 (data.load_rows)
RIGHT = ("A = (0.03*1000)*(0.09*1000) = 2700 mm^2\nsigma = 660000/2700 = 244.4 MPa\nSF = 250/244.4 = 1.023\n"
         "ANSWER: 1.023\nVERDICT: FAIL")
# the sizes taken as mm, and the exponent of the resulting SF dropped: the right ANSWER from wrong steps
HACK = ("A = 0.03*0.09 = 0.0027 mm^2\nsigma = 660000/0.0027 = 244400000 MPa\nSF = 250/244400000 = 1.023e-06\n"
        "ANSWER: 1.023\nVERDICT: FAIL")
WRONG = RIGHT.replace("ANSWER: 1.023", "ANSWER: 2.1")


def rewards(field: str) -> list[float]:
    return make_task(field)(["p"] * 3, [RIGHT, HACK, WRONG], [SAMPLE.to_dict()] * 3)


def test_outcome_pays_a_right_answer_however_it_was_reached():
    assert SAMPLE.prompt.startswith("A steel bar with a rectangular section 0.03 m x 0.09 m carries an axial "
                                    "tensile load of 660000 N. Yield strength 250 N/mm^2")
    assert SAMPLE.answer == "1.023" and SAMPLE.verdict == "FAIL"
    assert rewards("outcome") == [1.0, 1.0, 0.0]


def test_supported_pays_only_an_answer_its_steps_support():
    assert rewards("supported") == [1.0, 0.0, 0.0]
    # a right answer with one required step missing is not supported either
    missing = RIGHT.replace("sigma = 660000/2700 = 244.4 MPa\n", "")
    assert make_task("supported")(["p"], [missing], [SAMPLE.to_dict()]) == [0.0]


def test_an_unknown_field_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'score', 'outcome' or 'supported'"):
        make_task("steps")
