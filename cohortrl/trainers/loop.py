"""The training step GRPO and PPO share, and everything around it (train loop, evaluation, checkpoints).

One step, top to bottom (``RLTrainer.step``):

1. sample P prompts and generate G responses each;
2. score every response with the weighted reward functions; count zero-variance groups (all G equally
   correct) and keep / filter / resample them;
3. log-probs of the reference model (β > 0) and of the policy that sampled (when the algorithm needs them);
4. advantages — the algorithm's part (``_targets``): GRPO's group baseline, or PPO's critic values, KL in
   the reward and GAE;
5. μ epochs over minibatches of whole groups: the clipped surrogate plus the algorithm's extra per-token
   loss (``_extra_loss``: GRPO's β·KL, PPO's value loss), aggregated by the configured mode through
   ``token_weights`` so gradient accumulation over micro-batches is exact; grad-norm clipping, AdamW and
   LR schedule for every trained model (the policy, and PPO's critic);
6. log the step.

An algorithm is a subclass that fills in ``_targets`` and ``_extra_loss`` (and, if it trains more than the
policy, registers it in ``self.optimised`` and saves it via ``_algorithm_state``). Nothing else differs.

Departures from the papers, on purpose: log-probs are computed from logits divided by the sampling
temperature (the distribution actually sampled from, as TRL does); a zero-variance group is detected on the
correctness signal, not on the shaped total reward (a shaped total hides all-wrong groups).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from cohortrl import distributed
from cohortrl.algorithms import aggregate, get_policy_loss, masked_mean, truncated_importance_weights
from cohortrl.config import Config, ConfigError
from cohortrl.cpu_memory import apply_cpu_allocator, resolve_cpu_allocator
from cohortrl.data import PromptStream, load_rows
from cohortrl.kernels import linear_kernels, resolve_cpu_linear
from cohortrl.models import load_model
from cohortrl.rewards import grader_errors
from cohortrl.rewards.process import build_step_source, guard_steps, step_detectors
from cohortrl.rewards.scoring import RewardFunctionError, TrainerState, WeightedReward, resolve
from cohortrl.rewards.steps import step_end_tokens, token_char_ends
from cohortrl.rollout.hf import generate, response_logprobs
from cohortrl.rollout.tools import tool_metrics, toolset
from cohortrl.rollout.types import Rollout
from cohortrl.trainers import checkpoint, faults, guards
from cohortrl.trainers.callbacks import TensorBoardCallback, WandbCallback
from cohortrl.trainers.evaluate import EVAL_RESPONSES, evaluate_config, rollout_columns, score_rollout
from cohortrl.trainers.inputs import resolve_inputs
from cohortrl.trainers.metrics import MetricsLog, PhaseTimer, peak_rss_mb, plot_curves
from cohortrl.trainers.run_dir import claim as claim_run_dir
from cohortrl.trainers.setup import Reference, allocate_optimizer_state, build_optimizer, build_policy, build_scheduler

log = logging.getLogger("cohortrl")

# Settings that may change between a run and its resume without changing what the run computes.
RESUMABLE_CHANGES = {
    "train.steps", "train.progress", "train.checkpoint_every", "train.tensorboard", "train.wandb",
    "train.max_nonfinite_steps", "train.cpu_allocator", "train.reuse_rollout_forward", "train.keep_checkpoints",
    "reward.timeout_s",
}
# Written into RUN_DIR/final/ with the step it was saved at: a resume can tell a finished run from one
# killed between its last checkpoint and its final save.
FINAL_MARKER = "cohortrl_run.json"


class RunStateError(RuntimeError):
    """The run directory's state does not allow what was asked (e.g. resuming a finished run)."""


class RunCompleteError(RunStateError):
    """Resume of a run that has done all its steps and saved an intact final/: nothing to do. The CLI exits 0
    on it, so a wrapper that repeats ``train --resume`` until it succeeds stops."""


@dataclass
class ScoredBatch:
    rollout: Rollout
    rewards: list[float]  # (B,) weighted total reward
    per_fn: dict[str, list[float | None]]  # each reward function's values, (B,) each
    zero_variance: torch.Tensor  # (P,) bool: all G responses of the group equally correct
    zero_variance_first_draw: float  # fraction of zero-variance groups in the step's first draw
    draws: int  # prompt batches generated this step (1 unless resampling)
    prompts_truncated: int = 0  # prompts cut to data.max_prompt_tokens (overlong_prompts=truncate), all draws
    step_rewards: list[list[float]] | None = None  # (B, S_i) guarded step rewards (reward.process), else None
    step_ends: list[list[int]] | None = None  # (B, S_i) response-token index where each step ends


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


@dataclass
class Optimised:
    """A model the update trains: its parameters, optimiser and LR schedule; ``metric`` names its grad norm."""

    metric: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def token_weights(response_mask: torch.Tensor, mode: str, norm_length: int | None) -> torch.Tensor:
    """w_{i,t} = ∂ aggregate(L) / ∂ L_{i,t}. Aggregation is linear in L, so Σ w·L over any split of the rows
    into micro-batches equals ``aggregate`` over the whole minibatch: gradient accumulation stays exact for
    every mode without the trainer knowing which mode it is."""
    probe = torch.zeros(response_mask.shape, requires_grad=True)
    (w,) = torch.autograd.grad(aggregate(probe, response_mask, mode, norm_length), probe)
    return w


def _release_run_dir_on_failure(init):
    """Wraps a trainer's ``__init__``: a start that fails lets the run directory's lock go and removes the
    directory if the start created it (``run_dir.RunDirectory.release``)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            claim = self.__dict__.get("_run_claim")
            if claim is not None:
                claim.release(failed=True)
            raise

    return wrapper


class RLTrainer:
    """The shared step; subclasses (``GRPOTrainer``, ``PPOTrainer``) supply the algorithm."""

    name = "rl"
    # The update may differentiate decoding's own forward (train.reuse_rollout_forward): the algorithm's loss
    # reaches the policy only through the log-probs of the sampled tokens under the sampling policy.
    reuses_rollout_forward = False

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
        args: dict | None = None,
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
        ``args``, a dict of TRL ``GRPOConfig`` field names, over the config (``docs/trl_migration.md``);
        ``peft_config``, a PEFT ``LoraConfig``, as ``model.lora``."""
        inputs = resolve_inputs(
            config, self.name, model=model, tokenizer=tokenizer, reward_funcs=reward_funcs,
            reward_weights=reward_weights, train_dataset=train_dataset, eval_dataset=eval_dataset, tools=tools,
            args=args, peft_config=peft_config,
        )
        cfg = self.cfg = inputs.config
        a = cfg.algorithm
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        # Refused if it holds another run, locked against a second process, removed if this start fails (run_dir.py);
        # rank 0 of a torchrun job claims it for all ranks.
        self._run_claim = claim_run_dir(self.run_dir, resume=resume, overwrite=overwrite,
                                        main=os.environ.get("RANK", "0") == "0")
        self.policy_loss = get_policy_loss(a.policy_loss)  # names already checked by config.validate
        self.dist = distributed.from_env(cfg.train.strategy)  # the single-process identity unless started by torchrun
        self.device = distributed.resolve_device(cfg.train.device, self.dist)
        self.cpu_linear = resolve_cpu_linear(cfg.train.cpu_linear, self.device)  # the kernel every step and evaluation use
        apply_cpu_allocator(resolve_cpu_allocator(cfg.train.cpu_allocator, self.device))  # process-wide, before the first step
        if self.dist.launched:
            _check_distributed(cfg, self.name, self.dist)
        if resume:
            self._check_resume_config()
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)

        self.rewards = [
            WeightedReward(f.name, inputs.reward_fns.get(f.name) or resolve(f.name, f.kwargs), f.weight, cfg.reward.timeout_s)
            for f in cfg.reward.functions
        ]
        self.correctness = next(r for r in self.rewards if r.name == cfg.reward.correctness)
        self.tools = toolset(cfg.rollout, inputs.tools)  # None without tools; resolved before the model loads
        train_rows, eval_rows = load_rows(cfg.data, cfg.train.seed, inputs.train_rows, inputs.eval_rows)
        self.stream = PromptStream(train_rows, cfg.train.seed)
        self.eval_rows = eval_rows[: cfg.eval.n_prompts]

        model, tokenizer = inputs.model, inputs.tokenizer
        if model is None:
            model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype, seed=cfg.train.seed, init=cfg.model.init)
        self.optimised: dict[str, Optimised] = {}
        self.policy_frozen_steps = 0  # steps at the start that leave the policy unchanged (PPO critic warm-up)
        self._init_algorithm(model)  # before LoRA is attached: a critic copies the plain initial weights
        self.model, self.tokenizer = build_policy(cfg.model, cfg.train.seed, model, tokenizer)
        self.model.to(self.device)
        guards.check_run_fits(cfg, self.model, len(train_rows))
        self.reference = Reference(self.model, cfg.model.lora.enabled) if a.beta > 0 else None
        # Under torchrun: DDP around the policy, or FSDP2 sharding it in place (and the reference's own copy).
        self.train_model = self.dist.wrap(self.model)
        if self.dist.sharded and self.reference is not None and self.reference.model is not None:
            distributed.shard(self.reference.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.updates_per_step = a.epochs * a.minibatches
        policy_updates = max(0, cfg.train.steps - self.policy_frozen_steps) * self.updates_per_step
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, policy_updates)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimised = {"policy": Optimised("grad_norm", params, self.optimizer, self.scheduler), **self.optimised}
        for o in self.optimised.values():  # AdamW's moments now, before the first rollout (a resume overwrites them)
            allocate_optimizer_state(o.optimizer)
        self.sampling = cfg.sampling
        self.pool = self._reward_pool(inputs.reward_fns)
        p = cfg.reward.process
        self.process = None if p is None else build_step_source(  # the implicit PRM starts from the initial policy
            p.name, p.kwargs, timeout_s=cfg.reward.timeout_s, policy=self.model, tokenizer=self.tokenizer,
            reference=self.reference.model if self.reference is not None else None,
        )
        self.generator = None  # the vLLM engine, when sampling.backend is vllm
        if cfg.sampling.backend == "vllm":
            from cohortrl.rollout.vllm import VLLMGenerator

            self.generator = VLLMGenerator(self.model, self.tokenizer, gpu_memory_utilization=cfg.sampling.vllm_gpu_memory_utilization,
                                           seed=cfg.train.seed)
        self._engine_stale = False  # the policy changed since the engine last got its weights
        self._dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()) or bool(
            getattr(getattr(self.model, "config", None), "attention_dropout", 0))
        self.norm_length = a.norm_length or cfg.sampling.max_new_tokens
        self.step_count = 0
        self.log = MetricsLog(self.run_dir)
        self.grader_log = MetricsLog(self.run_dir, grader_errors.FILE)  # built-in graders' failures (a bug report)
        self.eval_log = MetricsLog(self.run_dir, EVAL_RESPONSES)
        grader_errors.drain()  # failures from before this run (each logged when it happened) are not this run's
        self.callbacks = [*self._config_loggers(), *callbacks]
        self.stop_reason: str | None = None
        self.guard = guards.NonfiniteGuard(self.run_dir, cfg.train.max_nonfinite_steps, self.dist.rank)
        self.config_hash = config_hash(cfg.to_dict())  # in every checkpoint's manifest
        self.strict = strict
        if resume:
            self._load_latest_checkpoint()
        elif self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
            self.log.truncate_after(-1)
            self.grader_log.truncate_after(-1)
            self.eval_log.truncate_after(-1)

    @classmethod
    def resume(cls, run_dir: str | Path, config=None, **inputs) -> "RLTrainer":
        """The run in ``run_dir``, ready to continue from its last checkpoint (``config`` defaults to the run's
        own ``config.yaml``; objects a file cannot hold, such as reward callables or rows, are passed again)."""
        return cls(config if config is not None else Path(run_dir) / "config.yaml", run_dir, resume=True, **inputs)

    def close(self) -> None:
        """Stop the reward workers (if any) and, under torchrun, leave the process group (after every rank got
        here: a rank that exits while another still talks to it aborts the run)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._run_claim.release()
        self.dist.barrier()
        self.dist.close()

    @property
    def trainer_state(self) -> TrainerState:
        """What reward functions get as ``trainer_state`` (TRL's argument): steps done and the run's total."""
        return TrainerState(global_step=self.step_count, max_steps=self.cfg.train.steps)

    def stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step (from a callback); it checkpoints before returning."""
        self.stop_reason = reason

    def _config_loggers(self) -> list:
        loggers = []
        if not self.dist.is_main:  # one copy of the numbers, from rank 0 (they are global already)
            return loggers
        if self.cfg.train.tensorboard:
            loggers.append(TensorBoardCallback(self.run_dir / "tensorboard"))
        if self.cfg.train.wandb:
            loggers.append(WandbCallback(self.cfg.to_dict(), self.run_dir))
        return loggers

    def _fire(self, event: str, *args) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(self, *args)

    # ------------------------------------------------------------------------------------------ the algorithm
    def _init_algorithm(self, model) -> None:
        """Build what the algorithm holds besides the policy (``model`` is the policy before LoRA)."""

    def _needs_old_logp(self) -> bool:
        """Whether step 3 computes log π_old; without it the update is on-policy (ratio 1). A vLLM sampler
        needs it for the importance weights (its own log-probs come from other numerics)."""
        a = self.cfg.algorithm
        return a.epochs > 1 or a.minibatches > 1 or self.generator is not None

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

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One training step: sample, score, reference log-probs, advantages, update. Returns its metrics."""
        with linear_kernels(self.cpu_linear):
            return self._step()

    def _step(self) -> dict:
        a, G = self.cfg.algorithm, self.cfg.algorithm.group_size
        timer = PhaseTimer()
        t0 = time.perf_counter()

        # 1-2. sample and score
        batch = self._sample_and_score(timer)
        rollout = batch.rollout
        response_mask = rollout.response_mask
        rewards_B = torch.tensor(batch.rewards)
        step_metrics = {}
        if self.process is not None:  # step-level rewards, mapped onto the tokens that end each step
            with timer("score_steps"):
                step_metrics = self._score_steps(batch)

        # Rows dropped from the loss by the zero-variance and truncation settings.
        keep_B = torch.ones(rollout.batch_size, dtype=torch.bool)
        if a.zero_variance == "filter":
            keep_B &= ~batch.zero_variance.repeat_interleave(G)
        if a.mask_truncated:
            keep_B &= ~rollout.truncated
        loss_mask = response_mask * keep_B.unsqueeze(-1)

        # 3. reference and old-policy log-probs, with the same micro-batches as the update
        input_ids, attention_mask = rollout.input_ids(), rollout.attention_mask()
        with timer("reference"), torch.no_grad():
            ref_logp = old_logp = None
            if self.reference is not None:
                with self.reference() as ref_model:
                    if rollout.replay is not None and rollout.replay.can_score(ref_model):
                        # on decoding's recorded rows, every product over all of them at once (rollout/replay.py)
                        ref_logp = rollout.replay.logprobs_under(ref_model, rollout.response_ids, rollout.response_mask)
                    else:
                        ref_logp = self._logprobs(ref_model, input_ids, attention_mask, rollout.response_ids)
            if self._needs_old_logp():
                old_logp = self._logprobs(self.model, input_ids, attention_mask, rollout.response_ids)

        # 4. advantages: where the algorithms differ
        targets = self._targets(batch, rewards_B, loss_mask, ref_logp, old_logp, timer)
        if rollout.sampling_logp is not None:  # sampled by vLLM: correct for its numerics (truncated IS)
            targets.is_weights = truncated_importance_weights(old_logp, rollout.sampling_logp, response_mask, self.sampling.is_cap)
            targets.metrics["is_weight_mean"] = masked_mean(targets.is_weights, response_mask).item()

        # 5. μ epochs over minibatches of whole groups
        with timer("train"):
            stats = self._update(rollout, input_ids, attention_mask, loss_mask, targets, timer)
        self.guard.after_step(self.step_count + 1, stats, batch)  # saves skipped steps' samples; may stop the run

        # 6. metrics, over the whole batch (every rank's rows, under torchrun)
        d = self.dist
        rewards_all = d.gather_rows(rewards_B)
        per_fn = {k: d.gather_list(v) for k, v in batch.per_fn.items()}
        zero_variance = d.gather_rows(batch.zero_variance.long())
        lengths = d.gather_rows(rollout.lengths).float()
        counts = d.sum({
            "tokens": float(response_mask.sum()), "kept": float(keep_B.sum()), "truncated": float(rollout.truncated.sum()),
            "prompts_truncated": float(batch.prompts_truncated),
            "advantage_abs": _masked_total(targets.advantages.abs(), response_mask),
        })
        elapsed = time.perf_counter() - t0
        return {
            "reward_mean": rewards_all.mean().item(),
            "reward_std": rewards_all.std().item() if len(rewards_all) > 1 else 0.0,
            **{f"reward/{k}_mean": _mean(v) for k, v in per_fn.items()},
            **{f"reward/{k}_std": _std(v) for k, v in per_fn.items()},
            "accuracy": _mean(per_fn[self.correctness.name]),
            # A group of one response has no variance to speak of (PPO with G = 1): None, not a misleading 1.
            "zero_variance_frac": batch.zero_variance_first_draw if G > 1 else None,
            "zero_variance_groups": int(zero_variance.sum()) if G > 1 else None,
            "resample_draws": batch.draws - 1,
            "prompts_truncated": int(counts["prompts_truncated"]),
            "trained_responses": int(counts["kept"]),
            "advantage_abs_mean": counts["advantage_abs"] / max(1.0, counts["tokens"]),
            **targets.metrics,
            **step_metrics,
            "response_length_mean": lengths.mean().item(),
            # Split by outcome (correct at >= 1, as evaluation counts it): the length biases of per-sequence
            # normalisation (Dr. GRPO, arXiv 2503.20783) show as incorrect responses growing longer.
            **_lengths_by_outcome(lengths, per_fn[self.correctness.name]),
            "response_length_max": lengths.max().item(),
            "truncation_rate": counts["truncated"] / len(lengths),
            **tool_metrics(rollout, d.sum),
            **stats,
            "lr": self.scheduler.get_last_lr()[0],
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            "time/step": elapsed,
            "tokens_per_s": counts["tokens"] / elapsed,
            "peak_rss_mb": peak_rss_mb(),
            "grader_errors": self._log_grader_errors(self.step_count + 1),  # built-in graders that raised: scored 0
        }

    def _sample_and_score(self, timer: PhaseTimer) -> ScoredBatch:
        """Generate and score P groups; with ``resample``, draw more prompt batches (at most
        ``max_resample_draws`` extra) until P informative groups are found (DAPO dynamic sampling).

        Each rank generates and scores its share of each draw's groups (one process: all of them). Under
        torchrun each group is seeded by its global index (``distributed.group_seed``), so sampling does not
        depend on the number of processes; informative groups are chosen over the whole batch in draw order,
        then dealt out again so that every rank trains on an equal share."""
        a, d = self.cfg.algorithm, self.dist
        P, G = a.prompts_per_step, a.group_size
        local = d.local_groups(P)
        draws: list[tuple[ScoredBatch, torch.Tensor]] = []  # this rank's groups, and every group's zero-variance flag

        def first_draw_only() -> ScoredBatch:  # nothing informative to train on: the first draw, where only KL acts
            return dataclasses.replace(draws[0][0], draws=len(draws), prompts_truncated=sum(b.prompts_truncated for b, _ in draws))

        while True:
            rows = self.stream.take(P)
            faults.point("generate")
            k = len(draws)
            group_ids = range(k * P + local.start, k * P + local.stop) if d.launched else None  # one process: batched
            rollout, rewards, per_fn, n_trunc = self._rollout_and_score([rows[g] for g in local], timer, group_ids)
            correct_PG = torch.tensor([v or 0.0 for v in per_fn[self.correctness.name]]).view(-1, G)
            zero_local = (correct_PG == correct_PG[:, :1]).all(-1)
            zero_all = d.gather_rows(zero_local.long()).bool()
            first_frac = zero_all.float().mean().item() if k == 0 else draws[0][0].zero_variance_first_draw
            draws.append((ScoredBatch(rollout, rewards, per_fn, zero_local, first_frac, k + 1, n_trunc), zero_all))
            if a.zero_variance != "resample":
                return draws[0][0]
            informative = sum(int((~z).sum()) for _, z in draws)
            if informative >= P:
                break
            if len(draws) > a.max_resample_draws:
                log.warning(
                    "resample: only %d informative group(s) of %d after %d extra draws (algorithm.max_resample_draws); "
                    "training on what there is", informative, P, a.max_resample_draws,
                )
                if informative == 0:
                    return first_draw_only()
                break
        chosen = [(k, g) for k, (_, z) in enumerate(draws) for g in range(P) if not z[g]][:P]
        if len(chosen) % d.world:
            log.warning("resample: %d informative group(s) do not split over %d processes; the last %d are not trained on",
                        len(chosen), d.world, len(chosen) % d.world)
            chosen = chosen[: len(chosen) - len(chosen) % d.world]
            if not chosen:
                return first_draw_only()
        mine = []  # the chosen groups this rank generated
        for k, g in chosen:
            if g in local:
                part, idx = draws[k][0], list(range((g - local.start) * G, (g - local.start + 1) * G))
                mine.append(((k, g), part.rollout.select(idx), [part.rewards[i] for i in idx],
                             {name: [v[i] for i in idx] for name, v in part.per_fn.items()}))
        everything = sorted(d.gather_list(mine), key=lambda item: item[0])  # every chosen group, in draw order
        mine_now = d.local_groups(len(everything))
        share = everything[mine_now.start : mine_now.stop]
        rollout = Rollout.concat([r for _, r, _, _ in share], self.tokenizer.pad_token_id)
        rewards = [x for _, _, rs, _ in share for x in rs]
        per_fn = {name: [x for _, _, _, fn in share for x in fn[name]] for name in draws[0][0].per_fn}
        return ScoredBatch(rollout, rewards, per_fn, torch.zeros(len(share), dtype=torch.bool), draws[0][0].zero_variance_first_draw,
                           len(draws), sum(b.prompts_truncated for b, _ in draws))

    def _rollout_and_score(self, rows: list[dict], timer: PhaseTimer, group_ids: range | None = None):
        """G responses for each row, scored: (rollout, total rewards, each function's values, prompts truncated).

        The rows are generated in chunks: one chunk normally; one per group under torchrun (``group_ids``),
        each sampled under its own seed (``distributed.group_seed``) so what a group samples does not depend on
        the number of processes; two halves with a reward pool, whose scoring of the first then runs while the
        second is generated."""
        cfg = self.cfg
        if group_ids is not None:
            chunks = [([row], distributed.group_seed(cfg.train.seed, self.step_count, g)) for row, g in zip(rows, group_ids)]
        elif self.pool is not None and len(rows) > 1:
            half = (len(rows) + 1) // 2
            chunks = [(rows[:half], None), (rows[half:], None)]
        else:
            chunks = [(rows, None)]
        if self.generator is not None and self._engine_stale:
            with timer("weight_sync"):
                self.generator.sync_weights(self.model)
            self._engine_stale = False
        parts, jobs = [], []
        with self.dist.gathered(self.model):  # FSDP2: ranks run different numbers of decoding steps
            for chunk, seed in chunks:
                with timer("generate"), torch.random.fork_rng(devices=[], enabled=seed is not None):
                    if seed is not None:
                        torch.manual_seed(seed)
                    rollout, n_trunc = self._generate(chunk, seed)
                parts.append((rollout, n_trunc))
                if self.pool is not None:
                    cols = rollout_columns(rollout, self.sampling.max_new_tokens, self.trainer_state)
                    jobs.append(self.pool.submit([r["prompt"] for r in rollout.rows], rollout.completions, cols))
        n_truncated = sum(n for _, n in parts)
        parts = [r for r, _ in parts]
        if n_truncated:
            log.warning("%d prompt(s) truncated to data.max_prompt_tokens=%d", n_truncated, cfg.data.max_prompt_tokens)
        rollout = parts[0] if len(parts) == 1 else Rollout.concat(parts, self.tokenizer.pad_token_id)
        with timer("score"):
            computed = None
            if jobs:
                results = [self.pool.result(job) for job in jobs]
                computed = {name: [v for res in results for v in res[name]] for name in results[0]}
            rewards, per_fn = score_rollout(self.rewards, rollout, self.sampling.max_new_tokens, computed, self.trainer_state)
        return rollout, rewards, per_fn, n_truncated

    def _score_steps(self, batch: ScoredBatch) -> dict:
        """Fill ``batch.step_rewards`` / ``step_ends`` from the process reward function (guarded, see
        ``rewards/process.py``) and return the step detectors' metrics (over the whole batch)."""
        p, rollout = self.cfg.reward.process, batch.rollout
        prompts = [r["prompt"] for r in rollout.rows]
        cols = rollout_columns(rollout, self.sampling.max_new_tokens, self.trainer_state)
        raw = self.process.score(rollout, cols)
        if not isinstance(raw, (list, tuple)) or len(raw) != rollout.batch_size:
            raise RewardFunctionError(
                f"process reward '{p.name}' must return one list of (score, span) per completion "
                f"({rollout.batch_size}), got {type(raw).__name__}" + (f" of {len(raw)}" if hasattr(raw, "__len__") else "")
            )
        step_rewards, step_ends = [], []
        for i, (completion, steps) in enumerate(zip(rollout.completions, raw)):
            for score, span in steps:
                if not isinstance(score, (int, float)) or not math.isfinite(score):
                    raise RewardFunctionError(
                        f"process reward '{p.name}' returned step score {score!r} for sample {i} "
                        f"(prompt: {prompts[i][:200]!r}); step scores must be finite numbers"
                    )
            guarded = guard_steps(completion, steps, cap=p.cap, max_steps=p.max_steps, require_answer=p.require_answer)
            ids = rollout.response_ids[i][rollout.sequence_mask[i].bool()].tolist()  # every token of the text
            char_ends = token_char_ends(self.tokenizer, ids)
            stated = iter(step_end_tokens([span for _, span in guarded if span is not None], char_ends))
            last = max(0, len(ids) - 1)  # a required step never stated counts on the last token
            step_rewards.append([score for score, _ in guarded])
            step_ends.append([next(stated) if span is not None else last for _, span in guarded])
        batch.step_rewards, batch.step_ends = step_rewards, step_ends
        learned = self.process.update(rollout, batch.per_fn[self.correctness.name])  # a PRM that learns online
        d = self.dist
        return {**step_detectors(
            d.gather_list(rollout.completions), d.gather_list(step_rewards),
            d.gather_list(batch.per_fn[self.correctness.name]), p.coef,
        ), **learned}

    def _generate(self, rows: list[dict], seed: int | None):
        cfg = self.cfg
        kw = dict(system_prompt=cfg.model.system_prompt, max_prompt_tokens=cfg.data.max_prompt_tokens,
                  overlong_prompts=cfg.data.overlong_prompts)
        if self.generator is not None:
            return self.generator.generate(rows, cfg.algorithm.group_size, self.sampling, seed=seed, **kw)
        return generate(self.model, self.tokenizer, rows, cfg.algorithm.group_size, self.sampling,
                        record=self._reuse_rollout_forward(), tools=self.tools, **kw)

    def _reuse_rollout_forward(self) -> bool:
        """Whether this step's update can differentiate decoding's forward (``train.reuse_rollout_forward``):
        the rollout is exactly the batch of a single on-policy update, and decoding computes what training
        would. Then ``generate`` records it (where the lean decoder runs)."""
        a = self.cfg.algorithm
        return (self.cfg.train.reuse_rollout_forward and self.reuses_rollout_forward and not self._needs_old_logp()
                and a.epochs == 1 and a.minibatches == 1 and self.dist.world == 1
                and (a.micro_batch_size == 0 or a.micro_batch_size >= a.prompts_per_step * a.group_size)
                and a.zero_variance != "resample" and self.pool is None  # a batch joined from parts drops the recording
                and self.step_count >= self.policy_frozen_steps and not self._dropout)

    def _reward_pool(self, in_memory: dict):
        """Worker processes for the reward functions that can be loaded by name (``reward.workers`` > 0)."""
        if not self.cfg.reward.workers:
            return None
        from cohortrl.rewards.pool import RewardPool

        specs = [(f.name, f.kwargs) for f in self.cfg.reward.functions if f.name not in in_memory]
        if not specs:
            return None
        return RewardPool(specs, self.cfg.reward.workers, self.cfg.reward.timeout_s)

    def _synced_modules(self, train_policy: bool) -> list:
        """The data-parallel modules whose gradients this update's backward produces (the algorithm may add
        its own, e.g. PPO's critic)."""
        return [self.train_model] if train_policy else []

    def _micro_batches(self, n: int) -> list[torch.Tensor]:
        """Positions 0..n-1 split into micro-batches of ``algorithm.micro_batch_size`` (0: one batch)."""
        return list(torch.arange(n).split(self.cfg.algorithm.micro_batch_size or n))

    def _logprobs(self, model, input_ids, attention_mask, response_ids) -> torch.Tensor:
        parts = []
        for idx in self._micro_batches(len(input_ids)):
            logp, _ = response_logprobs(
                model, input_ids[idx], attention_mask[idx], response_ids[idx], temperature=self.sampling.temperature
            )
            parts.append(logp.cpu())  # the batch and its targets live on the CPU; micro-batches move to the device
        return torch.cat(parts)

    def _update(self, rollout, input_ids, attention_mask, loss_mask, targets: Targets, timer: PhaseTimer) -> dict:
        a, d = self.cfg.algorithm, self.dist
        # Token weights come from the whole batch's loss mask (every rank's rows under torchrun), so an
        # aggregation over the batch (token-mean) divides by the global token count.
        loss_mask_all = d.gather_rows(loss_mask)
        G, n_groups = a.group_size, loss_mask_all.shape[0] // a.group_size
        first_row, T = d.local_groups(n_groups).start * G, loss_mask.shape[1]  # this rank's rows, first_row + 0 … b − 1
        train_policy = self.step_count >= self.policy_frozen_steps
        trained = [o for name, o in self.optimised.items() if name != "policy" or train_policy]
        sums = {"policy_loss": 0.0, "loss": 0.0, "entropy": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0}
        token_sums: dict[str, float] = defaultdict(float)  # the algorithm's per-token metrics
        grad_norms: dict[str, list[float]] = defaultdict(list)
        n_updates, token_count, skipped, replayed = 0, 0, 0, 0
        # Resampling can leave fewer groups than minibatches: then one minibatch per group.
        n_minibatches = min(a.minibatches, n_groups)
        for _ in range(a.epochs):
            order = torch.randperm(n_groups) if a.minibatches > 1 else torch.arange(n_groups)
            for mb_groups in order.tensor_split(n_minibatches):
                rows_all = (mb_groups.unsqueeze(-1) * G + torch.arange(G)).flatten()
                weights_all = token_weights(loss_mask_all[rows_all], a.aggregation, self.norm_length)
                mine = (rows_all >= first_row) & (rows_all < first_row + rollout.batch_size)
                rows = rows_all[mine] - first_row
                # DDP averages gradients over ranks; each rank's weights are its share of the global sum.
                weights_BT = weights_all[mine][:, :T] * d.world
                for o in trained:
                    o.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
                # A rank with no rows in this minibatch still joins the gradient all-reduce, with a zero-weight row.
                micro_batches = self._micro_batches(len(rows)) if len(rows) else [None]
                # FSDP2 gathers each layer in every forward: all ranks must run as many micro-batches.
                micro_batches += [None] * (d.max_int(len(micro_batches)) - len(micro_batches)) if d.sharded else []
                # one update on every row of the rollout, in order: what decoding computed (train.reuse_rollout_forward)
                single = (a.epochs == 1 and len(micro_batches) == 1 and micro_batches[0] is not None
                          and torch.equal(rows, torch.arange(rollout.batch_size)))
                for i, pos in enumerate(micro_batches):
                    if pos is None:
                        micro, w = torch.tensor([0]), torch.zeros(1, T)
                    else:
                        micro, w = rows[pos], weights_BT[pos]
                    sync = i == len(micro_batches) - 1  # DDP all-reduces on the last micro-batch only
                    mask, response_mask = loss_mask[micro], rollout.response_mask[micro]
                    if pos is None:
                        mask, response_mask = torch.zeros_like(mask), torch.zeros_like(response_mask)
                    dev = self.device  # a no-op on the CPU
                    mask, response_mask, w = mask.to(dev), response_mask.to(dev), w.to(dev)
                    # DDP / FSDP2 sync gradients on the last micro-batch only; the forwards belong inside too.
                    with d.no_sync(self._synced_modules(train_policy), sync):
                        logp, loss_BT = None, torch.zeros(mask.shape, device=dev)
                        # decoding's recorded forward, when this micro-batch is the whole rollout (rollout/replay.py)
                        replay = rollout.replay if train_policy and single and pos is not None else None
                        if replay is not None:
                            logp, entropy = replay.logprobs(rollout.response_ids, rollout.response_mask, self.sampling.temperature)
                            logp.requires_grad_()  # the loss's gradient stops here; replay.backward goes on
                        elif train_policy:
                            logp, entropy = response_logprobs(
                                self.train_model, input_ids[micro], attention_mask[micro], rollout.response_ids[micro],
                                temperature=self.sampling.temperature, with_entropy=True,
                                # a group's prompt runs once (two forward calls; DDP takes one per backward)
                                share_prompts=d.world == 1,
                            )
                        if train_policy:
                            old = targets.old_logp[micro].to(dev) if targets.old_logp is not None else logp.detach()
                            loss_BT, pg_metrics = self.policy_loss(
                                logp=logp, old_logp=old, advantages=targets.advantages[micro].to(dev), response_mask=mask,
                                clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                            )
                            if targets.is_weights is not None:  # vLLM sampled: w_t = min(π_old / π_vLLM, C) per token
                                loss_BT = loss_BT * targets.is_weights[micro].to(dev)
                            sums["policy_loss"] += torch.where(w != 0, w * loss_BT.detach(), 0.0).sum().item()
                            sums["entropy"] += _masked_total(entropy, response_mask)
                            sums["clip_frac_low"] += pg_metrics["clip_frac_low"] * int(mask.sum())
                            sums["clip_frac_high"] += pg_metrics["clip_frac_high"] * int(mask.sum())
                        extra_BT, extra_metrics = self._extra_loss(micro, mask, logp, input_ids, attention_mask, targets)
                        if extra_BT is not None:
                            loss_BT = loss_BT + extra_BT
                        for name, value_BT in extra_metrics.items():
                            token_sums[name] += _masked_total(value_BT.detach(), response_mask)
                        loss = torch.where(w != 0, w * loss_BT, 0.0).sum()
                        loss.backward()
                        if replay is not None:
                            replay.backward(logp.grad, rollout.response_ids, self.sampling.temperature)
                            replayed += 1
                    sums["loss"] += loss.item()
                    mb_loss += loss.item()
                    token_count += int(response_mask.sum())
                with timer("optimizer"):  # part of the "train" phase: clipping and the AdamW step
                    max_norm = self.cfg.optim.max_grad_norm or float("inf")
                    norms = {o.metric: _as_float(torch.nn.utils.clip_grad_norm_(o.params, max_norm)) for o in trained}
                    faults.point("update")
                    n_updates += 1
                    # No optimiser or scheduler step on a non-finite update; every rank decides alike.
                    finite = guards.finite(d.sum({"loss": mb_loss})["loss"], norms)
                    for o in trained:
                        if finite:
                            grad_norms[o.metric].append(norms[o.metric])
                            o.optimizer.step()
                            o.scheduler.step()
                        # Gradients freed once used (as transformers' Trainer does): the next rollout and reference
                        # pass run without them (SmolLM2: 540 MB), and lay their buffers out as every later step will.
                        o.optimizer.zero_grad(set_to_none=True)
                    if not finite:
                        skipped += 1
                        continue
                self._engine_stale = self.generator is not None and train_policy
        rollout.replay = None  # used up (or unused): free decoding's activations
        sums = d.sum(sums)
        for key in ("loss", "policy_loss"):  # weighted by world-scaled weights: back to the global aggregate
            sums[key] /= d.world
        token_sums = d.sum(dict(token_sums))
        token_count = d.sum({"n": token_count})["n"]
        n_loss_tokens = max(1, int(loss_mask_all.sum()) * a.epochs)
        policy = {
            "policy_loss": sums["policy_loss"] / n_updates,
            **{k: v / max(1, token_count) for k, v in token_sums.items()},
            "entropy": sums["entropy"] / max(1, token_count),
            "clip_frac_low": sums["clip_frac_low"] / n_loss_tokens,
            "clip_frac_high": sums["clip_frac_high"] / n_loss_tokens,
        }
        if not train_policy:  # nothing was measured: None, not a misleading 0
            policy.update(policy_loss=None, entropy=None, clip_frac_low=None, clip_frac_high=None, grad_norm=None)
        return {
            "loss": sums["loss"] / n_updates,
            **policy,
            **{o.metric: _mean(grad_norms[o.metric]) for o in trained},  # None when every update was skipped
            "skipped_nonfinite": skipped,
            "rollout_forward_reused": replayed,  # updates that differentiated decoding's forward (train.reuse_rollout_forward)
        }

    # ------------------------------------------------------------------------------------------ the loop
    def train(self, steps: int | None = None) -> list[dict]:
        """Train until ``steps`` steps in total (default ``train.steps``); steps done before a resume count."""
        self._run_claim.acquire()  # held from the constructor; taken again when train() is called once more
        try:
            return self._train(steps)
        finally:  # however training ends, another trainer (a resume) may take the directory now
            self._run_claim.release()

    def _train(self, steps: int | None) -> list[dict]:
        total = steps if steps is not None else self.cfg.train.steps
        if self.step_count >= total:
            return self._finish_or_refuse(total)
        if self.dist.is_main:  # before the first checkpoint, not when one fails hours in
            warning = checkpoint.space_warning(self.run_dir, self._checkpoint_bytes())
            if warning:
                log.warning(warning)
        rows = []
        self.stop_reason = None
        if self.step_count == 0 and self.cfg.eval.before and self.eval_rows:
            rows.append(self._log_eval())
        bar = _progress(self.step_count, total, self.cfg.train.progress, self.name)
        every_eval, every_ckpt = self.cfg.eval.every, self.cfg.train.checkpoint_every
        while self.step_count < total:
            metrics = self.step()
            self.step_count += 1
            row = self._log({"step": self.step_count, **metrics})
            rows.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}", kl=f"{metrics['kl']:.4f}")
            self._fire("on_step_end", row)
            last = self.step_count == total
            if self.eval_rows and ((every_eval and self.step_count % every_eval == 0) or last):
                rows.append(self._log_eval())
            stopping = self.stop_reason is not None
            if last or stopping or (every_ckpt and self.step_count % every_ckpt == 0):
                self._fire("on_save", self.save_checkpoint())
            if stopping:
                log.warning("stopping at step %d of %d: %s", self.step_count, total, self.stop_reason)
                break
        if bar is not None:
            bar.close()
        self._save_final()
        self._fire("on_train_end", rows)
        self.dist.barrier()
        return rows

    def _save_final(self) -> None:
        # FSDP2: the whole weights are gathered from every rank first; rank 0 writes them.
        state = self.dist.full_state(self.model, trainable_only=False) if self.dist.sharded else None
        if self.dist.is_main:
            try:
                self._fire("on_save", self.save(self.run_dir / "final", state_dict=state))
            except checkpoint.CheckpointError as e:
                raise self._write_failed(e) from None
            faults.point("final-written")
            plot_curves(self.run_dir)

    def _finish_or_refuse(self, total: int) -> list[dict]:
        """No steps left: finish what a run killed after its last checkpoint may lack (an intact final/, the
        curves), or say that there is nothing to do (:class:`RunCompleteError`); never a silent run of zero steps."""
        final = self.run_dir / "final"
        problem = checkpoint.verify(final, self.config_hash) if final.is_dir() else "not written"
        if problem is None and json.loads((final / FINAL_MARKER).read_text())["step"] != self.step_count:
            problem = "saved at another step"
        if problem is not None:
            log.warning("run in %s has done all %d steps but final/ is not complete (%s); writing final/", self.run_dir, total, problem)
            self._save_final()
            return []
        if self.dist.is_main and not (self.run_dir / "curves.png").is_file():  # killed between final/ and the plot
            plot_curves(self.run_dir)
        raise RunCompleteError(
            f"run in {self.run_dir} has already done {self.step_count} step(s) and saved final/, nothing is left up "
            f"to {total} step(s); to train further pass a larger total with --steps N, N > {self.step_count} "
            f"(cohortrl train --run-dir {self.run_dir} --resume --steps N)"
        )

    def _log_eval(self) -> dict:
        responses: list[dict] = []
        metrics = self.evaluate(responses)
        row = self._log({"step": self.step_count, **metrics, "eval/grader_errors": self._log_grader_errors(self.step_count)})
        for response in responses:  # filled on rank 0 only
            self.eval_log.write({"step": self.step_count, **response})
        self._fire("on_evaluate", row)
        return row

    def evaluate(self, responses: list | None = None) -> dict:
        """Held-out accuracy; under torchrun rank 0 evaluates and every rank gets its numbers. ``responses``
        (rank 0) receives each greedy response (``evaluate.evaluate``)."""
        with self.dist.gathered(self.model), linear_kernels(self.cpu_linear):  # FSDP2: rank 0 runs forward passes the others do not
            metrics = evaluate_config(self.model, self.tokenizer, self.eval_rows, self.correctness, self.cfg,
                                      self.trainer_state, tools=self.tools, responses=responses) if self.dist.is_main else None
        return self.dist.broadcast(metrics)

    def _log_grader_errors(self, step: int) -> int:
        """Append every rank's built-in grader failures since the last call to ``grader_errors.jsonl``, tagged
        with ``step``; returns how many there were."""
        errors = self.dist.gather_list([{"step": step, **e} for e in grader_errors.drain()])
        if self.dist.is_main:
            for entry in errors:
                self.grader_log.write(entry)
        return len(errors)

    def _log(self, row: dict) -> dict:
        if self.dist.is_main:
            self.log.write(row)
        return row

    # ------------------------------------------------------------------------------------------ persistence
    def save(self, directory: str | Path | None = None, state_dict: dict | None = None) -> Path:
        """The trained model (or adapter) and tokenizer, loadable by ``cohortrl eval`` (default ``RUN_DIR/final``);
        written atomically, with the step it was saved at in ``FINAL_MARKER``."""
        directory = Path(directory) if directory is not None else self.run_dir / "final"

        def write(tmp: Path) -> None:
            self.model.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
            self.tokenizer.save_pretrained(tmp)
            (tmp / FINAL_MARKER).write_text(json.dumps({"step": self.step_count}))

        saved = state_dict if state_dict is not None else (
            [p for p in self.model.parameters() if p.requires_grad] if self.cfg.model.lora.enabled else self.model.state_dict())
        checkpoint.write_dir(directory, write, step=self.step_count, config_hash=self.config_hash,
                             needed_bytes=checkpoint.tensor_bytes(saved))
        return directory

    def save_checkpoint(self) -> Path:
        state = {  # whole tensors (gathered from the shards with FSDP2: every rank takes part)
            "model": self.dist.full_state(self.model, trainable_only=True),
            **{f"{name}_optimizer": self.dist.optimizer_state(self.model, o.optimizer) if name == "policy"
               else o.optimizer.state_dict() for name, o in self.optimised.items()},
            **{f"{name}_scheduler": o.scheduler.state_dict() for name, o in self.optimised.items()},
            "rng": checkpoint.rng_state(),
            "data": self.stream.state_dict(),
            "guard": self.guard.state_dict(),
            "process": self.process.state_dict() if self.process is not None else {},
            **self._algorithm_state(),
        }
        path = checkpoint.checkpoint_dir(self.run_dir) / f"step_{self.step_count:06d}"
        if self.dist.is_main:  # the state is the same on every rank (DDP keeps replicas identical)
            try:
                path = checkpoint.save(self.run_dir, self.step_count, state, config_hash=self.config_hash,
                                       keep=self.cfg.train.keep_checkpoints)
            except checkpoint.CheckpointError as e:
                raise self._write_failed(e) from None
        self.dist.barrier()
        return path

    def _write_failed(self, error: checkpoint.CheckpointError) -> checkpoint.CheckpointError:
        """A failed write's one line, completed with the last intact checkpoint and what to run next."""
        last = checkpoint.latest(self.run_dir)
        if last is None:
            return checkpoint.CheckpointError(f"{error}; there is no intact checkpoint yet: free space, then start the run again")
        return checkpoint.CheckpointError(
            f"{error}; the last intact checkpoint is {last} (kept); free space (or fix the permissions), then resume "
            f"with: cohortrl train --run-dir {self.run_dir} --resume"
        )

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: the trained weights and their optimiser state."""
        return sum(checkpoint.tensor_bytes(o.params) + checkpoint.tensor_bytes(o.optimizer.state_dict()["state"])
                   for o in self.optimised.values())

    def _choose_checkpoint(self) -> Path:
        """The newest intact checkpoint. Damaged newer ones are named, one line each, then set aside (or, with
        ``strict``, the resume is refused and nothing changes)."""
        found = checkpoint.find_intact(self.run_dir, self.config_hash)
        fallback = f"step {int(found.path.name[5:])} ({found.path})" if found.path else None
        if found.rejected and self.strict:
            instead = f"without --strict the run resumes from {fallback}" if fallback else "no intact checkpoint is left"
            raise checkpoint.CheckpointError(f"--resume --strict: refusing a damaged checkpoint: {found.rejected[0][1]}; "
                                             f"nothing was changed ({instead})")
        for _, problem in found.rejected:
            log.warning("damaged checkpoint: %s", problem)
        if found.path is None:
            why = "; ".join(problem for _, problem in found.rejected) or "the run stopped before its first checkpoint"
            raise RunStateError(f"--resume: no intact checkpoint in {self.run_dir / 'checkpoints'} ({why}); start the run "
                                "again with --overwrite instead of --resume")
        if found.rejected:
            moved = checkpoint.set_aside([path for path, _ in found.rejected])
            log.warning("resuming from %s, the newest intact checkpoint; discarded: %s (moved to %s) and the metrics "
                        "after that step, which the run computes again", fallback,
                        ", ".join(p.name for p, _ in found.rejected), moved[0].parent)
        return found.path

    def _load_latest_checkpoint(self) -> None:
        choice = None
        if self.dist.is_main:  # rank 0 verifies and sets damaged ones aside; every rank loads what it chose
            try:
                choice = self._choose_checkpoint()
            except (RunStateError, checkpoint.CheckpointError) as e:
                choice = e
        choice = self.dist.broadcast(choice)
        if isinstance(choice, Exception):
            raise choice
        path = choice
        state = checkpoint.load(path)
        load_trainable_state(self.model, state["model"], f"checkpoint {path}", self.dist)
        for name, o in self.optimised.items():
            if name == "policy":
                self.dist.load_optimizer_state(self.model, o.optimizer, state[f"{name}_optimizer"])
            else:
                o.optimizer.load_state_dict(state[f"{name}_optimizer"])
            o.scheduler.load_state_dict(state[f"{name}_scheduler"])
        self.stream.load_state_dict(state["data"])
        self.guard.load_state_dict(state.get("guard", {}))  # absent in checkpoints written before the guard
        if self.process is not None:
            self.process.load_state_dict(state.get("process", {}))
        self._load_algorithm_state(state)
        checkpoint.set_rng_state(state["rng"])
        self.step_count = state["step"]
        if self.dist.is_main:
            self.log.truncate_after(self.step_count)
            self.grader_log.truncate_after(self.step_count)
            self.eval_log.truncate_after(self.step_count)
        log.info("resumed from %s at step %d", path, self.step_count)

    def _check_resume_config(self) -> None:
        saved_path = self.run_dir / "config.yaml"
        if not saved_path.exists():
            raise FileNotFoundError(f"--resume: {saved_path} not found; is {self.run_dir} a cohortrl run directory?")
        saved, now = _flatten(yaml.safe_load(saved_path.read_text())), _flatten(self.cfg.to_dict())
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
        if differ:
            detail = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
            raise ConfigError(f"--resume with a different config than the run was started with ({detail})")


def _check_distributed(cfg: Config, algorithm: str, dist: distributed.Dist) -> None:
    """Settings torchrun cannot run as asked: refused before any model loads."""
    a = cfg.algorithm
    if a.prompts_per_step % dist.world:
        raise ConfigError(
            f"config key 'algorithm.prompts_per_step' = {a.prompts_per_step}: must be divisible by the number of "
            f"processes ({dist.world}) so that every rank gets whole groups; use a multiple of {dist.world}"
        )
    if cfg.reward.process is not None and cfg.reward.process.name == "implicit_prm":
        raise ConfigError(
            "config key 'reward.process.name' = 'implicit_prm': not supported under torchrun yet (each rank would "
            "train its own implicit PRM); run it in one process"
        )
    if algorithm != "grpo" and cfg.train.strategy == "fsdp":
        raise ConfigError(
            "config key 'train.strategy' = 'fsdp': PPO's critic is not sharded yet; use train.strategy=ddp for PPO"
        )


def load_trainable_state(model, saved: dict[str, torch.Tensor], what: str, dist: distributed.Dist | None = None) -> None:
    """Copy a checkpoint's ``trainable_state`` back into ``model``, refusing one taken of another model."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = trainable ^ set(saved)
    if missing:
        raise RunStateError(f"{what} does not match the model: differing parameters {sorted(missing)[:5]}")
    (dist or distributed.Dist()).load_parameters(model, saved)


def _as_float(x) -> float:
    """A scalar tensor (a DTensor under FSDP2) as a Python float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def config_hash(config: dict) -> str:
    """SHA-256 of the settings that decide what a run computes (a config's ``to_dict()`` or its YAML, loaded):
    those in ``RESUMABLE_CHANGES`` are left out, so a resume with a longer ``train.steps`` keeps the hash."""
    kept = {k: v for k, v in _flatten(config).items() if k not in RESUMABLE_CHANGES}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "kwargs":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _std(values: list) -> float | None:
    """Sample std of the values a reward function returned (None where it did not apply)."""
    vals = torch.tensor([v for v in values if v is not None])
    return vals.std().item() if len(vals) > 1 else None


def _lengths_by_outcome(lengths: torch.Tensor, correctness: list) -> dict:
    """Mean response length of the correct and of the incorrect responses (None where there are none)."""
    pairs = [(float(n), c is not None and c >= 1.0) for n, c in zip(lengths.tolist(), correctness)]
    right = [n for n, ok in pairs if ok]
    wrong = [n for n, ok in pairs if not ok]
    return {"response_length_correct_mean": _mean(right), "response_length_incorrect_mean": _mean(wrong)}


def _masked_total(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return torch.where(mask_BT.bool(), x_BT, 0.0).sum().item()


def _progress(done: int, total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit="step")
