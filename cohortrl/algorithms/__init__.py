"""Pure tensor math of RL post-training: advantages, policy / value losses, KL, loss aggregation.

No model, no I/O, no config objects, no ``torch.distributed``: every function takes tensors and plain
keyword hyper-parameters. docs/algorithms.md maps every name to its paper, equation and test.

Dimension letters used in shapes and name suffixes (``logp_NT``):
    N (= B)  responses in the batch          G  responses per prompt (group size), N = P·G
    P        prompts                         T  response tokens (padded length)
    S        steps of one response           V  vocabulary
Groups are contiguous: rows k·G … k·G + G − 1 answer prompt k. ``response_mask`` (N, T) is 1 on response
tokens; padded slots never influence an output.

Registries (one call signature per family, so a trainer looks a name up and never branches on it):
    ADVANTAGE_ESTIMATORS / get_advantage_estimator / register_advantage_estimator  (see ``AdvantageEstimator``)
    POLICY_LOSSES / get_policy_loss / register_policy_loss                         (see ``PolicyLoss``)
Each entry is ``Entry(fn, needs)``: the function and what it declared it needs (`EstimatorNeeds`: groups, step
rewards, one advantage per response; `LossNeeds` for a loss), in one table per kind that refuses an entry without
them; ``config.validate`` asks these instead of listing names.
Users add their own with the ``register_*`` decorators; the same signature check applies to them.
"""

from cohortrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GAE_NEEDS,
    GROUP_SCALES,
    AdvantageEstimator,
    EstimatorNeeds,
    estimator_needs,
    gae_advantages,
    get_advantage_estimator,
    group_advantages,
    register_advantage_estimator,
    process_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from cohortrl.algorithms.aggregate import AGGREGATION_MODES, aggregate, token_weights
from cohortrl.algorithms.registry import Entry
from cohortrl.algorithms.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, exact_kl, kl_penalty
from cohortrl.algorithms.losses import (
    POLICY_LOSS_LEVELS,
    POLICY_LOSSES,
    LossNeeds,
    PolicyLoss,
    get_policy_loss,
    needs_sequence_advantages,
    policy_loss,
    register_policy_loss,
    truncated_importance_weights,
    value_loss,
)
from cohortrl.algorithms.masked import (
    as_bool_mask,
    broadcast_to_tokens,
    last_token_index,
    masked_fill_padding,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from cohortrl.algorithms.shaping import kl_shaped_rewards, outcome_token_rewards, soft_overlong_penalty

__all__ = [
    # advantages
    "group_advantages",
    "rloo_advantages",
    "process_advantages",
    "reinforce_pp_advantages",
    "gae_advantages",
    "GROUP_SCALES",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
    "register_advantage_estimator",
    "EstimatorNeeds",
    "Entry",
    "GAE_NEEDS",
    "estimator_needs",
    # losses
    "policy_loss",
    "value_loss",
    "POLICY_LOSS_LEVELS",
    "PolicyLoss",
    "POLICY_LOSSES",
    "get_policy_loss",
    "register_policy_loss",
    "LossNeeds",
    "needs_sequence_advantages",
    "truncated_importance_weights",
    # KL
    "kl_penalty",
    "exact_kl",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    # aggregation
    "aggregate",
    "token_weights",
    "AGGREGATION_MODES",
    # reward shaping
    "kl_shaped_rewards",
    "outcome_token_rewards",
    "soft_overlong_penalty",
    # masked helpers
    "as_bool_mask",
    "masked_fill_padding",
    "masked_sum",
    "masked_mean",
    "masked_whiten",
    "broadcast_to_tokens",
    "last_token_index",
]
