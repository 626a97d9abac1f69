"""The sections of a run's configuration (``model``, ``data``, ``sampling`` ...): each field documented in the
docstring under it, and each section's own checks beside its fields (``check``). Checks that read two sections
(``cohortrl.config.validate``) and the building from YAML and mappings live in ``cohortrl/config/__init__.py``."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration problem, raised before anything expensive happens."""


def require(ok: bool, path: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{path}' = {value!r}: {why}")


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train a LoRA adapter (PEFT) instead of all weights; the reference model is then the base weights
    with the adapter disabled, so no second copy of the model is kept."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get an adapter. The default names a Llama-family model's projections; another
    architecture needs its own (GPT-2: ``c_attn``, ``c_proj``, ``c_fc``)."""

    def check(self) -> None:
        require(self.r >= 1, "model.lora.r", self.r, "must be at least 1")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """Model spec: an alias (``cohortrl models`` lists them), a hub id, a local directory or a ``.gguf`` file."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype. CPUs train in float32."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings."""
    system_prompt: Optional[str] = None
    """System message put before every prompt that has none of its own (None: none added, as TRL does; the
    chat template's own default, if it has one, applies)."""
    init: Optional[str] = None
    """Start from a supervised run's weights: a ``final/`` directory of ``cohortrl sft`` (or any directory
    holding a PEFT adapter or full weights of ``name``'s architecture). An adapter is merged into ``name``'s
    weights; full weights replace them. The merged model is where training starts, the model ``algorithm.beta``'s
    KL term measures against (the frozen reference is the supervised model, not ``name``), and, with
    ``lora.enabled``, the base under the run's own new adapter. ``name`` must be the model the supervised run
    started from."""

    def check(self) -> None:
        self.lora.check()
        require(
            self.init is None or any((Path(self.init) / f).is_file() for f in ("adapter_config.json", "config.json")),
            "model.init", self.init,
            "must be a directory holding a PEFT adapter (adapter_config.json) or full weights (config.json), "
            "e.g. the final/ directory of a cohortrl sft run",
        )


@dataclass
class DataConfig:
    source: str = "task:arithmetic"
    """Where prompts come from: ``task:NAME`` (a gym family, see ``cohortrl tasks list``; ``task:gsm8k`` reads
    the copy shipped in the package), ``jsonl:PATH``, ``hf:DATASET_ID`` (Hugging Face hub, needs internet),
    or ``python:NAME`` (rows handed to the Python API as ``train_dataset=``; a config file cannot hold them)."""
    transform: Optional[str] = None
    """User code applied to every row before use, ``path/to/file.py:fn`` or ``module:fn``: ``fn(row: dict)
    -> dict``; the result must hold the prompt column. Not applied to ``task:`` rows (they are generated)."""
    level: int = 1
    """Difficulty level for ``task:`` sources."""
    levels: list[int] = field(default_factory=list)
    """``task:`` sources: a mix of difficulty levels instead of ``data.level`` (e.g. ``[1, 3]``): each level an
    equal share of ``train_size`` and of the held-out problems (the first levels take the remainder), drawn as
    that level alone would draw them, training rows interleaved level by level. Evaluation reports each level's
    accuracy too (``eval/accuracy_level1``, ...), and ``cohortrl report`` pairs arms on each level's problems: what
    a prompt mix of very different difficulty shows about how an estimator weights its questions."""
    eval_level: Optional[int] = None
    """``task:`` sources: draw the held-out problems from this level instead of ``data.level`` (a warm start
    trained on level-2 problems and measured on level 1). They are exactly the problems a run with
    ``data.level`` set to this level holds out (same ``data.seed``), so the two runs pair problem by problem."""
    prompt_column: str = "prompt"
    """Column holding the prompt text (jsonl / hf sources)."""
    answer_column: str = "answer"
    """Column holding the reference answer (jsonl / hf sources)."""
    train_size: int = 2000
    """Number of training prompts to draw (task sources) or keep (other sources; 0 keeps all)."""
    seed: Optional[int] = None
    """Seed of the problem draw (``task:`` sources) and of the held-out split; unset: ``train.seed``. Fix it when
    comparing seeds of a run, or phases of a pipeline (SFT then GRPO), so that every run trains and evaluates on
    the same problems and the held-out set stays disjoint from every run's training problems."""
    eval_size: Optional[int] = None
    """Held-out prompts for evaluation (disjoint from training). Unset: 200 from a gym task or a hub dataset's
    ``eval_split``; none from your own rows (``jsonl:`` / ``python:``), which are all trained on unless you set
    this (or pass ``eval_dataset=``)."""
    exclude_from_training: dict[str, list[str]] = field(default_factory=dict)
    """``task:`` sources: ``{FIELD: [VALUES]}`` keeps out of training every problem whose sample has one of
    VALUES in FIELD (a sample field, or one of its ``extra`` fields: ``{function: [circle_area]}`` for
    ``python_function``), so that the held-out problems that have one test what no training prompt asked for.
    The held-out set is drawn as without it; its rows are marked unseen or seen, and evaluation reports both
    parts (``eval/accuracy_unseen``, ``eval/accuracy_seen``; ``cohortrl report`` pairs each part)."""
    split: str = "train"
    """Dataset split for training (hf sources); evaluation uses ``eval_split``."""
    eval_split: str = "test"
    """Dataset split for evaluation (hf sources)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are handled per ``overlong_prompts``."""
    overlong_prompts: Literal["reject", "truncate"] = "reject"
    """``reject``: stop with an error naming the prompt, before step 1 (every training and held-out prompt is
    checked when the trainer is built); ``truncate``: keep the last tokens and count it."""

    def check(self) -> None:
        require(self.level >= 1, "data.level", self.level, "levels start at 1")
        require(self.eval_level is None or self.eval_level >= 1, "data.eval_level", self.eval_level, "levels start at 1")
        require(all(level >= 1 for level in self.levels), "data.levels", self.levels, "levels start at 1")
        require(len(set(self.levels)) == len(self.levels), "data.levels", self.levels, "names a level twice")
        require(not self.levels or self.source.startswith("task:"), "data.levels", self.levels,
                "applies to task: sources only")
        require(not self.levels or (self.eval_level is None and not self.exclude_from_training), "data.levels",
                self.levels, "mixes levels for training and evaluation alike: drop data.eval_level and "
                "data.exclude_from_training, or data.levels")
        require(self.eval_level is None or self.source.startswith("task:"), "data.eval_level", self.eval_level,
                "applies to task: sources only (other sources: give the held-out rows as eval_dataset= or a jsonl)")
        require(self.train_size >= 0, "data.train_size", self.train_size, "must be >= 0")
        require(self.eval_size is None or self.eval_size >= 0, "data.eval_size", self.eval_size, "must be >= 0")
        require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", self.max_prompt_tokens, "must be at least 1")
        require(not self.exclude_from_training or self.source.startswith("task:"), "data.exclude_from_training",
                self.exclude_from_training, "applies to task: sources only (a dataset's own rows: split them yourself)")
        require(all(isinstance(v, list) and v for v in self.exclude_from_training.values()), "data.exclude_from_training",
                self.exclude_from_training, "must map a sample field to a non-empty list of values, e.g. {function: [circle_area]}")
        require(
            self.source.split(":", 1)[0] in ("task", "jsonl", "hf", "python") and ":" in self.source,
            "data.source",
            self.source,
            "must be task:NAME, jsonl:PATH, hf:DATASET_ID or python:NAME",
        )


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature for rollouts (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 64
    """Generation budget per response; a response that hits it is 'truncated'."""
    min_new_tokens: int = 0
    """EOS cannot be sampled before this many tokens. Benchmarks set it to ``max_new_tokens`` so
    every response has the same length (equal work across runs and libraries); 0 for training."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (besides the EOS token); the stop string is kept in the response."""
    backend: Literal["hf", "vllm"] = "hf"
    """Rollout generation: ``hf`` (transformers, any device) or ``vllm`` (a colocated vLLM engine, GPU only;
    see docs/distributed.md). Evaluation always uses ``hf``."""
    vllm_gpu_memory_utilization: float = 0.3
    """With ``backend: vllm``: the share of GPU memory the engine may take (the rest is for training)."""
    vllm_max_model_len: int = 2048
    """With ``backend: vllm``: the longest sequence (prompt and response, in tokens) the engine holds a KV cache
    for; at least ``data.max_prompt_tokens + sampling.max_new_tokens`` (checked), at most the model's context."""
    is_cap: float = 2.0
    """With ``backend: vllm``, or ``train.cpu_decode_dtype: bfloat16`` where the update runs its own forward: C in
    the truncated importance weight min(π_old / π_sampler, C) that corrects for the sampler's numerics differing
    from the trainer's."""

    def check(self) -> None:
        require(self.temperature >= 0, "sampling.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        require(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
        require(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens, "must be at least 1")
        require(0 <= self.min_new_tokens <= self.max_new_tokens, "sampling.min_new_tokens", self.min_new_tokens,
                f"must be between 0 and sampling.max_new_tokens ({self.max_new_tokens})")
        require(0 < self.vllm_gpu_memory_utilization <= 1, "sampling.vllm_gpu_memory_utilization",
                self.vllm_gpu_memory_utilization, "must be in (0, 1]")
        require(self.is_cap > 0, "sampling.is_cap", self.is_cap, "must be > 0")
        require(self.vllm_max_model_len >= 1, "sampling.vllm_max_model_len", self.vllm_max_model_len, "must be at least 1")


@dataclass
class RolloutConfig:
    tools: list[str] = field(default_factory=list)
    """Tools the model may call in the middle of a response (docs/tools.md): built-in names (``calculator``,
    ``simulate``) or ``path/to/file.py:function`` / ``module:function``. Tool results are tokens in the response
    that the loss, the KL and the "generated" lengths leave out; they count against ``sampling.max_new_tokens``.
    Empty: single-shot responses."""
    max_tool_calls: int = 4
    """Tool calls per response; a call beyond it is not run and gets an error text as its result."""
    tool_timeout_s: float = 10.0
    """Seconds the calls made at one decoding step may take; a call still running then gets an error text."""
    tool_format: Literal["auto", "text", "chat"] = "auto"
    """How the model calls tools (docs/tools.md): ``chat``, its chat template's own tool calling (the tools
    described by the template, ``<tool_call>{json}</tool_call>``, results as tool messages); ``text``, the
    ``<call>NAME: ARGUMENT</call>`` protocol for templates without it (SmolLM2); ``auto``, chat when the
    template renders tools in that form, else text. ``chat`` on a template that cannot is refused."""

    def check(self, sampling: SamplingConfig) -> None:
        # Tool names are resolved by the trainer before the model loads, as reward functions are: a name may be a
        # function handed over in Python (tools=[fn]), which this file cannot know.
        require(self.max_tool_calls >= 1, "rollout.max_tool_calls", self.max_tool_calls, "must be at least 1")
        require(self.tool_timeout_s > 0, "rollout.tool_timeout_s", self.tool_timeout_s, "must be > 0 (seconds)")
        require(not self.tools or sampling.backend == "hf", "rollout.tools", self.tools,
                "tool calls run in the hf backend's decoding loop; set sampling.backend=hf or remove the tools")


@dataclass
class RewardFunctionConfig:
    name: str = "accuracy"
    """A built-in reward function (``accuracy``, ``format``, ``overlong``, ``task``, ``reward_model`` — a learned
    ORM, ``kwargs: {model: DIR_OR_HUB_ID}``) or ``module:function``."""
    weight: float = 1.0
    """Weight of this function in the total reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the function's factory."""


@dataclass
class ProcessRewardConfig:
    """Step-level (process) rewards: see cohortrl/rewards/process.py and docs/algorithms.md."""

    name: str = "task_steps"
    """The step source: ``task_steps`` (the gym's step graders), ``learned_prm`` (a PRM from ``cohortrl
    train-rm``, ``kwargs: {model: DIR}``), ``implicit_prm`` (PRIME: β·log π_φ/π_ref per token, φ learned
    online from the outcome; not under torchrun) or ``module:function`` returning, per completion, a
    list of (score, (start, end) or None). See docs/process_rewards.md."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for its factory."""
    coef: float = 1.0
    """λ: GRPO's ``grpo_combined`` uses A_outcome + λ·A_process; PPO adds λ × each step reward at the
    step's last token."""
    credit: Literal["sum", "min"] = "sum"
    """How a token is credited with the steps after it: their sum (DeepSeekMath) or their minimum (PURE)."""
    cap: float = 1.0
    """Largest reward one step can earn."""
    max_steps: int = 32
    """Steps beyond this many earn nothing positive (their zero or negative scores still count)."""
    require_answer: bool = True
    """No positive step reward in a response without an ``ANSWER:`` line."""

    def check(self) -> None:
        require(self.cap > 0, "reward.process.cap", self.cap, "must be > 0")
        require(self.max_steps >= 1, "reward.process.max_steps", self.max_steps, "must be at least 1")
        require(self.coef >= 0, "reward.process.coef", self.coef, "must be >= 0")


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    """The reward functions; the total reward is their weighted sum (``None`` results are skipped)."""
    correctness: str = "accuracy"
    """Name of the function whose value says whether a response is correct (accuracy metric, zero-variance
    test). Shaped totals hide all-wrong groups, so this is the outcome signal alone."""
    timeout_s: float = 60.0
    """Seconds one call of a reward function may take (0: no limit). Past it the batch is scored again one
    completion at a time, and a completion the function still does not return on scores 0 as a grader error
    (``grader_errors``); the run goes on. In the trainer's process the call runs in a thread, which Python cannot
    kill (it is left running in the background); with ``reward.workers`` the worker process is killed."""
    process: Optional[ProcessRewardConfig] = None
    """Step-level rewards (null: outcome only). GRPO needs ``algorithm.estimator`` grpo_process or
    grpo_combined to use them; PPO places them on the steps' last tokens before GAE."""
    workers: int = 0
    """Score in this many worker processes, overlapping generation (0: in the trainer's process). Reward
    callables handed to the Python API that cannot be imported by name are always scored in-process."""

    def check(self) -> None:
        require(self.timeout_s >= 0, "reward.timeout_s", self.timeout_s, "must be >= 0 (0: no limit)")
        if self.process is not None:
            self.process.check()
        require(self.workers >= 0, "reward.workers", self.workers, "must be >= 0 (0: score in the trainer's process)")
        for i, fn in enumerate(self.functions):
            require(fn.name != "", f"reward.functions[{i}].name", fn.name, "must name a reward function")
        require(len(self.functions) >= 1, "reward.functions", self.functions, "needs at least one reward function")
        names = [fn.name for fn in self.functions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        require(not dupes, "reward.functions", dupes, "each reward function may appear once (its name keys its metrics)")
        require(
            self.correctness in names,
            "reward.correctness",
            self.correctness,
            f"must be the name of one of reward.functions ({', '.join(names)})",
        )


@dataclass
class PPOConfig:
    """PPO for RLHF (Ziegler et al., arXiv 1909.08593; InstructGPT, arXiv 2203.02155): a critic, GAE, and the
    KL to the reference as a per-token penalty in the reward. Used only when ``algorithm.name`` is ``ppo``;
    ``algorithm.beta`` is the (initial) KL coefficient β, and the update settings (clip, epochs,
    minibatches, micro-batches, aggregation) are shared with GRPO."""

    gamma: float = 1.0
    """γ, the discount in GAE (1: the sequence-level reward reaches every token undiminished)."""
    lam: float = 0.95
    """λ, GAE's bias-variance trade-off (1: Monte-Carlo returns minus the value; 0: one-step TD)."""
    vf_coef: float = 0.1
    """Weight of the value loss. The critic has its own AdamW, which is blind to a constant loss scale, so
    this mainly decides how hard grad-norm clipping (optim.max_grad_norm) bites on the critic."""
    value_clip: Optional[float] = 0.2
    """c in the clipped value loss: V is kept within c of its value at rollout time (null: no clipping)."""
    critic_lr: Optional[float] = None
    """The critic's AdamW learning rate (null: optim.lr). Same warmup and schedule as the policy."""
    critic_warmup_steps: int = 0
    """Training steps at the start that update only the critic, so the policy's first advantages come from
    a value function that has seen some returns. With ``critic_warmup_ev``, the most such steps."""
    critic_warmup_ev: Optional[float] = None
    """End the critic's warm-up early, at the first step whose explained variance reaches this value (e.g. 0.3):
    1 − Var[R − V]/Var[R] over that step's fresh rollouts (the tokens the critic trains on), V from before the
    critic trained on them and R the Monte-Carlo return (the discounted sum of the rewards that follow; GAE's
    λ-return contains V itself, which would flatter a critic that tracks nothing), logged as
    ``explained_variance_mc``. That step already trains the policy; a batch whose returns do not vary does not
    end the warm-up. Null: the warm-up
    is ``critic_warmup_steps`` steps. Needs ``critic_warmup_steps`` > 0 (the most steps to wait) and a constant
    ``optim.schedule`` (the policy's number of updates is not known in advance)."""
    critic_init: str = "policy"
    """``policy``: the critic is a separate copy of the policy's initial transformer (even with LoRA on the
    policy it is a full, fully trained copy: weights, gradients and two AdamW moments, 16 bytes per parameter
    in float32, about 2 GB for SmolLM2-135M) with a zero-initialised value head. Or a directory holding a
    sequence-classification checkpoint with one label (a reward model, as in InstructGPT) whose backbone and
    score head become the critic; it must share the policy's vocabulary."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps β = algorithm.beta; ``adaptive`` steers the measured KL towards ``target_kl``
    (Ziegler et al.: β ← β(1 + clip(KL/target − 1, ±0.2)·n/horizon))."""
    target_kl: float = 6.0
    """Adaptive controller: target KL per response, in nats summed over its tokens."""
    horizon: int = 10000
    """Adaptive controller: responses over which β may change by a factor of about e^0.2."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0, std 1 over the batch's trained tokens."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the reward of a response that ends without EOS or a stop string (hit
    sampling.max_new_tokens); null disables. Discourages rambling past the budget."""

    def check(self) -> None:
        require(0 <= self.gamma <= 1, "algorithm.ppo.gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "algorithm.ppo.lam", self.lam, "must be in [0, 1]")
        require(self.vf_coef > 0, "algorithm.ppo.vf_coef", self.vf_coef,
                "must be > 0 (the critic learns only from the value loss)")
        require(self.value_clip is None or self.value_clip > 0, "algorithm.ppo.value_clip", self.value_clip,
                "must be > 0 or null (no clipping)")
        require(self.critic_lr is None or self.critic_lr > 0, "algorithm.ppo.critic_lr", self.critic_lr,
                "must be > 0 or null (use optim.lr)")
        require(self.critic_warmup_steps >= 0, "algorithm.ppo.critic_warmup_steps", self.critic_warmup_steps,
                "must be >= 0")
        require(self.critic_warmup_ev is None or self.critic_warmup_ev <= 1, "algorithm.ppo.critic_warmup_ev",
                self.critic_warmup_ev, "must be at most 1 (a perfect critic explains all the variance) or null")
        require(self.critic_warmup_ev is None or self.critic_warmup_steps > 0, "algorithm.ppo.critic_warmup_steps",
                self.critic_warmup_steps, "must be > 0 with critic_warmup_ev: it is the most warm-up steps to wait")
        require(self.target_kl > 0, "algorithm.ppo.target_kl", self.target_kl, "must be > 0 (nats per response)")
        require(self.horizon >= 1, "algorithm.ppo.horizon", self.horizon, "must be at least 1")
        require(
            self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
            "algorithm.ppo.missing_eos_penalty",
            self.missing_eos_penalty,
            "is subtracted from the reward, so give it as a number >= 0 (or null to disable)",
        )
        require(
            self.critic_init == "policy" or (Path(self.critic_init) / "config.json").is_file(),
            "algorithm.ppo.critic_init",
            self.critic_init,
            "must be 'policy' or a directory with a sequence-classification checkpoint (config.json not found there)",
        )


@dataclass
class AlgorithmConfig:
    name: Literal["grpo", "ppo", "rft"] = "grpo"
    """Which trainer: ``grpo`` (group-baseline advantages, KL to the reference in the loss), ``ppo`` (a
    critic and GAE, KL to the reference in the per-token reward; settings under ``algorithm.ppo``) or ``rft``
    (rejection-sampling fine-tuning: the supervised loss on the sampled responses that pass; beta 0)."""
    estimator: str = "grpo"
    """Advantage estimator (registry name in ``cohortrl.algorithms``: grpo, grpo_batch, dr_grpo, rloo,
    reinforce_pp, reinforce_pp_baseline, grpo_process, grpo_combined). GRPO only: PPO's advantages are GAE
    from its critic, and another name under PPO is refused."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_step: int = 4
    """P: prompts per training step (batch = P·G responses)."""
    beta: float = 0.04
    """KL coefficient to the reference model (β = 0 loads no reference model). GRPO: β·KL in the loss;
    PPO: the initial β of −β·KL in the per-token reward (InstructGPT used 0.02)."""
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = None
    """KL estimator (Schulman's k1, k2, k3), one for both trainers (``kl_kind`` resolves null): null is k3 under
    GRPO (unbiased and non-negative, in the loss or, with kl_in_reward, the reward) and k1 under PPO (log π −
    log π_ref in the per-token reward, as Ziegler et al. and InstructGPT). The old ``algorithm.ppo.kl_estimator``
    still loads: under PPO it sets this field (a deprecation warning says so); under GRPO it is ignored."""
    kl_in_reward: bool = False
    """GRPO: put β·KL_t (π_old vs π_ref, ``kl_estimator``; k1 is the usual choice there) into the reward
    instead of the loss, as PPO for RLHF does. Outcome estimators see r − β·Σ_t KL_t per response; token
    estimators (reinforce_pp, REINFORCE++'s own definition) the per-token rewards. PPO always does this."""
    policy_loss: str = "clip"
    """Policy loss (registry name: clip, gspo). gspo needs one advantage per response, so it is refused with
    an estimator whose advantages vary along the response (reinforce_pp, grpo_process, PPO's GAE)."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (DAPO clip-higher uses 0.28)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None disables)."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """How per-token losses become a scalar (GRPO / DAPO / Dr. GRPO)."""
    norm_length: Optional[int] = None
    """Constant normaliser for seq-mean-token-sum-norm (default: sampling.max_new_tokens)."""
    zero_variance: Literal["keep", "filter", "resample"] = "keep"
    """Groups whose correctness is identical for all G responses: keep (only KL acts), filter (dropped from
    the policy loss), resample (draw more prompts until the batch is informative; DAPO dynamic sampling)."""
    max_resample_draws: int = 4
    """With resample: at most this many extra prompt batches per step, then train on what there is."""
    retire_solved: int = 0
    """Take a training prompt out of the stream once this many of its groups were answered right by every
    response (0: never). Such a group's advantages are all zero, so from a warm start that solves much of the
    pool it costs its generation and teaches nothing; retired prompts are kept in checkpoints, and every prompt
    comes back (said once, at WARNING) should all of them be retired. It acts only once the run comes round to
    a prompt again (steps x prompts_per_step above the training prompts; said at WARNING before step 1 if not)."""
    mask_truncated: bool = False
    """Drop responses that hit max_new_tokens from the policy loss (they have no reliable outcome)."""
    epochs: int = 1
    """μ: passes over each rollout batch."""
    minibatches: int = 1
    """Optimiser steps per epoch (the batch is split into this many minibatches)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward (gradient accumulation); 0 = the whole minibatch at once."""
    eps: float = 1e-6
    """ε added to the std in group normalisation."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO settings (used when ``name`` is ``ppo``)."""

    @property
    def kl_kind(self) -> str:
        """The KL estimator in use: ``kl_estimator``, or its default for this trainer (k1 PPO, k3 GRPO)."""
        return self.kl_estimator or ("k1" if self.name == "ppo" else "k3")

    def advantage_needs(self):
        """What this algorithm's advantages need from the run (``cohortrl.algorithms.EstimatorNeeds``): PPO's
        GAE, or what the estimator registered under ``estimator`` declared."""
        from cohortrl.algorithms import GAE_NEEDS, estimator_needs

        return GAE_NEEDS if self.name == "ppo" else estimator_needs(self.estimator)

    def check(self) -> None:
        from cohortrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, needs_sequence_advantages

        a = self
        for path, name, registry in (
            ("algorithm.estimator", a.estimator, ADVANTAGE_ESTIMATORS),
            ("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES),
        ):
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            require(name in registry, path, name, f"unknown name; {hint}registered: {', '.join(registry)}")
        require(a.name != "ppo" or a.estimator == "grpo", "algorithm.estimator", a.estimator,
                "is GRPO's setting; PPO's advantages are GAE from its critic (tune algorithm.ppo.gamma / lam), so remove it")
        needs = a.advantage_needs()
        source = "PPO's GAE" if a.name == "ppo" else f"estimator '{a.estimator}'"
        require(
            not needs_sequence_advantages(a.policy_loss) or needs.per_sequence, "algorithm.policy_loss", a.policy_loss,
            f"needs one advantage per response, but {source} gives advantages that vary along the response (each token "
            "would get the response's mean advantage); use policy_loss: clip, or an outcome estimator (grpo, dr_grpo, rloo)",
        )
        require(a.group_size >= 1, "algorithm.group_size", a.group_size, "must be at least 1")
        require(
            a.group_size >= 2 or not needs.groups,
            "algorithm.group_size",
            a.group_size,
            f"estimator '{a.estimator}' normalises within a group and needs at least 2 responses per prompt; "
            "set algorithm.group_size >= 2 or use algorithm.estimator=reinforce_pp",
        )
        require(a.prompts_per_step >= 1, "algorithm.prompts_per_step", a.prompts_per_step, "must be at least 1")
        require(a.beta >= 0, "algorithm.beta", a.beta, "the KL coefficient must be >= 0 (0 disables the KL term)")
        require(a.name != "rft" or a.beta == 0, "algorithm.beta", a.beta,
                "rejection-sampling fine-tuning (algorithm.name=rft) trains with the supervised loss alone, with no KL "
                "term; set algorithm.beta=0")
        require(not a.kl_in_reward or a.beta > 0, "algorithm.kl_in_reward", a.kl_in_reward,
                "puts beta x KL into the reward, but algorithm.beta is 0; set beta > 0 or kl_in_reward: false")
        require(not a.kl_in_reward or a.name == "grpo", "algorithm.kl_in_reward", a.kl_in_reward,
                "is GRPO's switch; PPO always puts the KL into its per-token reward (set kl_in_reward: false)")
        require(0 <= a.clip_low < 1, "algorithm.clip_low", a.clip_low, "must be in [0, 1) (the ratio is clipped at 1 - clip_low)")
        require(a.clip_high >= 0, "algorithm.clip_high", a.clip_high, "must be >= 0")
        require(
            a.clip_high >= a.clip_low,
            "algorithm.clip_high",
            a.clip_high,
            f"must be >= algorithm.clip_low ({a.clip_low}); clip-higher widens the upper bound, never narrows it",
        )
        require(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", a.dual_clip, "must be > 1 (typically 3) or null")
        require(a.epochs >= 1, "algorithm.epochs", a.epochs, "must be at least 1")
        batch = a.group_size * a.prompts_per_step
        require(
            a.minibatches >= 1 and batch % a.minibatches == 0,
            "algorithm.minibatches",
            a.minibatches,
            f"must divide the batch of prompts_per_step x group_size = {batch} responses",
        )
        require(
            a.minibatches == 1 or (batch // a.minibatches) % a.group_size == 0,
            "algorithm.minibatches",
            a.minibatches,
            f"each minibatch must hold whole groups of {a.group_size}; use a divisor of prompts_per_step ({a.prompts_per_step})",
        )
        require(a.micro_batch_size >= 0, "algorithm.micro_batch_size", a.micro_batch_size, "must be >= 0")
        require(a.max_resample_draws >= 0, "algorithm.max_resample_draws", a.max_resample_draws, "must be >= 0")
        require(a.retire_solved >= 0, "algorithm.retire_solved", a.retire_solved,
                "must be >= 0 (0 keeps every prompt; 1 retires one at its first group answered right by every response)")
        require(a.norm_length is None or a.norm_length > 0, "algorithm.norm_length", a.norm_length, "must be > 0 or null")
        require(a.eps > 0, "algorithm.eps", a.eps, "must be > 0")
        require(
            a.group_size >= 2 or a.zero_variance == "keep",
            "algorithm.zero_variance",
            a.zero_variance,
            "a group of one response always has zero variance, so every group would be dropped; "
            "set algorithm.group_size >= 2 or algorithm.zero_variance=keep",
        )
        a.ppo.check()  # also under GRPO: a wrong value is wrong before anyone switches algorithm.name


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warmup, in optimiser steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup (decays to 0 over the run for linear/cosine)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping (0 disables)."""

    @property
    def decays(self) -> bool:
        """The schedule brings the LR to 0 at train.steps (linear, cosine): steps past it would not train."""
        return self.schedule != "constant"

    def check(self) -> None:
        require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", self.betas,
                "must be two numbers in [0, 1)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        require(self.max_grad_norm >= 0, "optim.max_grad_norm", self.max_grad_norm, "must be >= 0 (0 disables clipping)")


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate every N training steps (0: only before and after training)."""
    n_prompts: int = 200
    """Held-out prompts per evaluation (at most data.eval_size)."""
    pass_k: int = 0
    """Also draw k samples per prompt: sampled accuracy (mean over samples) and pass@k (0 disables)."""
    temperature: float = 1.0
    """Sampling temperature for the k samples (use the training temperature to measure the policy as trained)."""
    batch_size: int = 64
    """Prompts per generation batch during evaluation."""
    max_new_tokens: Optional[int] = None
    """Generation budget for evaluation (default: sampling.max_new_tokens)."""
    before: bool = True
    """Evaluate before the first training step."""
    before_n_prompts: Optional[int] = None
    """That evaluation on only the first N of the held-out prompts (null: all ``n_prompts``): a cheaper measure of
    the start, with a wider interval, where the start is slow to evaluate (a base model that writes to the token
    budget). Later evaluations use all ``n_prompts``."""
    kl_to_reference: bool = False
    """Also measure the policy's KL to the reference (exact over the vocabulary, at ``temperature``) on the first
    of the k samples of each prompt: one measure for every run, whatever KL estimator or β it trained with. Two
    forward passes per sampled response; needs ``pass_k``."""

    def check(self) -> None:
        require(self.every >= 0, "eval.every", self.every, "must be >= 0")
        require(not self.kl_to_reference or self.pass_k > 0, "eval.kl_to_reference", self.kl_to_reference,
                "needs eval.pass_k > 0: the KL is measured on the policy's own samples")
        require(self.n_prompts >= 0, "eval.n_prompts", self.n_prompts, "must be >= 0")
        require(self.before_n_prompts is None or 1 <= self.before_n_prompts <= self.n_prompts, "eval.before_n_prompts",
                self.before_n_prompts, f"must be null or between 1 and eval.n_prompts ({self.n_prompts})")
        require(self.pass_k >= 0, "eval.pass_k", self.pass_k, "must be >= 0")
        require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "must be at least 1")


@dataclass
class TrainConfig:
    steps: int = 20
    """Training steps (one rollout batch and its updates is one step)."""
    seed: int = 0
    """Seed for data order, sampling and model initialisation."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in RUN_DIR/checkpoints/ (the newest; 0 keeps all). Older ones are deleted only once the
    new one is complete, so a failed write never leaves fewer intact checkpoints than before."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the ``tensorboard`` package)."""
    progress: bool = True
    """Show a console progress bar."""
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    cpu_fast_path: Literal["auto", "off"] = "auto"
    """The CPU fast path (``cohortrl/cpu/``): oneDNN linear kernels, a lean decoding step, the on-policy update's
    backward through decoding's forward, freed memory kept between steps. ``auto``: on for a Llama-family
    model with fp32 weights on a CPU (anything else falls back to plain transformers, said once at INFO);
    ``off``: plain transformers, PyTorch's kernels and glibc's defaults throughout. The same function either way,
    to float rounding. The three settings below tune its parts when it is on."""
    cpu_linear: Literal["auto", "onednn", "aten"] = "auto"
    """Kernel for fp32 linear layers on a CPU: ``onednn`` (oneDNN, faster than PyTorch's default MKL on the
    thin products of decoding and training, ``benchmarks/cpu_linear.py``), ``aten`` (PyTorch's default) or
    ``auto`` (oneDNN when this PyTorch build has it). Same function either way, to float rounding
    (``cohortrl/cpu/kernels.py``). Ignored on a GPU."""
    cpu_allocator: Literal["auto", "retain", "system"] = "auto"
    """Freed CPU memory: ``retain`` keeps it mapped in the process for the next step's tensors (glibc's
    ``mallopt``: every block from the heap, no mmap, no heap trimming), so a step does not fault its pages in again;
    ``system`` leaves glibc's defaults; ``auto`` retains on a CPU under glibc. Process-wide while a run holds it:
    peak memory stays about where it was, but it is not returned to the OS until the run closes, which puts
    glibc's defaults back (``cohortrl/cpu/memory.py``)."""
    cpu_heap_trim_every: int = 0
    """Every N steps (0, the default: never), hand the C heap's free pages back to the OS (glibc's ``malloc_trim``).
    Batches of different lengths leave freed blocks the next step's tensors do not fit, so a long run's resident
    memory climbs (an SFT warm start from 4.7-6.3 to 10 GiB over 250 steps, ``docs/performance.md``) whichever
    ``cpu_allocator``; a trim returns them and the climb starts again from the first step's level, at the cost of
    faulting in again what the next step touches. For a long run that would otherwise run out of memory. Part of
    the CPU fast path (refused with ``cpu_fast_path: off``), done by the training loop (``Trainer.train``), not by a
    bare ``step()``; nothing on other C libraries or a GPU."""
    cpu_decode_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """The lean decoder's products (``cpu/decoder.py``) in training rollouts: ``bfloat16`` casts each product's
    input and the laid-out weights (LoRA adapters folded in first, in fp32) to bf16, its output back to fp32,
    faster on a CPU with bf16 units (AVX512-BF16, AMX; ``docs/performance.md`` has the measurements); the residual
    stream, norms, rotary, attention, sampling and the KV cache stay fp32, and so do the model's weights, its
    adapters, the optimiser and the update's own forward. The update sees the sampler's numbers: its replayed
    backward (``reuse_rollout_forward``) differentiates the bf16 forward decoding ran, so π_old is the sampling
    probability; where it runs its own fp32 forward instead, the rollout's bf16 log-probs correct the loss with
    truncated importance weights (``sampling.is_cap``), as for vLLM. With β > 0 the KL term compares that bf16
    policy's log-probs with the fp32 reference's, so it is not 0 at identical weights (its size not measured).
    Evaluation (during training and ``cohortrl eval``) and SFT decode in fp32 whatever this says. Needs the
    fast path's oneDNN kernel and a CPU with bf16 units, checked when the run starts (an error, not a fallback);
    ``auto`` takes bfloat16 where both hold and float32 elsewhere (a GPU, the fast path off, a model the lean
    decoder does not compute, a CPU without bf16 units); where the CPU's units decide, a progress line says which.
    The default stays float32: held-out accuracy under bf16 decoding is measured on one setting only
    (``docs/engineering/bf16_study.md``); ``make demo``'s GRPO, that setting, uses ``auto``."""
    reuse_rollout_forward: bool = True
    """GRPO with one update per rollout (``algorithm.epochs`` 1, one minibatch, one micro-batch), one process,
    the lean decoder (``cpu/decoder.py``) and no dropout: the policy that sampled is the policy being
    differentiated, so the update reuses decoding's forward instead of running its own: log-probabilities from
    decoding's logits, the backward from what decoding recorded (``cpu/replay.py``). The same gradient to
    float rounding, a third fewer FLOPs in the update. Where a condition does not hold, the update runs its own
    forward; ``false``: always."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the ``wandb`` package; project from ``WANDB_PROJECT``, else
    ``cohortrl``)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: ``ddp`` (a full replica of the policy per process, gradients all-reduced) or ``fsdp``
    (FSDP2: parameters, gradients and optimiser state sharded over processes, for models that do not fit one
    device). Ignored in a single process."""
    dist_timeout_s: float = 1800.0
    """Under torchrun: how long a collective waits for the other ranks before the run stops with an error.
    Rank 0 alone evaluates and writes checkpoints while the others wait, which for a large model can pass
    NCCL's own default of 10 minutes; a rank that died is noticed after this long. Ignored in a single process."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    gradient checkpointing on the policy): the update's activation memory falls from one layer's worth per layer
    to about one layer's, for about a third more compute in the update. The same loss and gradients, to float
    rounding."""
    tf32: bool = True
    """On a GPU, float32 matrix products in TF32 (``torch.set_float32_matmul_precision("high")``): several times
    faster on Ampere and later GPUs, with a 10-bit mantissa in the products' inputs (accumulation stays float32).
    Applies where float32 is kept: ``model.dtype: float32`` and the float32 master weights of bfloat16 training.
    Ignored on a CPU."""
    device: str = "auto"
    """Where the models run: ``auto`` (a GPU if PyTorch sees one, under torchrun ``cuda:LOCAL_RANK``),
    ``cpu``, ``cuda`` or ``cuda:N``."""
    max_nonfinite_steps: int = 3
    """An update whose loss or gradient is NaN/inf is skipped (logged as ``skipped_nonfinite``, samples saved
    under RUN_DIR/nonfinite/); this many such steps in a row stop the run (0: never stop)."""
    trace_steps: list[int] = field(default_factory=list)
    """Steps (counted from 1, as ``metrics.jsonl`` counts them) whose computation is recorded token by token in
    RUN_DIR/traces/step_N.pt: prompts, responses, rewards, the group arithmetic, advantages, and per response
    token the log-probs, ratio, clipping, KL, weight and contribution to the loss (``trainers/trace.py``); read
    with ``cohortrl explain RUN_DIR --step N``. Recording copies what the step computed and changes none of its
    numbers; empty (the default): nothing is recorded. Under torchrun rank 0 records its own rows."""

    def check(self) -> None:
        t = self
        require(t.steps >= 0, "train.steps", t.steps, "must be >= 0")
        require(t.checkpoint_every >= 0, "train.checkpoint_every", t.checkpoint_every, "must be >= 0")
        require(t.keep_checkpoints >= 0, "train.keep_checkpoints", t.keep_checkpoints, "must be >= 0 (0 keeps all)")
        require(all(n >= 1 for n in t.trace_steps), "train.trace_steps", t.trace_steps,
                "steps are counted from 1 (the first step is 1, as in metrics.jsonl)")
        require(t.dist_timeout_s > 0, "train.dist_timeout_s", t.dist_timeout_s, "must be > 0 (seconds)")
        require(t.max_nonfinite_steps >= 0, "train.max_nonfinite_steps", t.max_nonfinite_steps,
                "must be >= 0 (0: never stop)")
        require(t.cpu_heap_trim_every >= 0, "train.cpu_heap_trim_every", t.cpu_heap_trim_every, "must be >= 0 (0: never)")
        require(t.cpu_fast_path == "auto" or t.cpu_heap_trim_every == 0, "train.cpu_heap_trim_every",
                t.cpu_heap_trim_every, "is part of the CPU fast path, which train.cpu_fast_path=off turns off; drop one of the two")
        for key in ("cpu_linear", "cpu_allocator", "cpu_decode_dtype"):
            require(t.cpu_fast_path == "auto" or getattr(t, key) in ("auto", "aten", "system", "float32"),
                    f"train.{key}", getattr(t, key), "asks for part of the CPU fast path, which train.cpu_fast_path=off "
                    "turns off; drop one of the two")
        require(t.cpu_decode_dtype != "bfloat16" or t.cpu_linear != "aten", "train.cpu_decode_dtype", t.cpu_decode_dtype,
                "needs the CPU fast path's oneDNN kernel, which train.cpu_linear=aten turns off; drop one of the two")
        require(
            t.device in ("auto", "cpu", "cuda") or (t.device.startswith("cuda:") and t.device[5:].isdigit()),
            "train.device", t.device, "must be auto, cpu, cuda or cuda:N",
        )


@dataclass
class SFTConfig:
    """Supervised fine-tuning (``cohortrl sft``, ``SFTTrainer``): cross-entropy on the completion's tokens.
    The rest comes from the shared sections: the model and LoRA from ``model``, the learning rate, schedule and
    clipping from ``optim``, steps, seed and checkpoints from ``train``, the rows from ``data`` (a gym task's
    reference solutions, or TRL's prompt/completion and conversational formats), held-out evaluation from
    ``eval`` and ``reward.correctness``. Unused by the RL trainers."""

    batch_size: int = 8
    """Examples per forward/backward pass (a micro-batch)."""
    grad_accum: int = 1
    """Micro-batches per optimiser step: one training step sees ``batch_size x grad_accum`` examples, and its
    loss is the mean over all their completion tokens."""
    max_length: int = 1024
    """Longest example in tokens (prompt and completion, after the chat template); a longer row stops the run
    with an error naming it rather than being cut."""

    def check(self) -> None:
        require(self.batch_size >= 1, "sft.batch_size", self.batch_size, "must be at least 1")
        require(self.grad_accum >= 1, "sft.grad_accum", self.grad_accum, "must be at least 1 (1: no gradient accumulation)")
        require(self.max_length >= 2, "sft.max_length", self.max_length,
                "must be at least 2 (a prompt token and a completion token)")
