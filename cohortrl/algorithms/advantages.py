"""Advantage estimators: the GRPO group baseline and its variants, REINFORCE++, process supervision, GAE.

Shapes: N responses (= B), G responses per prompt, P = N / G prompts, T response tokens, S steps of one
response. Groups are contiguous: rows k·G … k·G + G − 1 answer prompt k. ``response_mask`` (N, T) is 1 on
response tokens. Every std is the sample std (Bessel-corrected, ``torch.std``'s default) with ``eps`` added:
A = (r − mean) / (std + eps).

A group whose rewards are all equal carries no signal; every group-normalised estimator returns exactly 0
for it (not 0/eps noise, not NaN).

``ADVANTAGE_ESTIMATORS`` maps a name to a function with ONE signature (see ``AdvantageEstimator``) and what it
needs from the run (``EstimatorNeeds``), so the GRPO trainer looks the name up and calls it without branching.
GAE needs a critic's values and is called directly by the PPO trainer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cohortrl.algorithms.masked import as_bool_mask, broadcast_to_tokens, masked_fill_padding, masked_whiten
from cohortrl.algorithms.registry import Entry, Registry, lookup, register
from cohortrl.algorithms.shaping import outcome_token_rewards

__all__ = [
    "GROUP_SCALES",
    "group_advantages",
    "rloo_advantages",
    "process_advantages",
    "reinforce_pp_advantages",
    "gae_advantages",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
    "register_advantage_estimator",
    "EstimatorNeeds",
    "GAE_NEEDS",
    "estimator_needs",
]

GROUP_SCALES = ("group", "batch", "none")


def _check_group_size(n: int, group_size: int, *, need_two: bool = True) -> int:
    group_size = operator.index(group_size)
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: must be a positive number of responses per prompt")
    if need_two and group_size < 2:
        raise ValueError(
            f"group_size={group_size}: group normalisation needs at least 2 responses per prompt; "
            "set group_size >= 2 or use estimator 'reinforce_pp'"
        )
    if n % group_size:
        raise ValueError(
            f"N={n} responses is not a multiple of group_size={group_size}: groups are contiguous rows "
            "k*G .. k*G+G-1, so N must equal prompts * group_size"
        )
    return group_size


def _as_float(x: torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    rewards = _as_float(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one outcome reward per response, shape (N,); got {tuple(rewards.shape)}")
    return rewards


def _is_constant(x_PG: torch.Tensor) -> torch.Tensor:
    """(P, G) → (P, 1) bool: the group's values are all equal."""
    return x_PG.amax(-1, keepdim=True) == x_PG.amin(-1, keepdim=True)


def _return_to_go(r_NT: torch.Tensor) -> torch.Tensor:
    """R_t = Σ_{s ≥ t} r_s along the last dim (γ = 1)."""
    return r_NT.flip(-1).cumsum(-1).flip(-1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome-supervision advantage, one per response. (N,) → (N,).

        scale="group":  A_i = (r_i − mean_g r) / (std_g r + eps)     DeepSeekMath, arXiv 2402.03300, §4.1.2
        scale="batch":  A_i = (r_i − mean_g r) / (std_N r + eps)     group baseline, batch-wide scale
        scale="none":   A_i =  r_i − mean_g r                        Dr. GRPO, arXiv 2503.20783

    mean_g / std_g run over the G responses of i's prompt, std_N over all N rewards. Dividing by the group
    std over-weights prompts that are nearly all right or all wrong (Dr. GRPO's "question-level difficulty
    bias"); "batch" keeps a scale without that bias. Needs G ≥ 2; a constant group gives exactly 0.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {GROUP_SCALES}")
    rewards = _check_rewards(rewards)
    group_size = _check_group_size(rewards.shape[0], group_size)
    r_PG = rewards.view(-1, group_size)
    centered_PG = r_PG - r_PG.mean(-1, keepdim=True)
    if scale == "group":
        centered_PG = centered_PG / (r_PG.std(-1, keepdim=True) + eps)
    elif scale == "batch":
        centered_PG = centered_PG / (rewards.std() + eps)
    return torch.where(_is_constant(r_PG), torch.zeros_like(centered_PG), centered_PG).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (RLOO, arXiv 2402.14740). (N,) → (N,).

        A_i = r_i − (1 / (G − 1)) Σ_{j ≠ i} r_j           (= G/(G−1) · Dr. GRPO's A_i)

    Needs G ≥ 2; a constant group gives exactly 0.
    """
    rewards = _check_rewards(rewards)
    group_size = _check_group_size(rewards.shape[0], group_size)
    r_PG = rewards.view(-1, group_size)
    others_mean_PG = (r_PG.sum(-1, keepdim=True) - r_PG) / (group_size - 1)
    advantages_PG = r_PG - others_mean_PG
    return torch.where(_is_constant(r_PG), torch.zeros_like(advantages_PG), advantages_PG).reshape(-1)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    response_mask: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    credit: str = "sum",
) -> torch.Tensor:
    """GRPO process supervision (DeepSeekMath, arXiv 2402.03300, §4.1.3). → (N, T).

        r̃_i^(j) = (r_i^(j) − mean(R)) / (std(R) + eps),  R = all step rewards of all G responses of the group
        A_{i,t}  = Σ_{j : index(j) ≥ t} r̃_i^(j)                      credit="sum" (DeepSeekMath)
        A_{i,t}  = min_{j : index(j) ≥ t} r̃_i^(j)                    credit="min" (PURE, arXiv 2504.15275)

    Min-form credit values a token by the worst step still ahead of it, so a run of easy correct steps cannot
    outweigh one wrong step (the summed form rewards writing many steps: the hacking PURE describes).

    ``step_rewards[i]`` holds the S_i step rewards of response i, ``step_ends[i]`` the response-token index
    (0-based, < T) where each step ends. A is 0 where the mask is 0 and after i's last step; a response
    without steps gets 0 everywhere. A group with fewer than two steps, or whose step rewards are all equal,
    gives exactly 0. G = 1 is allowed (normalisation then runs over the steps of one response).
    """
    if credit not in ("sum", "min"):
        raise ValueError(f"credit must be 'sum' or 'min', got {credit!r}")
    mask = as_bool_mask(response_mask)
    n, t_len = mask.shape
    if len(step_rewards) != n or len(step_ends) != n:
        raise ValueError(
            f"step_rewards ({len(step_rewards)}) and step_ends ({len(step_ends)}) need one entry per response (N={n})"
        )
    group_size = _check_group_size(n, group_size, need_two=False)
    dtype = torch.get_default_dtype()
    # Step lists are ragged Python data, so normalise group by group, then scatter onto (N, T).
    rows, ends, normalised = [], [], []
    for first in range(0, n, group_size):
        group_rows, group_ends, group_rewards = [], [], []
        for i in range(first, first + group_size):
            rewards_i = [float(r) for r in step_rewards[i]]
            ends_i = [operator.index(e) for e in step_ends[i]]
            if len(rewards_i) != len(ends_i):
                raise ValueError(f"response {i}: {len(rewards_i)} step rewards but {len(ends_i)} step ends")
            if any(not 0 <= e < t_len for e in ends_i):
                raise ValueError(f"response {i}: step ends {ends_i} fall outside the T={t_len} response tokens")
            group_rows += [i] * len(ends_i)
            group_ends += ends_i
            group_rewards += rewards_i
        values_S = torch.tensor(group_rewards, dtype=dtype)
        if len(group_rewards) < 2 or bool(values_S.amax() == values_S.amin()):
            values_S = torch.zeros_like(values_S)
        else:
            values_S = (values_S - values_S.mean()) / (values_S.std() + eps)
        rows += group_rows
        ends += group_ends
        normalised.append(values_S)
    if credit == "min":
        return masked_fill_padding(_min_to_go(rows, ends, torch.cat(normalised) if normalised else [], n, t_len).to(mask.device), mask)
    at_step_end_NT = torch.zeros((n, t_len), dtype=dtype)
    at_step_end_NT.index_put_(
        (torch.tensor(rows, dtype=torch.long), torch.tensor(ends, dtype=torch.long)),
        torch.cat(normalised) if normalised else torch.zeros(0, dtype=dtype),
        accumulate=True,  # two steps may end on the same token
    )
    return masked_fill_padding(_return_to_go(at_step_end_NT).to(mask.device), mask)


def _min_to_go(rows: list[int], ends: list[int], values, n: int, t_len: int) -> torch.Tensor:
    """A_{i,t} = min of row i's step values whose step ends at or after t; 0 after its last step."""
    out = torch.zeros((n, t_len), dtype=torch.get_default_dtype())
    by_row: dict[int, list[tuple[int, float]]] = {}
    for row, end, value in zip(rows, ends, values):
        by_row.setdefault(row, []).append((end, float(value)))
    for row, steps in by_row.items():
        steps.sort()
        running = float("inf")
        # Walk the steps from the last: tokens up to a step's end see the min of it and every later step.
        for end, value in reversed(steps):
            running = min(running, value)
            out[row, : end + 1] = running
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): return-to-go, optional group baseline, global whitening. → (N, T).

        R_{i,t} = Σ_{s ≥ t} r_{i,s}                               (γ = 1)
        baseline variant (group_size given): R_{i,t} ← R_{i,t} − mean_{j ∈ group(i)} R_{j,0}
        A = (R − mean(R)) / (std(R) + eps)      mean and std over every response token of the batch

    ``token_rewards`` (N, T) usually hold the outcome reward on the last response token minus β·KL per token
    (see ``outcome_token_rewards``). Departure: when all masked returns of the batch are equal the output is
    exactly 0 (``masked_whiten``). A constant group is NOT zeroed: the global mean shift is part of the method.
    """
    mask = as_bool_mask(response_mask)
    rewards_NT = masked_fill_padding(_as_float(token_rewards), mask)
    returns_NT = _return_to_go(rewards_NT)
    if group_size is not None:
        group_size = _check_group_size(mask.shape[0], group_size)
        total_PG = rewards_NT.sum(-1).view(-1, group_size)
        baseline_N = total_PG.mean(-1).repeat_interleave(group_size)
        returns_NT = returns_NT - baseline_N.unsqueeze(-1)
    return masked_whiten(returns_NT, mask, eps)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv 1506.02438, §3). → (adv, returns), (N, T).

        δ_t = r_t + γ V_{t+1} − V_t,   A_t = Σ_l (γλ)^l δ_{t+l},   R_t = A_t + V_t

    The value after the last response token is 0 (the episode ends there). Padding is skipped: t+1 means the
    next response token, so a hole in the mask (e.g. masked tool output) does not break the recursion. Both
    outputs are 0 on padding. Pass detached ``values``; whitening the advantages is the caller's choice
    (``masked_whiten``), as InstructGPT-style PPO does.
    """
    mask = as_bool_mask(response_mask)
    rewards_NT = masked_fill_padding(_as_float(token_rewards), mask)
    values_NT = masked_fill_padding(_as_float(values), mask)
    next_value_N = torch.zeros_like(values_NT[:, 0])
    next_advantage_N = torch.zeros_like(values_NT[:, 0])
    advantages = []
    for t in reversed(range(mask.shape[-1])):
        delta_N = rewards_NT[:, t] + gamma * next_value_N - values_NT[:, t]
        advantage_N = delta_N + gamma * lam * next_advantage_N
        on_token = mask[:, t]
        advantages.append(torch.where(on_token, advantage_N, torch.zeros_like(advantage_N)))
        next_advantage_N = torch.where(on_token, advantage_N, next_advantage_N)
        next_value_N = torch.where(on_token, values_NT[:, t], next_value_N)
    advantages_NT = torch.stack(advantages[::-1], dim=-1)
    return advantages_NT, masked_fill_padding(advantages_NT + values_NT, mask)


# ---------------------------------------------------------------------------------------------------------
# Registry: one call signature for every estimator, so the trainer never branches on the name.


class AdvantageEstimator(Protocol):
    """``fn(*, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None,
    eps=1e-6) -> advantages (N, T)``, 0 on padding.

    ``rewards`` (N,) outcome reward per response; ``token_rewards`` (N, T), ``step_rewards`` /
    ``step_ends`` (ragged, see ``process_advantages``), ``credit`` (sum / min) and ``process_coef`` (λ of the
    combined estimator) are used by the estimators that need them and ignored by the others. Outcome
    estimators give every response token of o_i the same A_i.
    """

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_size: int,
        token_rewards: torch.Tensor | None = None,
        step_rewards: Sequence[Sequence[float]] | None = None,
        step_ends: Sequence[Sequence[int]] | None = None,
        eps: float = 1e-6,
        credit: str = "sum",
        process_coef: float = 1.0,
    ) -> torch.Tensor: ...


def _grpo(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """GRPO outcome supervision: (r − mean_g) / (std_g + eps) on every token (arXiv 2402.03300)."""
    return broadcast_to_tokens(group_advantages(rewards, group_size, "group", eps), response_mask)


def _grpo_batch(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """Group mean baseline, batch std scale: (r − mean_g) / (std_N + eps) on every token."""
    return broadcast_to_tokens(group_advantages(rewards, group_size, "batch", eps), response_mask)


def _dr_grpo(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """Dr. GRPO: r − mean_g on every token, no std (arXiv 2503.20783)."""
    return broadcast_to_tokens(group_advantages(rewards, group_size, "none", eps), response_mask)


def _rloo(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """RLOO: r_i − mean of the other G − 1 rewards on every token (arXiv 2402.14740)."""
    return broadcast_to_tokens(rloo_advantages(rewards, group_size), response_mask)


def _token_rewards_or_outcome(token_rewards, rewards, response_mask):
    return outcome_token_rewards(_check_rewards(rewards), response_mask) if token_rewards is None else token_rewards


def _reinforce_pp(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """REINFORCE++: whitened return-to-go, no group baseline (arXiv 2501.03262). Default token rewards:
    the outcome reward on the last response token."""
    # No group baseline, but a batch that is not P·G rows is still a caller's bug worth reporting.
    _check_group_size(as_bool_mask(response_mask).shape[0], group_size, need_two=False)
    token_rewards = _token_rewards_or_outcome(token_rewards, rewards, response_mask)
    return reinforce_pp_advantages(token_rewards, response_mask, None, eps)


def _reinforce_pp_baseline(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """REINFORCE++-baseline: return-to-go minus the group mean return, whitened (arXiv 2501.03262)."""
    token_rewards = _token_rewards_or_outcome(token_rewards, rewards, response_mask)
    return reinforce_pp_advantages(token_rewards, response_mask, group_size, eps)


def _grpo_process(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """GRPO process supervision from step rewards and step end indices (arXiv 2402.03300, §4.1.3)."""
    missing = [name for name, value in (("step_rewards", step_rewards), ("step_ends", step_ends)) if value is None]
    if missing:
        raise ValueError(
            f"advantage estimator 'grpo_process' needs {' and '.join(missing)}: pass each response's step rewards "
            "and the token index where each step ends (a process reward function provides them)"
        )
    return process_advantages(step_rewards, step_ends, response_mask, group_size, eps, credit)


def _grpo_combined(
    *, rewards, response_mask, group_size, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6,
    credit="sum", process_coef=1.0
):
    """Outcome and process supervision together: A = A_outcome (GRPO) + λ·A_process (``process_coef``)."""
    process = _grpo_process(rewards=rewards, response_mask=response_mask, group_size=group_size,
                            step_rewards=step_rewards, step_ends=step_ends, eps=eps, credit=credit)
    return _grpo(rewards=rewards, response_mask=response_mask, group_size=group_size, eps=eps) + process_coef * process


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs from the rest of the run, so the config is checked against the registry
    rather than against a list of names.

    ``groups``: it compares a response with the others of its prompt, so it needs G >= 2.
    ``steps``: it reads ``step_rewards`` / ``step_ends``, so it needs a process reward (``reward.process``).
    ``per_sequence``: every token of a response gets the same advantage (a loss such as ``gspo`` that
    averages the advantage over the response needs this)."""

    groups: bool = False
    steps: bool = False
    per_sequence: bool = False


_OUTCOME_GROUP = EstimatorNeeds(groups=True, per_sequence=True)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", EstimatorNeeds, "register_advantage_estimator", {
    "grpo": Entry(_grpo, _OUTCOME_GROUP),
    "grpo_batch": Entry(_grpo_batch, _OUTCOME_GROUP),
    "dr_grpo": Entry(_dr_grpo, _OUTCOME_GROUP),
    "rloo": Entry(_rloo, _OUTCOME_GROUP),
    # Return-to-go varies along the response once token rewards (a KL in the reward) are present.
    "reinforce_pp": Entry(_reinforce_pp, EstimatorNeeds()),
    "reinforce_pp_baseline": Entry(_reinforce_pp_baseline, EstimatorNeeds(groups=True)),
    "grpo_process": Entry(_grpo_process, EstimatorNeeds(groups=True, steps=True)),
    "grpo_combined": Entry(_grpo_combined, EstimatorNeeds(groups=True, steps=True)),
})
"""Every advantage estimator by name: ``Entry(fn, EstimatorNeeds)``, ``fn`` of the one `AdvantageEstimator`
signature. Entries come in through `register_advantage_estimator`; one without its needs is refused."""
GAE_NEEDS = EstimatorNeeds()
"""PPO's GAE advantages (`gae_advantages`, computed by the PPO trainer, not looked up by name): per token."""


def register_advantage_estimator(name: str, *, groups: bool = False, steps: bool = False, per_sequence: bool = False):
    """Decorator: select ``fn`` by ``algorithm.estimator: NAME``. It must take the keyword arguments of
    ``AdvantageEstimator`` (or ``**kwargs``) and return advantages (N, T), 0 on padding. The keywords
    declare what it needs (`EstimatorNeeds`); the config is checked against them."""
    needs = EstimatorNeeds(groups=groups, steps=steps, per_sequence=per_sequence)
    return register(ADVANTAGE_ESTIMATORS, name, AdvantageEstimator, needs)


def estimator_needs(name: str) -> EstimatorNeeds:
    """What the registered estimator ``name`` declared (`EstimatorNeeds`)."""
    return lookup(ADVANTAGE_ESTIMATORS, name).needs


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator called ``name``; an unknown name raises ValueError naming the closest one."""
    return lookup(ADVANTAGE_ESTIMATORS, name).fn
