"""What ``train.trace_steps`` costs: nothing measurable when off, and how much a traced step takes when on.

    PYTHONPATH=. .venv/bin/python benchmarks/trace_overhead.py                 # tiny GRPO, 2 x 8 steps
    PYTHONPATH=. .venv/bin/python benchmarks/trace_overhead.py --steps 20 --config configs/tiny_ppo.yaml

Tracing off runs, per step, what the untraced step ran before tracing existed plus ``step.start_trace``
(a membership test) and a few ``trace is not None`` tests (two per step, one per update and one per
micro-batch); the step's sum of w·L is the same operations under a name. So the cost of tracing off is
measured directly: those calls timed in a loop of 100,000, times how often a step makes them, over the
median step time (the ratio printed as "tracing off"). Then two trainers of the same config, one tracing
every step and one tracing none, take steps in turn (interleaved, so a busy machine slows both alike); the
ratio of their median step times is what tracing costs when on (copying tensors, decoding each token's text,
writing the file).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import torch

from cohortrl.config import Config
from cohortrl.trainers import make_trainer
from cohortrl.trainers.step import start_trace

REPO = Path(__file__).resolve().parent.parent


def build(config: str, run_dir: Path, steps: int, traced: bool):
    overrides = [f"train.steps={steps}", "train.progress=false", "train.checkpoint_every=0", "eval.n_prompts=0",
                 "eval.before=false", "data.eval_size=0",
                 f"train.trace_steps=[{','.join(str(s) for s in range(1, steps + 1))}]" if traced else "train.trace_steps=[]"]
    return make_trainer(Config.from_yaml(config, overrides), run_dir)


def timed_step(trainer) -> float:
    t0 = time.perf_counter()
    trainer.step()
    trainer.step_count += 1  # what Trainer.train does after each step
    return time.perf_counter() - t0


def off_path_seconds(trainer, checks_per_step: int) -> float:
    """Seconds per step of what tracing off adds: one ``start_trace`` and ``checks_per_step`` None tests."""
    n = 100_000
    start = timeit.timeit(lambda: start_trace(trainer), number=n) / n
    trace = None
    checks = timeit.timeit(lambda: trace is not None, number=n) / n
    return start + checks_per_step * checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_grpo.yaml"))
    p.add_argument("--steps", type=int, default=8, help="steps per trainer (default 8)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        off = build(args.config, Path(tmp) / "off", args.steps, traced=False)
        on = build(args.config, Path(tmp) / "on", args.steps, traced=True)
        times = {"off": [], "on": []}
        for _ in range(args.steps):
            times["off"].append(timed_step(off))
            times["on"].append(timed_step(on))
        a = off.cfg.algorithm
        rows_per_update = a.prompts_per_step * a.group_size // a.minibatches
        updates = a.epochs * a.minibatches
        micro_batches = updates * -(-rows_per_update // (a.micro_batch_size or rows_per_update))
        extra = off_path_seconds(off, 2 + updates + micro_batches)
        traced_bytes = sum(f.stat().st_size for f in (Path(tmp) / "on" / "traces").glob("*.pt"))
        off.close()
        on.close()
    # the first step of each warms caches up: left out of the medians
    med_off, med_on = statistics.median(times["off"][1:]), statistics.median(times["on"][1:])
    print(f"config {args.config}, {args.steps} steps each, {args.threads} thread(s), first step left out")
    print(f"median step: tracing off {med_off * 1e3:.1f} ms, tracing every step {med_on * 1e3:.1f} ms")
    print(f"tracing off: {extra * 1e9:.0f} ns of added work per step = {extra / med_off:.1e} of a step")
    print(f"tracing on / off: {med_on / med_off:.3f} (trace files {traced_bytes / args.steps / 1024:.0f} KiB per step)")


if __name__ == "__main__":
    main()
