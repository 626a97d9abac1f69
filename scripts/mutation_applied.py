"""Mutants applied to the source, one at a time, for code that runs outside the test process (issue #28).

mutmut switches between mutants inside the tests' process (its trampolines read ``MUTANT_UNDER_TEST``). The
sandbox's server is a separate program started with ``python -I -S`` and an empty environment, so the
trampolines can neither be imported there nor told which mutant to run. Here each mutant is written into the
copy's source instead (``mutmut apply NAME``), the tests run against that plain copy, and the file is restored.

    python scripts/mutation_applied.py COPY --mutants 'GLOB' ... --tests FILE ... [--timeout 600]

COPY is a copy made by ``scripts/mutation.sh`` (its ``mutants/`` holds the generated mutants). Results go to
``COPY/applied-results.tsv`` (name, killed / survived / timeout, seconds, first failing test), one line per
mutant as it finishes; a rerun skips the names already there, so an interrupted pass continues.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def mutant_names(copy: Path) -> dict[str, Path]:
    """Every generated mutant's name -> the source file it belongs to (from mutmut's ``.meta`` files)."""
    names = {}
    for meta in (copy / "mutants").rglob("*.py.meta"):
        source = copy / meta.relative_to(copy / "mutants").with_suffix("")
        for name in json.loads(meta.read_text())["exit_code_by_key"]:
            names[name] = source
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("copy", type=Path)
    parser.add_argument("--mutants", nargs="+", required=True, help="fnmatch globs over mutmut's mutant names")
    parser.add_argument("--tests", nargs="+", required=True, help="test files or node ids, relative to the copy")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one mutant's tests")
    args = parser.parse_args()
    copy = args.copy.resolve()
    mutmut = Path(sys.executable).with_name("mutmut")
    out = copy / "applied-results.tsv"
    done = {line.split("\t")[0] for line in out.read_text().splitlines()} if out.exists() else set()
    chosen = {n: p for n, p in sorted(mutant_names(copy).items()) if any(fnmatch.fnmatch(n, g) for g in args.mutants)}
    if not chosen:
        sys.exit(f"no mutant in {copy}/mutants matches {args.mutants}")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    env.pop("MUTANT_UNDER_TEST", None)
    for source in set(chosen.values()):  # pristine copies to restore from (and to start from, after a crash)
        pristine = source.with_suffix(".py.pristine")
        if pristine.exists():
            shutil.copyfile(pristine, source)
        else:
            shutil.copyfile(source, pristine)
    pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:warnings", *args.tests]
    print(f"{len(chosen)} mutants, {len(done & set(chosen))} done before", flush=True)
    if not done:  # the unmutated copy must pass, or every mutant would count as killed
        clean = subprocess.run(pytest, cwd=copy, env=env, capture_output=True, text=True, timeout=args.timeout)
        if clean.returncode != 0:
            sys.exit(f"the unmutated copy fails its tests:\n{clean.stdout[-3000:]}")
    for name, source in chosen.items():
        if name in done:
            continue
        subprocess.run([str(mutmut), "apply", name], cwd=copy, check=True, capture_output=True)
        start = time.monotonic()
        try:
            run = subprocess.run(pytest, cwd=copy, env=env, capture_output=True, text=True, timeout=args.timeout)
            status = "survived" if run.returncode == 0 else "killed"
            failed = next((line.split()[1] for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
        except subprocess.TimeoutExpired:
            status, failed = "timeout", ""
        finally:
            shutil.copyfile(source.with_suffix(".py.pristine"), source)
        line = f"{name}\t{status}\t{time.monotonic() - start:.0f}\t{failed}"
        print(line, flush=True)
        with out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
