"""Tests written from `scripts/mutation.sh grading` (docs/testing.md, "Mutation testing"): each pins a behaviour
of ``grading/answer_format.py`` or ``grading/units.py`` that a surviving mutant changed and no test noticed.
The equivalent survivors are listed, with the reason, in docs/testing.md."""

from fractions import Fraction as F

import pytest

from cohortrl.grading.answer_format import (
    _strip_remark,
    commitment,
    decimals,
    evaluate,
    find_statements,
    format_exact,
    format_instructions,
    format_sig,
    is_identity,
    normalize_key,
    normalize_lhs,
    parse_number,
    parse_response,
    rounds_to,
)
from cohortrl.grading.units import quantity_matches


# --- numbers, keys and units as written -------------------------------------------------------------------

def test_parse_number_reads_exponents_up_to_max_exponent_with_any_sign_or_leading_zeros():
    assert parse_number("1e400") == 10**400 and parse_number("1e+400") == 10**400
    assert parse_number("1e-400") == F(1, 10**400)
    assert parse_number("1e100") == 10**100  # three digits are fine
    assert parse_number("1e0001") == 10 and parse_number("2E0") == 2  # leading zeros do not count
    for beyond in ("1e401", "1E401", "1e+401", "1e-401", "1e4000", "1e0401"):
        assert parse_number(beyond) is None, beyond


def test_normalize_key_is_lower_case():
    assert normalize_key("M_max") == "mmax" and normalize_key("Σ_Δ") == "σdelta"


def test_an_unreadable_written_or_expected_unit_is_wrong_not_an_error():
    assert not quantity_matches(F(1), "apples", F(1), "m", 0.01)
    assert not quantity_matches(F(1), "m", F(1), "apples", 0.01)


# --- the prompt's format paragraph -------------------------------------------------------------------------

def test_format_instructions_lists_steps_with_their_units_and_the_verdict_only_when_asked():
    assert format_instructions([("A", "mm^2"), ("SF", "")], "SF", True) == (
        "Write one step per line as KEY = expression = value unit, for A (mm^2), SF. "
        "Then write ANSWER: <SF> and VERDICT: SAFE or FAIL.")
    assert format_instructions([("F_AB", "kN")], "F_AB", False) == (
        "Write one step per line as KEY = expression = value unit, for F_AB (kN). Then write ANSWER: <F_AB>.")


# --- numbers as the reference solutions write them ---------------------------------------------------------

def test_format_sig_of_one_and_other_non_zero_values_is_not_zero():
    assert format_sig(1.0) == "1"
    assert format_sig(-1.0) == "-1"
    assert format_sig(1.0, sig=2) == "1"


def test_format_exact_goes_to_twenty_places_without_exponent_notation_and_no_further():
    assert format_exact(F(1, 10**20)) == "0.00000000000000000001"  # Decimal's own str would be "1E-20"
    assert format_exact(F(-3, 2**20)) == "-0.00000286102294921875"
    with pytest.raises(ValueError, match="has no short finite decimal expansion"):
        format_exact(F(1, 10**21))
    with pytest.raises(ValueError, match="1/3 has no short finite decimal expansion"):
        format_exact(F(1, 3))


# --- free-text arithmetic statements -----------------------------------------------------------------------

def test_is_identity_counts_adding_zero_and_multiplying_by_one():
    assert is_identity(F(48), [F(48), F(0)])  # 48 + 0 = 48
    assert is_identity(F(48), [F(48), F(1)])  # 48 * 1 = 48
    assert not is_identity(F(48), [F(48), F(2)])  # 48 * 2 = 48 is wrong, not trivial
    assert not is_identity(F(49), [F(48), F(1)])  # 48 + 1 = 49 computes something
    (statement,) = find_statements("48 + 0 = 48")
    assert statement.trivial and statement.correct


def test_normalize_lhs_drops_tabs_dollars_and_thousands_commas_and_spells_every_operator_as_star_or_slash():
    assert normalize_lhs("$1,000\t× 2 ÷ 4") == "1000*2/4"
    assert normalize_lhs("$12 x 3") == "12*3"
    assert normalize_lhs("7\t+\t5") == "7+5"
    assert normalize_lhs("6 ÷ 3") == "6/3"


def test_a_statement_carries_its_exact_value_the_written_value_and_the_span_from_where_its_lhs_starts():
    (statement,) = find_statements("so 10/3 = 3.33 each")
    assert (statement.exact, statement.written, statement.written_text) == (F(10, 3), F(333, 100), "3.33")
    assert statement.operands == (F(10), F(3)) and statement.span == (3, 14)
    # Prose before the left-hand side: the regex starts at "3", evaluation at "4"; the span starts there too.
    (statement,) = find_statements("3, 4 + 5 = 9")
    assert (statement.lhs, statement.span) == ("4+5", (3, 12))


def test_statement_spans_are_offsets_into_the_whole_text_on_every_line():
    text = "a\n2+3=5\nso 10 / 4 = 2.5 and 1+1=2"
    found = find_statements(text)
    assert [(s.lhs, s.span) for s in found] == [("2+3", (2, 7)), ("10/4", (11, 23)), ("1+1", (28, 33))]
    assert [text[s.span[0]:s.span[1]] for s in found] == ["2+3=5", "10 / 4 = 2.5", "1+1=2"]


def test_statements_at_the_start_of_a_line_without_spaces_or_indented():
    assert [(s.lhs, s.correct) for s in find_statements("2+3=5")] == [("2+3", True)]
    assert [(s.lhs, s.written) for s in find_statements("1+1=2")] == [("1+1", 2)]  # a one-character rhs
    assert [(s.lhs, s.span) for s in find_statements("    2 + 3 = 5")] == [("2+3", (4, 13))]
    assert find_statements("total =") == [] and find_statements("2 + 3 =\n= 5") == []  # "=" at a line's end
    assert [(s.lhs, s.span) for s in find_statements("= 2 + 3 = 5")] == [("2+3", (2, 11))]  # "=" at a line's start


def test_a_left_hand_side_does_not_start_right_after_a_digit():
    """Implicit multiplication is not read; nor is it misread as the bracket alone ("(4+5) = 27", wrong)."""
    assert find_statements("3(4+5) = 27") == []


# The longest left-hand side `_STATEMENT` admits: MAX_NESTING leading brackets, ".5", then MAX_LHS characters.
LONGEST_LHS = "(" * 50 + ".5" + ")" * 50 + "+1" * 75


@pytest.mark.parametrize("sep", ["=", " = ", " =", "= ", " \t= ", "  =  "])
def test_the_longest_left_hand_side_is_found_whatever_the_spacing_around_the_equals_sign(sep):
    """`_statements_in` searches only a window of MAX_NESTING + MAX_LHS + 2 characters before the spaces that
    precede "="; a window one character too short would start inside the brackets and find "1+1+...+1"."""
    assert len(LONGEST_LHS) == 252
    text = "Total: " + LONGEST_LHS + sep + "75.5"
    (statement,) = find_statements(text)
    assert statement.lhs == LONGEST_LHS and statement.exact == F(151, 2) and statement.correct
    assert statement.span == (7, len(text))


# --- response lines ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, stripped", [
    ("-6.25 kN (compression)", "-6.25 kN"),
    ("-6.25 kN (member 3) (compression)", "-6.25 kN (member 3)"),  # only the last remark
    ("5 kN (a)(b)", "5 kN (a)"),
    ("(a remark only)", ""),  # a remark at position 0
    ("5 kN ()", "5 kN"),  # an empty remark
    ("5 kN)", "5 kN)"),  # no "(": nothing to strip
    ("5 (a (b) c)", "5 (a (b) c)"), ("5 (a))", "5 (a))"), ("5 ()x)", "5 ()x)"),  # nested brackets: kept
])
def test_strip_remark_takes_off_one_trailing_parenthesised_remark_without_nested_brackets(text, stripped):
    assert _strip_remark(text) == stripped


def test_response_lines_keep_the_unit_as_written_and_lose_backticks_and_the_templates_brackets():
    (step,) = parse_response("A = 5 mX").steps
    assert (step.value, step.unit) == (5, "mX")  # not "m": an unreadable unit must stay unreadable
    (step,) = parse_response("`A` = `5 mm`").steps
    assert (step.key, step.value, step.unit) == ("A", 5, "mm")
    (answer,) = parse_response("ANSWER: <12>").answers
    assert (answer.value, answer.unit, answer.text) == (12, "", "12")
    (answer,) = parse_response("ANSWER: about two").answers
    assert (answer.value, answer.unit) == (None, "")
    (answer,) = parse_response("x\ny\nANSWER: 3 kN").answers  # the third line: spans add up line lengths
    assert (answer.key, answer.text, answer.span) == ("ANSWER", "3 kN", (4, 16))
    (answer,) = parse_response("ANSWER: x = 2 * 3 = 6").answers  # the value after the last "="
    assert (answer.key, answer.value, answer.text) == ("ANSWER", 6, "6")


def test_a_step_is_graded_on_the_value_after_its_last_equals_sign():
    (step,) = parse_response("A = pi*d^2/4 = 3.1416*400/4 = 314.2 mm^2 (rounded)").steps
    assert (step.key, step.value, step.unit, step.text) == ("A", F("314.2"), "mm^2", "314.2 mm^2 (rounded)")


def test_verdict_lines_are_read_upper_case_without_a_trailing_full_stop():
    (verdict,) = parse_response("x\ny\nVERDICT: safe.").verdicts
    assert (verdict.key, verdict.value, verdict.unit, verdict.text, verdict.span) == ("VERDICT", None, "", "SAFE", (4, 18))
    (verdict,) = parse_response("VERDICT: .FAIL").verdicts
    assert verdict.text == ".FAIL"  # only a trailing stop goes
    (verdict,) = parse_response("VERDICT: SAFEX").verdicts
    assert verdict.text == "SAFEX"
    assert not commitment(parse_response("ANSWER: 2\nVERDICT: SAFEX"), needs_verdict=True).committed


def test_a_single_safe_verdict_commits():
    committed = commitment(parse_response("ANSWER: 2\nVERDICT: SAFE"), needs_verdict=True)
    assert committed.committed and committed.verdict == "SAFE"


# --- the arithmetic evaluator ------------------------------------------------------------------------------

def test_evaluate_subtracts_and_ignores_trailing_whitespace():
    assert evaluate("10 - 4") == (6, [10, 4])
    assert evaluate("10 - 4 + 1 - 2") == (5, [10, 4, 1, 2])
    assert evaluate("2 + 3 ") == (5, [2, 3])
    assert evaluate("2 + 3\t") == (5, [2, 3])


def test_evaluate_allows_max_nesting_brackets_or_unary_minuses_and_no_more_but_any_number_of_operands():
    assert evaluate("(" * 50 + "1+1" + ")" * 50)[0] == 2
    assert evaluate("(" * 51 + "1+1" + ")" * 51) is None
    assert evaluate("-" * 50 + "1 + 1")[0] == 2
    assert evaluate("-" * 51 + "1 + 1") is None
    assert evaluate("+".join(["1"] * 60))[0] == 60  # 119 tokens, none of them "(" or "-"


def test_decimals_and_rounds_to_of_an_unreadable_number():
    assert decimals("24") == 0 and decimals("3.33") == 2 and decimals("1000.5") == 1
    assert not rounds_to(F(3), "three") and not rounds_to(F(3), "")
