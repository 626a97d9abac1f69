"""The chat protocol of tool calls, for models whose chat template renders tools (Qwen2.5, Qwen3, Hermes-style
templates; docs/tools.md says when it is chosen):

    the prompt       the template's own description of the tools: ``apply_chat_template(messages, tools=schemas)``
    <tool_call>{"name": NAME, "arguments": {...}}</tool_call>
                     written by the model; decoding of that response pauses right after ``</tool_call>``
    the tool turn    what the template renders between the model's text and its next turn when a
                     ``{"role": "tool", "content": RESULT}`` message follows: end of turn, the tool turn's header,
                     RESULT, end of turn, the assistant's header. Appended by the rollout as tokens that are not
                     the model's; decoding goes on after it.

:func:`tool_turn` finds that text by rendering the conversation with markers where the model's text ends and
where the result goes, so whatever a template puts around a tool result is reproduced as it renders it;
:func:`continue_dialog` extends the conversation by one exchange, for the next turn's rendering.
:func:`unsupported_reason` says why a template cannot drive the protocol (None when it can).

Graders and reward functions read each tool turn as ``<tool_response>RESULT</tool_response>`` right after the
call, whatever the template wraps around the result (the token ids hold the template's rendering);
:func:`render_call` turns a calculator call with its result into ``EXPR = VALUE``, as ``text.render`` does
for the text protocol. :func:`call_text` writes a call as the model is taught to (supervised warm starts,
``text.with_calculator``), and :func:`split_exchanges` cuts a completion in that form back into the model's
texts and the results, which ``SFTTrainer`` renders as the rollout would.
"""

from __future__ import annotations

import json
import re

from cohortrl.tools.base import Tool, ToolError, Toolset, ToolSetupError, failed, loads

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# Markers rendered in place of the model's text and of a result: text no model writes and no template alters.
_SAID, _RESULT = "\u2063cohortrl-said\u2063", "\u2063cohortrl-result\u2063"
_PROBE = {"type": "function", "function": {
    "name": "cohortrl_probe_tool", "description": "Repeat a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "the text"}},
                   "required": ["text"]},
}}


def without(tag: str) -> str:
    """A regex for the shortest text up to what follows that holds no ``tag``: a search over thousands of
    unclosed tags then stops each try at the next one (linear time) instead of scanning to the end (quadratic)."""
    return rf"(?:(?!{re.escape(tag)}).)*?"


_EXCHANGE = re.compile(rf"</tool_call>\s*(?P<open><tool_response>)(?P<result>{without(RESPONSE_OPEN)})</tool_response>", re.DOTALL)
CALL_RESPONSE = re.compile(rf"<tool_call>(?P<call>{without(CALL_OPEN)})</tool_call>(?P<space>\s*)<tool_response>"
                           rf"(?P<value>{without(RESPONSE_OPEN)})</tool_response>", re.DOTALL)


def call_text(name: str, arguments: dict) -> str:
    """A call as the model writes it: ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, the
    form the Hermes-style templates of Qwen2.5, Qwen3 and Hermes ask for (the JSON on its own line).

    >>> call_text("calculator", {"expression": "2*3"})
    '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2*3"}}\\n</tool_call>'
    """
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def has_call(text: str) -> bool:
    """Whether ``text`` (a response since its last tool turn) holds a finished call."""
    return CALL_CLOSE in text


def _name_and_arguments(body: str) -> tuple[str, dict]:
    """NAME and ARGUMENTS of a call's JSON ``{"name": NAME, "arguments": {...}}``; ARGUMENTS may also come as a
    JSON string holding the object (OpenAI's wire form). Raises :class:`ToolError` saying what is wrong."""
    form = 'a call is the JSON object {"name": NAME, "arguments": {...}} between the tool_call tags'
    try:
        call = loads(body)
    except ToolError as e:
        raise ToolError(f"the call is {e}; {form}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError(f"the call has no tool name; {form}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments)
        except ToolError:
            pass
    if not isinstance(arguments, dict):
        raise ToolError(f"the arguments of {call['name']} are not a JSON object; {form}")
    return call["name"], arguments


def parse_call(text: str, toolset: Toolset) -> tuple[Tool, dict]:
    """The tool and arguments of the first finished call in ``text``; raises :class:`ToolError` (its message is
    the call's result) when there is none that can be run."""
    end = text.find(CALL_CLOSE)
    start = text.rfind(CALL_OPEN, 0, end)
    if end < 0 or start < 0:
        raise ToolError('a call is the JSON object {"name": NAME, "arguments": {...}} between the tool_call tags')
    name, arguments = _name_and_arguments(text[start + len(CALL_OPEN) : end].strip())
    return toolset.get(name), arguments


def called_name(text: str) -> str | None:
    """The tool name of the first finished call in ``text``, if it can be read (for the tool message)."""
    end = text.find(CALL_CLOSE)
    start = text.rfind(CALL_OPEN, 0, end)
    if end < 0 or start < 0:
        return None
    try:
        return _name_and_arguments(text[start + len(CALL_OPEN) : end].strip())[0]
    except ToolError:
        return None


def tool_turn(tokenizer, messages: list[dict], schemas: list[dict], name: str | None = None,
              said: str = "") -> tuple[str, str]:
    """(before, after): the text the chat template puts between the end of the model's text and the result of a
    tool call, and between the result and the model's next turn (its assistant header included).

    ``messages``: the conversation before the model's text ``said`` (the prompt's messages, then the earlier
    assistant texts and tool messages of this response); a final assistant message there is one ``said``
    continues. ``name``: the called tool's, given to the tool message as templates that show it expect."""
    convo = [dict(m) for m in messages]
    if convo and convo[-1]["role"] == "assistant":
        said = convo.pop()["content"] + said
    tool_message = {"role": "tool", "content": _RESULT} | ({"name": name} if name else {})
    convo += [{"role": "assistant", "content": said + _SAID}, tool_message]
    text = tokenizer.apply_chat_template(convo, tools=schemas, tokenize=False, add_generation_prompt=True)
    if text.count(_SAID) != 1 or text.count(_RESULT) != 1 or text.find(_SAID) > text.find(_RESULT):
        raise ToolSetupError("the chat template does not render an assistant message followed by a tool message "
                             "with their contents as given")
    before, _, after = text.partition(_SAID)[2].partition(_RESULT)
    return before, after


def continue_dialog(dialog: list[dict], said: str, result: str, name: str | None = None) -> list[dict]:
    """The conversation ``dialog`` (as :func:`tool_turn` takes it) followed by the model's text ``said``, which
    ends in a call, and the tool message with its ``result``: what the next tool turn is rendered after, as the
    template renders a conversation. A final assistant message in ``dialog`` is one ``said`` continues."""
    dialog = [dict(m) for m in dialog]
    if dialog and dialog[-1]["role"] == "assistant":
        dialog[-1]["content"] += said
    else:
        dialog.append({"role": "assistant", "content": said})
    dialog.append({"role": "tool", "content": result} | ({"name": name} if name else {}))
    return dialog


def split_exchanges(text: str) -> tuple[list[tuple[str, str]], str]:
    """A completion in the form graders read (each call followed by ``<tool_response>RESULT</tool_response>``)
    as ``([(said, result), ...], rest)``: the model's text through each call (whitespace before the response
    included), the call's result, and the text after the last response. Text without responses is ``([], text)``.

    >>> split_exchanges("A = <tool_call>{}</tool_call><tool_response>6</tool_response> N")
    ([('A = <tool_call>{}</tool_call>', '6')], ' N')
    """
    exchanges, at = [], 0
    for m in _EXCHANGE.finditer(text):
        exchanges.append((text[at : m.start("open")], m["result"]))
        at = m.end()
    return exchanges, text[at:]


def unsupported_reason(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot drive the chat protocol, or None when it can: it must describe
    the ``tools`` it is given, ask for calls as ``<tool_call>...</tool_call>`` and render a tool message."""
    user = [{"role": "user", "content": "hi"}]
    try:
        prompt = tokenizer.apply_chat_template(user, tools=[_PROBE], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may raise anything (jinja's own errors, raise_exception)
        return f"its chat template fails when given tools ({type(e).__name__}: {e})"
    if _PROBE["function"]["name"] not in prompt:
        return "its chat template does not describe tools"
    if CALL_OPEN not in prompt:
        return f"its chat template asks for tool calls in another form than {CALL_OPEN}{{json}}{CALL_CLOSE}"
    try:
        tool_turn(tokenizer, user, [_PROBE], _PROBE["function"]["name"])
    except Exception as e:
        return f"its chat template cannot render a tool message ({type(e).__name__}: {e})"
    return None


def render_call(m: re.Match) -> str:
    """One :data:`CALL_RESPONSE` match (a chat-protocol call and its ``<tool_response>``) as graders read it:
    ``EXPR = VALUE`` for a calculator call, else ``""`` (``text.render`` applies it to a whole response).

    >>> render_call(CALL_RESPONSE.search('A = <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call><tool_response>6</tool_response> N'))
    '2*3 = 6'
    """
    try:
        name, arguments = _name_and_arguments(m["call"].strip())
    except ToolError:
        return ""
    expression = next(iter(arguments.values())) if len(arguments) == 1 else None
    if name != "calculator" or not isinstance(expression, str) or failed(m["value"]):
        return ""  # a failed call states nothing (its error text's digits are not a value)
    return f"{expression.strip()} = {m['value'].strip()}{m['space']}"
