"""The RL step, one function read top to bottom (``rl_step``): sample → score → targets → update → log.

1-2. sample and score: P prompts with G responses each from the run's rollout engine, scored by the weighted
     reward functions, zero-variance groups kept, filtered or resampled, step rewards under ``reward.process``
     (``sampler.Sampler.sample``, one call; the batch it returns is never changed after);
3.   log-probs of the reference (β > 0) and of the sampling policy (when the run needs them);
4.   targets, where the algorithms differ: the run's algorithm object (``algorithm.py``; GRPO's group
     advantages, PPO's critic and GAE, RFT's zero advantages) returns what the update regresses onto;
5.   update: μ epochs over minibatches of whole groups; each micro-batch's loss (the clipped surrogate plus the
     algorithm's ``extra_loss``) is weighted by the configured aggregation, so that accumulating micro-batches
     is exact; then one optimiser step for every trained model (``setup.optimizer_step``);
6.   log: the step's metrics row (``metrics.step_metrics``).

Under torchrun a rank's share of each minibatch is one call (``distributed.Dist.micro_batch_share``); the CPU
fast path's replayed backward is ``ReplayedForward`` in place of ``PlainForward``. Building the run is
``rl.RLTrainer``; the run around the steps (loop, evaluation, checkpoints) is ``loop.Trainer``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from cohortrl import distributed
from cohortrl.algorithms import masked_mean, token_weights, truncated_importance_weights
from cohortrl.rollout.hf import micro_batched_logprobs, response_logprobs
from cohortrl.trainers import faults
from cohortrl.trainers.algorithm import Targets
from cohortrl.trainers.metrics import PhaseTimer, UpdateTotals, log_grader_errors, step_metrics
from cohortrl.trainers.setup import fast_kernels, optimizer_step
from cohortrl.trainers.trace import StepTrace


def rl_step(t) -> dict:
    """One training step of the RL trainer ``t`` (``rl.RLTrainer``) with its algorithm ``t.algorithm``; returns
    the step's metrics."""
    a, algo = t.cfg.algorithm, t.algorithm
    with fast_kernels(t.fast_path, *t.kernel_models):  # the CPU fast path's kernel, for this step only
        timer, started = PhaseTimer(), time.perf_counter()
        trace = start_trace(t)  # None unless this step is in train.trace_steps

        # 1-2. sample and score (with step rewards under reward.process)
        batch = t.sampler.sample(t.step_count, timer, record=t.rollout_forward_reusable)
        rollout, rewards_B = batch.rollout, torch.tensor(batch.rewards)
        keep_B = rows_to_train(batch, a, algo.keep(batch))
        loss_mask = rollout.response_mask * keep_B.unsqueeze(-1)

        # 3. reference and old-policy log-probs, with the same micro-batches as the update
        with timer("reference"), torch.no_grad():
            ref_logp = reference_logprobs(t.reference, rollout, a.micro_batch_size, t.sampling.temperature)
            old_logp = logprobs(t.model, rollout, a.micro_batch_size, t.sampling.temperature) if t.needs_old_logp else None

        # 4. targets: where the algorithms differ
        targets = algo.targets(batch, rewards_B, loss_mask, ref_logp, old_logp, timer)
        if rollout.sampling_logp is not None and algo.corrects_sampler:  # sampled by other numerics (vLLM, bf16 decoding)
            targets = with_importance_weights(targets, rollout, old_logp, t.sampling.is_cap)
        if trace is not None:
            trace.scored(batch, rewards_B, keep_B, loss_mask, targets)

        # 5. loss and update: μ epochs over minibatches of whole groups
        with timer("train"):
            update_metrics = update(t, rollout, loss_mask, targets, timer, trace)
        t.guard.after_step(t.step_count + 1, update_metrics, batch)  # saves skipped steps' samples; may stop the run

        # 6. log: the metrics over the whole batch (every rank's rows, under torchrun)
        errors = log_grader_errors(t.dist, t.grader_log, t.step_count + 1)  # built-in graders that raised
        if trace is not None:
            trace.save(t.run_dir)
        return step_metrics(t.dist, batch, rewards_B, keep_B, targets, update_metrics, group_size=a.group_size,
                            correctness=t.correctness.name, lr=t.scheduler.get_last_lr()[0], timer=timer,
                            started=started, grader_errors=errors, levels=t.cfg.data.levels)


def start_trace(t) -> StepTrace | None:
    """The recording of this step when ``train.trace_steps`` names it (under torchrun rank 0 records its own
    rows), else None: nothing of ``trace.py`` runs."""
    if t.step_count + 1 not in t.cfg.train.trace_steps or not t.dist.is_main:
        return None
    return StepTrace(t.step_count + 1, t.cfg, t.tokenizer, t.name, {r.name: r.weight for r in t.rewards})


def rows_to_train(batch, a, kept_by_algorithm: torch.Tensor | None) -> torch.Tensor:
    """(B,) bool: the responses the loss keeps after the zero-variance and truncation settings (``a``: the
    ``algorithm`` section) and the algorithm's own rule (None: none)."""
    keep_B = torch.ones(batch.rollout.batch_size, dtype=torch.bool)
    if a.zero_variance == "filter":
        keep_B &= ~batch.zero_variance.repeat_interleave(a.group_size)
    if a.mask_truncated:
        keep_B &= ~batch.rollout.truncated
    return keep_B if kept_by_algorithm is None else keep_B & kept_by_algorithm


# ---------------------------------------------------------------------------------------------- 3. log-probs
def logprobs(model, rollout, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """log π of the rollout's response tokens under ``model`` (B, T), in the update's micro-batches."""
    return distributed.forward_inside(  # under FSDP2 inside one root forward: the LM head in chunks
        model, micro_batched_logprobs, input_ids=rollout.input_ids(), attention_mask=rollout.attention_mask(),
        response_ids=rollout.response_ids, micro_batches=distributed.micro_batch_positions(rollout.batch_size, micro_batch_size),
        temperature=temperature)


def reference_logprobs(reference, rollout, micro_batch_size: int, temperature: float) -> torch.Tensor | None:
    """log π_ref of the response tokens (B, T); None without a reference (β = 0)."""
    if reference is None:
        return None
    with reference() as ref_model:
        if rollout.replay is not None and rollout.replay.can_score(ref_model):
            # the CPU fast path: on decoding's recorded rows, every product over all of them at once (cpu/replay.py)
            return rollout.replay.logprobs_under(ref_model, rollout.response_ids, rollout.response_mask)
        return logprobs(ref_model, rollout, micro_batch_size, temperature)


def with_importance_weights(targets: Targets, rollout, old_logp: torch.Tensor, cap: float) -> Targets:
    """vLLM or the lean decoder's bf16 products sampled the batch: the targets with truncated importance weights
    w_t = min(π_old / π_sampler, C) per token, which correct the policy loss for the sampler's other numerics."""
    w = truncated_importance_weights(old_logp, rollout.sampling_logp, rollout.response_mask, cap)
    metrics = {**targets.metrics, "is_weight_mean": masked_mean(w, rollout.response_mask).item()}
    return dataclasses.replace(targets, is_weights=w, metrics=metrics)


# ---------------------------------------------------------------------------------------------- 5. update
def update(t, rollout, loss_mask, targets: Targets, timer: PhaseTimer, trace: StepTrace | None) -> dict:
    """μ epochs over minibatches of whole groups; in each, every micro-batch's loss is accumulated into the
    gradients, then one optimiser step per trained model. Returns the update's metrics."""
    a, d, algo = t.cfg.algorithm, t.dist, t.algorithm
    # Token weights come from the whole batch's loss mask (every rank's rows under torchrun), so an
    # aggregation over the batch (token-mean) divides by the global token count.
    loss_mask_all = d.gather_rows(loss_mask)
    n_groups = loss_mask_all.shape[0] // a.group_size
    train_policy = not algo.policy_frozen(t.step_count)
    trained = [o for name, o in t.optimised.items() if name != "policy" or train_policy]
    synced = [t.train_model, *algo.synced()] if train_policy else algo.synced()  # whose gradients the backward makes
    inputs = rollout.input_ids(), rollout.attention_mask()
    temperature = algo.loss_temperature or t.sampling.temperature
    plain = PlainForward(t.train_model, rollout, *inputs, temperature, share_prompts=not d.sharded or d.world == 1)
    totals = UpdateTotals()
    for rows_all in minibatch_rows(n_groups, a.group_size, a.epochs, a.minibatches):
        weights_all = token_weights(loss_mask_all[rows_all], a.aggregation, t.norm_length)
        # torchrun: this rank's rows of the minibatch, and zero-weight micro-batches that keep ranks in step
        rows, weights_BT, positions, n_padding = d.micro_batch_share(rows_all, weights_all, n_groups, a.group_size,
                                                                      loss_mask.shape[1], a.micro_batch_size)
        batches = micro_batches(rows, weights_BT, loss_mask, rollout.response_mask, positions, t.device, n_padding)
        # the CPU fast path: one on-policy update on every row of the rollout is what decoding computed
        replay = train_policy and a.epochs == 1 and rollout.replay is not None and is_whole_rollout(batches, rollout.batch_size)
        forward = ReplayedForward(rollout.replay, rollout, temperature) if replay else plain
        for o in trained:
            o.optimizer.zero_grad(set_to_none=True)
        update_loss = 0.0
        if trace is not None:
            trace.begin_update()
        for mb in batches:
            # DDP / FSDP2 sync gradients on the last micro-batch only; the forwards belong inside too.
            with d.no_sync(synced, mb.sync):
                loss = micro_batch_loss(t, mb, forward if train_policy else None, inputs, targets, totals, trace)
            totals.add_loss(mb, loss)
            update_loss += loss
        totals.replayed += int(forward.replayed)
        with timer("optimizer"):  # part of the "train" phase: clipping and the AdamW step
            faults.point("update")
            # No optimiser or scheduler step on a non-finite update; every rank decides alike.
            finite, norms = optimizer_step(trained, d.sum({"loss": update_loss})["loss"], t.cfg.optim.max_grad_norm)
            totals.add_update(finite, norms)
        if finite and train_policy:
            t.sampler.policy_updated()
    return totals.result(d, int(loss_mask_all.sum()) * a.epochs, [o.metric for o in trained], train_policy)


def micro_batch_loss(t, mb, forward, inputs, targets: Targets, totals: UpdateTotals, trace=None) -> float:
    """Σ w·L over micro-batch ``mb``, backpropagated: the clipped surrogate on the log-probs ``forward``
    computes (None while the policy is frozen: no surrogate) plus the algorithm's extra loss. ``inputs``: the
    rollout's (input ids, attention mask). Returns the loss's value."""
    a, dev = t.cfg.algorithm, t.device
    logp, old, loss_BT = None, None, torch.zeros(mb.loss_mask.shape, device=dev)
    if forward is not None:
        logp, entropy = forward.logprobs(mb.rows)
        old = targets.old_logp[mb.rows].to(dev) if targets.old_logp is not None else logp.detach()
        loss_BT, pg_metrics = t.policy_loss(
            logp=logp, old_logp=old, advantages=targets.advantages[mb.rows].to(dev), response_mask=mb.loss_mask,
            clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
        )
        if targets.is_weights is not None:  # other numerics sampled: w_t = min(π_old / π_sampler, C) per token
            loss_BT = loss_BT * targets.is_weights[mb.rows].to(dev)
        totals.add_policy(mb, loss_BT, entropy, pg_metrics)
    policy_BT = loss_BT
    extra_BT, extra_metrics = t.algorithm.extra_loss(mb.rows, mb.loss_mask, logp, *inputs, targets)
    if extra_BT is not None:
        loss_BT = loss_BT + extra_BT
    totals.add_extra(mb, extra_metrics)
    contribution_BT = torch.where(mb.weights != 0, mb.weights * loss_BT, 0.0)
    loss = contribution_BT.sum()
    if trace is not None:
        trace.micro_batch(mb, logp, old, targets.advantages[mb.rows], policy_BT, extra_BT, extra_metrics, contribution_BT)
    if forward is None:  # the policy is frozen: only the algorithm's own model (PPO's critic) learns
        loss.backward()
    else:
        forward.backward(loss, logp)
    return loss.item()


def minibatch_rows(n_groups: int, group_size: int, epochs: int, minibatches: int) -> Iterator[torch.Tensor]:
    """The rows (whole groups) of each minibatch, epoch after epoch: shuffled groups with more than one
    minibatch, in order otherwise. Lazy: each epoch draws its permutation when it starts."""
    n_minibatches = min(minibatches, n_groups)  # resampling can leave fewer groups than minibatches
    for _ in range(epochs):
        order = torch.randperm(n_groups) if minibatches > 1 else torch.arange(n_groups)
        for groups in order.tensor_split(n_minibatches):
            yield (groups.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten()


@dataclass(frozen=True)
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
    last, empty = len(positions) + n_padding - 1, torch.tensor([0])
    out = [MicroBatch(rows[pos], weights_BT[pos].to(device), loss_mask[rows[pos]].to(device),
                      response_mask[rows[pos]].to(device), sync=i == last) for i, pos in enumerate(positions)]
    return out + [MicroBatch(empty, torch.zeros(1, loss_mask.shape[1], device=device), torch.zeros_like(loss_mask[empty]).to(device),
                             torch.zeros_like(response_mask[empty]).to(device), sync=len(out) + i == last, padding=True)
                  for i in range(n_padding)]


class PlainForward:
    """log π_θ of a micro-batch's response tokens through the training module, and autograd's backward."""

    replayed = False

    def __init__(self, model, rollout, input_ids, attention_mask, temperature: float, share_prompts: bool):
        self.model, self.rollout, self.temperature, self.share_prompts = model, rollout, temperature, share_prompts
        self.input_ids, self.attention_mask = input_ids, attention_mask  # the rollout's, (B, Tp + T)

    def logprobs(self, rows: torch.Tensor):
        """(log-probs (b, T) with gradient, entropy (b, T))."""
        # Inside the forward DDP or FSDP2 runs (distributed.forward_inside): the LM head in chunks, no (b, T, V) logits.
        return distributed.forward_inside(
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
    replaying its recorded forward backwards (``cpu/replay.py``). Only for one micro-batch holding every row of
    the rollout, in order, in a single on-policy update (``RLTrainer.rollout_forward_reusable``)."""

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
