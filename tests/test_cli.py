"""The command line in a subprocess, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cohortrl", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def start(*args) -> subprocess.Popen:
    """``run`` without waiting: a command that runs beside the next ones (2 cores); ``communicate()`` collects it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "cohortrl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)


@pytest.mark.parametrize("sub", [[], ["train"], ["eval"], ["models"], ["plot"], ["report"], ["plan"], ["demo"], ["tasks"], ["tasks", "sample"], ["explain"]])
def test_every_subcommand_has_help(sub):
    out = run(*sub, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: cohortrl" in out.stdout


def test_config_error_exits_2_before_loading_a_model(tmp_path):
    out = run("train", str(REPO / "configs" / "tiny_grpo.yaml"), "--run-dir", str(tmp_path), "algorithm.group_sise=4")
    assert out.returncode == 2
    assert "config error: unknown config key 'algorithm.group_sise'; did you mean 'algorithm.group_size'?" in out.stderr
    assert not (tmp_path / "config.yaml").exists()


COMMON_KEYS = ("reward_mean", "loss", "kl", "grad_norm", "response_length_mean")


@pytest.mark.parametrize(
    "config, keys",
    [("tiny_grpo.yaml", COMMON_KEYS + ("entropy",)), ("tiny_ppo.yaml", COMMON_KEYS + ("value_loss", "kl_coef", "critic_grad_norm"))],
)
def test_train_stop_resume_continues_exactly_and_plots(tmp_path, config, keys):
    """A run stopped after step 2 (process ended) and resumed gives steps 3-4 equal to an uninterrupted run."""
    config = str(REPO / "configs" / config)
    full, split = tmp_path / "full", tmp_path / "split"
    reference = start("train", config, "--run-dir", str(full), "train.progress=false")  # beside the stopped run
    first = run("train", config, "--run-dir", str(split), "--steps", "2", "train.progress=false")
    assert first.returncode == 0, first.stderr
    resumed = run("train", "--run-dir", str(split), "--resume", "train.progress=false")
    assert resumed.returncode == 0, resumed.stderr
    assert "held-out greedy accuracy" in resumed.stdout
    _, err = reference.communicate(timeout=600)  # (reading the pipes as it ends: a full pipe would block it)
    assert reference.returncode == 0, err

    def train_rows(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}

    a, b = train_rows(full), train_rows(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in keys:
            assert abs(a[step][key] - b[step][key]) <= 1e-6, (step, key)
    again = run("train", "--run-dir", str(split), "--resume", "train.progress=false")
    assert again.returncode == 0 and "already done 4 step(s)" in again.stdout  # requeue-safe: a finished run is a success
    (split / "curves.png").unlink()
    assert run("plot", str(split)).returncode == 0 and (split / "curves.png").exists()


def test_models_lists_aliases():
    out = run("models")
    assert out.returncode == 0
    assert "smollm2-135m-instruct" in out.stdout and "tiny-llama" in out.stdout


def test_eval_a_trained_lora_adapter(tmp_path):
    config = str(REPO / "configs" / "tiny_grpo.yaml")
    lora = ["model.lora.enabled=true", "model.lora.r=4", "train.progress=false", "eval.n_prompts=8"]
    assert run("train", config, "--run-dir", str(tmp_path), "--steps", "1", *lora).returncode == 0
    assert (tmp_path / "final" / "adapter_config.json").exists()
    responses = tmp_path / "responses.jsonl"
    writer = start("eval", config, "--adapter", str(tmp_path / "final"), *lora, "--responses", str(responses))
    out = run("eval", config, "--adapter", str(tmp_path / "final"), *lora, "eval.pass_k=2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["eval/n"] == 8 and 0 <= result["eval/accuracy"] <= 1 and "eval/pass@2" in result
    # every failed greedy response has exactly one error category (arithmetic is graded by keyed steps)
    errors = sum(v for k, v in result.items() if k.startswith("eval/error/"))
    assert errors == pytest.approx(1 - result["eval/accuracy"])
    # the trainer kept each evaluation's responses; `eval --responses` writes them too, never over a file
    kept = [json.loads(line) for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in kept}) == [0, 1] and len(kept) == 16
    _, err = writer.communicate(timeout=600)
    assert writer.returncode == 0, err
    rows = [json.loads(line) for line in responses.read_text().splitlines()]
    assert len(rows) == 8 and all((r["category"] in ("correct", "unsupported")) == r["correct"] for r in rows)
    assert rows == [{k: r[k] for k in rows[0]} for r in kept if r["step"] == 1]  # the run's final evaluation, again
    again = run("eval", config, "--adapter", str(tmp_path / "final"), *lora, "--responses", str(responses))
    assert again.returncode != 0 and "already exists" in again.stderr
