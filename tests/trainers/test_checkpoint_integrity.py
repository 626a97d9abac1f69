"""Checkpoints you can trust: every checkpoint and final/ carries a manifest written last; a damaged one
(flipped bytes, a truncated file, no manifest) is named in one line and resume falls back to the newest intact
one, which reproduces the uninterrupted run; a failed write leaves nothing partial and says what to do; a
finished run resumed again is a success. docs/reliability.md lists each case."""

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from contextlib import closing
from pathlib import Path

import pytest
import torch

from cohortrl import __version__, cli
from cohortrl.config import ConfigError
from cohortrl.trainers import checkpoint
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.loop import RunCompleteError, RunStateError
from tests.trainers.test_grpo import VOLATILE, tiny_config
from tests.trainers.test_reliability import KILL_RUN, cohortrl, finish, train_rows

MANIFEST = checkpoint.MANIFEST


def config(data, **train):
    """Three steps, a checkpoint after each; the default retention keeps steps 2 and 3."""
    return tiny_config(data, train={"steps": 3, "checkpoint_every": 1, **train}, eval={"n_prompts": 0})


def train(cfg, run_dir: Path, **kwargs) -> list[dict]:
    """Train (or, with resume=True, resume) and release the run directory, as the CLI does."""
    with closing(GRPOTrainer(cfg, run_dir, **kwargs)) as trainer:
        return trainer.train()


def by_step(run_dir: Path) -> dict[int, dict]:
    """Training rows of metrics.jsonl by step, without the timing keys; fails on a duplicated step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, addition_jsonl):
    """An uninterrupted run: its directory (copied, never changed, by each test) and its config hash."""
    run = tmp_path_factory.mktemp("reference") / "run"
    with closing(GRPOTrainer(config(addition_jsonl), run)) as trainer:
        trainer.train()
    return run, trainer.config_hash


def copy_of(reference, tmp_path) -> Path:
    return Path(shutil.copytree(reference[0], tmp_path / "run"))


def flip_two_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    data[middle + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def step_dir(run: Path, step: int) -> Path:
    return checkpoint.checkpoint_dir(run) / f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------- the manifest
def test_every_checkpoint_and_final_carry_a_complete_manifest(reference, capsys):
    run, config_hash = reference
    assert [p.name for p in checkpoint.step_dirs(run)] == ["step_000002", "step_000003"]  # keep_checkpoints=2
    for path, step in [(step_dir(run, 2), 2), (step_dir(run, 3), 3), (run / "final", 3)]:
        manifest = json.loads((path / MANIFEST).read_text())
        assert (manifest["step"], manifest["cohortrl_version"], manifest["config_hash"]) == (step, __version__, config_hash)
        on_disk = {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.name != MANIFEST}
        assert set(manifest["files"]) == set(on_disk) and {"model.safetensors"} <= set(on_disk)
        for name, file in on_disk.items():
            assert manifest["files"][name] == {"size": file.stat().st_size, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
        assert checkpoint.verify(path, config_hash) is None
        # an ordinary directory's mode, as the umask gives it (mkdtemp's 0700 would hide it from other users)
        umask = os.umask(0)
        os.umask(umask)
        assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    assert cli.main(["verify", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok   {step_dir(run, 2)}", f"ok   {step_dir(run, 3)}", f"ok   {run / 'final'}"]


def test_a_checkpoint_of_another_config_or_step_does_not_verify(reference, tmp_path):
    run = copy_of(reference, tmp_path)
    assert checkpoint.verify(step_dir(run, 3), "0" * 64) == (
        f"{step_dir(run, 3) / MANIFEST}: written under another config (hash {reference[1][:12]}, this run's is "
        "000000000000): copied from another run?"
    )
    os.replace(step_dir(run, 3), step_dir(run, 4))
    assert checkpoint.verify(step_dir(run, 4)) == (
        f"{step_dir(run, 4) / MANIFEST}: says step 3, the directory is step 4 (renamed or copied into place)")
    (step_dir(run, 2) / "notes.txt").write_text("added later")
    assert checkpoint.verify(step_dir(run, 2)) == (
        f"{step_dir(run, 2) / 'notes.txt'}: not in the manifest (added after the checkpoint was written)")


# ---------------------------------------------------------------------------------------------- damage and fallback
DAMAGE = {
    "flipped model.safetensors": ("model.safetensors", flip_two_bytes, "SHA-256 differs from the manifest"),
    "flipped state.pt": ("state.pt", flip_two_bytes, "SHA-256 differs from the manifest"),
    "flipped manifest": (MANIFEST, flip_two_bytes, "unreadable"),
    "truncated model.safetensors": ("model.safetensors", lambda p: os.truncate(p, 1000), "1000 bytes, the manifest says"),
    "missing manifest": (MANIFEST, Path.unlink, None),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_the_uninterrupted_numbers(
    reference, tmp_path, addition_jsonl, caplog, capsys, case
):
    run = copy_of(reference, tmp_path)
    name, damage, why = DAMAGE[case]
    damaged = step_dir(run, 3)
    damage(damaged / name)

    assert cli.main(["verify", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ok   {step_dir(run, 2)}" and lines[2] == f"ok   {run / 'final'}"
    if why is None:
        assert lines[1] == f"BAD  {damaged}: no {MANIFEST}, which is written last: the write or a copy of it did not finish"
    else:
        assert lines[1].startswith(f"BAD  {damaged / name}: ") and why in lines[1]

    with caplog.at_level(logging.WARNING, logger="cohortrl"):
        resumed = GRPOTrainer(config(addition_jsonl), run, resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.name == "cohortrl" and r.levelno == logging.WARNING]
    assert warnings == [
        f"damaged checkpoint: {lines[1][5:]}",
        f"resuming from step 2 ({step_dir(run, 2)}), the newest intact checkpoint; discarded: step_000003 (moved to "
        f"{checkpoint.checkpoint_dir(run) / 'rejected'}) and the metrics after that step, which the run computes again",
    ]
    assert resumed.step_count == 2 and (checkpoint.checkpoint_dir(run) / "rejected" / "step_000003" / "state.pt").is_file()
    assert sorted(by_step(run)) == [1, 2]  # the rows after the fallback step are gone, before any is recomputed

    with closing(resumed):
        assert [r["step"] for r in resumed.train()] == [3]
    assert by_step(run) == by_step(reference[0])  # steps 1-3, once each, equal to the run never damaged
    assert [p.name for p in checkpoint.step_dirs(run)] == ["step_000002", "step_000003"]
    assert checkpoint.verify(step_dir(run, 3)) is None and checkpoint.verify(run / "final") is None


def test_strict_refuses_a_damaged_checkpoint_in_one_line_and_changes_nothing(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    flip_two_bytes(step_dir(run, 3) / "state.pt")
    before = (run / "metrics.jsonl").read_text()
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--strict"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress line of the model's loading
    assert err == (
        f"error: --resume --strict: refusing a damaged checkpoint: {step_dir(run, 3) / 'state.pt'}: SHA-256 differs "
        "from the manifest (changed after it was written: bit rot, a bad copy or an edit); nothing was changed "
        f"(without --strict the run resumes from step 2 ({step_dir(run, 2)}))"
    )
    assert step_dir(run, 3).is_dir() and not (checkpoint.checkpoint_dir(run) / "rejected").exists()
    assert (run / "metrics.jsonl").read_text() == before


def test_no_intact_checkpoint_left_refuses_naming_each(reference, tmp_path, addition_jsonl):
    run = copy_of(reference, tmp_path)
    (step_dir(run, 2) / MANIFEST).unlink()
    os.truncate(step_dir(run, 3) / "state.pt", 10)
    with pytest.raises(RunStateError) as err:
        GRPOTrainer(config(addition_jsonl), run, resume=True)
    size = json.loads((step_dir(run, 3) / MANIFEST).read_text())["files"]["state.pt"]["size"]
    assert str(err.value).startswith(  # then how to start again, which the run directory's rules decide
        f"--resume: no intact checkpoint in {checkpoint.checkpoint_dir(run)} ({step_dir(run, 3) / 'state.pt'}: 10 bytes, "
        f"the manifest says {size} (truncated or overwritten); "
        f"{step_dir(run, 2)}: no {MANIFEST}, which is written last: the write or a copy of it did not finish); start the "
        "run again "
    )
    assert "\n" not in str(err.value)
    assert step_dir(run, 2).is_dir() and step_dir(run, 3).is_dir()  # nothing set aside when there is nothing to resume


# ---------------------------------------------------------------------------------------------- failed writes
def enospc(what):
    return OSError(errno.ENOSPC, "No space left on device", what)


@pytest.mark.parametrize("target", ["model.safetensors", "state.pt", MANIFEST, "rename"])
def test_a_failed_write_at_each_file_leaves_nothing_partial_and_keeps_the_older_checkpoint(tmp_path, monkeypatch, target):
    state = {"model": {"w": torch.ones(4)}, "optimizer": {"m": torch.zeros(4)}}
    checkpoint.save(tmp_path, 1, state, keep=1)  # keep 1: step 1 would go, were the new one complete
    real_write, real_replace = checkpoint._write_file, os.replace

    def write_file(path, write):
        if path.name == target:
            raise enospc(str(path))
        return real_write(path, write)

    def replace(src, dst):
        if target == "rename" and Path(dst).name == "step_000002":
            raise enospc(str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint, "_write_file", write_file)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 2, state, keep=1)
    monkeypatch.undo()
    failed = step_dir(tmp_path, 2) / ("" if target == "rename" else target)
    assert str(err.value).startswith(f"could not write {failed}: [Errno 28] No space left on device (needs about 32 B, ")
    assert str(err.value).endswith(" free on that filesystem); nothing partial was left behind")
    assert [p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()] == ["step_000001"]  # no .tmp-*, no step 2
    assert checkpoint.verify(step_dir(tmp_path, 1)) is None


def test_real_write_errors_of_torch_and_safetensors_are_reported_as_the_os_error(tmp_path):
    """A file-size limit makes the kernel refuse the write (EFBIG) inside safetensors' Rust writer and inside
    torch.save, which report it as their own exception types; the message still carries the OS's error."""
    script = (
        "import json, resource, signal, sys, torch\n"
        "from cohortrl.trainers import checkpoint\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))\n"
        "out = []\n"
        "for sub, state in [('a', {'model': {'w': torch.ones(10000)}}), ('b', {'model': {'w': torch.ones(4)}, 'm': torch.ones(10000)})]:\n"
        "    try:\n"
        "        checkpoint.save(sys.argv[1] + '/' + sub, 1, state)\n"
        "    except checkpoint.CheckpointError as e:\n"
        "        out.append(str(e))\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    a, b = json.loads(proc.stdout)
    assert a.startswith(f"could not write {step_dir(tmp_path / 'a', 1) / 'model.safetensors'}: [Errno 27] File too large")
    assert b.startswith(f"could not write {step_dir(tmp_path / 'b', 1) / 'state.pt'}: [Errno 27] File too large")
    for sub in "ab":
        assert not any(checkpoint.checkpoint_dir(tmp_path / sub).iterdir())


def test_a_full_disk_in_a_run_stops_it_in_one_line_and_resume_reproduces_the_rest(reference, tmp_path, addition_jsonl, monkeypatch):
    run = tmp_path / "run"
    trainer = GRPOTrainer(config(addition_jsonl), run)
    real_write = checkpoint._write_file

    def full_at_step_2(path, write):
        if path.name == "state.pt" and ".tmp-step_000002" in str(path):
            raise enospc(str(path))
        return real_write(path, write)

    monkeypatch.setattr(checkpoint, "_write_file", full_at_step_2)
    with closing(trainer), pytest.raises(checkpoint.CheckpointError) as err:
        trainer.train()
    monkeypatch.undo()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"could not write {step_dir(run, 2) / 'state.pt'}: [Errno 28] No space left on device (needs about ")
    assert message.endswith(
        f"; nothing partial was left behind; the last intact checkpoint is {step_dir(run, 1)} (kept); free space (or fix "
        f"the permissions), then resume with: cohortrl train --run-dir {run} --resume"
    )
    assert [p.name for p in checkpoint.checkpoint_dir(run).iterdir()] == ["step_000001"]
    assert sorted(by_step(run)) == [1, 2]  # step 2 ran; its row goes when the resume goes back to step 1

    assert [r["step"] for r in train(config(addition_jsonl), run, resume=True)] == [2, 3]
    assert by_step(run) == by_step(reference[0])


def test_a_full_disk_at_the_final_save_keeps_the_checkpoints_and_resume_writes_final(reference, tmp_path, addition_jsonl):
    run = copy_of(reference, tmp_path)
    checkpoint._discard(run / "final")
    trainer = GRPOTrainer(config(addition_jsonl), run, resume=True)

    def full(*args, **kwargs):
        raise enospc(None)

    trainer.model.save_pretrained = full
    with closing(trainer), pytest.raises(checkpoint.CheckpointError) as err:
        trainer.train()
    assert str(err.value).startswith(f"could not write {run / 'final'}: [Errno 28] No space left on device (needs about ")
    assert f"the last intact checkpoint is {step_dir(run, 3)} (kept)" in str(err.value)
    assert not (run / "final").exists() and not list(run.glob(".tmp-*"))
    assert train(config(addition_jsonl), run, resume=True) == []
    assert checkpoint.verify(run / "final") is None
    with pytest.raises(RunCompleteError, match="already done 3 step"):
        train(config(addition_jsonl), run, resume=True)


@pytest.mark.parametrize("short", [1, 0])
def test_the_space_check_counts_keep_plus_one_checkpoints_and_final(tmp_path, addition_jsonl, monkeypatch, caplog, short):
    """keep_checkpoints=2 (the default) and a checkpoint every step: three exist at the peak (the new one is written
    before the oldest goes), then final/ (all the weights); one byte short of that is warned about, before the first."""
    with closing(GRPOTrainer(config(addition_jsonl), tmp_path)) as trainer:
        per_copy, final = trainer._checkpoint_bytes(), checkpoint.tensor_bytes(trainer.model.state_dict())
        free = 3 * per_copy + final - short
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))
        with caplog.at_level(logging.WARNING, logger="cohortrl"):
            trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.name == "cohortrl" and r.levelno == logging.WARNING]
    human = checkpoint._human
    assert warnings[:1] == ([f"{tmp_path} has {human(free)} free, less than 3 checkpoints (about {human(per_copy)} each) "
                             f"and final/ (about {human(final)}) need: a checkpoint write may fail with a full disk; free "
                             "space or use another --run-dir"] if short else [])


@pytest.mark.parametrize("keep, every, steps, at_once", [(2, 1, 3, 3), (1, 1, 3, 2), (0, 1, 3, 3), (0, 2, 5, 3),
                                                         (5, 1, 2, 2), (2, 0, 4, 1)])
def test_the_checkpoints_at_once_are_keep_plus_one_at_most_those_written(tmp_path, addition_jsonl, keep, every, steps, at_once):
    """0 keeps all: every one written (steps 2, 4 and the last, 5, with every=2); checkpoint_every=0: the last only."""
    with closing(GRPOTrainer(config(addition_jsonl, keep_checkpoints=keep, checkpoint_every=every), tmp_path)) as trainer:
        assert trainer._checkpoints_at_once(steps) == at_once


# ---------------------------------------------------------------------------------------------- retention
@pytest.mark.parametrize("keep, left", [(1, [3]), (2, [2, 3]), (0, [1, 2, 3])])
def test_retention_keeps_the_newest_checkpoints(tmp_path, keep, left):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"model": {"w": torch.ones(1) * step}}, keep=keep)
    assert [int(p.name[5:]) for p in checkpoint.step_dirs(tmp_path)] == left


def test_a_run_that_keeps_every_checkpoint_keeps_them_and_resumes_from_the_oldest(tmp_path, addition_jsonl, one_thread):
    """``keep_checkpoints: 0`` in a run: the checkpoints of steps 1, 2 and 3 all stay. With the newer two and
    final/ deleted (going back to step 1), resume trains steps 2 and 3 again to the same numbers, and keeps all
    three checkpoints again."""
    run = tmp_path / "run"
    cfg = config(addition_jsonl, keep_checkpoints=0)
    train(cfg, run)
    kept = [p.name for p in checkpoint.step_dirs(run)]
    assert kept == ["step_000001", "step_000002", "step_000003"]
    uninterrupted = by_step(run)
    for path in (step_dir(run, 2), step_dir(run, 3), run / "final"):
        shutil.rmtree(path)
    assert [r["step"] for r in train(cfg, run, resume=True) if "loss" in r] == [2, 3]
    assert by_step(run) == uninterrupted
    assert [p.name for p in checkpoint.step_dirs(run)] == kept


def test_keep_checkpoints_must_not_be_negative(addition_jsonl):
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints.*-1.*must be >= 0 \(0 keeps all\)"):
        config(addition_jsonl, keep_checkpoints=-1)


# ---------------------------------------------------------------------------------------------- kills and requeues
@pytest.mark.one_path
def test_kills_between_files_and_manifest_and_after_final_resume_to_the_uninterrupted_numbers(tmp_path):
    """A kill after the checkpoint's files but before its manifest leaves no checkpoint of that step; a kill
    after final/ is written leaves a run that `train --resume` completes with exit 0 and one line."""
    three = [*KILL_RUN, "train.steps=3"]
    full, run = tmp_path / "full", tmp_path / "killed"
    reference = cohortrl(*three, run_dir=full)  # alongside the chain below: 2 cores

    rc, _, err = finish(cohortrl(*three, fault="checkpoint-manifest:2", run_dir=run))
    assert rc == -signal.SIGKILL, err
    unfinished = list(checkpoint.checkpoint_dir(run).glob(".tmp-step_000002-*"))
    assert len(unfinished) == 1 and (unfinished[0] / "state.pt").is_file() and not (unfinished[0] / MANIFEST).exists()
    assert [p.name for p in checkpoint.step_dirs(run)] == ["step_000001"]

    rc, _, err = finish(cohortrl("--resume", fault="final-written:1", run_dir=run))
    assert rc == -signal.SIGKILL, err
    assert checkpoint.verify(run / "final") is None and not (run / "curves.png").exists()

    rc, out, err = finish(cohortrl("--resume", run_dir=run))
    assert rc == 0, err
    assert out.strip().splitlines() == [
        f"run in {run} has already done 3 step(s) and saved final/, nothing is left up to 3 step(s); to train further "
        f"pass a larger total with --steps N, N > 3 (cohortrl train --run-dir {run} --resume --steps N)"
    ]
    assert (run / "curves.png").is_file()

    rc, _, err = finish(reference)
    assert rc == 0, err
    assert train_rows(run) == train_rows(full) and sorted(train_rows(run)) == [1, 2, 3]
