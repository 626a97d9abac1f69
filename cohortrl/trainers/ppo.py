"""PPO for RLHF (Ziegler et al., arXiv 1909.08593; InstructGPT, arXiv 2203.02155) as the ``PPO`` object the RL step
(``step.py``) calls, and ``PPOTrainer``, the RL trainer that runs it.

What is PPO's own, against GRPO (``grpo.py``):

* a critic V (``critic.py``): its own copy of a transformer with a scalar head, its own AdamW and LR,
  optionally trained alone for the first ``critic_warmup_steps`` steps, or until its explained variance of the
  Monte-Carlo returns of a step's fresh rollouts reaches ``critic_warmup_ev``;
* the KL to the reference is a penalty in the reward, not a loss term. Per response token t:
      r_t = −β · KL_t  (+ the response's score on its last token)            Ziegler et al. §2.2
  with KL_t the k1 (log π_old − log π_ref) or k3 estimate, β fixed or steered towards a target KL by the
  adaptive controller (Ziegler et al. §2.2, ``AdaptiveKLController``);
* advantages by GAE(γ, λ) on those rewards and the critic's values (arXiv 1506.02438, §3), whitened over
  the batch; returns R_t = A_t + V_t are the critic's target;
* the update adds vf_coef · the clipped value loss ½·max((V − R)², (V_c − R)²) (PPO2 / Ziegler et al.).

G may be 1: nothing here uses group statistics. A response without EOS (it hit the budget) can be
penalised (``missing_eos_penalty``). Departure: the score of a reward function is placed on the last
response token, which is the EOS token when there is one.
"""

from __future__ import annotations

import dataclasses

import torch

from cohortrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    kl_penalty,
    masked_fill_padding,
    masked_mean,
    masked_sum,
    masked_whiten,
    outcome_token_rewards,
    value_loss,
)
from cohortrl.distributed import micro_batch_positions
from cohortrl.trainers import checkpoint
from cohortrl.trainers.algorithm import Algorithm, Targets
from cohortrl.trainers.critic import build_critic, response_values
from cohortrl.trainers.loop import load_trainable_state
from cohortrl.trainers.rl import RLTrainer
from cohortrl.trainers.setup import Optimised, build_optimizer, build_scheduler

__all__ = ["PPO", "PPOTrainer"]


class PPO(Algorithm):
    def __init__(self, cfg, dist, device, policy):
        a, p = cfg.algorithm, cfg.algorithm.ppo
        self.a, self.p, self.dist = a, p, dist
        self.process_coef = cfg.reward.process.coef if cfg.reward.process is not None else None
        self.critic = build_critic(p.critic_init, policy, getattr(torch, cfg.model.dtype)).to(device)
        critic_optim = dataclasses.replace(cfg.optim, lr=p.critic_lr or cfg.optim.lr)
        optimizer = build_optimizer(self.critic, critic_optim)
        scheduler = build_scheduler(optimizer, critic_optim, cfg.train.steps * a.epochs * a.minibatches)
        params = [p for p in self.critic.parameters() if p.requires_grad]
        self.critic_optimised = Optimised("critic_grad_norm", params, optimizer, scheduler)
        if p.kl_controller == "adaptive":
            self.kl_controller = AdaptiveKLController(a.beta, p.target_kl, p.horizon)
        else:
            self.kl_controller = FixedKLController(a.beta)
        self.policy_frozen_steps = p.critic_warmup_steps
        # With critic_warmup_ev: set once a step's explained variance reaches it, which ends the warm-up there.
        self.critic_ready = False
        # The KL in the reward is measured on the policy that sampled, so β > 0 needs log π_old.
        self.needs_old_logp = a.beta > 0
        # Under torchrun the critic is data-parallel like the policy (DDP); its value targets stay local.
        self.train_critic = dist.wrap(self.critic)

    def models(self) -> list:
        return [self.critic]

    def synced(self) -> list:
        return [self.train_critic]

    def optimised(self) -> dict:
        return {"critic": self.critic_optimised}

    def targets(self, batch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        p, rollout = self.p, batch.rollout
        response_mask = rollout.response_mask
        with timer("values"), torch.no_grad():
            old_values_BT = self.values(rollout.input_ids(), rollout.attention_mask(), response_mask.shape[1]).cpu()

        # r_t = score on the last token − β·KL_t (Ziegler et al. §2.2; ALGORITHMS.md "PPO for RLHF").
        score_B = rewards_B
        if p.missing_eos_penalty:
            score_B = score_B - p.missing_eos_penalty * rollout.truncated.float()
        beta = self.kl_controller.value
        kl_BT = torch.zeros(response_mask.shape)
        if ref_logp is not None:
            kl_BT = masked_fill_padding(kl_penalty(old_logp, ref_logp, self.a.kl_kind), response_mask)
        token_rewards_BT = self.token_rewards(batch, score_B) - beta * kl_BT

        # GAE: δ_t = r_t + γV_{t+1} − V_t, A_t = Σ_l (γλ)^l δ_{t+l}, R_t = A_t + V_t (arXiv 1506.02438, eq. 16).
        advantages_BT, returns_BT = gae_advantages(token_rewards_BT, old_values_BT, response_mask, p.gamma, p.lam)
        detail = {"kl": kl_BT, "token_rewards": token_rewards_BT, "gae_advantages": advantages_BT,
                  "score": score_B, "kl_coef": torch.tensor(beta)}  # what a trace shows (trace.py)
        d, T = self.dist, response_mask.shape[1]
        if p.whiten_advantages:  # over the whole batch (every rank's rows under torchrun)
            whitened = masked_whiten(d.gather_rows(advantages_BT), d.gather_rows(loss_mask))
            advantages_BT = d.local_rows(whitened, self.a.group_size, T)

        # The controller sees the KL per response of this batch and sets β for the next one (Ziegler et al.).
        kl_all, mask_all = d.gather_rows(kl_BT), d.gather_rows(response_mask)
        values_all, returns_all = d.gather_rows(old_values_BT), d.gather_rows(returns_BT)
        kl_per_response = masked_sum(kl_all, mask_all, dim=-1).mean().item()
        self.kl_controller.update(kl_per_response, n_steps=kl_all.shape[0])
        # The warm-up's gate: V (from before this step's update, so on returns it has not trained on) against the
        # Monte-Carlo return, the discounted sum of the rewards that follow (GAE at λ = 1). The λ-return the critic
        # trains on is built from V itself, so against it even a V unrelated to the reward explains much of the
        # variance at λ < 1. Over the tokens the critic trains on.
        explained = _explained_variance(values_all, returns_all, mask_all)
        if p.critic_warmup_ev is not None:
            _, mc_returns = gae_advantages(token_rewards_BT, old_values_BT, response_mask, p.gamma, 1.0)
            explained_mc = _explained_variance(values_all, d.gather_rows(mc_returns), d.gather_rows(loss_mask))
            if explained_mc is not None and explained_mc >= p.critic_warmup_ev:
                self.critic_ready = True
        metrics = {
            # The KL the reward penalised: sampling policy vs reference, per token (GRPO logs its loss term's KL).
            "kl": masked_mean(kl_all, mask_all).item(),
            "kl_per_response": kl_per_response,
            "kl_coef": beta,
            "value_mean": masked_mean(values_all, mask_all).item(),
            "return_mean": masked_mean(returns_all, mask_all).item(),
            "explained_variance": explained,
            "critic_lr": self.critic_optimised.scheduler.get_last_lr()[0],
        }
        if p.critic_warmup_ev is not None:
            metrics["explained_variance_mc"] = explained_mc
            metrics["critic_ready"] = float(self.critic_ready)
        return Targets(advantages_BT, old_logp, ref_logp, old_values_BT, returns_BT, metrics, detail=detail)

    def policy_frozen(self, step_count: int) -> bool:
        """The critic's warm-up: the first ``critic_warmup_steps`` steps, ended early by ``critic_ready``."""
        return step_count < self.policy_frozen_steps and not self.critic_ready

    def token_rewards(self, batch, score_B: torch.Tensor) -> torch.Tensor:
        """(B, T) rewards before the KL penalty: each response's score on its last token, plus, with
        ``reward.process``, λ × each step's reward on the step's last token (GAE then credits earlier tokens)."""
        rewards_BT = outcome_token_rewards(score_B, batch.rollout.response_mask)
        if batch.step_rewards is not None:
            for i, (scores, ends) in enumerate(zip(batch.step_rewards, batch.step_ends)):
                for score, end in zip(scores, ends):
                    rewards_BT[i, end] += self.process_coef * score
        return rewards_BT

    def extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """vf_coef · clipped value loss per token (Ziegler et al.; ``value_loss``): the critic's share."""
        p = self.p
        values_BT = self.values(input_ids[rows], attention_mask[rows], targets.returns.shape[1], self.train_critic)
        dev = values_BT.device  # the batch lives on the CPU, the critic where train.device puts it
        loss_BT = value_loss(values_BT, targets.old_values[rows].to(dev), targets.returns[rows].to(dev), loss_mask.to(dev),
                             clip=p.value_clip)
        return p.vf_coef * loss_BT, {"value_loss": loss_BT}

    def values(self, input_ids, attention_mask, response_len: int, critic=None) -> torch.Tensor:
        """The critic's V on response tokens, (B, T), in the update's micro-batches (through ``critic``, the
        data-parallel wrapper, when gradients must be synced)."""
        parts = [
            response_values(critic or self.critic, input_ids[idx], attention_mask[idx], response_len)
            for idx in micro_batch_positions(len(input_ids), self.a.micro_batch_size)
        ]
        return torch.cat(parts)

    def state_dict(self) -> dict:
        return {"critic": checkpoint.trainable_state(self.critic), "kl_coef": self.kl_controller.value,
                "critic_ready": self.critic_ready}

    def load_state_dict(self, state: dict) -> None:
        load_trainable_state(self.critic, state["critic"], "the critic's checkpoint")
        self.kl_controller.value = state["kl_coef"]
        self.critic_ready = state.get("critic_ready", False)  # checkpoints written before the EV-gated warm-up


class PPOTrainer(RLTrainer):
    name = "ppo"
    algorithm_class = PPO


def _explained_variance(values_BT, returns_BT, response_mask) -> float | None:
    """1 − Var[R − V] / Var[R] over response tokens: 1 for a perfect critic, ≤ 0 for one no better than a
    constant; None when the returns do not vary."""
    mask = response_mask.bool()
    returns, values = returns_BT[mask], values_BT[mask]
    if returns.numel() < 2 or returns.var() == 0:
        return None
    return (1 - (returns - values).var() / returns.var()).item()
