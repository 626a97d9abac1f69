"""What the critic costs: peak memory and time per step of PPO and GRPO on the same configuration.

Both algorithms run the same model (LoRA on the policy unless --full), the same prompts (same seed, same
data order), P prompts x G responses per step, the same sampling and length budget, β = 0.04, one update
per rollout. Each runs in its own subprocess, so its peak resident memory (ru_maxrss) is its own; time per
step is the median over --steps steps (evaluation and checkpoints are not part of a step). Prints a
markdown table with the PPO / GRPO ratios.

    .venv/bin/python benchmarks/ppo_vs_grpo.py --steps 3 --prompts 2 --group 4 --tokens 32

Not part of the test suite: it loads SmolLM2-135M-Instruct and takes minutes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "reference", "values", "train")


def config(algorithm: str, args) -> dict:
    return {
        "model": {"name": args.model, "lora": {"enabled": not args.full, "r": 16, "alpha": 32}, "system_prompt": "Be brief."},
        "data": {"source": "task:arithmetic", "level": 1, "train_size": 200, "eval_size": 0},
        "sampling": {"temperature": 0.7, "max_new_tokens": args.tokens},
        "reward": {"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}], "correctness": "accuracy"},
        "algorithm": {"name": algorithm, "group_size": args.group, "prompts_per_step": args.prompts, "beta": 0.04},
        "optim": {"lr": 5e-4},
        "train": {"steps": args.steps, "progress": False, "seed": 0, "threads": args.threads},
        "eval": {"before": False, "n_prompts": 0},
    }


def child(algorithm: str, args) -> None:
    """One algorithm's steps in this process; prints one JSON line."""
    import tempfile

    from cohortrl.config import Config
    from cohortrl.trainers import make_trainer
    from cohortrl.trainers.metrics import peak_rss_mb

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(Config.from_dict(config(algorithm, args)), run_dir)
        setup_s = time.perf_counter() - t0
        rows = []
        for _ in range(args.steps):
            rows.append(trainer.step())
            trainer.step_count += 1
    print(json.dumps({
        "setup_s": setup_s,
        "step_s": [r["time/step"] for r in rows],
        "phases": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES},
        "response_length_mean": statistics.mean(r["response_length_mean"] for r in rows),
        "peak_rss_mb": peak_rss_mb(),
    }))


def run(algorithm: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", algorithm, *sys.argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if out.returncode != 0:
        sys.exit(f"{algorithm} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(grpo: dict, ppo: dict) -> str:
    def row(name, g, p, fmt="{:.2f}"):
        ratio = f"{p / g:.2f}x" if g else "-"
        return f"| {name} | {fmt.format(g)} | {fmt.format(p)} | {ratio} |"

    lines = ["| per step | GRPO | PPO | PPO / GRPO |", "|---|---:|---:|---:|"]
    lines.append(row("peak RSS (MB, ru_maxrss)", grpo["peak_rss_mb"], ppo["peak_rss_mb"], "{:.0f}"))
    median = {k: statistics.median(d["step_s"]) for k, d in (("g", grpo), ("p", ppo))}
    lines.append(row("median time per step (s)", median["g"], median["p"]))
    for phase in PHASES:
        lines.append(row(f"  {phase} (s, median)", grpo["phases"][phase], ppo["phases"][phase]))
    lines.append(row("mean response length (tokens)", grpo["response_length_mean"], ppo["response_length_mean"], "{:.1f}"))
    lines.append(row("setup: load model(s) (s)", grpo["setup_s"], ppo["setup_s"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="P, prompts per step")
    parser.add_argument("--group", type=int, default=4, help="G, responses per prompt (both algorithms)")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per response")
    parser.add_argument("--full", action="store_true", help="train all policy weights instead of a LoRA adapter")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per run (0: torch's default)")
    parser.add_argument("--child", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    results = {name: run(name, args) for name in ("grpo", "ppo")}
    print(
        f"{args.model}, {'full fine-tune' if args.full else 'LoRA r=16 on the policy'}; P={args.prompts}, G={args.group} "
        f"({args.prompts * args.group} responses per step), {args.tokens} new tokens, {args.steps} steps each, "
        "each algorithm in its own process\n"
    )
    print(table(results["grpo"], results["ppo"]))
    for name, r in results.items():
        print(f"\n{name} step times (s): {', '.join(f'{s:.2f}' for s in r['step_s'])}")


if __name__ == "__main__":
    main()
