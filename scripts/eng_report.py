"""The engineering study's table and plots (docs/engineering.md), computed from the runs of scripts/eng_study.sh:

    .venv/bin/python scripts/eng_report.py runs/eng docs/engineering/axial3
    .venv/bin/python scripts/eng_report.py runs/eng_beam_bending3 docs/engineering/beam3

writes OUT.md (held-out strict accuracy of every arm with its 95% Wilson interval, the GRPO seeds' mean and
spread, accuracy by kind of problem (section shape; beam and load case), the verdicts written, error categories) and OUT.png (per-seed training curves of the RL phase:
sampled accuracy, groups with signal, response length, tool calls). Every number is read from the files."""

from __future__ import annotations

import collections
import json
import re
import statistics
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cohortrl.grading.answer_format import parse_response  # noqa: E402
from cohortrl.rewards.error_categories import CATEGORIES  # noqa: E402
from cohortrl.stats import wilson_interval  # noqa: E402
from cohortrl.tools.text import render  # noqa: E402

SHAPES = ("solid round", "hollow round", "rectangular")  # axial_stress's sections
BEAMS = ("cantilever, two point loads", "cantilever, point load + UDL", "simply supported, two point loads",
         "simply supported, point load + UDL")  # beam_bending level 3's cases


# scripts/eng_study.sh's GRPO runs by reward (REWARD=...): the run-name prefix and the table's label
# (START=sft_more: GRPO from the first control, the warm start trained further; TAG=steps: with step rewards)
GRPO_RUNS = (("grpo", "SFT + GRPO (20 steps)"), ("grpo_supported", "SFT + GRPO on the supported reward (20 steps)"),
             ("grpo_supported_from_sft_more", "the first control (SFT continued) + GRPO on the supported reward (20 steps)"),
             ("grpo_supported_steps", "SFT + GRPO on the supported reward and task_steps step rewards (grpo_combined, 20 steps)"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_responses(run: Path) -> list[dict]:
    """The greedy responses of a run's last evaluation."""
    rows = read_jsonl(run / "eval_completions.jsonl")
    last = max(r["step"] for r in rows)
    return [r for r in rows if r["step"] == last]


def arms(root: Path) -> list[tuple[str, list[dict]]]:
    found = []
    sft = "sft_axial3_e200" if (root / "sft_axial3_e200").is_dir() else "sft"  # the first study's name
    tools = ", with the calculator" if uses_tools(root / sft) else ""
    if (root / "eval_base.jsonl").is_file():
        found.append((f"base SmolLM2-135M-Instruct{tools}", read_jsonl(root / "eval_base.jsonl")))
    # `cohortrl eval` of a warm start's final/ on the RL level (scripts/eng_study.sh eval_sft): the warm start's
    # own evaluation is on its references' level, which is another level when SFT_LEVEL was set
    on_rl_level = (root / "eval_sft.jsonl").is_file()
    sft_level = sft_level_note(root / sft)
    sft_steps = warm_start_steps(root / sft)
    if on_rl_level:
        found.append((f"SFT ({sft_steps} steps{sft_level})", read_jsonl(root / "eval_sft.jsonl")))
    elif (root / sft / "eval_completions.jsonl").is_file():
        found.append((f"SFT ({sft_steps} steps{sft_level})", final_responses(root / sft)))
    for prefix, label in GRPO_RUNS:
        for seed in range(10):
            run = root / f"{prefix}_s{seed}"
            if (run / "final").is_dir():
                found.append((f"{label}, seed {seed}", final_responses(run)))
    # the controls: copies of a supervised run, resumed (sft_more continues the warm start; sft_more_more
    # continues sft_more, the start of the START=sft_more GRPO runs), each counted once it went further
    previous, run = sft_steps, f"{sft}_more"
    while (root / run).is_dir():
        more = root / run
        steps = max((r["step"] for r in read_jsonl(more / "metrics.jsonl")), default=0)
        if not ((more / "final" / "cohortrl_run.json").is_file() and steps > previous and
                json.loads((more / "final" / "cohortrl_run.json").read_text()).get("step") == steps):
            break
        start = f" from {previous}" if previous != sft_steps else ""
        name = f"SFT continued{start} to {steps} steps{sft_level} (the GRPO phase's wall time)"
        if run == f"{sft}_more" and (root / "eval_control.jsonl").is_file():
            found.append((name, read_jsonl(root / "eval_control.jsonl")))
        elif not on_rl_level:
            found.append((name, final_responses(more)))
        previous, run = steps, run + "_more"
    return found


def uses_tools(run: Path) -> bool:
    """Whether the warm start (and so every arm of its study) ran with tools (``rollout.tools``)."""
    import yaml

    config = run / "config.yaml"
    return not config.is_file() or bool((yaml.safe_load(config.read_text()).get("rollout") or {}).get("tools", True))


def warm_start_steps(run: Path) -> int:
    """The warm start's length (``train.steps`` of its config; 40, the configs' own, when it has none)."""
    import yaml

    config = run / "config.yaml"
    return yaml.safe_load(config.read_text())["train"]["steps"] if config.is_file() else 40


def sft_level_note(run: Path) -> str:
    """ ", level-K references" when the warm start's references are of another level than the RL phase's, and
    ", N references" when they are a fixed set smaller than the RL phase's prompt pool (SFT_SIZE)."""
    import yaml

    config = run / "config.yaml"
    grpo = next(iter(sorted(run.parent.glob("grpo*_s0/config.yaml"))), None)
    if not (config.is_file() and grpo is not None):
        return ""
    sft_data, rl_data = yaml.safe_load(config.read_text())["data"], yaml.safe_load(grpo.read_text())["data"]
    note = "" if sft_data["level"] == rl_data["level"] else f", level-{sft_data['level']} references"
    if sft_data.get("train_size") and sft_data["train_size"] < (rl_data.get("train_size") or 0):
        note += f", a fixed set of {sft_data['train_size']} references"
    return note


def new_units(prompt) -> bool:
    """An axial_stress problem with a unit that level 2 never uses: a size in m or the strength in GPa."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return bool(re.search(r"\d m\b", text)) or "GPa" in text


def kind(prompt) -> str:
    """The problem's section shape (axial_stress), beam and load case (beam_bending) or function
    (python_function)."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    function = re.search(r"Write a Python function\s+def (\w+)\(", text)
    if function:
        return function.group(1)
    if "beam" in text.split(".")[0] or "cantilever" in text.split(".")[0]:
        beam = "cantilever" if "cantilever" in text.split(".")[0] else "simply supported"
        loads = "point load + UDL" if "uniformly distributed" in text else "two point loads"
        return f"{beam}, {loads}"
    return next((s for s in SHAPES if s in text), "other")


def verdict_written(completion: str) -> str | None:
    """The last SAFE or FAIL a response wrote on a ``VERDICT:`` line (read as the graders read it), or None."""
    found = [v.text for v in parse_response(render(completion)).verdicts if v.text in ("SAFE", "FAIL")]
    return found[-1] if found else None


def verdict_follows_own_sigma(row: dict) -> bool | None:
    """beam_bending: whether the verdict written is the one the response's own sigma line implies (SAFE iff sigma <=
    the prompt's allowable stress), whatever that sigma's value; None without both or for other families."""
    allow = re.search(r"allowable bending stress (\d+(?:\.\d+)?) MPa", row["prompt"])
    parsed = parse_response(render(row["completion"]))
    sigma = next((s.value for s in parsed.steps if s.key == "sigma" and s.unit == "MPa"), None)
    verdict = verdict_written(row["completion"])
    if not (allow and sigma is not None and verdict):
        return None
    return (sigma <= Fraction(allow[1])) == (verdict == "SAFE")


def accuracy(rows: list[dict]) -> tuple[float, float, float, int]:
    hits = sum(r["correct"] for r in rows)
    lo, hi = wilson_interval(hits, len(rows))
    return hits / len(rows), lo, hi, len(rows)


def supported_only(rows: list[dict]) -> list[dict]:
    """The rows with a right answer that a required step does not support counted wrong."""
    return [{**r, "correct": r["correct"] and r["category"] != "unsupported"} for r in rows]


def seed_summary(values: list[float]) -> str:
    spread = f", sd {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"mean {statistics.mean(values):.3f}, range {min(values):.3f}-{max(values):.3f}{spread}"


def table(root: Path) -> str:
    found = arms(root)
    kinds_seen = {kind(r["prompt"]) for _, rows in found for r in rows}
    columns = [k for k in SHAPES + BEAMS if k in kinds_seen] + sorted(kinds_seen - set(SHAPES + BEAMS) - {"other"})
    lines = ["| " + " | ".join(["arm", "held-out strict accuracy (95% Wilson CI, n)", "supported: every required step right too",
                               *columns]) + " |", "|---|---|---|" + "---|" * len(columns)]
    for name, rows in found:
        acc, lo, hi, n = accuracy(rows)
        s_acc, s_lo, s_hi, _ = accuracy(supported_only(rows))
        by_shape = []
        for s in columns:
            sub = [r for r in rows if kind(r["prompt"]) == s]
            by_shape.append(f"{sum(r['correct'] for r in sub)}/{len(sub)}" if sub else "-")
        lines.append("| " + " | ".join([name, f"{acc:.3f} ({lo:.3f}-{hi:.3f}, n={n})", f"{s_acc:.3f} ({s_lo:.3f}-{s_hi:.3f})",
                                         *by_shape]) + " |")
    out = ["\n".join(lines)]
    if "solid round" in kinds_seen and any(new_units(r["prompt"]) for _, rows in found for r in rows):
        # axial_stress level 3: the units level 2 never uses (sizes in m, strength in GPa) or not
        def right(rows):
            return f"{sum(r['correct'] for r in rows)} ({sum(r['correct'] for r in supported_only(rows))})/{len(rows)}"

        units = ["| arm | a size in m or the strength in GPa | only level-2 units (mm, N or kN, MPa or N/mm^2) |",
                 "|---|---|---|"]
        for name, rows in found:
            new = [r for r in rows if new_units(r["prompt"])]
            old = [r for r in rows if not new_units(r["prompt"])]
            units.append(f"| {name} | {right(new)} | {right(old)} |")
        out.append("By units, right answers strict (supported) / problems (a level-2 warm start has never seen a size "
                   "in m or a strength in GPa):\n\n"
                   + "\n".join(units))
    verdicts = {name: collections.Counter(verdict_written(r["completion"]) for r in rows) for name, rows in found}
    if any(c.keys() - {None} for c in verdicts.values()):
        # one verdict written for every problem means the comparison was never learned (docs/engineering.md);
        # for beams, whether the verdict follows from the response's own sigma against the allowable stress
        own = {name: [v for v in map(verdict_follows_own_sigma, rows) if v is not None] for name, rows in found}
        out.append("Verdicts written (SAFE / FAIL / none), and for beams how many follow from the response's own sigma "
                   "against the allowable stress:\n\n| arm | SAFE | FAIL | none | follows its own sigma |\n|---|---|---|---|---|\n"
                   + "\n".join(f"| {name} | {c['SAFE']} | {c['FAIL']} | {c[None]} | "
                                f"{f'{sum(own[name])}/{len(own[name])}' if own[name] else '-'} |" for name, c in verdicts.items()))
    for _, label in GRPO_RUNS:
        seeds = [rows for name, rows in found if name.startswith(label + ", seed")]
        if seeds:
            out.append(f"{label} over {len(seeds)} seed(s): strict {seed_summary([accuracy(r)[0] for r in seeds])}; "
                       f"supported {seed_summary([accuracy(supported_only(r))[0] for r in seeds])}.")
    if not any(r["category"] for _, rows in found for r in rows):  # a family without error categories (code)
        return "\n\n".join(out) + "\n"
    kinds = [k for k in CATEGORIES if k != "correct"]
    cat = ["| arm | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name, rows in found:
        counts = collections.Counter(r["category"] for r in rows)
        cat.append(f"| {name} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    out.append("Greedy responses by category (`rewards/error_categories.py`; `unsupported` = right answer with a "
               "required step missing or wrong):\n\n" + "\n".join(cat))
    return "\n\n".join(out) + "\n"


def plot(root: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # "accuracy" is the reward's own field: the strict outcome, or the supported one in grpo_supported runs
    panels = [("accuracy", "sampled accuracy (32 responses, T 0.8)"),
              ("zero_variance_frac", "groups without signal (fraction)"),
              ("response_length_mean", "response length (tokens)"),
              ("tools/calls_per_response", "calculator calls per response")]
    runs = [(prefix, seed, style, [r for r in read_jsonl(path) if "reward_mean" in r])
            for (prefix, _), style in zip(GRPO_RUNS, ("-", "--", ":", "-.")) for seed in range(10)
            if (path := root / f"{prefix}_s{seed}" / "metrics.jsonl").is_file()]
    panels = [(key, title) for key, title in panels if any(key in r for *_, rows in runs for r in rows)]  # no tools: 3
    if not runs:
        print(f"{root}: no GRPO run yet, so no curves ({out} not written)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
    for prefix, seed, style, rows in runs:
        for ax, (key, title) in zip(axes, panels):
            ax.plot([r["step"] for r in rows], [r.get(key) for r in rows], style, label=f"{prefix} seed {seed}", lw=1.2)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("GRPO step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, out = Path(argv[0]), Path(argv[1])
    out.with_suffix(".md").write_text(table(root))
    plot(root, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
