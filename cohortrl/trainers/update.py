"""The pieces of the update (step 5) that do not depend on the algorithm: which rows each minibatch and
micro-batch trains on, with which token weights; how the policy's log-probs are computed and differentiated;
the optimiser step.

The plain path is one process, autograd through the training forward (``PlainForward``). Two paths extend it
from behind these boundaries instead of branching inside the loop (``RLTrainer._update``):

* torchrun (``distributed.Dist``): a minibatch is chosen over the whole batch, each rank keeps its share of
  the rows (``Dist.local_share``) and adds zero-weight micro-batches where collectives need every rank to run
  as many forwards (``Dist.padding_micro_batches``);
* the CPU fast path (``train.reuse_rollout_forward``): ``ReplayedForward`` differentiates decoding's own
  recorded forward (``cpu/replay.py``) when a single micro-batch is the whole rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from cohortrl.distributed import forward_inside
from cohortrl.rollout.hf import response_logprobs
from cohortrl.trainers import guards
from cohortrl.trainers.setup import Optimised


def minibatch_rows(n_groups: int, group_size: int, epochs: int, minibatches: int) -> Iterator[torch.Tensor]:
    """The rows (whole groups) of each minibatch, epoch after epoch: shuffled groups with more than one
    minibatch, in order otherwise. Lazy: each epoch draws its permutation when it starts."""
    # Resampling can leave fewer groups than minibatches: then one minibatch per group.
    n_minibatches = min(minibatches, n_groups)
    for _ in range(epochs):
        order = torch.randperm(n_groups) if minibatches > 1 else torch.arange(n_groups)
        for groups in order.tensor_split(n_minibatches):
            yield (groups.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten()


@dataclass
class MicroBatch:
    """Rows of the rollout one forward/backward runs on, with their share of the minibatch's aggregate."""

    rows: torch.Tensor  # (b,) positions in this process's rollout
    weights: torch.Tensor  # (b, T) token weights (``algorithms.token_weights``), 0 on padding
    loss_mask: torch.Tensor  # (b, T) response tokens that carry loss
    response_mask: torch.Tensor  # (b, T) response tokens (the metrics' denominator)
    sync: bool  # the last micro-batch before the optimiser step: gradients are all-reduced here (torchrun)
    padding: bool = False  # a zero-weight stand-in that only keeps the ranks' collectives in step


def micro_batches(rows: torch.Tensor, weights_BT: torch.Tensor, loss_mask, response_mask, positions: list[torch.Tensor],
                  device, n_padding: int) -> list[MicroBatch]:
    """A minibatch's ``rows`` (with their token weights) cut at ``positions`` (index lists into ``rows``), then
    ``n_padding`` zero-weight micro-batches on row 0 with empty masks (``Dist.padding_micro_batches``). Weights
    and masks go to ``device``; the rows index the rollout, which stays on the CPU."""
    out = [MicroBatch(rows[pos], weights_BT[pos].to(device), loss_mask[rows[pos]].to(device),
                      response_mask[rows[pos]].to(device), sync=False) for pos in positions]
    empty = torch.tensor([0])
    out += [MicroBatch(empty, torch.zeros(1, loss_mask.shape[1], device=device), torch.zeros_like(loss_mask[empty]).to(device),
                       torch.zeros_like(response_mask[empty]).to(device), sync=False, padding=True) for _ in range(n_padding)]
    out[-1].sync = True
    return out


class PlainForward:
    """log π_θ of a micro-batch's response tokens through the training module, and autograd's backward."""

    replayed = False

    def __init__(self, model, rollout, input_ids, attention_mask, temperature: float, share_prompts: bool):
        self.model, self.rollout, self.temperature, self.share_prompts = model, rollout, temperature, share_prompts
        self.input_ids, self.attention_mask = input_ids, attention_mask  # the rollout's, (B, Tp + T)

    def logprobs(self, rows: torch.Tensor):
        """(log-probs (b, T) with gradient, entropy (b, T))."""
        # Inside the forward DDP or FSDP2 runs (distributed.forward_inside): the LM head in chunks, no (b, T, V) logits.
        return forward_inside(
            self.model, response_logprobs, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            response_ids=self.rollout.response_ids[rows], temperature=self.temperature, with_entropy=True,
            # a group's prompt runs once: two decoder calls, or one where no prompt repeats, which FSDP2's
            # collectives over several ranks cannot follow (each layer's forward gathers its shards)
            share_prompts=self.share_prompts,
        )

    def backward(self, loss: torch.Tensor, logp: torch.Tensor) -> None:
        loss.backward()


class ReplayedForward:
    """The CPU fast path: the log-probs decoding already computed for the whole rollout, differentiated by
    replaying its recorded forward backwards (``cpu/replay.py``). Only for one micro-batch holding every
    row of the rollout, in order, in a single on-policy update (``RLTrainer.rollout_forward_reusable``)."""

    replayed = True

    def __init__(self, replay, rollout, temperature: float):
        self.replay, self.rollout, self.temperature = replay, rollout, temperature

    def logprobs(self, rows: torch.Tensor):
        logp, entropy = self.replay.logprobs(self.rollout.response_ids, self.rollout.response_mask, self.temperature)
        logp.requires_grad_()  # the loss's gradient stops here; ``backward`` carries it on through the replay
        return logp, entropy

    def backward(self, loss: torch.Tensor, logp: torch.Tensor) -> None:
        loss.backward()
        self.replay.backward(logp.grad, self.rollout.response_ids, self.temperature)


def is_whole_rollout(batches: list[MicroBatch], batch_size: int) -> bool:
    """One micro-batch with every row of the rollout, in order: what decoding's recorded forward computed."""
    return len(batches) == 1 and not batches[0].padding and torch.equal(batches[0].rows, torch.arange(batch_size))


def as_float(x) -> float:
    """A scalar tensor (a DTensor under FSDP2) as a Python float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def optimizer_step(trained: list[Optimised], loss: float, max_grad_norm: float | None) -> tuple[bool, dict[str, float]]:
    """Grad-norm clipping, then AdamW and the LR schedule for every trained model, unless the loss or a
    gradient norm is not finite (then neither steps: their state stays exactly as before). ``loss`` is the
    update's loss (summed over ranks under torchrun, so that every rank decides alike). Gradients are freed
    either way. Returns (finite, each model's grad norm by its metric name)."""
    norms = {o.metric: as_float(torch.nn.utils.clip_grad_norm_(o.params, max_grad_norm or float("inf"))) for o in trained}
    finite = guards.finite(loss, norms)
    for o in trained:
        if finite:
            o.optimizer.step()
            o.scheduler.step()
        # Freed once used (as transformers' Trainer does): the next rollout and reference pass run without
        # them (SmolLM2: 540 MB), and lay their buffers out as every later step will.
        o.optimizer.zero_grad(set_to_none=True)
    return finite, norms
