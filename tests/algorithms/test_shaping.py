"""DAPO's soft overlong punishment; the KL penalty placed in the reward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import kl_shaped_rewards, soft_overlong_penalty

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


def test_kl_shaped_rewards_hand_worked():
    # β = 0.5; response 0 has three tokens with KL .1 .2 .3, response 1 one token with KL .5 (then padding,
    # whose KL values are garbage and must be ignored).
    #   sequence: 1 − .5·(.1 + .2 + .3) = .7;   0 − .5·.5 = −.25
    #   tokens:   [−.05, −.1, 1 − .15 = .85];   [−.25, 0, 0]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 99.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    seq, tok = kl_shaped_rewards(torch.tensor([1, 0]), kl, mask, beta=0.5)
    torch.testing.assert_close(seq, torch.tensor([0.7, -0.25]))
    torch.testing.assert_close(tok, torch.tensor([[-0.05, -0.1, 0.85], [-0.25, 0.0, 0.0]]))
    torch.testing.assert_close(tok.sum(-1), seq)  # one reward, two placements
