"""The trainer with its optional back ends: a reward pool (a worker killed mid-run is replaced and the step
retried) and the vLLM generation path (against a stand-in vllm: weights synced after updates, importance
weights applied)."""

import sys
import textwrap

import pytest

from cohortrl.config import ConfigError
from cohortrl.trainers.grpo import GRPOTrainer
from tests.rollout import vllm_standin
from tests.rollout.test_vllm_backend import record_syncs
from tests.trainers.test_grpo import tiny_config


def test_a_reward_worker_killed_mid_run_is_replaced_and_training_goes_on(tmp_path, addition_jsonl):
    fns = tmp_path / "pool_rewards.py"
    marker = tmp_path / "killed"
    fns.write_text(textwrap.dedent(f"""
        import os, signal

        def letter_dies_once(prompts, completions, **columns):
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return [1.0 if c[:1].isalpha() else 0.0 for c in completions]
    """))
    name = f"{fns}:letter_dies_once"
    cfg = tiny_config(addition_jsonl, reward={"functions": [{"name": name}], "correctness": name, "workers": 2})
    trainer = GRPOTrainer(cfg, tmp_path / "run")
    try:
        rows = [r for r in trainer.train() if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2] and marker.exists()
        assert trainer.sampler.pool.restarts == 1
        assert all(0 <= r["accuracy"] <= 1 for r in rows)
    finally:
        trainer.close()


def test_vllm_backend_syncs_weights_after_updates_and_weights_the_loss(tmp_path, addition_jsonl, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", vllm_standin.module())
    syncs = record_syncs(monkeypatch)
    cfg = tiny_config(addition_jsonl, sampling={"backend": "vllm", "max_new_tokens": 3, "is_cap": 2.0}, train={"steps": 2})
    trainer = GRPOTrainer(cfg, tmp_path)
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(syncs) == 1  # before step 2's generation, after step 1's update (none before step 1)
    assert sorted(syncs[0]) == sorted(trainer.model.state_dict())
    assert all(0 < r["is_weight_mean"] <= 2.0 for r in rows)
    assert "time/weight_sync" in rows[1] and "time/weight_sync" not in rows[0]


def test_choosing_a_gpu_that_is_not_there_fails_before_loading(tmp_path, addition_jsonl):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match=r"config key 'train.device' = 'cuda': PyTorch sees no CUDA GPU here; use auto or cpu"):
        GRPOTrainer(tiny_config(addition_jsonl, train={"device": "cuda"}), tmp_path)
