"""Tools a model may call in the middle of a response (docs/tools.md).

This package is low in the layers: it imports no rollout, reward or trainer code (only ``simulate`` reads the
gym's controller family). ``base``: the protocol (a tool is a typed, documented Python function), the registry
of built-ins and the guarded runner; ``calculator``: the safe expression evaluator; ``simulate``: the
controller family's try-it-first tool; ``text``: the ``<call>``/``<result>`` text protocol, ``render`` (both
protocols) and ``with_calculator``; ``chat``: the chat-template protocol (``<tool_call>{json}</tool_call>``, results
as the template's tool turn) for models whose template renders tools. Generation with tools lives in
``cohortrl/rollout/tools.py``, which picks the protocol per model.

The tool functions themselves are ``cohortrl.tools.calculator.calculator`` and
``cohortrl.tools.simulate.simulate`` (not re-exported here, where they would hide their modules' names).
"""

from cohortrl.tools.base import (
    MAX_RESULT_CHARS, Tool, ToolError, Toolset, ToolSetupError, builtin_tools, make_tool, resolve_tools, run_calls,
)
from cohortrl.tools.calculator import CalculatorError, evaluate, format_value
from cohortrl.tools.text import parse_call, render, result_spans, tool_prompt, with_calculator

__all__ = [
    "MAX_RESULT_CHARS", "CalculatorError", "Tool", "ToolError", "ToolSetupError", "Toolset", "builtin_tools", "evaluate",
    "format_value", "make_tool", "parse_call", "render", "resolve_tools", "result_spans", "run_calls", "tool_prompt",
    "with_calculator",
]
