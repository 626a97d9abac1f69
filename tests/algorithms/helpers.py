"""Shared test helpers for cohortrl.algorithms: hypothesis settings, strategies, padding fuzz."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

# Fast and deterministic enough for CI on 2 cores: a few dozen examples per property, no per-example deadline
# (the first torch call of a process can take a while).
FAST = settings(max_examples=60, deadline=None)

# Garbage for padded slots: huge, tiny, infinite — anything but NaN (NaN-free, as the issue asks).
GARBAGE = st.sampled_from([1e30, -1e30, float("inf"), -float("inf"), 1e4, -1e4, 88.0, 123.456, 0.0])

DTYPE = torch.float64


def t(values, dtype=DTYPE) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def right_padded_mask(lengths: list[int], t_len: int) -> torch.Tensor:
    """(N, T) bool mask with the first lengths[i] tokens of row i set."""
    return torch.arange(t_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)


def with_garbage(x: torch.Tensor, mask: torch.Tensor, garbage: float) -> torch.Tensor:
    """x with every padded slot replaced by garbage."""
    return torch.where(mask.bool(), x, torch.full_like(x, garbage))


@st.composite
def masks(draw, max_rows: int = 6, max_len: int = 6, holes: bool = True, min_len: int = 1) -> torch.Tensor:
    """A (N, T) bool response mask: right-padded rows, optionally with holes (masked tool output)."""
    n = draw(st.integers(1, max_rows))
    t_len = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(min(min_len, t_len), t_len), min_size=n, max_size=n))
    mask = right_padded_mask(lengths, t_len)
    if holes:
        hole_bits = draw(st.lists(st.booleans(), min_size=n * t_len, max_size=n * t_len))
        # keep the first token of each row so that min_len still holds for rows that have one
        holes_NT = torch.tensor(hole_bits).view(n, t_len)
        holes_NT[:, 0] = False
        mask = mask & ~holes_NT
    return mask


def tensor_like(draw, mask: torch.Tensor, low: float = -5.0, high: float = 5.0) -> torch.Tensor:
    """A float64 tensor of mask's shape with values drawn in [low, high]."""
    values = draw(
        st.lists(
            st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False),  # subnormal spreads underflow the std
            min_size=mask.numel(),
            max_size=mask.numel(),
        )
    )
    return torch.tensor(values, dtype=DTYPE).view(mask.shape)
