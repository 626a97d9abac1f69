"""Advantage estimators against hand-worked numbers (arithmetic in the comments) and their properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from cohortrl.algorithms import (
    gae_advantages,
    group_advantages,
    outcome_token_rewards,
    process_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

from .helpers import FAST, GARBAGE, masks, right_padded_mask, t, tensor_like, with_garbage

EPS = 1e-6
SQRT3 = math.sqrt(3.0)


# ---------------------------------------------------------------------------------------------- group (GRPO)


def test_group_advantages_scale_group_hand_worked():
    # group 0: r = [1, 0, 0, 1], mean 0.5, sample var = 4·0.25 / 3 = 1/3, std = 1/√3
    #   A = ±0.5 / (1/√3 + eps) = ±√3/2 ≈ ±0.8660
    # group 1: r all 0.5 → exactly 0 (no signal)
    rewards = t([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5])
    expected = 0.5 / (1 / SQRT3 + EPS)
    got = group_advantages(rewards, group_size=4)
    torch.testing.assert_close(got, t([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    assert torch.equal(got[4:], torch.zeros(4, dtype=got.dtype))


def test_group_advantages_scale_batch_hand_worked():
    # same rewards; batch mean 0.5, Σ(r − 0.5)² = 4·0.25 + 4·0 = 1, sample var = 1/7, std = 1/√7
    #   A = (r − group mean) / std_N = ±0.5·√7 ≈ ±1.3229; group 1 stays exactly 0
    rewards = t([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5])
    expected = 0.5 / (1 / math.sqrt(7) + EPS)
    got = group_advantages(rewards, group_size=4, scale="batch")
    torch.testing.assert_close(got, t([expected, -expected, -expected, expected, 0, 0, 0, 0]))


def test_group_advantages_scale_none_is_dr_grpo():
    # Dr. GRPO: r − group mean. group 0: mean 0.5 → ±0.5; group 1: [3, 1] mean 2 → [1, −1]
    got = group_advantages(t([1, 0, 0, 1, 3, 1, 2, 2]), group_size=2, scale="none")
    # with G=2: groups [1,0] [0,1] [3,1] [2,2] → [.5,−.5] [−.5,.5] [1,−1] [0,0]
    torch.testing.assert_close(got, t([0.5, -0.5, -0.5, 0.5, 1, -1, 0, 0]))


def test_rloo_hand_worked():
    # r = [1, 0, 0, 1]: A_0 = 1 − (0 + 0 + 1)/3 = 2/3, A_1 = 0 − (1 + 0 + 1)/3 = −2/3
    # r = [4, 2, 0, 2]: A_0 = 4 − 4/3 = 8/3, A_1 = 2 − 6/3 = 0, A_2 = 0 − 8/3, A_3 = 0
    got = rloo_advantages(t([1, 0, 0, 1, 4, 2, 0, 2]), group_size=4)
    torch.testing.assert_close(got, t([2 / 3, -2 / 3, -2 / 3, 2 / 3, 8 / 3, 0, -8 / 3, 0]))


def test_group_estimators_reject_a_single_response_per_prompt():
    for call in (
        lambda: group_advantages(t([1.0, 0.0]), group_size=1),
        lambda: group_advantages(t([1.0, 0.0]), group_size=1, scale="none"),
        lambda: rloo_advantages(t([1.0, 0.0]), group_size=1),
        lambda: reinforce_pp_advantages(t([[1.0], [0.0]]), torch.ones(2, 1), group_size=1),
    ):
        with pytest.raises(ValueError, match="group_size=1: group normalisation needs at least 2"):
            call()


def test_group_estimators_reject_a_ragged_batch():
    with pytest.raises(ValueError, match="N=5 responses is not a multiple of group_size=2"):
        group_advantages(t([1, 0, 1, 0, 1]), group_size=2)
    with pytest.raises(ValueError, match="not a multiple"):
        rloo_advantages(t([1, 0, 1]), group_size=2)
    with pytest.raises(ValueError, match="scale="):
        group_advantages(t([1, 0]), group_size=2, scale="global")
    with pytest.raises(ValueError, match=r"shape \(N,\)"):
        group_advantages(t([[1, 0]]), group_size=2)


def test_integer_rewards_are_accepted():
    got = group_advantages(torch.tensor([1, 0, 1, 1]), group_size=2, scale="none")
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, 0.0, 0.0]))


group_rewards = st.integers(1, 4).flatmap(
    lambda p: st.integers(2, 8).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(
                st.one_of(st.sampled_from([0.0, 1.0, 0.1, 0.3]), st.floats(-10, 10, allow_nan=False)),
                min_size=p * g,
                max_size=p * g,
            ),
        )
    )
)


@FAST
@given(group_rewards, st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_sum_to_zero_and_stay_bounded(case, scale):
    group_size, rewards = case
    got = group_advantages(t(rewards), group_size, scale=scale)
    assert torch.isfinite(got).all()
    group_sums = got.view(-1, group_size).sum(-1)
    torch.testing.assert_close(group_sums, torch.zeros_like(group_sums), atol=1e-6, rtol=0)
    if scale == "group":
        # |r_i − mean| ≤ std·(G − 1)/√G for a sample std, so nothing blows up however small the std
        assert got.abs().max() <= (group_size - 1) / math.sqrt(group_size) + 1e-9


@FAST
@given(group_rewards)
def test_rloo_is_scaled_dr_grpo_and_sums_to_zero(case):
    group_size, rewards = case
    rloo = rloo_advantages(t(rewards), group_size)
    dr_grpo = group_advantages(t(rewards), group_size, scale="none")
    # Dr. GRPO (arXiv 2503.20783): G/(G − 1) · A equals the RLOO advantage
    torch.testing.assert_close(rloo, group_size / (group_size - 1) * dr_grpo, atol=1e-9, rtol=1e-9)
    group_sums = rloo.view(-1, group_size).sum(-1)
    torch.testing.assert_close(group_sums, torch.zeros_like(group_sums), atol=1e-9, rtol=0)


@FAST
@given(
    st.integers(2, 16),
    st.integers(1, 3),
    st.one_of(st.sampled_from([0.1, 1 / 3, 0.7, 1e-8, 1e8]), st.floats(-1e6, 1e6, allow_nan=False)),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_identical_rewards_give_exactly_zero(group_size, prompts, value, dtype):
    rewards = torch.full((group_size * prompts,), value, dtype=dtype)
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(rewards, group_size, scale=scale), torch.zeros_like(rewards))
    assert torch.equal(rloo_advantages(rewards, group_size), torch.zeros_like(rewards))


# ---------------------------------------------------------------------------------------------- process


def test_process_advantages_hand_worked():
    # G = 2, T = 5.  o_0: step rewards [1, 0] ending at tokens [1, 3], 5 tokens.
    #                o_1: step reward  [1]    ending at token  [2],    3 tokens.
    # R = {1, 0, 1}: mean 2/3, sample var = (1/9 + 4/9 + 1/9)/2 = 1/3, std = 1/√3
    #   r̃ = (1 − 2/3)·√3 = 1/√3 ≈ 0.5774 for the 1s, (0 − 2/3)·√3 = −2/√3 ≈ −1.1547 for the 0
    # o_0: t = 0,1 → steps ending at 1 and 3: 1/√3 − 2/√3 = −1/√3; t = 2,3 → only the step ending at 3:
    #      −2/√3; t = 4 → after the last step: 0
    # o_1: t = 0..2 → 1/√3; t = 3,4 padding → 0
    mask = right_padded_mask([5, 3], 5)
    got = process_advantages([[1.0, 0.0], [1.0]], [[1, 3], [2]], mask, group_size=2, eps=0.0)
    a, b = 1 / SQRT3, 2 / SQRT3
    expected = t([[a - b, a - b, -b, -b, 0], [a, a, a, 0, 0]], dtype=torch.get_default_dtype())
    torch.testing.assert_close(got, expected)


def test_process_advantages_groups_are_separate_and_constant_groups_are_zero():
    # group 0 as above with one step each: R = {1, 0} → mean .5, std = 1/√2 → r̃ = ±1/√2
    # group 1: step rewards all 0.3 → exactly 0; a response with no steps → 0
    mask = torch.ones(4, 3, dtype=torch.bool)
    got = process_advantages([[1.0], [0.0], [0.3, 0.3], []], [[2], [1], [0, 2], []], mask, group_size=2, eps=0.0)
    h = 1 / math.sqrt(2)
    expected = t([[h, h, h], [-h, -h, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.get_default_dtype())
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[2:], torch.zeros(2, 3))


def test_process_steps_ending_on_one_token_add_up():
    # G = 1, R = {0, 1, 3}: mean 4/3, deviations −4/3, −1/3, 5/3, sample var = (16 + 1 + 25)/9/2 = 7/3
    # steps 1 and 2 both end at token 1, step 0 at token 0:
    #   A_0 = Σ all r̃ = 0;  A_1 = (−1/3 + 5/3)/√(7/3) = (4/3)/√(7/3) ≈ 0.8729;  A_2 = 0 (after the last step)
    got = process_advantages([[0.0, 1.0, 3.0]], [[0, 1, 1]], torch.ones(1, 3), group_size=1, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([[0.0, (4 / 3) / math.sqrt(7 / 3), 0.0]]))


def test_process_advantages_validates_its_inputs():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="one entry per response"):
        process_advantages([[1.0]], [[0]], mask, group_size=2)
    with pytest.raises(ValueError, match="2 step rewards but 1 step ends"):
        process_advantages([[1.0, 0.0], [1.0]], [[0], [0]], mask, group_size=2)
    with pytest.raises(ValueError, match="outside the T=3"):
        process_advantages([[1.0], [1.0]], [[3], [0]], mask, group_size=2)


@FAST
@given(st.data())
def test_process_advantages_first_token_sums_to_zero_per_group(data):
    # With every step ending on a response token, A_{i,0} = Σ_j r̃_i^(j), and Σ over the group of all r̃ is 0.
    group_size = data.draw(st.integers(1, 4))
    prompts = data.draw(st.integers(1, 3))
    t_len = data.draw(st.integers(1, 6))
    n = group_size * prompts
    mask = torch.ones(n, t_len, dtype=torch.bool)
    ends = [sorted(data.draw(st.lists(st.integers(0, t_len - 1), max_size=4))) for _ in range(n)]
    rewards = [data.draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=len(e), max_size=len(e))) for e in ends]
    got = process_advantages(rewards, ends, mask, group_size)
    assert torch.isfinite(got).all()
    sums = got[:, 0].view(prompts, group_size).sum(-1)
    # float32: a nearly constant group (std ~1e-3) normalises with cancellation error ~1e-4 per value
    torch.testing.assert_close(sums, torch.zeros(prompts), atol=1e-3, rtol=0)
    # nothing after a response's last step
    for i, e in enumerate(ends):
        after = (max(e) + 1) if e else 0
        assert torch.equal(got[i, after:], torch.zeros(t_len - after))


# ---------------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_worked():
    # returns-to-go: row 0 rewards [0, 0, 1] → [1, 1, 1]; row 1 rewards [−0.1, 0.5, pad] → [0.4, 0.5, 0]
    # masked values {1, 1, 1, 0.4, 0.5}: mean 3.9/5 = 0.78
    # deviations .22, .22, .22, −.38, −.28 → squares .0484·3 + .1444 + .0784 = .368; sample var .092
    mask = right_padded_mask([3, 2], 3)
    rewards = t([[0, 0, 1], [-0.1, 0.5, 1e30]])
    std = math.sqrt(0.092)
    expected = t([[0.22, 0.22, 0.22], [-0.38, -0.28, 0]]) / (std + EPS)
    expected[1, 2] = 0
    torch.testing.assert_close(reinforce_pp_advantages(rewards, mask), expected)


def test_reinforce_pp_baseline_hand_worked():
    # outcome rewards [1, 0 | 1, 1] on the last of T = 2 tokens → returns rows [1,1] [0,0] [1,1] [1,1]
    # no baseline: values {1×6, 0×2}: mean .75, Σ dev² = 6·.0625 + 2·.5625 = 1.5, var 1.5/7
    #   → A = .25/√(1.5/7) ≈ 0.5401 and −.75/√(1.5/7) ≈ −1.6202
    # baseline: group means .5 and 1 → rows [.5,.5] [−.5,−.5] [0,0] [0,0]; mean 0, var (4·.25)/7 = 1/7
    #   → A = ±.5·√7 ≈ ±1.3229, and 0 for the constant group (here the batch mean is 0)
    mask = torch.ones(4, 2)
    rewards = t([[0, 1], [0, 0], [0, 1], [0, 1]])
    s = math.sqrt(1.5 / 7)
    plain = reinforce_pp_advantages(rewards, mask, eps=0.0)
    torch.testing.assert_close(plain, t([[0.25, 0.25], [-0.75, -0.75], [0.25, 0.25], [0.25, 0.25]]) / s)
    base = reinforce_pp_advantages(rewards, mask, group_size=2, eps=0.0)
    torch.testing.assert_close(base, t([[0.5, 0.5], [-0.5, -0.5], [0, 0], [0, 0]]) * math.sqrt(7))


@FAST
@given(st.data())
def test_reinforce_pp_is_whitened_over_the_batch(data):
    mask = data.draw(masks())
    rewards = tensor_like(data.draw, mask)
    # eps = 0 makes the std exact but divides by it: keep to spreads that don't underflow when squared
    assume(mask.sum() < 2 or rewards[mask].std() > 1e-6)
    got = reinforce_pp_advantages(rewards, mask, eps=0.0)
    values = got[mask]
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    if values.numel() >= 2 and values.abs().max() > 0:
        torch.testing.assert_close(values.mean(), torch.tensor(0.0, dtype=values.dtype), atol=1e-9, rtol=0)
        torch.testing.assert_close(values.std(), torch.tensor(1.0, dtype=values.dtype), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- GAE


def test_gae_hand_worked():
    # rewards [0, 0, 1], values [.5, .6, .7], V after the end = 0, γ = 1, λ = .5
    # δ_2 = 1 + 0 − .7 = .3;  δ_1 = 0 + .7 − .6 = .1;  δ_0 = 0 + .6 − .5 = .1
    # A_2 = .3;  A_1 = .1 + .5·.3 = .25;  A_0 = .1 + .5·.25 = .225;  R = A + V = [.725, .85, 1.0]
    rewards, values = t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, t([[0.225, 0.25, 0.3]]))
    torch.testing.assert_close(ret, t([[0.725, 0.85, 1.0]]))
    # γ = .9, λ = 1: δ_2 = .3; δ_1 = .9·.7 − .6 = .03; δ_0 = .9·.6 − .5 = .04
    # A_2 = .3; A_1 = .03 + .9·.3 = .3; A_0 = .04 + .9·.3 = .31; R = [.81, .9, 1] (the discounted return)
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=1.0)
    torch.testing.assert_close(adv, t([[0.31, 0.3, 0.3]]))
    torch.testing.assert_close(ret, t([[0.81, 0.9, 1.0]]))


def test_gae_skips_holes_and_ends_at_the_last_token():
    # row 0 has a hole at t = 1: the recursion must treat t = 2 as the successor of t = 0,
    # so it equals the GAE of the compact row [r_0, r_2], [V_0, V_2] (and 0 at the hole)
    mask = t([[1, 0, 1, 0]]).bool()
    rewards, values = t([[0.2, 1e30, 1.0, -1e30]]), t([[0.5, float("inf"), 0.7, 3.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    compact_adv, compact_ret = gae_advantages(t([[0.2, 1.0]]), t([[0.5, 0.7]]), torch.ones(1, 2), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, [0, 2]], compact_adv)
    torch.testing.assert_close(ret[:, [0, 2]], compact_ret)
    assert torch.equal(adv[:, [1, 3]], torch.zeros(1, 2)) and torch.equal(ret[:, [1, 3]], torch.zeros(1, 2))


@FAST
@given(st.data())
def test_gae_with_lambda_one_gamma_one_is_return_to_go_minus_value(data):
    mask = data.draw(masks(holes=False))
    rewards, values = tensor_like(data.draw, mask), tensor_like(data.draw, mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    rewards = torch.where(mask, rewards, 0.0)
    return_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, torch.where(mask, return_to_go - values, 0.0), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, torch.where(mask, return_to_go, 0.0), atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------------------- masked fuzz


@FAST
@given(st.data(), GARBAGE)
def test_padding_never_influences_token_estimators(data, garbage):
    mask = data.draw(masks())
    rewards, values = tensor_like(data.draw, mask), tensor_like(data.draw, mask)
    clean_pp = reinforce_pp_advantages(rewards, mask)
    clean_gae = gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
    dirty_rewards, dirty_values = with_garbage(rewards, mask, garbage), with_garbage(values, mask, -garbage)
    assert torch.equal(reinforce_pp_advantages(dirty_rewards, mask), clean_pp)
    for clean, dirty in zip(clean_gae, gae_advantages(dirty_rewards, dirty_values, mask, gamma=0.99, lam=0.95)):
        assert torch.equal(clean, dirty)
    # process advantages only read the mask and the step lists: steps ending on padding add nothing visible
    assert torch.isfinite(clean_pp).all() and all(torch.isfinite(x).all() for x in clean_gae)


def test_outcome_token_rewards_places_the_reward_on_the_last_response_token():
    # row 0: 3 tokens → reward at t = 2; row 1: a hole, last response token t = 1; row 2: no tokens → dropped
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]).bool()
    mask[1, 0] = False
    got = outcome_token_rewards(t([1.0, -0.5, 7.0]), mask)
    torch.testing.assert_close(got, t([[0, 0, 1, 0], [0, -0.5, 0, 0], [0, 0, 0, 0]]))


def test_min_credit_hand_worked():
    # R = [1, 0, 1] -> mean 2/3, std sqrt(1/3): r~ = +0.5774 (1) and -1.1547 (0)
    mask = torch.ones(2, 4)
    got = process_advantages([[1.0, 0.0], [1.0]], [[1, 3], [2]], mask, group_size=2, eps=0.0, credit="min")
    hi, lo = 1 / 3**0.5, -2 / 3**0.5
    torch.testing.assert_close(got, torch.tensor([[lo, lo, lo, lo], [hi, hi, hi, 0.0]]))
    summed = process_advantages([[1.0, 0.0], [1.0]], [[1, 3], [2]], mask, group_size=2, eps=0.0, credit="sum")
    torch.testing.assert_close(summed, torch.tensor([[hi + lo, hi + lo, lo, lo], [hi, hi, hi, 0.0]]))


def test_combined_estimator_is_outcome_plus_lambda_process():
    from cohortrl.algorithms import get_advantage_estimator

    mask = torch.ones(2, 3)
    kw = dict(response_mask=mask, group_size=2, step_rewards=[[1.0], [0.0]], step_ends=[[1], [2]], eps=0.0)
    outcome = get_advantage_estimator("grpo")(rewards=torch.tensor([1.0, 0.0]), **kw)
    process = get_advantage_estimator("grpo_process")(rewards=torch.tensor([1.0, 0.0]), **kw)
    combined = get_advantage_estimator("grpo_combined")(rewards=torch.tensor([1.0, 0.0]), process_coef=0.5, **kw)
    torch.testing.assert_close(combined, outcome + 0.5 * process)
