"""Steps 1-2 of the RL step (``step.rl_step``): the rollout and its rewards.

``Sampler.sample`` takes P prompts from the stream, generates G responses to each with the run's rollout engine
(``rollout/engine.py``: transformers with the run's tools and CPU fast path, or vLLM), scores them with the
weighted reward functions and flags the groups whose G responses are equally correct. With ``algorithm.zero_variance: resample`` it draws again until P informative groups are
found (DAPO's dynamic sampling); with ``algorithm.retire_solved``, prompts whose groups keep being answered right by
every response leave the stream (``data.PromptStream``). Under ``reward.process`` the batch it returns carries the process reward's step
rewards (``Sampler.score_steps``); a batch is never changed once built. Under torchrun every rank generates its
share of the groups in one batched call, each group seeded by its global index, and the zero-variance flags are
gathered over all ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import torch

from cohortrl import distributed
from cohortrl.rewards.process import guard_steps, step_detectors
from cohortrl.rewards.scoring import RewardFunctionError, TrainerState, rollout_columns, score_rollout
from cohortrl.rollout.types import Rollout
from cohortrl.step_spans import step_end_tokens
from cohortrl.trainers import faults

log = logging.getLogger("cohortrl")


@dataclass(frozen=True)
class ScoredBatch:
    """One step's rollout with its rewards, as sampled and scored; never changed once built (``dataclasses.replace``
    makes the batch with the step rewards)."""

    rollout: Rollout
    rewards: list[float]  # (B,) weighted total reward
    per_fn: dict[str, list[float | None]]  # each reward function's values, (B,) each
    zero_variance: torch.Tensor  # (P,) bool: all G responses of the group equally correct
    zero_variance_first_draw: float  # fraction of zero-variance groups in the step's first draw
    draws: int  # prompt batches generated this step (1 unless resampling)
    prompts_truncated: int = 0  # prompts cut to data.max_prompt_tokens (overlong_prompts=truncate), all draws
    step_rewards: list[list[float]] | None = None  # (B, S_i) guarded step rewards (reward.process), else None
    step_ends: list[list[int]] | None = None  # (B, S_i) response-token index where each step ends
    process_metrics: dict = field(default_factory=dict)  # the step detectors' numbers (reward.process)
    retired_prompts: int | None = None  # prompts out of the stream after this step (algorithm.retire_solved), else None


def reward_pool(cfg, in_memory: dict):
    """Worker processes for the reward functions that can be loaded by name (``reward.workers`` > 0)."""
    if not cfg.reward.workers:
        return None
    from cohortrl.rewards.pool import RewardPool

    specs = [(f.name, f.kwargs) for f in cfg.reward.functions if f.name not in in_memory]
    if not specs:
        return None
    return RewardPool(specs, cfg.reward.workers, cfg.reward.timeout_s)


class Sampler:
    """The policy's rollout on the stream's prompts, scored. It holds what sampling needs besides the policy:
    the prompt stream, the rollout engine (``engine``, a ``rollout.engine.RolloutEngine``), the reward functions
    (``correctness`` decides zero variance), the reward workers (``pool``) and the process reward (``process``)."""

    def __init__(self, cfg, dist, model, tokenizer, stream, engine, rewards, correctness, *, pool=None, process=None):
        self.cfg, self.sampling, self.dist = cfg, cfg.sampling, dist
        self.model, self.tokenizer, self.stream, self.engine = model, tokenizer, stream, engine
        self.rewards, self.correctness = rewards, correctness
        self.pool, self.process = pool, process
        self._engine_stale = False  # the policy changed since the engine last got its weights

    def policy_updated(self) -> None:
        """The policy's weights changed (an optimiser step, or a resume's checkpoint loaded): an engine with its
        own copy of them (vLLM) needs them again before it samples."""
        self._engine_stale = self.engine.syncs_weights

    def close(self) -> None:
        self.engine.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def trainer_state(self, step: int) -> TrainerState:
        """What reward functions get as ``trainer_state`` (TRL's argument): steps done and the run's total."""
        return TrainerState(global_step=step, max_steps=self.cfg.train.steps)

    def sample(self, step: int, timer, record: bool = False) -> ScoredBatch:
        """P groups of G responses, scored, at training step ``step`` (steps done before it); with
        ``algorithm.zero_variance: resample``, more draws until P informative groups are found; then the step
        rewards under ``reward.process``. ``record``: the lean decoder keeps its forward for the update to
        differentiate (``cpu/replay.py``)."""
        batch, zero_all = self._draw(step, timer, 0, record)
        if self.cfg.algorithm.zero_variance == "resample":
            batch = self._resample(step, timer, [(batch, zero_all)])
        if self.process is not None:
            with timer("score_steps"):
                batch = self.score_steps(batch, step)
        if self.cfg.algorithm.retire_solved:
            batch = dataclasses.replace(batch, retired_prompts=len(self.stream.retired))
        return batch

    def _draw(self, step: int, timer, k: int, record: bool, first_frac: float | None = None) -> tuple[ScoredBatch, torch.Tensor]:
        """Draw ``k`` (0 first) of the step's prompt batches: this rank's groups generated and scored, and every
        group's zero-variance flag (P,). Under torchrun each rank generates its share, each group seeded by its
        global index (``distributed.group_seed``), so sampling does not depend on the number of processes."""
        a, d = self.cfg.algorithm, self.dist
        P, G = a.prompts_per_step, a.group_size
        local = d.local_groups(P)
        rows = self.stream.take(P)
        faults.point("generate")
        group_ids = range(k * P + local.start, k * P + local.stop) if d.launched else None  # one process: the run's stream
        rollout, rewards, per_fn, n_trunc = self._rollout_and_score(step, [rows[g] for g in local], timer, group_ids, record)
        correct_PG = torch.tensor([v or 0.0 for v in per_fn[self.correctness.name]]).view(-1, G)
        zero_local = (correct_PG == correct_PG[:, :1]).all(-1)
        zero_all = d.gather_rows(zero_local.long()).bool()
        if a.retire_solved:  # every rank took the same P rows, so each tells its own stream the same groups
            solved_all = d.gather_rows((correct_PG >= 1).all(-1).long()).bool()
            self.stream.solved([rows[g] for g in range(P) if solved_all[g]])
        first_frac = zero_all.float().mean().item() if first_frac is None else first_frac
        return ScoredBatch(rollout, rewards, per_fn, zero_local, first_frac, k + 1, n_trunc), zero_all

    def _resample(self, step: int, timer, draws: list[tuple[ScoredBatch, torch.Tensor]]) -> ScoredBatch:
        """DAPO dynamic sampling: draw more prompt batches (at most ``max_resample_draws`` extra) until P
        informative groups are found. They are chosen over the whole batch in draw order, then dealt out again
        so that every rank trains on an equal share."""
        a, d = self.cfg.algorithm, self.dist
        P, G = a.prompts_per_step, a.group_size
        first = draws[0][0]

        def first_draw_only() -> ScoredBatch:  # nothing informative to train on: the first draw, where only KL acts
            return dataclasses.replace(first, draws=len(draws), prompts_truncated=sum(b.prompts_truncated for b, _ in draws))

        while True:
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
            draws.append(self._draw(step, timer, len(draws), False, first.zero_variance_first_draw))
        chosen = [(k, g) for k, (_, z) in enumerate(draws) for g in range(P) if not z[g]][:P]
        if len(chosen) % d.world:
            log.warning("resample: %d informative group(s) do not split over %d processes; the last %d are not trained on",
                        len(chosen), d.world, len(chosen) % d.world)
            chosen = chosen[: len(chosen) - len(chosen) % d.world]
            if not chosen:
                return first_draw_only()
        local = d.local_groups(P)
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
        per_fn = {name: [x for _, _, _, fn in share for x in fn[name]] for name in first.per_fn}
        return ScoredBatch(rollout, rewards, per_fn, torch.zeros(len(share), dtype=torch.bool), first.zero_variance_first_draw,
                           len(draws), sum(b.prompts_truncated for b, _ in draws))

    def _rollout_and_score(self, step: int, rows: list[dict], timer, group_ids: range | None, record: bool):
        """G responses for each row, scored: (rollout, total rewards, each function's values, prompts truncated)."""
        if self._engine_stale:  # vLLM: the policy changed since the engine last got its weights
            with timer("weight_sync"):
                self.engine.sync_weights(self.model)
            self._engine_stale = False
        state = self.trainer_state(step)
        parts, jobs = [], []
        with self.dist.gathered(self.model):  # FSDP2: ranks run different numbers of decoding steps
            for chunk, seeds in self._generation_chunks(step, rows, group_ids):
                with timer("generate"):
                    rollout, n_trunc = self._generate(chunk, seeds, record)
                parts.append((rollout, n_trunc))
                if self.pool is not None:  # reward workers score this chunk while the next one is generated
                    cols = rollout_columns(rollout, self.sampling.max_new_tokens, state)
                    jobs.append(self.pool.submit([r["prompt"] for r in rollout.rows], rollout.completions, cols))
        n_truncated = sum(n for _, n in parts)
        parts = [r for r, _ in parts]
        if n_truncated:
            log.warning("%d prompt(s) truncated to data.max_prompt_tokens=%d", n_truncated, self.cfg.data.max_prompt_tokens)
        rollout = parts[0] if len(parts) == 1 else Rollout.concat(parts, self.tokenizer.pad_token_id)
        with timer("score"):
            computed = None
            if jobs:
                results = [self.pool.result(job) for job in jobs]
                computed = {name: [v for res in results for v in res[name]] for name in results[0]}
            rewards, per_fn = score_rollout(self.rewards, rollout, self.sampling.max_new_tokens, computed, state)
        return rollout, rewards, per_fn, n_truncated

    def _generation_chunks(self, step: int, rows: list[dict], group_ids: range | None) -> list[tuple[list[dict], list[int] | None]]:
        """The rows cut into generation calls, each with its rows' sampling seeds (None: the run's random stream).
        One call normally; two halves with a reward pool, whose scoring of the first then runs while the second
        is generated. Under torchrun (``group_ids``: the rows' global group indices) each row is seeded by its
        group's index (``distributed.group_seed``), so a group's random draws depend neither on the number of
        processes nor on the other groups in its call; its logits still do, to float rounding (left-padding to the
        call's longest prompt, kernels chosen by batch size), so its tokens can differ where a draw lies that close
        to a boundary."""
        seeds = None if group_ids is None else [distributed.group_seed(self.cfg.train.seed, step, g) for g in group_ids]
        if self.pool is not None and len(rows) > 1:
            half = (len(rows) + 1) // 2
            return [(rows[:half], None if seeds is None else seeds[:half]),
                    (rows[half:], None if seeds is None else seeds[half:])]
        return [(rows, seeds)]

    def _generate(self, rows: list[dict], seeds: list[int] | None, record: bool):
        cfg = self.cfg
        return self.engine.generate(rows, cfg.algorithm.group_size, self.sampling, system_prompt=cfg.model.system_prompt,
                                    max_prompt_tokens=cfg.data.max_prompt_tokens,
                                    overlong_prompts=cfg.data.overlong_prompts, seeds=seeds, record=record)

    def score_steps(self, batch: ScoredBatch, step: int) -> ScoredBatch:
        """``batch`` with its ``step_rewards`` / ``step_ends`` from the process reward function (guarded, see
        ``rewards/process.py``) and the step detectors' metrics (over the whole batch) as its ``process_metrics``."""
        p, rollout = self.cfg.reward.process, batch.rollout
        prompts = [r["prompt"] for r in rollout.rows]
        cols = rollout_columns(rollout, self.sampling.max_new_tokens, self.trainer_state(step))
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
            char_ends = rollout.char_ends(i, self.tokenizer)  # every token of the text, tool turns included
            stated = iter(step_end_tokens([span for _, span in guarded if span is not None], char_ends))
            last = max(0, len(char_ends) - 1)  # a required step never stated counts on the last token
            step_rewards.append([score for score, _ in guarded])
            step_ends.append([next(stated) if span is not None else last for _, span in guarded])
        learned = self.process.update(rollout, batch.per_fn[self.correctness.name])  # a PRM that learns online
        d = self.dist
        metrics = {**step_detectors(
            d.gather_list(rollout.completions), d.gather_list(step_rewards),
            d.gather_list(batch.per_fn[self.correctness.name]), p.coef,
        ), **learned}
        return dataclasses.replace(batch, step_rewards=step_rewards, step_ends=step_ends, process_metrics=metrics)
