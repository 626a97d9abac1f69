"""The rollout batch: what generation hands to scoring, advantages and the update.

Dimension letters (used as suffixes and in comments throughout cohortrl):
    P prompts, G responses per prompt, B = P·G sequences, Tp prompt tokens (left-padded),
    T response tokens (right-padded), S steps, V vocabulary.
Groups are contiguous: rows ``k*G … k*G+G-1`` answer prompt k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, Tp) left-padded prompt tokens (chat template applied)
    prompt_mask: torch.Tensor  # (B, Tp) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) generated tokens, right-padded with the pad id
    response_mask: torch.Tensor  # (B, T) 1 on generated tokens up to and including EOS / the stop string
    truncated: torch.Tensor  # (B,) bool: hit max_new_tokens without EOS or a stop string
    completions: list[str]  # (B,) decoded responses, without special tokens
    group_size: int  # G
    rows: list[dict] = field(default_factory=list)  # (B,) the dataset row each response answers
    sampling_logp: torch.Tensor | None = None  # (B, T) log-probs under the sampler's own numerics (vLLM); None: HF
    # The decoding forward, kept for the update's backward (rollout/replay.py); only for these rows as generated:
    # ``select`` and ``concat`` drop it.
    replay: object | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:  # (B,) response tokens
        return self.response_mask.sum(-1)

    def input_ids(self) -> torch.Tensor:  # (B, Tp + T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> torch.Tensor:  # (B, Tp + T)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

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
        )
