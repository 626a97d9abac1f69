"""Masked helpers: hand-worked numbers and padding fuzz."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import broadcast_to_tokens, last_token_index, masked_mean, masked_sum, masked_whiten

from .helpers import FAST, GARBAGE, masks, right_padded_mask, t, tensor_like, with_garbage


def test_masked_reductions_hand_worked():
    # x = [[1, 2, pad], [pad, pad, pad], [3, 5, 7]]
    #   row sums 3, 0, 15; row means 1.5, 0 (empty row: 0, not NaN), 5; all: 18 / 5 = 3.6
    x = t([[1, 2, 1e30], [-1e30, float("inf"), 0], [3, 5, 7]])
    mask = right_padded_mask([2, 0, 3], 3)
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), t([3, 0, 15]))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), t([1.5, 0, 5]))
    assert masked_mean(x, mask).item() == 3.6
    assert masked_sum(x, mask).item() == 18.0


def test_masked_whiten_hand_worked():
    # values {1, 2, 3, 6}: mean 3, deviations −2, −1, 0, 3, sample var = (4 + 1 + 0 + 9)/3 = 14/3
    x = t([[1, 2, 1e30], [3, 6, -1e30]])
    mask = right_padded_mask([2, 2], 3)
    s = math.sqrt(14 / 3)
    torch.testing.assert_close(masked_whiten(x, mask, eps=0.0), t([[-2 / s, -1 / s, 0], [0, 3 / s, 0]]))
    # a constant batch (or a single token) has nothing to normalise: exactly 0
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    assert torch.equal(masked_whiten(t([[0.1, 0.1], [0.1, 5.0]]), right_padded_mask([2, 1], 2)), zeros)
    assert torch.equal(masked_whiten(t([[4.0, 5.0], [6.0, 7.0]]), right_padded_mask([1, 0], 2)), zeros)


def test_broadcast_and_last_token():
    mask = right_padded_mask([2, 0, 3], 3)
    torch.testing.assert_close(broadcast_to_tokens(t([1.0, 2.0, -1.0]), mask), t([[1, 1, 0], [0, 0, 0], [-1, -1, -1]]))
    assert last_token_index(mask).tolist() == [1, -1, 2]


@FAST
@given(st.data(), GARBAGE)
def test_padding_never_influences_the_masked_helpers(data, garbage):
    mask = data.draw(masks())
    x = tensor_like(data.draw, mask)
    dirty = with_garbage(x, mask, garbage)
    for fn in (masked_sum, masked_mean):
        assert torch.equal(fn(x, mask), fn(dirty, mask))
        assert torch.equal(fn(x, mask, dim=-1), fn(dirty, mask, dim=-1))
    assert torch.equal(masked_whiten(x, mask), masked_whiten(dirty, mask))
    assert torch.equal(broadcast_to_tokens(x, mask), broadcast_to_tokens(dirty, mask))
