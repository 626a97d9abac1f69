"""KL estimators between the policy and the reference model, and the controllers that set their weight β.

Shapes: N responses, T response tokens. The estimators are element-wise, so their padded slots hold
whatever the inputs held there; ``aggregate`` and ``masked_mean`` drop those slots with ``torch.where``.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_penalty", "exact_kl", "AdaptiveKLController", "FixedKLController"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman, "Approximating KL divergence",
    2020). (N, T), (N, T) → (N, T). With x = log π_ref − log π_θ:

        k1 = −x            unbiased, can be negative
        k2 = x² / 2        biased, low variance, ≥ 0
        k3 = eˣ − x − 1    unbiased, ≥ 0; GRPO's KL term (DeepSeekMath, arXiv 2402.03300, eq. 4)

    In a loss, d k3 / d logp = 1 − π_ref/π_θ: GRPO's gradient coefficient β(π_ref/π_θ − 1) (App. A.1) with
    the sign of a quantity to minimise. ``ref_logp`` is a constant (pass it detached). Padded slots must hold
    finite log-probs (any model's do): exp of a garbage value there can overflow, and although the forward
    output is dropped by ``aggregate``, ``0 · inf`` in the backward pass is NaN.
    """
    x = ref_logp - logp
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x.square()
    if kind == "k3":
        # expm1 keeps k3 accurate (and exactly ≥ 0) for small |x|, where exp(x) − 1 would cancel.
        return torch.expm1(x) - x
    raise ValueError(f"kind={kind!r}: expected one of {KL_ESTIMATORS}")


def exact_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p ‖ q) over the whole vocabulary at each position, of the distributions softmax(logits / temperature):
    (N, T, V), (N, T, V) → (N, T),

        KL_t = Σ_v p_t(v) · (log p_t(v) − log q_t(v))

    the expectation over the next token that k1 and k3 above estimate from the one token sampled. A measurement
    to compare runs by, whatever estimator each trained with; the sum over the vocabulary makes it no estimate.
    """
    scale = temperature if temperature not in (0, 1) else 1.0
    dtype = torch.promote_types(logits_p.dtype, torch.float32)  # bf16 logits measured in fp32, fp64 kept
    logp = torch.log_softmax(logits_p.to(dtype) / scale, dim=-1)
    logq = torch.log_softmax(logits_q.to(dtype) / scale, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


class FixedKLController:
    """A constant KL coefficient β with the adaptive controller's interface, so trainers treat both alike."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"coef={coef}: a KL coefficient must be >= 0")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Leaves β unchanged; returns it."""
        return self.value


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards a target (Ziegler et al., arXiv 1909.08593):

        e = clip(KL / KL_target − 1, −0.2, 0.2),     β ← β · (1 + e · n_steps / horizon)

    ``current_kl`` is the measured KL of the last batch (per sequence, as the paper; a tensor or float),
    ``n_steps`` the number of samples it came from. ``update`` returns the new β; ``value`` holds it.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_coef >= 0, target > 0, horizon > 0; got {init_coef}, {target}, {horizon}"
            )
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
