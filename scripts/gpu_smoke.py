"""The checks of ``scripts/gpu_smoke.sh``, one per call: ``python scripts/gpu_smoke.py CHECK WORK_DIR``.

Each prints one line, ``PASS CHECK: what was seen``, and exits 0, or raises (the driver prints the failure's
last line). Every model is built from a config (``tiny-llama-4l``: 4 layers, hidden 128, head size 32, which
vLLM's attention kernels take); nothing is downloaded. ``SMOKE_DEVICE`` (default ``auto``) is
``train.device``: on a GPU machine the GPU, here ``cpu`` for the checks a CPU can run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEVICE = os.environ.get("SMOKE_DEVICE", "auto")
MODEL = "tiny-llama-4l"


def sft_config(**sections):
    from cohortrl.config import Config

    base = {
        "model": {"name": MODEL, "system_prompt": None},
        "data": {"source": "task:arithmetic", "train_size": 24, "eval_size": 0},
        "reward": {"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
        "sampling": {"max_new_tokens": 8},
        "train": {"steps": 10, "progress": False, "device": DEVICE},
        "eval": {"before": False, "n_prompts": 0},
        "sft": {"batch_size": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Config.from_dict(base)


def collectives(work: Path) -> str:
    """Under ``torchrun --nproc-per-node 1``: the process group cohortrl builds serves the CPU tensors and objects
    the trainer's own collectives use and, on a GPU, CUDA tensors (NCCL)."""
    import torch.distributed as dist

    from cohortrl import distributed

    d = distributed.from_env("ddp", timeout_s=120)
    assert d.launched and dist.is_initialized()
    seen = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        t = torch.arange(4.0, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        parts = [torch.empty_like(t)]
        dist.all_gather(parts, t)
        assert torch.equal(parts[0], torch.arange(4.0, device=device))
        seen.append(device)
    objects = [None]
    dist.all_gather_object(objects, {"rank": d.rank})
    box = [{"x": 1}]
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    assert objects == [{"rank": 0}] and box == [{"x": 1}]
    backend = str(dist.get_backend())
    d.close()
    return f"all_reduce/all_gather on {'+'.join(seen)} tensors, object collectives, barrier (group backend {backend})"


def bf16_full(work: Path) -> str:
    """Full fine-tuning in bf16 at lr 1e-5: the weights move (float32 master copies)."""
    from cohortrl.trainers.sft import SFTTrainer

    trainer = SFTTrainer(sft_config(model={"dtype": "bfloat16"}, optim={"lr": 1e-5}), work / "bf16_full")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(10):
        trainer.step()
    changed = total = 0
    for n, p in trainer.model.named_parameters():
        mid = (start[n].float().abs() >= 0.01) & (start[n].float().abs() < 0.05)
        changed += ((p.detach() != start[n]) & mid).sum().item()
        total += mid.sum().item()
    device = next(trainer.model.parameters()).device
    trainer.close()
    assert total and changed / total > 0.5, f"only {changed} of {total} weights with 0.01 <= |w| < 0.05 moved"
    return f"10 SFT steps on {device}: {changed / total:.0%} of {total} weights with 0.01 <= |w| < 0.05 moved"


def lora(work: Path) -> str:
    """LoRA on a bf16 base at lr 1e-3: the SFT loss on the same 24 examples falls over 10 steps."""
    from cohortrl.trainers.sft import SFTTrainer

    cfg = sft_config(model={"dtype": "bfloat16", "lora": {"enabled": True, "r": 8}}, optim={"lr": 1e-3})
    trainer = SFTTrainer(cfg, work / "lora")
    losses = [trainer.step()["loss"] for _ in range(10)]
    trainer.close()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"loss {first:.3f} -> {last:.3f}"
    return f"10 SFT steps: loss {first:.3f} (first 3) -> {last:.3f} (last 3)"


def compare_final(work: Path) -> str:
    """The FSDP2 run resumed from its step-2 checkpoint ends where the uninterrupted one ends."""
    from safetensors.torch import load_file

    def weights(run):
        out = {}
        for f in sorted((work / run / "final").glob("*.safetensors")):
            out.update({f"{f.stem}/{k}": v.float() for k, v in load_file(f).items()})
        return out

    a, b = weights("fsdp_whole"), weights("fsdp_resumed")
    assert a and sorted(a) == sorted(b), "the two runs' final weights differ in names"
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-2, f"largest weight difference {worst:.3g}"
    return f"4 steps = 2 + resume 2 under FSDP2 (bf16): largest weight difference {worst:.3g}"


def vllm(work: Path) -> str:
    """GRPO sampled by vLLM at temperature 0.7: the weights reach the engine before each step after the first,
    and the importance weights of the engine's sampling are near 1 (the engine's numerics differ slightly)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "SKIP: vllm is not installed"
    from cohortrl.config import Config
    from cohortrl.trainers.grpo import GRPOTrainer

    cfg = Config.from_dict({
        "model": {"name": MODEL, "system_prompt": None, "dtype": "bfloat16"},
        "data": {"source": "task:arithmetic", "level": 1, "train_size": 50, "eval_size": 0},
        "sampling": {"backend": "vllm", "temperature": 0.7, "max_new_tokens": 16},
        "reward": {"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}, {"name": "format", "weight": 0.2}],
                   "correctness": "accuracy"},
        "algorithm": {"group_size": 4, "prompts_per_step": 4, "beta": 0.04},
        "optim": {"lr": 1e-4},
        "train": {"steps": 3, "progress": False, "device": DEVICE},
        "eval": {"before": False, "n_prompts": 0},
    })
    trainer = GRPOTrainer(cfg, work / "vllm")
    rows = [r for r in trainer.train() if "loss" in r]
    trainer.close()
    weights = [r["is_weight_mean"] for r in rows]
    synced = ["time/weight_sync" in r for r in rows]
    assert len(rows) == 3 and all(abs(w - 1) < 0.05 for w in weights), f"is_weight_mean {weights}"
    assert synced == [False, True, True], f"weight syncs per step {synced}"
    return f"3 GRPO steps at T 0.7: is_weight_mean {', '.join(f'{w:.4f}' for w in weights)}; synced before steps 2 and 3"


CHECKS = {"collectives": collectives, "bf16_full": bf16_full, "lora": lora, "fsdp_save_resume": compare_final, "vllm": vllm}

if __name__ == "__main__":
    name, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    result = CHECKS[name](work)
    if int(os.environ.get("RANK", "0")) == 0:
        print(result if result.startswith("SKIP") else f"PASS {name}: {result}")
