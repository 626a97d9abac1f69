"""A lean one-token decoding step for Llama-architecture models on a CPU (Llama, Qwen2, Mistral without a
sliding window): the same function as the transformers model's forward, minus its per-call machinery.

Decoding runs the model on one token per row, B rows at a time, once per sampled token. At B = 8 on SmolLM2
the products themselves are small (one 8-row product per weight), and transformers' forward spends as long
again around them: the cache object's ``torch.cat`` per layer and token, mask construction, rotary
embeddings recomputed per layer, module dispatch, dtype casts, SDPA's checks. :class:`LlamaDecoder` reads the
model's own weights and does only the arithmetic:

- the q/k/v projections and gate/up projections merged into one product each, every weight laid out once
  in oneDNN's blocked format for B-row products (what ``kernels.decoding_weights`` does for the transformers
  path);
- a preallocated KV cache, written in place;
- the rotary cos/sin for every step computed once, by the model's own rotary module (any rope type it has),
  applied as one complex product per tensor (q and k features reordered into adjacent pairs);
- attention as two batched products over each KV head's group of query heads (no repeated K/V);
- rows that have ended (EOS, a stop string) leave the products (:meth:`LlamaDecoder.end_rows`): a batch
  decodes until its longest response ends, and its shorter rows would otherwise be computed to the end.

PEFT LoRA adapters are folded into the laid-out copy (W + s·B·A): the same function, computed in one
product. Only plain LoRA; DoRA, LoRA bias or other variants fall back to transformers' forward, as do other
architectures, GPUs and non-fp32 weights (:func:`decoder_for` returns None and says why at INFO, once per model).
Prefill stays with transformers' forward: it runs once per prompt, on many tokens, where its overhead is
small. The arithmetic is the same to float rounding; ``tests/cpu/test_decoder.py`` checks the logits against
transformers' step by step.

``dtype=torch.bfloat16`` (``train.cpu_decode_dtype``, training rollouts only): the laid-out copies are bf16
(adapters folded in fp32 first, then cast), each product's input is cast to bf16 and its output, which oneDNN
writes in bf16, back to fp32 (the logits too: the head's bf16 output); everything between the products (residual
stream, norms, rotary, attention, the KV cache) stays fp32, and so does transformers' prefill. The same function
to bf16 rounding (``tests/cpu/test_bf16_decoding.py``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cohortrl.cpu import kernels
from cohortrl.cpu.memory import RecordingMaps, mapped_zeros, release_tail

log = logging.getLogger("cohortrl")

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
# A recording decoder keeps every step's logits (B·S·V fp32) up to this size, as the chunked LM head keeps its
# probabilities (rollout/hf.py); above it the update recomputes them from the recorded final hidden states.
RECORD_LOGITS_BYTES = 128 * 2**20
# Rows that have ended leave the products once this share of the rows still computed has ended
# (:meth:`LlamaDecoder.end_rows`): dropping them costs a copy of the survivors' KV cache, so not at every end.
DROP_SHARE = 0.25


class Unsupported(Exception):
    """This model cannot use the lean decoder; transformers' forward is used instead."""


# The reasons already logged, per model: generation asks before every call, and a run's policy is one model
# object, so a run says each reason once instead of every step. Weak keys: a finished run's model is not kept.
_fallbacks_logged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def log_fallback(model, reason: Exception, instead: str) -> None:
    """Say at INFO, once per model and reason, that the CPU fast path is not used for ``model``, why, and what
    runs ``instead``."""
    logged = _fallbacks_logged.setdefault(model, set())
    if str(reason) in logged:
        return
    logged.add(str(reason))
    inner = getattr(model, "module", model)  # DDP
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    log.info("the CPU fast path is not used for %s: %s; %s", type(inner).__name__, reason, instead)


def _linear_parts(module) -> tuple[torch.nn.Linear, list[str]]:
    """A linear module as (its plain ``nn.Linear``, the names of the plain LoRA adapters it adds on top);
    raises :class:`Unsupported` for anything else. Cheap: no weight is computed."""
    if type(module) in kernels.PLAIN_LINEAR:
        return module, []
    base = getattr(module, "base_layer", None)
    if type(base) not in kernels.PLAIN_LINEAR or not hasattr(module, "get_delta_weight"):
        raise Unsupported(f"linear layer of type {type(module).__name__}")
    if module.disable_adapters or module.merged:
        return base, []
    names = [name for name in module.active_adapters if name in module.lora_A]
    for name in names:
        if name in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(name):
            raise Unsupported(f"LoRA variant or LoRA bias in adapter {name!r}")
    return base, names


def _weight_and_bias(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The function a linear module computes, as (W, b): its own weight, or for a PEFT LoRA layer the base
    weight plus each active adapter's s·B·A (what ``merge`` would write)."""
    base, adapters = _linear_parts(module)
    weight = base.weight.detach()
    for name in adapters:
        weight = weight + module.get_delta_weight(name).detach()
    return weight, None if base.bias is None else base.bias.detach()


def _stacked(modules, orders=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight for several linear layers with the same input (their rows stacked, contiguous) and their
    stacked bias (None if none has one). ``orders``: per module, an order of its output features (None: as
    they are)."""
    pairs = [_weight_and_bias(m) for m in modules]
    if orders is not None:
        pairs = [(w, b) if o is None else (w[o], None if b is None else b[o]) for (w, b), o in zip(pairs, orders)]
    weight = torch.cat([w for w, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
    if any(b is not None for _, b in pairs):
        bias = torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in pairs])
    else:
        bias = None
    return weight.contiguous(), bias


def _merged(modules, rows: int, orders=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_stacked` (adapters folded in fp32), the weight cast to ``dtype`` in oneDNN's layout for ``rows``-row
    products."""
    weight, bias = _stacked(modules, orders)
    return laid_out(weight, rows, dtype), bias


def laid_out(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 weight (out, in) cast to ``dtype`` in oneDNN's blocked layout for ``rows``-row products: how the
    decoder holds every linear weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), rows)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x Wᵀ + b in fp32 through a :func:`laid_out` weight of ``dtype``: x cast to it, oneDNN's product in it, its
    output cast back (no-op casts in fp32)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, bias, "none", [], "").float()


def grouped_attention(q_nHD: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor,
                      scale: float, length: int) -> torch.Tensor:
    """One layer's attention for one decoding step: n rows' queries (n, H, D) against the first ``length`` columns
    of their keys and values (n, Hkv, T, D); each KV head serves its H / Hkv query heads as one batched product,
    (n·Hkv, g, D) @ (n·Hkv, D, length), scaled, plus ``key_bias`` (n·Hkv, 1, length), the key mask. Returns
    (n, H·D). Each call reads every row's keys and values up to ``length`` for a few FLOPs per value read."""
    n, H, D = q_nHD.shape
    Hkv = keys.shape[1]
    scores = torch.baddbmm(key_bias, q_nHD.reshape(n * Hkv, H // Hkv, D),
                           keys[:, :, :length].flatten(0, 1).transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), values[:, :, :length].flatten(0, 1)).view(n, H * D)


class StepOps(NamedTuple):
    """What a decoding step of the lean decoder runs, for code that times it without importing this package
    (``planner.cpu_rates.measure_cpu_rates``, handed it by ``trainers.setup.decoding_step_ops``)."""

    laid_out: Callable  # (weight (out, in), rows, dtype) -> the weight as the products read it
    product: Callable  # (x fp32, that weight, bias, dtype) -> x Wᵀ + b in fp32
    attention: Callable  # grouped_attention
    cache_zeros: Callable  # (shape, dtype) -> a zero tensor where the decoder keeps its KV cache (mapped_zeros)
    # (model, rows, steps, dtype, record) -> None: generation's loop for ``steps`` tokens, the lean decoder's step
    # and the sampler; the sampler lives above this package, so ``trainers.setup.decoding_step_ops`` supplies it
    generate: Callable | None = None


def step_ops() -> StepOps:
    """The decoding step's operations on this build: the lean decoder's (oneDNN's layout and product, its
    attention) where the build has oneDNN's linear and layout ops; else, where transformers' forward decodes,
    PyTorch's own ``F.linear`` on plain weights beside the same attention."""
    try:
        check_build()
    except Unsupported:
        return StepOps(_plain_weight, _plain_product, grouped_attention, mapped_zeros)
    return StepOps(laid_out, product, grouped_attention, mapped_zeros)


def _plain_weight(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


def _plain_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return F.linear(x.to(dtype), weight, bias).float()


def _cached(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s keys and values (B, Hkv, T, D) in a transformers ``DynamicCache``: ``cache.layers``
    from transformers 4.56, ``key_cache`` / ``value_cache`` lists before."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _base_model(model):
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise Unsupported("a DDP-wrapped model")
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.lru_cache(maxsize=None)
def _cache_layout_known(cache_class) -> bool:
    """Whether transformers' ``DynamicCache`` keeps its keys and values where :func:`_cached` reads them. Asked
    before every generation; the answer depends only on the class, so it is worked out once per class."""
    try:
        cache = cache_class()
    except Exception:  # a newer constructor that wants arguments: a layout this module does not know
        return False
    return hasattr(cache, "layers") or hasattr(cache, "key_cache")


def check_architecture(model) -> None:
    """Raise :class:`Unsupported` (with the reason) unless the fast path computes this model: a Llama-family
    architecture with fp32 weights on a CPU, made of plain linear layers or plain LoRA ones, under a
    transformers version whose KV cache it can read. An attribute the checks expect but a newer transformers
    or PEFT no longer has raises ``AttributeError``, which :func:`computes` treats as a reason too."""
    if not _cache_layout_known(DynamicCache):
        raise Unsupported("transformers' DynamicCache has neither `layers` (4.56+) nor `key_cache` (before), the "
                          "layouts the lean decoder reads")
    base = _base_model(model)
    cfg = base.config
    if cfg.model_type not in SUPPORTED_TYPES:
        raise Unsupported(f"not a Llama-family architecture (model_type {cfg.model_type!r}; the lean decoder "
                          f"computes {', '.join(SUPPORTED_TYPES)})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg.hidden_act!r}")
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type != "qwen2" or getattr(cfg, "use_sliding_window", False)):
        raise Unsupported("sliding-window attention")
    weight = base.get_input_embeddings().weight
    if not kernels._plain_cpu_fp32(weight):
        raise Unsupported(f"weights of type {type(weight).__name__} on {weight.device} in {weight.dtype} "
                          "(the lean decoder is for plain fp32 tensors on a CPU)")
    inner = getattr(base, "model", None)
    missing = [name for name in ("layers", "norm", "rotary_emb") if not hasattr(inner, name)]
    if missing or base.get_output_embeddings() is None:
        raise Unsupported(f"a decoder without {', '.join(missing) or 'an output head'}")
    _linear_parts(base.get_output_embeddings())
    for layer in base.model.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            _linear_parts(m)


def check_supported(model) -> None:
    """Raise :class:`Unsupported` (with the reason) unless the lean decoder computes this model's forward:
    :func:`check_architecture`, on a build with oneDNN's linear op and layout op. Whether a run decodes on
    oneDNN at all is its fast path's decision (``cpu.FastPath.decoder_for``), not this function's."""
    check_architecture(model)
    check_build()


def check_build() -> None:
    """Raise :class:`Unsupported` unless this PyTorch build has the oneDNN ops the lean decoder multiplies with."""
    if not kernels.onednn_available():
        raise Unsupported("this PyTorch build has no oneDNN linear op")
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or "binary" not in torch.ops.mkldnn._linear_pointwise.overloads():
        raise Unsupported("this PyTorch build has no oneDNN weight layout op or fused linear-add")


def computes(model, instead: str, check=check_supported) -> bool:
    """Whether ``check`` (:func:`check_supported` or :func:`check_architecture`) passes for ``model``; if not,
    the reason is logged once per model with what runs ``instead``."""
    try:
        check(model)
    except (Unsupported, AttributeError) as e:
        log_fallback(model, e, instead)
        return False
    return True


def decoder_for(model):
    """A :class:`LlamaDecoder` factory for ``model`` if it qualifies, else None (transformers' forward; the
    reason logged once per model)."""
    return LlamaDecoder if computes(model, "generation and backward use plain transformers") else None


class LlamaDecoder:
    """Decoding state for B rows: weights in oneDNN's layout, the KV cache, the rotary tables.

    Built from a transformers KV cache holding each row's first ``seen`` tokens (columns of the left-padded
    prompt batch) and the prompt mask (B, Tp); :meth:`step` then takes one token per row, for columns
    ``seen, seen + 1, ...`` in order, and returns the next-token logits (B, V) in fp32.

    ``prefix`` = (ids_UP, mask_UP, index_B) instead of a cache: the decoder runs the first P prompt columns
    itself, each of the U distinct prompts once (``index_B``: each row's prompt), in :meth:`_prefill`.
    ``record``: keep what the update's backward needs to reuse this forward (``cpu/replay.py``): per layer
    and per call, the layer's input, its q/k/v and gate/up products and the residual after attention; per
    step, the final hidden state, the tokens fed, log Z and the entropy of the logits at ``temperature`` and (told
    by :meth:`sampled`) the sampled token's logit, and the logits themselves while they fit. It takes ``prefix``,
    not a transformers cache (every position must be recorded). ``dtype``: the products' (see the module
    docstring); a recording keeps what they computed, in fp32. ``recording_maps``: the run's kept maps for the
    recording (``memory.RecordingMaps``; :meth:`mark_reusable` tells them what every row wrote), else each
    buffer in a fresh map of its own."""

    def __init__(self, model, hf_cache, prompt_mask_BT: torch.Tensor, positions_BS: torch.Tensor, *,
                 prefix: tuple | None = None, record: bool = False, temperature: float = 1.0,
                 dtype: torch.dtype = torch.float32, recording_maps: RecordingMaps | None = None):
        if record and hf_cache is not None:
            raise ValueError("a recording decoder runs the prompt itself: pass prefix=, not a transformers cache")
        base = self.base = _base_model(model)
        cfg = base.config
        B = prompt_mask_BT.shape[0]
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        # Rotary embedding pairs feature i of a head with feature i + D/2 (transformers' rotate_half). Ordering
        # each head's q and k features as (0, D/2, 1, D/2 + 1, ...) makes every pair adjacent, so the rotation
        # is one complex product. Queries and keys share the order, so their dot products do not change.
        pair = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], 1).flatten()  # (D,)
        self.q_order = q_order = (torch.arange(self.H)[:, None] * D + pair).flatten()
        self.k_order = k_order = (torch.arange(self.Hkv)[:, None] * D + pair).flatten()
        self.dtype = dtype
        merged = functools.partial(_merged, rows=B, dtype=dtype)
        self.layers = []
        for layer in base.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon,
                merged([attn.q_proj, attn.k_proj, attn.v_proj], orders=[q_order, k_order, None]), merged([attn.o_proj]),
                layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon,
                merged([mlp.gate_proj, mlp.up_proj]), merged([mlp.down_proj]),
            ))
        self.norm = (base.model.norm.weight.detach(), base.model.norm.variance_epsilon)
        self.head = merged([base.get_output_embeddings()])
        self.embed = base.get_input_embeddings().weight.detach()
        self.scale = D ** -0.5

        # positions_BS: the position of each token still to be fed, one column per step
        S = positions_BS.shape[1]
        seen = hf_cache.get_seq_length() if hf_cache is not None else prefix[0].shape[1] if prefix is not None else 0
        self.col = seen
        T = seen + S
        dtype = self.embed.dtype  # fp32: the cache and the records whatever the products' dtype
        # the per-call buffers (KV cache, recording) in maps of their own, returned to the OS when freed (memory.py)
        self.k = [mapped_zeros((B, self.Hkv, T, self.D), dtype) for _ in self.layers]
        self.v = [mapped_zeros((B, self.Hkv, T, self.D), dtype) for _ in self.layers]
        for i in range(len(self.layers) if hf_cache is not None and seen else 0):
            keys, values = _cached(hf_cache, i)
            self.k[i][:, :, :seen] = keys[..., pair]  # the keys in the paired order, as computed below
            self.v[i][:, :, :seen] = values
        # additive key mask over all T columns: the prompt's padding is -inf, everything fed later is real
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[:, : prompt_mask_BT.shape[1]] = prompt_mask_BT.bool()
        key_bias = torch.zeros(B, 1, 1, T, dtype=dtype).masked_fill(~keep[:, None, None, :], float("-inf"))
        self.key_bias_groups = key_bias.expand(B, self.Hkv, 1, T).reshape(B * self.Hkv, 1, T)  # per KV head
        self.rotation = self.rotation_for(positions_BS)  # (B, S, 1, D/2)
        self.B = B
        self.rows: torch.Tensor | None = None  # the rows still computed (None: all B); the cache holds only theirs
        self.dropped: dict[int, int] = {}  # row -> the first step that did not compute it
        self.s = 0
        self.record = record
        V = base.get_output_embeddings().weight.shape[0]
        self.keep_logits = record and B * S * V * 4 <= RECORD_LOGITS_BYTES
        # Recorded rows (cpu/replay.py): the prefix's U·P rows, then step s's B rows at U·P + s·B, written in
        # place as they are computed (no concatenation afterwards); a run that ends early leaves the tail unused.
        self.n_prefix = prefix[0].numel() if record and prefix is not None else 0
        rows, d = self.n_prefix + S * B, cfg.hidden_size
        widths = (d, (self.H + 2 * self.Hkv) * D, d, 2 * cfg.intermediate_size)  # x_in, qkv, x_mid, gate_up
        # in the run's kept maps when it has them (no page faults for what the last call's rows all wrote)
        self.maps = recording_maps
        def zeros(key, shape, dtype):
            return recording_maps.zeros(key, shape, dtype) if recording_maps is not None else mapped_zeros(shape, dtype)
        self.records = [[zeros(("record", i, j), (rows, w), dtype) for j, w in enumerate(widths)]
                        for i in range(len(self.layers))] if record else []
        self.finals = zeros("finals", (S * B, d), dtype) if record else None  # the last layer's output, before the final norm
        self.logits = zeros("logits", (S * B, V), torch.float32) if self.keep_logits else None  # as returned, while they fit
        self.fed: list[torch.Tensor] = []  # per step: the tokens fed (B,)
        self.temperature = float(temperature or 1.0)  # greedy decoding is scored at temperature 1, as response_logprobs does
        self.logz: list[torch.Tensor] = []  # per step (B,): log Σ exp(logits / temperature)
        self.entropy: list[torch.Tensor] = []  # per step (B,)
        self.target: list[torch.Tensor] = []  # per step (B,): the sampled token's logit / temperature
        if prefix is not None and seen:
            self._prefill(*prefix)

    def mark_reusable(self) -> None:
        """Decoding is over: tell the run's kept maps how much of each recording buffer every row wrote (the
        prefix's rows and the steps before the first row left the products), which the next call may reuse."""
        if self.maps is None or not self.record:
            return
        steps = min(self.dropped.values(), default=self.s)
        for layer in self.records:
            for buffer in layer:
                self.maps.mark_reusable(buffer, buffer[: self.n_prefix + steps * self.B].nbytes)
        for buffer in (self.finals, self.logits):
            if buffer is not None:
                self.maps.mark_reusable(buffer, buffer[: steps * self.B].nbytes)

    def rotation_for(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotary factors (..., 1, D/2) for positions (...), as complex numbers (see :func:`rotate`), from the
        model's own rotary module (any rope type it has; its cos and sin repeat over the two halves)."""
        D = self.D
        cos, sin = self.base.model.rotary_emb(self.embed[:1], positions)
        return torch.complex(cos[..., : D // 2], sin[..., : D // 2]).unsqueeze(-2)

    @torch.no_grad()
    def _prefill(self, ids_UP: torch.Tensor, mask_UP: torch.Tensor, index_B: torch.Tensor) -> None:
        """The first P prompt columns of each distinct prompt, all at once (U·P rows per product, through the
        same laid-out weights as the decoding step: oneDNN's blocked layout is faster than the plain one at any
        row count); keys and values go to the rows' cache. Padding queries attend to themselves only: their
        outputs reach nothing."""
        U, P = ids_UP.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        # kept: the recording's attention over the prefix is this one (cpu/replay.py)
        self.prefix_rotation = rotation = self.rotation_for((mask_UP.cumsum(-1) - 1).clamp(min=0))  # (U, P, 1, D/2)
        self.prefix_allowed = allowed = (  # (U, P, P): causal over the prompt's real positions, padding sees itself
            torch.ones(P, P, dtype=torch.bool).tril() & mask_UP.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool)
        x = F.embedding(ids_UP.reshape(-1), self.embed)  # (U·P, d)
        for i, (w_in, eps_in, qkv_w, o_w, w_post, eps_post, gate_up_w, down_w) in enumerate(self.layers):
            qkv = self._linear(rms_norm(x, w_in, eps_in), qkv_w)  # q and k in the paired order
            q, k, v = qkv.view(U, P, -1).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k = rotate(q.unflatten(-1, (H, D)), rotation), rotate(k.unflatten(-1, (Hkv, D)), rotation)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.unflatten(-1, (Hkv, D)).transpose(1, 2)  # (U, heads, P, D)
            self.k[i][:, :, :P] = k[index_B]
            self.v[i][:, :, :P] = v[index_B]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=H != Hkv)
            x_mid = self._linear_add(a.transpose(1, 2).reshape(U * P, H * D), o_w, x)
            gate_up = self._linear(rms_norm(x_mid, w_post, eps_post), gate_up_w)
            half = gate_up.shape[1] // 2
            out = self._linear_add(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]), down_w, x_mid)
            if self.record:
                for buffer, t in zip(self.records[i], (x, qkv, x_mid, gate_up)):
                    buffer[: U * P] = t
            x = out

    def _linear(self, x, packed):
        """x Wᵀ + b in fp32, the product in the decoder's dtype (a no-op cast each side in fp32)."""
        return product(x, *packed, self.dtype)

    def _linear_add(self, x, packed, residual):
        """residual + x Wᵀ + b; in fp32 one call, oneDNN adding the residual to the product's output as it writes
        it. Its fused add takes the residual in the product's dtype, so in bf16 the fp32 residual is added after."""
        if self.dtype != torch.float32:
            return residual + self._linear(x, packed)
        weight, bias = packed
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")

    def end_rows(self, ended_B: torch.Tensor) -> None:
        """Rows ``ended_B`` (B,) bool have ended: their next tokens are padding nobody reads. Once ``DROP_SHARE``
        of the rows still computed have ended, they leave the products; from then on :meth:`step` returns 0
        as their logits and records nothing for them (``cpu/replay.py`` never reads a row after its end).
        Each row's arithmetic is unchanged: oneDNN computes a row of a product the same whatever the other
        rows (checked bit for bit by ``tests/cpu/test_decoder.py``), except a one-row product, which takes
        another kernel: one row never computes alone while others could join it."""
        rows = self.rows if self.rows is not None else torch.arange(self.B)
        keep = ~ended_B.to(rows.device)[rows]
        n = int(keep.sum())
        if n == 0 or n > (1 - DROP_SHARE) * len(rows):
            return
        if n == 1 and len(rows) > 1:  # a second row, ended, keeps the products at two rows
            keep[int((~keep).nonzero()[0])] = True
        for row in rows[~keep].tolist():
            self.dropped[row] = self.s
        self.rows = rows[keep]
        self.k = [_compact_rows(k, keep, self.col) for k in self.k]
        self.v = [_compact_rows(v, keep, self.col) for v in self.v]
        Hkv = self.Hkv
        self.key_bias_groups = self.key_bias_groups.view(len(rows), Hkv, 1, -1)[keep].flatten(0, 1)

    @torch.no_grad()
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (the next column); the next-token logits (B, V), 0 for rows no longer
        computed (:meth:`end_rows`)."""
        H, Hkv, D, rows = self.H, self.Hkv, self.D, self.rows
        c, qk = self.col, (H + Hkv) * D
        # this step's rows in the records (after the prefix's) and in the final states: a slice while every
        # row is computed, else the computed rows' indices
        first = self.s * self.B
        step_rows = slice(first, first + self.B) if rows is None else first + rows
        where = slice(first + self.n_prefix, first + self.n_prefix + self.B) if rows is None else self.n_prefix + step_rows
        token_n = token_B if rows is None else token_B[rows]
        n = token_n.shape[0]  # the rows computed
        x = F.embedding(token_n, self.embed)  # (n, d)
        bias = self.key_bias_groups[..., : c + 1]  # (n·Hkv, 1, c+1)
        rotation = self.rotation[:, self.s] if rows is None else self.rotation[rows, self.s]  # (n, 1, D/2)
        for i, (w_in, eps_in, qkv, o, w_post, eps_post, gate_up, down) in enumerate(self.layers):
            y_qkv = self._linear(rms_norm(x, w_in, eps_in), qkv)
            q_k = rotate(y_qkv[:, :qk].view(n, H + Hkv, D), rotation)  # queries and keys rotated together
            keys, values = self.k[i], self.v[i]
            keys[:, :, c] = q_k[:, H:]
            values[:, :, c] = y_qkv[:, qk:].view(n, Hkv, D)
            attn = grouped_attention(q_k[:, :H], keys, values, bias, self.scale, c + 1)
            x_mid = self._linear_add(attn, o, x)  # x + o_proj(attn), the add inside the product
            y_gu = self._linear(rms_norm(x_mid, w_post, eps_post), gate_up)
            half = y_gu.shape[1] // 2
            out = self._linear_add(F.silu(y_gu[:, :half]).mul_(y_gu[:, half:]), down, x_mid)
            if self.record:
                for buffer, t in zip(self.records[i], (x, y_qkv, x_mid, y_gu)):
                    buffer[where] = t
            x = out
        logits = self._linear(rms_norm(x, *self.norm), self.head)  # (n, V)
        if self.record:
            self.fed.append(token_B)
            self.finals[step_rows] = x
            self._record_logits(logits, step_rows)
        self.col += 1
        self.s += 1
        return logits if rows is None else logits.new_zeros(self.B, logits.shape[1]).index_copy_(0, rows, logits)

    def _record_logits(self, logits: torch.Tensor, step_rows) -> None:
        """Keep what the update reads of this step's logits (n, V) of the rows computed (``step_rows``, as
        :meth:`step` has them): log Z and the entropy at the temperature, and the logits while they fit; a row
        not computed gets 0 (no loss reaches it). The caller may mask the returned logits in place
        (min_new_tokens): z is a copy."""
        B, rows = self.B, self.rows
        if self.keep_logits:
            self.logits[step_rows] = logits
        z = logits / self.temperature if self.temperature != 1.0 else logits.clone()
        logz = z.logsumexp(-1)
        entropy = logz - (z - logz[:, None]).exp_().mul_(z).sum(-1)
        self.logz.append(logz if rows is None else logz.new_zeros(B).index_copy_(0, rows, logz))
        self.entropy.append(entropy if rows is None else entropy.new_zeros(B).index_copy_(0, rows, entropy))
        self._z, self._z_rows = z, rows

    def sampled(self, token_B: torch.Tensor) -> None:
        """Record the token sampled from the last step's logits (the response token of that step)."""
        rows = self._z_rows
        target = self._z.gather(-1, (token_B if rows is None else token_B[rows])[:, None]).squeeze(-1)
        self.target.append(target if rows is None else target.new_zeros(self.B).index_copy_(0, rows, target))
        self._z = None


def _compact_rows(cache: torch.Tensor, keep: torch.Tensor, written: int) -> torch.Tensor:
    """``cache[keep]`` (rows of a KV cache, (B, Hkv, T, D)) moved to the front of the cache's own memory, as a
    view of its first rows; the pages past them go back to the OS (``memory.release_tail``). Only the ``written``
    columns are copied: reading or writing the columns still to come would make their pages resident for the
    whole budget. In place, not into a new map: a new one is faulted in page by page again (about 0.5 million
    pages a step on the demo's rollouts)."""
    rows = keep.nonzero().flatten().tolist()
    start = 0  # a run of consecutive kept rows moves by one shift: copied in blocks of at most that many rows,
    while start < len(rows):  # so that no block overlaps its destination (each lands where the last was read)
        end = start + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1:
            end += 1
        shift = rows[start] - start  # kept rows start..end-1 are rows[start] + 0, 1, ...
        for a in range(start, end, shift) if shift else ():
            b = min(a + shift, end)
            cache[a:b, :, :written] = cache[a + shift : b + shift, :, :written]
        start = end
    kept = cache[: len(rows)]
    release_tail(cache, (cache.storage_offset() + len(rows) * cache.stride(0)) * cache.element_size())
    return kept


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, term for term (``F.rms_norm`` is one call but no faster on a CPU); also what
    ``cpu/replay.py`` recomputes (its derivative is ``replay.rms_norm_backward``)."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt_() * weight


def paired_qkv(attn, h: torch.Tensor, q_order: torch.Tensor, k_order: torch.Tensor) -> torch.Tensor:
    """An attention block's q, k and v projections of h, concatenated, q and k in the decoder's paired feature
    order (see :class:`LlamaDecoder`): one product with the three weights stacked in that order (active LoRA
    adapters merged in, as the decoding step has them)."""
    return kernels.onednn_linear(h, *_stacked([attn.q_proj, attn.k_proj, attn.v_proj], [q_order, k_order, None]))


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., heads, D), its features in paired order, by complex factors (..., 1, D/2):
    (a + ib)(cos + i sin) = (a cos − b sin) + i(a sin + b cos), transformers' x·cos + rotate_half(x)·sin."""
    pairs = torch.view_as_complex(x.unflatten(-1, (x.shape[-1] // 2, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)
