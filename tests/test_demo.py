"""``cohortrl demo`` (``make demo``) on tiny stand-in configs: the first run trains and caches the warm start, a
second reuses it without training, both print the before/after numbers; phases that would not be evaluated
alike are refused before any model loads. The shipped configs' held-out sets agree."""

import json
import re
import shutil

import pytest
import yaml

from cohortrl import cli
from cohortrl.demo import check_same_evaluation
from cohortrl.stats import mcnemar_exact
from cohortrl.trainers.evaluate import read_answers
from cohortrl.trainers.sft import SFTTrainer

COMMON = {
    "model": {"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": True, "r": 4}},
    "data": {"source": "task:arithmetic", "seed": 0, "train_size": 24, "eval_size": 4},
    "reward": {"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
    "sampling": {"max_new_tokens": 4},
}
SFT = {**COMMON, "optim": {"lr": 1e-2}, "sft": {"batch_size": 4},
       "train": {"steps": 2, "progress": False}, "eval": {"before": True, "n_prompts": 4, "batch_size": 4}}
GRPO = {**COMMON, "algorithm": {"group_size": 2, "prompts_per_step": 2},
        "train": {"steps": 1, "progress": False}, "eval": {"before": False, "n_prompts": 4, "batch_size": 4}}
NUMBER = r"\d\.\d{3} \(95% CI \d\.\d{3}-\d\.\d{3}, n=4\)"


@pytest.fixture
def demo(tmp_path, monkeypatch, capsys):
    """``cohortrl demo`` with the stand-in configs, COHORTRL_HOME and the working directory in tmp_path."""
    monkeypatch.setenv("COHORTRL_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for name, config in (("sft.yaml", SFT), ("grpo.yaml", GRPO)):
        (tmp_path / name).write_text(yaml.safe_dump(config))

    def run(*args):
        code = cli.main(["demo", "--sft-config", "sft.yaml", "--grpo-config", "grpo.yaml", *args])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def test_first_run_trains_the_warm_start_and_the_second_reuses_it(demo, tmp_path, monkeypatch):
    code, out, err = demo("--run-dir", "runs/a")
    assert code == 0, err
    assert "warm start: training it (2 SFT steps; none cached yet); it will be cached in" in out
    summary = out[out.index("summary:"):]
    assert re.search(rf"base model \(tiny-llama\)\s+{NUMBER}  \[the warm start's step-0 evaluation, this run\]", summary)
    assert re.search(rf"after the warm start \(2 SFT steps\)\s+{NUMBER}  \[its final evaluation, this run\]", summary)
    assert re.search(rf"after GRPO \(1 step\)\s+{NUMBER}  \[this run\]", summary)
    assert "GRPO starts from the warm start: its 'before' is the warm start's line" in summary
    run = tmp_path / "runs" / "a"
    assert (run / "demo_summary.txt").read_text().strip() == summary.strip()
    assert (run / "curves.png").is_file() and (run / "warm_start_curves.png").is_file()
    assert (run / "demo_accuracy.png").is_file() and "plot: runs/a/demo_accuracy.png" in summary
    [cached] = (tmp_path / "home" / "demo").iterdir()
    # the paired line, recomputed from the two runs' own answer files
    warm = {r["id"]: r["correct"] for r in read_answers(cached) if r["step"] == 2}
    after = {r["id"]: r["correct"] for r in read_answers(run) if r["step"] == 1}
    assert sorted(warm) == sorted(after) and len(warm) == 4
    only_warm = sum(warm[i] and not after[i] for i in warm)
    only_rl = sum(after[i] and not warm[i] for i in warm)
    assert (f"paired on the same 4 problems: only the warm start right {only_warm}, only after GRPO right {only_rl}; "
            f"exact McNemar p = {mcnemar_exact(only_warm, only_rl):.3g}") in summary
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["init"] == str(cached / "final")

    def refuse(self, steps=None):
        raise AssertionError("the warm start was trained again")
    monkeypatch.setattr(SFTTrainer, "train", refuse)
    code, again, err = demo("--run-dir", "runs/b")
    assert code == 0, err
    assert f"warm start: reusing the run cached in {cached}, trained " in again
    second = again[again.index("summary:"):]
    cached_line = re.compile(r"after the warm start .*\[its final evaluation, measured when the cached warm start was trained, [-\d: ]+\]")
    assert cached_line.search(second)
    # the warm start's numbers are the cached run's, the same in both summaries
    assert [line.split("[")[0] for line in second.splitlines()[1:3]] == [line.split("[")[0] for line in summary.splitlines()[1:3]]
    assert (tmp_path / "runs" / "b" / "curves.png").is_file()

    # a damaged cache is not used: it is trained again (here: refused training proves the attempt)
    shutil.rmtree(cached / "final")
    with pytest.raises(AssertionError, match="trained again"):
        demo("--run-dir", "runs/c")


def test_the_base_model_can_be_measured_on_the_first_n_held_out_problems(demo, tmp_path):
    """eval.before_n_prompts: the step-0 evaluation on the first N held-out problems only (its answers and n say so),
    every later one on all of them; the summary says which lines are on fewer."""
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({**SFT, "eval": {**SFT["eval"], "before_n_prompts": 2}}))
    code, out, err = demo("--run-dir", "runs/a")
    assert code == 0, err
    summary = out[out.index("summary:"):]
    assert "the base model on the first 2 of them (eval.before_n_prompts)" in summary.splitlines()[0]
    assert re.search(r"base model \(tiny-llama\)\s+\d\.\d{3} \(95% CI \d\.\d{3}-\d\.\d{3}, n=2\)", summary)
    assert re.search(rf"after the warm start \(2 SFT steps\)\s+{NUMBER}", summary)
    [cached] = (tmp_path / "home" / "demo").iterdir()
    answers = read_answers(cached)
    first = [r["id"] for r in answers if r["step"] == 2][:2]
    assert [r["id"] for r in answers if r["step"] == 0] == first  # the first two of the same held-out problems


def test_eval_before_n_prompts_outside_1_to_n_prompts_is_refused():
    from cohortrl.config import Config, ConfigError

    for bad in (0, 5):
        with pytest.raises(ConfigError, match=r"eval.before_n_prompts.*between 1 and eval.n_prompts \(4\)"):
            Config.from_dict({**SFT, "eval": {**SFT["eval"], "before_n_prompts": bad}})


def test_phases_that_would_not_be_evaluated_alike_are_refused_before_any_model_loads(demo, tmp_path, monkeypatch):
    monkeypatch.setattr(SFTTrainer, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    code, _, err = demo("data.seed=1")  # the GRPO phase's held-out problems would be other ones
    assert code == 2 and "they differ in: held-out problems (data.*, eval.n_prompts)" in err
    code, _, err = demo("--sft", "model.system_prompt=Be brief.")
    assert code == 2 and "they differ in: model.system_prompt" in err
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "metrics.jsonl").write_text("")
    code, _, err = demo("--run-dir", "runs/x")  # refused now, not after the warm start trained
    assert code == 2 and "runs/x already holds a run" in err
    code, _, err = demo("--arithmetic", "--fresh")
    assert code == 2 and "--arithmetic runs GRPO alone" in err


def test_the_shipped_demo_configs_share_their_held_out_problems():
    sft = cli._load_config(str(cli.REPO_CONFIGS / "demo_sft.yaml"), [])
    grpo = cli._load_config(str(cli.REPO_CONFIGS / "demo_grpo.yaml"), [])
    check_same_evaluation(sft, grpo)  # raises if not
    assert sft.eval.before and not grpo.eval.before and grpo.model.init is None  # the demo sets model.init


def test_arithmetic_runs_the_earlier_grpo_only_demo(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(cli, "cmd_train", lambda ns: seen.append(ns) or 0)
    assert cli.main(["demo", "--arithmetic", "--run-dir", str(tmp_path / "r"), "train.steps=3"]) == 0
    [ns] = seen
    assert ns.config == str(cli.REPO_CONFIGS / "demo_arithmetic.yaml") and ns.overrides == ["train.steps=3"]
    assert ns.run_dir == str(tmp_path / "r") and not ns.resume


def test_the_study_line_is_recomputed_from_the_studys_committed_files(tmp_path):
    """The demo's line on its controls reads the committed study (each seed's last evaluation), not numbers
    written into the code; arms not committed are left out, and no study at all gives no line."""
    from cohortrl.demo import study_line

    def sweep(folder: str, accuracies: dict[int, float]) -> None:
        root = tmp_path / folder
        root.mkdir()
        (root / "sweep.json").write_text(json.dumps({"config": "c.yaml", "command": "train", "grid": {},
                                                     "seeds": sorted(accuracies), "overrides": []}))
        lines = []
        for seed, acc in accuracies.items():
            run = root / "base" / f"seed{seed}"
            run.mkdir(parents=True)
            rows = [{"step": 10, "eval/accuracy": 0.0, "eval/n": 200}, {"step": 20, "eval/accuracy": acc, "eval/n": 200}]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            lines.append(json.dumps({"run": str(run), "arm": "base", "seed": seed, "attempt": "start", "rc": 0,
                                     "wall_s": 1.0, "cpu_s": 1.0}) + "\n")
        (root / "sweep.jsonl").write_text("".join(lines))

    arms = (("g", "GRPO"), ("c", "more SFT"), ("r", "RFT"))
    assert study_line(tmp_path, arms, "docs/x.md") is None
    sweep("g", {0: 0.24, 1: 0.525})
    sweep("c", {0: 0.0, 1: 0.0})
    assert study_line(tmp_path, arms, "docs/x.md") == (
        "the same design with controls (docs/x.md, held-out accuracy per seed): GRPO 0.240, 0.525 (2 seeds, step 20); "
        "more SFT 0.000, 0.000 (2 seeds, step 20)")
