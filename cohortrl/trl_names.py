"""TRL's ``GRPOConfig`` field names and their cohortrl equivalents (``docs/trl_migration.md`` is the same table for
people).

:data:`TRL_NAMES` maps a TRL field to (the cohortrl config path, how the value carries over). Config-key errors
use it to name our key when a TRL name is written (``num_generations`` -> ``algorithm.group_size``), and
:func:`from_trl_args` turns a dict of TRL fields (a trainer's ``args=``) into config sections.
"""

from __future__ import annotations

from typing import Any

_BATCH = ("TRL counts completions: prompts_per_step = per_device_train_batch_size x gradient_accumulation_steps x "
          "processes / num_generations")

TRL_NAMES: dict[str, tuple[str, str]] = {
    "num_generations": ("algorithm.group_size", ""),
    "learning_rate": ("optim.lr", ""),
    "per_device_train_batch_size": ("algorithm.prompts_per_step", _BATCH),
    "gradient_accumulation_steps": ("algorithm.prompts_per_step", _BATCH),
    "max_completion_length": ("sampling.max_new_tokens", ""),
    "max_prompt_length": ("data.max_prompt_tokens", "a longer prompt is refused, or cut from the left with "
                          "data.overlong_prompts=truncate"),
    "beta": ("algorithm.beta", ""),
    "epsilon": ("algorithm.clip_low", "and algorithm.clip_high, unless epsilon_high is given"),
    "epsilon_high": ("algorithm.clip_high", ""),
    "temperature": ("sampling.temperature", ""),
    "top_p": ("sampling.top_p", ""),
    "top_k": ("sampling.top_k", "None is 0 (off)"),
    "num_iterations": ("algorithm.epochs", ""),
    "max_steps": ("train.steps", ""),
    "num_train_epochs": ("train.steps", "training is counted in steps, not epochs"),
    "seed": ("train.seed", ""),
    "report_to": ("train.tensorboard / train.wandb", "'tensorboard' and 'wandb' set them true, 'none' neither"),
    "lr_scheduler_type": ("optim.schedule", "constant, linear or cosine"),
    "warmup_steps": ("optim.warmup_steps", ""),
    "weight_decay": ("optim.weight_decay", ""),
    "max_grad_norm": ("optim.max_grad_norm", ""),
    "adam_beta1": ("optim.betas", "the first of the two"),
    "adam_beta2": ("optim.betas", "the second of the two"),
    "save_steps": ("train.checkpoint_every", ""),
    "eval_steps": ("eval.every", ""),
    "per_device_eval_batch_size": ("eval.batch_size", "prompts per generation batch"),
    "use_vllm": ("sampling.backend", "true is vllm"),
    "vllm_gpu_memory_utilization": ("sampling.vllm_gpu_memory_utilization", ""),
    "mask_truncated_completions": ("algorithm.mask_truncated", ""),
    "loss_type": ("algorithm.aggregation", "grpo is seq-mean-token-mean, bnpo and dapo are token-mean, dr_grpo is "
                  "seq-mean-token-sum-norm"),
    "scale_rewards": ("algorithm.estimator", "group (true) is grpo, batch is grpo_batch, none (false) is dr_grpo"),
    "importance_sampling_level": ("algorithm.policy_loss", "token is clip, sequence is gspo"),
    "bf16": ("model.dtype", "true is bfloat16"),
    "gradient_checkpointing": ("train.activation_checkpointing", ""),
    "reward_weights": ("reward.functions", "each function's weight; or reward_weights= on the trainer"),
    "output_dir": ("run_dir", "the trainer's run_dir= argument, --run-dir on the command line"),
}

# Fields whose value carries over unchanged (top_k's None aside).
_DIRECT = {
    "num_generations", "learning_rate", "max_completion_length", "max_prompt_length", "beta", "epsilon", "epsilon_high",
    "temperature", "top_p", "top_k", "num_iterations", "max_steps", "seed", "warmup_steps", "weight_decay",
    "max_grad_norm", "save_steps", "eval_steps", "per_device_eval_batch_size", "vllm_gpu_memory_utilization",
    "mask_truncated_completions", "gradient_checkpointing",
}
_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
_SCALE_REWARDS = {"group": "grpo", True: "grpo", "batch": "grpo_batch", "none": "dr_grpo", False: "dr_grpo"}
_IS_LEVELS = {"token": "clip", "sequence": "gspo"}
_REPORTERS = {"tensorboard", "wandb", "none"}


class TRLArgsError(ValueError):
    """A TRL field that has no cohortrl equivalent, or a value that does not carry over."""


def _pick(table: dict, key: str, value: Any) -> Any:
    if value not in table:
        raise TRLArgsError(f"TRL's {key}={value!r} has no cohortrl equivalent; use one of {sorted(map(str, table))}")
    return table[value]


def from_trl_args(args: dict[str, Any], group_size: int) -> dict[str, dict[str, Any]]:
    """Config sections (``{"algorithm": {"group_size": 8}, ...}``) for a dict of TRL ``GRPOConfig`` fields.
    ``group_size`` is the config's own, used when ``args`` has no ``num_generations``. Fields without an
    equivalent, and ``output_dir`` / ``reward_weights`` (trainer arguments here), raise :class:`TRLArgsError`."""
    unknown = sorted(k for k in args if k not in TRL_NAMES or k in ("output_dir", "reward_weights", "num_train_epochs"))
    if unknown:
        raise TRLArgsError(
            f"TRL field(s) {unknown} have no cohortrl config equivalent (output_dir is run_dir=, reward_weights is "
            "reward_weights=, epochs are counted as max_steps; the rest: docs/trl_migration.md)"
        )
    out: dict[str, dict[str, Any]] = {}

    def put(path: str, value: Any) -> None:
        section, key = path.split(".")
        out.setdefault(section, {})[key] = value

    for key, value in args.items():
        if key in _DIRECT:
            put(TRL_NAMES[key][0], 0 if key == "top_k" and value is None else value)
    if "epsilon" in args and "epsilon_high" not in args:
        put("algorithm.clip_high", args["epsilon"])
    if "per_device_train_batch_size" in args or "gradient_accumulation_steps" in args:
        G = args.get("num_generations", group_size)
        completions = args.get("per_device_train_batch_size", 8) * args.get("gradient_accumulation_steps", 1)
        if completions % G:
            raise TRLArgsError(
                f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions is not a multiple of "
                f"num_generations = {G}; {_BATCH}"
            )
        put("algorithm.prompts_per_step", completions // G)
    if "report_to" in args:
        reporters = [args["report_to"]] if isinstance(args["report_to"], str) else list(args["report_to"] or [])
        for r in reporters:
            _pick({x: x for x in _REPORTERS}, "report_to", r)
        put("train.tensorboard", "tensorboard" in reporters)
        put("train.wandb", "wandb" in reporters)
    if "lr_scheduler_type" in args:
        put("optim.schedule", _pick({s: s for s in ("constant", "linear", "cosine")}, "lr_scheduler_type", args["lr_scheduler_type"]))
    if "adam_beta1" in args or "adam_beta2" in args:
        put("optim.betas", [args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)])
    if "use_vllm" in args:
        put("sampling.backend", "vllm" if args["use_vllm"] else "hf")
    if "loss_type" in args:
        put("algorithm.aggregation", _pick(_LOSS_TYPES, "loss_type", args["loss_type"]))
    if "scale_rewards" in args:
        put("algorithm.estimator", _pick(_SCALE_REWARDS, "scale_rewards", args["scale_rewards"]))
    if "importance_sampling_level" in args:
        put("algorithm.policy_loss", _pick(_IS_LEVELS, "importance_sampling_level", args["importance_sampling_level"]))
    if "bf16" in args:
        put("model.dtype", "bfloat16" if args["bf16"] else "float32")
    return out
