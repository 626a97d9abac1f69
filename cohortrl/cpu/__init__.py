"""The CPU fast path: what makes an RL step on a small model fast on a CPU, as one object a run is handed.

``train.cpu_fast_path: auto`` (the default) turns it on where it is supported: a Llama-family model (llama,
qwen2, mistral without a sliding window) with fp32 weights on a CPU, plain or with plain LoRA adapters.
Anywhere else, and with ``train.cpu_fast_path: off``, a run uses plain transformers, PyTorch's kernels and
autograd throughout; where ``auto`` falls back, the run says so once, at INFO, with the reason. The parts:

- ``kernels.py``: the model's fp32 linear layers on oneDNN for the duration of a step or an evaluation
  (``train.cpu_linear``), switched per model, never by replacing ``torch.nn.functional.linear``;
- ``decoder.py``: a lean one-token decoding step computing the model's forward without transformers'
  per-call machinery, its products in fp32 or, for training rollouts, bf16 (``train.cpu_decode_dtype``);
- ``replay.py``: an on-policy GRPO update's backward through what decoding recorded, instead of a second
  forward (``train.reuse_rollout_forward``);
- ``memory.py``: freed memory kept in the process between steps (``train.cpu_allocator``; glibc's
  ``mallopt``, which is process-wide by nature: set when a run starts, glibc's defaults back when it closes),
  and the recording's buffers in maps kept from one generate call to the next (``RecordingMaps``).

A run builds its fast path once, from its settings and its model (:func:`build`: a :class:`FastPath`, or None
where nothing of it applies), and hands that object to what uses it: the step's and the evaluation's kernel
context (:meth:`FastPath.kernels`), generation (the lean decoder and its recording, :meth:`FastPath.decoder_for`,
:meth:`FastPath.recording`; the weights' decoding layout, :meth:`FastPath.decoding_weights`), and the update
(the recording's replayed backward). Nothing outside this package imports it except where that object is built
(``trainers/setup.py``'s ``build_fast_path``, ``reward_models/train.py``), and those import it only when the
setting is not ``off``: with ``train.cpu_fast_path: off`` no line of this package runs
(``tests/trainers/test_plain_path_imports.py`` checks it in a fresh process). The state it keeps is the run's:
the layers it switches, each layer's decoding layout, the recording's kept maps and the allocator hold (both
released on ``close``).

Each computes the same function as the plain path, to float rounding (the lean decoder's opt-in bf16 products,
``train.cpu_decode_dtype``, to bf16 rounding: ``tests/cpu/test_bf16_decoding.py``); ``tests/cpu/`` checks each against
it, and the trainer tests run on both paths (``tests/trainers/conftest.py``). It relies on transformers'
Llama module layout and PEFT's LoRA layer attributes (``lora_A``, ``lora_B``, ``scaling``, ``base_layer``,
``get_delta_weight``): the versions it is tested with are pinned in ``constraints.txt`` (dev and CI), and a model
whose layout it does not recognise falls back rather than fails (``decoder.check_architecture``). What it
gains is measured by ``benchmarks/vs_trl.py`` and ``benchmarks/cpu_linear.py`` (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from cohortrl.cpu import decoder, kernels
from cohortrl.cpu.decoder import check_architecture, computes
from cohortrl.cpu.kernels import resolve_cpu_linear, resolve_decode_dtype
from cohortrl.cpu.memory import (RecordingMaps, apply_cpu_allocator, release_freed_memory, resolve_cpu_allocator,
                                 trim_heap)
from cohortrl.cpu.replay import Recording


class FastPath:
    """One run's CPU fast path: its linear kernel (``onednn`` or ``aten``), whether it holds the retained
    allocator, ``decode_dtype``, the dtype of the lean decoder's products in the run's training rollouts
    (``train.cpu_decode_dtype``; what the rollout engine asks :meth:`decoder_for`, evaluation never does), and
    ``trim_every``, how often the heap's free pages go back to the OS (``train.cpu_heap_trim_every``).
    Built by :func:`build`; the run calls :meth:`end_of_step` after each step and :meth:`close` when it ends."""

    def __init__(self, linear: str, allocator: str, decode_dtype: torch.dtype = torch.float32, trim_every: int = 0):
        self.linear = linear
        self.decode_dtype = decode_dtype
        self.trim_every = trim_every
        self.holds_allocator = apply_cpu_allocator(allocator)  # process-wide while held: glibc's mallopt
        self.recording_maps = RecordingMaps()  # the recording's buffers, kept from one generate call to the next

    def end_of_step(self, step: int) -> None:
        """Step ``step`` (counted from 1) is done: the recording's kept maps give back what is past their marks
        (``memory.RecordingMaps``), and every ``trim_every`` steps the heap's free pages go back to the OS
        (``memory.trim_heap``), so what freed blocks of varying sizes leave behind does not pile up."""
        self.recording_maps.end_of_step()
        if self.trim_every and step % self.trim_every == 0:
            trim_heap()

    def kernels(self, *models):
        """A context for one phase of work (a step, an evaluation): the linear layers of ``models`` on this
        run's kernel (``kernels.linear_kernels``)."""
        return kernels.linear_kernels(self.linear, *models)

    def decoder_for(self, model, dtype: torch.dtype = torch.float32):
        """The lean decoder's factory for ``model`` (``decoder.LlamaDecoder``) when this run decodes on oneDNN
        and the decoder computes the model, else None (transformers' forward; the reason said once). ``dtype``:
        its products' dtype (fp32 unless the caller passes :attr:`decode_dtype`, as training rollouts do)."""
        factory = decoder.decoder_for(model) if self.linear == "onednn" else None
        if factory is None:
            return None
        return functools.partial(factory, dtype=dtype, recording_maps=self.recording_maps)

    def decoding_weights(self, model, rows: int):
        """While transformers' forward decodes ``rows`` rows: the weights in oneDNN's layout for them
        (``kernels.decoding_weights``; nothing unless the model's layers are on oneDNN)."""
        return kernels.decoding_weights(model, rows) if self.linear == "onednn" else contextlib.nullcontext()

    @staticmethod
    def recording(lean_decoder, prefix, mask) -> Recording:
        """What a recording decoder computed, for the update to differentiate (``replay.Recording``); what every
        row wrote is marked reusable for the next call (``memory.RecordingMaps``)."""
        lean_decoder.mark_reusable()
        return Recording(lean_decoder, prefix, mask)

    def close(self) -> None:
        """The run is over: the recording's maps and the allocator hold go back (glibc's defaults after the last
        holder)."""
        self.recording_maps.close()
        if self.holds_allocator:
            release_freed_memory()
            self.holds_allocator = False


def build(settings, device, model, *, generates: bool = True) -> FastPath | None:
    """A run's fast path from its settings (``cpu_fast_path``, ``cpu_linear``, ``cpu_allocator``: a run's
    ``train`` section, or ``train-rm``'s config) and its model, or None where no part of it applies (off, a GPU,
    ``cpu_linear: aten`` with the system allocator). ``generates``: the run decodes with the model (the
    trainers), so ``cpu_linear: auto`` falls back on a model the lean decoder does not compute, and
    ``cpu_decode_dtype: bfloat16`` is checked against the machine and the model (an error where it cannot run;
    ``auto`` decodes in fp32 there);
    a run that does not (``train-rm``) takes oneDNN's kernel on any model, the kernel being the same function."""
    if settings.cpu_fast_path == "off":
        return None
    decode_dtype = torch.float32
    if generates:
        # the model first: on one the lean decoder does not compute, cpu_linear auto has already fallen back to
        # aten, and the kernel's error would send the user to the wrong setting
        wanted = settings.cpu_decode_dtype
        if wanted != "float32" and torch.device(device).type == "cpu" and decoder.decoder_for(model) is None:
            if wanted == "bfloat16":
                raise RuntimeError("train.cpu_decode_dtype=bfloat16 needs the lean decoder, which does not compute "
                                   "this model (the reason is logged above); set train.cpu_decode_dtype=float32.")
            wanted = "float32"  # auto: transformers' forward decodes, in the model's dtype (the reason logged above)
        linear = linear_kernel(settings, device, model)
        decode_dtype = resolve_decode_dtype(wanted, linear)
    else:
        linear = resolve_cpu_linear(settings.cpu_linear, device)
    allocator = resolve_cpu_allocator(settings.cpu_allocator, device)
    trim_every = getattr(settings, "cpu_heap_trim_every", 0)  # train-rm's config has none: it never trims
    if linear == "aten" and allocator == "system" and not (trim_every and torch.device(device).type == "cpu"):
        return None
    return FastPath(linear, allocator, decode_dtype, trim_every)


def linear_kernel(settings, device, model) -> str:
    """The kernel a run's linear layers use, ``onednn`` or ``aten``, from ``cpu_fast_path`` and ``cpu_linear``.
    ``auto`` on a model the fast path does not compute falls back to ``aten`` and says why; an explicit
    ``cpu_linear: onednn`` is honoured on any model (the kernel is the same function)."""
    if settings.cpu_fast_path == "off" or torch.device(device).type != "cpu":
        return "aten"
    kind = resolve_cpu_linear(settings.cpu_linear, device)
    instead = "it runs on plain transformers and PyTorch's kernels (train.cpu_fast_path)"
    if kind == "onednn" and settings.cpu_linear == "auto" and not computes(model, instead, check_architecture):
        return "aten"
    return kind
