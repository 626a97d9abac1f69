"""The Structured Text subset's grammar (IEC 61131-3, a small part of it) and its parser.

    PROGRAM name                              (optional, as is END_PROGRAM)
    VAR  x, y : REAL := 0.0;  t : TON;  END_VAR        persistent variables and function-block instances
    VAR_INPUT / VAR_OUTPUT ... END_VAR        may restate the interface the prompt gives (checked)
    x := expr;                                assignment
    IF c THEN ... ELSIF c THEN ... ELSE ... END_IF;
    t(IN := c, PT := T#2s);                   a function-block call
    (* comments *)  // comments

Expressions: OR, XOR, AND / &, = <>, < > <= >=, + -, * / MOD, ** (always REAL), unary - and NOT, literals
(12, 1.5, 2.5E-3, TRUE, FALSE, T#1m30s, T#250ms), variables, ``t.Q`` members, and the functions ABS, SQRT,
MIN, MAX, LIMIT, TRUNC. Keywords and names are case-insensitive. There are no loops, CASE, arrays,
pointers or user-defined blocks: outside this subset, a program fails with a message that says so.

Lark (LALR, so parsing is linear in the text) builds the tree; `cohortrl.tasks.st.interpreter` checks and
runs it. Model text never becomes Python.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedEOF, UnexpectedInput, UnexpectedToken

GRAMMAR = r"""
start: program_head? var_block* stmt* program_tail?
program_head: "PROGRAM"i NAME ";"?
program_tail: "END_PROGRAM"i ";"?

var_block: VAR_KIND decl* "END_VAR"i ";"?
VAR_KIND.2: /VAR(_INPUT|_OUTPUT)?\b/i
decl: NAME ("," NAME)* ":" NAME (":=" expr)? ";"

?stmt: assign | if_stmt | fb_call | empty
assign: NAME ":=" expr ";"
fb_call: NAME "(" [arg ("," arg)*] ")" ";"
arg: NAME ":=" expr
if_stmt: "IF"i expr "THEN"i body elsif* else_part? "END_IF"i ";"
elsif: "ELSIF"i expr "THEN"i body
else_part: "ELSE"i body
body: stmt*
empty: ";"

?expr: or_expr
?or_expr: xor_expr | or_expr "OR"i xor_expr -> or_
?xor_expr: and_expr | xor_expr "XOR"i and_expr -> xor
?and_expr: eq_expr | and_expr ("AND"i | "&") eq_expr -> and_
?eq_expr: rel_expr | eq_expr EQ_OP rel_expr -> compare
?rel_expr: add_expr | rel_expr REL_OP add_expr -> compare
?add_expr: mul_expr | add_expr ADD_OP mul_expr -> arith
?mul_expr: unary | mul_expr MUL_OP unary -> arith
?unary: power | "-" unary -> neg | "+" unary | "NOT"i unary -> not_
?power: atom | atom POW unary -> pow
?atom: NUMBER -> number
     | TIME -> time
     | TRUE -> true
     | FALSE -> false
     | NAME -> var
     | NAME "." NAME -> member
     | NAME "(" [expr ("," expr)*] ")" -> call
     | "(" expr ")"

POW.3: "**"
EQ_OP.2: "<>" | "="
REL_OP: "<=" | ">=" | "<" | ">"
ADD_OP: "+" | "-"
MUL_OP: "*" | "/" | /MOD\b/i
TRUE.2: /TRUE\b/i
FALSE.2: /FALSE\b/i
TIME.2: /(T|TIME)#[0-9][0-9._a-z]*/i
NUMBER: /[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/
NAME: /[A-Za-z_][A-Za-z0-9_]*/

COMMENT: /\(\*(.|\n)*?\*\)/ | /\/\/[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""

# Words a model may reach for that this subset does not have: named in the error instead of "unexpected".
UNSUPPORTED = {
    "WHILE": "WHILE loops", "FOR": "FOR loops", "REPEAT": "REPEAT loops", "CASE": "CASE statements",
    "FUNCTION_BLOCK": "user-defined function blocks", "FUNCTION": "user-defined functions", "ARRAY": "arrays",
    "POINTER": "pointers", "REF_TO": "references", "STRUCT": "structures", "RETURN": "RETURN",
    "EXIT": "EXIT", "JMP": "jumps", "VAR_TEMP": "VAR_TEMP", "VAR_IN_OUT": "VAR_IN_OUT",
    "VAR_GLOBAL": "VAR_GLOBAL", "VAR_EXTERNAL": "VAR_EXTERNAL", "CONSTANT": "VAR CONSTANT", "RETAIN": "RETAIN",
}
# Names that are keywords of the subset: they may not be used as variables.
KEYWORDS = {"IF", "THEN", "ELSIF", "ELSE", "END_IF", "VAR", "VAR_INPUT", "VAR_OUTPUT", "END_VAR", "PROGRAM",
            "END_PROGRAM", "AND", "OR", "XOR", "NOT", "MOD", "TRUE", "FALSE"}
MAX_SOURCE_CHARS = 20_000


class STError(ValueError):
    """A program outside the subset, or wrong: the message says where and why, for the model to read."""


@lru_cache(maxsize=1)
def parser() -> Lark:
    """Built once per process (~0.1 s); parses in linear time."""
    return Lark(GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=False)


def parse(text: str) -> Tree:
    if len(text) > MAX_SOURCE_CHARS:
        raise STError(f"the program is longer than {MAX_SOURCE_CHARS} characters")
    if not text.strip():
        raise STError("the program is empty")
    try:
        return parser().parse(text)
    except UnexpectedInput as e:
        raise STError(_explain(text, e)) from None
    except RecursionError:
        raise STError("the program is nested too deeply") from None


def _explain(text: str, e: UnexpectedInput) -> str:
    lines = text.split("\n")  # as lark counts lines (splitlines would also split at \x0c, \x85, U+2028, ...)
    line_no = e.line if isinstance(getattr(e, "line", None), int) and e.line > 0 else len(lines)
    where = f"line {line_no}, column {e.column}" if isinstance(getattr(e, "column", None), int) else f"line {line_no}"
    # Name a construct outside the subset if the failing line (or the one before) reaches for one.
    for line in lines[max(0, line_no - 2):line_no]:
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", line):
            if word.upper() in UNSUPPORTED:
                return f"{where}: {UNSUPPORTED[word.upper()]}: not in the supported Structured Text subset"
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        return f"{where}: the program ends too early (a missing END_IF, ';' or ')'?)"
    if isinstance(e, UnexpectedToken):
        word = str(e.token)
    else:
        pos = e.pos_in_stream if isinstance(getattr(e, "pos_in_stream", None), int) else len(text)
        name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[pos:])
        word = name.group(0) if name else text[pos : pos + 1]
    source = lines[line_no - 1].strip()[:120] if 0 < line_no <= len(lines) else ""
    if len(word) == 1 and (word.isspace() or not word.isprintable()):
        # A no-break or em space pasted from a document: invisible in the message unless named.
        what = unicodedata.name(word, "a control character")
        return (f"{where}: unexpected character U+{ord(word):04X} ({what}) in {source!r}; write programs with "
                "plain spaces, tabs and newlines")
    hint = ""
    if word == ".":
        hint = " (only variables can be assigned; set a function block's inputs in its call: t(IN := x);)"
    elif word.upper() in KEYWORDS:
        hint = f" ({word.upper()} is a keyword)"
    return f"{where}: unexpected {word[:40]!r} in {source!r}{hint}"


def position(node: Tree | Token) -> str:
    line = getattr(node, "line", None) if isinstance(node, Token) else getattr(node.meta, "line", None)
    return f"line {line}" if line else "somewhere"
