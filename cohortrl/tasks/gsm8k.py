"""[gsm8k] Grade-school maths word problems: GSM8K (Cobbe et al. 2021, arXiv:2110.14168), real data.

Levels pick a split and a difficulty, measured by the number of ``<<a*b=c>>`` calculations in the dataset's
own solution:
  1  train, 0-2 calculations      4  test, 0-2 calculations
  2  train, 3-4 calculations      5  test, 3-4 calculations
  3  train, 5 or more             6  test, 5 or more
``sample(n, seed, level)`` walks a seeded permutation of the level's problems (wrapping around if n
exceeds them), so it is deterministic in (seed, level); train on levels 1-3 and evaluate on 4-6.

Outcome: the single ANSWER line's number equals the dataset's final ``#### N`` exactly (a ``$``,
thousands commas and a trailing word such as "apples" are allowed: there is no unit rule here; a second
number after it, as in "72 or 80", is a hedge and earns nothing).

Steps: one per distinct calculation of the dataset's solution that is itself right and computes something
(a few hundred GSM8K annotations are wrong, rounded to whole numbers, or identities such as 1*6=6; those
are dropped). A step is credited when the response
writes a correct statement ``a op b = c`` (`answer_format.find_statements`, evaluated exactly; rounding to
two or more decimals is accepted) whose value equals the calculation's result. The response may compute it
any way it likes. So that statements cannot be farmed:
- a statement counts only if it is grounded: each operand is a number from the question, a constant the
  dataset's own calculations use (2 for "twice", 60, 100, ...) or a result the response derived earlier,
  so "1 + 1 = 2, 2 + 1 = 3, ..." counts for nothing unless the problem is about those numbers;
- only the first 2 R + 2 statements count (R = required steps), so even grounded combinations of the
  question's numbers get few guesses and crowd out the response's own work;
- a statement credits at most one step, and repeating a statement (same left-hand side) counts once;
- a left-hand side written with two different results is a contradiction: none of them count;
- identities that restate a number (``48 * 1 = 48``, ``48 + 0 = 48``) count for nothing;
- as everywhere, no credit without exactly one ANSWER line.

Data: ``$COHORTRL_GSM8K_DIR`` if set (a directory with ``train.jsonl`` and ``test.jsonl``, columns question,
answer), else the copy shipped inside the package (``cohortrl/tasks/gsm8k_data``, MIT, with its LICENSE), so
the family works offline everywhere. Another dataset or split (``hf:openai/gsm8k@socratic``) goes through
the ``hf:`` data source instead (``cohortrl.data``).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from pathlib import Path

from cohortrl.grading.answer_format import (
    commitment,
    evaluate,
    format_exact,
    is_identity,
    parse_number,
    parse_response,
    rounds_to,
)
from cohortrl.tasks.base import Grade, Sample, Step, StepResult, TaskFamily, credit_statements, make_grade, register

LEVELS = {1: ("train", 0, 2), 2: ("train", 3, 4), 3: ("train", 5, 10**9),
          4: ("test", 0, 2), 5: ("test", 3, 4), 6: ("test", 5, 10**9)}
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_QUESTION_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def local_data_dir() -> Path | None:
    """``$COHORTRL_GSM8K_DIR`` when set: a directory holding train.jsonl and test.jsonl that replaces the
    packaged copy (another revision of the data, or a smaller one for tests)."""
    env = os.environ.get("COHORTRL_GSM8K_DIR")
    return Path(env) if env else None


@lru_cache(maxsize=2)
def load_rows(split: str) -> list[dict]:
    directory = local_data_dir()
    if directory is not None:
        path = directory / f"{split}.jsonl"
        if not path.is_file():
            raise RuntimeError(f"COHORTRL_GSM8K_DIR={directory} has no {split}.jsonl: point it at a directory "
                               "with train.jsonl and test.jsonl, or unset it to use the packaged copy")
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    packaged = resources.files("cohortrl.tasks") / "gsm8k_data" / f"{split}.jsonl.gz"
    with packaged.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class Problem:
    question: str
    final: str  # the "#### N" number, commas removed
    calculations: int  # how many <<...>> annotations the solution has (sets the level)
    steps: tuple[tuple[str, str], ...]  # distinct correct annotations (lhs, rhs)


def parse_row(row: dict) -> Problem:
    annotations = _ANNOTATION.findall(row["answer"])
    steps: list[tuple[str, str]] = []
    for lhs, rhs in annotations:
        lhs, rhs = lhs.strip(), rhs.strip()
        evaluated = evaluate(lhs)
        # Keep the annotations that are right and compute something (GSM8K has a few "1*6=6").
        if evaluated is None or not rounds_to(evaluated[0], rhs) or is_identity(parse_number(rhs), evaluated[1]):
            continue
        if all(lhs != seen for seen, _ in steps):  # a repeated calculation is one step, as in grading
            steps.append((lhs, rhs))
    final = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    return Problem(row["question"], final, len(annotations), tuple(steps))


@lru_cache(maxsize=2)
def problems(split: str) -> list[Problem]:
    return [parse_row(row) for row in load_rows(split)]


@lru_cache(maxsize=6)
def pool(level: int) -> list[int]:
    split, low, high = LEVELS[level]
    return [i for i, p in enumerate(problems(split)) if low <= p.calculations <= high]


@lru_cache(maxsize=64)
def permutation(seed: int, level: int) -> list[int]:
    rows = pool(level)
    return random.Random(f"gsm8k/{seed}/{level}").sample(rows, len(rows))


@register
@dataclass(frozen=True)
class GSM8K(TaskFamily):
    name = "gsm8k"
    levels = tuple(LEVELS)

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        split = LEVELS[level][0]
        order = permutation(seed, level)
        row = order[index % len(order)]
        problem = problems(split)[row]
        prompt = (f"{problem.question}\nSolve it step by step, writing each calculation as a op b = c. "
                  f"End with a line ANSWER: <number>")
        lines = [f"{lhs} = {rhs}" for lhs, rhs in problem.steps]
        reference = "\n".join(lines + [f"ANSWER: {problem.final}"])
        return Sample(
            self.name, level, seed, index, prompt, problem.final, reference,
            target=Step("answer", format_exact(Fraction(problem.final))),
            steps=[Step(f"{lhs}={rhs}", rhs) for lhs, rhs in problem.steps],
            givens=_QUESTION_NUMBER.findall(problem.question),
            extra={"split": split, "row": row},
        )

    def grade(self, sample: Sample, completion: str) -> Grade:
        commit = commitment(parse_response(completion), needs_verdict=False)
        # No unit rule here, but a trailing word must not carry another number ("72 or 80", "72-80").
        answer_ok = commit.committed and not any(c.isdigit() for c in commit.answer.unit)
        outcome = 1.0 if answer_ok and commit.answer.value == Fraction(sample.target.value) else 0.0

        return make_grade(outcome, self.grade_statements(sample, completion), commit.committed, self.step_weight)

    def grade_statements(self, sample: Sample, completion: str, rewrites: bool = False) -> list[StepResult]:
        # Numbers a statement may use: the question's, the constants the dataset's own calculations use
        # (2 for "twice", 60, 100, ...), and results the response has already derived.
        known = {parse_number(g) for g in sample.givens}
        known |= {o for step in sample.steps for o in evaluate(step.key.rsplit("=", 1)[0])[1]}
        return credit_statements(completion, sample.steps, [step.key.rsplit("=", 1)[0] for step in sample.steps], known,
                                 rewrites)
