"""CPU kernels: fp32 linear layers through oneDNN instead of MKL.

On a CPU, PyTorch sends an fp32 ``F.linear`` to MKL's sgemm. The products a small LLM's RL step is made of are
thin: decoding multiplies a weight by one row per sequence (8 × 576 by 576 × 1,536 for SmolLM2 at P·G = 8),
training by a few hundred rows. On those shapes oneDNN (shipped inside every x86 PyTorch wheel, used by
PyTorch for its own convolutions and bf16 products) can be faster than MKL; ``benchmarks/cpu_linear.py``
measures both side by side on any machine, and docs/performance.md records what it measured where.

:func:`linear_kernels` is a context for one phase of work on the models it is given: each of their
``nn.Linear`` layers (what transformers' Llama-family models, PEFT's LoRA layers and the critic's head are made
of) becomes a :class:`OneDNNLinear` while it lasts, whose forward calls ``torch.ops.mkldnn._linear_pointwise``
on fp32 plain tensors on the CPU and PyTorch's own ``F.linear`` on anything else (GPU tensors, bf16, FSDP's
DTensors). Nothing outside those modules changes: ``torch.nn.functional.linear`` is never replaced, and
other models in the process keep PyTorch's kernel. This package's own products (the lean decoder, the
replayed backward) call :func:`onednn_linear`: they run only on a run whose fast path chose oneDNN. Code outside
the package that applies a layer's weight itself (the rollout's chunked logit head) calls the layer class's
``product``, so it follows the layer and no process-wide state.
Under autograd, :class:`_OneDNNLinearFn` computes the input gradient with oneDNN too and the weight gradient
with ``torch.mm`` (on SmolLM2's shapes oneDNN was no faster there). It is the same function, summed in another
order: outputs and gradients agree with PyTorch's to float rounding (``tests/cpu/test_kernels.py``), so
sampling and the loss do not change, only the last bits of each product.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import torch.nn.functional as F

from cohortrl import machine

# the decoding dtype auto chose, said where a run's progress lines go (stderr under the CLI)
progress = logging.getLogger("cohortrl.progress")

_ATEN_LINEAR = F.linear  # PyTorch's own (never replaced; the name keeps call sites explicit)


def onednn_available() -> bool:
    """oneDNN's fused linear op exists in this PyTorch build (x86 wheels have it; some ARM builds do not)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_cpu_linear(setting: str, device: torch.device | str) -> str:
    """``train.cpu_linear`` made concrete for a device: ``onednn`` or ``aten``. ``auto`` picks oneDNN on a CPU
    when the build has it; ``onednn`` on a build without it is an error rather than a silent fallback."""
    if torch.device(device).type != "cpu":
        return "aten"
    if setting == "onednn" and not onednn_available():
        raise RuntimeError(
            "train.cpu_linear=onednn, but this PyTorch build has no oneDNN linear op "
            "(torch.ops.mkldnn._linear_pointwise). Set train.cpu_linear=aten (or auto)."
        )
    if setting == "auto":
        return "onednn" if onednn_available() else "aten"
    return setting


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), asked at run time: oneDNN
    also runs bf16 products on CPUs without them, by conversion, and no faster than fp32 there."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # PyTorch 2.9+
    if capabilities is not None:
        found = capabilities()
        return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    flags = machine.cpuinfo().get("flags", "").split()  # older PyTorch, on Linux: the kernel's list (none elsewhere)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_decode_dtype(setting: str, linear: str) -> torch.dtype:
    """``train.cpu_decode_dtype`` made concrete for a run whose linear kernel is ``linear``: the dtype of the lean
    decoder's products in training rollouts. ``bfloat16`` on a machine that cannot run it fast is an error
    rather than a silent fallback; ``auto`` takes bf16 where it would run and fp32 elsewhere, saying which on
    the progress logger when the CPU decides (a GPU run never decodes on the lean decoder)."""
    if setting == "float32":
        return torch.float32
    if setting == "auto":
        if linear != "onednn":
            return torch.float32  # a GPU, the fast path off, or a model it does not compute (said where decided)
        if not cpu_has_bf16_units():
            progress.info("train.cpu_decode_dtype=auto: this CPU has no bf16 units (neither avx512_bf16 nor amx_bf16); "
                          "training rollouts decode in float32")
            return torch.float32
        progress.info("train.cpu_decode_dtype=auto: this CPU has bf16 units; training rollouts decode with bf16 products")
        return torch.bfloat16
    if linear != "onednn":
        raise RuntimeError("train.cpu_decode_dtype=bfloat16 needs the CPU fast path's oneDNN kernel (a CPU, "
                           "train.cpu_fast_path=auto, train.cpu_linear auto or onednn, a PyTorch build with oneDNN); "
                           "set train.cpu_decode_dtype=float32 (or auto).")
    if not cpu_has_bf16_units():
        raise RuntimeError("train.cpu_decode_dtype=bfloat16, but this CPU has no bf16 units (neither avx512_bf16 nor "
                           "amx_bf16), where bf16 products are no faster than fp32; set train.cpu_decode_dtype=float32 "
                           "(or auto).")
    return torch.bfloat16


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b with oneDNN; backward: dx = dy W (oneDNN), dW = dyᵀ x and db = Σ dy (aten)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = _onednn(grad_y, weight.t(), None)
        if need_w or (need_b and ctx.has_bias):
            g2 = grad_y.reshape(-1, grad_y.shape[-1])
            if need_w:
                grad_w = g2.t() @ x.reshape(-1, x.shape[-1])
            if need_b and ctx.has_bias:
                grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def _plain_cpu_fp32(t: torch.Tensor | None) -> bool:
    # Subclasses (DTensor, FakeTensor, ...) keep their own dispatch; Parameter is a plain tensor here.
    return t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32)


def onednn_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  layout: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``F.linear`` on oneDNN where eligible (fp32 plain CPU tensors, see the module docstring), else PyTorch's
    own ``F.linear``. ``layout``: (rows, the weight in oneDNN's layout for products of that many rows), used for
    such a product without gradient (:func:`decoding_weights`)."""
    x = input
    if x.dim() < 2 or weight.dim() != 2 or not (_plain_cpu_fp32(x) and _plain_cpu_fp32(weight) and _plain_cpu_fp32(bias)):
        return _ATEN_LINEAR(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDNNLinearFn.apply(x, weight, bias)
    if layout is not None and x.numel() == layout[0] * x.shape[-1]:
        return _onednn(x, layout[1], bias)  # a decoding step: the weight in oneDNN's own layout
    return _onednn(x, weight, bias)


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`onednn_linear`: what :func:`linear_kernels` turns a model's
    linear layers into for its duration (same parameters, same state dict). ``product``: the function it
    computes, for code that applies its weight itself (``rollout/hf.py``'s chunked logit head) and so stays
    on this layer's kernel without importing this package."""

    product = staticmethod(onednn_linear)
    decoding_layout: tuple[int, torch.Tensor] | None = None  # set by decoding_weights while it lasts

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return onednn_linear(input, self.weight, self.bias, self.decoding_layout)


# What a plain linear layer is while a step runs: code of this package that needs one (rather than a subclass
# with its own forward) checks ``type(m) in PLAIN_LINEAR``.
PLAIN_LINEAR = (torch.nn.Linear, OneDNNLinear)

_lock = threading.Lock()  # two threads switching the same model's layers would race


@contextlib.contextmanager
def linear_kernels(kind: str, *models: torch.nn.Module | None):
    """A context for one phase of work (a training step, an evaluation) on ``models``: ``onednn`` runs their
    ``nn.Linear`` layers on oneDNN; ``aten`` changes nothing. None among ``models`` is skipped.

    A layer is switched by setting its class to :class:`OneDNNLinear` (a subclass: ``isinstance`` checks, the
    state dict and hooks are unchanged) and switched back on exit; layers of a subclass of ``nn.Linear`` keep
    their own forward. Nested contexts leave a layer switched until the one that switched it exits. What is
    switched is the layers themselves: no state outside them."""
    if kind not in ("onednn", "aten"):
        raise ValueError(f"unknown linear kernel {kind!r}: expected 'onednn' or 'aten'")
    if kind == "aten":
        yield
        return
    switched = []
    with _lock:
        for model in models:
            for m in model.modules() if model is not None else ():
                if type(m) is torch.nn.Linear:
                    m.__class__ = OneDNNLinear
                    switched.append(m)
    try:
        yield
    finally:
        with _lock:
            for m in switched:
                m.__class__ = torch.nn.Linear


@contextlib.contextmanager
def decoding_weights(model, rows: int):
    """While decoding ``rows`` sequences one token at a time: the weight of every layer of ``model`` on the oneDNN
    kernel (switched by :func:`linear_kernels`) in oneDNN's blocked layout for ``rows``-row products, made once on
    entry and freed on exit, kept on the layer (``OneDNNLinear.decoding_layout``); its forward uses it for the
    products with exactly ``rows`` rows. A no-op on layers not on the oneDNN kernel and on a build without the
    layout op; inside another decoding context (an evaluation inside a step) the outer layout stays.

    Decoding multiplies every weight by a few rows per token, so it reads all the weights once per token, and
    oneDNN reads its own layout faster than the plain one (``benchmarks/cpu_linear.py`` measures both on any
    model; docs/performance.md has the numbers). It holds a second copy of the weights while decoding, freed
    when decoding ends, before the update (whose gradients and optimiser state weigh more). Same function, to
    float rounding."""
    laid_out = []
    try:
        if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            for m in model.modules():
                w = m.weight if type(m) is OneDNNLinear else None
                if w is not None and w.dim() == 2 and _plain_cpu_fp32(w) and m.decoding_layout is None:
                    m.decoding_layout = (rows, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))
                    laid_out.append(m)
        yield
    finally:
        for m in laid_out:
            del m.decoding_layout  # back to the class's None
