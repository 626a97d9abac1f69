"""Grading latency of the gym (issue 5): p99 per sample must stay under 200 ms, GSM8K included.

Grading runs where a trainer would run it: in long-lived worker processes (a `multiprocessing` pool whose
initializer imports every family module and grades once to warm up), so no sample pays for an interpreter
start or a numpy import. For each family, 1,000 samples spread over its levels are graded one at a time:

- ``worker``: time inside the worker for ``sample_from_dict`` + ``grade`` (what a reward function costs);
- ``round trip``: time in the parent from submitting one sample to receiving its grade (adds the pickling
  and the pipe: what a trainer waiting on one grade sees);

then all of them again through ``imap`` on every worker, for throughput. Completions mix three kinds a
policy produces: the reference solution, the reference buried in ~1,500 characters of prose and padding
lines, and ~1,000 characters of unformatted text. The code families (issue 6) replace the third kind with a
wrong program, so that every completion is really run: for ``controller`` the reference's gains and
limits perturbed (every scenario simulated, most failing at performance), for ``python_function`` a
function returning a constant (a full round trip through the worker's sandbox, one forked child).

    .venv/bin/python benchmarks/grading.py [--n 1000] [--workers 2] [--families controller python_function]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import time

PROSE = ("Let me work through this carefully, one quantity at a time, and check the units as I go. " * 6).strip()
PADDING = "\n".join(f"note_{i} = {i * 7} mm" for i in range(12))


def completions_for(sample: dict, i: int) -> str:
    kind = i % 3
    if kind == 0:
        return sample["reference_solution"]
    if kind == 1:
        return f"{PROSE}\n{PADDING}\n{sample['reference_solution']}\n{PROSE}"
    if sample["family"] == "controller":
        # Every number in the reference nudged: the same program shape, simulated in full.
        return re.sub(r"\d+\.\d+", lambda m: f"{float(m[0]) * 0.7:.4g}", sample["reference_solution"])
    if sample["family"] == "python_function":
        return f"```python\ndef {sample['extra']['function']}(*args):\n    return 0.0\n```"
    return (PROSE + " ") * 2 + "so the result is probably around 42 or so."


def _warm() -> None:
    """Pool initializer: import every family once and grade one sample each, so the timed calls are warm."""
    from cohortrl import tasks

    for name in tasks.names():
        family = tasks.get(name)
        level = family.levels[0]
        try:
            sample = family.sample(1, seed=0, level=level)[0]
        except (RuntimeError, OSError):  # GSM8K data absent: the family is skipped by the parent too
            continue
        family.grade(sample, sample.reference_solution)


def _grade(job: tuple[dict, str]) -> tuple[float, float]:
    from cohortrl import tasks

    sample_dict, completion = job
    start = time.perf_counter()
    family = tasks.get(sample_dict["family"])
    grade = family.grade(family.sample_from_dict(sample_dict), completion)
    return time.perf_counter() - start, grade.score


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="samples per family (default 1000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+", default=None, help="default: every family")
    args = parser.parse_args()

    from cohortrl import tasks

    jobs: dict[str, list[tuple[dict, str]]] = {}
    for name in args.families or tasks.names():
        family = tasks.get(name)
        per_level = -(-args.n // len(family.levels))
        try:
            samples = [s.to_dict() for level in family.levels for s in family.sample(per_level, args.seed, level)][: args.n]
        except (RuntimeError, OSError) as error:
            print(f"skipping {name}: {error}")
            continue
        jobs[name] = [(s, completions_for(s, i)) for i, s in enumerate(samples)]

    context = mp.get_context("spawn")  # fresh interpreters: what a worker really has to import is measured
    started = time.perf_counter()
    with context.Pool(args.workers, initializer=_warm) as pool:
        pool.map(_grade, [jobs[name][0] for name in jobs] * args.workers)  # make sure every worker is up
        print(f"pool of {args.workers} started and warmed in {time.perf_counter() - started:.1f} s\n")
        print("| family | samples | worker p50 ms | worker p99 ms | worker max ms | round trip p50 ms "
              "| round trip p99 ms | imap samples/s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, family_jobs in jobs.items():
            inside, round_trip = [], []
            for job in family_jobs:
                start = time.perf_counter()
                seconds, _ = pool.apply_async(_grade, (job,)).get()
                round_trip.append(time.perf_counter() - start)
                inside.append(seconds)
            start = time.perf_counter()
            list(pool.imap(_grade, family_jobs, chunksize=16))
            throughput = len(family_jobs) / (time.perf_counter() - start)
            ms = lambda v: f"{1000 * v:.2f}"  # noqa: E731
            print(f"| {name} | {len(family_jobs)} | {ms(statistics.median(inside))} | {ms(percentile(inside, 99))} "
                  f"| {ms(max(inside))} | {ms(statistics.median(round_trip))} | {ms(percentile(round_trip, 99))} "
                  f"| {throughput:.0f} |")


if __name__ == "__main__":
    main()
