"""The recording's buffers in kept maps (``cpu/memory.RecordingMaps``, the default) against fresh maps for every
generate call (``cpu/memory.mapped_zeros``, as before 2026-12-07): page faults, system time, step time and memory.

Two designs, because the host's speed drifts by more than the difference between the arms:

- ``--workload lora`` / ``fullft``: ``benchmarks/vs_trl.py``'s two SmolLM2 GRPO workloads (forced lengths, so
  every step does the same work) in one process, the arm switched step by step (kept, fresh, fresh, kept, ...):
  both arms see the same drift. The first step (the heap's and the maps' first touch) is left out.
- ``--workload demo``: ``configs/demo_grpo.yaml`` (real lengths: rows end and leave the products), one process
  per arm, ``--repeats`` times alternately. Its steps differ from each other in work, but step k is the same
  work in every process (the same seed), so arms are compared step by step; each step's peak resident memory
  is its own (VmHWM reset before it), and the resident set after it shows what the kept maps hold between steps.

    .venv/bin/python benchmarks/recording_maps.py --workload fullft --steps 18
    .venv/bin/python benchmarks/recording_maps.py --workload lora --steps 14
    .venv/bin/python benchmarks/recording_maps.py --workload demo --init RUN/final --steps 3 --repeats 2

Not part of the test suite: minutes of CPU.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = {  # benchmarks/vs_trl.py's two SmolLM2 workloads, on configs/tiny_grpo.yaml
    "fullft": ["algorithm.prompts_per_step=2", "algorithm.group_size=4", "sampling.max_new_tokens=48",
               "sampling.min_new_tokens=48"],
    "lora": ["algorithm.prompts_per_step=4", "algorithm.group_size=8", "model.lora.enabled=true",
             "sampling.max_new_tokens=32", "sampling.min_new_tokens=32"],
}


class FreshMaps:
    """The arm without kept maps: every buffer a fresh map of its own, as the decoder had it before."""

    def zeros(self, key, shape, dtype):
        from cohortrl.cpu.memory import mapped_zeros

        return mapped_zeros(shape, dtype)

    def mark_reusable(self, tensor, nbytes):
        pass

    def end_of_step(self):
        pass

    def close(self):
        pass


def trainer(args, tmp: str):
    import torch

    from cohortrl.config import Config
    from cohortrl.trainers.grpo import GRPOTrainer

    torch.set_num_threads(2)
    common = [f"train.steps={max(args.steps, 1)}", "train.threads=2", "eval.before=false", "eval.every=0"]
    if args.workload == "demo":
        cfg = Config.from_yaml(REPO / "configs" / "demo_grpo.yaml", [f"model.init={args.init}", *common])
    else:
        cfg = Config.from_yaml(REPO / "configs" / "tiny_grpo.yaml",
                               ["model.name=smollm2-135m-instruct", *WORKLOADS[args.workload], *common])
    t = GRPOTrainer(cfg, run_dir=Path(tmp) / "run")
    if t.fast_path is None:
        raise SystemExit("this run has no CPU fast path (a GPU, or train.cpu_fast_path off): nothing to compare")
    return t


def timed_step(t) -> dict:
    """One step as the training loop runs it (``end_of_step`` after it), with its own usage and peak memory."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    metrics = t.step()
    t.step_count += 1
    t.fast_path.end_of_step(t.step_count)
    u1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"s": t1 - t0, "user": u1.ru_utime - u0.ru_utime, "sys": u1.ru_stime - u0.ru_stime,
            "faults": u1.ru_minflt - u0.ru_minflt, "generate": metrics["time/generate"],
            "peak_mib": int(status["VmHWM"].split()[0]) / 1024, "after_mib": int(status["VmRSS"].split()[0]) / 1024,
            "reward": metrics["reward_mean"], "length": metrics["response_length_mean"]}


def line(arm: str, step: int, r: dict) -> str:
    return (f"{arm} step {step}: {r['s']:.2f} s (user {r['user']:.2f}, system {r['sys']:.2f}), {r['faults']} faults, "
            f"generate {r['generate']:.2f} s, peak {r['peak_mib']:.0f} MiB, after {r['after_mib']:.0f} MiB, "
            f"reward {r['reward']:.4f}, length {r['length']:.2f}")


def interleaved(args) -> None:
    """Both arms in this process, switched step by step in the order kept, fresh, fresh, kept (repeated)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(args, tmp)
        kept, results = t.fast_path.recording_maps, {"kept": [], "fresh": []}
        for i in range(args.steps):
            arm = ("kept", "fresh", "fresh", "kept")[i % 4]
            t.fast_path.recording_maps = kept if arm == "kept" else FreshMaps()
            r = timed_step(t)
            print(line(arm, i + 1, r), flush=True)
            if i:  # the first step faults everything in whichever arm it is
                results[arm].append(r)
        t.fast_path.recording_maps = kept
        t.close()
    for arm, rows in results.items():
        print(f"{arm}: {len(rows)} steps, median step {statistics.median(r['s'] for r in rows):.3f} s, user "
              f"{statistics.median(r['user'] for r in rows):.2f} s, system {statistics.median(r['sys'] for r in rows):.3f} s, "
              f"faults {statistics.median(r['faults'] for r in rows):.0f}, generate "
              f"{statistics.median(r['generate'] for r in rows):.3f} s")
    ratio = statistics.median(r["s"] for r in results["fresh"]) / statistics.median(r["s"] for r in results["kept"])
    print(f"median step, fresh / kept: {ratio:.3f}x")


def one_arm(args) -> None:
    """``--arm``'s steps in this process (the demo design's child)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(args, tmp)
        if args.arm == "fresh":
            t.fast_path.recording_maps = FreshMaps()
        for i in range(args.steps):
            print(line(args.arm, i + 1, timed_step(t)), flush=True)
        t.close()


def alternating(args) -> None:
    """One process per arm, fresh then kept, ``--repeats`` times; their step lines as they come."""
    for _ in range(args.repeats):
        for arm in ("fresh", "kept"):
            cmd = [sys.executable, __file__, "--workload", args.workload, "--steps", str(args.steps),
                   "--init", str(args.init), "--arm", arm]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
            if out.returncode:
                raise SystemExit(f"the {arm} arm failed (rc {out.returncode}); its log is above")
            print(out.stdout, end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "demo"], required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--init", type=Path, help="demo: the warm start's final/ (a configs/demo_sft.yaml run)")
    parser.add_argument("--repeats", type=int, default=2, help="demo: processes per arm, alternating")
    parser.add_argument("--arm", choices=["kept", "fresh"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload == "demo" and args.init is None:
        parser.error("--workload demo needs --init, the demo warm start's final/ directory")
    if args.arm:
        one_arm(args)
    elif args.workload == "demo":
        alternating(args)
    else:
        interleaved(args)


if __name__ == "__main__":
    main()
