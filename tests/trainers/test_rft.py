"""Rejection-sampling fine-tuning (``algorithm.name: rft``): the supervised loss on the sampled responses that
pass, over their own tokens only, at temperature 1."""

import copy

import pytest
import torch

from cohortrl.config import ConfigError
from cohortrl.rollout.hf import response_logprobs
from cohortrl.trainers import make_trainer
from cohortrl.trainers.rft import RFTTrainer
from tests.trainers.test_grpo import FNS, params_of, tiny_config


def rft_config(data, **algorithm):
    return tiny_config(data, fn="starts_with_letter", algorithm={"name": "rft", "beta": 0.0, "aggregation": "token-mean", **algorithm},
                       sampling={"temperature": 0.7, "max_new_tokens": 8}, train={"steps": 1, "progress": True},
                       eval={"n_prompts": 0})


def test_rft_trains_on_the_passed_responses_own_tokens_only(tmp_path, addition_jsonl):
    """One step: the logged loss equals −log π (temperature 1, the weights before the step) averaged over the
    tokens of the passing responses, with a tool-result-like hole (tokens the model attends to but did not
    write) left out; failed responses and the hole add nothing."""
    trainer = make_trainer(rft_config(addition_jsonl), tmp_path)
    assert isinstance(trainer, RFTTrainer) and trainer.reference is None
    before = copy.deepcopy(trainer.model)
    sample, seen = trainer.sampler.sample, {}

    def sample_with_a_hole(step, timer, record=False):
        batch = sample(step, timer, record=record)
        r = batch.rollout
        hole = torch.zeros_like(r.response_mask)
        hole[:, 2:4] = r.response_mask[:, 2:4]
        r.tool_mask, r.response_mask = hole, r.response_mask * (1 - hole)
        r.tool_calls = r.tool_errors = torch.zeros(r.batch_size)
        seen["batch"] = batch
        return batch

    trainer.sampler.sample = sample_with_a_hole
    row = trainer.train()[0]
    batch = seen["batch"]
    r = batch.rollout
    passed = torch.tensor([v >= 1.0 for v in batch.per_fn[f"{FNS}:starts_with_letter"]])
    assert 0 < passed.sum() < r.batch_size, "the tiny model should pass some responses and fail others"
    assert row["trained_responses"] == int(passed.sum())
    with torch.no_grad():
        logp, _ = response_logprobs(before, r.input_ids(), r.attention_mask(), r.response_ids, temperature=1.0)
    mask = r.response_mask * passed.unsqueeze(-1)
    expected = (-logp * mask).sum() / mask.sum()
    assert row["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert row["rft_kept_fraction"] == pytest.approx(passed.float().mean().item())


def test_a_step_where_nothing_passes_changes_nothing(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, fn="always_zero", algorithm={"name": "rft", "beta": 0.0},
                      train={"steps": 1}, eval={"n_prompts": 0})
    trainer = make_trainer(cfg, tmp_path)
    before = params_of(trainer)
    row = trainer.train()[0]
    assert row["trained_responses"] == 0 and row["loss"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in params_of(trainer).items())


def test_rft_with_a_kl_coefficient_is_refused_in_one_line(addition_jsonl):
    with pytest.raises(ConfigError, match="algorithm.beta.*rft.*set algorithm.beta=0"):
        tiny_config(addition_jsonl, algorithm={"name": "rft", "beta": 0.04})
