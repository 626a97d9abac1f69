"""Per-token losses to MINIMISE: the clipped policy surrogate (token level and GSPO sequence level, with
clip-higher and dual-clip) and PPO's clipped value loss. How a per-token loss becomes a scalar lives in
``aggregate``.

Shapes: N responses, T response tokens; ``response_mask`` (N, T). ``old_logp``, ``advantages``,
``old_values`` and ``returns`` are constants of the update, so they are detached here: a trainer that passes
``old_logp=logp`` (one update per rollout) gets ρ = 1 with the right gradient instead of a silent zero.
Every loss is exactly 0 on padding, and padded inputs never reach a non-linear op.

``POLICY_LOSSES`` maps a name to a function with ONE signature (see ``PolicyLoss``) and what it needs from the
advantages (``LossNeeds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cohortrl.algorithms.masked import as_bool_mask, broadcast_to_tokens, masked_fill_padding, masked_mean
from cohortrl.algorithms.registry import Entry, Registry, lookup, register

__all__ = [
    "POLICY_LOSS_LEVELS", "policy_loss", "value_loss", "PolicyLoss", "POLICY_LOSSES", "get_policy_loss", "register_policy_loss",
    "LossNeeds", "needs_sequence_advantages",
    "truncated_importance_weights",
]

POLICY_LOSS_LEVELS = ("token", "sequence")


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip={dual_clip}: the dual-clip constant c must be > 1 (Ye et al. use 3)")


def _check_shapes(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected response_mask's {tuple(mask.shape)}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy surrogate per token, to minimise. → (loss (N, T), metrics).

        L_{i,t} = −min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A)
        level="token":     ρ = ρ_{i,t} = exp(logp_{i,t} − old_logp_{i,t})
                           PPO (arXiv 1707.06347, eq. 7), GRPO (arXiv 2402.03300, eq. 3)
        level="sequence":  ρ = s_i = exp((1/|o_i|) Σ_t log ρ_{i,t}) on every token of o_i
                           GSPO (arXiv 2507.18071)
        dual_clip=c:       L ← min(L, −c·A) where A < 0                      Ye et al. (arXiv 1912.09729), c ≈ 3

    ``clip_high > clip_low`` is DAPO's clip-higher (arXiv 2503.14476: 0.2 / 0.28); GSPO uses 3e-4 / 4e-4.
    ``advantages`` is (N,) or (N, T). ``logp`` (N, T) carries the gradient. At ρ = 1 the loss is −A with
    gradient −A·∇logp, the plain policy gradient.

    metrics (Python floats, over response tokens): ``clip_frac_low`` (A < 0, ρ < 1 − ε_low: the clip
    removed the gradient), ``clip_frac_high`` (A > 0, ρ > 1 + ε_high), ``clip_frac_dual`` (A < 0, ρ > c),
    ``ratio_mean`` (of the ρ used: sequence ratios count once per token), ``approx_kl`` (mean of
    (ρ_t − 1) − log ρ_t, Schulman's k3 estimate of KL(π_old ‖ π_θ), always per token).
    """
    if level not in POLICY_LOSS_LEVELS:
        raise ValueError(f"level={level!r}: expected one of {POLICY_LOSS_LEVELS}")
    _check_clip(clip_low, clip_high, dual_clip)
    mask = as_bool_mask(response_mask)
    _check_shapes(mask, logp=logp, old_logp=old_logp)
    advantages_NT = broadcast_to_tokens(advantages.detach().to(logp.dtype), mask)
    token_log_ratio_NT = masked_fill_padding(logp - old_logp.detach(), mask)
    if level == "sequence":
        log_ratio_NT = masked_mean(token_log_ratio_NT, mask, dim=-1).unsqueeze(-1).expand_as(token_log_ratio_NT)
    else:
        log_ratio_NT = token_log_ratio_NT
    ratio_NT = torch.exp(log_ratio_NT)
    unclipped_NT = -advantages_NT * ratio_NT
    clipped_NT = -advantages_NT * ratio_NT.clamp(1 - clip_low, 1 + clip_high)
    loss_NT = torch.maximum(unclipped_NT, clipped_NT)
    if dual_clip is not None:
        capped_NT = torch.minimum(loss_NT, -dual_clip * advantages_NT)
        loss_NT = torch.where(advantages_NT < 0, capped_NT, loss_NT)
    loss_NT = masked_fill_padding(loss_NT, mask)

    with torch.no_grad():
        negative, positive = advantages_NT < 0, advantages_NT > 0
        dual_capped = negative & (ratio_NT > dual_clip) if dual_clip is not None else torch.zeros_like(mask)
        token_ratio_NT = torch.exp(token_log_ratio_NT)
        values = torch.stack([
            masked_mean((negative & (ratio_NT < 1 - clip_low)).to(logp.dtype), mask),
            masked_mean((positive & (ratio_NT > 1 + clip_high)).to(logp.dtype), mask),
            masked_mean(dual_capped.to(logp.dtype), mask),
            masked_mean(ratio_NT, mask),
            masked_mean(token_ratio_NT - 1 - token_log_ratio_NT, mask),
        ]).tolist()
    names = ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean", "approx_kl")
    return loss_NT, dict(zip(names, values))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """PPO clipped value loss per token, to minimise. → (N, T), 0 on padding.

        V_c = clip(V, V_old − c, V_old + c),    L^V_t = ½ · max((V − R)², (V_c − R)²)

    as in PPO-for-RLHF (Ziegler et al. 2019; the PPO2 baselines code); R are the GAE returns. ``clip=None``
    drops the clipped term (plain ½(V − R)²).
    """
    mask = as_bool_mask(response_mask)
    _check_shapes(mask, values=values, old_values=old_values, returns=returns)
    values_NT = masked_fill_padding(values, mask)
    old_NT = masked_fill_padding(old_values.detach(), mask)
    returns_NT = masked_fill_padding(returns.detach(), mask)
    squared_NT = (values_NT - returns_NT).square()
    if clip is not None:
        if clip < 0:
            raise ValueError(f"clip={clip}: the value clip range must be >= 0 (or None for no clipping)")
        clipped_NT = torch.clamp(values_NT, min=old_NT - clip, max=old_NT + clip)
        squared_NT = torch.maximum(squared_NT, (clipped_NT - returns_NT).square())
    return masked_fill_padding(0.5 * squared_NT, mask)


# ---------------------------------------------------------------------------------------------------------
# Registry: one call signature for every policy loss, so the trainer never branches on the name.


class PolicyLoss(Protocol):
    """``fn(*, logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip=None)
    -> (loss (N, T), metrics dict of floats)``; see ``policy_loss`` for the metrics."""

    def __call__(
        self,
        *,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def _clip(*, logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip=None):
    return policy_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip, level="token")


def _gspo(*, logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip=None):
    return policy_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip, level="sequence")


@dataclass(frozen=True)
class LossNeeds:
    """What a policy loss needs from the advantages. ``sequence_advantages``: one advantage per response. GSPO's
    sequence ratio s_i multiplies every token's A_{i,t}, so its gradient gives each token −s_i·mean_t(A_{i,t})/|o_i|,
    not the token's own advantage: with advantages that vary along a response (reinforce_pp, grpo_process, PPO's
    GAE) that is not the estimator's credit."""

    sequence_advantages: bool = False


POLICY_LOSSES = Registry("policy loss", LossNeeds, "register_policy_loss", {
    "clip": Entry(_clip, LossNeeds()),
    "gspo": Entry(_gspo, LossNeeds(sequence_advantages=True)),
})
"""Every policy loss by name: ``Entry(fn, LossNeeds)``, ``fn`` of the one `PolicyLoss` signature."""


def register_policy_loss(name: str, *, sequence_advantages: bool = False):
    """Decorator: select ``fn`` by ``algorithm.policy_loss: NAME``. It must take the keyword arguments of
    ``PolicyLoss`` (or ``**kwargs``) and return (loss (N, T), metrics with clip_frac_low / clip_frac_high).
    ``sequence_advantages``: it is only right when every token of a response has the same advantage."""
    return register(POLICY_LOSSES, name, PolicyLoss, LossNeeds(sequence_advantages=sequence_advantages))


def needs_sequence_advantages(name: str) -> bool:
    """Whether the registered policy loss ``name`` needs one advantage per response."""
    return lookup(POLICY_LOSSES, name).needs.sequence_advantages


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss called ``name``; an unknown name raises ValueError naming the closest one."""
    return lookup(POLICY_LOSSES, name).fn


def truncated_importance_weights(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_t = min(π_old(y_t) / π_sampler(y_t), C): truncated importance sampling for a sampler whose numerics
    differ from the trainer's (vLLM's kernels vs the training forward pass). The policy-gradient loss of each
    token is multiplied by w_t, so the gradient estimates the trainer's on-policy gradient; truncating at C
    bounds the variance (Ionides 2008, truncated IS; applied to RL rollouts by Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"). (N, T), detached, 0 on padding."""
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    mask = as_bool_mask(response_mask)
    ratio = torch.exp((old_logp - sampling_logp).detach()).clamp(max=cap)
    return torch.where(mask, ratio, torch.zeros_like(ratio))
