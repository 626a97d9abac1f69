"""KL estimators and KL controllers: hand-worked numbers, k3's properties and gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import AdaptiveKLController, FixedKLController, exact_kl, kl_penalty

from .helpers import FAST, t


def test_kl_estimators_hand_worked():
    # π_θ = .5, π_ref = .25 → x = ln .25 − ln .5 = −ln 2 ≈ −.6931
    #   k1 = −x = ln 2 ≈ .6931;  k2 = x²/2 = (ln 2)²/2 ≈ .2402
    #   k3 = eˣ − x − 1 = .5 + ln 2 − 1 ≈ .1931
    # second token: π_θ = π_ref → every estimator is 0
    logp, ref_logp = t([[math.log(0.5), math.log(0.3)]]), t([[math.log(0.25), math.log(0.3)]])
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k1"), t([[ln2, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k2"), t([[ln2**2 / 2, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k3"), t([[0.5 + ln2 - 1, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref_logp), kl_penalty(logp, ref_logp, "k3"))
    with pytest.raises(ValueError, match="kind='k4'"):
        kl_penalty(logp, ref_logp, "k4")


@FAST
@given(
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=16),
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=16, max_size=16),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_k3_is_nonnegative_and_zero_only_at_equality(logp, ref_logp, dtype):
    logp = torch.tensor(logp, dtype=dtype)
    ref_logp = torch.tensor(ref_logp[: len(logp)], dtype=dtype)
    k3 = kl_penalty(logp, ref_logp, "k3")
    assert (k3 >= 0).all()
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))
    # away from rounding (|x| ≥ 1e-3, where k3 ≈ x²/2 ≥ 5e-7 is representable) it is strictly positive
    assert (k3[(ref_logp - logp).abs() >= 1e-3] > 0).all()
    assert (kl_penalty(logp, ref_logp, "k2") >= 0).all()


@FAST
@given(st.lists(st.floats(-8, 0), min_size=1, max_size=8), st.lists(st.floats(-8, 0), min_size=8, max_size=8))
def test_k3_gradient_is_the_grpo_kl_coefficient(logp, ref_logp):
    # DeepSeekMath App. A.1: ∂/∂logp (π_ref/π_θ − log(π_ref/π_θ) − 1) = 1 − π_ref/π_θ
    #                                                                  = 1 − exp(ref − logp)
    logp = t(logp).requires_grad_(True)
    ref_logp = t(ref_logp[: len(logp)])
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref_logp, "k3").sum(), logp)
    torch.testing.assert_close(grad, 1 - torch.exp(ref_logp - logp.detach()))
    # k1's gradient is 1 everywhere, k2's is −x = logp − ref
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref_logp, "k1").sum(), logp)
    torch.testing.assert_close(grad, torch.ones_like(grad))
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref_logp, "k2").sum(), logp)
    torch.testing.assert_close(grad, logp.detach() - ref_logp)


def test_adaptive_kl_controller_hand_worked():
    # Ziegler et al.: e = clip(KL/target − 1, ±.2); β ← β(1 + e·n/horizon).  β₀ = .1, target 6, horizon 10000
    #   KL 12  → e = clip(1, ±.2) = .2     → β = .1·(1 + .2·256/10000) = .1·1.00512 = .100512
    #   KL 3   → e = clip(−.5) = −.2       → β = .100512·(1 − .00512) = .100512·.99488
    #   KL 6.6 → e = .1 (inside the clip)  → β ·= (1 + .1·256/10000) = 1.00256
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    assert controller.value == 0.1
    assert controller.update(12.0, n_steps=256) == pytest.approx(0.100512)
    assert controller.value == pytest.approx(0.100512)
    controller.update(torch.tensor(3.0), n_steps=256)
    assert controller.value == pytest.approx(0.100512 * 0.99488)
    controller.update(6.6, n_steps=256)
    assert controller.value == pytest.approx(0.100512 * 0.99488 * 1.00256)


def test_fixed_kl_controller_has_the_same_interface():
    controller = FixedKLController(coef=0.04)
    assert controller.update(100.0, n_steps=512) == 0.04 and controller.value == 0.04
    with pytest.raises(ValueError):
        FixedKLController(coef=-1)
    with pytest.raises(ValueError):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=100)


def test_exact_kl_is_what_k1_and_k3_estimate_in_expectation():
    """Hand-worked: p = (.5, .5), q = (.25, .75) → KL = .5 ln 2 + .5 ln(2/3) ≈ .1438. And on random logits, the
    p-weighted mean of k1 and of k3 over the whole vocabulary is exactly the exact KL (they are unbiased)."""
    p, q = t([[[0.5, 0.5]]]).log(), t([[[0.25, 0.75]]]).log()
    torch.testing.assert_close(exact_kl(p, q), t([[0.5 * math.log(2) + 0.5 * math.log(2 / 3)]]))
    torch.testing.assert_close(exact_kl(p, p), t([[0.0]]))
    g = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.randn(2, 3, 11, generator=g, dtype=torch.float64), torch.randn(2, 3, 11, generator=g, dtype=torch.float64)
    for temperature in (1.0, 0.7):
        logp, logq = (torch.log_softmax(x / temperature, -1) for x in (logits_p, logits_q))
        for kind in ("k1", "k3"):
            expected = (logp.exp() * kl_penalty(logp, logq, kind)).sum(-1)
            torch.testing.assert_close(exact_kl(logits_p, logits_q, temperature), expected)
    assert (exact_kl(logits_p, logits_q) > 0).all()
