"""The RL step (``trainers/step.py``) changes no batch once it is built: the scored batch the sampler returns (its
rollout included, the decoding recording too) and the targets the algorithm returns hold, after the whole step,
exactly what they held when they were handed to it (issue 54)."""

import copy
import dataclasses

import pytest
import torch

from cohortrl.trainers import make_trainer
from tests.trainers.test_grpo import tiny_config


def snapshot(obj):
    """A deep copy of a dataclass's fields; the decoding recording (``Rollout.replay``) by identity."""
    return {f.name: getattr(obj, f.name) if f.name == "replay" else
            snapshot(getattr(obj, f.name)) if dataclasses.is_dataclass(getattr(obj, f.name)) else
            copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def assert_same(before, after, where: str = "") -> None:
    if isinstance(before, dict):
        assert set(before) == set(after), where
        for key in before:
            assert_same(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after)):
            assert_same(b, a, f"{where}[{i}]")
    elif torch.is_tensor(before):
        assert torch.equal(before, after), where
    elif where.endswith(".replay"):
        assert after is before, where
    else:
        assert before == after, where


def record_handed_over(trainer) -> list:
    """Wrap the sampler's ``sample`` and the algorithm's ``targets``: (object, its snapshot) of each one returned."""
    seen, sample, targets = [], trainer.sampler.sample, trainer.algorithm.targets

    def recording(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.append((out, snapshot(out)))
            return out
        return call

    trainer.sampler.sample, trainer.algorithm.targets = recording(sample), recording(targets)
    return seen


@pytest.mark.parametrize("algorithm", [
    {"name": "grpo"},  # on the fast path the update replays decoding's recording, which stays the rollout's
    {"name": "grpo", "epochs": 2, "minibatches": 2},  # log π_old, shuffled minibatches, KL in the loss
    {"name": "grpo", "kl_in_reward": True},  # the reward shaped by the KL
    {"name": "ppo", "group_size": 1, "prompts_per_step": 4, "ppo": {"critic_warmup_steps": 0}},  # critic, GAE
    {"name": "rft", "beta": 0.0},  # the algorithm's own keep rule
], ids=["grpo", "grpo-epochs2", "grpo-kl-in-reward", "ppo", "rft"])
def test_a_step_changes_neither_its_batch_nor_its_targets(tmp_path, addition_jsonl, algorithm):
    trainer = make_trainer(tiny_config(addition_jsonl, algorithm=algorithm), tmp_path / "run")
    try:
        seen = record_handed_over(trainer)
        metrics = trainer.step()
    finally:
        trainer.close()
    assert metrics["skipped_nonfinite"] == 0 and len(seen) == 2  # the batch, then the targets
    if trainer.rollout_forward_reusable:  # the fast path: the step replayed the recording it must leave in place
        assert metrics["rollout_forward_reused"] == 1 and seen[0][1]["rollout"]["replay"] is not None
    for obj, before in seen:
        assert_same(before, snapshot(obj), type(obj).__name__)
