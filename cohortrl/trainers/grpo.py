"""GRPO (DeepSeekMath, arXiv 2402.03300) and its group-baseline relatives on the shared step (``loop.py``).

What is GRPO's own, against PPO (``ppo.py``):

* advantages come from the rewards of the G responses to the same prompt, through the registered estimator
  (grpo, grpo_batch, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline) — no critic;
* the KL to the reference is a term of the loss, β·KL_t per token with the configured estimator (k3 by
  default, eq. 4 of the paper), not a penalty in the reward.
"""

from __future__ import annotations

import torch

from cohortrl.algorithms import get_advantage_estimator, kl_penalty
from cohortrl.trainers.loop import RLTrainer, RunStateError, ScoredBatch, Targets, token_weights

__all__ = ["GRPOTrainer", "RunStateError", "token_weights"]


class GRPOTrainer(RLTrainer):
    name = "grpo"

    def _init_algorithm(self, model) -> None:
        self.estimator = get_advantage_estimator(self.cfg.algorithm.estimator)

    def _targets(self, batch: ScoredBatch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        a, d = self.cfg.algorithm, self.dist
        # The estimator sees the whole batch (every rank's groups under torchrun): batch-level statistics
        # (grpo_batch's std, REINFORCE++ whitening) are global; each rank keeps its own rows.
        response_mask = batch.rollout.response_mask
        process = self.cfg.reward.process
        steps = {}
        if batch.step_rewards is not None:  # process supervision: step rewards and where each step ends
            steps = dict(step_rewards=d.gather_list(batch.step_rewards), step_ends=d.gather_list(batch.step_ends),
                         credit=process.credit, process_coef=process.coef)
        advantages_all = self.estimator(
            rewards=d.gather_rows(rewards_B), response_mask=d.gather_rows(response_mask), group_size=a.group_size,
            eps=a.eps, **steps,
        )
        advantages_BT = d.local_rows(advantages_all, a.group_size, response_mask.shape[1])
        return Targets(advantages_BT, old_logp, ref_logp)

    def _extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """β·KL(π_θ ‖ π_ref) per token (arXiv 2402.03300, eq. 3-4); with β = 0 there is no reference and KL is 0."""
        if targets.ref_logp is None:
            return None, {"kl": torch.zeros_like(logp)}
        kl_BT = kl_penalty(logp, targets.ref_logp[rows].to(logp.device), self.cfg.algorithm.kl_estimator)
        return self.cfg.algorithm.beta * kl_BT, {"kl": kl_BT}
