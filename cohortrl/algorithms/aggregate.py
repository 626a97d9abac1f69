"""Turning a per-token loss into the scalar to minimise: the one place that decides how tokens are weighted.

Shapes: N responses, T response tokens; ``loss`` and ``response_mask`` are (N, T).
"""

from __future__ import annotations

import torch

from cohortrl.algorithms.masked import as_bool_mask, masked_fill_padding

__all__ = ["AGGREGATION_MODES", "aggregate", "token_weights"]

AGGREGATION_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def aggregate(
    loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "seq-mean-token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:
    """Scalar loss from per-token losses L_{i,t}; padded slots are dropped, whatever they hold. → 0-dim.

        "seq-mean-token-mean":      (1/N) Σ_i (1/|o_i|) Σ_t L_{i,t}    GRPO (arXiv 2402.03300, eq. 3)
        "token-mean":               Σ_{i,t} L_{i,t} / Σ_{i,t} M_{i,t}  DAPO (arXiv 2503.14476)
        "seq-mean-token-sum-norm":  Σ_{i,t} L_{i,t} / (N · norm_length) Dr. GRPO (arXiv 2503.20783)

    The per-sequence mean gives a token of a short response more weight than one of a long response (Dr.
    GRPO's length bias); the token mean weighs every token alike; the constant normaliser (``norm_length``,
    e.g. the generation budget) also keeps the scale independent of the batch's lengths. ``norm_length`` is
    required by the last mode and ignored by the others, so a trainer can always pass it.

    Departure: in "seq-mean-token-mean", N counts rows with at least one response token, so all-padding rows
    (e.g. filler rows of a micro-batch) neither add a 0/0 nor dilute the mean. With equal lengths |o_i| = L
    all three modes agree (norm_length = L).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {AGGREGATION_MODES}")
    mask = as_bool_mask(response_mask)
    if loss.shape != mask.shape:
        raise ValueError(f"loss has shape {tuple(loss.shape)}, expected response_mask's {tuple(mask.shape)}")
    loss_NT = masked_fill_padding(loss, mask)
    if mode == "token-mean":
        return loss_NT.sum() / mask.sum().clamp(min=1).to(loss_NT.dtype)
    if mode == "seq-mean-token-mean":
        lengths_N = mask.sum(-1)
        per_sequence_N = loss_NT.sum(-1) / lengths_N.clamp(min=1).to(loss_NT.dtype)
        return per_sequence_N.sum() / (lengths_N > 0).sum().clamp(min=1).to(loss_NT.dtype)
    if norm_length is None or norm_length <= 0:
        raise ValueError(
            f"mode 'seq-mean-token-sum-norm' needs norm_length > 0 (e.g. the max new tokens), got {norm_length}"
        )
    return loss_NT.sum() / (mask.shape[0] * norm_length)


def token_weights(response_mask: torch.Tensor, mode: str, norm_length: int | None) -> torch.Tensor:
    """w_{i,t} = ∂ aggregate(L) / ∂ L_{i,t}, (N, T). Aggregation is linear in L, so Σ w·L over any split of the
    rows into micro-batches equals ``aggregate`` over all of them: gradient accumulation stays exact for every
    mode without the trainer knowing which mode it is."""
    probe = torch.zeros(response_mask.shape, requires_grad=True)
    (w,) = torch.autograd.grad(aggregate(probe, response_mask, mode, norm_length), probe)
    return w
