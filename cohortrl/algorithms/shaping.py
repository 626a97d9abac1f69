"""Reward shaping that is pure tensor math: where an outcome reward sits among the tokens, the KL penalty
placed in the reward, and DAPO's soft overlong punishment.

Shapes: N responses, T response tokens; ``response_mask`` (N, T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cohortrl.algorithms.masked import as_bool_mask, last_token_index

__all__ = ["kl_shaped_rewards", "outcome_token_rewards", "soft_overlong_penalty"]


def outcome_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's outcome reward placed on its last response token, 0 elsewhere. (N,) → (N, T).

    This is how an outcome (or reward-model) score enters token-level return computations: the PPO-for-RLHF
    per-token reward (Ziegler et al. 2019; InstructGPT, arXiv 2203.02155) is
    ``outcome_token_rewards(score, M) - beta * kl_penalty(logp, ref_logp, "k1")``, and REINFORCE++
    (arXiv 2501.03262) uses the same construction. A row without response tokens gets no reward.
    """
    mask = as_bool_mask(response_mask)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards have shape {tuple(rewards.shape)}, expected (N,) = ({mask.shape[0]},)")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    last_BT = torch.arange(mask.shape[-1], device=mask.device) == last_token_index(mask).unsqueeze(-1)
    return torch.where(last_BT, rewards.unsqueeze(-1), torch.zeros((), dtype=rewards.dtype, device=rewards.device))


def kl_shaped_rewards(
    rewards: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty placed in the reward rather than the loss. (N,), (N, T) → (N,), (N, T).

    Per token, r_t = [t is the last response token]·r − β·KL_t (Ziegler et al. 2019; the PPO-for-RLHF reward,
    ALGORITHMS.md); per response, the sum of those, r − β·Σ_t KL_t, which is what an outcome estimator
    (GRPO's group normalisation) sees. ``kl`` is a per-token estimate from the sampling policy (detached:
    a reward carries no gradient); padded slots are ignored. Returns (sequence rewards, token rewards).
    """
    mask = as_bool_mask(response_mask)
    kl = torch.where(mask, kl.to(torch.get_default_dtype()), 0.0)
    token_rewards = outcome_token_rewards(rewards, response_mask) - beta * kl
    return rewards.to(token_rewards.dtype) - beta * kl.sum(-1), token_rewards


def soft_overlong_penalty(
    lengths: torch.Tensor | Sequence[int], max_length: int, cache_length: int
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476), added to the outcome reward. → (N,).

        R_len(y) = 0                                   if |y| ≤ L_max − L_cache
                   ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                   −1                                  if |y| > L_max

    ``lengths`` (N,) are response lengths in tokens; ``max_length`` is L_max, ``cache_length`` L_cache
    (DAPO: 20480 and 4096). The penalty falls linearly from 0 to −1 across the last L_cache tokens.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length; got {cache_length} and {max_length}")
    lengths = torch.as_tensor(lengths)
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    threshold = max_length - cache_length
    ramp = (threshold - lengths) / cache_length
    zero = torch.zeros_like(lengths)
    return torch.where(lengths <= threshold, zero, torch.where(lengths <= max_length, ramp, zero - 1))
