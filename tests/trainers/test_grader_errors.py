"""A built-in grader that raises does not stop a run (issue 27): the sample scores 0, the step's
``grader_errors`` counts it and ``RUN_DIR/grader_errors.jsonl`` holds its prompt, completion and traceback.
A user's own reward function that raises still stops the run (tests/trainers/test_grpo*.py)."""

import json
from collections import Counter

from cohortrl import tasks
from cohortrl.config import Config
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.metrics import read_metrics


def test_a_broken_builtin_grader_case_scores_zero_is_counted_and_saved(tmp_path, monkeypatch):
    family = type(tasks.get("arithmetic"))
    real_grade = family.grade

    def grade(self, sample, completion):  # deliberately broken on about half of the responses
        if len(completion) % 2:
            raise ZeroDivisionError("a grader bug on odd-length responses")
        return real_grade(self, sample, completion)

    monkeypatch.setattr(family, "grade", grade)
    cfg = Config.from_dict({
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": "task:arithmetic", "train_size": 16, "eval_size": 4},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": "task"}], "correctness": "task"},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        "train": {"steps": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 4, "batch_size": 4},
    })
    trainer = GRPOTrainer(cfg, tmp_path)
    rows = trainer.train()

    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2  # the run finished
    saved = [json.loads(line) for line in (tmp_path / "grader_errors.jsonl").read_text().splitlines()]
    counted = sum(r["grader_errors"] for r in steps) + sum(r.get("eval/grader_errors", 0) for r in rows)
    assert counted > 0 and counted == len(saved)
    assert sum(r["grader_errors"] for r in read_metrics(tmp_path) if "loss" in r) == sum(r["grader_errors"] for r in steps)
    first = saved[0]
    assert len(first["completion"]) % 2 == 1 and first["prompt"].startswith("What is")
    assert first["step"] in (1, 2) and first["reward"] == "task"
    # each saved failure is tagged with the step whose row counted it (a step's, or an evaluation's after that step)
    expected = Counter()
    for r in rows:
        expected[r["step"]] += r.get("grader_errors", 0) + r.get("eval/grader_errors", 0)
    assert Counter(e["step"] for e in saved) == +expected
    assert "ZeroDivisionError: a grader bug" in first["error"] and "raise ZeroDivisionError" in first["traceback"]
    # The failing samples scored 0: every step's mean task reward is at most the share that did not fail.
    for r in steps:
        assert r["reward/task_mean"] <= 1 - r["grader_errors"] / 8 + 1e-9
