"""The group-size study's arithmetic (benchmarks/group_size.py): draw weights reproduce GRPO's advantages, and
the Gram-matrix statistics equal the ones computed on explicit gradient vectors."""

import pytest
import torch

from benchmarks.group_size import draw_weights, gradient_stats, observed_zero_variance, pool_weights, predicted_zero_variance


def test_draw_weights_hand_worked_one_prompt_two_responses():
    # Rewards [1, 0], P = 1, G = 2: a draw of the two different responses has A = ±0.5 / std([1, 0]) = ±0.7071,
    # weights A / (P·G) = ±0.3536; a draw of one response twice is a zero-variance group with weight 0.
    w, zero = draw_weights(torch.tensor([[1.0, 0.0]]), prompts=1, group_size=2, draws=400,
                           generator=torch.Generator().manual_seed(0))
    informative = w.abs().sum(-1) > 0
    assert torch.equal(zero, (~informative).double())
    torch.testing.assert_close(w[informative], torch.tensor([0.5 ** 0.5 / 2, -(0.5 ** 0.5) / 2], dtype=torch.float64)
                               .expand(int(informative.sum()), 2), atol=1e-6, rtol=0)
    assert 0.4 < informative.double().mean() < 0.6  # P(two different picks) = 1/2


def test_draw_weights_take_p_prompts_and_sum_repeated_picks():
    correct = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    w, zero = draw_weights(correct, prompts=2, group_size=4, draws=200, generator=torch.Generator().manual_seed(1))
    per_prompt = w.view(200, 3, 4)
    assert ((per_prompt.abs().sum(-1) > 0).sum(-1) <= 2).all()  # at most P prompts carry weight
    assert per_prompt[:, 1].abs().sum() == 0  # the all-correct prompt never has an advantage
    torch.testing.assert_close(per_prompt.sum(-1), torch.zeros(200, 3, dtype=torch.float64), atol=1e-12, rtol=0)
    assert ((zero == 0) | (zero == 0.5) | (zero == 1)).all()
    with pytest.raises(ValueError, match="pool"):
        draw_weights(correct, prompts=4, group_size=2, draws=1, generator=torch.Generator())


def test_gradient_stats_from_the_gram_matrix_match_explicit_vectors():
    g = torch.Generator().manual_seed(0)
    H = torch.randn(6, 10, generator=g, dtype=torch.float64)  # 6 responses' gradients in 10 dimensions
    W = torch.randn(50, 6, generator=g, dtype=torch.float64)
    W[3] = 0  # a draw with no gradient
    w_ref = torch.randn(6, generator=g, dtype=torch.float64)
    stats = gradient_stats(W, H @ H.T, w_ref)
    grads, ref = W @ H, w_ref @ H
    assert stats["trace_cov"] == pytest.approx(grads.var(0, unbiased=True).sum().item(), rel=1e-9)
    assert stats["mean_sq"] == pytest.approx(grads.mean(0).square().sum().item(), rel=1e-9)
    cos = torch.nn.functional.cosine_similarity(grads, ref.expand_as(grads), dim=-1)
    cos[3] = 0
    assert stats["cos_ref"] == pytest.approx(cos.mean().item(), rel=1e-9)
    assert stats["zero_grad_frac"] == pytest.approx(1 / 50)


def test_pool_weights_and_zero_variance_prediction():
    correct = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # prompt 0: mean .25, std (unbiased) .5 → A = 1.5, −.5, −.5, −.5; prompt 1 constant → 0; divided by K·S = 8
    torch.testing.assert_close(pool_weights(correct), torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0],
                                                                   dtype=torch.float64) / 8, atol=1e-6, rtol=0)
    assert predicted_zero_variance([0.25, 1.0], 2) == pytest.approx((0.25**2 + 0.75**2 + 1.0) / 2)
    assert observed_zero_variance(correct.tolist(), 2) == pytest.approx(3 / 4)  # [1,0] no; [0,0], [1,1], [1,1] yes
