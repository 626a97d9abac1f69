"""Every way a run can stop has a way back: ``cohortrl train CONFIG --run-dir D --resume``, repeated by a
pre-emption wrapper, starts a run that is not there, starts again one killed before its first checkpoint,
continues one killed mid-run (saying from which step) and exits 0 on a finished one; Ctrl-C ends with one line
naming the last checkpoint and the command that resumes; an error is printed on a line of its own after the
progress bar is closed."""

import os
import re
import shlex
import signal
import time

import pytest

from cohortrl import Config, GRPOTrainer
from cohortrl.trainers import checkpoint
from cohortrl.trainers.metrics import read_metrics
from cohortrl.trainers.run_dir import LOCK_FILE
from tests.trainers.test_reliability import KILL_RUN, REPO, cohortrl, finish, train_rows

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
FNS = REPO / "tests" / "trainers" / "reward_fns.py"


def test_resume_starts_a_run_in_a_directory_that_does_not_exist(tmp_path):
    """Python's resume=True, as the CLI's --resume: nothing to continue, so the run starts."""
    cfg = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4},
                 algorithm={"group_size": 2, "prompts_per_step": 2}, train={"steps": 1, "progress": False},
                 eval={"before": False}, reward={"functions": [{"name": "format"}], "correctness": "format"})
    run = tmp_path / "new"
    trainer = GRPOTrainer(cfg, run, train_dataset=ROWS, resume=True)
    assert [r["step"] for r in trainer.train() if "loss" in r] == [1]
    trainer.close()
    assert [r["step"] for r in read_metrics(run)] == [1]


@pytest.mark.one_path
def test_repeating_train_resume_recovers_from_a_kill_at_every_moment(tmp_path):
    """The same command each time, as a requeue wrapper runs it, on a directory killed during start-up (only the
    lock file left), before its first checkpoint, while writing it, mid-run and finished; the numbers equal a
    run never killed."""
    full, run = tmp_path / "full", tmp_path / "run"
    reference = cohortrl(*KILL_RUN, run_dir=full)  # alongside the chain below: 2 cores
    again = [*KILL_RUN, "--resume"]

    run.mkdir()  # what a kill while loading the model leaves: the claim's lock file, nothing of the run
    (run / LOCK_FILE).write_text("12345")
    rc, _, err = finish(cohortrl(*again, fault="update:1", run_dir=run))  # dies in step 1: no checkpoint yet
    assert rc == -signal.SIGKILL, err
    assert (run / "config.yaml").is_file() and not checkpoint.step_dirs(run)

    rc, _, err = finish(cohortrl(*again, fault="checkpoint-write:1", run_dir=run))  # dies renaming the first one
    assert rc == -signal.SIGKILL, err
    assert "stopped before its first checkpoint" in err and "starting the run again from step 0" in err, err
    assert not checkpoint.step_dirs(run) and [r["step"] for r in read_metrics(run)] == [1]

    rc, _, err = finish(cohortrl(*again, fault="update:3", run_dir=run))  # checkpoints 1 and 2, dies in step 3
    assert rc == -signal.SIGKILL, err
    assert "starting the run again from step 0" in err, err
    assert [p.name for p in checkpoint.step_dirs(run)] == ["step_000001", "step_000002"]

    rc, out, err = finish(cohortrl(*again, run_dir=run))
    assert rc == 0, err
    assert f"resuming the run in {run} from step 2 ({run / 'checkpoints' / 'step_000002'})" in err, err
    assert "starting the run again" not in err

    rc, out, err = finish(cohortrl(*again, run_dir=run))  # finished: nothing to do, and a wrapper stops
    assert rc == 0, err
    assert "has already done 4 step(s) and saved final/" in out

    rc, _, err = finish(reference)
    assert rc == 0, err
    assert train_rows(run) == train_rows(full) and sorted(train_rows(run)) == [1, 2, 3, 4]


def test_resume_without_a_config_on_a_directory_with_no_run_says_to_give_one(tmp_path):
    rc, _, err = finish(cohortrl("--resume", run_dir=tmp_path / "none"))
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        f"config error: --resume: {tmp_path / 'none'} holds no run to continue (no config.yaml); give CONFIG too "
        f"(cohortrl train CONFIG --run-dir {tmp_path / 'none'} --resume starts it when there is none)")


@pytest.mark.one_path
def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes(tmp_path):
    run = tmp_path / "run"
    args = [*KILL_RUN, "train.steps=40"]
    proc = cohortrl(*args, run_dir=run, new_session=True)
    deadline = time.time() + 240
    while not checkpoint.step_dirs(run) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the group gets it
    rc, _, err = finish(proc)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(r"interrupted; the last checkpoint is (\S+); resume with: (cohortrl train .* --resume)", last)
    assert found, last
    assert found.group(1) == str(checkpoint.latest(run))
    resume = shlex.split(found.group(2))
    assert resume[:2] == ["cohortrl", "train"] and resume[2:2 + len(args)] == args
    rc, _, err = finish(cohortrl(*resume[2:-3], "train.steps=" + str(int(found.group(1)[-6:]) + 1),
                                 "--resume", run_dir=run))
    assert rc == 0, err  # the printed command resumes (one more step, to keep the test short)
    assert "resuming the run in" in err


@pytest.mark.one_path
def test_an_error_is_printed_on_its_own_line_after_the_progress_bar(tmp_path):
    """The bar is drawn with carriage returns; the error line must start a line of its own and nothing of the
    bar may be drawn after it."""
    rc, _, err = finish(cohortrl(
        *KILL_RUN[:1], "train.progress=true", "eval.n_prompts=0", f"reward.functions=[{{name: {FNS}:raises_from_step_2}}]",
        f"reward.correctness={FNS}:raises_from_step_2", run_dir=tmp_path / "run"))
    assert rc == 2, err
    lines = err.rstrip("\n").split("\n")
    assert lines[-1].startswith("error: reward function "), lines[-2:]
    assert "\r" not in lines[-1] and "%|" in lines[-2], lines[-2:]  # the closed bar's own last line
