"""``cohortrl eval RUN_DIR`` evaluates a run's final/ with the run's own config and held-out set, and says which
set that is; ``evaluate()`` with nothing held out says so instead of reporting an accuracy of 0 over 0 prompts;
``cohortrl config show`` without a CONFIG prints the defaults."""

import json
from contextlib import closing

import pytest
import yaml

from cohortrl import Config, GRPOTrainer, cli
from cohortrl.config import ConfigError
from tests.trainers.test_grpo import tiny_config

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]


def completions(path) -> list[tuple[str, str]]:
    """(prompt, greedy completion) of each response in an evaluation's JSONL file."""
    return [(r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]), r["completion"])
            for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize("lora", [False, True])
def test_eval_run_dir_measures_final_on_the_runs_own_held_out_set(tmp_path, addition_jsonl, capsys, lora):
    cfg = tiny_config(addition_jsonl, train={"steps": 1}, eval={"n_prompts": 4, "batch_size": 4},
                      model={"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": lora, "r": 4}})
    run = tmp_path / "run"
    with closing(GRPOTrainer(cfg, run)) as trainer:
        trainer.train()
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--json", "--responses", str(tmp_path / "responses.jsonl")]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["eval/n"] == 4
    assert (f"evaluating {run / 'final'} with {run / 'config.yaml'} on 4 held-out prompts: those jsonl:{addition_jsonl} "
            "holds out (data.eval_size=8, train.seed=0)") in out.err
    # the run's own last evaluation: the same weights on the same problems, so the same greedy responses
    assert completions(tmp_path / "responses.jsonl") == completions(run / "eval_completions.jsonl")


def test_eval_run_dir_of_a_run_from_python_rows_uses_its_saved_held_out_rows(tmp_path, capsys):
    cfg = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4}, algorithm={"group_size": 2, "prompts_per_step": 2},
                 train={"steps": 1, "progress": False}, eval={"before": False, "n_prompts": 3},
                 reward={"functions": [{"name": "accuracy"}], "correctness": "accuracy"})
    run = tmp_path / "run"
    with closing(GRPOTrainer(cfg, run, train_dataset=ROWS[:5], eval_dataset=ROWS[5:])) as trainer:
        trainer.train()
    assert [json.loads(line) for line in (run / "eval_rows.jsonl").read_text().splitlines()] == ROWS[5:]
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--json", "--responses", str(tmp_path / "responses.jsonl")]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["eval/n"] == 3 and f"on 3 held-out prompts: {run / 'eval_rows.jsonl'}" in out.err
    assert completions(tmp_path / "responses.jsonl") == completions(run / "eval_completions.jsonl")


def test_eval_run_dir_without_final_says_how_to_finish_it(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(Config().to_yaml())
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"config error: {tmp_path} has no final/ (the run has not finished)")


def test_evaluate_with_nothing_held_out_says_so(tmp_path):
    cfg = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4}, algorithm={"group_size": 2, "prompts_per_step": 2},
                 train={"steps": 1, "progress": False})
    with closing(GRPOTrainer(cfg, tmp_path / "run", train_dataset=ROWS)) as trainer:  # own rows: nothing held out
        with pytest.raises(ConfigError, match=r"^nothing to evaluate: there are no held-out rows \(pass eval_dataset="):
            trainer.evaluate()


def test_config_show_without_a_config_prints_the_defaults(capsys):
    assert cli.main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# cohortrl's defaults (no CONFIG given") and yaml.safe_load(out) == Config().to_dict()
    assert cli.main(["config", "show", "algorithm.group_size=4"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["algorithm"]["group_size"] == 4


def test_an_evaluation_marks_and_scores_the_problems_kept_out_of_training_apart(tmp_path):
    from cohortrl.data import load_rows
    from cohortrl.trainers.evaluate import export_answers, read_answers
    from tests.test_sweep import CONFIG

    cfg = Config.from_yaml(CONFIG, ["train.steps=1", "train.progress=false", "eval.before=false", "eval.n_prompts=16"])
    answer = load_rows(cfg.data, cfg.train.seed)[1][0]["sample"]["answer"]  # a held-out problem's answer
    cfg = cfg.with_overrides(f"data.exclude_from_training={{answer: ['{answer}']}}")
    train, held_out = load_rows(cfg.data, cfg.train.seed)
    assert all(r["sample"]["answer"] != answer for r in train)
    run = tmp_path / "run"
    with closing(GRPOTrainer(cfg, run)) as trainer:
        trainer.train()
    rows = read_answers(run)
    assert [r["unseen"] for r in rows] == [r["sample"]["answer"] == answer for r in held_out]
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/n" in line][-1]
    for part, flag in (("unseen", True), ("seen", False)):
        right = [r["correct"] for r in rows if r["unseen"] is flag]
        assert final[f"eval/n_{part}"] == len(right) > 0
        assert final[f"eval/accuracy_{part}"] == sum(right) / len(right)
    (run / "eval_completions.jsonl").rename(tmp_path / "live.jsonl")
    assert [r["unseen"] for r in read_answers(run)] == [r["unseen"] for r in rows]  # kept in answers.jsonl.gz


def test_an_evaluation_of_a_mix_of_levels_scores_each_level_apart(tmp_path):
    from cohortrl.trainers.evaluate import read_answers

    cfg = tiny_config(None, train={"steps": 1}, eval={"n_prompts": 6, "before": False},
                      data={"source": "task:arithmetic", "levels": [1, 2], "train_size": 20, "eval_size": 6})
    run = tmp_path / "run"
    with closing(GRPOTrainer(cfg, run)) as trainer:
        trainer.train()
    rows = read_answers(run)
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/n" in line][-1]
    for level in (1, 2):
        right = [r["correct"] for r in rows if f"/L{level}/" in r["id"]]
        assert final[f"eval/n_level{level}"] == len(right) == 3
        assert final[f"eval/accuracy_level{level}"] == sum(right) / 3
    step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])  # the training step's row
    shares = [step[f"level{level}/advantage_share"] for level in (1, 2)]
    assert {f"level{level}/{name}" for level in (1, 2) for name in ("accuracy", "advantage_abs_mean")} <= set(step)
    assert None in shares or abs(sum(shares) - 1) < 1e-9


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_reference_is_zero_before_training_and_measured_after_by_the_trainer_and_by_cohortrl_eval(
        tmp_path, addition_jsonl, capsys, lora):
    """eval.kl_to_reference at β = 0 (no KL term, so the reference is built for the measurement): the policy equals
    its reference before the first step (LoRA's B starts at 0; a full run's reference is a copy), and differs after
    two steps at a large LR; ``cohortrl eval RUN_DIR`` measures the final model against the same start."""
    cfg = tiny_config(addition_jsonl, algorithm={"beta": 0.0}, train={"steps": 2},
                      eval={"before": True, "n_prompts": 4, "batch_size": 4, "pass_k": 2, "kl_to_reference": True},
                      model={"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": lora, "r": 4}})
    run = tmp_path / "run"
    with closing(GRPOTrainer(cfg, run)) as trainer:
        trainer.train()
    evaluations = [row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                   if "eval/kl_to_reference" in row]
    assert [row["step"] for row in evaluations] == [0, 2]
    assert abs(evaluations[0]["eval/kl_to_reference"]) < 1e-6 and abs(evaluations[0]["eval/kl_to_reference_per_response"]) < 1e-5
    assert evaluations[1]["eval/kl_to_reference"] > 1e-4
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/kl_to_reference"] > 1e-4


def test_kl_to_reference_needs_samples_and_a_start_to_measure_against(tmp_path, addition_jsonl, capsys):
    with pytest.raises(ConfigError, match="eval.kl_to_reference.*needs eval.pass_k > 0"):
        tiny_config(addition_jsonl, eval={"kl_to_reference": True})
    config = tmp_path / "config.yaml"
    config.write_text(tiny_config(addition_jsonl, eval={"kl_to_reference": True, "pass_k": 2}).to_yaml())
    assert cli.main(["eval", str(config)]) == 2
    assert "eval.kl_to_reference measures a trained model against the one it started from" in capsys.readouterr().err
