"""The chunked LM head against the model's own full-logits head in ``response_logprobs``: seconds and peak
resident memory above the starting point, no-grad (reference log-probs) and forward+backward (the update),
alternating the two A/B/A/B in one process. Random prompts (G = 4 rows share each) and responses.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/logprob_head.py --model smollm2-135m-instruct --rows 8 \
        --prompt-tokens 40 --response-tokens 64 --lora

Peak memory is VmHWM from /proc/self/status, reset before each call (Linux: /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cohortrl.rollout.hf as hf
from cohortrl.models import load_model


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status: this benchmark needs Linux")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on every projection (the head stays frozen)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, _ = load_model(args.model)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    V = model.get_output_embeddings().weight.shape[0]
    prompts = torch.randint(10, V, (max(1, args.rows // 4), args.prompt_tokens)).repeat_interleave(4, 0)[: args.rows]
    responses = torch.randint(10, V, (args.rows, args.response_tokens))
    ids = torch.cat([prompts, responses], 1)
    mask = torch.ones_like(ids)
    chunked_head = hf._plain_lm_head

    def run(chunked: bool, grad: bool) -> tuple[float, float]:
        hf._plain_lm_head = chunked_head if chunked else (lambda m: None)  # None: the model's own head
        model.zero_grad(set_to_none=True)
        start = _status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        t0 = time.perf_counter()
        if grad:
            logp, _ = hf.response_logprobs(model, ids, mask, responses, temperature=0.7, with_entropy=True)
            logp.sum().backward()
        else:
            with torch.no_grad():
                hf.response_logprobs(model, ids, mask, responses, temperature=0.7)
        return time.perf_counter() - t0, _status_mib("VmHWM") - start

    print(f"{args.model}{' + LoRA r=16' if args.lora else ''}, {args.rows} rows x ({args.prompt_tokens} prompt + "
          f"{args.response_tokens} response tokens), V = {V}, chunk {hf.LOGPROB_CHUNK_BYTES // 2**20} MiB\n")
    print("| pass | head | median s | peak MiB above start |")
    print("|---|---|---:|---:|")
    for grad in (False, True):
        results: dict[bool, list] = {False: [], True: []}
        run(True, grad), run(False, grad)  # warm-up
        for _ in range(args.repeats):
            for chunked in (False, True):
                results[chunked].append(run(chunked, grad))
        for chunked in (False, True):
            seconds = statistics.median(r[0] for r in results[chunked])
            peak = max(0.0, *(r[1] for r in results[chunked]))
            print(f"| {'forward+backward' if grad else 'no-grad'} | {'chunked' if chunked else 'full logits'} | "
                  f"{seconds:.3f} | {peak:.0f} |", flush=True)
    hf._plain_lm_head = chunked_head


if __name__ == "__main__":
    main()
