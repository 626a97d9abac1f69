"""Checking and running a Structured Text program (grammar: `cohortrl.tasks.st.syntax`).

`compile_program(text, interface)` parses the text, checks it against the controller's interface (names,
types, which variables are inputs) and turns the tree into nested closures of our own operations, so a
scan costs a few microseconds. Model text never becomes Python source: each node is one of a fixed set
of closures built here.

Semantics (IEC 61131-3, the parts the subset has):
- Types: BOOL; INT (also DINT, SINT, LINT, UINT, UDINT: one 32-bit signed range, overflow is an error);
  REAL (also LREAL); TIME is REAL seconds (``T#1m30s`` = 90.0). INT widens to REAL; REAL never narrows
  silently (``TRUNC(x)``). INT / INT truncates toward zero; MOD takes the sign of the dividend.
  REAL / 0 gives ±inf or NaN, as PLCs do; a controller that writes such a value to an output fails.
- Variables declared in VAR keep their values from scan to scan (a PLC's persistent memory) and start at
  their initial value (or 0 / FALSE) when a scenario starts. Inputs are read-only; outputs keep their last
  value when a scan does not assign them.
- Function blocks (instances declared in VAR): ``TON`` (IN, PT → Q, ET: Q once IN has been TRUE for PT
  seconds of simulated time), ``R_TRIG`` (CLK → Q: TRUE for one scan on a rising edge), ``SR`` (S1, R →
  Q1: set-dominant latch). Inputs not given in a call keep their previous values.
- Functions: ABS, SQRT (NaN below 0), MIN, MAX (two or more arguments), LIMIT(MN, IN, MX), TRUNC (REAL → INT).
- Bounded work: the subset has no loops or recursion, so one scan evaluates each node at most once;
  programs over ``max_nodes`` nodes, with expressions nested deeper than `MAX_DEPTH` or IF statements
  deeper than `MAX_NESTING`, are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from lark import Token, Tree

from cohortrl.tasks.st.syntax import KEYWORDS, STError, parse, position

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
# Compiling an expression level takes up to 3 Python frames and running it 1-2, an IF level 4 and 1: at
# these limits a program needs at most ~260 frames whatever it is, far inside Python's limit of 1000 even
# when grading is itself called deep in a stack, so whether a program is accepted never depends on the caller.
MAX_DEPTH = 64  # expression nesting
MAX_NESTING = 16  # IF statements inside IF statements
TYPE_NAMES = {"BOOL": "BOOL", "REAL": "REAL", "LREAL": "REAL", "TIME": "REAL", "INT": "INT", "DINT": "INT",
              "SINT": "INT", "LINT": "INT", "UINT": "INT", "UDINT": "INT"}
# Function blocks: member -> (type, is an input). Internal state lives in extra slots.
BLOCKS = {
    "TON": {"IN": ("BOOL", True), "PT": ("REAL", True), "Q": ("BOOL", False), "ET": ("REAL", False)},
    "R_TRIG": {"CLK": ("BOOL", True), "Q": ("BOOL", False)},
    "SR": {"S1": ("BOOL", True), "R": ("BOOL", True), "Q1": ("BOOL", False)},
}
BLOCK_STATE = {"TON": "start", "R_TRIG": "m", "SR": None}  # hidden member: TON's start time, R_TRIG's memory


class STRuntimeError(STError):
    """An error while a scan runs (INT overflow, INT division by zero, TRUNC of NaN)."""


@dataclass(frozen=True)
class Var:
    """One variable of the controller's interface, as the prompt states it."""

    name: str
    type: str  # "REAL", "BOOL" or "INT"
    input: bool  # True: the plant writes it before every scan; False: an output the program writes
    unit: str = ""
    help: str = ""


Thunk = Callable[[], object]


class Program:
    """A compiled program: `reset` at the start of a scenario, then `scan` once per scan period."""

    def __init__(self, memory: list, clock: list, statements: list, inputs: list[int], outputs: list[int],
                 initial: list, nodes: int) -> None:
        self._memory, self._clock, self._statements = memory, clock, statements
        self._inputs, self._outputs, self._initial = inputs, outputs, initial
        self.nodes = nodes  # an upper bound on the operations one scan performs

    def reset(self) -> None:
        self._memory[:] = self._initial

    def scan(self, inputs: Sequence, now: float) -> list:
        """Write ``inputs`` (in interface order), run one scan at simulated time ``now`` (seconds), and
        return the outputs (in interface order)."""
        memory = self._memory
        for slot, value in zip(self._inputs, inputs):
            memory[slot] = value
        self._clock[0] = now
        for statement in self._statements:
            statement()
        return [memory[slot] for slot in self._outputs]


def compile_program(text: str, interface: Sequence[Var], max_nodes: int = 2000) -> Program:
    """Parse and check ``text`` against ``interface``; raises `STError` with a message for the model."""
    return _Compiler(interface, max_nodes).program(parse(text))


class _Compiler:
    def __init__(self, interface: Sequence[Var], max_nodes: int) -> None:
        self.memory: list = []
        self.clock = [0.0]
        self.slots: dict[str, tuple[int, str]] = {}  # lower-case name -> (slot, type or block name)
        self.spelling: dict[str, str] = {}
        self.inputs = {v.name.lower() for v in interface if v.input}
        self.interface = {v.name.lower(): v for v in interface}
        self.assigned: set[str] = set()
        self.nodes = 0
        self.max_nodes = max_nodes
        self.nesting = 0  # IF statements open around the one being compiled
        for var in interface:
            self.declare(var.name, var.type, None)

    # -- declarations ------------------------------------------------------------------------------------
    def declare(self, name: str, type_name: str, where) -> None:
        key = name.lower()
        if key.upper() in KEYWORDS:
            raise STError(f"{position(where)}: {name!r} is a keyword and cannot be a variable name")
        if key in self.slots:
            raise STError(f"{position(where)}: {name!r} is declared twice")
        self.spelling[key] = name
        if type_name in BLOCKS:
            self.slots[key] = (len(self.memory), type_name)
            for member, (member_type, _) in BLOCKS[type_name].items():
                self.slots[f"{key}.{member.lower()}"] = (len(self.memory), member_type)
                self.memory.append(False if member_type == "BOOL" else 0.0)
            if BLOCK_STATE[type_name]:
                self.slots[f"{key}.#{BLOCK_STATE[type_name]}"] = (len(self.memory), "REAL")
                self.memory.append(-1.0 if type_name == "TON" else False)
            return
        self.slots[key] = (len(self.memory), type_name)
        self.memory.append(False if type_name == "BOOL" else 0.0 if type_name == "REAL" else 0)

    def var_block(self, block: Tree) -> None:
        kind = str(block.children[0]).upper()
        for decl in block.children[1:]:
            *names, type_token = [c for c in decl.children if isinstance(c, Token)]
            init = next((c for c in decl.children if isinstance(c, Tree)), None)
            type_name = type_token.upper()
            if type_name not in BLOCKS and type_name not in TYPE_NAMES:
                raise STError(f"{position(type_token)}: type {str(type_token)!r} is not in the subset "
                              f"(types: BOOL, INT, DINT, REAL, LREAL, TIME; blocks: TON, R_TRIG, SR)")
            for name in names:
                if kind == "VAR":
                    self.declare(str(name), TYPE_NAMES.get(type_name, type_name), name)
                else:
                    self.restate(str(name), kind, TYPE_NAMES.get(type_name, type_name), name)
                if init is not None:
                    self.initialise(name, init)

    def restate(self, name: str, kind: str, type_name: str, where) -> None:
        """VAR_INPUT / VAR_OUTPUT may repeat the interface; they must agree with it."""
        var = self.interface.get(name.lower())
        wanted_input = kind == "VAR_INPUT"
        if var is None or var.input != wanted_input:
            which = "input" if wanted_input else "output"
            raise STError(f"{position(where)}: {name!r} is not an {which} of this controller "
                          f"(the interface is given in the task)")
        if var.type != type_name:
            raise STError(f"{position(where)}: {name!r} is {var.type} in the interface, not {type_name}")

    def initialise(self, name: Token, init: Tree) -> None:
        key = str(name).lower()
        slot, type_name = self.slots[key]
        if key in self.inputs or type_name in BLOCKS:
            raise STError(f"{position(name)}: {str(name)!r} cannot have an initial value")
        value_fn, value_type = self.expr(init, 0)
        if self.reads:
            raise STError(f"{position(name)}: the initial value of {str(name)!r} must be a constant")
        self.check_assignable(str(name), type_name, value_type, name)
        value = value_fn()
        self.memory[slot] = float(value) if type_name == "REAL" else value

    # -- the program -------------------------------------------------------------------------------------
    def program(self, tree: Tree) -> Program:
        statements = []
        try:
            for child in tree.children:
                if child.data == "var_block":
                    self.var_block(child)
                elif child.data not in ("program_head", "program_tail"):
                    statements.extend(self.statement(child))
        except RecursionError:
            raise STError("the program is nested too deeply") from None
        for var in self.interface.values():
            if not var.input and var.name.lower() not in self.assigned:
                raise STError(f"the program never assigns the output {var.name!r}")
        if self.nodes > self.max_nodes:
            raise STError(f"the program has {self.nodes} operations; at most {self.max_nodes} per scan are allowed")
        inputs = [self.slots[v.name.lower()][0] for v in self.interface.values() if v.input]
        outputs = [self.slots[v.name.lower()][0] for v in self.interface.values() if not v.input]
        initial = list(self.memory)
        return Program(self.memory, self.clock, statements, inputs, outputs, initial, self.nodes)

    def statement(self, node: Tree) -> list[Thunk]:
        self.nodes += 1
        if node.data == "empty":
            return []
        if node.data == "assign":
            return [self.assign(node.children[0], node.children[1])]
        if node.data == "if_stmt":
            return [self.if_statement(node)]
        if node.data == "fb_call":
            return [self.block_call(node)]
        raise STError(f"{position(node)}: {node.data} is not in the subset")

    def body(self, node: Tree) -> list[Thunk]:
        return [s for child in node.children for s in self.statement(child)]

    def assign(self, name: Token, expr: Tree) -> Thunk:
        key = str(name).lower()
        if key not in self.slots:
            raise STError(f"{position(name)}: {str(name)!r} is not declared (declare it in VAR ... END_VAR)")
        slot, type_name = self.slots[key]
        if key in self.inputs:
            raise STError(f"{position(name)}: {str(name)!r} is an input; inputs cannot be assigned")
        if type_name in BLOCKS:
            raise STError(f"{position(name)}: {str(name)!r} is a {type_name}; call it, e.g. {name}(IN := ...);")
        value, value_type = self.expr(expr, 0)
        self.check_assignable(str(name), type_name, value_type, name)
        self.assigned.add(key)
        memory = self.memory
        if type_name == "REAL":
            def run() -> None:
                memory[slot] = float(value())
        else:
            def run() -> None:
                memory[slot] = value()
        return run

    @staticmethod
    def check_assignable(name: str, target: str, source: str, where) -> None:
        if target == source or (target == "REAL" and source == "INT"):
            return
        hint = "; use TRUNC(...)" if (target, source) == ("INT", "REAL") else ""
        article = "an" if source == "INT" else "a"
        raise STError(f"{position(where)}: cannot assign {article} {source} value to {target} variable {name!r}{hint}")

    def if_statement(self, node: Tree) -> Thunk:
        if self.nesting >= MAX_NESTING:
            raise STError(f"{position(node)}: IF statements are nested more than {MAX_NESTING} deep")
        self.nesting += 1
        branches: list[tuple[Thunk, list[Thunk]]] = []
        condition, body, *rest = node.children
        branches.append((self.condition(condition), self.body(body)))
        otherwise: list[Thunk] = []
        for part in rest:
            if part.data == "elsif":
                branches.append((self.condition(part.children[0]), self.body(part.children[1])))
            else:
                otherwise = self.body(part.children[0])
        self.nesting -= 1

        def run() -> None:
            for test, statements in branches:
                if test():
                    for statement in statements:
                        statement()
                    return
            for statement in otherwise:
                statement()

        return run

    def condition(self, node: Tree) -> Thunk:
        fn, type_name = self.expr(node, 0)
        if type_name != "BOOL":
            raise STError(f"{position(node)}: a condition must be BOOL, not {type_name}")
        return fn

    def block_call(self, node: Tree) -> Thunk:
        name, *args = node.children
        key = str(name).lower()
        block = self.slots.get(key, (0, ""))[1]
        if block not in BLOCKS:
            raise STError(f"{position(name)}: {str(name)!r} is not a function-block instance (declare e.g. "
                          f"{name} : TON; in VAR ... END_VAR)")
        members = BLOCKS[block]
        setters = []
        given = set()
        for arg in (a for a in args if a is not None):
            member, expr = arg.children
            member_key = str(member).upper()
            if member_key not in members or not members[member_key][1]:
                inputs = ", ".join(m for m, (_, is_input) in members.items() if is_input)
                raise STError(f"{position(member)}: {block} has no input {str(member)!r} (inputs: {inputs})")
            if member_key in given:
                raise STError(f"{position(member)}: {str(member)!r} is given twice")
            given.add(member_key)
            value, value_type = self.expr(expr, 0)
            slot, member_type = self.slots[f"{key}.{member_key.lower()}"]
            self.check_assignable(f"{name}.{member}", member_type, value_type, member)
            setters.append((slot, value))
        update = self.block_update(block, key)
        memory = self.memory

        def run() -> None:
            for slot, value in setters:
                memory[slot] = value()
            update()

        return run

    def block_update(self, block: str, key: str) -> Thunk:
        memory, clock = self.memory, self.clock
        slot = lambda member: self.slots[f"{key}.{member}"][0]  # noqa: E731
        if block == "TON":
            IN, PT, Q, ET, START = slot("in"), slot("pt"), slot("q"), slot("et"), slot("#start")

            def ton() -> None:
                if not memory[IN]:
                    memory[START], memory[ET], memory[Q] = -1.0, 0.0, False
                    return
                if memory[START] < 0:
                    memory[START] = clock[0]
                elapsed = clock[0] - memory[START]
                # 1e-9 s: scan times accumulate in floating point; a whole number of scans must count.
                done = elapsed >= memory[PT] - 1e-9
                memory[Q], memory[ET] = done, min(elapsed, memory[PT]) if done else elapsed

            return ton
        if block == "R_TRIG":
            CLK, Q, M = slot("clk"), slot("q"), slot("#m")

            def r_trig() -> None:
                clk = bool(memory[CLK])
                memory[Q], memory[M] = clk and not memory[M], clk

            return r_trig
        S1, R, Q1 = slot("s1"), slot("r"), slot("q1")

        def sr() -> None:
            memory[Q1] = bool(memory[S1] or (not memory[R] and memory[Q1]))

        return sr

    # -- expressions -------------------------------------------------------------------------------------
    def expr(self, node: Tree | Token, depth: int) -> tuple[Thunk, str]:
        """(closure, type) for an expression; ``self.reads`` tells whether it read any variable."""
        if depth == 0:
            self.reads = False
        if depth > MAX_DEPTH:
            raise STError(f"{position(node)}: an expression is nested more than {MAX_DEPTH} deep")
        self.nodes += 1
        kind = node.data
        if kind == "number":
            return self.number(node.children[0])
        if kind == "time":
            seconds = parse_time(str(node.children[0]), node)
            return (lambda: seconds), "REAL"
        if kind in ("true", "false"):
            value = kind == "true"
            return (lambda: value), "BOOL"
        if kind == "var":
            return self.read(node.children[0])
        if kind == "member":
            return self.read_member(*node.children)
        if kind == "call":
            return self.call(node, depth)
        operands = [c for c in node.children if isinstance(c, Tree)]
        ops = [str(c) for c in node.children if isinstance(c, Token)]
        parts = [self.expr(c, depth + 1) for c in operands]
        if kind == "neg":
            (a, t), = parts
            self.need_number(t, "-", node)
            if t == "INT":  # -INT_MIN does not fit: an overflow like any other
                where = position(node)
                return (lambda: checked_int(-a(), where)), t
            return (lambda: -a()), t
        if kind == "not_":
            (a, t), = parts
            if t != "BOOL":
                raise STError(f"{position(node)}: NOT needs a BOOL, not {t}")
            return (lambda: not a()), "BOOL"
        if kind in ("and_", "or_", "xor"):
            return self.logic(kind, parts, node)
        if kind == "compare":
            return self.compare(ops[0], parts, node)
        if kind == "arith":
            return self.arith(ops[0].upper(), parts, node)
        if kind == "pow":
            (a, ta), (b, tb) = parts
            self.need_number(ta, "**", node)
            self.need_number(tb, "**", node)
            return (lambda: real_pow(a(), b())), "REAL"
        raise STError(f"{position(node)}: {kind} is not in the subset")

    def number(self, token: Token) -> tuple[Thunk, str]:
        text = str(token)
        if any(c in text for c in ".eE"):
            value = float(text)
            if not math.isfinite(value):
                raise STError(f"{position(token)}: {text[:20]} does not fit in a REAL")
            return (lambda: value), "REAL"
        if len(text.lstrip("0")) > 10 or int(text) > INT_MAX:  # length first: int() of 5000 digits refuses
            raise STError(f"{position(token)}: {text[:20]} does not fit in an INT; write {text[:20]}.0 for a REAL")
        value = int(text)
        return (lambda: value), "INT"

    def read(self, name: Token) -> tuple[Thunk, str]:
        key = str(name).lower()
        if key not in self.slots:
            raise STError(f"{position(name)}: {str(name)!r} is not declared (declare it in VAR ... END_VAR)")
        slot, type_name = self.slots[key]
        if type_name in BLOCKS:
            members = ", ".join(m for m, (_, is_input) in BLOCKS[type_name].items() if not is_input)
            raise STError(f"{position(name)}: {str(name)!r} is a {type_name}; read its outputs ({members}) as {name}.Q")
        self.reads = True
        memory = self.memory
        return (lambda: memory[slot]), type_name

    def read_member(self, name: Token, member: Token) -> tuple[Thunk, str]:
        key = str(name).lower()
        block = self.slots.get(key, (0, ""))[1]
        if block not in BLOCKS:
            raise STError(f"{position(name)}: {str(name)!r} is not a function-block instance, so {name}.{member} means nothing")
        if str(member).upper() not in BLOCKS[block]:
            raise STError(f"{position(member)}: {block} has no member {str(member)!r} (members: {', '.join(BLOCKS[block])})")
        slot, type_name = self.slots[f"{key}.{str(member).lower()}"]
        self.reads = True
        memory = self.memory
        return (lambda: memory[slot]), type_name

    def call(self, node: Tree, depth: int) -> tuple[Thunk, str]:
        name, *args = node.children
        function = str(name).upper()
        parts = [self.expr(a, depth + 1) for a in args if a is not None]
        fns = [fn for fn, _ in parts]
        types = [t for _, t in parts]
        for t in types:
            self.need_number(t, function, node)
        result = "INT" if all(t == "INT" for t in types) else "REAL"
        if function in ("ABS", "SQRT", "TRUNC") and len(parts) != 1:
            raise STError(f"{position(node)}: {function} takes one argument, not {len(parts)}")
        if function == "ABS":
            a, = fns
            if types[0] == "INT":  # ABS(INT_MIN) does not fit
                where = position(node)
                return (lambda: checked_int(abs(a()), where)), "INT"
            return (lambda: abs(a())), types[0]
        if function == "SQRT":
            a, = fns
            return (lambda: real_sqrt(a())), "REAL"
        if function == "TRUNC":
            a, = fns
            where = position(node)
            return (lambda: trunc(a(), where)), "INT"
        if function in ("MIN", "MAX"):
            if len(parts) < 2:
                raise STError(f"{position(node)}: {function} takes two or more arguments")
            pick = min if function == "MIN" else max
            return (lambda: pick([f() for f in fns])), result
        if function == "LIMIT":
            if len(parts) != 3:
                raise STError(f"{position(node)}: LIMIT takes three arguments: LIMIT(MN, IN, MX)")
            lo, x, hi = fns
            return (lambda: min(max(x(), lo()), hi())), result
        raise STError(f"{position(node)}: unknown function {str(name)!r} (the subset has ABS, SQRT, MIN, MAX, LIMIT, TRUNC)")

    @staticmethod
    def need_number(type_name: str, op: str, node) -> None:
        if type_name == "BOOL":
            raise STError(f"{position(node)}: {op} needs numbers, not BOOL")

    @staticmethod
    def logic(kind: str, parts, node) -> tuple[Thunk, str]:
        (a, ta), (b, tb) = parts
        if ta != "BOOL" or tb != "BOOL":
            word = {"and_": "AND", "or_": "OR", "xor": "XOR"}[kind]
            raise STError(f"{position(node)}: {word} needs BOOL operands, not {ta} and {tb}")
        if kind == "and_":
            return (lambda: a() and b()), "BOOL"
        if kind == "or_":
            return (lambda: a() or b()), "BOOL"
        return (lambda: a() != b()), "BOOL"

    @staticmethod
    def compare(op: str, parts, node) -> tuple[Thunk, str]:
        (a, ta), (b, tb) = parts
        if (ta == "BOOL") != (tb == "BOOL") or (ta == "BOOL" and op not in ("=", "<>")):
            raise STError(f"{position(node)}: cannot compare {ta} {op} {tb}")
        fn = {"=": lambda: a() == b(), "<>": lambda: a() != b(), "<": lambda: a() < b(), ">": lambda: a() > b(),
              "<=": lambda: a() <= b(), ">=": lambda: a() >= b()}[op]
        return fn, "BOOL"

    def arith(self, op: str, parts, node) -> tuple[Thunk, str]:
        (a, ta), (b, tb) = parts
        self.need_number(ta, op, node)
        self.need_number(tb, op, node)
        where = position(node)
        if ta == "INT" and tb == "INT":
            return int_op(op, a, b, where), "INT"
        if op == "MOD":
            raise STError(f"{where}: MOD needs INT operands")
        if op == "/":
            return (lambda: real_div(a(), b())), "REAL"
        return {"+": lambda: a() + b(), "-": lambda: a() - b(), "*": lambda: a() * b()}[op], "REAL"


def checked_int(value: int, where: str) -> int:
    """``value`` if it fits an INT, else the overflow error the docs promise."""
    if not INT_MIN <= value <= INT_MAX:
        raise STRuntimeError(f"{where}: INT overflow ({value})")
    return value


def int_op(op: str, a: Thunk, b: Thunk, where: str) -> Thunk:
    def checked(value: int) -> int:
        return checked_int(value, where)

    if op == "+":
        return lambda: checked(a() + b())
    if op == "-":
        return lambda: checked(a() - b())
    if op == "*":
        return lambda: checked(a() * b())

    def divide() -> int:
        x, y = a(), b()
        if y == 0:
            raise STRuntimeError(f"{where}: INT division by zero")
        q = abs(x) // abs(y) * (1 if (x >= 0) == (y >= 0) else -1)  # truncation toward zero
        return checked(q) if op == "/" else x - q * y

    return divide


def real_div(x: float, y: float) -> float:
    if y == 0:
        return math.nan if x == 0 or math.isnan(x) else math.copysign(math.inf, x) * math.copysign(1.0, y)
    return x / y


def real_pow(x: float, y: float) -> float:
    try:
        result = math.pow(x, y)
    except OverflowError:
        return math.inf
    except ValueError:  # a negative base to a fractional power
        return math.nan
    return result


def real_sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else math.nan


def trunc(x: float, where: str) -> int:
    if not math.isfinite(x) or not INT_MIN <= x <= INT_MAX:
        raise STRuntimeError(f"{where}: TRUNC of {x} does not fit in an INT")
    return int(x)


_UNITS = (("d", 86400.0), ("h", 3600.0), ("ms", 0.001), ("m", 60.0), ("s", 1.0))


_TIME_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(d|h|ms|m|s)")


def parse_time(text: str, node) -> float:
    """``T#1m30s`` → 90.0, ``TIME#250ms`` → 0.25, ``T#1.5s`` → 1.5 (seconds): each part a number (at least
    one digit, at most one point: the lone ``.`` of ``T#1s.s`` is refused) and a unit."""
    body = text.split("#", 1)[1].lower().replace("_", "")
    total, pos = 0.0, 0
    while pos < len(body):
        part = _TIME_PART.match(body, pos)
        if part is None:
            raise STError(f"{position(node)}: {text[:40]!r} is not a TIME literal (write e.g. T#2s, T#500ms, T#1m30s)")
        total += float(part[1]) * dict(_UNITS)[part[2]]
        pos = part.end()
    if not math.isfinite(total):
        raise STError(f"{position(node)}: {text[:40]!r} is longer than a TIME can be")
    return total
