"""PRIME's implicit process reward model (Cui et al. 2025, arXiv 2502.01456; the implicit PRM of Yuan et al.
2024, arXiv 2412.01981).

A causal LM π_φ, read against the frozen reference π_ref, gives every response token a reward

    r_t = β · (log π_φ(y_t | x, y_<t) − log π_ref(y_t | x, y_<t)),

and a step's reward is the sum of its tokens' rewards: the tokens after the previous step's last token up to
and including its own (`cohortrl.step_spans` finds that token; the last step also takes any tokens after
it, so the steps of a response sum to its whole-response reward β·log π_φ(y|x)/π_ref(y|x)). That sum is an
outcome reward model, so φ learns from outcome labels y ∈ [0, 1] alone, by cross-entropy:

    L(φ) = −[ y · log σ(β Σ_t log π_φ/π_ref) + (1 − y) · log(1 − σ(β Σ_t log π_φ/π_ref)) ].

PRIME updates φ online, on each step's rollouts, after scoring them (its Algorithm 1: compute the implicit
process rewards, then update the PRM on the outcome labels), so a batch's rewards come from a PRM that has
not seen that batch's labels; online updates keep the PRM on the policy's distribution, which is what stops an
offline PRM from being over-optimised.

Why a class and not a process reward function: it reads the token ids the policy sampled (not re-tokenised
text), starts from the policy's initial weights, and needs each response's outcome after scoring — none of
which the reward-function signature carries. The trainer calls it through `StepSource` (`score`, then
`update` with the correctness function's values), so nothing in the trainer names it.

Departures from the paper, on purpose: log-probs at temperature 1 (the two LMs' own distributions, not the
sampling temperature); one AdamW step per training step on the whole batch (micro-batched), gradient norm
clipped at 1; no accuracy filter on prompts (cohortrl's ``algorithm.zero_variance`` does that job); step rewards,
not PRIME's per-token returns, reach the advantages (``grpo_process`` / ``grpo_combined`` / PPO). PRIME's
settings: β = 0.05, PRM learning rate 1e-6, φ initialised from the SFT policy.

Cost: φ and π_ref are two more copies of the policy (π_ref is shared with the trainer's KL reference when it
has one), plus AdamW state for φ; each step adds two forward passes to score and one forward-backward of φ.
With a LoRA policy both are full copies of the merged initial weights (φ is fully trained; LoRA saves the
policy's optimiser memory, not these). Under torchrun the trainer refuses it: each rank would train its own φ.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cohortrl.distributed import micro_batch_positions
from cohortrl.rollout.hf import response_logprobs
from cohortrl.step_spans import Span, StepScores, StepSource, split_steps, step_end_tokens


def step_sums(token_rewards: Sequence[float], step_ends: Sequence[int]) -> list[float]:
    """Each step's share of a response's token rewards: step j gets the tokens (end_{j−1}, end_j], the last
    step also every token after its end, so the shares add up to the whole response's reward. Two steps
    ending on one token: the second gets 0 (the token is the first's).

    >>> step_sums([1.0, 2.0, 3.0, 4.0, 5.0], [1, 3])   # (1 + 2), (3 + 4 + 5)
    [3.0, 12.0]
    """
    out, start = [], 0
    for j, end in enumerate(step_ends):
        stop = len(token_rewards) if j == len(step_ends) - 1 else end + 1
        out.append(float(sum(token_rewards[start:stop])))
        start = max(start, stop)
    return out


def plain_copy(model):
    """A copy of ``model`` as a plain causal LM: a LoRA-wrapped policy is merged into its base weights (at the
    start of training its adapter is the identity, so this is the initial policy), every weight trainable."""
    model = copy.deepcopy(model)
    if hasattr(model, "merge_and_unload"):  # peft
        model = model.merge_and_unload()
    return model.requires_grad_(True)


class ImplicitPRM(StepSource):
    """π_φ against π_ref, scoring steps and (``update``) learning online from outcome labels.

    ``policy``: the policy at its initial weights; φ starts as a copy of it (or is ``prm``, a causal LM with
    the policy's tokenizer, given through the Python API). ``reference``: the frozen π_ref, or None to copy
    ``policy``. ``beta``: β. ``update``: train φ online with ``lr``. ``delimiter`` / ``regex``: step
    splitting (`split_steps`). ``micro_batch_size``: rows per forward pass (0: the whole batch)."""

    name = "implicit_prm"

    def __init__(self, policy, tokenizer, *, reference=None, beta: float = 0.05, update: bool = True,
                 lr: float = 1e-6, delimiter: str = "\n", regex: str | None = None, micro_batch_size: int = 0,
                 prm=None):
        if beta <= 0:
            raise ValueError(f"implicit_prm beta must be > 0, got {beta}")
        if prm is None and not update:
            raise ValueError(
                "implicit_prm with update: false and φ copied from the policy scores every token 0 (φ = π_ref "
                "until it is trained); set update: true"
            )
        self.tokenizer, self.beta, self.delimiter, self.regex = tokenizer, beta, delimiter, regex
        self.micro_batch_size = micro_batch_size
        self.phi = (prm if prm is not None else plain_copy(policy)).eval()
        self.reference = reference if reference is not None else plain_copy(policy).eval().requires_grad_(False)
        self.learns = update
        self.phi.requires_grad_(update)
        self.optimizer = torch.optim.AdamW([p for p in self.phi.parameters() if p.requires_grad], lr=lr) if update else None
        self._scored: tuple | None = None  # (rollout, log π_ref (B, T)) of the last batch scored, for update

    # ------------------------------------------------------------------------------------------ scoring
    def _logprobs(self, model, rollout, rows: torch.Tensor) -> torch.Tensor:
        """log π(y_t | x, y_<t) for the response tokens of ``rows``: (len(rows), T), on the model's device."""
        input_ids, attention_mask = rollout.input_ids()[rows], rollout.attention_mask()[rows]
        logp, _ = response_logprobs(model, input_ids, attention_mask, rollout.response_ids[rows], temperature=1.0)
        return logp

    @torch.no_grad()
    def token_rewards(self, rollout) -> torch.Tensor:
        """r_t = β·(log π_φ − log π_ref) per response token, 0 on padding: (B, T) on the CPU."""
        phi, ref = [], []
        for idx in micro_batch_positions(rollout.batch_size, self.micro_batch_size):
            phi.append(self._logprobs(self.phi, rollout, idx).float().cpu())
            ref.append(self._logprobs(self.reference, rollout, idx).float().cpu())
        ref_logp = torch.cat(ref)
        self._scored = (rollout, ref_logp)
        return self.beta * (torch.cat(phi) - ref_logp) * rollout.response_mask

    def score(self, rollout, columns: dict[str, list]) -> list[StepScores]:
        rewards_BT = self.token_rewards(rollout)
        out = []
        for i, completion in enumerate(rollout.completions):
            spans: list[Span] = split_steps(completion, self.delimiter, self.regex)
            # every token of the text, tool results included (their rewards are 0), so positions are the response's
            char_ends = rollout.char_ends(i, self.tokenizer)
            ends = step_end_tokens(spans, char_ends)
            out.append(list(zip(step_sums(rewards_BT[i, : len(char_ends)].tolist(), ends), spans)))
        return out

    # ------------------------------------------------------------------------------------------ learning
    def update(self, rollout, outcomes: Sequence[float | None]) -> dict[str, float]:
        """One AdamW step of φ on L(φ) over the responses with an outcome (None: not labelled, skipped).
        Returns the loss and the PRM's accuracy on this batch, both from before the step."""
        if not self.learns:
            return {}
        rows = [i for i, y in enumerate(outcomes) if y is not None]
        bad = [outcomes[i] for i in rows if not 0.0 <= outcomes[i] <= 1.0]
        if bad:
            raise ValueError(f"implicit_prm learns from outcome labels in [0, 1] (reward.correctness); got {bad[:3]}")
        if not rows:
            return {}
        if self._scored is not None and self._scored[0] is rollout:
            ref_logp = self._scored[1]
        else:
            with torch.no_grad():
                ref_logp = torch.cat([self._logprobs(self.reference, rollout, idx).float().cpu()
                                      for idx in micro_batch_positions(rollout.batch_size, self.micro_batch_size)])
        labels = torch.tensor([float(outcomes[i]) for i in rows])
        rows_t = torch.tensor(rows)
        self.optimizer.zero_grad(set_to_none=True)
        total, agree = 0.0, 0
        for idx in micro_batch_positions(len(rows), self.micro_batch_size):
            r = rows_t[idx]
            logp = self._logprobs(self.phi, rollout, r)
            mask = rollout.response_mask[r].to(logp.device)
            implicit_B = self.beta * ((logp.float() - ref_logp[r].to(logp.device)) * mask).sum(-1)
            y = labels[idx].to(logp.device)
            loss = F.binary_cross_entropy_with_logits(implicit_B, y, reduction="sum") / len(rows)
            loss.backward()
            total += loss.item()
            agree += int(((implicit_B.detach() > 0) == (y >= 0.5)).sum())
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.phi.parameters() if p.requires_grad], 1.0)
        if math.isfinite(total) and torch.isfinite(grad_norm):
            self.optimizer.step()
        return {"implicit_prm/loss": total, "implicit_prm/accuracy": agree / len(rows),
                "implicit_prm/grad_norm": float(grad_norm)}

    def state_dict(self) -> dict:
        if not self.learns:
            return {}
        return {"weights": {k: v.detach().cpu().clone() for k, v in self.phi.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.phi.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
