"""Memory and compute model of one RL step: PPO, GRPO (or RLOO) or rejection-sampling fine-tuning (RFT), and which G.

``plan(model, run)`` returns per-device memory by component and FLOPs per step by phase, as dataclasses;
``cohortrl plan`` only formats them (``planner/tables.py``). Every formula cites its source; where cohortrl's own
step decides a number (what is kept alive, how many logit copies exist), the comment says which code it counts.

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
  oneDNN's layout, which the lean decoder or ``kernels.decoding_weights`` holds while decoding, in bf16 where the
  decoder's products are (``train.cpu_decode_dtype``); under zero3 over several devices
  the whole policy in the compute dtype, which generation gathers from the shards, ``Dist.gathered``, as
  TRL does under ZeRO-3) and the update phase (the
  gradients, which the trainer frees after each optimiser step, and the activations and logits of one
  micro-batch);
* where the trainer runs the update on decoding's recording (a CPU in fp32, GRPO/RLOO, one epoch, one
  micro-batch, one process: ``train.reuse_rollout_forward``), the recording stands in for the activations
  and is held in both phases; the update then runs no forward (``cpu/replay.py``);
* each distinct prompt runs once per pass (generation's prefill, the recording, one process's log-prob
  passes); tool-result tokens are part of T, fed and attended to but never scored;
* attention runs in a fused kernel (SDPA / FlashAttention) that does not keep the S×S score matrix.

Times: on a GPU a model prediction (datasheet peak × an assumed MFU); on a CPU FLOPs divided by rates
measured on the machine (``measure_cpu_rates``; decoding's attention by KV bytes read, plus a time per step), or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cohortrl.planner.shapes import PRESETS, ModelShape, PlanError, resolve_shape, shape_from_config  # noqa: F401

GIB = 1024**3
MIB = 1024**2


# ---------------------------------------------------------------------------------------------- the run
# rft: trainers/rft.py, the supervised loss on the passing samples; no reference (the trainer requires β = 0); on
# decoding's recording its log-probs at temperature 1 need the head again over every response position
ALGORITHMS = ("ppo", "grpo", "rloo", "rft")
SHARDING = ("none", "zero1", "zero2", "zero3")
SHARDING_ALIASES = {"fsdp": "zero3", "full_shard": "zero3", "fsdp-full-shard": "zero3"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# Peak dense matmul FLOP/s from the vendors' datasheets (NVIDIA A100 / H100 SXM / H200 bf16 dense, no sparsity).
# A GPU step time is a model prediction from these and an assumed MFU, never a measurement. A CPU has no
# entry: its rates are measured on the machine (``measure_cpu_rates``) or given, else no time is shown.
GPU_PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12}
# A CPU's rates (``RunSpec.cpu_rates``, measured by ``cpu_rates.measure_cpu_rates``) and their units.
CPU_RATES = {
    "decode": "FLOP/s of decoding's products, B rows through every weight, in decode_dtype",
    "attention_bytes": "bytes/s of fp32 KV cache read by decoding's attention, B rows",
    "layer": "FLOP/s of forward and backward through transformers layers",
    "thin": "FLOP/s of LoRA's rank-r products",
    "step_s": "seconds per decoding step outside the layers, the head's product aside: sampler, recording, loop",
    "layer_step_s": "seconds per layer and decoding step besides its products and attention: norms, rotary, casts",
}


@dataclass(frozen=True)
class RunSpec:
    """One training step's settings. Sizes are in tokens and sequences; defaults are cohortrl's trainer's
    (``config.AlgorithmConfig``) where it has one: one micro-batch per update, one epoch, β > 0."""

    algorithm: str = "grpo"
    gpus: int = 1
    sharding: str = "none"
    dtype: str = "bf16"
    lora_rank: int = 0  # 0: full fine-tuning
    prompt_len: int = 512  # s_p, padded
    response_len: int = 1024  # T, padded: the decoding steps, sampled and tool-result tokens alike
    max_new_tokens: int | None = None  # the sampling budget (≥ T); None: T. The CPU decoder sizes its buffers by it
    group_size: int = 8  # G
    prompts_per_step: int = 64  # P
    micro_batch_size: int = 0  # b, sequences per forward/backward on one device; 0: all of them at once
    distinct_prompts: int | None = None  # U, prompts the batch holds once each; None: P (every prompt distinct)
    response_tokens: int | None = None  # sampled tokens the loss scores, whole batch; None: B·T − tool_tokens
    tool_tokens: int = 0  # tool-result tokens, whole batch: fed through the model, never sampled or scored
    checkpointing: bool = False  # activation checkpointing (full recomputation of each layer)
    reference: bool = True  # β > 0: log π_ref is needed
    reward_model: bool = False  # a learned reward model of the policy's shape (forward only)
    epochs: int = 1  # μ: passes over the batch per step (> 1 adds a forward for log π_old)
    reuse_rollout_forward: bool | None = None  # the update on decoding's recording; None: where the trainer does it
    # cpu, fp32: the lean decoder's products (train.cpu_decode_dtype). bf16: its weight layout in 2 bytes a value,
    # decoding timed at the bf16 decode rate, and without the recording a forward for log π_old (the sampler's
    # numerics are not the trainer's)
    decode_dtype: str = "fp32"
    device: str = "gpu"  # "cpu": add the process baseline (cpu_baseline_bytes)
    cpu_baseline_bytes: float = 0.0  # resident memory of the process before any model is loaded
    peak_flops: float = GPU_PEAK_FLOPS["h100"]  # gpu: per device, a datasheet figure
    mfu: float = 0.4  # gpu: model FLOPs utilisation assumed for forward/backward passes
    generation_mfu: float = 0.1  # gpu: decoding is memory-bandwidth bound: far lower utilisation than training
    # cpu: measured rates (measure_cpu_rates; CPU_RATES says what each is); None: no time
    cpu_rates: dict | None = None

    @property
    def sequences(self) -> int:
        """B = P·G."""
        return self.prompts_per_step * self.group_size

    @property
    def seq_len(self) -> int:
        """S = s_p + T."""
        return self.prompt_len + self.response_len

    @property
    def prompts(self) -> int:
        """U: the distinct prompts, each of which the trainer runs through a model once for its whole group."""
        return self.distinct_prompts if self.distinct_prompts is not None else self.prompts_per_step

    @property
    def scored_tokens(self) -> int:
        """Response tokens the LM head scores in log-prob passes (not padding after EOS, not tool results)."""
        if self.response_tokens is not None:
            return self.response_tokens
        return self.sequences * self.response_len - self.tool_tokens

    @property
    def budget(self) -> int:
        """The decoding budget, sampling.max_new_tokens: what the CPU decoder allocates its buffers for."""
        return self.max_new_tokens if self.max_new_tokens is not None else self.response_len

    @property
    def micro_batch(self) -> int:
        """b: sequences in one forward/backward on one device."""
        return self.micro_batch_size or self.sequences // self.gpus


def replay_possible(run: RunSpec) -> bool:
    """Whether the trainer's update differentiates decoding's own forward (``RLTrainer._reuse_rollout_forward``
    with ``train.reuse_rollout_forward`` on): the lean decoder (a CPU in fp32), a critic-free algorithm, one
    epoch, one process, one micro-batch holding the whole batch."""
    return (run.device == "cpu" and run.dtype == "fp32" and run.algorithm in ("grpo", "rloo", "rft") and run.epochs == 1
            and run.gpus == 1 and run.micro_batch >= run.sequences)


def validate(run: RunSpec) -> RunSpec:
    """The run with aliases and defaults resolved, or a PlanError naming the bad value and the fix."""
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
    if run.decode_dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown decode-dtype '{run.decode_dtype}': use fp32 or bf16")
    if run.decode_dtype == "bf16" and not (run.device == "cpu" and run.dtype == "fp32"):
        raise PlanError("decode-dtype bf16 is the CPU lean decoder's, which decodes fp32 models only: use device cpu "
                        "with dtype fp32, or drop decode-dtype")
    for name in ("gpus", "group_size", "prompts_per_step", "prompt_len", "response_len", "epochs"):
        if getattr(run, name) < 1:
            raise PlanError(f"{name.replace('_', '-')} must be >= 1 (got {getattr(run, name)})")
    if run.budget < run.response_len:
        raise PlanError(f"max-new-tokens ({run.budget}) must be at least the response length T ({run.response_len})")
    if run.micro_batch_size < 0:
        raise PlanError(f"micro-batch-size must be >= 0 (0: the whole batch at once; got {run.micro_batch_size})")
    if run.lora_rank < 0:
        raise PlanError(f"lora-rank must be >= 0 (0: full fine-tuning; got {run.lora_rank})")
    if not (0 < run.mfu <= 1 and 0 < run.generation_mfu <= 1):
        raise PlanError(f"MFU must be in (0, 1] (got mfu={run.mfu}, generation_mfu={run.generation_mfu})")
    if run.sequences % run.gpus:
        raise PlanError(f"P·G = {run.sequences} sequences do not split evenly over {run.gpus} devices; change P, G or gpus")
    if not 1 <= run.prompts <= run.prompts_per_step:
        raise PlanError(f"distinct-prompts must be between 1 and P = {run.prompts_per_step} (got {run.prompts})")
    if not 0 <= run.tool_tokens < run.sequences * run.response_len:
        raise PlanError(f"tool-tokens must be >= 0 and fewer than B·T = {run.sequences * run.response_len} "
                        f"(got {run.tool_tokens})")
    if not 0 < run.scored_tokens <= run.sequences * run.response_len - run.tool_tokens:
        raise PlanError(f"response-tokens must be between 1 and B·T − tool tokens = "
                        f"{run.sequences * run.response_len - run.tool_tokens} (got {run.scored_tokens})")
    missing = [k for k in CPU_RATES if k not in (run.cpu_rates or {})]
    if run.device == "cpu" and run.cpu_rates and missing:
        raise PlanError(f"the CPU rates lack {', '.join(missing)} (rates measured before the planner used them): "
                        "measure them again with this version (cohortrl plan measures them; "
                        "benchmarks/planner_validation.py without --from-json)")
    replay = replay_possible(run)
    if run.reuse_rollout_forward and not replay:
        raise PlanError("the update reuses decoding's forward only on a CPU in fp32, for grpo, rloo or rft, with one epoch, "
                        "one device and one micro-batch holding the whole batch: drop --reuse-rollout-forward or "
                        "change those settings")
    # RFT never has a reference (config: algorithm.beta must be 0 for rft); RunSpec's default, β > 0, is PPO's and GRPO's
    reference = run.reference and run.algorithm != "rft"
    return replace(run, sharding=sharding, reference=reference,
                   reuse_rollout_forward=replay if run.reuse_rollout_forward is None else run.reuse_rollout_forward)


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


def shares_prompts(run: RunSpec) -> bool:
    """Whether the update's forward runs a group's prompt once (``rollout/hf.response_logprobs``,
    ``share_prompts``): on one process and under DDP, not with sharding over several processes (FSDP2, where
    each layer's forward is a collective and the number of decoder calls would depend on the rows)."""
    return run.gpus == 1 or run.sharding == "none"


def update_tokens(run: RunSpec) -> int:
    """Tokens one forward of the update's micro-batch runs through the policy: U_b·s_p + b·T when it shares
    prompts (``shares_prompts``), with U_b = the micro-batch's share of the distinct prompts; else every row runs
    its own prompt: b·S."""
    b = run.micro_batch
    if not shares_prompts(run):
        return b * run.seq_len
    prompts = max(1, -(-run.prompts * b // run.sequences))  # ceil: a micro-batch holds whole groups
    return prompts * run.prompt_len + b * run.response_len


# ``rollout/hf._HeadLogProbs`` applies the head in chunks of LOGPROB_CHUNK_BYTES of fp32 logits (on one process,
# and inside DDP's and FSDP2's forward: ``distributed.forward_inside``).
# Probabilities of at most LOGPROB_KEEP_BYTES (all response tokens) are kept from forward to backward: those
# plus one chunk of logits. Above that none are kept, and at most two chunks exist at once (the logits and the
# entropy's probabilities in forward; the recomputed logits, turned into their gradient in place, in backward).
CHUNKED_LOGIT_COPIES = 2
LOGPROB_CHUNK_BYTES = 32 * 2**20  # = rollout.hf.LOGPROB_CHUNK_BYTES (a test keeps them equal)
LOGPROB_KEEP_BYTES = 128 * 2**20  # = rollout.hf.LOGPROB_KEEP_BYTES
RECORD_LOGITS_BYTES = 128 * 2**20  # = cpu.decoder.RECORD_LOGITS_BYTES


def recording_rows(run: RunSpec) -> int:
    """Rows decoding's recording holds (``cpu/decoder.LlamaDecoder``, ``record=True``): each distinct prompt's
    first s_p − 1 columns once (the prefix), then one row per token fed to a row still computed. Rows leave the
    products once a quarter of those still computed have ended (``end_rows``), so that is about the response
    and tool-result tokens: counted as those (B·T where they are not given), slightly under what is written."""
    return run.prompts * (run.prompt_len - 1) + decoded_rows(run)


def decoded_rows(run: RunSpec) -> int:
    """The decoding rows with a real token: every response and tool-result token (B·T − padding), B·T when the
    response tokens are not given."""
    return min(run.sequences * run.response_len, run.scored_tokens + run.tool_tokens)


def recording_bytes(m: ModelShape, run: RunSpec) -> float:
    """What decoding keeps for the update's backward, fp32: per layer and row the layer's input, the q/k/v
    products, the residual after attention and the gate/up products (2h + (a + 2k)·d + 2f values); per
    decoding row the last layer's output (h); and the logits of every decoding row when B·(budget)·V fp32
    fits in RECORD_LOGITS_BYTES (``cpu/decoder.py``).

    The decoder allocates these buffers for the whole sampling budget, each in a memory map (the run's kept
    maps, ``cpu/memory.RecordingMaps``), whose pages become resident only when written: what is resident is the
    rows it wrote (:func:`recording_rows`), counted here. (The kept maps also hold, from the last call, the rows
    every row wrote, which this call's rows mostly overwrite; not counted.)"""
    h, f, d = m.hidden_size, m.intermediate_size, m.d
    per_row = m.num_layers * (2 * h + (m.num_heads + 2 * m.num_kv_heads) * d + 2 * f)
    decoded = decoded_rows(run)
    logits_kept = run.sequences * run.budget * m.vocab_size * 4 <= RECORD_LOGITS_BYTES  # decided on the budget
    return (recording_rows(run) * per_row + decoded * h) * 4 + (decoded * m.vocab_size * 4 if logits_kept else 0)


def replay_temporaries(m: ModelShape, run: RunSpec) -> float:
    """The largest set of temporaries the replayed backward (``cpu/replay.Recording.backward``) holds at once,
    over every recorded row: the gradient flowing down the residual (h) and, inside the MLP's backward,
    silu(gate), the down projection's input and input gradient and the gate's gradient (4f) with the norm's
    input gradient and output (2h) and the LoRA branch's input gradient (h); plus two chunks of at most
    32 MiB (the head's logits, an attention block's probabilities)."""
    return recording_rows(run) * (4 * m.intermediate_size + 4 * m.hidden_size) * 4 + 2 * LOGPROB_CHUNK_BYTES


@dataclass(frozen=True)
class Memory:
    """Bytes per device by component; ``peak`` = persistent states + the larger of the two phases. Gradients
    belong to the update phase: the trainer frees them after each optimiser step (``trainers/setup.optimizer_step``).
    Decoding's recording (the update on decoding's forward) is held from generation through the update, so
    it is in both phases."""

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
    # cpu, fp32: the linear weights' oneDNN layout while decoding, in decode_dtype (cpu/decoder.py, kernels.decoding_weights)
    decode_layout: float = 0.0
    recording: float = 0.0  # decoding's recorded forward, when the update reuses it (cpu/replay.py)
    replay_temporaries: float = 0.0  # the replayed backward's largest set of temporaries
    gathered_weights: float = 0.0  # zero3 over several devices: the whole policy, gathered for generation

    @property
    def gradients(self) -> float:
        return self.policy.gradients + (self.critic.gradients if self.critic else 0.0)

    @property
    def persistent(self) -> float:
        critic = self.critic.total if self.critic else 0.0
        return self.baseline + self.policy.total + critic + self.reference + self.reward_model - self.gradients

    @property
    def update_phase(self) -> float:
        return self.recording + self.replay_temporaries + self.activations + self.logits + self.gradients

    @property
    def generation_phase(self) -> float:
        return self.recording + self.kv_cache + self.decode_layout + self.gathered_weights

    @property
    def peak(self) -> float:
        return self.persistent + max(self.update_phase, self.generation_phase)


def kv_cache_bytes(m: ModelShape, tokens: int, dtype: str) -> float:
    """KV cache = 2 (K and V) · L · k · d · bytes per token (the cache HF generate / vLLM fill)."""
    return 2 * m.num_layers * m.num_kv_heads * m.d * DTYPE_BYTES[dtype] * tokens


def chunked_logit_bytes(positions: int, vocab: int) -> float:
    """The chunked LM head (``rollout/hf._HeadLogProbs``) over ``positions`` scored tokens: the kept
    probabilities plus one chunk while they fit in LOGPROB_KEEP_BYTES, else two chunks."""
    full = positions * vocab * 4
    chunk = min(LOGPROB_CHUNK_BYTES, full)
    return full + chunk if full <= LOGPROB_KEEP_BYTES else CHUNKED_LOGIT_COPIES * chunk


def plan_memory(m: ModelShape, run: RunSpec) -> Memory:
    n, shard, dt = run.gpus, run.sharding, run.dtype
    lora = run.lora_rank > 0
    trainable = m.lora_params(run.lora_rank) if lora else m.params
    policy_params = m.params + (trainable if lora else 0)  # the base weights and, with LoRA, the adapter
    policy = model_states(policy_params, trainable, dt, shard, n)
    critic = model_states(m.critic_params, m.critic_params, dt, shard, n) if run.algorithm == "ppo" else None
    frozen_copy = m.params * DTYPE_BYTES[dt] / (n if shard == "zero3" else 1)
    reference = frozen_copy if run.reference and not lora else 0.0  # LoRA: the base weights, adapter off
    reward_model = frozen_copy if run.reward_model else 0.0

    act_bytes = DTYPE_BYTES[dt]
    b = run.micro_batch
    scored_b = run.scored_tokens * b // run.sequences  # the micro-batch's share of the scored tokens
    if run.reuse_rollout_forward:  # the update runs no forward: decoding's recording stands in for activations
        no_ckpt = ckpt = logits = 0.0
        recording, temporaries = recording_bytes(m, run), replay_temporaries(m, run)
    else:
        tokens, critic_tokens = update_tokens(run), (b * run.seq_len if run.algorithm == "ppo" else 0)
        no_ckpt = (tokens + critic_tokens) * activation_elements_per_token(m, False) * act_bytes
        ckpt = (tokens + critic_tokens) * activation_elements_per_token(m, True) * act_bytes
        logits = chunked_logit_bytes(scored_b, m.vocab_size)  # the chunked head (rollout/hf._HeadLogProbs)
        recording = temporaries = 0.0
    # K and V of every row's whole length, s_p + T: HF generate grows them to T; the CPU's lean decoder (fp32)
    # allocates them for the budget in memory maps whose pages become resident as the T steps write them.
    kv = kv_cache_bytes(m, run.sequences // n * run.seq_len, dt)
    # On a CPU in fp32 (train.cpu_linear auto), decoding holds a second copy of every linear weight, the
    # projections and the LM head, in oneDNN's layout (the lean decoder's merged q/k/v and gate/up copies, or
    # kernels.decoding_weights for transformers' forward: the same bytes); LoRA's small matrices are not counted
    # (the lean decoder folds them in). With bf16 products the copy is bf16. Building it, the decoder folds and
    # casts one layer's matrices at a time, in fp32 (the head: its bf16 cast): transients freed before the first
    # step, when the KV cache and the recording, which make the phase's peak, are still empty.
    linear_weights = m.num_layers * m.layer_matrix_params + m.vocab_size * m.hidden_size
    decode_layout = linear_weights * DTYPE_BYTES[run.decode_dtype] if run.device == "cpu" and dt == "fp32" else 0.0
    # Sharded over several devices, generation gathers every layer of the policy at once and keeps it until
    # decoding ends (distributed.Dist.gathered: the ranks decode different numbers of steps, so per-layer
    # gathers could not be matched), into buffers of its own beside the shards, in the compute dtype.
    gathered = policy_params * DTYPE_BYTES[dt] if shard == "zero3" and n > 1 else 0.0
    return Memory(
        policy=policy, critic=critic, reference=reference, reward_model=reward_model,
        activations=ckpt if run.checkpointing else no_ckpt, activations_no_ckpt=no_ckpt, activations_ckpt=ckpt,
        logits=logits, kv_cache=kv, baseline=run.cpu_baseline_bytes if run.device == "cpu" else 0.0,
        decode_layout=decode_layout, recording=recording, replay_temporaries=temporaries, gathered_weights=gathered,
    )


# ---------------------------------------------------------------------------------------------- FLOPs
def forward_flops(m: ModelShape, seq_len: int, logit_positions: int, vocab_head: bool = True) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` tokens: 2 per weight per token (Kaplan et al.,
    arXiv 2001.08361, §2.1, C_forward ≈ 2N) over the layers, the LM head 2·h·V on the positions whose logits
    are computed, and attention 4·L·a·d·ctx per token (QKᵀ and the weighted sum of V, 2·ctx·a·d each;
    Chinchilla, arXiv 2203.15556, App. F) with the causal mean context ctx = (S + 1)/2."""
    layers = 2 * m.num_layers * m.layer_params * seq_len
    head = 2 * m.hidden_size * m.vocab_size * logit_positions if vocab_head else 2 * m.hidden_size * logit_positions
    return layers + head + attention_flops(m, seq_len * (seq_len + 1) / 2)


def attention_flops(m: ModelShape, pairs: float) -> float:
    """QKᵀ and the weighted sum of V over ``pairs`` (query, key) pairs: 4·L·a·d each (Chinchilla, App. F)."""
    return 4 * m.num_layers * m.num_heads * m.d * pairs


@dataclass(frozen=True)
class Pass:
    """One pass over a batch's tokens, split by what its FLOPs are spent on."""

    layers: float  # the layers' weight products: 2 per weight per token
    attention: float
    head: float  # the LM head (or a critic's value head) on the positions it scores

    @property
    def total(self) -> float:
        return self.layers + self.attention + self.head


def batch_pass(m: ModelShape, run: RunSpec, shared: bool, head_positions: int, vocab_head: bool = True) -> Pass:
    """A forward over the whole batch. ``shared``: each distinct prompt once and every response against its
    prompt's cache (``response_logprobs`` with ``share_prompts``, the recording's rows): U·s_p + B·T tokens;
    else every sequence whole, B·S tokens."""
    B, sp, T, U = run.sequences, run.prompt_len, run.response_len, run.prompts
    if shared:
        tokens, pairs = U * sp + B * T, U * sp * (sp + 1) / 2 + B * (T * sp + T * (T + 1) / 2)
    else:
        tokens, pairs = B * run.seq_len, B * run.seq_len * (run.seq_len + 1) / 2
    head = 2 * m.hidden_size * (m.vocab_size if vocab_head else 1) * head_positions
    return Pass(2 * m.num_layers * m.layer_params * tokens, attention_flops(m, pairs), head)


@dataclass(frozen=True)
class Flops:
    """FLOPs of one whole step (all devices) by phase."""

    prefill: float  # generation: each distinct prompt once
    decoding: float  # generation: B rows per step, T steps (layers, attention, the head on every row)
    reference: float
    reward_model: float
    old_logprobs: float
    critic: float  # PPO: values at rollout time + forward/backward in the update
    policy: float  # the update: forward/backward (+ recomputation with checkpointing), or the replayed backward
    adapters: float = 0.0  # LoRA's rank-r products wherever they run beside the frozen weights (all phases)

    @property
    def generation(self) -> float:
        return self.prefill + self.decoding

    @property
    def total(self) -> float:
        return (self.generation + self.reference + self.reward_model + self.old_logprobs + self.critic + self.policy
                + self.adapters)


PHASES = ("prefill", "decoding", "reference", "reward_model", "old_logprobs", "critic", "policy", "adapters")


def backward_flops(p: Pass, lora: bool, head_trained: bool) -> float:
    """Backward ≈ 2 × forward (Kaplan §2.1: 6N per token in training = 2N forward + 4N backward): the input
    gradient and the weight gradient, one product each. Frozen weights (LoRA's base, a frozen head) still pass
    the input gradient on but get none of their own: 1 × their forward. Attention has no weights: its
    backward is 2 × its forward (dQ, dK from the scores' gradient, dV and the scores' gradient from dO)."""
    return p.layers * (1 if lora else 2) + 2 * p.attention + p.head * (2 if head_trained else 1)


def adapter_flops(m: ModelShape, run: RunSpec, tokens: int, replayed_rows: int | None = None) -> float:
    """LoRA's own products, 2·r·(in + out) per adapted matrix and token forward (``m.lora_params`` per token),
    counted apart from the frozen weights' because they run at another rate: rank-r products are thin.
    The update (its own forward and backward, or the replayed backward, which runs each adapter forward again
    under autograd: ``cpu/replay.linear_backward``) costs 3 × that on its tokens (``replayed_rows`` where the
    update is the replay: the rows it computes); an old-log-prob pass 1 ×; generation 1 × unless the CPU decoder folds the adapter into its weight copy (an fp32 model,
    ``cpu/decoder.py``: folded in fp32 whatever its products' dtype). The reference is the base with the
    adapter off: none."""
    if not run.lora_rank:
        return 0.0
    per_token = 2 * m.lora_params(run.lora_rank)
    folded = run.device == "cpu" and run.dtype == "fp32"
    update = tokens if replayed_rows is None else replayed_rows  # the replayed backward: the rows it reaches
    return per_token * (3 * run.epochs * update + ((1 if computes_old_logprobs(run) else 0) + (0 if folded else 1)) * tokens)


def decoding_product_flops(m: ModelShape, run: RunSpec) -> float:
    """Decoding's weight products: B rows at each of T steps through the layers and the head."""
    return (2 * m.num_layers * m.layer_params + 2 * m.hidden_size * m.vocab_size) * run.sequences * run.response_len


def decoding_attention_flops(m: ModelShape, run: RunSpec) -> float:
    """Decoding's attention: B rows at each of T steps; step t (from 0) attends to s_p + t columns (the padded
    prompt and the steps so far): B·(T·s_p + T(T − 1)/2) (query, key) pairs."""
    B, T, sp = run.sequences, run.response_len, run.prompt_len
    return attention_flops(m, B * (T * sp + T * (T - 1) / 2))


def decoding_kv_read_bytes(m: ModelShape, run: RunSpec) -> float:
    """Bytes of KV cache decoding's attention reads, all devices: at each step every row computed reads its keys
    and values (2·L·k·d values a column, in the model's dtype: fp32 on the CPU decoder) for each of the s_p + t
    columns it attends to (``cpu/decoder.grouped_attention``). Rows leave the computation after their end
    (``LlamaDecoder.end_rows``), so the rows are those with a real token (:func:`decoded_rows`), each at the mean
    context s_p + (T − 1)/2: exact when every row runs T steps (B·(T·s_p + T(T − 1)/2) columns, the pairs of
    :func:`decoding_attention_flops`); with shorter rows it overcounts their contexts and misses the ended rows
    still computed until a quarter have ended."""
    return kv_cache_bytes(m, decoded_rows(run) * (run.prompt_len + (run.response_len - 1) / 2), run.dtype)


def uniform_cpu_rates(m: ModelShape, flops_per_s: float, dtype: str = "fp32") -> dict[str, float]:
    """One given FLOP rate for every kind of work (``cohortrl plan --peak-gflops``), decoding's attention included:
    its KV-cache rate is the bytes that rate reads at attention's 4·a·d FLOPs per 2·k·d values of a column; no time per step."""
    kv_bytes_per_flop = 2 * m.num_kv_heads * m.d * DTYPE_BYTES[dtype] / (4 * m.num_heads * m.d)
    return {"decode": flops_per_s, "attention_bytes": flops_per_s * kv_bytes_per_flop, "layer": flops_per_s,
            "thin": flops_per_s, "step_s": 0.0, "layer_step_s": 0.0}


def computes_old_logprobs(run: RunSpec) -> bool:
    """Whether the step runs a forward for log π_old (``RLTrainer.needs_old_logp``): several epochs, or decoding's
    bf16 products without the update on their recording (the sampler's numerics are not the trainer's: the update
    corrects for them with importance weights, π_old from the trainer's own forward; not RFT's supervised loss,
    which has no ratio to correct)."""
    return run.epochs > 1 or (run.decode_dtype == "bf16" and not run.reuse_rollout_forward and run.algorithm != "rft")


def plan_flops(m: ModelShape, run: RunSpec) -> Flops:
    B, T, U, sp = run.sequences, run.response_len, run.prompts, run.prompt_len
    lora = run.lora_rank > 0
    # Generation: each distinct prompt's first s_p − 1 tokens once (prefill), then B rows per step for T steps:
    # the layers and the head on every row (finished rows and tool-result tokens included: the batch steps
    # together), attention over the prompt and the steps so far.
    prefill = 2 * m.num_layers * m.layer_params * U * (sp - 1) + attention_flops(m, U * (sp - 1) * sp / 2)
    decoding = decoding_product_flops(m, run) + decoding_attention_flops(m, run)
    shared = shares_prompts(run)  # a group's prompt runs once in the log-prob passes
    score = batch_pass(m, run, shared, run.scored_tokens)
    recompute = score.layers + score.attention if run.checkpointing else 0.0  # Korthikanti §5: one more forward
    update_rows = None
    if run.reuse_rollout_forward:
        # cpu/replay.py: the update's backward on decoding's recording, no forward of its own; it recomputes the
        # attention's forward per layer and the head's logits when they were not kept. Its layers' products run
        # on the rows the loss's gradient reaches only (Recording._reached_rows: each distinct prompt once, each
        # row's steps up to its last response token), its attention over the whole step-major layout.
        kept = B * run.budget * m.vocab_size * 4 <= RECORD_LOGITS_BYTES  # the decoder decides on its budget
        # the recorded rows (the prefix of s_p - 1 columns, then the real tokens: a row's last one is a response
        # token, its tool results lie before it); an upper bound, since a group with no gradient (all rewards
        # equal, beta 0) is not reached at all. score.layers counted U*sp + B*T tokens (shared: one process)
        assert shared, "the update runs on decoding's recording on one process only, where prompts are shared"
        update_rows = recording_rows(run)
        reached = Pass(score.layers * update_rows / (U * sp + B * T), score.attention, score.head)
        policy = backward_flops(reached, lora, not lora) + score.attention + (0 if kept else score.head)
        if run.algorithm == "rft" and not kept:  # Recording.logprobs at temperature 1: the head over every position
            policy += score.head
    else:
        policy = run.epochs * (score.total + backward_flops(score, lora, not lora) + recompute)
    critic = 0.0
    if run.algorithm == "ppo":  # the critic runs every sequence whole (trainers/critic.response_values), fully trained
        values = batch_pass(m, run, False, B * (T + 1), vocab_head=False)
        critic_recompute = values.layers + values.attention if run.checkpointing else 0.0
        critic = values.total + run.epochs * (values.total + backward_flops(values, False, True) + critic_recompute)
    return Flops(
        prefill=prefill,
        decoding=decoding,
        adapters=adapter_flops(m, run, U * sp + B * T, update_rows),
        reference=score.total if run.reference else 0.0,
        reward_model=batch_pass(m, run, False, B, vocab_head=False).total if run.reward_model else 0.0,
        old_logprobs=score.total if computes_old_logprobs(run) else 0.0,
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
    step_seconds: dict[str, float] = field(default_factory=dict)  # per phase, on one device; empty: not known

    @property
    def step_time(self) -> float | None:
        return sum(self.step_seconds.values()) if self.step_seconds else None


def step_seconds(m: ModelShape, flops: Flops, run: RunSpec) -> dict[str, float]:
    """Seconds per phase on one device (the N devices split the step's sequences evenly).
    GPU: FLOPs / (datasheet peak · an assumed MFU): a model prediction. CPU: rates measured on the machine
    (``measure_cpu_rates``): decoding's products at their B-row rate (measured in the decoder's products' dtype)
    and its attention by the KV cache it reads (:func:`decoding_attention_seconds`), plus a measured time per step
    (:func:`decoding_step_overhead_seconds`), LoRA's products at the thin (rank-r) rate, every other phase at
    the rate of a training pass through real layers, except a recording decoder's prefill in bf16, whose products
    are decoding's, on more rows (``LlamaDecoder._prefill``): at the decode rate, which more rows would not lower;
    {} when no rate was measured or given: no time is better than an invented one."""
    per_device = {k: getattr(flops, k) / run.gpus for k in PHASES}
    if run.device == "cpu":
        if not run.cpu_rates:
            return {}
        rates = run.cpu_rates
        rate = {"adapters": rates["thin"]}
        if run.decode_dtype == "bf16" and run.reuse_rollout_forward:
            rate["prefill"] = rates["decode"]
        decoding = (decoding_product_flops(m, run) / run.gpus / rates["decode"]
                    + decoding_attention_seconds(m, run) + decoding_step_overhead_seconds(m, run))
        return {k: decoding if k == "decoding" else v / rate.get(k, rates["layer"]) for k, v in per_device.items()}
    train_rate = run.peak_flops * run.mfu
    gen_rate = run.peak_flops * run.generation_mfu
    return {k: v / (gen_rate if k in ("prefill", "decoding") else train_rate) for k, v in per_device.items()}


def decoding_attention_seconds(m: ModelShape, run: RunSpec) -> float:
    """CPU seconds on one device of decoding's attention: the KV cache it reads (:func:`decoding_kv_read_bytes`)
    at the rate measured over a cache of the model's shape (``measure_cpu_rates``' ``attention_bytes``). A step
    reads every row's keys and values for a few FLOPs a value, so memory bandwidth, not arithmetic, sets its
    time: at the products' FLOP rate it would be counted several times too fast."""
    return decoding_kv_read_bytes(m, run) / run.gpus / run.cpu_rates["attention_bytes"]


def decoding_step_overhead_seconds(m: ModelShape, run: RunSpec) -> float:
    """CPU seconds on one device of decoding's work around its products and attention, which no FLOP rate times:
    T steps (until the longest response ends; each device runs all) of ``step_s`` + L · ``layer_step_s``."""
    return run.response_len * (run.cpu_rates["step_s"] + m.num_layers * run.cpu_rates["layer_step_s"])


def plan(model: ModelShape | str, run: RunSpec) -> Plan:
    """The memory per device and FLOPs of one step of ``run`` on ``model`` (a shape or a spec for
    ``resolve_shape``)."""
    shape = resolve_shape(model) if isinstance(model, str) else model
    run = validate(run)
    flops = plan_flops(shape, run)
    return Plan(shape, run, plan_memory(shape, run), flops, step_seconds(shape, flops, run))


def run_spec_from_config(cfg, *, bf16_units: bool = False, **sizes) -> RunSpec:
    """The RunSpec of a cohortrl ``Config`` (its algorithm, P, G, β, LoRA, micro-batches, dtype, the update on
    decoding's recording, the decoder's products' dtype), with ``sizes`` (prompt_len, response_len,
    response_tokens, tool_tokens, distinct_prompts, device, cpu_rates, cpu_baseline_bytes, ...) for what a config
    does not fix. Without ``response_len``: the sampling budget, the longest a step can be. ``bf16_units``: the
    machine the run trains on multiplies bf16 in hardware, with oneDNN (``trainers.setup.cpu_bf16_products``
    asks this one), where ``train.cpu_decode_dtype: auto`` decodes with bf16 products."""
    a, t = cfg.algorithm, cfg.train
    algorithm = a.name if a.name in ("ppo", "rft") else ("rloo" if a.estimator == "rloo" else "grpo")
    device = sizes.pop("device", "cpu" if t.device in ("auto", "cpu") else "gpu")
    spec = dict(
        algorithm=algorithm, dtype={"float32": "fp32"}.get(cfg.model.dtype, "bf16"),
        lora_rank=cfg.model.lora.r if cfg.model.lora.enabled else 0, group_size=a.group_size,
        prompts_per_step=a.prompts_per_step, micro_batch_size=a.micro_batch_size, reference=a.beta > 0,
        epochs=a.epochs, checkpointing=t.activation_checkpointing, device=device,
        response_len=cfg.sampling.max_new_tokens, max_new_tokens=cfg.sampling.max_new_tokens,
        prompt_len=cfg.data.max_prompt_tokens,
    )
    # The trainer reuses decoding's forward only where the config lets it (train.reuse_rollout_forward, one
    # minibatch, no KL in the reward, no resampled groups, the CPU fast path on).
    reusable = (t.reuse_rollout_forward and t.cpu_fast_path == "auto" and a.minibatches == 1 and not a.kl_in_reward
                and a.zero_variance != "resample")
    spec.update(sizes)
    # train.cpu_decode_dtype as the trainer resolves it (cpu.build, kernels.resolve_decode_dtype): bf16 products
    # are the lean decoder's, which runs an fp32 model on a CPU on the fast path's oneDNN kernel; auto takes them
    # where the machine has bf16 units, bfloat16 wherever asked (where it cannot run, the trainer refuses to start)
    lean = spec["device"] == "cpu" and spec["dtype"] == "fp32" and t.cpu_fast_path == "auto" and t.cpu_linear != "aten"
    wanted = t.cpu_decode_dtype == "bfloat16" or (t.cpu_decode_dtype == "auto" and bf16_units)
    spec.setdefault("decode_dtype", "bf16" if lean and wanted else "fp32")
    run = RunSpec(**spec)
    return run if reusable else replace(run, reuse_rollout_forward=False)
