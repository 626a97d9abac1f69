"""Tool calls inside a batch being decoded: found as rows write them, run, and fed back as tokens.

Decoding runs B rows in lock step, one token per row per step (``rollout/hf.py``). When a row finishes a call
(``</call>`` in the text protocol of ``cohortrl/tools/text.py``, ``</tool_call>`` in the chat protocol of
``cohortrl/tools/chat.py``; :func:`tool_protocol` picks one per model), the calls of every row that finished one
at this step run together (``tools.run_calls``: threads, a time limit, errors as text), and each result is
queued as that row's next tokens: ``<result>TEXT</result>`` in the text protocol, the chat template's tool turn
(end of turn, tool header, result, end of turn, assistant header) in the chat protocol. From the next step on,
the row is fed its queued tokens one per step in place of what it samples, while every other row goes on
sampling: nothing waits for a tool but the row that called it, and neither the KV cache nor the lean decoder
needs to know, as a fed token is a fed token. The price: a result of n tokens costs its row n decoding steps
(batched with everyone else's), and those count against ``sampling.max_new_tokens``.

The queued tokens are marked: ``tool_mask`` is 1 on them, and the rollout's ``response_mask`` has holes
there, so the loss, the KL, the entropy and the "generated" lengths leave them out.
"""

from __future__ import annotations

import logging
import weakref

import torch

from cohortrl.rollout.types import token_char_ends
from cohortrl.tools import Toolset, chat, resolve_tools, run_calls, text
from cohortrl.tools.base import ToolError, ToolSetupError, printable

log = logging.getLogger("cohortrl")

# Tokens decoded to look for a finished call: enough to hold "</tool_call>" however it is split, as for stop strings.
_WINDOW = max(len(text.CALL_CLOSE), len(chat.CALL_CLOSE)) + 2
_TEMPLATE_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its template, reason or None)


def toolset(rollout_cfg, in_memory: dict | None = None) -> Toolset | None:
    """The config's ``rollout`` section as a :class:`Toolset` (None without tools); ``in_memory``: functions
    given in Python (``tools=[fn]``), by the name the config records for them."""
    if not rollout_cfg.tools:
        return None
    return Toolset(resolve_tools(rollout_cfg.tools, in_memory), rollout_cfg.max_tool_calls, rollout_cfg.tool_timeout_s,
                   rollout_cfg.tool_format)


def tool_protocol(tools: Toolset, tokenizer) -> str:
    """``"chat"`` or ``"text"``: the protocol ``tools.format`` (``rollout.tool_format``) gives with this tokenizer.
    ``auto`` is chat when the chat template can drive it (``chat.unsupported_reason``), else text; ``chat`` on
    a template that cannot is a :class:`ToolSetupError`. The template is checked once per tokenizer."""
    if tools.format == "text":
        return "text"
    template = getattr(tokenizer, "chat_template", None)
    checked = _TEMPLATE_CHECKS.get(tokenizer)
    if checked is None or checked[0] != template:
        checked = (template, chat.unsupported_reason(tokenizer))
        _TEMPLATE_CHECKS[tokenizer] = checked
        if tools.format == "auto":
            log.info("tool calls use the %s protocol (docs/tools.md)%s", "chat" if checked[1] is None else "text",
                     f", not the chat template's: {checked[1]}" if checked[1] else "")
    reason = checked[1]
    if reason is None:
        return "chat"
    if tools.format == "chat":
        raise ToolSetupError(f"rollout.tool_format is chat, but the model cannot use it: {reason}. Use "
                             "rollout.tool_format=text (or auto, which picks text for this model)")
    return "text"


class ToolSession:
    """The tool calls of one decoding batch of B rows (``rows``: the dataset row of each).

    ``messages``: in the chat protocol, each row's prompt as chat messages (``data.prompt_messages``), from which
    the template renders its tool turns, and ``schemas`` the tools' JSON schemas it was given; None (the
    default): the text protocol."""

    def __init__(self, tools: Toolset, tokenizer, rows: list[dict], messages: list[list[dict]] | None = None,
                 schemas: list[dict] | None = None):
        B = len(rows)
        self.tools, self.tokenizer, self.rows = tools, tokenizer, rows
        self.protocol = text if messages is None else chat
        self.messages, self.schemas = messages, schemas
        self.dialog = [[dict(m) for m in row] for row in messages] if messages is not None else None  # + tool turns
        self.history: list[list[int]] = [[] for _ in range(B)]  # every response token so far, per row
        self.since = [0] * B  # where each row's text after its last tool result starts (in history)
        self.queued: list[list[int]] = [[] for _ in range(B)]  # result tokens still to feed, per row
        self.calls = [0] * B
        self.errors = [0] * B
        # chat protocol, per row: each tool turn's (start in history, tokens before the result, result tokens,
        # tokens in all, result text)
        self.turns: list[list[tuple]] = [[] for _ in range(B)]
        self.fed: list[torch.Tensor] = []  # per step, (B,) bool: the token came from a tool

    def feed(self, token_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's tokens with queued result tokens in place of the sampled ones, and which rows got one."""
        fed_B = torch.tensor([bool(q) for q in self.queued])
        if fed_B.any():
            token_B = token_B.clone()
            for i in fed_B.nonzero().flatten().tolist():
                token_B[i] = self.queued[i].pop(0)
        self.fed.append(fed_B)
        return token_B, fed_B.to(token_B.device)

    def after_step(self, token_B: torch.Tensor, ended_B: torch.Tensor) -> None:
        """Record this step's tokens; run the calls rows have just finished and queue their results."""
        fed = self.fed[-1].tolist()
        ended = ended_B.tolist()
        finished = []
        for i, token in enumerate(token_B.tolist()):
            self.history[i].append(token)
            if fed[i]:
                self.since[i] = len(self.history[i])
            elif not ended[i] and self._call_finished(i):
                finished.append(i)
        if finished:
            self._run(finished)

    def _call_finished(self, i: int) -> bool:
        recent = self.history[i][max(self.since[i], len(self.history[i]) - _WINDOW):]
        return self.protocol.has_call(self.tokenizer.decode(recent))

    def _run(self, rows: list[int]) -> None:
        said = {i: self.tokenizer.decode(self.history[i][self.since[i]:]) for i in rows}
        jobs = [self._job(i, said[i]) for i in rows]
        for i, (result, failed) in zip(rows, run_calls(jobs, self.tools.timeout_s)):
            self.calls[i] += 1
            try:
                self.queued[i] = self._turn(i, said[i], result)
            except Exception as e:  # noqa: BLE001  (whatever the model wrote, the call gets a result and decoding goes on)
                result, failed = printable(f"error: the result could not be rendered ({type(e).__name__}: {e})"[:200]), True
                self.queued[i] = self._turn(i, "", result)
            self.errors[i] += failed
            self.since[i] = len(self.history[i])

    def _turn(self, i: int, said: str, result: str) -> list[int]:
        """The tokens that answer row i's call with ``result``, in the row's protocol."""
        return self._encode(result) if self.messages is None else self._chat_turn(i, said, result)

    def _job(self, i: int, said: str):
        """What to run for row i's finished call: the tool, or a function raising why it cannot run."""
        try:
            if self.calls[i] >= self.tools.max_calls:
                raise ToolError(f"no more tool calls in this response (the limit is {self.tools.max_calls})")
            tool, arguments = self.protocol.parse_call(said, self.tools)
        except Exception as e:  # noqa: BLE001  (a ToolError says why; anything else is reported as what it is)
            error = e

            def refuse():
                raise error
            return refuse
        row = self.rows[i]
        return lambda: tool(arguments, row)

    def _encode(self, result: str) -> list[int]:
        """The text protocol's ``<result>`` tokens."""
        return self._text_ids(text.result_text(result))

    def _text_ids(self, result: str) -> list[int]:
        """Token ids of a tool's text. Special-token strings in it stay text (a tool cannot end the response
        by returning "<|im_end|>")."""
        return self.tokenizer(result, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _chat_turn(self, i: int, said: str, result: str) -> list[int]:
        """The chat template's tool turn after row i's call (``said``: the row's text since its last turn), as
        token ids: the template's own text (special tokens and all) around the result's (tokenized as text)."""
        name = chat.called_name(said)
        name = name if name in self.tools.by_name else None  # only a real tool's name reaches the template
        try:
            before, after = chat.tool_turn(self.tokenizer, self.dialog[i], self.schemas, name, said)
        except Exception:  # noqa: BLE001  (the model's text made the template fail: the turn after the bare prompt)
            before, after = chat.tool_turn(self.tokenizer, self.messages[i], self.schemas, name)
        own = lambda s: self.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        head, body, tail = own(before), self._text_ids(result), own(after)
        self.turns[i].append((len(self.history[i]), len(head), body, len(head) + len(body) + len(tail), result))
        # later calls' turns are rendered after this exchange, as the template renders a conversation
        self.dialog[i] = chat.continue_dialog(self.dialog[i], said, result, name)
        return head + body + tail

    def completions(self, response_ids: torch.Tensor, lengths_B: torch.Tensor) -> tuple[list[str], list[list[int]]]:
        """The chat protocol's completion texts: each row's own tokens decoded (special tokens skipped) with each
        tool turn written ``<tool_response>RESULT</tool_response>``, what graders and reward functions read
        (``tools.render``); a turn cut by the budget shows the part of its result that was fed, unclosed.

        Also, per row, where each of its ``length`` tokens ends in that text (``Rollout.completion_ends``), which
        decoding the tokens cannot give, as they hold the template's turn: the model's tokens end where their
        decoding does, a turn's head where ``<tool_response>`` does, its result's tokens where their decoding
        does inside the result, its tail where the turn's text does."""
        def decode(part: list[int]) -> str:
            return self.tokenizer.decode(part, skip_special_tokens=True)

        texts, all_ends = [], []
        for i, (ids, length) in enumerate(zip(response_ids.tolist(), lengths_B.tolist())):
            ids, pieces, ends, at = ids[:length], [], [], 0
            base = 0  # characters written so far

            def add(piece: str, piece_ends: list[int]) -> None:
                nonlocal base
                pieces.append(piece)
                ends.extend(base + min(e, len(piece)) for e in piece_ends)
                base += len(piece)

            for start, n_head, body, n_turn, result in self.turns[i]:
                if start >= length:
                    break
                add(decode(ids[at:start]), token_char_ends(self.tokenizer, ids[at:start]))
                n = min(n_turn, length - start)  # the turn's tokens in the response
                shown = n - n_head  # of which result and tail
                result_ends = [len(chat.RESPONSE_OPEN) + e for e in token_char_ends(self.tokenizer, body[:max(0, shown)])]
                if shown >= len(body) and start + n_turn <= length:
                    piece = f"{chat.RESPONSE_OPEN}{result}{chat.RESPONSE_CLOSE}"
                elif shown > 0:
                    piece = chat.RESPONSE_OPEN + decode(body[:shown])
                else:
                    piece = ""
                head_end = len(chat.RESPONSE_OPEN) if shown > 0 else 0
                add(piece, [head_end] * min(n, n_head) + result_ends + [len(piece)] * max(0, shown - len(body)))
                at = start + n_turn
            add(decode(ids[at:]), token_char_ends(self.tokenizer, ids[at:]))
            texts.append("".join(pieces))
            all_ends.append(ends)
        return texts, all_ends

    def tool_mask(self, T: int) -> torch.Tensor:
        """(B, T) long: 1 on tokens a tool supplied."""
        fed = torch.stack(self.fed, dim=1) if self.fed else torch.zeros(len(self.rows), 0, dtype=torch.bool)
        return torch.nn.functional.pad(fed, (0, T - fed.shape[1])).long()

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(calls (B,), errors (B,)) per response."""
        return torch.tensor(self.calls), torch.tensor(self.errors)


def tool_metrics(rollout, total=lambda counts: counts) -> dict:
    """Tool use over a rollout: calls per response, the share of calls that returned an error, and result
    tokens against the model's own. ``total`` sums the counts over processes (``Dist.sum``); {} without tools."""
    if rollout.tool_mask is None:
        return {}
    counts = total({
        "responses": float(rollout.batch_size), "calls": float(rollout.tool_calls.sum()),
        "errors": float(rollout.tool_errors.sum()), "tool_tokens": float(rollout.tool_mask.sum()),
        "generated_tokens": float(rollout.response_mask.sum()),
    })
    return {
        "tools/calls_per_response": counts["calls"] / max(1.0, counts["responses"]),
        "tools/error_rate": counts["errors"] / counts["calls"] if counts["calls"] else None,
        "tools/result_tokens_mean": counts["tool_tokens"] / max(1.0, counts["responses"]),
        "tools/result_token_share": counts["tool_tokens"] / max(1.0, counts["tool_tokens"] + counts["generated_tokens"]),
    }
