"""The trainer's wiring checked against the step's own tensors, not against itself:

* the advantages a GRPO step trains on are the configured estimator's output on the step's rewards (every
  registered estimator), and PPO's are GAE on the score − β·KL token rewards (plus step rewards under
  ``reward.process``) and the critic's values, whitened (or not, as configured), across the holes that tool
  results leave in a response;
* every update after a step's first (another minibatch or epoch) trains against the rollout's log-probs as π_old;
* the logged loss is the policy loss plus β·KL, recomputed by hand from the step's log-probs, the reference's
  log-probs (checked against a plain forward of a copy of the initial model) and the advantages, for every
  aggregation mode and with the k2 estimator; PPO's value loss without a clip (``ppo.value_clip: null``) is the
  plain squared error of the critic's values;
* the LR of every optimiser step follows the schedule's formula (warm-up, then constant / linear / cosine),
  written out as numbers below, for the policy and PPO's critic, and a resumed run continues it exactly;
* the weights synced into a (stand-in) vLLM engine are the policy's merged weights, tensor by tensor, and a
  resumed run syncs the checkpoint's before its first step samples.

The step's tensors are read by wrapping methods on the instance (the algorithm object's ``targets``, the trainer's
``policy_loss``) and by optimiser hooks; nothing in the library is changed.
"""

import copy
import math
import sys

import pytest
import torch

from cohortrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    gae_advantages,
    kl_penalty,
    kl_shaped_rewards,
    masked_fill_padding,
    masked_whiten,
    outcome_token_rewards,
)
from cohortrl.trainers import make_trainer
from tests.golden.rewards import letter_words, starts_with_letter, starts_with_vowel
from tests.golden.runs import BASE, PROCESS_REWARD, ROWS, THREADS
from tests.rollout import vllm_standin
from tests.rollout.test_tools import _says_five as says_five, scripted
from tests.rollout.test_vllm_backend import record_syncs

WEIGHTS = (1.0, 0.5)  # starts_with_letter, starts_with_vowel


@pytest.fixture(autouse=True)
def one_thread_no_plots(monkeypatch):
    """As the golden runs: one thread (the same numbers as two, a fraction of the time on a busy 2-core
    machine) and no end-of-run plot (matplotlib takes longer than these runs and nothing here reads it)."""
    monkeypatch.setattr("cohortrl.trainers.loop.plot_curves", lambda run_dir: None)
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def build(tmp_path, *, reward_funcs=(starts_with_letter, starts_with_vowel), reward_weights=WEIGHTS, **sections):
    cfg = copy.deepcopy(BASE)
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return make_trainer(cfg, tmp_path, reward_funcs=list(reward_funcs), reward_weights=list(reward_weights),
                        train_dataset=ROWS)


def record_targets(trainer) -> list[dict]:
    """Wrap ``trainer.algorithm.targets``: per step, its inputs (batch, rewards, loss mask, ref / old log-probs) and
    output."""
    seen, targets = [], trainer.algorithm.targets

    def recording(batch, rewards_B, loss_mask, ref_logp, old_logp, timer):
        out = targets(batch, rewards_B, loss_mask, ref_logp, old_logp, timer)
        seen.append({"batch": batch, "rewards": rewards_B.clone(), "loss_mask": loss_mask.clone(), "ref_logp": ref_logp,
                     "old_logp": old_logp, "targets": out})
        return out

    trainer.algorithm.targets = recording
    return seen


def record_policy_loss(trainer) -> list[dict]:
    """Wrap ``trainer.policy_loss``: the keyword arguments of every call, detached."""
    calls, policy_loss = [], trainer.policy_loss

    def recording(**kwargs):
        calls.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        return policy_loss(**kwargs)

    trainer.policy_loss = recording
    return calls


def plain_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """log π(response token) from one plain forward of ``model``, written out here rather than taken from the
    library: logits at position P + t − 1 predict response token t; positions count real tokens only."""
    ids, mask = rollout.input_ids(), rollout.attention_mask()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    P, T = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1] / temperature, dim=-1)
    logp = logp.gather(-1, rollout.response_ids.unsqueeze(-1)).squeeze(-1)
    return logp * rollout.response_mask


# ---------------------------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("estimator", list(ADVANTAGE_ESTIMATORS))
def test_grpo_trains_on_the_configured_estimators_advantages_of_the_steps_rewards(tmp_path, estimator):
    process = estimator in ("grpo_process", "grpo_combined")
    # Settings away from the estimators' defaults (eps 1e-6, credit "sum"), so one dropped on its way is seen.
    eps, credit = 0.25, "min" if estimator == "grpo_process" else "sum"
    trainer = build(tmp_path, algorithm={"estimator": estimator, "eps": eps}, train={"steps": 1},
                    reward={"process": {**PROCESS_REWARD, "credit": credit}} if process else {})
    seen, losses = record_targets(trainer), record_policy_loss(trainer)
    trainer.train()
    (step,) = seen
    batch, targets = step["batch"], step["targets"]
    mask = batch.rollout.response_mask

    # The rewards are the weighted reward functions on the step's completions, recomputed here.
    completions = batch.rollout.completions
    rewards = torch.tensor([WEIGHTS[0] * a + WEIGHTS[1] * b for a, b in
                            zip(starts_with_letter(None, completions), starts_with_vowel(None, completions))])
    torch.testing.assert_close(step["rewards"], rewards, rtol=0, atol=0)
    assert rewards.view(-1, 4).std(-1).max() > 0, "no group has reward variance: every estimator would give 0"

    kwargs = dict(rewards=rewards, response_mask=mask, group_size=4, eps=eps)
    if process:
        assert batch.step_rewards is not None and any(any(s) for s in batch.step_rewards)
        kwargs.update(step_rewards=batch.step_rewards, step_ends=batch.step_ends, credit=credit, process_coef=0.5)
        # the step rewards are the process reward function's scores on the completions (no guard fires here)
        assert batch.step_rewards == [[s for s, _ in steps] for steps in letter_words(None, completions)]
    expected = ADVANTAGE_ESTIMATORS[estimator].fn(**kwargs)
    torch.testing.assert_close(targets.advantages, expected, rtol=0, atol=0)
    if estimator != "grpo":  # ... and that output differs from GRPO's: a swap for grpo would not pass
        assert not torch.allclose(expected, ADVANTAGE_ESTIMATORS["grpo"].fn(**kwargs), atol=1e-4)
    # The policy loss is handed exactly those advantages (one update on the whole batch here).
    (call,) = losses
    torch.testing.assert_close(call["advantages"], targets.advantages, rtol=0, atol=0)
    # ... with the configured eps and credit: the defaults would give other advantages
    if estimator in ("grpo", "grpo_batch", "grpo_process", "grpo_combined", "reinforce_pp", "reinforce_pp_baseline"):
        defaults = {**kwargs, "eps": 1e-6, **({"credit": "sum"} if process else {})}
        assert not torch.allclose(expected, ADVANTAGE_ESTIMATORS[estimator].fn(**defaults), atol=1e-4), estimator
    if estimator == "grpo_process":
        assert not torch.allclose(expected, ADVANTAGE_ESTIMATORS[estimator].fn(**{**kwargs, "credit": "sum"}), atol=1e-4)


def test_kl_in_the_reward_reaches_a_token_level_estimator_as_token_rewards(tmp_path):
    """REINFORCE++ with KL in the reward: the advantages are the estimator's on r − β·Σ KL and the per-token
    −β·KL_t (measured on the sampling policy against the reference), recomputed here from the step's tensors."""
    beta = 0.1
    trainer = build(tmp_path, algorithm={"estimator": "reinforce_pp", "kl_in_reward": True, "kl_estimator": "k1",
                                         "beta": beta}, train={"steps": 2})
    seen = record_targets(trainer)
    trainer.train()
    step = seen[1]  # after one update, so the policy and the reference differ
    mask = step["batch"].rollout.response_mask
    kl_BT = kl_penalty(step["old_logp"], step["ref_logp"], "k1")
    assert (kl_BT * mask).abs().max() > 1e-3
    shaped, token_rewards = kl_shaped_rewards(step["rewards"], kl_BT, mask, beta)
    kwargs = dict(rewards=shaped, response_mask=mask, group_size=4, eps=1e-6)
    expected = ADVANTAGE_ESTIMATORS["reinforce_pp"].fn(**kwargs, token_rewards=token_rewards)
    torch.testing.assert_close(step["targets"].advantages, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected, ADVANTAGE_ESTIMATORS["reinforce_pp"].fn(**kwargs), atol=1e-4)


def test_grpo_without_a_kl_term_trains_on_the_policy_loss_alone(tmp_path):
    """β = 0 (Dr. GRPO, DAPO, this repository's engineering runs): no reference model, KL logged as exactly 0,
    and the loss is the policy loss."""
    trainer = build(tmp_path, algorithm={"beta": 0.0}, train={"steps": 2})
    assert trainer.reference is None
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["kl"] == 0.0
        assert row["loss"] == pytest.approx(row["policy_loss"], rel=1e-6, abs=1e-9)


def check_ppo_targets(step: dict, beta: float, penalty: float, gamma: float, lam: float, whiten: bool = True,
                      process_coef: float = 0.0) -> None:
    """PPO's step ``step`` (from ``record_targets``) trained on GAE of score − β·k1, worked out by hand from its
    tensors: the score on each response's last token (and ``process_coef`` x each step reward on its step's last
    token), GAE over the row's response tokens in order (a masked tool result between two of them is skipped, as
    if absent), whitened over the loss mask (unless ``whiten`` is False: then as they are)."""
    batch, t = step["batch"], step["targets"]
    rollout, mask = batch.rollout, batch.rollout.response_mask
    kl = (step["old_logp"] - step["ref_logp"]) * mask  # k1, by hand
    assert kl.abs().max() > 1e-3
    score = step["rewards"] - penalty * rollout.truncated.float()
    steps = torch.zeros_like(kl)  # process_coef x each step's reward on the step's last token
    if process_coef:
        assert batch.step_rewards is not None and any(batch.step_rewards)
        for i, (scores, ends) in enumerate(zip(batch.step_rewards, batch.step_ends)):
            for value, end in zip(scores, ends):
                steps[i, end] += process_coef * value
    token_rewards = -beta * kl + steps
    positions = [row.nonzero().flatten().tolist() for row in mask]  # each row's response tokens, holes skipped
    for i, row in enumerate(positions):
        token_rewards[i, row[-1]] += score[i]  # the score on the last response token
    # GAE by hand: δ_t = r_t + γ V_next − V_t (V = 0 after the last token), A_t = δ_t + γλ A_next, where next is
    # the row's next response token.
    V = t.old_values * mask
    adv = torch.zeros_like(V)
    for i, row in enumerate(positions):
        running, next_v = 0.0, 0.0
        for k in reversed(row):
            running = token_rewards[i, k] + gamma * next_v - V[i, k] + gamma * lam * running
            adv[i, k], next_v = running, V[i, k]
    torch.testing.assert_close(t.returns * mask, (adv + V) * mask, rtol=1e-5, atol=1e-6)
    m = step["loss_mask"].bool()
    if whiten:
        adv = (adv - adv[m].mean()) / (adv[m].var() + 1e-8).sqrt()  # masked_whiten: unbiased variance, eps 1e-8
    torch.testing.assert_close(t.advantages * m, adv * m, rtol=1e-4, atol=1e-5)
    # sanity of the by-hand path against the library's pieces, so a mistake here is not a test that passes
    lib = gae_advantages(outcome_token_rewards(score, mask) + steps - beta * masked_fill_padding(
        kl_penalty(step["old_logp"], step["ref_logp"], "k1"), mask), t.old_values, mask, gamma, lam)[0]
    lib = masked_whiten(lib, m) if whiten else lib
    torch.testing.assert_close(t.advantages * m, lib * m, rtol=1e-5, atol=1e-6)


PPO_GAE = {"name": "ppo", "group_size": 1, "beta": 0.05, "kl_estimator": "k1",
           "ppo": {"kl_controller": "fixed", "gamma": 0.9, "lam": 0.8, "missing_eos_penalty": 0.1}}


@pytest.mark.parametrize("variant", ["whitened", "unwhitened", "process"])
def test_ppo_trains_on_whitened_gae_of_the_kl_penalised_rewards_and_the_critics_values(tmp_path, variant):
    """``ppo.whiten_advantages: false``: the same GAE, not whitened. ``reward.process``: each step's reward,
    times its coefficient, joins the token rewards on the step's last token."""
    ppo = {**PPO_GAE["ppo"], "whiten_advantages": variant != "unwhitened"}
    process = {"reward": {"process": PROCESS_REWARD}} if variant == "process" else {}
    trainer = build(tmp_path, algorithm={**PPO_GAE, "ppo": ppo, "prompts_per_step": 8}, train={"steps": 2}, **process)
    seen, losses = record_targets(trainer), record_policy_loss(trainer)
    reference = copy.deepcopy(trainer.model)  # the initial policy: what π_ref must be
    trainer.train()
    step = seen[1]  # step 2: the policy has moved, so the KL term is not 0
    torch.testing.assert_close(step["ref_logp"], plain_logprobs(reference, step["batch"].rollout, 1.0), rtol=1e-4, atol=1e-5)
    check_ppo_targets(step, beta=0.05, penalty=0.1, gamma=0.9, lam=0.8, whiten=variant != "unwhitened",
                      process_coef=PROCESS_REWARD["coef"] if variant == "process" else 0.0)
    # one update per step (1 epoch, 1 minibatch): step 2's policy loss is handed exactly those advantages
    assert len(losses) == 2
    torch.testing.assert_close(losses[1]["advantages"], step["targets"].advantages, rtol=0, atol=0)


def test_ppo_gae_skips_the_tool_results_inside_a_response(tmp_path):
    """A scripted model calls the calculator mid-response, so the response mask has holes where the results
    were fed (``tests/rollout/test_tools.py``): GAE runs from each model token to the next one across them, the
    score lands on the last model token, and the holes carry no advantage."""
    model, tok = scripted({"What is": "x = <call>calculator: 2+3</call>\nANSWER: 5\n"}, bias=10.0)
    cfg = copy.deepcopy(BASE)
    cfg.update(algorithm={**PPO_GAE, "prompts_per_step": 4}, sampling={"max_new_tokens": 56},
               rollout={"tools": ["calculator"]}, train={"steps": 2, "progress": False})
    trainer = make_trainer(cfg, tmp_path, model=model, tokenizer=tok, reward_funcs=[says_five], train_dataset=ROWS)
    seen = record_targets(trainer)
    trainer.train()
    step = seen[1]  # step 2: the policy has moved, so the KL term is not 0
    rollout = step["batch"].rollout
    mask = rollout.response_mask.bool()
    before_last = mask.flip(-1).long().cumsum(-1).flip(-1) > 0  # at or before each row's last response token
    holes = rollout.tool_mask.bool() & ~mask & before_last
    assert holes.any(), "no tool result inside a response: nothing to skip"
    check_ppo_targets(step, beta=0.05, penalty=0.1, gamma=0.9, lam=0.8)
    assert not step["targets"].advantages[holes].any()


def record_value_losses(trainer) -> list[dict]:
    """Wrap PPO's ``extra_loss`` and ``values``: per call, the critic's values V (from the one ``values`` call
    inside it), V_old and the returns R of its rows, its loss mask, and the value loss it returned."""
    algo = trainer.algorithm
    calls, values, extra_loss, critic_values = [], [], algo.extra_loss, algo.values

    def recording_values(*args, **kwargs):
        out = critic_values(*args, **kwargs)
        values.append(out.detach().clone())
        return out

    def recording_extra_loss(rows, loss_mask, logp, input_ids, attention_mask, targets):
        before = len(values)
        loss_BT, metrics = extra_loss(rows, loss_mask, logp, input_ids, attention_mask, targets)
        (V,) = values[before:]
        calls.append({"V": V, "old": targets.old_values[rows], "R": targets.returns[rows], "mask": loss_mask.clone(),
                      "loss": loss_BT.detach().clone(), "value_loss": metrics["value_loss"].detach().clone()})
        return loss_BT, metrics

    algo.values, algo.extra_loss = recording_values, recording_extra_loss
    return calls


def test_ppo_without_a_value_clip_trains_the_critic_on_the_plain_squared_error(tmp_path):
    """``ppo.value_clip: null``: L^V = ½ (V − R)², with no clipped term, in every update of a run whose second
    epoch moves V from V_old by more than the default clip (0.2), so a clip applied anyway would show."""
    vf_coef, default_clip = 0.5, 0.2
    ppo = {**PPO_GAE["ppo"], "value_clip": None, "vf_coef": vf_coef, "critic_lr": 0.05}
    trainer = build(tmp_path, algorithm={**PPO_GAE, "ppo": ppo, "prompts_per_step": 8, "epochs": 2})
    calls = record_value_losses(trainer)
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(calls) == 2 * len(rows) == 6  # 2 epochs of one minibatch, one micro-batch each
    binds = []
    for c in calls:
        m = c["mask"].float()
        plain = 0.5 * (c["V"] - c["R"]).square() * m
        torch.testing.assert_close(c["value_loss"] * m, plain, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(c["loss"] * m, vf_coef * plain, rtol=1e-5, atol=1e-7)
        clipped = torch.clamp(c["V"], c["old"] - default_clip, c["old"] + default_clip)
        binds.append(float(((0.5 * (clipped - c["R"]).square() * m) - plain).clamp(min=0).max()))
    assert max(binds) > 1e-3, binds  # the default clip would have raised the loss somewhere
    for step, row in enumerate(rows):  # the logged value loss: the mean over both epochs' loss tokens
        two = calls[2 * step : 2 * step + 2]
        by_hand = sum(float((0.5 * (c["V"] - c["R"]).square() * c["mask"]).sum()) for c in two) / sum(
            float(c["mask"].sum()) for c in two)
        assert row["value_loss"] == pytest.approx(by_hand, rel=1e-5)


# ---------------------------------------------------------------------------------------------- the loss
def aggregate_by_hand(loss_BT, mask_BT, mode: str, norm_length: int) -> torch.Tensor:
    m = mask_BT.double()
    loss_BT = loss_BT.double() * m
    if mode == "seq-mean-token-mean":  # (1/N) Σ_i (1/|o_i|) Σ_t L_it over rows with a token
        rows = m.sum(-1) > 0
        return (loss_BT.sum(-1)[rows] / m.sum(-1)[rows]).mean()
    if mode == "token-mean":  # Σ L / Σ M
        return loss_BT.sum() / m.sum()
    return loss_BT.sum() / (m.shape[0] * norm_length)  # Σ L / (N · norm_length)


# Schulman's estimators of KL(π_θ ‖ π_ref) by hand, x = log π_ref − log π_θ (the library's: tests/algorithms/test_kl.py)
KL_BY_HAND = {"k2": lambda x: x.square() / 2, "k3": lambda x: torch.exp(x) - x - 1}


@pytest.mark.parametrize("aggregation, kl_estimator", [
    ("seq-mean-token-mean", None), ("token-mean", None), ("seq-mean-token-sum-norm", None), ("token-mean", "k2"),
])
def test_grpo_loss_is_the_policy_loss_plus_beta_kl_recomputed_from_the_steps_tensors(tmp_path, aggregation, kl_estimator):
    """``kl_estimator`` None is GRPO's default, k3; k2 is set, so an estimator that does not reach the loss fails."""
    beta, kl_of = 0.1, KL_BY_HAND[kl_estimator or "k3"]
    trainer = build(tmp_path, algorithm={"aggregation": aggregation, "beta": beta, "kl_estimator": kl_estimator})
    reference = copy.deepcopy(trainer.model)
    seen, losses = record_targets(trainer), record_policy_loss(trainer)
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(rows) == len(seen) == len(losses) == 3  # one update per step
    kl_terms = []
    for row, step, call in zip(rows, seen, losses):
        rollout, mask = step["batch"].rollout, step["loss_mask"]
        assert torch.equal(call["response_mask"], mask)
        # π_ref is the initial policy: a plain forward of its copy gives the step's reference log-probs
        torch.testing.assert_close(step["ref_logp"], plain_logprobs(reference, rollout, 1.0), rtol=1e-4, atol=1e-5)
        logp, old, adv, ref = call["logp"], call["old_logp"], call["advantages"], step["ref_logp"]
        ratio = torch.exp(logp - old)  # on-policy: exactly 1, so the clipped surrogate is −A
        assert torch.equal(ratio * mask, mask.float())
        policy_BT = -adv * ratio
        kl_BT = kl_of(ref - logp)
        policy = aggregate_by_hand(policy_BT, mask, aggregation, 8)
        kl_term = beta * aggregate_by_hand(kl_BT, mask, aggregation, 8)
        # abs: the trainer sums float32 terms of size ~1 whose total is ~0 at ratio 1 (group baselines)
        assert row["loss"] == pytest.approx(float(policy + kl_term), rel=1e-5, abs=1e-6)
        assert row["policy_loss"] == pytest.approx(float(policy), rel=1e-5, abs=1e-6)
        assert row["kl"] == pytest.approx(float((kl_BT * mask).sum() / mask.sum()), rel=1e-5, abs=1e-9)
        kl_terms.append(float(kl_term))
    # After the first update the KL term is far above the tolerance: a loss without it fails above.
    assert min(kl_terms[1:]) > 100 * 1e-6, kl_terms


# ---------------------------------------------------------------------------------------------- LR schedule
# LR factor of each optimiser update u = 0 … 7 with 2 warm-up updates and 8 in all (4 steps x 2 minibatches):
# warm-up (u + 1)/2; then progress p = (u − 2)/6: constant 1, linear 1 − p, cosine (1 + cos πp)/2.
SCHEDULES = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.5, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6],
    "cosine": [0.5, 1.0, 1.0, 0.9330127018922193, 0.75, 0.5, 0.25, 0.0669872981077807],
}
LR = 1e-2


def record_lrs(optimizer) -> list[float]:
    lrs = []
    optimizer.register_step_pre_hook(lambda opt, *_: lrs.append(opt.param_groups[0]["lr"]))
    return lrs


def lr_config(schedule: str, steps: int = 4) -> dict:
    return dict(algorithm={"group_size": 2, "prompts_per_step": 2, "minibatches": 2},
                sampling={"max_new_tokens": 4}, optim={"lr": LR, "warmup_steps": 2, "schedule": schedule},
                train={"steps": steps, "checkpoint_every": 2})


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_lr_of_every_update_follows_the_schedule_and_resumes_mid_schedule(tmp_path, schedule):
    want = [LR * f for f in SCHEDULES[schedule]]
    full = build(tmp_path / "full", **lr_config(schedule))
    lrs = record_lrs(full.optimizer)
    rows = [r for r in full.train() if "loss" in r]
    assert lrs == pytest.approx(want, rel=1e-12)
    # the logged LR is the one the next update will use: factor of update 2k after step k (0 after the last)
    assert [r["lr"] for r in rows] == pytest.approx([*want[2::2], 0.0 if schedule != "constant" else LR], rel=1e-12)

    first = build(tmp_path / "split", **lr_config(schedule))
    first_lrs = record_lrs(first.optimizer)
    first.train(steps=2)
    resumed = make_trainer(full.cfg, tmp_path / "split", resume=True, reward_funcs=[starts_with_letter, starts_with_vowel],
                           reward_weights=list(WEIGHTS), train_dataset=ROWS)
    resumed_lrs = record_lrs(resumed.optimizer)
    resumed.train()
    assert first_lrs == pytest.approx(want[:4], rel=1e-12)
    assert resumed_lrs == pytest.approx(want[4:], rel=1e-12), "the resumed run did not continue the schedule"


def test_ppo_policy_and_critic_lrs_follow_their_schedules(tmp_path):
    """The policy is frozen for the critic's 1 warm-up step, so its schedule spans (3 − 1) x 2 = 4 updates; the
    critic's spans all 3 x 2 = 6. One LR warm-up update, then linear decay: 1 − (u − 1)/(n − 1)."""
    trainer = build(tmp_path, algorithm={
        "name": "ppo", "group_size": 1, "prompts_per_step": 4, "minibatches": 2,
        "ppo": {"critic_warmup_steps": 1, "critic_lr": 1e-3},
    }, sampling={"max_new_tokens": 4}, optim={"lr": LR, "warmup_steps": 1, "schedule": "linear"}, train={"steps": 3})
    policy_lrs, critic_lrs = record_lrs(trainer.optimizer), record_lrs(trainer.optimised["critic"].optimizer)
    trainer.train()
    assert policy_lrs == pytest.approx([LR * f for f in (1.0, 1.0, 2 / 3, 1 / 3)], rel=1e-12)
    assert critic_lrs == pytest.approx([1e-3 * f for f in (1.0, 1.0, 0.8, 0.6, 0.4, 0.2)], rel=1e-12)


def test_steps_past_a_decayed_schedule_are_refused_and_a_longer_train_steps_stretches_it(tmp_path):
    """Linear and cosine decay reach LR 0 at train.steps: steps past it would not train, so asking for them is
    refused with the fix (a larger train.steps, over which the decay is then spread)."""
    from cohortrl.config import ConfigError
    from cohortrl.trainers.loop import RunCompleteError

    trainer = build(tmp_path, **lr_config("linear", steps=2))
    trainer.train()
    with pytest.raises(RunCompleteError, match=r"larger total with train\.steps=N, N > 2 .*--resume train\.steps=N\)"):
        trainer.train()
    with pytest.raises(ConfigError, match=r"^training to step 3 \(--steps\) goes past train\.steps=2, where "
                                          r"optim\.schedule=linear has brought the learning rate to 0.* Set train\.steps=3"):
        trainer.train(steps=3)
    assert trainer.step_count == 2

    longer = copy.deepcopy(trainer.cfg)
    longer.train.steps = 4
    resumed = make_trainer(longer, tmp_path, resume=True, reward_funcs=[starts_with_letter, starts_with_vowel],
                           reward_weights=list(WEIGHTS), train_dataset=ROWS)
    lrs = record_lrs(resumed.optimizer)
    resumed.train()
    # updates 4-7 follow the new schedule from the first on (not the 0 the checkpoint's last LR was): 8 updates,
    # 2 warm-up, progress (u − 2)/6
    assert lrs == pytest.approx([LR * f for f in (4 / 6, 3 / 6, 2 / 6, 1 / 6)], rel=1e-12)


# ---------------------------------------------------------------------------------------------- vLLM sync
def first_token_is_even(prompts, completions, completion_ids, **columns):
    """About half of every group is right (the tiny model's first tokens are near-uniform)."""
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


def merged_by_peft(model) -> dict[str, torch.Tensor]:
    if not hasattr(model, "peft_config"):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return copy.deepcopy(model).merge_and_unload().state_dict()


@pytest.mark.parametrize("lora", [False, True])
def test_the_weights_synced_into_vllm_are_the_updated_policys_merged_weights(tmp_path, monkeypatch, lora):
    monkeypatch.setitem(sys.modules, "vllm", vllm_standin.module())
    loaded = record_syncs(monkeypatch)
    trainer = build(tmp_path, reward_funcs=[first_token_is_even], reward_weights=[1.0],
                    sampling={"backend": "vllm", "max_new_tokens": 3},
                    model={"lora": {"enabled": lora, "r": 4, "alpha": 8}}, optim={"lr": 5e-2})
    initial = merged_by_peft(trainer.model)
    trainer.train(steps=1)
    assert loaded == []  # nothing to sync before the first update
    updated = merged_by_peft(trainer.model)
    moved = [k for k in initial if not torch.equal(initial[k], updated[k])]
    assert moved, "the update did not move the policy; the test would not tell a stale sync from a fresh one"
    trainer.train(steps=2)  # step 2 syncs the engine before generating
    assert len(loaded) == 1
    synced = loaded[0]
    assert sorted(synced) == sorted(updated)
    for key, value in updated.items():
        torch.testing.assert_close(synced[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    assert any(synced[k].abs().max() > 0 for k in moved)
    assert math.isfinite(sum(float(v.float().abs().sum()) for v in synced.values()))


@pytest.mark.parametrize("lora", [False, True])
def test_a_resumed_vllm_run_samples_its_first_step_from_the_checkpoints_weights(tmp_path, monkeypatch, lora):
    """The engine is built from the model as loaded, before the checkpoint's weights replace it: the first
    resumed step must sync the engine before it generates, or it samples from the initial policy."""
    monkeypatch.setitem(sys.modules, "vllm", vllm_standin.module())
    loaded = record_syncs(monkeypatch)
    sections = dict(sampling={"backend": "vllm", "max_new_tokens": 3}, optim={"lr": 5e-2},
                    model={"lora": {"enabled": lora, "r": 4, "alpha": 8}})
    first = build(tmp_path, reward_funcs=[first_token_is_even], reward_weights=[1.0], **sections)
    initial = merged_by_peft(first.model)
    first.train(steps=1)  # checkpoints step 1
    first.close()
    checkpointed = merged_by_peft(first.model)
    assert any(not torch.equal(initial[k], checkpointed[k]) for k in initial), "step 1 did not move the policy"
    assert loaded == []  # the first run's one step needed no sync

    resumed = make_trainer(first.cfg, tmp_path, resume=True, reward_funcs=[first_token_is_even], reward_weights=[1.0],
                           train_dataset=ROWS)
    synced_before_generating = []
    generate = resumed.engine.generate
    resumed.engine.generate = lambda *a, **kw: synced_before_generating.append(len(loaded)) or generate(*a, **kw)
    resumed.train(steps=2)
    resumed.close()
    assert synced_before_generating == [1], "the resumed run's first step sampled before the engine got the checkpoint"
    synced = loaded[0]
    assert sorted(synced) == sorted(checkpointed)
    for key, value in checkpointed.items():
        torch.testing.assert_close(synced[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


# ---------------------------------------------------------------------------------------------- the step's settings
@pytest.mark.parametrize("setting", ["mask_truncated", "filter", "both"])
def test_the_loss_mask_keeps_exactly_the_responses_the_settings_train_on(tmp_path, setting):
    """``mask_truncated``: a response that hit the token budget carries no loss; ``zero_variance: filter``: nor
    does any response of a group whose responses were all equally correct; with both, neither. Every other token
    of the response mask does, with weight 1. The responses stop at a space or at 3 tokens, so both kinds occur."""
    algorithm = {"mask_truncated": setting != "filter", "zero_variance": "keep" if setting == "mask_truncated" else "filter"}
    trainer = build(tmp_path, algorithm=algorithm, sampling={"max_new_tokens": 3}, train={"steps": 2})
    seen = record_targets(trainer)
    rows = [r for r in trainer.train() if "loss" in r]
    dropped = 0
    for step, row in zip(seen, rows):
        batch = step["batch"]
        drop_B = torch.zeros(8, dtype=torch.bool)
        if algorithm["mask_truncated"]:
            drop_B |= batch.rollout.truncated
        if algorithm["zero_variance"] == "filter":
            drop_B |= batch.zero_variance.repeat_interleave(4)
        expected = batch.rollout.response_mask * (~drop_B).unsqueeze(-1)
        assert torch.equal(step["loss_mask"], expected.to(step["loss_mask"].dtype))
        assert row["skipped_nonfinite"] == 0 and math.isfinite(row["loss"])
        assert row["trained_responses"] == int((~drop_B).sum())
        dropped += int(drop_B.sum())
    assert 0 < dropped < 2 * 8  # some rows dropped, some kept


def test_a_step_times_each_phase_under_its_name(tmp_path):
    row = build(tmp_path, train={"steps": 1}).step()
    for phase in ("generate", "score", "reference", "train", "optimizer"):
        assert row[f"time/{phase}"] >= 0, phase
    assert row["time/optimizer"] <= row["time/train"] <= row["time/step"]  # the optimiser step is part of training


def test_vllm_importance_weights_multiply_the_policy_loss_token_by_token(tmp_path, monkeypatch):
    """Sampled by (a stand-in) vLLM, whose log-probs differ from the policy's: the loss is the clipped surrogate
    times w_t = min(π_old / π_vLLM, C), recomputed here from the rollout's sampling log-probs."""
    monkeypatch.setitem(sys.modules, "vllm", vllm_standin.module())
    trainer = build(tmp_path, reward_funcs=[first_token_is_even], reward_weights=[1.0], algorithm={"beta": 0.0},
                    sampling={"backend": "vllm", "max_new_tokens": 3, "is_cap": 2.0}, train={"steps": 1})
    # The engine's numerics differ from the trainer's: here, through vLLM's own interface, perturbed weights.
    torch.manual_seed(0)
    perturbed = [(name, value + 0.05 * torch.randn_like(value)) for name, value in merged_by_peft(trainer.model).items()]
    trainer.engine.llm.collective_rpc("cohortrl_load_weights", args=(perturbed,))
    seen, losses = record_targets(trainer), record_policy_loss(trainer)
    row = trainer.step()
    step, call = seen[0], losses[0]
    rollout, mask = step["batch"].rollout, step["loss_mask"]
    w_BT = torch.clamp(torch.exp(step["old_logp"] - rollout.sampling_logp), max=2.0) * rollout.response_mask
    assert not torch.allclose(w_BT[mask.bool()], torch.ones(())), "weights of 1 would not tell × from ÷"
    policy_BT = -call["advantages"] * torch.exp(call["logp"] - call["old_logp"])  # ratio ~1: one on-policy update
    expected = aggregate_by_hand(policy_BT * w_BT, mask, "seq-mean-token-mean", 3)
    assert row["policy_loss"] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert row["is_weight_mean"] == pytest.approx(float(w_BT.sum() / rollout.response_mask.sum()), rel=1e-5)


@pytest.mark.parametrize("epochs, minibatches, off_policy", [(1, 1, False), (2, 1, True), (1, 2, True)])
def test_old_logprobs_are_computed_exactly_when_an_update_can_be_off_policy(tmp_path, epochs, minibatches, off_policy):
    """A second epoch or minibatch updates a policy that no longer sampled the batch: the clipped ratio needs
    log π_old, computed before the first update (on-policy with one update it is the policy's own, ratio 1)."""
    trainer = build(tmp_path, algorithm={"epochs": epochs, "minibatches": minibatches}, train={"steps": 1})
    seen = record_targets(trainer)
    row = trainer.step()
    assert (seen[0]["old_logp"] is not None) == off_policy
    assert row["time/reference"] >= 0  # the phase that computes them (and π_ref's) is timed under its name


@pytest.mark.parametrize("epochs, minibatches", [(1, 2), (2, 1)])
def test_every_update_after_the_first_trains_against_the_rollouts_logprobs(tmp_path, epochs, minibatches):
    """π_old is the policy that sampled, for every minibatch of every epoch, whichever of the two makes the second
    update: its ratio is π_θ (moved by the first update) over the rollout's log-probs, not 1. A π_old taken from
    the current policy unless ``epochs > 1`` (or unless ``minibatches > 1``) passes every run with both."""
    trainer = build(tmp_path, algorithm={"epochs": epochs, "minibatches": minibatches}, train={"steps": 2})
    seen, calls = record_targets(trainer), record_policy_loss(trainer)
    trainer.train()
    assert len(calls) == 2 * 2  # per step, one call per update (each one micro-batch)
    moved = 0
    for s, step in enumerate(seen):
        old_BT, G = step["old_logp"], 4
        rows = [old_BT[g * G:(g + 1) * G] for g in range(2)] if minibatches == 2 else [old_BT]  # a group, or all
        for u, call in enumerate(calls[2 * s:2 * s + 2]):
            assert any(torch.equal(call["old_logp"], r) for r in rows), \
                f"step {s + 1} update {u + 1}: π_old is not the rollout's log-probs"
        second = calls[2 * s + 1]
        mask = second["response_mask"].bool()
        moved += bool((second["logp"] - second["old_logp"])[mask].abs().max() > 1e-4)
    assert moved, "the first update never moved the policy: the ratio of the second would be 1 anyway"


def test_reward_functions_see_how_many_steps_are_done(tmp_path):
    """TRL's ``trainer_state.global_step``: 0 while the first step samples, 1 during the second."""
    steps = []

    def letter(prompts, completions, trainer_state=None, **_):
        steps.append(trainer_state.global_step)
        return [float(c[:1].isalpha()) for c in completions]

    trainer = build(tmp_path, reward_funcs=(letter,), reward_weights=(1.0,), train={"steps": 2})
    trainer.train()
    assert steps == [0, 1]


def test_the_policy_loss_gets_the_configured_clip_range_and_dual_clip(tmp_path):
    trainer = build(tmp_path, algorithm={"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 3.0}, train={"steps": 1})
    calls = record_policy_loss(trainer)
    trainer.step()
    assert [(c["clip_low"], c["clip_high"], c["dual_clip"]) for c in calls] == [(0.1, 0.3, 3.0)]



def first_row_right(prompts, completions, **columns):
    """Row 0 scores 1, the others 0."""
    return [float(i == 0) for i in range(len(completions))]


def test_a_minibatch_of_one_token_trains_on_it(tmp_path):
    """The edge where a token's aggregation weight is exactly 1: two prompts with one one-token response each,
    one per minibatch (each minibatch's aggregate is its single token, in every aggregation mode), REINFORCE++'s
    batch-normalised advantages ±1/√2. The logged loss is the backpropagated one: it must equal the policy loss
    recomputed from the step's tensors, and have a gradient."""
    trainer = build(tmp_path, reward_funcs=(first_row_right,), reward_weights=(1.0,),
                    sampling={"max_new_tokens": 1}, train={"steps": 1},
                    algorithm={"estimator": "reinforce_pp", "group_size": 1, "prompts_per_step": 2, "minibatches": 2,
                               "beta": 0.0})
    calls = record_policy_loss(trainer)
    row = trainer.step()
    assert len(calls) == 2 and all(int(c["response_mask"].sum()) == 1 for c in calls)
    per_minibatch = [float((-c["advantages"] * torch.exp(c["logp"] - c["old_logp"]) * c["response_mask"]).sum())
                     for c in calls]
    assert abs(per_minibatch[0]) == pytest.approx(2 ** -0.5, rel=1e-5)  # on-policy (ratio 1), |A| = 1/√2
    assert row["loss"] == pytest.approx(sum(per_minibatch) / 2, rel=1e-4, abs=1e-6)
    assert row["grad_norm"] > 1e-3
