"""Every committed study report (``docs/**/*.md`` whose Regenerate line is a ``cohortrl report`` over committed sweep
folders) made again from those folders: ``--check`` compares each report's text with what the report makes of the
committed answers now and lists the ones that differ (exit 1); without it, every such report and its plot are
written again. Reports whose Regenerate line names folders that are not in the repository (the older
``runs/...`` ones) are listed as skipped.

    .venv/bin/python scripts/regenerate_reports.py --check      # compare, write nothing
    .venv/bin/python scripts/regenerate_reports.py              # make reports

tests/test_sweep.py makes the same comparison for every committed report in the suite.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def committed_reports(root: Path = REPO) -> list[tuple[Path, list[str]]]:
    """(report, its Regenerate command's arguments after ``cohortrl``) for every committed report, sorted."""
    found = []
    for md in sorted((root / "docs").rglob("*.md")):
        text = md.read_text()
        if "Regenerate: `cohortrl report " in text:
            found.append((md, shlex.split(text.split("Regenerate: `")[1].split("`")[0])[1:]))
    return found


def parse(args: list[str]) -> argparse.Namespace:
    """``cohortrl report``'s own parser on a Regenerate line's arguments."""
    from cohortrl.cli import build_parser

    return build_parser().parse_args(args)


def from_committed_folders(args: argparse.Namespace, root: Path = REPO) -> bool:
    """Whether every directory the line names is a sweep folder in the repository."""
    return all((root / d / "sweep.json").is_file() for d in args.run_dirs)


def regenerated_text(args: argparse.Namespace) -> str:
    from cohortrl.study import study_report_text

    return study_report_text([Path(d) for d in args.run_dirs], Path(args.out), baseline=args.baseline,
                             metrics=args.metrics or [], panels=args.panels or ["reward_mean"], last_k=args.last_k,
                             answer_checks=args.answer_checks)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    check = parser.parse_args(argv).check
    os.chdir(REPO)  # the Regenerate lines name folders relative to the checkout
    differ = []
    for md, argv_ in committed_reports():
        args = parse(argv_)
        name = md.relative_to(REPO)
        if not from_committed_folders(args):
            print(f"skipped {name}: its folders are not in the repository ({' '.join(args.run_dirs)})")
            continue
        if check:
            same = regenerated_text(args) == md.read_text()
            print(f"{'same' if same else 'DIFFERS'} {name}")
            differ += [] if same else [name]
        else:
            from cohortrl.study import write_study_report

            for path in write_study_report([Path(d) for d in args.run_dirs], Path(args.out), baseline=args.baseline,
                                           metrics=args.metrics or [], panels=args.panels or ["reward_mean"],
                                           last_k=args.last_k, answer_checks=args.answer_checks):
                print(f"wrote {path}")
    if differ:
        print(f"{len(differ)} report(s) differ from what their committed folders give now: {', '.join(map(str, differ))}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
