"""Policy and value losses: hand-worked numbers, the closed-form gradient, ρ = 1, and padding fuzz."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import AGGREGATION_MODES, aggregate, kl_penalty, policy_loss, value_loss

from .helpers import FAST, GARBAGE, masks, right_padded_mask, t, tensor_like, with_garbage

LN = math.log


# ---------------------------------------------------------------------------------------------- hand-worked


def test_token_clip_hand_worked():
    # ε_low = .2, ε_high = .28 (DAPO clip-higher), dual clip c = 3.  L = −min(ρA, clip(ρ, .8, 1.28)A)
    #   t0: ρ 1.5, A +1 → −min(1.5, 1.28)   = −1.28   clipped high
    #   t1: ρ 0.5, A +1 → −min(0.5, 0.8)    = −0.5
    #   t2: ρ 0.5, A −1 → −min(−0.5, −0.8)  =  0.8    clipped low
    #   t3: ρ 1.5, A −1 → −min(−1.5, −1.28) =  1.5
    #   t4: ρ 4.0, A −2 → −min(−8, −2.56)   =  8  → dual clip: min(8, 3·2) = 6
    #   row 1: one token, ρ 1, A .5 → −.5; the rest is padding with garbage
    ratios = t([[1.5, 0.5, 0.5, 1.5, 4.0], [1.0, 1e30, -1e30, 5.0, 0.0]])
    advantages = t([[1, 1, -1, -1, -2], [0.5, 1e30, -1e30, 7.0, 0.0]])
    mask = right_padded_mask([5, 1], 5)
    old_logp = t([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, 0, 0, 0, 0]])
    logp = torch.where(mask, old_logp + torch.log(ratios.clamp(min=1e-300)), t(1e30))
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, t([[-1.28, -0.5, 0.8, 1.5, 6.0], [-0.5, 0, 0, 0, 0]]))
    loss_no_dual, _ = policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert loss_no_dual[0, 4].item() == pytest.approx(8.0)
    # 6 response tokens: one clipped low, one high, one dual-capped; ratio mean (1.5+.5+.5+1.5+4+1)/6 = 1.5
    # approx_kl = mean((ρ − 1) − ln ρ) = (.0945 + .1931 + .1931 + .0945 + 1.6137 + 0)/6 ≈ 0.3648
    kl = [(r - 1) - LN(r) for r in (1.5, 0.5, 0.5, 1.5, 4.0, 1.0)]
    assert metrics == pytest.approx(
        {"clip_frac_low": 1 / 6, "clip_frac_high": 1 / 6, "clip_frac_dual": 1 / 6, "ratio_mean": 1.5,
         "approx_kl": sum(kl) / 6}
    )
    assert all(isinstance(v, float) for v in metrics.values())


def test_sequence_level_gspo_hand_worked():
    # row 0: log ρ = [.1, −.1, .3] → mean .1 → s = e^.1 ≈ 1.1052 ∈ [.8, 1.2], A = 1 → L = −1.1052 per token
    # row 1: log ρ = [.5, .5] → s = e^.5 ≈ 1.6487 > 1.2, A = 1 → L = −1.2 (clipped high)
    # row 2: log ρ = [−.5] → s = e^−.5 ≈ .6065 < .8, A = −1 → L = −min(−.6065, −.8) = .8 (clip low)
    mask = right_padded_mask([3, 2, 1], 3)
    log_ratio = t([[0.1, -0.1, 0.3], [0.5, 0.5, 99.0], [-0.5, 99.0, 99.0]])
    old_logp = torch.full((3, 3), -1.0, dtype=torch.float64)
    loss, metrics = policy_loss(old_logp + log_ratio, old_logp, t([1.0, 1.0, -1.0]), mask, level="sequence")
    e = math.exp(0.1)
    torch.testing.assert_close(loss, t([[-e, -e, -e], [-1.2, -1.2, 0], [0.8, 0, 0]]))
    # 6 tokens: 2 clipped high (row 1), 1 clipped low (row 2); ratio mean (3e^.1 + 2e^.5 + e^−.5)/6
    assert metrics["clip_frac_high"] == pytest.approx(2 / 6)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["ratio_mean"] == pytest.approx((3 * e + 2 * math.exp(0.5) + math.exp(-0.5)) / 6)


def test_value_loss_hand_worked():
    # c = .2.  V_c = clip(V, V_old − .2, V_old + .2);  L = ½ max((V − R)², (V_c − R)²)
    #   V 1, V_old .5, R 0 → V_c .7: ½ max(1, .49)    = .5
    #   V 1, V_old .5, R 2 → V_c .7: ½ max(1, 1.69)   = .845   (the clipped term wins)
    #   V .5, V_old .5, R 0 → V_c .5: ½ max(.25, .25) = .125
    #   4th slot padding
    values, old_values, returns = t([[1.0, 1.0, 0.5, 1e30]]), t([[0.5, 0.5, 0.5, -1e30]]), t([[0.0, 2.0, 0.0, 1e30]])
    mask = right_padded_mask([3], 4)
    torch.testing.assert_close(value_loss(values, old_values, returns, mask), t([[0.5, 0.845, 0.125, 0.0]]))
    # unclipped: ½ (V − R)² = [.5, .5, .125]
    torch.testing.assert_close(value_loss(values, old_values, returns, mask, clip=None), t([[0.5, 0.5, 0.125, 0.0]]))


def test_losses_validate_their_arguments():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="level="):
        policy_loss(logp, logp, torch.zeros(2), mask, level="tokens")
    with pytest.raises(ValueError, match="dual_clip=0.5"):
        policy_loss(logp, logp, torch.zeros(2), mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, logp, torch.zeros(2), mask, clip_low=1.0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(logp, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match=r"expected \(N,\) = \(2,\)"):
        policy_loss(logp, logp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(logp, logp, torch.zeros(2), mask)


# ---------------------------------------------------------------------------------------------- gradients


def _token_weights(mask: torch.Tensor, mode: str, norm_length: int) -> torch.Tensor:
    """∂ aggregate / ∂ L_{i,t}: 1/(n·|o_i|), 1/ΣM or 1/(N·L), on response tokens."""
    m = mask.to(torch.float64)
    if mode == "token-mean":
        return m / m.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        lengths = m.sum(-1, keepdim=True)
        return m / lengths.clamp(min=1) / (lengths > 0).sum().clamp(min=1)
    return m / (mask.shape[0] * norm_length)


CLIPS = st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])


@FAST
@given(st.data(), CLIPS, st.sampled_from([None, 2.0, 3.0]), st.sampled_from(AGGREGATION_MODES),
       st.sampled_from([0.0, 0.04]))
def test_token_loss_gradient_matches_the_grpo_coefficient(data, clips, dual_clip, mode, beta):
    # GRPO App. A.1: the gradient coefficient of log π_θ(o_t) is A_t + β(π_ref/π_θ − 1). With PPO clipping
    # the policy part is ρA where the clip is inactive and 0 where it is active; as a loss to minimise:
    #   ∂/∂logp_{i,t} = w_{i,t} · (−ρ A · active + β (1 − exp(ref − logp)))
    mask = data.draw(masks())
    logp = tensor_like(data.draw, mask, -3.0, 0.0).requires_grad_(True)
    old_logp = logp.detach() + tensor_like(data.draw, mask, -0.7, 0.7)
    ref_logp = logp.detach() + tensor_like(data.draw, mask, -1.0, 1.0)
    advantages = tensor_like(data.draw, mask, -2.0, 2.0)
    clip_low, clip_high = clips
    loss, _ = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)
    total = aggregate(loss + beta * kl_penalty(logp, ref_logp, "k3"), mask, mode, norm_length=7)
    (grad,) = torch.autograd.grad(total, logp)

    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
        if dual_clip is not None:
            clipped |= (advantages < 0) & (ratio > dual_clip)
        coef = -ratio * advantages * (~clipped) + beta * (1 - torch.exp(ref_logp - logp))
        expected = _token_weights(mask, mode, 7) * coef
    torch.testing.assert_close(grad, torch.where(mask, expected, 0.0), atol=1e-10, rtol=1e-8)


@FAST
@given(st.data(), CLIPS, st.sampled_from(AGGREGATION_MODES))
def test_sequence_loss_gradient_matches_gspo(data, clips, mode):
    # GSPO (arXiv 2507.18071): ∇ s_i A_i = s_i A_i (1/|o_i|) Σ_t ∇ log π(o_{i,t}) where unclipped.
    # Every token of o_i carries the same L_i, so ∂/∂logp_{i,t} = −W_i · s_i A_i / |o_i| · active_i,
    # with W_i = Σ_t w_{i,t} the aggregation weight of the whole response.
    mask = data.draw(masks())
    logp = tensor_like(data.draw, mask, -3.0, 0.0).requires_grad_(True)
    old_logp = logp.detach() + tensor_like(data.draw, mask, -0.3, 0.3)
    advantages = t(data.draw(st.lists(st.floats(-2, 2), min_size=mask.shape[0], max_size=mask.shape[0])))
    clip_low, clip_high = clips
    loss, _ = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, level="sequence")
    (grad,) = torch.autograd.grad(aggregate(loss, mask, mode, norm_length=5), logp)

    with torch.no_grad():
        lengths = mask.sum(-1)
        s = torch.exp(torch.where(mask, logp - old_logp, 0.0).sum(-1) / lengths.clamp(min=1))
        clipped = ((advantages > 0) & (s > 1 + clip_high)) | ((advantages < 0) & (s < 1 - clip_low))
        weight = _token_weights(mask, mode, 5).sum(-1)
        per_sequence = -weight * s * advantages * (~clipped) / lengths.clamp(min=1)
    torch.testing.assert_close(grad, torch.where(mask, per_sequence.unsqueeze(-1), 0.0), atol=1e-10, rtol=1e-8)


@FAST
@given(st.data(), st.sampled_from(["token", "sequence"]), st.sampled_from(AGGREGATION_MODES), st.booleans())
def test_ratio_one_is_the_plain_policy_gradient(data, level, mode, same_tensor):
    # At ρ = 1 the clipped surrogate is −A with gradient −A ∇logp: REINFORCE with a baseline. Passing
    # old_logp = logp itself (undetached) must not turn the gradient off.
    mask = data.draw(masks())
    logp = tensor_like(data.draw, mask, -3.0, 0.0).requires_grad_(True)
    advantages = t(data.draw(st.lists(st.floats(-2, 2), min_size=mask.shape[0], max_size=mask.shape[0])))
    old_logp = logp if same_tensor else logp.detach().clone()
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, dual_clip=3.0, level=level)
    plain = -advantages.unsqueeze(-1) * torch.exp(logp - logp.detach())
    torch.testing.assert_close(loss, torch.where(mask, plain, 0.0))
    (grad,) = torch.autograd.grad(aggregate(loss, mask, mode, norm_length=6), logp)
    (plain_grad,) = torch.autograd.grad(aggregate(plain, mask, mode, norm_length=6), logp)
    torch.testing.assert_close(grad, plain_grad, atol=1e-12, rtol=1e-10)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == metrics["clip_frac_dual"] == 0.0
    assert metrics["approx_kl"] == 0.0


def test_value_loss_gradient():
    # ∂/∂V ½max((V − R)², (V_c − R)²): V − R where the unclipped term wins, 0 where a clamped V_c wins
    #   V 1, V_old .5, R 0 → unclipped wins → 1;  V 1, V_old .5, R 2 → clamped V_c wins → 0
    values = t([[1.0, 1.0]]).requires_grad_(True)
    loss = value_loss(values, t([[0.5, 0.5]]), t([[0.0, 2.0]]), torch.ones(1, 2))
    (grad,) = torch.autograd.grad(loss.sum(), values)
    torch.testing.assert_close(grad, t([[1.0, 0.0]]))


# ---------------------------------------------------------------------------------------------- padding fuzz


@FAST
@given(st.data(), GARBAGE, st.sampled_from(["token", "sequence"]), st.booleans())
def test_padding_never_influences_the_policy_loss(data, garbage, level, per_token_advantages):
    mask = data.draw(masks())
    logp = tensor_like(data.draw, mask, -3.0, 0.0)
    old_logp = logp + tensor_like(data.draw, mask, -0.5, 0.5)
    if per_token_advantages:
        advantages = tensor_like(data.draw, mask, -2, 2)
        dirty_advantages = with_garbage(advantages, mask, garbage)
    else:
        advantages = dirty_advantages = t(data.draw(st.lists(st.floats(-2, 2), min_size=len(mask), max_size=len(mask))))

    def run(logp, old_logp, advantages):
        logp = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, dual_clip=3.0, level=level)
        (grad,) = torch.autograd.grad(aggregate(loss, mask), logp)
        return loss.detach(), metrics, grad

    clean = run(logp, old_logp, advantages)
    dirty = run(with_garbage(logp, mask, garbage), with_garbage(old_logp, mask, -garbage), dirty_advantages)
    assert torch.equal(clean[0], dirty[0]) and clean[1] == dirty[1] and torch.equal(clean[2], dirty[2])
    assert torch.isfinite(dirty[2]).all() and torch.equal(dirty[2][~mask], torch.zeros_like(dirty[2][~mask]))


@FAST
@given(st.data(), GARBAGE)
def test_padding_never_influences_the_value_loss(data, garbage):
    mask = data.draw(masks())
    values, old_values, returns = (tensor_like(data.draw, mask) for _ in range(3))

    def run(values, old_values, returns):
        values = values.clone().requires_grad_(True)
        loss = value_loss(values, old_values, returns, mask, clip=0.2)
        (grad,) = torch.autograd.grad(aggregate(loss, mask, "token-mean"), values)
        return loss.detach(), grad

    clean = run(values, old_values, returns)
    dirty = run(*(with_garbage(x, mask, g) for x, g in ((values, garbage), (old_values, -garbage), (returns, garbage))))
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    assert torch.isfinite(dirty[1]).all()


def test_truncated_importance_weights_hand_worked():
    from cohortrl.algorithms import truncated_importance_weights

    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = truncated_importance_weights(old, sampler, mask, cap=2.0)
    # exp(0.5) = 1.6487, exp(-1) = 0.3679, exp(0) = 1, exp(2) = 7.389 -> capped at 2; padding 0
    torch.testing.assert_close(w, torch.tensor([[1.6487213, 0.3678794, 1.0], [2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(old, sampler, mask, cap=0.0)
