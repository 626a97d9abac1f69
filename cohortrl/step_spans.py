"""The steps of a response as character spans, the response token where each step ends, and the protocol
(`StepSource`) a step-reward source follows.

A process reward is given per step, but the policy gradient is per token, so each step's reward must land on
the token that completes the step. Character spans come from the text (a step is a line by default, or the
pieces between a delimiter / regex matches); token positions come from decoding the response's own token ids
one prefix at a time, which is correct for any tokenizer: byte-level BPE, SentencePiece, tokens that hold
the end of one step and the start of the next, and multi-byte characters split across tokens
(`cohortrl.rollout.types.token_char_ends`). Where the completion is not the tokens' decoding (the chat
protocol of tool calls writes each tool turn as ``<tool_response>RESULT</tool_response>``, not as the
template's text the tokens hold), generation records each token's end in the completion instead:
`Rollout.char_ends` gives either, for every token of the response, tool tokens included. `StepSource` is what
the trainer calls for step rewards; `StepScores` what it returns per response.

Layer 1: it imports nothing from cohortrl. The process rewards (`cohortrl.rewards.process`) and the implicit
PRM (`cohortrl.reward_models.implicit_prm`, a `StepSource`) both build on it, so `rewards` can import
`reward_models` (the PRM loader, the implicit PRM) and never the other way round.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence

Span = tuple[int, int]  # [start, end) in characters of the decoded completion
StepScores = list[tuple[float, Span | None]]  # per response: (step reward, span or None for a missing step)


def split_steps(text: str, delimiter: str = "\n", regex: str | None = None) -> list[Span]:
    """Character spans of the non-blank steps of ``text``: pieces between ``delimiter`` (default: lines), or,
    with ``regex``, the pieces ending at its matches. A step keeps the delimiter that ends it ("x = 3;"), and
    each span is trimmed of surrounding whitespace (so a line's newline is not part of it)."""
    if regex is not None:
        cuts = [m.end() for m in re.finditer(regex, text)]
    else:
        cuts, at = [], 0
        while (found := text.find(delimiter, at)) != -1:
            at = found + len(delimiter)
            cuts.append(at)
    spans, start = [], 0
    for end in [*cuts, len(text)]:
        piece = text[start:end]
        if piece.strip():
            left = len(piece) - len(piece.lstrip())
            right = len(piece.rstrip())
            spans.append((start + left, start + right))
        start = end
    return spans


def step_end_tokens(spans: Sequence[Span], char_ends: Sequence[int]) -> list[int]:
    """The token holding each step's last character: the first token whose decoded end reaches the span's end.
    A step cut off by truncation ends on the response's last token."""
    if not char_ends:
        return []
    last = len(char_ends) - 1
    return [min(bisect_left(char_ends, end), last) for _, end in spans]


class StepSource:
    """A process reward as the trainer calls it. ``score`` gives each response of the rollout its
    ``(score, span)`` list; ``update`` shows a source that learns online (the implicit PRM) the batch's
    outcome labels after scoring and returns metrics for the log; ``state_dict`` / ``load_state_dict`` carry
    what it learned through a checkpoint. A process reward *function* (text in, steps out) is wrapped by
    `FunctionSteps`; only sources that need the rollout's token ids or the policy's weights subclass this."""

    name: str = "process"

    def score(self, rollout, columns: dict[str, list]) -> list[StepScores]:
        raise NotImplementedError

    def update(self, rollout, outcomes: Sequence[float | None]) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
