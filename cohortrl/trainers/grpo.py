"""GRPO (DeepSeekMath, arXiv 2402.03300) and its group-baseline relatives: the ``GRPO`` object the RL step
(``step.py``) calls, and ``GRPOTrainer``, the RL trainer that runs it.

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
from cohortrl.trainers.algorithm import Algorithm, Targets
from cohortrl.trainers.loop import RunStateError
from cohortrl.trainers.rl import RLTrainer

__all__ = ["GRPO", "GRPOTrainer", "RunStateError"]


class GRPO(Algorithm):
    reuses_rollout_forward = True  # clipped ratio and β·KL of the sampled tokens' log-probs (train.reuse_rollout_forward)

    def __init__(self, cfg, dist, device, policy):
        self.a, self.process, self.dist = cfg.algorithm, cfg.reward.process, dist
        self.estimator = get_advantage_estimator(self.a.estimator)
        # KL in the reward needs a reference (β > 0); it is measured on the policy that sampled: log π_old is needed
        self.kl_in_reward = self.needs_old_logp = self.a.kl_in_reward and self.a.beta > 0

    def targets(self, batch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        a, d, p = self.a, self.dist, self.process
        response_mask = batch.rollout.response_mask
        metrics, steps = {}, {}
        if self.kl_in_reward:
            rewards_B, steps["token_rewards"], metrics = self.kl_shaped_rewards(rewards_B, old_logp, ref_logp, response_mask)
        if batch.step_rewards is not None:  # process supervision: step rewards and where each step ends
            steps.update(step_rewards=d.gather_list(batch.step_rewards), step_ends=d.gather_list(batch.step_ends),
                         credit=p.credit, process_coef=p.coef)
        # The estimator sees the whole batch (every rank's groups under torchrun): batch-level statistics
        # (grpo_batch's std, REINFORCE++ whitening) are global; each rank keeps its own rows.
        advantages_all = self.estimator(rewards=d.gather_rows(rewards_B), response_mask=d.gather_rows(response_mask),
                                        group_size=a.group_size, eps=a.eps, **steps)
        advantages_BT = d.local_rows(advantages_all, a.group_size, response_mask.shape[1])
        detail = {"shaped_rewards": rewards_B, "token_rewards": steps["token_rewards"]} if self.kl_in_reward else {}
        return Targets(advantages_BT, old_logp, ref_logp, metrics=metrics, detail=detail)

    def kl_shaped_rewards(self, rewards_B, old_logp, ref_logp, response_mask):
        """KL in the reward (``algorithm.kl_in_reward``): r_t = [last]·r − β·KL_t, measured on the policy that
        sampled. A reward, so no gradient flows through it (π_old and π_ref are constants). Returns the rewards,
        every rank's token rewards (the estimator's ``token_rewards``) and the KL's metrics."""
        a, d = self.a, self.dist
        kl_BT = kl_penalty(old_logp, ref_logp, a.kl_kind)
        rewards_B, token_rewards = kl_shaped_rewards(rewards_B, kl_BT, response_mask, a.beta)
        kl_all, mask_all = d.gather_rows(kl_BT), d.gather_rows(response_mask)
        metrics = {"kl_reward_per_response": masked_sum(kl_all, mask_all, dim=-1).mean().item(),
                   "kl_reward_token_mean": masked_mean(kl_all, mask_all).item()}
        return rewards_B, d.gather_rows(token_rewards), metrics

    def extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """β·KL(π_θ ‖ π_ref) per token (arXiv 2402.03300, eq. 3-4); with β = 0 there is no reference and KL is 0."""
        if targets.ref_logp is None:
            return None, {"kl": torch.zeros_like(logp)}
        kl_BT = kl_penalty(logp, targets.ref_logp[rows].to(logp.device), self.a.kl_kind)
        if self.kl_in_reward:  # already in the advantages; logged here as the current policy's KL
            return None, {"kl": kl_BT.detach()}
        return self.a.beta * kl_BT, {"kl": kl_BT}


class GRPOTrainer(RLTrainer):
    name = "grpo"
    algorithm_class = GRPO
