"""Planner against measurement: peak resident memory of PPO and GRPO steps on this CPU (fp32, one process,
no sharding) beside ``cohortrl.planner``'s prediction for the same work.

Each (model, algorithm) runs in its own subprocess, on the configuration of ``ppo_vs_grpo.py`` (same
prompts, P x G, sampling, β = 0.04). The subprocess first measures its own baseline — resident memory
(VmRSS) after importing torch, transformers, peft and cohortrl's trainer, before any model is loaded — then
builds the trainer and runs ``--steps`` steps (at least 2: AdamW allocates its moments in the first
optimiser step, so the second step is the first to hold everything at once). Its peak is ru_maxrss. The
prediction uses that baseline, the model's config and the padded prompt and response lengths the steps
actually had (the largest seen). Prints a markdown table.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_validation.py --steps 2 --prompts 2 --group 4 --tokens 16

Not part of the test suite: SmolLM2-135M-Instruct steps take tens of seconds each on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1024**2


def vm_rss_bytes() -> float:
    """The current resident set size (not the peak), from /proc/self/status (Linux, reported in kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


def child(model: str, algorithm: str, args) -> None:
    """One (model, algorithm) in this process; prints one JSON line."""
    import tempfile

    import peft  # noqa: F401  (part of the baseline: the trainer imports it for LoRA)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from cohortrl.config import Config
    from cohortrl.trainers import make_trainer
    from cohortrl.trainers.metrics import peak_rss_mb

    baseline = vm_rss_bytes()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ppo_vs_grpo import config

    ns = argparse.Namespace(model=model, full=not args.lora, tokens=args.tokens, group=args.group,
                            prompts=args.prompts, steps=args.steps, threads=args.threads)
    cfg = config(algorithm, ns)
    shapes = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(Config.from_dict(cfg), run_dir)
        after_setup = peak_rss_mb()
        update = trainer._update

        def recording_update(rollout, *rest):
            shapes.append((rollout.response_ids.shape[1], rollout.prompt_ids.shape[1]))
            return update(rollout, *rest)

        trainer._update = recording_update
        for _ in range(args.steps):
            trainer.step()
            trainer.step_count += 1
    print(json.dumps({
        "baseline_bytes": baseline,
        "peak_after_setup_mb": after_setup,
        "peak_rss_mb": peak_rss_mb(),
        "response_len": max(t for t, _ in shapes),
        "prompt_len": max(p for _, p in shapes),
    }))


def predict(model: str, algorithm: str, measured: dict, args):
    from cohortrl.planner import DEVICE_PEAK_FLOPS, RunSpec, plan

    run = RunSpec(
        algorithm=algorithm, gpus=1, sharding="none", dtype="fp32", lora_rank=16 if args.lora else 0,
        prompt_len=measured["prompt_len"], response_len=measured["response_len"], group_size=args.group,
        prompts_per_step=args.prompts, micro_batch_size=args.prompts * args.group,  # micro_batch_size 0: one batch
        checkpointing=False, reference=True, device="cpu", cpu_baseline_bytes=measured["baseline_bytes"],
        peak_flops=DEVICE_PEAK_FLOPS["cpu"],
    )
    return plan(model, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m-instruct"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="P, prompts per step")
    parser.add_argument("--group", type=int, default=4, help="G, responses per prompt (both algorithms)")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per response")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on the policy instead of full fine-tuning")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: AdamW's moments first exist after step 1's optimiser step")
    if args.child:
        return child(*args.child, args)
    print(f"fp32, one process, {'LoRA r=16' if args.lora else 'full fine-tuning'}; P={args.prompts}, G={args.group}, "
          f"{args.tokens} new tokens, beta=0.04 (reference model), {args.steps} steps; MiB\n")
    print("| model | algorithm | s_p + T | baseline (measured) | predicted peak | measured peak | error |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model in args.models:
        for algorithm in ("grpo", "ppo"):
            cmd = [sys.executable, __file__, "--child", model, algorithm, *sys.argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
            if out.returncode != 0:
                sys.exit(f"{model} {algorithm} failed:\n{out.stderr[-3000:]}")
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            p = predict(model, algorithm, measured, args)
            predicted, actual = p.memory.peak / MIB, measured["peak_rss_mb"]
            print(f"| {model} | {algorithm} | {measured['prompt_len']} + {measured['response_len']} | "
                  f"{measured['baseline_bytes'] / MIB:.0f} | {predicted:.0f} | {actual:.0f} | "
                  f"{(predicted - actual) / actual:+.1%} |", flush=True)
            print(json.dumps({"model": model, "algorithm": algorithm, **measured,
                              "components_mib": {k: round(v / MIB, 1) for k, v in _components(p)}}), file=sys.stderr)


def _components(p):
    from cohortrl.planner import memory_rows

    return memory_rows(p)


if __name__ == "__main__":
    main()
