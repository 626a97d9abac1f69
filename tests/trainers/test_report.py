"""``cohortrl report``: two hand-written runs side by side; the markdown holds the numbers computed from
their metrics.jsonl and config.yaml, and the PNG is written."""

import json

import yaml

from cohortrl.cli import main
from cohortrl.trainers.report import summarise


def write_run(run_dir, rows, P=4, G=4):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"prompts_per_step": P, "group_size": G}}))


def train_row(step, reward, **extra):
    return {"step": step, "reward_mean": reward, "loss": 0.1, "time/step": 10.0 + step, "resample_draws": 0, **extra}


def eval_row(step, acc, lo, hi):
    return {"step": step, "eval/accuracy": acc, "eval/accuracy_ci_low": lo, "eval/accuracy_ci_high": hi, "eval/n": 100}


def test_report_puts_two_runs_side_by_side(tmp_path):
    outcome = tmp_path / "outcome"
    write_run(outcome, [
        eval_row(0, 0.10, 0.055, 0.174),
        train_row(1, 0.2), train_row(2, 0.4), train_row(3, 0.6, resample_draws=2),
        eval_row(3, 0.15, 0.093, 0.233),
    ])
    process = tmp_path / "process_sum"
    steps = dict(steps_per_response=3.0, unique_step_ratio=1.0, step_outcome_corr=None, step_reward_share=0.25)
    write_run(process, [
        eval_row(0, 0.10, 0.055, 0.174),
        train_row(1, 0.5, **steps),
        eval_row(1, 0.30, 0.220, 0.395),
        train_row(2, 0.7, **{**steps, "steps_per_response": 5.0, "unique_step_ratio": 0.5, "step_outcome_corr": 0.4}),
        eval_row(2, 0.20, 0.133, 0.289),
    ], P=2, G=8)

    assert main(["report", str(outcome), str(process), "--out", str(tmp_path / "docs" / "cmp"), "--last-k", "2"]) == 0
    assert (tmp_path / "docs" / "cmp.png").stat().st_size > 10_000
    md = (tmp_path / "docs" / "cmp.md").read_text()
    lines = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}

    # outcome: reward over the last 2 steps (0.4 + 0.6) / 2 = 0.5; no detectors logged; wall 11 + 12 + 13 = 36 s;
    # responses: (1 + 1 + 3 draws) × 4 × 4 = 80; held-out 0.10 at start, 0.15 final and best (step 3).
    row = lines["outcome"]
    assert "| 3 | 0.100 (0.055–0.174) @0 | 0.150 (0.093–0.233) @3 | 0.150 (0.093–0.233) @3 | 0.500 |" in row
    assert row.endswith("| – | – | – | – | 36.0 | 80 |")
    # process_sum: reward (0.5 + 0.7) / 2 = 0.600; steps/response (3 + 5) / 2 = 4; unique (1 + 0.5) / 2 = 0.75;
    # correlation only logged at step 2 = 0.4; share 0.25; wall 11 + 12 = 23 s; responses 2 × 2 × 8 = 32;
    # best 0.30 at step 1, final 0.20 at step 2.
    row = lines["process_sum"]
    assert "| 2 | 0.100 (0.055–0.174) @0 | 0.200 (0.133–0.289) @2 | 0.300 (0.220–0.395) @1 | 0.600 |" in row
    assert row.endswith("| 4.000 | 0.750 | 0.400 | 0.250 | 23.0 | 32 |")
    assert f"cohortrl report {outcome} {process} --out {tmp_path / 'docs' / 'cmp'} --last-k 2" in md


def test_a_run_without_evaluations_or_config_still_summarises(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(train_row(1, 0.3)) + "\n")
    s = summarise(run)
    assert s["steps"] == 1 and s["reward_last_k"] == 0.3 and s["responses"] is None and "final" not in s


def test_report_panels_tabulate_chosen_metrics_first_and_last_steps(tmp_path):
    run = tmp_path / "grpo"
    write_run(run, [train_row(s, 0.1 * s, kl=0.01 * s, response_length_incorrect_mean=None if s == 1 else 10.0 * s)
                    for s in range(1, 6)])
    out = tmp_path / "docs" / "study"
    assert main(["report", str(run), "--out", str(out), "--last-k", "2", "--panels", "kl",
                 "response_length_incorrect_mean"]) == 0
    md = (tmp_path / "docs" / "study.md").read_text()
    assert "| kl, first → last 2 steps | response_length_incorrect_mean, first → last 2 steps |" in md
    # kl: steps 1-2 → (.01 + .02) / 2 = .015; steps 4-5 → .045. Length: step 1 not logged → 20.0; (40 + 50) / 2 = 45
    row = next(line for line in md.splitlines() if line.startswith("| grpo"))
    assert "| 0.015 → 0.045 | 20.000 → 45.000 |" in row
    assert "--panels kl response_length_incorrect_mean`" in md
    assert (tmp_path / "docs" / "study.png").stat().st_size > 10_000
