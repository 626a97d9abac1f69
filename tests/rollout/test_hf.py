"""Shared prompts in the HF backend: a group's prompt is prefilled once for generation and run once for
log-probs; both must give what running every [prompt | response] row in full gives."""

import pytest
import torch

from cohortrl.models import load_model
from cohortrl.rollout.hf import Sampling, generate, response_logprobs

ROWS = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 * 3? Answer briefly please."}]


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prefilled_group_samples_what_unshared_rows_sample(temperature):
    model, tok = load_model("tiny-llama", seed=1)
    torch.manual_seed(0)
    grouped, _ = generate(model, tok, ROWS, 3, Sampling(temperature=temperature, max_new_tokens=12))
    torch.manual_seed(0)  # the same six rows, each on its own (group size 1 prefills nothing)
    flat, _ = generate(model, tok, [r for r in ROWS for _ in range(3)], 1, Sampling(temperature=temperature, max_new_tokens=12))
    assert torch.equal(grouped.response_ids, flat.response_ids)
    assert torch.equal(grouped.response_mask, flat.response_mask)
    if temperature:
        assert len({tuple(r.tolist()) for r in grouped.response_ids[:3]}) > 1  # the group's samples differ


def _logprobs_and_grads(model, rollout, rows, share):
    model.zero_grad()
    ids, mask = rollout.input_ids()[rows], rollout.attention_mask()[rows]
    logp, entropy = response_logprobs(model, ids, mask, rollout.response_ids[rows], temperature=0.7,
                                      with_entropy=True, share_prompts=share)
    # an arbitrary weighting of the tokens, so every position's gradient matters
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp) * rollout.response_mask[rows]
    (logp * weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("case", ["full", "lora", "partial_groups", "one_token"])
def test_shared_prompt_logprobs_and_gradients_equal_the_full_forward(case):
    model, tok = load_model("tiny-llama", seed=2)
    if case == "lora":
        model = lora(model)
    torch.manual_seed(0)
    n_tokens = 1 if case == "one_token" else 10
    rollout, _ = generate(model, tok, ROWS, 3, Sampling(temperature=1.0, max_new_tokens=n_tokens))
    rows = torch.tensor([1, 2, 3]) if case == "partial_groups" else torch.arange(6)  # a micro-batch across groups
    model.train()
    shared = _logprobs_and_grads(model, rollout, rows, share=True)
    full = _logprobs_and_grads(model, rollout, rows, share=False)
    m = rollout.response_mask[rows].bool()
    torch.testing.assert_close(shared[0][m], full[0][m], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1][m], full[1][m], rtol=0, atol=1e-5)
    assert full[2].norm() > 0
    assert ((shared[2] - full[2]).norm() / full[2].norm()).item() < 1e-5


def test_generate_modes_prefills_once_and_matches_one_call_per_mode():
    from cohortrl.rollout.hf import generate_modes

    model, tok = load_model("tiny-llama", seed=1)
    prompts = [r["prompt"] for r in ROWS]
    greedy, sampled = Sampling(temperature=0.0, max_new_tokens=10), Sampling(temperature=1.0, max_new_tokens=10)
    torch.manual_seed(0)
    both = generate_modes(model, tok, prompts, {"greedy": greedy, "sampled": sampled})
    torch.manual_seed(0)  # greedy decoding draws no random numbers, so the sampled call sees the same stream
    one_by_one = {name: generate(model, tok, ROWS, 1, s)[0].completions for name, s in (("greedy", greedy), ("sampled", sampled))}
    assert both == one_by_one
    assert both["greedy"] != both["sampled"]
