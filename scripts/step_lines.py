"""How many lines a reader follows through one GRPO step (issue 24: at most 250, generation and the algorithms'
pure functions aside). Runs two steps of a tiny GRPO run on the plain path (one process, train.cpu_linear=aten,
beta > 0, no resampling, step rewards or vLLM), records every function of the package that ran in the second, and counts
each one's lines (``def`` to its end, docstring included) by where it lives:

  counted      the trainers' step: cohortrl/trainers/ except sampler.py and metrics.py
  aside        the rollout and its scoring (cohortrl/trainers/sampler.py: prompts drawn, generation called,
               rewards scored, resampling; generation itself in cohortrl/rollout/), the algorithms' pure
               functions (cohortrl/algorithms/), reward scoring (cohortrl/rewards/, user reward functions), the
               metrics assembly (cohortrl/trainers/metrics.py), the distributed helper and everything else

    .venv/bin/python scripts/step_lines.py [--all]      # --all lists the functions set aside too
"""

from __future__ import annotations

import json
import logging
import random
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import cohortrl
from cohortrl.config import Config
from cohortrl.trainers.grpo import GRPOTrainer

ROOT = Path(cohortrl.__file__).parent
COUNTED = "trainers/"
ASIDE_IN_TRAINERS = ("trainers/sampler.py", "trainers/metrics.py")


def reward(completions, **_):
    return [float(c.strip()[:1].isalpha()) for c in completions]


def config(data: Path) -> Config:
    return Config.from_dict({
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": f"jsonl:{data}", "eval_size": 8},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": f"{__file__}:reward"}], "correctness": f"{__file__}:reward"},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        "train": {"steps": 1, "progress": False, "cpu_linear": "aten"},
        "eval": {"before": False, "n_prompts": 0},
    })


def ran_functions(trainer) -> set:
    """The code objects of the package that ran during one ``trainer.step()``."""
    seen = set()

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(ROOT)):
            seen.add(frame.f_code)
        return None

    sys.setprofile(lambda frame, event, arg: tracer(frame, event, arg))
    try:
        trainer.step()
    finally:
        sys.setprofile(None)
    return seen


def spans(codes) -> dict[str, list[tuple[str, int, int]]]:
    """Per file: (qualified name, first line, last line) of each function, nested ones folded into their parent."""
    by_file = defaultdict(list)
    for code in codes:
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if not lines or code.co_name in ("<module>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>"):
            continue
        by_file[code.co_filename].append((code.co_qualname, code.co_firstlineno, max(lines)))
    out = {}
    for path, items in by_file.items():
        items.sort(key=lambda s: (s[1], -s[2]))
        kept = []
        for name, first, last in items:
            if kept and first >= kept[-1][1] and last <= kept[-1][2]:
                continue  # nested in the function before it
            kept.append((name, first, last))
        out[str(Path(path).relative_to(ROOT))] = kept
    return out


def main() -> None:
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "add.jsonl"
        rng = random.Random(0)
        data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                                for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(64))))
        trainer = GRPOTrainer(config(data), Path(tmp) / "run")
        try:
            trainer.step()  # the first step builds what later steps reuse; the second is the one read
            by_file = spans(ran_functions(trainer))
        finally:
            trainer.close()
    counted = aside = 0
    for path in sorted(by_file):
        is_counted = path.startswith(COUNTED) and path not in ASIDE_IN_TRAINERS
        n = sum(last - first + 1 for _, first, last in by_file[path])
        if is_counted:
            counted += n
        else:
            aside += n
        if is_counted or "--all" in sys.argv:
            print(f"{'' if is_counted else '(aside) '}{path}: {n}")
            for name, first, last in by_file[path]:
                print(f"    {name:45s} {first:4d}-{last:<4d} {last - first + 1}")
    print(f"GRPO step, lines to read: {counted} (set aside: {aside})")


if __name__ == "__main__":
    main()
