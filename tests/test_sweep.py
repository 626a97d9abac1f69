"""``cohortrl sweep``: each (arm, seed) a run directory; a sweep stopped anywhere and started again ends with the
results of a sweep never stopped; and the paired report over its arms (``cohortrl report SWEEP``)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cohortrl.config import ConfigError
from cohortrl.sweep import Sweep, arms, code_version, parse_grid, parse_seeds, split_values
from cohortrl.trainers.evaluate import ANSWERS, read_answers
from tests.trainers.test_grpo import VOLATILE

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_grpo.yaml")
# Three steps, a checkpoint after each, 4 held-out problems evaluated before and after: seconds per run.
RUN = ["train.steps=3", "train.checkpoint_every=1", "eval.n_prompts=4", "train.progress=false"]
SWEEP = ["--seeds", "1", "--grid", "algorithm.beta=0.0,0.04"]  # two runs: the second is the one the sweep is killed in


def sweep(out: Path, *extra, fault=None, new_session=False):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("COHORTRL_FAULT", None)
    if fault:
        env["COHORTRL_FAULT"] = fault  # passed on to every run the sweep starts
    cmd = [sys.executable, "-m", "cohortrl", "sweep", CONFIG, *RUN, "--out", str(out), *SWEEP, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=new_session)


def results(out: Path) -> dict:
    """Per run: its metrics without the timings, and its answers."""
    got = {}
    for run in sorted(out.glob("*/seed*/metrics.jsonl")):
        rows = [json.loads(line) for line in run.read_text().splitlines()]
        got[str(run.parent.relative_to(out))] = (
            [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows], read_answers(run.parent))
    return got


def attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def test_a_sweep_stopped_twice_and_started_again_equals_one_never_stopped(tmp_path):
    """Every run killed at its second update (SIGKILL), then the sweep itself killed while its second run trains,
    then the same command once more: each of the four runs' metrics and answers equal the uninterrupted sweep's
    exactly; finished runs were skipped and interrupted ones resumed, each attempt's times logged. (Two runs, one
    seed of two arms: each is killed, the sweep dies in the second; seeds × arms are expanded in the test below.)"""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    reference = sweep(full)  # alongside the chain below: 2 cores

    out, err = sweep(stopped, fault="update:2").communicate(timeout=600)
    assert "FAILED" in err
    assert [a["rc"] for a in attempts(stopped)] == [-signal.SIGKILL] * 2

    proc = sweep(stopped, new_session=True)
    deadline = time.monotonic() + 300
    while not any(a["rc"] == 0 for a in attempts(stopped)) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the run it started: a lost machine
    proc.communicate(timeout=60)

    out, err = sweep(stopped).communicate(timeout=600)
    assert "2 runs" in out and "FAILED" not in err, err
    assert reference.wait(timeout=600) == 0

    expected, got = results(full), results(stopped)
    assert sorted(got) == sorted(expected) and len(got) == 2
    for run in expected:
        assert got[run] == expected[run], run
        assert [r["step"] for r in got[run][0]] == [0, 1, 2, 3, 3]  # eval, three steps, eval: nothing twice
    log = attempts(stopped)
    assert {a["attempt"] for a in log[2:]} == {"resume"}  # each interrupted run continued from its checkpoint
    assert sum(a["rc"] == 0 for a in log) == 2 and all(a["wall_s"] > 0 and a["cpu_s"] > 0 for a in log)
    assert all(a["machine"]["cores"] > 0 and a["machine"]["torch"] for a in log)  # where each attempt ran
    assert all(a["code"].get("commit") == code_version().get("commit") for a in log)  # and on which code
    for run in expected:  # the answers are kept compressed with each finished run
        assert (stopped / run / ANSWERS).is_file()

    rerun = sweep(stopped).communicate(timeout=120)[0]
    assert "2 finished, 0 to run" in rerun


def test_the_code_a_run_starts_with_is_the_checkouts_commit_or_else_the_packages_version(monkeypatch):
    from importlib import metadata

    import cohortrl

    repo = Path(cohortrl.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (CI's clone, a developer's)
        code = code_version()
        assert code["commit"] == head.stdout.strip() and isinstance(code["uncommitted_changes"], bool)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert code_version() == {"version": metadata.version("cohortrl")}  # installed (here: editable) as cohortrl


def test_a_run_that_died_before_its_first_checkpoint_starts_again_and_a_finished_one_resumes(tmp_path):
    s = Sweep(tmp_path / "s", CONFIG, "train", parse_grid(["algorithm.beta=0"]), [3], ["train.steps=2"])
    run = s.runs[0]
    assert run.path == tmp_path / "s" / "algorithm.beta=0" / "seed3"
    assert run.overrides == ("train.steps=2", "algorithm.beta=0", "train.seed=3")
    cmd, kind = s.command_line(run)
    assert kind == "start" and cmd[-3:] == list(run.overrides) and "--overwrite" not in cmd
    run.path.mkdir(parents=True)
    (run.path / "config.yaml").write_text("{}")  # what a start leaves before its first checkpoint
    cmd, kind = s.command_line(run)
    assert kind == "restart" and cmd[-1] == "--overwrite" and CONFIG in cmd
    (run.path / "final").mkdir()  # killed after final/, before the sweep logged the run as done
    cmd, kind = s.command_line(run)
    assert kind == "resume" and cmd[-3:] == ["--run-dir", str(run.path), "--resume"] and CONFIG not in cmd


def test_seed_placeholders_grid_parsing_and_a_changed_definition(tmp_path):
    s = Sweep(tmp_path, CONFIG, "train", {}, [0, 2], ["model.init=runs/ws/base/seed{seed}/final"])
    assert [r.overrides[0] for r in s.runs] == ["model.init=runs/ws/base/seed0/final", "model.init=runs/ws/base/seed2/final"]
    assert [r.arm for r in s.runs] == ["base", "base"]
    assert split_values("[1,2],[3, 4],5") == ["[1,2]", "[3, 4]", "5"]
    assert [name for name, _ in arms(parse_grid(["a.b=1,2", "c=x"]))] == ["a.b=1+c=x", "a.b=2+c=x"]
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    grid = Sweep(tmp_path / "grid", CONFIG, "train", parse_grid(["algorithm.beta=0.0,0.04"]), [0, 1], [])
    assert [(r.arm, r.seed) for r in grid.runs] == [(a, seed) for a in ("algorithm.beta=0.0", "algorithm.beta=0.04")
                                                    for seed in (0, 1)]  # every arm at every seed
    for bad in (["a.b"], ["a.b="], ["a.b=1,1"], ["a.b=1", "a.b=2"]):
        with pytest.raises(ConfigError, match="--grid"):
            parse_grid(bad)
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds("0,x")
    s.claim()
    Sweep(tmp_path, CONFIG, "train", {}, [0, 1, 2], s.spec["overrides"]).claim()  # more seeds: the same sweep, extended
    assert json.loads((tmp_path / "sweep.json").read_text())["seeds"] == [0, 1, 2]
    with pytest.raises(ConfigError, match="holds another sweep"):
        Sweep(tmp_path, CONFIG, "train", {}, [0, 1, 2], ["train.steps=9"]).claim()


# ------------------------------------------------------------------------------------------ the paired report
def hand_made_sweep(root: Path, right: dict, unseen: set | None = None, last_step: int = 5, id_of=lambda i: f"p{i}",
                    sampled: dict | None = None) -> Path:
    """A sweep directory written by hand: arms A and B, seeds 0 and 1, ten problems each; ``right[(arm, seed)]``
    lists the problems answered correctly at the last evaluation (``last_step``); ``unseen``: the problems marked so
    (as ``data.exclude_from_training`` marks them), the others marked seen; ``sampled[(arm, seed)]``: per problem,
    how many of 4 samples were right at the last evaluation (eval.pass_k; 2 of 4 at step 0)."""
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"config": "c.yaml", "command": "train", "grid": {"x": ["A", "B"]},
                                                 "seeds": [0, 1, 2], "overrides": []}))
    lines = []
    for (arm, seed), ok in right.items():
        run = root / f"x={arm}" / f"seed{seed}"
        run.mkdir(parents=True)
        rows = [{"step": last_step, "loss": 0.1 * (seed + 1), "reward_mean": 0.5},
                {"step": last_step, "eval/accuracy": len(ok) / 10, "eval/n": 10}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        drawn = (sampled or {}).get((arm, seed))
        at_0 = {"sampled_correct": 2, "samples": 4} if drawn else {}
        answers = [{"step": 0, "id": id_of(i), "correct": True, **at_0} for i in range(10)]  # the first evaluation
        answers += [{"step": last_step, "id": id_of(i), "correct": i in ok, **({} if unseen is None else {"unseen": i in unseen}),
                     **({"sampled_correct": drawn[i], "samples": 4} if drawn else {})}
                    for i in range(10)]
        (run / "eval_completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
        lines.append(json.dumps({"run": str(run), "arm": f"x={arm}", "seed": seed, "attempt": "start", "rc": 0,
                                 "wall_s": 10.0, "cpu_s": 15.0}))
    unfinished = root / "x=B" / "seed2"  # a run still training (or stopped): not reported
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    lines.append(json.dumps({"run": str(unfinished), "arm": "x=B", "seed": 2, "attempt": "start", "rc": -15,
                             "wall_s": 1.0, "cpu_s": 1.0}))
    (root / "sweep.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_the_report_pairs_arms_problem_by_problem_as_computed_by_hand(tmp_path):
    from cohortrl.study import from_start, load_sweep, paired, seed_agreement, write_study_report

    root = hand_made_sweep(tmp_path / "sweep", {
        ("A", 0): {0, 1, 2, 3, 4, 5}, ("B", 0): {0, 1, 2, 3, 6, 7, 8, 9},  # only A: p4 p5; only B: p6-p9
        ("A", 1): {0, 1}, ("B", 1): set(range(10)),  # only B: p2-p9
    })
    a, b = load_sweep(root)
    assert [r.seed for r in b.runs] == [0, 1]  # seed 2 has not finished
    c = paired(a, b)
    # seed 0: 6 discordant, 2 one way: p = 2·(C(6,0)+C(6,1)+C(6,2))/2^6 = 2·22/64 = 0.6875
    # seed 1: 8 discordant, all one way: p = 2·C(8,0)/2^8 = 0.0078125
    assert c["per_seed"] == [(0, 10, 2, 4, 0.6875), (1, 10, 0, 8, 0.0078125)]
    mean, low, high = c["bootstrap"]
    assert mean == pytest.approx((4 - 2 + 8) / 20)  # B − A over the 20 seed × problem pairs
    assert low < mean < high
    # an arm's seeds against each other: A's seed 0 alone right on p2-p5 (p = 2·C(4,0)/2^4 = 0.125), both on p0 p1
    assert seed_agreement(a) == {"pairs": [(0, 1, 10, 4, 0, 0.125)], "n": 10, "all": 2, "any": 6}
    # each run against its own first evaluation (step 0: every problem right): A lost p6-p9 at seed 0, p2-p9 at seed 1
    start = from_start(a)
    assert start["per_seed"] == [(0, 0, 5, 10, 4, 0, 0.125), (1, 0, 5, 10, 8, 0, 0.0078125)]
    assert start["bootstrap"][0] == pytest.approx((-4 - 8) / 20)

    md, png = write_study_report([root], tmp_path / "report", metrics=["loss"])
    text = md.read_text()
    assert "s0: 2/4 of 10, p=0.688; s1: 0/8 of 10, p=0.008" in text
    assert "| x=A | s0 v s1: 4/0 of 10, p=0.125 | 2 / 6 of 10 |" in text
    assert "| x=B | s0 v s1: 0/2 of 10, p=0.500 | 8 / 10 of 10 |" in text  # B's seed 1 alone right on p4 p5
    assert "| x=A | s0 step 0 → 5: 4/0 of 10, p=0.125; s1 step 0 → 5: 8/0 of 10, p=0.008 | -0.600" in text
    assert "| x=A | 2 | s0 0.600 (0.313-0.832, n=10, step 5); s1 0.200 (0.057-0.510, n=10, step 5) | 0.400 | 0.283 |" in text
    assert "0.15 ± 0.071" in text  # loss: seeds 0.1 and 0.2
    assert "| 20 | 30 |" in text  # wall and CPU s summed over the arm's finished runs
    assert png.stat().st_size > 0

    copy = tmp_path / "committed"
    write_study_report([root], tmp_path / "r1", metrics=["loss"], keep_dir=copy)
    md2, _ = write_study_report([copy], tmp_path / "r2", metrics=["loss"])  # from the copy alone
    assert (copy / "x=B" / "seed1" / ANSWERS).is_file() and not (copy / "x=B" / "seed1" / "eval_completions.jsonl").exists()
    strip = lambda t: [line for line in t.splitlines() if "Regenerate" not in line and "![curves]" not in line and not line.startswith("# ")]
    assert strip(md2.read_text()) == strip((tmp_path / "r1.md").read_text())


def test_the_report_pairs_sampled_accuracy_problem_by_problem(tmp_path):
    """eval.pass_k's per-problem counts: each arm's sampled accuracy, paired with the baseline and with step 0."""
    from cohortrl.study import load_sweep, sampled_paired

    root = hand_made_sweep(tmp_path / "sweep", {("A", 0): set(), ("B", 0): set()}, sampled={
        ("A", 0): [1] * 10, ("B", 0): [3] * 5 + [1] * 5})  # of 4 samples; step 0 had 2 of 4 on every problem
    a, b = load_sweep(root)
    assert a.runs[0].samples == 4 and a.runs[0].sampled["p0"] == 0.25 and b.runs[0].start_sampled["p9"] == 0.5
    c = sampled_paired([(0, a.runs[0].sampled, b.runs[0].sampled)])
    seed, n, mean_a, mean_b, diff, lo, hi = c["per_seed"][0]
    assert (seed, n, mean_a, mean_b, diff) == (0, 10, 0.25, 0.5, pytest.approx(0.25))  # B − A: +0.5 on p0-p4, 0 on p5-p9
    assert lo < diff < hi and c["bootstrap"][0] == pytest.approx(0.25)
    from cohortrl.study import write_study_report

    text = write_study_report([root], tmp_path / "r")[0].read_text()
    assert "| x=A | s0 0.250 (0.250-0.250, n=10) |" in text  # every problem 1 of 4: no spread
    assert "| x=B | s0 0.250 → 0.500: +0.250" in text  # against the baseline A
    assert "| x=A | s0 0.500 → 0.250: -0.250 (-0.250 to -0.250) |" in text  # A against its own step 0


def test_several_sweeps_are_reported_side_by_side_as_one_study(tmp_path):
    """A study whose arms need different commands (an SFT warm start, GRPO and RFT) is one sweep per command:
    the report names each arm by its sweep's folder and pairs them as arms of one sweep."""
    from cohortrl.study import load_sweeps, write_study_report

    warm = hand_made_sweep(tmp_path / "ws", {("A", 0): {0, 1}, ("B", 0): {0}, ("A", 1): {0}})
    rl = hand_made_sweep(tmp_path / "rl", {("A", 0): {0, 1, 2, 3}, ("B", 0): {5}, ("A", 1): {0, 1, 2}})
    assert [a.name for a in load_sweeps([warm, rl])] == ["ws/x=A", "ws/x=B", "rl/x=A", "rl/x=B"]
    md, _ = write_study_report([warm, rl], tmp_path / "study", keep_dir=tmp_path / "kept")
    text = md.read_text()
    # rl/x=A against ws/x=A: seed 0 only rl right p2 p3 (p = 0.5), seed 1 only rl right p1 p2 (p = 0.5)
    assert "| rl/x=A | s0: 0/2 of 10, p=0.500; s1: 0/2 of 10, p=0.500 |" in text
    assert "| rl/x=B | s0: 2/1 of 10, p=1.000 |" in text
    assert f"Regenerate: `cohortrl report {warm} {rl} --out" in text
    again, _ = write_study_report([tmp_path / "kept" / "ws", tmp_path / "kept" / "rl"], tmp_path / "again")
    strip = lambda t: [line for line in t.splitlines() if "Regenerate" not in line and "![curves]" not in line
                       and not line.startswith("# ")]
    assert strip(again.read_text()) == strip(text)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="two sweep folders are named 'ws'"):
        load_sweeps([warm, hand_made_sweep(tmp_path / "other" / "ws", {("A", 0): {0}, ("B", 0): {0}})])


def test_arms_of_different_lengths_are_drawn_over_the_fraction_of_their_own_steps(tmp_path):
    """A 250-step warm start and a 20-step GRPO run on one step axis would put GRPO's whole run in the warm
    start's first tenth; the curves then go over each arm's fraction of its own steps, and say so."""
    from cohortrl.study import last_steps, load_sweep, load_sweeps, plot

    warm = hand_made_sweep(tmp_path / "ws", {("A", 0): {0, 1}, ("B", 0): {0}}, last_step=250)
    rl = hand_made_sweep(tmp_path / "rl", {("A", 0): {0, 1, 2}, ("B", 0): {5}}, last_step=20)
    arms_ = load_sweeps([warm, rl])
    assert last_steps(arms_) == {"ws/x=A": 250, "ws/x=B": 250, "rl/x=A": 20, "rl/x=B": 20}
    assert plot(arms_, tmp_path / "mixed.png", ["loss"]).startswith("fraction of the arm's own steps")
    assert plot(load_sweep(rl), tmp_path / "one.png", ["loss"]) == "step"
    assert (tmp_path / "mixed.png").stat().st_size > 0 and (tmp_path / "one.png").stat().st_size > 0


def test_the_report_pairs_the_unseen_and_the_seen_problems_apart(tmp_path):
    from cohortrl.study import load_sweep, paired, write_study_report

    root = hand_made_sweep(tmp_path / "sweep", {
        ("A", 0): {0, 1, 2, 3, 4, 5}, ("B", 0): {0, 1, 2, 3, 6, 7, 8, 9},
        ("A", 1): {0, 1}, ("B", 1): set(range(10)),
    }, unseen={6, 7, 8, 9})
    a, b = load_sweep(root)
    # unseen p6-p9: seed 0 only B 4 (p = 2/16), seed 1 only B 4; seen p0-p5: seed 0 only A p4 p5, seed 1 only B p2-p5
    assert paired(a, b, part="unseen")["per_seed"] == [(0, 4, 0, 4, 0.125), (1, 4, 0, 4, 0.125)]
    assert paired(a, b, part="seen")["per_seed"] == [(0, 6, 2, 0, 0.5), (1, 6, 0, 4, 0.125)]
    assert paired(a, b, part="unseen")["bootstrap"][0] == pytest.approx(1.0)
    text = write_study_report([root], tmp_path / "report")[0].read_text()
    assert "| x=B | s0 1.000 (0.510-1.000, n=4); s1 1.000 (0.510-1.000, n=4) | s0 0.667 (0.300-0.903, n=6); s1 1.000 (0.610-1.000, n=6) |" in text
    assert "on the unseen problems only" in text and "s0: 0/4 of 4, p=0.125; s1: 0/4 of 4, p=0.125" in text
    unmarked = write_study_report([hand_made_sweep(tmp_path / "plain", {("A", 0): {0}, ("B", 0): {1}})], tmp_path / "r")[0]
    assert "unseen" not in unmarked.read_text()  # runs without the marks: no such section


def test_the_report_says_which_runs_shared_a_machine(tmp_path):
    from cohortrl.machine import label
    from cohortrl.study import write_study_report

    root = hand_made_sweep(tmp_path / "sweep", {("A", 0): {0}, ("B", 0): {1}, ("A", 1): {2}})
    text = write_study_report([root], tmp_path / "old")[0].read_text()
    assert "machine" not in text  # a sweep from before machines were recorded: nothing claimed
    one = {"cpu": "AMD EPYC", "family": "25", "model": "17", "stepping": "1", "caches": "L2 1024K, L3 32768K",
           "cores": 2, "torch": "2.13.0+cpu"}
    other = {**one, "caches": "L2 512K, L3 16384K"}
    assert label(one) == "AMD EPYC (family 25 model 17 stepping 1; L2 1024K, L3 32768K; 2 cores; torch 2.13.0+cpu)"
    attempts = [json.loads(line) for line in (root / "sweep.jsonl").read_text().splitlines()]

    def write(machines):
        (root / "sweep.jsonl").write_text("".join(json.dumps({**a, **m}) + "\n" for a, m in zip(attempts, machines)))
        return write_study_report([root], tmp_path / "report")[0].read_text()

    text = write([{"machine": one}] * 4)
    assert f"Every run ran on one machine: {label(one)}." in text
    # x=A seed 1 on the other machine; x=B seed 0 not recorded (an attempt from before); x=B seed 2 unfinished
    text = write([{"machine": one}, {}, {"machine": other}, {"machine": other}])
    assert "The runs ran on more than one machine" in text
    assert f"| {label(one)} | x=A s0 |" in text and f"| {label(other)} | x=A s1 |" in text
    assert "| not recorded | x=B s0 |" in text
    text = write([{"machine": one}, {}, {"machine": one}, {"machine": one}])
    assert "Not every run recorded its machine" in text and "more than one machine" not in text
    assert f"| {label(one)} | x=A s0, x=A s1 |" in text and "| not recorded | x=B s0 |" in text


def test_the_sampled_accuracy_interval_is_over_problems_as_computed_by_hand():
    """``stats.mean_interval``, which both the trainer's evaluation (``eval/sampled_accuracy_ci_*``) and the report use:
    mean ± 1.96·sd/√n of the per-problem fractions, clipped to [0, 1]."""
    from cohortrl.stats import mean_interval

    # sd of (0, .5, 1, .5) = √(0.5 / 3) = 0.408248; half = 1.96 · 0.408248 / 2 = 0.400083
    assert mean_interval([0.0, 0.5, 1.0, 0.5]) == pytest.approx((0.5, 0.099917, 0.900083), abs=1e-6)
    # sd of (1, 1, 1, .75) = 0.125; half 0.1225: the upper end clipped at 1
    assert mean_interval([1.0, 1.0, 1.0, 0.75]) == pytest.approx((0.9375, 0.815, 1.0))
    assert mean_interval([0.25]) == (0.25, 0.0, 1.0)


def test_mcnemar_and_the_paired_bootstrap_by_hand():
    from cohortrl.stats import mcnemar_exact, paired_bootstrap

    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(3, 12) == pytest.approx(2 * (1 + 15 + 105 + 455) / 2**15)  # 0.03515625
    assert mcnemar_exact(12, 3) == mcnemar_exact(3, 12)
    assert paired_bootstrap([[1, 1, 1], [1]]) == (1.0, 1.0, 1.0)  # no spread: the interval is the point
    # One pair of two problems, differences 0 and 1: a resample's mean is 0, 1/2 or 1 with probability 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% quantiles are 0 and 1.
    assert paired_bootstrap([[0, 1]]) == (0.5, 0.0, 1.0)
    # Many problems, one seed: the percentile interval approaches mean ± 1.96·sd/√n.
    diffs = [1] * 120 + [0] * 240 + [-1] * 40  # mean 0.2, sd ≈ 0.5578
    mean, low, high = paired_bootstrap([diffs])
    half = 1.96 * (sum((d - 0.2) ** 2 for d in diffs) / 399) ** 0.5 / 400 ** 0.5
    assert mean == pytest.approx(0.2) and low == pytest.approx(0.2 - half, abs=0.006) and high == pytest.approx(0.2 + half, abs=0.006)
    # Seeds that disagree widen the interval beyond what the problems alone give.
    _, lo1, hi1 = paired_bootstrap([diffs, diffs])
    _, lo2, hi2 = paired_bootstrap([[1] * 160 + [0] * 240, [-1] * 80 + [0] * 320])
    assert hi2 - lo2 > 2 * (hi1 - lo1)


def test_the_paired_bootstrap_equals_the_draw_by_draw_loop_when_pairs_hold_the_same_problems():
    """Pairs of one length take one draw of S × N problem indices per resample: the same numbers, bit for bit,
    as the two-level loop written out here (S draws of N), so the committed intervals did not move."""
    import numpy as np

    from cohortrl.stats import paired_bootstrap

    def loop(diffs_SN, resamples, seed):
        rng, groups = np.random.default_rng(seed), [np.asarray(d, dtype=float) for d in diffs_SN]
        stats = []
        for _ in range(resamples):
            sums = counts = 0
            for s in rng.integers(len(groups), size=len(groups)):
                sums += groups[s][rng.integers(len(groups[s]), size=len(groups[s]))].sum()
                counts += len(groups[s])
            stats.append(sums / counts)
        return np.quantile(stats, [0.025, 0.975]).tolist()

    rng = np.random.default_rng(7)
    for seeds, problems in ((3, 200), (1, 57), (2, 1), (5, 33)):
        diffs = rng.integers(-1, 2, size=(seeds, problems)).tolist()
        assert list(paired_bootstrap(diffs, resamples=2000, seed=3)[1:]) == loop(diffs, 2000, 3)
    uneven = [[1, 0, -1, 1], [0, 1]]  # different lengths go through the loop itself
    assert list(paired_bootstrap(uneven, resamples=500, seed=1)[1:]) == loop(uneven, 500, 1)


def committed_study_reports() -> list[Path]:
    """Every report in docs/ made by `cohortrl report` over a committed sweep folder."""
    return [md for md in sorted((REPO / "docs").rglob("*.md"))
            if "Regenerate: `cohortrl report docs/" in md.read_text() and "sweep.json" not in md.name]


@pytest.mark.parametrize("md", committed_study_reports(), ids=lambda p: p.name)
def test_each_committed_study_report_regenerates_from_its_committed_files(md, tmp_path):
    """The tables of docs/*.md reports over committed sweep folders are what `cohortrl report` makes of those
    files now, byte for byte (the Regenerate line aside, which names where the copy was written)."""
    import shlex

    from cohortrl.cli import main

    command = md.read_text().split("Regenerate: `")[1].split("`")[0]
    args = shlex.split(command)[2:]
    out = args.index("--out") + 1
    args[out] = str(tmp_path / Path(args[out]).name)
    for i in range(out - 1):  # the sweep folders, before --out
        args[i] = str(REPO / args[i])
        assert (Path(args[i]) / "sweep.json").is_file(), f"{md}: {args[i]} is not a committed sweep folder"
    assert main(["report", *args]) == 0
    strip = lambda text: [line for line in text.splitlines() if not line.startswith("Regenerate: ")]
    assert strip((tmp_path / md.name).read_text()) == strip(md.read_text())


def test_the_report_pairs_arms_on_each_level_of_a_mix(tmp_path):
    """Held-out problems of several levels (``data.levels``; a gym id names its level: FAMILY/L{n}/...): the
    report gives each level's accuracy per seed and pairs the arms on each level's problems alone."""
    from cohortrl.study import load_sweep, paired, write_study_report

    root = hand_made_sweep(tmp_path / "sweep", {
        ("A", 0): {0, 1, 2, 3, 4}, ("B", 0): {0, 1, 2, 3, 4, 5, 6, 7},  # only B on p5-p7, all level 3
        ("A", 1): {0, 1}, ("B", 1): {0, 1, 2, 3, 4},  # only B on p2-p4, level 1
    }, id_of=lambda i: f"arithmetic/L{1 if i < 5 else 3}/s1000003/{i}")
    a, b = load_sweep(root)
    assert set(a.runs[0].parts.values()) == {"level 1", "level 3"}
    assert paired(a, b, part="level 1")["per_seed"] == [(0, 5, 0, 0, 1.0), (1, 5, 0, 3, 0.25)]
    assert paired(a, b, part="level 3")["per_seed"] == [(0, 5, 0, 3, 0.25), (1, 5, 0, 0, 1.0)]
    text = write_study_report([root], tmp_path / "report")[0].read_text()
    assert "| arm | level 1: accuracy per seed (95% CI, n) | level 3: accuracy per seed (95% CI, n) |" in text
    assert "| x=B | s0 1.000 (0.566-1.000, n=5); s1 1.000 (0.566-1.000, n=5) | s0 0.600 (0.231-0.882, n=5); s1 0.000 (0.000-0.434, n=5) |" in text
    assert "on the level 3 problems only" in text


def test_answer_checks_count_what_a_hacked_reward_leaves_in_the_final_answers(tmp_path):
    """Per run, from its last greedy answers on gym problems: lines per response, the share of lines not repeating
    one before, tokens, and answers right by the outcome whose required steps were not all stated (here arithmetic
    level 2, "Compute 6 + 3 * 8": s1 = 24, s2 = 30, read from free-text statements as the process reward reads them)."""
    from cohortrl import tasks
    from cohortrl.study import answer_checks, write_study_report

    sample = tasks.sample_from_id("arithmetic/L2/s1000003/0")
    assert sample.prompt.startswith("Compute 6 + 3 * 8") and [s.value for s in sample.steps] == ["24", "30"]
    ident = sample.id
    rows = [{"step": 0, "id": ident, "correct": False, "length": 99, "completion": "x"},  # an earlier evaluation: ignored
            {"step": 5, "id": ident, "correct": True, "length": 10, "completion": "3 * 8 = 24\n6 + 24 = 30\nANSWER: 30"},
            {"step": 5, "id": ident, "correct": True, "length": 4, "completion": "ANSWER: 30"},  # right, no step
            {"step": 5, "id": ident, "correct": True, "length": 12, "completion": "3 * 8 = 24\n3 * 8 = 24\n3 * 8 = 24\n30"},
            {"step": 5, "id": ident, "correct": False, "length": 6, "completion": "3 * 8 = 24\nANSWER: 31"},
            {"step": 5, "id": ident, "correct": True, "length": 9, "completion": "6 + 3 * 8 = 6 + 24 = 30"},  # a chain
            {"step": 5, "id": "sha1:0123456789abcdef", "correct": True, "length": 50, "completion": "not a gym problem"}]
    got = answer_checks(rows)
    assert got == {"n": 5, "lines": (3 + 1 + 4 + 2 + 1) / 5, "distinct": (3 + 1 + 2 + 2 + 1) / 11,
                   "tokens": (10 + 4 + 12 + 6 + 9) / 5, "right": 4, "unsupported": 3, "unsupported_rewrites": 2}
    assert answer_checks([r for r in rows if r["id"].startswith("sha1:")]) is None

    root = hand_made_sweep(tmp_path / "sweep", {("A", 0): {0, 1}, ("B", 0): {0}}, id_of=lambda i: f"arithmetic/L1/s1000003/{i}")
    plain = write_study_report([root], tmp_path / "plain")[0].read_text()
    text = write_study_report([root], tmp_path / "checked", answer_checks=True)[0].read_text()
    assert "What a hacked reward leaves" not in plain and text.rstrip().endswith("--answer-checks`")
    # hand_made_sweep writes no completions; a level-1 problem requires no step, so no right answer is unsupported
    assert "| x=A | 0.00 | – | 0.0 | 0/0 | 0/0 | s0 |" in text and "| x=B | 0.00 | – | 0.0 | 0/0 | 0/0 | s0 |" in text
