"""Building what a trainer holds: the policy (optionally with a LoRA adapter), the frozen reference, the
optimiser and the learning-rate schedule. Shared by every trainer."""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cohortrl.config import ConfigError
from cohortrl.models import load_model
from cohortrl.trainers import checkpoint


def load_configured_model(model_cfg, seed: int):
    """``load_model`` for a config's ``model`` section; a cohortrl ``final/`` or checkpoint it names (as
    ``model.name`` or ``model.init``) is verified against its manifest first, so damaged weights never train or
    become a KL reference."""
    for key, path in (("model.name", model_cfg.name), ("model.init", model_cfg.init)):
        if path is not None:
            checkpoint.check_saved(path, key)
    return load_model(model_cfg.name, dtype=model_cfg.dtype, seed=seed, init=model_cfg.init)


def build_policy(model_cfg, seed: int, model=None, tokenizer=None):
    """(model, tokenizer): loaded from the spec unless given; wrapped with a LoRA adapter if enabled."""
    if model is None:
        model, tokenizer = load_configured_model(model_cfg, seed)
    if model_cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model
        from transformers.pytorch_utils import Conv1D

        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [m for m in model_cfg.lora.target_modules if m not in names]
        if missing:
            # The default names are a Llama-family model's projections; GPT-2's are Conv1D layers (c_attn, ...),
            # which PEFT adapts as well, so they are listed too.
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, (torch.nn.Linear, Conv1D))})
            raise ConfigError(
                f"config key 'model.lora.target_modules': {missing} not found in {model_cfg.name} "
                f"({type(model).__name__}); its linear modules are {linear}; set model.lora.target_modules to the ones to adapt"
            )
        lora = LoraConfig(
            r=model_cfg.lora.r,
            lora_alpha=model_cfg.lora.alpha,
            lora_dropout=model_cfg.lora.dropout,
            target_modules=list(model_cfg.lora.target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.train()
    return model, tokenizer


class Reference:
    """π_ref for the KL term: a frozen copy of the initial policy or, with LoRA, the policy itself with its
    adapter disabled (the base weights never change, so no second copy is needed)."""

    def __init__(self, policy, lora: bool):
        self.lora = lora
        self.model = None if lora else copy.deepcopy(policy).eval().requires_grad_(False)
        self.policy = policy

    @contextmanager
    def __call__(self):
        if self.lora:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.model


@dataclass
class Optimised:
    """A model the update trains: its parameters, optimiser and LR schedule; ``metric`` names its grad norm."""

    metric: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_optimizer(model, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; the fused kernel (one pass over each tensor instead of a dozen
    elementwise ops) where torch has it: plain tensors on the CPU or a GPU, not FSDP2's sharded DTensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and type(p.data) is torch.Tensor for p in params)
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay,
                             fused=fused or None)


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimiser's state (AdamW's two moment buffers per parameter) now, as its first step would,
    so that a run that does not fit fails at the start rather than after its first rollout, and so that the
    first steps' activations are laid out around the state instead of being displaced by it (on a CPU, the
    second step then reuses the first's freed memory instead of faulting in fresh pages: see
    ``cpu/memory.py``). Done by torch's own code: one step with zero gradients at learning rate 0 (the moments
    stay 0 and the weights unchanged, weight decay included), then the step counters back to 0. The state is
    the one a first step would have started from; ``tests/trainers/test_optimizer.py`` checks that the first real
    step gives bit-identical weights and state."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]
    if not params:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
    for p in params:  # AdamW counts its steps in a tensor
        optimizer.state[p]["step"].zero_()


def build_scheduler(optimizer, optim_cfg, total_updates: int):
    """Linear warmup, then constant / linear decay / cosine decay to 0 over ``total_updates`` optimiser steps."""
    warmup = optim_cfg.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if not optim_cfg.decays:
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        return 1.0 - progress if optim_cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
