"""The run around the steps, shared by every trainer (RL in ``rl.py``, supervised in ``sft.py``): the train
loop with its evaluation and checkpoint schedule, metrics rows and callbacks, checkpoints and exact resume,
the final save.

A trainer subclasses ``Trainer`` and supplies ``step()`` (one optimiser step's worth of work, returning its
metrics) and ``evaluate()``; what its checkpoints hold beyond the weights, optimisers, schedules, RNG and data
position goes through ``_extra_state`` / ``_load_extra_state``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from pathlib import Path

import torch
import yaml

from cohortrl import distributed
from cohortrl.config import Config, ConfigError
from cohortrl.models import final_marker
from cohortrl.trainers import checkpoint, faults
from cohortrl.trainers.callbacks import TensorBoardCallback, WandbCallback
from cohortrl.trainers.evaluate import EVAL_RESPONSES, EVAL_ROWS, export_answers
from cohortrl.trainers.metrics import MetricsLog, plot_curves

log = logging.getLogger("cohortrl")
progress = logging.getLogger("cohortrl.progress")  # shown on stderr by the CLI

# Settings that may change between a run and its resume without changing what the run computes.
RESUMABLE_CHANGES = {
    "train.steps", "train.progress", "train.checkpoint_every", "train.tensorboard", "train.wandb",
    "train.max_nonfinite_steps", "train.cpu_allocator", "train.reuse_rollout_forward", "train.keep_checkpoints",
    "train.trace_steps", "reward.timeout_s", "train.dist_timeout_s", "train.cpu_heap_trim_every",
}
FINAL_MARKER = checkpoint.FINAL_MARKER
UNKNOWN = object()  # Trainer.trained_on for a model passed in: what it was trained from is not known here


class RunStateError(RuntimeError):
    """The run directory's state does not allow what was asked (e.g. resuming a finished run)."""


class RunCompleteError(RunStateError):
    """Resume of a run that has done all its steps and saved an intact final/: nothing to do. The CLI exits 0
    on it, so a wrapper that repeats ``train --resume`` until it succeeds stops."""


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
            fast_path = self.__dict__.get("fast_path")
            if fast_path is not None:  # its allocator hold is process-wide
                fast_path.close()
            raise

    return wrapper


class Trainer:
    """A run: ``train()`` steps, evaluates, checkpoints and saves ``final/``; subclasses do the steps.

    A subclass's constructor sets ``cfg``, ``run_dir``, ``_run_claim``, ``dist``, ``model``, ``tokenizer``,
    ``fast_path`` (``setup.build_fast_path``), ``optimised`` (each trained model's optimiser and schedule,
    ``"policy"`` first), ``stream``, ``eval_rows``, ``config_hash`` and ``step_count``, then calls ``_open_run``."""

    name = "trainer"
    command = "train"  # the CLI command that continues such a run, for messages
    strict = False  # --resume --strict: refuse a damaged newest checkpoint instead of falling back
    _saved_hashes: tuple[str, ...] = ()  # resuming: the saved config's hashes (accepted_hashes)
    # What the policy's weights were before training: checkpoint.init_record of model.init as the run loaded it,
    # None for model.name's own, UNKNOWN for a model passed in Python (nothing is recorded then)
    trained_on: dict | None | object = UNKNOWN

    @classmethod
    def resume(cls, run_dir: str | Path, config=None, **inputs) -> "Trainer":
        """The run in ``run_dir``, ready to continue from its last checkpoint (``config`` defaults to the run's
        own ``config.yaml``; objects a file cannot hold, such as reward callables or rows, are passed again)."""
        return cls(config if config is not None else Path(run_dir) / "config.yaml", run_dir, resume=True, **inputs)

    def step(self) -> dict:
        """One step of training; returns its metrics (a row of ``metrics.jsonl`` without ``step``)."""
        raise NotImplementedError

    def evaluate(self, responses: list | None = None, rows: list[dict] | None = None) -> dict:
        """Held-out metrics; ``responses`` (rank 0) receives each evaluated response; ``rows``: these held-out rows
        instead of the run's (a part of them: ``eval.before_n_prompts``)."""
        raise NotImplementedError

    def _open_run(self, resume: bool, callbacks, logs: tuple[MetricsLog, ...] = ()) -> None:
        """The run's files and callbacks, last in the constructor: on ``resume`` the newest intact checkpoint is
        loaded and every log cut back to its step; otherwise the config is written and the logs (``metrics.jsonl``,
        ``EVAL_RESPONSES`` and ``logs``) start empty."""
        self.log = MetricsLog(self.run_dir)
        self.eval_log = MetricsLog(self.run_dir, EVAL_RESPONSES)
        self._logs = (self.log, *logs, self.eval_log)
        self.callbacks = [*self._config_loggers(), *(callbacks or ())]  # TRL passes callbacks=None
        self.stop_reason: str | None = None
        if resume:
            self._load_latest_checkpoint()
        elif self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())
            for run_log in self._logs:
                run_log.truncate_after(-1)
            self._save_eval_rows()

    def _save_eval_rows(self) -> None:
        """Rows given in Python: the held-out ones written beside config.yaml (``EVAL_ROWS``), which alone cannot
        name them, so ``cohortrl eval RUN_DIR`` evaluates the run on its own held-out problems."""
        if not self.cfg.data.source.startswith("python:") or not self.eval_rows:
            return
        try:
            lines = "".join(json.dumps(row) + "\n" for row in self.eval_rows)
        except TypeError as e:
            log.warning("held-out rows not saved to %s (%s): `cohortrl eval %s` cannot evaluate this run by itself",
                        EVAL_ROWS, e, self.run_dir)
            return
        (self.run_dir / EVAL_ROWS).write_text(lines)

    def close(self) -> None:
        """Give the CPU fast path's allocator back (``cpu/memory.py``), let the run directory's lock go and, under
        torchrun, leave the process group (after every rank got here: a rank that exits while another still
        talks to it aborts the run)."""
        if self.fast_path is not None:
            self.fast_path.close()
        self._run_claim.release()
        self.dist.barrier()
        self.dist.close()

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
        schedule = self.cfg.optim.schedule
        if total > self.cfg.train.steps and self.cfg.optim.decays:
            raise ConfigError(
                f"training to step {total} (--steps) goes past train.steps={self.cfg.train.steps}, where "
                f"optim.schedule={schedule} has brought the learning rate to 0: the steps after it would not train. "
                f"Set train.steps={total} instead (a resume may change it; the {schedule} decay is then spread over "
                f"{total} steps)"
            )
        if self.dist.is_main:  # before the first checkpoint, not when one fails hours in
            warning = checkpoint.space_warning(self.run_dir, self._checkpoint_bytes(), self._checkpoints_at_once(total),
                                               checkpoint.tensor_bytes(self._final_tensors()))
            if warning:
                log.warning(warning)
        rows = []
        self.stop_reason = None
        if self.step_count == 0 and self.cfg.eval.before and self.eval_rows:
            rows.append(self._log_eval(self.eval_rows[: self.cfg.eval.before_n_prompts]))  # None: all of them
        bar = _progress(self.step_count, total, self.cfg.train.progress, self.name)
        every_eval, every_ckpt = self.cfg.eval.every, self.cfg.train.checkpoint_every
        try:  # closed however the loop ends: an error's line then starts a line of its own, not the bar's
            while self.step_count < total:
                metrics = self.step()
                self.step_count += 1
                if self.fast_path is not None:
                    self.fast_path.end_of_step(self.step_count)
                row = self._log({"step": self.step_count, **metrics})
                rows.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(self._progress_postfix(metrics))
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
        finally:
            if bar is not None:
                bar.close()
        self._save_final()
        self._fire("on_train_end", rows)
        self.dist.barrier()
        return rows

    def _progress_postfix(self, metrics: dict) -> dict:
        """What the progress bar shows after each step."""
        return {"loss": f"{metrics['loss']:.4f}"}

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
            export_answers(self.run_dir)  # every evaluation's answers, small enough to commit with a study

    def _finish_or_refuse(self, total: int) -> list[dict]:
        """No steps left: finish what a run killed after its last checkpoint may lack (an intact final/, the
        curves), or say that there is nothing to do (:class:`RunCompleteError`); never a silent run of zero steps."""
        final = self.run_dir / "final"
        problem = checkpoint.verify(final, self.accepted_hashes) if final.is_dir() else "not written"
        if problem is None and final_marker(final)["step"] != self.step_count:
            problem = "saved at another step"
        if problem is not None:
            log.warning("run in %s has done all %d steps but final/ is not complete (%s); writing final/", self.run_dir, total, problem)
            self._save_final()
            return []
        if self.dist.is_main and not (self.run_dir / "curves.png").is_file():  # killed between final/ and the plot
            plot_curves(self.run_dir)
        further = "train.steps=N" if self.cfg.optim.decays else "--steps N"  # --steps past a decay is refused (_train)
        raise RunCompleteError(
            f"run in {self.run_dir} has already done {self.step_count} step(s) and saved final/, nothing is left up "
            f"to {total} step(s); to train further pass a larger total with {further}, N > {self.step_count} "
            f"(cohortrl {self.command} --run-dir {self.run_dir} --resume {further})"
        )

    def _log_eval(self, rows: list[dict] | None = None) -> dict:
        responses: list[dict] = []
        row = self._log({"step": self.step_count, **self._eval_metrics(responses, rows)})
        for response in responses:  # filled on rank 0 only
            self.eval_log.write({"step": self.step_count, **response})
        self._fire("on_evaluate", row)
        return row

    def _eval_metrics(self, responses: list, rows: list[dict] | None = None) -> dict:
        """An evaluation's row of ``metrics.jsonl`` (without ``step``), on ``rows`` (None: the run's held-out rows)."""
        return self.evaluate(responses, rows)

    def _log(self, row: dict) -> dict:
        if self.dist.is_main:
            self.log.write(row)
        return row

    # ------------------------------------------------------------------------------------------ persistence
    def save(self, directory: str | Path | None = None, state_dict: dict | None = None) -> Path:
        """The trained model (or adapter) and tokenizer, loadable by ``cohortrl eval`` and as ``model.init``
        (default ``RUN_DIR/final``); written atomically, with the step it was saved at in ``FINAL_MARKER``, and,
        for an adapter, the weights it was trained on (:attr:`trained_on`), without which it would be merged
        into the wrong ones."""
        directory = Path(directory) if directory is not None else self.run_dir / "final"
        marker = {"step": self.step_count}
        if self.cfg.model.lora.enabled and self.trained_on is not UNKNOWN:  # None: model.name's own weights
            marker["init"] = self.trained_on

        def write(tmp: Path) -> None:
            self.model.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
            self.tokenizer.save_pretrained(tmp)
            (tmp / FINAL_MARKER).write_text(json.dumps(marker))

        saved = state_dict if state_dict is not None else self._final_tensors()
        checkpoint.write_dir(directory, write, step=self.step_count, config_hash=self.config_hash,
                             needed_bytes=checkpoint.tensor_bytes(saved))
        return directory

    def _final_tensors(self):
        """What ``final/`` holds: the adapter's weights with LoRA, else every weight."""
        if self.cfg.model.lora.enabled:
            return [p for p in self.model.parameters() if p.requires_grad]
        return self.model.state_dict()

    def save_checkpoint(self) -> Path:
        state = {  # whole tensors (gathered from the shards with FSDP2: every rank takes part)
            "model": self.dist.full_state(self.model, trainable_only=True),
            **{f"{name}_optimizer": self.dist.optimizer_state(self.model, o.optimizer) if name == "policy"
               else o.optimizer.state_dict() for name, o in self.optimised.items()},
            **{f"{name}_scheduler": o.scheduler.state_dict() for name, o in self.optimised.items()},
            "rng": checkpoint.rng_state(),
            "data": self.stream.state_dict(),
            # the weights the run started from, as loaded: a resume checks that model.init still holds them
            **({"trained_on": self.trained_on} if self.trained_on is not UNKNOWN else {}),
            **self._extra_state(),
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

    def _extra_state(self) -> dict:
        """Checkpoint entries of the subclass's own (a guard's count, PPO's critic and KL coefficient)."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        """Restore what ``_extra_state`` saved."""

    def _write_failed(self, error: checkpoint.CheckpointError) -> checkpoint.CheckpointError:
        """A failed write's one line, completed with the last intact checkpoint and what to run next."""
        last = checkpoint.latest(self.run_dir)
        if last is None:
            return checkpoint.CheckpointError(f"{error}; there is no intact checkpoint yet: free space, then start the run again")
        return checkpoint.CheckpointError(
            f"{error}; the last intact checkpoint is {last} (kept); free space (or fix the permissions), then resume "
            f"with: cohortrl {self.command} --run-dir {self.run_dir} --resume"
        )

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: the trained weights and their optimiser state."""
        return sum(checkpoint.tensor_bytes(o.params) + checkpoint.tensor_bytes(o.optimizer.state_dict()["state"])
                   for o in self.optimised.values())

    def _checkpoints_at_once(self, total: int) -> int:
        """The most checkpoints on disk at once while training to step ``total``: ``keep_checkpoints`` and the
        new one written beside them (all of them with 0, which keeps every one), at most as many as are still
        written (every ``checkpoint_every`` steps and at the last)."""
        every, keep = self.cfg.train.checkpoint_every, self.cfg.train.keep_checkpoints
        written = sum(1 for s in range(self.step_count + 1, total + 1) if s == total or (every and s % every == 0))
        return min(keep + 1, written) if keep else written

    def _choose_checkpoint(self) -> Path:
        """The newest intact checkpoint. Damaged newer ones are named, one line each, then set aside (or, with
        ``strict``, the resume is refused and nothing changes)."""
        found = checkpoint.find_intact(self.run_dir, self.accepted_hashes)
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
        # FSDP2: rank 0 alone reads the weights and the policy's optimiser state and sends them into the shards
        state = self.dist.read_state(lambda: checkpoint.load(path), tensors=("model", "policy_optimizer"))
        self._check_same_start(state, path)
        load_trainable_state(self.model, state["model"], f"checkpoint {path}", self.dist)
        for name, o in self.optimised.items():
            if name == "policy":
                self.dist.load_optimizer_state(self.model, o.optimizer, state[f"{name}_optimizer"])
            else:
                o.optimizer.load_state_dict(state[f"{name}_optimizer"])
            o.scheduler.load_state_dict(state[f"{name}_scheduler"])
            # The next update's LR from this run's schedule, not the saved one: the same number unless a resume
            # changed train.steps, whose schedule (stretched or shortened) must then apply from this update on.
            # (_last_lr is what the scheduler's get_last_lr() reports, and the logged "lr".)
            s = o.scheduler
            s._last_lr = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
            for group, lr in zip(o.optimizer.param_groups, s._last_lr):
                group["lr"] = lr
        self.stream.load_state_dict(state["data"])
        self._load_extra_state(state)
        checkpoint.set_rng_state(state["rng"])
        self.step_count = state["step"]
        if self.dist.is_main:
            for run_log in self._logs:
                run_log.truncate_after(self.step_count)
            progress.info("resuming the run in %s from step %d (%s)", self.run_dir, self.step_count, path)

    def _check_same_start(self, state: dict, path: Path) -> None:
        """Refuse a resume whose ``model.init`` no longer holds the weights the checkpoint's run started from (the
        same path in the config, other contents: a warm start trained again into the same directory): the saved
        adapter or weights were trained on the earlier ones, and the run would go on from a mix. Checkpoints
        written before the record existed, a model passed in, and an init without a manifest are not checked."""
        if "trained_on" not in state or self.trained_on is UNKNOWN:
            return
        before, now = state["trained_on"] or {}, self.trained_on or {}
        if before.get("manifest_sha256") is None or before.get("manifest_sha256") == now.get("manifest_sha256"):
            return
        raise ConfigError(
            f"--resume: model.init {now.get('path')} has changed since the run started (its manifest differs from the "
            f"one recorded in {path}): the checkpoint was trained on the earlier weights; put them back, or start "
            f"the run again with --overwrite")

    def _seed_process(self, resume: bool) -> None:
        """Before any model is built: a resumed run's config checked against its own, the thread count and (on a
        GPU) the float32 matmul precision set, and torch's and Python's RNGs seeded from ``train.seed``."""
        if resume:
            self._check_resume_config()
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        precision = float32_matmul_precision(self.device, self.cfg.train.tf32)
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
        torch.manual_seed(self.cfg.train.seed)
        random.seed(self.cfg.train.seed)

    @property
    def accepted_hashes(self) -> tuple[str, ...]:
        """The config hashes this run's checkpoints may carry: this version's, and (resuming) those of the run's
        saved config, as this and earlier versions computed them (:func:`config_hashes`)."""
        return (self.config_hash, *self._saved_hashes)

    def _check_resume_config(self) -> None:
        saved_path = self.run_dir / "config.yaml"
        if not saved_path.exists():
            raise FileNotFoundError(f"--resume: {saved_path} not found; is {self.run_dir} a cohortrl run directory?")
        saved = yaml.safe_load(saved_path.read_text())
        self._saved_hashes = config_hashes(saved)
        try:  # a setting added to cohortrl since the run started is compared at its default, not as a change
            saved = Config.from_dict(saved).to_dict()
        except ConfigError:  # a saved config this version cannot build: compared as written, key by key
            pass
        saved, now = _flatten(saved), _flatten(self.cfg.to_dict())
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
        if differ:
            detail = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
            raise ConfigError(f"--resume with a different config than the run was started with ({detail})")


def float32_matmul_precision(device: torch.device, tf32: bool) -> str | None:
    """``train.tf32`` on a GPU: float32 matrix products in TF32 ("high") or in full float32 ("highest"); None on a
    CPU, where the setting changes nothing and is left alone."""
    if device.type != "cuda":
        return None
    return "high" if tf32 else "highest"


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
    if cfg.sampling.backend == "vllm":
        raise ConfigError(
            "config key 'sampling.backend' = 'vllm': not supported under torchrun yet (each rank would start its own "
            "engine, and FSDP2 would hand it sharded weights); run it in one process, or use sampling.backend=hf under torchrun"
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


def config_hash(config: dict) -> str:
    """SHA-256 of the settings that decide what a run computes (a config's ``to_dict()`` or its YAML, loaded):
    those in ``RESUMABLE_CHANGES`` are left out, so a resume with a longer ``train.steps`` keeps the hash, and so
    are those at cohortrl's defaults, so a setting added to cohortrl after the run started keeps it too."""
    defaults = _default_settings()
    kept = {k: v for k, v in _flatten(config).items() if k not in RESUMABLE_CHANGES and (k not in defaults or defaults[k] != v)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def config_hashes(config: dict) -> tuple[str, str]:
    """The hashes a checkpoint of a run with this saved config may carry: :func:`config_hash`, and the one that
    cohortrl wrote before defaults were left out (every setting as saved), so that such checkpoints still resume."""
    legacy = {k: v for k, v in _flatten(config).items() if k not in RESUMABLE_CHANGES}
    return config_hash(config), hashlib.sha256(json.dumps(legacy, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def _default_settings() -> dict:
    return _flatten(Config().to_dict())


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "kwargs":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _progress(done: int, total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit="step")
