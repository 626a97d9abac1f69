"""The CPU fast path: what makes an RL step on a small model fast on a CPU, behind one switch.

``train.cpu_fast_path: auto`` (the default) turns it on where it is supported: a Llama-family model (llama,
qwen2, mistral without a sliding window) with fp32 weights on a CPU, plain or with plain LoRA adapters.
Anywhere else, and with ``train.cpu_fast_path: off``, a run uses plain transformers, PyTorch's kernels and
autograd throughout; where ``auto`` falls back, the run says so once, at INFO, with the reason. The parts:

- ``kernels.py``: the model's fp32 linear layers on oneDNN for the duration of a step or an evaluation
  (``train.cpu_linear``), switched per model, never by replacing ``torch.nn.functional.linear``;
- ``decoder.py``: a lean one-token decoding step computing the model's forward without transformers'
  per-call machinery;
- ``replay.py``: an on-policy GRPO update's backward through what decoding recorded, instead of a second
  forward (``train.reuse_rollout_forward``);
- ``memory.py``: freed memory kept in the process between steps (``train.cpu_allocator``; glibc's
  ``mallopt``, which is process-wide by nature: set when a run starts, glibc's defaults back when it closes).

Each computes the same function as the plain path, to float rounding; ``tests/cpu/`` checks each against
it, and the trainer tests run on both paths (``tests/trainers/conftest.py``). It relies on transformers'
Llama module layout and PEFT's LoRA layer attributes (``lora_A``, ``lora_B``, ``scaling``, ``base_layer``,
``get_delta_weight``): the versions it is tested with are pinned in ``constraints.txt`` (dev and CI), and a model
whose layout it does not recognise falls back rather than fails (``decoder.check_architecture``). What it
gains is measured by ``benchmarks/vs_trl.py`` and ``benchmarks/cpu_linear.py`` (docs/performance.md).
"""

from __future__ import annotations

import torch

from cohortrl.cpu.decoder import check_architecture, computes
from cohortrl.cpu.kernels import resolve_cpu_linear
from cohortrl.cpu.memory import resolve_cpu_allocator


def linear_kernel(train_cfg, device, model) -> str:
    """The kernel a run's linear layers use, ``onednn`` or ``aten``, from ``train.cpu_fast_path`` and
    ``train.cpu_linear``. ``auto`` on a model the fast path does not compute falls back to ``aten`` and says
    why; an explicit ``cpu_linear: onednn`` is honoured on any model (the kernel is the same function)."""
    if train_cfg.cpu_fast_path == "off" or torch.device(device).type != "cpu":
        return "aten"
    kind = resolve_cpu_linear(train_cfg.cpu_linear, device)
    instead = "it runs on plain transformers and PyTorch's kernels (train.cpu_fast_path)"
    if kind == "onednn" and train_cfg.cpu_linear == "auto" and not computes(model, instead, check_architecture):
        return "aten"
    return kind


def allocator(train_cfg, device) -> str:
    """``retain`` or ``system`` (``memory.py``), from ``train.cpu_fast_path`` and ``train.cpu_allocator``."""
    if train_cfg.cpu_fast_path == "off":
        return "system"
    return resolve_cpu_allocator(train_cfg.cpu_allocator, device)
