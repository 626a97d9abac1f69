"""Every registry entry, called through the one uniform signature; the public API contract of issue 3;
docs/algorithms.md covers every registered name and points at tests that exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cohortrl.algorithms as algorithms
from cohortrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    Entry,
    AdvantageEstimator,
    EstimatorNeeds,
    LossNeeds,
    PolicyLoss,
    estimator_needs,
    get_advantage_estimator,
    get_policy_loss,
    needs_sequence_advantages,
    register_advantage_estimator,
    register_policy_loss,
)

from .helpers import FAST, GARBAGE, right_padded_mask, t, with_garbage

ROOT = Path(__file__).resolve().parents[2]

# Entries whose baseline is the group: they need G >= 2. The others work with any G.
NEEDS_TWO = {"grpo", "grpo_batch", "dr_grpo", "rloo", "reinforce_pp_baseline", "grpo_combined"}
# Entries that return exactly 0 for a group whose rewards are all equal, whatever the rest of the batch holds.
ZERO_ON_CONSTANT_GROUP = {"grpo", "grpo_batch", "dr_grpo", "rloo", "grpo_process", "grpo_combined"}


def _signature(fn) -> list[tuple[str, object, object]]:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [(p.name, p.kind, p.default) for p in params]


def _inputs(group_size: int = 2):
    """N = 4 responses, T = 4, groups of 2: rewards, a right-padded mask, steps for process supervision."""
    mask = right_padded_mask([4, 2, 3, 1], 4)
    rewards = t([1.0, 0.0, 0.5, 0.5])
    steps = {"step_rewards": [[1.0, 0.0], [1.0], [0.5], [0.5]], "step_ends": [[1, 3], [1], [2], [0]]}
    return {"rewards": rewards, "response_mask": mask, "group_size": group_size, **steps}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_advantage_estimator_has_the_uniform_signature_and_contract(name):
    fn = get_advantage_estimator(name)
    assert _signature(fn) == _signature(AdvantageEstimator.__call__)
    kwargs = _inputs()
    advantages = fn(**kwargs)
    mask = kwargs["response_mask"]
    assert advantages.shape == mask.shape and torch.isfinite(advantages).all()
    assert torch.equal(advantages[~mask], torch.zeros_like(advantages[~mask]))
    assert advantages[mask].abs().sum() > 0  # the mixed first group carries signal for every estimator
    # explicit token rewards are accepted by everyone (and used by the REINFORCE++ entries)
    token_rewards = torch.where(mask, 0.1, 0.0)
    assert fn(**kwargs, token_rewards=token_rewards, eps=1e-4).shape == mask.shape
    if name in ZERO_ON_CONSTANT_GROUP:
        assert torch.equal(advantages[2:], torch.zeros_like(advantages[2:]))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_group_size_one_is_refused_only_where_a_group_is_needed(name):
    fn = get_advantage_estimator(name)
    if name in NEEDS_TWO:
        with pytest.raises(ValueError, match="group_size=1: group normalisation needs at least 2 responses"):
            fn(**_inputs(group_size=1))
    else:
        assert torch.isfinite(fn(**_inputs(group_size=1))).all()
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        fn(**_inputs(group_size=3))


@FAST
@given(
    st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)),
    st.integers(1, 3),
    st.integers(2, 4),
    st.one_of(st.sampled_from([0.0, 1.0, 0.1]), st.floats(-100, 100, allow_nan=False)),
    st.data(),
)
def test_identical_rewards_give_exactly_zero_for_every_estimator(name, prompts, group_size, value, data):
    n = prompts * group_size
    lengths = data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    mask = right_padded_mask(lengths, 5)
    steps = {"step_rewards": [[value] * 2 for _ in range(n)], "step_ends": [[0, ln - 1] for ln in lengths]}
    got = get_advantage_estimator(name)(
        rewards=torch.full((n,), value, dtype=torch.float64), response_mask=mask, group_size=group_size, **steps
    )
    assert torch.equal(got, torch.zeros_like(got))


@FAST
@given(st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)), GARBAGE)
def test_padding_never_influences_any_estimator(name, garbage):
    kwargs = _inputs()
    mask = kwargs["response_mask"]
    token_rewards = torch.where(mask, t([[0, 0.1, 0, 1], [0.2, 0, 0, 0], [0, -0.3, 0.5, 0], [1, 0, 0, 0]]), 0.0)
    fn = get_advantage_estimator(name)
    clean = fn(**kwargs, token_rewards=token_rewards)
    assert torch.equal(clean, fn(**kwargs, token_rewards=with_garbage(token_rewards, mask, garbage)))


def test_grpo_process_names_what_is_missing():
    kwargs = _inputs()
    del kwargs["step_ends"]
    with pytest.raises(ValueError, match="'grpo_process' needs step_ends"):
        get_advantage_estimator("grpo_process")(**kwargs)
    with pytest.raises(ValueError, match="needs step_rewards and step_ends"):
        get_advantage_estimator("grpo_process")(rewards=t([1.0, 0.0]), response_mask=torch.ones(2, 2), group_size=2)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_has_the_uniform_signature_and_contract(name):
    fn = get_policy_loss(name)
    assert _signature(fn) == _signature(PolicyLoss.__call__)
    mask = right_padded_mask([3, 1], 3)
    logp = t([[-1.0, -2.0, -0.5], [-0.3, 7.0, 7.0]]).requires_grad_(True)
    advantages = t([1.0, -0.5])
    # ρ = 1: every entry is the plain policy gradient −A on response tokens
    loss, metrics = fn(logp=logp, old_logp=logp.detach(), advantages=advantages, response_mask=mask,
                       clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, t([[-1.0, -1.0, -1.0], [0.5, 0.0, 0.0]]))
    assert set(metrics) == {"clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean", "approx_kl"}
    assert all(isinstance(v, float) for v in metrics.values())
    # off-policy with dual clip: finite, zero on padding, differentiable
    loss, metrics = fn(logp=logp, old_logp=logp.detach() + 0.4, advantages=advantages, response_mask=mask,
                       clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert torch.isfinite(loss).all() and torch.equal(loss[~mask], torch.zeros(2, dtype=loss.dtype))
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_unknown_names_fail_with_the_closest_entry():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo_proces'; did you mean 'grpo_process'"):
        get_advantage_estimator("grpo_proces")
    with pytest.raises(ValueError, match=r"unknown policy loss 'gpso'.*registered: clip, gspo"):
        get_policy_loss("gpso")


# The public API of issue 3, exactly: names, parameter names, order and defaults.
CONTRACT = {
    "group_advantages": "(rewards, group_size, scale='group', eps=1e-06)",
    "rloo_advantages": "(rewards, group_size)",
    "process_advantages": "(step_rewards, step_ends, response_mask, group_size, eps=1e-06, credit='sum')",
    "reinforce_pp_advantages": "(token_rewards, response_mask, group_size=None, eps=1e-06)",
    "gae_advantages": "(token_rewards, values, response_mask, gamma=1.0, lam=0.95)",
    "kl_penalty": "(logp, ref_logp, kind='k3')",
    "policy_loss": "(logp, old_logp, advantages, response_mask, clip_low=0.2, clip_high=0.2, dual_clip=None, "
    "level='token')",
    "aggregate": "(loss, response_mask, mode='seq-mean-token-mean', norm_length=None)",
    "value_loss": "(values, old_values, returns, response_mask, clip=0.2)",
    "AdaptiveKLController": "(init_coef, target, horizon)",
    "FixedKLController": "(coef)",
    "soft_overlong_penalty": "(lengths, max_length, cache_length)",
}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_public_api_matches_the_issue(name):
    fn = getattr(algorithms, name)
    params = inspect.signature(fn).parameters.values()
    plain = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params])
    assert str(plain) == CONTRACT[name]
    assert name in algorithms.__all__
    assert fn.__doc__ and len(fn.__doc__) > 80  # equation, paper and shapes live there
    if name.endswith("Controller"):
        assert list(inspect.signature(fn.update).parameters) == ["self", "current_kl", "n_steps"]
        assert hasattr(fn(*([1.0] * len(params))), "value")


def test_docs_cover_every_registered_name_and_cite_real_tests():
    doc = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
    for name in list(ADVANTAGE_ESTIMATORS) + list(POLICY_LOSSES) + list(algorithms.AGGREGATION_MODES):
        assert f"`{name}`" in doc, f"docs/algorithms.md does not document {name!r}"
    tests_dir = Path(__file__).parent
    sources = [f.read_text(encoding="utf-8") for f in tests_dir.glob("test_*.py")]
    defined = {name for source in sources for name in re.findall(r"def (test_\w+)", source)}
    cited = set(re.findall(r"::(test_\w+)", doc))
    assert cited, "docs/algorithms.md cites no tests"
    assert cited <= defined, f"docs cite tests that do not exist: {sorted(cited - defined)}"
    for path in set(re.findall(r"(tests/algorithms/test_\w+\.py)", doc)):
        assert (ROOT / path).exists(), path


# What each built-in entry declares, by its formula: the group estimators compare a response with its group
# (G >= 2); the outcome ones give every token of a response one advantage; REINFORCE++'s return-to-go varies
# along the response once token rewards (KL in the reward) are present; the process ones read step rewards.
BUILT_IN_NEEDS = {
    "grpo": EstimatorNeeds(groups=True, per_sequence=True),
    "grpo_batch": EstimatorNeeds(groups=True, per_sequence=True),
    "dr_grpo": EstimatorNeeds(groups=True, per_sequence=True),
    "rloo": EstimatorNeeds(groups=True, per_sequence=True),
    "reinforce_pp": EstimatorNeeds(),
    "reinforce_pp_baseline": EstimatorNeeds(groups=True),
    "grpo_process": EstimatorNeeds(groups=True, steps=True),
    "grpo_combined": EstimatorNeeds(groups=True, steps=True),
}


def test_each_built_in_estimator_declares_what_its_formula_needs():
    assert {name: estimator_needs(name) for name in ADVANTAGE_ESTIMATORS} == BUILT_IN_NEEDS
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'grop'; did you mean 'grpo'\?"):
        estimator_needs("grop")


def test_a_registered_estimator_needs_what_its_keywords_declare_and_nothing_by_default():
    def mine(**kwargs):
        return kwargs["rewards"]

    try:
        register_advantage_estimator("needs_nothing_test")(mine)
        register_advantage_estimator("needs_groups_test", groups=True)(mine)
        register_advantage_estimator("needs_steps_test", steps=True)(mine)
        register_advantage_estimator("needs_one_per_response_test", per_sequence=True)(mine)
        assert estimator_needs("needs_nothing_test") == EstimatorNeeds()
        assert estimator_needs("needs_groups_test") == EstimatorNeeds(groups=True)
        assert estimator_needs("needs_steps_test") == EstimatorNeeds(steps=True)
        assert estimator_needs("needs_one_per_response_test") == EstimatorNeeds(per_sequence=True)
        assert ADVANTAGE_ESTIMATORS["needs_groups_test"] == Entry(mine, EstimatorNeeds(groups=True))  # one table
    finally:
        for name in ("needs_nothing_test", "needs_groups_test", "needs_steps_test", "needs_one_per_response_test"):
            ADVANTAGE_ESTIMATORS.pop(name, None)


@pytest.mark.parametrize("registry, fix", [
    (ADVANTAGE_ESTIMATORS, "register_advantage_estimator"), (POLICY_LOSSES, "register_policy_loss"),
])
def test_an_entry_put_in_by_hand_without_what_it_needs_is_refused(registry, fix):
    """No silent default: a bare function, or an entry whose needs are the other kind's, never enters a table."""
    def mine(**kwargs):
        return kwargs["rewards"]

    other = LossNeeds() if registry is ADVANTAGE_ESTIMATORS else EstimatorNeeds()
    for how in (lambda: registry.__setitem__("by_hand_test", mine), lambda: registry.update(by_hand_test=mine),
                lambda: registry.setdefault("by_hand_test", mine), lambda: registry.__ior__({"by_hand_test": mine}),
                lambda: registry.__setitem__("by_hand_test", Entry(mine, other))):
        with pytest.raises(TypeError, match=rf"'by_hand_test': a registry entry is Entry\(fn, \w+Needs\(\.\.\.\)\), "
                                            rf"not a \w+; add it with {fix}, which declares what it needs"):
            how()
        assert "by_hand_test" not in registry


def test_a_policy_loss_needs_one_advantage_per_response_only_when_it_says_so():
    assert {name: needs_sequence_advantages(name) for name in POLICY_LOSSES} == {"clip": False, "gspo": True}
    with pytest.raises(ValueError, match=r"^unknown policy loss 'gspp'; did you mean 'gspo'\?"):
        needs_sequence_advantages("gspp")

    def mine(**kwargs):
        return kwargs["logp"], {}

    try:
        register_policy_loss("per_token_test")(mine)
        assert needs_sequence_advantages("per_token_test") is False
        register_policy_loss("per_response_test", sequence_advantages=True)(mine)
        assert needs_sequence_advantages("per_response_test") is True
        register_policy_loss("per_response_test")(mine)  # the same function again, now declaring nothing
        assert needs_sequence_advantages("per_response_test") is False
    finally:
        for name in ("per_token_test", "per_response_test"):
            POLICY_LOSSES.pop(name, None)
