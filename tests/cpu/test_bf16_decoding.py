"""bf16 products in the lean decoder (``train.cpu_decode_dtype: bfloat16``, cohortrl/cpu/decoder.py): the logits
are the fp32 decoder's to bf16 rounding, LoRA adapters folded in; the update sees what the sampler computed (a
recording's log-probs are the sampled distribution's, exactly; without a recording the rollout carries them as
``sampling_logp``); a GRPO step runs on either path; evaluation decodes in fp32; and a machine without bf16 units
or a run without the fast path is refused with one line."""

import pytest
import torch

from cohortrl.config import Config, ConfigError, apply_overrides
from cohortrl.cpu import FastPath, build, kernels
from cohortrl.cpu import decoder as decoder_module
from cohortrl.cpu.decoder import LlamaDecoder
from cohortrl.cpu.kernels import linear_kernels
from cohortrl.models import load_model
from cohortrl.rollout import hf
from cohortrl.rollout.hf import Sampling, generate, response_logprobs
from tests.cpu.test_decoder import PROMPTS, tiny_qwen2, with_lora
from tests.cpu.test_decoder import _stepwise_logits as stepwise_logits
from tests.cpu.test_replay import build as build_model, grads

# oneDNN computes bf16 products on any x86 CPU with AVX-512 (converting where the CPU has no bf16 units, no faster
# than fp32 there): the arithmetic is tested wherever it runs, the run-time refusal apart.
needs_bf16 = pytest.mark.skipif(
    not (kernels.onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this PyTorch build's oneDNN computes no bf16 products on this CPU")


@pytest.fixture(autouse=True)
def bf16_units(monkeypatch):
    """The tests run as on a CPU with bf16 units (the refusal test says otherwise for itself)."""
    monkeypatch.setattr(kernels, "cpu_has_bf16_units", lambda: True)
BF16 = FastPath("onednn", "system", torch.bfloat16)


def _stepwise_logits(model, tok, dtype) -> torch.Tensor:
    """The lean decoder's next-token logits (B, steps, V) of a fixed continuation of three left-padded prompts."""
    return stepwise_logits(model, tok, dtype=dtype)[0]


def _base_weight_only(module):
    """A broken fold: a LoRA layer's base weight without its adapters."""
    base, _ = decoder_module._linear_parts(module)
    return base.weight.detach(), None if base.bias is None else base.bias.detach()


@needs_bf16
@pytest.mark.parametrize("build", ["tiny-llama-4l", "qwen2", "tiny-llama-4l+lora", "qwen2+lora"])
def test_bf16_products_give_the_fp32_decoders_logits_to_bf16_rounding(build, monkeypatch):
    name, _, adapter = build.partition("+")
    model, tok = tiny_qwen2() if name == "qwen2" else load_model(name, seed=2)
    if adapter:
        model = with_lora(model)
    fp32 = _stepwise_logits(model, tok, torch.float32)
    bf16 = _stepwise_logits(model, tok, torch.bfloat16)
    scale = fp32.abs().max()
    assert scale > 0.1  # not a degenerate model
    # bf16 keeps 8 bits of mantissa: a product's inputs and output each move by up to 2^-9 relative; through a few
    # layers the logits move by about 0.5% of their scale here (a cast missed somewhere would leave them exact)
    assert 1e-4 * scale < (bf16 - fp32).abs().max() <= 2e-2 * scale
    if adapter:  # the tolerance catches adapters left out of the bf16 copy
        monkeypatch.setattr(decoder_module, "_weight_and_bias", _base_weight_only)
        unfolded = _stepwise_logits(model, tok, torch.bfloat16)
        assert (unfolded - fp32).abs().max() > 2e-2 * scale


def _sampler_logits(monkeypatch) -> list:
    """Every logits tensor the sampler draws from, copied as it was handed over."""
    seen, sample = [], hf._sample
    monkeypatch.setattr(hf, "_sample", lambda logits, *a, **k: seen.append(logits.clone()) or sample(logits, *a, **k))
    return seen


def _logp_of_sampled(seen: list, response_ids, response_mask, temperature) -> torch.Tensor:
    z = torch.stack(seen, 1) / temperature  # (B, T, V)
    logp = z.gather(-1, response_ids[..., None]).squeeze(-1) - z.logsumexp(-1)
    return logp.masked_fill(response_mask == 0, 0.0)


@needs_bf16
@pytest.mark.parametrize("record", [True, False])
def test_the_update_gets_the_log_probs_the_bf16_sampler_drew_from(record, monkeypatch):
    """Recorded: the recording's log-probs (the update's log π and, on policy, log π_old) are the sampled
    distribution's, exactly, so the ratio is 1. Not recorded: the rollout carries them as ``sampling_logp``."""
    model, tok = build_model("tiny-llama-4l+lora")
    temperature, rows = 0.8, [{"prompt": p} for p in PROMPTS]
    seen = _sampler_logits(monkeypatch)
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=temperature, max_new_tokens=8), record=record,
                              fast_path=BF16, decode_dtype=torch.bfloat16)
        fp32_logp, _ = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), rollout.response_ids,
                                         temperature=temperature)
    drawn = _logp_of_sampled(seen, rollout.response_ids, rollout.response_mask, temperature)
    if record:
        assert rollout.sampling_logp is None
        got, _ = rollout.replay.logprobs(rollout.response_ids, rollout.response_mask, temperature)
    else:
        assert rollout.replay is None
        got = rollout.sampling_logp
    assert torch.equal(got, drawn)
    assert (got - fp32_logp).abs().max() > 1e-4  # bf16's numbers, not fp32's: what the importance weights correct


@needs_bf16
@pytest.mark.parametrize("logits, loss_temperature", [("kept", 0.8), ("recomputed", 0.8), ("kept", 1.0), ("recomputed", 1.0)])
def test_the_replayed_backward_of_bf16_products_is_autograds_to_bf16_rounding(logits, loss_temperature, monkeypatch):
    """The bf16 recording's gradients against autograd through the fp32 model on the same responses; with the
    logits too big to keep, the update recomputes them with bf16 products; at the sampling temperature and at 1
    (RFT's loss), where the log-probs come from the logits again."""
    if logits == "recomputed":
        monkeypatch.setattr(decoder_module, "RECORD_LOGITS_BYTES", 0)
    model, tok = build_model("tiny-llama-4l+lora")
    temperature, rows = 0.8, [{"prompt": p} for p in PROMPTS]
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=temperature, max_new_tokens=8), record=True,
                              fast_path=BF16, decode_dtype=torch.bfloat16)
        response_ids, recording = rollout.response_ids, rollout.replay
        assert (recording.logits_NV is None) == (logits == "recomputed")
        torch.manual_seed(1)
        weights = torch.randn(response_ids.shape) * rollout.response_mask
        model.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), response_ids,
                                    temperature=loss_temperature)
        (weights * logp).sum().backward()
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        logp_r, _ = recording.logprobs(response_ids, rollout.response_mask, loss_temperature)
        recording.backward(weights, response_ids, loss_temperature)
        got = grads(model)
    mask = rollout.response_mask.bool()
    assert (logp_r - logp.detach())[mask].abs().max() < 5e-2  # bf16 products' log-probs, at the asked temperature
    assert set(got) == set(expected) and expected
    for n, g in expected.items():
        assert torch.isfinite(got[n]).all(), n
        torch.testing.assert_close(got[n], g, rtol=0, atol=5e-2 * g.abs().max(), msg=lambda m: f"{n}: {m}")


@needs_bf16
@pytest.mark.parametrize("reuse", [True, False])
def test_a_grpo_step_samples_with_bf16_products_and_trains(tmp_path, addition_jsonl, monkeypatch, reuse):
    """Replayed: the recording of bf16 products is what the update differentiates, no importance weights. Its own
    forward: log π_old by it, and the sampler's bf16 log-probs weight the loss (``is_weight_mean``)."""
    from cohortrl.trainers.grpo import GRPOTrainer
    from tests.trainers.test_grpo import tiny_config

    dtypes = []
    init = LlamaDecoder.__init__
    monkeypatch.setattr(LlamaDecoder, "__init__", lambda dec, *a, **k: dtypes.append(k.get("dtype")) or init(dec, *a, **k))
    cfg = tiny_config(addition_jsonl, train={"steps": 1, "cpu_decode_dtype": "bfloat16", "reuse_rollout_forward": reuse},
                      model={"lora": {"enabled": True, "r": 4}}, sampling={"max_new_tokens": 8, "temperature": 0.9})
    trainer = GRPOTrainer(cfg, tmp_path)
    assert trainer.fast_path.decode_dtype == torch.bfloat16 and trainer.rollout_forward_reusable == reuse
    assert trainer.needs_old_logp == (not reuse)
    row = trainer.step()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # every rollout's decoder
    assert row["rollout_forward_reused"] == int(reuse)
    assert ("is_weight_mean" in row) == (not reuse)
    if not reuse:  # bf16 and fp32 log-probs of the same tokens: close, not equal
        assert row["is_weight_mean"] == pytest.approx(1.0, abs=0.05) and row["is_weight_mean"] != 1.0
    assert torch.isfinite(torch.tensor([row["loss"], row["grad_norm"]])).all() and row["grad_norm"] > 0
    dtypes.clear()
    trainer.evaluate()
    assert dtypes and set(dtypes) == {torch.float32}  # evaluation: fp32 whatever the training rollouts' setting
    trainer.close()


@needs_bf16
def test_rft_with_bf16_sampling_computes_no_old_log_probs(tmp_path, addition_jsonl):
    """RFT's loss has no ratio term (zero advantages, the supervised loss): a bf16 sampler needs no importance
    weights there, so the step runs no forward for log π_old."""
    from cohortrl.trainers import make_trainer
    from tests.trainers.test_rft import rft_config

    cfg = rft_config(addition_jsonl)
    cfg = cfg.with_overrides("train.cpu_decode_dtype=bfloat16", "train.reuse_rollout_forward=false")
    trainer = make_trainer(cfg, tmp_path)
    assert trainer.engine.own_numerics and not trainer.rollout_forward_reusable
    assert not trainer.needs_old_logp
    row = trainer.step()
    assert "is_weight_mean" not in row and torch.isfinite(torch.tensor(row["loss"]))
    trainer.close()


def test_evaluation_decodes_in_fp32_whatever_the_runs_setting(monkeypatch):
    """``generate`` without ``decode_dtype`` (what evaluation calls) asks the fast path for an fp32 decoder."""
    asked = []
    monkeypatch.setattr(FastPath, "decoder_for", lambda self, model, dtype=torch.float32: asked.append(dtype))
    model, tok = load_model("tiny-llama", seed=0)
    generate(model, tok, [{"prompt": PROMPTS[0]}], 2, Sampling(temperature=0, max_new_tokens=2), fast_path=BF16)
    assert asked and set(asked) == {torch.float32}


def _config(overrides: list[str]) -> Config:
    return Config.from_dict(apply_overrides({}, overrides))


@pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch build has no oneDNN linear op")
def test_bfloat16_decoding_is_refused_on_a_cpu_without_bf16_units(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_has_bf16_units", lambda: False)
    cfg = _config(["train.cpu_decode_dtype=bfloat16"])
    model, _ = load_model("tiny-llama", seed=0)
    with pytest.raises(RuntimeError, match="no bf16 units.*set train.cpu_decode_dtype=float32"):
        build(cfg.train, "cpu", model)


def test_bfloat16_decoding_of_a_model_the_lean_decoder_does_not_compute_names_the_decoder():
    """Not the oneDNN kernel's message: under cpu_linear auto the kernel has fallen back because of the model."""
    from tests.trainers.test_other_architectures import tiny_gpt2

    cfg = _config(["train.cpu_decode_dtype=bfloat16"])
    model, _ = tiny_gpt2()
    with pytest.raises(RuntimeError, match="needs the lean decoder, which does not compute this model"):
        build(cfg.train, "cpu", model)


def test_bfloat16_decoding_without_the_fast_path_is_a_config_error():
    with pytest.raises(ConfigError, match="train.cpu_decode_dtype"):
        _config(["train.cpu_fast_path=off", "train.cpu_decode_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="train.cpu_decode_dtype"):
        _config(["train.cpu_linear=aten", "train.cpu_decode_dtype=bfloat16"])


@pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch build has no oneDNN linear op")
@pytest.mark.parametrize("units", [True, False])
def test_auto_decodes_in_bf16_where_the_cpu_has_bf16_units_and_in_fp32_elsewhere(monkeypatch, caplog, units):
    monkeypatch.setattr(kernels, "cpu_has_bf16_units", lambda: units)
    model, _ = load_model("tiny-llama", seed=0)
    with caplog.at_level("INFO", logger="cohortrl.progress"):
        fast_path = build(_config(["train.cpu_decode_dtype=auto"]).train, "cpu", model)
    assert fast_path.decode_dtype == (torch.bfloat16 if units else torch.float32)
    said = "this CPU has bf16 units; training rollouts decode with bf16" if units else "no bf16 units"
    assert any(said in r.getMessage() for r in caplog.records)


def test_auto_decodes_in_fp32_where_bf16_would_be_refused():
    """A model the lean decoder does not compute, or no fast path: auto is float32 where bfloat16 is an error."""
    from tests.trainers.test_other_architectures import tiny_gpt2

    model, _ = tiny_gpt2()
    fast_path = build(_config(["train.cpu_decode_dtype=auto"]).train, "cpu", model)
    assert fast_path is None or fast_path.decode_dtype == torch.float32
    fast_path = build(_config(["train.cpu_decode_dtype=auto", "train.cpu_linear=onednn"]).train, "cpu", model)
    assert fast_path.decode_dtype == torch.float32
    for off in (["train.cpu_fast_path=off"], ["train.cpu_linear=aten"]):
        fast_path = build(_config([*off, "train.cpu_decode_dtype=auto"]).train, "cpu", model)  # valid: nothing asks for bf16
        assert fast_path is None or fast_path.decode_dtype == torch.float32
