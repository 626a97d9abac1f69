"""The calculator against hand-worked values and hostile input, the text protocol's render / with_calculator on
every numeric family's reference solutions, simulate's feedback, and the guarded tool runner."""

import doctest
import math
import re
import time

import pytest

from cohortrl import tasks
from cohortrl.tools import (
    CalculatorError,
    ToolError,
    Toolset,
    ToolSetupError,
    evaluate,
    format_value,
    make_tool,
    parse_call,
    render,
    resolve_tools,
    result_spans,
    run_calls,
    with_calculator,
)
from cohortrl.tools.calculator import calculator
from cohortrl.tools.simulate import simulate


@pytest.mark.parametrize("expression, value", [
    ("pi*19^2/4", math.pi * 361 / 4),   # 283.528...: axial_stress level 2's area
    ("2^3^2", 512.0),                    # right-associative: 2^(3^2) = 2^9
    ("-2^2", -4.0),                      # the power binds tighter than the sign
    ("2^-1", 0.5),
    ("2**10", 1024.0),
    ("1.5e3/3", 500.0),
    (".5 + 2.", 2.5),
    ("(1 - 3) * (2 + 4)", -12.0),        # -2 * 6
    ("1 - - 1", 2.0),
    ("10 - 4 - 3", 3.0),                 # left-associative: (10 - 4) - 3
    ("12 / 4 / 3", 1.0),                 # (12 / 4) / 3
    ("sqrt(16) + abs(-3)", 7.0),
    ("sin(pi/2) + cos(0) + tan(0)", 2.0),
    ("asin(1)*2", math.pi),
    ("acos(0) + atan(1)", math.pi / 2 + math.pi / 4),
    ("ln(e) + log(e^2) + log10(1000)", 6.0),  # 1 + 2 + 3
    ("exp(0)", 1.0),
    ("min(2.903, 1.003) + max(1, 2, 3)", 4.003),  # the gym's buckling check, SF = min(SF_y, SF_b)
    ("3 × 4 − 8 ÷ 2", 8.0),              # 12 - 4, the typographic operators
    ("128000000*180/349900000", 128e6 * 180 / 349.9e6),
])
def test_hand_worked_values(expression, value):
    assert evaluate(expression) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("expression, message", [
    ("10^10^10", "too large"),                 # 10^(1e10): a float overflow, not a huge integer
    ("9^9^9^9", "too large"),
    ("1e400", "not a finite"),
    ("(" * 40 + "1" + ")" * 40, "nested more than"),
    ("-" * 60 + "1", "nested more than"),
    ("1+" * 200 + "1", "characters long"),
    ("__import__(1)", "unknown name '__import__'"),
    ("__import__('os')", "unexpected character"),
    ("x + 1", "unknown name 'x'"),
    ("open", "unknown name 'open'"),
    ("sqrt 4", "needs parentheses"),
    ("2(3)", "after a complete expression"),
    ("1/0", "division by zero"),
    ("1/(2-2)", "division by zero"),
    ("sqrt(-1)", "undefined"),
    ("log(0)", "undefined"),
    ("(-8)^(1/3)", "not a real number"),
    ("3 +", "ends too early"),
    ("(1 + 2", "not closed"),
    ("", "empty"),
    ("1; 2", "unexpected character ';'"),
    ("2 $ 3", "unexpected character '$'"),
    ("sqrt(4, 9)", "sqrt takes one argument, not 2"),
    ("1, 2", "unexpected ','"),
])
def test_hostile_or_broken_input_is_an_error_with_a_reason(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)


def test_a_hostile_expression_fails_fast():
    start = time.perf_counter()
    for expression in ("9^9^9^9^9^9", "(" * 32 + "2^2^2^2" + ")" * 32, "1e308*1e308"):
        with pytest.raises(CalculatorError):
            evaluate(expression)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("x, text", [
    (283.5287369864788, "283.5"), (349920000.0, "349900000"), (-810.6, "-810.6"), (64.0, "64"), (0.0, "0"),
    (0.0012345678, "0.001235"), (1.23456e-7, "1.235e-07"), (2.5e20, "2.5e+20"), (3.8486, "3.849"),
])
def test_results_have_four_significant_figures(x, text):
    assert format_value(x) == text


def test_the_calculator_tool_and_doctests():
    assert calculator("pi*19^2/4") == "283.5"
    import cohortrl.tools.text as text_module

    calculator_module = __import__("cohortrl.tools.calculator", fromlist=["evaluate"])
    assert doctest.testmod(calculator_module).failed == 0
    assert doctest.testmod(text_module).failed == 0


# ---------------------------------------------------------------------------------------------- text protocol
def test_render_turns_calculator_calls_into_statements_and_drops_other_calls():
    line = "A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2"
    assert render(line) == "A = pi*19^2/4 = 283.5 mm^2"
    # a newline written in the same token as "</call>" lands after the value
    assert render("x = <call>calculator: 1+2</call>\n<result>3</result>ANSWER: 3") == "x = 1+2 = 3\nANSWER: 3"
    assert render("a <call>simulate: pump := 1;</call><result>fails run</result>b") == "a b"
    assert render("no calls here = 5") == "no calls here = 5"
    text = "s = <call>calculator: 1/0</call><result>error: division by zero</result>"
    assert render(text) == "s = "  # a failed call states nothing: no value, and no digits of its error text (#50)
    # the digits of an error text are not an answer (accuracy's last_number read "300" here before #50)
    failed = "<call>calculator: 1</call><result>error: the expression is 400 characters long; the limit is 300</result>"
    assert render(f"ANSWER: {failed}") == "ANSWER: "
    # a result cut by the token budget is the tool's text to the end: nothing of it is read
    assert render("x <call>shout: a</call><result>ANSWER: 72") == "x <call>shout: a</call>"
    assert result_spans(text) == [(text.index("<result>"), len(text))]


@pytest.mark.parametrize("family", ["axial_stress", "beam_bending", "truss"])
def test_with_calculator_references_earn_full_credit_at_every_level(family):
    fam = tasks.get(family)
    for level in fam.levels:
        for sample in fam.sample(12, seed=5, level=level):
            tool_form = with_calculator(sample.reference_solution)
            rendered = render(tool_form)
            grade = fam.grade(sample, rendered)
            assert (grade.outcome, grade.step_credit) == (1.0, 1.0), (family, level, tool_form)
            for line, new in zip(sample.reference_solution.splitlines(), tool_form.splitlines()):
                if line.count("=") == 2 and new == line:  # kept: only where the middle is not arithmetic
                    with pytest.raises(CalculatorError):  # ("N_2 = P_2 = 78 kN" names a given)
                        evaluate(line.split("=")[1])
                elif line.count("=") == 2:
                    assert new.count("<call>calculator:") == new.count("<result>") == 1


def test_with_calculator_uses_the_calculators_own_value_and_the_answer_copies_it():
    reference = "A = pi*35^2/4 = 962.1 mm^2\nsigma = 60000/962.1 = 62.36 MPa\nSF = 240/62.36 = 3.848\nANSWER: 3.848\nVERDICT: SAFE"
    assert with_calculator(reference) == (
        "A = <call>calculator: pi*35^2/4</call><result>962.1</result> mm^2\n"
        "sigma = <call>calculator: 60000/962.1</call><result>62.36</result> MPa\n"
        "SF = <call>calculator: 240/62.36</call><result>3.849</result>\n"  # 240/62.36 = 3.84862...
        "ANSWER: 3.849\nVERDICT: SAFE"
    )
    assert with_calculator("R_A = -1950 N\nANSWER: 5") == "R_A = -1950 N\nANSWER: 5"  # nothing to compute


def test_parse_call_reads_raw_text_or_json_and_explains_bad_calls():
    def scale(value: float, factor: float) -> float:
        """Multiply.

        Args:
            value: a number
            factor: another number
        """
        return value * factor

    tools = Toolset(resolve_tools(["calculator", scale]))
    tool, args = parse_call("x = <call>calculator:  2 + 3 </call>", tools)
    assert (tool.name, args) == ("calculator", {"expression": "2 + 3"})
    tool, args = parse_call('<call>scale: {"value": 2, "factor": 4}</call>', tools)
    assert (tool.name, args) == ("scale", {"value": 2, "factor": 4})
    for text, message in [("<call>nope: 1</call>", "unknown tool 'nope'"), ("<call>calculator 1</call>", "':' is missing"),
                          ("1+1</call>", "a call is written"), ("<call>scale: 2, 4</call>", "JSON object with value, factor")]:
        with pytest.raises(ToolError, match=message):
            parse_call(text, tools)


def test_a_tool_needs_hints_and_a_documented_signature():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ToolSetupError, match="tool 'undocumented' cannot be described to the model.*docstring"):
        make_tool(undocumented)
    with pytest.raises(ToolSetupError, match="unknown tool 'calc'.*calculator, simulate"):
        resolve_tools(["calc"])
    with pytest.raises(ToolSetupError, match="cohortrl.tools.text has no 'nothing'"):
        resolve_tools(["cohortrl.tools.text:nothing"])
    with pytest.raises(ToolSetupError, match="two tools are both called 'calculator'"):
        Toolset(resolve_tools(["calculator", "calculator"]))
    simulate_tool = make_tool(simulate)
    assert simulate_tool.takes_row and "row" not in simulate_tool.parameters  # the row is not the model's to fill
    assert simulate_tool.text_parameter == "program"


# ---------------------------------------------------------------------------------------------- the runner
def test_run_calls_turns_failures_into_short_error_texts():
    def hang():
        time.sleep(30)

    def boom():
        raise RuntimeError("tool broke")

    start = time.perf_counter()
    results = run_calls([lambda: 2 + 3, boom, hang, lambda: "x" * 5000, lambda: evaluate("1/0")], timeout_s=0.5)
    assert time.perf_counter() - start < 5  # the hung call is abandoned at the deadline
    assert results[0] == ("5", False)
    assert results[1] == ("error: RuntimeError: tool broke", True)
    assert results[2] == ("error: no result within 0.5 s", True)
    assert results[3] == ("error: the result is 5000 characters long; the limit is 1000", True)
    assert results[4] == ("error: division by zero", True)  # a tool's own error reads without its class name


# ---------------------------------------------------------------------------------------------- simulate
def test_simulate_runs_only_the_shown_scenario_and_reports_stages():
    family = tasks.get("controller")
    sample = family.sample(1, seed=0, level=2)[0]
    row = {"prompt": sample.prompt, "sample": sample.to_dict()}
    good = sample.reference_solution.split("```st\n")[1].split("```")[0]
    assert simulate(good, row).startswith("passes parse, run, safety and performance on the shown scenario")
    feedback = simulate("pump := 1.0;", row)
    assert feedback.startswith("passes parse; fails run: scenario visible 1:")
    assert "hidden" not in feedback.replace("the hidden ones", "")
    assert simulate("pump := foo;", row).startswith("fails parse: line 1: 'foo' is not declared")
    with pytest.raises(ToolError, match="only on controller problems"):
        simulate("pump := 1.0;", {"prompt": "What is 2 + 2?"})
