"""Building what a trainer holds: the policy (optionally with a LoRA adapter), the frozen reference, the
optimiser and the learning-rate schedule; and the optimiser step. Shared by every trainer."""

from __future__ import annotations

import copy
import functools
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from cohortrl.config import ConfigError
from cohortrl.models import load_model
from cohortrl.trainers import checkpoint


def load_configured_model(model_cfg, seed: int):
    """``load_model`` for a config's ``model`` section; a cohortrl ``final/`` or checkpoint it names (as
    ``model.name`` or ``model.init``) is verified against its manifest first, so damaged weights never train or
    become a KL reference. A ``model.init`` adapter trained on top of another run's weights gets those merged
    first (``checkpoint.init_chain``), each verified the same way."""
    checkpoint.check_saved(model_cfg.name, "model.name")
    # init_chain verifies model.init and every link under it before reading their markers
    inits = [*checkpoint.init_chain(model_cfg.init), model_cfg.init] if model_cfg.init is not None else []
    return load_model(model_cfg.name, dtype=model_cfg.dtype, seed=seed, init=inits or None)


def trained_on(model_cfg) -> dict | None:
    """What a run that loads ``model_cfg`` itself starts its policy from, for its ``final/`` marker
    (``Trainer.trained_on``): ``checkpoint.init_record`` of ``model.init`` taken now, as it is loaded, or None."""
    return checkpoint.init_record(model_cfg.init) if model_cfg.init is not None else None


def build_policy(model_cfg, seed: int, model=None, tokenizer=None, *, activation_checkpointing: bool = False):
    """(model, tokenizer): loaded from the spec unless given; wrapped with a LoRA adapter if enabled; with
    ``activation_checkpointing`` (``train.activation_checkpointing``), each decoder layer recomputes its
    activations in the backward pass (transformers' gradient checkpointing, active only in training mode with
    gradients on: generation and the no-grad log-prob passes run as before)."""
    if model is None:
        model, tokenizer = load_configured_model(model_cfg, seed)
    if activation_checkpointing:
        # Non-reentrant checkpointing: gradients reach a LoRA adapter even though the embeddings feeding the
        # first checkpointed layer are frozen (the reentrant form needs inputs that require grad), and it
        # composes with FSDP2. transformers 5 renamed the method (the old name warns); 4.x has only the old one.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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

    def __init__(self, policy, lora: bool, frozen_copy: bool = True):
        """``frozen_copy=False``: the caller sets ``model`` itself (under FSDP2, from the sharded policy)."""
        self.lora = lora
        self.model = copy.deepcopy(policy).eval().requires_grad_(False) if frozen_copy and not lora else None
        self.policy = policy

    @contextmanager
    def __call__(self):
        if self.lora:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.model


def start_reference(model, start, seed: int, device) -> Reference:
    """The model an evaluated one was trained from, as a ``Reference``: ``start`` is the ``model`` section that
    names it, loaded here, or None when ``model`` is a LoRA adapter (then the model with its adapter off)."""
    if start is None:
        return Reference(model, lora=True)
    reference = Reference(model, lora=False, frozen_copy=False)
    reference.model = load_configured_model(start, seed)[0].to(device).eval()
    return reference


@dataclass
class Optimised:
    """A model the update trains: its parameters, optimiser and LR schedule; ``metric`` names its grad norm."""

    metric: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def as_float(x) -> float:
    """A scalar tensor (a DTensor under FSDP2) as a Python float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def optimizer_step(trained: list[Optimised], loss: float, max_grad_norm: float | None) -> tuple[bool, dict[str, float]]:
    """Grad-norm clipping, then AdamW and the LR schedule for every trained model, unless the loss or a
    gradient norm is not finite (then neither steps: their state stays exactly as before; ``guards.py`` says
    why). ``loss`` is the update's loss (summed over ranks under torchrun, so that every rank decides alike).
    Gradients are freed either way. Returns (finite, each model's grad norm by its metric name)."""
    norms = {o.metric: as_float(torch.nn.utils.clip_grad_norm_(o.params, max_grad_norm or float("inf"))) for o in trained}
    finite = math.isfinite(loss) and all(math.isfinite(n) for n in norms.values())  # a NaN anywhere makes the norm NaN
    for o in trained:
        if finite:
            o.optimizer.step()
            o.scheduler.step()
        # Freed once used (as transformers' Trainer does): the next rollout and reference pass run without
        # them (SmolLM2: 540 MB), and lay their buffers out as every later step will.
        o.optimizer.zero_grad(set_to_none=True)
    return finite, norms


LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on float32 master copies of bfloat16 / float16 parameters.

    An update of lr·m/√v ≈ 1e-5 is far below the spacing of bfloat16 numbers near a weight of 0.02 (2⁻¹³ ≈
    1.2e-4): AdamW applied to bf16 weights rounds nearly every update away, and the model does not learn. Here
    the model keeps its bf16 weights (forward, backward, generation and checkpoints unchanged) and each
    optimiser step runs AdamW on a float32 copy (``state["master"]``, with float32 moments) from the bf16
    gradient made float32, then writes the copy back rounded to bf16: small updates accumulate in the copy
    until they move the bf16 weight. The mixed-precision recipe of Micikevicius et al. (arXiv:1710.03740),
    without loss scaling (bf16 has float32's exponent range).

    The param groups hold the model's own parameters, so clipping, ``zero_grad``, the LR schedule and the
    checkpoint's ``state_dict`` (which carries the master copies) work as for plain AdamW."""

    @torch.no_grad()
    def step(self, closure=None):
        swapped = []  # (parameter, its bf16 data, its bf16 gradient) while AdamW sees the float32 copy
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # made on the first step (or after a checkpoint written without master copies), and kept in the
                # state only after AdamW's step: AdamW creates its moments for a parameter whose state is empty
                master = self.state[p].get("master")
                if master is None:
                    master = p.detach().to(torch.float32, copy=True)
                low, grad = p.data, p.grad
                p.grad = None
                p.data = master
                p.grad = grad.to(torch.float32)
                swapped.append((p, low, grad))
        try:
            return super().step(closure)
        finally:
            for p, low, grad in swapped:
                self.state[p]["master"] = p.data
                low.copy_(p.data)  # the updated master, rounded to the model's dtype
                p.grad = None
                p.data = low
                p.grad = grad

    def load_state_dict(self, state_dict: dict) -> None:
        """As AdamW's, but the master copies and moments stay float32 (torch casts a state tensor to its
        parameter's dtype, which would round the master copies to bf16)."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, saved):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)


def build_optimizer(model, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, with float32 master copies of bf16 / fp16 ones (``MasterWeightAdamW``);
    the fused kernel (one pass over each tensor instead of a dozen elementwise ops) where torch has it: plain
    tensors on the CPU or a GPU, not FSDP2's sharded DTensors (which FSDP2 keeps in float32 itself, see
    ``distributed.shard``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and type(p.data) is torch.Tensor for p in params)
    adamw = MasterWeightAdamW if any(p.dtype in LOW_PRECISION for p in params) else torch.optim.AdamW
    return adamw(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay,
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


def build_fast_path(train_cfg, device, model):
    """The run's CPU fast path (``cohortrl/cpu/``: a ``cpu.FastPath`` built once from ``train`` and the policy,
    handed to generation, the step and evaluation), or None. The trainers' one import of that package, made only
    when ``train.cpu_fast_path`` is not ``off``: with ``off`` no line of it runs."""
    if train_cfg.cpu_fast_path == "off":
        return None
    from cohortrl import cpu

    return cpu.build(train_cfg, device, model)


def cpu_bf16_products() -> bool:
    """Whether this machine runs ``train.cpu_decode_dtype``'s bf16 products fast (a CPU with bf16 units, a PyTorch
    build with oneDNN's linear op): what ``auto`` asks of the machine, for ``cohortrl plan``, which plans a run
    before there is a model to build its fast path for (``planner.run_spec_from_config``'s ``bf16_units``)."""
    from cohortrl.cpu import kernels

    return kernels.onednn_available() and kernels.cpu_has_bf16_units()


def decoding_step_ops(sampling=None):
    """The operations a decoding step runs on this build (``cpu.decoder.step_ops``: the lean decoder's laid-out
    products and attention) and generation's loop around them (:func:`generate_steps`, with ``sampling``: a run's
    ``sampling`` section, None for its defaults), for ``planner.cpu_rates.measure_cpu_rates``'s probes, so that
    they time what decoding runs; the planner, below this package, is handed them (``cohortrl plan``,
    ``benchmarks/planner_validation.py``)."""
    from cohortrl.config import SamplingConfig
    from cohortrl.cpu import decoder

    return decoder.step_ops()._replace(generate=functools.partial(generate_steps, sampling or SamplingConfig()))


def generate_steps(sampling, model, rows: int, steps: int, dtype: torch.dtype, record: bool) -> None:
    """``steps`` decoding steps of ``model`` for ``rows`` rows from a one-column prompt, as a training rollout runs
    them (``rollout.hf.generate_ids`` on a fast path of oneDNN's kernel, where the build has it: the lean decoder,
    its products in ``dtype``, recording where ``record`` and it can, and ``sampling``'s sampler; no stop string,
    no tool). No row ends: no token is EOS."""
    from cohortrl import cpu
    from cohortrl.cpu import kernels
    from cohortrl.rollout.hf import generate_ids

    fast_path = cpu.FastPath("onednn" if kernels.onednn_available() else "aten", "system", dtype)
    ids = torch.zeros(rows, 1, dtype=torch.long)
    sampling = replace(sampling, max_new_tokens=steps, min_new_tokens=0, stop=[])
    generate_ids(model, SimpleNamespace(pad_token_id=0), ids, torch.ones_like(ids), sampling, eos_ids=[-1],
                 record=record and fast_path.decoder_for(model) is not None, fast_path=fast_path, decode_dtype=dtype)


def fast_kernels(fast_path, *models):
    """A context for one phase of work (a step, an evaluation): ``models`` on the fast path's linear kernel, or
    nothing without a fast path."""
    return fast_path.kernels(*models) if fast_path is not None else nullcontext()
