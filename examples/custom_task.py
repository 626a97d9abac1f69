"""A gym task of your own, registered with a decorator and trained on like a built-in one.

    python examples/custom_task.py                                 # tiny random model: seconds, learns nothing
    python examples/custom_task.py --model smollm2-135m-instruct --steps 30

The family generates unit conversions ("2.5 m in mm?"); it inherits the gym's grader, so the answer must be
written as ``ANSWER: 2500 mm``, with the value within 1% and a unit of the right dimension. To use it from a
YAML file instead, put this file under ``imports:`` and set ``data.source: task:unit_conversion``.
"""

import argparse
from dataclasses import dataclass
from fractions import Fraction

from cohortrl import Config, GRPOTrainer, register_task
from cohortrl.tasks import Sample, Step, TaskFamily
from cohortrl.tasks.base import rng_for

# level -> (quantity, pairs of units a factor 1000 apart, each unit with its size in SI)
LEVELS = {
    1: ("length", [(("m", 1), ("mm", Fraction(1, 1000))), (("km", 1000), ("m", 1))]),
    2: ("force", [(("kN", 1000), ("N", 1)), (("MN", 10**6), ("kN", 1000))]),
}


@register_task
@dataclass(frozen=True)
class UnitConversion(TaskFamily):
    name = "unit_conversion"
    levels = tuple(LEVELS)

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        quantity, pairs = LEVELS[level]
        (src, src_si), (dst, dst_si) = rng.sample(rng.choice(pairs), 2)  # either direction
        value = Fraction(rng.randint(1, 99), rng.choice([1, 10]))
        converted = value * src_si / dst_si
        answer = f"{float(converted):g} {dst}"
        prompt = f"Convert the {quantity} {float(value):g} {src} to {dst}. End with a line ANSWER: <value> {dst}"
        return Sample(self.name, level, seed, index, prompt, answer, f"ANSWER: {answer}",
                      target=Step("answer", str(converted), dst), steps=[])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/unit-conversion")
    args = parser.parse_args()

    config = Config(
        model={"system_prompt": "Be brief."},
        data={"level": 1, "train_size": 500, "eval_size": 8},
        reward={"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
        sampling={"max_new_tokens": 24},
        algorithm={"group_size": 4, "prompts_per_step": 2},
        optim={"lr": 1e-5 if args.model != "tiny-llama" else 1e-3},
        train={"steps": args.steps, "progress": False},
        eval={"n_prompts": 8, "batch_size": 8},
    )
    trainer = GRPOTrainer(config, args.run_dir, model=args.model, train_dataset="unit_conversion")
    sample = trainer.eval_rows[0]
    print(f"a held-out prompt: {sample['prompt']!r} (answer {sample['answer']})")
    rows = trainer.train()
    evals = [r for r in rows if "eval/accuracy" in r]
    print(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} (n={evals[-1]['eval/n']})")


if __name__ == "__main__":
    main()
