"""The answer a free-form response commits to, and whether it equals a reference: what the built-in
``accuracy`` and ``format`` rewards grade (`cohortrl.rewards.functions`).

The ANSWER line is read by the gym's one parser (`answer_format.parse_response`), with the gym's rules:
markdown decoration and bullets are ignored, ``ANSWER: x = 5`` and the template echo ``ANSWER: <5>`` read
as ``5``, and exactly one ANSWER line commits: two lines are a hedge, even when they agree.

>>> extract_answer("2 + 3 = 5\\n**ANSWER**: 5")
'5'
>>> extract_answer("ANSWER: 5\\nANSWER: 5") is None     # a hedge, not a commitment
True
>>> answers_match("1,000.0", "1000"), answers_match("1/2", "0.5")
(True, True)
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from cohortrl.grading.answer_format import NUMBER, commitment, parse_number, parse_response
from cohortrl.grading.units import within_tolerance

ACCURACY_MODES = ("answer_line", "last_number")
_NUMBER_RE = re.compile(NUMBER)


def extract_answer(text: str, mode: str = "answer_line") -> str | None:
    """The answer ``text`` commits to, as written (its unit, if any, included).

    ``answer_line``: the value text of the single ``ANSWER:`` line (None if there is none, several, or it is
    empty). ``last_number``: the same when the response has any ANSWER line, else the last number in the text
    (a lenient reading for models that don't follow the format yet)."""
    if mode not in ACCURACY_MODES:
        raise ValueError(f"unknown accuracy mode {mode!r}; use 'answer_line' or 'last_number'")
    answers = parse_response(text).answers
    if answers:
        return (answers[0].text or None) if len(answers) == 1 else None
    if mode == "last_number":
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    return None


def commits_to_a_number(text: str) -> bool:
    """Exactly one ANSWER line, and its value reads as a number (the gym's commitment, without a verdict)."""
    return commitment(parse_response(text), needs_verdict=False).committed


def _plain_number(text: str) -> Fraction | None | bool:
    """``text`` as an exact number; False when it is not written as one plain number, None when it is but is
    beyond reading (an exponent past ``answer_format.MAX_EXPONENT``)."""
    text = text.strip().rstrip(".").replace(" ", "")
    return parse_number(text) if re.fullmatch(NUMBER, text) else False


def answers_match(predicted: str, gold, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Plain numbers on both sides: equal within ``max(rel_tol·|gold|, abs_tol)`` (the gym's tolerance rule,
    `units.within_tolerance`, exact over fractions). Otherwise math-verify's symbolic equivalence (fractions,
    expressions, LaTeX)."""
    p, g = _plain_number(predicted), _plain_number(str(gold))
    if p is not False and g is not False:
        return p is not None and g is not None and within_tolerance(p, g, rel_tol, Fraction(str(abs_tol)))
    from math_verify import parse, verify  # imported lazily: it pulls in sympy

    # math-verify bounds its own time with signal.alarm, which only the main thread may set. Off the main thread
    # (reward.timeout_s runs reward functions in a thread) it would raise, so there the thread's timeout bounds it.
    main = threading.current_thread() is threading.main_thread()
    parse_kw, verify_kw = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    return bool(verify(parse(str(gold), **parse_kw), parse(predicted, **parse_kw), **verify_kw))
