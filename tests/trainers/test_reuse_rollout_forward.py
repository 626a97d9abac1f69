"""``train.reuse_rollout_forward``: on-policy GRPO (and RFT) differentiates decoding's own forward (cpu/replay.py)
instead of running another. The step's numbers are those of the update's own forward to float rounding, and
every setting under which decoding's forward is not the update's forward turns it off."""

import pytest
import torch

from cohortrl.cpu import kernels
from cohortrl.cpu.replay import Recording
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.ppo import PPOTrainer
from cohortrl.trainers.rft import RFTTrainer
from tests.trainers.test_grpo import tiny_config
from tests.trainers.test_ppo import ppo_config
from tests.trainers.test_rft import rft_config

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="the lean decoder needs oneDNN's linear op")


def replays(monkeypatch) -> list:
    calls = []
    real = Recording.backward
    monkeypatch.setattr(Recording, "backward", lambda self, *a: calls.append(1) or real(self, *a))
    return calls


@pytest.mark.fast_path
@needs_onednn
@pytest.mark.parametrize("lora", [False, True])
def test_a_step_on_decodings_forward_matches_a_step_on_its_own(tmp_path, addition_jsonl, monkeypatch, lora):
    calls = replays(monkeypatch)
    scored = []  # the reference's log-probs on the recording's rows
    real = Recording.logprobs_under
    monkeypatch.setattr(Recording, "logprobs_under", lambda self, *a: scored.append(1) or real(self, *a))
    rows = {}
    for reuse in (True, False):
        cfg = tiny_config(addition_jsonl, train={"steps": 1, "reuse_rollout_forward": reuse},
                          model={"lora": {"enabled": lora, "r": 4}}, sampling={"max_new_tokens": 8, "temperature": 0.9})
        trainer = GRPOTrainer(cfg, tmp_path / str(reuse))
        assert trainer.rollout_forward_reusable == reuse
        before = len(calls)
        rows[reuse] = trainer.step()
        assert len(calls) - before == (1 if reuse else 0)
        assert len(scored) == len(calls)
    on, off = rows[True], rows[False]
    assert on["response_length_mean"] == off["response_length_mean"]  # the same sampled batch (same seed)
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "kl"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-7), key
    assert on["grad_norm"] > 0
    assert (on["rollout_forward_reused"], off["rollout_forward_reused"]) == (1, 0)  # the metric says which path ran


@pytest.mark.fast_path
@needs_onednn
@pytest.mark.parametrize("change", [
    {"train": {"steps": 1, "reuse_rollout_forward": False}},
    {"algorithm": {"epochs": 2}},  # the second epoch's policy is not the one that sampled
    {"algorithm": {"minibatches": 2}},
    {"algorithm": {"micro_batch_size": 4}},  # the update's micro-batches are not the rollout's batch
    {"algorithm": {"zero_variance": "resample"}},  # a batch joined from several draws
    {"model": {"lora": {"enabled": True, "r": 4, "dropout": 0.1}}},  # training's forward is not decoding's
])
def test_settings_where_decodings_forward_is_not_the_updates_turn_it_off(tmp_path, addition_jsonl, monkeypatch, change):
    calls = replays(monkeypatch)
    trainer = GRPOTrainer(tiny_config(addition_jsonl, **{"train": {"steps": 1}, **change}), tmp_path)
    assert not trainer.rollout_forward_reusable
    row = trainer.step()
    assert calls == [] and row["grad_norm"] > 0 and row["rollout_forward_reused"] == 0


@pytest.mark.fast_path
@needs_onednn
def test_one_micro_batch_holding_the_whole_rollout_keeps_it_on(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, train={"steps": 1}, algorithm={"micro_batch_size": 8})  # P·G = 2 × 4
    trainer = GRPOTrainer(cfg, tmp_path)
    assert cfg.algorithm.prompts_per_step * cfg.algorithm.group_size == 8
    assert trainer.rollout_forward_reusable and trainer.step()["rollout_forward_reused"] == 1


@pytest.mark.fast_path
@needs_onednn
def test_an_rft_step_on_decodings_forward_at_temperature_1_matches_a_step_on_its_own(tmp_path, addition_jsonl, monkeypatch):
    """RFT samples at 0.7 and trains at 1 on the passing responses only: the replay recomputes the logits at 1."""
    calls = replays(monkeypatch)
    rows = {}
    for reuse in (True, False):
        cfg = rft_config(addition_jsonl).with_overrides(f"train.reuse_rollout_forward={str(reuse).lower()}",
                                                        "train.progress=false", "model.lora.enabled=true", "model.lora.r=4")
        trainer = RFTTrainer(cfg, tmp_path / str(reuse))
        assert trainer.rollout_forward_reusable == reuse
        rows[reuse] = trainer.step()
    on, off = rows[True], rows[False]
    assert calls == [1] and (on["rollout_forward_reused"], off["rollout_forward_reused"]) == (1, 0)
    assert on["response_length_mean"] == off["response_length_mean"] and 0 < on["rft_kept_fraction"] < 1
    for key in ("loss", "nll", "grad_norm", "entropy"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-7), key
    assert on["grad_norm"] > 0


@pytest.mark.fast_path
@needs_onednn
def test_ppo_runs_its_own_forward(tmp_path, addition_jsonl, monkeypatch):
    calls = replays(monkeypatch)
    trainer = PPOTrainer(ppo_config(addition_jsonl, train={"steps": 1}), tmp_path)
    assert not trainer.rollout_forward_reusable
    trainer.step()
    assert calls == []


@pytest.mark.fast_path  # the reuse needs the lean decoder: with the fast path off nothing is reused
@pytest.mark.parametrize("attention_dropout, reusable", [(0.1, False), (0.0, True)])
def test_attention_dropout_set_in_the_models_config_turns_it_off(tmp_path, addition_jsonl, attention_dropout, reusable):
    """Llama's attention dropout is a config value, not an ``nn.Dropout`` module: it too makes training's
    forward differ from decoding's. (The tiny Llama has no dropout modules, so 0.0 leaves the reuse on.)"""
    from cohortrl.models import load_model

    model, tokenizer = load_model("tiny-llama", seed=0)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    model.config.attention_dropout = attention_dropout
    trainer = GRPOTrainer(tiny_config(addition_jsonl, train={"steps": 1}), tmp_path, model=model, tokenizer=tokenizer)
    assert trainer.rollout_forward_reusable == (reusable and kernels.onednn_available())


@pytest.mark.fast_path  # the reuse needs the lean decoder: with the fast path off nothing is reused
@pytest.mark.parametrize("p, reusable", [(0.0, True), (0.1, False)])
def test_a_dropout_module_with_p_0_leaves_it_on(tmp_path, addition_jsonl, p, reusable):
    """An ``nn.Dropout(p=0)`` (GPT-2's with its dropout set to 0, a LoRA adapter's) is the identity in training;
    one with p > 0 is not. (The module is attached beside the MLP, not in its path: wrapping a projection would
    change the architecture the lean decoder computes, and with no decoder nothing is reused anyway.)"""
    from cohortrl.models import load_model

    model, tokenizer = load_model("tiny-llama", seed=0)
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(p)
    trainer = GRPOTrainer(tiny_config(addition_jsonl, train={"steps": 1}), tmp_path, model=model, tokenizer=tokenizer)
    assert trainer.rollout_forward_reusable == (reusable and kernels.onednn_available())
