"""TRL's ``GRPOConfig`` and ``SFTConfig`` by their own names, so that a TRL script runs with only its
import changed (``from cohortrl import GRPOConfig, GRPOTrainer``).

Each class takes TRL's field names with TRL's defaults (TRL main of 2026-07: ``learning_rate=1e-6``,
``num_generations=8``, ``beta=0.0``, ``loss_type="dapo"``, ``num_train_epochs=3``, ...), so the same script
asks for the same run. :meth:`TRLConfig.sections` turns it into cohortrl config sections through
:data:`cohortrl.trl_names.TRL_NAMES` (the one table of what maps to what). A field that has no meaning here
(``logging_steps``: every step is logged already) is accepted and, when set, named in one line at WARNING with
the reason; a name TRL does not have, or that cohortrl does not know, is refused as a dataclass would refuse
it. ``docs/trl_migration.md`` lists every field and every remaining difference.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cohortrl.trl_names import TRLArgsError, from_trl_args

log = logging.getLogger("cohortrl")

# Fields of TRL's configs (and of transformers' TrainingArguments under them) accepted without an effect here,
# each with why; named in one line when a script sets one.
NO_EFFECT = {
    "logging_steps": "every step is logged to RUN_DIR/metrics.jsonl (and TensorBoard / W&B when on)",
    "logging_strategy": "every step is logged to RUN_DIR/metrics.jsonl",
    "logging_first_step": "every step is logged to RUN_DIR/metrics.jsonl",
    "logging_dir": "logs go to the run directory (output_dir): RUN_DIR/metrics.jsonl, RUN_DIR/tensorboard",
    "log_completions": "each held-out evaluation's responses are kept in RUN_DIR/eval_completions.jsonl",
    "num_completions_to_print": "nothing is printed per step; responses are in RUN_DIR/eval_completions.jsonl",
    "save_strategy": "checkpoints are written every save_steps steps and at the last",
    "eval_strategy": "held-out evaluation runs every eval_steps steps and at the last, when there are held-out rows",
    "gradient_checkpointing": "activations are kept (no recomputation)",
    "push_to_hub": "nothing is uploaded; the model is saved in output_dir/final",
    "hub_model_id": "nothing is uploaded",
    "run_name": "the run is named by its directory (output_dir)",
    "remove_unused_columns": "every dataset column reaches the reward functions, as TRL's GRPO default",
    "dataloader_num_workers": "rows are read in the training process",
    "shuffle_dataset": "training rows are always shuffled, each epoch by train.seed",
    "disable_dropout": "the models have their configs' dropout (none for the usual instruct models)",
    "use_liger_kernel": "the CPU fast path (train.cpu_linear) is cohortrl's own",
    "overwrite_output_dir": "a directory holding a run is refused; pass overwrite=True to the trainer",
    "resume_from_checkpoint": "resume with the trainer's resume=True (cohortrl train --resume)",
    "dataset_text_field": "rows are prompt/completion or messages (TRL's formats), or a gym task",
    "packing": "each example is its own sequence (no packing)",
}


class TRLConfig:
    """Fields and defaults of one TRL config class (``FIELDS``, each mapped through ``trl_names``) plus the fields
    accepted without an effect (``NO_EFFECT``); values are attributes, as on TRL's dataclasses."""

    FIELDS: dict[str, Any] = {}
    trainer = ""

    def __init__(self, output_dir: str | None = None, **fields):
        known = {*self.FIELDS, *NO_EFFECT}
        unknown = sorted(k for k in fields if k not in known)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got field(s) {unknown} that cohortrl does not know (a typo, or a TRL field "
                "with no equivalent here: docs/trl_migration.md lists them)"
            )
        self.output_dir = output_dir
        self.given = set(fields)  # what the script set, as opposed to TRL's defaults
        for name, default in self.FIELDS.items():
            setattr(self, name, fields.get(name, default))
        for name in NO_EFFECT:
            setattr(self, name, fields.get(name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(output_dir={self.output_dir!r}, {', '.join(f'{k}={getattr(self, k)!r}' for k in sorted(self.given))})"

    def notes(self) -> list[str]:
        """One line for each field the script set that has no effect here."""
        return [f"{type(self).__name__}: {name}={getattr(self, name)!r} has no effect in cohortrl: {NO_EFFECT[name]}"
                for name in sorted(self.given & set(NO_EFFECT))]

    def sections(self, data: dict, n_rows: int | None) -> dict[str, dict[str, Any]]:
        """Config sections for these fields over ``data`` (a config's ``to_dict()``); ``n_rows``: the training rows
        given in Python, which turn ``num_train_epochs`` into steps (None: rows read from a file or a task)."""
        raise NotImplementedError

    def _steps(self, n_rows: int | None, prompts_per_step: int) -> int:
        """``max_steps`` if set (> 0), else ``num_train_epochs`` passes over the rows, as TRL counts them."""
        if self.max_steps > 0:
            return self.max_steps
        if n_rows is None:
            raise TRLArgsError(
                f"num_train_epochs={self.num_train_epochs} needs the number of training rows, which a file or task "
                "source gives only when read; set max_steps (cohortrl counts training in steps)"
            )
        return max(1, math.ceil(self.num_train_epochs * n_rows / prompts_per_step))


def _merge(out: dict, sections: dict) -> dict:
    for section, values in sections.items():
        out.setdefault(section, {}).update(values)
    return out


class GRPOConfig(TRLConfig):
    """TRL's ``GRPOConfig``: its field names and defaults (``output_dir`` is the run directory)."""

    trainer = "GRPO"
    FIELDS = {
        "learning_rate": 1e-6, "num_generations": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        "max_completion_length": 512, "max_prompt_length": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "num_iterations": 1, "loss_type": "dapo",
        "scale_rewards": "group", "importance_sampling_level": "token", "mask_truncated_completions": False,
        "max_steps": -1, "num_train_epochs": 3.0, "seed": 42, "lr_scheduler_type": "linear", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "save_steps": 500,
        "save_total_limit": None, "eval_steps": None, "per_device_eval_batch_size": 8, "report_to": "none",
        "use_vllm": False, "vllm_gpu_memory_utilization": 0.3, "bf16": None, "reward_weights": None,
        "disable_tqdm": False,
    }
    # Fields set only when not None (None: TRL derives them, or leaves the setting alone).
    _OPTIONAL = {"max_prompt_length", "epsilon_high", "eval_steps", "bf16", "save_total_limit"}
    _OWN = {"max_steps", "num_train_epochs", "reward_weights", "save_total_limit", "disable_tqdm"}

    def sections(self, data: dict, n_rows: int | None) -> dict[str, dict[str, Any]]:
        trl = {k: getattr(self, k) for k in self.FIELDS
               if k not in self._OWN and not (k in self._OPTIONAL and getattr(self, k) is None)}
        out = from_trl_args(trl, data["algorithm"]["group_size"])
        prompts = out.get("algorithm", {}).get("prompts_per_step", data["algorithm"]["prompts_per_step"])
        return _merge(out, _common(self, n_rows, prompts))


class SFTConfig(TRLConfig):
    """TRL's ``SFTConfig``: its field names and defaults (``output_dir`` is the run directory)."""

    trainer = "SFT"
    FIELDS = {
        "learning_rate": 2e-5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_length": 1024,
        "max_steps": -1, "num_train_epochs": 3.0, "seed": 42, "lr_scheduler_type": "linear", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "save_steps": 500,
        "save_total_limit": None, "eval_steps": None, "report_to": "none", "bf16": None, "disable_tqdm": False,
        "completion_only_loss": None, "assistant_only_loss": False,
    }

    def sections(self, data: dict, n_rows: int | None) -> dict[str, dict[str, Any]]:
        if self.completion_only_loss is False:
            raise TRLArgsError("completion_only_loss=False (loss on the prompt too) has no equivalent: cohortrl's SFT "
                               "trains on the completion's (assistant turns') tokens only")
        shared = {k: getattr(self, k) for k in ("learning_rate", "seed", "lr_scheduler_type", "warmup_steps",
                                                "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "save_steps",
                                                "report_to")}
        if self.eval_steps is not None:
            shared["eval_steps"] = self.eval_steps
        if self.bf16 is not None:
            shared["bf16"] = self.bf16
        out = from_trl_args(shared, data["algorithm"]["group_size"])
        out["sft"] = {"batch_size": self.per_device_train_batch_size, "grad_accum": self.gradient_accumulation_steps,
                      "max_length": self.max_length}
        return _merge(out, _common(self, n_rows, self.per_device_train_batch_size * self.gradient_accumulation_steps))


def _common(cfg: TRLConfig, n_rows: int | None, prompts_per_step: int) -> dict[str, dict[str, Any]]:
    """The sections every trainer shares: steps from max_steps or epochs, checkpoints kept, the progress bar."""
    train: dict[str, Any] = {"steps": cfg._steps(n_rows, prompts_per_step), "progress": not cfg.disable_tqdm}
    if cfg.save_total_limit is not None:
        train["keep_checkpoints"] = cfg.save_total_limit
    return {"train": train}
