"""PRIME's implicit PRM (arXiv 2502.01456): token rewards β·(log π_φ − log π_ref) checked against log-probs
worked out from the models' own forward passes; step rewards are sums of their tokens' rewards; one online
update moves σ(β Σ_t log π_φ/π_ref) towards the outcome label; the trainer runs it, logs it, checkpoints φ and
refuses it under torchrun."""

import copy
import math

import pytest
import torch

from cohortrl.config import ConfigError
from cohortrl.distributed import Dist
from cohortrl.models import load_model
from cohortrl.reward_models.implicit_prm import ImplicitPRM, step_sums
from cohortrl.rewards.process import build_step_source
from cohortrl.rewards.scoring import RewardFunctionError
from cohortrl.rollout.types import Rollout
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.loop import _check_distributed
from tests.trainers.test_grpo import params_of, tiny_config

PROMPT = "Compute 2 + 8 - 6."
RESPONSES = ["s1 = 10\ns2 = 4\nANSWER: 4", "s1 = 12"]


def test_step_sums_hand_worked():
    # Token rewards 1..5, steps ending on tokens 1 and 3: (1 + 2), then (3 + 4) plus the trailing 5.
    assert step_sums([1.0, 2.0, 3.0, 4.0, 5.0], [1, 3]) == [3.0, 12.0]
    # Two steps ending on token 1: the token is the first's, the second gets the rest (3).
    assert step_sums([1.0, 2.0, 3.0], [1, 1, 2]) == [3.0, 0.0, 3.0]
    assert step_sums([1.0, 2.0], []) == []


def make_rollout(tok, responses=RESPONSES) -> Rollout:
    """One prompt, the given responses, right-padded: the tensors generation would hand over."""
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    T = max(len(x) for x in ids)
    B = len(responses)
    response_ids = torch.full((B, T), tok.pad_token_id)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for b, x in enumerate(ids):
        response_ids[b, : len(x)], response_mask[b, : len(x)] = torch.tensor(x), 1
    return Rollout(
        prompt_ids=torch.tensor([prompt_ids] * B), prompt_mask=torch.ones(B, len(prompt_ids), dtype=torch.long),
        response_ids=response_ids, response_mask=response_mask, truncated=torch.zeros(B, dtype=torch.bool),
        completions=[tok.decode(x, skip_special_tokens=True) for x in ids], group_size=B,
        rows=[{"prompt": PROMPT}] * B,
    )


def by_hand(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log π(y_t | x, y_<t) from one unpadded forward: the logits at position |x| + t − 1 predict y_t."""
    full = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = model(input_ids=full).logits[0].float().log_softmax(-1)
    n = len(prompt_ids)
    return [logp[n + t - 1, y].item() for t, y in enumerate(response_ids)]


@pytest.fixture(scope="module")
def models():
    policy, tok = load_model("tiny-llama", seed=0)
    phi = copy.deepcopy(policy)
    with torch.no_grad():  # a different φ, so that the log-ratios are not all 0
        for p in phi.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy.eval(), phi.eval(), tok


def test_token_rewards_and_step_rewards_by_hand(models):
    policy, phi, tok = models
    beta = 0.5
    prm = ImplicitPRM(policy, tok, beta=beta, update=False, prm=phi)
    rollout = make_rollout(tok)
    rewards_BT = prm.token_rewards(rollout)
    prompt_ids = rollout.prompt_ids[0].tolist()
    for b in range(rollout.batch_size):
        ids = rollout.response_ids[b][rollout.response_mask[b].bool()].tolist()
        expected = [beta * (f - r) for f, r in zip(by_hand(phi, prompt_ids, ids), by_hand(policy, prompt_ids, ids))]
        assert rewards_BT[b, : len(ids)].tolist() == pytest.approx(expected, abs=1e-4)
        assert rewards_BT[b, len(ids):].abs().sum() == 0  # padding earns nothing
        assert any(abs(x) > 1e-3 for x in expected)

    # Steps of response 0 are its lines. A line's last token is the first whose decoded prefix holds the
    # whole line, found here by decoding prefixes; each step sums its tokens, the last also the rest.
    steps = prm.score(rollout, {})
    ids = rollout.response_ids[0][rollout.response_mask[0].bool()].tolist()
    text = rollout.completions[0]
    lines = text.split("\n")
    ends, pos = [], 0
    for line in lines:
        pos += len(line)
        ends.append(next(k for k in range(len(ids)) if len(tok.decode(ids[: k + 1], skip_special_tokens=True)) >= pos))
        pos += 1
    r = rewards_BT[0].tolist()
    expected_steps = [sum(r[: ends[0] + 1]), sum(r[ends[0] + 1 : ends[1] + 1]), sum(r[ends[1] + 1 : len(ids)])]
    assert [s for s, _ in steps[0]] == pytest.approx(expected_steps, abs=1e-5)
    assert [text[a:b] for _, (a, b) in steps[0]] == lines
    # The steps add up to the whole-response reward β·log π_φ(y|x)/π_ref(y|x).
    for b, row in enumerate(steps):
        assert sum(s for s, _ in row) == pytest.approx(rewards_BT[b].sum().item(), abs=1e-5)


def test_steps_are_found_in_the_whole_response_when_a_tool_result_sits_in_it(models):
    """A text-protocol tool result inside the response: the completion holds it, so steps are mapped over every
    token of the response (the result's own earn 0), at their positions in the response."""
    policy, phi, tok = models
    prm = ImplicitPRM(policy, tok, beta=0.5, update=False, prm=phi)
    pieces = ["s1 = <call>calculator: 2+8</call>", "<result>10</result>", "\ns2 = 4\nANSWER: 4"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in pieces]
    rollout = make_rollout(tok, ["".join(pieces)])
    flat = [t for x in ids for t in x]
    rollout.response_ids = torch.tensor([flat])
    rollout.tool_mask = torch.tensor([[0] * len(ids[0]) + [1] * len(ids[1]) + [0] * len(ids[2])])
    rollout.response_mask = 1 - rollout.tool_mask
    rollout.completions = [tok.decode(flat, skip_special_tokens=True)]
    assert rollout.completions[0] == "".join(pieces)
    rewards = prm.token_rewards(rollout)[0].tolist()
    assert all(rewards[k] == 0 for k in range(len(ids[0]), len(ids[0]) + len(ids[1])))  # the tool's tokens
    # hand-found: step 1 ends on the result's last token, step 2 on the "4" of "s2 = 4", step 3 takes the rest
    end1 = len(ids[0]) + len(ids[1]) - 1
    end2 = end1 + next(k for k in range(1, len(ids[2]) + 1) if tok.decode(ids[2][:k]) == "\ns2 = 4")
    expected = [sum(rewards[: end1 + 1]), sum(rewards[end1 + 1 : end2 + 1]), sum(rewards[end2 + 1 :])]
    steps = prm.score(rollout, {})[0]
    assert [s for s, _ in steps] == pytest.approx(expected, abs=1e-6)
    # Mapping over the model's tokens only (what it did before) misplaces the steps after the result.
    from cohortrl.rollout.types import token_char_ends
    from cohortrl.step_spans import split_steps, step_end_tokens

    own = [t for t, m in zip(flat, rollout.response_mask[0].tolist()) if m]
    before = step_sums(rewards[: len(own)], step_end_tokens(split_steps(rollout.completions[0]), token_char_ends(tok, own)))
    assert before != pytest.approx(expected, abs=1e-6)


def implicit_reward(prm: ImplicitPRM, rollout, row: int) -> float:
    return prm.token_rewards(rollout)[row].sum().item()


@pytest.mark.parametrize("label", [1.0, 0.0])
def test_one_update_moves_the_implicit_outcome_towards_the_label(models, label):
    policy, _, tok = models
    rollout = make_rollout(tok, RESPONSES[:1])
    prm = ImplicitPRM(policy, tok, beta=0.5, lr=1e-3)  # φ starts as a copy of the policy: every reward 0
    assert implicit_reward(prm, rollout, 0) == 0.0
    metrics = prm.update(rollout, [label])
    # Before the step σ(0) = ½ for either label: L = −log ½ = log 2; the PRM's sign test (> 0) calls it 0.
    assert metrics["implicit_prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["implicit_prm/accuracy"] == (1.0 if label == 0.0 else 0.0)
    after = torch.sigmoid(torch.tensor(implicit_reward(prm, rollout, 0))).item()
    assert (after > 0.5) if label == 1.0 else (after < 0.5)
    assert prm.update(rollout, [None]) == {}  # nothing labelled, nothing learned
    with pytest.raises(ValueError, match=r"outcome labels in \[0, 1\]"):
        prm.update(rollout, [2.0])


def test_lora_policy_is_copied_as_plain_weights_and_bad_kwargs_are_named():
    from peft import LoraConfig, get_peft_model

    policy, tok = load_model("tiny-llama", seed=0)
    lora = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    prm = ImplicitPRM(lora, tok, beta=0.1)
    assert not hasattr(prm.phi, "peft_config") and all(p.requires_grad for p in prm.phi.parameters())
    assert implicit_reward(prm, make_rollout(tok), 0) == 0.0
    with pytest.raises(RewardFunctionError, match="process reward 'implicit_prm' does not take kwargs"):
        build_step_source("implicit_prm", {"betta": 0.1}, policy=policy, tokenizer=tok)
    with pytest.raises(ValueError, match="update: false"):
        build_step_source("implicit_prm", {"update": False}, policy=policy, tokenizer=tok)


def implicit_config(tmp_path, **train):
    return tiny_config(
        tmp_path / "unused.jsonl",
        data={"source": "task:arithmetic", "level": 2, "train_size": 50, "eval_size": 8},
        reward={"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}], "correctness": "accuracy",
                "process": {"name": "implicit_prm", "kwargs": {"beta": 0.5, "lr": 1e-3}, "require_answer": False}},
        algorithm={"estimator": "grpo_combined"},
        sampling={"max_new_tokens": 12},
        train={"steps": 2, "progress": False, **train},
    )


def test_grpo_with_the_implicit_prm_learns_it_online_and_checkpoints_it(tmp_path):
    cfg = implicit_config(tmp_path, checkpoint_every=1)
    trainer = GRPOTrainer(cfg, tmp_path / "run")
    source = trainer.process
    assert isinstance(source, ImplicitPRM) and source.reference is trainer.reference.model  # π_ref shared
    phi_before = params_of(source.phi)
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(rows) == 2
    # φ = π_ref before its first update: 0 up to float noise (equal weights in two tensors can take different
    # BLAS paths for a one-position product)
    assert abs(rows[0]["step_reward_mean"]) < 1e-6
    assert abs(rows[1]["step_reward_mean"]) > 1e-5  # and not after it
    for r in rows:
        assert math.isfinite(r["implicit_prm/loss"]) and 0 <= r["implicit_prm/accuracy"] <= 1
    assert any(not torch.equal(phi_before[n], p) for n, p in params_of(source.phi).items())
    # A resumed run gets φ back from the checkpoint, not the initial policy.
    resumed = GRPOTrainer.resume(tmp_path / "run", cfg)
    for name, p in params_of(resumed.process.phi).items():
        assert torch.equal(p, params_of(source.phi)[name]), name


def test_implicit_prm_is_refused_under_torchrun(tmp_path):
    with pytest.raises(ConfigError, match="'implicit_prm': not supported under torchrun"):
        _check_distributed(implicit_config(tmp_path), "grpo", Dist(rank=0, world=2, launched=True))
