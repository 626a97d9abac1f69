"""``cohortrl report SWEEP_DIR --out NAME``: a sweep's arms over their seeds, and each arm paired against a
baseline arm on the same held-out problems.

Per arm: every seed's final held-out accuracy with its Wilson 95% interval, the mean and the sample sd over
seeds, any logged step metric (``--metrics``: each seed's mean over its last K training steps, then mean and sd
over seeds), and the runs' summed wall and CPU time (``sweep.jsonl``). Per arm against the baseline: for each
seed present in both, the problems only one of the two got right and the exact McNemar p-value; over all seed
pairs, the mean paired difference with a two-level bootstrap interval (seeds, then problems: ``stats``). Within
each arm, every pair of its seeds the same way (exact McNemar), and how many problems every seed got right.
Where the sweep recorded them, the machines the runs ran on (the same seed rounds differently on another one).
Problems are matched by id (``data.problem_id``): only those both runs answered count, and the table says how
many. ``NAME.md`` holds the tables, ``NAME.png`` each arm's last evaluation per seed on one axis, then the curves
(:func:`plot`).

Everything is read from files a study can commit: ``sweep.json``, ``sweep.jsonl`` and per run ``metrics.jsonl``
and ``answers.jsonl.gz`` (or the run's own ``eval_completions.jsonl``). ``--keep DIR`` copies exactly those into
DIR, and ``cohortrl report DIR`` then regenerates the same tables from the copy.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from cohortrl import machine
from cohortrl.stats import mcnemar_exact, mean_interval, paired_bootstrap, wilson_interval
from cohortrl.sweep import ATTEMPTS, SPEC, arms, read_attempts
from cohortrl.trainers.evaluate import ANSWERS, export_answers, read_answers
from cohortrl.trainers.metrics import read_metrics

LEVEL_IN_ID = re.compile(r"/L(\d+)/")  # a gym problem's id: FAMILY/L{level}/s{seed}/{index} (tasks/base.py)


def final_answers(run_dir: Path) -> tuple[dict[str, bool], dict[str, str]]:
    """At the run's last evaluation: problem id → correct (answers written before ids existed have none: {}),
    and problem id → its part of the held-out set: "unseen" or "seen" where the run marked them
    (``data.exclude_from_training``), else "level N" where its problems span several levels (``data.levels``),
    else {}."""
    return final_of(read_answers(run_dir))


def final_of(rows: list[dict]) -> tuple[dict[str, bool], dict[str, str]]:
    """:func:`final_answers` from a run's answers (``read_answers``)."""
    if not rows:
        return {}, {}
    last = max(r["step"] for r in rows)
    rows = [r for r in rows if r["step"] == last and r.get("id")]
    answers = {r["id"]: bool(r["correct"]) for r in rows}
    parts = {r["id"]: "unseen" if r["unseen"] else "seen" for r in rows if r.get("unseen") is not None}
    if not parts:
        levels = {i: m.group(1) for i in answers if (m := LEVEL_IN_ID.search(i))}
        if len(set(levels.values())) > 1:
            parts = {i: f"level {n}" for i, n in levels.items()}
    return answers, parts


def start_answers(rows: list[dict]) -> tuple[int | None, dict[str, bool], int | None]:
    """From a run's answers (``read_answers``): its evaluation before its first step (``eval.before``), when it
    evaluated again later: (0, problem id → correct, the last evaluation's step); else (None, {}, None)."""
    rows = [r for r in rows if r.get("id")]
    steps = sorted({r["step"] for r in rows})
    if len(steps) < 2 or steps[0] != 0:
        return None, {}, None
    return steps[0], {r["id"]: bool(r["correct"]) for r in rows if r["step"] == steps[0]}, steps[-1]


def sampled_answers(rows: list[dict]) -> tuple[dict[str, float], dict[str, float], int]:
    """From a run's answers (``read_answers``): where its last evaluation (the one the greedy tables read) drew k
    samples per problem (``eval.pass_k``), problem id → the fraction of them right there and at step 0 (empty where
    step 0 was not evaluated or drew none), and k; else ({}, {}, 0)."""
    rows = [r for r in rows if r.get("id")]
    if not rows:
        return {}, {}, 0
    last = max(r["step"] for r in rows)

    def fractions(step: int) -> dict[str, float]:
        return {r["id"]: r["sampled_correct"] / r["samples"] for r in rows if r["step"] == step and r.get("samples")}

    final = fractions(last)
    if not final:
        return {}, {}, 0
    ks = {r["samples"] for r in rows if r["step"] == last and r.get("samples")}
    return final, (fractions(0) if last != 0 else {}), ks.pop() if len(ks) == 1 else 0


@dataclass
class SeedRun:
    seed: int
    path: Path
    rows: list[dict]
    answers: dict[str, bool]
    parts: dict[str, str] = field(default_factory=dict)  # problem id → "unseen" / "seen" or "level N" (final_answers)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    machines: list[str] = field(default_factory=list)  # each attempt's machine (machine.label), first seen first
    start_step: int | None = None  # 0 where the run evaluated before training and again later (start_answers)
    start: dict[str, bool] = field(default_factory=dict)
    last_step: int | None = None  # then: the step of the last evaluation, which ``answers`` holds
    # eval.pass_k: problem id → fraction of the k samples right, at the last evaluation and at step 0 (sampled_answers)
    sampled: dict[str, float] = field(default_factory=dict)
    start_sampled: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    @property
    def final_eval(self) -> dict | None:
        evals = [r for r in self.rows if "eval/accuracy" in r]
        return evals[-1] if evals else None

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.rows if not any(k.startswith("eval/") for k in r)]


@dataclass
class Arm:
    name: str
    runs: list[SeedRun] = field(default_factory=list)


def load_sweep(directory: Path) -> list[Arm]:
    """The sweep's arms, in its grid's order, each with the seeds whose run finished (an attempt with rc 0 in
    ``sweep.jsonl``): a sweep still running, or stopped, is reported on its finished runs only."""
    directory = Path(directory)
    spec_path = directory / SPEC
    if not spec_path.is_file():
        raise FileNotFoundError(f"{directory} is not a sweep directory (no {SPEC}); `cohortrl sweep ... --out DIR` makes one")
    spec = json.loads(spec_path.read_text())
    times: dict[tuple[str, int], list[float]] = {}
    machines: dict[tuple[str, int], list[str]] = {}
    finished = set()
    for a in read_attempts(directory):
        t = times.setdefault((a["arm"], a["seed"]), [0.0, 0.0])
        t[0] += a["wall_s"]
        t[1] += a["cpu_s"]
        seen = machines.setdefault((a["arm"], a["seed"]), [])
        where = machine.label(a["machine"]) if "machine" in a else None
        if where is not None and where not in seen:
            seen.append(where)
        if a["rc"] == 0:
            finished.add((a["arm"], a["seed"]))
    out = []
    for name, _ in arms(spec["grid"]):
        arm = Arm(name)
        for seed in spec["seeds"]:
            path = directory / name / f"seed{seed}"
            if (name, seed) in finished and (path / "metrics.jsonl").is_file():
                wall, cpu = times.get((name, seed), (0.0, 0.0))
                rows = read_answers(path)  # once: the final, step-0 and sampled answers all come from it
                answers, parts = final_of(rows)
                arm.runs.append(SeedRun(seed, path, read_metrics(path), answers, parts, wall, cpu,
                                        machines.get((name, seed), []), *start_answers(rows), *sampled_answers(rows)))
        out.append(arm)
    return out


def load_sweeps(directories: list[Path]) -> list[Arm]:
    """The arms of one sweep (named as in its grid), or of several sweeps side by side: a study whose arms need
    different commands (an SFT warm start and control, GRPO and RFT runs) is one sweep per command, with the
    same seeds and ``data.seed``. With several, an arm is named by its sweep's folder (``pf_grpo``), followed by
    its grid name where the sweep has a grid (``pf_rl/algorithm.name=rft``)."""
    directories = [Path(d) for d in directories]
    if len(directories) == 1:
        return load_sweep(directories[0])
    names = [d.name for d in directories]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two sweep folders are named {twice[0]!r}: the arms are named by folder, so give folders "
                         "with different names")
    out = []
    for d in directories:
        for arm in load_sweep(d):
            arm.name = d.name if arm.name == "base" else f"{d.name}/{arm.name}"
            out.append(arm)
    return out


def keep(directory: Path, dest: Path) -> Path:
    """Copy what the report reads (and each run's config) into ``dest``: a folder small enough to commit, from
    which ``cohortrl report dest`` regenerates the same tables."""
    directory, dest = Path(directory), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in (SPEC, ATTEMPTS):
        if (directory / name).is_file():
            shutil.copyfile(directory / name, dest / name)
    for arm in load_sweep(directory):
        for run in arm.runs:
            target = dest / arm.name / f"seed{run.seed}"
            target.mkdir(parents=True, exist_ok=True)
            for name in ("config.yaml", "metrics.jsonl"):
                if (run.path / name).is_file():
                    shutil.copyfile(run.path / name, target / name)
            if not (run.path / ANSWERS).is_file():
                export_answers(run.path)
            if (run.path / ANSWERS).is_file():
                shutil.copyfile(run.path / ANSWERS, target / ANSWERS)
    return dest


# ------------------------------------------------------------------------------------------ the numbers
def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def arm_summary(arm: Arm, metrics: list[str], last_k: int) -> dict:
    """Per seed: final accuracy (acc, low, high, n, step); over seeds: mean and sd of the accuracy and of each
    metric's last-K mean; summed wall and CPU time."""
    per_seed = []
    for run in arm.runs:
        e = run.final_eval
        if e is not None:
            n = int(e["eval/n"])
            lo, hi = wilson_interval(round(e["eval/accuracy"] * n), n)
            per_seed.append((run.seed, e["eval/accuracy"], lo, hi, n, e["step"]))
    out = {"per_seed": per_seed, "accuracy": _mean_sd([s[1] for s in per_seed]),
           "wall_s": sum(r.wall_s for r in arm.runs), "cpu_s": sum(r.cpu_s for r in arm.runs), "metrics": {}}
    for key in metrics:
        seeds = []
        for run in arm.runs:
            values = [r[key] for r in run.train_rows if r.get(key) is not None][-last_k:]
            if values:
                seeds.append(statistics.fmean(values))
        out["metrics"][key] = _mean_sd(seeds)
    return out


def _discordant(a: dict[str, bool], b: dict[str, bool], ids) -> tuple[int, int]:
    """Of the problems ``ids``: how many only ``a`` got right, and how many only ``b`` (McNemar's two counts)."""
    return sum(a[i] and not b[i] for i in ids), sum(b[i] and not a[i] for i in ids)


def paired(base: Arm, other: Arm, resamples: int = 10_000, part: str | None = None) -> dict:
    """``other`` against ``base`` on the problems both answered, seed by seed: per seed (seed, n, only base
    right, only other right, McNemar p); and the bootstrap's (mean difference, low, high) over all seed pairs
    (None when no seed pair shares a problem). ``part`` (one of :func:`final_answers`' parts: "unseen", "seen",
    "level N"): only the problems both runs put in it."""
    base_by_seed = {r.seed: r for r in base.runs}
    per_seed, diffs = [], []
    for run in other.runs:
        b = base_by_seed.get(run.seed)
        if b is None:
            continue
        common = sorted(set(b.answers) & set(run.answers))
        if part is not None:
            common = [i for i in common if b.parts.get(i) == part and run.parts.get(i) == part]
        if not common:
            continue
        only_base, only_other = _discordant(b.answers, run.answers, common)
        per_seed.append((run.seed, len(common), only_base, only_other, mcnemar_exact(only_base, only_other)))
        diffs.append([int(run.answers[i]) - int(b.answers[i]) for i in common])
    return {"per_seed": per_seed, "bootstrap": paired_bootstrap(diffs, resamples) if diffs else None}


def seed_agreement(arm: Arm) -> dict:
    """An arm's seeds against each other on the problems each pair answered: per pair (seed a, seed b, n, only a
    right, only b right, McNemar p), and over the problems every seed answered (n, right at every seed, right at
    one or more). A recipe whose seeds agree has pairs that differ by no more than chance."""
    runs = [r for r in arm.runs if r.answers]
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            common = sorted(set(a.answers) & set(b.answers))
            if common:
                only_a, only_b = _discordant(a.answers, b.answers, common)
                pairs.append((a.seed, b.seed, len(common), only_a, only_b, mcnemar_exact(only_a, only_b)))
    shared = set.intersection(*(set(r.answers) for r in runs)) if runs else set()
    return {"pairs": pairs, "n": len(shared), "all": sum(all(r.answers[k] for r in runs) for k in shared),
            "any": sum(any(r.answers[k] for r in runs) for k in shared)}


# ------------------------------------------------------------------------------------------ the files
def _f(x, fmt=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ci(mean: float, low: float, high: float) -> str:
    """A difference with its bootstrap interval, as every paired table writes it."""
    return f"{mean:+.3f} ({low:+.3f} to {high:+.3f})"


def _p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def markdown(arms_: list[Arm], baseline: str, metrics: list[str], last_k: int, command: str, checks: bool = False) -> str:
    summaries = {a.name: arm_summary(a, metrics, last_k) for a in arms_}
    head = ["arm", "seeds", "held-out accuracy per seed (95% CI)", "mean", "sd",
            *[f"{k} (last {last_k} steps), mean ± sd" for k in metrics], "wall s", "CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in arms_:
        s = summaries[a.name]
        seeds = "; ".join(f"s{seed} {acc:.3f} ({lo:.3f}-{hi:.3f}, n={n}, step {step})"
                          for seed, acc, lo, hi, n, step in s["per_seed"]) or "–"
        mean, sd = s["accuracy"]
        cells = [a.name, str(len(s["per_seed"])), seeds, _f(mean), _f(sd),
                 *[f"{_f(s['metrics'][k][0], '.4g')} ± {_f(s['metrics'][k][1], '.2g')}" for k in metrics],
                 _f(s["wall_s"], ".0f"), _f(s["cpu_s"], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    text += _agreement_section(arms_)
    base = next(a for a in arms_ if a.name == baseline)
    rows = _paired_rows(arms_, base, None)
    if rows:
        text += (f"\n\nPaired against **{baseline}** on the same held-out problems (matched by id, the final "
                 "evaluation of each run, seed k against seed k):\n\n" + _PAIRED_HEAD + "\n".join(rows))
    text += _start_section(arms_)
    if any(run.sampled for a in arms_ for run in a.runs):
        text += _sampled_section(arms_, base)
    if any(run.parts for a in arms_ for run in a.runs):
        text += _parts_section(arms_, base)
    text += _checks_section(arms_) if checks else ""
    text += _machines_section(arms_)
    text += (f"\n\nAccuracy: greedy, strict, at each run's last evaluation, Wilson 95% interval; sd: sample sd over "
             f"seeds; only runs that finished are reported. Bootstrap: 10,000 resamples of seed pairs and, within each, of "
             f"problems (numpy seed 0). Wall and CPU s: every attempt at the arm's finished runs, summed (sweep.jsonl).\n\n"
             f"Regenerate: `{command}`\n")
    return text


_PAIRED_HEAD = ("| arm | per seed: only baseline right / only this arm right of n shared, exact McNemar p | "
                "difference in accuracy, bootstrap 95% CI (seeds × problems) |\n|---|---|---|\n")


def _paired_rows(arms_: list[Arm], base: Arm, part: str | None) -> list[str]:
    rows = []
    for a in arms_:
        if a is base:
            continue
        c = paired(base, a, part=part)
        seeds = "; ".join(f"s{seed}: {ob}/{oo} of {n}, p={_p(p)}" for seed, n, ob, oo, p in c["per_seed"]) or "no shared problems"
        if c["bootstrap"] is None:
            diff = "–"
        else:
            diff = _ci(*c["bootstrap"])
        rows.append(f"| {a.name} | {seeds} | {diff} |")
    return rows


def from_start(arm: Arm, resamples: int = 10_000) -> dict:
    """Each run's last evaluation against its evaluation at step 0 (``eval.before``: the model it started from), on the
    problems both answered: per seed (seed, first step, last step, n, only first right, only last right, McNemar
    p); and the bootstrap's (mean difference, low, high) over seeds (None when no run evaluated twice)."""
    per_seed, diffs = [], []
    for run in arm.runs:
        common = sorted(set(run.start) & set(run.answers))
        if run.start_step is None or not common:
            continue
        only_first, only_last = _discordant(run.start, run.answers, common)
        per_seed.append((run.seed, run.start_step, run.last_step, len(common), only_first, only_last,
                         mcnemar_exact(only_first, only_last)))
        diffs.append([int(run.answers[i]) - int(run.start[i]) for i in common])
    return {"per_seed": per_seed, "bootstrap": paired_bootstrap(diffs, resamples) if diffs else None}


def _start_section(arms_: list[Arm]) -> str:
    """What each arm's runs gained over the model each started from (:func:`from_start`); empty where no run
    evaluated at step 0 and again later."""
    rows = []
    for a in arms_:
        c = from_start(a)
        if not c["per_seed"]:
            continue
        seeds = "; ".join(f"s{seed} step {first} → {last}: {of}/{ol} of {n}, p={_p(p)}"
                          for seed, first, last, n, of, ol, p in c["per_seed"])
        rows.append(f"| {a.name} | {seeds} | {_ci(*c['bootstrap'])} |")
    if not rows:
        return ""
    return ("\n\nEach run against its own evaluation at step 0 (the model it started from), on the same held-out problems:"
            "\n\n| arm | per seed: only step 0 right / only the last evaluation right of n shared, exact McNemar p | "
            "difference in accuracy, bootstrap 95% CI (seeds × problems) |\n|---|---|---|\n" + "\n".join(rows))


def sampled_paired(pairs: list[tuple[int, dict[str, float], dict[str, float]]], resamples: int = 10_000) -> dict:
    """Sampled accuracy (each problem's fraction of k samples right), B against A on the problems both drew:
    ``pairs`` holds (seed, A's fractions, B's fractions). Per seed (seed, n, A's mean, B's mean, B − A with the
    bootstrap's 95% interval over its problems); and over seeds the two-level bootstrap's (mean, low, high)."""
    per_seed, diffs = [], []
    for seed, a, b in pairs:
        common = sorted(set(a) & set(b))
        if not common:
            continue
        d = [b[i] - a[i] for i in common]
        mean, lo, hi = paired_bootstrap([d], resamples)
        per_seed.append((seed, len(common), statistics.fmean(a[i] for i in common),
                         statistics.fmean(b[i] for i in common), mean, lo, hi))
        diffs.append(d)
    return {"per_seed": per_seed, "bootstrap": paired_bootstrap(diffs, resamples) if diffs else None}


def _sampled_section(arms_: list[Arm], base: Arm) -> str:
    """Sampled accuracy (eval.pass_k): per arm and seed, with its interval over problems; each arm paired with the
    baseline and each run with its own step 0, on per-problem fractions of the k samples right."""
    ks = sorted({run.samples for a in arms_ for run in a.runs if run.samples}) or ["k (varied within a run)"]
    lines = ["| arm | per seed: sampled accuracy (95% CI over problems, n) |", "|---|---|"]
    for a in arms_:
        cells = []
        for run in a.runs:
            if run.sampled:
                mean, low, high = mean_interval(list(run.sampled.values()))
                cells.append(f"s{run.seed} {mean:.3f} ({low:.3f}-{high:.3f}, n={len(run.sampled)})")
        lines.append(f"| {a.name} | {'; '.join(cells) or '–'} |")
    text = (f"\n\nSampled accuracy: {' or '.join(map(str, ks))} samples per held-out problem at the evaluation's temperature "
            "(`eval.pass_k`), each problem's fraction right; the greedy tables above do not see a policy that only "
            "sharpens its sampling:\n\n" + "\n".join(lines))

    def rows(pairs_of) -> list[str]:
        out = []
        for a in arms_:
            c = sampled_paired(pairs_of(a))
            if not c["per_seed"]:
                continue
            seeds = "; ".join(f"s{seed} {ma:.3f} → {mb:.3f}: {_ci(d, lo, hi)}" for seed, n, ma, mb, d, lo, hi in c["per_seed"])
            out.append(f"| {a.name} | {seeds} | {_ci(*c['bootstrap'])} |")
        return out

    head = ("| arm | per seed: {what} → this, difference (bootstrap 95% CI over problems) | difference, bootstrap 95% CI "
            "(seeds × problems) |\n|---|---|---|\n")
    base_by_seed = {r.seed: r for r in base.runs}
    against_base = rows(lambda a: [] if a is base else [
        (r.seed, base_by_seed[r.seed].sampled, r.sampled) for r in a.runs if r.seed in base_by_seed])
    if against_base:
        text += (f"\n\nSampled accuracy paired against **{base.name}**, seed k against seed k, problem by problem:\n\n"
                 + head.format(what="baseline") + "\n".join(against_base))
    elif not any(r.sampled for r in base.runs):
        text += f"\n\nThe baseline **{base.name}** drew no samples at its last evaluation: no arm is paired with it on sampled accuracy."
    against_start = rows(lambda a: [(r.seed, r.start_sampled, r.sampled) for r in a.runs if r.start_sampled])
    if against_start:
        text += ("\n\nSampled accuracy of each run against its own step 0, problem by problem:\n\n"
                 + head.format(what="step 0") + "\n".join(against_start))
    return text


def _agreement_section(arms_: list[Arm]) -> str:
    """Each arm's seeds against each other (:func:`seed_agreement`); empty where no arm has two seeds with answers."""
    rows = []
    for a in arms_:
        g = seed_agreement(a)
        if g["pairs"]:
            pairs = "; ".join(f"s{sa} v s{sb}: {oa}/{ob} of {n}, p={_p(p)}" for sa, sb, n, oa, ob, p in g["pairs"])
            rows.append(f"| {a.name} | {pairs} | {g['all']} / {g['any']} of {g['n']} |")
    if not rows:
        return ""
    return ("\n\nSeeds of an arm against each other on the same held-out problems (final evaluations):\n\n"
            "| arm | per seed pair: only the first right / only the second right of n shared, exact McNemar p | "
            "right at every seed / at one or more, of n |\n|---|---|---|\n" + "\n".join(rows))


def answer_checks(rows: list[dict]) -> dict | None:
    """What reward hacking leaves in a run's last greedy answers on gym problems (``read_answers``; None for
    other data): ``lines``, non-blank lines per response (padding raises it); ``distinct``, the share of a
    response's lines not repeating an earlier one, over all lines (repetition lowers it); ``tokens``, the mean
    length; ``unsupported``, answers right by the outcome with a required step not stated correctly, of ``right``,
    the right answers to problems that have required steps (read as the process reward reads them: free-text
    statements where the family has them, else its keyed lines); ``unsupported_rewrites``, the same with rewriting
    chains (``7 * 8 + 9 = 56 + 9 = 65``) read as steps, as ``task_steps`` does with ``rewrites``.
    A process reward is paid per stated step and the outcome per answer, so these are what the two can disagree on."""
    from cohortrl import tasks
    from cohortrl.rewards.process import normalised_steps

    rows = [r for r in rows if r.get("id")]
    last = max((r["step"] for r in rows), default=None)
    found = [(r, sample) for r in rows if r["step"] == last and (sample := tasks.sample_from_id(r["id"])) is not None]
    if not found:
        return None
    n_lines = n_distinct = right = unsupported = unsupported_rewrites = 0
    for r, sample in found:
        text = r.get("completion") or ""
        lines = normalised_steps(text)  # as the training step's unique_step_ratio reads them
        n_lines, n_distinct = n_lines + len(lines), n_distinct + len(set(lines))
        family = tasks.get(sample.family)
        try:
            steps = family.grade_statements(sample, text)
            chained = family.grade_statements(sample, text, rewrites=True)
        except ValueError:  # a family whose steps carry units and names: its keyed lines, before the commitment gate
            steps = chained = family.grade(sample, text).stated
        right += bool(r["correct"]) and bool(steps)  # a problem with no required step (arithmetic level 1) has nothing to skip
        unsupported += bool(r["correct"]) and not all(s.correct for s in steps)
        unsupported_rewrites += bool(r["correct"]) and not all(s.correct for s in chained)
    return {"n": len(found), "lines": n_lines / len(found), "distinct": n_distinct / n_lines if n_lines else None,
            "tokens": sum(r.get("length") or 0 for r, _ in found) / len(found), "right": right, "unsupported": unsupported,
            "unsupported_rewrites": unsupported_rewrites}


def _checks_section(arms_: list[Arm]) -> str:
    """:func:`answer_checks` per arm and seed; empty where no run answered gym problems."""
    rows = []
    for a in arms_:
        checks = [(run.seed, answer_checks(read_answers(run.path))) for run in a.runs]
        checks = [(seed, c) for seed, c in checks if c is not None]
        if checks:
            rows.append(f"| {a.name} | " + " | ".join("; ".join(cell(c) for _, c in checks) for cell in (
                lambda c: f"{c['lines']:.2f}", lambda c: _f(c["distinct"]), lambda c: f"{c['tokens']:.1f}",
                lambda c: f"{c['unsupported']}/{c['right']}", lambda c: f"{c['unsupported_rewrites']}/{c['right']}"))
                + f" | {', '.join(f's{seed}' for seed, _ in checks)} |")
    if not rows:
        return ""
    return ("\n\nWhat a hacked reward leaves in the final greedy answers (`answer_checks`; per seed, in the order of the "
            "last column):\n\n| arm | lines per response | distinct-line share | tokens | right by the outcome with a "
            "required step not stated correctly / right, on problems with required steps | the same, rewriting chains "
            "(`7 * 8 + 9 = 56 + 9`) read as steps | seeds |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def _machines_section(arms_: list[Arm]) -> str:
    """Which runs ran on which machine, from the sweep's attempts; empty for sweeps that did not record it (made
    before it was recorded). A run resumed on another machine is listed under each."""
    runs = [(a.name, r) for a in arms_ for r in a.runs]
    if not any(r.machines for _, r in runs):
        return ""
    labels = list(dict.fromkeys(m for _, r in runs for m in r.machines))
    unrecorded = [f"{name} s{r.seed}" for name, r in runs if not r.machines]
    if len(labels) == 1 and not unrecorded:
        return f"\n\nEvery run ran on one machine: {labels[0]}."
    rows = [f"| {m} | {', '.join(f'{name} s{r.seed}' for name, r in runs if m in r.machines)} |" for m in labels]
    if unrecorded:
        rows.append(f"| not recorded | {', '.join(unrecorded)} |")
    head = ("The runs ran on more than one machine: a difference between runs on two machines is rounding as well as "
            "whatever the arms change." if len(labels) > 1 else
            "Not every run recorded its machine (sweeps made before it was recorded), so whether all shared one is "
            "not known.")
    return f"\n\n{head}\n\n| machine | runs |\n|---|---|\n" + "\n".join(rows)


def _parts_section(arms_: list[Arm], base: Arm) -> str:
    """Accuracy and the paired test on each part of the held-out set: the problems no training prompt of the run
    had (unseen) and the others (seen), for runs trained with ``data.exclude_from_training``; or each level of a
    mix (``data.levels``)."""
    names = {p for a in arms_ for run in a.runs for p in run.parts.values()}
    by_level = not names & {"unseen", "seen"}
    order = sorted(names, key=lambda p: int(p.split()[1])) if by_level else ["unseen", "seen"]
    lines = ["| arm | " + " | ".join(f"{part}: accuracy per seed (95% CI, n)" for part in order) + " |",
             "|---|" + "---|" * len(order)]
    for a in arms_:
        cells = []
        for part in order:
            per_seed = []
            for run in a.runs:
                ids = [i for i, p in run.parts.items() if p == part and i in run.answers]
                if ids:
                    hits = sum(run.answers[i] for i in ids)
                    lo, hi = wilson_interval(hits, len(ids))
                    per_seed.append(f"s{run.seed} {hits / len(ids):.3f} ({lo:.3f}-{hi:.3f}, n={len(ids)})")
            cells.append("; ".join(per_seed) or "–")
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    what = ("each level of the mix (`data.levels`; a run without it shows –)" if by_level else
            "**unseen**, the problems whose `data.exclude_from_training` value no training prompt had; **seen**, the "
            "others (a run without the marks shows –)")
    text = f"\n\nBy part of the held-out set: {what}:\n\n" + "\n".join(lines)
    for part in order:
        rows = _paired_rows(arms_, base, part)
        if rows:
            text += f"\n\nPaired against **{base.name}** on the {part} problems only:\n\n" + _PAIRED_HEAD + "\n".join(rows)
    return text


def last_steps(arms_: list[Arm]) -> dict[str, int]:
    """Arm name -> the last step its runs logged (the longest seed's)."""
    return {a.name: max((r["step"] for run in a.runs for r in run.rows), default=0) for a in arms_}


def plot(arms_: list[Arm], png: Path, panels: list[str]) -> str:
    """First panel: each arm's last held-out evaluation, one dot per seed with its Wilson 95% interval, the arms
    side by side on one accuracy axis (a warm start of 250 SFT steps and a GRPO run of 20 compare there, not on
    a step axis). Then the curves (held-out accuracy's only where a run evaluated more than once), one thin line per seed, the arm's mean bold and its min-max band shaded;
    over the step when every arm ran as many steps, else over the fraction of each arm's own steps (the legend
    gives them), since one step of SFT and one of GRPO are not the same amount of anything. Returns the curves'
    x-axis label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = last_steps(arms_)
    same_length = len(set(last.values())) == 1
    curves = any(sum("eval/accuracy" in r for r in run.rows) > 1 for a in arms_ for run in a.runs)
    keys = [*([("eval/accuracy", "held-out accuracy (greedy)")] if curves else []), *((k, k) for k in panels)]
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(5.5 * (1 + len(keys)), 4.2), squeeze=False)
    final_ax, curve_axes = axes.flat[0], list(axes.flat[1:])
    xlabel = "step" if same_length else "fraction of the arm's own steps (its count in the legend)"
    for i, arm in enumerate(arms_):
        colour = f"C{i % 10}"
        per_seed = arm_summary(arm, [], 1)["per_seed"]  # the table's numbers: (seed, acc, low, high, n, step)
        for j, (_, acc, lo, hi, _, _) in enumerate(per_seed):
            x = i + (j - (len(per_seed) - 1) / 2) * 0.12
            final_ax.errorbar([x], [acc], yerr=[[acc - lo], [hi - acc]], fmt="o", capsize=3, color=colour, markersize=4)
        if per_seed:
            final_ax.hlines(statistics.fmean(s[1] for s in per_seed), i - 0.3, i + 0.3, color=colour, linewidth=2)
    final_ax.set_xticks(range(len(arms_)), [a.name for a in arms_], rotation=20, ha="right", fontsize=7)
    final_ax.set_xlim(-0.6, len(arms_) - 0.4)
    final_ax.set_title("last held-out evaluation: each seed, 95% interval; bar = mean", fontsize=9)
    final_ax.set_ylabel("held-out accuracy (greedy)")
    for ax, (key, title) in zip(curve_axes, keys):
        for i, arm in enumerate(arms_):
            colour = f"C{i % 10}"
            scale = 1 if same_length else max(last[arm.name], 1)
            series = []
            for run in arm.runs:
                pts = [(r["step"] / scale, r[key]) for r in run.rows if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colour, alpha=0.35, linewidth=0.8)
                    series.append(dict(pts))
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if steps:
                values = [[s[t] for s in series] for t in steps]
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.15)
                ax.plot(steps, [statistics.fmean(v) for v in values], color=colour, linewidth=2,
                        marker="o" if len(steps) < 12 else None,
                        label=f"{arm.name} (n={len(series)}" + ("" if same_length else f", {last[arm.name]} steps") + ")")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
    if curve_axes:
        curve_axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return xlabel


def write_study_report(directories: list[Path], out: Path, *, baseline: str | None = None, metrics: list[str] = (),
                       panels: list[str] = ("reward_mean",), last_k: int = 5, keep_dir: Path | None = None,
                       answer_checks: bool = False) -> tuple[Path, Path]:
    """``out.md`` and ``out.png`` for the sweep in ``directories`` (or several sweeps side by side, see
    :func:`load_sweeps`; the module docstring says what is in them); returns both. ``keep_dir``: one sweep is
    copied into it, several each into ``keep_dir/FOLDER``. ``answer_checks``: add :func:`answer_checks`' table."""
    directories = [Path(d) for d in directories]
    arms_ = _arms_with_runs(directories)
    if keep_dir is not None:
        for d in directories:
            keep(d, keep_dir if len(directories) == 1 else Path(keep_dir) / d.name)
    out = Path(out)
    out = out.with_suffix("") if out.suffix in (".md", ".png") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    md = out.with_suffix(".md")
    png = out.with_suffix(".png")
    md.write_text(study_report_text(directories, out, baseline=baseline, metrics=metrics, panels=panels, last_k=last_k,
                                    arms_=arms_, answer_checks=answer_checks))
    plot(arms_, png, list(panels or []))
    return md, png


def _arms_with_runs(directories: list[Path]) -> list[Arm]:
    arms_ = [a for a in load_sweeps(directories) if a.runs]
    if not arms_:
        raise FileNotFoundError(f"{' '.join(map(str, directories))}: no run of the sweep has a metrics.jsonl yet")
    return arms_


def study_report_text(directories: list[Path], out: Path, *, baseline: str | None = None, metrics: list[str] = (),
                      panels: list[str] = ("reward_mean",), last_k: int = 5, arms_: list[Arm] | None = None,
                      answer_checks: bool = False) -> str:
    """The text of :func:`write_study_report`'s ``out.md`` (``out`` without its suffix), its Regenerate line
    included: what a committed report is checked against (``scripts/regenerate_reports.py``)."""
    arms_ = arms_ if arms_ is not None else _arms_with_runs([Path(d) for d in directories])
    names = [a.name for a in arms_]
    baseline = baseline or names[0]
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not an arm with runs; the arms: {', '.join(names)}")
    out = Path(out)
    command = " ".join(["cohortrl report", *map(str, directories), "--out", str(out), *(["--baseline", baseline] if baseline != names[0] else []),
                        *(["--metrics", *metrics] if metrics else []),
                        *(["--panels", *panels] if list(panels or []) != ["reward_mean"] else []),
                        *([f"--last-k {last_k}"] if last_k != 5 else []), *(["--answer-checks"] if answer_checks else [])])
    return (f"# {out.name}\n\n![curves]({out.with_suffix('.png').name})\n\n"
            + markdown(arms_, baseline, list(metrics), last_k, command, answer_checks))
