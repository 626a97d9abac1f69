"""PPO's critic: a transformer with a scalar value head on every token, and its values on response tokens.

The critic is initialised either from the policy's initial weights (a separate, fully trained copy) or from
a sequence-classification checkpoint with one label — a reward model, as InstructGPT (arXiv 2203.02155)
initialises its value function — whose backbone and score head carry over unchanged.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from cohortrl.config import ConfigError


class ValueModel(torch.nn.Module):
    """V(s_t): ``backbone`` (a transformer without LM head, e.g. ``LlamaModel``) + Linear(hidden, 1)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        with torch.random.fork_rng(devices=[]):  # building the head must not shift the sampling stream
            self.value_head = torch.nn.Linear(hidden_size, 1)
        # A zero head predicts V = 0 everywhere: the value of "no reward yet" before any return is seen.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    def forward(self, input_ids, attention_mask, position_ids, keep_last: int) -> torch.Tensor:
        """Values at the last ``keep_last`` positions, (B, keep_last)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden[:, -keep_last:]).squeeze(-1).float()


def response_values(critic: ValueModel, input_ids, attention_mask, response_len: int) -> torch.Tensor:
    """V_t for every response token t, (B, T), aligned like ``response_logprobs``: V_t is read at the
    position that predicts token t (the state before it is emitted), so V_0 is the value of the prompt.

    ``input_ids`` is [left-padded prompt | right-padded response]; positions are rebuilt from the mask as in
    generation, so a left-padded row sees the same positions.
    """
    device = next(critic.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    values = critic(input_ids, attention_mask, position_ids, keep_last=response_len + 1)
    return values[:, :-1]


def build_critic(init: str, policy, dtype: torch.dtype) -> ValueModel:
    """A value model from ``init`` (``policy`` or a sequence-classification checkpoint directory).

    ``policy`` must be the policy before any LoRA adapter is attached: the critic copies its backbone.
    """
    hidden_size = policy.config.hidden_size
    if init == "policy":
        critic = ValueModel(copy.deepcopy(policy.base_model), hidden_size)
    else:
        critic = _from_sequence_classifier(Path(init), policy, dtype)
    return critic.to(dtype).train()


def _from_sequence_classifier(path: Path, policy, dtype) -> ValueModel:
    from transformers import AutoModelForSequenceClassification

    with torch.random.fork_rng(devices=[]):  # a head missing from the checkpoint would be drawn at random
        classifier = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    where = f"config key 'algorithm.ppo.critic_init' = '{path}'"
    if classifier.config.num_labels != 1:
        raise ConfigError(f"{where}: the checkpoint has {classifier.config.num_labels} labels; a critic needs a one-label (scalar) head")
    if classifier.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(
            f"{where}: its vocabulary has {classifier.config.vocab_size} tokens, the policy's {policy.config.vocab_size}; "
            "the critic reads the policy's token ids, so both must share a tokenizer"
        )
    backbone = classifier.base_model
    heads = [m for name, m in classifier.named_children() if m is not backbone and isinstance(m, torch.nn.Linear)]
    if len(heads) != 1 or heads[0].out_features != 1:
        raise ConfigError(f"{where}: found no single Linear(hidden, 1) score head beside the backbone")
    critic = ValueModel(backbone, classifier.config.hidden_size)
    with torch.no_grad():
        critic.value_head.weight.copy_(heads[0].weight)
        if heads[0].bias is not None:
            critic.value_head.bias.copy_(heads[0].bias)
    return critic
