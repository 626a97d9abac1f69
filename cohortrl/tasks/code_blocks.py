"""Reading the program out of a response, for the code families (controller, python_function).

The prompt asks for one fenced block (```st ... ``` or ```python ... ```). Models often add prose around it
or write a draft first, so the LAST fenced block is graded, whatever its language tag; a response with no
fence at all is graded whole if it contains ``marker`` (":=" for Structured Text, "def " for Python), so a
bare program is not thrown away for its formatting.
"""

from __future__ import annotations

import re

# The optional tag and the spaces around it are one group, so a long run of spaces after a fence has one way
# to match, not quadratically many (``[ \t]*[tag]*[ \t]*`` backtracked over every split of the run).
_FENCED = re.compile(r"```[ \t]*(?:[A-Za-z0-9_+-]+[ \t]*)?\n(.*?)```", re.DOTALL)


def extract_code(completion: str, marker: str) -> tuple[str, tuple[int, int]] | None:
    """(code, its character span in the completion), or None when there is nothing to grade."""
    blocks = list(_FENCED.finditer(completion))
    if blocks:
        return blocks[-1].group(1), blocks[-1].span(1)
    if marker in completion:
        return completion, (0, len(completion))
    return None
