"""Fuzzing every family's ``grade`` with adversarial completions (issue 27): whatever a policy writes, a
grade comes back, quickly, never an exception.

Each completion is built from: every unicode space, control, format, surrogate, private-use and unassigned
character; huge, tiny and malformed numbers; deeply nested brackets; many ANSWER / VERDICT lines; gigantic
lines; step lines with the sample's own keys; and the reference solution with odd characters spliced in.
The code families also get programs: for ``controller`` Structured Text generated from the subset's
grammar (and a corpus of hostile programs), for ``python_function`` a corpus of hostile programs (the
issue's findings and more) and functions returning generated values. Every grade must be a well-formed
`Grade` (outcome 0 or 1, score in [0, 1], one step per required step), its feedback clean (bounded, no
control, format or surrogate character) and it must take at most ``SLOW_S`` seconds of CPU (``HANG_S`` of
wall time).

Issue 50 added tool-call text (both protocols, custom tools: a clean, bounded result, quickly) and the
built-in answer readers (``accuracy`` never credits an answer other than the gold one, however it is hedged
or wherever else the gold number is written).

The bounded run is part of ``make test`` (derandomized: the same examples every run; about a minute of
one core). ``COHORTRL_FUZZ=25`` runs 25 times as many examples, drawn at random (docs/sandbox.md has the
command and its last result).
"""

from __future__ import annotations

import functools
import os
import re
import time
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cohortrl import tasks
from cohortrl.rewards import grader_errors
from cohortrl.rewards.functions import make_accuracy, make_format
from cohortrl.tasks import Grade

SCALE = os.environ.get("COHORTRL_FUZZ", "1")
if not SCALE.isdigit() or int(SCALE) < 1:
    raise ValueError(f"COHORTRL_FUZZ={SCALE!r}: set it to how many times the bounded run's examples to try, e.g. 25")
SCALE = int(SCALE)
# A grade costing more CPU than this (in this process: parsing, the step reading, ST interpretation) is a hang in
# the making. CPU time, not wall time: the long run at nice 19 behind a training job once took 10.6 s of wall
# time on a gsm8k text of the kind that costs 0.8 s of CPU at 100,000 characters (docs/sandbox.md). Wall time
# gets its own, looser bound, for what runs in the sandbox's processes (python_function's programs).
SLOW_S = 10.0
HANG_S = 60.0


def fuzz(examples: int):
    """Bounded and derandomized by default (the same examples every run); ``COHORTRL_FUZZ=N``: N times the
    examples, drawn at random."""
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=SCALE == 1, database=None,
                    suppress_health_check=list(HealthCheck))


@functools.lru_cache(maxsize=None)
def sample_of(name: str, level: int, index: int):
    return tasks.get(name).sample(index + 1, seed=7, level=level)[index]


def assert_clean(text: str | None) -> None:
    if text is None:
        return
    assert len(text) <= 600, len(text)
    text.encode("utf-8")
    assert not [c for c in text if c not in "\t\n" and unicodedata.category(c) in ("Cc", "Cf", "Cs")], repr(text[:200])


def check(family, sample, completion: str) -> Grade:
    start, wall = time.process_time(), time.perf_counter()
    grade = family.grade(sample, completion)
    elapsed, waited = time.process_time() - start, time.perf_counter() - wall
    assert isinstance(grade, Grade) and grade.outcome in (0.0, 1.0) and 0.0 <= grade.score <= 1.0
    assert [s.key for s in grade.steps] == [s.key for s in sample.steps]
    for step in [*grade.steps, *grade.stated]:
        assert_clean(step.written)
    assert elapsed < SLOW_S, f"{family.name} took {elapsed:.1f} s of CPU on {completion[:200]!r}"
    assert waited < HANG_S, f"{family.name} took {waited:.1f} s on {completion[:200]!r}"
    if family.name in ("arithmetic", "gsm8k"):  # their free-text statement reading (task_steps read=statements)
        for rewrites in (False, True):
            start = time.process_time()
            assert len(family.grade_statements(sample, completion, rewrites)) == len(sample.steps)
            elapsed = time.process_time() - start
            assert elapsed < SLOW_S, f"statements (rewrites={rewrites}) took {elapsed:.1f} s of CPU on {completion[:200]!r}"
    return grade


# ---------------------------------------------------------------------------------------------------------
# Adversarial text

ODD = st.characters(categories=("Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"))
ANY_CHAR = st.one_of(ODD, st.characters())
NUMBERS = st.one_of(
    st.integers().map(str),
    st.integers(-(10**400), 10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(allow_nan=False).map(lambda x: f"{x:,.3f}"),
    st.sampled_from(["1e999999999", "-1e-999999999", "9" * 5000, "0." + "0" * 400 + "1", "1e400", "1e-400", "-0",
                     "$1,234.50", "1,2,3", ".", "1.2.3", "1e", "+-1", "−5", "٣", "１２", "1_000", "0x1F", "1/3", "∞"]),
)
UNITS = st.one_of(st.sampled_from(["", "kN", "MPa", "mm^2", "kN*m", "m", "N", "%", "°C", "kN (compression)", "µm",
                                   "kN/m", "Pa", "mm", "kN·m"]), st.text(ANY_CHAR, max_size=5))
SEPARATORS = st.sampled_from(["\n", "\r\n", "\r", "\u2028", "\x85", "\n\n", " ", "\x0c", "\x0b"])


def lines(keys: list[str]):
    key = st.one_of(st.sampled_from(keys + ["ANSWER", "VERDICT", "x", "σ_max", "Δ"]), st.text(ANY_CHAR, max_size=10))
    value = st.one_of(NUMBERS, st.text(ANY_CHAR, max_size=20), st.sampled_from(["SAFE", "FAIL", "safe", "<12>", "(", ")"]))
    decoration = st.sampled_from(["", "**", "`", "- ", "1. ", "> ", "• ", "  "])
    step = st.tuples(decoration, key, st.sampled_from([" = ", "=", " := ", ": ", " = 2 * 3 = "]), value, st.sampled_from([" ", ""]), UNITS)
    answer = st.tuples(st.sampled_from(["ANSWER:", "answer :", "**ANSWER**:", "ANSWER: x =", "VERDICT:", "verdict: "]),
                       st.just(" "), value, st.just(" "), UNITS)
    op = st.sampled_from([" + ", " * ", " / ", " - ", " x ", "÷", "×"])
    statement = st.tuples(NUMBERS, op, NUMBERS, st.just(" = "), NUMBERS)
    chain = st.tuples(NUMBERS, op, NUMBERS, op, NUMBERS, st.just(" = "), NUMBERS, op, NUMBERS, st.just(" = "), NUMBERS)
    repeated = st.tuples(st.one_of(answer.map("".join), step.map("".join)), st.integers(2, 300)).map(lambda t: "\n".join([t[0]] * t[1]))
    nested = st.tuples(st.sampled_from(["(", "[", "{", "-", "((", "$("]), st.integers(1, 5000), st.sampled_from(["1 + 1", "2"]),
                       st.sampled_from([")", "]", ""]), st.sampled_from([" = 2", "", " = 2 = 2"]))
    nested = nested.map(lambda t: t[0] * t[1] + t[2] + t[3] * t[1] + t[4])
    gigantic = st.tuples(st.sampled_from(["1", " ", "x", "(", "=", "1+", "ANSWER: ", "\u00a0", "```", "F = 1 ", ",", "9."]),
                         st.integers(1000, 30000)).map(lambda t: t[0] * t[1])
    noise = st.text(ANY_CHAR, max_size=60)
    return st.one_of(step.map("".join), answer.map("".join), statement.map("".join), chain.map("".join), repeated, nested,
                     gigantic, noise)


def adversarial(keys: list[str]):
    return st.lists(st.tuples(lines(keys), SEPARATORS), max_size=10).map(lambda xs: "".join(a + b for a, b in xs))


@st.composite
def spliced(draw, text: str):
    """``text`` (a reference solution) with odd characters and strings inserted or written over it."""
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        piece = draw(st.one_of(ODD.map(str), st.text(ANY_CHAR, max_size=8), NUMBERS))
        cut = draw(st.integers(0, 3))
        text = text[:at] + piece + text[at + cut:]
    return text


# ---------------------------------------------------------------------------------------------------------
# The keyed families and GSM8K

KEYED = ["arithmetic", "axial_stress", "beam_bending", "truss", "gsm8k"]


@pytest.mark.parametrize("name", KEYED)
@fuzz(150)
@given(data=st.data())
def test_every_keyed_family_grades_any_text(name, data):
    family = tasks.get(name)
    sample = sample_of(name, data.draw(st.sampled_from(family.levels)), data.draw(st.integers(0, 3)))
    keys = [s.key for s in sample.steps] + [sample.target.key]
    completion = data.draw(st.one_of(adversarial(keys), spliced(sample.reference_solution)))
    check(family, sample, completion)


# ---------------------------------------------------------------------------------------------------------
# controller: Structured Text generated from the subset's grammar, and hostile programs

ST_LITERALS = st.one_of(
    st.sampled_from(["0.0", "1.0", "0.5", "1e308", "1.0E308", "1e-320", "2147483647", "2147483648", "0", "99999999999",
                     "9" * 400, "1" + "0" * 400 + ".0", "TRUE", "FALSE", "T#1s", "T#1s.s", "T#1.5m30s", "T#9999999d",
                     "T#" + "9" * 400 + "s", "TIME#250ms", "T#.5s", "T#1", "DT"]),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: repr(abs(x))),
)


def st_expressions(names: list[str]):
    atoms = st.one_of(ST_LITERALS, st.sampled_from(names), st.sampled_from(["t.Q", "t.ET", "r.Q", "s.Q1", "t.IN"]))

    def extend(inner):
        binary = st.tuples(inner, st.sampled_from([" + ", " - ", " * ", " / ", " MOD ", " ** ", " AND ", " OR ", " XOR ",
                                                   " = ", " <> ", " < ", " >= ", " & "]), inner).map("".join)
        unary = st.tuples(st.sampled_from(["-", "NOT ", "+"]), inner).map("".join)
        call = st.tuples(st.sampled_from(["ABS(", "SQRT(", "TRUNC(", "MIN(", "MAX(", "LIMIT(", "EXP(", "ABS(("]),
                         st.lists(inner, min_size=0, max_size=3).map(", ".join), st.just(")")).map("".join)
        return st.one_of(binary, unary, call, inner.map(lambda e: f"({e})"))

    return st.recursive(atoms, extend, max_leaves=12)


def st_programs(sample):
    from cohortrl.tasks.plants import PLANTS

    interface = PLANTS[sample.extra["plant"]].interface(sample.extra["params"])
    names = [v.name for v in interface] + ["x", "i", "b"]
    outputs = [v.name for v in interface if not v.input] + ["x", "i", "b", "t", "level"]
    expr = st_expressions(names)
    assign = st.tuples(st.sampled_from(outputs), st.just(" := "), expr, st.just(";")).map("".join)
    block = st.tuples(st.sampled_from(["t(IN := ", "r(CLK := ", "s(S1 := ", "t(PT := ", "t(Q := "]), expr, st.just(");")).map("".join)
    statement = st.recursive(st.one_of(assign, block, st.just(";")), lambda inner: st.tuples(
        st.just("IF "), expr, st.just(" THEN\n"), st.lists(inner, max_size=3).map("\n".join),
        st.sampled_from(["\nELSE\n", "\nELSIF TRUE THEN\n", "\n"]), st.lists(inner, max_size=2).map("\n".join),
        st.just("\nEND_IF;")).map("".join), max_leaves=8)
    decls = st.sampled_from(["", "VAR x : REAL; i : INT := 3; b : BOOL; t : TON; r : R_TRIG; s : SR; END_VAR\n",
                             "VAR x : REAL := 1e309; i : DINT := 2147483648; END_VAR\n", "VAR_INPUT level : REAL; END_VAR\n",
                             "PROGRAM p\nVAR x, i : REAL; END_VAR\n", "VAR t : TON; x : TIME := T#1s.s; END_VAR\n"])
    body = st.lists(statement, min_size=1, max_size=8).map("\n".join)
    fence = st.sampled_from([("```st\n", "\n```"), ("", ""), ("```\n", "\n```"), ("```st\n", ""), ("```python\n", "\n```")])
    return st.tuples(fence, decls, body).map(lambda t: t[0][0] + t[1] + t[2] + t[0][1])


HOSTILE_ST = {
    "T#1s.s": "VAR t : TON; END_VAR\nt(IN := TRUE, PT := T#1s.s);\npump := 0.5;",
    "no-break space": "pump\u00a0:= 0.5;",
    "em space": "pump :=\u20030.5;",
    "ideographic space and BOM": "\ufeffpump\u3000:= 0.5;",
    "NUL and bidi": "pump := 0.5;\x00\u202e",
    "lone surrogate": "pump := 0.5; (* \ud800 *)",
    "unclosed comment": "pump := 0.5; (* " + "x" * 5000,
    "deep IF": "IF TRUE THEN\n" * 900 + "pump := 0.5;\n" + "END_IF;\n" * 900,
    "deep parentheses": "pump := " + "(" * 5000 + "0.5" + ")" * 5000 + ";",
    "deep unary minus": "pump := " + "-" * 5000 + "0.5;",
    "long sum": "pump := 0.0" + " + 0.0" * 3000 + ";",
    "REAL overflow to inf": "pump := 1e308 * 10.0;",
    "NaN output": "pump := SQRT(-1.0);",
    "division by zero": "VAR i : INT; END_VAR\ni := 1 / 0;\npump := 0.5;",
    "INT overflow": "VAR i : INT := 2147483647; END_VAR\ni := i + 1;\npump := 0.5;",
    "TRUNC of huge": "VAR i : INT; END_VAR\ni := TRUNC(1e300);\npump := 0.5;",
    "power overflow": "pump := 10.0 ** 400.0;",
    "huge INT literal": "pump := " + "9" * 500 + ";",
    "huge TIME": "VAR t : TON; END_VAR\nt(IN := TRUE, PT := T#" + "9" * 400 + "d);\npump := 0.5;",
    "keyword as a name": "VAR if : REAL; END_VAR\npump := 0.5;",
    "FOR loop": "FOR i := 1 TO 10 DO\npump := 0.5;\nEND_FOR;",
    "unicode identifier": "VAR pümp : REAL; END_VAR\npump := 0.5;",
    "fullwidth digits": "pump := １.０;",
    "20,000 characters": "pump := 0.5;\n" * 1700,
    "only END_IF": "END_IF;" * 2000,
    "empty": "",
    "assign to input": "level := 1.0;\npump := 0.5;",
    "block member write": "VAR t : TON; END_VAR\nt.Q := TRUE;\npump := 0.5;",
    "many scans of work": "VAR x : REAL; END_VAR\n" + "x := x + SQRT(ABS(x) + 1.0);\n" * 300 + "pump := 0.5;",
}


def controller_sample(level: int = 1):
    return sample_of("controller", level, 0)


@pytest.mark.parametrize("name", list(HOSTILE_ST))
def test_controller_grades_each_hostile_program(name):
    family = tasks.get("controller")
    for level in (1, 4):
        grade = check(family, controller_sample(level), f"```st\n{HOSTILE_ST[name]}\n```")
        assert grade.outcome == 0.0


@fuzz(90)
@given(data=st.data())
def test_controller_grades_any_program_or_text(data):
    family = tasks.get("controller")
    sample = sample_of("controller", data.draw(st.sampled_from(family.levels)), 0)
    completion = data.draw(st.one_of(st_programs(sample), spliced(sample.reference_solution), adversarial(["pump"])))
    check(family, sample, completion)


# ---------------------------------------------------------------------------------------------------------
# python_function: hostile programs and generated return values

ESCAPE = "_os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close').__init__.__globals__\n"


def forged(result: str) -> str:
    return ESCAPE + f"def FUNC(*args):\n    _os['write'](3, {result})\n    _os['_exit'](0)\n"


HOSTILE_PY = {
    "int subclass, abs 0, 10**400": "class B(int):\n    def __abs__(self):\n        return 0\ndef FUNC(*a):\n    return B(10**400)\n",
    "str subclass equal to anything": "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\ndef FUNC(*a):\n    return S('x')\n",
    "float subclass with a raising repr": "class F(float):\n    def __repr__(self):\n        raise ValueError\ndef FUNC(*a):\n    return F(1.0)\n",
    "list subclass that lies": "class L(list):\n    def __iter__(self):\n        return iter([1e308] * 10**6)\n    def __len__(self):\n        raise ValueError\ndef FUNC(*a):\n    return L([1.0])\n",
    "tuple holding itself": "def FUNC(*a):\n    x = []\n    x.append(x)\n    return x\n",
    "nested 25 deep": "def FUNC(*a):\n    v = 1.0\n    for _ in range(25):\n        v = [v]\n    return v\n",
    "forged: calls not objects": forged("b'{\"calls\": [1, \"x\", null, [], 5, 6, 7, 8]}'"),
    "forged: value 1000 deep": forged("('{\"calls\": [' + ','.join(['{\"ok\": true, \"value\": ' + '[' * 1000 + ']' * 1000 + '}'] * 8) + ']}').encode()"),
    "forged: 400-digit integers": forged("('{\"calls\": [' + ','.join(['{\"ok\": true, \"value\": 1' + '0' * 400 + '}'] * 8) + ']}').encode()"),
    "forged: NaN and Infinity": forged("('{\"calls\": [' + ','.join(['{\"ok\": true, \"value\": NaN}', '{\"ok\": true, \"value\": -Infinity}'] * 4) + ']}').encode()"),
    "forged: ok is a string": forged("('{\"calls\": [' + ','.join(['{\"ok\": \"yes\", \"value\": 1}'] * 8) + ']}').encode()"),
    "forged: error not text": forged("('{\"calls\": [' + ','.join(['{\"ok\": false, \"error\": [1]}'] * 8) + ']}').encode()"),
    "forged: wrong number of calls": forged("b'{\"calls\": [{\"ok\": true, \"value\": 1}]}'"),
    "forged: lone surrogates": forged("('{\"calls\": [' + ','.join(['{\"ok\": true, \"value\": \"\\\\ud800\\\\u202e\"}'] * 8) + ']}').encode()"),
    "forged: invalid UTF-8": forged("b'{\"calls\": \\xff\\xfe}'"),
    "forged: deep JSON": forged("b'[' * 200000"),
    "forged: deep object": forged("b'{\"a\":' * 100000"),
    "forged: truncated": forged("b'{\"calls\": [{\"ok\": tr'"),
    "forged: result and a real one": ESCAPE + "def FUNC(*a):\n    _os['write'](3, b'{\"calls\": []}')\n    return 1.0\n",
    "forged: over a megabyte": forged("b'{\"error\": \"' + b'x' * 1100000 + b'\"}'"),
    "real-time signal": ESCAPE + ("def FUNC(*a):\n    libc = _os['sys'].modules['ctypes'].CDLL(None)\n"
                                  "    libc.fcntl(1, 8, _os['getpid']())\n    libc.fcntl(1, 10, 40)\n"
                                  "    libc.fcntl(1, 4, libc.fcntl(1, 3) | 0o20000)\n    _os['write'](1, b'x' * 60000)\n"
                                  "    _os['sys'].modules['time'].sleep(0.3)\n    return 1.0\n"),
    "huge exception message": "def FUNC(*a):\n    raise ValueError('x' * 900000)\n",
    "odd exception message": "def FUNC(*a):\n    raise ValueError('\\ud800\\u202e\\x00\\x1b[2J' * 50)\n",
    "exception whose str raises": "class E(Exception):\n    def __str__(self):\n        raise RuntimeError\ndef FUNC(*a):\n    raise E()\n",
    "SystemExit and KeyboardInterrupt": "def FUNC(*a):\n    raise KeyboardInterrupt\nraise SystemExit(3)\n",
    "GeneratorExit per call": "def FUNC(*a):\n    raise GeneratorExit\n",
    "exit 0 before the result": ESCAPE + "def FUNC(*a):\n    _os['_exit'](0)\n",
    "closes its result pipe": ESCAPE + "def FUNC(*a):\n    _os['close'](3)\n    return 1.0\n",
    "invalid UTF-8 on stdout": ESCAPE + "def FUNC(*a):\n    _os['write'](1, b'\\xff\\xfe\\x00\\x1b[2J')\n    return 1.0\n",
    "patches json in the child": "import json\njson.dumps = lambda *a, **k: '{\"calls\": 7}'\ndef FUNC(*a):\n    return 1.0\n",
    "patches the server's as_json": ESCAPE + "_os['sys'].modules['__main__'].as_json = lambda v, d=0: v\ndef FUNC(*a):\n    return object()\n",
    "returns odd types": "def FUNC(*a):\n    return [b'x', 1j, {1: 2}, {1, 2}, print, (i for i in ())]\n",
    "recursion": "def FUNC(*a):\n    return FUNC(*a)\n",
    "infinite loop": "def FUNC(*a):\n    while True:\n        pass\n",
    "memory": "def FUNC(*a):\n    return [0] * 10**10\n",
    "print flood": "def FUNC(*a):\n    print('x' * 10**6)\n",
    "fork bomb": ESCAPE + "def FUNC(*a):\n    while True:\n        _os['fork']()\n",
    "NUL in the source": "def FUNC(*a):\n    return 1.0\n\x00",
    "lone surrogate in the source": "def FUNC(*a):\n    return '\ud800'\n",
    "not a function": "FUNC = 5\n",
    "a class": "class FUNC:\n    pass\n",
    "syntax error": "def FUNC(*a) return\n",
}


def python_sample():
    return next(s for s in tasks.get("python_function").sample(20, seed=0, level=1) if s.extra["function"] == "axial_stress")


@pytest.mark.parametrize("name", list(HOSTILE_PY))
def test_python_function_grades_each_hostile_program(name):
    family = tasks.get("python_function", timeout_s=0.5)
    sample = python_sample()
    code = HOSTILE_PY[name].replace("FUNC", sample.extra["function"])
    grade = check(family, sample, f"```python\n{code}\n```")
    assert grade.outcome == 0.0


def python_literal(value) -> str:
    """Source text that evaluates to ``value`` (floats through float(), so nan and inf are literals too)."""
    if isinstance(value, float):
        return f"float({repr(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(python_literal(v) + ", " for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {python_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**330), 10**330), st.floats(),
              st.text(ANY_CHAR, max_size=30), st.sampled_from(["SAFE", "FAIL", "x" * 100000])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.text(ANY_CHAR, max_size=5), inner, max_size=3)),
    max_leaves=10,
)


@fuzz(60)
@given(data=st.data())
def test_python_function_grades_any_returned_value_or_text(data):
    family = tasks.get("python_function", timeout_s=0.5)
    sample = python_sample()
    name = sample.extra["function"]
    value = data.draw(VALUES)
    code = f"def {name}(*args):\n    return {python_literal(value)}\n"
    completion = data.draw(st.one_of(st.just(f"```python\n{code}```"), spliced(f"```python\n{code}```"),
                                     adversarial(["def ", "```python", "return"])))
    check(family, sample, completion)


# ---------------------------------------------------------------------------------------------------------
# The built-in reward functions that read text


@fuzz(150)
@given(completion=adversarial(["ANSWER"]), gold=st.one_of(NUMBERS, st.sampled_from(["5", "1/2", "\\frac{1}{2}", "x^2"])))
def test_accuracy_and_format_read_any_text_without_failing(completion, gold):
    grader_errors.drain()
    assert make_format()(["q"], [completion])[0] in (0.0, 1.0)
    assert make_accuracy(mode="last_number")(["q"], [completion], answer=[gold])[0] in (0.0, 1.0)
    assert grader_errors.drain() == []  # read, not a contained failure


@pytest.mark.parametrize("protocol", ["text", "chat"])
@fuzz(40)
@given(data=st.data())
def test_any_tool_call_text_gets_a_clean_bounded_result_quickly(protocol, data):
    """Issue 50: whatever a call holds (deep JSON, lone-surrogate escapes, huge integers, protocol tags, unknown
    or custom tools), the session answers it with one result turn of valid, bounded text that cannot close
    itself early, and decoding goes on."""
    from tests.rollout.test_tool_containment import answer, call_texts, result_of

    said = data.draw(call_texts(protocol))
    start = time.perf_counter()
    turn, session = answer(protocol, said)
    elapsed = time.perf_counter() - start
    result = result_of(protocol, turn)
    result.encode("utf-8")
    assert len(result) <= 1500  # MAX_RESULT_CHARS and the escaped tags
    assert not re.search(r"<\s*/?\s*(call|result|tool_call|tool_response)\s*>", result, re.IGNORECASE), result
    assert session.calls == [1]
    assert elapsed < SLOW_S, f"{elapsed:.1f} s on {said[:200]!r}"


# Where a reader must not find the answer: after the committed one (a hedge), inside a tool turn (the tool's
# text, closed or cut by the budget), or in a failed call's error text.
HEDGES = [" (not {x})", " ({x})", " or {x}", ", {x}", "-{x}", " \\text{ or } {x}", " (or {x} kN)", " and {x}"]
TOOL_TURNS = ["<call>echo: a</call><result>ANSWER: {x}</result>", "<call>echo: a</call><result>\nANSWER: {x}",
              '<tool_call>{"name": "echo", "arguments": {}}</tool_call><tool_response>ANSWER: {x}</tool_response>',
              '<tool_call>{}</tool_call><tool_response>\nANSWER: {x}',
              "<call>calculator: 1</call><result>error: the limit is {x}</result>"]
WRONG = st.one_of(st.integers(-10**6, 10**6).map(str), st.sampled_from([
    "9^9^9^9^9^9^9^9^9^9", "9^{9^{9^{9}}}", "10^{10^{10}}", "0/0", "\\frac{1}{0}", "(1, 2)", "x", "\\infty", "1e999", "nan"]))


@fuzz(120)
@given(gold=st.integers(-10**6, 10**6), wrong=WRONG, hedge=st.sampled_from(["", *HEDGES]),
       turn=st.sampled_from(["", *TOOL_TURNS]), before=adversarial(["ANSWER"]), order=st.booleans())
def test_the_answer_readers_never_credit_an_answer_other_than_the_gold_one(gold, wrong, hedge, turn, before, order):
    """Issue 50: ``accuracy`` (both modes) scores 0 whenever the model's one ANSWER line commits to something
    other than the gold answer, wherever else the gold number is written (in a trailing alternative, a tool
    result, an error text), and scores quickly, whatever the wrong answer costs to evaluate."""
    if "answer" in before.lower() or wrong.lstrip("-").isdigit() and int(wrong) == gold:
        return  # the drawn noise may commit by itself; the wrong answer must be wrong
    if hedge and not order and not any(c.isdigit() for c in wrong):
        return  # "ANSWER: 5 (not x)" offers no second number: a remark, and 5 is the answer
    x = str(gold)
    # the gold number offered after the wrong one, or the wrong one after the gold: either way a hedge
    answer = wrong + hedge.replace("{x}", x) if order or not hedge else x + hedge.replace("{x}", wrong)
    cut = turn.endswith("ANSWER: {x}")  # a result cut by the token budget ends the response
    turn = turn.replace("{x}", x)
    completion = f"{before}\nANSWER: {answer}\n{turn}" if cut else f"{before}\n{turn}\nANSWER: {answer}"
    start = time.process_time()
    grader_errors.drain()
    assert make_accuracy()(["q"], [completion], answer=[x]) == [0.0], completion[-300:]
    assert make_accuracy(mode="last_number")(["q"], [completion], answer=[x]) == [0.0], completion[-300:]
    assert grader_errors.drain() == []
    assert time.process_time() - start < SLOW_S, completion[-300:]
    # the same line with the gold answer alone is credited (the property is not vacuous)
    if not hedge:
        right = completion.replace(f"ANSWER: {answer}", f"ANSWER: {x}")
        assert make_accuracy()(["q"], [right], answer=[x]) == [1.0], right[-300:]
