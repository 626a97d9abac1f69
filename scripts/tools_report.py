"""Issue 25's table (docs/tools.md), from the runs of scripts/tools_study.sh:

    .venv/bin/python scripts/tools_report.py runs/tools_axial_stress3 docs/tools/axial3.md

For each arm (calc: the warm start in the calculator's call form, with the calculator; plain: the same
references with the arithmetic written out, no tools) and seed: held-out strict accuracy with its 95% Wilson
interval, the grader's error categories, tool calls and response length, the run's CPU time; then each arm's
mean and spread over seeds and the per-problem agreement between seeds. Every number is read from the files."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cohortrl.rewards.error_categories import CATEGORIES  # noqa: E402
from eng_report import accuracy, final_responses, read_jsonl  # noqa: E402  (scripts/, this file's own folder)

ARMS = (("calc", "with the calculator"), ("plain", "without tools"))


def cpu_time(log: Path) -> tuple[float, str]:
    """User CPU seconds and wall times of the SFT run (evaluation included), summed over the log's /usr/bin/time
    reports under its `== NAME: sft` headers (a resumed run has several; another command's report is left out)."""
    text = "".join(part for part in re.split(r"(?m)^(?===)", log.read_text()) if re.match(r"== \S+: sft", part))
    user = sum(float(x) for x in re.findall(r"User time \(seconds\): ([\d.]+)", text))
    walls = re.findall(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    return user, " + ".join(walls)


def runs(root: Path):
    for arm, label in ARMS:
        for seed in range(10):
            run = root / f"{arm}_s{seed}"
            if not (run / "final").is_dir():
                continue
            last = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r][-1]
            yield arm, label, seed, last, final_responses(run)


def main(root: Path, out: Path) -> None:
    lines = [f"# With and without the calculator: `{root.name}`", "",
             f"Written by `scripts/tools_report.py {root} {out}` from the runs of `scripts/tools_study.sh`.", "",
             "| arm | seed | strict accuracy (95% CI) | " + " | ".join(CATEGORIES) + " | tool calls / response | "
             "response tokens | user CPU (s) | wall |",
             "|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|---|---|"]
    by_arm: dict[str, list[float]] = {}
    solved: dict[str, list[set[str]]] = {}
    n_eval = set()
    for arm, label, seed, last, rows in runs(root):
        acc, lo, hi, n = accuracy(rows)
        n_eval.add(n)
        counts = {c: sum(r.get("category") == c for r in rows) for c in CATEGORIES}
        user, wall = cpu_time(root / f"{arm}_s{seed}.log")
        lines.append(f"| {label} | {seed} | {acc:.3f} ({lo:.3f}-{hi:.3f}) | "
                     + " | ".join(str(counts[c]) for c in CATEGORIES)
                     + f" | {last.get('eval/tool_calls_per_response', 0.0):.2f} | {last['eval/response_length_mean']:.1f}"
                     f" | {user:,.0f} | {wall} |")
        by_arm.setdefault(label, []).append(acc)
        solved.setdefault(label, []).append({r["prompt"] for r in rows if r["correct"]})
    lines += ["", f"Held-out problems per evaluation: {sorted(n_eval)}.", "",
              "| arm | seeds | mean accuracy | sd over seeds | min-max | problems solved by every seed | by any seed |",
              "|---|---|---|---|---|---|---|"]
    for label, accs in by_arm.items():
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        every, anyone = set.intersection(*solved[label]), set.union(*solved[label])
        lines.append(f"| {label} | {len(accs)} | {statistics.mean(accs):.3f} | {sd:.3f} | {min(accs):.3f}-{max(accs):.3f} "
                     f"| {len(every)} | {len(anyone)} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
