"""What a trainer is given, in Python or from a file, turned into one ``Config`` plus the in-memory objects a
config file cannot hold (a loaded model, reward callables, rows).

The Python API and ``cohortrl train CONFIG`` are one machinery: every Python argument is first written into the
config (``model.name``, ``reward.functions``, ``data.source``), so ``RUN_DIR/config.yaml`` records the run,
and the trainer then reads only the config and, where a name cannot be loaded from a file, the object
handed to it here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cohortrl.config import Config, ConfigError, RewardFunctionConfig
from cohortrl.trl_config import TRLConfig
from cohortrl.trl_names import TRLArgsError, from_trl_args
from cohortrl.user_code import callable_ref, check_reward_signature

log = logging.getLogger("cohortrl")


@dataclass
class RunInputs:
    config: Config
    model: Any = None  # a loaded model, or None: load config.model.name
    tokenizer: Any = None
    reward_fns: dict[str, Callable] = field(default_factory=dict)  # config reward name -> callable given in Python
    tools: dict[str, Callable] = field(default_factory=dict)  # rollout.tools entry -> tool function given in Python
    train_rows: list[dict] | None = None  # rows given in Python (data.source = python:...)
    eval_rows: list[dict] | None = None
    run_dir: str | Path | None = None  # as given, or a TRL config's output_dir


def as_config(config: Config | dict | str | Path | None) -> Config:
    """A ``Config`` from a ``Config``, a mapping of sections, a YAML path, or None (all defaults)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return Config.from_dict(config.to_dict())  # a copy: the trainer fills it in without touching the caller's
    if isinstance(config, dict):
        return Config.from_dict(config)
    if isinstance(config, (str, Path)):
        return Config.from_yaml(config)
    raise ConfigError(f"config must be a cohortrl.Config, a dict of sections or a YAML path, got {type(config).__name__}")


def is_model_argument(value) -> bool:
    """Whether a trainer's first positional argument is TRL's ``model`` (a hub id, a model directory, an alias, a
    ``.gguf`` file or a loaded model) rather than cohortrl's ``config`` (a ``Config``, a dict of sections, a YAML
    path or None)."""
    if value is None or isinstance(value, (Config, dict)):
        return False
    if isinstance(value, (str, Path)):
        path = Path(value)
        return not (path.suffix in (".yaml", ".yml") or (path.is_file() and path.suffix != ".gguf"))
    return True


def from_trl_order(config, run_dir, model, second, second_name: str):
    """``(config, run_dir, model, second)`` for a trainer called in TRL's order, ``GRPOTrainer(model, reward_funcs,
    ...)`` or ``SFTTrainer(model, args, ...)`` (``second_name``), rather than cohortrl's ``(config, run_dir, ...)``:
    told apart by the arguments' types (a run directory is a path, a model is not a config); unchanged otherwise."""
    if is_model_argument(config):
        if model is not None:
            raise ConfigError(f"model given twice: as the first argument ({config!r}) and as model=; keep one")
        model, config = config, None
    if run_dir is not None and not isinstance(run_dir, (str, Path)):
        if second is not None:
            raise ConfigError(f"{second_name} given twice: as the second argument and as {second_name}=; keep one")
        second, run_dir = run_dir, None
    return config, run_dir, model, second


def resolve_inputs(
    config, algorithm: str, *, model=None, tokenizer=None, reward_funcs=None, reward_weights=None,
    train_dataset=None, eval_dataset=None, tools=None, args=None, peft_config=None, run_dir=None,
) -> RunInputs:
    cfg = as_config(config)
    data = cfg.to_dict()
    inputs = RunInputs(cfg, run_dir=run_dir)
    trl_config = args if isinstance(args, TRLConfig) else None  # applied once the rows are known (epochs -> steps)
    if trl_config is not None:
        inputs.run_dir = _output_dir(trl_config, run_dir)
        if getattr(trl_config, "reward_weights", None) is not None:  # GRPOConfig's; SFTConfig has none
            reward_weights = _once(trl_config.reward_weights, reward_weights)
    elif args is not None:  # TRL's GRPOConfig field names, over the config's own values
        reward_weights = _apply_trl_args(args, data, reward_weights)
    if peft_config is not None:
        data["model"]["lora"] = _lora_section(peft_config)

    if cfg.algorithm.name != algorithm:
        if cfg.algorithm.name != "grpo":  # "grpo" is the default: only an explicit other choice conflicts
            raise ConfigError(
                f"config key 'algorithm.name' = {cfg.algorithm.name!r} but this is the {algorithm.upper()} trainer; "
                "use the matching trainer class, or cohortrl.make_trainer(config, ...) to pick it from the config"
            )
        data["algorithm"]["name"] = algorithm

    if isinstance(model, (str, Path)):
        data["model"]["name"] = str(model)
    elif model is not None:
        if tokenizer is None:
            raise ConfigError("model= is a loaded model: pass its tokenizer= too")
        inputs.model, inputs.tokenizer = model, tokenizer
        name = getattr(getattr(model, "config", None), "_name_or_path", "")
        if name:  # what config.yaml records; a model built in memory keeps the config's name
            data["model"]["name"] = name

    if reward_funcs is not None:
        functions = _reward_entries(reward_funcs, reward_weights, inputs.reward_fns)
        data["reward"]["functions"] = [dataclasses.asdict(RewardFunctionConfig(n, w, k)) for n, w, k in functions]
        names = [n for n, _, _ in functions]
        if data["reward"]["correctness"] not in names:
            # TRL has no notion of "the correctness function": the first one given plays that part.
            data["reward"]["correctness"] = names[0]
    elif reward_weights is not None:
        raise ConfigError("reward_weights= needs reward_funcs= (one weight per function)")

    if tools is not None:  # replaces rollout.tools, as reward_funcs= replaces reward.functions
        data["rollout"]["tools"] = _tool_entries(tools, inputs.tools)

    if train_dataset is not None:
        source, rows = _source(train_dataset, "train_dataset")
        data["data"]["source"] = source
        inputs.train_rows = rows
    if eval_dataset is not None:
        source, rows = _source(eval_dataset, "eval_dataset")
        if rows is None:
            raise ConfigError("eval_dataset= must be rows (a list of dicts or a datasets.Dataset); "
                              "a file or task source holds out its own evaluation prompts (data.eval_size)")
        inputs.eval_rows = rows

    if trl_config is not None:
        try:
            _sections(data, trl_config.sections(data, len(inputs.train_rows) if inputs.train_rows is not None else None))
        except TRLArgsError as e:
            raise ConfigError(f"args=: {e}") from None
        for note in trl_config.notes():
            log.warning(note)

    inputs.config = Config.from_dict(data)
    check_optional_packages(inputs.config)
    return inputs


def _output_dir(trl_config: TRLConfig, run_dir):
    """The run directory: ``run_dir=`` or the TRL config's ``output_dir`` (the same thing by TRL's name)."""
    if run_dir is not None and trl_config.output_dir is not None and Path(run_dir) != Path(trl_config.output_dir):
        raise ConfigError(f"two run directories: run_dir={str(run_dir)!r} and args.output_dir={trl_config.output_dir!r}; "
                          "give one")
    return run_dir if run_dir is not None else trl_config.output_dir


def _once(in_args, given):
    if given is not None:
        raise ConfigError("reward weights given twice: in args= (reward_weights) and as reward_weights=; keep one")
    return in_args


def _sections(data: dict, sections: dict) -> None:
    for section, values in sections.items():
        data[section].update(values)


def check_optional_packages(cfg: Config) -> None:
    """Settings that need a package that is not installed: refused now, before any model loads."""
    needs = [
        (cfg.sampling.backend == "vllm", "sampling.backend", "'vllm'", "vllm", "pip install vllm (Linux with a CUDA GPU); or sampling.backend=hf"),
        (cfg.train.tensorboard, "train.tensorboard", "true", "tensorboard", "pip install tensorboard; or train.tensorboard=false"),
        (cfg.train.wandb, "train.wandb", "true", "wandb", "pip install wandb; or train.wandb=false"),
    ]
    for wanted, key, value, package, fix in needs:
        if wanted and not _installed(package):
            raise ConfigError(f"config key '{key}' = {value} needs the {package} package, which is not installed: {fix}")


def _installed(package: str) -> bool:
    # A module already imported counts as it is: find_spec raises ValueError on one without a __spec__ (a module
    # built in code, as a test's stand-in is), and None in sys.modules means "import it and fail".
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def _apply_trl_args(args, data: dict, reward_weights):
    """Write ``args`` (a dict of the TRL ``GRPOConfig`` fields a script set) into the config sections ``data``; returns the
    reward weights (TRL keeps them in its config, here they are a trainer argument)."""
    if not isinstance(args, dict):
        raise ConfigError(
            f"args= must be cohortrl's GRPOConfig or SFTConfig (TRL's fields and defaults: from cohortrl import "
            f"GRPOConfig) or a dict of TRL field names (e.g. {{'num_generations': 8}}), got {type(args).__name__}"
        )
    args = dict(args)
    weights = args.pop("reward_weights", None)
    if weights is not None:
        reward_weights = _once(weights, reward_weights)
    try:
        sections = from_trl_args(args, data["algorithm"]["group_size"])
    except TRLArgsError as e:
        raise ConfigError(f"args=: {e}") from None
    _sections(data, sections)
    return reward_weights


def _lora_section(peft_config) -> dict:
    """``model.lora`` for a PEFT ``LoraConfig`` (TRL's ``peft_config=``); settings with no equivalent are refused."""
    get = peft_config.get if isinstance(peft_config, dict) else lambda k, d=None: getattr(peft_config, k, d)
    unsupported = {"bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
                   "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    odd = [k for k, default in unsupported.items() if get(k, default) not in (default, None, {}, [])]
    if odd:
        raise ConfigError(f"peft_config= sets {odd}, which cohortrl's LoRA (model.lora) does not support; leave them at "
                          "their defaults")
    targets = get("target_modules")
    lora = {"enabled": True, "r": get("r", 8), "alpha": get("lora_alpha", 8), "dropout": get("lora_dropout", 0.0)}
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"peft_config= target_modules={targets!r}: give a list of module names (or 'all-linear')")
    if targets and targets != "all-linear":  # None and 'all-linear' keep model.lora's default: every projection
        lora["target_modules"] = sorted(targets)
    return lora


def _reward_entries(reward_funcs, reward_weights, in_memory: dict[str, Callable]):
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ConfigError("reward_funcs= is empty: give at least one reward function")
    weights = [1.0] * len(funcs) if reward_weights is None else list(reward_weights)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights= has {len(weights)} weights for {len(funcs)} reward functions")
    out = []
    for fn, weight in zip(funcs, weights):
        if isinstance(fn, str):
            out.append((fn, float(weight), {}))
            continue
        if not callable(fn):
            raise ConfigError(f"reward_funcs= entries must be functions or names, got {type(fn).__name__}")
        ref = callable_ref(fn)
        name = ref or getattr(fn, "__name__", type(fn).__name__)
        check_reward_signature(fn, name, ConfigError)
        if name in in_memory:
            raise ConfigError(f"two reward functions are both called {name!r}; give them distinct names")
        in_memory[name] = fn
        out.append((name, float(weight), {}))
    return out


def _tool_entries(tools, in_memory: dict[str, Callable]) -> list[str]:
    """``rollout.tools`` entries for ``tools=``: names as given; a function by its importable reference
    (``module:function``, so a resumed run from the config alone finds it) or else its name, kept in memory."""
    entries = []
    for tool in tools if isinstance(tools, (list, tuple)) else [tools]:
        if isinstance(tool, str):
            entries.append(tool)
            continue
        if not callable(tool):
            raise ConfigError(f"tools= entries must be functions or tool names, got {type(tool).__name__}")
        name = callable_ref(tool) or getattr(tool, "__name__", type(tool).__name__)
        if name in in_memory:
            raise ConfigError(f"two tools are both called {name!r}; give them distinct names")
        in_memory[name] = tool
        entries.append(name)
    return entries


def _source(dataset, what: str) -> tuple[str, list[dict] | None]:
    """(data.source, in-memory rows or None) for a dataset given in Python."""
    from cohortrl import tasks

    if isinstance(dataset, Path):
        dataset = str(dataset)
    if isinstance(dataset, str):
        if dataset.split(":", 1)[0] in ("task", "jsonl", "hf", "python") and ":" in dataset:
            return dataset, None
        if dataset.endswith(".jsonl"):
            return f"jsonl:{dataset}", None
        if dataset in tasks.names():
            return f"task:{dataset}", None
        raise ConfigError(
            f"{what}={dataset!r} is neither a .jsonl path, a gym task ({', '.join(tasks.names())}) nor a "
            "task:/jsonl:/hf: source"
        )
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # a datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise ConfigError(f"{what}= must be a list of dicts, a datasets.Dataset, a .jsonl path or a task name, got {type(dataset).__name__}")
    for i, row in enumerate(rows):
        if isinstance(row, str):  # a bare list of prompts
            rows[i] = {"prompt": row}
        elif not isinstance(row, dict):
            raise ConfigError(f"{what} row {i} is a {type(row).__name__}; rows must be dicts (or prompt strings)")
    return f"python:{what}", rows
