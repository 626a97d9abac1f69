"""Tool calls inside a batch being decoded: found as rows write them, run, and fed back as tokens.

Decoding runs B rows in lock step, one token per row per step (``rollout/hf.py``). When a row finishes a call
(``</call>``, the text protocol of ``cohortrl/tools/text.py``), the calls of every row that finished one at this
step run together (``tools.run_calls``: threads, a time limit, errors as text), and each result,
``<result>TEXT</result>``, is queued as that row's next tokens. From the next step on, the row is fed its
queued tokens one per step in place of what it samples, while every other row goes on sampling: nothing
waits for a tool but the row that called it, and neither the KV cache nor the lean decoder needs to know, as
a fed token is a fed token. The price: a result of n tokens costs its row n decoding steps (batched with
everyone else's), and those count against ``sampling.max_new_tokens``.

The queued tokens are marked: ``tool_mask`` is 1 on them, and the rollout's ``response_mask`` has holes
there, so the loss, the KL, the entropy and the "generated" lengths leave them out.
"""

from __future__ import annotations

import torch

from cohortrl.tools import Toolset, resolve_tools, run_calls
from cohortrl.tools.base import ToolError
from cohortrl.tools.text import CALL_CLOSE, has_call, parse_call, result_text

# Tokens decoded to look for a finished call: enough to hold "</call>" however it is split, as for stop strings.
_WINDOW = len(CALL_CLOSE) + 2


def toolset(rollout_cfg, in_memory: dict | None = None) -> Toolset | None:
    """The config's ``rollout`` section as a :class:`Toolset` (None without tools); ``in_memory``: functions
    given in Python (``tools=[fn]``), by the name the config records for them."""
    if not rollout_cfg.tools:
        return None
    return Toolset(resolve_tools(rollout_cfg.tools, in_memory), rollout_cfg.max_tool_calls, rollout_cfg.tool_timeout_s)


class ToolSession:
    """The tool calls of one decoding batch of B rows (``rows``: the dataset row of each)."""

    def __init__(self, tools: Toolset, tokenizer, rows: list[dict]):
        B = len(rows)
        self.tools, self.tokenizer, self.rows = tools, tokenizer, rows
        self.history: list[list[int]] = [[] for _ in range(B)]  # every response token so far, per row
        self.since = [0] * B  # where each row's text after its last tool result starts (in history)
        self.queued: list[list[int]] = [[] for _ in range(B)]  # result tokens still to feed, per row
        self.calls = [0] * B
        self.errors = [0] * B
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
        return has_call(self.tokenizer.decode(recent))

    def _run(self, rows: list[int]) -> None:
        jobs = [self._job(i) for i in rows]
        for i, (text, failed) in zip(rows, run_calls(jobs, self.tools.timeout_s)):
            self.calls[i] += 1
            self.errors[i] += failed
            self.queued[i] = self._encode(result_text(text))
            self.since[i] = len(self.history[i])

    def _job(self, i: int):
        """What to run for row i's finished call: the tool, or a function raising why it cannot run."""
        text = self.tokenizer.decode(self.history[i][self.since[i]:])
        try:
            if self.calls[i] >= self.tools.max_calls:
                raise ToolError(f"no more tool calls in this response (the limit is {self.tools.max_calls})")
            tool, arguments = parse_call(text, self.tools)
        except ToolError as e:
            error = e

            def refuse():
                raise error
            return refuse
        row = self.rows[i]
        return lambda: tool(arguments, row)

    def _encode(self, text: str) -> list[int]:
        """Token ids of a result. Special-token strings in it stay text (a tool cannot end the response
        by returning "<|im_end|>")."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

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
