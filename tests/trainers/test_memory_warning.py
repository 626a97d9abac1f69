"""The memory check before step 1 (``guards.memory_warning``): on a CPU the kernel's OOM killer ends a run that
does not fit with SIGKILL and no message, so the log says beforehand what the planner expects and what fits."""

import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from cohortrl.config import Config
from cohortrl.planner import plan, run_spec_from_config, shape_from_config
from cohortrl.trainers import guards, make_trainer
from tests.trainers.test_grpo import tiny_config

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
GIB = 1024**3


def rft_g16(*overrides):
    """python_function's GRPO config as RFT at G 16 with the update's own forward: what the kernel killed at step 1
    on a 24 GB machine (before RFT's update ran on decoding's recording)."""
    return Config.from_yaml(REPO / "configs" / "pyfunc_grpo.yaml", [
        "model.init=null", "algorithm.name=rft", "algorithm.aggregation=token-mean", "algorithm.group_size=16",
        "train.reuse_rollout_forward=false", *overrides])


def peak(cfg, **changes) -> float:
    run = run_spec_from_config(cfg, device="cpu", cpu_baseline_bytes=guards.PROCESS_BASELINE_BYTES)
    return plan(shape_from_config(SMOLLM2, "smollm2"), replace(run, **changes)).memory.peak


def test_a_step_that_cannot_fit_is_named_with_the_largest_micro_batch_that_does():
    cfg = rft_g16()
    whole = peak(cfg)
    assert whole > 23 * GIB  # 64 rows of 512 + 256 tokens through the update's own forward at once
    line = guards.memory_warning(cfg, SMOLLM2, 23 * GIB)
    assert line.startswith(f"memory: a step at its longest (64 sequences of 512 prompt + 256 response tokens) needs about "
                           f"{whole / GIB:.1f} GiB by the planner, more than the 23.0 GiB")
    assert "algorithm.micro_batch_size=32" in line and "train.activation_checkpointing=true" in line
    # 32 is the largest power of two that fits; 64 (the whole batch) does not
    assert peak(cfg, micro_batch_size=32) <= 23 * GIB < peak(cfg, micro_batch_size=64)
    # with less memory the suggestion is smaller, and with enough there is nothing to say
    assert "algorithm.micro_batch_size=16 " in guards.memory_warning(cfg, SMOLLM2, 10 * GIB)
    assert guards.memory_warning(cfg, SMOLLM2, int(whole) + 1) is None


def test_when_nothing_fits_the_line_names_the_batch_and_length_settings():
    line = guards.memory_warning(rft_g16(), SMOLLM2, GIB // 4)  # less than the weights alone
    assert line.endswith("Set fewer sequences per step (algorithm.prompts_per_step, algorithm.group_size) or a shorter "
                         "sampling.max_new_tokens (cohortrl plan --config shows the breakdown)")


@pytest.mark.fast_path  # plans the update on decoding's recording, which only the fast path makes
def test_grpo_and_rft_on_decodings_recording_fit_where_rft_with_its_own_forward_does_not():
    """GRPO at G 16 ran on the same 24 GB machine: its update differentiates decoding's recording (no forward);
    so does RFT's now, by default. What the trainer decided is what is planned."""
    grpo = Config.from_yaml(REPO / "configs" / "pyfunc_grpo.yaml", ["model.init=null", "algorithm.group_size=16"])
    assert guards.memory_warning(grpo, SMOLLM2, 23 * GIB) is None
    assert guards.memory_warning(rft_g16("train.reuse_rollout_forward=true"), SMOLLM2, 23 * GIB) is None
    assert guards.memory_warning(rft_g16(), SMOLLM2, 23 * GIB) is not None
    # the config allows the recording, the trainer did not take it (LoRA dropout, a reward pool, ...)
    assert guards.memory_warning(rft_g16("train.reuse_rollout_forward=true"), SMOLLM2, 23 * GIB,
                                 reuse_rollout_forward=False) is not None


def test_a_cpu_run_logs_the_line_before_step_1_and_nothing_when_it_fits(tmp_path, addition_jsonl, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="cohortrl")
    monkeypatch.setattr(guards, "memory_available_bytes", lambda: GIB // 8)
    make_trainer(tiny_config(addition_jsonl), tmp_path / "short").close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: a step at its longest")]
    assert len(said) == 1 and "more than the 0.1 GiB this process can have here" in said[0]
    caplog.clear()
    monkeypatch.setattr(guards, "memory_available_bytes", lambda: 64 * GIB)
    make_trainer(tiny_config(addition_jsonl), tmp_path / "enough").close()
    assert not [r for r in caplog.records if r.getMessage().startswith("memory:")]


def test_the_available_memory_is_the_resident_part_plus_the_least_the_kernel_or_the_cgroup_leaves():
    meminfo = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    statm = "900000 250000 3000 1 0 400000 0\n"  # 250,000 resident pages
    resident = 250_000 * 4096
    assert guards.available_bytes(meminfo, statm, 4096) == resident + 20_000_000 * 1024
    assert guards.available_bytes(meminfo, statm, 4096, "max\n", "123\n") == resident + 20_000_000 * 1024
    # a container's limit: 8 GiB, of which 6 GiB in use, leaves 2 GiB whatever the host's MemAvailable says
    assert guards.available_bytes(meminfo, statm, 4096, f"{8 * GIB}\n", f"{6 * GIB}\n") == resident + 2 * GIB
    assert guards.available_bytes("MemTotal: 1 kB\n", statm, 4096) is None  # a kernel without MemAvailable


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads Linux's /proc/meminfo")
def test_on_linux_the_available_memory_is_read_and_holds_at_least_the_process_itself():
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert guards.memory_available_bytes() > resident


def test_processes_on_one_machine_each_hold_their_share_and_their_own_copy():
    """CPU torchrun: each of 2 processes plans half the batch with its own weights; the machine holds both."""
    cfg = rft_g16()
    one = peak(cfg, gpus=2)
    line = guards.memory_warning(cfg, SMOLLM2, int(1.5 * one), processes=2)
    assert f"in 2 processes) needs about {2 * one / GIB:.1f} GiB" in line
    assert guards.memory_warning(cfg, SMOLLM2, int(2 * one) + 1, processes=2) is None
