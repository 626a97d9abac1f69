"""``cohortrl report RUN_DIR... --out docs/NAME``: several runs side by side, from their ``metrics.jsonl``
(and ``config.yaml``, for the rollout budget).

Writes ``NAME.png`` (held-out accuracy with its 95% interval, reward, and the step-reward hacking detectors
per step, one line per run) and ``NAME.md`` (a summary table, one row per run). Every number in the table is
computed from the files: nothing is estimated. ``--panels KEY...`` plots other logged step metrics instead of
the detectors (e.g. ``kl response_length_correct_mean``), and the table then gives each one's mean over the
first and over the last K steps.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cohortrl.trainers.metrics import plot_accuracy, read_metrics

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("steps_per_response", "steps per response"),
    ("unique_step_ratio", "unique-step ratio"),
    ("step_outcome_corr", "step reward vs outcome (Pearson r)"),
    ("step_reward_share", "share of reward from steps"),
]
DETECTORS = ["steps_per_response", "unique_step_ratio", "step_outcome_corr", "step_reward_share"]


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarise(run_dir: Path, last_k: int = 5, keys: list[str] | None = None) -> dict:
    """The numbers of one run's summary row (None where the run did not log them). ``keys``: step metrics
    summarised as (mean over the first ``last_k`` steps, mean over the last ``last_k``)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    out: dict = {"name": Path(run_dir).name, "steps": max((r["step"] for r in train), default=0)}
    if evals:
        first, final = evals[0], evals[-1]
        best = max(evals, key=lambda r: (r["eval/accuracy"], -r["step"]))  # the earliest of equal bests
        for tag, r in (("start", first), ("final", final), ("best", best)):
            out[tag] = (r["eval/accuracy"], r.get("eval/accuracy_ci_low"), r.get("eval/accuracy_ci_high"), r["step"])
    out["reward_last_k"] = _mean([r["reward_mean"] for r in train[-last_k:]])
    for key in DETECTORS:
        out[key] = _mean([r.get(key) for r in train])
    for key in keys or []:
        out[key] = (_mean([r.get(key) for r in train[:last_k]]), _mean([r.get(key) for r in train[-last_k:]]))
    out["wall_s"] = sum(r.get("time/step", 0.0) for r in train)
    config = Path(run_dir) / "config.yaml"
    out["responses"] = None
    if config.is_file():
        algorithm = (yaml.safe_load(config.read_text()) or {}).get("algorithm", {})
        per_draw = algorithm.get("prompts_per_step", 0) * algorithm.get("group_size", 0)
        out["responses"] = sum((r.get("resample_draws") or 0) + 1 for r in train) * per_draw or None
    return out


def _num(x, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _acc(entry) -> str:
    if entry is None:
        return "–"
    acc, lo, hi, step = entry
    ci = f" ({lo:.3f}–{hi:.3f})" if lo is not None and hi is not None else ""
    return f"{acc:.3f}{ci} @{step}"


def markdown_table(summaries: list[dict], last_k: int, keys: list[str] | None = None) -> str:
    middle = [f"{k}, first → last {last_k} steps" for k in keys] if keys else [
        "steps/response", "unique-step ratio", "step–outcome r", "step-reward share"]
    head = ["run", "steps", "held-out acc. at start (95% CI) @step", "final", "best", f"reward, last {last_k} steps",
            *middle, "train wall s", "responses sampled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        columns = [f"{_num(s[k][0])} → {_num(s[k][1])}" for k in keys] if keys else [_num(s[k]) for k in DETECTORS]
        cells = [s["name"], str(s["steps"]), _acc(s.get("start")), _acc(s.get("final")), _acc(s.get("best")),
                 _num(s["reward_last_k"]), *columns, _num(s["wall_s"], ".1f"), _num(s["responses"], "d")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(run_dirs: list[Path], out: Path, last_k: int = 5, panels: list[str] | None = None) -> tuple[Path, Path]:
    """``out.png`` and ``out.md`` for ``run_dirs`` (``out`` without its suffix); returns both paths.
    ``panels``: step metrics to plot (after held-out accuracy and reward) instead of the hacking detectors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.lines
    import matplotlib.pyplot as plt

    out = Path(out)
    out = out.with_suffix("") if out.suffix in (".md", ".png") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    chosen = [("reward_mean", "reward (mean)"), *((k, k) for k in panels)] if panels else PANELS
    n_rows = (len(chosen) + 1 + 2) // 3
    fig, axes = plt.subplots(n_rows, 3, figsize=(14, 3.75 * n_rows), squeeze=False)
    colours = [f"C{i % 10}" for i in range(len(runs))]  # one colour per run on every panel
    ax = axes.flat[0]
    for (run_dir, rows), colour in zip(runs, colours):
        plot_accuracy(ax, [r for r in rows if "eval/accuracy" in r], "eval/accuracy", run_dir.name, color=colour)
    ax.set_title("held-out accuracy (greedy, 95% CI)")
    for ax, (key, title) in zip(axes.flat[1:], chosen):
        for (run_dir, rows), colour in zip(runs, colours):
            pts = [(r["step"], r[key]) for r in rows if "reward_mean" in r and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", color=colour)
        ax.set_title(title)
    for ax in axes.flat:
        ax.set_xlabel("step")
    for ax in axes.flat[len(chosen) + 1:]:  # the grid's leftover cells
        ax.set_visible(False)
    handles = [matplotlib.lines.Line2D([], [], color=c, marker="o") for c in colours]
    fig.legend(handles, [d.name for d, _ in runs], loc="lower center", ncol=max(1, len(runs)))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=90)
    plt.close(fig)

    summaries = [summarise(d, last_k, panels) for d, _ in runs]
    md = out.with_suffix(".md")
    dirs = " ".join(str(d) for d, _ in runs)
    md.write_text(
        f"# {out.name}\n\n![curves]({png.name})\n\n{markdown_table(summaries, last_k, panels)}\n\n"
        "Held-out accuracy: greedy, on the run's held-out prompts, with the Wilson 95% interval, at the step "
        "shown. " + (f"Metric columns: mean over the first and over the last {last_k} training steps (– where not "
                     "logged). " if panels else "Detector columns: means over all training steps (– where not logged). ")
        + "Train wall s: the "
        "training steps' time (evaluations excluded). Responses sampled: every response generated for "
        "training, resampled draws included.\n\n"
        f"Regenerate: `cohortrl report {dirs} --out {out}" + (f" --last-k {last_k}" if last_k != 5 else "")
        + (f" --panels {' '.join(panels)}" if panels else "") + "`\n"
    )
    return png, md
