"""Learned reward models on gym labels (issue 7): train a PRM and an ORM on perturbed reference solutions
labelled by the gym's graders, then report

- held-out step accuracy / AUROC (PRM) and outcome accuracy / AUROC (ORM), beside the majority-label base rate;
- best-of-N accuracy on fresh problems whose N candidates are gym perturbations (no policy needed): pick by
  PRM min and product of step scores, by ORM score, by majority vote on the final answer, at random, and the
  oracle (some candidate is right);
- the cost of labels: CPU seconds per labelled step for the programmatic (gym grader) labels versus
  Math-Shepherd completion rollouts (arXiv 2312.08935) with the backbone model as the policy.

    .venv/bin/python benchmarks/reward_models.py [--model tiny-llama | smollm2-135m-instruct] [--steps 200]

The tiny model is a random 2-layer Llama with a 512-token BPE: beating chance there means it learned from
the labels alone, not from pretraining.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch


def label_costs(args) -> dict:
    """CPU seconds per labelled step: gym grader labels vs Math-Shepherd rollouts from the backbone."""
    from cohortrl import tasks
    from cohortrl.models import load_model
    from cohortrl.reward_models.labels import gym_step_examples, math_shepherd_labels, policy_completer

    t0 = time.process_time()
    examples = gym_step_examples(args.family, 200, seed=7, level=args.level)
    gym_s = (time.process_time() - t0) / sum(len(e.steps) for e in examples)

    family = tasks.get(args.family)
    policy, tokenizer = load_model(args.model, seed=args.seed)
    samples = family.sample(args.shepherd_problems, seed=7, level=args.level)
    t0 = time.process_time()
    n_steps, hard, soft = 0, [], []
    for sample in samples:
        steps = sample.reference_solution.split("\n")
        complete = policy_completer(policy, tokenizer, sample.prompt, max_new_tokens=args.shepherd_tokens, seed=args.seed)
        labels = math_shepherd_labels(family, sample, steps, complete, n=args.shepherd_n)
        n_steps += len(steps)
        hard += [x.hard for x in labels]
        soft += [x.soft for x in labels]
    shepherd_s = (time.process_time() - t0) / n_steps
    return {"gym_cpu_s_per_step": gym_s, "shepherd_cpu_s_per_step": shepherd_s, "shepherd_n": args.shepherd_n,
            "shepherd_max_new_tokens": args.shepherd_tokens, "shepherd_steps_labelled": n_steps,
            "shepherd_mean_hard": sum(hard) / len(hard), "shepherd_mean_soft": sum(soft) / len(soft)}


def position_baseline(examples) -> dict:
    """AUROC of a scorer that sees only where a step is (earlier = more likely right) and whether it is the
    last line: what a PRM can get without reading any number."""
    from cohortrl.reward_models.evaluate import auroc

    scores, labels = [], []
    for e in examples:
        for i, y in enumerate(e.labels):
            scores.append(-i)
            labels.append(y)
    return {"position_only_auroc": auroc(scores, labels)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="backbone: tiny-llama (default) or smollm2-135m-instruct")
    parser.add_argument("--family", default="arithmetic")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=1024)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bon-problems", type=int, default=100)
    parser.add_argument("--bon-n", type=int, default=8)
    parser.add_argument("--shepherd-problems", type=int, default=4)
    parser.add_argument("--shepherd-n", type=int, default=4)
    parser.add_argument("--shepherd-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--label-cost-only", action="store_true",
                        help="only the label costs (no reward-model training): for a backbone too slow to train here")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.label_cost_only:
        print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)
        print("label_cost", json.dumps(label_costs(args)), flush=True)
        return 0

    from cohortrl.reward_models.evaluate import best_of_n, evaluate_orm, evaluate_prm
    from cohortrl.reward_models.labels import as_pointwise, gym_step_examples
    from cohortrl.reward_models.train import build_reward_model, train_on

    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)
    train = gym_step_examples(args.family, args.n_train, seed=args.seed, level=args.level)
    held = gym_step_examples(args.family, args.n_eval, seed=args.seed + 10_000, level=args.level)
    results: dict = {"args": vars(args)}
    models = {}
    for kind in ("prm", "orm"):
        model, tokenizer = build_reward_model(args.model, kind, seed=args.seed)
        data = train if kind == "prm" else as_pointwise(train)
        t0 = time.process_time()
        losses = train_on(model, tokenizer, data, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                          seed=args.seed)
        cpu = time.process_time() - t0
        if kind == "prm":
            evaluation = {**evaluate_prm(model, tokenizer, held), **position_baseline(held)}
        else:
            evaluation = evaluate_orm(model, tokenizer, as_pointwise(held))
        results[kind] = {"train_cpu_s": cpu, "loss_first10": sum(losses[:10]) / 10, "loss_last10": sum(losses[-10:]) / 10,
                         **evaluation}
        print(kind, json.dumps(results[kind]), flush=True)
        models[kind] = (model, tokenizer)
    results["best_of_n"] = best_of_n(args.family, args.bon_problems, args.bon_n, level=args.level, seed=args.seed + 20_000,
                                     prm=models["prm"], orm=models["orm"])
    print("best_of_n", json.dumps(results["best_of_n"]), flush=True)
    results["label_cost"] = label_costs(args)
    print("label_cost", json.dumps(results["label_cost"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
