"""[arithmetic] Multi-step integer and decimal expressions; every intermediate result is a step, graded exactly.

Levels (knobs: operations, operand count, digits, brackets, negatives, decimals):
  1  one operation, + - or *, on 2-12 (times tables), result >= 0 ("What is 7 + 5?"); no steps, only ANSWER
  2  two operations (+ - *) on 2-9, precedence but no brackets, results >= 0; steps s1, s2
  3  two or three operations (+ - *) on 2-99, with brackets, results >= 0 and <= 10,000
  4  three or four operations (+ - * /) on -99..99, brackets, negatives, exact division
  5  four or five operations (+ - * /) on decimals with one or two places, negatives, brackets, exact division

Steps are the intermediate results in the order of evaluation: innermost brackets first, then * and /
before + and -, left to right (the expression's parse tree in post-order). Step ``s{i}`` is the i-th
operation; the last step is the answer. Values are exact (``Fraction``), and graded with ``rel_tol = 0``:
3.50 equals 3.5, 3.499 does not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

from cohortrl.grading.answer_format import evaluate, format_exact
from cohortrl.tasks.base import Sample, Step, StepResult, TaskFamily, credit_statements, register, rng_for


@dataclass(frozen=True)
class Knobs:
    n_ops: tuple[int, int]  # inclusive range of operations
    operand_max: int  # operands are drawn from [2, operand_max] (and negated, with negatives)
    operations: str
    brackets: bool
    negatives: bool
    decimals: int  # operands may have up to this many decimal places
    value_max: int = 10_000  # bound on |every intermediate result|, to keep numbers readable


LEVELS = {
    1: Knobs((1, 1), 12, "+-*", brackets=False, negatives=False, decimals=0),
    2: Knobs((2, 2), 9, "+-*", brackets=False, negatives=False, decimals=0),
    3: Knobs((2, 3), 99, "+-*", brackets=True, negatives=False, decimals=0),
    4: Knobs((3, 4), 99, "+-*/", brackets=True, negatives=True, decimals=0),
    5: Knobs((4, 5), 99, "+-*/", brackets=True, negatives=True, decimals=2),
}

# An expression tree: a leaf is a Fraction, a node is (op, left, right).
Tree = Fraction | tuple


def random_operand(rng: random.Random, knobs: Knobs) -> Fraction:
    places = rng.randint(1, knobs.decimals) if knobs.decimals else 0
    value = Fraction(rng.randint(2 * 10**places, knobs.operand_max * 10**places), 10**places)
    return -value if knobs.negatives and rng.random() < 0.3 else value


def random_tree(rng: random.Random, n_ops: int, knobs: Knobs) -> Tree:
    if n_ops == 0:
        return random_operand(rng, knobs)
    left_ops = rng.randint(0, n_ops - 1)
    return (rng.choice(knobs.operations), random_tree(rng, left_ops, knobs), random_tree(rng, n_ops - 1 - left_ops, knobs))


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def render(tree: Tree) -> str:
    """Write the tree with only the brackets it needs, so that standard precedence parses it back into this
    very tree (a right child of equal precedence keeps its brackets: 9 - (4 - 2) is not 9 - 4 - 2)."""
    if isinstance(tree, Fraction):
        text = format_exact(tree)
        return f"({text})" if tree < 0 else text
    op, left, right = tree
    left_text, right_text = render(left), render(right)
    if isinstance(left, tuple) and _PRECEDENCE[left[0]] < _PRECEDENCE[op]:
        left_text = f"({left_text})"
    if isinstance(right, tuple) and _PRECEDENCE[right[0]] <= _PRECEDENCE[op]:
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}"


def evaluate_steps(tree: Tree, steps: list[tuple[str, Fraction]]) -> Fraction:
    """Evaluate in post-order, appending each operation as (expression text, value) to ``steps``.
    Raises ValueError for a division that is not exact or by zero (the generator then redraws)."""
    if isinstance(tree, Fraction):
        return tree
    op, left, right = tree
    a, b = evaluate_steps(left, steps), evaluate_steps(right, steps)
    if op == "/":
        if b == 0 or abs(b) == 1:
            raise ValueError("trivial or impossible division")
        value = a / b
    else:
        value = a + b if op == "+" else a - b if op == "-" else a * b
    steps.append((f"{render(a)} {op} {render(b)}", value))
    return value


def acceptable(steps: list[tuple[str, Fraction]], knobs: Knobs) -> bool:
    for _, value in steps:
        if abs(value) > knobs.value_max or (value < 0 and not knobs.negatives):
            return False
        # Division must stay exact and short: a terminating decimal with at most 4 places.
        if (value * 10**4).denominator != 1:
            return False
    return True


def draw_expression(rng: random.Random, knobs: Knobs) -> tuple[str, list[tuple[str, Fraction]]]:
    while True:  # rejection sampling; on these knobs well under 20 draws on average
        tree = random_tree(rng, rng.randint(*knobs.n_ops), knobs)
        text = render(tree)
        if not knobs.brackets and "(" in text:
            continue
        steps: list[tuple[str, Fraction]] = []
        try:
            evaluate_steps(tree, steps)
        except ValueError:
            continue
        if acceptable(steps, knobs):
            return text, steps


@register
@dataclass(frozen=True)
class Arithmetic(TaskFamily):
    name = "arithmetic"
    levels = tuple(LEVELS)
    rel_tol: float = 0.0  # exact

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        text, ops = draw_expression(rng, LEVELS[level])
        answer = format_exact(ops[-1][1])
        if len(ops) == 1:
            # The lowest level is one operation a small model can do in its head: no steps to write.
            prompt = f"What is {text}? End with a line of the form ANSWER: <number>"
            return Sample(self.name, level, seed, index, prompt, answer, f"ANSWER: {answer}",
                          target=Step("answer", answer), steps=[])
        steps = [Step(f"s{i}", format_exact(value)) for i, (_, value) in enumerate(ops, start=1)]
        prompt = (
            f"Compute {text}.\n"
            f"Write each intermediate result on its own line in order of evaluation, from s1 to s{len(steps)}, "
            f"as s1 = expression = value. Then write ANSWER: <number>"
        )
        lines = [f"s{i} = {expr} = {format_exact(value)}" for i, (expr, value) in enumerate(ops, start=1)]
        reference = "\n".join(lines + [f"ANSWER: {answer}"])
        return Sample(self.name, level, seed, index, prompt, answer, reference, target=steps[-1], steps=steps,
                      extra={"expression": text, "calculations": [expr for expr, _ in ops]})

    def grade_statements(self, sample: Sample, completion: str, rewrites: bool = False) -> list[StepResult]:
        """Steps read from statements such as "2 + 8 = 10" wherever the response writes them, with or without
        the ``s1 =`` key; the grounding numbers are the expression's."""
        if not sample.steps:  # level 1: one operation, no steps (and no expression kept to ground them)
            return []
        if "calculations" not in sample.extra:  # a sample saved before they were recorded: regenerate it
            sample = self.make_sample(sample.seed, sample.level, sample.index)
        known = set(evaluate(sample.extra["expression"])[1])
        return credit_statements(completion, sample.steps, sample.extra["calculations"], known, rewrites)
