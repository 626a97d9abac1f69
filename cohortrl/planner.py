"""Memory and compute model of one RL step: PPO or GRPO (or RLOO), and which G.

``plan(model, run)`` returns per-device memory by component and FLOPs per step by phase, as dataclasses;
``cohortrl plan`` only formats them. Every formula cites its source; where cohortrl's own step decides a
number (what is kept alive, how many logit copies exist), the comment says which code it counts.

Symbols (DESIGN/STYLE table plus the model's): Ψ parameters, h hidden size, f MLP intermediate size,
L layers, a attention heads, k key/value heads, d head dim, V vocabulary, P prompts per step, G responses
per prompt, B = P·G sequences, s_p prompt tokens, T response tokens, S = s_p + T, b micro-batch
(sequences), N devices.

What the model assumes (each is a choice a reader can check and change):

* data parallelism over N devices: every device holds its share B/N of the sequences and, unless sharded,
  a full copy of every model;
* mixed precision for ``bf16``: bf16 weights and gradients, AdamW keeps an fp32 master copy plus its two
  fp32 moments — 2 + 2 + 12 bytes per trained parameter (ZeRO, arXiv 1910.02054, §3.1, K = 12);
  ``fp32``: 4 + 4 + 8 (no master copy);
* PPO's critic is a full copy of the transformer without the LM head plus a scalar head, trained fully
  even when the policy has a LoRA adapter (``trainers/critic.py``: the critic copies the backbone);
* the reference model is a frozen copy, or with LoRA no copy at all (the adapter is disabled,
  ``trainers/setup.Reference``); the reward is rule-based unless ``reward_model`` is set (then a model of
  the policy's shape, forward only);
* generation and the update do not overlap: the peak is the persistent states (weights, optimiser states,
  models) plus the larger of the generation phase (KV cache; on a CPU in fp32 also the linear weights in
  oneDNN's layout, which ``kernels.decoding_weights`` holds while decoding) and the update phase (the
  gradients, which the trainer frees after each optimiser step, and the activations and logits of one
  micro-batch);
* attention runs in a fused kernel (SDPA / FlashAttention) that does not keep the S×S score matrix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

GIB = 1024**3
MIB = 1024**2


class PlanError(ValueError):
    """Planner input that cannot be planned, with the reason and the fix."""


# ---------------------------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP."""

    name: str
    hidden_size: int  # h
    num_layers: int  # L
    num_heads: int  # a
    num_kv_heads: int  # k
    intermediate_size: int  # f
    vocab_size: int  # V
    tie_embeddings: bool
    head_dim: int | None = None  # d; None: h / a
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def layer_matrix_params(self) -> int:
        """The weight matrices of one layer: q, k, v, o projections + gate, up, down."""
        h, d, a, k, f = self.hidden_size, self.d, self.num_heads, self.num_kv_heads, self.intermediate_size
        return h * a * d + 2 * h * k * d + a * d * h + 3 * h * f

    @property
    def layer_params(self) -> int:
        """The layer's matrices + two RMSNorm weights (+ q/k/v biases)."""
        d, a, k = self.d, self.num_heads, self.num_kv_heads
        return self.layer_matrix_params + 2 * self.hidden_size + (a * d + 2 * k * d if self.qkv_bias else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the LM head is the embedding matrix."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Ψ: embeddings + L layers + final norm + LM head (if untied)."""
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.lm_head_params

    @property
    def critic_params(self) -> int:
        """The backbone without the LM head, plus Linear(h, 1) with bias (``trainers/critic.ValueModel``)."""
        return self.params - self.lm_head_params + self.hidden_size + 1

    def lora_params(self, rank: int) -> int:
        """LoRA on all seven projections of every layer: r·(in + out) per matrix (Hu et al., arXiv 2106.09685)."""
        h, d, a, k, f = self.hidden_size, self.d, self.num_heads, self.num_kv_heads, self.intermediate_size
        per_layer = (h + a * d) + 2 * (h + k * d) + (a * d + h) + 2 * (h + f) + (f + h)
        return self.num_layers * rank * per_layer


# Published configs (config.json on the Hugging Face hub of each model).
PRESETS = {
    "0.5b": ModelShape("Qwen2.5-0.5B shape", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True),
    "1.5b": ModelShape("Qwen2.5-1.5B shape", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True),
    "7b": ModelShape("Llama-2-7B shape", 4096, 32, 32, 32, 11008, 32000, False),
    "8b": ModelShape("Llama-3-8B shape", 4096, 32, 32, 8, 14336, 128256, False),
    "70b": ModelShape("Llama-3-70B shape", 8192, 80, 64, 8, 28672, 128256, False),
}


def shape_from_config(config: dict, name: str) -> ModelShape:
    """A ModelShape from a transformers ``config.json`` dict (Llama, Qwen2, Mistral field names)."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if k not in config]
    if missing:
        raise PlanError(f"{name}: config.json lacks {missing}; the planner needs a Llama/Qwen-style decoder config")
    return ModelShape(
        name=name,
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim"),
        qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
    )


def resolve_shape(spec: str) -> ModelShape:
    """A preset (``7b``), a directory with a config.json, or a cohortrl alias (``tiny-llama``,
    ``smollm2-135m-instruct`` once converted)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text()), spec)
    from cohortrl.models import ALIASES, cohortrl_home

    alias = ALIASES.get(spec)
    if alias is not None and alias.tiny is not None:
        from cohortrl.models import build_tiny_tokenizer

        t = alias.tiny
        return ModelShape(spec, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size,
                          len(build_tiny_tokenizer()), tie_embeddings=True)
    if alias is not None:
        cached = cohortrl_home() / "models" / spec / "config.json"
        if not cached.is_file():
            raise PlanError(f"model '{spec}' is not converted yet; run `cohortrl models --load {spec}` once, then plan again")
        return shape_from_config(json.loads(cached.read_text()), spec)
    raise PlanError(
        f"unknown model '{spec}': give a size preset ({', '.join(PRESETS)}), a directory with a config.json, "
        f"or a cohortrl alias ({', '.join(ALIASES)})"
    )


# ---------------------------------------------------------------------------------------------- the run
ALGORITHMS = ("ppo", "grpo", "rloo")
SHARDING = ("none", "zero1", "zero2", "zero3")
SHARDING_ALIASES = {"fsdp": "zero3", "full_shard": "zero3", "fsdp-full-shard": "zero3"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# Device peak dense matmul FLOP/s: vendor datasheets (NVIDIA A100 / H100 SXM bf16 dense, no sparsity);
# cpu: this repository's 2-core AVX2 machine, fp32 (2 cores × 2.45 GHz × 2 FMA × 8 lanes × 2, MEASUREMENTS.md).
DEVICE_PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "cpu": 157e9}


@dataclass(frozen=True)
class RunSpec:
    """One training step's settings. Sizes are in tokens and sequences; defaults are cohortrl's."""

    algorithm: str = "grpo"
    gpus: int = 1
    sharding: str = "none"
    dtype: str = "bf16"
    lora_rank: int = 0  # 0: full fine-tuning
    prompt_len: int = 512  # s_p, padded
    response_len: int = 1024  # T, padded
    group_size: int = 8  # G
    prompts_per_step: int = 64  # P
    micro_batch_size: int = 4  # b, sequences per forward/backward on one device
    checkpointing: bool = False  # activation checkpointing (full recomputation of each layer)
    reference: bool = True  # β > 0: log π_ref is needed
    reward_model: bool = False  # a learned reward model of the policy's shape (forward only)
    epochs: int = 1  # μ: passes over the batch per step (> 1 adds a forward for log π_old)
    device: str = "gpu"  # "cpu": add the process baseline (cpu_baseline_bytes)
    cpu_baseline_bytes: float = 0.0  # resident memory of the process before any model is loaded
    peak_flops: float = DEVICE_PEAK_FLOPS["h100"]  # per device
    mfu: float = 0.4  # model FLOPs utilisation assumed for forward/backward passes
    generation_mfu: float = 0.1  # decoding is memory-bandwidth bound: far lower utilisation than training

    @property
    def sequences(self) -> int:
        """B = P·G."""
        return self.prompts_per_step * self.group_size

    @property
    def seq_len(self) -> int:
        """S = s_p + T."""
        return self.prompt_len + self.response_len


def validate(run: RunSpec) -> RunSpec:
    """The run with aliases resolved, or a PlanError naming the bad value and the fix."""
    sharding = SHARDING_ALIASES.get(run.sharding, run.sharding)
    if sharding not in SHARDING:
        raise PlanError(f"unknown sharding '{run.sharding}': use one of {', '.join(SHARDING)} (fsdp = zero3)")
    if run.algorithm not in ALGORITHMS:
        raise PlanError(f"unknown algorithm '{run.algorithm}': use one of {', '.join(ALGORITHMS)}")
    if run.algorithm in ("grpo", "rloo") and run.group_size < 2:
        raise PlanError(
            f"{run.algorithm} needs a group of at least 2 responses per prompt (G={run.group_size}): its baseline "
            "is the other responses' rewards; use G >= 2, or ppo for one response per prompt"
        )
    if run.dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype '{run.dtype}': use fp32 or bf16")
    if run.device not in ("gpu", "cpu"):
        raise PlanError(f"unknown device '{run.device}': use gpu or cpu")
    for name in ("gpus", "group_size", "prompts_per_step", "micro_batch_size", "prompt_len", "response_len", "epochs"):
        if getattr(run, name) < 1:
            raise PlanError(f"{name.replace('_', '-')} must be >= 1 (got {getattr(run, name)})")
    if run.lora_rank < 0:
        raise PlanError(f"lora-rank must be >= 0 (0: full fine-tuning; got {run.lora_rank})")
    if not (0 < run.mfu <= 1 and 0 < run.generation_mfu <= 1):
        raise PlanError(f"MFU must be in (0, 1] (got mfu={run.mfu}, generation_mfu={run.generation_mfu})")
    if run.sequences % run.gpus:
        raise PlanError(f"P·G = {run.sequences} sequences do not split evenly over {run.gpus} devices; change P, G or gpus")
    return replace(run, sharding=sharding)


# ---------------------------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class ModelStates:
    """Bytes one device holds for one model: weights, gradients, optimiser states."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_states(params: int, trainable: int, dtype: str, sharding: str, n: int) -> ModelStates:
    """ZeRO (Rajbhandari et al., arXiv 1910.02054, §5.1, Fig. 1): with Ψ parameters and N devices,
    no sharding (2 + 2 + K)Ψ, stage 1 (2 + 2 + K/N)Ψ, stage 2 (2 + (2 + K)/N)Ψ, stage 3 (2 + 2 + K)Ψ/N, for
    bf16 with K = 12 (fp32 master weights, momentum, variance). fp32 training: 4 + 4 + 8 (no master copy).
    Frozen parameters (LoRA's base, the reference) have no gradient or optimiser state."""
    w = DTYPE_BYTES[dtype]
    k = 12 if dtype == "bf16" else 8
    weights, grads, optim = params * w, trainable * w, trainable * k
    if sharding in ("zero1", "zero2", "zero3"):
        optim /= n
    if sharding in ("zero2", "zero3"):
        grads /= n
    if sharding == "zero3":
        weights /= n
    return ModelStates(weights, grads, optim)


def activation_elements_per_token(m: ModelShape, checkpointing: bool) -> float:
    """Elements autograd keeps per token for the L decoder layers of one forward.

    Korthikanti et al. (arXiv 2205.05198, §4.1) count sbh(34 + 5as/h) bytes per GPT layer (16-bit, 4h MLP,
    dropout). Re-counted the same way for a Llama block as transformers runs it (no dropout, fused attention
    that keeps no score matrix): each RMSNorm keeps its input, the normalised tensor and its output (3h, two
    norms); attention keeps q, the repeated k and v, the kernel's output and its contiguous copy for o_proj
    (5h); SwiGLU keeps gate, silu(gate), up and their product (4f). Total 11h + 4f per layer.
    With full recomputation only each layer's input (h) is kept, plus one layer's full set while it is
    recomputed (Korthikanti §4.2: 2sbh bytes per layer in 16-bit = sbh elements)."""
    h, f, L = m.hidden_size, m.intermediate_size, m.num_layers
    per_layer = 11 * h + 4 * f
    return L * h + per_layer if checkpointing else L * per_layer


# How many (b, T+1, V) fp32 logit tensors are alive at once in the update when the model's own head runs
# (DDP or FSDP2, several processes): the LM head's output, the temperature-scaled copy log-softmax keeps for
# backward, and the entropy's probabilities and product (``rollout/hf._logprobs_from_logits``); backward then
# replaces two of them with gradients of the same size.
LOGIT_COPIES = 4
# One process: ``rollout/hf._HeadLogProbs`` applies the head in chunks of LOGPROB_CHUNK_BYTES of fp32 logits.
# Probabilities of at most LOGPROB_KEEP_BYTES (all response tokens) are kept from forward to backward: those
# plus one chunk of logits. Above that none are kept, and at most two chunks exist at once (the logits and the
# entropy's probabilities in forward; the recomputed logits, turned into their gradient in place, in backward).
CHUNKED_LOGIT_COPIES = 2
LOGPROB_CHUNK_BYTES = 32 * 2**20  # = rollout.hf.LOGPROB_CHUNK_BYTES (a test keeps them equal)
LOGPROB_KEEP_BYTES = 128 * 2**20  # = rollout.hf.LOGPROB_KEEP_BYTES


@dataclass(frozen=True)
class Memory:
    """Bytes per device by component; ``peak`` = persistent states + the larger of the two phases. Gradients
    belong to the update phase: the trainer frees them after each optimiser step (``trainers/update.py``)."""

    policy: ModelStates
    critic: ModelStates | None
    reference: float
    reward_model: float
    activations: float  # the update's micro-batch (policy, and critic for PPO), with the chosen checkpointing
    activations_no_ckpt: float
    activations_ckpt: float
    logits: float  # fp32 logit copies of one micro-batch during the update
    kv_cache: float  # generation: this device's share of the B sequences, whole length S
    baseline: float  # cpu: the process before any model (imports, allocator); 0 on a GPU
    decode_layout: float = 0.0  # cpu, fp32: the linear weights' oneDNN layout while decoding (cpu/decoder.py, kernels.decoding_weights)

    @property
    def gradients(self) -> float:
        return self.policy.gradients + (self.critic.gradients if self.critic else 0.0)

    @property
    def persistent(self) -> float:
        critic = self.critic.total if self.critic else 0.0
        return self.baseline + self.policy.total + critic + self.reference + self.reward_model - self.gradients

    @property
    def update_phase(self) -> float:
        return self.activations + self.logits + self.gradients

    @property
    def generation_phase(self) -> float:
        return self.kv_cache + self.decode_layout

    @property
    def peak(self) -> float:
        return self.persistent + max(self.update_phase, self.generation_phase)


def kv_cache_bytes(m: ModelShape, tokens: int, dtype: str) -> float:
    """KV cache = 2 (K and V) · L · k · d · bytes per token (the cache HF generate / vLLM fill)."""
    return 2 * m.num_layers * m.num_kv_heads * m.d * DTYPE_BYTES[dtype] * tokens


def plan_memory(m: ModelShape, run: RunSpec) -> Memory:
    n, shard, dt = run.gpus, run.sharding, run.dtype
    lora = run.lora_rank > 0
    trainable = m.lora_params(run.lora_rank) if lora else m.params
    policy = model_states(m.params + (trainable if lora else 0), trainable, dt, shard, n)
    critic = model_states(m.critic_params, m.critic_params, dt, shard, n) if run.algorithm == "ppo" else None
    frozen_copy = m.params * DTYPE_BYTES[dt] / (n if shard == "zero3" else 1)
    reference = frozen_copy if run.reference and not lora else 0.0  # LoRA: the base weights, adapter off
    reward_model = frozen_copy if run.reward_model else 0.0

    tokens = run.micro_batch_size * run.seq_len  # one micro-batch on one device
    act_bytes = DTYPE_BYTES[dt]
    models_backpropagated = 2 if run.algorithm == "ppo" else 1  # cohortrl backpropagates policy and critic together
    no_ckpt = models_backpropagated * tokens * activation_elements_per_token(m, False) * act_bytes
    ckpt = models_backpropagated * tokens * activation_elements_per_token(m, True) * act_bytes
    full_logits = run.micro_batch_size * (run.response_len + 1) * m.vocab_size * 4
    if run.gpus == 1:  # one process: the chunked head (rollout/hf._HeadLogProbs)
        chunk = min(LOGPROB_CHUNK_BYTES, full_logits)
        logits = full_logits + chunk if full_logits <= LOGPROB_KEEP_BYTES else CHUNKED_LOGIT_COPIES * chunk
    else:
        logits = LOGIT_COPIES * full_logits
    kv = kv_cache_bytes(m, run.sequences // n * run.seq_len, dt)
    # On a CPU in fp32 (train.cpu_linear auto), decoding holds a second copy of every linear weight, the
    # projections and the LM head, in oneDNN's layout (the lean decoder's merged q/k/v and gate/up copies, or
    # kernels.decoding_weights for transformers' forward: the same bytes); LoRA's small matrices are not counted.
    linear_weights = m.num_layers * m.layer_matrix_params + m.vocab_size * m.hidden_size
    decode_layout = linear_weights * DTYPE_BYTES[dt] if run.device == "cpu" and dt == "fp32" else 0.0
    return Memory(
        policy=policy, critic=critic, reference=reference, reward_model=reward_model,
        activations=ckpt if run.checkpointing else no_ckpt, activations_no_ckpt=no_ckpt, activations_ckpt=ckpt,
        logits=logits, kv_cache=kv, baseline=run.cpu_baseline_bytes if run.device == "cpu" else 0.0,
        decode_layout=decode_layout,
    )


# ---------------------------------------------------------------------------------------------- FLOPs
def forward_flops(m: ModelShape, seq_len: int, logit_positions: int, vocab_head: bool = True) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` tokens: 2 per weight per token (Kaplan et al.,
    arXiv 2001.08361, §2.1, C_forward ≈ 2N) over the layers, the LM head 2·h·V on the positions whose logits
    are computed, and attention 4·L·a·d·ctx per token (QKᵀ and the weighted sum of V, 2·ctx·a·d each;
    Chinchilla, arXiv 2203.15556, App. F) with the causal mean context ctx = (S + 1)/2."""
    layers = 2 * m.num_layers * m.layer_params * seq_len
    head = 2 * m.hidden_size * m.vocab_size * logit_positions if vocab_head else 2 * m.hidden_size * logit_positions
    attention = 4 * m.num_layers * m.num_heads * m.d * seq_len * (seq_len + 1) / 2
    return layers + head + attention


@dataclass(frozen=True)
class Flops:
    """FLOPs of one whole step (all devices) by phase."""

    generation: float
    reference: float
    reward_model: float
    old_logprobs: float
    critic: float  # PPO: values at rollout time + forward/backward in the update
    policy: float  # forward/backward in the update (+ recomputation with checkpointing)

    @property
    def total(self) -> float:
        return self.generation + self.reference + self.reward_model + self.old_logprobs + self.critic + self.policy


def plan_flops(m: ModelShape, run: RunSpec) -> Flops:
    B, S, T = run.sequences, run.seq_len, run.response_len
    # Generation: prefill of s_p tokens and T decoded tokens, logits only for the decoded ones; the same
    # 2N-per-token count as a forward of the whole sequence.
    gen = B * forward_flops(m, S, T)
    fwd = forward_flops(m, S, T + 1)  # the update and scoring passes keep logits of the last T+1 positions
    # Backward ≈ 2 × forward (Kaplan §2.1: 6N per token in training = 2N forward + 4N backward). With LoRA the
    # frozen weights still pass gradients to the activations (2N) but get none of their own: backward ≈ 1 ×
    # forward. Full recomputation adds one more forward (Korthikanti §5).
    backward = 1 if run.lora_rank else 2
    recompute = 1 if run.checkpointing else 0
    policy = run.epochs * B * fwd * (1 + backward + recompute)
    critic = 0.0
    if run.algorithm == "ppo":
        cfwd = forward_flops(m, S, T + 1, vocab_head=False)
        critic = B * cfwd + run.epochs * B * cfwd * (1 + 2 + recompute)
    return Flops(
        generation=gen,
        reference=B * fwd if run.reference else 0.0,
        reward_model=B * forward_flops(m, S, 1, vocab_head=False) if run.reward_model else 0.0,
        old_logprobs=B * fwd if run.epochs > 1 else 0.0,
        critic=critic,
        policy=policy,
    )


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    model: ModelShape
    run: RunSpec
    memory: Memory
    flops: Flops
    step_seconds: dict[str, float] = field(default_factory=dict)  # per phase, on one device

    @property
    def step_time(self) -> float:
        return sum(self.step_seconds.values())


def step_seconds(flops: Flops, run: RunSpec) -> dict[str, float]:
    """Time = FLOPs per device / (peak FLOP/s · MFU); the N devices split the step's sequences evenly."""
    train_rate = run.peak_flops * run.mfu
    gen_rate = run.peak_flops * run.generation_mfu
    per_device = {k: getattr(flops, k) / run.gpus for k in
                  ("generation", "reference", "reward_model", "old_logprobs", "critic", "policy")}
    return {k: v / (gen_rate if k == "generation" else train_rate) for k, v in per_device.items()}


def plan(model: ModelShape | str, run: RunSpec) -> Plan:
    """The memory per device and FLOPs of one step of ``run`` on ``model`` (a shape or a spec for
    ``resolve_shape``)."""
    shape = resolve_shape(model) if isinstance(model, str) else model
    run = validate(run)
    flops = plan_flops(shape, run)
    return Plan(shape, run, plan_memory(shape, run), flops, step_seconds(flops, run))


def memory_rows(p: Plan) -> list[tuple[str, float]]:
    """(component, bytes per device) in table order; the CLI and the docs print these."""
    mem, rows = p.memory, []
    if mem.baseline:
        rows.append(("process baseline (cpu)", mem.baseline))
    rows += [("policy weights", mem.policy.weights), ("policy gradients", mem.policy.gradients),
             ("policy optimizer states", mem.policy.optimizer)]
    if mem.critic:
        rows += [("critic weights", mem.critic.weights), ("critic gradients", mem.critic.gradients),
                 ("critic optimizer states", mem.critic.optimizer)]
    rows += [("reference model", mem.reference), ("reward model", mem.reward_model),
             ("activations, no checkpointing", mem.activations_no_ckpt),
             ("activations, checkpointing", mem.activations_ckpt),
             ("logits (fp32, update micro-batch)", mem.logits), ("KV cache (generation)", mem.kv_cache)]
    if mem.decode_layout:
        rows.append(("linear weights in oneDNN's layout (cpu, generation)", mem.decode_layout))
    return rows


def format_plan(p: Plan) -> str:
    """The plan as two markdown tables (memory per device, FLOPs and time per step)."""
    r, m = p.run, p.model
    lora = f"LoRA r={r.lora_rank}" if r.lora_rank else "full fine-tuning"
    lines = [
        f"{m.name}: {m.params / 1e9:.3f}B parameters (h={m.hidden_size}, L={m.num_layers}, heads={m.num_heads}, "
        f"kv heads={m.num_kv_heads}, f={m.intermediate_size}, V={m.vocab_size})",
        f"{r.algorithm}, {r.gpus} device(s), sharding {r.sharding}, {r.dtype}, {lora}; P={r.prompts_per_step} x "
        f"G={r.group_size} = {r.sequences} sequences of {r.prompt_len}+{r.response_len} tokens; micro-batch "
        f"{r.micro_batch_size}; activation checkpointing {'on' if r.checkpointing else 'off'}",
        "",
        "| memory per device | GiB |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {value / GIB:.3f} |" for name, value in memory_rows(p)]
    mem = p.memory
    lines += [
        f"| **persistent (weights, optimizer states, models{' + baseline' if mem.baseline else ''})** | {mem.persistent / GIB:.3f} |",
        f"| **update phase (gradients + activations as chosen + logits)** | {mem.update_phase / GIB:.3f} |",
        f"| **peak = persistent + max(update phase, generation phase{' (KV cache + weight layout)' if mem.decode_layout else ' (KV cache)'})** | {mem.peak / GIB:.3f} |",
        "",
        f"| FLOPs per step (all devices) | TFLOP | s on one device ({r.peak_flops / 1e12:g} TFLOP/s peak) |",
        "|---|---:|---:|",
    ]
    names = {"generation": f"generation (MFU {r.generation_mfu:g})", "reference": "reference forward",
             "reward_model": "reward model forward", "old_logprobs": "old log-probs forward",
             "critic": "critic forward/backward", "policy": f"policy forward/backward (MFU {r.mfu:g})"}
    for key, label in names.items():
        lines.append(f"| {label} | {getattr(p.flops, key) / 1e12:.2f} | {p.step_seconds[key]:.2f} |")
    lines.append(f"| **total** | {p.flops.total / 1e12:.2f} | {p.step_time:.2f} |")
    return "\n".join(lines)
