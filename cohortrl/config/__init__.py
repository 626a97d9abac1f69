"""Typed run configuration: dataclasses, YAML files, ``a.b=value`` overrides, validation before any model loads.

Each field is documented once, in the docstring under it. A YAML file is a serialised :class:`Config`; the
command line and the Python API build the same object, so both go through the same checks:

* an unknown key fails with its full path and the closest valid key;
* a wrong type fails with the path, the value and the expected type;
* an impossible setting (``group_size=1`` with group normalisation, ``clip_high < clip_low`` ...) fails with
  the path, the value and what to do instead.

The sections and their own checks are in ``sections.py``; this file holds :class:`Config`, the checks that read
two sections (:func:`validate`) and the typed building from YAML, mappings and overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cohortrl.config.sections import (
    AlgorithmConfig, ConfigError, DataConfig, EvalConfig, LoraConfig, ModelConfig, OptimConfig, PPOConfig,
    ProcessRewardConfig, RewardConfig, RewardFunctionConfig, RolloutConfig, SamplingConfig, SFTConfig, TrainConfig,
    require,
)
from cohortrl.trl_names import TRL_NAMES

__all__ = [
    "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "LoraConfig", "ModelConfig", "OptimConfig",
    "PPOConfig", "ProcessRewardConfig", "RewardConfig", "RewardFunctionConfig", "RolloutConfig", "SamplingConfig",
    "SFTConfig", "TrainConfig", "apply_overrides", "validate",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts for training and evaluation."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout generation."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Tool calls inside rollouts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, loss and update schedule."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop length, seed, checkpoints, logging."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (``cohortrl sft``)."""
    imports: list[str] = field(default_factory=list)
    """Modules (``package.module``) or files (``path/to/file.py``) imported before the config is checked, so
    the estimators, losses, reward functions and tasks they register can be named in it."""

    # ---------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        """``Config(algorithm={"group_size": 4})`` or ``Config(algorithm=AlgorithmConfig(group_size=4))``: each
        section, given as a mapping or as its dataclass, goes through the same type checks and validation as a
        YAML file, with the same errors."""
        from cohortrl.user_code import import_plugin

        self.imports = _convert(list[str], self.imports, "imports")
        for ref in self.imports:
            import_plugin(ref)
        hints = typing.get_type_hints(Config)
        for f in dataclasses.fields(self):
            tp, value = hints[f.name], getattr(self, f.name)
            if not dataclasses.is_dataclass(tp):
                continue
            if isinstance(value, tp):
                value = dataclasses.asdict(value)
            setattr(self, f.name, _convert(tp, value, f.name))
        validate(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        return _build(cls, data, "")

    def with_overrides(self, *overrides: str) -> "Config":
        """A copy with ``a.b=value`` overrides applied: ``cfg.with_overrides("algorithm.group_size=4")``."""
        return Config.from_dict(apply_overrides(self.to_dict(), list(overrides)))

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] = ()) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path} (give the path of a YAML file, e.g. configs/tiny_grpo.yaml)")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.constructor.ConstructorError as e:
            # safe_load builds plain data only; a `!!python/...` tag would construct (and run) Python objects.
            raise ConfigError(
                f"config file {path} uses a YAML tag that safe loading refuses ({e.problem}); config files hold plain "
                "data only (mappings, lists, strings, numbers): remove the tag"
            ) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
        return cls.from_dict(apply_overrides(data, overrides))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -------------------------------------------------------------------- overrides
def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (value parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. algorithm.group_size=4)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data


# -------------------------------------------------------------------- typed building
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


_YAML11_EXPONENT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def _fail_type(path: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"config key '{path}': expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _fail_type(path, value, tp)
        return _build(tp, value, path + ".")
    if origin is Literal:
        if isinstance(value, bool) and ("off" if not value else "on") in typing.get_args(tp):
            value = "on" if value else "off"  # YAML 1.1 (PyYAML) reads a bare off / on as false / true
        if value not in typing.get_args(tp):
            raise _fail_type(path, value, tp)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError:
                pass
        raise _fail_type(path, value, tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _fail_type(path, value, tp)
        (item_tp,) = typing.get_args(tp)
        return [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail_type(path, value, tp)
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail_type(path, value, tp)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail_type(path, value, tp)
        return value
    if tp is float:
        # YAML 1.1 (PyYAML) reads 1e-4 as a string: it wants a dot (1.0e-4). Take the number the user meant.
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail_type(path, value, tp)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail_type(path, value, tp)
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {path}")  # a bug in this file, not user input


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(_all_paths(tp, prefix + f.name + "."))
    return out


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if cls is AlgorithmConfig:
        data = _moved_kl_estimator(data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            path = prefix + str(key)
            close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
            if key in TRL_NAMES:  # a TRL GRPOConfig name: say ours (and how the value carries over)
                ours, how = TRL_NAMES[key]
                raise ConfigError(f"unknown config key '{path}': '{key}' is TRL's name; cohortrl's is '{ours}'"
                                  + (f" ({how})" if how else "") + "; see docs/trl_migration.md")
            if close:
                hint = f"; did you mean '{prefix + close[0]}'?"
            else:  # maybe a key put in the wrong section
                elsewhere = difflib.get_close_matches(path, _all_paths(Config), n=1, cutoff=0.6)
                hint = f"; did you mean '{elsewhere[0]}'?" if elsewhere else f"; valid keys here: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown config key '{path}'{hint}")
    kwargs = {name: _convert(hints[name], value, prefix + name) for name, value in data.items()}
    return cls(**kwargs)


def _moved_kl_estimator(data: dict[str, Any]) -> dict[str, Any]:
    """``algorithm.ppo.kl_estimator`` (before there was one ``algorithm.kl_estimator``) still loads, so old
    YAML files and saved run configs resume unchanged: under PPO it is the estimator PPO used, so it sets
    ``algorithm.kl_estimator``; under GRPO it was unused and is dropped."""
    ppo = data.get("ppo")
    if not isinstance(ppo, dict) or "kl_estimator" not in ppo:
        return data
    data, ppo = dict(data), dict(ppo)
    old = ppo.pop("kl_estimator")
    data["ppo"] = ppo
    if data.get("name") == "ppo":
        data["kl_estimator"] = old
    import logging

    logging.getLogger(__name__).warning(
        "config key 'algorithm.ppo.kl_estimator' is deprecated: write algorithm.kl_estimator (one field for both "
        "trainers)%s", f"; read as algorithm.kl_estimator = {old!r}" if data.get("name") == "ppo" else "; unused by GRPO, ignored")
    return data


# -------------------------------------------------------------------- validation
def validate(cfg: Config) -> None:
    """Check settings that are impossible on their own or together: each section's own checks (``check`` beside
    its fields, ``sections.py``), then those that read two sections. Raises :class:`ConfigError`."""
    a = cfg.algorithm
    a.check()
    cfg.sampling.check()
    cfg.optim.check()
    cfg.data.check()
    cfg.eval.check()
    cfg.train.check()
    needs, proc = a.advantage_needs(), cfg.reward.process
    require(
        proc is not None or not needs.steps,
        "algorithm.estimator", a.estimator, "uses step rewards: set reward.process (e.g. {name: task_steps})",
    )
    from cohortrl.algorithms import ADVANTAGE_ESTIMATORS

    require(
        proc is None or a.name == "ppo" or needs.steps,
        "reward.process", proc and proc.name,
        f"step rewards would be ignored by estimator '{a.estimator}'; use one that reads them "
        f"({', '.join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs.steps)})",
    )
    require(a.name != "ppo" or a.ppo.critic_warmup_ev is None or cfg.optim.schedule == "constant", "optim.schedule",
            cfg.optim.schedule, "must be constant with algorithm.ppo.critic_warmup_ev: the warm-up's length, and so "
            "the policy's number of updates, is known only as the run goes")
    cfg.reward.check()
    cfg.rollout.check(cfg.sampling)
    cfg.model.check()
    cfg.sft.check()
    s, longest = cfg.sampling, cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens
    require(s.backend != "vllm" or s.vllm_max_model_len >= longest, "sampling.vllm_max_model_len", s.vllm_max_model_len,
            f"shorter than data.max_prompt_tokens + sampling.max_new_tokens ({longest}), the longest sequence a rollout "
            f"makes; raise it to {longest} or more")
