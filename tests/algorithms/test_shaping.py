"""DAPO's soft overlong punishment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import soft_overlong_penalty

from .helpers import FAST


def test_soft_overlong_penalty_hand_worked():
    # L_max = 20, L_cache = 5 → free up to 15 tokens, then a ramp ((15 − |y|)/5), then −1 beyond 20
    #   10 → 0;  15 → 0;  16 → −1/5 = −.2;  18 → −3/5 = −.6;  20 → −5/5 = −1;  21 → −1
    got = soft_overlong_penalty(torch.tensor([10, 15, 16, 18, 20, 21]), max_length=20, cache_length=5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    torch.testing.assert_close(soft_overlong_penalty([16], 20, 5), torch.tensor([-0.2]))
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty([1], max_length=4, cache_length=5)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty([1], max_length=4, cache_length=0)


@FAST
@given(st.integers(1, 64), st.data())
def test_soft_overlong_penalty_is_monotone_and_bounded(max_length, data):
    cache_length = data.draw(st.integers(1, max_length))
    lengths = torch.arange(0, max_length + 5)
    got = soft_overlong_penalty(lengths, max_length, cache_length)
    assert ((got <= 0) & (got >= -1)).all()
    assert (got[1:] <= got[:-1]).all()  # longer is never rewarded more
    assert (got[lengths <= max_length - cache_length] == 0).all() and (got[lengths > max_length] == -1).all()
