"""PyTorch's fp32 linear (MKL) against oneDNN's (``cohortrl/cpu/kernels.py``) on the products an RL step makes, on
this machine: decoding (one position per sequence, B rows; oneDNN also with the weights in its own blocked
layout, as ``kernels.decoding_weights`` lays them out for generation), a training forward and its backward
(B·T rows), and whole phases of a real model (a sampled batch, response log-probs, their backward). A/B
alternation in one process, same threads; medians and the ratio oneDNN / aten.

    .venv/bin/python benchmarks/cpu_linear.py --model smollm2-135m-instruct --rows 8 --tokens 48

``train.cpu_linear: auto`` picks oneDNN wherever the build has it; run this where you train to check that it
pays there (the numbers in docs/performance.md are from this repository's 2-core AMD EPYC).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cohortrl.cpu import FastPath, kernels
from cohortrl.cpu.kernels import linear_kernels, onednn_available, onednn_linear
from cohortrl.models import load_model
from cohortrl.rollout.hf import Sampling, generate, response_logprobs

ROWS = [{"prompt": f"What is {a} * {b}?"} for a, b in [(3, 4), (7, 8), (6, 9), (2, 5)]]
FAST_PATHS = {kind: FastPath(kind, "system") for kind in ("aten", "onednn")}  # a run's, on each kernel


LINEAR = {"aten": F.linear, "onednn": onednn_linear}  # one product on each kernel


def timed(fn, repeats: int, model=None) -> dict[str, float]:
    """Median seconds of ``fn(kind)`` under each kernel (``model``'s linear layers switched to it), alternating
    aten / oneDNN ``repeats`` times after a warm-up."""
    times: dict[str, list[float]] = {"aten": [], "onednn": []}
    for i in range(repeats + 1):
        for kind in times:
            with linear_kernels(kind, model):
                t0 = time.perf_counter()
                fn(kind)
                if i:  # the first round warms both up
                    times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8, help="B: sequences decoded together (P·G)")
    parser.add_argument("--tokens", type=int, default=48, help="T: response tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not onednn_available():
        raise SystemExit("this PyTorch build has no oneDNN linear op: nothing to compare")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    B, T = args.rows, args.tokens
    # Every linear layer of the model once, in order, as one decoding step or one training forward makes them
    # (distinct weights: a product repeated on one small weight would run from cache, which decoding never does).
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    results = []  # (what, aten s, onednn s)
    for what, rows in (("one decoding step", B), ("one training forward", B * T)):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        r = timed(lambda kind: [LINEAR[kind](xs[w.shape[1]], w) for w in weights], args.repeats)
        results.append((f"{what}: all {len(weights)} linear layers, {rows} rows", r["aten"], r["onednn"]))
    gs = {w.shape[0]: torch.randn(B * T, w.shape[0]) for w in weights}
    r = timed(lambda kind: [LINEAR[kind](gs[w.shape[0]], w.t()) for w in weights], args.repeats)
    results.append((f"their input gradients (dy W), {B * T} rows", r["aten"], r["onednn"]))
    # Decoding under the oneDNN kernel uses the weights in oneDNN's blocked layout (kernels.decoding_weights).
    xs = {w.shape[1]: torch.randn(B, w.shape[1]) for w in weights}
    layout = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, B) for w in weights]
        layout.append(time.perf_counter() - t0)
    dense = timed(lambda kind: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeats)["aten"]
    blocked = timed(lambda kind: [kernels._onednn(xs[w.shape[1]], p, None) for w, p in zip(weights, packed)],
                    args.repeats)["onednn"]
    results.append((f"one decoding step, weights in oneDNN's layout for {B} rows (kernels.decoding_weights)", dense, blocked))
    results.append(("laying the weights out in that layout (once per generate call)", float("nan"), statistics.median(layout)))

    sampling = Sampling(temperature=1.0, max_new_tokens=T, min_new_tokens=T)
    groups = max(1, B // 4)
    rollout, _ = generate(model, tok, ROWS[:groups], B // groups, sampling)
    r = timed(lambda kind: generate(model, tok, ROWS[:groups], B // groups, sampling, fast_path=FAST_PATHS[kind]),
              args.repeats, model)
    # under oneDNN a Llama-family model decodes through the lean step (cpu/decoder.py), under aten through
    # transformers' forward: this row is the whole decoding path, not the kernel alone
    results.append((f"generate {B} x {T} tokens (oneDNN: cpu/decoder.py's lean step where it applies)", r["aten"], r["onednn"]))
    ids, mask = rollout.input_ids(), rollout.attention_mask()
    with torch.no_grad():
        r = timed(lambda kind: response_logprobs(model, ids, mask, rollout.response_ids), args.repeats, model)
    results.append(("response log-probs, no grad (reference)", r["aten"], r["onednn"]))

    def forward_backward(kind):
        model.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(model, ids, mask, rollout.response_ids, with_entropy=True)
        logp.sum().backward()

    r = timed(forward_backward, args.repeats, model)
    results.append(("response log-probs, forward + backward (update)", r["aten"], r["onednn"]))

    print(f"# fp32 linear: aten (MKL) vs oneDNN, {args.model}, {args.threads} thread(s), torch {torch.__version__}\n")
    print("| work | aten (ms) | oneDNN (ms) | oneDNN / aten |\n|---|---:|---:|---:|")
    for what, a, o in results:
        if a != a:  # NaN: oneDNN only
            print(f"| {what} | | {o * 1e3:.1f} | |")
        else:
            print(f"| {what} | {a * 1e3:.1f} | {o * 1e3:.1f} | {o / a:.2f}x |")


if __name__ == "__main__":
    main()
