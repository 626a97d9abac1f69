"""A run's numbers: how a step's row is assembled (``step_metrics``, with the update's sums in
``UpdateTotals``), and where rows go: ``RUN_DIR/metrics.jsonl`` (one row per step, each with its ``step``) and
``RUN_DIR/curves.png``; TensorBoard and Weights & Biases are callbacks (``callbacks.py``)."""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and the rollout are imported inside the functions that need them: ``cohortrl plot`` and ``cohortrl
# report`` read metrics.jsonl through this module and start in a fraction of the time without them.


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhaseTimer:
    """Wall time per named phase of a step: ``with timer("generate"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


class MetricsLog:
    """Append-only JSONL log (``metrics.jsonl``, or ``name``: ``grader_errors.jsonl``). On resume, rows after the
    checkpoint's step are dropped: they belong to work the crashed run did after its last checkpoint, which the
    resumed run does again."""

    def __init__(self, run_dir: Path, name: str = "metrics.jsonl"):
        self.path = Path(run_dir) / name

    def truncate_after(self, step: int) -> None:
        """Keep the rows up to ``step``. A process killed mid-write leaves a torn last line (no newline), which
        is dropped; the file is replaced atomically, so a crash here loses nothing either."""
        if not self.path.exists():
            return
        text = self.path.read_text()
        lines = text.split("\n")[:-1]  # a torn last line has no newline: the split leaves it in [-1]
        kept = [line for line in lines if line and json.loads(line)["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: is it a cohortrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


CURVES = [
    ("reward_mean", "reward (mean)"),
    ("accuracy", "accuracy (train samples)"),
    ("kl", "KL to reference"),
    ("response_length_mean", "response length (tokens)"),
    ("zero_variance_frac", "zero-variance groups (fraction)"),
]
# A supervised run (cohortrl sft) logs no rewards: its own curves.
SFT_CURVES = [
    ("loss", "loss (completion tokens)"),
    ("grad_norm", "gradient norm"),
    ("lr", "learning rate"),
    ("tokens", "loss tokens per step"),
]


def plot_accuracy(ax, evals: list[dict], key: str, label: str, **style) -> None:
    """Held-out ``key`` per step on ``ax``, with its 95% interval as error bars where logged (``style``: more
    keyword arguments for ``errorbar``, e.g. a colour)."""
    pts = [r for r in evals if key in r]
    if not pts:
        return
    yerr = None
    if all(f"{key}_ci_low" in r and f"{key}_ci_high" in r for r in pts):
        yerr = [[r[key] - r[f"{key}_ci_low"] for r in pts], [r[f"{key}_ci_high"] - r[key] for r in pts]]
    ax.errorbar([r["step"] for r in pts], [r[key] for r in pts], yerr=yerr, marker="o", capsize=3, label=label, **style)


def plot_curves(run_dir: Path) -> Path:
    """Write ``RUN_DIR/curves.png``: training curves over steps, with held-out accuracy where evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    curves = CURVES if any("reward_mean" in r for r in rows) else SFT_CURVES
    train = [r for r in rows if curves[0][0] in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax in axes.flat[len(curves):-1]:
        ax.axis("off")
    for ax, (key, title) in zip(axes.flat, curves):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
    ax = axes.flat[-1]
    for key, label in (("eval/accuracy", "greedy"), ("eval/sampled_accuracy", "sampled")):
        plot_accuracy(ax, evals, key, label)
    if evals:
        ax.legend()
    ax.set_title("held-out accuracy (95% CI)")
    ax.set_xlabel("step")
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------- a step's row
class UpdateTotals:
    """Sums over an update's micro-batches (this process's rows), reduced over ranks into the step's loss,
    policy loss, entropy, clip fractions, the algorithm's per-token numbers and the grad norms."""

    def __init__(self):
        self.sums = {"policy_loss": 0.0, "loss": 0.0, "entropy": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0}
        self.token_sums: dict[str, float] = defaultdict(float)  # the algorithm's per-token metrics
        self.grad_norms: dict[str, list[float]] = defaultdict(list)
        self.n_updates, self.token_count, self.skipped, self.replayed = 0, 0, 0, 0

    def add_policy(self, mb, loss_BT, entropy_BT, pg_metrics: dict) -> None:
        """The clipped surrogate's numbers on micro-batch ``mb`` (a ``step.MicroBatch``)."""
        import torch

        from cohortrl.algorithms import masked_sum

        w, n_loss_tokens = mb.weights, int(mb.loss_mask.sum())
        self.sums["policy_loss"] += torch.where(w != 0, w * loss_BT.detach(), 0.0).sum().item()
        self.sums["entropy"] += masked_sum(entropy_BT, mb.response_mask).item()
        self.sums["clip_frac_low"] += pg_metrics["clip_frac_low"] * n_loss_tokens
        self.sums["clip_frac_high"] += pg_metrics["clip_frac_high"] * n_loss_tokens

    def add_extra(self, mb, metrics_BT: dict) -> None:
        """The algorithm's per-token numbers (the algorithm's ``extra_loss`` metrics), summed over response tokens."""
        from cohortrl.algorithms import masked_sum

        for name, value_BT in metrics_BT.items():
            self.token_sums[name] += masked_sum(value_BT.detach(), mb.response_mask).item()

    def add_loss(self, mb, loss: float) -> None:
        self.sums["loss"] += loss
        self.token_count += int(mb.response_mask.sum())

    def add_update(self, finite: bool, norms: dict[str, float]) -> None:
        self.n_updates += 1
        if not finite:
            self.skipped += 1
            return
        for metric, norm in norms.items():
            self.grad_norms[metric].append(norm)

    def result(self, d, n_loss_tokens: int, trained_metrics: list[str], train_policy: bool) -> dict:
        """The update's part of the step's row, over every rank. ``n_loss_tokens``: the whole batch's loss
        tokens times the epochs (the clip fractions' denominator); ``trained_metrics``: the grad-norm names
        of the models this update trained."""
        sums = d.sum(self.sums)
        for key in ("loss", "policy_loss"):  # weighted by world-scaled weights: back to the global aggregate
            sums[key] /= d.world
        token_sums = d.sum(dict(self.token_sums))
        token_count = d.sum({"n": self.token_count})["n"]
        n_loss_tokens = max(1, n_loss_tokens)
        policy = {
            "policy_loss": sums["policy_loss"] / self.n_updates,
            **{k: v / max(1, token_count) for k, v in token_sums.items()},
            "entropy": sums["entropy"] / max(1, token_count),
            "clip_frac_low": sums["clip_frac_low"] / n_loss_tokens,
            "clip_frac_high": sums["clip_frac_high"] / n_loss_tokens,
        }
        if not train_policy:  # nothing was measured: None, not a misleading 0
            policy.update(policy_loss=None, entropy=None, clip_frac_low=None, clip_frac_high=None, grad_norm=None)
        return {
            "loss": sums["loss"] / self.n_updates,
            **policy,
            **{m: mean(self.grad_norms[m]) for m in trained_metrics},  # None when every update was skipped
            "skipped_nonfinite": self.skipped,
            "rollout_forward_reused": self.replayed,  # updates that differentiated decoding's forward (train.reuse_rollout_forward)
        }


def step_metrics(d, batch, rewards_B, keep_B, targets, update: dict, *, group_size: int,
                 correctness: str, lr: float, timer: PhaseTimer, started: float, grader_errors: int,
                 levels: list[int] = ()) -> dict:
    """A step's row of ``metrics.jsonl``, over the whole batch (every rank's rows under torchrun): rewards
    per function, accuracy, zero-variance groups, lengths, the algorithm's numbers (``targets.metrics``),
    the process rewards' (``batch.process_metrics``), the update's (``UpdateTotals.result``), LR, timings, memory;
    on a mix of ``levels`` (``data.levels``), each level's accuracy and share of the advantage (``by_level``)."""
    from cohortrl.algorithms import masked_sum
    from cohortrl.rollout.tools import tool_metrics

    rollout, response_mask = batch.rollout, batch.rollout.response_mask
    rewards_all = d.gather_rows(rewards_B)
    per_fn = {k: d.gather_list(v) for k, v in batch.per_fn.items()}
    zero_variance = d.gather_rows(batch.zero_variance.long())
    lengths = d.gather_rows(rollout.lengths).float()
    counts = d.sum({
        "tokens": float(response_mask.sum()), "kept": float(keep_B.sum()), "truncated": float(rollout.truncated.sum()),
        "prompts_truncated": float(batch.prompts_truncated),
        "advantage_abs": masked_sum(targets.advantages.abs(), response_mask).item(),
    })
    elapsed = time.perf_counter() - started
    G = group_size
    return {
        "reward_mean": rewards_all.mean().item(),
        "reward_std": rewards_all.std().item() if len(rewards_all) > 1 else 0.0,
        **{f"reward/{k}_mean": mean(v) for k, v in per_fn.items()},
        **{f"reward/{k}_std": _std(v) for k, v in per_fn.items()},
        "accuracy": mean(per_fn[correctness]),
        # A group of one response has no variance to speak of (PPO with G = 1): None, not a misleading 1.
        "zero_variance_frac": batch.zero_variance_first_draw if G > 1 else None,
        "zero_variance_groups": int(zero_variance.sum()) if G > 1 else None,
        "resample_draws": batch.draws - 1,
        **({} if batch.retired_prompts is None else {"retired_prompts": batch.retired_prompts}),
        "prompts_truncated": int(counts["prompts_truncated"]),
        "trained_responses": int(counts["kept"]),
        "advantage_abs_mean": counts["advantage_abs"] / max(1.0, counts["tokens"]),
        **targets.metrics,
        **batch.process_metrics,
        "response_length_mean": lengths.mean().item(),
        # Split by outcome (correct at >= 1, as evaluation counts it): the length biases of per-sequence
        # normalisation (Dr. GRPO, arXiv 2503.20783) show as incorrect responses growing longer.
        **_lengths_by_outcome(lengths, per_fn[correctness]),
        "response_length_max": lengths.max().item(),
        "truncation_rate": counts["truncated"] / len(lengths),
        **error_categories(d, rollout),
        **tool_metrics(rollout, d.sum),
        **update,
        "lr": lr,
        **{f"time/{k}": v for k, v in timer.seconds.items()},
        "time/step": elapsed,
        "tokens_per_s": counts["tokens"] / elapsed,
        "peak_rss_mb": peak_rss_mb(),
        "grader_errors": grader_errors,  # built-in graders that raised: scored 0
        **(by_level(d, rollout, batch.per_fn[correctness], targets.advantages, levels) if len(levels) > 1 else {}),
    }


def by_level(d, rollout, correctness_B: list, advantages_BT, levels: list[int]) -> dict:
    """Where a step's weight goes on a mix of difficulty levels: per level, the batch's accuracy, the mean
    |advantage| per response token, and the level's share of the batch's Σ|advantage| over response tokens.
    Dividing by the group's std gives a hard level's rare right answer a large advantage (1/σ grows as the success
    rate p → 0); without it the advantage is r − mean, at most 1 − p (Dr. GRPO, arXiv 2503.20783, §3.1)."""
    from cohortrl.algorithms import masked_sum

    row_levels = [(row.get("sample") or {}).get("level") for row in rollout.rows]
    abs_B = masked_sum(advantages_BT.abs(), rollout.response_mask, dim=-1).tolist()
    tokens_B = rollout.response_mask.sum(-1).tolist()
    totals = {}
    for k in levels:
        rows = [i for i, level in enumerate(row_levels) if level == k]
        totals |= {f"n{k}": float(len(rows)), f"right{k}": float(sum((correctness_B[i] or 0.0) >= 1.0 for i in rows)),
                   f"abs{k}": float(sum(abs_B[i] for i in rows)), f"tokens{k}": float(sum(tokens_B[i] for i in rows))}
    totals = d.sum(totals)  # the same keys on every rank: the configured levels
    whole = sum(totals[f"abs{k}"] for k in levels)
    out = {}
    for k in levels:
        n, tokens = totals[f"n{k}"], totals[f"tokens{k}"]
        out[f"level{k}/accuracy"] = totals[f"right{k}"] / n if n else None
        out[f"level{k}/advantage_abs_mean"] = totals[f"abs{k}"] / tokens if tokens else None
        out[f"level{k}/advantage_share"] = totals[f"abs{k}"] / whole if whole else None
    return out


def log_grader_errors(d, grader_log: MetricsLog, step: int) -> int:
    """Append every rank's built-in grader failures since the last call to ``grader_log``
    (``grader_errors.jsonl``), tagged with ``step``; returns how many there were (they were scored 0)."""
    from cohortrl.rewards import grader_errors

    errors = d.gather_list([{"step": step, **e} for e in grader_errors.drain()])
    if d.is_main:
        for entry in errors:
            grader_log.write(entry)
    return len(errors)


def error_categories(d, rollout) -> dict:
    """On gym problems graded by keyed steps, the sampled responses' error categories as fractions
    (``error/<category>``, as evaluation logs ``eval/error/<category>`` for greedy ones), and
    ``unsupported_correct``: right by the outcome with a required step missing or wrong. Logged every step
    because gaming an outcome reward shows here while it happens (a rising ``unsupported_correct``), long
    before the held-out evaluation at the end of a run. Empty for other data."""
    from cohortrl.rewards.error_categories import category_fractions, row_category
    from cohortrl.rewards.grader_errors import contained

    kinds = d.gather_list([contained("error_categories", row["prompt"], text, lambda: row_category(row, text), None)
                           for row, text in zip(rollout.rows, rollout.completions)])
    graded = [k for k in kinds if k is not None]
    return category_fractions(graded) if graded else {}


def mean(values: list) -> float | None:
    """Mean of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _std(values: list) -> float | None:
    """Sample std of the values a reward function returned (None where it did not apply)."""
    import torch

    vals = torch.tensor([v for v in values if v is not None])
    return vals.std().item() if len(vals) > 1 else None


def _lengths_by_outcome(lengths: torch.Tensor, correctness: list) -> dict:
    """Mean response length of the correct and of the incorrect responses (None where there are none)."""
    pairs = [(float(n), c is not None and c >= 1.0) for n, c in zip(lengths.tolist(), correctness)]
    right = [n for n, ok in pairs if ok]
    wrong = [n for n, ok in pairs if not ok]
    return {"response_length_correct_mean": mean(right), "response_length_incorrect_mean": mean(wrong)}
