"""Tests written to kill the mutants that survived `mutmut` over cohortrl/algorithms/ (issue #28; the command,
the scores and the mutants argued equivalent are in docs/testing.md, "Mutation testing").

Each test pins a behaviour the rest of tests/algorithms/ left open: a hyper-parameter a registry entry must
pass on (eps, dual_clip, process_coef, token_rewards) and its default, the dtype and device of an output, the
edge of an argument check and the text of its error.
"""

from __future__ import annotations

import math

import pytest
import torch

from cohortrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    aggregate,
    FixedKLController,
    gae_advantages,
    get_policy_loss,
    group_advantages,
    kl_shaped_rewards,
    last_token_index,
    masked_whiten,
    outcome_token_rewards,
    policy_loss,
    process_advantages,
    register_advantage_estimator,
    register_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    soft_overlong_penalty,
    truncated_importance_weights,
    value_loss,
)

from .helpers import t

# One group of two responses, two tokens each, rewards 0 and 1 (float64 throughout).
REWARDS = t([0.0, 1.0])
MASK = torch.ones(2, 2, dtype=torch.bool)
# Process supervision: one step per response, ending on token 1, with the outcome rewards as step rewards.
STEPS = {"step_rewards": [[0.0], [1.0]], "step_ends": [[1], [1]]}

# With eps = 1 every estimator below gives ±a on every token, worked out by hand:
#   group of rewards {0, 1}: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.70710678
#     GRPO / group-batch scale / process steps: 0.5 / (0.70710678 + 1) = 0.29289322
#   REINFORCE++: token rewards [[0, 0], [0, 1]] (outcome on the last token), returns-to-go [[0, 0], [1, 1]];
#     over the 4 tokens mean 0.5, sample var 4 · 0.25 / 3 = 1/3, std 0.57735027: 0.5 / 1.57735027 = 0.31698730
#   REINFORCE++-baseline: group mean of the total rewards 0.5 subtracted, returns [[-0.5]*2, [0.5]*2]: mean 0,
#     same spread: 0.31698730
#   combined: GRPO + 1.0 · process = 2 · 0.29289322 = 0.58578644
A_EPS_1 = {
    "grpo": 0.5 / (math.sqrt(0.5) + 1),
    "grpo_batch": 0.5 / (math.sqrt(0.5) + 1),
    "reinforce_pp": 0.5 / (math.sqrt(1 / 3) + 1),
    "reinforce_pp_baseline": 0.5 / (math.sqrt(1 / 3) + 1),
    "grpo_process": 0.5 / (math.sqrt(0.5) + 1),
    "grpo_combined": 2 * 0.5 / (math.sqrt(0.5) + 1),
}


@pytest.mark.parametrize("name", sorted(A_EPS_1))
def test_registry_entries_pass_eps_on_and_default_it_to_1e_6(name):
    estimator = ADVANTAGE_ESTIMATORS[name].fn
    a = A_EPS_1[name]
    expected = t([[-a, -a], [a, a]])
    got = estimator(rewards=REWARDS, response_mask=MASK, group_size=2, eps=1.0, **STEPS)
    # (process advantages come in the default dtype, float32)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    # The default is the documented 1e-6, exactly as if passed.
    default = estimator(rewards=REWARDS, response_mask=MASK, group_size=2, **STEPS)
    assert torch.equal(default, estimator(rewards=REWARDS, response_mask=MASK, group_size=2, eps=1e-6, **STEPS))
    assert not torch.equal(default, got)


def test_grpo_combined_defaults_process_coef_to_1_and_scales_the_process_part():
    combined = ADVANTAGE_ESTIMATORS["grpo_combined"].fn
    default = combined(rewards=REWARDS, response_mask=MASK, group_size=2, eps=1.0, **STEPS)
    assert torch.equal(default, combined(rewards=REWARDS, response_mask=MASK, group_size=2, eps=1.0,
                                         process_coef=1.0, **STEPS))
    # λ = 0.5: 0.29289322 + 0.5 · 0.29289322 = 0.43933983
    a = 1.5 * 0.5 / (math.sqrt(0.5) + 1)
    half = combined(rewards=REWARDS, response_mask=MASK, group_size=2, eps=1.0, process_coef=0.5, **STEPS)
    torch.testing.assert_close(half, t([[-a, -a], [a, a]]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_entries_use_the_token_rewards_they_are_given(name):
    # token rewards [[1, 0], [0, 0]] (the outcome rewards [0, 1] would put a 1 on row 1's last token instead):
    #   reinforce_pp: returns-to-go [[1, 0], [0, 0]]
    #   baseline: row totals [1, 0], group mean 0.5: returns [[0.5, -0.5], [-0.5, -0.5]]
    #   either way, over 4 tokens: centred [0.75, -0.25, -0.25, -0.25], sample var (0.5625 + 3 · 0.0625) / 3
    #   = 0.25, std 0.5: whitened [1.5, -0.5, -0.5, -0.5] (eps = 1e-6 moves it by < 4e-6)
    got = ADVANTAGE_ESTIMATORS[name].fn(rewards=REWARDS, response_mask=MASK, group_size=2,
                                     token_rewards=t([[1.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(got, t([[1.5, -0.5], [-0.5, -0.5]]), rtol=0, atol=1e-5)


def test_grpo_process_names_what_is_missing_and_where_it_comes_from():
    with pytest.raises(ValueError, match=r"needs step_ends: pass each response's step rewards and the token "
                                         r"index where each step ends \(a process reward function provides them\)"):
        ADVANTAGE_ESTIMATORS["grpo_process"].fn(rewards=REWARDS, response_mask=MASK, group_size=2,
                                             step_rewards=[[0.0], [1.0]])


@pytest.mark.parametrize("name", ["clip", "gspo"])
def test_policy_loss_entries_pass_dual_clip_on(name):
    # One token, ρ = exp(log 4) = 4, A = −1, ε = 0.2: unclipped −A·ρ = 4, clipped −A·clip(4, 0.8, 1.2) = 1.2,
    # max = 4; dual clip c = 3 caps it at −c·A = 3. (For GSPO the one-token sequence ratio is also 4.)
    loss, metrics = POLICY_LOSSES[name].fn(
        logp=t([[math.log(4.0)]]), old_logp=t([[0.0]]), advantages=t([-1.0]), response_mask=torch.ones(1, 1),
        clip_low=0.2, clip_high=0.2, dual_clip=3.0,
    )
    torch.testing.assert_close(loss, t([[3.0]]))
    assert metrics["clip_frac_dual"] == 1.0
    uncapped, _ = POLICY_LOSSES[name].fn(
        logp=t([[math.log(4.0)]]), old_logp=t([[0.0]]), advantages=t([-1.0]), response_mask=torch.ones(1, 1),
        clip_low=0.2, clip_high=0.2,
    )
    torch.testing.assert_close(uncapped, t([[4.0]]))


def test_truncated_importance_weights_accept_a_cap_below_one():
    # ratios π_old / π_sampler = exp(0 − log 4) = 0.25 and exp(0 + log 4) = 4; cap 0.5: [0.25, 0.5]
    w = truncated_importance_weights(t([[0.0, 0.0]]), t([[math.log(4.0), -math.log(4.0)]]), torch.ones(1, 2), cap=0.5)
    torch.testing.assert_close(w, t([[0.25, 0.5]]))


def test_kl_controllers_accept_beta_zero_and_refuse_the_edges_with_a_message():
    fixed = FixedKLController(0.0)
    assert fixed.value == 0.0 and fixed.update(5.0, 10) == 0.0
    adaptive = AdaptiveKLController(0.0, target=1.0, horizon=10.0)
    assert adaptive.update(2.0, 10) == 0.0  # 0 · (1 + 0.2 · 10 / 10) = 0
    with pytest.raises(ValueError, match=r"coef=-0.1: a KL coefficient must be >= 0"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match=r"need init_coef >= 0, target > 0, horizon > 0; got 0.1, 1.0, 0"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)


def test_outcome_token_rewards_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"rewards have shape \(3,\), expected \(N,\) = \(2,\)"):
        outcome_token_rewards(t([1.0, 2.0, 3.0]), torch.ones(2, 4))


def test_integer_rewards_are_placed_as_floats_of_the_default_dtype():
    # rows of length 2 and 1 in T = 3: the rewards 2 and 3 land on tokens 1 and 0.
    got = outcome_token_rewards(torch.tensor([2, 3]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert got.dtype == torch.get_default_dtype()
    assert torch.equal(got, torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))


def test_token_positions_are_built_on_the_masks_device():
    # The "meta" device stands in for a GPU on a CPU-only machine: a position tensor built on the CPU cannot
    # be compared with a meta mask, so an index or reward built without device=mask.device raises here.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool, device="meta")
    assert last_token_index(mask).device.type == "meta"
    assert outcome_token_rewards(torch.ones(2, device="meta"), mask).device.type == "meta"


def test_kl_shaped_rewards_compute_in_the_default_dtype():
    # float32 rewards, float64 KL: the KL is cast to the default dtype (float32), so both outputs are float32.
    # rewards [1, 2], KL 0.5 on each of rows' tokens, β = 0.1, lengths 2 and 1:
    #   sequence rewards 1 − 0.1 · 1.0 = 0.9 and 2 − 0.1 · 0.5 = 1.95
    #   token rewards [[−0.05, 1 − 0.05, 0], [2 − 0.05, 0, 0]]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    sequence, token = kl_shaped_rewards(torch.tensor([1.0, 2.0]), torch.full((2, 3), 0.5, dtype=torch.float64),
                                        mask, beta=0.1)
    assert sequence.dtype == token.dtype == torch.float32
    torch.testing.assert_close(sequence, torch.tensor([0.9, 1.95]))
    torch.testing.assert_close(token, torch.tensor([[-0.05, 0.95, 0.0], [1.95, 0.0, 0.0]]))


def test_soft_overlong_penalty_keeps_a_float_lengths_dtype():
    # L_max 10, L_cache 4, threshold 6: lengths 6, 8, 11 → 0, (6 − 8) / 4 = −0.5, −1
    got = soft_overlong_penalty(torch.tensor([6.0, 8.0, 11.0], dtype=torch.float64), max_length=10, cache_length=4)
    assert got.dtype == torch.float64
    assert torch.equal(got, t([0.0, -0.5, -1.0]))


def test_grpo_process_passes_credit_on():
    # G = 1, one response of 2 tokens, steps with rewards [1, 0] ending on tokens 0 and 1, eps = 1:
    #   normalised over the 2 steps: mean 0.5, sample std 0.70710678: ±0.5 / 1.70710678 = ±0.29289322
    #   credit "sum": A_0 = 0.29289322 − 0.29289322 = 0, A_1 = −0.29289322
    #   credit "min": A_0 = min(0.29289322, −0.29289322) = −0.29289322, A_1 = −0.29289322
    a = 0.5 / (math.sqrt(0.5) + 1)
    kwargs = dict(rewards=t([1.0]), response_mask=torch.ones(1, 2), group_size=1, eps=1.0,
                  step_rewards=[[1.0, 0.0]], step_ends=[[0, 1]])
    summed = ADVANTAGE_ESTIMATORS["grpo_process"].fn(**kwargs)
    least = ADVANTAGE_ESTIMATORS["grpo_process"].fn(credit="min", **kwargs)
    torch.testing.assert_close(summed.double(), t([[0.0, -a]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(least.double(), t([[-a, -a]]), rtol=0, atol=1e-6)


def test_process_advantages_defaults_eps_to_1e_6_and_checks_both_lists_and_credit():
    mask = torch.ones(2, 2)
    default = process_advantages([[0.0], [1.0]], [[1], [1]], mask, group_size=2)
    assert torch.equal(default, process_advantages([[0.0], [1.0]], [[1], [1]], mask, group_size=2, eps=1e-6))
    # ±0.5 / (0.70710678 + 1e-6) = ±0.70710578
    torch.testing.assert_close(default.double(), t([[-0.70710578] * 2, [0.70710578] * 2]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"step_rewards \(2\) and step_ends \(1\) need one entry per response"):
        process_advantages([[0.0], [1.0]], [[1]], mask, group_size=2)
    with pytest.raises(ValueError, match=r"step_rewards \(1\) and step_ends \(2\) need one entry per response"):
        process_advantages([[0.0]], [[1], [1]], mask, group_size=2)
    with pytest.raises(ValueError, match=r"credit must be 'sum' or 'min', got 'max'"):
        process_advantages([[0.0], [1.0]], [[1], [1]], mask, group_size=2, credit="max")


def test_value_loss_checks_every_shape_and_clips_from_below():
    mask = torch.ones(2, 2)
    good = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"^values has shape \(2, 3\)"):
        value_loss(torch.zeros(2, 3), good, good, mask)
    with pytest.raises(ValueError, match=r"^old_values has shape \(2,\)"):
        value_loss(good, torch.zeros(2), good, mask)  # (2,) would broadcast silently
    # V = −1, V_old = 0, R = −2, c = 0.2: (V − R)² = 1; V_c = clip(−1, −0.2, 0.2) = −0.2, (V_c − R)² = 3.24;
    # ½ · max = 1.62 (without the lower clip bound V_c would stay −1 and the loss be 0.5)
    torch.testing.assert_close(value_loss(t([[-1.0]]), t([[0.0]]), t([[-2.0]]), torch.ones(1, 1), clip=0.2),
                               t([[1.62]]))


def test_value_loss_clip_zero_pins_the_value_and_a_negative_clip_is_refused():
    # c = 0: V_c = V_old = 0; V = 1, R = 2: ½ · max((1 − 2)², (0 − 2)²) = ½ · 4 = 2
    torch.testing.assert_close(value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), torch.ones(1, 1), clip=0.0),
                               t([[2.0]]))
    with pytest.raises(ValueError, match=r"clip=-0.1: the value clip range must be >= 0 \(or None for no clipping\)"):
        value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), torch.ones(1, 1), clip=-0.1)


def test_unknown_name_with_nothing_close_gets_no_hint():
    with pytest.raises(ValueError) as caught:
        get_policy_loss("zzzz")
    assert str(caught.value) == "unknown policy loss 'zzzz' (registered: clip, gspo)"


@pytest.mark.parametrize("credit", ["sum", "min"])
def test_process_advantages_of_an_empty_batch_are_empty(credit):
    got = process_advantages([], [], torch.zeros(0, 3), group_size=2, credit=credit)
    assert got.shape == (0, 3)


def test_process_advantages_come_back_on_the_masks_device():
    # Built from Python lists on the CPU, then moved to the mask's device ("meta" stands in for a GPU).
    got = process_advantages([[0.0], [1.0]], [[1], [1]], torch.ones(2, 2, device="meta"), group_size=2)
    assert got.device.type == "meta"


def test_min_credit_process_advantages_come_back_on_the_masks_device():
    got = process_advantages([[0.0], [1.0]], [[1], [1]], torch.ones(2, 2, device="meta"), group_size=2, credit="min")
    assert got.device.type == "meta"


def test_register_checks_the_call_signature_and_refuses_a_taken_name():
    def mine(*args, rewards, response_mask, group_size, **kwargs):  # *args and **kwargs are never "required"
        return rewards

    def needs_more(*, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None,
                   eps=1e-6, credit="sum", process_coef=1.0, temperature):
        return rewards

    def too_few(*, rewards, response_mask, eps=1e-6):
        return rewards

    try:
        assert register_advantage_estimator("mine_test")(mine) is mine
        assert ADVANTAGE_ESTIMATORS["mine_test"].fn is mine
        assert register_advantage_estimator("mine_test")(mine) is mine  # the same function again: no error
        with pytest.raises(ValueError) as caught:
            register_advantage_estimator("mine_test")(lambda **kwargs: None)
        assert str(caught.value) == "advantage estimator 'mine_test' is already registered; pick another name"
        with pytest.raises(TypeError) as caught:
            register_advantage_estimator("few_test")(too_few)
        assert str(caught.value) == (
            "advantage estimator 'few_test' (too_few) does not accept group_size, token_rewards, step_rewards, "
            "step_ends, credit, process_coef; every advantage estimator is called with the keyword arguments "
            "rewards, response_mask, group_size, token_rewards, step_rewards, step_ends, eps, credit, process_coef "
            "(add **kwargs to ignore the ones it does not use)")
        with pytest.raises(TypeError) as caught:
            register_advantage_estimator("more_test")(needs_more)
        assert str(caught.value) == (
            "advantage estimator 'more_test' (needs_more) requires temperature, which the trainer never passes")
        assert "few_test" not in ADVANTAGE_ESTIMATORS and "more_test" not in ADVANTAGE_ESTIMATORS
    finally:
        ADVANTAGE_ESTIMATORS.pop("mine_test", None)


def test_register_policy_loss_accepts_a_positional_or_keyword_signature():
    def plain(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip=None):
        return logp, {}

    try:
        assert register_policy_loss("plain_test")(plain) is plain
        assert get_policy_loss("plain_test") is plain
        with pytest.raises(TypeError, match=r"^policy loss 'bad_test' \(<lambda>\) does not accept dual_clip; "
                                            r"every policy loss is called with the keyword arguments logp, old_logp, "):
            register_policy_loss("bad_test")(lambda *, logp, old_logp, advantages, response_mask, clip_low, clip_high: 0)
    finally:
        POLICY_LOSSES.pop("plain_test", None)


def test_gae_defaults_are_gamma_1_and_lambda_0_95():
    # One response of 2 tokens, rewards [0, 1], values [0.5, 0.5]; γ = 1, λ = 0.95:
    #   δ_1 = 1 + 0 − 0.5 = 0.5, δ_0 = 0 + 0.5 − 0.5 = 0;  A_1 = 0.5, A_0 = 0 + 0.95 · 0.5 = 0.475
    advantages, returns = gae_advantages(t([[0.0, 1.0]]), t([[0.5, 0.5]]), torch.ones(1, 2))
    torch.testing.assert_close(advantages, t([[0.475, 0.5]]))
    torch.testing.assert_close(returns, t([[0.975, 1.0]]))


def test_reinforce_pp_baseline_checks_the_group_size_against_the_rows():
    # N = 2 rows of T = 3 tokens, G = 2: fine (a check against T = 3 would refuse it).
    # rewards 1 and 0 on the last tokens: returns [[1, 1, 1], [0, 0, 0]], group mean 0.5 subtracted:
    # ±0.5 on 6 tokens, sample std sqrt(6 · 0.25 / 5) = 0.54772256: ±0.5 / 0.54772356 = ±0.91287
    got = reinforce_pp_advantages(t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), torch.ones(2, 3), group_size=2)
    a = 0.5 / (math.sqrt(0.3) + 1e-6)
    torch.testing.assert_close(got, t([[a] * 3, [-a] * 3]))
    with pytest.raises(ValueError, match=r"N=3 responses is not a multiple of group_size=2"):
        reinforce_pp_advantages(torch.zeros(3, 2), torch.ones(3, 2), group_size=2)


def test_clip_ranges_of_zero_are_allowed_and_dual_clip_must_exceed_one():
    # ε_low = ε_high = 0: ρ = 2, A = 1: max(−2, −clip(2, 1, 1)) = −1; ρ = 0.5, A = −1: max(0.5, 1) = 1
    loss, _ = policy_loss(t([[math.log(2.0), math.log(0.5)]]), t([[0.0, 0.0]]), t([[1.0, -1.0]]), torch.ones(1, 2),
                          clip_low=0.0, clip_high=0.0)
    torch.testing.assert_close(loss, t([[-1.0, 1.0]]))
    with pytest.raises(ValueError, match=r"dual_clip=1.0: the dual-clip constant c must be > 1"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), torch.ones(1, 1), dual_clip=1.0)


def test_policy_loss_checks_logps_shape_and_computes_in_its_dtype():
    with pytest.raises(ValueError, match=r"^logp has shape \(1, 2\), expected response_mask's \(1, 1\)"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    # float32 log-probs, float64 advantages: the loss is float32 (ρ = 1: −A = −0.5)
    loss, _ = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), t([0.5]), torch.ones(1, 1))
    assert loss.dtype == torch.float32 and loss.item() == -0.5


def test_masked_whiten_of_two_values_and_its_default_eps():
    # two values 0, 1: mean 0.5, sample std 0.70710678; ±0.5 / (0.70710678 + 1e-6) = ±0.70710578
    got = masked_whiten(t([[0.0, 1.0, 7.0]]), torch.tensor([[1, 1, 0]]))
    assert torch.equal(got, masked_whiten(t([[0.0, 1.0, 7.0]]), torch.tensor([[1, 1, 0]]), eps=1e-6))
    torch.testing.assert_close(got, t([[-0.70710578, 0.70710578, 0.0]]), rtol=0, atol=1e-8)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_constant_group_is_exactly_zero_beside_a_group_that_spans_it(scale):
    # In float64, 0.1 three times has mean 0.1 + 1.4e-17, so without the constant-group test its advantages would
    # be −1.4e-17 / (std + eps) ≈ −1e-11, not 0. The other group's max (10) and min (−10) lie outside 0.1, so a
    # constant test taken over the whole batch instead of per group would miss it.
    rewards = t([0.1, 0.1, 0.1, -10.0, 0.0, 10.0])
    got = group_advantages(rewards, group_size=3, scale=scale)
    assert torch.equal(got[:3], t([0.0, 0.0, 0.0]))
    assert got[3] < 0 < got[5]
    assert torch.equal(rloo_advantages(rewards, group_size=3)[:3], t([0.0, 0.0, 0.0]))


def test_clip_fractions_count_strictly_and_ignore_zero_advantages():
    # A = 0 tokens are neither clipped low nor high nor dual-capped, whatever their ratio (0.5, 2, 4).
    ratios = t([[math.log(0.5), math.log(2.0), math.log(4.0)]])  # exp gives exactly 0.5, 2, 4 in float64
    _, zero = policy_loss(ratios, torch.zeros(1, 3, dtype=torch.float64), t([[0.0, 0.0, 0.0]]), torch.ones(1, 3),
                          clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert (zero["clip_frac_low"], zero["clip_frac_high"], zero["clip_frac_dual"]) == (0.0, 0.0, 0.0)
    # Exactly on the bounds: ρ = 0.5 = 1 − ε_low (A < 0), ρ = 2 = 1 + ε_high (A > 0), ρ = 4 = c (A < 0): the
    # clip or cap changes nothing there, so none is counted.
    _, edge = policy_loss(ratios, torch.zeros(1, 3, dtype=torch.float64), t([[-1.0, 1.0, -1.0]]), torch.ones(1, 3),
                          clip_low=0.5, clip_high=1.0, dual_clip=4.0)
    assert (edge["clip_frac_low"], edge["clip_frac_high"], edge["clip_frac_dual"]) == (0.0, 0.0, 0.0)
    # A = 0.5 (positive but < 1) at ρ = 0.5 below 1 − 0.2: not a low clip (that needs A < 0)
    _, half = policy_loss(t([[math.log(0.5)]]), t([[0.0]]), t([[0.5]]), torch.ones(1, 1))
    assert half["clip_frac_low"] == 0.0


def test_group_size_errors_say_what_to_do():
    with pytest.raises(ValueError) as caught:
        group_advantages(t([1.0, 2.0]), group_size=0)
    assert str(caught.value) == "group_size=0: must be a positive number of responses per prompt"
    with pytest.raises(ValueError) as caught:
        group_advantages(t([1.0, 2.0]), group_size=1)
    assert str(caught.value) == ("group_size=1: group normalisation needs at least 2 responses per prompt; "
                                 "set group_size >= 2 or use estimator 'reinforce_pp'")
    with pytest.raises(ValueError) as caught:
        group_advantages(t([1.0, 2.0, 3.0]), group_size=2)
    assert str(caught.value) == ("N=3 responses is not a multiple of group_size=2: groups are contiguous rows "
                                 "k*G .. k*G+G-1, so N must equal prompts * group_size")


def test_register_names_every_unknown_required_parameter():
    def two_more(*, rewards, response_mask, group_size, temperature, top_k, **kwargs):
        return rewards

    with pytest.raises(TypeError) as caught:
        register_advantage_estimator("two_more_test")(two_more)
    assert str(caught.value) == (
        "advantage estimator 'two_more_test' (two_more) requires temperature, top_k, which the trainer never passes")
    assert "two_more_test" not in ADVANTAGE_ESTIMATORS


def test_constant_normaliser_of_zero_is_refused():
    with pytest.raises(ValueError, match=r"needs norm_length > 0 \(e.g. the max new tokens\), got 0"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", norm_length=0)


def test_grpo_combined_passes_credit_on():
    # G = 2, eps = 1, rewards [1, 0]: GRPO gives ±0.5 / (0.70710678 + 1) = ±0.29289322 (a) on every token.
    # Both responses have steps [1, 0] ending on tokens 0 and 1: over the group's 4 step rewards mean 0.5,
    # sample std sqrt(4 · 0.25 / 3) = 0.57735027, normalised ±0.5 / 1.57735027 = ±0.31698730 (b).
    #   credit "min": every token min(b, −b) = −b; total row 0: a − b, row 1: −a − b
    #   (credit "sum" would give b − b = 0 on token 0 instead)
    a, b = 0.5 / (math.sqrt(0.5) + 1), 0.5 / (math.sqrt(1 / 3) + 1)
    got = ADVANTAGE_ESTIMATORS["grpo_combined"].fn(
        rewards=t([1.0, 0.0]), response_mask=torch.ones(2, 2), group_size=2, eps=1.0, credit="min",
        step_rewards=[[1.0, 0.0], [1.0, 0.0]], step_ends=[[0, 1], [0, 1]])
    torch.testing.assert_close(got.double(), t([[a - b, a - b], [-a - b, -a - b]]), rtol=0, atol=1e-6)


def test_the_gspo_entry_is_sequence_level():
    # Token ratios 2 and 1, A = 1, wide clip (0.5 / 10) so nothing is clipped:
    #   "clip" (token level): −A·ρ_t = [−2, −1];  "gspo": s = exp((log 2 + 0) / 2) = √2 on both tokens: [−√2, −√2]
    kwargs = dict(logp=t([[math.log(2.0), 0.0]]), old_logp=t([[0.0, 0.0]]), advantages=t([1.0]),
                  response_mask=torch.ones(1, 2), clip_low=0.5, clip_high=10.0)
    torch.testing.assert_close(POLICY_LOSSES["clip"].fn(**kwargs)[0], t([[-2.0, -1.0]]))
    torch.testing.assert_close(POLICY_LOSSES["gspo"].fn(**kwargs)[0], t([[-math.sqrt(2.0)] * 2]))
