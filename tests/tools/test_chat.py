"""The chat protocol's pieces without a model: a small Hermes/Qwen-style template written here, calls parsed from
their JSON, the template's tool turn found around a result, protocol detection per template, and graders'
rendering of chat-protocol calls."""

import pytest

from cohortrl.config import Config, ConfigError
from cohortrl.models import build_tiny_tokenizer
from cohortrl.rollout.tools import tool_protocol, toolset
from cohortrl.tools import Toolset, ToolError, ToolSetupError, chat, render, resolve_tools

# A Hermes / Qwen2.5-style template: the tools described in the system turn with the <tool_call> convention, the
# tool role rendered as its own turn holding <tool_response>. Written with explicit strings, so jinja's
# whitespace rules do not matter.
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\nFunctions:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nTo call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same with each tool described by its name only: prompts short enough for the tiny model's 1024 positions.
COMPACT_HERMES_TEMPLATE = HERMES_TEMPLATE.replace("(tool | tojson)", "tool.function.name")
assert COMPACT_HERMES_TEMPLATE != HERMES_TEMPLATE
# What that template puts around a tool result, between the model's call and its next turn.
TURN_BEFORE = "<|im_end|>\n<|im_start|>tool\n<tool_response>\n"
TURN_AFTER = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

# Tools described by the template, but called in another syntax (Llama 3.1 style JSON without tags).
OTHER_SYNTAX_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nAnswer with a JSON {\"name\": ..., \"parameters\": ...}. ' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def hermes_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def shout(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: what to repeat
    """
    return text.upper()


def convert(value: float, factor: float) -> float:
    """Multiply a value by a unit conversion factor.

    Args:
        value: the number to convert
        factor: the conversion factor
    """
    return value * factor


TOOLS = Toolset(resolve_tools(["calculator", shout, convert]))


def test_a_call_is_parsed_from_its_json():
    tool, args = chat.parse_call('x <tool_call>\n{"name": "convert", "arguments": {"value": 3, "factor": 1000}}\n</tool_call>', TOOLS)
    assert tool.name == "convert" and args == {"value": 3, "factor": 1000}
    assert tool(args) == 3000
    # arguments as a JSON string (OpenAI's wire form) are read too
    tool, args = chat.parse_call('<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>', TOOLS)
    assert (tool.name, args) == ("shout", {"text": "hi"})
    assert chat.called_name('<tool_call>{"name": "nope", "arguments": {}}</tool_call>') == "nope"
    assert chat.called_name("<tool_call>{oops</tool_call>") is None


@pytest.mark.parametrize("call, message", [
    ("<tool_call>{oops}</tool_call>", "the call is not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "the call has no tool name"),
    ('<tool_call>["calculator"]</tool_call>', "the call has no tool name"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "the arguments of calculator are not a JSON object"),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool 'nope' (tools: calculator, shout, convert)"),
])
def test_a_bad_call_is_a_tool_error_saying_why(call, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        chat.parse_call(call, TOOLS)


def test_the_tool_turn_is_what_the_template_renders_around_a_result():
    tok = hermes_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    before, after = chat.tool_turn(tok, messages, TOOLS.schemas(), "calculator", said="x = <tool_call>{}</tool_call>")
    assert (before, after) == (TURN_BEFORE, TURN_AFTER)
    # the turn glues the model's text to its continuation exactly as the template renders the conversation
    said, result, rest = 'x = <tool_call>{"name": "calculator"}</tool_call>', "5", "ANSWER: 5"
    prompt = tok.apply_chat_template(messages, tools=TOOLS.schemas(), tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": said}, {"role": "tool", "content": result},
                                                {"role": "assistant", "content": rest}], tools=TOOLS.schemas(), tokenize=False)
    assert prompt + said + before + result + after + rest + "<|im_end|>\n" == whole


def test_the_protocol_is_chosen_per_template():
    assert chat.unsupported_reason(hermes_tokenizer()) is None
    assert chat.unsupported_reason(build_tiny_tokenizer()) == "its chat template does not describe tools"  # SmolLM2's ChatML
    other = build_tiny_tokenizer()
    other.chat_template = OTHER_SYNTAX_TEMPLATE
    assert "another form than <tool_call>" in chat.unsupported_reason(other)

    def tools(fmt):
        return Toolset(resolve_tools(["calculator"]), format=fmt)

    assert tool_protocol(tools("auto"), hermes_tokenizer()) == "chat"
    assert tool_protocol(tools("auto"), build_tiny_tokenizer()) == "text"
    assert tool_protocol(tools("auto"), other) == "text"
    assert tool_protocol(tools("text"), hermes_tokenizer()) == "text"
    assert tool_protocol(tools("chat"), hermes_tokenizer()) == "chat"
    with pytest.raises(ToolSetupError, match="rollout.tool_format is chat, but the model cannot use it: its chat template does not describe tools"):
        tool_protocol(tools("chat"), build_tiny_tokenizer())
    # a template changed on the same tokenizer is checked again
    tok = build_tiny_tokenizer()
    assert tool_protocol(tools("auto"), tok) == "text"
    tok.chat_template = HERMES_TEMPLATE
    assert tool_protocol(tools("auto"), tok) == "chat"


def test_the_config_names_the_format():
    cfg = Config(rollout={"tools": ["calculator"], "tool_format": "chat"})
    assert toolset(cfg.rollout).format == "chat"
    assert toolset(Config(rollout={"tools": ["calculator"]}).rollout).format == "auto"
    with pytest.raises(ConfigError, match="rollout.tool_format"):
        Config(rollout={"tools": ["calculator"], "tool_format": "hermes"})


def test_graders_read_chat_calls_as_text_calls():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "pi*19^2/4"}}</tool_call>'
    assert render(f"A = {call}<tool_response>283.5</tool_response> mm^2") == "A = pi*19^2/4 = 283.5 mm^2"
    assert render(f"A = {call}<tool_response>283.5</tool_response> mm^2") == render(
        "A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2")
    # whitespace the model wrote after the call goes after the value; other tools' calls are scratch work
    assert render(f"A = {call}\n<tool_response>283.5</tool_response>next") == "A = pi*19^2/4 = 283.5\nnext"
    assert render('a <tool_call>{"name": "shout", "arguments": {"text": "x"}}</tool_call><tool_response>X</tool_response>b') == "a b"
    assert render("a <tool_call>{bad</tool_call><tool_response>error: ...</tool_response>b") == "a b"
    assert render("no calls = 3") == "no calls = 3"


def test_warm_starts_write_calls_in_the_chat_form_and_read_them_back():
    import doctest

    assert doctest.testmod(chat).failed == 0
    from cohortrl.tools import with_calculator

    written = with_calculator("SF = 240/62.36 = 3.848\nANSWER: 3.848", "chat")
    assert written == ('SF = <tool_call>\n{"name": "calculator", "arguments": {"expression": "240/62.36"}}\n</tool_call>'
                       "<tool_response>3.849</tool_response>\nANSWER: 3.849")
    assert parse_call_of(written) == ("calculator", {"expression": "240/62.36"})
    # graders read it as the text protocol's form
    assert render(written) == render(with_calculator("SF = 240/62.36 = 3.848\nANSWER: 3.848")) == "SF = 240/62.36 = 3.849\nANSWER: 3.849"
    exchanges, rest = chat.split_exchanges(written)
    assert exchanges == [(written.partition("<tool_response>")[0], "3.849")] and rest == "\nANSWER: 3.849"
    assert chat.split_exchanges("no calls") == ([], "no calls")
    with pytest.raises(ValueError, match="protocol must be 'text' or 'chat'"):
        with_calculator("x = 1+1 = 2", "hermes")


def parse_call_of(text: str):
    tool, arguments = chat.parse_call(text, TOOLS)
    return tool.name, arguments


@pytest.mark.parametrize("piece", ["<call>", "<tool_call>", "<call>calculator:", "<call>x</call>", "<call>x</call><result>",
                                   "<tool_call>{}</tool_call><tool_response>", "<result>", "</tool_call><tool_response>"])
def test_rendering_thousands_of_unclosed_tags_takes_linear_time(piece):
    """Issue 50: each lazy ``.*?`` scanned from every unclosed tag to the end of the text (quadratic: 5,000
    "<call>calculator:" took 3 s, 20,000 a minute); now each try stops at the next opening tag."""
    import time

    from cohortrl.tools import result_spans

    text = piece * 20_000
    start = time.process_time()
    render(text), result_spans(text), chat.split_exchanges(text)
    assert time.process_time() - start < 2.0
