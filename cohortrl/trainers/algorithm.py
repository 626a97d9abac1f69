"""What differs between the RL algorithms, as the step (``step.py``) sees it: one object per algorithm (``grpo.GRPO``,
``ppo.PPO``, ``rft.RFT``), built once per run, and the ``Targets`` its step 4 returns. The step calls the object's
``targets`` and ``extra_loss`` and reads its settings; the math itself is ``algorithms/`` (pure functions).

``Algorithm`` holds the defaults: an algorithm that trains the policy alone, on the clipped surrogate of the
sampling temperature's log-probs, with no model or checkpoint state of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Targets:
    """What the update regresses onto, fixed for the whole step: the algorithm's output of step 4."""

    advantages: torch.Tensor  # (B, T) advantage per response token, 0 on padding
    old_logp: torch.Tensor | None  # (B, T) log π_old (the sampling policy); None: on-policy, ratio 1
    ref_logp: torch.Tensor | None  # (B, T) log π_ref; None when β = 0
    old_values: torch.Tensor | None = None  # (B, T) PPO: the critic's values at rollout time
    returns: torch.Tensor | None = None  # (B, T) PPO: GAE returns, the critic's regression target
    metrics: dict = field(default_factory=dict)  # the algorithm's numbers for the step's log row
    is_weights: torch.Tensor | None = None  # (B, T) truncated importance weights for a vLLM sampler; None: 1
    # intermediate tensors of the algorithm's step 4 that only a trace reads (``trace.py``), e.g. PPO's
    # KL-penalised token rewards; the update never looks here
    detail: dict[str, torch.Tensor] = field(default_factory=dict)


class Algorithm:
    """One algorithm's part of the RL step. Built as ``cls(cfg, dist, device, policy)`` (``policy``: the model
    before LoRA is attached, which a critic copies) before the policy is wrapped for training."""

    # The update may differentiate decoding's own forward (train.reuse_rollout_forward): the loss reaches the
    # policy only through the log-probs of the sampled tokens under the sampling policy.
    reuses_rollout_forward = False
    # The temperature of the log-probs the update trains on; None: the sampling temperature (the distribution
    # actually sampled from).
    loss_temperature: float | None = None
    needs_old_logp = False  # step 3 computes log π_old for the algorithm's own use (besides several updates or vLLM)
    # The loss has a policy-ratio term that a sampler of other numerics (vLLM, bf16 decoding) must correct with
    # importance weights; False where no ratio reaches the loss (RFT's supervised loss), so no log π_old for them.
    corrects_sampler = True
    policy_frozen_steps = 0  # steps at the start that leave the policy unchanged (PPO's critic warm-up): the most
    progress_metric = "kl"  # the number the progress bar shows beside reward and accuracy

    def policy_frozen(self, step_count: int) -> bool:
        """Whether the update at ``step_count`` (0 for the first) leaves the policy unchanged; called after
        ``targets`` of the same step."""
        return step_count < self.policy_frozen_steps

    def models(self) -> list:
        """Models of its own the step runs forward passes of (the CPU fast path's kernel computes them too)."""
        return []

    def synced(self) -> list:
        """Data-parallel modules of its own whose gradients ``extra_loss`` produces."""
        return []

    def optimised(self) -> dict:
        """Models of its own the update trains, by name (``setup.Optimised``)."""
        return {}

    def keep(self, batch) -> torch.Tensor | None:
        """(B,) bool: the responses the loss keeps by the algorithm's own rule, or None: every one."""
        return None

    def targets(self, batch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        """Step 4: advantages (and whatever else the update regresses onto) for the scored batch."""
        raise NotImplementedError

    def extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """The per-token loss added to the clipped surrogate on ``rows`` (``loss_mask`` is theirs, (b, T)):
        (loss (b, T) or None, metrics), where metrics maps a name to a (b, T) tensor averaged over response
        tokens for the log. ``logp`` (b, T) carries the policy's gradient; it is None while the policy is frozen."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Its checkpoint entries (e.g. PPO's critic and KL coefficient)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
