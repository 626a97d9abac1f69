"""The ``cohortrl`` command line: train, sft, sweep, explain, verify, eval, train-rm, models, tasks, plot, report, plan, demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from cohortrl.config import Config, ConfigError

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _load_config(path: str, overrides: list[str]) -> Config:
    return Config.from_yaml(path, overrides)


def cmd_train(args) -> int:
    from cohortrl.trainers import make_trainer
    from cohortrl.trainers.loop import RunCompleteError

    run_dir = Path(args.run_dir)
    if getattr(args, "trace_steps", None):  # the same as the override train.trace_steps=[...]
        args.overrides = [*(args.overrides or []), f"train.trace_steps=[{args.trace_steps}]"]
    cfg = _run_config(args, "train")
    trainer = make_trainer(cfg, run_dir, resume=args.resume, strict=getattr(args, "strict", False),  # GRPO or PPO
                           overwrite=getattr(args, "overwrite", False), callbacks=[_PrintEvaluations()])
    try:
        trainer.train(steps=args.steps)
    except RunCompleteError as e:  # a requeue wrapper repeating `train --resume` until it succeeds stops here
        print(e)
        return 0
    finally:
        trainer.close()
    if trainer.dist.is_main:  # under torchrun: one report, from rank 0
        print(f"run directory: {run_dir} (metrics.jsonl, curves.png, final/)")
    return 0


class _PrintEvaluations:
    """A callback: each held-out evaluation printed as soon as it finishes, not only when training ends."""

    def on_evaluate(self, trainer, metrics: dict) -> None:
        if trainer.dist.is_main and "eval/accuracy" in metrics:
            print(_eval_line(metrics), flush=True)


def _run_config(args, command: str) -> Config:
    """The config of ``cohortrl train`` / ``sft``: CONFIG with overrides, or with --resume the run's own."""
    if args.config and "=" in args.config and not Path(args.config).exists():  # `--resume a.b=1`: no CONFIG given
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.resume:
        config_path = args.config or str(Path(args.run_dir) / "config.yaml")
        if not Path(config_path).is_file() and not args.config:
            raise ConfigError(f"--resume: {args.run_dir} holds no run to continue (no config.yaml); give CONFIG too "
                              f"(cohortrl {command} CONFIG --run-dir {args.run_dir} --resume starts it when there is none)")
    else:
        if not args.config:
            raise ConfigError(f"{command} needs a CONFIG file (or --resume with --run-dir of an earlier run)")
        config_path = args.config
    return _load_config(config_path, args.overrides)


def _eval_line(r: dict) -> str:
    line = (
        f"step {r['step']:>4}: held-out greedy accuracy {r['eval/accuracy']:.3f} "
        f"(95% CI {r['eval/accuracy_ci_low']:.3f}-{r['eval/accuracy_ci_high']:.3f}, n={r['eval/n']})"
    )
    if "eval/sampled_accuracy" in r:
        line += (
            f"; sampled accuracy {r['eval/sampled_accuracy']:.3f} "
            f"(95% CI {r['eval/sampled_accuracy_ci_low']:.3f}-{r['eval/sampled_accuracy_ci_high']:.3f})"
        )
    return line


def cmd_explain(args) -> int:
    """Walk through one traced training step (train.trace_steps / --trace-steps): what was sampled, the rewards,
    the advantages with the group's arithmetic, the objective token by token, and the step's loss reconciled
    with the logged one."""
    from cohortrl.trainers.explain import explain

    try:
        print(explain(args.run_dir, args.step, args.prompt, args.html))
    except ValueError as e:  # --prompt out of range
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.html:
        print(f"wrote {args.html}")
    return 0


def cmd_sft(args) -> int:
    """Supervised fine-tuning: a gym task's reference solutions, or your prompt/completion or conversation rows."""
    from cohortrl.trainers.loop import RunCompleteError
    from cohortrl.trainers.sft import SFTTrainer

    trainer = SFTTrainer(_run_config(args, "sft"), Path(args.run_dir), resume=args.resume, overwrite=args.overwrite,
                         callbacks=[_PrintEvaluations()])
    try:
        trainer.train(steps=args.steps)
    except RunCompleteError as e:  # as cmd_train: a wrapper repeating `--resume` until it succeeds stops here
        print(e)
        return 0
    finally:
        trainer.close()
    print(f"run directory: {args.run_dir} (metrics.jsonl, curves.png, final/)")
    return 0


def cmd_verify(args) -> int:
    """Check a run's checkpoints and final/ (PATH a run directory), or one checkpoint or final/ (PATH that
    directory), against their manifests: one line each; exit 1 if any is damaged."""
    import yaml

    from cohortrl.trainers import checkpoint
    from cohortrl.trainers.loop import config_hashes

    path = Path(args.run_dir)
    paths, run_dir = _verify_targets(path)
    if not paths:
        print(f"{path}: nothing to verify: neither a run directory (no checkpoints, no final/) nor a checkpoint or "
              f"final/ (no {checkpoint.MANIFEST})", file=sys.stderr)
        return 1
    config = run_dir / "config.yaml"
    expected = None  # without the run's config, the files are still checked
    if config.is_file():
        try:
            expected = config_hashes(yaml.safe_load(config.read_text()))
        except (OSError, yaml.YAMLError) as e:
            print(f"{config}: unreadable ({str(e).splitlines()[0]}); checking the files but not the config hashes", file=sys.stderr)
    bad = 0
    for target in paths:
        problem = checkpoint.verify(target, expected)
        bad += problem is not None
        print(f"ok   {target}" if problem is None else f"BAD  {problem}")
    return 1 if bad else 0


def _verify_targets(path: Path) -> tuple[list[Path], Path]:
    """(the directories ``cohortrl verify PATH`` checks, the run directory whose config they were written under):
    PATH itself if it is a checkpoint (``RUN/checkpoints/step_N``) or a ``final/`` (it has a manifest or the
    final marker), else PATH's checkpoints and final/."""
    from cohortrl.trainers import checkpoint

    if path in checkpoint.step_dirs(path.parent.parent):
        return [path], path.parent.parent
    if (path / checkpoint.MANIFEST).is_file() or (path / checkpoint.FINAL_MARKER).is_file():
        return [path], path.parent
    return [*checkpoint.step_dirs(path), *([path / "final"] if (path / "final").is_dir() else [])], path


def cmd_eval(args) -> int:
    """Greedy accuracy (and pass@k) on held-out prompts: of CONFIG's model (or an adapter on it), or of a run's
    final/ with the run's own config and held-out set (RUN_DIR)."""
    from cohortrl.data import load_rows
    from cohortrl.distributed import process_device
    from cohortrl.rewards.scoring import WeightedReward, check_columns, resolve
    from cohortrl.rollout.hf import model_device
    from cohortrl.trainers import checkpoint
    from cohortrl.trainers.evaluate import EVAL_ROWS, evaluate_config
    from cohortrl.trainers.setup import build_fast_path, fast_kernels, load_configured_model, start_reference

    run_dir = Path(args.config) if Path(args.config).is_dir() else None
    start = None  # a full-weight run's own model section: what eval.kl_to_reference measures it against
    if run_dir is not None:
        cfg, args.adapter, start = _run_evaluation(run_dir, args)
    else:
        cfg = _load_config(args.config, args.overrides)
    if args.adapter:
        _check_adapter(Path(args.adapter))
        checkpoint.check_saved(args.adapter, "--adapter")
        _check_adapter_base(Path(args.adapter), cfg)
    if args.responses and Path(args.responses).exists():
        raise ConfigError(f"--responses {args.responses} already exists; give a new path (nothing is overwritten)")
    model, tokenizer = load_configured_model(cfg.model, cfg.train.seed)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.to(process_device(cfg.train.device))  # the GPU when there is one, as the trainer chooses (train.device)
    reference = None
    if cfg.eval.kl_to_reference:  # against the model it was trained from: an adapter's base, a full run's configured one
        if run_dir is None and not args.adapter:
            raise ConfigError("eval.kl_to_reference measures a trained model against the one it started from: give a "
                              "run directory (cohortrl eval RUN_DIR) or --adapter, not a config's own model")
        reference = start_reference(model, start, cfg.train.seed, process_device(cfg.train.device))
    fn = next(f for f in cfg.reward.functions if f.name == cfg.reward.correctness)
    saved = run_dir / EVAL_ROWS if run_dir is not None and cfg.data.source.startswith("python:") else None
    if saved is not None:  # the run's rows were given in Python: its held-out ones were saved beside its config
        if not saved.is_file():
            raise ConfigError(f"{run_dir} was trained on rows given in Python and has no {EVAL_ROWS} (it held none out, "
                              "or they were not JSON): evaluate it with cohortrl eval CONFIG, data.source naming the rows")
        eval_rows = [json.loads(line) for line in saved.read_text().splitlines()]
    else:
        _, eval_rows = load_rows(cfg.data, cfg.train.seed)
    eval_rows = eval_rows[: cfg.eval.n_prompts]
    if run_dir is not None:
        print(f"evaluating {args.adapter or cfg.model.name} with {run_dir / 'config.yaml'} on {len(eval_rows)} held-out "
              f"prompts: {saved or _held_out_set(cfg)}", file=sys.stderr, flush=True)
    correctness = WeightedReward(fn.name, resolve(fn.name, fn.kwargs), timeout_s=cfg.reward.timeout_s)
    check_columns({fn.name: correctness.fn}, eval_rows, "held-out rows")
    # The CPU fast path the trainer's own evaluations use (train.cpu_fast_path), so both report the same numbers;
    # evaluation decodes in fp32 whatever train.cpu_decode_dtype says (a training rollouts' setting, not checked here).
    fast_path = build_fast_path(replace(cfg.train, cpu_decode_dtype="float32"), model_device(model), model)
    try:
        with fast_kernels(fast_path, model):
            responses: list[dict] = []
            result = evaluate_config(model, tokenizer, eval_rows, correctness, cfg, responses=responses,
                                     fast_path=fast_path, reference=reference)
    finally:
        if fast_path is not None:
            fast_path.close()
    if args.responses:
        Path(args.responses).write_text("".join(json.dumps(r) + "\n" for r in responses))
    print(json.dumps(result, indent=2) if args.json else _eval_table(result, args.adapter or cfg.model.name))
    return 0


def _run_evaluation(run_dir: Path, args) -> tuple[Config, str | None, object]:
    """``cohortrl eval RUN_DIR``: the run's config (with the overrides) set to load its final/, the adapter to
    apply (a LoRA run's final/) or None, and for a full-weight run the model section it started from (else None)."""
    config, final = run_dir / "config.yaml", run_dir / "final"
    if not config.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); give a run directory or a CONFIG file")
    if not final.is_dir():
        raise ConfigError(f"{run_dir} has no final/ (the run has not finished); finish it with cohortrl train --run-dir "
                          f"{run_dir} --resume, or evaluate a model with cohortrl eval CONFIG")
    if args.adapter:
        raise ConfigError(f"--adapter does not go with RUN_DIR: {run_dir}/final is what is evaluated")
    cfg = _load_config(str(config), args.overrides)
    if (final / "adapter_config.json").is_file():  # LoRA: the adapter on the run's own base (and model.init)
        return cfg, str(final), None
    return cfg.with_overrides(f"model.name={final}", "model.init=null"), None, cfg.model  # all the weights: init in them


def _held_out_set(cfg: Config) -> str:
    """Which held-out problems a config's data section draws (data.load_rows), in words."""
    level = "" if cfg.data.eval_level is None else f", data.eval_level={cfg.data.eval_level}"
    return f"those {cfg.data.source} holds out (data.eval_size={cfg.data.eval_size}{level}, train.seed={cfg.train.seed})"


def _check_adapter_base(path: Path, cfg) -> None:
    """An adapter trained on top of a ``model.init`` fits only those weights: the config's ``model.init`` must be
    that one, as the adapter's final marker records it (``checkpoint.init_record``; adapters saved before it was
    recorded are not checked)."""
    from cohortrl.models import final_marker, manifest_sha256
    from cohortrl.trainers import checkpoint

    marker = final_marker(path)
    if "init" not in marker:
        return
    chain = checkpoint.init_chain(path, "--adapter")  # the recorded init is there and unchanged
    trained_on = chain[-1] if chain else None
    given = cfg.model.init
    if trained_on is None or given is None:
        same = trained_on is None and given is None
    else:  # the same directory, or a copy of it (the same manifest)
        sha = marker["init"]["manifest_sha256"]
        same = Path(trained_on).resolve() == Path(given).resolve() or (sha is not None and manifest_sha256(given) == sha)
    if not same:
        raise ConfigError(f"--adapter {path} was trained on top of {trained_on or 'the base model (no model.init)'}, "
                          f"but the config's model.init is {given}; set model.init={trained_on or 'null'}")


def _check_adapter(path: Path) -> None:
    """``eval --adapter PATH`` needs a PEFT adapter directory; say what PATH is instead, before any model loads."""
    if not path.is_dir():
        raise ConfigError(f"--adapter {path}: no such directory; give a LoRA run's final/ (RUN_DIR/final)")
    if not (path / "adapter_config.json").is_file():
        if (path / "config.json").is_file():
            raise ConfigError(
                f"--adapter {path} holds a full model (a run without LoRA), not an adapter; evaluate it with "
                f"model.name={path} instead of --adapter"
            )
        raise ConfigError(f"--adapter {path} has no adapter_config.json; give a LoRA run's final/ (RUN_DIR/final)")


def _eval_table(result: dict, what: str) -> str:
    """The evaluation as a two-column table: each metric, with its 95% interval where there is one."""
    rows = []
    for key, value in result.items():
        if key.endswith(("_ci_low", "_ci_high")):
            continue
        name = key.removeprefix("eval/")
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        if f"{key}_ci_low" in result:
            shown += f"  (95% CI {result[f'{key}_ci_low']:.3f}-{result[f'{key}_ci_high']:.3f})"
        rows.append((name, shown))
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"held-out evaluation of {what}", *(f"  {name:<{width}}  {shown}" for name, shown in rows)])


def cmd_config_show(args) -> int:
    """The full resolved config, defaults included, as YAML (what a run would write to RUN_DIR/config.yaml);
    without CONFIG, cohortrl's defaults."""
    if args.config and "=" in args.config and not Path(args.config).exists():  # `config show a.b=1`: no CONFIG
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.config is None:
        print("# cohortrl's defaults (no CONFIG given; cohortrl config show CONFIG [key.path=value ...] resolves a file)")
        print(Config().with_overrides(*args.overrides).to_yaml(), end="")
        return 0
    print(_load_config(args.config, args.overrides).to_yaml(), end="")
    return 0


def cmd_models(args) -> int:
    from cohortrl.models import ALIASES, cached_models, cohortrl_home, timed_load

    if args.load:
        (model, tokenizer), seconds = timed_load(args.load)
        print(f"loaded {args.load} in {seconds:.2f} s ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
        if args.chat:
            from cohortrl.rollout.hf import Sampling, generate

            rollout, _ = generate(model, tokenizer, [{"prompt": args.chat}], 1, Sampling(temperature=0, max_new_tokens=64), system_prompt="Be brief.")
            print(rollout.completions[0])
        return 0
    print("aliases:")
    for name, alias in ALIASES.items():
        print(f"  {name:24s} {alias.description}")
    cached = cached_models()
    print(f"cached in {cohortrl_home() / 'models'}: {', '.join(cached) if cached else '(none)'}")
    return 0


def cmd_train_rm(args) -> int:
    """Train an outcome (ORM) or process (PRM) reward model; see cohortrl.reward_models.train."""
    from cohortrl.reward_models.train import load_rm_config, train_reward_model

    items = list(args.items)
    source = items.pop(0) if items and "=" not in items[0] else None
    cfg = load_rm_config(source, items + list(getattr(args, "overrides", []) or []))
    summary = train_reward_model(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    print(f"saved the {cfg.kind.upper()} to {cfg.out}")
    return 0


def cmd_plot(args) -> int:
    from cohortrl.trainers.metrics import plot_curves

    print(plot_curves(Path(args.run_dir)))
    return 0


def cmd_report(args) -> int:
    """Several runs side by side: held-out accuracy, reward and step-reward hacking detectors per step
    (OUT.png) and a summary table (OUT.md). Given one sweep directory (cohortrl sweep): per arm the mean, sd and
    per-seed intervals over seeds, curves with one line per seed and a band, and each arm paired against the
    baseline arm on the same held-out problems (exact McNemar per seed, paired bootstrap over seeds x problems)."""
    sweeps = [(Path(d) / "sweep.json").is_file() for d in args.run_dirs]
    if any(sweeps) and not all(sweeps):
        raise ConfigError(f"{args.run_dirs[sweeps.index(False)]} is not a sweep directory (no sweep.json) but "
                          f"{args.run_dirs[sweeps.index(True)]} is: give sweep directories only, or run directories only")
    if all(sweeps):
        from cohortrl.study import write_study_report

        paths = write_study_report([Path(d) for d in args.run_dirs], Path(args.out), baseline=args.baseline, metrics=args.metrics or [],
                                   panels=args.panels or ["reward_mean"], last_k=args.last_k,
                                   keep_dir=Path(args.keep) if args.keep else None, answer_checks=args.answer_checks)
    else:
        if args.baseline or args.metrics or args.keep or args.answer_checks:
            raise ConfigError("--baseline, --metrics, --keep and --answer-checks compare the arms of a sweep: give one sweep directory "
                              "(cohortrl sweep ... --out DIR), not run directories")
        from cohortrl.trainers.report import write_report

        paths = write_report([Path(d) for d in args.run_dirs], Path(args.out), last_k=args.last_k, panels=args.panels)
    for path in paths:
        print(path)
    return 0


def cmd_sweep(args) -> int:
    """A config × a grid of overrides × seeds, each (arm, seed) a run directory OUT/ARM/seedK, run one at a time
    (or --jobs N at once). Stopped at any moment, the same command continues it: finished runs are skipped,
    interrupted ones resumed from their last checkpoint. Then: cohortrl report OUT --out NAME."""
    from cohortrl.sweep import Sweep, parse_grid, parse_seeds

    sweep = Sweep(Path(args.out), args.config, args.command_name, parse_grid(args.grid), parse_seeds(args.seeds),
                  args.overrides)
    return sweep.run(jobs=args.jobs)


# cohortrl plan's flags that set a RunSpec field; one left out keeps --config's value, else the RunSpec default
PLAN_FIELDS = ("algorithm", "gpus", "sharding", "dtype", "lora_rank", "prompt_len", "response_len", "max_new_tokens", "group_size",
               "prompts_per_step", "micro_batch_size", "distinct_prompts", "response_tokens", "tool_tokens",
               "epochs", "device", "decode_dtype", "mfu", "generation_mfu")


def cmd_plan(args) -> int:
    """Memory per device and time per step of a PPO / GRPO / RLOO / RFT step (``cohortrl.planner``)."""
    from cohortrl.planner import (GPU_PEAK_FLOPS, PlanError, RunSpec, plan, resolve_shape, run_spec_from_config,
                                  uniform_cpu_rates, validate)
    from cohortrl.planner.tables import format_plan
    from cohortrl.planner.cpu_rates import measure_cpu_rates

    given = {name: getattr(args, name) for name in PLAN_FIELDS if getattr(args, name) is not None}
    for flag, name, value in (("checkpointing", "checkpointing", True), ("no_reference", "reference", False),
                              ("reward_model", "reward_model", True), ("no_reuse_rollout_forward", "reuse_rollout_forward", False)):
        if getattr(args, flag):
            given[name] = value
    try:
        if args.config:
            cfg = Config.from_yaml(args.config, ["model.init=null"])  # the shapes are model.name's; a warm start need not exist here
            model = args.model or cfg.model.name
            bf16_units = False
            if cfg.train.cpu_decode_dtype == "auto":  # decided by this machine, as the trainer decides it
                from cohortrl.trainers.setup import cpu_bf16_products

                bf16_units = cpu_bf16_products()
            run = run_spec_from_config(cfg, bf16_units=bf16_units, **given)
        elif args.model is None:
            raise PlanError("give a model (a size preset, a directory with a config.json, a cohortrl alias) or --config")
        else:
            model, run = args.model, RunSpec(**given)
        shape = resolve_shape(model)
        if run.device == "cpu":  # a rate given, measured now (seconds), or none: then no time is shown
            if args.peak_gflops:
                rates = uniform_cpu_rates(shape, args.peak_gflops * 1e9, run.dtype)
            elif args.no_measure:
                rates = None
            else:
                import torch

                from cohortrl.trainers.setup import decoding_step_ops

                # the attention probe's cache: decoding's mean context, s_p + T/2 columns; the step overhead's probe:
                # the config's sampler and whether decoding records for the update
                rates = measure_cpu_rates(shape, args.threads or torch.get_num_threads(), run.sequences // run.gpus,
                                          ops=decoding_step_ops(cfg.sampling if args.config else None),
                                          context=run.prompt_len + run.response_len // 2,
                                          rank=run.lora_rank or 16, decode_dtype=run.decode_dtype,
                                          record=validate(run).reuse_rollout_forward)
            run = replace(run, cpu_rates=rates, cpu_baseline_bytes=args.cpu_baseline_mb * 1024**2)
        else:
            run = replace(run, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else GPU_PEAK_FLOPS[args.gpu])
        print(format_plan(plan(shape, run)))
    except (PlanError, ConfigError) as e:  # caught here: main's handler imports the trainer stack (seconds) just to name its errors
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    """The library's main claim on the default model: a supervised warm start, then GRPO, on an engineering gym
    family with the calculator (configs/demo_sft.yaml, configs/demo_grpo.yaml), held-out accuracy before and
    after each phase. The warm start is trained once and cached in $COHORTRL_HOME/demo/ (--fresh: train it
    again); GRPO runs into a new runs/demo-DATE-TIME each time. --arithmetic: the earlier GRPO-only demo
    (configs/demo_arithmetic.yaml)."""
    run_dir = Path(args.run_dir or time.strftime("runs/demo-%Y%m%d-%H%M%S"))  # a new directory each time: never refused
    if args.arithmetic:
        if args.fresh or args.sft or args.sft_config or args.grpo_config:
            raise ConfigError("--arithmetic runs GRPO alone: --fresh, --sft, --sft-config and --grpo-config do not apply")
        return cmd_train(argparse.Namespace(
            config=str(REPO_CONFIGS / "demo_arithmetic.yaml"), overrides=args.overrides, run_dir=str(run_dir),
            steps=None, resume=False, overwrite=args.overwrite,
        ))
    from cohortrl.demo import (DEMO_STUDY, DEMO_STUDY_ARMS, DEMO_STUDY_REPORT, check_same_evaluation, demo_summary, mtime,
                               study_line)
    from cohortrl.models import cohortrl_home
    from cohortrl.trainers import make_trainer
    from cohortrl.trainers.run_dir import RunDirectoryError, run_files
    from cohortrl.trainers.warm_start import cached_sft, lookup

    sft_path = args.sft_config or str(REPO_CONFIGS / "demo_sft.yaml")
    rl_path = args.grpo_config or str(REPO_CONFIGS / "demo_grpo.yaml")
    sft_cfg, rl_cfg = _load_config(sft_path, args.sft), _load_config(rl_path, args.overrides)
    check_same_evaluation(sft_cfg, rl_cfg)  # the summary compares the phases' numbers: before any model loads
    if not args.overwrite and run_files(run_dir):  # refused now, not after the warm start's minutes of training
        raise RunDirectoryError(f"{run_dir} already holds a run ({', '.join(run_files(run_dir))}); give another "
                                "--run-dir, or --overwrite to delete that run's files first")
    rl_name = rl_cfg.algorithm.name.upper()
    tools = f", tools {', '.join(sft_cfg.rollout.tools)}" if sft_cfg.rollout.tools else ""
    levels = (f"level {sft_cfg.data.level}" if sft_cfg.data.level == rl_cfg.data.level else
              f"level {sft_cfg.data.level} references, {rl_name} on level {rl_cfg.data.level}")
    print(f"cohortrl demo: {sft_cfg.model.name} on {sft_cfg.data.source} {levels}{tools}: "
          f"a supervised warm start ({sft_path}), then {rl_name} ({rl_path})", flush=True)

    root = cohortrl_home() / "demo"
    cached, problem = lookup(sft_cfg, root)
    if problem is None and not args.fresh:
        print(f"warm start: reusing the run cached in {cached}, trained {mtime(cached / 'final')} "
              "(cohortrl demo --fresh trains it again)", flush=True)
    else:
        why = "--fresh" if args.fresh and problem is None else ("none cached yet" if not cached.exists() else f"the cached one is not usable: {problem}")
        print(f"warm start: training it ({sft_cfg.train.steps} SFT steps; {why}); it will be cached in {cached}", flush=True)
    warm = cached_sft(sft_cfg, root, fresh=args.fresh, callbacks=[_PrintEvaluations()])

    rl = rl_cfg.to_dict()
    rl["model"]["init"] = str(warm.final)
    print(f"{rl_name}: {rl_cfg.train.steps} step(s) from the warm start ({warm.final}) into {run_dir}", flush=True)
    trainer = make_trainer(Config.from_dict(rl), run_dir, overwrite=args.overwrite, callbacks=[_PrintEvaluations()])
    try:
        rl_rows = trainer.train()
    finally:
        trainer.close()
    shutil.copyfile(warm.path / "curves.png", run_dir / "warm_start_curves.png")
    summary = demo_summary(sft_cfg, rl_cfg, warm, [r for r in rl_rows if "eval/accuracy" in r], run_dir)
    if args.sft_config is None and args.grpo_config is None:  # the shipped design: what its study's controls showed
        line = study_line(DEMO_STUDY, DEMO_STUDY_ARMS, DEMO_STUDY_REPORT)
        summary += f"\n{line}" if line else ""
    (run_dir / "demo_summary.txt").write_text(summary + "\n")
    print(summary)
    return 0


def _run_arguments(p: argparse.ArgumentParser, steps: str) -> None:
    """The run-directory options ``train`` and ``sft`` share; ``steps`` names what ``--steps`` counts."""
    p.add_argument("--run-dir", required=True, help="directory for metrics.jsonl, checkpoints, curves.png, final/")
    p.add_argument("--steps", type=int, default=None, help=f"stop after N {steps} in total (default: train.steps)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest intact checkpoint; "
                   "safe to repeat: with no run there, or one stopped before its first checkpoint, the run starts from step 0")
    p.add_argument("--overwrite", action="store_true",
                   help="--run-dir holds an earlier run: delete its files first and start over (without it such a directory is refused)")


def _step_list(text: str) -> str:
    """``--trace-steps 1,5``: comma-separated step numbers, kept as the text of a YAML list's items."""
    try:
        return ",".join(str(int(x)) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step numbers separated by commas, e.g. 1,5") from None


def build_parser() -> argparse.ArgumentParser:
    from cohortrl import __version__

    parser = argparse.ArgumentParser(prog="cohortrl", description="RL post-training of LLMs: GRPO and PPO.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; show tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"cohortrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with a YAML config", description="Train a policy with GRPO or PPO (algorithm.name) from a YAML config.")
    p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/tiny_grpo.yaml, configs/tiny_ppo.yaml)")
    p.add_argument("overrides", nargs="*", help="overrides as key.path=value (e.g. algorithm.group_size=4)")
    _run_arguments(p, steps="training steps")
    p.add_argument("--strict", action="store_true",
                   help="with --resume: refuse, rather than fall back to an older checkpoint, when the newest is damaged")
    p.add_argument("--trace-steps", metavar="N,M", type=_step_list,
                   help="record these steps token by token for `cohortrl explain` (train.trace_steps)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("explain", help="walk through one traced training step, token by token",
                       description=cmd_explain.__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, required=True, help="a step the run traced (train.trace_steps)")
    p.add_argument("--prompt", type=int, default=0, help="which of the step's prompts to walk through (default 0)")
    p.add_argument("--html", metavar="FILE", help="also write one self-contained page with every prompt of the step")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("sft", help="supervised fine-tuning with a YAML config", description=cmd_sft.__doc__ + (
        " Its final/ starts an RL run as model.init (docs/python_api.md)."))
    p.add_argument("config", nargs="?", help="YAML config file (model, data, optim, train and sft sections)")
    p.add_argument("overrides", nargs="*", help="overrides as key.path=value (e.g. sft.batch_size=4)")
    _run_arguments(p, steps="optimiser steps")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("verify", help="check a run's checkpoints and final/, or one of them, against their manifests",
                       description=cmd_verify.__doc__)
    p.add_argument("run_dir", metavar="PATH", help="a run directory, one of its checkpoints, or a final/")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("eval", help="evaluate a model on a config's held-out prompts, or a run's final/",
                       description=cmd_eval.__doc__)
    p.add_argument("config", metavar="CONFIG_OR_RUN_DIR", help="YAML config file (model, data, reward.correctness, "
                   "eval settings), or a run directory: its final/ with its own config and held-out set")
    p.add_argument("overrides", nargs="*", help="overrides as key.path=value")
    p.add_argument("--adapter", help="a LoRA adapter directory (e.g. RUN_DIR/final) to apply to the config's model")
    p.add_argument("--json", action="store_true", help="print the raw result as JSON instead of a table")
    p.add_argument("--responses", metavar="PATH", help="also write each greedy response (prompt, completion, "
                   "correct, error category) to PATH as JSON lines; PATH must not exist")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("models", help="list model aliases and the cache", description="List model aliases and cached conversions.")
    p.add_argument("--load", metavar="SPEC", help="load SPEC and print how long it took")
    p.add_argument("--chat", metavar="TEXT", help="with --load: answer TEXT greedily")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("train-rm", help="train an outcome or process reward model",
                       description=cmd_train_rm.__doc__ + " Example: cohortrl train-rm kind=prm data=task:arithmetic out=runs/prm")
    p.add_argument("items", nargs="*", metavar="CONFIG_OR_FLAGS", help="an optional YAML file, then key=value flags (kind, model, data, steps, out, ...)")
    p.set_defaults(func=cmd_train_rm)

    p = sub.add_parser("plot", help="write RUN_DIR/curves.png", description="Plot a run's training curves to RUN_DIR/curves.png.")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="compare runs: OUT.png curves and OUT.md summary", description=cmd_report.__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with metrics.jsonl), or sweep directories (one sweep's arms, or several "
                   "sweeps' arms side by side, named by folder)")
    p.add_argument("--out", required=True, help="output path without suffix, e.g. docs/process_rewards_smollm2")
    p.add_argument("--last-k", type=int, default=5, help="mean reward over the last K training steps (default 5)")
    p.add_argument("--panels", nargs="+", metavar="KEY", help="step metrics to plot and tabulate (first and last K "
                   "steps) instead of the step-reward detectors, e.g. kl response_length_incorrect_mean")
    p.add_argument("--baseline", metavar="ARM", help="sweep: the arm the others are paired against (default the first)")
    p.add_argument("--metrics", nargs="+", metavar="KEY", help="sweep: logged step metrics to tabulate per arm "
                   "(each seed's mean over its last K steps; mean and sd over seeds)")
    p.add_argument("--keep", metavar="DIR", help="sweep: also copy what the report reads (configs, metrics.jsonl, "
                   "answers.jsonl.gz, sweep.json/.jsonl) into DIR, small enough to commit")
    p.add_argument("--answer-checks", action="store_true", help="sweep: tabulate what reward hacking leaves in the final answers")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("sweep", help="a config x a grid of overrides x seeds, resumable", description=cmd_sweep.__doc__)
    p.add_argument("config", help="YAML config file every run starts from")
    p.add_argument("overrides", nargs="*", help="overrides for every run as key.path=value; {seed} is the run's seed "
                   "(e.g. model.init=runs/ws/base/seed{seed}/final)")
    p.add_argument("--out", required=True, help="the sweep's directory: OUT/ARM/seedK run directories, sweep.json, sweep.jsonl")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="one axis of the grid (repeatable; arms are the product), e.g. --grid algorithm.group_size=2,4")
    p.add_argument("--seeds", default="0,1,2", help="train.seed of each run, comma-separated (default 0,1,2)")
    p.add_argument("--command", dest="command_name", default="train", choices=["train", "sft"],
                   help="train (GRPO, PPO, RFT: algorithm.name) or sft (default train)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: the runs share the machine's cores)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("plan", help="memory per device and time per step of PPO vs GRPO",
                       description="Per-device memory by component and FLOPs / time per step by phase (docs/planner.md). "
                                   "Defaults are the trainer's; --config takes a run's config, the flags override it.")
    p.add_argument("model", nargs="?", default=None,
                   help="size preset (0.5b, 1.5b, 7b, 8b, 70b), a directory with a config.json, or a cohortrl alias "
                        "(default with --config: its model.name)")
    p.add_argument("--config", default=None, help="a cohortrl YAML config: its algorithm, P, G, beta, LoRA, dtype, "
                                                  "micro-batches, max_new_tokens and max_prompt_tokens")
    p.add_argument("--algorithm", default=None, help="ppo, grpo, rloo or rft (default grpo)")
    p.add_argument("--gpus", type=int, default=None, help="data-parallel devices (default 1)")
    p.add_argument("--sharding", default=None, help="none, zero1, zero2, zero3 (= fsdp full shard)")
    p.add_argument("--dtype", default=None, help="bf16 (fp32 master weights in AdamW) or fp32 (default bf16)")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank on the policy; 0: full fine-tuning (default)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens, padded (default 512)")
    p.add_argument("--response-len", type=int, default=None,
                   help="response tokens, padded, tool results included (default 1024; with --config its max_new_tokens)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="the sampling budget, >= --response-len (default: the response length; with --config its own): "
                        "a CPU run allocates its decoding buffers for it")
    p.add_argument("-G", "--group-size", type=int, default=None, help="responses per prompt (default 8)")
    p.add_argument("-P", "--prompts", dest="prompts_per_step", type=int, default=None, help="prompts per step (default 64)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per forward/backward per device; 0: all at once (default 0, as the trainer)")
    p.add_argument("--distinct-prompts", type=int, default=None, help="distinct prompts in the batch (default P)")
    p.add_argument("--response-tokens", type=int, default=None,
                   help="sampled response tokens in the whole batch, scored by the loss (default B·T − tool tokens)")
    p.add_argument("--tool-tokens", type=int, default=None, help="tool-result tokens in the whole batch (default 0)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (recompute each layer)")
    p.add_argument("--no-reference", action="store_true", help="beta = 0: no reference model")
    p.add_argument("--reward-model", action="store_true", help="a learned reward model of the policy's size")
    p.add_argument("--no-reuse-rollout-forward", action="store_true",
                   help="cpu: the update runs its own forward (train.reuse_rollout_forward false)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the batch per step (default 1)")
    p.add_argument("--device", default=None, help="gpu or cpu (default gpu; with --config: cpu unless train.device names another)")
    p.add_argument("--decode-dtype", default=None, choices=["fp32", "bf16"],
                   help="cpu, fp32 model: the lean decoder's products (default fp32; with --config its "
                        "train.cpu_decode_dtype, auto resolved on this machine)")
    p.add_argument("--cpu-baseline-mb", type=float, default=350.0,
                   help="cpu: resident MiB of the process before any model (default 350, measured by benchmarks/planner_validation.py)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="cpu: GFLOP/s to time the step with, every product and decoding's attention (default: "
                        "measured on this machine now)")
    p.add_argument("--threads", type=int, default=0, help="cpu: torch threads to measure with (default torch's)")
    p.add_argument("--no-measure", action="store_true", help="cpu: no measurement and no time column")
    p.add_argument("--gpu", default="h100", choices=["a100", "h100", "h200"], help="gpu: datasheet peak FLOP/s to assume (default h100)")
    p.add_argument("--peak-tflops", type=float, default=None, help="gpu: peak TFLOP/s per device (overrides --gpu)")
    p.add_argument("--mfu", type=float, default=None, help="gpu: model FLOPs utilisation of forward/backward passes (default 0.4)")
    p.add_argument("--generation-mfu", type=float, default=None, help="gpu: utilisation while decoding (default 0.1: bandwidth-bound)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("demo", help="SFT warm start then GRPO on SmolLM2-135M-Instruct (engineering gym)",
                       description=cmd_demo.__doc__)
    p.add_argument("overrides", nargs="*", help="overrides to the GRPO config (configs/demo_grpo.yaml; with "
                   "--arithmetic configs/demo_arithmetic.yaml) as key.path=value")
    p.add_argument("--run-dir", default=None, help="GRPO's run directory (default runs/demo-DATE-TIME, a new one each time)")
    p.add_argument("--overwrite", action="store_true", help="--run-dir may hold an earlier run: delete its files first")
    p.add_argument("--fresh", action="store_true", help="train the warm start again, replacing the cached one")
    p.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE",
                   help="an override to the warm start's config (repeatable); a changed config is a new cache entry")
    p.add_argument("--sft-config", default=None, help="the warm start's config (default configs/demo_sft.yaml)")
    p.add_argument("--grpo-config", default=None, help="the RL phase's config (default configs/demo_grpo.yaml)")
    p.add_argument("--arithmetic", action="store_true",
                   help="the earlier demo instead: GRPO alone on arithmetic level 1 (configs/demo_arithmetic.yaml)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("config", help="show a config with every default filled in",
                       description="Inspect configs: `cohortrl config show CONFIG [key.path=value ...]`.")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    p = config_sub.add_parser("show", help="print the full resolved config (defaults included) as YAML",
                              description=cmd_config_show.__doc__)
    p.add_argument("config", nargs="?", help="YAML config file (default: none, cohortrl's defaults)")
    p.add_argument("overrides", nargs="*", help="overrides as key.path=value")
    p.set_defaults(func=cmd_config_show)

    try:
        from cohortrl.tasks.cli import add_tasks_parser
    except ImportError:
        pass
    else:
        add_tasks_parser(sub)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    from cohortrl.data import DataError
    from cohortrl.models import ModelLoadError
    from cohortrl.reward_models.labels import LabelDataError
    from cohortrl.rewards.scoring import RewardFunctionError
    from cohortrl.rollout.hf import PromptTooLongError
    from cohortrl.trainers.checkpoint import CheckpointError
    from cohortrl.trainers.guards import NonfiniteError
    from cohortrl.trainers.loop import RunStateError
    from cohortrl.trainers.run_dir import RunDirectoryError
    from cohortrl.user_code import UserCodeError

    return (
        DataError, ModelLoadError, RewardFunctionError, PromptTooLongError, RunStateError, CheckpointError,
        NonfiniteError, FileNotFoundError, LabelDataError, RunDirectoryError, UserCodeError,
    )


@contextlib.contextmanager
def _progress_on_stderr():
    """Progress lines (model loading, the GGUF conversion, evaluation batches) on stderr, for people watching;
    the library logs them at INFO on the ``cohortrl.progress`` logger and prints nothing by itself. The logger is
    put back as it was on the way out: ``main`` may be called in a running process (tests, notebooks), where a
    handler left behind would print each line again on the next call, or write to a stream closed since."""
    progress = logging.getLogger("cohortrl.progress")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = progress.level, progress.propagate
    progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False  # with -v the root logger would print each line a second time
    try:
        yield
    finally:
        progress.removeHandler(handler)
        progress.setLevel(level)
        progress.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`train CONFIG --run-dir D a.b=1`), which argparse won't intermix with
    # a positional list; collect the stray key=value items here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The `tasks` commands report an unknown family (KeyError) or level (ValueError) by raising; there those are
    # the user's input, elsewhere they would be bugs and keep their traceback.
    task_errors = (KeyError, ValueError) if args.command == "tasks" else ()
    with _progress_on_stderr():
        try:
            return args.func(args)
        except KeyboardInterrupt:
            return _interrupted(args)
        except ConfigError as e:
            return _fail(f"config error: {e}", args.verbose)
        except (*_user_errors(), *task_errors) as e:  # problems with the user's input: one line, not a traceback
            return _fail(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", args.verbose)


def _interrupted(args) -> int:
    """Ctrl-C: one line and exit 130 (128 + SIGINT, as a shell reports it); for a run, where it can go on from
    and the command that does (with CONFIG, which also starts a run stopped before its first checkpoint)."""
    if args.command not in ("train", "sft"):
        print("interrupted", file=sys.stderr)
        return 130
    import shlex

    from cohortrl.trainers.checkpoint import latest

    last = latest(Path(args.run_dir)) if Path(args.run_dir).is_dir() else None
    where = f"the last checkpoint is {last}" if last else "no checkpoint was written yet (resuming starts the run again)"
    config = shlex.join([args.config, *args.overrides]) + " " if args.config else ""
    print(f"interrupted; {where}; resume with: cohortrl {args.command} {config}--run-dir {shlex.quote(str(args.run_dir))} "
          "--resume", file=sys.stderr)
    return 130


def _fail(message: str, verbose: bool) -> int:
    """Exit code 2 with ``message`` on stderr; the traceback too with -v (for a bug report)."""
    if verbose:
        import traceback

        traceback.print_exc()
    print(message, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
