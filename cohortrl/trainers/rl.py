"""The RL trainer (``RLTrainer``): what a GRPO, PPO or RFT run holds and how it is built: the policy, the
reference, the algorithm's object (``algorithm.py``: ``grpo.GRPO``, ``ppo.PPO``, ``rft.RFT``), the rollout
engine and the sampler, an optimiser and LR schedule for every trained model. Its ``step`` is
``step.rl_step``, one function in one file (sample → score → targets → update → log); the run around the
steps (train loop, evaluation, checkpoints, resume) is ``loop.Trainer``, shared with SFT.

An algorithm is its object, named by a trainer subclass (``algorithm_class``); nothing else differs.

Departures from the papers, on purpose: log-probs are computed from logits divided by the sampling
temperature (the distribution actually sampled from, as TRL does); a zero-variance group is detected on the
correctness signal, not on the shaped total reward (a shaped total hides all-wrong groups).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from cohortrl import distributed
from cohortrl.algorithms import get_policy_loss
from cohortrl.config import Config, ConfigError
from cohortrl.data import PromptStream, load_rows
from cohortrl.rewards import grader_errors
from cohortrl.rewards.process import build_step_source
from cohortrl.rewards.scoring import TrainerState, WeightedReward, check_columns, resolve
from cohortrl.rollout.engine import build_engine
from cohortrl.rollout.tools import toolset
from cohortrl.trainers import guards
from cohortrl.trainers.algorithm import Algorithm
from cohortrl.trainers.evaluate import evaluate_config
from cohortrl.trainers.inputs import from_trl_order, resolve_inputs
from cohortrl.trainers.loop import Trainer, _check_distributed, _release_run_dir_on_failure, config_hash
from cohortrl.trainers.metrics import MetricsLog, log_grader_errors
from cohortrl.trainers.run_dir import claim as claim_run_dir
from cohortrl.trainers.sampler import Sampler, reward_pool
from cohortrl.trainers.setup import (
    Optimised, Reference, allocate_optimizer_state, build_fast_path, build_optimizer, build_policy, build_scheduler,
    fast_kernels, load_configured_model, trained_on,
)
from cohortrl.trainers.step import rl_step

log = logging.getLogger("cohortrl")


class RLTrainer(Trainer):
    """An RL run; a subclass (``GRPOTrainer``, ``PPOTrainer``, ``RFTTrainer``) names its algorithm's object."""

    name = "rl"
    algorithm_class: type[Algorithm]  # built once per run as ``self.algorithm``

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
        # the models a step runs forward passes of, whose linear layers the fast path's kernel computes
        self.kernel_models = [self.model, self.reference_copy, *self.algorithm.models()]
        # before the reward workers and the vLLM engine start: a refused prompt leaves no process behind
        guards.check_prompts_fit(self.cfg, self.tokenizer, self.tools,
                                 {"training prompt": self.stream.rows, "held-out prompt": self.eval_rows})
        self._build_rollout(inputs)
        if self.device.type == "cpu" and self.dist.is_main:  # the plan of the step as _build_rollout decided it
            guards.warn_if_memory_short(self.cfg, self.model, self.rollout_forward_reusable, self.dist.world)
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
        self.stream = PromptStream(train_rows, cfg.train.seed, retire_after=cfg.algorithm.retire_solved)
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
            self.trained_on = trained_on(cfg.model)  # before the load: the weights it is about to read
            # FSDP2 over several processes: rank 0 loads, the others build on the meta device (Dist.load)
            model, tokenizer = self.dist.load(lambda: load_configured_model(cfg.model, cfg.train.seed))
        # before LoRA is attached: a critic copies the plain initial weights
        self.algorithm = self.algorithm_class(cfg, self.dist, self.device, model)
        self.model, self.tokenizer = build_policy(cfg.model, cfg.train.seed, model, tokenizer,
                                                  activation_checkpointing=cfg.train.activation_checkpointing)
        if not self.dist.sharded:  # FSDP2: wrap puts each rank's shards there, never the whole model
            self.model.to(self.device)
        guards.check_run_fits(cfg, self.model, n_train_rows)
        self.reference = Reference(self.model, cfg.model.lora.enabled, frozen_copy=not self.dist.sharded) if a.beta > 0 else None
        # What eval.kl_to_reference measures against: the run's π_ref, or at β = 0 one built for the measurement alone
        # (free with LoRA, a frozen copy without). Rank 0 evaluates alone, so it cannot be an FSDP2-sharded copy.
        self.eval_reference = self.reference
        if cfg.eval.kl_to_reference and self.dist.sharded and not cfg.model.lora.enabled:
            raise ConfigError("eval.kl_to_reference under FSDP2 needs model.lora.enabled (the reference is then the "
                              "policy with its adapter off); a sharded full copy cannot be evaluated on one rank")
        if cfg.eval.kl_to_reference and self.eval_reference is None:
            self.eval_reference = Reference(self.model, cfg.model.lora.enabled)
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
        policy_updates = max(0, cfg.train.steps - self.algorithm.policy_frozen_steps) * self.updates_per_step
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, policy_updates)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimised: dict[str, Optimised] = {"policy": Optimised("grad_norm", params, self.optimizer, self.scheduler),
                                                **self.algorithm.optimised()}
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
        # Whether step 3 computes log π_old; without it the update is on-policy (ratio 1). So may the algorithm
        # need it; and a sampler of other numerics (vLLM, the lean decoder's bf16 products) for the importance
        # weights, unless the update differentiates decoding's own recorded forward, whose log-probs are π_old.
        a = cfg.algorithm
        self.needs_old_logp = a.epochs > 1 or a.minibatches > 1 or self.algorithm.needs_old_logp
        self.rollout_forward_reusable = self._reuse_rollout_forward()  # a property of the run: decided once
        self.needs_old_logp |= (self.engine.own_numerics and self.algorithm.corrects_sampler
                                and not self.rollout_forward_reusable)

    def close(self) -> None:
        """Stop the reward workers (if any), then let the run go (``Trainer.close``: the fast path's allocator
        too)."""
        self.sampler.close()
        super().close()

    @property
    def trainer_state(self) -> TrainerState:
        """What reward functions get as ``trainer_state`` (TRL's argument): steps done and the run's total."""
        return self.sampler.trainer_state(self.step_count)

    def step(self) -> dict:
        """One training step: sample → score → targets → update → log (``step.rl_step``). Returns its metrics."""
        return rl_step(self)

    def _reuse_rollout_forward(self) -> bool:
        """Whether the run's updates can differentiate decoding's forward (``train.reuse_rollout_forward``):
        each rollout is exactly the batch of a single on-policy update, and decoding computes what training
        would, on the run's fast path's lean decoder. Then ``generate`` records it; the update uses the recording
        only while the policy trains."""
        a = self.cfg.algorithm
        if self.fast_path is None or self.fast_path.decoder_for(self.model) is None:  # nothing would record it
            return False
        if self.engine.syncs_weights:  # it samples from its own copy of the weights (vLLM), not the policy's forward
            return False
        return (self.cfg.train.reuse_rollout_forward and self.algorithm.reuses_rollout_forward and not self.needs_old_logp
                and a.epochs == 1 and a.minibatches == 1 and self.dist.world == 1
                and (a.micro_batch_size == 0 or a.micro_batch_size >= a.prompts_per_step * a.group_size)
                and a.zero_variance != "resample" and self.sampler.pool is None  # a batch joined from parts drops the recording
                and not self._dropout)

    # ------------------------------------------------------------------------------------------ the run (loop.Trainer)
    def _progress_postfix(self, metrics: dict) -> dict:
        shown = self.algorithm.progress_metric
        return {"reward": f"{metrics['reward_mean']:.3f}", "acc": f"{metrics['accuracy']:.2f}", shown: f"{metrics[shown]:.4f}"}

    def evaluate(self, responses: list | None = None, rows: list[dict] | None = None) -> dict:
        """Held-out accuracy; under torchrun rank 0 evaluates and every rank gets its numbers. ``responses``
        (rank 0) receives each greedy response (``evaluate.evaluate``); ``rows``: these instead of the run's."""
        # FSDP2: rank 0 runs forward passes the others do not
        with self.dist.gathered(self.model), fast_kernels(self.fast_path, self.model):
            metrics = evaluate_config(self.model, self.tokenizer, self.eval_rows if rows is None else rows,
                                      self.correctness, self.cfg, self.trainer_state, tools=self.tools, responses=responses,
                                      fast_path=self.fast_path, reference=self.eval_reference) if self.dist.is_main else None
        return self.dist.broadcast(metrics)

    def _eval_metrics(self, responses: list, rows: list[dict] | None = None) -> dict:
        metrics = self.evaluate(responses, rows)
        return {**metrics, "eval/grader_errors": log_grader_errors(self.dist, self.grader_log, self.step_count)}

    def _extra_state(self) -> dict:
        return {"guard": self.guard.state_dict(), "process": self.process.state_dict() if self.process is not None else {},
                **self.algorithm.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        self.guard.load_state_dict(state.get("guard", {}))  # absent in checkpoints written before the guard
        if self.process is not None:
            self.process.load_state_dict(state.get("process", {}))
        self.algorithm.load_state_dict(state)
