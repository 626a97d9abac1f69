from fractions import Fraction

from cohortrl.grading.answer_format import (
    commitment,
    evaluate,
    find_statements,
    format_exact,
    format_sig,
    normalize_key,
    parse_number,
    parse_response,
    rounds_to,
)

F = Fraction


def test_parse_number():
    assert parse_number("1,250.5") == F(2501, 2)
    assert parse_number("$72") == 72
    assert parse_number("-3.5e2") == -350
    assert parse_number(".5") == F(1, 2)
    assert parse_number("−4") == -4  # unicode minus
    for bad in ("3/4", "1_000", "12 apples", "", "1,2"):
        assert parse_number(bad) is None


def test_keys_compare_loosely():
    assert normalize_key("M_max") == normalize_key("Mmax") == normalize_key("m_MAX")
    assert normalize_key("σ") == normalize_key("sigma")
    assert normalize_key("R_Ax") != normalize_key("R_Ay")


def test_parse_response_lines_and_spans():
    text = "Working:\nA = pi*20^2/4 = 314.2 mm^2\n- **sigma** = 79.58 MPa.\nF_AB = -6.25 kN (compression)\nA = pi*d^2/4\nANSWER: 3.14\nVERDICT: safe"
    parsed = parse_response(text)
    assert [(s.key, s.value, s.unit) for s in parsed.steps] == [
        ("A", F("314.2"), "mm^2"), ("sigma", F("79.58"), "MPa"), ("F_AB", F("-6.25"), "kN")]
    # The span is the whole line the step was read from.
    start, end = parsed.steps[0].span
    assert text[start:end] == "A = pi*20^2/4 = 314.2 mm^2"
    assert [a.value for a in parsed.answers] == [F("3.14")]
    assert [v.text for v in parsed.verdicts] == ["SAFE"]


def test_commitment_needs_exactly_one_answer_and_verdict():
    def commit(text, needs_verdict=True):
        return commitment(parse_response(text), needs_verdict)

    assert commit("ANSWER: 2\nVERDICT: FAIL").committed
    assert not commit("ANSWER: 2\nANSWER: 2\nVERDICT: FAIL").committed  # even identical lines hedge
    assert not commit("ANSWER: 2\nVERDICT: SAFE or FAIL").committed
    assert not commit("ANSWER: 2\nVERDICT: SAFE\nVERDICT: FAIL").committed
    assert not commit("ANSWER: about two\nVERDICT: SAFE").committed
    assert not commit("VERDICT: SAFE").committed
    assert commit("ANSWER: 2", needs_verdict=False).committed
    # The template echoed, or the quantity named: still one readable answer.
    assert commit("ANSWER: <12>", needs_verdict=False).answer.value == 12
    assert commit("ANSWER: SF = 1.57\nVERDICT: SAFE").answer.value == Fraction("1.57")


def test_evaluate_is_exact_and_refuses_non_arithmetic():
    assert evaluate("3 + 4 * 5") == (23, [3, 4, 5])
    assert evaluate("(2 + 3) x 4")[0] == 20
    assert evaluate("10 / 4")[0] == F(5, 2)
    assert evaluate("-17 + 43")[0] == 26
    assert evaluate("$1,000 * 2")[0] == 2000
    for bad in ("48", "2 +", "import os", "2 ** 3", "1 / 0", "(2 + 3"):
        assert evaluate(bad) is None


def test_statements_in_free_text():
    text = ("Natalia sold 48/2 = 24 clips in May. Weng earns 0.2 x 50 = $10. 10/3 = 3.33 a share, "
            "not 10/3 = 3. Then 2 * 3 = 6 * 4 = 24, and 48 * 1 = 48.")
    found = [(s.lhs, s.written_text, s.correct, s.trivial) for s in find_statements(text)]
    assert found == [
        ("48/2", "24", True, False),
        ("0.2*50", "$10", True, False),
        ("10/3", "3.33", True, False),  # rounded to two places: accepted
        ("10/3", "3", False, False),  # rounded to a whole number: not
        ("2*3", "6", True, False),
        ("6*4", "24", True, False),  # a chain gives two statements
        ("48*1", "48", True, True),  # an identity restates a number
    ]


def test_rewriting_chains_state_the_sub_expressions_they_replace():
    def read(text):
        return [(s.lhs, s.written_text, s.correct) for s in find_statements(text, rewrites=True)]

    assert read("7 * 8 + 9 = 56 + 9 = 65") == [("7*8", "56", True), ("56+9", "65", True)]
    assert [(s.lhs, s.written_text, s.correct) for s in find_statements("7 * 8 + 9 = 56 + 9 = 65")] == [
        ("7*8+9", "56", False), ("56+9", "65", True)]  # without rewrites: the first "=" is a wrong claim
    assert read("7*8 + 3*4 = 56 + 12 = 68.") == [("7*8", "56", True), ("3*4", "12", True), ("56+12", "68", True)]
    assert read("(7 * 8) + 9 = 56 + 9") == [("7*8", "56", True)]  # the brackets go with the value
    assert read("-(3 * 4) + 20 = -12 + 20 = 8") == [("3*4", "12", True), ("-12+20", "8", True)]
    assert read("7*8+9*2 = 56+9*2 = 56+18 = 74")[:2] == [("7*8", "56", True), ("9*2", "18", True)]
    # not rewrites: a wrong value, a span taken against precedence, prose after the numbers, a restatement
    assert read("7 * 8 + 9 = 57 + 9 = 66")[0] == ("7*8+9", "57", False)
    assert read("2 + 3 * 4 = 5 * 4 = 20")[0] == ("2+3*4", "5", False)
    assert read("7 * 8 + 9 = 56 + 9 apples")[0] == ("7*8+9", "56", False)
    assert read("7 * 8 + 9 = 7 * 8 + 9") == [("7*8+9", "7", False)]


def test_rewrite_reading_stays_fast_on_long_chains():
    """Every alignment of a 90-token chain is tried at most once (memoised): far below the grader's budget."""
    import time

    left = "+".join(["2*1"] * 30)
    lines = [f"{left} = {right}" for right in ("2+" + "+".join(["2*1"] * 29), "+".join(["2"] * 30), left)]
    start = time.process_time()
    found = find_statements("\n".join(lines * 5), rewrites=True)
    assert time.process_time() - start < 1.0
    # per pass over the three lines: one span rewritten, then thirty, then none (the third restates its left side)
    assert [s.lhs == "2*1" and s.correct for s in found] == ([True] * 31 + [False]) * 5


def test_rounds_to():
    assert rounds_to(F(10, 3), "3.33") and rounds_to(F(10, 3), "3.333") and not rounds_to(F(10, 3), "3.3")
    assert rounds_to(F(24), "24.00") and not rounds_to(F(24), "24.4")


def test_number_formatting():
    assert format_sig(83333333.3) == "83330000"
    assert format_sig(0.000314159) == "0.0003142"
    assert format_sig(-6.25) == "-6.25"
    assert format_sig(0.0) == "0"
    assert format_exact(F(69967, 1000)) == "69.967"
    assert format_exact(F(-12)) == "-12"
