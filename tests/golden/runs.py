"""The golden training runs: tiny configurations whose per-step metrics are pinned in ``golden_runs.json``.

Each run is 3 steps of the tiny random Llama (2 prompts x 4 responses of at most 8 tokens for GRPO, 8 x 1
for PPO, 2 micro-batches of 2 prompt/completion rows for SFT) trained in-process, exactly as a user's run, on
in-memory rows (and, for RL, the reward functions of ``rewards.py``). After every step it records the logged
metrics (loss, policy loss, KL, grad norm, reward, entropy, LR, lengths, and the algorithm's own numbers; for
SFT loss, grad norm, LR, loss tokens, examples and epoch) and, for RL, statistics of the advantages the step
trained on (mean, std, min, max over response tokens, read from the step's ``Targets``).

``tests/trainers/test_golden.py`` reruns every run and compares with the numbers pinned for the installed
torch version; ``python -m tests.golden.regenerate`` pins them again and prints what changed. This module
run as ``python -m tests.golden.runs --out FILE`` writes the current numbers (the regenerator calls it in
two fresh processes, in opposite orders, and pins only bit-identical results).

What each run covers (one run per registry entry, so a silently swapped entry changes its numbers):
    grpo ... grpo_combined   every advantage estimator, aggregation seq-mean-token-mean, β·KL (k3) in the loss
    agg_*                    the other two aggregation modes (estimator grpo)
    kl_in_reward             β·KL (k1) moved into the reward (GRPO)
    grpo_epochs2             2 epochs x 2 minibatches: log π_old, ratios away from 1, clipping
    grpo_minibatches2        1 epoch x 2 minibatches: the second minibatch's ratio against the rollout's π_old
    gspo                     the sequence-level policy loss (GSPO), 1 epoch x 2 minibatches so its ratio leaves 1
    ppo                      PPO: critic (one warm-up step with the policy frozen), GAE, adaptive β
    sft                      SFTTrainer (a run with an ``sft`` section, built by ``_sft_trainer``, not
                             ``make_trainer``) on SFT_ROWS, the same 40 additions as prompt/completion rows;
                             batch size 2 x 2 micro-batches of gradient accumulation in every step, with
                             different loss-token counts in step 1's two micro-batches (14 and 10)
    sft_spans                SFT as ``sft`` on SFT_SPAN_ROWS: every completion holds tokens without loss (a
                             calculator's result, or a second user turn), so loss tokens < completion tokens
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from tests.golden.rewards import starts_with_letter, starts_with_vowel

GOLDEN_FILE = Path(__file__).with_name("golden_runs.json")
REGENERATE = "python -m tests.golden.regenerate"
# Relative tolerance of the comparison. The absolute floor only matters for values that are rounding noise
# around 0 (e.g. the KL of step 1, where policy and reference are the same weights but the policy's log-probs
# come from decoding's kernels: ~1e-14).
RTOL, ATOL = 1e-5, 1e-9
# The runs use one thread, in the test as here. The numbers are the same with two (checked when they were
# first pinned), but on a busy 2-core machine two threads spin against each other: 3-10x the CPU time.
THREADS = 1
# Wall-clock and memory readings, and the per-function reward keys (their names carry the file path).
UNPINNED_PREFIXES = ("time/", "tokens_per_s", "peak_rss_mb", "reward/")

PROCESS_REWARD = {"name": f"{Path(__file__).with_name('rewards.py')}:letter_words", "coef": 0.5,
                  "require_answer": False}

BASE = {
    "model": {"name": "tiny-llama", "system_prompt": None},
    "data": {"eval_size": 4},
    # A space ends a response: lengths vary from 1 to 8 tokens, so the three aggregation modes differ (with equal
    # lengths they agree) and responses stop early as well as hit the budget.
    "sampling": {"max_new_tokens": 8, "temperature": 1.0, "stop": [" "]},
    "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.1},
    # A large LR for a tiny model: the KL to the reference is far from 0 by step 2, so dropping it shows.
    "optim": {"lr": 1e-2},
    "train": {"steps": 3, "progress": False},
    "eval": {"before": False, "n_prompts": 0},
}

RUNS: dict[str, dict] = {
    "grpo": {},
    "grpo_batch": {"algorithm": {"estimator": "grpo_batch"}},
    "dr_grpo": {"algorithm": {"estimator": "dr_grpo"}},
    "rloo": {"algorithm": {"estimator": "rloo"}},
    "reinforce_pp": {"algorithm": {"estimator": "reinforce_pp"}},
    "reinforce_pp_baseline": {"algorithm": {"estimator": "reinforce_pp_baseline"}},
    "grpo_process": {"algorithm": {"estimator": "grpo_process"}, "reward": {"process": PROCESS_REWARD}},
    "grpo_combined": {"algorithm": {"estimator": "grpo_combined"}, "reward": {"process": PROCESS_REWARD}},
    "agg_token_mean": {"algorithm": {"aggregation": "token-mean"}},
    "agg_seq_mean_token_sum_norm": {"algorithm": {"aggregation": "seq-mean-token-sum-norm"}},
    "kl_in_reward": {"algorithm": {"kl_in_reward": True, "kl_estimator": "k1"}},
    "grpo_epochs2": {"algorithm": {"epochs": 2, "minibatches": 2}},
    "grpo_minibatches2": {"algorithm": {"minibatches": 2}},
    "gspo": {"algorithm": {"policy_loss": "gspo", "minibatches": 2}},
    "ppo": {
        "algorithm": {
            "name": "ppo", "group_size": 1, "prompts_per_step": 8, "beta": 0.05, "epochs": 2, "minibatches": 2,
            "ppo": {"critic_lr": 1e-3, "critic_warmup_steps": 1, "kl_controller": "adaptive", "target_kl": 1.0,
                    "horizon": 1000, "vf_coef": 0.1, "value_clip": 0.2, "missing_eos_penalty": 0.1},
        },
    },
    # SFT (a run with an "sft" section; built by SFTTrainer on SFT_ROWS): 3 steps of 2 micro-batches of 2.
    "sft": {"sft": {"batch_size": 2, "grad_accum": 2}},
    # SFT on SFT_SPAN_ROWS: completions with a calculator's result or a second user turn inside, without loss.
    "sft_spans": {"sft": {"batch_size": 2, "grad_accum": 2}},
}

# 40 additions, fixed: the runs depend on the trainer, not on the gym's task generators.
ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(5) for b in range(8)]
# The same additions as SFT rows: the completion is the bare answer for even b and the equation for odd b, so
# completions are 3 to 7 tokens (with the end-of-turn tokens) and a step's micro-batches hold different
# numbers of loss tokens (a loss averaged per micro-batch then differs from the step's mean).
SFT_ROWS = [{"prompt": f"What is {a} + {b}?", "completion": str(a + b) if b % 2 == 0 else f"{a} + {b} = {a + b}"}
            for a in range(5) for b in range(8)]


def _span_row(a: int, b: int) -> dict:
    """An SFT row whose completion holds tokens without loss: for even b, a calculator's result (a text
    completion with ``no_loss_spans`` over ``<result>...</result>``); for odd b, a second user turn between two
    assistant turns (a conversation)."""
    if b % 2 == 0:
        completion = f"<call>{a}+{b}</call><result>{a + b}</result> {a + b}"
        start = completion.index("<result>")
        return {"prompt": f"What is {a} + {b}?", "completion": completion,
                "no_loss_spans": [[start, start + len(f"<result>{a + b}</result>")]]}
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)},
                         {"role": "user", "content": "Twice that?"}, {"role": "assistant", "content": str(2 * (a + b))}]}


# The same additions with untrained spans inside every completion: a loss divided by the completion's length
# instead of its loss tokens changes the numbers only on rows like these.
SFT_SPAN_ROWS = [_span_row(a, b) for a in range(5) for b in range(8)]
SFT_DATASETS = {"sft_spans": SFT_SPAN_ROWS}  # an SFT run's rows when not SFT_ROWS


def golden_key(cpu_fast_path: str = "auto") -> str:
    """Whose numbers apply here: the torch version and the CPU's vendor. The same torch rounds differently on
    another vendor's CPU (oneDNN and MKL pick kernels by it; docs/testing.md, "Golden runs"), so each vendor
    has its own pinned numbers. So has the plain CPU path (``cpu_fast_path`` off, the pass ``pytest
    --cpu-fast-path=off`` runs), which rounds otherwise than the fast path and reuses no forward of decoding's."""
    from cohortrl.machine import cpuinfo

    vendor = cpuinfo().get("vendor_id") or platform.machine() or "unknown"
    key = f"{torch.__version__} {vendor}"
    return key if cpu_fast_path == "auto" else f"{key} cpu_fast_path={cpu_fast_path}"


def is_sft(name: str) -> bool:
    """Whether run ``name`` is supervised (``SFTTrainer``); the RL trainers do not read the ``sft`` section."""
    return "sft" in RUNS[name]


def config(name: str) -> dict:
    """The full config of run ``name``: ``BASE`` with the run's sections merged in (one level deep)."""
    cfg = copy.deepcopy(BASE)
    for section, values in RUNS[name].items():
        cfg[section] = {**cfg.get(section, {}), **copy.deepcopy(values)}
    return cfg


def advantage_stats(advantages_BT: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    values = advantages_BT[response_mask.bool()].double()
    return {"adv_mean": values.mean().item(), "adv_std": values.std().item(),
            "adv_min": values.min().item(), "adv_max": values.max().item()}


def pinned_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items()
            if not k.startswith(UNPINNED_PREFIXES) and (v is None or isinstance(v, (int, float)))}


def _rl_trainer(name: str, run_dir: str | Path):
    """The RL trainer of run ``name`` and the list its steps' advantage statistics are appended to."""
    from cohortrl.trainers import make_trainer

    trainer = make_trainer(config(name), run_dir, reward_funcs=[starts_with_letter, starts_with_vowel],
                           reward_weights=[1.0, 0.5], train_dataset=ROWS)
    advantages = []
    targets = trainer.algorithm.targets

    def recording_targets(batch, *args, **kwargs):  # the advantages the step trains on, as the update sees them
        out = targets(batch, *args, **kwargs)
        advantages.append(advantage_stats(out.advantages, batch.rollout.response_mask))
        return out

    trainer.algorithm.targets = recording_targets
    return trainer, advantages


def _sft_trainer(name: str, run_dir: str | Path):
    """The SFT trainer of run ``name`` on ``SFT_ROWS`` (no advantages to record)."""
    from cohortrl.trainers.sft import SFTTrainer

    return SFTTrainer(config(name), run_dir, train_dataset=SFT_DATASETS.get(name, SFT_ROWS)), None


def run(name: str, run_dir: str | Path) -> list[dict]:
    """Train run ``name`` in ``run_dir``; one dict of pinned numbers per step."""
    trainer, advantages = (_sft_trainer if is_sft(name) else _rl_trainer)(name, run_dir)
    # The end-of-run plot takes longer than the training (matplotlib) and computes nothing that is pinned.
    patch = mock.patch("cohortrl.trainers.loop.plot_curves", lambda run_dir: None)
    try:
        with patch:
            rows = [r for r in trainer.train() if "loss" in r]
    finally:
        trainer.close()
    if advantages is None:
        return [pinned_metrics(r) for r in rows]
    return [{**pinned_metrics(r), **a} for r, a in zip(rows, advantages, strict=True)]


def close(expected, got) -> bool:
    if expected is None or got is None:
        return expected is got
    return math.isclose(float(got), float(expected), rel_tol=RTOL, abs_tol=ATOL)


def compare(expected: list[dict], got: list[dict]) -> list[str]:
    """Every difference beyond the tolerance, one line each; metrics only ``got`` has are new, not wrong."""
    if len(expected) != len(got):
        return [f"{len(got)} steps, pinned {len(expected)}"]
    out = []
    for step, (want, have) in enumerate(zip(expected, got), start=1):
        for key, value in want.items():
            if key not in have:
                out.append(f"step {step} {key}: no longer logged (pinned {value!r})")
            elif not close(value, have[key]):
                rel = ""
                if value and have[key] is not None:
                    rel = f" (relative {(have[key] - value) / abs(value):+.2e})"
                out.append(f"step {step} {key}: {have[key]!r}, pinned {value!r}{rel}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the golden runs and write their numbers as JSON.")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--reverse", action="store_true", help="run them in the opposite order")
    parser.add_argument("--cpu-fast-path", choices=("auto", "off"), default="auto",
                        help="off: on the plain CPU path, as `pytest --cpu-fast-path=off` runs them")
    parser.add_argument("names", nargs="*", help="runs to do (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    if args.cpu_fast_path == "off":  # the switch the test pass makes (a fresh process: for good)
        from cohortrl.config import Config
        from tests.plain_path.sitecustomize import plain

        Config.__post_init__ = plain(Config.__post_init__)
    names = args.names or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; the runs are {list(RUNS)}")
    results, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        for name in reversed(names) if args.reverse else names:
            start, cpu = time.perf_counter(), time.process_time()
            results[name] = run(name, Path(tmp) / name)
            seconds[name] = time.perf_counter() - start
            print(f"{name}: {seconds[name]:.1f} s wall, {time.process_time() - cpu:.1f} s CPU", file=sys.stderr)
    Path(args.out).write_text(json.dumps({"key": golden_key(args.cpu_fast_path), "runs": {n: results[n] for n in names},
                                          "seconds": seconds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
