"""Nothing lost, nothing hidden: a run killed anywhere resumes to the same numbers, checkpoints are never half
written or loaded with code in them, non-finite updates are skipped and saved, and settings that cannot fit
the model or the data stop the run before its first step. docs/reliability.md lists each fault and its test."""

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cohortrl.config import ConfigError
from cohortrl.data import DataError
from cohortrl.rollout.hf import PromptTooLongError
from cohortrl.trainers import checkpoint
from cohortrl.trainers.grpo import GRPOTrainer, RunStateError
from cohortrl.trainers.guards import NonfiniteError
from tests.trainers.test_grpo import VOLATILE, params_of, tiny_config

REPO = Path(__file__).resolve().parents[2]
# Four steps, a checkpoint after each, no evaluation: every kill point is reached within seconds.
KILL_RUN = [str(REPO / "configs" / "tiny_grpo.yaml"), "train.steps=4", "train.checkpoint_every=1", "eval.n_prompts=0",
            "train.progress=false"]


def cohortrl(*args, fault=None, run_dir, new_session=False):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("COHORTRL_FAULT", None)
    if fault:
        env["COHORTRL_FAULT"] = fault
    cmd = [sys.executable, "-m", "cohortrl", "train", *args, "--run-dir", str(run_dir)]
    # new_session: its own process group, for a test's Ctrl-C, with SIGINT's default action as a terminal's
    # foreground job has it (a shell starts a background job, such as a test suite run with `&`, with SIGINT
    # ignored, and the child would inherit that)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=new_session, preexec_fn=_default_sigint if new_session else None)


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def train_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if "loss" in r}


def assert_checkpoints_complete(run_dir: Path) -> int:
    """Every ``step_*`` directory loads in full; returns the newest step."""
    steps = []
    for path in sorted(checkpoint.checkpoint_dir(run_dir).glob("step_*")):
        state = checkpoint.load(path)
        assert state["step"] == int(path.name.split("_")[1]) and state["model"], path
        steps.append(state["step"])
    return steps[-1] if steps else 0


@pytest.mark.one_path
def test_killed_anywhere_resumes_to_the_uninterrupted_numbers(tmp_path):
    """SIGKILL mid-update, mid-checkpoint-write (file written, not yet renamed), mid-generation and at a random
    moment; each resume starts from the last complete checkpoint and the final metrics equal a run never
    killed. Then --steps 5 on the finished run does exactly the fifth step of the run never killed."""
    full, run = tmp_path / "full", tmp_path / "killed"
    reference = cohortrl(*KILL_RUN, "--steps", "5", run_dir=full)  # alongside the chain below: 2 cores

    rc, _, err = finish(cohortrl(*KILL_RUN, fault="update:2", run_dir=run))
    assert rc == -signal.SIGKILL, err
    assert assert_checkpoints_complete(run) == 1

    rc, _, err = finish(cohortrl("--resume", fault="checkpoint-write:2", run_dir=run))  # writes 2, dies writing 3
    assert rc == -signal.SIGKILL, err
    assert list(checkpoint.checkpoint_dir(run).glob(".tmp-*/state.pt")), "the kill should leave the unrenamed write"
    assert assert_checkpoints_complete(run) == 2

    rc, _, err = finish(cohortrl("--resume", fault="generate:2", run_dir=run))  # step 3, then dies generating 4
    assert rc == -signal.SIGKILL, err
    assert assert_checkpoints_complete(run) == 3

    delay = random.uniform(1.5, 5.0)  # start-up takes about 3 s: most draws land in the steps or the final save
    proc = cohortrl("--resume", run_dir=run)
    time.sleep(delay)
    proc.kill()
    finish(proc)
    assert_checkpoints_complete(run)
    if assert_checkpoints_complete(run) < 4 or not (run / "final").is_dir():
        rc, _, err = finish(cohortrl("--resume", run_dir=run))
        assert rc == 0, (delay, err)

    done = train_rows(run)
    assert sorted(done) == [1, 2, 3, 4], delay

    rc, _, err = finish(cohortrl("--resume", "--steps", "5", run_dir=run))
    assert rc == 0, err

    rc, _, err = finish(reference)
    assert rc == 0, err
    expected, got = train_rows(full), train_rows(run)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5]
    for step in expected:
        assert got[step] == expected[step], (delay, step)  # exact: same arithmetic in the same order


def test_resuming_a_run_killed_before_its_final_save_writes_it_and_larger_steps_continue(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, train={"steps": 1}, eval={"n_prompts": 0})
    GRPOTrainer(cfg, tmp_path).train()
    checkpoint._discard(tmp_path / "final")  # as if killed between the last checkpoint and the final save
    assert GRPOTrainer(cfg, tmp_path, resume=True).train() == []
    assert (tmp_path / "final" / "config.json").is_file()
    with pytest.raises(RunStateError) as err:
        GRPOTrainer(cfg, tmp_path, resume=True).train()
    assert str(err.value) == (
        f"run in {tmp_path} has already done 1 step(s) and saved final/, nothing is left up to 1 step(s); to train "
        f"further pass a larger total with --steps N, N > 1 (cohortrl train --run-dir {tmp_path} --resume --steps N)"
    )
    rows = GRPOTrainer(cfg, tmp_path, resume=True).train(steps=2)
    assert [r["step"] for r in rows] == [2]


def test_resuming_at_an_epoch_boundary_does_the_remaining_steps(tmp_path, tmp_path_factory):
    """4 training prompts, 2 per step: the checkpoint after step 2 sits exactly at the end of an epoch."""
    data = tmp_path_factory.mktemp("d") / "six.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(6)))
    cfg = tiny_config(data, data={"eval_size": 2}, train={"steps": 3, "checkpoint_every": 2}, eval={"n_prompts": 0})
    GRPOTrainer(cfg, tmp_path).train(steps=2)
    resumed = GRPOTrainer(cfg, tmp_path, resume=True)
    assert resumed.stream.state_dict() == {"epoch": 0, "index": 4, "n_rows": 4}
    assert [r["step"] for r in resumed.train()] == [3]


def test_a_resume_checkpointed_inside_the_second_epoch_continues_as_the_uninterrupted_run(tmp_path, tmp_path_factory,
                                                                                         monkeypatch, request):
    """4 training prompts, 2 per step: the checkpoint after step 3 lies half way through the second epoch, whose
    order is its own shuffle. The resumed step 4 takes that epoch's other two prompts, in the uninterrupted
    run's order, and computes its numbers. (A checkpoint at the end of an epoch, as above, hides a resume that
    restores the position but not the epoch.)"""
    data = tmp_path_factory.mktemp("d") / "six.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(6)))
    cfg = tiny_config(data, data={"eval_size": 2}, train={"steps": 4, "checkpoint_every": 3}, eval={"n_prompts": 0})
    monkeypatch.setattr("cohortrl.trainers.loop.plot_curves", lambda run_dir: None)  # nothing here reads the plots
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the golden runs: a quarter of the time on 2 busy cores
    request.addfinalizer(lambda: torch.set_num_threads(before))

    def taking(trainer) -> list[list[str]]:
        """The prompts of each of the trainer's takes from its stream, in order."""
        taken, take = [], trainer.stream.take

        def recording(n):
            rows = take(n)
            taken.append([r["prompt"] for r in rows])
            return rows

        trainer.stream.take = recording
        return taken

    full = GRPOTrainer(cfg, tmp_path / "full")
    full_prompts = taking(full)
    full_rows = {r["step"]: r for r in full.train() if "loss" in r}
    GRPOTrainer(cfg, tmp_path / "split").train(steps=3)
    resumed = GRPOTrainer(cfg, tmp_path / "split", resume=True)
    assert resumed.stream.state_dict() == {"epoch": 1, "index": 2, "n_rows": 4}
    resumed_prompts = taking(resumed)
    resumed_rows = {r["step"]: r for r in resumed.train() if "loss" in r}
    assert sorted(full_prompts[2] + full_prompts[3]) == sorted(full_prompts[0] + full_prompts[1])  # epoch 2: all 4
    assert full_prompts[2] != full_prompts[0]  # with its own order (else a lost epoch would not show)
    assert resumed_prompts == [full_prompts[3]]
    for key, value in full_rows[4].items():
        if not key.startswith(VOLATILE):
            assert resumed_rows[4][key] == pytest.approx(value, abs=1e-6), key


# ---------------------------------------------------------------------------------------------- numeric guards
def nan_policy_loss(trainer):
    inner = trainer.policy_loss

    def loss(**kw):
        value, metrics = inner(**kw)
        return value * float("nan"), metrics

    trainer.policy_loss = loss


def test_nonfinite_loss_skips_the_update_saves_the_samples_and_stops_after_k_in_a_row(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, train={"steps": 4, "max_nonfinite_steps": 2}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path)
    before = params_of(trainer)
    nan_policy_loss(trainer)
    with pytest.raises(NonfiniteError) as err:
        trainer.train()
    assert str(err.value) == (
        "2 steps in a row (steps 1-2) had a non-finite loss or gradient and were skipped (train.max_nonfinite_steps=2); "
        f"their samples are in {tmp_path / 'nonfinite'}. Lower optim.lr, check the reward functions and data, or "
        "raise train.max_nonfinite_steps"
    )
    after = params_of(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # AdamW never stepped: its state is as allocated before the first step (counters 0, moments 0)
    state = trainer.optimizer.state_dict()["state"]
    assert state and all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in state.values())
    assert trainer.scheduler.last_epoch == 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["skipped_nonfinite"] == 1 and row["grad_norm"] is None
    samples = [json.loads(line) for line in (tmp_path / "nonfinite" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and (tmp_path / "nonfinite" / "step_000001.jsonl").is_file()
    assert samples[0]["prompt"].startswith("What is") and isinstance(samples[0]["completion"], str)
    assert isinstance(samples[0]["reward"], float) and samples[0]["loss"] != samples[0]["loss"]  # NaN


def test_a_nonfinite_gradient_alone_is_skipped_and_the_next_step_trains(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, train={"steps": 2}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path)
    before = params_of(trainer)
    calls = []

    def poison_first_backward(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad

    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    handle = param.register_hook(poison_first_backward)
    rows = trainer.train()
    handle.remove()
    assert [r["skipped_nonfinite"] for r in rows] == [1, 0]
    assert rows[0]["loss"] == rows[0]["loss"] and rows[0]["grad_norm"] is None  # the loss itself was finite
    assert rows[1]["grad_norm"] > 0 and trainer.guard.in_a_row == 0
    assert any(not torch.equal(before[n], p) for n, p in params_of(trainer).items())


def test_a_resumed_run_keeps_counting_the_nonfinite_steps_in_a_row(tmp_path, addition_jsonl):
    """The count lives in the checkpoint: skipped steps before a restart and after it add up toward the limit."""
    cfg = tiny_config(addition_jsonl, train={"steps": 1, "max_nonfinite_steps": 3}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path)
    trainer.train()
    trainer.guard.in_a_row = 2  # as after two skipped steps
    trainer.save_checkpoint()
    trainer.close()
    resumed = GRPOTrainer(cfg, tmp_path, resume=True)
    assert resumed.guard.in_a_row == 2
    resumed._load_extra_state({})  # what a checkpoint written before the guard existed holds: no count, start at 0
    assert resumed.guard.in_a_row == 0
    resumed.close()


# ---------------------------------------------------------------------------------------------- checkpoints
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["torch.save", "os.replace"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path, monkeypatch, where):
    checkpoint.save(tmp_path, 1, {"model": {"w": torch.ones(2)}, "x": 1})
    monkeypatch.setattr(torch if where == "torch.save" else os, where.split(".")[1], enospc)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 2, {"model": {"w": torch.zeros(2)}, "x": 2})
    monkeypatch.undo()
    failed = tmp_path / "checkpoints" / "step_000002" / ("state.pt" if where == "torch.save" else "")
    assert str(err.value).startswith(f"could not write {failed}: [Errno 28] No space left on device (needs about 8 B, ")
    assert str(err.value).endswith(" free on that filesystem); nothing partial was left behind")
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(2))
    assert not list(checkpoint.checkpoint_dir(tmp_path).glob(".tmp-*"))


def test_a_trainer_whose_checkpoint_write_fails_stops_and_resumes_from_the_last_good_one(tmp_path, addition_jsonl, monkeypatch):
    cfg = tiny_config(addition_jsonl, train={"steps": 2, "checkpoint_every": 1}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path)
    real_save, saves = torch.save, []

    def full_on_second(obj, f):
        saves.append(1)
        return enospc() if len(saves) == 2 else real_save(obj, f)

    monkeypatch.setattr(torch, "save", full_on_second)
    with pytest.raises(checkpoint.CheckpointError, match=r"step_000002/state.pt: \[Errno 28\] No space left on device .*step_000001 \(kept\)"):
        trainer.train()
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path).name == "step_000001"
    assert [r["step"] for r in GRPOTrainer(cfg, tmp_path, resume=True).train()] == [2]


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_with_a_malicious_pickle_is_refused_without_running_it(tmp_path):
    checkpoint.save(tmp_path, 1, {"model": {"w": torch.ones(2)}, "x": 1})
    path = checkpoint.latest(tmp_path)
    assert (path / "model.safetensors").is_file() and "model" not in torch.load(path / "state.pt", weights_only=True)
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": RunsCode(str(marker))}, path / "state.pt")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value).startswith(
        f"refusing to load {path / 'state.pt'}: it holds pickled Python objects other than tensors and plain data, "
        "which could run code when loaded (torch.load weights_only=True said: Trying to load unsupported GLOBAL posix.system "
    )
    assert str(err.value).endswith("Only resume from checkpoints cohortrl wrote")
    assert not marker.exists()


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    from cohortrl.trainers.metrics import MetricsLog

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    MetricsLog(tmp_path).truncate_after(2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'


# ---------------------------------------------------------------------------------------------- before step 1
def test_prompt_plus_generation_beyond_the_models_context_fails_before_training(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, data={"max_prompt_tokens": 1020})
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(cfg, tmp_path)
    assert str(err.value) == (
        "data.max_prompt_tokens (1020) + the generation budget (sampling.max_new_tokens 8, eval.max_new_tokens None) "
        "= 1028 tokens, more than tiny-llama's context of 1024 (max_position_embeddings); lower "
        "data.max_prompt_tokens or the max_new_tokens settings"
    )


def test_fewer_training_prompts_than_one_step_fails_before_training(tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(3)))
    cfg = tiny_config(data, data={"eval_size": 2})
    with pytest.raises(DataError) as err:
        GRPOTrainer(cfg, tmp_path / "run")
    assert str(err.value) == (
        f"'jsonl:{data}' has 1 training prompt(s) after holding out data.eval_size=2 for evaluation, fewer than one "
        "step's algorithm.prompts_per_step=2; add prompts, lower data.eval_size or lower algorithm.prompts_per_step"
    )


def test_lora_on_modules_the_model_lacks_names_both(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, model={"lora": {"enabled": True, "target_modules": ["q_proj", "c_attn"]}})
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(cfg, tmp_path)
    assert str(err.value) == (
        "config key 'model.lora.target_modules': ['c_attn'] not found in tiny-llama (LlamaForCausalLM); its linear "
        "modules are ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']; set "
        "model.lora.target_modules to the ones to adapt"
    )


def test_overlong_prompts_are_rejected_by_name_or_truncated_and_counted(tmp_path, addition_jsonl, caplog):
    cfg = tiny_config(addition_jsonl, data={"max_prompt_tokens": 5}, train={"steps": 1}, eval={"n_prompts": 0})
    with pytest.raises(PromptTooLongError) as err:
        GRPOTrainer(cfg, tmp_path / "reject")  # before step 1: every training prompt is checked up front
    assert err.match(
        r"^training prompt 0 has \d+ tokens after the chat template, more than data.max_prompt_tokens=5: "
        r"'What is \d \+ \d\?'\. Raise data.max_prompt_tokens or set data.overlong_prompts=truncate\.$"
    )
    cfg = tiny_config(addition_jsonl, data={"max_prompt_tokens": 5, "overlong_prompts": "truncate"}, train={"steps": 1},
                      eval={"n_prompts": 0})
    with caplog.at_level(logging.WARNING, logger="cohortrl"):
        row = GRPOTrainer(cfg, tmp_path / "truncate").train()[0]
    assert row["prompts_truncated"] == 2
    assert "2 prompt(s) truncated to data.max_prompt_tokens=5" in caplog.text


@pytest.mark.parametrize("trainer", ["grpo", "sft"])
def test_an_overlong_held_out_prompt_stops_the_run_before_training(tmp_path, trainer):
    """The held-out set is first generated from at the final evaluation (eval.before false): a prompt too long
    for data.max_prompt_tokens there once ended a 20-minute SFT run after its last step, with nothing saved."""
    from cohortrl.trainers.sft import SFTTrainer

    short = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "completion": f" {i + 1}"} for i in range(8)]
    held_out = short[:2] + [{"prompt": "Add these numbers: " + " + ".join(["1"] * 40) + ".", "answer": "40"}]
    cfg = tiny_config(Path("unused.jsonl"), data={"max_prompt_tokens": 48, "eval_size": 0}, train={"steps": 1},
                      eval={"before": False, "n_prompts": 3})
    cls = GRPOTrainer if trainer == "grpo" else SFTTrainer
    with pytest.raises(PromptTooLongError, match=r"^held-out prompt 2 has \d+ tokens after the chat template, more "
                                                 r"than data.max_prompt_tokens=48: 'Add these numbers: 1 \+ 1"):
        cls(cfg, tmp_path / trainer, train_dataset=short, eval_dataset=held_out)


def test_a_refused_prompt_starts_no_reward_workers_or_engine(tmp_path, addition_jsonl, monkeypatch):
    """The prompt check runs before the rollout stage is built: the reward workers' processes and a vLLM engine
    (GPU memory) would otherwise be started for a run that cannot begin."""
    import cohortrl.trainers.rl as rl

    built = []
    monkeypatch.setattr(rl, "reward_pool", lambda *a, **k: built.append("reward workers"))
    monkeypatch.setattr(rl, "Sampler", lambda *a, **k: built.append("sampler"))
    cfg = tiny_config(addition_jsonl, data={"max_prompt_tokens": 5}, reward={"workers": 1}, train={"steps": 1},
                      eval={"n_prompts": 0})
    with pytest.raises(PromptTooLongError):
        GRPOTrainer(cfg, tmp_path / "run")
    assert built == []


def test_a_hung_reward_function_scores_failed_and_the_run_goes_on(tmp_path, addition_jsonl):
    """Issue 50: a reward past reward.timeout_s no longer stops the run; each completion it does not return on
    scores 0, counted in the step's grader_errors and saved to grader_errors.jsonl."""
    cfg = tiny_config(addition_jsonl, fn="hangs", reward={"timeout_s": 0.3}, eval={"n_prompts": 0}, train={"steps": 1})
    rows = GRPOTrainer(cfg, tmp_path).train()
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 1 and steps[0]["grader_errors"] == 8 and steps[0]["reward_mean"] == 0.0
    saved = [json.loads(line) for line in (tmp_path / "grader_errors.jsonl").read_text().splitlines()]
    assert len(saved) == 8 and {e["error"] for e in saved} == {"RewardTimeoutError: no result within reward.timeout_s=0.3 s"}
