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


def test_a_seeded_group_samples_alone_what_it_samples_in_a_batch():
    """Under torchrun each row carries its group's seed (``seeds``): a group samples the same responses in one
    batched call with other groups as in a call of its own, and as a call of its own after ``torch.manual_seed``
    of that seed (what the sampler did before it batched the groups); the process's random stream is untouched."""
    model, tok = load_model("tiny-llama", seed=1)
    sampling = Sampling(temperature=1.0, max_new_tokens=12)
    before = torch.random.get_rng_state()
    batched, _ = generate(model, tok, ROWS, 3, sampling, seeds=[7, 8])
    assert torch.equal(torch.random.get_rng_state(), before)
    for i, seed in enumerate((7, 8)):
        alone, _ = generate(model, tok, ROWS[i : i + 1], 3, sampling, seeds=[seed])
        torch.manual_seed(seed)
        stream, _ = generate(model, tok, ROWS[i : i + 1], 3, sampling)
        assert alone.completions == stream.completions == batched.completions[3 * i : 3 * i + 3], i
    swapped, _ = generate(model, tok, ROWS, 3, sampling, seeds=[8, 7])  # the seed, not the position, decides
    assert swapped.completions[:3] != batched.completions[:3]
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):  # not one group of six rows, silently
        generate(model, tok, ROWS, 3, sampling, seeds=[7])


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


@pytest.mark.parametrize("lora_model", [False, True])
def test_greedy_decoding_matches_transformers_generate(lora_model):
    """The decoding loop is ours (see ``generate_ids``); greedy, it must pick what ``model.generate`` picks."""
    from cohortrl.rollout.hf import encode_prompts

    model, tok = load_model("tiny-llama", seed=3)
    model = lora(model) if lora_model else model
    model.eval()
    ours, _ = generate(model, tok, ROWS, 2, Sampling(temperature=0.0, max_new_tokens=16, min_new_tokens=3))
    ids, mask, _ = encode_prompts(tok, [r["prompt"] for r in ROWS], None, 512, "reject")
    theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, min_new_tokens=3,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1] :]
    for row in range(len(ROWS)):
        n = int(ours.response_mask[2 * row].sum())
        assert torch.equal(ours.response_ids[2 * row, :n], theirs[row, :n])
        assert n == 16 or ours.response_ids[2 * row, n - 1] == tok.eos_token_id


def _first_token_frequencies(logits_V: torch.Tensor, sampling: Sampling, n: int) -> torch.Tensor:
    from cohortrl.rollout.hf import _sample

    torch.manual_seed(0)
    draws = _sample(logits_V.expand(n, -1).clone(), sampling)
    return torch.bincount(draws, minlength=logits_V.shape[-1]).float() / n


def test_sampling_draws_from_the_tempered_truncated_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 200_000
    # temperature only: the frequencies are softmax(logits / T)
    freq = _first_token_frequencies(logits, Sampling(temperature=0.7), n)
    torch.testing.assert_close(freq, (logits / 0.7).softmax(-1), rtol=0, atol=0.005)
    # top-k 2: only the two best, renormalised
    freq = _first_token_frequencies(logits, Sampling(temperature=1.0, top_k=2), n)
    expect = torch.zeros(6)
    expect[:2] = logits[:2].softmax(-1)
    torch.testing.assert_close(freq, expect, rtol=0, atol=0.005)
    # top-p 0.8: the smallest set reaching 0.8 — probabilities .462 .280 .170 ...: the first three (.911)
    p = logits.softmax(-1)
    assert p[:2].sum() < 0.8 < p[:3].sum()
    freq = _first_token_frequencies(logits, Sampling(temperature=1.0, top_p=0.8), n)
    expect = torch.zeros(6)
    expect[:3] = p[:3] / p[:3].sum()
    torch.testing.assert_close(freq, expect, rtol=0, atol=0.005)
    # temperature 0: always the argmax
    assert _first_token_frequencies(logits, Sampling(temperature=0.0), 10)[0] == 1.0


def test_stop_strings_end_a_response_and_are_kept():
    model, tok = load_model("tiny-llama", seed=1)
    torch.manual_seed(0)
    free, _ = generate(model, tok, ROWS, 4, Sampling(temperature=1.0, max_new_tokens=24))
    # a stop string that some free responses contain: the first 2-character piece of the first response
    stop = free.completions[0][2:4]
    assert stop.strip()
    torch.manual_seed(0)
    stopped, _ = generate(model, tok, ROWS, 4, Sampling(temperature=1.0, max_new_tokens=24, stop=[stop]))
    assert stop in stopped.completions[0]  # the token that completes it may run past it ("51" for " 5")
    for text, ids, mask in zip(stopped.completions, stopped.response_ids, stopped.response_mask):
        n = int(mask.sum())
        if stop in text:  # ends at the first token that completes the stop string
            assert stop not in tok.decode(ids[: n - 1], skip_special_tokens=True)


def _plain_logprobs(model, ids, mask, response_ids, temperature):
    """The textbook computation, nothing shared or chunked: every position's full-vocabulary logits."""
    T = response_ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -T - 1:-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1), entropy


def _rollout_ending_early(model, tok):
    """Two groups of 3 responses of up to 9 tokens, two of them cut short: a random tiny model rarely samples EOS,
    and rows that ended early put padding after the end into the batch."""
    torch.manual_seed(0)
    rollout, _ = generate(model, tok, ROWS, 3, Sampling(temperature=1.0, max_new_tokens=9))
    for row, end in ((0, 5), (4, 1)):
        rollout.response_mask[row, end:] = 0
        rollout.response_ids[row, end:] = tok.pad_token_id
    return rollout


class _OwnHead(torch.nn.Linear):
    """An LM head that is not a plain ``nn.Linear`` (as a model that changes its logits after the head has, or a
    DDP-wrapped one): ``response_logprobs`` cannot apply it itself and runs the model's own forward instead."""


@pytest.mark.parametrize("share", [False, True])
def test_the_models_own_head_gives_the_full_forwards_logprobs_entropy_and_gradients(share):
    """The path torchrun's gradient forward takes (DDP: the model's own head, prompts not shared), here in one
    process: left-padded prompts of two lengths, rows that end early, temperature 0.7."""
    from cohortrl.rollout.hf import _plain_lm_head

    model, tok = load_model("tiny-llama", seed=3)
    head = model.get_output_embeddings()
    own = _OwnHead(head.in_features, head.out_features, bias=False)
    own.weight = head.weight  # tied, as in the tiny model
    model.lm_head = own
    assert _plain_lm_head(model) is None
    rollout = _rollout_ending_early(model, tok)
    ids, mask, resp = rollout.input_ids(), rollout.attention_mask(), rollout.response_ids
    assert (mask[:, 0] == 0).any()  # a left-padded prompt: positions must be rebuilt from the mask
    m = rollout.response_mask.bool()
    weights = torch.linspace(-1.0, 2.0, resp.numel()).view_as(resp) * m
    model.train()
    results = []
    for compute in (lambda: _plain_logprobs(model, ids, mask, resp, 0.7),
                    lambda: response_logprobs(model, ids, mask, resp, temperature=0.7, with_entropy=True, share_prompts=share)):
        model.zero_grad()
        logp, entropy = compute()
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (want_logp, want_entropy, want_grads), (logp, entropy, grads) = results
    torch.testing.assert_close(logp[m], want_logp[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[m], want_entropy[m], rtol=0, atol=1e-5)
    assert want_grads.norm() > 0 and ((grads - want_grads).norm() / want_grads.norm()).item() < 1e-5


@pytest.mark.parametrize("probabilities", ["kept", "recomputed"])
@pytest.mark.parametrize("case", ["full", "lora", "untied_with_bias", "shared_prompts"])
def test_chunked_head_equals_full_vocabulary_logits_in_value_and_gradient(case, probabilities, monkeypatch):
    import cohortrl.rollout.hf as hf

    kept = []
    real_exp = torch.exp
    monkeypatch.setattr(hf.torch, "exp", lambda x, out=None: kept.append(out is not None) or real_exp(x, out=out))
    if probabilities == "recomputed":  # a budget too small for any batch: backward recomputes the logits
        monkeypatch.setattr(hf, "LOGPROB_KEEP_BYTES", 0)
    model, tok = load_model("tiny-llama", seed=3)
    if case == "untied_with_bias":  # a trainable head with a bias of its own, not the embedding matrix
        head = model.get_output_embeddings()
        new = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(head.weight + 0.01 * torch.randn_like(head.weight))
            new.bias.normal_(0, 0.5)
        model.lm_head = new
        model.config.tie_word_embeddings = False
    if case == "lora":
        model = lora(model)
    rollout = _rollout_ending_early(model, tok)
    ids, mask, resp = rollout.input_ids(), rollout.attention_mask(), rollout.response_ids
    m = rollout.response_mask.bool()
    weights = torch.linspace(-1.0, 2.0, resp.numel()).view_as(resp) * m

    def grads():
        out = torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
        return out

    model.train()
    model.zero_grad()
    want_logp, want_entropy = _plain_logprobs(model, ids, mask, resp, 0.7)
    (want_logp * weights).sum().backward()
    want_grads = grads()
    # 3 KiB of logits per chunk is one position of the tiny vocabulary at a time: many chunks, ragged last one
    logp, entropy = response_logprobs(model, ids, mask, resp, temperature=0.7, with_entropy=True,
                                      share_prompts=case == "shared_prompts", chunk_bytes=3 * 4 * 1024)
    (logp * weights).sum().backward()
    got_grads = grads()
    torch.testing.assert_close(logp[m], want_logp.detach()[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[m], want_entropy.detach()[m], rtol=0, atol=1e-5)
    assert (logp[~m] == 0).all() and (entropy[~m] == 0).all()  # padding: no head computed, zeros, masked later
    assert want_grads.norm() > 0 and got_grads.shape == want_grads.shape
    assert ((got_grads - want_grads).norm() / want_grads.norm()).item() < 1e-5
    if case == "untied_with_bias":
        assert model.lm_head.bias.grad is None  # grads() cleared it; it was part of the comparison above
    assert bool(kept) == (probabilities == "kept") and all(kept)  # forward wrote into the kept buffer, or not at all


def test_a_head_with_no_response_tokens_has_a_zero_weight_gradient():
    from cohortrl.rollout.hf import _HeadLogProbs

    weight = torch.randn(11, 4, requires_grad=True)
    hidden = torch.randn(0, 4, requires_grad=True)
    logp, _ = _HeadLogProbs.apply(hidden, weight, None, torch.zeros(0, dtype=torch.long), 1.0, 3, False, 2**20,
                                  torch.nn.functional.linear)
    logp.sum().backward()
    assert weight.grad is not None and (weight.grad == 0).all() and hidden.grad.shape == (0, 4)


def test_the_chunked_head_is_used_and_bounds_the_logits_it_makes(monkeypatch):
    """The head runs in chunks of ``chunk_bytes``; the model's own full-logits path is not called."""
    import cohortrl.rollout.hf as hf

    model, tok = load_model("tiny-llama", seed=3)
    rollout, _ = generate(model, tok, ROWS, 2, Sampling(temperature=1.0, max_new_tokens=6))
    V = model.get_output_embeddings().weight.shape[0]
    sizes = []
    real = hf._chunk_logits
    monkeypatch.setattr(hf, "_chunk_logits", lambda product, h, *a: sizes.append(h.shape[0]) or real(product, h, *a))
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("the full-logits forward ran"))
    logp, _ = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), rollout.response_ids,
                                chunk_bytes=4 * V * 5)
    assert max(sizes) == 5 and sum(sizes) == int(rollout.attention_mask()[:, -rollout.response_ids.shape[1]:].sum())
    assert torch.isfinite(logp).all()


def test_a_pad_token_sampled_inside_a_response_does_not_end_it(monkeypatch):
    """SmolLM2 pads with <|endoftext|>, a token it can sample: the response runs on to its EOS, all of it
    scored and trained on, instead of being cut at the sampled pad."""
    import cohortrl.rollout.hf as hf

    model, tok = load_model("tiny-llama", seed=1)
    eos = hf.eos_token_ids(model, tok)[0]
    a, b = 40, 41
    script = iter([a, tok.pad_token_id, b, eos])
    monkeypatch.setattr(hf, "_sample", lambda logits, sampling, rows=None, generators=None: torch.full((logits.shape[0],), next(script)))
    rollout, _ = generate(model, tok, ROWS[:1], 1, Sampling(temperature=1.0, max_new_tokens=6))
    assert rollout.response_ids[0, :4].tolist() == [a, tok.pad_token_id, b, eos]
    assert rollout.response_mask[0].tolist() == [1, 1, 1, 1]  # through the EOS; the loop stopped there
    assert rollout.completions[0] == tok.decode([a, tok.pad_token_id, b], skip_special_tokens=True)
    assert not bool(rollout.truncated[0])
