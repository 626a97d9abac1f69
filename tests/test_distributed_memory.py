"""What a rank holds under torchrun (gloo, 2 processes on CPU): the chunked LM head inside DDP's and FSDP2's
forward (no (B, T, V) logits, the same log-probs and gradients as one process); FSDP2 loading the model on rank 0
alone and sending each rank its shards, and checkpoints gathered whole on rank 0 only."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def torchrun_script(script: str, *args: str, nproc: int = 2, timeout: int = 300) -> str:
    """Run ``tests/<script>`` under torchrun with gloo; returns its stdout (fails the test on a non-zero exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / script), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    return out.stdout


def ranks_ok(stdout: str) -> list[str]:
    """The ranks that printed ``rank R ok``: both processes share one stdout pipe, so their lines can interleave
    (CI once saw ``rank 1 okrank 0 ok``); the test asks which ranks reported, not how the pipe merged them."""
    return sorted(re.findall(r"rank (\d+) ok", stdout))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_chunked_lm_head_runs_inside_the_wrapped_forward(strategy):
    """``distributed.forward_inside`` under DDP and FSDP2: the checks are in ``tests/wrapped_logprobs_check.py``."""
    assert ranks_ok(torchrun_script("wrapped_logprobs_check.py", strategy)) == ["0", "1"]


@pytest.mark.parametrize("variant", ["plain", "lora", "bf16"])
def test_fsdp2_loads_on_rank_0_and_sends_each_rank_its_shards(variant):
    """``Dist.load`` and ``Dist.wrap`` under FSDP2: the checks are in ``tests/fsdp_rank0_load_check.py``."""
    assert ranks_ok(torchrun_script("fsdp_rank0_load_check.py", variant)) == ["0", "1"]
