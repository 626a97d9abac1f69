"""TRL's documented quickstart scripts run with nothing changed but the import (``from trl import`` becomes
``from cohortrl import``). The hub stand-ins are built here: the model id resolves, offline, to the tiny
random Llama saved in a Hugging Face cache laid out as the hub client writes it, and ``load_dataset`` returns
rows in the named dataset's columns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cohortrl import Config, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from cohortrl.config import ConfigError
from cohortrl.trainers.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent

# TRL's README, "GRPOTrainer" (TRL v0.14 to v0.2x), as written.
GRPO_QUICKSTART = '''\
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", logging_steps=10)
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''

# TRL's README, "SFTTrainer", as written.
SFT_QUICKSTART = '''\
from trl import SFTTrainer
from datasets import load_dataset

dataset = load_dataset("trl-lib/Capybara", split="train")

trainer = SFTTrainer(
    model="Qwen/Qwen2.5-0.5B",
    train_dataset=dataset,
)
trainer.train()
'''

# TRL's docs, sft_trainer.md "Quick start" with its SFTConfig.
SFT_CONFIG_QUICKSTART = '''\
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

dataset = load_dataset("trl-lib/Capybara", split="train")
training_args = SFTConfig(output_dir="Qwen2.5-0.5B-SFT")
trainer = SFTTrainer(
    model="Qwen/Qwen2.5-0.5B",
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''

TLDR = [{"prompt": f"SUBREDDIT: r/test\nTITLE: post {i}\nPOST: the answer is {i}\nTL;DR:", "completion": f" answer {i}"}
        for i in range(2)]
CAPYBARA = [{"source": "test", "messages": [{"content": f"What is {i} + 1?", "role": "user"},
                                            {"content": f"The answer is {i + 1}.", "role": "assistant"}]}
            for i in range(8)]

# Runs a script as `python SCRIPT` would, with datasets.load_dataset standing in for the hub.
RUNNER = '''\
import json, sys
import datasets
name, rows = sys.argv[2], json.load(open(sys.argv[3]))
def load_dataset(path, *args, split=None, **kwargs):
    assert path == name and split == "train", (path, split)
    return datasets.Dataset.from_list(rows)
datasets.load_dataset = load_dataset
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), {"__name__": "__main__"})
'''


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding the tiny Llama under the quickstarts' model ids."""
    from cohortrl.models import build_tiny_model

    cache = tmp_path_factory.mktemp("hub")
    model, tokenizer = build_tiny_model("tiny-llama")
    for repo in ("Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-0.5B"):
        commit = "0" * 40
        root = cache / f"models--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)
        model.save_pretrained(root / "snapshots" / commit)
        tokenizer.save_pretrained(root / "snapshots" / commit)
    return cache


def run_script(trl_script: str, dataset: str, rows: list[dict], tmp_path: Path, hub_cache: Path):
    script = trl_script.replace("from trl import", "from cohortrl import")
    changed = [(a, b) for a, b in zip(trl_script.splitlines(), script.splitlines()) if a != b]
    assert len(changed) == 1 and changed[0][0].startswith("from trl import")  # the one changed line
    (tmp_path / "script.py").write_text(script)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", RUNNER, "script.py", dataset, "rows.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)


def test_trls_grpo_quickstart_runs_with_only_the_import_changed(tmp_path, hub_cache):
    done = run_script(GRPO_QUICKSTART, "trl-lib/tldr", TLDR, tmp_path, hub_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "Qwen2-0.5B-GRPO"  # output_dir is the run directory
    assert (run / "final" / "model.safetensors").is_file()
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    # TRL's defaults: 8 completions per prompt, 8 per device batch (1 prompt a step), 3 epochs of the 2 rows,
    # lr 1e-6, no KL term, the DAPO token-mean loss, 512 new tokens, seed 42; no system message added.
    assert cfg["model"]["name"] == "Qwen/Qwen2-0.5B-Instruct" and cfg["model"]["system_prompt"] is None
    assert (cfg["algorithm"]["group_size"], cfg["algorithm"]["prompts_per_step"], cfg["train"]["steps"]) == (8, 1, 6)
    assert (cfg["optim"]["lr"], cfg["algorithm"]["beta"], cfg["algorithm"]["aggregation"]) == (1e-6, 0.0, "token-mean")
    assert (cfg["sampling"]["max_new_tokens"], cfg["train"]["seed"], cfg["optim"]["schedule"]) == (512, 42, "linear")
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert ("GRPOConfig: logging_steps=10 has no effect in cohortrl: every step is logged to RUN_DIR/metrics.jsonl"
            in done.stderr)


@pytest.mark.parametrize("script, out", [(SFT_QUICKSTART, None), (SFT_CONFIG_QUICKSTART, "Qwen2.5-0.5B-SFT")])
def test_trls_sft_quickstarts_run_with_only_the_import_changed(tmp_path, hub_cache, script, out):
    done = run_script(script, "trl-lib/Capybara", CAPYBARA, tmp_path, hub_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = [tmp_path / out] if out else list((tmp_path / "runs").glob("sft-*"))  # without output_dir: runs/sft-TIME
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["name"] == "Qwen/Qwen2.5-0.5B" and cfg["data"]["source"] == "python:train_dataset"
    if out:  # SFTConfig's defaults: lr 2e-5, 8 rows a step, 3 epochs of the 8 rows
        assert (cfg["optim"]["lr"], cfg["sft"]["batch_size"], cfg["train"]["steps"]) == (2e-5, 8, 3)
    assert (run / "final" / "model.safetensors").is_file()


ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def test_trls_positional_order_and_todays_order_both_work(tmp_path):
    """GRPOTrainer(model, reward_funcs, args=...) as TRL orders them; GRPOTrainer(config, run_dir, ...) as before."""
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, max_steps=1, disable_tqdm=True)
    trainer = GRPOTrainer("tiny-llama", [reward_len], args=args, train_dataset=ROWS)
    assert trainer.run_dir == tmp_path / "trl" and trainer.cfg.model.name == "tiny-llama"
    assert (trainer.cfg.algorithm.group_size, trainer.cfg.algorithm.prompts_per_step, trainer.cfg.train.steps) == (2, 2, 1)
    trainer.close()
    cfg = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4}, algorithm={"group_size": 2, "prompts_per_step": 2},
                 train={"steps": 1, "progress": False}, eval={"before": False})
    trainer = GRPOTrainer(cfg, tmp_path / "ours", reward_funcs=[reward_len], train_dataset=ROWS)
    assert trainer.run_dir == tmp_path / "ours" and trainer.cfg.algorithm.beta == Config().algorithm.beta
    trainer.close()
    sft = SFTTrainer("tiny-llama", SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, disable_tqdm=True),
                     train_dataset=[{"prompt": "What is 1 + 1?", "completion": "2"}] * 8)
    assert sft.run_dir == tmp_path / "sft" and sft.cfg.sft.batch_size == 8 and sft.cfg.optim.lr == 2e-5
    sft.close()


def test_trl_config_fields_cohortrl_does_not_know_are_refused_and_run_dirs_must_agree(tmp_path):
    with pytest.raises(TypeError, match=r"GRPOConfig\(\) got field\(s\) \['num_generation'\] that cohortrl does not know"):
        GRPOConfig(num_generation=4)  # a typo of num_generations
    with pytest.raises(ConfigError, match="two run directories"):
        GRPOTrainer(model="tiny-llama", reward_funcs=[reward_len], args=GRPOConfig(output_dir=str(tmp_path / "a")),
                    run_dir=tmp_path / "b", train_dataset=ROWS)
    with pytest.raises(ConfigError, match=r"^args=: num_train_epochs=3.0 needs the number of training rows, .*; set max_steps"):
        GRPOTrainer("tiny-llama", ["format"], args=GRPOConfig(output_dir=str(tmp_path / "c")), train_dataset="arithmetic")


def test_readme_and_the_migration_guide_show_the_quickstart_with_the_one_changed_import():
    readme, guide = (REPO / "README.md").read_text(), (REPO / "docs" / "trl_migration.md").read_text()
    grpo = GRPO_QUICKSTART.replace("from trl import", "from cohortrl import")
    assert f"```python\n{grpo}```" in readme and f"```python\n{grpo}```" in guide
    assert SFT_CONFIG_QUICKSTART.replace("from trl import", "from cohortrl import") in guide
