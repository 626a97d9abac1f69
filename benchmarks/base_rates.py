"""Base rates of a model on the gym: how often it succeeds per family and level, greedy and sampled.

The table this prints goes into docs/tasks.md; GRPO needs levels where the sampled success rate is neither
~0 nor ~1 (otherwise every group of responses gets the same reward and there is no signal).

    .venv/bin/python benchmarks/base_rates.py --model smollm2-135m-instruct --n 200
    .venv/bin/python benchmarks/base_rates.py --families arithmetic axial_stress --levels 1 2 --n 50

For each family and level: ``n`` prompts from ``family.sample(n, seed, level)``, the chat template applied
(``tokenizer.apply_chat_template``, with an optional system prompt), batched ``model.generate`` with left
padding, then ``family.grade``. Columns: outcome (mean), score (mean of the default reward) and committed
(the fraction that wrote exactly one ANSWER line, and VERDICT where asked: the format rate).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def generate(model, tokenizer, prompts: list[str], *, system: str | None, max_new_tokens: int,
             temperatures: dict[str, float], batch_size: int) -> dict[str, list[str]]:
    """Completions for ``prompts`` under each named temperature (0: greedy), through the trainer's own rollout
    code; each batch of prompts is prefilled once for all the modes."""
    from cohortrl.rollout.hf import Sampling, generate_modes

    samplings = {mode: Sampling(temperature=t, max_new_tokens=max_new_tokens) for mode, t in temperatures.items()}
    out: dict[str, list[str]] = {mode: [] for mode in temperatures}
    for start in range(0, len(prompts), batch_size):
        batch = generate_modes(model, tokenizer, prompts[start : start + batch_size], samplings,
                               system_prompt=system, max_prompt_tokens=4096)
        for mode, completions in batch.items():
            out[mode] += completions
    return out


def last_number_correct(sample, completion: str, rel_tol: float = 0.01) -> float:
    """Lenient reading: the ANSWER line if present, else the last number, against the answer's number (1%).
    This is the correctness the arithmetic GRPO demo trains on; the gym's own outcome also requires the format."""
    import re

    from cohortrl.grading.answer_format import NUMBER, parse_number
    from cohortrl.grading.answers import extract_answer

    def first_number(text: str) -> float | None:
        found = re.search(NUMBER, text)
        value = parse_number(found.group(0)) if found else None
        return None if value is None else float(value)

    predicted = extract_answer(completion, mode="last_number")
    gold = first_number(str(sample.answer))
    value = first_number(predicted) if predicted is not None else None
    return float(value is not None and gold is not None and abs(value - gold) <= rel_tol * max(abs(gold), 1e-9))


def main() -> None:
    from cohortrl import tasks
    from cohortrl.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a cohortrl.models.load_model spec")
    parser.add_argument("--families", nargs="+", default=tasks.names(), help="default: all")
    parser.add_argument("--levels", nargs="+", type=int, default=None, help="default: every level of each family")
    parser.add_argument("--n", type=int, default=200, help="prompts per family and level (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="for the sampled column (default 1.0)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--system", default="Be brief.", help="system prompt (default 'Be brief.', as the arithmetic demo)")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--dump", default=None, help="write every prompt, completion and grade to this JSONL file")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    model.eval()
    dump = open(args.dump, "w", encoding="utf-8") if args.dump else None
    columns = " | ".join(f"{m} outcome | {m} score | {m} committed | {m} last-number" for m in args.modes)
    print(f"model {args.model}, n {args.n} per row, max_new_tokens {args.max_new_tokens}, "
          f"sampled at temperature {args.temperature}\n")
    print(f"| family | level | {columns} | seconds |")
    print("|---|---|" + "---|" * (4 * len(args.modes) + 1))
    for name in args.families:
        family = tasks.get(name)
        for level in args.levels or family.levels:
            if level not in family.levels:
                continue
            samples = family.sample(args.n, seed=args.seed, level=level)
            cells, started = [], time.perf_counter()
            temperatures = {mode: 0.0 if mode == "greedy" else args.temperature for mode in args.modes}
            by_mode = generate(model, tokenizer, [s.prompt for s in samples], system=args.system,
                               max_new_tokens=args.max_new_tokens, temperatures=temperatures, batch_size=args.batch_size)
            for mode in args.modes:
                completions = by_mode[mode]
                grades = [family.grade(s, c) for s, c in zip(samples, completions)]
                n = len(grades)
                cells += [f"{sum(g.outcome for g in grades) / n:.3f}", f"{sum(g.score for g in grades) / n:.3f}",
                          f"{sum(g.committed for g in grades) / n:.2f}",
                          f"{sum(last_number_correct(s, c) for s, c in zip(samples, completions)) / n:.3f}"]
                if dump:
                    for s, c, g in zip(samples, completions, grades):
                        dump.write(json.dumps({"id": s.id, "mode": mode, "prompt": s.prompt, "completion": c,
                                               "outcome": g.outcome, "score": g.score, "committed": g.committed}) + "\n")
            print(f"| {name} | {level} | {' | '.join(cells)} | {time.perf_counter() - started:.0f} |", flush=True)
    if dump:
        dump.close()


if __name__ == "__main__":
    main()
