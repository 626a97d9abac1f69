"""float32 against bfloat16 weights (``model.dtype``) for SmolLM2-135M-Instruct + LoRA on this CPU: SFT steps of
``configs/eng_sft.yaml`` and GRPO steps of ``configs/eng_grpo.yaml`` (axial_stress level 3, the calculator).

    .venv/bin/python benchmarks/bf16_cpu.py --init RUN/final                 # 2 rounds, both workloads
    .venv/bin/python benchmarks/bf16_cpu.py --init RUN/final --only sft --rounds 3 --threads 2

Each (workload, dtype) is an ordinary ``cohortrl sft`` / ``cohortrl train`` run of a few steps in a child process,
the arms alternating float32, bfloat16, float32, ... so that a change in the machine's load reaches both; the
first step of every run (model load, first allocations) is left out of the medians. float32 runs the CPU fast
path where it applies (``train.cpu_fast_path: auto``: oneDNN products, the lean decoder, the replayed backward);
bfloat16 weights send the model to plain transformers and PyTorch's bfloat16 kernels (oneDNN's AMX / AVX512-BF16
products where the CPU has them), with LoRA's adapters and the optimiser in float32. ``--init``: the GRPO runs
start from a warm start's ``final/`` (an untrained model answers nothing, so its rollouts would not be the
study's); without it the GRPO workload is skipped. The report (markdown) goes to stdout: per arm the median step
time and its phases, the ratio, the first steps' losses (the two arms compute the same function to bfloat16's
rounding, not bit for bit), and the CPU's bfloat16 units. Minutes of CPU; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16")
WORKLOADS = {
    "sft": ("sft", "configs/eng_sft.yaml", ["eval.n_prompts=0", "train.checkpoint_every=0"]),
    "grpo": ("train", "configs/eng_grpo.yaml", ["eval.n_prompts=0", "train.checkpoint_every=0",
                                                "algorithm.prompts_per_step=2"]),
}
PHASES = ("time/generate", "time/train")


def cpu_flags() -> str:
    """The CPU's model name and its bfloat16 units, from /proc/cpuinfo (Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    units = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(units) or 'no bfloat16 units'})"


def run_arm(workload: str, dtype: str, steps: int, threads: int, init: str | None, scratch: Path) -> list[dict]:
    """One ordinary run of ``steps`` steps; its metrics.jsonl rows that carry a step time."""
    command, config, overrides = WORKLOADS[workload]
    run_dir = scratch / f"{workload}_{dtype}"
    args = [sys.executable, "-m", "cohortrl", command, str(REPO / config), "--run-dir", str(run_dir), "--overwrite",
            f"train.steps={steps}", f"train.threads={threads}", f"model.dtype={dtype}", "train.progress=false",
            *overrides, *([f"model.init={init}"] if workload == "grpo" else [])]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{workload} {dtype} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "time/step" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", help="a warm start's final/ for the GRPO workload (skipped without it)")
    p.add_argument("--only", choices=sorted(WORKLOADS), help="one workload only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is left out of the medians)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    workloads = [w for w in WORKLOADS if (args.only in (None, w)) and (w != "grpo" or args.init)]
    times: dict = {(w, d): [] for w in workloads for d in DTYPES}
    phases: dict = {(w, d, ph): [] for w in workloads for d in DTYPES for ph in PHASES}
    losses: dict = {}
    with tempfile.TemporaryDirectory(prefix="bf16_cpu_") as scratch:
        for _ in range(args.rounds):
            for w in workloads:
                for d in DTYPES:
                    rows = run_arm(w, d, args.steps, args.threads, args.init, Path(scratch))
                    times[w, d] += [r["time/step"] for r in rows[1:]]
                    for ph in PHASES:
                        phases[w, d, ph] += [r[ph] for r in rows[1:] if ph in r]
                    losses[w, d] = [round(r["loss"], 4) for r in rows]
    print(f"# float32 against bfloat16 weights on {cpu_flags()}\n")
    print(f"{args.rounds} rounds alternating the arms, {args.steps} steps per run (the first left out), "
          f"{args.threads} thread(s), torch threads per run as given.\n")
    print("| workload | arm | median step s | " + " | ".join(f"median {ph} s" for ph in PHASES) + " | losses, steps 1.. |")
    print("|---|---|---:|" + "---:|" * len(PHASES) + "---|")
    for w in workloads:
        for d in DTYPES:
            cells = [f"{statistics.median(phases[w, d, ph]):.2f}" if phases[w, d, ph] else "-" for ph in PHASES]
            print(f"| {w} | {d} | {statistics.median(times[w, d]):.2f} | " + " | ".join(cells) + f" | {losses[w, d]} |")
    print()
    for w in workloads:
        ratio = statistics.median(times[w, "float32"]) / statistics.median(times[w, "bfloat16"])
        print(f"- {w}: float32 / bfloat16 median step time = **{ratio:.2f}x**")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
