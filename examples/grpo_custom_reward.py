"""GRPO from Python with your own reward function, on a list of prompts you built yourself.

    python examples/grpo_custom_reward.py                          # tiny random model: seconds, learns nothing
    python examples/grpo_custom_reward.py --model smollm2-135m-instruct --steps 30 --run-dir runs/sums

The reward function has TRL's signature: it receives the prompts, the completions, and every other column of
the rows (here ``answer``) as keyword arguments, and returns one float (or None: "does not apply") each.
"""

import argparse
import random
import re

from cohortrl import Config, GRPOTrainer


def right_number(prompts, completions, answer, **columns):
    """1 when the last number a completion writes is the answer, else 0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion)
        scores.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return scores


def short(prompts, completions, **columns):
    """A small bonus for answers of at most 40 characters."""
    return [1.0 if len(c) <= 40 else 0.0 for c in completions]


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        rows.append({"prompt": f"What is {a} + {b}? Reply with the number.", "answer": str(a + b)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/custom-reward")
    args = parser.parse_args()

    config = Config(
        model={"system_prompt": "Be brief."},
        data={"eval_size": 8},  # held out from the rows below; never trained on
        sampling={"temperature": 1.0, "max_new_tokens": 16},
        algorithm={"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        optim={"lr": 1e-5 if args.model != "tiny-llama" else 1e-3},
        train={"steps": args.steps, "progress": False},
        eval={"n_prompts": 8, "batch_size": 8, "before": True},
    )
    trainer = GRPOTrainer(
        config,
        args.run_dir,
        model=args.model,
        reward_funcs=[right_number, short],  # the first is the correctness signal (accuracy, zero-variance groups)
        reward_weights=[1.0, 0.1],
        train_dataset=make_prompts(200),
    )
    rows = trainer.train()
    last = [r for r in rows if "reward_mean" in r][-1]
    evals = [r for r in rows if "eval/accuracy" in r]
    print(f"step {last['step']}: reward {last['reward_mean']:.3f}, accuracy {last['accuracy']:.3f}")
    print(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} (n={evals[-1]['eval/n']})")
    print(f"model saved in {trainer.run_dir / 'final'}")


if __name__ == "__main__":
    main()
