"""Where a run's numbers go: ``RUN_DIR/metrics.jsonl`` (one row per step, each with its ``step``) and
``RUN_DIR/curves.png``; TensorBoard and Weights & Biases are callbacks (``callbacks.py``)."""

from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path


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
