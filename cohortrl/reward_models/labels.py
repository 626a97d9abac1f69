"""Labelled data for reward models, from three sources:

1. JSONL files: pointwise ``{prompt, completion, label}``, pairs ``{prompt, chosen, rejected}`` (ORM), or
   steps ``{prompt, steps, labels}`` (PRM). A bad row fails with its file, line and what to fix.
2. The gym's programmatic graders, at no annotation cost (`gym_step_examples`): a family's reference
   solutions with one step's value corrupted; the error carries into every later line that quotes the
   corrupted value, and the family's own grader labels each line. Some references stay intact.
3. Math-Shepherd completion rollouts (Wang et al. 2023, arXiv 2312.08935, §3.3): a step is labelled by
   whether policy completions from it reach the right answer — hard estimate = any of N does, soft = the
   fraction that do (`math_shepherd_labels`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from cohortrl.grading.answer_format import evaluate, format_exact, format_sig


class LabelDataError(ValueError):
    """A labelled-data row that cannot be used, with where it is and how to fix it."""


@dataclass(frozen=True)
class PointExample:
    prompt: str
    completion: str
    label: float  # 1.0 good, 0.0 bad (a soft label in between is allowed)


@dataclass(frozen=True)
class PairExample:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class StepExample:
    prompt: str
    steps: list[str]
    labels: list[float]  # one per step: 1.0 right, 0.0 wrong (soft labels allowed)
    outcome: float | None = None  # whether the whole response is right, when known


KINDS = {"pointwise": ("prompt", "completion", "label"), "pairs": ("prompt", "chosen", "rejected"),
         "steps": ("prompt", "steps", "labels")}


# ------------------------------------------------------------------------------------------- JSONL files
def _label(value, where: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise LabelDataError(f"{where}: a label must be true/false or a number in [0, 1], got {value!r}")
    return float(value)


def _text(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str) or not value:
        raise LabelDataError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def parse_row(row, kind: str, where: str):
    """One JSON object → an example of ``kind`` ('pointwise', 'pairs' or 'steps')."""
    if kind not in KINDS:
        raise LabelDataError(f"unknown label data kind {kind!r}; use one of {', '.join(KINDS)}")
    if not isinstance(row, dict):
        raise LabelDataError(f"{where}: expected a JSON object with keys {', '.join(KINDS[kind])}, got {type(row).__name__}")
    missing = [k for k in KINDS[kind] if k not in row]
    if missing:
        raise LabelDataError(f"{where}: missing key(s) {', '.join(missing)}; a {kind} row needs {', '.join(KINDS[kind])}")
    prompt = _text(row, "prompt", where)
    if kind == "pointwise":
        return PointExample(prompt, _text(row, "completion", where), _label(row["label"], where))
    if kind == "pairs":
        chosen, rejected = _text(row, "chosen", where), _text(row, "rejected", where)
        if chosen == rejected:
            raise LabelDataError(f"{where}: 'chosen' and 'rejected' are the same text; a pair must differ")
        return PairExample(prompt, chosen, rejected)
    steps, labels = row["steps"], row["labels"]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s for s in steps):
        raise LabelDataError(f"{where}: 'steps' must be a non-empty list of non-empty strings")
    if not isinstance(labels, list) or len(labels) != len(steps):
        n = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise LabelDataError(f"{where}: {len(steps)} steps but {n} labels; give one label per step")
    return StepExample(prompt, steps, [_label(v, f"{where}, label {i}") for i, v in enumerate(labels)])


def load_jsonl(path: str | Path, kind: str) -> list:
    """Every row of a JSONL file as examples of ``kind``; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise LabelDataError(f"label data file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LabelDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        out.append(parse_row(row, kind, where))
    if not out:
        raise LabelDataError(f"{path} has no rows")
    return out


# ------------------------------------------------------------------------------------------- gym labels
_RESULT = re.compile(r"=\s*(-?\d+(?:\.\d+)?)(?=[^=]*$)")  # the number right after a line's last "="


def _result_span(line: str) -> tuple[int, int]:
    """Where a ``KEY = ... = value unit`` line writes its value."""
    match = _RESULT.search(line)
    if match is None:
        raise ValueError(f"no value after the last '=' in {line!r}")
    return match.span(1)


def _quoted(value: str) -> re.Pattern:
    """``value`` as a whole number in a line: 46 matches in "92 + 46" but not in "146" or "4.6"."""
    return re.compile(rf"(?<![\d.]){re.escape(value)}(?![\d.])")


def response_steps(family, sample, completion: str) -> StepExample:
    """Split ``completion`` into lines and label each with the family's grader: a line stating a required step
    gets that step's verdict; every other line (ANSWER, VERDICT) gets the outcome."""
    grade = family.grade(sample, completion)
    by_start = {r.span[0]: float(r.correct) for r in grade.steps if r.span is not None}
    steps, labels, pos = [], [], 0
    for line in completion.split("\n"):
        if line.strip():
            steps.append(line)
            labels.append(by_start.get(pos, grade.outcome))
        pos += len(line) + 1
    return StepExample(sample.prompt, steps, labels, grade.outcome)


def corrupt_value(text: str, rng: random.Random) -> str:
    """A wrong value written like ``text``: an integer moves by 1-30% (at least 1), a decimal is scaled by
    a factor 5-50% away from 1 and written to 4 significant figures; both far outside the graders' 1%."""
    value = Fraction(text)
    sign = rng.choice((-1, 1))
    if "." not in text:
        step = max(1, round(abs(value) * Fraction(rng.randint(10, 30), 100)))
        return format_exact(value + sign * step)
    return format_sig(float(value) * (1 + sign * rng.uniform(0.05, 0.5)))


def _recompute(line: str, old: str, new: str, rng: random.Random) -> str:
    """``line`` (``KEY = expression = value unit``) with the quoted value ``old`` replaced by ``new`` in its
    expression, and its own result redone: exactly when the expression is plain arithmetic, otherwise scaled
    by new/old (the first-order effect of the error)."""
    a, b = _result_span(line)
    head, result_text, tail = line[:a], line[a:b], line[b:]
    cut = head.index("=") + 1  # the key stays as it is; only the expression quotes values
    head = head[:cut] + _quoted(old).sub(new, head[cut:])
    exact = evaluate(head[cut:].rsplit("=", 1)[0])
    if exact is not None:
        value = exact[0]
        result = format_exact(value) if "." not in result_text and value.denominator == 1 else format_sig(float(value))
    elif Fraction(old) != 0:
        result = format_sig(float(Fraction(result_text) * Fraction(new) / Fraction(old)))
    else:
        result = corrupt_value(result_text, rng)
    return head + result + tail


def perturb_reference(family, sample, rng: random.Random) -> tuple[str, int]:
    """The reference solution with one required step's value made wrong, and that step's index.

    Every later line that quotes a corrupted value by its exact text (a dependent step, the ANSWER line) has
    it replaced and, for a step with an expression, its own result redone, so the error carries forward as
    a real slip would. For families whose steps are ``KEY = ... = value unit`` lines.
    """
    reference = sample.reference_solution
    lines = reference.split("\n")
    line_of_step = {}  # step index -> line number
    for i, r in enumerate(family.grade(sample, reference).steps):
        if r.span is None:
            continue
        n = reference[: r.span[0]].count("\n")
        if lines[n].split("=")[0].strip() != sample.steps[i].key or "=" not in lines[n]:
            raise ValueError(f"{sample.family}: reference steps are not 'KEY = ... = value' lines, so steps cannot "
                             "be corrupted one at a time; use arithmetic, axial_stress, beam_bending or truss")
        line_of_step[i] = n
    if not line_of_step:
        raise ValueError(f"{sample.id}: its reference states no steps, so there is no step to corrupt")
    k = rng.choice(sorted(line_of_step))
    step_lines = set(line_of_step.values())
    a, b = _result_span(lines[line_of_step[k]])
    old = lines[line_of_step[k]][a:b]
    replaced = {old: corrupt_value(old, rng)}  # value text -> its wrong replacement
    lines[line_of_step[k]] = lines[line_of_step[k]][:a] + replaced[old] + lines[line_of_step[k]][b:]
    for n in range(line_of_step[k] + 1, len(lines)):
        for old, new in list(replaced.items()):
            line = lines[n]
            if not _quoted(old).search(line):
                continue
            if n in step_lines and line.count("=") >= 2:
                a, b = _result_span(line)
                lines[n] = _recompute(line, old, new, rng)
                a2, b2 = _result_span(lines[n])
                if lines[n][a2:b2] != line[a:b]:
                    replaced[line[a:b]] = lines[n][a2:b2]
            else:  # the ANSWER line, or a step stated without an expression: it quotes the value itself
                lines[n] = _quoted(old).sub(new, line)
    return "\n".join(lines), k


def gym_candidates(family, sample, n: int, rng: random.Random, p_intact: float = 0.25) -> list[str]:
    """``n`` candidate responses: each the intact reference with probability ``p_intact``, else a perturbation."""
    return [sample.reference_solution if rng.random() < p_intact else perturb_reference(family, sample, rng)[0]
            for _ in range(n)]


def gym_step_examples(family_name: str, n: int, seed: int = 0, level: int = 2, p_intact: float = 0.25) -> list[StepExample]:
    """``n`` labelled responses, one per gym problem (deterministic in the arguments); labels come from the
    family's grader, so they are exactly right by the gym's own rules."""
    from cohortrl import tasks

    family = tasks.get(family_name)
    rng = random.Random(f"gym-labels/{family_name}/{seed}/{level}")
    out = []
    for sample in family.sample(n, seed=seed, level=level):
        (completion,) = gym_candidates(family, sample, 1, rng, p_intact)
        out.append(response_steps(family, sample, completion))
    return out


def gym_pair_examples(family_name: str, n: int, seed: int = 0, level: int = 2, tries: int = 8) -> list[PairExample]:
    """``n`` Bradley–Terry pairs, one per gym problem (deterministic in the arguments): chosen is the reference
    solution, rejected a perturbation of it (one step's value made wrong, carried forward). The family's
    grader confirms the order: the reference's outcome is 1 and the perturbation's 0. The two differ only
    where the slip is, so the pair isolates the signal an ORM must learn."""
    from cohortrl import tasks

    family = tasks.get(family_name)
    rng = random.Random(f"gym-pairs/{family_name}/{seed}/{level}")
    out = []
    for sample in family.sample(n, seed=seed, level=level):
        if family.grade(sample, sample.reference_solution).outcome != 1.0:
            raise ValueError(f"{sample.id}: the reference solution does not grade as correct; the task family is broken")
        for _ in range(tries):
            rejected, _ = perturb_reference(family, sample, rng)
            if family.grade(sample, rejected).outcome == 0.0:
                out.append(PairExample(sample.prompt, sample.reference_solution, rejected))
                break
        else:
            raise ValueError(f"{sample.id}: {tries} perturbations of the reference all still grade as correct, so "
                             "there is no wrong response to pair it with")
    return out


def as_pointwise(examples: list[StepExample]) -> list[PointExample]:
    """ORM data from step data: the whole response, labelled by its outcome."""
    return [PointExample(e.prompt, "\n".join(e.steps), e.outcome if e.outcome is not None else min(e.labels))
            for e in examples]


# ------------------------------------------------------------------------------------------- Math-Shepherd
Completer = Callable[[str, int], list[str]]  # (response prefix, n) -> n continuations of it


@dataclass(frozen=True)
class ShepherdLabel:
    hard: float  # 1.0 if any completion from this step reaches the right answer (Math-Shepherd's HE)
    soft: float  # the fraction that do (SE)


def math_shepherd_labels(family, sample, steps: list[str], complete: Completer, n: int) -> list[ShepherdLabel]:
    """Label each of ``steps`` by rolling out ``n`` completions from the response up to and including it and
    grading their outcome with the family's grader (arXiv 2312.08935, eqs. 3-4).

    ``complete(prefix, n)`` continues the response ``prefix`` (steps joined by newlines, ending in one);
    what it returns is appended to the prefix and the whole is graded.
    """
    out = []
    for i in range(len(steps)):
        prefix = "\n".join(steps[: i + 1]) + "\n"
        outcomes = [family.grade(sample, prefix + c).outcome for c in complete(prefix, n)]
        if len(outcomes) != n:
            raise ValueError(f"complete(prefix, {n}) returned {len(outcomes)} completions; it must return {n}")
        out.append(ShepherdLabel(float(any(o == 1.0 for o in outcomes)), sum(outcomes) / n))
    return out


def policy_completer(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
                     seed: int = 0) -> Completer:
    """A `Completer` that samples continuations of the assistant's response from a causal LM."""
    import torch

    generator_seed = [seed]

    @torch.no_grad()
    def complete(prefix: str, n: int) -> list[str]:
        from cohortrl.rollout.hf import Sampling, eos_token_ids, generate_ids, prefill_cache

        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(head + prefix, add_special_tokens=False, return_tensors="pt")["input_ids"].expand(n, -1)
        mask = torch.ones_like(ids)
        torch.manual_seed(generator_seed[0])
        generator_seed[0] += 1
        # cohortrl's decoding loop: the prefix is prefilled once for the n continuations
        cache = prefill_cache(model, ids, mask) if ids.shape[1] > 1 else None
        out, lengths, _ = generate_ids(model, tokenizer, ids, mask, Sampling(temperature=temperature, max_new_tokens=max_new_tokens),
                                       eos_token_ids(model, tokenizer), cache)
        return [tokenizer.decode(row[ids.shape[1]:ids.shape[1] + k], skip_special_tokens=True)
                for row, k in zip(out, lengths.tolist())]

    return complete
