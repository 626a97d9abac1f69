"""Process rewards: one score per reasoning step, placed on the token that ends the step.

A process reward function has the outcome functions' signature and returns, per completion, a list of
``(score, span)``: the step's reward and its character span ``(start, end)`` in the completion, or ``None``
for a required step the response never stated (its score then lands on the response's last token, so every
response of a group carries the same number of step rewards and a missing step counts against it).

Built in: ``task_steps``, the gym's own step graders (a required step is worth 1 when stated correctly, once,
and only if the response commits to an answer; 0 otherwise) — for GSM8K these are its checked arithmetic
statements; ``learned_prm``, a PRM trained by ``cohortrl train-rm``, on the steps `split_steps` finds;
``implicit_prm``, PRIME's implicit PRM (`cohortrl.reward_models.implicit_prm`), which reads the rollout's tokens
and learns online, so it is a `StepSource` of its own rather than a function.

Every source goes through the same guards before a step reward reaches the advantages (``guard_steps``):
a per-step cap, nothing positive beyond a bounded number of steps, nothing for a step whose text repeats an
earlier one, and no positive step reward in a response without an ``ANSWER:`` line. ``step_detectors`` computes the per-step
numbers that make step-reward hacking visible in the curves.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence

from cohortrl.grading.answers import extract_answer
from cohortrl.rewards.grader_errors import contained
from cohortrl.step_spans import Span, StepScores, StepSource, split_steps
from cohortrl.tools.text import render, render_with_origins


def make_task_steps(require_commit: bool = True, read: str = "keyed", rewrites: bool = False) -> Callable[..., list[StepScores]]:
    """The gym family's step grades, one entry per required step (in the sample's order).

    ``require_commit`` (the gym's rule): a step counts only in a response with an ``ANSWER:`` line. Off, a
    step counts when stated correctly, answer or not: for a policy that never writes the line (SmolLM2-135M
    on the gym), whose step rewards would otherwise all be 0. ``reward.process.require_answer`` is the same
    gate as a guard, for every source.

    ``read``: ``keyed``, the family's own ``KEY = expression = value`` lines; ``statements``, arithmetic
    statements such as "2 + 8 = 10" anywhere in the text (`TaskFamily.grade_statements`: arithmetic and
    gsm8k), for a policy that computes the steps but does not write the keys, with gsm8k's guards against
    farming (grounded operands, no contradictions, at most 2R + 2 statements read). ``rewrites`` (with
    ``statements``): a rewriting chain ``7 * 8 + 9 = 56 + 9 = 65`` also states ``7 * 8 = 56``, the way
    SmolLM2 writes two operations; without it the chain's first ``=`` reads as the wrong ``7 * 8 + 9 = 56``."""
    from cohortrl import tasks

    if read not in ("keyed", "statements"):
        raise ValueError(f"task_steps: read must be 'keyed' or 'statements', not {read!r}")
    if rewrites and read != "statements":
        raise ValueError("task_steps: rewrites reads free-text statements; give read: statements with it")

    def step_scores(family, problem, completion) -> StepScores:
        # Graded as the outcome is, with tool calls rendered (`A = pi*19^2/4 = 283.5 mm^2`), so a step written
        # as a calculator call counts; its span is then carried back onto the completion as generated.
        text, origins = render_with_origins(completion)
        if read == "keyed":
            grade = family.grade(problem, text)
            steps = grade.steps if require_commit else grade.stated
        else:  # the full grade only for its commitment flag, and only when the gate is on
            steps = family.grade_statements(problem, text, rewrites)
            if require_commit and not family.grade(problem, text).committed:
                steps = [dataclasses.replace(step, correct=False) for step in steps]
        return [(1.0 if step.correct else 0.0, _generated_span(step.span, origins)) for step in steps]

    def task_steps(prompts, completions, sample, **columns) -> list[StepScores]:
        out = []
        for prompt, completion, s in zip(prompts, completions, sample):
            family = tasks.get(s["family"])
            problem = family.sample_from_dict(s)
            if read == "statements" and type(family).grade_statements is tasks.TaskFamily.grade_statements:
                family.grade_statements(problem, "")  # a setting this family cannot serve: its error stops the run
            # A grader bug scores every step 0 and is reported (grader_errors.py); it never stops the run.
            failed = [(0.0, None) for _ in problem.steps]
            out.append(contained("task_steps", prompt, completion, lambda: step_scores(family, problem, completion), failed))
        return out

    return task_steps


def _generated_span(span: Span | None, origins: list[int]) -> Span | None:
    """A span of the rendered text as a span of the completion it was rendered from (`render_with_origins`)."""
    if span is None or span[1] <= span[0]:
        return span
    return origins[span[0]], origins[span[1] - 1] + 1


def make_learned_prm(model: str, delimiter: str = "\n", regex: str | None = None, batch_size: int = 16,
                     max_length: int = 1024, score: str = "prob", threshold: float | None = None,
                     device: str = "cpu") -> Callable[..., list[StepScores]]:
    """A learned PRM (a directory written by ``cohortrl train-rm kind=prm``) as a step source: each completion
    is split into steps with `split_steps` (``delimiter`` / ``regex``), the PRM reads the prompt and those
    steps (joined by newlines, as it was trained) and scores each at its last token.

    ``score``: ``prob`` gives σ(logit), the probability the step is right (Lightman et al., arXiv 2305.20050);
    ``logit`` the raw logit. ``threshold``: 1.0 when σ(logit) ≥ threshold, else 0.0 (a hard verdict, like the
    gym's). A step past ``max_length`` tokens is unseen and earns 0. The model is loaded once, in eval mode,
    on ``device``, and runs without gradients in the trainer's process, ``batch_size`` exchanges a forward."""
    from cohortrl.reward_models.scoring import load_prm, prm_step_logits

    if score not in ("prob", "logit"):
        raise ValueError(f"learned_prm score must be 'prob' or 'logit', got {score!r}")
    if threshold is not None and not 0.0 < threshold < 1.0:
        raise ValueError(f"learned_prm threshold must be in (0, 1), got {threshold}")
    prm, tokenizer = load_prm(model)
    prm.to(device)

    def read(logit: float) -> float:
        if math.isnan(logit):
            return 0.0
        p = 1.0 / (1.0 + math.exp(-logit)) if score == "prob" or threshold is not None else logit
        return float(p >= threshold) if threshold is not None else p

    def learned_prm(prompts, completions, **columns) -> list[StepScores]:
        spans = [split_steps(c, delimiter, regex) for c in completions]
        steps = [[c[a:b] for a, b in s] for c, s in zip(completions, spans)]
        logits = prm_step_logits(prm, tokenizer, list(prompts), steps, batch_size=batch_size, max_length=max_length)
        return [[(read(x), span) for x, span in zip(xs, s)] for xs, s in zip(logits, spans)]

    return learned_prm


BUILTIN_PROCESS_REWARDS: dict[str, Callable[..., Callable]] = {"task_steps": make_task_steps, "learned_prm": make_learned_prm}


def resolve_process(name: str, kwargs: dict | None = None) -> Callable[..., list[StepScores]]:
    """A built-in process reward by name, or user code as ``module:function`` / ``file.py:function``."""
    from cohortrl.rewards.scoring import resolve_named

    return resolve_named(name, kwargs, BUILTIN_PROCESS_REWARDS, "process reward")


# ---------------------------------------------------------------------------------------------------- sources
class FunctionSteps(StepSource):
    """A process reward function called on the prompts and completions, within the reward timeout."""

    def __init__(self, name: str, fn: Callable[..., list[StepScores]], timeout_s: float | None = None):
        self.name, self.fn, self.timeout_s = name, fn, timeout_s

    def score(self, rollout, columns: dict[str, list]) -> list[StepScores]:
        from cohortrl.rewards.scoring import _call

        prompts = [r["prompt"] for r in rollout.rows]
        return _call(self.fn, self.name, prompts, rollout.completions, columns, self.timeout_s, failed=[])  # no steps


def build_step_source(name: str, kwargs: dict | None, *, timeout_s: float | None = None, policy=None,
                      tokenizer=None, reference=None, rows: list[dict] = ()) -> StepSource:
    """The step source ``reward.process`` names: a source built from the trainer's policy (``implicit_prm``:
    ``policy`` is its initial weights, ``reference`` the frozen π_ref or None to copy the policy), else a
    process reward function (`resolve_process`), refused if it reads a column the training ``rows`` lack."""
    from cohortrl.reward_models.implicit_prm import ImplicitPRM
    from cohortrl.rewards.scoring import RewardFunctionError, check_columns

    policy_sources = {"implicit_prm": ImplicitPRM}
    if name in policy_sources:
        cls, kwargs = policy_sources[name], dict(kwargs or {})
        try:
            inspect.signature(cls).bind(policy, tokenizer, reference=reference, **kwargs)
        except TypeError as e:
            raise RewardFunctionError(f"process reward '{name}' does not take kwargs {sorted(kwargs)}: {e}") from None
        return cls(policy, tokenizer, reference=reference, **kwargs)
    fn = resolve_process(name, kwargs)
    check_columns({name: fn}, list(rows), "training rows")
    return FunctionSteps(name, fn, timeout_s)


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def normalised_steps(completion: str) -> list[str]:
    """The completion's steps (`split_steps`: its non-blank lines) as the repetition guard and the detectors compare
    them: lower-cased, whitespace collapsed."""
    return [_normalised(completion[a:b]) for a, b in split_steps(completion)]


def guard_steps(completion: str, steps: StepScores, *, cap: float, max_steps: int, require_answer: bool) -> StepScores:
    """The step rewards a response may keep: each score capped at ``cap``; nothing positive for a step whose
    text repeats an earlier step's, for steps beyond the first ``max_steps``, or in a response without a
    committed ``ANSWER:`` line of its own (``require_answer``; read as rendered: one in a tool result does not
    count). Zero and negative scores always stay: a guard that removed a bad step would reward hiding it behind
    filler."""
    committed = extract_answer(render(completion), "answer_line") is not None  # the model's own ANSWER line
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
    lines = [normalised_steps(c) for c in completions]
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
