"""A model outside the Llama family trains end to end: a tiny GPT-2 (learned positions, fused Conv1D attention
projections, GELU) under GRPO, GRPO with LoRA, and SFT. The CPU fast path (the lean decoder and the replayed
backward, cpu/decoder.py and cpu/replay.py) computes only Llama-family models, so generation and the
update run through transformers' forward, and the run says so once, at INFO, with the reason."""

import logging

import pytest
import torch

from cohortrl.config import ConfigError
from cohortrl.models import build_tiny_tokenizer, prepare_tokenizer
from cohortrl.cpu import FastPath
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.sft import SFTTrainer
from tests.trainers.test_grpo import params_of, tiny_config
from tests.trainers.test_sft import sft_config

NAME = {"name": "tiny-gpt2"}  # model.name as the run records it (the model itself is handed to the trainer)
FALLBACK = (
    "the CPU fast path is not used for GPT2LMHeadModel: not a Llama-family architecture (model_type 'gpt2'; the lean "
    "decoder computes llama, qwen2, mistral); it runs on plain transformers and PyTorch's kernels (train.cpu_fast_path)"
)


def tiny_gpt2(seed: int = 0):
    """A tiny random GPT-2 (2 layers, width 64: about 0.2M parameters) with the tiny tokenizer, prepared as
    ``load_model`` prepares its models. No dropout: the trainer keeps the replayed backward off under dropout
    anyway, and here only the architecture should rule it out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tiny_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, prepare_tokenizer(tok, model)


def finite(row, keys):
    return all(torch.isfinite(torch.tensor(float(row[k]))) for k in keys)


@pytest.mark.fast_path  # what train.cpu_fast_path=auto says when it steps aside
def test_grpo_trains_a_gpt2_through_transformers_and_says_once_why(tmp_path, addition_jsonl, monkeypatch, caplog):
    model, tok = tiny_gpt2()
    assert sum(p.numel() for p in model.parameters()) < 300_000
    chosen = []  # what generation got from the fast path's decoder_for: None is transformers' forward
    real = FastPath.decoder_for
    monkeypatch.setattr(FastPath, "decoder_for", lambda self, m, *a: chosen.append(real(self, m, *a)) or chosen[-1])
    one_token_calls = []  # transformers' forward on one token per row: a decoding step of the plain loop
    model.register_forward_pre_hook(
        lambda module, args, kwargs: one_token_calls.append(1) if kwargs.get("input_ids") is not None
        and kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    with caplog.at_level(logging.INFO, logger="cohortrl"):
        trainer = GRPOTrainer(tiny_config(addition_jsonl, model=NAME), tmp_path, model=model, tokenizer=tok)
        assert trainer.model is model
        # the settings allow the replayed backward, but no lean decoder computes a GPT-2: nothing would record it
        assert not trainer.rollout_forward_reusable
        before = params_of(trainer)
        rows = trainer.train()
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert finite(r, ("loss", "policy_loss", "kl", "grad_norm", "entropy"))
        assert r["rollout_forward_reused"] == 0
    assert any("eval/" in k for r in rows for k in r)  # the final evaluation generated too
    assert not any(torch.equal(before[n], p) for n, p in params_of(trainer).items())
    assert chosen and all(c is None for c in chosen)
    assert one_token_calls
    said = [r for r in caplog.records if "CPU fast path" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [(logging.INFO, FALLBACK)]


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")  # PEFT on GPT-2's Conv1D, whose weights are stored transposed
def test_lora_on_a_gpt2_names_its_modules_and_trains_them(tmp_path, addition_jsonl):
    model, tok = tiny_gpt2()
    with pytest.raises(ConfigError) as err:  # the default targets are a Llama-family model's projections
        GRPOTrainer(tiny_config(addition_jsonl, model={**NAME, "lora": {"enabled": True, "r": 4}}), tmp_path / "default",
                    model=model, tokenizer=tok)
    assert str(err.value) == (
        "config key 'model.lora.target_modules': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
        "'down_proj'] not found in tiny-gpt2 (GPT2LMHeadModel); its linear modules are ['c_attn', 'c_fc', 'c_proj', "
        "'lm_head']; set model.lora.target_modules to the ones to adapt"
    )
    cfg = tiny_config(addition_jsonl, model={**NAME, "lora": {"enabled": True, "r": 4, "target_modules": ["c_attn", "c_fc"]}},
                      train={"steps": 1}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path / "lora", model=model, tokenizer=tok)
    before = params_of(trainer)
    assert before and all("lora_" in n for n in before)
    [row] = trainer.train()
    assert finite(row, ("loss", "policy_loss", "kl", "grad_norm", "entropy")) and row["grad_norm"] > 0
    assert all(not torch.equal(before[n], p) for n, p in params_of(trainer).items() if "lora_B" in n)  # B starts at 0


def test_sft_trains_a_gpt2(tmp_path):
    model, tok = tiny_gpt2()
    trainer = SFTTrainer(sft_config(model=NAME), tmp_path, model=model, tokenizer=tok)
    before = params_of(trainer)
    rows = trainer.train()
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    assert all(finite(r, ("loss", "grad_norm")) and r["grad_norm"] > 0 for r in steps)
    assert not any(torch.equal(before[n], p) for n, p in params_of(trainer).items())
