"""``train.cpu_fast_path: off`` runs zero lines of ``cohortrl/cpu/``: a fresh process that builds a GRPO, a PPO and
an SFT trainer on the plain path, runs a step and an evaluation of each, and trains a reward model with
``cpu_fast_path=off``, never imports the package (so none of its lines, not even its module bodies, ran). The
same process with ``auto`` does import it: the check can fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from cohortrl.config import Config
from cohortrl.reward_models.train import load_rm_config, train_reward_model
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.ppo import PPOTrainer
from cohortrl.trainers.sft import SFTTrainer

path, out = sys.argv[1], sys.argv[2]
base = {
    "model": {"name": "tiny-llama", "system_prompt": None},
    "data": {"source": "task:arithmetic", "train_size": 16, "eval_size": 4},
    "reward": {"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
    "sampling": {"max_new_tokens": 4},
    "algorithm": {"group_size": 2, "prompts_per_step": 2, "beta": 0.04},
    "train": {"steps": 1, "progress": False, "cpu_fast_path": path},
    "eval": {"before": False, "n_prompts": 4, "batch_size": 4},
    "sft": {"batch_size": 2},
}
runs = ((GRPOTrainer, {"name": "grpo"}), (PPOTrainer, {"name": "ppo"}), (SFTTrainer, {}))
for cls, algorithm in runs if path == "off" else runs[:1]:  # auto: one trainer shows the import happens
    cfg = Config.from_dict({**base, "algorithm": {**base["algorithm"], **algorithm}})
    trainer = cls(cfg, f"{out}/{cls.__name__}")
    trainer.step()
    trainer.evaluate()
    trainer.close()
if path == "off":
    train_reward_model(load_rm_config(None, ["kind=prm", "steps=1", "n_train=2", "n_eval=2", "batch_size=2",
                                             f"cpu_fast_path={path}", f"out={out}/rm"]))
print(json.dumps(sorted(m for m in sys.modules if m == "cohortrl.cpu" or m.startswith("cohortrl.cpu."))))
"""


@pytest.mark.parametrize("path", ["off", "auto"])
def test_the_plain_path_never_imports_the_cpu_fast_path(tmp_path, path):
    # PYTHONPATH is the repository alone: the plain pass's sitecustomize would turn `auto` off here
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, path, str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    if path == "off":
        assert imported == [], f"cpu_fast_path=off imported {imported}"
    else:
        assert "cohortrl.cpu" in imported
