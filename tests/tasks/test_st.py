"""The Structured Text subset: semantics worked by hand, and a clear error for everything outside it."""

from __future__ import annotations

import math

import pytest

from cohortrl.tasks.st import STError, STRuntimeError, Var, compile_program

IO = [Var("x", "REAL", True), Var("b", "BOOL", True), Var("DT", "REAL", True), Var("y", "REAL", False),
      Var("q", "BOOL", False)]


def scans(text: str, inputs: list[tuple], dt: float = 0.1, interface=IO) -> list[list]:
    """Run one scan per input tuple, at t = 0, dt, 2 dt, ...; the outputs of each scan."""
    program = compile_program(text, interface)
    program.reset()
    return [program.scan([*row, dt], k * dt) for k, row in enumerate(inputs)]


def test_arithmetic_and_precedence():
    # 2 + 3 * 4 = 14; -2 ** 2 = -(2 ** 2) = -4 (a REAL: ** is always REAL); 7 / 2 = 3 (INT truncates);
    # -7 / 2 = -3 (toward zero); -7 MOD 2 = -1 (sign of the dividend); 7.0 / 2 = 3.5.
    text = """VAR a, c, d : INT; r, s, t : REAL; END_VAR
    a := 2 + 3 * 4; r := -2 ** 2; c := 7 / 2; d := -7 / 2; s := -7 MOD 2; t := 7.0 / 2;
    y := a + r + c + d + s + t; q := (a = 14) AND (r = -4.0) AND (c = 3) AND (d = -3) AND (s = -1) AND (t = 3.5);"""
    (y, q), = scans(text, [(0.0, False)])
    assert q and y == 14 - 4 + 3 - 3 - 1 + 3.5


def test_logic_comparisons_and_functions():
    text = """y := LIMIT(0.0, x * 2.0, 1.0) + ABS(-1.5) + MAX(1, 2, 3) + MIN(x, 0.0) + SQRT(4.0) + TRUNC(2.9);
    q := (b XOR TRUE) OR NOT (x <> 0.25) & (x >= 0.25);"""
    # x = 0.25: LIMIT → 0.5; + 1.5 + 3 + 0.0 + 2.0 + 2 = 9.0. b = FALSE: FALSE XOR TRUE = TRUE.
    (y, q), = scans(text, [(0.25, False)])
    assert y == 9.0 and q is True


def test_variables_persist_between_scans_and_reset_restarts_them():
    text = "VAR n : INT := 10; acc : REAL; END_VAR n := n + 1; acc := acc + x * DT; y := acc + n; q := n > 12;"
    out = scans(text, [(1.0, False)] * 3)
    # n: 11, 12, 13; acc: 0.1, 0.2, 0.3.
    assert [o[1] for o in out] == [False, False, True]
    assert out[-1][0] == pytest.approx(13.3)
    program = compile_program(text, IO)
    program.reset()
    program.scan([1.0, False, 0.1], 0.0)
    program.reset()
    assert program.scan([1.0, False, 0.1], 0.0)[0] == pytest.approx(11.1)


def test_outputs_keep_their_value_when_not_assigned():
    text = "IF b THEN y := x; END_IF; q := b;"
    assert [o[0] for o in scans(text, [(1.0, True), (2.0, False), (3.0, True)])] == [1.0, 1.0, 3.0]


def test_ton_counts_simulated_time_while_in_is_true():
    # PT = 0.3 s at DT = 0.1 s: IN rises at the scan at t = 0.1, so Q is TRUE from t = 0.4 on; IN falling
    # resets it at once, and ET with it.
    text = "VAR t : TON; END_VAR t(IN := b, PT := T#300ms); q := t.Q; y := t.ET;"
    ins = [(0.0, False), (0.0, True), (0.0, True), (0.0, True), (0.0, True), (0.0, True), (0.0, False)]
    out = scans(text, ins)
    assert [o[1] for o in out] == [False, False, False, False, True, True, False]
    assert [round(o[0], 6) for o in out] == [0.0, 0.0, 0.1, 0.2, 0.3, 0.3, 0.0]


def test_r_trig_is_true_for_one_scan_on_a_rising_edge():
    text = "VAR e : R_TRIG; END_VAR e(CLK := b); q := e.Q; y := 0.0;"
    out = scans(text, [(0.0, b) for b in (False, True, True, False, True)])
    assert [o[1] for o in out] == [False, True, False, False, True]


def test_sr_latch_is_set_dominant_and_holds():
    text = "VAR l : SR; END_VAR l(S1 := b, R := x > 0.5); q := l.Q1; y := 0.0;"
    rows = [(0.0, False), (0.0, True), (0.0, False), (1.0, True), (1.0, False), (0.0, False)]
    # set, hold, set+reset (set wins), reset, stays reset.
    assert [o[1] for o in scans(text, rows)] == [False, True, True, True, False, False]


def test_block_inputs_not_given_keep_their_previous_values():
    text = "VAR t : TON; END_VAR IF b THEN t(IN := TRUE, PT := T#0.2s); ELSE t(); END_IF; q := t.Q; y := 0.0;"
    assert [o[1] for o in scans(text, [(0.0, True), (0.0, False), (0.0, False)])] == [False, False, True]


def test_case_insensitive_keywords_and_names_comments_and_program_wrapper():
    text = """PROGRAM demo  (* a comment *)
    var Total : real; end_var   // another
    if B then TOTAL := total + X; end_if;
    Y := total; Q := FALSE;
    END_PROGRAM"""
    assert [o[0] for o in scans(text, [(2.0, True), (3.0, True)])] == [2.0, 5.0]


@pytest.mark.parametrize("literal,seconds", [("T#2s", 2.0), ("TIME#250ms", 0.25), ("t#1m30s", 90.0),
                                             ("T#1.5s", 1.5), ("T#1h2m", 3720.0)])
def test_time_literals(literal, seconds):
    (y, _), = scans(f"y := {literal}; q := FALSE;", [(0.0, False)])
    assert y == seconds


def test_real_division_by_zero_gives_inf_or_nan_like_a_plc():
    (y, _), = scans("y := x / 0.0; q := FALSE;", [(1.0, False)])
    assert y == math.inf
    (y, _), = scans("y := SQRT(x); q := FALSE;", [(-1.0, False)])
    assert math.isnan(y)


@pytest.mark.parametrize("text,message", [
    ("VAR n : INT := 2147483647; END_VAR n := n + 1; y := 0.0; q := FALSE;", "INT overflow"),
    ("VAR n : INT; END_VAR n := 1 / n; y := 0.0; q := FALSE;", "INT division by zero"),
    ("VAR n : INT; END_VAR n := TRUNC(x / 0.0); y := 0.0; q := FALSE;", "TRUNC of inf"),
    # issue 50: the minimum INT negated or made absolute is 2147483648, which no INT holds
    ("VAR n : INT := -2147483647; END_VAR n := n - 1; n := -n; y := 0.0; q := FALSE;", r"INT overflow \(2147483648\)"),
    ("VAR n : INT := -2147483647; END_VAR n := n - 1; n := ABS(n); y := 0.0; q := FALSE;", r"INT overflow \(2147483648\)"),
    ("VAR n : DINT := -2147483647; END_VAR n := n - 1; y := ABS(n) * 1.0; q := FALSE;", r"INT overflow \(2147483648\)"),
])
def test_runtime_errors(text, message):
    with pytest.raises(STRuntimeError, match=message):
        scans(text, [(1.0, False)])


def test_negation_and_abs_of_ints_in_range_are_exact():
    (y, _), = scans("VAR n : INT := -2147483647; END_VAR y := ABS(n) * 1.0 + (-n) * 1.0; q := FALSE;", [(0.0, False)])
    assert y == 2 * 2147483647


@pytest.mark.parametrize("text,message", [
    ("WHILE b DO y := 1.0; END_WHILE; q := b;", "WHILE loops: not in the supported Structured Text subset"),
    ("FOR i := 1 TO 3 DO y := 1.0; END_FOR; q := b;", "FOR loops: not in the supported"),
    ("CASE n OF 1: y := 1.0; END_CASE; q := b;", "CASE statements: not in the supported"),
    ("VAR a : ARRAY[1..3] OF REAL; END_VAR y := 0.0; q := b;", "arrays: not in the supported"),
    ("y := 1.0; q := b", "ends too early"),
    ("IF b THEN y := 1.0; q := b;", "ends too early"),
    ("y := 1.0 +; q := b;", "unexpected ';'"),
    ("t.Q := TRUE; y := 1.0; q := b;", "only variables can be assigned"),
    ("y := 1.0;", "never assigns the output 'q'"),
    ("x := 1.0; y := 1.0; q := b;", "'x' is an input"),
    ("y := b; q := b;", "cannot assign a BOOL value to REAL variable 'y'"),
    ("VAR n : INT; END_VAR n := x; y := 0.0; q := b;", "use TRUNC"),
    ("y := z; q := b;", "'z' is not declared"),
    ("y := FOO(x); q := b;", "unknown function 'FOO'"),
    ("VAR s : STRING; END_VAR y := 0.0; q := b;", "type 'STRING' is not in the subset"),
    ("VAR t : TON; END_VAR t(IN := b, XX := 1.0); y := 0.0; q := b;", "TON has no input 'XX'"),
    ("VAR t : TON; END_VAR y := t; q := b;", "'t' is a TON"),
    ("IF x THEN y := 1.0; END_IF; q := b;", "a condition must be BOOL"),
    ("y := 1.0; q := b AND x;", "AND needs BOOL operands"),
    ("VAR y : REAL; END_VAR y := 1.0; q := b;", "'y' is declared twice"),
    ("VAR v : REAL := x; END_VAR y := v; q := b;", "must be a constant"),
    ("VAR_INPUT y : REAL; END_VAR y := 1.0; q := b;", "not an input of this controller"),
    ("y := 99999999999; q := b;", "does not fit in an INT"),
    ("", "the program is empty"),
    ("y := " + "-" * 250 + "1.0; q := b;", "nested more than"),
])
def test_outside_the_subset_or_wrong_is_a_clear_error(text, message):
    with pytest.raises(STError, match=message.replace("(", r"\(").replace("[", r"\[")):
        compile_program(text, IO)


def test_programs_are_bounded_in_size():
    text = "y := x + x; " * 400 + "q := b;"
    with pytest.raises(STError, match="at most 1000 per scan"):
        compile_program(text, IO, max_nodes=1000)
    with pytest.raises(STError, match="longer than"):
        compile_program("y := 1.0; " * 3000 + "q := b;", IO)


def test_restating_the_interface_is_allowed():
    text = "VAR_INPUT x : REAL; b : BOOL; END_VAR VAR_OUTPUT y : LREAL; q : BOOL; END_VAR y := x; q := b;"
    assert scans(text, [(4.0, True)]) == [[4.0, True]]
