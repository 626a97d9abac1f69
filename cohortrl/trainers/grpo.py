"""GRPO (DeepSeekMath, arXiv 2402.03300) and its group-baseline relatives on the shared step (``rl.py``).

What is GRPO's own, against PPO (``ppo.py``):

* advantages come from the rewards of the G responses to the same prompt, through the registered estimator
  (grpo, grpo_batch, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline) — no critic;
* the KL to the reference is a term of the loss, β·KL_t per token with the configured estimator (k3 by
  default, eq. 4 of the paper), not a penalty in the reward — unless ``algorithm.kl_in_reward`` moves it
  into the reward as PPO has it (r − β·Σ_t KL_t per response, measured on the sampling policy), for the
  comparison of the two placements (docs/grpo_variants.md).
"""

from __future__ import annotations

import torch

from cohortrl.algorithms import get_advantage_estimator, kl_penalty, kl_shaped_rewards, masked_mean, masked_sum
from cohortrl.trainers.loop import RunStateError
from cohortrl.trainers.rl import RLTrainer, ScoredBatch, Targets

__all__ = ["GRPOTrainer", "RunStateError"]


class GRPOTrainer(RLTrainer):
    name = "grpo"
    reuses_rollout_forward = True  # clipped ratio and β·KL of the sampled tokens' log-probs (train.reuse_rollout_forward)

    def _init_algorithm(self, model) -> None:
        self.estimator = get_advantage_estimator(self.cfg.algorithm.estimator)

    def _needs_old_logp(self) -> bool:
        # KL in the reward is measured on the policy that sampled, before the update: log π_old is needed.
        return super()._needs_old_logp() or self._kl_in_reward()

    def _kl_in_reward(self) -> bool:
        return self.cfg.algorithm.kl_in_reward and self.reference is not None

    def _targets(self, batch: ScoredBatch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        a, d, p = self.cfg.algorithm, self.dist, self.cfg.reward.process
        response_mask = batch.rollout.response_mask
        metrics, steps = {}, {}
        if self._kl_in_reward():
            rewards_B, steps["token_rewards"], metrics = self._kl_shaped_rewards(rewards_B, old_logp, ref_logp, response_mask)
        if batch.step_rewards is not None:  # process supervision: step rewards and where each step ends
            steps.update(step_rewards=d.gather_list(batch.step_rewards), step_ends=d.gather_list(batch.step_ends),
                         credit=p.credit, process_coef=p.coef)
        # The estimator sees the whole batch (every rank's groups under torchrun): batch-level statistics
        # (grpo_batch's std, REINFORCE++ whitening) are global; each rank keeps its own rows.
        advantages_all = self.estimator(rewards=d.gather_rows(rewards_B), response_mask=d.gather_rows(response_mask),
                                        group_size=a.group_size, eps=a.eps, **steps)
        advantages_BT = d.local_rows(advantages_all, a.group_size, response_mask.shape[1])
        detail = {"shaped_rewards": rewards_B, "token_rewards": steps["token_rewards"]} if self._kl_in_reward() else {}
        return Targets(advantages_BT, old_logp, ref_logp, metrics=metrics, detail=detail)

    def _kl_shaped_rewards(self, rewards_B, old_logp, ref_logp, response_mask):
        """KL in the reward (``algorithm.kl_in_reward``): r_t = [last]·r − β·KL_t, measured on the policy that
        sampled. A reward, so no gradient flows through it (π_old and π_ref are constants). Returns the rewards,
        every rank's token rewards (the estimator's ``token_rewards``) and the KL's metrics."""
        a, d = self.cfg.algorithm, self.dist
        kl_BT = kl_penalty(old_logp, ref_logp, a.kl_kind)
        rewards_B, token_rewards = kl_shaped_rewards(rewards_B, kl_BT, response_mask, a.beta)
        kl_all, mask_all = d.gather_rows(kl_BT), d.gather_rows(response_mask)
        metrics = {"kl_reward_per_response": masked_sum(kl_all, mask_all, dim=-1).mean().item(),
                   "kl_reward_token_mean": masked_mean(kl_all, mask_all).item()}
        return rewards_B, d.gather_rows(token_rewards), metrics

    def _extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """β·KL(π_θ ‖ π_ref) per token (arXiv 2402.03300, eq. 3-4); with β = 0 there is no reference and KL is 0."""
        if targets.ref_logp is None:
            return None, {"kl": torch.zeros_like(logp)}
        kl_BT = kl_penalty(logp, targets.ref_logp[rows].to(logp.device), self.cfg.algorithm.kl_kind)
        if self._kl_in_reward():  # already in the advantages; logged here as the current policy's KL
            return None, {"kl": kl_BT.detach()}
        return self.cfg.algorithm.beta * kl_BT, {"kl": kl_BT}
