"""Loss aggregation modes: hand-worked numbers, agreement at equal lengths, padding fuzz."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cohortrl.algorithms import AGGREGATION_MODES, aggregate, token_weights

from .helpers import FAST, GARBAGE, masks, right_padded_mask, t, tensor_like, with_garbage


def test_aggregation_modes_hand_worked():
    # L = [[1, 2, 3], [4, pad, pad]]
    #   seq-mean-token-mean: ((1+2+3)/3 + 4/1) / 2 = (2 + 4)/2 = 3      (GRPO: the short answer weighs more)
    #   token-mean:          (1+2+3+4) / 4 = 2.5                          (DAPO)
    #   seq-mean-token-sum-norm, L_const = 4: 10 / (2·4) = 1.25           (Dr. GRPO)
    loss = t([[1, 2, 3], [4, float("inf"), -1e30]])
    mask = right_padded_mask([3, 1], 3)
    assert aggregate(loss, mask).item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=4).item() == pytest.approx(1.25)


def test_token_weights_are_each_tokens_share_of_the_aggregate_hand_worked():
    # mask [[1, 1, 1], [1, pad, pad], [pad, pad, pad]] (the last a filler row):
    #   seq-mean-token-mean: 1/(2 rows · 3) = 1/6 on row 0, 1/(2 · 1) = 1/2 on row 1 (the filler row is no sequence)
    #   token-mean: 1/4 on each of the 4 tokens
    #   seq-mean-token-sum-norm, norm_length 4: 1/(3 rows · 4) = 1/12 on every token (N counts every row)
    mask = right_padded_mask([3, 1, 0], 3)
    expected = {
        "seq-mean-token-mean": [[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0], [0, 0, 0]],
        "token-mean": [[1 / 4, 1 / 4, 1 / 4], [1 / 4, 0, 0], [0, 0, 0]],
        "seq-mean-token-sum-norm": [[1 / 12, 1 / 12, 1 / 12], [1 / 12, 0, 0], [0, 0, 0]],
    }
    for mode, weights in expected.items():
        torch.testing.assert_close(token_weights(mask, mode, norm_length=4), torch.tensor(weights))
    with pytest.raises(ValueError, match="needs norm_length > 0"):
        token_weights(mask, "seq-mean-token-sum-norm", norm_length=None)


def test_empty_rows_do_not_count_as_sequences():
    # a filler row with no response token: seq-mean-token-mean = (2 + 4)/2 still, not /3 and not NaN
    loss = t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = right_padded_mask([3, 1, 0], 3)
    assert aggregate(loss, mask).item() == pytest.approx(3.0)
    assert aggregate(loss, torch.zeros(3, 3)).item() == 0.0
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)


def test_aggregate_validates_its_arguments():
    loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="mode="):
        aggregate(loss, mask, "sequence-mean")
    with pytest.raises(ValueError, match="needs norm_length"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss has shape"):
        aggregate(torch.zeros(2), mask)
    # norm_length is accepted (and ignored) by the other modes, so a trainer can always pass it
    assert aggregate(loss, mask, "token-mean", norm_length=8).item() == 0.0


@FAST
@given(st.data(), st.integers(1, 6), st.integers(1, 5))
def test_modes_agree_when_every_response_has_the_same_length(data, rows, length):
    # |o_i| = L for all i: (1/N)Σ_i(1/L)Σ_t = Σ/(N·L) = Σ/ΣM
    t_len = length + data.draw(st.integers(0, 3))
    mask = right_padded_mask([length] * rows, t_len)
    loss = tensor_like(data.draw, mask)
    values = [aggregate(loss, mask, mode, norm_length=length) for mode in AGGREGATION_MODES]
    for value in values[1:]:
        torch.testing.assert_close(value, values[0], atol=1e-12, rtol=1e-12)


@FAST
@given(st.data(), GARBAGE, st.sampled_from(AGGREGATION_MODES))
def test_padding_never_influences_the_aggregate_or_its_gradient(data, garbage, mode):
    mask = data.draw(masks())
    loss = tensor_like(data.draw, mask)

    def run(loss):
        loss = loss.clone().requires_grad_(True)
        value = aggregate(loss, mask, mode, norm_length=5)
        (grad,) = torch.autograd.grad(value, loss)
        return value.detach(), grad

    clean, dirty = run(loss), run(with_garbage(loss, mask, garbage))
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    assert torch.equal(dirty[1][~mask], torch.zeros_like(dirty[1][~mask]))
