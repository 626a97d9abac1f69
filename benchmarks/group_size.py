"""Group-size study, first part: how often is a group of G all right or all wrong?

With a binary reward and per-prompt success rate p, a group of G responses has zero variance — no policy
gradient, only the KL term acts — with probability p^G + (1 − p)^G (ALGORITHMS.md, "Group size and
zero-variance groups"). This samples ``--samples`` responses for each of ``--prompts`` prompts, estimates
each prompt's p from them, and for each G prints the predicted zero-variance fraction (the mean of
p^G + (1 − p)^G over prompts) beside the fraction observed in disjoint groups of G cut from the same samples.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/group_size.py --model smollm2-135m-instruct --prompts 8 --samples 16

Not done yet (the second part of the study): the variance of the policy gradient over repeated draws of a
batch, per G at fixed P·G. The predicted and observed columns share their samples, so they agree closely by
construction when ``--samples`` is large; the prediction is the point: it needs only the success rates.
"""

from __future__ import annotations

import argparse


def all_same_probability(p: float, group_size: int) -> float:
    """P(all G equal) for Bernoulli(p) rewards: p^G + (1 − p)^G."""
    return p**group_size + (1 - p) ** group_size


def predicted_zero_variance(success_rates: list[float], group_size: int) -> float:
    """Expected fraction of zero-variance groups over prompts with the given success rates."""
    return sum(all_same_probability(p, group_size) for p in success_rates) / len(success_rates)


def observed_zero_variance(correct_by_prompt: list[list[float]], group_size: int) -> float | None:
    """Fraction of disjoint groups of ``group_size`` (within each prompt's samples) whose rewards are all equal."""
    groups = [c[i:i + group_size] for c in correct_by_prompt for i in range(0, len(c) - group_size + 1, group_size)]
    return sum(len(set(g)) == 1 for g in groups) / len(groups) if groups else None


def sample_correctness(args) -> list[list[float]]:
    """``args.samples`` responses per prompt at the training temperature, scored by the correctness reward."""
    from cohortrl.config import Config
    from cohortrl.data import load_rows
    from cohortrl.models import load_model
    from cohortrl.rewards.scoring import WeightedReward, resolve
    from cohortrl.rollout.hf import Sampling, generate
    from cohortrl.trainers.evaluate import score_rollout

    cfg = Config.from_dict({
        "model": {"name": args.model},
        "data": {"source": "task:arithmetic", "level": args.level, "train_size": max(args.prompts, 10), "eval_size": 0},
        "reward": {"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}], "correctness": "accuracy"},
    })
    model, tokenizer = load_model(cfg.model.name, seed=0)
    rows, _ = load_rows(cfg.data, seed=0)
    rows = rows[: args.prompts]
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.tokens)
    rollout, _ = generate(model, tokenizer, rows, args.samples, sampling, system_prompt="Be brief.")
    accuracy = WeightedReward("accuracy", resolve("accuracy", {"mode": "last_number"}))
    _, per_fn = score_rollout([accuracy], rollout, args.tokens)
    flat = [v or 0.0 for v in per_fn["accuracy"]]
    return [flat[i * args.samples:(i + 1) * args.samples] for i in range(len(rows))]  # rows are group-major


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16, help="responses per prompt (a multiple of every G)")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--level", type=int, default=1, help="arithmetic task difficulty")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    correct = sample_correctness(args)
    rates = [sum(c) / len(c) for c in correct]
    print(f"{args.model}: {args.prompts} prompts x {args.samples} samples; success rates {', '.join(f'{p:.2f}' for p in rates)}\n")
    print("| G | predicted mean p^G + (1-p)^G | observed zero-variance fraction |")
    print("|---:|---:|---:|")
    for g in args.groups:
        observed = observed_zero_variance(correct, g)
        print(f"| {g} | {predicted_zero_variance(rates, g):.3f} | {'-' if observed is None else f'{observed:.3f}'} |")


if __name__ == "__main__":
    main()
