"""Guards that stop a run from going wrong quietly: settings that cannot fit the loaded model or data (checked
once, before the first step) and update steps whose loss or gradient is not finite (skipped, saved, counted).

A non-finite loss or gradient would turn every weight it touches into NaN with the next optimiser step, and
AdamW's moments with it, so that one bad batch ends the run's usefulness without an error. Such an update is
skipped instead (no optimiser or scheduler step, so their state is exactly as before) and the step's samples
are written to ``RUN_DIR/nonfinite/step_NNNNNN.jsonl`` for inspection. One bad batch can be bad luck; several
in a row mean the run itself is broken, so ``train.max_nonfinite_steps`` of them in a row stop it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dataclasses import replace

from cohortrl.config import ConfigError
from cohortrl.data import DataError
from cohortrl.planner import PlanError, plan, run_spec_from_config, shape_from_config
from cohortrl.rollout.hf import check_prompt_lengths
from cohortrl.trainers.setup import cpu_bf16_products

log = logging.getLogger("cohortrl")


class NonfiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


def check_run_fits(cfg, model, n_train_rows: int) -> None:
    """Settings that are valid on their own but impossible for this model or this data; raised before step 1."""
    n_ctx = getattr(model.config, "max_position_embeddings", None)
    longest = cfg.data.max_prompt_tokens + max(cfg.sampling.max_new_tokens, cfg.eval.max_new_tokens or 0)
    if n_ctx is not None and longest > n_ctx:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + the generation budget "
            f"(sampling.max_new_tokens {cfg.sampling.max_new_tokens}, eval.max_new_tokens {cfg.eval.max_new_tokens}) "
            f"= {longest} tokens, more than {cfg.model.name}'s context of {n_ctx} (max_position_embeddings); "
            "lower data.max_prompt_tokens or the max_new_tokens settings"
        )
    P = cfg.algorithm.prompts_per_step
    if n_train_rows < P:
        # Cycling would put the same prompt into one step more than once, which quietly weights it double.
        raise DataError(
            f"{cfg.data.source!r} has {n_train_rows} training prompt(s) after holding out data.eval_size="
            f"{cfg.data.eval_size if cfg.data.eval_size is not None else '(unset: 200 from a gym task, none from your rows)'}"
            f" for evaluation, fewer than one step's algorithm.prompts_per_step={P}; "
            "add prompts, lower data.eval_size or lower algorithm.prompts_per_step"
        )
    a = cfg.algorithm
    most_drawn = cfg.train.steps * P * (1 + a.max_resample_draws if a.zero_variance == "resample" else 1)
    if a.retire_solved and most_drawn <= n_train_rows:
        # The stream goes through a shuffled epoch before any prompt comes round again, so nothing can be skipped.
        log.warning(
            "algorithm.retire_solved=%d cannot act: %d steps draw at most %d of the %d training prompts, none of them "
            "twice; retiring solved prompts matters once a run comes round to its prompts again (more train.steps or "
            "a smaller data.train_size)", a.retire_solved, cfg.train.steps, most_drawn, n_train_rows)


def check_prompts_fit(cfg, tokenizer, tools, splits: dict[str, list[dict]]) -> None:
    """With ``data.overlong_prompts: reject``, every prompt of ``splits`` (name: rows) fits
    ``data.max_prompt_tokens`` as generation will render it, or the run stops now with the row named, not at the
    step that draws it or at the final evaluation."""
    if cfg.data.overlong_prompts != "reject":
        return
    for what, rows in splits.items():
        check_prompt_lengths(tokenizer, [r["prompt"] for r in rows], what, system_prompt=cfg.model.system_prompt,
                             max_prompt_tokens=cfg.data.max_prompt_tokens, tools=tools)


# A trainer process before any model: imports and the allocator (cohortrl plan's --cpu-baseline-mb default)
PROCESS_BASELINE_BYTES = 350 * 2**20


def warn_if_memory_short(cfg, model, reuse_rollout_forward: bool, processes: int) -> None:
    """On a CPU, ``memory_warning``'s line in the log before step 1 (a log that ends in a SIGKILL then says why)."""
    available = memory_available_bytes()
    if available is None:
        return
    # with train.cpu_fast_path=off nothing of cohortrl.cpu is imported (tests/trainers/test_plain_path_imports.py)
    # and the plain path never decodes in bf16
    bf16_units = cfg.train.cpu_fast_path != "off" and cpu_bf16_products()
    warning = memory_warning(cfg, model.config.to_dict(), available, bf16_units=bf16_units,
                             reuse_rollout_forward=reuse_rollout_forward, processes=processes)
    if warning:
        log.warning(warning)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def memory_available_bytes() -> int | None:
    """What this process could grow to on Linux (``available_bytes`` of /proc and the cgroup's files); None where
    /proc does not tell."""
    meminfo, statm = _read("/proc/meminfo"), _read("/proc/self/statm")
    if meminfo is None or statm is None:
        return None
    return available_bytes(meminfo, statm, os.sysconf("SC_PAGE_SIZE"), _read("/sys/fs/cgroup/memory.max"),
                           _read("/sys/fs/cgroup/memory.current"))


def available_bytes(meminfo: str, statm: str, page_size: int, cgroup_max: str | None = None,
                    cgroup_current: str | None = None) -> int | None:
    """This process's resident memory (``statm``'s second field, in pages) plus the least of what the kernel
    could give it (``MemAvailable`` in /proc/meminfo: free memory and page cache it can drop) and what its cgroup
    v2 limit leaves (``memory.max`` − ``memory.current``; a container's /proc/meminfo shows the host's memory)."""
    try:
        resident = int(statm.split()[1]) * page_size
        room = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (ValueError, IndexError, StopIteration):
        return None
    if cgroup_max and cgroup_current and cgroup_max.strip() != "max":
        room = min(room, max(0, int(cgroup_max) - int(cgroup_current)))
    return resident + room


def memory_warning(cfg, model_config: dict, available: int, bf16_units: bool = False,
                   reuse_rollout_forward: bool | None = None, processes: int = 1) -> str | None:
    """One line when the planner (``cohortrl.planner``) puts a CPU step of this run at its longest (every prompt
    ``data.max_prompt_tokens``, every response ``sampling.max_new_tokens``), times the ``processes`` on this
    machine (CPU torchrun: one per rank, each its share of the batch), above ``available`` bytes, naming the
    settings that fit; else None. ``reuse_rollout_forward``: what the trainer decided (None: where the config
    allows it). On a CPU the kernel's OOM killer ends such a run with SIGKILL and no word of why, possibly hours in;
    a GPU raises its own out-of-memory error. The plan is a model, within about 20% of measured peaks
    (docs/planner.md), and real steps are mostly shorter than the longest: hence a warning, not a refusal."""
    try:
        shape = shape_from_config(model_config, cfg.model.name)
        run = run_spec_from_config(cfg, bf16_units=bf16_units, device="cpu", cpu_baseline_bytes=PROCESS_BASELINE_BYTES,
                                   gpus=processes)
        if reuse_rollout_forward is not None:
            run = replace(run, reuse_rollout_forward=reuse_rollout_forward)
        need = plan(shape, run).memory.peak * processes
    except PlanError:  # a model or split the planner cannot describe: nothing to say
        return None
    if need <= available:
        return None
    gib = 1024**3
    fits = []
    b = run.sequences // processes // 2
    while b >= 1 and not fits:  # the largest power-of-two micro-batch whose step fits
        smaller = plan(shape, replace(run, micro_batch_size=b, reuse_rollout_forward=False)).memory.peak * processes
        if smaller <= available:
            fits.append(f"algorithm.micro_batch_size={b} (about {smaller / gib:.1f} GiB)")
        b //= 2
    if not run.reuse_rollout_forward and not run.checkpointing:
        ckpt = plan(shape, replace(run, checkpointing=True)).memory.peak * processes
        if ckpt <= available:
            fits.append(f"train.activation_checkpointing=true (about {ckpt / gib:.1f} GiB)")
    fix = " or ".join(fits) if fits else "fewer sequences per step (algorithm.prompts_per_step, algorithm.group_size) or a shorter sampling.max_new_tokens"
    ranks = f" in {processes} processes" if processes > 1 else ""
    return (f"memory: a step at its longest ({run.sequences} sequences of {run.prompt_len} prompt + {run.response_len} response "
            f"tokens{ranks}) needs about {need / gib:.1f} GiB by the planner, more than the {available / gib:.1f} GiB "
            f"this process can have here; the kernel may kill the run without a message. Set {fix} "
            f"(cohortrl plan --config shows the breakdown)")


class NonfiniteGuard:
    """Counts steps with skipped (non-finite) updates, saves their samples, and stops the run after
    ``max_in_a_row`` such steps in a row (0: never stop)."""

    def __init__(self, run_dir: Path, max_in_a_row: int, rank: int = 0):
        self.dir = Path(run_dir) / "nonfinite"
        self.rank = rank  # under torchrun each rank saves its own rows
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def after_step(self, step: int, stats: dict, batch) -> None:
        """``stats`` is the update's metrics (with ``skipped_nonfinite``), ``batch`` the step's ScoredBatch."""
        skipped = stats["skipped_nonfinite"]
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        path = self._save(step, stats, batch)
        log.warning("step %d: %d update(s) with a non-finite loss or gradient skipped; samples in %s", step, skipped, path)
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise NonfiniteError(
                f"{self.in_a_row} steps in a row (steps {step - self.in_a_row + 1}-{step}) had a non-finite loss or "
                f"gradient and were skipped (train.max_nonfinite_steps={self.max_in_a_row}); their samples are in "
                f"{self.dir}. Lower optim.lr, check the reward functions and data, or raise train.max_nonfinite_steps"
            )

    def _save(self, step: int, stats: dict, batch) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / (f"step_{step:06d}.jsonl" if self.rank == 0 else f"step_{step:06d}.rank{self.rank}.jsonl")
        rollout = batch.rollout
        numbers = {k: stats.get(k) for k in ("loss", "policy_loss", "grad_norm", "skipped_nonfinite")}
        with path.open("w") as f:
            for i, row in enumerate(rollout.rows):
                sample = {
                    "step": step, "index": i, "prompt": row["prompt"], "completion": rollout.completions[i],
                    "reward": batch.rewards[i], "rewards": {k: v[i] for k, v in batch.per_fn.items()}, **numbers,
                }
                f.write(json.dumps(sample) + "\n")
        return path

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row = state.get("in_a_row", 0)
