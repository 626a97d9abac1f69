"""The built-in ``calculator`` tool: a small expression language, parsed and evaluated here, never by ``eval``.

The model's text is untrusted, so nothing of Python is reachable from it: the grammar below is all there is.

    expression := sum
    sum        := product (("+" | "-") product)*
    product    := unary (("*" | "/") unary)*
    unary      := "-" unary | "+" unary | power
    power      := atom (("^" | "**") unary)?        right-associative: 2^3^2 = 2^9
    atom       := number | constant | function "(" sum ("," sum)* ")" | "(" sum ")"

Numbers may use decimals and scientific notation (``1.5e3``, ``.5``). Constants: ``pi``, ``e``. Functions of one
argument: ``sqrt``, ``sin cos tan asin acos atan`` (radians), ``log`` and ``ln`` (natural), ``log10``, ``exp``,
``abs``; of one or more: ``min``, ``max`` (the gym's buckling check writes ``SF = min(2.903, 1.003)``).
``×``, ``÷`` and ``−`` are read as ``*``, ``/`` and ``-``. As in mathematics, ``-2^2`` is -4.

Arithmetic is in floats, so a power can never build a huge integer; a result that does not fit a float,
a division by zero or a function outside its domain is an error. Inputs are bounded in length and in
parenthesis depth, so the recursive parser cannot exhaust the stack. Every failure is a
:class:`CalculatorError` whose message says what was wrong; the tool runner hands it to the model as text.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from cohortrl.tools.errors import ToolError

MAX_LENGTH = 300  # characters of one expression: any gym step's expression is far shorter
MAX_DEPTH = 32  # nested parentheses / unary signs; each level costs a few Python stack frames

CONSTANTS = {"pi": math.pi, "e": math.e}
FUNCTIONS = {
    "sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos,
    "atan": math.atan, "log": math.log, "ln": math.log, "log10": math.log10, "exp": math.exp, "abs": abs,
    "min": min, "max": max,
}
VARIADIC = {"min", "max"}
_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>\*\*|[-+*/^(),]))")
_ALIASES = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class CalculatorError(ToolError):
    """The expression could not be evaluated; the message says why."""


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; kind is ``num``, ``name`` or ``op``."""
    out, pos, text = [], 0, text.translate(_ALIASES).rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise CalculatorError(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        kind = match.lastgroup
        out.append((kind, match[kind]))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.pos += 1
        return token

    def nested(self, parse):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested more than {MAX_DEPTH} levels deep")
        try:
            return parse()
        finally:
            self.depth -= 1

    def sum(self) -> float:
        value = self.product()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            rhs = self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self) -> float:
        value = self.unary()
        while self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()[1]
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise CalculatorError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def unary(self) -> float:
        if self.peek() in (("op", "-"), ("op", "+")):
            sign = -1.0 if self.take()[1] == "-" else 1.0
            return sign * self.nested(self.unary)
        return self.power()

    def power(self) -> float:
        base = self.atom()
        if self.peek() in (("op", "^"), ("op", "**")):
            self.take()
            exponent = self.nested(self.unary)
            try:
                result = math.pow(base, exponent)
            except OverflowError:
                raise CalculatorError(f"{_short(base)}^{_short(exponent)} is too large") from None
            except ValueError:
                raise CalculatorError(f"{_short(base)}^{_short(exponent)} is not a real number") from None
            return result
        return base

    def atom(self) -> float:
        kind, text = self.take()
        if kind == "num":
            return float(text)
        if kind == "name":
            if text in CONSTANTS:
                return CONSTANTS[text]
            if text not in FUNCTIONS:
                known = ", ".join([*CONSTANTS, *FUNCTIONS])
                raise CalculatorError(f"unknown name {text!r} (known: {known})")
            if self.take() != ("op", "("):
                raise CalculatorError(f"{text} needs parentheses: {text}(...)")
            arguments = [self.nested(self.sum)]
            while self.peek() == ("op", ","):
                self.take()
                arguments.append(self.nested(self.sum))
            self.close()
            if len(arguments) > 1 and text not in VARIADIC:
                raise CalculatorError(f"{text} takes one argument, not {len(arguments)}")
            try:
                return float(FUNCTIONS[text](*arguments))
            except (ValueError, OverflowError):
                raise CalculatorError(f"{text}({', '.join(map(_short, arguments))}) is undefined") from None
        if (kind, text) == ("op", "("):
            value = self.nested(self.sum)
            self.close()
            return value
        raise CalculatorError(f"unexpected {text!r}")

    def close(self) -> None:
        if self.peek() != ("op", ")"):
            raise CalculatorError("a '(' is not closed")
        self.take()


def _short(x: float) -> str:
    return format(x, ".6g")


def evaluate(expression: str) -> float:
    """The value of ``expression`` (grammar: module docstring); raises :class:`CalculatorError`.

    >>> round(evaluate("pi*19^2/4"), 3)
    283.529
    """
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is {len(expression)} characters long; the limit is {MAX_LENGTH}")
    tokens = _tokens(expression)
    if not tokens:
        raise CalculatorError("the expression is empty")
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()[1]!r} after a complete expression")
    if not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_value(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant figures, as the gym's reference solutions write numbers: a plain decimal
    (``349900000``, ``0.001235``) unless that would be very long, then scientific (``1.235e+20``)."""
    if x == 0:
        return "0"
    rounded = f"{x:.{digits}g}"
    if not 1e-4 <= abs(x) < 1e15:
        return rounded
    text = format(Decimal(rounded), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value to 4 significant figures.

    Args:
        expression: numbers, + - * / ^ and parentheses, the constants pi and e, and the functions sqrt, sin, cos,
            tan, asin, acos, atan (radians), log and ln (natural), log10, exp, abs, min and max (of several
            arguments, separated by commas); for example pi*19^2/4
    """
    return format_value(evaluate(expression))
