"""The update's backward through the rollout's own forward (cohortrl/cpu/replay.py): the log-probabilities,
entropies and every parameter's gradient are those of autograd through transformers' forward over the same
responses, for left-padded prompts shared by groups, responses ending at different steps, grouped-query
attention, q/k/v biases, a tied head and LoRA adapters."""

import contextlib

import pytest
import torch

from cohortrl.cpu import kernels
from cohortrl.cpu import FastPath
from cohortrl.cpu.kernels import linear_kernels
from cohortrl.models import load_model
from cohortrl.cpu import decoder as decoder_module
from cohortrl.cpu import replay as replay_module
from cohortrl.rollout.hf import Sampling, generate, response_logprobs
from tests.cpu.test_decoder import PROMPTS, tiny_qwen2, with_lora

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch build has no oneDNN linear op")


def tied_llama(seed: int = 0):
    """tiny-llama-4l with its head tied to the embedding (as SmolLM2's)."""
    from transformers import LlamaForCausalLM

    model, tok = load_model("tiny-llama-4l", seed=seed)
    config = model.config
    config.tie_word_embeddings = True
    # As in SmolLM2, the embedding's padding_idx (a row autograd leaves at 0) is a token the prompts contain.
    config.pad_token_id = tok("<|im_start|>", add_special_tokens=False)["input_ids"][0]
    torch.manual_seed(seed)
    tied = LlamaForCausalLM(config)
    assert tied.get_input_embeddings().padding_idx == config.pad_token_id
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    return tied, tok


def build(name: str):
    name, _, adapter = name.partition("+")
    if name == "qwen2":
        model, tok = tiny_qwen2(seed=1)
    elif name == "tied":
        model, tok = tied_llama(seed=2)
    else:
        model, tok = load_model(name, seed=3)
    if adapter:
        model = with_lora(model, seed=4)
    # Many end-of-sequence tokens, so that responses end at different steps and the batch has padding.
    model.generation_config.eos_token_id = list(range(10, len(tok), 7))
    return model, tok


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@needs_onednn
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-4l", "qwen2", "tied", "tiny-llama-4l+lora", "qwen2+lora",
                                  "tied/recomputed", "qwen2+lora/recomputed", "qwen2/blocks", "tiny-llama-4l+lora/dropped",
                                  "tied/dropped", "tiny-llama-4l+lora/at1", "qwen2+lora/at1-recomputed", "tied/at1-blocks"])
def test_the_replayed_backward_gives_autograds_gradients(name, monkeypatch):
    """At the sampling temperature, and at 1 (``at1``: RFT's supervised loss on responses sampled at 0.8, with
    only some rows in the loss, as RFT keeps the passing ones)."""
    name, _, variant = name.partition("/")
    recomputed = variant.endswith("recomputed")
    if recomputed:  # logits too big to keep: the update recomputes them from the final hidden states
        monkeypatch.setattr(decoder_module, "RECORD_LOGITS_BYTES", 0)
    if variant.endswith("blocks"):  # the attention one prompt or one row at a time, the head one position at a time
        monkeypatch.setattr(replay_module, "CHUNK_BYTES", 1)
    if variant == "dropped":  # every row leaves decoding's products at its end: never recorded after it
        monkeypatch.setattr(decoder_module, "DROP_SHARE", 0.0)
    model, tok = build(name)
    temperature = 0.8
    rows = [{"prompt": p} for p in PROMPTS]
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=temperature, max_new_tokens=8), record=True,
                              fast_path=FastPath("onednn", "system"))
        recording = rollout.replay
        assert recording is not None and (recording.logits_NV is None) == bool(recomputed)
        lengths = rollout.lengths
        assert lengths.min() < 8 and lengths.unique().numel() > 1  # responses end at different steps: padding
        assert recording.dropped or variant != "dropped"
        ids, mask, response_ids = rollout.input_ids(), rollout.attention_mask(), rollout.response_ids
        torch.manual_seed(1)
        weights = torch.randn(response_ids.shape) * rollout.response_mask  # dL/dlogp: any loss through logp
        loss_temperature = temperature
        if variant.startswith("at1"):
            loss_temperature = 1.0
            weights[1::2] = 0  # rows out of the loss: the backward does not reach them

        model.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(model, ids, mask, response_ids, temperature=loss_temperature, with_entropy=True)
        (weights * logp).sum().backward()
        expected = grads(model)

        model.zero_grad(set_to_none=True)
        logp_r, entropy_r = recording.logprobs(response_ids, rollout.response_mask, loss_temperature)
        leaf = logp_r.clone().requires_grad_()
        (weights * leaf).sum().backward()
        recording.backward(leaf.grad, response_ids, loss_temperature)
        got = grads(model)

    torch.testing.assert_close(logp_r, logp.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy_r, entropy, rtol=0, atol=2e-5)
    assert set(got) == set(expected) and expected
    for n, g in expected.items():
        assert g.abs().max() > 0, n  # every trainable parameter is reached
        scale = g.abs().max()
        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-4 * scale, msg=lambda m: f"{n}: {m}")


@needs_onednn
@pytest.mark.parametrize("name", ["tiny-llama-4l+lora", "tied"])
def test_a_backward_with_no_gradient_hands_autograds_zeros_without_running_the_layers(name, monkeypatch):
    """Every dL/dlogp 0 (all groups' rewards identical at β = 0; no RFT sample passed): each trainable parameter
    gets the exact zeros autograd gives it, so the optimiser steps as it would, and no layer's backward runs."""
    model, tok = build(name)
    rows = [{"prompt": p} for p in PROMPTS]
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=0.8, max_new_tokens=8), record=True,
                              fast_path=FastPath("onednn", "system"))
        response_ids = rollout.response_ids
        model.zero_grad(set_to_none=True)
        logp = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), response_ids, temperature=0.8)[0]
        (0 * logp).sum().backward()
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(replay_module, "linear_backward", lambda *a: pytest.fail("a layer's backward ran"))
        rollout.replay.backward(torch.zeros(response_ids.shape), response_ids, 0.8)
        got = grads(model)
    assert set(got) == set(expected) and expected
    for n, g in expected.items():
        assert not g.any() and torch.equal(got[n], g), n
    assert rollout.replay.records[0] is None  # used up, as after any backward


@needs_onednn
@pytest.mark.parametrize("name", ["tiny-llama-4l", "qwen2", "tied", "tiny-llama-4l+lora", "qwen2/blocks"])
def test_another_models_logprobs_on_the_recording_equal_its_own_forward(name, monkeypatch):
    """The reference's log-probs, computed on the policy's recording in one pass, are ``response_logprobs``'
    under the reference: a second model of the same architecture with other weights, or under LoRA the
    policy with its adapter disabled."""
    name, _, variant = name.partition("/")
    if variant == "blocks":  # the attention one prompt or one row at a time, the head one position at a time
        monkeypatch.setattr(replay_module, "CHUNK_BYTES", 1)
    model, tok = build(name)
    if name.endswith("+lora"):
        reference = model
    else:
        other, _ = build(name)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        reference = other
    rows = [{"prompt": p} for p in PROMPTS]
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=0.8, max_new_tokens=8), record=True,
                              fast_path=FastPath("onednn", "system"))
        ids, mask, response_ids = rollout.input_ids(), rollout.attention_mask(), rollout.response_ids
        with torch.no_grad():
            policy, _ = response_logprobs(model, ids, mask, response_ids, temperature=0.8)
            with reference.disable_adapter() if reference is model else contextlib.nullcontext():
                expected, _ = response_logprobs(reference, ids, mask, response_ids, temperature=0.8)
                got = rollout.replay.logprobs_under(reference, response_ids, rollout.response_mask)
    assert (expected - policy).abs().max() > 1e-3  # the reference is another function
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_gradients_are_handed_to_autograd_as_a_backward_would_leave_them():
    """Gradients.deliver: tensor hooks transform the gradient, post-accumulate hooks run, an existing .grad
    accumulates, and a gradient that nothing else holds becomes .grad itself (kept, not copied)."""
    from cohortrl.cpu.replay import Gradients

    hooked, plain, accumulated = (torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    hooked.register_hook(lambda g: g * 2)
    seen = []
    plain.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    accumulated.grad = torch.ones(3, 4)
    g_hooked, g_plain, g_acc = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    expected = {"hooked": g_hooked * 2, "plain": g_plain.clone(), "accumulated": g_acc + 1}
    plain_storage = g_plain.data_ptr()
    grads = Gradients()
    grads.add(hooked, g_hooked)
    grads.add(plain, g_plain)
    grads.add(accumulated, g_acc)
    del g_plain  # the caller keeps no reference, as in Recording.backward
    grads.deliver()
    assert not grads and frozen.grad is None
    torch.testing.assert_close(hooked.grad, expected["hooked"], rtol=0, atol=0)
    torch.testing.assert_close(plain.grad, expected["plain"], rtol=0, atol=0)
    torch.testing.assert_close(accumulated.grad, expected["accumulated"], rtol=0, atol=0)
    assert len(seen) == 1 and torch.equal(seen[0], expected["plain"])
    assert plain.grad.data_ptr() == plain_storage  # kept as it was computed, no copy
