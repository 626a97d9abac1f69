"""``cohortrl plan`` against measurement: peak resident memory and step time of real training steps on this CPU
beside the planner's prediction for the same work, on the configurations the engineering runs use.

Each configuration runs in its own subprocess, niced by the caller; each step's peak resident memory is its own
(Linux's VmHWM, reset before the step), not the process's peak so far. The
subprocess reads its baseline (VmRSS after importing torch, transformers, peft and the trainer, before any
model), measures this CPU's rates at the model's shapes (``planner.measure_cpu_rates``: the
calibration the planner's times rest on, taken in the same process, at the same moment and with the same
threads as the steps it predicts; decoding's in the dtype of the products the trainer will decode with, as the
planner resolves ``train.cpu_decode_dtype`` on this machine, checked against the trainer's), builds the trainer
and runs ``--steps`` steps, recording for each step its wall time, the process's CPU time and the shapes it
had: prompt columns, distinct prompts, decoding steps, response and tool-result tokens, and whether the update
ran on decoding's recording. The prediction
(``planner.plan``) takes those shapes, so the comparison tests the planner's model of the trainer, not a
guess of how long the model's answers will be.

Time: the planner predicts compute seconds on ``threads`` threads. The machine is shared; a niced process's
wall time includes the time other processes held the cores, while its CPU time (user + system, from
``resource.getrusage``) counts only what it ran. With one torch thread (``--threads 1``, the default) CPU time
is that thread's busy time, unaffected by waiting for a core; with several, OpenMP threads that spin while
they wait for each other add CPU time under contention. The tolerance is therefore on CPU time per step with
one thread; the wall time is printed beside it.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/planner_validation.py --steps 2 \\
        --init /path/to/sft/final --json docs/planner_validation.json

Not part of the test suite: SmolLM2-135M-Instruct steps take tens of seconds to minutes each on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1024**2
MEMORY_TOLERANCE = 0.20
TIME_TOLERANCE = 0.25

# name → (config file, overrides): `make demo`'s RL phase as it runs (`configs/demo_grpo.yaml`: GRPO on python_function
# level 1, P 4 x G 8, no tool), the engineering GRPO configuration (GRPO with the calculator on axial_stress) at
# two batches (2 x 4: the demo's RL phase until 2026-12-05, then named `demo_grpo`), and its PPO variant on the
# same family. Their lengths (256 new tokens, up to 8 calculator
# calls) are the configs'; the batches are smaller than the configs' P = 4 x G = 8, so that a run fits beside
# the other jobs of a shared 23 GB machine (a first try at 4 x 4 was killed when its memory ran out): demo
# 2 x 4, GRPO 4 x 2 (more distinct prompts, smaller groups), PPO 4 x 1 in micro-batches of one sequence (PPO's
# update runs its own forward, whose activations grow with the micro-batch; the setting is the config's own).
CONFIGS = {
    "demo_grpo": ("configs/demo_grpo.yaml", []),
    "eng_grpo_2x4": ("configs/eng_grpo.yaml", ["algorithm.prompts_per_step=2", "algorithm.group_size=4"]),
    "eng_grpo": ("configs/eng_grpo.yaml", ["algorithm.prompts_per_step=4", "algorithm.group_size=2"]),
    "eng_ppo": ("configs/eng_grpo.yaml", ["algorithm.name=ppo", "algorithm.prompts_per_step=4", "algorithm.group_size=1",
                                          "algorithm.micro_batch_size=1"]),
}


def init_for(name: str, inits: list[str]) -> str | None:
    """The warm start a configuration runs from: ``NAME=PATH`` from ``--init`` for that configuration, else the
    plain ``PATH`` given (one for the rest), else None."""
    named = dict(i.split("=", 1) for i in inits if "=" in i.split("/")[0])
    plain = [i for i in inits if "=" not in i.split("/")[0]]
    return named.get(name, plain[0] if plain else None)


def status_bytes(key: str) -> float:
    """A memory figure of /proc/self/status (``VmRSS``, ``VmHWM``; Linux reports them in kB), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status: this benchmark needs Linux")


def vm_rss_bytes() -> float:
    """The current resident set size (not the peak)."""
    return status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Start a new peak: Linux resets VmHWM (the peak resident set) on writing 5 to /proc/self/clear_refs. False
    where it cannot (then each step's peak is the process's peak so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def step_peak_mib() -> float:
    """VmHWM: the peak resident memory since the last :func:`reset_peak_rss`, in MiB."""
    return status_bytes("VmHWM") / MIB


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def overrides(name: str, args) -> list[str]:
    """The configuration's own overrides plus the benchmark's: steps, threads, no evaluation or checkpoints."""
    extra = [f"train.steps={args.steps}", f"train.threads={args.threads}", "train.progress=false",
             "eval.before=false"]
    init = init_for(name, args.init)
    if init:
        extra.append(f"model.init={init}")
    else:  # the configs' warm start may not exist here: the base model (its answers' lengths are measured anyway)
        extra.append("model.init=null")
    return [*CONFIGS[name][1], *extra]


def step_shape(rollout) -> dict:
    """What the planner needs to know of one rollout: its padded sizes and its real token counts."""
    from cohortrl.rollout.hf import _unique_prompts

    prompt_cols = rollout.prompt_ids.shape[1]
    distinct = _unique_prompts(rollout.prompt_ids, rollout.prompt_mask)[0].shape[0]
    tool = int(rollout.tool_mask.sum()) if rollout.tool_mask is not None else 0
    return {
        "sequences": rollout.prompt_ids.shape[0], "prompt_len": prompt_cols, "distinct_prompts": distinct,
        "response_len": rollout.response_ids.shape[1], "response_tokens": int(rollout.response_mask.sum()),
        "tool_tokens": tool, "replayed": rollout.replay is not None,
    }


@contextlib.contextmanager
def profiled(on: bool):
    """With ``on``: torch's profiler around the block, its operators by CPU time to stderr (a diagnosis of where
    a step's time goes that the planner's FLOPs do not see; it slows the step it profiles)."""
    if not on:
        yield
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)


def child(name: str, args) -> None:
    """One configuration's steps in this process; prints one JSON line."""
    import tempfile

    import peft  # noqa: F401  (part of the baseline: the trainer imports it for LoRA)
    import torch
    import transformers  # noqa: F401

    from cohortrl.config import Config
    from cohortrl.planner import resolve_shape, run_spec_from_config, validate
    from cohortrl.planner.cpu_rates import measure_cpu_rates
    from cohortrl.trainers import make_trainer, step
    from cohortrl.trainers.metrics import peak_rss_mb
    from cohortrl.trainers.setup import cpu_bf16_products, decoding_step_ops

    baseline = vm_rss_bytes()
    cfg = Config.from_yaml(REPO / CONFIGS[name][0], overrides(name, args))
    torch.set_num_threads(args.threads)
    planned = validate(run_spec_from_config(cfg, bf16_units=cpu_bf16_products(), device="cpu"))
    decode_dtype = planned.decode_dtype
    # the attention probe's cache: the config's mean context (the longest prompt, half the budget); the step
    # overhead's probe: the config's sampler, recording where the update runs on decoding's recording
    rates = measure_cpu_rates(resolve_shape(cfg.model.name), threads=args.threads,
                              rows=cfg.algorithm.prompts_per_step * cfg.algorithm.group_size, rank=cfg.model.lora.r,
                              decode_dtype=decode_dtype, ops=decoding_step_ops(cfg.sampling),
                              context=cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens // 2,
                              record=planned.reuse_rollout_forward)
    steps = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(cfg, run_dir)
        trained = {torch.float32: "fp32", torch.bfloat16: "bf16"}[getattr(trainer.engine, "decode_dtype", torch.float32)]
        if trained != decode_dtype:
            sys.exit(f"{name}: the planner resolves train.cpu_decode_dtype to {decode_dtype}, the trainer decodes in "
                     f"{trained}: planner.run_spec_from_config no longer follows cpu.build")
        after_setup = peak_rss_mb()
        update, sample = step.update, trainer.sampler.sample

        def timed(name, fn):
            def call(*a, **kw):
                start = cpu_seconds()
                try:
                    return fn(*a, **kw)
                finally:
                    steps[-1][f"cpu_{name}_s"] = cpu_seconds() - start
            return call

        def recording_update(t, rollout, *rest):
            steps[-1].update(step_shape(rollout))
            return update(t, rollout, *rest)

        step.update = timed("update", recording_update)  # the update: forward/backward, optimiser step (this process's only trainer)
        trainer.sampler.sample = timed("sample", sample)  # generation and scoring
        for i in range(args.steps):
            steps.append({})
            per_step = reset_peak_rss()  # each step's own peak, not the process's so far
            wall, cpu = time.perf_counter(), cpu_seconds()
            with profiled(i + 1 == args.profile_step):
                metrics = trainer.step()
            steps[-1].update(wall_s=time.perf_counter() - wall, cpu_s=cpu_seconds() - cpu, peak_rss_mb=step_peak_mib(),
                             peak_is_the_steps=per_step,
                             phases={k[5:]: v for k, v in metrics.items() if k.startswith("time/")})
            trainer.step_count += 1
        trainer.close()
    print(json.dumps({"name": name, "config": CONFIGS[name][0], "overrides": overrides(name, args),
                      "baseline_bytes": baseline, "peak_after_setup_mb": after_setup, "threads": args.threads,
                      "decode_dtype": decode_dtype, "cpu_rates": rates, "steps": steps}))


def run_spec(cfg, measured: dict, step: dict):
    """The planner's RunSpec for one measured step: the trainer's settings from the config, the sizes the step had."""
    from cohortrl.planner import run_spec_from_config

    return run_spec_from_config(
        cfg, prompt_len=step["prompt_len"], response_len=step["response_len"],
        response_tokens=step["response_tokens"], tool_tokens=step["tool_tokens"],
        distinct_prompts=step["distinct_prompts"], device="cpu", cpu_baseline_bytes=measured["baseline_bytes"], cpu_rates=measured["cpu_rates"],
        decode_dtype=measured.get("decode_dtype", "fp32"),  # measurements before it was recorded decoded in fp32
    )


def compare(measured: dict) -> list[dict]:
    """Per step: the planner's prediction beside the measurement."""
    from cohortrl.config import Config
    from cohortrl.planner import plan

    # the planner reads no weights (the warm start shows only in the recorded lengths), so a file re-planned on
    # another machine, whose warm-start directory is not there, plans the same with model.init=null
    cfg = Config.from_yaml(REPO / measured["config"],
                           [o for o in measured["overrides"] if not o.startswith("model.init=")] + ["model.init=null"])
    rows = []
    for i, step in enumerate(measured["steps"]):
        p = plan(cfg.model.name, run_spec(cfg, measured, step))
        rows.append({"step": i + 1, "plan": p, "predicted_mib": p.memory.peak / MIB,
                     "measured_mib": step["peak_rss_mb"], "predicted_s": p.step_time, "cpu_s": step["cpu_s"],
                     "wall_s": step["wall_s"], **{k: step[k] for k in ("prompt_len", "distinct_prompts", "response_len",
                                                                         "response_tokens", "tool_tokens", "replayed")}})
    return rows


def table(results: list[tuple[dict, list[dict]]]) -> tuple[str, bool]:
    """The markdown table and whether every row is within the tolerances."""
    lines = ["| config | step | B · (s_p + T) | distinct prompts | tool tokens | replayed | predicted peak MiB | "
             "measured peak MiB | error | predicted s | CPU s | error | wall s |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    ok = True
    for measured, rows in results:
        for r in rows:
            mem_err = r["predicted_mib"] / r["measured_mib"] - 1
            time_err = r["predicted_s"] / r["cpu_s"] - 1
            ok &= abs(mem_err) <= MEMORY_TOLERANCE and abs(time_err) <= TIME_TOLERANCE
            lines.append(
                f"| {measured['name']} | {r['step']} | {r['plan'].run.sequences} · ({r['prompt_len']} + {r['response_len']}) | "
                f"{r['distinct_prompts']} | {r['tool_tokens']} | {'yes' if r['replayed'] else 'no'} | "
                f"{r['predicted_mib']:.0f} | {r['measured_mib']:.0f} | {mem_err:+.1%} | {r['predicted_s']:.1f} | "
                f"{r['cpu_s']:.1f} | {time_err:+.1%} | {r['wall_s']:.1f} |")
    return "\n".join(lines), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1: see the docstring)")
    parser.add_argument("--init", action="append", default=[],
                        help="model.init: a supervised warm start's final/, for every configuration (PATH) or for one "
                             "(NAME=PATH; repeat the flag); default: the base model")
    parser.add_argument("--profile-step", type=int, default=0, help="print torch's profile of this step (a diagnosis)")
    parser.add_argument("--json", default=None, help="also write the measurements here, replacing the entries of the configurations measured and "
                             "keeping the file's others (a later --from-json re-plans them)")
    parser.add_argument("--from-json", default=None, help="compare saved measurements instead of running steps")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    if args.from_json:
        measurements = json.loads(Path(args.from_json).read_text())
    else:
        measurements = []
        kept = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else []
        kept = [m for m in kept if m["name"] not in args.configs and m["name"] in CONFIGS]
        for name in args.configs:
            cmd = [sys.executable, __file__, *[a for a in sys.argv[1:]], "--child", name]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
            if out.returncode != 0:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            measurements.append(json.loads(out.stdout.strip().splitlines()[-1]))
            if args.json:  # this run's configurations replace their entries; the file's others are kept
                Path(args.json).write_text(json.dumps(kept + measurements, indent=1) + "\n")
        measurements = kept + measurements
    from cohortrl.planner import PlanError

    try:
        text, ok = table([(m, compare(m)) for m in measurements])
    except PlanError as e:  # measurements from an older version (--from-json), without a rate the planner needs
        sys.exit(f"error: {e}")
    decoding = ", ".join(f"{m['name']} {m.get('decode_dtype', 'fp32')}" for m in measurements)
    print(f"fp32 models, one process, decoding's products: {decoding}; memory: predicted peak vs the step's peak "
          f"resident memory (VmHWM reset before the step; tolerance ±{MEMORY_TOLERANCE:.0%}); time: "
          f"predicted compute seconds vs the step's process CPU time at {measurements[0]['threads']} thread(s) "
          f"(tolerance ±{TIME_TOLERANCE:.0%})\n")
    print(text)
    print(f"\nwithin tolerance: {'all' if ok else 'NOT all'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
