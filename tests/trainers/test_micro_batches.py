"""``step.micro_batches``: a minibatch's rows cut into micro-batches, then the zero-weight padding micro-batches that
keep torchrun's ranks in step (``Dist.padding_micro_batches``). One process never pads, so the trainer tests reach the
padding only through ``tests/test_distributed.py``; here it is checked directly."""

import torch

from cohortrl.trainers.step import MicroBatch, micro_batches


def _minibatch():
    B, T = 3, 5
    rows = torch.tensor([2, 0, 1])
    weights = torch.arange(B * T, dtype=torch.float32).view(B, T) / 100
    loss_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    response_mask = torch.ones(B, T)
    response_mask[2, 3:] = 0
    return rows, weights, loss_mask, response_mask


def test_rows_are_cut_at_the_positions_with_their_weights_and_masks():
    rows, weights, loss_mask, response_mask = _minibatch()
    out = micro_batches(rows, weights, loss_mask, response_mask, [torch.tensor([0, 1]), torch.tensor([2])], "cpu", n_padding=0)
    assert [mb.rows.tolist() for mb in out] == [[2, 0], [1]]
    assert torch.equal(out[0].weights, weights[:2]) and torch.equal(out[1].weights, weights[2:])
    # the masks are the rollout's rows the micro-batch trains on (rows index the rollout, weights the minibatch)
    assert torch.equal(out[0].loss_mask, loss_mask[[2, 0]]) and torch.equal(out[1].response_mask, response_mask[[1]])
    assert [mb.sync for mb in out] == [False, True] and not any(mb.padding for mb in out)


def test_padding_micro_batches_are_one_row_stand_ins_with_nothing_to_train_on():
    rows, weights, loss_mask, response_mask = _minibatch()
    out = micro_batches(rows, weights, loss_mask, response_mask, [torch.tensor([0, 1, 2])], "cpu", n_padding=2)
    assert len(out) == 3 and not out[0].padding
    for mb in out[1:]:
        assert isinstance(mb, MicroBatch) and mb.padding is True
        # row 0 exists on every rank that holds any row; its forward runs (FSDP2 gathers the shards) and counts for nothing
        assert mb.rows.tolist() == [0]
        assert mb.weights.shape == mb.loss_mask.shape == mb.response_mask.shape == (1, loss_mask.shape[1])
        assert not mb.weights.any() and not mb.loss_mask.any() and not mb.response_mask.any()
        assert mb.loss_mask.dtype == loss_mask.dtype and mb.response_mask.dtype == response_mask.dtype
    # gradients are all-reduced once, on the last micro-batch, whether it is a real one or a stand-in
    assert [mb.sync for mb in out] == [False, False, True]


def test_a_rank_without_rows_runs_only_the_stand_in_and_syncs_on_it():
    _, weights, loss_mask, response_mask = _minibatch()
    out = micro_batches(torch.tensor([], dtype=torch.long), weights[:0], loss_mask, response_mask, [], "cpu", n_padding=1)
    assert len(out) == 1 and out[0].padding and out[0].sync and out[0].rows.tolist() == [0]
