"""The training step GRPO and PPO share (``RLTrainer.step``), read top to bottom:

1. rollout: sample P prompts and generate G responses each (``sampler.Sampler.sample``);
2. rewards: score every response with the weighted reward functions; count zero-variance groups (all G equally
   correct) and keep / filter / resample them; step rewards when ``reward.process`` is set;
3. log-probs of the reference model (β > 0) and of the policy that sampled (when the algorithm needs them);
4. advantages — the algorithm's part (``_targets``): GRPO's group baseline, or PPO's critic values, KL in
   the reward and GAE;
5. loss and update (``_update``): μ epochs over minibatches of whole groups, the clipped surrogate plus the
   algorithm's extra per-token loss (``_extra_loss``: GRPO's β·KL, PPO's value loss), aggregated by the
   configured mode through token weights so gradient accumulation over micro-batches is exact; grad-norm
   clipping, AdamW and LR schedule for every trained model (the policy, and PPO's critic);
6. the step's metrics (``metrics.step_metrics``).

The update is the plain single-process loop; torchrun's row sharing and padding sit behind ``distributed.Dist``
and the CPU fast path's replayed backward behind ``update.ReplayedForward`` (``update.py``). The run around
the steps (train loop, evaluation, checkpoints, resume) is ``loop.Trainer``, shared with SFT.

An algorithm is a subclass that fills in ``_targets`` and ``_extra_loss`` (and, if it trains more than the
policy, registers it in ``self.optimised`` and saves it via ``_algorithm_state``). Nothing else differs.

Departures from the papers, on purpose: log-probs are computed from logits divided by the sampling
temperature (the distribution actually sampled from, as TRL does); a zero-variance group is detected on the
correctness signal, not on the shaped total reward (a shaped total hides all-wrong groups).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cohortrl import distributed
from cohortrl.algorithms import get_policy_loss, masked_mean, token_weights, truncated_importance_weights
from cohortrl.config import Config
from cohortrl.data import PromptStream, load_rows
from cohortrl.rewards import grader_errors
from cohortrl.rewards.process import build_step_source
from cohortrl.rewards.scoring import TrainerState, WeightedReward, check_columns, resolve
from cohortrl.rollout.engine import build_engine
from cohortrl.rollout.hf import micro_batched_logprobs
from cohortrl.rollout.tools import toolset
from cohortrl.rollout.types import Rollout
from cohortrl.trainers import faults, guards
from cohortrl.trainers.evaluate import evaluate_config
from cohortrl.trainers.inputs import from_trl_order, resolve_inputs
from cohortrl.trainers.loop import Trainer, _check_distributed, _release_run_dir_on_failure, config_hash
from cohortrl.trainers.metrics import MetricsLog, PhaseTimer, UpdateTotals, log_grader_errors, step_metrics
from cohortrl.trainers.run_dir import claim as claim_run_dir
from cohortrl.trainers.sampler import Sampler, ScoredBatch, reward_pool
from cohortrl.trainers.setup import (
    Optimised, Reference, allocate_optimizer_state, build_fast_path, build_optimizer, build_policy, build_scheduler,
    fast_kernels, load_configured_model,
)
from cohortrl.trainers.trace import StepTrace
from cohortrl.trainers.update import (
    PlainForward, ReplayedForward, is_whole_rollout, micro_batches, minibatch_rows, optimizer_step,
)

log = logging.getLogger("cohortrl")


@dataclass
class Targets:
    """What the update regresses onto, fixed for the whole step: the algorithm's output of step 4."""

    advantages: torch.Tensor  # (B, T) advantage per response token, 0 on padding
    old_logp: torch.Tensor | None  # (B, T) log π_old (the sampling policy); None: on-policy, ratio 1
    ref_logp: torch.Tensor | None  # (B, T) log π_ref; None when β = 0
    old_values: torch.Tensor | None = None  # (B, T) PPO: the critic's values at rollout time
    returns: torch.Tensor | None = None  # (B, T) PPO: GAE returns, the critic's regression target
    metrics: dict = field(default_factory=dict)  # the algorithm's numbers for the step's log row
    is_weights: torch.Tensor | None = None  # (B, T) truncated importance weights for a vLLM sampler; None: 1
    # intermediate tensors of the algorithm's step 4 that only a trace reads (``trace.py``), e.g. PPO's
    # KL-penalised token rewards; the update never looks here
    detail: dict[str, torch.Tensor] = field(default_factory=dict)


class RLTrainer(Trainer):
    """The shared step; subclasses (``GRPOTrainer``, ``PPOTrainer``) supply the algorithm."""

    name = "rl"
    # The update may differentiate decoding's own forward (train.reuse_rollout_forward): the algorithm's loss
    # reaches the policy only through the log-probs of the sampled tokens under the sampling policy.
    reuses_rollout_forward = False
    # The temperature of the log-probs the update trains on; None: the sampling temperature (the distribution
    # actually sampled from). RFT's supervised loss sets 1.
    loss_temperature: float | None = None

    @_release_run_dir_on_failure
    def __init__(
        self,
        config: Config | dict | str | Path | None = None,
        run_dir: str | Path | None = None,
        *,
        model=None,
        tokenizer=None,
        reward_funcs=None,
        reward_weights=None,
        train_dataset=None,
        eval_dataset=None,
        callbacks=(),
        tools=None,
        resume: bool = False,
        strict: bool = False,
        overwrite: bool = False,
        args=None,
        peft_config=None,
    ):
        """``config``: a ``Config``, a dict of sections, a YAML path, or None (defaults). ``run_dir``: where
        metrics, checkpoints and the final model go (default ``runs/<algorithm>-<time>``). ``model``: a model
        spec (overrides ``model.name``) or a loaded model, then with its ``tokenizer``. ``reward_funcs``:
        functions ``fn(prompts, completions, **columns)`` or reward names (replace ``reward.functions``;
        the first is the correctness signal unless ``reward.correctness`` names one of them), weighted by
        ``reward_weights``. ``train_dataset``: a list of dicts (or prompt strings), a ``datasets.Dataset``,
        a ``.jsonl`` path or a gym task name; ``eval_dataset``: held-out rows (default: held out from the
        training source, ``data.eval_size``). ``callbacks``: see ``cohortrl.trainers.callbacks``. ``tools``:
        functions (or tool names) the model may call mid-response (replace ``rollout.tools``; docs/tools.md).
        ``resume``: continue the run in ``run_dir`` from its newest intact checkpoint (``strict``: refuse,
        rather than fall back, when the newest one is damaged). ``overwrite``: ``run_dir`` may hold another run,
        whose files are deleted first (without it, or ``resume``, such a directory is refused). TRL's spellings:
        ``args``, a ``cohortrl.GRPOConfig`` (TRL's fields and defaults; its ``output_dir`` is ``run_dir``) or a
        dict of the TRL field names a script set, over the config (``docs/trl_migration.md``); ``peft_config``,
        a PEFT ``LoraConfig``, as ``model.lora``; and TRL's order, ``GRPOTrainer(model, reward_funcs, args=...)``,
        told from ``(config, run_dir)`` by the arguments' types (``inputs.from_trl_order``)."""
        config, run_dir, model, reward_funcs = from_trl_order(config, run_dir, model, reward_funcs, "reward_funcs")
        inputs = resolve_inputs(
            config, self.name, model=model, tokenizer=tokenizer, reward_funcs=reward_funcs,
            reward_weights=reward_weights, train_dataset=train_dataset, eval_dataset=eval_dataset, tools=tools,
            args=args, peft_config=peft_config, run_dir=run_dir,
        )
        self.cfg = inputs.config
        self._start_run(inputs.run_dir, resume, overwrite)
        n_train_rows = self._build_rewards_and_data(inputs)
        self._build_models(inputs, n_train_rows)
        # the CPU fast path (cpu/), built once and handed to generation, every step and evaluation; None when off
        self.fast_path = build_fast_path(self.cfg.train, self.device, self.model)
        self.kernel_models = self._kernel_models()  # whose linear layers it computes during a step
        # before the reward workers and the vLLM engine start: a refused prompt leaves no process behind
        guards.check_prompts_fit(self.cfg, self.tokenizer, self.tools,
                                 {"training prompt": self.stream.rows, "held-out prompt": self.eval_rows})
        self._build_rollout(inputs)
        self.step_count = 0
        self.grader_log = MetricsLog(self.run_dir, grader_errors.FILE)  # built-in graders' failures (a bug report)
        grader_errors.drain()  # failures from before this run (each logged when it happened) are not this run's
        self.guard = guards.NonfiniteGuard(self.run_dir, self.cfg.train.max_nonfinite_steps, self.dist.rank)
        self.config_hash = config_hash(self.cfg.to_dict())  # in every checkpoint's manifest
        self.strict = strict
        self._open_run(self._run_claim.resumes, callbacks, logs=(self.grader_log,))
        if self._run_claim.resumes:  # the vLLM engine was built from the initial weights, before the checkpoint's were loaded
            self.sampler.policy_updated()

    def _start_run(self, run_dir, resume: bool, overwrite: bool) -> None:
        """The run directory, the process (torchrun or not), the device and the seeds, before anything loads."""
        cfg = self.cfg
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        # Refused if it holds another run, locked against a second process, removed if this start fails (run_dir.py);
        # rank 0 of a torchrun job claims it for all ranks.
        self._run_claim = claim_run_dir(self.run_dir, resume=resume, overwrite=overwrite,
                                        main=os.environ.get("RANK", "0") == "0")
        self.policy_loss = get_policy_loss(cfg.algorithm.policy_loss)  # names already checked by config.validate
        self.dist = distributed.from_env(cfg.train.strategy, cfg.train.dist_timeout_s)  # the single-process identity unless started by torchrun
        self.device = distributed.resolve_device(cfg.train.device, self.dist)
        if self.dist.launched:
            _check_distributed(cfg, self.name, self.dist)
        self._seed_process(self._run_claim.resumes)  # False when a resume finds no checkpoint: the run starts

    def _build_rewards_and_data(self, inputs) -> int:
        """The weighted reward functions, the tools, the prompt stream and the held-out rows; returns the number
        of training prompts."""
        cfg = self.cfg
        self.rewards = [
            WeightedReward(f.name, inputs.reward_fns.get(f.name) or resolve(f.name, f.kwargs), f.weight, cfg.reward.timeout_s)
            for f in cfg.reward.functions
        ]
        self.correctness = next(r for r in self.rewards if r.name == cfg.reward.correctness)
        self.tools = toolset(cfg.rollout, inputs.tools)  # None without tools; resolved before the model loads
        train_rows, eval_rows = load_rows(cfg.data, cfg.train.seed, inputs.train_rows, inputs.eval_rows)
        self.stream = PromptStream(train_rows, cfg.train.seed)
        self.eval_rows = eval_rows[: cfg.eval.n_prompts]
        check_columns({r.name: r.fn for r in self.rewards}, train_rows, "training rows")  # before the model loads
        check_columns({self.correctness.name: self.correctness.fn}, self.eval_rows, "held-out rows")
        return len(train_rows)

    def _build_models(self, inputs, n_train_rows: int) -> None:
        """The policy (with LoRA if enabled), the algorithm's own models, the reference, the data-parallel
        wrappers, and an optimiser and LR schedule for each trained model (``self.optimised``)."""
        cfg, a = self.cfg, self.cfg.algorithm
        model, tokenizer = inputs.model, inputs.tokenizer
        if model is None:
            # FSDP2 over several processes: rank 0 loads, the others build on the meta device (Dist.load)
            model, tokenizer = self.dist.load(lambda: load_configured_model(cfg.model, cfg.train.seed))
        self.optimised: dict[str, Optimised] = {}
        self.policy_frozen_steps = 0  # steps at the start that leave the policy unchanged (PPO critic warm-up)
        self._init_algorithm(model)  # before LoRA is attached: a critic copies the plain initial weights
        self.model, self.tokenizer = build_policy(cfg.model, cfg.train.seed, model, tokenizer,
                                                  activation_checkpointing=cfg.train.activation_checkpointing)
        if not self.dist.sharded:  # FSDP2: wrap puts each rank's shards there, never the whole model
            self.model.to(self.device)
        guards.check_run_fits(cfg, self.model, n_train_rows)
        self.reference = Reference(self.model, cfg.model.lora.enabled, frozen_copy=not self.dist.sharded) if a.beta > 0 else None
        dtype = next(self.model.parameters()).dtype  # the reference's, before FSDP2 keeps trainable shards in float32
        # Under torchrun: DDP around the policy, or FSDP2 sharding it in place.
        self.train_model = self.dist.wrap(self.model, self.device)
        if self.reference is not None and not self.reference.lora and self.dist.sharded:
            self.reference.model = distributed.sharded_frozen_copy(self.model, dtype)  # shard by shard, never whole
        # π_ref's own frozen weights; None with LoRA (the policy with its adapter off) or at β = 0 (no KL term)
        self.reference_copy = self.reference.model if self.reference is not None else None
        if self.dist.launched:  # what this rank holds shows whether the strategy asked for is the one that ran
            held = {"policy": distributed.held_elements(self.model)}
            if self.reference_copy is not None:
                held["reference"] = distributed.held_elements(self.reference_copy)
            log.info("rank %d of %d (%s): %s", self.dist.rank, self.dist.world, self.dist.strategy,
                     ", ".join(f"{name} {h} of {t} parameter elements" for name, (h, t) in held.items()))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.updates_per_step = a.epochs * a.minibatches
        policy_updates = max(0, cfg.train.steps - self.policy_frozen_steps) * self.updates_per_step
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, policy_updates)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimised = {"policy": Optimised("grad_norm", params, self.optimizer, self.scheduler), **self.optimised}
        for o in self.optimised.values():  # AdamW's moments now, before the first rollout (a resume overwrites them)
            allocate_optimizer_state(o.optimizer)

    def _build_rollout(self, inputs) -> None:
        """What the step samples and scores with besides the policy: the reward workers, the process reward,
        the rollout engine; and the settings the step reads."""
        cfg = self.cfg
        self.sampling = cfg.sampling
        p = cfg.reward.process
        self.process = None if p is None else build_step_source(  # the implicit PRM starts from the initial policy
            p.name, p.kwargs, timeout_s=cfg.reward.timeout_s, policy=self.model, tokenizer=self.tokenizer,
            reference=self.reference_copy, rows=self.stream.rows,
        )
        # what samples the responses (sampling.backend): transformers with the tools and the fast path, or vLLM
        self.engine = build_engine(cfg, self.model, self.tokenizer, tools=self.tools, fast_path=self.fast_path)
        self.sampler = Sampler(cfg, self.dist, self.model, self.tokenizer, self.stream, self.engine, self.rewards,
                               self.correctness, pool=reward_pool(cfg, inputs.reward_fns), process=self.process)
        self._dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()) or bool(
            getattr(getattr(self.model, "config", None), "attention_dropout", 0))
        self.norm_length = self.cfg.algorithm.norm_length or cfg.sampling.max_new_tokens
        self.rollout_forward_reusable = self._reuse_rollout_forward()  # a property of the run: decided once

    def close(self) -> None:
        """Stop the reward workers (if any), then let the run go (``Trainer.close``: the fast path's allocator
        too)."""
        self.sampler.close()
        super().close()

    @property
    def trainer_state(self) -> TrainerState:
        """What reward functions get as ``trainer_state`` (TRL's argument): steps done and the run's total."""
        return self.sampler.trainer_state(self.step_count)

    # ------------------------------------------------------------------------------------------ the algorithm
    def _init_algorithm(self, model) -> None:
        """Build what the algorithm holds besides the policy (``model`` is the policy before LoRA)."""

    def _needs_old_logp(self) -> bool:
        """Whether step 3 computes log π_old; without it the update is on-policy (ratio 1). A vLLM sampler
        needs it for the importance weights (its own log-probs come from other numerics)."""
        a = self.cfg.algorithm
        return a.epochs > 1 or a.minibatches > 1 or self.engine.own_numerics

    def _targets(self, batch: ScoredBatch, rewards_B, loss_mask, ref_logp, old_logp, timer: PhaseTimer) -> Targets:
        """Step 4: advantages (and whatever else the update regresses onto) for the scored batch."""
        raise NotImplementedError

    def _extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """The per-token loss added to the clipped surrogate on ``rows`` (``loss_mask`` is theirs, (b, T)):
        (loss (b, T) or None, metrics), where metrics maps a name to a (b, T) tensor averaged over response
        tokens for the log. ``logp`` (b, T) carries the policy's gradient; it is None while the policy is
        frozen."""
        raise NotImplementedError

    def _algorithm_state(self) -> dict:
        """Extra checkpoint entries (e.g. PPO's critic and KL coefficient)."""
        return {}

    def _load_algorithm_state(self, state: dict) -> None:
        pass

    def _synced_modules(self, train_policy: bool) -> list:
        """The data-parallel modules whose gradients this update's backward produces (the algorithm may add
        its own, e.g. PPO's critic)."""
        return [self.train_model] if train_policy else []

    def _kernel_models(self) -> list:
        """The models a step runs forward passes of, whose linear layers the CPU fast path's kernel computes
        (the algorithm may add its own, e.g. PPO's critic)."""
        return [self.model, self.reference_copy]

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One training step: rollout → rewards → advantages → loss → update. Returns its metrics."""
        with fast_kernels(self.fast_path, *self.kernel_models):  # the CPU fast path's kernel, for this step only
            timer, started = PhaseTimer(), time.perf_counter()
            trace = self._start_trace()  # None unless this step is in train.trace_steps

            # 1-2. rollout and rewards (with step rewards under reward.process)
            batch = self.sampler.sample(self.step_count, timer, record=self.rollout_forward_reusable)
            rollout, rewards_B = batch.rollout, torch.tensor(batch.rewards)
            keep_B = self._rows_to_train(batch)
            loss_mask = rollout.response_mask * keep_B.unsqueeze(-1)

            # 3. reference and old-policy log-probs, with the same micro-batches as the update
            with timer("reference"), torch.no_grad():
                ref_logp = self._reference_logprobs(rollout) if self.reference is not None else None
                old_logp = self._logprobs(self.model, rollout) if self._needs_old_logp() else None

            # 4. advantages: where the algorithms differ
            targets = self._targets(batch, rewards_B, loss_mask, ref_logp, old_logp, timer)
            if rollout.sampling_logp is not None:  # sampled by vLLM: correct for its numerics
                self._add_importance_weights(targets, rollout, old_logp)
            if trace is not None:
                trace.scored(batch, rewards_B, keep_B, loss_mask, targets)

            # 5. loss and update: μ epochs over minibatches of whole groups
            with timer("train"):
                update_metrics = self._update(rollout, loss_mask, targets, timer, trace)
            self.guard.after_step(self.step_count + 1, update_metrics, batch)  # saves skipped steps' samples; may stop the run

            # 6. metrics, over the whole batch (every rank's rows, under torchrun)
            errors = log_grader_errors(self.dist, self.grader_log, self.step_count + 1)  # built-in graders that raised
            if trace is not None:
                trace.save(self.run_dir)
            return step_metrics(self.dist, batch, rewards_B, keep_B, targets, update_metrics,
                                group_size=self.cfg.algorithm.group_size, correctness=self.correctness.name,
                                lr=self.scheduler.get_last_lr()[0], timer=timer, started=started, grader_errors=errors)

    def _start_trace(self) -> StepTrace | None:
        """The recording of this step when ``train.trace_steps`` names it (under torchrun rank 0 records its own
        rows), else None: nothing of ``trace.py`` runs."""
        if self.step_count + 1 not in self.cfg.train.trace_steps or not self.dist.is_main:
            return None
        return StepTrace(self.step_count + 1, self.cfg, self.tokenizer, self.name, {r.name: r.weight for r in self.rewards})

    def _reuse_rollout_forward(self) -> bool:
        """Whether the run's updates can differentiate decoding's forward (``train.reuse_rollout_forward``):
        each rollout is exactly the batch of a single on-policy update, and decoding computes what training
        would, on the run's fast path's lean decoder. Then ``generate`` records it; the update uses the recording
        only while the policy trains."""
        a = self.cfg.algorithm
        if self.fast_path is None or self.fast_path.decoder_for(self.model) is None:  # nothing would record it
            return False
        return (self.cfg.train.reuse_rollout_forward and self.reuses_rollout_forward and not self._needs_old_logp()
                and a.epochs == 1 and a.minibatches == 1 and self.dist.world == 1
                and (a.micro_batch_size == 0 or a.micro_batch_size >= a.prompts_per_step * a.group_size)
                and a.zero_variance != "resample" and self.sampler.pool is None  # a batch joined from parts drops the recording
                and not self._dropout)

    def _rows_to_train(self, batch: ScoredBatch) -> torch.Tensor:
        """(B,) bool: the responses the loss keeps after the zero-variance and truncation settings."""
        a = self.cfg.algorithm
        keep_B = torch.ones(batch.rollout.batch_size, dtype=torch.bool)
        if a.zero_variance == "filter":
            keep_B &= ~batch.zero_variance.repeat_interleave(a.group_size)
        if a.mask_truncated:
            keep_B &= ~batch.rollout.truncated
        return keep_B

    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """log π_ref of the response tokens (B, T)."""
        with self.reference() as ref_model:
            if rollout.replay is not None and rollout.replay.can_score(ref_model):
                # the CPU fast path: on decoding's recorded rows, every product over all of them at once (cpu/replay.py)
                return rollout.replay.logprobs_under(ref_model, rollout.response_ids, rollout.response_mask)
            return self._logprobs(ref_model, rollout)

    def _add_importance_weights(self, targets: Targets, rollout: Rollout, old_logp: torch.Tensor) -> None:
        """vLLM sampled the batch: truncated importance weights w_t = min(π_old / π_vLLM, C) per token correct
        the policy loss for the engine's other numerics."""
        targets.is_weights = truncated_importance_weights(old_logp, rollout.sampling_logp, rollout.response_mask, self.sampling.is_cap)
        targets.metrics["is_weight_mean"] = masked_mean(targets.is_weights, rollout.response_mask).item()

    # ------------------------------------------------------------------------------------------ 3. log-probs
    def _micro_batches(self, n: int) -> list[torch.Tensor]:
        """Positions 0..n-1 split into micro-batches of ``algorithm.micro_batch_size`` (0: one batch)."""
        return list(torch.arange(n).split(self.cfg.algorithm.micro_batch_size or n))

    def _logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """log π of the rollout's response tokens under ``model`` (B, T), in the update's micro-batches."""
        return distributed.forward_inside(  # under FSDP2 inside one root forward: the LM head in chunks
            model, micro_batched_logprobs, input_ids=rollout.input_ids(), attention_mask=rollout.attention_mask(),
            response_ids=rollout.response_ids, micro_batches=self._micro_batches(rollout.batch_size),
            temperature=self.sampling.temperature)

    # ------------------------------------------------------------------------------------------ 5. loss, update
    def _update(self, rollout: Rollout, loss_mask, targets: Targets, timer: PhaseTimer, trace: StepTrace | None = None) -> dict:
        """μ epochs over minibatches of whole groups; in each, every micro-batch's loss is accumulated into the
        gradients, then one optimiser step per trained model. Returns the update's metrics. ``trace``: this
        step's recording, or None."""
        a, d = self.cfg.algorithm, self.dist
        # Token weights come from the whole batch's loss mask (every rank's rows under torchrun), so an
        # aggregation over the batch (token-mean) divides by the global token count.
        loss_mask_all = d.gather_rows(loss_mask)
        n_groups = loss_mask_all.shape[0] // a.group_size
        train_policy = self.step_count >= self.policy_frozen_steps
        trained = [o for name, o in self.optimised.items() if name != "policy" or train_policy]
        inputs = rollout.input_ids(), rollout.attention_mask()
        temperature = self.loss_temperature or self.sampling.temperature
        plain = PlainForward(self.train_model, rollout, *inputs, temperature, share_prompts=not d.sharded or d.world == 1)
        totals = UpdateTotals()
        for rows_all in minibatch_rows(n_groups, a.group_size, a.epochs, a.minibatches):
            weights_all = token_weights(loss_mask_all[rows_all], a.aggregation, self.norm_length)
            # torchrun: this rank's rows of the minibatch, and zero-weight micro-batches that keep ranks in step
            rows, weights_BT = d.local_share(rows_all, weights_all, n_groups, a.group_size, loss_mask.shape[1])
            positions = self._micro_batches(len(rows)) if len(rows) else []
            batches = micro_batches(rows, weights_BT, loss_mask, rollout.response_mask, positions, self.device,
                                    n_padding=d.padding_micro_batches(len(positions)))
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
                with d.no_sync(self._synced_modules(train_policy), mb.sync):
                    loss = self._micro_batch_loss(mb, forward if train_policy else None, inputs, targets, totals, trace)
                totals.add_loss(mb, loss)
                update_loss += loss
            totals.replayed += int(forward.replayed)
            with timer("optimizer"):  # part of the "train" phase: clipping and the AdamW step
                faults.point("update")
                # No optimiser or scheduler step on a non-finite update; every rank decides alike.
                finite, norms = optimizer_step(trained, d.sum({"loss": update_loss})["loss"], self.cfg.optim.max_grad_norm)
                totals.add_update(finite, norms)
            if finite and train_policy:
                self.sampler.policy_updated()
        rollout.replay = None  # used up (or unused): free decoding's activations
        return totals.result(d, int(loss_mask_all.sum()) * a.epochs, [o.metric for o in trained], train_policy)

    def _micro_batch_loss(self, mb, forward, inputs, targets: Targets, totals: UpdateTotals, trace=None) -> float:
        """Σ w·L over micro-batch ``mb``, backpropagated: the clipped surrogate on the log-probs ``forward``
        computes (None while the policy is frozen: no surrogate) plus the algorithm's extra loss. ``inputs``: the
        rollout's (input ids, attention mask). Returns the loss's value."""
        a, dev = self.cfg.algorithm, self.device
        logp, old, loss_BT = None, None, torch.zeros(mb.loss_mask.shape, device=dev)
        if forward is not None:
            logp, entropy = forward.logprobs(mb.rows)
            old = targets.old_logp[mb.rows].to(dev) if targets.old_logp is not None else logp.detach()
            loss_BT, pg_metrics = self.policy_loss(
                logp=logp, old_logp=old, advantages=targets.advantages[mb.rows].to(dev), response_mask=mb.loss_mask,
                clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
            )
            if targets.is_weights is not None:  # vLLM sampled: w_t = min(π_old / π_vLLM, C) per token
                loss_BT = loss_BT * targets.is_weights[mb.rows].to(dev)
            totals.add_policy(mb, loss_BT, entropy, pg_metrics)
        policy_BT = loss_BT
        extra_BT, extra_metrics = self._extra_loss(mb.rows, mb.loss_mask, logp, *inputs, targets)
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

    # ------------------------------------------------------------------------------------------ the run (loop.Trainer)
    def _progress_postfix(self, metrics: dict) -> dict:
        return {"reward": f"{metrics['reward_mean']:.3f}", "acc": f"{metrics['accuracy']:.2f}", "kl": f"{metrics['kl']:.4f}"}

    def evaluate(self, responses: list | None = None) -> dict:
        """Held-out accuracy; under torchrun rank 0 evaluates and every rank gets its numbers. ``responses``
        (rank 0) receives each greedy response (``evaluate.evaluate``)."""
        # FSDP2: rank 0 runs forward passes the others do not
        with self.dist.gathered(self.model), fast_kernels(self.fast_path, self.model):
            metrics = evaluate_config(self.model, self.tokenizer, self.eval_rows, self.correctness, self.cfg,
                                      self.trainer_state, tools=self.tools, responses=responses,
                                      fast_path=self.fast_path) if self.dist.is_main else None
        return self.dist.broadcast(metrics)

    def _eval_metrics(self, responses: list) -> dict:
        metrics = self.evaluate(responses)
        return {**metrics, "eval/grader_errors": log_grader_errors(self.dist, self.grader_log, self.step_count)}

    def _extra_state(self) -> dict:
        return {"guard": self.guard.state_dict(), "process": self.process.state_dict() if self.process is not None else {},
                **self._algorithm_state()}

    def _load_extra_state(self, state: dict) -> None:
        self.guard.load_state_dict(state.get("guard", {}))  # absent in checkpoints written before the guard
        if self.process is not None:
            self.process.load_state_dict(state.get("process", {}))
        self._load_algorithm_state(state)
