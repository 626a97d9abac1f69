"""The tables of docs/engineering.md that rest on committed sweep folders, made again from those folders.

A table is marked in the doc by the line ``<!-- table NAME: scripts/eng_tables.py -->`` right above it; the table
is every line below the marker that starts with ``|``. TABLES says what each one holds: its rows (one arm of a
committed sweep folder each) and its columns (per-seed accuracy with its Wilson interval, mean and sd, the paired
comparison with another row, problems right by kind, error categories, verdicts written, CPU time). Every number
is computed from the folders' answers (``answers.jsonl.gz``), metrics and ``sweep.jsonl``, as the report computes it.

    .venv/bin/python scripts/eng_tables.py --check     # compare the doc's tables with what the folders give
    .venv/bin/python scripts/eng_tables.py             # write them into the doc

``make reports`` runs it after the reports; tests/test_eng_tables.py makes the --check comparison in the suite.
What the script does not check: the numbers in the doc's prose, and the header cells written in TABLES (such as
"n = 200" or "of 71"). Tables of the sections dated before the sweep existed (rounds 1-4 and the single-run families) rest on runs whose
per-problem answers were not kept; they are not marked, and the doc says so.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cohortrl.study import Arm, arm_summary, load_sweep, paired  # noqa: E402
from cohortrl.trainers.evaluate import read_answers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "engineering.md"
MARKER = re.compile(r"^<!-- table (\S+): scripts/eng_tables\.py -->$")
E = "docs/engineering"


@dataclass(frozen=True)
class Row:
    label: str
    folder: str  # a committed sweep folder, relative to the repository
    arm: str = "base"


@dataclass(frozen=True)
class Table:
    head: tuple[str, ...]
    columns: tuple[str, ...]  # one per header cell after the first (the row's label); see CELLS
    rows: tuple[Row, ...]


# ------------------------------------------------------------------------------------------ the numbers
_ARMS: dict[tuple[str, str], Arm] = {}


def arm_of(row: Row) -> Arm:
    key = (row.folder, row.arm)
    if key not in _ARMS:
        found = {a.name: a for a in load_sweep(REPO / row.folder)}
        if row.arm not in found:
            raise SystemExit(f"{row.folder} has no arm {row.arm!r} (it has {', '.join(found)})")
        if len(found[row.arm].runs) < 2:
            raise SystemExit(f"{row.folder}/{row.arm}: {len(found[row.arm].runs)} finished run(s); a table row needs "
                             "at least two seeds for its sd")
        _ARMS[key] = found[row.arm]
    return _ARMS[key]


@functools.lru_cache(maxsize=None)  # a table's category and verdict columns read the same runs
def _final_rows_at(path: Path) -> list[dict]:
    rows = read_answers(path)
    last = max(r["step"] for r in rows)
    return [r for r in rows if r["step"] == last]


def _minus(x: float, fmt: str) -> str:
    return format(x, fmt).replace("-", "−")


def _p(p: float) -> str:
    """Exact McNemar p as the doc writes it: three decimals, or one significant digit where that would read 0.000."""
    if p >= 0.0005:
        return f"{p:.3f}"
    mantissa, exponent = f"{p:.0e}".split("e")
    return f"{mantissa}e-{int(exponent[1:])}"


def cell_acc(arm: Arm) -> str:
    return ", ".join(f"{acc:.3f} ({lo:.3f}-{hi:.3f})" for _, acc, lo, hi, _, _ in arm_summary(arm, [], 1)["per_seed"])


def cell_sd(arm: Arm) -> str:
    return f"{arm_summary(arm, [], 1)['accuracy'][1]:.3f}"


def cell_mean_sd(arm: Arm) -> str:
    mean, sd = arm_summary(arm, [], 1)["accuracy"]
    return f"{mean:.3f}, {sd:.3f}"


def cell_cpu(arm: Arm) -> str:
    return f"{sum(r.cpu_s for r in arm.runs):,.0f}"


def cell_wall(arm: Arm) -> str:
    return ", ".join(f"{r.wall_s:,.0f}" for r in arm.runs)


def paired_cell(base: Arm, other: Arm, with_bootstrap: bool) -> str:
    """Seed k of ``other`` against seed k of ``base`` on the problems both answered (``study.paired``): only base
    right / only other right (exact McNemar p) per seed; then the paired bootstrap's mean difference and 95% interval."""
    c = paired(base, other)
    if len(c["per_seed"]) != len(other.runs):
        unpaired = sorted({r.seed for r in other.runs} - {seed for seed, *_ in c["per_seed"]})
        raise SystemExit(f"{other.runs[0].path.parent}: seed(s) {unpaired} share no problem with the row paired with")
    text = ", ".join(f"{ob}/{oo} (p = {_p(p)})" for _, _, ob, oo, p in c["per_seed"])
    if with_bootstrap:
        d, lo, hi = c["bootstrap"]
        text += f"; {_minus(d, '+.3f')} ({_minus(lo, '+.3f')} to {_minus(hi, '+.3f')})"
    return text


def kinds_right(arm: Arm, kind: str) -> str:
    from eng_kinds import held_out_kinds

    counts = []
    for run in arm.runs:
        kinds = held_out_kinds(run.path)
        counts.append(str(sum(ok for i, ok in run.answers.items() if kinds[i] == kind)))
    return ", ".join(counts)


def category_count(arm: Arm, category: str) -> str:
    return ", ".join(str(sum(r["category"] == category for r in _final_rows_at(run.path))) for run in arm.runs)


def verdicts(arm: Arm) -> str:
    from eng_report import verdict_written

    out = []
    for run in arm.runs:
        written = collections.Counter(verdict_written(r["completion"]) for r in _final_rows_at(run.path))
        out.append(f"{written['FAIL']} / {written['SAFE']}")
    return ", ".join(out)


def cell(column: str, row: Row, table: Table) -> str:
    """One cell. Columns: acc, sd, mean_sd, cpu (CPU s of the arm's runs), wall (each run's wall s), vs=LABEL (McNemar per seed), vsb=LABEL (and the bootstrap),
    kind=NAME (problems of that kind right per seed), category=NAME (answers in that error category per seed),
    verdicts (FAIL / SAFE written per seed), '-' (an empty cell, for the row the others are paired against)."""
    arm = arm_of(row)
    if column == "-":
        return "–"
    simple = {"acc": cell_acc, "sd": cell_sd, "mean_sd": cell_mean_sd, "cpu": cell_cpu, "wall": cell_wall,
              "verdicts": verdicts}
    if column in simple:
        return simple[column](arm)
    kind, _, value = column.partition("=")
    if kind in ("vs", "vsb"):
        base = next((r for r in table.rows if r.label == value), None)
        if base is None:
            raise SystemExit(f"column {column!r}: no row labelled {value!r}")
        return "–" if base == row else paired_cell(arm_of(base), arm, kind == "vsb")
    if kind == "kind":
        return kinds_right(arm, value)
    if kind == "category":
        return category_count(arm, value)
    raise SystemExit(f"unknown column {column!r}")


def render(table: Table) -> str:
    if len(table.head) != len(table.columns) + 1:
        raise SystemExit(f"a table has {len(table.head)} header cells for {len(table.columns)} columns + the label")
    lines = ["| " + " | ".join(table.head) + " |", "|" + "---|" * len(table.head)]
    for row in table.rows:
        lines.append("| " + " | ".join([row.label, *(cell(c, row, table) for c in table.columns)]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the tables
ACC = "held-out strict accuracy per seed (95% Wilson CI, n = 200, the same problems)"
ACC_L1 = "held-out strict accuracy on level 1 per seed (95% Wilson CI, n = 200)"
WS100 = Row("100 steps, 10 warm-up, cosine to 0 (Intel Xeon)", f"{E}/warmstart_cos100_runs")
WS200 = Row("200 steps, 20 warm-up, cosine to 0 (Intel Xeon)", f"{E}/warmstart_cos200_runs")
WS250 = Row("250 steps (one epoch), 25 warm-up, cosine to 0 (AMD EPYC)", f"{E}/warmstart_cos250_runs")
R2 = f"{E}/r2_cos250_runs"
WS = Row("one-epoch warm start", f"{E}/warmstart_cos250_runs")
GRPO = Row("+ GRPO, 20 steps", f"{R2}/r2_cos250_grpo")
SFTC = Row("+ SFT for GRPO's wall time (59 steps)", f"{R2}/r2_cos250_sftc")
HOLLOW = "kind=hollow round"

TABLES: dict[str, Table] = {
    "warmstart_cos100": Table(("recipe", ACC, "sd"), ("acc", "sd"), (WS100,)),
    "warmstart_cos200": Table(("recipe", ACC, "sd"), ("acc", "sd"), (WS100, WS200)),
    "warmstart_cos250": Table(("recipe", ACC, "sd"), ("acc", "sd"), (WS250,)),
    "warmstart_l1from2_sft8": Table(
        ("recipe", ACC_L1, "sd", "verdicts written (FAIL / SAFE)"), ("acc", "sd", "verdicts"),
        (Row("8 steps, lr 1e-3 constant, level-2 references (Intel Xeon)", f"{E}/warmstart_l1from2_sft8_runs"),)),
    "warmstart_l1from2_cos250": Table(
        ("recipe", ACC_L1, "sd", "`unit` errors", "verdicts written (FAIL / SAFE)"),
        ("acc", "sd", "category=unit", "verdicts"),
        (Row("8 steps, lr 1e-3 constant (above, Intel Xeon)", f"{E}/warmstart_l1from2_sft8_runs"),
         Row("250 steps (one epoch), 25 warm-up, cosine to 0 (AMD EPYC)", f"{E}/warmstart_l1from2_cos250_runs"))),
    "r2_cos250": Table(
        ("arm", ACC, "mean, sd", "paired against the warm start, seed k against seed k: only the warm start right / "
         "only this arm right (exact McNemar p); mean difference (bootstrap 95% CI)", "hollow sections right (of 71)"),
        ("acc", "mean_sd", f"vsb={WS.label}", HOLLOW), (WS, GRPO, SFTC)),
    "r2_item7": Table(
        ("arm (3 seeds each)", ACC, "mean, sd", "paired against the warm start, seed k against seed k: only the warm "
         "start right / only this arm right (exact McNemar p); mean difference (bootstrap 95% CI)",
         "against SFT continued: only SFT continued right / only this arm right (p); mean difference (bootstrap 95% CI)",
         "hollow sections right (of 71)", "CPU s, 3 runs"),
        ("acc", "mean_sd", f"vsb={WS.label}", "vsb=SFT continued for GRPO's wall time", HOLLOW, "cpu"),
        (WS, Row("GRPO (previous section)", GRPO.folder),
         Row("KL to the warm start, β = 0.04", f"{R2}/r2_cos250_kl04", "algorithm.beta=0.04"),
         Row("KL to the warm start, β = 0.5 (measured after the others, code `57cdfa2`, same machine)",
             f"{R2}/r2_cos250_kl50", "algorithm.beta=0.5"),
         Row("lr 5e-5", f"{R2}/r2_cos250_lr5e5", "optim.lr=5e-5"),
         Row("dynamic sampling (DAPO: all-right and all-wrong groups replaced by new prompts), 10 steps",
             f"{R2}/r2_cos250_resample", "algorithm.zero_variance=resample"),
         Row("SFT continued for GRPO's wall time", SFTC.folder))),
    "r2_item7_converged": Table(
        ("arm", ACC, "mean, sd", "paired against the converged start, seed k against seed k: only the start right / "
         "only this arm right (exact McNemar p); mean difference (bootstrap 95% CI)",
         "hollow sections right (of 71)", "CPU s, 3 runs"),
        ("acc", "mean_sd", "vsb=converged start (SFT continued, above)", HOLLOW, "cpu"),
        (Row("converged start (SFT continued, above)", SFTC.folder),
         Row("GRPO from it, 20 steps", f"{R2}/conv_grpo"),
         Row("SFT continued again, 59 steps", f"{R2}/conv_sftc"))),
    "pyfunc_study": Table(
        ("arm", ACC_L1, "paired with the same seed's warm start: only warm start / only this arm right (exact McNemar p)"),
        ("acc", "vs=warm start (8 steps, level-2 references)"),
        (Row("warm start (8 steps, level-2 references)", f"{E}/pyfunc_study_runs/pf_ws"),
         Row("GRPO (20 steps, strict outcome)", f"{E}/pyfunc_study_runs/pf_grpo"),
         Row("control: the warm start continued to 53 SFT steps", f"{E}/pyfunc_study_runs/pf_control"),
         Row("RFT (20 steps, the supervised loss on the passing samples)", f"{E}/pyfunc_study_runs/pf_rft"))),
    "pyfunc_cos": Table(
        ("arm", ACC_L1, "paired with the same seed's warm start: only warm start / only this arm right (exact McNemar "
         "p); mean difference (bootstrap 95% CI)", "paired with GRPO at G 16: only GRPO / only this arm right (p)",
         "circle_area right (of 48)", "axial_stress right (of 57)", "hydrostatic_pressure right (of 49)", "CPU s, 3 runs"),
        ("acc", "vsb=warm start, 8 steps, 2 warm-up, cosine to 0", "vs=GRPO from it, G 16, 20 steps",
         "kind=circle_area", "kind=axial_stress", "kind=hydrostatic_pressure", "cpu"),
        (Row("warm start, 8 steps, 2 warm-up, cosine to 0", f"{E}/pyfunc_cos_runs/pf_ws_cos"),
         Row("GRPO from it, G 8, 20 steps", f"{E}/pyfunc_cos_runs/pf_grpo_cos"),
         Row("GRPO from it, G 16, 20 steps", f"{E}/pyfunc_cos_runs/pf_grpo_cos_g16"),
         Row("the warm start continued by 100 SFT steps", f"{E}/pyfunc_cos_runs/pf_control_cos"))),
    "pyfunc_cos_xeon": Table(
        ("arm (Intel Xeon)", ACC_L1, "paired with the same seed's warm start: only warm start / only this arm right "
         "(exact McNemar p); mean difference (bootstrap 95% CI)", "paired with GRPO at G 16: only GRPO / only this arm "
         "right (p); mean difference (bootstrap 95% CI)", "circle_area right (of 48)", "axial_stress right (of 57)",
         "hydrostatic_pressure right (of 49)", "wall s per run", "CPU s, 3 runs"),
        ("acc", "vsb=warm start, 8 steps, 2 warm-up, cosine to 0", "vsb=GRPO from it, G 16, 20 steps",
         "kind=circle_area", "kind=axial_stress", "kind=hydrostatic_pressure", "wall", "cpu"),
        (Row("warm start, 8 steps, 2 warm-up, cosine to 0", f"{E}/pyfunc_cos_xeon_runs/pf_ws_cos"),
         Row("GRPO from it, G 16, 20 steps", f"{E}/pyfunc_cos_xeon_runs/pf_grpo_cos_g16"),
         Row("RFT from it, G 16, 20 steps (the supervised loss on the passing samples)",
             f"{E}/pyfunc_cos_xeon_runs/pf_rft_cos_g16"),
         Row("RFT from it, G 16, 33 steps (GRPO's step time: 20 × 52.0 / 32.0 s)",
             f"{E}/pyfunc_cos_xeon_runs/pf_rft_cos_g16_t33"),
         Row("the warm start continued by 100 SFT steps", f"{E}/pyfunc_cos_xeon_runs/pf_control_cos"))),
}


# ------------------------------------------------------------------------------------------ the doc
def regenerate(text: str) -> tuple[str, list[str]]:
    """The doc with every marked table made again, and the names of the marked tables."""
    lines = text.split("\n")
    out, names, i = [], [], 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        name = m.group(1)
        if name not in TABLES:
            raise SystemExit(f"docs/engineering.md marks a table {name!r} that scripts/eng_tables.py does not define")
        names.append(name)
        if i >= len(lines) or not lines[i].startswith("|"):
            raise SystemExit(f"docs/engineering.md line {i}: the table {name!r} must start on the line right after its marker")
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        out.append(render(TABLES[name]))
    unused = sorted(set(TABLES) - set(names))
    if unused:
        raise SystemExit(f"scripts/eng_tables.py defines table(s) the doc does not mark: {', '.join(unused)}")
    return "\n".join(out), names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    check = parser.parse_args(argv).check
    os.chdir(REPO)
    text = DOC.read_text()
    new, names = regenerate(text)
    if check:
        if new != text:
            diff = difflib.unified_diff(text.split("\n"), new.split("\n"), "docs/engineering.md", "made from the folders",
                                        lineterm="", n=0)
            print("docs/engineering.md: tables differ from what their folders give now:\n" + "\n".join(list(diff)[:40]))
            return 1
        print(f"same: {len(names)} tables of docs/engineering.md ({', '.join(names)})")
        return 0
    DOC.write_text(new)
    print(f"wrote {len(names)} tables into docs/engineering.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
