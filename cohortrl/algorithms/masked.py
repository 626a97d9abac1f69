"""Masked reductions over response tokens: sum, mean, whitening, broadcasting a per-response value.

Every helper selects with ``torch.where`` instead of multiplying by the mask. Padded slots may hold
anything the model or the collator left there (a huge log-prob, ``inf``), and ``inf * 0`` is NaN; a
``where`` drops the value outright. Inputs are sanitised *before* any non-linear op so that the backward
pass also never sees the garbage (``0 * inf`` would poison the gradient just the same).

Shapes: N responses (= B), T response tokens. ``response_mask`` is (N, T), 1 / True on response tokens;
bool, integer and float masks are all accepted.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_bool_mask",
    "masked_fill_padding",
    "masked_sum",
    "masked_mean",
    "masked_whiten",
    "broadcast_to_tokens",
    "last_token_index",
]


def as_bool_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """The mask as a bool tensor (N, T); non-zero entries are response tokens."""
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


def masked_fill_padding(x: torch.Tensor, response_mask: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """``x`` with every padded slot replaced by ``value``: where(M, x, value). Shapes (N, T) → (N, T).

    Gradients reaching the padded slots of ``x`` are exactly 0, whatever ``x`` held there.
    """
    mask = as_bool_mask(response_mask)
    return torch.where(mask, x, torch.full_like(x, value))


def masked_sum(x: torch.Tensor, response_mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ_{t: M_t=1} x_t, over ``dim`` (all elements when None). (N, T) → (N,) for dim=-1, or a scalar."""
    x = masked_fill_padding(x, response_mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, response_mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ M·x / Σ M over ``dim`` (all elements when None). A slice with no response token gives 0, not NaN."""
    mask = as_bool_mask(response_mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, response_mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x − mean) / (std + eps) over all response tokens of the batch; 0 on padding. (N, T) → (N, T).

    mean and std are taken over the masked elements only; std is the sample std (Bessel-corrected, as
    ``torch.std``). This is the "whiten over the global batch" of REINFORCE++ (arXiv 2501.03262) and of
    PPO-for-RLHF advantage normalisation.

    Departure: when the masked elements are all equal (or there are fewer than two), the output is exactly 0
    instead of 0/eps or NaN: there is no signal to normalise, and a zero-variance batch must give a zero
    update, not numerical noise.
    """
    mask = as_bool_mask(response_mask)
    x = masked_fill_padding(x, mask)
    count = mask.sum()
    mean = x.sum() / count.clamp(min=1).to(x.dtype)
    centered = masked_fill_padding(x - mean, mask)
    var = centered.square().sum() / (count - 1).clamp(min=1).to(x.dtype)
    highest = torch.where(mask, x, torch.full_like(x, -float("inf"))).amax()
    lowest = torch.where(mask, x, torch.full_like(x, float("inf"))).amin()
    constant = (count < 2) | (highest == lowest)
    whitened = centered / (var.sqrt() + eps)
    return torch.where(mask & ~constant, whitened, torch.zeros_like(whitened))


def broadcast_to_tokens(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A per-response value (N,) copied onto every response token: A_{i,t} = v_i·M_{i,t}. → (N, T).

    A per-token tensor (N, T) passes through with its padding zeroed, so callers may hand either.
    """
    mask = as_bool_mask(response_mask)
    if values.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(
            f"values have shape {tuple(values.shape)}; expected (N,) = {tuple(mask.shape[:1])} "
            f"or response_mask's (N, T) = {tuple(mask.shape)}"
        )
    if values.dim() == 1:
        values = values.unsqueeze(-1).expand(mask.shape)
    return masked_fill_padding(values, mask)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last response token of each row, (N,) long; −1 for a row without any response token."""
    mask = as_bool_mask(response_mask)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)
