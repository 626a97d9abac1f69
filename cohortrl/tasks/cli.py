"""``cohortrl tasks ...``: list the gym's families, print samples, grade a file of responses.

`add_tasks_parser` plugs into the main CLI's subparsers; every subcommand sets ``func(args) -> int``.
This module also runs on its own: ``python -m cohortrl.tasks.cli tasks list``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cohortrl import tasks

GRADE_FILE_HELP = """\
responses.jsonl: one JSON object per line, either
  {"seed": 0, "index": 3, "completion": "..."}      the sample is regenerated from NAME, --level
                                                      (or a "level" key on the line), seed and index
  {"sample": {...}, "completion": "..."}            a sample as printed by `tasks sample --json`
Prints one JSON line per response (id, outcome, score, step_credit, committed, steps) and a summary
line on stderr."""


def add_tasks_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tasks list | sample | grade`` under ``subparsers``; returns the ``tasks`` parser."""
    parser = subparsers.add_parser("tasks", help="the engineering gym: list, sample and grade task families",
                                   description="The engineering gym: list, sample and grade task families.")
    commands = parser.add_subparsers(dest="tasks_command", metavar="{list,sample,grade}", required=True)

    listing = commands.add_parser("list", help="list the families and their levels",
                                  description="List the task families and their levels.")
    listing.set_defaults(func=run_list)

    sample = commands.add_parser("sample", help="print prompts and reference solutions",
                                 description="Print K prompts of family NAME at level L with their reference solutions.")
    sample.add_argument("name", metavar="NAME", help=f"a family: {', '.join(tasks.names())}")
    sample.add_argument("--level", type=int, default=1, help="difficulty level (default 1)")
    sample.add_argument("--n", type=int, default=3, help="how many samples (default 3)")
    sample.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    sample.add_argument("--json", action="store_true", help="print each sample as one JSON line instead")
    sample.set_defaults(func=run_sample)

    grade = commands.add_parser("grade", help="grade a JSONL file of responses",
                                description="Grade responses to family NAME.",
                                epilog=GRADE_FILE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    grade.add_argument("name", metavar="NAME", help=f"a family: {', '.join(tasks.names())}")
    grade.add_argument("--level", type=int, default=1, help="level of the samples named by seed and index")
    grade.add_argument("--file", required=True, help="the responses, JSONL (format below)")
    grade.set_defaults(func=run_grade)
    return parser


def run_list(args: argparse.Namespace) -> int:
    width = max(map(len, tasks.names()))
    for name in tasks.names():
        family = tasks.get(name)
        doc = (sys.modules[type(family).__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:{width}s} levels {','.join(map(str, family.levels)):12s} {doc}")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    family = tasks.get(args.name)
    for sample in family.sample(args.n, seed=args.seed, level=args.level):
        if args.json:
            print(json.dumps(sample.to_dict()))
            continue
        print(f"=== {sample.id}")
        print(f"--- prompt\n{sample.prompt}\n--- reference solution\n{sample.reference_solution}\n")
    return 0


def run_grade(args: argparse.Namespace) -> int:
    family = tasks.get(args.name)
    regenerated: dict[tuple[int, int], list] = {}
    outcomes, scores = [], []
    with open(args.file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row: dict[str, Any] = json.loads(line)
            if "sample" in row:
                sample = family.sample_from_dict(row["sample"])
            elif "seed" in row and "index" in row:
                level, seed, index = int(row.get("level", args.level)), int(row["seed"]), int(row["index"])
                if (seed, level) not in regenerated or len(regenerated[seed, level]) <= index:
                    regenerated[seed, level] = family.sample(index + 1, seed=seed, level=level)
                sample = regenerated[seed, level][index]
            else:
                print(f"{args.file}:{number}: needs 'sample' or 'seed' and 'index'", file=sys.stderr)
                return 2
            grade = family.grade(sample, row["completion"])
            outcomes.append(grade.outcome)
            scores.append(grade.score)
            print(json.dumps({
                "id": sample.id, "outcome": grade.outcome, "score": grade.score, "step_credit": grade.step_credit,
                "committed": grade.committed, "steps": {s.key: s.correct for s in grade.steps},
            }))
    if outcomes:
        print(f"graded {len(outcomes)}: mean outcome {sum(outcomes) / len(outcomes):.3f}, "
              f"mean score {sum(scores) / len(scores):.3f}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cohortrl")
    add_tasks_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
