"""Process rewards: one score per reasoning step, placed on the token that ends the step.

A process reward function has the outcome functions' signature and returns, per completion, a list of
``(score, span)``: the step's reward and its character span ``(start, end)`` in the completion, or ``None``
for a required step the response never stated (its score then lands on the response's last token, so every
response of a group carries the same number of step rewards and a missing step counts against it).

Built in: ``task_steps``, the gym's own step graders (a required step is worth 1 when stated correctly, once,
and only if the response commits to an answer; 0 otherwise) — for GSM8K these are its checked arithmetic
statements. Learned PRMs plug in through the same signature.

Every source goes through the same guards before a step reward reaches the advantages (``guard_steps``):
a per-step cap, nothing positive beyond a bounded number of steps, nothing for a step whose text repeats an
earlier one, and no positive step reward in a response without an ``ANSWER:`` line. ``step_detectors`` computes the per-step
numbers that make step-reward hacking visible in the curves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from cohortrl.rewards.functions import extract_answer
from cohortrl.rewards.steps import Span, split_steps

StepScores = list[tuple[float, Span | None]]


def make_task_steps() -> Callable[..., list[StepScores]]:
    """The gym family's step grades, one entry per required step (in the sample's order)."""
    from cohortrl import tasks

    def task_steps(prompts, completions, sample, **columns) -> list[StepScores]:
        out = []
        for completion, s in zip(completions, sample):
            family = tasks.get(s["family"])
            grade = family.grade(family.sample_from_dict(s), completion)
            out.append([(1.0 if step.correct else 0.0, step.span) for step in grade.steps])
        return out

    return task_steps


BUILTIN_PROCESS_REWARDS: dict[str, Callable[..., Callable]] = {"task_steps": make_task_steps}


def resolve_process(name: str, kwargs: dict | None = None) -> Callable[..., list[StepScores]]:
    """A built-in process reward by name, or user code as ``module:function`` / ``file.py:function``."""
    from cohortrl.rewards.scoring import resolve_named

    return resolve_named(name, kwargs, BUILTIN_PROCESS_REWARDS, "process reward")


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def guard_steps(completion: str, steps: StepScores, *, cap: float, max_steps: int, require_answer: bool) -> StepScores:
    """The step rewards a response may keep: each score capped at ``cap``; nothing positive for a step whose
    text repeats an earlier step's, for steps beyond the first ``max_steps``, or in a response without a
    committed ``ANSWER:`` line (``require_answer``). Zero and negative scores always stay: a guard that
    removed a bad step would reward hiding it behind filler."""
    committed = extract_answer(completion, "answer_line") is not None
    seen, out = set(), []
    for index, (score, span) in enumerate(steps):
        score = min(float(score), cap)
        if index >= max_steps:  # kept, not dropped: dropping would also drop a bad step's low score
            score = min(score, 0.0)
        if span is not None:
            text = _normalised(completion[span[0] : span[1]])
            if text in seen:
                score = min(score, 0.0)
            seen.add(text)
        if require_answer and not committed:
            score = min(score, 0.0)
        out.append((score, span))
    return out


def step_detectors(completions: Sequence[str], step_rewards: Sequence[Sequence[float]],
                   outcomes: Sequence[float | None], process_coef: float) -> dict[str, float | None]:
    """Numbers that make step-reward hacking show up in the curves:

    * ``steps_per_response``: lines the responses write (padding raises it);
    * ``unique_step_ratio``: distinct lines / lines (repetition lowers it);
    * ``step_reward_mean``: the mean step reward after the guards;
    * ``step_reward_share``: λ·Σ step rewards / (λ·Σ step rewards + Σ outcome rewards), the share of the
      reward that comes from steps;
    * ``step_outcome_corr``: Pearson correlation of a response's mean step reward with its outcome (step
      rewards that stop predicting the outcome are being farmed).
    """
    lines = [[_normalised(c[a:b]) for a, b in split_steps(c)] for c in completions]
    n_lines = sum(len(x) for x in lines)
    flat = [r for rs in step_rewards for r in rs]
    per_response = [sum(rs) / len(rs) if rs else 0.0 for rs in step_rewards]
    outcome = [0.0 if o is None else float(o) for o in outcomes]
    step_total, outcome_total = process_coef * sum(flat), sum(outcome)
    denom = step_total + outcome_total
    return {
        "steps_per_response": n_lines / max(1, len(completions)),
        "unique_step_ratio": sum(len(set(x)) for x in lines) / n_lines if n_lines else None,
        "step_reward_mean": sum(flat) / len(flat) if flat else None,
        "step_reward_share": step_total / denom if denom > 0 else None,
        "step_outcome_corr": _pearson(per_response, outcome),
    }


def _pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5
