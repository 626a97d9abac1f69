"""Pin the golden runs' numbers again: ``python -m tests.golden.regenerate`` (from the repository root).

Runs every golden run (``runs.py``) in two fresh processes, the second in the opposite order, and pins the
numbers only if the two agree bit for bit (so what is pinned does not depend on the process or on which runs
went before). Prints every number that moved beyond the test's tolerance against what is pinned for the
installed torch version and this CPU's vendor (``runs.golden_key``), then writes ``golden_runs.json``
(entries of other torch versions and vendors are kept).

    python -m tests.golden.regenerate            # regenerate, print the diff, write
    python -m tests.golden.regenerate --check    # print the diff only; exit 1 if anything moved
    python -m tests.golden.regenerate ppo grpo   # only these runs (the others stay as pinned)
    python -m tests.golden.regenerate --cpu-fast-path=off   # the plain CPU path's numbers, under their own key

Regenerate only when a change of the numbers is intended (a fix, a deliberate change of an algorithm), and
say in the commit message which runs moved and why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.golden.runs import GOLDEN_FILE, RUNS, compare

REPO = Path(__file__).resolve().parents[2]


def _run_in_a_fresh_process(names: list[str], out: Path, reverse: bool, cpu_fast_path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "tests.golden.runs", "--out", str(out), f"--cpu-fast-path={cpu_fast_path}",
           *(["--reverse"] if reverse else []), *names]
    done = subprocess.run(cmd, cwd=REPO, env=env)
    if done.returncode:
        sys.exit(f"golden runs failed (exit code {done.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text())


def _bitwise_differences(a: dict, b: dict) -> list[str]:
    out = []
    for name, steps in a.items():
        for step, (x, y) in enumerate(zip(steps, b[name]), start=1):
            out += [f"{name} step {step} {k}: {x[k]!r} vs {y.get(k)!r}" for k in x if x[k] != y.get(k)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="print the diff, write nothing; exit 1 if anything moved")
    parser.add_argument("--cpu-fast-path", choices=("auto", "off"), default="auto",
                        help="off: pin the plain CPU path's numbers (their own key, runs.golden_key)")
    parser.add_argument("names", nargs="*", help="runs to regenerate (default: all)")
    args = parser.parse_args(argv)
    names = args.names or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; the runs are {list(RUNS)}")

    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        first = _run_in_a_fresh_process(names, Path(tmp) / "a.json", False, args.cpu_fast_path)
        second = _run_in_a_fresh_process(names, Path(tmp) / "b.json", True, args.cpu_fast_path)
    unstable = _bitwise_differences(first["runs"], second["runs"])
    if unstable:
        print("not bit-repeatable across two processes; nothing written:\n  " + "\n  ".join(unstable))
        return 1
    key = first["key"]
    wall = sum(first["seconds"].values())
    print(f"{key}: {len(names)} run(s), bit-identical in two processes ({wall:.1f} s of runs in the first)")

    pinned_all = json.loads(GOLDEN_FILE.read_text()) if GOLDEN_FILE.exists() else {}
    pinned = pinned_all.get(key, {})
    moved = 0
    for name in names:
        if name not in pinned:
            print(f"{name}: new (nothing pinned for {key})")
            continue
        lines = compare(pinned[name], first["runs"][name])
        new_keys = sorted(set(first["runs"][name][0]) - set(pinned[name][0]))
        moved += bool(lines)
        print(f"{name}: " + ("unchanged" if not lines else f"{len(lines)} number(s) moved") +
              (f"; logged but not pinned yet (pinned when written): {new_keys}" if new_keys else ""))
        for line in lines:
            print(f"    {line}")
    dropped = sorted(set(pinned) - set(RUNS))
    for name in dropped:
        print(f"{name}: pinned but no longer a golden run; removed")
    if args.check:
        return 1 if moved or dropped or any(n not in pinned for n in names) else 0
    runs = {n: v for n, v in pinned.items() if n in RUNS}
    runs.update(first["runs"])
    pinned_all[key] = {n: runs[n] for n in RUNS if n in runs}
    GOLDEN_FILE.write_text(json.dumps(pinned_all, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
