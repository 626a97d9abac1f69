"""The answer a free-form response commits to, and whether it equals a reference: what the built-in
``accuracy`` and ``format`` rewards grade (`cohortrl.rewards.functions`).

The ANSWER line is read by the gym's one parser (`answer_format.parse_response`), with the gym's rules:
markdown decoration and bullets are ignored, ``ANSWER: x = 5`` and the template echo ``ANSWER: <5>`` read
as ``5``, and exactly one ANSWER line commits: two lines are a hedge, even when they agree; so is a second
number after the value (``ANSWER: 80 (not 72)``, ``6 or 99``: `answer_format.hedged`). An answer that is not a
plain number is read by math-verify as one whole expression, within bounds on its cost, and an undefined value
(0/0) equals nothing (`answers_match`, issue 50).

>>> extract_answer("2 + 3 = 5\\n**ANSWER**: 5")
'5'
>>> extract_answer("ANSWER: 5\\nANSWER: 5") is None     # a hedge, not a commitment
True
>>> answers_match("1,000.0", "1000"), answers_match("1/2", "0.5")
(True, True)
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction

from cohortrl.grading.answer_format import NUMBER, commitment, hedged, number_and_rest, parse_number, parse_response
from cohortrl.grading.units import within_tolerance

ACCURACY_MODES = ("answer_line", "last_number")
_OPERATORS = set("^*/×÷·")
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


def _leading_number(text: str) -> Fraction | None | bool:
    """The number ``text`` starts with when only words or a unit follow it (``72 apples``, ``72.0 kN``), as the
    gym reads an answer; False when it does not start with one or offers another number (`hedged`)."""
    split = number_and_rest(text)
    if split is None or hedged(text) or split[1][:1] in _OPERATORS:
        return False  # "2^10" and "3*pi" are expressions: math-verify reads them
    return parse_number(split[0])


def answers_match(predicted: str, gold, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """A plain number on the gold side and one on the predicted side, alone or followed by words (never by a
    second number): equal within ``max(rel_tol·|gold|, abs_tol)`` (the gym's tolerance rule,
    `units.within_tolerance`, exact over fractions). Otherwise math-verify's symbolic equivalence (fractions,
    expressions, LaTeX) of the whole text, read as one expression (`_symbolic`).

    >>> answers_match("72 apples", "72"), answers_match("80 (not 72)", "72"), answers_match("2^{10}", "1024")
    (True, False, True)
    """
    g = _plain_number(str(gold))
    p = _plain_number(predicted) if g is False else _leading_number(predicted)
    if p is not False and g is not False:
        return p is not None and g is not None and within_tolerance(p, g, rel_tol, Fraction(str(abs_tol)))
    from math_verify import verify  # imported lazily: it pulls in sympy

    gold_read = _symbolic(str(gold))
    predicted_read = None if _prose(predicted) or _items(predicted) > _items(str(gold)) else _symbolic(predicted)
    if gold_read is None or predicted_read is None:
        return False
    # math-verify bounds its own time with signal.alarm, which only the main thread may set. Off the main thread
    # (reward.timeout_s runs reward functions in a thread) it would raise, so there `_symbolic`'s bound on what
    # may be evaluated keeps the cost down, and reward.timeout_s catches the rest.
    kw = {} if threading.current_thread() is threading.main_thread() else {"timeout_seconds": None}
    return bool(verify(gold_read, predicted_read, **kw))


# What math-verify is given to read: short texts without the constructs whose values sympy computes as it parses
# (factorials, binomials, sums, products, integrals, limits, Gamma): ``\binom{10^9}{5 \cdot 10^8}`` would
# take minutes. Answers written with them are not read (they score 0 with ``accuracy``).
MAX_SYMBOLIC_CHARS = 200
_COMPUTED_WHILE_PARSED = re.compile(r"!|\\(?:[dt]?binom|choose|prod|sum|int|oint|lim|Gamma|operatorname)")
# Integers math-verify may build while it compares: 2^100,000 has 30,103 digits and takes milliseconds; a power
# tower (9^9^9^9) would take longer than the run.
MAX_BITS = 100_000


# Letters math-verify would read as a product of symbols: "80 (not 72)" is 80·n·o·t·72, and "x (or 0)" is 0.
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_FUNCTION_NAMES = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "log",
                   "ln", "exp", "sqrt", "pi"}
_JUXTAPOSED = re.compile(r"[\w)}\]]\s+[\w(\[{]")  # "6 99", "x (0)": two answers side by side, no operator
_RANGE = re.compile(rf"^\s*{NUMBER}\s*[-–]\s*\d")  # "72-80": a hedge to the gym (`answer_format.hedged`), not 72 - 80


def _prose(answer: str) -> bool:
    """Whether a model's answer holds words (``not``, ``or``, ``apples``: a run of letters that is no LaTeX
    command or function name), two terms side by side with no operator between them, or starts as a range
    (``72-80``): text around or between values, which math-verify would read as a product of single-letter
    symbols or as arithmetic. Not read symbolically; a plain number followed by words (``72 apples``) is read
    as that number before this (`_leading_number`)."""
    words = (w.lower() for w in _WORD.findall(answer))
    operands_only = re.sub(r"\\[A-Za-z]+", "\\\\", answer)  # a LaTeX command (\cdot, \pi) is never a bare term
    return (any(w not in _FUNCTION_NAMES for w in words) or _JUXTAPOSED.search(operands_only) is not None
            or _RANGE.match(answer) is not None)


def _items(text: str) -> int:
    """How many comma-separated values ``text`` lists outside brackets: more than the gold answer lists is a
    hedge, even when math-verify's set of them collapses to the gold one (``0, 0`` is {0}; ``0/0, 0`` is 0)."""
    depth, items = 0, 1
    for c in text:
        depth += (c in "([{") - (c in ")]}")
        items += c == "," and depth <= 0
    return items


def _symbolic(text: str) -> list | None:
    """math-verify's reading of ``text`` as one math expression (``$text$``), or None when it cannot be one
    answer: too long or computed while parsed (above), read only in part (a digit of ``text`` outside what was
    read: a second number, ``\\boxed{5} and 6``), undefined (0/0, 1/0: never equal to anything), or an
    integer too large to build (`_log2_bound` past ``MAX_BITS``)."""
    from math_verify import parse

    text = text.strip().strip("$").strip()
    if not text or len(text) > MAX_SYMBOLIC_CHARS or _COMPUTED_WHILE_PARSED.search(text):
        return None
    main = threading.current_thread() is threading.main_thread()
    read = parse(f"${text}$", **({} if main else {"parsing_timeout": None}))
    if len(read) < 2 or sum(c.isdigit() for c in str(read[1])) != sum(c.isdigit() for c in text):
        return None
    expression = read[0]
    if not hasattr(expression, "free_symbols") or _log2_bound(expression) > MAX_BITS:
        return None
    if _undefined(expression):
        return None
    return read


def _log2_bound(e) -> float:
    """An upper bound on log2 of the largest number evaluating sympy expression ``e`` builds, from its tree
    alone (nothing is evaluated): a power multiplies its base's bound by its exponent's value, a product adds,
    a factorial-like function of n grows as n·log2(n). Infinite past what is worth computing."""
    import sympy

    if e.is_Rational:
        return float(max(abs(e.p).bit_length(), e.q.bit_length(), 1))
    if e.is_Float:
        magnitude = abs(float(e))
        return math.log2(magnitude) + 1 if 1 <= magnitude < math.inf else (1.0 if magnitude < 1 else math.inf)
    if not e.args:
        return 1.0  # a symbol or constant (x, pi, E, I, oo)
    if e.is_Pow or isinstance(e, sympy.exp):
        base, exponent = e.args if e.is_Pow else (sympy.E, e.args[0])
        bits = _log2_bound(exponent)
        return math.inf if bits > 40 else 2.0**bits * _log2_bound(base)
    args = [_log2_bound(a) for a in e.args]
    if e.is_Mul:
        return sum(args)
    if isinstance(e, sympy.Function) and not type(e).__module__.startswith("sympy.functions.elementary"):
        n = max(args)
        return math.inf if n > 16 else 2.0**n * n
    return max(args) + math.log2(len(args))  # sums, elementary functions, sets, tuples, equations


def _undefined(expression) -> bool:
    """0/0, 1/0, log(0) and the like, in an expression already known to be cheap to evaluate."""
    import sympy

    try:
        value = expression.evalf(15) if isinstance(expression, sympy.Expr) else expression
        return bool(value.has(sympy.nan, sympy.zoo))
    except (TypeError, ValueError, ArithmeticError, RecursionError):
        return True
