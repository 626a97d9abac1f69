"""A roofline of the real GRPO step: each phase's FLOPs, counted from the step's own tokens, against the seconds
it took and this machine's fp32 matmul peak measured in the same run; plus where the rest of the time goes.

The step is a training configuration's (default ``configs/eng_grpo.yaml``: SmolLM2-135M + LoRA r16 on
axial_stress level 3 with the calculator), P prompts × G responses, from a warm start (``--init``, a finished
SFT run's ``final/``: the demo's GRPO starts from one; the base model rarely calls the calculator). A worker
process builds the trainer, runs ``--steps`` steps and times the library's own functions by wrapping them
(nothing in ``cohortrl/`` knows it is measured):

| phase | timed | FLOPs counted (N_body: the decoder layers' linear weights; N_head = V·d; d the width) |
|---|---|---|
| prompt prefill | the decoder's prefill of the distinct prompts | 2·N_body per real prompt token + attention 4·d·(keys seen) per token and layer |
| generation steps | each one-token step of the lean decoder, all B rows | per row the step computes: 2·(N_body + N_head) + attention 4·d·(keys) per layer; split below into tokens the model sampled, tool-result tokens fed to it, and rows that had already ended |
| tool-result prefill | its own prefill calls, where the code has them | as prompt prefill |
| reference / old log-probs | the step's ``reference`` phase | a forward over the update's rows: 2·N_body per prompt, sampled or tool token, 2·N_head per response token, attention once (0 when β = 0 and on-policy) |
| update | the step's ``train`` phase (backward, optimiser) | backward through the recorded forward under LoRA: the frozen weights' input gradients 2·N_body per recorded row, the head's 2·N_head (+2·N_head to recompute logits not kept) per response token, attention 3× its forward; LoRA's own products (rank r) left out |

"Needed" FLOPs are the ones the step's real tokens require (each prompt once, each sampled or fed token once,
the head only where a token is sampled); "executed" are what the code ran (padding, ended rows, the head on
fed tokens). The share of peak is needed FLOPs / seconds / peak. The rest of each step's time is summarised
from ``torch.profiler`` (top operators by self CPU time) on one extra step.

    # the roofline of the current tree (one worker, a profiled extra step)
    .venv/bin/python benchmarks/step_roofline.py --init RUN/final --profile
    # A/B: the current tree against another checkout (e.g. `git worktree add /tmp/base dbb9b36`), alternating
    .venv/bin/python benchmarks/step_roofline.py --init RUN/final --baseline /tmp/base --rounds 2
    # ... both workers alive, their steps alternating one by one (a host whose speed drifts over minutes)
    .venv/bin/python benchmarks/step_roofline.py --init RUN/final --baseline /tmp/base --interleaved --steps 12
    # decoding's products in bf16 (train.cpu_decode_dtype; the shares stay those of the fp32 peak)
    .venv/bin/python benchmarks/step_roofline.py --init RUN/final --override train.cpu_decode_dtype=bfloat16
    # ... against fp32 on an earlier checkout, alternating (the setting for the current tree only)
    .venv/bin/python benchmarks/step_roofline.py --init RUN/final --baseline /tmp/base \
        --current-override train.cpu_decode_dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- timing probe
class Probe:
    """Seconds and calls of the library functions it wraps, per name (the wrapped function's own time, its
    callees included)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.extra: dict[str, list] = defaultdict(list)

    def wrap(self, owner, attribute: str, name: str, on_call=None) -> None:
        """Time ``owner.attribute`` under ``name``; skipped when this tree has no such function (a baseline
        checkout). ``on_call(args, kwargs, result)`` records what the call worked on."""
        original = getattr(owner, attribute, None)
        if original is None:
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            if on_call is not None:
                self.extra[name].append(on_call(args, kwargs, result))
            return result

        setattr(owner, attribute, timed)

    def take(self) -> dict:
        out = {"seconds": dict(self.seconds), "calls": dict(self.calls), "extra": dict(self.extra)}
        self.seconds, self.calls, self.extra = defaultdict(float), defaultdict(int), defaultdict(list)
        return out


def install_probe(probe: Probe, batches: list) -> None:
    """Wrap the step's phases (those this tree has) and put each step's scored batch in ``batches`` (which the
    worker empties once it has counted its tokens)."""
    from cohortrl.cpu import decoder, replay
    from cohortrl.rollout import hf, tools
    from cohortrl.trainers import sampler

    probe.wrap(decoder.LlamaDecoder, "_prefill", "prompt_prefill", lambda a, k, r: list(a[1].shape))
    # the rows each step computed (a tree whose decoder drops ended rows has them in ``rows``)
    probe.wrap(decoder.LlamaDecoder, "step", "decode_steps",
               lambda a, k, r: len(a[0].rows) if getattr(a[0], "rows", None) is not None else int(a[1].shape[0]))
    probe.wrap(decoder.LlamaDecoder, "prefill_tools", "tool_prefill", lambda a, k, r: None)
    probe.wrap(hf, "_sample", "sample_tokens")
    probe.wrap(tools.ToolSession, "after_step", "tool_detect_and_run")
    probe.wrap(tools.ToolSession, "_run", "tool_run")
    probe.wrap(replay.Recording, "__init__", "recording_build")
    # the recorded rows the backward's products ran on (all, unless this tree's backward has ``_reached_rows``)
    probe.wrap(replay.Recording, "backward", "update_backward",
               lambda a, k, r: len(a[0]._reached_rows(a[1].t().float())) if hasattr(a[0], "_reached_rows") else None)
    probe.wrap(hf, "_finish", "decode_texts")
    original = sampler.Sampler.sample

    def sample(self, *args, **kwargs):
        batch = original(self, *args, **kwargs)
        batches.append(batch)
        return batch

    sampler.Sampler.sample = sample


# ---------------------------------------------------------------------------------------------- FLOPs
def model_shape(model) -> dict:
    """N_body (the decoder layers' linear weights, LoRA's rank-r factors left out), N_head (V·d), d, layers."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = sum(m.weight.numel() for name, m in base.model.layers.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    head = base.get_output_embeddings().weight
    return {"n_body": body, "n_head": head.numel(), "d": base.config.hidden_size, "layers": base.config.num_hidden_layers,
            "vocab": head.shape[0]}


def token_counts(rollout) -> dict:
    """What one step's rollout holds, from its masks: per row its prompt length, its response tokens the model
    sampled, the tool-result tokens fed to it, and decoding's step count S (the longest row)."""
    import torch

    prompt_len = rollout.prompt_mask.sum(-1)  # (B,)
    sampled = rollout.response_mask.bool()
    tool = rollout.tool_mask.bool() if rollout.tool_mask is not None else torch.zeros_like(sampled)
    length = (sampled | tool).sum(-1)  # tokens through the row's end
    G = rollout.group_size
    return {"B": int(rollout.batch_size), "G": G, "prompt_len": prompt_len.tolist(), "length": length.tolist(),
            "sampled": int(sampled.sum()), "tool": int(tool.sum()), "S": int(length.max()),
            "Tp": int(rollout.prompt_mask.shape[1]),
            # per row, per response position: 1 where the token is a tool's (for the keys each step sees)
            "tool_positions": [row.nonzero().flatten().tolist() for row in tool]}


def phase_flops(shape: dict, counts: dict, rows_per_step: list[int], update_rows: int | None) -> dict:
    """Needed and executed FLOPs per phase (see the module docstring), from one step's tokens, the rows each
    decoding step computed and the rows the update's backward ran its products on (None: all recorded)."""
    nb, nh, d, L = shape["n_body"], shape["n_head"], shape["d"], shape["layers"]
    B, G, S, Tp = counts["B"], counts["G"], counts["S"], counts["Tp"]
    prompts = counts["prompt_len"][::G]  # one per group (groups are contiguous)
    att = lambda keys: 4 * d * keys * L  # noqa: E731  (scores and values, per query token, all layers)
    prefill_needed = sum(2 * nb * p + sum(att(j + 1) for j in range(p)) for p in prompts)
    prefill_exec = len(prompts) * (2 * nb * Tp + sum(att(j + 1) for j in range(Tp)))
    sampled_f = tool_f = ended_f = 0.0
    for b in range(B):
        p, n, tool = counts["prompt_len"][b], counts["length"][b], set(counts["tool_positions"][b])
        for s in range(S):  # step s feeds response token s − 1 (s = 0: the prompt's last) and predicts token s
            body = 2 * nb + att(p + s)
            if s >= n:  # the row has ended; the step still computes it
                ended_f += body + 2 * nh
            elif s - 1 in tool:  # fed a tool token; the head is needed only where the model samples token s
                tool_f += body + (0 if s in tool else 2 * nh)
            else:
                sampled_f += body + (0 if s in tool else 2 * nh)
    # the step's executed work: the rows each step computed, the head included (their attention as the average
    # row's of the whole batch: the rows computed are not recorded one by one)
    every = sum(att(counts["prompt_len"][b] + s) for b in range(B) for s in range(S)) / (B * S)
    decode_exec = sum(rows_per_step) * (2 * (nb + nh) + every)
    n_resp = counts["sampled"]  # response tokens the loss reaches
    rows = update_rows if update_rows is not None else len(prompts) * Tp + B * S
    update_needed = (2 * nb * (sum(prompts) + counts["sampled"] + counts["tool"]) + 4 * nh * n_resp
                     + 3 * (prefill_needed - 2 * nb * sum(prompts)))
    update_exec = 2 * nb * rows + 4 * nh * n_resp + 3 * (B * S * every + prefill_exec - 2 * nb * len(prompts) * Tp)
    # a forward over the same rows (the reference's, or π_old's): the layers on every token, the head where the
    # loss reads a log-prob, attention once
    scoring_needed = (2 * nb * (sum(prompts) + counts["sampled"] + counts["tool"]) + 2 * nh * n_resp
                      + (prefill_needed - 2 * nb * sum(prompts)))
    scoring_exec = 2 * nb * rows + 2 * nh * n_resp + B * S * every + prefill_exec - 2 * nb * len(prompts) * Tp
    return {"prompt_prefill": (prefill_needed, prefill_exec), "decode_sampled": sampled_f, "decode_tool": tool_f,
            "decode_ended": ended_f, "decode": (sampled_f + tool_f, decode_exec), "update": (update_needed, update_exec),
            "scoring": (scoring_needed, scoring_exec)}


# ---------------------------------------------------------------------------------------------- the worker
def worker(args) -> dict:
    """Build the trainer in this process, run the steps, print one JSON line: per step the phase seconds
    (the trainer's own ``time/`` metrics and the probe's) and the token counts."""
    import torch

    from cohortrl.config import Config
    from cohortrl.trainers.grpo import GRPOTrainer

    torch.set_num_threads(args.threads)
    overrides = [f"algorithm.prompts_per_step={args.prompts}", f"algorithm.group_size={args.group}",
                 f"train.steps={args.steps}", "eval.before=false", f"train.seed={args.seed}", *args.overrides]
    if args.init:
        overrides.append(f"model.init={args.init}")
    cfg = Config.from_yaml(args.config, overrides)
    probe, batches = Probe(), []
    install_probe(probe, batches)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(cfg, run_dir=Path(tmp) / "run")
        setup_s = time.perf_counter() - t0
        shape = model_shape(trainer.model)
        steps = []

        def one_step() -> dict:
            t0, cpu0, use0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            metrics = trainer.step()
            step_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            use = resource.getrusage(resource.RUSAGE_SELF)
            trainer.step_count += 1
            counts = token_counts(batches[-1].rollout)
            batches.clear()  # a batch kept would keep its recording's maps in use, and the next step's in new ones
            print(f"step {len(steps) + 1}: {step_s:.1f} s", file=sys.stderr, flush=True)
            taken = probe.take()
            return {"step_s": step_s, "cpu_s": cpu_s, "sys_s": use.ru_stime - use0.ru_stime,
                    "faults": use.ru_minflt - use0.ru_minflt, "time": {k[5:]: v for k, v in metrics.items() if k.startswith("time/")},
                    "probe": taken, "counts": {k: v for k, v in counts.items() if k != "tool_positions"},
                    "flops": phase_flops(shape, counts, taken["extra"]["decode_steps"],
                                         taken["extra"]["update_backward"][0]), "reused": metrics.get("rollout_forward_reused"),
                    "accuracy": metrics.get("accuracy")}

        if args.interleaved:  # the driver says when: one step per line it writes, each step's record as a line back
            print(json.dumps({"ready": setup_s}), flush=True)
            for _ in sys.stdin:
                steps.append(one_step())
                print(json.dumps({"step": steps[-1]}), flush=True)
        else:
            for _ in range(args.steps):
                steps.append(one_step())
        profile = profile_step(trainer) if args.profile else None
        trainer.close()
    # the reference phase runs a forward (an older tree, e.g. dbb9b36, asks a method with an underscore)
    old_logp = getattr(trainer, "needs_old_logp", None)
    scored = cfg.algorithm.beta > 0 or (old_logp if old_logp is not None else trainer._needs_old_logp())
    return {"tree": os.environ.get("PYTHONPATH", str(REPO)), "setup_s": setup_s, "shape": shape, "steps": steps,
            "scored": scored,
            "profile": profile}


def profile_step(trainer, top: int = 15) -> list[dict]:
    """One more step under ``torch.profiler``: the operators with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step()
    trainer.step_count += 1
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
            for e in rows]


# ---------------------------------------------------------------------------------------------- driver
def worker_command(tree: Path, args, profile: bool, extra_overrides: list[str] = ()) -> tuple[list[str], dict]:
    """The command and environment of ``worker`` in a subprocess with ``tree`` first on PYTHONPATH (the current
    checkout or a baseline), with ``extra_overrides`` after the run's own."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", str(args.config),
           "--prompts", str(args.prompts), "--group", str(args.group), "--steps", str(args.steps),
           "--threads", str(args.threads), "--seed", str(args.seed)]
    if args.init:
        cmd += ["--init", str(args.init)]
    if profile:
        cmd.append("--profile")
    cmd += [f"--override={o}" for o in (*args.overrides, *extra_overrides)]
    if args.interleaved:
        cmd.append("--interleaved")
    return cmd, {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}


def run_worker(tree: Path, args, profile: bool, extra_overrides: list[str] = ()) -> dict:
    """``worker`` in a subprocess (``worker_command``), its ``--steps`` steps one after the other."""
    cmd, env = worker_command(tree, args, profile, extra_overrides)
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=tree)  # its log and progress: stderr
    if out.returncode != 0:
        raise SystemExit(f"worker in {tree} failed (rc {out.returncode}); its log is above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(result: dict, peak: float) -> list[str]:
    """The roofline rows of one worker's steps (medians over its steps)."""
    steps = result["steps"]

    def med(get):
        return statistics.median(get(s) for s in steps)

    def row(phase, needed, executed, secs, note=""):
        share = needed / secs / 1e9 / peak if secs else float("nan")
        return (f"| {phase} | {needed / 1e9:.1f} | {executed / 1e9:.1f} | {secs:.2f} | {needed / secs / 1e9 if secs else 0:.1f} | "
                f"{100 * share:.1f}% | {note} |")

    probe = lambda name: med(lambda s: s["probe"]["seconds"].get(name, 0.0))  # noqa: E731
    timer = lambda name: med(lambda s: s["time"].get(name, 0.0))  # noqa: E731
    flops = lambda name, i: med(lambda s: s["flops"][name][i])  # noqa: E731
    c = steps[-1]["counts"]
    lines = [
        "| phase | needed GFLOP | executed GFLOP | s | GFLOP/s (needed) | share of peak | note |",
        "|---|---:|---:|---:|---:|---:|---|",
        row("prompt prefill", flops("prompt_prefill", 0), flops("prompt_prefill", 1), probe("prompt_prefill"),
            f"{c['B'] // c['G']} distinct prompts, padded to {c['Tp']} columns"),
        row("generation steps (sampled + tool tokens)", flops("decode", 0), flops("decode", 1), probe("decode_steps"),
            f"{c['sampled']} sampled + {c['tool']} tool tokens over S = {c['S']} steps × B = {c['B']}: "
            f"{sum(c['length'])} row-steps needed, {sum(steps[-1]['probe']['extra']['decode_steps'])} computed"),
        row("tool-result prefill", 0.0, 0.0, probe("tool_prefill"), "fed one token per step above unless timed here")
        if probe("tool_prefill") else "| tool-result prefill | (in the steps above) | | | | | fed one token per step |",
        f"| sampling, tool detection and calls, texts | | | {probe('sample_tokens') + probe('tool_detect_and_run') + probe('decode_texts'):.2f} | | | "
        f"sampling {probe('sample_tokens'):.2f}, tools {probe('tool_detect_and_run'):.2f} (calls {probe('tool_run'):.2f}), texts {probe('decode_texts'):.2f} |",
        f"| generate (whole phase) | | | {timer('generate'):.2f} | | | |",
        f"| score | | | {timer('score'):.2f} | | | |",
        row("reference / old log-probs", flops("scoring", 0), flops("scoring", 1), timer("reference"),
            "a forward over the recorded rows, the head on response tokens only")
        if result.get("scored", True) and "scoring" in steps[-1]["flops"]
        else f"| reference / old log-probs | 0 | 0 | {timer('reference'):.2f} | | | β = 0 and on-policy: not computed |",
        row("update (backward + optimiser)", flops("update", 0), flops("update", 1), timer("train"),
            f"backward {probe('update_backward'):.2f} s, optimiser {timer('optimizer'):.2f} s; forward reused: {steps[-1]['reused']}"),
        f"| **step** | | | **{med(lambda s: s['step_s']):.2f}** | | | medians of {len(steps)} step(s); the process's CPU "
        f"time {med(lambda s: s['cpu_s']):.2f} s |",
    ]
    return lines


def matmul_peak(threads: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_trl import matmul_peak_gflops

    return matmul_peak_gflops(threads)["gflops"]


def cpu_name() -> str:
    from cohortrl.machine import cpuinfo

    return cpuinfo().get("model name", "unknown")


def pair_ratio_interval(ratios: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap 95% interval of the median of the pairs' ratios (pairs resampled with replacement)."""
    import numpy as np

    r = np.asarray(ratios)
    medians = np.median(r[np.random.default_rng(seed).integers(0, len(r), (draws, len(r)))], axis=1)
    return float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))


def run_interleaved(arms: list[tuple[str, Path]], args) -> dict[str, list[dict]]:
    """Both workers built and waiting, then step k of each in turn (which goes first alternates from pair to
    pair), so that the two arms' k-th steps run seconds apart: this host's speed drifts by more over the minutes
    between whole rounds than the differences measured."""
    procs = {}
    for name, tree in arms:
        cmd, env = worker_command(tree, args, profile=False,
                                  extra_overrides=args.current_overrides if name == "current" else ())
        procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)
        ready = procs[name].stdout.readline()  # built one at a time: two models loading at once would share the cores
        if not ready:
            raise SystemExit(f"worker in {tree} failed before its first step (rc {procs[name].wait()}); its log is above")
    for k in range(args.steps):
        order, took = arms if k % 2 == 0 else arms[::-1], {}
        for name, _ in order:
            time.sleep(1.0)  # the other worker's OpenMP threads stop spinning before this one starts
            procs[name].stdin.write("step\n")
            procs[name].stdin.flush()
            line = procs[name].stdout.readline()
            if not line:
                raise SystemExit(f"worker {name} failed at step {k + 1} (rc {procs[name].wait()}); its log is above")
            took[name] = json.loads(line)["step"]["step_s"]
        print(f"pair {k + 1}: " + ", ".join(f"{name} {s:.2f} s" for name, s in took.items()), flush=True)
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate("")  # stdin closed: the worker leaves its loop and prints its whole record
        if proc.returncode != 0:
            raise SystemExit(f"worker {name} failed at its end (rc {proc.returncode}); its log is above")
        results[name] = [json.loads(out.strip().splitlines()[-1])]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "eng_grpo.yaml"))
    parser.add_argument("--init", help="the warm start (a finished SFT run's final/), as model.init")
    parser.add_argument("--prompts", type=int, default=4, help="P")
    parser.add_argument("--group", type=int, default=8, help="G")
    parser.add_argument("--steps", type=int, default=2, help="steps per worker (medians over them)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", dest="overrides", action="append", default=[], help="a.b=value, repeatable")
    parser.add_argument("--current-override", dest="current_overrides", action="append", default=[],
                        help="a.b=value for the current tree's worker only (e.g. a setting the baseline does not have)")
    parser.add_argument("--baseline", type=Path, help="another checkout to alternate with (A/B), e.g. a git worktree")
    parser.add_argument("--rounds", type=int, default=2, help="baseline, current alternations (with --baseline)")
    parser.add_argument("--interleaved", action="store_true",
                        help="with --baseline: both workers alive, their steps alternating one by one (--steps pairs) "
                             "instead of whole rounds")
    parser.add_argument("--profile", action="store_true", help="one extra profiled step (the current tree only)")
    parser.add_argument("--out", type=Path, help="also write the JSON results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.interleaved and not args.baseline:
        raise SystemExit("--interleaved alternates with a baseline: give --baseline too")

    peaks = [matmul_peak(args.threads)]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads; fp32 matmul peak {peaks[0]:.0f} GFLOP/s", flush=True)
    arms = ([("baseline", args.baseline)] if args.baseline else []) + [("current", REPO)]
    results: dict[str, list[dict]] = {name: [] for name, _ in arms}
    if args.interleaved:
        results = run_interleaved(arms, args)
    for r in range(0 if args.interleaved else args.rounds if args.baseline else 1):
        for name, tree in arms:
            out = run_worker(tree, args, profile=args.profile and name == "current" and r == 0,
                             extra_overrides=args.current_overrides if name == "current" else ())
            results[name].append(out)
            times = lambda get: ", ".join(f"{get(s):.2f}" for s in out["steps"])  # noqa: E731
            print(f"round {r} {name}: steps {times(lambda s: s['step_s'])} s (generate "
                  f"{times(lambda s: s['time'].get('generate', 0))}, train {times(lambda s: s['time'].get('train', 0))})",
                  flush=True)
    peaks.append(matmul_peak(args.threads))
    peak = statistics.median(peaks)
    print(f"\nfp32 matmul peak (2048³, before / after): {', '.join(f'{p:.0f}' for p in peaks)} GFLOP/s; shares below use {peak:.0f}\n")
    for name, outs in results.items():
        merged = {**outs[0], "steps": [s for o in outs for s in o["steps"]]}
        print(f"### {name} ({merged['tree']})\n")
        print("\n".join(table(merged, peak)))
        profile = next((o["profile"] for o in outs if o.get("profile")), None)
        if profile:
            print("\ntop operators by self CPU time (one profiled step):\n")
            print("| operator | self s | share | calls |\n|---|---:|---:|---:|")
            for p in profile:
                print(f"| `{p['op']}` | {p['self_s']:.2f} | {100 * p['share']:.1f}% | {p['calls']} |")
        print()
    if args.baseline:
        base = [s["step_s"] for o in results["baseline"] for s in o["steps"]]
        cur = [s["step_s"] for o in results["current"] for s in o["steps"]]
        print(f"step s, baseline: {', '.join(f'{x:.2f}' for x in base)}; current: {', '.join(f'{x:.2f}' for x in cur)}")
        print(f"median ratio baseline / current: {statistics.median(base) / statistics.median(cur):.2f}x")
        if args.interleaved:  # step k of each arm ran seconds apart: the pairs' ratios, and how far they move
            ratios = [b / c for b, c in zip(base, cur)]
            low, high = pair_ratio_interval(ratios)
            print(f"per pair baseline / current: median {statistics.median(ratios):.3f}x (bootstrap 95% CI of the "
                  f"median over pairs {low:.3f}-{high:.3f}); current faster in {sum(r > 1 for r in ratios)} of {len(ratios)} pairs")
        base = [s["cpu_s"] for o in results["baseline"] for s in o["steps"]]
        cur = [s["cpu_s"] for o in results["current"] for s in o["steps"]]
        print(f"step CPU s (the worker process's user + system time), baseline: {', '.join(f'{x:.2f}' for x in base)}; "
              f"current: {', '.join(f'{x:.2f}' for x in cur)}; median ratio {statistics.median(base) / statistics.median(cur):.2f}x")
        # page faults and system time: what the kernel spent mapping pages in, not moved by other load on the host
        for key, what in (("faults", "minor page faults"), ("sys_s", "system CPU s")):
            base = [s.get(key) for o in results["baseline"] for s in o["steps"]]
            cur = [s.get(key) for o in results["current"] for s in o["steps"]]
            print(f"{what} per step, median: baseline {statistics.median(base):.6g}, current {statistics.median(cur):.6g}")
    if args.out:
        args.out.write_text(json.dumps({"peaks": peaks, "results": results}, indent=1))


if __name__ == "__main__":
    main()
