"""The rollout batch: what generation hands to scoring, advantages and the update.

Dimension letters (used as suffixes and in comments throughout cohortrl):
    P prompts, G responses per prompt, B = P·G sequences, Tp prompt tokens (left-padded),
    T response tokens (right-padded), S steps, V vocabulary.
Groups are contiguous: rows ``k*G … k*G+G-1`` answer prompt k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, Tp) left-padded prompt tokens (chat template applied)
    prompt_mask: torch.Tensor  # (B, Tp) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) generated tokens, right-padded with the pad id
    # (B, T) 1 on the model's own tokens up to and including EOS / the stop string; 0 on padding and on tool
    # results (holes): what the loss, the KL, the entropy and the generated lengths count
    response_mask: torch.Tensor
    truncated: torch.Tensor  # (B,) bool: hit max_new_tokens without EOS or a stop string
    completions: list[str]  # (B,) decoded responses, without special tokens
    group_size: int  # G
    rows: list[dict] = field(default_factory=list)  # (B,) the dataset row each response answers
    # (B, T) log-probs under the sampler's own numerics (vLLM; the lean decoder's bf16 products, unrecorded);
    # None: the trainer's numerics
    sampling_logp: torch.Tensor | None = None
    # The decoding forward, kept for the update's backward (cpu/replay.py); only for these rows as generated:
    # ``select`` and ``concat`` drop it.
    replay: object | None = field(default=None, repr=False)
    # Tool calls (rollout/tools.py); None when the rollout ran without tools.
    tool_mask: torch.Tensor | None = None  # (B, T) 1 on tokens a tool supplied (inside the response, not the model's)
    tool_calls: torch.Tensor | None = None  # (B,) calls made by each response
    tool_errors: torch.Tensor | None = None  # (B,) of those, calls whose result was an error text
    # Per response, where each of its tokens (every token of ``sequence_mask``, in order) ends in its completion
    # text, recorded where that text is not the tokens' own decoding (the chat protocol writes each tool turn as
    # <tool_response>RESULT</tool_response>); None (the whole field or a row's entry): the tokens' decoding is the
    # completion. Read it through ``char_ends``.
    completion_ends: list[list[int] | None] | None = None

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:  # (B,) response tokens the model generated (tool results not counted)
        return self.response_mask.sum(-1)

    @property
    def sequence_mask(self) -> torch.Tensor:  # (B, T) 1 on every response token, the model's and the tools'
        return self.response_mask if self.tool_mask is None else self.response_mask | self.tool_mask

    def char_ends(self, i: int, tokenizer) -> list[int]:
        """Where each of response ``i``'s tokens (every token of ``sequence_mask``) ends in ``completions[i]``,
        in characters: what maps a character span of the completion (a step) to the token that completes it."""
        if self.completion_ends is not None and self.completion_ends[i] is not None:
            return list(self.completion_ends[i])
        return token_char_ends(tokenizer, self.response_ids[i][self.sequence_mask[i].bool()].tolist())

    def input_ids(self) -> torch.Tensor:  # (B, Tp + T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> torch.Tensor:  # (B, Tp + T): the model attends to tool results as it did decoding
        return torch.cat([self.prompt_mask, self.sequence_mask], dim=1)

    def select(self, index: torch.Tensor | list[int]) -> "Rollout":
        """The rows in ``index`` (keep whole groups to keep group structure)."""
        index = torch.as_tensor(index, dtype=torch.long)
        rows = [self.rows[i] for i in index.tolist()] if self.rows else []
        return Rollout(
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            response_ids=self.response_ids[index],
            response_mask=self.response_mask[index],
            truncated=self.truncated[index],
            completions=[self.completions[i] for i in index.tolist()],
            group_size=self.group_size,
            rows=rows,
            sampling_logp=self.sampling_logp[index] if self.sampling_logp is not None else None,
            **{name: getattr(self, name)[index] for name in _TOOL_FIELDS if getattr(self, name) is not None},
            completion_ends=[self.completion_ends[i] for i in index.tolist()] if self.completion_ends is not None else None,
        )

    @staticmethod
    def concat(parts: list["Rollout"], pad_id: int) -> "Rollout":
        """Join rollouts, re-padding prompts on the left and responses on the right."""
        Tp = max(r.prompt_ids.shape[1] for r in parts)
        T = max(r.response_ids.shape[1] for r in parts)

        def left(x, width, value):
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x, width, value):
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        return Rollout(
            prompt_ids=torch.cat([left(r.prompt_ids, Tp, pad_id) for r in parts]),
            prompt_mask=torch.cat([left(r.prompt_mask, Tp, 0) for r in parts]),
            response_ids=torch.cat([right(r.response_ids, T, pad_id) for r in parts]),
            response_mask=torch.cat([right(r.response_mask, T, 0) for r in parts]),
            truncated=torch.cat([r.truncated for r in parts]),
            completions=[c for r in parts for c in r.completions],
            group_size=parts[0].group_size,
            rows=[row for r in parts for row in r.rows],
            sampling_logp=torch.cat([right(r.sampling_logp, T, 0.0) for r in parts])
            if all(r.sampling_logp is not None for r in parts) else None,
            **_concat_tools(parts, T),
            completion_ends=None if all(r.completion_ends is None for r in parts)
            else [e for r in parts for e in (r.completion_ends or [None] * r.batch_size)],
        )


_TOOL_FIELDS = ("tool_mask", "tool_calls", "tool_errors")


def _concat_tools(parts: list[Rollout], T: int) -> dict:
    """The tool fields of joined rollouts: parts without tools count as no calls and no tool tokens."""
    if all(r.tool_mask is None for r in parts):
        return {}

    def mask(r):
        m = r.tool_mask if r.tool_mask is not None else torch.zeros_like(r.response_mask)
        return torch.nn.functional.pad(m, (0, T - m.shape[1]))

    def count(r, name):
        value = getattr(r, name)
        return value if value is not None else torch.zeros(r.batch_size, dtype=torch.long)

    return {"tool_mask": torch.cat([mask(r) for r in parts]),
            **{name: torch.cat([count(r, name) for r in parts]) for name in ("tool_calls", "tool_errors")}}


def token_char_ends(tokenizer, token_ids: Sequence[int]) -> list[int]:
    """For each response token k, the length of the decoded text of tokens 0..k: where token k ends in the
    completion string (decoded with ``skip_special_tokens=True``, as the trainer decodes completions).

    A prefix that ends inside a multi-byte character decodes to a trailing U+FFFD; that token does not complete
    any character yet, so it ends where the previous token ended. Ends never decrease."""
    ends, last = [], 0
    for k in range(1, len(token_ids) + 1):
        text = tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True)
        while text.endswith("\ufffd"):
            text = text[:-1]
        last = max(last, len(text))
        ends.append(last)
    return ends
