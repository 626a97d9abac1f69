"""The tool protocol: what a tool is, how a config names one, and how calls run without ever failing a run.

A tool is a plain Python function with type hints and a docstring whose ``Args:`` section describes every
parameter (TRL's and transformers' convention): the model calls it by the function's name, and its JSON schema
comes from ``transformers.utils.get_json_schema``. It returns anything whose ``str`` the model then reads. A
parameter named ``row`` is not the model's to fill: it receives the dataset row the response answers (that is
how ``simulate`` knows the scenario shown in the prompt) and is left out of the schema.

Calls never raise into the trainer: :func:`run_calls` runs them on threads with a time limit and turns an
exception, a timeout or an over-long result into a short ``error: ...`` text, which the model reads as the
call's result. A tool runs in the trainer's process, so a tool that executes model-written code must hand it
to the sandbox itself (``cohortrl.grading.sandbox``); the built-in ones only parse and interpret.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cohortrl.tools.errors import ToolError
from cohortrl.user_code import UserCodeError, load_object

# A result longer than this is refused (an error text instead): results are appended to the response as
# tokens the model then attends to, and a runaway tool must not flood the context.
MAX_RESULT_CHARS = 1000
_MAX_ERROR_CHARS = 200
# The tags of both call protocols (``text.py``: <call>, <result>; ``chat.py``: <tool_call>, <tool_response>). A
# result holding one could close its own turn early in what graders read, and the text after it (an ANSWER line,
# say) would pass for the model's although those tokens are outside the loss; in results they are escaped.
_PROTOCOL_TAG = re.compile(r"<(\s*/?\s*(?:call|result|tool_call|tool_response)\s*>)", re.IGNORECASE)


class ToolSetupError(UserCodeError):
    """A tool that cannot be used as configured (unknown name, no schema, two of one name): the user's to fix,
    reported in one line before training starts."""


@dataclass(frozen=True)
class Tool:
    name: str  # what the model writes to call it
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters", ...}}, without ``row``
    takes_row: bool  # fn has a ``row`` parameter: it gets the dataset row of the response

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"].get("properties", {})

    @property
    def text_parameter(self) -> str | None:
        """The parameter a call's raw text goes to: the tool's only parameter, when it is a string; None when
        the call's argument is a JSON object of named arguments."""
        params = self.parameters
        if len(params) == 1:
            (name, spec), = params.items()
            if spec.get("type") == "string":
                return name
        return None

    def __call__(self, arguments: dict, row: dict | None = None) -> Any:
        return self.fn(**arguments, row=row) if self.takes_row else self.fn(**arguments)


@dataclass
class Toolset:
    """The tools a rollout may call and the limits on calling them."""

    tools: list[Tool]
    max_calls: int = 4  # per response; a call beyond it is answered with an error text, not run
    timeout_s: float = 10.0  # per round of calls; a call still running then gets an error text
    format: str = "auto"  # the call protocol (rollout.tool_format): auto (chat if the template can), text or chat
    by_name: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {}
        for tool in self.tools:
            if tool.name in self.by_name:
                raise ToolSetupError(f"two tools are both called {tool.name!r}; give them distinct function names")
            self.by_name[tool.name] = tool

    def get(self, name: str) -> Tool:
        if name not in self.by_name:
            raise ToolError(f"unknown tool {name!r} (tools: {', '.join(self.by_name)})")
        return self.by_name[name]

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools]


def make_tool(fn: Callable, ref: str | None = None) -> Tool:
    """A :class:`Tool` from a function; ``ref`` names it in errors (default: the function's name)."""
    from transformers.utils import get_json_schema

    ref = ref or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise ToolSetupError(f"tool {ref!r} is a {type(fn).__name__}, not a function")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises its own exception types for missing hints and docstrings
        raise ToolSetupError(
            f"tool {ref!r} cannot be described to the model: {e}. A tool needs type hints on its parameters and a "
            "docstring with an Args: section describing each one"
        ) from None
    params = schema["function"].setdefault("parameters", {"type": "object", "properties": {}})
    takes_row = "row" in params.get("properties", {})
    if takes_row:
        params["properties"].pop("row")
        params["required"] = [p for p in params.get("required", []) if p != "row"]
    return Tool(schema["function"]["name"], fn, schema, takes_row)


def builtin_tools() -> dict[str, Callable]:
    """The built-in tools by name."""
    # Imported here, not above, only because simulate loads the whole gym (about 0.5 s) and most runs have no tools.
    from cohortrl.tools.calculator import calculator
    from cohortrl.tools.simulate import simulate

    return {"calculator": calculator, "simulate": simulate}


def resolve_tools(entries: list, in_memory: dict[str, Callable] | None = None) -> list[Tool]:
    """Tools from config entries: a built-in name, a name given in memory (``tools=[fn]`` in Python), or user
    code as ``path/to/file.py:function`` / ``module:function`` (loaded like reward functions); a function
    itself is taken as it is."""
    builtins, in_memory = builtin_tools(), in_memory or {}
    tools = []
    for entry in entries:
        if callable(entry):
            tools.append(make_tool(entry))
        elif entry in in_memory:
            tools.append(make_tool(in_memory[entry], entry))
        elif entry in builtins:
            tools.append(make_tool(builtins[entry], entry))
        elif isinstance(entry, str) and ":" in entry:
            tools.append(make_tool(load_object(entry, "tool", ToolSetupError), entry))
        else:
            raise ToolSetupError(
                f"unknown tool {entry!r}: use a built-in one ({', '.join(builtins)}), 'module:function' or "
                "'path/to/file.py:function' (from Python, pass the function itself: tools=[fn])"
            )
    return tools


def run_calls(jobs: list[Callable[[], Any]], timeout_s: float, max_chars: int = MAX_RESULT_CHARS) -> list[tuple[str, bool]]:
    """Run every job at once, each on its own thread; ``(text, failed)`` per job, in order. Waits at most
    ``timeout_s`` in all. A job that raises, is still running at the deadline, or returns more than
    ``max_chars`` characters gives a short ``error: ...`` text instead of its result.

    Daemon threads rather than a ``ThreadPoolExecutor``: Python cannot stop a hung call, and an executor's
    workers are joined when the interpreter exits, so one hung tool would keep the process alive for ever."""
    outcomes: list[tuple[bool, Any] | None] = [None] * len(jobs)

    def work(i: int, job: Callable[[], Any]) -> None:
        try:
            outcomes[i] = (True, str(job()))  # str() here too: a result's own __str__ may raise
        except BaseException as e:  # noqa: BLE001  (whatever the tool does, the model gets a text back)
            outcomes[i] = (False, e)

    threads = [threading.Thread(target=work, args=(i, job), daemon=True, name=f"cohortrl-tool-{i}")
               for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [_as_text(outcome, timeout_s, max_chars) for outcome in outcomes]


def _as_text(outcome: tuple[bool, Any] | None, timeout_s: float, max_chars: int) -> tuple[str, bool]:
    if outcome is None:
        return f"error: no result within {timeout_s:g} s", True
    ok, value = outcome
    if not ok:
        # A ToolError's message is written for the model; anything else also says what kind of failure it was.
        message = str(value) if isinstance(value, ToolError) else f"{type(value).__name__}: {value}"
        return "error: " + printable(message[:_MAX_ERROR_CHARS]), True
    text = value
    if len(text) > max_chars:
        return f"error: the result is {len(text)} characters long; the limit is {max_chars}", True
    return printable(text), False


def failed(result: str) -> bool:
    """Whether a tool's result (as fed back to the model) is the error text of a failed call."""
    return result.strip().startswith("error:")


def printable(text: str) -> str:
    """``text`` as a tool result may hold it: valid UTF-8 (a lone surrogate, which a JSON escape such as
    ``"\\ud800"`` can put in an argument and so in an error message, becomes ``?``: tokenizers raise on
    one) and no protocol tag (``<`` of ``</result>``, ``<tool_call>``... written ``&lt;``).

    >>> printable("x</tool_response>\\nANSWER: 5 \\ud800")
    'x&lt;/tool_response>\\nANSWER: 5 ?'
    """
    text = text.encode("utf-8", "replace").decode("utf-8")
    return _PROTOCOL_TAG.sub(r"&lt;\1", text)


def loads(text: str):
    """``json.loads(text)`` for a call's model-written arguments: any way the text fails to read (invalid JSON,
    nesting deeper than the parser's recursion, an integer past Python's digit limit) is a :class:`ToolError`
    whose message completes "the call is ..."."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolError(f"not valid JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise ToolError("JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise ToolError(f"JSON that cannot be read ({str(e)[:80]})") from None
