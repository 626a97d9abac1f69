"""Run directories are never mixed: a directory holding a run is refused unless resumed or overwritten,
--overwrite deletes the old run's files first, a lock refuses a second process, and a failed start leaves no
empty directory behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cohortrl import Config, GRPOTrainer
from cohortrl.rewards.scoring import RewardFunctionError
from cohortrl.trainers.run_dir import LOCK_FILE, RunDirectoryError, claim
from cohortrl.trainers.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]


def config(steps: int = 1) -> Config:
    return Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4},
                  algorithm={"group_size": 2, "prompts_per_step": 2}, train={"steps": steps, "progress": False},
                  eval={"before": False}, reward={"functions": [{"name": "format"}], "correctness": "format"})


def test_a_directory_holding_a_run_is_refused_then_overwritten(tmp_path):
    run = tmp_path / "run"
    GRPOTrainer(config(steps=2), run, train_dataset=ROWS).train()
    (run / "notes.txt").write_text("mine")  # not a run file: --overwrite leaves it
    with pytest.raises(RunDirectoryError) as err:
        GRPOTrainer(config(), run, train_dataset=ROWS)
    assert str(err.value) == (
        f"{run} already holds a run (config.yaml, metrics.jsonl, checkpoints, final, curves.png); continue it with "
        "--resume (resume=True), or start over with --overwrite (overwrite=True), which deletes that run's files "
        "first; or give another --run-dir")
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # untouched by the refused start
    GRPOTrainer(config(steps=1), run, train_dataset=ROWS, overwrite=True).train()
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_000001"]
    assert (run / "notes.txt").read_text() == "mine"


def test_without_a_run_dir_a_run_goes_to_runs_name_and_start_time(tmp_path, monkeypatch):
    """TRL's default output_dir is relative to the working directory; ours is runs/<trainer>-<start time>."""
    monkeypatch.chdir(tmp_path)
    before = time.strftime("%Y%m%d-%H%M%S")
    trainer = GRPOTrainer(config(), train_dataset=ROWS)
    after = time.strftime("%Y%m%d-%H%M%S")
    try:
        assert trainer.run_dir.parent == Path("runs") and (tmp_path / trainer.run_dir).is_dir()
        name, date, clock = trainer.run_dir.name.split("-")
        assert name == "grpo" and len(date) == 8 and len(clock) == 6
        assert before <= f"{date}-{clock}" <= after  # %Y%m%d-%H%M%S sorts as the time it spells
    finally:
        trainer.close()


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(RunDirectoryError, match="give one of them"):
        claim(tmp_path / "x", resume=True, overwrite=True)
    assert not (tmp_path / "x").exists()


def test_a_second_process_is_refused_by_the_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[2]); "
         "from cohortrl.trainers.run_dir import claim; c = claim(sys.argv[1]); print('held', flush=True); time.sleep(60)",
         str(run), str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryError) as err:
            GRPOTrainer(config(), run, train_dataset=ROWS)
        assert str(err.value) == (f"{run} is in use by another cohortrl process (pid {holder.pid}); wait for it to "
                                  "finish, or use another --run-dir")
    finally:
        holder.kill()
        holder.wait()
    claim(run).release()  # the holder is gone: the lock is free again (the kernel dropped it with the process)


def test_a_failed_start_leaves_no_empty_run_directory(tmp_path):
    new = tmp_path / "new"
    bad = config()
    bad.reward.functions[0].name = bad.reward.correctness = "nope.py:f"
    with pytest.raises(RewardFunctionError):
        GRPOTrainer(bad, new, train_dataset=ROWS)
    assert not new.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RewardFunctionError):
        GRPOTrainer(bad, existing, train_dataset=ROWS)
    assert existing.is_dir() and sorted(p.name for p in existing.iterdir()) == [LOCK_FILE]  # the user's own dir stays
    GRPOTrainer(config(), existing, train_dataset=ROWS).train()  # and is free for a run


def test_the_lock_is_free_after_training_for_a_resume_in_the_same_process(tmp_path):
    run = tmp_path / "run"
    first = GRPOTrainer(config(steps=1), run, train_dataset=ROWS)
    first.train()
    resumed = GRPOTrainer.resume(run, config(steps=2), train_dataset=ROWS)  # holds the lock from here
    with pytest.raises(RunDirectoryError, match="is in use by another cohortrl process"):
        first.train(steps=3)  # taking the directory back while the resumed trainer holds it is refused
    assert [r["step"] for r in resumed.train() if "loss" in r] == [2]
    resumed.close()


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cohortrl", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


@pytest.mark.one_path
def test_cli_train_refuses_names_the_flags_and_overwrites(tmp_path):
    cfg = str(REPO / "configs" / "tiny_grpo.yaml")
    common = ["train.progress=false", "eval.n_prompts=2", "eval.before=false"]
    assert run_cli("train", cfg, "--run-dir", "r", "--steps", "2", *common, cwd=tmp_path).returncode == 0
    again = run_cli("train", cfg, "--run-dir", "r", "--steps", "1", *common, cwd=tmp_path)
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1
    started = time.time()
    over = run_cli("train", cfg, "--run-dir", "r", "--steps", "1", "--overwrite", *common, cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "loss" in r] == [1]
    assert (tmp_path / "r" / "config.yaml").stat().st_mtime >= started - 1


def test_other_torchrun_ranks_never_take_the_lock_rank_0_holds(tmp_path):
    rank0 = claim(tmp_path / "run")
    other = claim(tmp_path / "run", main=False)
    other.acquire()  # train() re-acquires on every rank; on rank 1 this must not meet rank 0's lock
    assert rank0.locked and not other.locked
    other.release()
    assert rank0.locked
    rank0.release()
