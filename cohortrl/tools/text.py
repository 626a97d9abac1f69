"""The text protocol of tool calls, for models whose chat template has no tool calling (SmolLM2):

    <call>NAME: ARGUMENT</call>      written by the model; decoding of that response pauses right after </call>
    <result>TEXT</result>            appended by the rollout as tokens that are not the model's; decoding goes on

ARGUMENT is the raw text when the tool's only parameter is a string (``<call>calculator: pi*19^2/4</call>``),
else a JSON object of its arguments (``<call>convert: {"value": 3, "unit": "kN"}</call>``). A call that cannot
be parsed, names an unknown tool or comes after the response's last allowed call still gets a result: an
``error: ...`` text saying what was wrong.

:func:`render` gives graders what the response states: each calculator call with its result becomes
``EXPR = VALUE``, so the gym line ``A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2`` is
graded as ``A = pi*19^2/4 = 283.5 mm^2``; any other tool's call and result are scratch work and are removed.
:func:`with_calculator` rewrites a gym reference solution into that call form (or the chat protocol's), for
supervised warm starts.
"""

from __future__ import annotations

import re

from cohortrl.tools.base import Tool, ToolError, Toolset, failed, loads
from cohortrl.tools.calculator import CalculatorError, evaluate, format_value
from cohortrl.tools.chat import CALL_RESPONSE, RESPONSE_CLOSE, RESPONSE_OPEN, call_text, render_call, without

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

_CALCULATED = re.compile(rf"<call>\s*calculator\s*:(?P<expr>{without(CALL_OPEN)})</call>(?P<space>\s*)<result>"
                         rf"(?P<value>{without(RESULT_OPEN)})</result>", re.DOTALL)
_OTHER_CALL = re.compile(rf"<call>{without(CALL_OPEN)}</call>\s*<result>{without(RESULT_OPEN)}</result>", re.DOTALL)
_RESULT = re.compile(rf"<result>{without(RESULT_OPEN)}</result>", re.DOTALL)
# A gym step line "KEY = expression = value unit" (answer_format.py's shape), the expression without "=".
_STEP_LINE = re.compile(r"^(?P<key>[^\W\d]\w*)\s*=\s*(?P<expr>[^=\n]+?)\s*=\s*(?P<value>[-+]?[\d.]+(?:[eE][-+]?\d+)?)(?P<unit>[^=\n]*)$",
                        re.MULTILINE)
_ANSWER_LINE = re.compile(r"^(?P<head>ANSWER\s*:\s*)(?P<value>[-+]?[\d.]+(?:[eE][-+]?\d+)?)", re.MULTILINE)


def describe(toolset: Toolset) -> str:
    """How to call the tools, for the system prompt."""
    lines = [f"You can call tools. Write {CALL_OPEN}NAME: ARGUMENT{CALL_CLOSE} and the result comes back as "
             f"{RESULT_OPEN}...{RESULT_CLOSE}; then go on. Tools:"]
    for tool in toolset.tools:
        # the description's first sentence: the prompt stays short, the full docstring is in the schema
        summary = re.split(r"(?<=\.)\s", " ".join(tool.schema["function"].get("description", "").split()), maxsplit=1)[0]
        if tool.text_parameter:
            lines.append(f"- {tool.name}: {summary} ARGUMENT: the {tool.text_parameter}.")
        else:
            lines.append(f"- {tool.name}: {summary} ARGUMENT: a JSON object with {', '.join(tool.parameters)}.")
    return "\n".join(lines)


def tool_prompt(system_prompt: str | None, toolset: Toolset) -> str:
    """The system prompt with the tools described after it."""
    return describe(toolset) if not system_prompt else f"{system_prompt}\n\n{describe(toolset)}"


def has_call(text: str) -> bool:
    """Whether ``text`` (a response since its last tool result) holds a finished call."""
    return CALL_CLOSE in text


def parse_call(text: str, toolset: Toolset) -> tuple[Tool, dict]:
    """The tool and arguments of the first finished call in ``text``; raises :class:`ToolError` (its message is
    the call's result) when there is none that can be run."""
    end = text.find(CALL_CLOSE)
    start = text.rfind(CALL_OPEN, 0, end)
    if end < 0 or start < 0:
        raise ToolError(f"a call is written {CALL_OPEN}NAME: ARGUMENT{CALL_CLOSE}")
    name, colon, argument = text[start + len(CALL_OPEN) : end].partition(":")
    if not colon:
        raise ToolError(f"a call is written {CALL_OPEN}NAME: ARGUMENT{CALL_CLOSE} (the ':' is missing)")
    tool = toolset.get(name.strip())
    if tool.text_parameter:
        return tool, {tool.text_parameter: argument.strip()}
    try:
        arguments = loads(argument)
    except ToolError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ToolError(f"the argument of {tool.name} is a JSON object with {', '.join(tool.parameters)}")
    return tool, arguments


def result_text(text: str) -> str:
    return f"{RESULT_OPEN}{text}{RESULT_CLOSE}"


def result_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the ``<result>...</result>`` parts of ``text``: what a supervised loss should skip,
    since the model never writes them itself."""
    return [m.span() for m in _RESULT.finditer(text)]


def render(text: str) -> str:
    """``text`` as graders read it: calculator calls as ``EXPR = VALUE``, other calls, failed calls and results
    removed, in either protocol (this one's ``<call>``/``<result>`` and the chat protocol's ``<tool_call>`` with
    its ``<tool_response>``, ``chat.render_call``), and a result cut by the token budget removed with all after
    it. Text without tool calls is unchanged. Every built-in reward reads responses so.

    >>> render("A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2")
    'A = pi*19^2/4 = 283.5 mm^2'
    """
    return render_with_origins(text)[0]


def render_with_origins(text: str) -> tuple[str, list[int]]:
    """:func:`render`'s text and, for each of its characters, the index in ``text`` it stands for, so that a
    span a grader finds in the rendered text can be placed on the response as generated (step rewards). A
    character kept from ``text`` points at itself; one that rendering writes (the expression, `` = ``, the
    value) points at the last character of the call and result it replaces, where the step is complete.

    >>> text = "x = <call>calculator: 2*3</call><result>6</result>!"
    >>> rendered, origins = render_with_origins(text)
    >>> rendered, text[origins[rendered.index("6")]], text[origins[-1]]
    ('x = 2*3 = 6!', '>', '!')
    """
    origins = list(range(len(text)))
    text, origins = _substitute(CALL_RESPONSE, render_call, text, origins)
    # whitespace the model wrote after </call> (a token may hold "</call>" and a newline) goes after the value;
    # a failed call states nothing (its error text's digits are not a value)
    text, origins = _substitute(
        _CALCULATED, lambda m: "" if failed(m["value"]) else f"{m['expr'].strip()} = {m['value'].strip()}{m['space']}",
        text, origins)
    text, origins = _substitute(_OTHER_CALL, lambda m: "", text, origins)
    # A result the token budget cut (no closing tag) ends the response; it is the tool's text, not the model's.
    cut = min(_unclosed(text, RESULT_OPEN, RESULT_CLOSE), _unclosed(text, RESPONSE_OPEN, RESPONSE_CLOSE))
    return text[:cut], origins[:cut]


def _unclosed(text: str, open_tag: str, close_tag: str) -> int:
    """Where the last ``open_tag`` of ``text`` starts if no ``close_tag`` follows it, else ``len(text)``."""
    at = text.rfind(open_tag)
    return at if at >= 0 and text.find(close_tag, at) < 0 else len(text)


def _substitute(pattern: re.Pattern, replace, text: str, origins: list[int]) -> tuple[str, list[int]]:
    """``pattern.sub(replace, text)`` that carries ``origins`` (one entry per character of ``text``) along."""
    pieces, new_origins, at = [], [], 0
    for m in pattern.finditer(text):
        written = replace(m)
        pieces += [text[at : m.start()], written]
        new_origins += origins[at : m.start()] + [origins[m.end() - 1]] * len(written)
        at = m.end()
    pieces.append(text[at:])
    new_origins += origins[at:]
    return "".join(pieces), new_origins


def with_calculator(reference_text: str, protocol: str = "text") -> str:
    """A gym reference solution with each ``KEY = expression = value unit`` line's value computed by the
    calculator: ``KEY = <call>calculator: expression</call><result>VALUE</result> unit``, VALUE the calculator's
    own result (4 significant figures). Lines without an expression are kept. An ``ANSWER:`` value that is a
    rewritten line's value becomes that line's new value, so the answer copies what the calculator said.

    ``protocol="chat"`` writes each call in the chat protocol's form, as graders read a chat rollout:
    ``KEY = <tool_call>\\n{"name": "calculator", "arguments": {"expression": ...}}\\n</tool_call><tool_response>VALUE</tool_response> unit``
    (``chat.call_text``; ``SFTTrainer`` renders each response as the chat template's tool turn).

    >>> with_calculator("SF = 240/62.36 = 3.848\\nANSWER: 3.848")
    'SF = <call>calculator: 240/62.36</call><result>3.849</result>\\nANSWER: 3.849'
    """
    if protocol not in ("text", "chat"):
        raise ValueError(f"with_calculator: protocol must be 'text' or 'chat', not {protocol!r}")
    new_values: dict[str, str] = {}

    def rewrite(m: re.Match) -> str:
        try:
            value = format_value(evaluate(m["expr"]))
        except CalculatorError:
            return m[0]
        new_values[m["value"]] = value
        if protocol == "chat":
            call = f"{call_text('calculator', {'expression': m['expr']})}{RESPONSE_OPEN}{value}{RESPONSE_CLOSE}"
        else:
            call = f"{CALL_OPEN}calculator: {m['expr']}{CALL_CLOSE}{result_text(value)}"
        return f"{m['key']} = {call}{m['unit']}"

    text = _STEP_LINE.sub(rewrite, reference_text)
    return _ANSWER_LINE.sub(lambda m: m["head"] + new_values.get(m["value"], m["value"]), text)
