"""What every gym family shares: the Sample and Grade types, the family base class, the keyed step grader
(where the anti-hacking rules live, once) and the registry.

A family is a frozen dataclass whose fields are its knobs (``rel_tol``, ``step_weight``); it generates
`Sample`s with ``sample(n, seed, level)`` and grades a completion with ``grade(sample, completion)``.

Step credit cannot be farmed (issue 5); the rules, all in `grade_keyed`:
- credit is the fraction of the sample's REQUIRED steps stated correctly, so extra lines, restated givens
  and invented keys (member names that do not exist) add nothing;
- each key is credited once, and only if every line stating it agrees: a later contradicting value cancels
  it, so repeating a step gains nothing and hedging between values loses it;
- credit counts only when the response commits: exactly one readable ANSWER line and, where asked, exactly
  one VERDICT line; several ANSWER or VERDICT lines, or none (stopping after the steps), earn no step credit
  and no outcome;
- values must carry the right unit (`units.quantity_matches`): bare numbers and wrong units are wrong;
- verdicts are balanced SAFE/FAIL over any two consecutive samples, so always answering SAFE is right half
  the time, and a verdict only counts together with a correct ANSWER value.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import random
import re
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from cohortrl.grading.answer_format import (
    commitment,
    find_statements,
    normalize_key,
    normalize_lhs,
    parse_response,
    rounds_to,
)
from cohortrl.grading.units import quantity_matches


@dataclass(frozen=True)
class Step:
    """A quantity a response must state as ``KEY = ... = value unit``.

    ``value`` is text so that it round-trips through JSON exactly: an exact decimal for arithmetic,
    ``repr(float)`` for engineering results. ``abs_tol`` (in ``unit``) is for quantities that may be zero.
    """

    key: str
    value: str
    unit: str = ""
    abs_tol: float = 0.0

    def matches(self, value: Fraction | None, unit: str, rel_tol: float) -> bool:
        return quantity_matches(value, unit, Fraction(self.value), self.unit, rel_tol, self.abs_tol)


def _fields(obj) -> dict[str, Any]:
    """A dataclass's fields by name, in order, the values as they are (not copied)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@dataclass
class Sample:
    """One problem instance; JSON-serialisable via `to_dict` / `Sample.from_dict`, so it can be a dataset row."""

    family: str
    level: int
    seed: int
    index: int  # position in ``family.sample(n, seed, level)``; (family, seed, level, index) regenerates it
    prompt: str  # a plain user message; the trainer applies the chat template
    answer: str  # what the reference writes after "ANSWER:", e.g. "1.571" or "45.3 kN*m"
    reference_solution: str  # earns outcome 1 and every step
    target: Step  # the exact quantity the ANSWER line must state
    steps: list[Step]  # the required steps, in solution order (empty: outcome-only problem)
    verdict: str | None = None  # "SAFE" / "FAIL" where the family asks for a verdict
    givens: list[str] = field(default_factory=list)  # the problem's data as "name = value unit" lines
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific, JSON-serialisable
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{self.family}/L{self.level}/s{self.seed}/{self.index}"

    def to_dict(self) -> dict[str, Any]:
        # What dataclasses.asdict gives: asdict recurses into every value and was half the time of drawing a task
        # pool's rows, so only the fields that hold containers are copied (``extra`` deeply, as asdict copies it).
        row = _fields(self)
        row.update(target=_fields(self.target), steps=[_fields(s) for s in self.steps], givens=list(self.givens),
                   extra=copy.deepcopy(self.extra))
        return row

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["target"] = Step(**d["target"])
        d["steps"] = [Step(**s) for s in d["steps"]]
        return cls(**d)


@dataclass(frozen=True)
class StepResult:
    key: str
    correct: bool  # stated correctly, never contradicted, and the response committed to an answer
    span: tuple[int, int] | None  # the line the verdict on this step was read from; None if never stated
    written: str | None = None  # the value text as written, for diagnostics


@dataclass(frozen=True)
class Grade:
    outcome: float  # 1.0 when the ANSWER (and VERDICT, if asked) is right, else 0.0
    steps: list[StepResult]  # one per required step, in the sample's order
    score: float  # the default reward: (1 - w) * outcome + w * step_credit; just outcome if no steps
    committed: bool  # exactly one readable ANSWER (and VERDICT) line
    # The step verdicts before the commitment gate: what the response stated, answer or not (process rewards
    # with reward.process.require_answer off read these; the gym's own score never does).
    stated: list[StepResult] = field(default_factory=list, compare=False, repr=False)

    @property
    def step_credit(self) -> float:
        return sum(s.correct for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def supported(self) -> bool:
        """A right outcome whose every required step is right too (the outcome alone pays a right ANSWER
        however it was reached)."""
        return self.outcome >= 1.0 and all(s.correct for s in self.steps)


# A step's ``written`` text is shown to people and written to logs; model text can make it anything.
MAX_WRITTEN_CHARS = 500


def clean_text(text: str | None, limit: int = MAX_WRITTEN_CHARS) -> str | None:
    """``text`` safe to print, log and encode as UTF-8: at most ``limit`` characters (a note says how many
    more there were), and every control, format or surrogate character except tab and newline (NUL, bidi
    overrides, zero-width characters, lone surrogates) replaced by U+FFFD, so it stays visible without
    acting. Cut first, so a megabyte of text costs no more than ``limit`` characters."""
    if text is None:
        return None
    head = text[:limit]
    head = "".join(c if c in "\t\n" or unicodedata.category(c) not in ("Cc", "Cf", "Cs") else "\ufffd" for c in head)
    return head if len(text) <= limit else f"{head}… ({len(text) - limit} more characters)"


def make_grade(outcome: float, steps: list[StepResult], committed: bool, step_weight: float) -> Grade:
    """The grade of a response from its step verdicts; every ``written`` text is cleaned (`clean_text`)."""
    steps = [dataclasses.replace(s, written=clean_text(s.written)) if s.written else s for s in steps]
    stated = steps
    if not committed:
        steps = [dataclasses.replace(s, correct=False) for s in steps]
    credit = sum(s.correct for s in steps) / len(steps) if steps else 0.0
    score = outcome if not steps else (1.0 - step_weight) * outcome + step_weight * credit
    return Grade(outcome, steps, score, committed, stated)


def grade_keyed(sample: Sample, completion: str, rel_tol: float, step_weight: float, answer_ok) -> Grade:
    """Grade a ``KEY = ... = value unit`` response against the sample's required steps (rules: module doc).

    ``answer_ok(sample, value, unit) -> bool`` judges the committed ANSWER value.
    """
    parsed = parse_response(completion)
    commit = commitment(parsed, needs_verdict=sample.verdict is not None)
    answer_right = commit.committed and answer_ok(sample, commit.answer.value, commit.answer.unit)
    outcome = 1.0 if answer_right and commit.verdict == sample.verdict else 0.0

    stated: dict[str, list] = {}
    for line in parsed.steps:
        stated.setdefault(normalize_key(line.key), []).append(line)
    results = []
    for step in sample.steps:
        lines = stated.get(normalize_key(step.key), [])
        if not lines:
            results.append(StepResult(step.key, False, None))
            continue
        wrong = [line for line in lines if not step.matches(line.value, line.unit, rel_tol)]
        decisive = wrong[0] if wrong else lines[0]
        results.append(StepResult(step.key, not wrong, decisive.span, decisive.text))
    return make_grade(outcome, results, commit.committed, step_weight)


# ---------------------------------------------------------------------------------------------------------
# Generation helpers shared by the engineering families.

# Verdicts of generated problems sit at least this far from the threshold (utilisation <= 0.9 or >= 1.1),
# so values rounded within the 1% tolerance can never flip them.
VERDICT_MARGIN = 0.10


def rng_for(family: str, seed: int, level: int, index: int) -> random.Random:
    """One RNG per sample, so ``sample(n)[:k] == sample(k)`` and any single sample can be regenerated.
    (String seeds are hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.)"""
    return random.Random(f"{family}/{seed}/{level}/{index}")


def wants_safe(seed: int, index: int) -> bool:
    """Alternate SAFE and FAIL so every pair of consecutive samples is balanced exactly."""
    return (seed + index) % 2 == 0


def target_utilisation(rng: random.Random, safe: bool) -> float:
    """A utilisation (demand / capacity) clear of 1 by more than the margin, on the requested side."""
    return rng.uniform(0.4, 0.8) if safe else rng.uniform(1.2, 2.2)


def clear_of_threshold(utilisation: float) -> bool:
    return abs(utilisation - 1.0) >= VERDICT_MARGIN


def round_nice(x: float, sig: int = 2) -> float:
    """Round a generated given to ``sig`` significant figures, as a textbook would state it."""
    if x == 0:
        return 0.0
    return round(x, sig - 1 - math.floor(math.log10(abs(x))))


# ---------------------------------------------------------------------------------------------------------
# The family base class and the registry.


@dataclass(frozen=True)
class TaskFamily:
    """Base of every family. Subclasses set ``name`` and ``levels`` and implement `make_sample`
    (or override `sample`); most inherit `grade`."""

    name: ClassVar[str] = ""
    levels: ClassVar[tuple[int, ...]] = ()
    # Relative tolerance on every graded value. Reference solutions are written to 4 significant figures
    # (error <= 0.05%), so values below 0.001 would fail them.
    rel_tol: float = 0.01
    # Weight of step credit in `Grade.score`; the rest is the outcome.
    step_weight: float = 0.25

    def check_level(self, level: int) -> None:
        if level not in self.levels:
            raise ValueError(f"{self.name} has levels {list(self.levels)}, not {level!r}")

    def sample(self, n: int, seed: int = 0, level: int = 1) -> list[Sample]:
        """``n`` samples, deterministic in (seed, level); sample i depends only on (seed, level, i)."""
        self.check_level(level)
        return [self.make_sample(seed, level, i) for i in range(n)]

    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        raise NotImplementedError

    def grade(self, sample: Sample, completion: str) -> Grade:
        return grade_keyed(sample, completion, self.rel_tol, self.step_weight, self.answer_ok)

    def answer_ok(self, sample: Sample, value: Fraction | None, unit: str) -> bool:
        return sample.target.matches(value, unit, self.rel_tol)

    def grade_statements(self, sample: Sample, completion: str, rewrites: bool = False) -> list[StepResult]:
        """The required steps read from free-text statements ``a op b = c`` (`credit_statements`; ``rewrites``
        also reads rewriting chains, `find_statements`), for families whose steps are plain arithmetic; before
        the commitment gate. Others have units and named quantities that a bare statement cannot carry."""
        raise ValueError(f"the {self.name} family's steps are KEY = value unit lines, not free-text statements: "
                         "read them with the default (keyed) step reading")

    def sample_from_dict(self, d: dict[str, Any]) -> Sample:
        if d.get("family") != self.name:
            raise ValueError(f"a {d.get('family')!r} sample given to the {self.name!r} family")
        return Sample.from_dict(d)


_REGISTRY: dict[str, TaskFamily] = {}


def register(family: type[TaskFamily]) -> type[TaskFamily]:
    """Class decorator: make ``family`` available as ``cohortrl.tasks.get(family.name)`` and as
    ``data.source: task:NAME`` in a config (put the defining module under ``imports:``)."""
    if not (isinstance(family, type) and issubclass(family, TaskFamily)):
        raise TypeError(f"tasks.register takes a TaskFamily subclass, got {family!r}")
    if not family.name or not family.levels:
        raise TypeError(f"task family {family.__name__} must set the class attributes name and levels")
    if family.make_sample is TaskFamily.make_sample and family.sample is TaskFamily.sample:
        raise TypeError(f"task family {family.__name__} must implement make_sample(seed, level, index) (or sample)")
    known = _REGISTRY.get(family.name)
    if known is not None and type(known).__qualname__ != family.__qualname__:
        raise ValueError(f"task family name {family.name!r} is already registered by {type(known).__qualname__}; pick another name")
    _REGISTRY[family.name] = family()
    return family


def get(name: str, **knobs: Any) -> TaskFamily:
    """The family called ``name``, with any knobs overridden: ``get("truss", rel_tol=0.02)``."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"no task family {name!r}{hint} (known: {', '.join(names())})")
    family = _REGISTRY[name]
    return dataclasses.replace(family, **knobs) if knobs else family


def names() -> list[str]:
    return sorted(_REGISTRY)


_SAMPLE_ID = re.compile(r"(?P<family>[^/]+)/L(?P<level>\d+)/s(?P<seed>-?\d+)/(?P<index>\d+)")


def sample_from_id(sample_id: str) -> Sample | None:
    """The gym problem a ``Sample.id`` names (``FAMILY/L{level}/s{seed}/{index}``), made again with the family's
    default knobs; None for an id that names no registered family (a hashed prompt, another dataset)."""
    m = _SAMPLE_ID.fullmatch(sample_id)
    if m is None or m["family"] not in _REGISTRY:
        return None
    family, seed, level, index = _REGISTRY[m["family"]], int(m["seed"]), int(m["level"]), int(m["index"])
    if type(family).make_sample is TaskFamily.make_sample:  # a family that implements sample() only
        return family.sample(index + 1, seed, level)[index]
    return family.make_sample(seed, level, index)


def credit_statements(completion: str, steps: list[Step], calculations: list[str], known: set[Fraction],
                      rewrites: bool = False) -> list[StepResult]:
    """Required steps credited from free-text arithmetic statements ``a op b = c`` instead of ``KEY = …`` lines
    (the rules are gsm8k's, module docstring of `cohortrl.tasks.gsm8k`): a statement counts if it is right,
    grounded (each operand is in ``known`` or a result the response derived earlier), not an identity (unless
    the step's own calculation is one, as arithmetic's "0 + 2" can be), not contradicted (one left-hand side, one result) and among the first 2R + 2; each required step is matched
    to a distinct statement, first one writing the same calculation (``calculations[i]``), then any with the
    step's value. ``rewrites``: a rewriting chain ``7 * 8 + 9 = 56 + 9 = 65`` states ``7 * 8 = 56``
    (`find_statements`). The verdicts before the commitment gate: callers apply it (``make_grade``) or not."""
    statements = find_statements(completion, rewrites)[: 2 * len(steps) + 2]
    results_by_lhs: dict[str, set[Fraction]] = {}
    for s in statements:
        results_by_lhs.setdefault(s.lhs, set()).add(s.written)
    known = set(known)
    usable, seen = [], set()
    for s in statements:
        grounded = all(o in known for o in s.operands)
        if s.correct and grounded:
            known |= {s.written, abs(s.written)}  # operands are read without their sign
        if s.correct and grounded and len(results_by_lhs[s.lhs]) == 1 and s.lhs not in seen:
            usable.append(s)
            seen.add(s.lhs)
    matched: dict[int, object] = {}
    for same_calculation in (True, False):
        for i, step in enumerate(steps):
            if i in matched:
                continue
            lhs = normalize_lhs(calculations[i])
            # An identity (0 + 2 = 2) restates a number: it counts only where the step's own calculation is it.
            match = next((s for s in usable if (s.lhs == lhs if same_calculation else not s.trivial)
                          and rounds_to(s.exact, step.value)), None)
            if match is not None:
                matched[i] = match
                usable.remove(match)
    return [StepResult(step.key, i in matched, matched[i].span if i in matched else None,
                       matched[i].written_text if i in matched else None) for i, step in enumerate(steps)]
