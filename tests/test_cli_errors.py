"""Every input mistake the command line meets exits with code 2 and one line, no traceback unless -v; and the
small commands a new user reaches for first (--version, config show, eval's table) work."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cohortrl import Config, GRPOTrainer, cli
from cohortrl.cli import _PrintEvaluations

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_grpo.yaml")


def run(*args, cwd, env=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "cohortrl", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


MISTAKES = [
    (["train", TINY, "--run-dir", "r", "data.source=task:nope"],
     "error: data.source 'task:nope': no task family 'nope' (known: "),
    (["train", TINY, "--run-dir", "r", "data.level=99"],
     "error: data.level=99: arithmetic has levels [1, 2, 3, 4, 5], not 99; set data.level to one of them"),
    (["train", TINY, "--run-dir", "r", "model.name=tiny-lama"],
     "error: unknown model 'tiny-lama': did you mean 'tiny-llama'? Known aliases: smollm2-135m-instruct, tiny-llama"),
    (["train", TINY, "--run-dir", "r", "num_generations=4"],
     "config error: unknown config key 'num_generations': 'num_generations' is TRL's name; cohortrl's is 'algorithm.group_size'"),
    (["train", TINY, "--run-dir", "r", "reward.functions=[{name: nope.py:f}]", "reward.correctness=nope.py:f"],
     "error: reward function file not found: nope.py"),
    (["tasks", "sample", "nope", "--n", "1"], "error: no task family 'nope' (known: "),
    (["tasks", "sample", "arithmetic", "--level", "9", "--n", "1"], "error: arithmetic has levels [1, 2, 3, 4, 5], not 9"),
    (["eval", TINY, "--adapter", "missing_dir"], "config error: --adapter missing_dir: no such directory"),
]


@pytest.mark.parametrize("argv, start", MISTAKES, ids=[" ".join(a[-2:]) for a, _ in MISTAKES])
def test_input_mistakes_exit_2_with_one_line(tmp_path, argv, start):
    out = run(*argv, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("loading model")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith(start), out.stderr
    assert not (tmp_path / "r").exists()  # a failed start leaves no run directory


@pytest.mark.parametrize("package, override", [("vllm", "sampling.backend=vllm"), ("tensorboard", "train.tensorboard=true"),
                                               ("wandb", "train.wandb=true")])
def test_a_setting_that_needs_a_missing_package_is_refused_before_loading(tmp_path, package, override):
    # Whether or not the package is installed here, the subprocess sees it as missing: a None entry in
    # sys.modules is what importlib.util.find_spec reports as "not found".
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    out = run("train", TINY, "--run-dir", "r", override, cwd=tmp_path,
              env={"PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith(f"config error: config key '{override.split('=')[0]}' = ")
    assert f"needs the {package} package, which is not installed" in out.stderr and "Traceback" not in out.stderr


def test_verbose_shows_the_traceback(tmp_path):
    out = run("-v", "train", TINY, "--run-dir", "r", "data.level=99", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback (most recent call last)" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: data.level=99")


def test_version_and_config_show(tmp_path):
    version = run("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == "cohortrl 0.1.0"
    shown = run("config", "show", TINY, "algorithm.group_size=3", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    full = Config.from_yaml(TINY, ["algorithm.group_size=3"])
    import yaml

    assert yaml.safe_load(shown.stdout) == full.to_dict()  # every section and default, overrides applied
    assert "optim:" in shown.stdout and "max_nonfinite_steps:" in shown.stdout


def test_eval_prints_a_table_or_json(tmp_path):
    table = run("eval", TINY, "eval.n_prompts=2", "eval.batch_size=2", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == "held-out evaluation of tiny-llama"
    assert any(line.split()[:1] == ["accuracy"] and "95% CI" in line for line in table.stdout.splitlines())
    assert "held-out evaluation: 2/2 prompts (greedy)" in table.stderr  # progress, on stderr
    raw = run("eval", TINY, "eval.n_prompts=2", "eval.batch_size=2", "--json", cwd=tmp_path)
    assert json.loads(raw.stdout)["eval/n"] == 2


def test_eval_adapter_on_a_full_fine_tune_says_what_to_do(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    out = run("eval", TINY, "--adapter", str(final), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"config error: --adapter {final} holds a full model (a run without LoRA), not an adapter; "
                                  f"evaluate it with model.name={final} instead of --adapter")


def test_each_evaluation_is_printed_when_it_finishes(tmp_path, capsys):
    seen_at_step = {}

    class Watch:
        def on_step_end(self, trainer, metrics):
            seen_at_step[metrics["step"]] = capsys.readouterr().out

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    cfg = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4}, algorithm={"group_size": 2, "prompts_per_step": 2},
                 train={"steps": 2, "progress": False}, eval={"before": True, "every": 1, "n_prompts": 2, "batch_size": 2})
    GRPOTrainer(cfg, tmp_path / "run", train_dataset=rows, eval_dataset=rows[:2], callbacks=[_PrintEvaluations(), Watch()]).train()
    # the evaluation before training is on screen by the end of step 1, step 1's by the end of step 2
    assert seen_at_step[1].startswith("step    0: held-out greedy accuracy")
    assert seen_at_step[2].startswith("step    1: held-out greedy accuracy")


def test_main_in_a_running_process_prints_progress_once_and_leaves_the_logger_as_it_was(monkeypatch, capsys):
    """A handler left on the progress logger printed each line once more per earlier call, and later wrote to the
    stderr of a test that had ended ("I/O operation on closed file")."""
    progress = logging.getLogger("cohortrl.progress")
    before = (list(progress.handlers), progress.level, progress.propagate)
    monkeypatch.setattr(cli, "cmd_models", lambda args: progress.info("loading model x") or 0)
    for _ in range(2):
        assert cli.main(["models"]) == 0
        assert capsys.readouterr().err == "loading model x\n"
    assert (list(progress.handlers), progress.level, progress.propagate) == before
