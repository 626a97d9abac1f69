"""Rejection-sampling fine-tuning (expert iteration) as the ``RFT`` object the RL step (``step.py``) calls,
and ``RFTTrainer``, the RL trainer that runs it: the baseline that needs no
demonstrations, as RL does not, but learns only by imitation.

Each step samples G responses to each of P training prompts from the current policy (with the run's tools),
grades them with the correctness function, keeps those that pass (correctness >= 1) and takes one optimiser step
on the supervised loss −log π_θ(token) over the kept responses' own tokens: a tool's result and the prompt are not
trained on, exactly as the SFT loss (``sft.py``) leaves them out. Then the next step samples from the updated
policy (the online form of ReST-EM, arXiv 2312.06585, and STaR, arXiv 2203.14465; RAFT, arXiv 2304.06767, keeps
the best of each group instead of every passing one).

What is RFT's own, against GRPO (``grpo.py``):

* the loss keeps only passing responses (``keep``): a failed one contributes nothing, not a negative
  gradient; a step where nothing passes trains on nothing (its loss is 0, ``trained_responses`` says so);
* the loss is the supervised one (``extra_loss``), on log-probs at temperature 1 (``loss_temperature``), not
  the sampling distribution's: the policy is fitted to the kept text, as by SFT; its advantages are zero, so
  the clipped surrogate adds nothing;
* no reference model and no KL term (``algorithm.beta`` must be 0); ``algorithm.aggregation: token-mean`` gives
  the SFT trainer's normalisation (each kept token weighs the same).
"""

from __future__ import annotations

import torch

from cohortrl.trainers.algorithm import Algorithm, Targets
from cohortrl.trainers.rl import RLTrainer

__all__ = ["RFT", "RFTTrainer"]


class RFT(Algorithm):
    loss_temperature = 1.0  # the SFT loss's distribution, whatever the sampling temperature
    # The loss reaches the policy only through the sampled tokens' log-probs: on the CPU fast path the update
    # differentiates decoding's recording (cpu/replay.py), at temperature 1 from the recorded final states, and
    # its backward runs on the passing responses' rows only (a failed one's gradient is 0).
    reuses_rollout_forward = True
    progress_metric = "loss"
    corrects_sampler = False  # zero advantages: no ratio term to weight, whoever sampled

    def __init__(self, cfg, dist, device, policy):
        self.correctness = cfg.reward.correctness

    def keep(self, batch) -> torch.Tensor:
        """(B,) bool: the responses the correctness function passes."""
        return torch.tensor([(v or 0.0) >= 1.0 for v in batch.per_fn[self.correctness]], dtype=torch.bool)

    def targets(self, batch, rewards_B, loss_mask, ref_logp, old_logp, timer) -> Targets:
        # Zero advantages: the surrogate term vanishes and only the supervised loss of extra_loss trains.
        advantages_BT = torch.zeros(batch.rollout.response_mask.shape)
        return Targets(advantages_BT, old_logp, ref_logp, metrics={"rft_kept_fraction": float(loss_mask.any(-1).float().mean())})

    def extra_loss(self, rows, loss_mask, logp, input_ids, attention_mask, targets: Targets):
        """−log π_θ of each kept response token (the SFT loss; ``loss_mask`` selects the tokens)."""
        if logp is None:
            return None, {}
        return -logp, {"nll": -logp.detach()}


class RFTTrainer(RLTrainer):
    name = "rft"
    algorithm_class = RFT
