"""``cohortrl demo``'s checks and closing lines: both phases measured alike, the held-out accuracy of the base
model, the warm start and the RL run, their paired test and one plot (the command itself is ``cli.cmd_demo``)."""

from __future__ import annotations

import time
from pathlib import Path

from cohortrl.config import Config, ConfigError


def check_same_evaluation(sft: Config, rl: Config) -> None:
    """Both phases must measure alike (the same held-out problems, model, prompt, tools, token budget and
    correctness), or the demo's before/after numbers would not compare; say what differs."""
    from cohortrl.data import load_rows, prompt_key

    def measured(cfg: Config) -> dict:
        _, held_out = load_rows(cfg.data, cfg.train.seed)
        fn = next(f for f in cfg.reward.functions if f.name == cfg.reward.correctness)
        return {
            "held-out problems (data.*, eval.n_prompts)": [prompt_key(r["prompt"]) for r in held_out[: cfg.eval.n_prompts]],
            "model.name": cfg.model.name, "model.system_prompt": cfg.model.system_prompt,
            "rollout.tools": cfg.rollout.tools, "eval.max_new_tokens": cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
            "reward.correctness": (fn.name, fn.kwargs),
        }

    a, b = measured(sft), measured(rl)
    differ = [key for key in a if a[key] != b[key]]
    if differ:
        raise ConfigError(f"the warm start and the RL phase must be evaluated alike for the demo to compare them; "
                          f"they differ in: {', '.join(differ)}")


def mtime(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))


def demo_summary(sft: Config, rl: Config, warm, rl_evals: list[dict], run_dir: Path) -> str:
    """The demo's closing lines: held-out accuracy of the base model, after the warm start and after RL (each
    with its 95% interval and n, and where it was measured), and where the curves are."""
    def acc(r: dict | None) -> str:
        if r is None:
            return "not measured"
        return f"{r['eval/accuracy']:.3f} (95% CI {r['eval/accuracy_ci_low']:.3f}-{r['eval/accuracy_ci_high']:.3f}, n={r['eval/n']})"

    sft_evals = warm.evaluations()
    base = next((r for r in sft_evals if r["step"] == 0), None)
    after_sft = next((r for r in sft_evals if r["step"] == sft.train.steps), None)  # None: eval.n_prompts is 0
    fn = next(f for f in sft.reward.functions if f.name == sft.reward.correctness)
    how = fn.name + (f" ({', '.join(f'{k}={v}' for k, v in fn.kwargs.items())})" if fn.kwargs else "")
    if (fn.name, fn.kwargs.get("field")) == ("task", "outcome"):
        how += ": the gym grader's strict outcome"
    name = rl.algorithm.name.upper()
    when = f"measured when the cached warm start was trained, {mtime(warm.final)}" if warm.reused else "this run"
    rows = [
        (f"base model ({sft.model.name})", acc(base) if base else "not measured (the warm start's eval.before is off)",
         f"the warm start's step-0 evaluation, {when}" if base else "docs/tasks.md has base rates (without tools)"),
        (f"after the warm start ({sft.train.steps} SFT steps)", acc(after_sft), f"its final evaluation, {when}"),
    ]
    rl_before = next((r for r in rl_evals if r["step"] == 0), None)
    if rl_before:
        rows.append((f"before {name} (the warm start, merged)", acc(rl_before), "this run, step 0"))
    if rl_evals and rl_evals[-1]["step"] > 0:
        n = rl_evals[-1]["step"]
        rows.append((f"after {name} ({n} step{'s' * (n != 1)})", acc(rl_evals[-1]), "this run"))
    width = max(len(r[0]) for r in rows)
    # check_same_evaluation makes the warm start's and the RL run's problems the same; only the base model's
    # evaluation can hold fewer of them (its first eval.before_n_prompts)
    fewer = base is not None and any(base["eval/n"] < r["eval/n"] for r in (after_sft, *rl_evals) if r)
    same = "the same held-out problems in every line" + (
        f", the base model on the first {base['eval/n']} of them (eval.before_n_prompts)" if fewer else "")
    lines = [f"summary: held-out greedy accuracy by reward.correctness {how}; {same}",
             *(f"  {label:<{width}}  {value}  [{where}]" for label, value, where in rows)]
    if not rl_before:
        lines.append(f"  ({name} starts from the warm start: its 'before' is the warm start's line, not evaluated again)")
    paired = paired_line(warm.path, run_dir, name)
    if paired:
        lines.append(paired)
    if accuracy_plot(rows, run_dir / "demo_accuracy.png", [base, after_sft, rl_evals[-1] if rl_evals else None]):
        lines.append(f"plot: {run_dir / 'demo_accuracy.png'} (the lines above on one axis, with their intervals)")
    lines.append(f"curves: {run_dir / 'curves.png'} ({name}), {warm.path / 'curves.png'} (the warm start; copied to "
                 f"{run_dir / 'warm_start_curves.png'}); run directory {run_dir}")
    return "\n".join(lines)


def paired_line(warm_dir: Path, rl_dir: Path, name: str) -> str | None:
    """One line: the warm start's and the RL run's last evaluations compared problem by problem (exact McNemar),
    or None when either kept no answers with ids."""
    from cohortrl.stats import mcnemar_exact
    from cohortrl.study import final_answers

    warm, rl = final_answers(warm_dir)[0], final_answers(rl_dir)[0]
    common = sorted(set(warm) & set(rl))
    if not common:
        return None
    only_warm = sum(warm[i] and not rl[i] for i in common)
    only_rl = sum(rl[i] and not warm[i] for i in common)
    p = mcnemar_exact(only_warm, only_rl)
    return (f"paired on the same {len(common)} problems: only the warm start right {only_warm}, only after {name} "
            f"right {only_rl}; exact McNemar p = {p:.3g}" + (" (a difference beyond chance at 0.05)" if p < 0.05 else
                                                             " (not distinguishable from chance at 0.05)"))


# The study behind the shipped demo: its design at 3 seeds per arm (docs/engineering.md, python_function level 1
# from level-2 references, the cosine warm start), the folders `cohortrl report --keep` committed, the report made
# from them, and what each arm is, in words.
DEMO_STUDY = Path(__file__).resolve().parent.parent / "docs" / "engineering" / "pyfunc_cos_runs"
DEMO_STUDY_REPORT = "docs/engineering/pyfunc_cos_g16.md"
DEMO_STUDY_ARMS = (("pf_ws_cos", "the warm start"), ("pf_grpo_cos_g16", "GRPO at G 16"),
                   ("pf_control_cos", "the warm start continued by SFT for GRPO's wall time"),
                   ("pf_grpo_cos", "GRPO at G 8"))


def study_line(study: Path, arms: tuple[tuple[str, str], ...], where: str) -> str | None:
    """One line: what each arm of the committed study behind the demo (``where`` names its report) scored at each
    seed's last evaluation, recomputed from the study's committed files; None when the study is not there (an
    installed package ships no docs/) or has no finished run."""
    from cohortrl.study import load_sweep

    parts = []
    for folder, words in arms:
        if not (study / folder / "sweep.json").is_file():
            continue
        evals = [run.final_eval for arm in load_sweep(study / folder) for run in arm.runs if run.final_eval]
        if evals:
            steps = "/".join(str(s) for s in sorted({e["step"] for e in evals}))
            accs = ", ".join(format(e["eval/accuracy"], ".3f") for e in evals)
            parts.append(f"{words} {accs} ({len(evals)} seed{'s' * (len(evals) != 1)}, step {steps})")
    if not parts:
        return None
    return f"the same design with controls ({where}, held-out accuracy per seed): " + "; ".join(parts)


def accuracy_plot(rows: list[tuple[str, str, str]], png: Path, evals: list[dict | None]) -> bool:
    """The base model, the warm start and the RL run's last evaluation on one axis, each with its Wilson 95%
    interval; False (nothing written) when fewer than two were measured."""
    points = [(label.split(" (")[0], e) for (label, _, _), e in zip(rows[:2] + rows[-1:], evals) if e is not None]
    if len(points) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for x, (label, e) in enumerate(points):
        acc = e["eval/accuracy"]
        ax.errorbar([x], [acc], yerr=[[acc - e["eval/accuracy_ci_low"]], [e["eval/accuracy_ci_high"] - acc]],
                    fmt="o", capsize=4, color="C0")
        ax.annotate(f"{acc:.3f}", (x, acc), textcoords="offset points", xytext=(8, 0), va="center")
    ax.set_xticks(range(len(points)), [f"{label}\n(n={e['eval/n']})" for label, e in points], fontsize=8)
    ax.set_xlim(-0.5, len(points) - 0.5)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy")  # each point's n under its name: the base model may be on fewer
    ax.set_title("the same held-out problems, 95% Wilson intervals", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True
