import json
import sys
from importlib import resources

import pytest

from cohortrl import tasks
from cohortrl.tasks import gsm8k

NATALIA = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
              "in April and May.\n#### 72",
}
WENG = {
    "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                "How much did she earn?",
    "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
              "$<<0.2*50=10>>10.\n#### 10",
}
LONG = {  # five calculations, one of them an identity the dataset writes (dropped from the steps)
    "question": "A shop has 3 boxes of 12 pens and sells 10 pens on each of 2 days. Then 1 more box of 12 arrives. "
                "How many pens are there?",
    "answer": "<<3*12=36>>36 pens. <<10*2=20>>20 sold. <<36-20=16>>16 left. <<1*12=12>>12 arrive. "
              "<<16+12=28>>28.\n#### 28",
}


def _clear_caches():
    for cached in (gsm8k.load_rows, gsm8k.problems, gsm8k.pool, gsm8k.permutation):
        cached.cache_clear()


@pytest.fixture
def tiny_gsm8k(tmp_path, monkeypatch):
    """A three-problem GSM8K in a temporary directory, found through COHORTRL_GSM8K_DIR."""
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in (NATALIA, WENG, LONG)) + "\n")
    monkeypatch.setenv("COHORTRL_GSM8K_DIR", str(tmp_path))
    _clear_caches()
    yield tmp_path
    _clear_caches()


def test_the_environment_variable_wins(tiny_gsm8k):
    assert gsm8k.local_data_dir() == tiny_gsm8k
    family = tasks.get("gsm8k")
    level1 = family.sample(4, seed=0, level=1)  # two problems with 1-2 calculations, wrapping around
    assert {s.answer for s in level1} == {"72", "10"}
    assert [s.answer for s in family.sample(2, seed=0, level=3)] == ["28", "28"]  # the 5-calculation one
    assert family.sample(1, seed=0, level=4)[0].extra["split"] == "test"


def test_reference_steps_come_from_the_annotations(tiny_gsm8k):
    sample = next(s for s in tasks.get("gsm8k").sample(2, seed=0, level=1) if s.answer == "72")
    assert [st.key for st in sample.steps] == ["48/2=24", "48+24=72"]
    assert sample.reference_solution == "48/2 = 24\n48+24 = 72\nANSWER: 72"
    long = tasks.get("gsm8k").sample(1, seed=0, level=3)[0]
    assert "1*12=12" not in [st.key for st in long.steps]  # an identity computes nothing


def test_grading_a_worked_answer(tiny_gsm8k):
    family = tasks.get("gsm8k")
    sample = next(s for s in family.sample(2, seed=0, level=1) if s.answer == "72")
    # Free text around the statements is fine, and so are spaces, "$" and a word after the answer.
    response = "In May she sold 48 / 2 = 24 clips.\nAltogether 48 + 24 = $72 of clips.\nANSWER: 72 clips"
    g = family.grade(sample, response)
    assert (g.outcome, g.step_credit, g.score) == (1.0, 1.0, 1.0)
    start, end = g.steps[1].span
    assert response[start:end] == "48 + 24 = $72"
    # An arithmetic slip loses the step; the answer still counts.
    g = family.grade(sample, "48/2 = 25\n48 + 24 = 72\nANSWER: 72")
    assert (g.outcome, [s.correct for s in g.steps]) == (1.0, [False, True])
    # The answer without the work: outcome only.
    g = family.grade(sample, "ANSWER: 72")
    assert (g.outcome, g.step_credit, g.score) == (1.0, 0.0, 0.75)
    # A second number in the answer line is a hedge, even with no unit rule.
    assert family.grade(sample, "ANSWER: 72 or 80").outcome == 0.0
    assert family.grade(sample, "ANSWER: 72-80").outcome == 0.0
    # Work without an answer: nothing.
    assert family.grade(sample, "48/2 = 24\n48 + 24 = 72\nSo 72.").score == 0.0


def test_numbers_from_nowhere_are_not_grounded(tiny_gsm8k):
    family = tasks.get("gsm8k")
    sample = next(s for s in family.sample(2, seed=0, level=1) if s.answer == "72")
    # 20 + 4 = 24 has the right value, but neither 20 nor 4 is in the problem or derived: no credit.
    assert not family.grade(sample, "20 + 4 = 24\nANSWER: 72").steps[0].correct
    # 48 / 2 uses the dataset's own constant 2 ("half"): credited. 48 * 0.5 is right too, but 0.5 is in
    # neither the question nor the dataset's calculations, so it is not (the price of grounding).
    assert family.grade(sample, "48 / 2 = 24\nANSWER: 72").steps[0].correct
    assert not family.grade(sample, "48 * 0.5 = 24\nANSWER: 72").steps[0].correct


def test_the_packaged_copy_is_read_without_network_or_datasets(monkeypatch):
    monkeypatch.delenv("COHORTRL_GSM8K_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` would raise ImportError
    _clear_caches()
    try:
        rows = gsm8k.load_rows("test")
        assert len(rows) == 1319 and set(rows[0]) == {"question", "answer"}
        assert rows[0]["answer"].rsplit("####", 1)[-1].strip() == "18"  # Janet's ducks, the test split's first row
        licence = resources.files("cohortrl.tasks") / "gsm8k_data" / "LICENSE"
        assert "MIT License" in licence.read_text() and "OpenAI" in licence.read_text()
    finally:
        _clear_caches()


def test_a_directory_without_the_split_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("COHORTRL_GSM8K_DIR", str(tmp_path))
    _clear_caches()
    try:
        with pytest.raises(RuntimeError, match="has no train.jsonl.*unset it"):
            gsm8k.load_rows("train")
    finally:
        _clear_caches()


def test_real_data_levels():
    sizes = {level: len(gsm8k.pool(level)) for level in gsm8k.LEVELS}
    assert sum(sizes[l] for l in (1, 2, 3)) == 7473 and sum(sizes[l] for l in (4, 5, 6)) == 1319
    assert all(size > 200 for size in sizes.values())
    train = {s.extra["row"] for s in tasks.get("gsm8k").sample(50, seed=0, level=2)}
    assert len(train) == 50  # without replacement
