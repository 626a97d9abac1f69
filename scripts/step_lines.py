"""How many lines a reader follows through one RL step (issue 54: under 300): every line of the step's own file,
``cohortrl/trainers/step.py`` (``rl_step``, sample → score → targets → update → log, and every piece of the step
it defines), docstrings, comments and blank lines included; nothing in the file is set aside. The functions of other
files it calls are not counted: the rollout and its scoring (``Sampler.sample``), the algorithm's object
(``trainers/algorithm.py``; GRPO's, PPO's and RFT's in ``trainers/grpo.py``, ``ppo.py``, ``rft.py``) with its pure
functions (``cohortrl/algorithms/``), the collectives (``distributed.py``), the optimiser step (``setup.py``), the
non-finite guard and the metrics row, each reached by one call from the step.

It also runs two steps of a tiny single-process GRPO run on the plain path (``train.cpu_fast_path: off``, beta > 0)
and checks that the second went through that file's ``rl_step``; ``--calls`` lists every other function of the
package that step ran, by file, with its lines (``def`` to its end), for a reader who wants to follow the calls.
Exits 1 when the file has 300 lines or more, or the step did not run through it.

    .venv/bin/python scripts/step_lines.py [--calls]
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
STEP_FILE = "trainers/step.py"
STEP_FUNCTION = "rl_step"
LIMIT = 300


def reward(completions, **_):
    return [float(c.strip()[:1].isalpha()) for c in completions]


def config(data: Path) -> Config:
    return Config.from_dict({
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": f"jsonl:{data}", "eval_size": 8},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": f"{__file__}:reward"}], "correctness": f"{__file__}:reward"},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        "train": {"steps": 1, "progress": False, "cpu_fast_path": "off"},
        "eval": {"before": False, "n_prompts": 0},
    })


def ran_functions(trainer) -> set:
    """The code objects of the package that ran during one ``trainer.step()``."""
    seen = set()

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(ROOT)):
            seen.add(frame.f_code)

    sys.setprofile(tracer)
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


def traced_step() -> dict[str, list[tuple[str, int, int]]]:
    """The functions the second step of a tiny GRPO run ran, by file (the first builds what later steps reuse)."""
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "add.jsonl"
        rng = random.Random(0)
        data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                                for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(64))))
        trainer = GRPOTrainer(config(data), Path(tmp) / "run")
        try:
            trainer.step()
            return spans(ran_functions(trainer))
        finally:
            trainer.close()


def main() -> int:
    n_lines = len((ROOT / STEP_FILE).read_text().splitlines())
    by_file = traced_step()
    through = any(name == STEP_FUNCTION for name, _, _ in by_file.get(STEP_FILE, []))
    if "--calls" in sys.argv:
        for path in sorted(set(by_file) - {STEP_FILE}):
            print(f"{path}: {sum(last - first + 1 for _, first, last in by_file[path])}")
            for name, first, last in by_file[path]:
                print(f"    {name:45s} {first:4d}-{last:<4d} {last - first + 1}")
    print(f"RL step, lines to read: {n_lines} (cohortrl/{STEP_FILE}, every line; the limit is under {LIMIT})")
    if not through:
        print(f"the step did not run through {STEP_FUNCTION} in cohortrl/{STEP_FILE}")
    return 0 if through and n_lines < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
