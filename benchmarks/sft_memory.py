"""Resident memory of supervised steps under each way of handing freed memory back (docs/performance.md, "Not
done yet": SFT's memory climb).

    .venv/bin/python benchmarks/sft_memory.py --arm retain --steps 20     # train.cpu_allocator: auto (retained heap)
    .venv/bin/python benchmarks/sft_memory.py --arm trim --steps 20       # the same, malloc_trim(0) after every step
    .venv/bin/python benchmarks/sft_memory.py --arm system --steps 20     # train.cpu_allocator: system (glibc's own)
    .venv/bin/python benchmarks/sft_memory.py --arm retain --trim-every 10 --steps 20   # the trainer's own trim, every 10 steps

Each arm is one process: it builds ``cohortrl.SFTTrainer`` on ``--config`` (default ``configs/eng_sft.yaml``, the
one-epoch recipe's schedule) in a temporary run directory, runs ``--steps`` optimiser steps and prints, per step,
its wall time, the resident set after it (``/proc/self/statm``) and the peak so far (``ru_maxrss``, the trainer's
``peak_rss_mb``). The arms are meant to run one after the other on a quiet machine; the summary line's median
leaves out the first two steps (first-touch of the heap). Not part of the test suite: minutes of CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", choices=["retain", "trim", "system"], required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "eng_sft.yaml")
    parser.add_argument("--trim-every", type=int, default=0, help="train.cpu_heap_trim_every (0: never, the arms above)")
    args = parser.parse_args()

    from cohortrl.trainers.sft import SFTTrainer

    cfg = yaml.safe_load(args.config.read_text())
    cfg["train"].update(steps=250, checkpoint_every=0, cpu_allocator="system" if args.arm == "system" else "auto",
                        cpu_heap_trim_every=args.trim_every)
    cfg.setdefault("optim", {}).update(schedule="cosine", warmup_steps=25)
    libc = ctypes.CDLL(None)
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        trainer = SFTTrainer(cfg, run_dir=Path(tmp) / "run")
        times = []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            metrics = trainer.step()
            if trainer.fast_path is not None:  # as the training loop calls it (train.cpu_heap_trim_every)
                trainer.fast_path.end_of_step(step)
            if args.arm == "trim":
                libc.malloc_trim(0)  # every free page of the heap back to the OS, at the cost of faulting it in again
            times.append(time.perf_counter() - t0)
            rss_mb = int(Path("/proc/self/statm").read_text().split()[1]) * page_mb
            print(f"{args.arm} step {step}: {times[-1]:.2f} s, resident {rss_mb:.0f} MiB, "
                  f"peak {metrics['peak_rss_mb']:.0f} MiB", flush=True)
        trainer.close()
    arm = f"{args.arm} trim every {args.trim_every}" if args.trim_every else args.arm
    print(f"SUMMARY {arm}: median step {statistics.median(times[2:]):.2f} s (steps 3-{args.steps}), "
          f"resident at the end {rss_mb:.0f} MiB, peak {metrics['peak_rss_mb']:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
