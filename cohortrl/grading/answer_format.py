"""The one answer format of the gym, and the one parser for it.

Every family's prompt asks for the same shape of response::

    KEY = expression = value unit        one step per line; "KEY = value unit" is fine too
    ...
    ANSWER: value unit                   exactly one
    VERDICT: SAFE                        exactly one, where the family asks for a verdict (SAFE or FAIL)

Only the text after the last ``=`` of a step line is graded; the expression between is for the reader.
Lines may carry markdown decoration (``**``, backticks, a leading ``-`` / ``*`` bullet or ``1.``), and a step's
value may be followed by a parenthesised remark (``F_AB = -6.25 kN (compression)``); both are ignored.
Keys are matched case-insensitively and without underscores (``M_max`` = ``Mmax`` = ``m_MAX``).
Numbers may use thousands commas, exponents and a leading ``$``.

GSM8K responses are free text, so that family reads arithmetic statements ``a op b = c`` instead
(`find_statements`), evaluated exactly with `Fraction`s by a small recursive-descent evaluator.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

# A number: optional sign and "$", digits with optional thousands groups, decimals, exponent.
NUMBER = r"[-+]?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_ONLY = re.compile(rf"^{NUMBER}$")
_VALUE_UNIT = re.compile(rf"^(?P<num>{NUMBER})\s*(?P<unit>.*?)$")
_KEY = re.compile(r"^(?P<key>[^\W\d][\w]*)\s*=(?P<rest>.*)$")
_ANSWER = re.compile(r"^ANSWER\s*:(?P<rest>.*)$", re.IGNORECASE)
_VERDICT = re.compile(r"^VERDICT\s*:(?P<rest>.*)$", re.IGNORECASE)
_BULLET = re.compile(r"^(?:[-*•>]+\s+|\d+[.)]\s+)")
_KEY_ALIASES = {"σ": "sigma", "δ": "delta", "Δ": "delta"}
# Exponents beyond this are not a quantity anyone means; reading them exactly would take unbounded time.
MAX_EXPONENT = 400
# A second number after an answer's value: a digit that is not part of a unit's name or exponent (mm^2, N/mm2).
# "ANSWER: 6 or 99", "ANSWER: 80 (not 72)" and "ANSWER: 72-80" offer alternatives; no answer line commits with one.
_ANOTHER_NUMBER = re.compile(r"(?<![A-Za-z_^])\d")


def parse_number(text: str) -> Fraction | None:
    """A written number as an exact `Fraction` (``"$1,250.5"`` → 2501/2), or ``None``."""
    text = text.strip().replace("−", "-")
    if not _NUMBER_ONLY.match(text):
        return None  # Fraction() would also read "3/4" and " 1_000"; answers are decimals
    text = text.replace("$", "").replace(",", "")
    digits = text.lower().partition("e")[2].lstrip("+-").lstrip("0")
    if len(digits) > 3 or int(digits or 0) > MAX_EXPONENT:
        return None  # Fraction("1e999999999") would build a billion-digit integer: a hang, not an answer
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):  # also digits beyond Python's int-conversion limit (4300)
        return None


def normalize_key(key: str) -> str:
    """Keys compare case-insensitively and without underscores: ``M_max`` → ``mmax``."""
    for alias, name in _KEY_ALIASES.items():
        key = key.replace(alias, name)
    return key.replace("_", "").lower()


@dataclass(frozen=True)
class ValueLine:
    """One parsed line of a response. ``value`` is ``None`` when the line's value could not be read."""

    key: str  # the key as written ("M_max"), or "ANSWER" / "VERDICT"
    value: Fraction | None
    unit: str
    text: str  # the graded value text as written, for diagnostics ("314.2 mm^2", "SAFE")
    span: tuple[int, int]  # character span of the whole line in the response


@dataclass(frozen=True)
class ParsedResponse:
    steps: list[ValueLine]  # every "KEY = ... = value unit" line, in order
    answers: list[ValueLine]  # every ANSWER line
    verdicts: list[ValueLine]  # every VERDICT line; value is None, text is "SAFE"/"FAIL" or what was written


def _strip_remark(text: str) -> str:
    """``"-6.25 kN (compression)"`` → ``"-6.25 kN"``: one trailing parenthesised remark without nested
    brackets. String searches rather than a regex: the regex backtracks quadratically over a long run of
    spaces, which a model can write."""
    text = text.strip()
    if not text.endswith(")"):
        return text
    start = text.rfind("(", 0, len(text) - 1)
    if start < 0 or ")" in text[start + 1 : -1]:
        return text
    return text[:start].rstrip()


def _split_value_unit(text: str) -> tuple[Fraction | None, str]:
    text = _strip_remark(text).rstrip(" .,;").strip()
    match = _VALUE_UNIT.match(text)
    if match is None:
        return None, ""
    return parse_number(match["num"]), match["unit"].strip()


def _clean(line: str) -> str:
    line = line.replace("**", "").replace("`", "").strip()
    return _BULLET.sub("", line).strip()


def parse_response(text: str) -> ParsedResponse:
    """Split a response into step, ANSWER and VERDICT lines; everything else is ignored."""
    steps: list[ValueLine] = []
    answers: list[ValueLine] = []
    verdicts: list[ValueLine] = []
    start = 0
    for raw in text.split("\n"):
        span = (start, start + len(raw))
        start += len(raw) + 1
        line = _clean(raw)
        if match := _ANSWER.match(line):
            # Small models echo the prompt's template ("ANSWER: <12>") or name the quantity
            # ("ANSWER: SF = 1.57"); neither hedges, so both are read.
            rest = match["rest"].rsplit("=", 1)[-1].strip().removeprefix("<").removesuffix(">")
            value, unit = _split_value_unit(rest)
            if hedged(rest):
                value = None
            answers.append(ValueLine("ANSWER", value, unit, rest, span))
        elif match := _VERDICT.match(line):
            word = match["rest"].strip().rstrip(".").strip().upper()
            verdicts.append(ValueLine("VERDICT", None, "", word, span))
        elif match := _KEY.match(line):
            # The graded value is after the last "="; a line with no readable value (e.g. "A = pi*d^2/4")
            # states nothing yet and is skipped rather than counted as a wrong value.
            last = match["rest"].rsplit("=", 1)[-1]
            value, unit = _split_value_unit(last)
            if value is not None:
                steps.append(ValueLine(match["key"], value, unit, last.strip(), span))
    return ParsedResponse(steps, answers, verdicts)


def hedged(answer: str) -> bool:
    """Whether an answer's value text offers another number after its value, in its unit, its words or a
    parenthesised remark (``6 or 99``, ``80 (not 72)``, ``72-80``): a hedge, read as no answer by every family
    and by the ``accuracy`` and ``format`` rewards. Digits inside a unit (``mm^2``, ``N/mm2``) are not one.

    >>> hedged("80 (not 72)"), hedged("6 or 99"), hedged("283.5 mm^2 (area)"), hedged("-6.25 kN (compression)")
    (True, True, False, False)
    """
    split = number_and_rest(answer)
    return split is not None and _ANOTHER_NUMBER.search(split[1]) is not None


def number_and_rest(text: str) -> tuple[str, str] | None:
    """``(number, what follows it)`` for a text that starts with a number (``"72.0 kN"`` → ``("72.0", "kN")``),
    else None."""
    match = _VALUE_UNIT.match(text.strip())
    return None if match is None else (match["num"], match["unit"])


@dataclass(frozen=True)
class Commitment:
    """What a response commits to. ``committed`` needs exactly one readable ANSWER line and, where the
    family asks for one, exactly one VERDICT line reading SAFE or FAIL. Several such lines are a hedge,
    not a commitment, even if one of them is right."""

    committed: bool
    answer: ValueLine | None
    verdict: str | None


def commitment(parsed: ParsedResponse, needs_verdict: bool) -> Commitment:
    answer = parsed.answers[0] if len(parsed.answers) == 1 and parsed.answers[0].value is not None else None
    verdict = None
    if len(parsed.verdicts) == 1 and parsed.verdicts[0].text in ("SAFE", "FAIL"):
        verdict = parsed.verdicts[0].text
    committed = answer is not None and (verdict is not None or not needs_verdict)
    return Commitment(committed, answer, verdict)


def format_instructions(steps: list[tuple[str, str]], answer_of: str, verdict: bool) -> str:
    """The prompt's format paragraph. ``steps`` are (key, unit) pairs; unit "" means no unit."""
    listed = ", ".join(f"{key} ({unit})" if unit else key for key, unit in steps)
    tail = f"ANSWER: <{answer_of}>" + (" and VERDICT: SAFE or FAIL" if verdict else "")
    return f"Write one step per line as KEY = expression = value unit, for {listed}. Then write {tail}."


# ---------------------------------------------------------------------------------------------------------
# Numbers as the reference solutions write them.


def format_sig(x: float, sig: int = 4) -> str:
    """``x`` to ``sig`` significant figures without exponent notation: 83333333.3 → "83330000".

    Four figures keep every reference value within 0.05% of the truth, far inside the 1% tolerance.
    """
    if x == 0:
        return "0"
    text = format(Decimal(f"{x:.{sig}g}"), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_exact(value: Fraction) -> str:
    """A terminating fraction as an exact decimal: 69967/1000 → "69.967". Raises if it does not terminate."""
    for places in range(21):
        scaled = value * 10**places
        if scaled.denominator == 1:
            return format(Decimal(scaled.numerator).scaleb(-places), "f")
    raise ValueError(f"{value} has no short finite decimal expansion")


# ---------------------------------------------------------------------------------------------------------
# Free-text arithmetic statements "a op b = c" (the GSM8K family's steps).

_LHS_START = re.compile(r"[$(\-]*\.?\d")
# The left-hand side is at most MAX_LHS characters after at most MAX_NESTING leading brackets or signs, so
# each statement is looked for in a bounded window before its "=" (`find_statements`).
MAX_LHS = 200
MAX_NESTING = 50  # brackets and unary minus signs in one statement (more are not evaluated)
_RHS = r"-?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_STATEMENT = re.compile(
    r"(?P<lhs>[$(\-]{0,%d}\.?\d[\d$.,() \tx×÷*/+\-]{0,%d}?)[ \t]*=[ \t]*(?P<rhs>%s)" % (MAX_NESTING, MAX_LHS, _RHS)
)
_RHS_AFTER_EQUALS = re.compile(r"[ \t]*%s" % _RHS)
_TOKEN = re.compile(r"\s*(?:(?P<num>\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\$?\.\d+)|(?P<op>[-+*/x×÷()]))")
_OPS = {"x": "*", "×": "*", "÷": "/"}


def _tokenize(text: str) -> list[str | Fraction] | None:
    spanned = _spanned_tokens(text, 0, len(text))
    return None if spanned is None else [token for token, _, _ in spanned]


def evaluate(text: str) -> tuple[Fraction, list[Fraction]] | None:
    """Evaluate ``+ - * / ( )`` over decimal numbers exactly; returns (value, operands) or ``None``.

    Hand-written rather than ``eval``: responses are untrusted text, and we need exact rationals.
    Requires at least one binary operator, so a bare number is not a statement.
    """
    tokens = _tokenize(text)
    if not tokens or sum(t in ("(", "-") for t in tokens) > MAX_NESTING:
        return None  # each "(" or unary "-" is a level of recursion below: bounded, never a RecursionError
    pos = 0
    operands: list[Fraction] = []
    binary_ops = 0

    def peek() -> str | Fraction | None:
        return tokens[pos] if pos < len(tokens) else None

    def atom() -> Fraction:
        nonlocal pos
        token = peek()
        pos += 1
        if isinstance(token, Fraction):
            operands.append(token)
            return token
        if token == "-":
            return -atom()
        if token == "(":
            value = expr()
            if peek() != ")":
                raise ValueError("unbalanced")
            pos += 1
            return value
        raise ValueError(f"unexpected {token!r}")

    def term() -> Fraction:
        nonlocal pos, binary_ops
        value = atom()
        while peek() in ("*", "/"):
            op = tokens[pos]
            pos += 1
            binary_ops += 1
            rhs = atom()
            value = value * rhs if op == "*" else value / rhs
        return value

    def expr() -> Fraction:
        nonlocal pos, binary_ops
        value = term()
        while peek() in ("+", "-"):
            op = tokens[pos]
            pos += 1
            binary_ops += 1
            rhs = term()
            value = value + rhs if op == "+" else value - rhs
        return value

    try:
        value = expr()
    except (ValueError, ZeroDivisionError):
        return None
    if pos != len(tokens) or binary_ops == 0:
        return None
    return value, operands


def decimals(text: str) -> int:
    """Decimal places written in a number: "3.33" → 2, "24" → 0."""
    return len(text.split(".", 1)[1]) if "." in text else 0


def rounds_to(exact: Fraction, written_text: str) -> bool:
    """Is ``written_text`` the exact value, or the exact value correctly rounded to >= 2 decimal places?
    (GSM8K writes 10/3 = 3.33; rounding to fewer places would let 10/3 = 3 pass.)"""
    written = parse_number(written_text)
    if written is None:
        return False
    if written == exact:
        return True
    places = decimals(written_text.replace(",", ""))
    return places >= 2 and round(exact, places) == written


def is_identity(result: Fraction, operands: list[Fraction]) -> bool:
    """48 * 1 = 48, 48 + 0 = 48: the result is an operand and the rest is a 0 or a 1 — nothing computed."""
    return result in operands and any(o in (0, 1) for o in operands)


@dataclass(frozen=True)
class Statement:
    """One arithmetic statement ``lhs = rhs`` found in free text."""

    lhs: str  # normalised: no spaces, "$" or thousands commas; x × ÷ as * /
    exact: Fraction  # the left-hand side, evaluated exactly
    written: Fraction  # the right-hand side as written
    written_text: str
    correct: bool  # the right-hand side is the exact value (or correctly rounded, see `rounds_to`)
    trivial: bool  # an identity such as 48 * 1 = 48 or 48 + 0 = 48: restates a number, computes nothing
    operands: tuple[Fraction, ...]
    span: tuple[int, int]


def normalize_lhs(text: str) -> str:
    """A left-hand side without spaces, "$" or thousands commas, with x × ÷ as * /: "$1,000 x 2" → "1000*2"."""
    for old, new in ((" ", ""), ("\t", ""), ("$", ""), ("x", "*"), ("×", "*"), ("÷", "/")):
        text = text.replace(old, new)
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


def _statement_at(lhs_text: str, rhs_text: str, span: tuple[int, int]) -> Statement | None:
    # The regex starts the left-hand side at the first digit it can; prose such as "3, 4 + 5 = 9" makes
    # that start too early, so try each later start until one evaluates.
    for start in _LHS_START.finditer(lhs_text):
        if start.start() > 0 and lhs_text[start.start() - 1] in "0123456789.$,(":
            continue
        evaluated = evaluate(lhs_text[start.start():])
        if evaluated is None:
            continue
        exact, operands = evaluated
        written = parse_number(rhs_text)
        if written is None:
            return None
        lhs = normalize_lhs(lhs_text[start.start():])
        trivial = is_identity(written, operands)
        return Statement(lhs, exact, written, rhs_text, rounds_to(exact, rhs_text), trivial, tuple(operands),
                         (span[0] + start.start(), span[1]))
    return None


def find_statements(text: str, rewrites: bool = False) -> list[Statement]:
    """Every ``a op b = c`` in ``text``, in order. Chains ``2 * 3 = 6 * 4 = 24`` give two statements.

    ``rewrites``: also read a rewriting chain, ``7 * 8 + 9 = 56 + 9 = 65``, where the right-hand side of an
    ``=`` is the left's expression with sub-expressions replaced by their values. Read plainly its first
    ``=`` is the wrong claim ``7 * 8 + 9 = 56``; read as a rewrite it states ``7 * 8 = 56`` (`_rewritten`)."""
    found: list[Statement] = []
    line_start = 0
    for line in text.split("\n"):  # a statement never spans lines
        found += _statements_in(line, line_start, rewrites)
        line_start += len(line) + 1
    return found


MAX_REWRITTEN = 15  # tokens of one sub-expression a rewrite replaces by its value
_CONTINUATION_END = re.compile(r"[ \t.,;:!?]*$")


def _rewritten(line: str, offset: int, statement: Statement, lhs_end: int, rhs_start: int) -> list[Statement]:
    """The statements a rewrite ``E1 = E2`` makes, one per sub-expression of E1 that E2 writes as a number
    (``7 * 8 + 9 = 56 + 9``: ``7 * 8 = 56``); none unless E2 (the text up to the next ``=``) is E1 with
    each replaced span's exact value written in its place and E2's value is E1's, so a wrong value, a
    span taken against precedence (``2 + 3 * 4 = 5 * 4``) or prose after the numbers is not read as one."""
    following = line.find("=", rhs_start)
    continuation = line[rhs_start: following if following >= 0 else len(line)]
    continuation = continuation[: _CONTINUATION_END.search(continuation).start()]
    if len(continuation) > MAX_NESTING + MAX_LHS:  # bounded as a left-hand side is
        return []
    evaluated = evaluate(continuation)
    if evaluated is None or evaluated[0] != statement.exact:
        return []
    lhs_start = statement.span[0] - offset
    left, right = _spanned_tokens(line, lhs_start, lhs_end), _spanned_tokens(line, rhs_start, rhs_start + len(continuation))
    if left is None or right is None:
        return []
    found = []
    for i, k, j in _reductions(line, left, right) or []:
        start, end = left[i][1], left[k - 1][2]
        text = line[start:end]
        if text.startswith("(") and text.endswith(")") and evaluate(text[1:-1]) is not None:
            text = text[1:-1]  # (7 * 8) = 56 states 7 * 8 = 56
        exact, operands = evaluate(text)
        written_text = line[right[j][1]:right[j][2]]
        found.append(Statement(normalize_lhs(text), exact, right[j][0], written_text, True,
                               is_identity(right[j][0], operands), tuple(operands),
                               (offset + start, offset + right[j][2])))
    return found


def _spanned_tokens(line: str, start: int, end: int) -> list[tuple[str | Fraction, int, int]] | None:
    """The numbers and operators of ``line[start:end]`` (trailing space ignored), each with its span in ``line``;
    ``None`` where something else is written."""
    tokens, pos = [], start
    end = start + len(line[start:end].rstrip())
    while pos < end:
        match = _TOKEN.match(line, pos, end)
        if match is None:
            return None
        value = parse_number(match["num"]) if match["num"] is not None else _OPS.get(match["op"], match["op"])
        tokens.append((value, match.start("num") if match["num"] is not None else match.start("op"), match.end()))
        pos = match.end()
    return tokens


def _reductions(line: str, left: list, right: list) -> list[tuple[int, int, int]] | None:
    """Spans ``left[i:k]`` (tokens with their spans in ``line``) that ``right[j]`` replaces by their exact
    value, at least one, every other token equal; ``None`` if ``right`` is not ``left`` so rewritten."""
    values: dict[tuple[int, int], Fraction | None] = {}

    def value(i: int, k: int) -> Fraction | None:
        if (i, k) not in values:
            evaluated = evaluate(line[left[i][1]:left[k - 1][2]])
            values[i, k] = evaluated[0] if evaluated is not None else None
        return values[i, k]

    @functools.lru_cache(maxsize=None)
    def align(i: int, j: int) -> tuple[tuple[int, int, int], ...] | None:
        if i == len(left) or j == len(right):
            return () if i == len(left) and j == len(right) else None
        if left[i][0] == right[j][0]:
            rest = align(i + 1, j + 1)
            if rest is not None:
                return rest
        if isinstance(right[j][0], Fraction) and (isinstance(left[i][0], Fraction) or left[i][0] in "(-"):
            # a replaced span holds a binary operation, so three tokens at least; MAX_REWRITTEN at most
            for k in range(i + 3, min(len(left), i + MAX_REWRITTEN) + 1):
                if (isinstance(left[k - 1][0], Fraction) or left[k - 1][0] == ")") and value(i, k) == right[j][0]:
                    rest = align(k, j + 1)
                    if rest is not None:
                        return ((i, k, j), *rest)
        return None

    if len(right) >= len(left):  # nothing replaced: E2 restates E1 (or is longer), no step in it
        return None
    return list(align(0, 0) or ()) or None


def _statements_in(line: str, offset: int, rewrites: bool = False) -> list[Statement]:
    """The statements of one line, as searching ``_STATEMENT`` from the line's start, match after match, finds
    them; but each search is confined to the window before one "=" where a left-hand side ending there can
    start (it contains no "=" and is at most MAX_NESTING + MAX_LHS + 2 characters before its spaces). Over the
    whole line the search tried every start for up to MAX_LHS characters: seconds on a 25,000-digit line."""
    found: list[Statement] = []
    pos = 0
    equals = line.find("=")
    while equals >= 0:
        rhs = _RHS_AFTER_EQUALS.match(line, equals + 1)
        spaces = equals
        while spaces > 0 and line[spaces - 1] in " \t":
            spaces -= 1
        window = max(pos, spaces - MAX_NESTING - MAX_LHS - 2)
        match = _STATEMENT.search(line, window, rhs.end()) if rhs is not None and equals >= pos else None
        if match is not None:
            statement = _statement_at(match["lhs"], match["rhs"], (offset + match.start(), offset + match.end()))
            made = (_rewritten(line, offset, statement, match.end("lhs"), match.start("rhs"))
                    if rewrites and statement is not None and not statement.correct else [])
            found += made or ([statement] if statement is not None else [])
            pos = match.start("rhs")  # the right-hand side may start the next statement of a chain
        equals = line.find("=", equals + 1)
    return found
