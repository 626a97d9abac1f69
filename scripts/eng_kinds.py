"""Held-out problems answered right by kind of problem (axial_stress's section shape, beam_bending's beam and
load case, python_function's function), per arm and seed, from sweep folders (committed or in runs/):

    .venv/bin/python scripts/eng_kinds.py docs/engineering/warmstart_cos250_runs \\
        docs/engineering/r2_cos250_runs/r2_cos250_grpo docs/engineering/r2_cos250_runs/r2_cos250_sftc \\
        --out docs/engineering/r2_cos250_kinds.md

Each run's final evaluation (its answers file) is matched by problem id to the held-out rows its own
config.yaml draws (the gym's generator is deterministic), and each row's kind is read from its prompt as
scripts/eng_report.py reads it. Writes (or, without --out, prints) a markdown table: per arm, per kind, right
of n at each seed, under the command that regenerates it (tests/test_eng_kinds.py checks the committed ones)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cohortrl.config import Config  # noqa: E402
from cohortrl.data import load_rows, problem_id  # noqa: E402
from cohortrl.study import load_sweeps  # noqa: E402
from eng_report import kind  # noqa: E402


_HELD_OUT: dict[tuple[str, int, int], dict[str, str]] = {}  # drawn once per data section and seed, not once per run


def held_out_kinds(run: Path) -> dict[str, str]:
    """Problem id -> kind for the held-out rows the run at ``run`` evaluated on."""
    raw = yaml.safe_load((run / "config.yaml").read_text())
    # The weights a run started from do not decide which rows it holds out, and a committed run's model.init
    # (runs/.../final) is not in a fresh clone, where loading it would fail the config's check.
    raw.get("model", {}).pop("init", None)
    raw.get("algorithm", {}).get("ppo", {}).pop("critic_init", None)
    cfg = Config.from_dict(raw)
    key = (repr(cfg.data), cfg.train.seed, cfg.eval.n_prompts)
    if key not in _HELD_OUT:
        _, held = load_rows(cfg.data, cfg.train.seed)
        _HELD_OUT[key] = {problem_id(r): kind(r["prompt"]) for r in held[: cfg.eval.n_prompts]}
    return _HELD_OUT[key]


def table(directories: list[str]) -> str:
    arms = load_sweeps([Path(d) for d in directories])
    rows, kinds_seen = [], set()
    for arm in arms:
        cells: dict[str, list[str]] = collections.defaultdict(list)
        for run in arm.runs:
            kinds = held_out_kinds(run.path)
            missing = set(run.answers) - set(kinds)
            if missing:
                raise SystemExit(f"{run.path}: {len(missing)} answered problem id(s) are not among the held-out rows "
                                 f"its config.yaml draws (e.g. {sorted(missing)[0]}); was the task generator changed?")
            total = collections.Counter(kinds[i] for i in run.answers)
            right = collections.Counter(kinds[i] for i, ok in run.answers.items() if ok)
            kinds_seen |= set(total)
            for k in sorted(total):
                cells[k].append(f"s{run.seed} {right[k]}/{total[k]}")
        rows.append((arm.name, cells))
    columns = sorted(kinds_seen)  # every kind any run answered, so none is left out of the table
    lines = ["| arm | " + " | ".join(columns) + " |", "|" + "---|" * (1 + len(columns))]
    for name, cells in rows:
        lines.append(f"| {name} | " + " | ".join(", ".join(cells.get(k, ["–"])) for k in columns) + " |")
    return "\n".join(lines)


def document(directories: list[str], out: str | None) -> str:
    command = " ".join(["scripts/eng_kinds.py", *directories, *(["--out", out] if out else [])])
    return (f"# Held-out answers right by kind of problem\n\nRegenerate: `{command}`\n\n"
            f"{table(directories)}\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            raise SystemExit("--out needs a path, e.g. --out docs/engineering/r2_cos250_kinds.md")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    text = document(argv, out)
    if out:
        Path(out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
