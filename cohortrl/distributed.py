"""Data parallelism under ``torchrun``, with PyTorch's own engine (DDP), and the few collectives the trainer needs.

``torchrun --nproc-per-node N -m cohortrl train CONFIG`` starts N copies of the trainer. Each reads the same
prompt stream and takes its share of the step's P prompts (P / N whole groups: a prompt's G responses stay on
one rank, so group statistics are local and exact). Everything that is a statistic of the whole batch is
computed on the gathered batch, so the update does not depend on N:

* advantages: the estimator runs on the gathered rewards and response masks (batch-std scaling,
  REINFORCE++ whitening and any user estimator see the global batch), each rank keeps its rows;
* loss aggregation: the token weights (``token_weights``) come from the gathered loss mask, so token-mean
  divides by the global token count; DDP averages gradients over ranks, so each rank's loss is scaled by N;
* metrics: rewards, accuracy, zero-variance counts and lengths are gathered; loss sums are all-reduced.

Sampling is made independent of N by seeding each group's generation from (seed, step, global group index).
A 1-process and a 2-process run with the same config therefore compute the same update
(``tests/test_distributed.py`` checks the parameters after a step with gloo on CPU).

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) ``Dist`` is the single-process identity and the
trainer runs as it always did. Algorithms never import this module.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    launched: bool = False  # started by torchrun (even with one process): the distributed code path

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ sharding the step's groups
    def local_groups(self, n_groups: int) -> range:
        """The global indices of the groups this rank generates and trains on."""
        per_rank = n_groups // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_rows(self, x_B: torch.Tensor, group_size: int, length: int | None = None) -> torch.Tensor:
        """This rank's rows of a gathered (B, ...) tensor, optionally cut to its own padded length."""
        groups = self.local_groups(x_B.shape[0] // group_size)
        x = x_B[groups.start * group_size : groups.stop * group_size]
        return x[:, :length] if length is not None else x

    # ------------------------------------------------------------------ collectives (identity on one process)
    def gather_rows(self, x_B: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's (b, ...) rows in rank order; a second dimension is right-padded with 0 to
        the longest rank's (response lengths differ between ranks)."""
        if not self.launched or self.world == 1:
            return x_B
        import torch.distributed as dist

        if x_B.dim() >= 2:
            width = torch.tensor([x_B.shape[1]])
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            x_B = torch.nn.functional.pad(x_B, (0, int(width) - x_B.shape[1]))
        parts = [torch.empty_like(x_B) for _ in range(self.world)]
        dist.all_gather(parts, x_B.contiguous())
        return torch.cat(parts)

    def gather_list(self, values: list) -> list:
        """Concatenate every rank's Python list in rank order."""
        if not self.launched or self.world == 1:
            return values
        import torch.distributed as dist

        parts: list = [None] * self.world
        dist.all_gather_object(parts, values)
        return [v for part in parts for v in part]

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Every value summed over ranks (same keys on every rank)."""
        if not self.launched or self.world == 1:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.launched or self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.launched and self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------ the model
    def wrap(self, model):
        """The module the update runs forward/backward through: ``model`` itself on one process, else DDP.
        Generation, the reference and saving keep using the plain ``model`` (it shares its parameters)."""
        if not self.launched or self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: buffers (rotary frequencies) never change, and broadcasting them would make
        # every forward a collective, which ranks with different micro-batch counts could not match.
        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)

    @contextlib.contextmanager
    def no_sync(self, module, sync: bool):
        """Accumulate gradients locally unless ``sync`` (the last micro-batch before an optimiser step)."""
        if sync or not hasattr(module, "no_sync"):
            yield
        else:
            with module.no_sync():
                yield

    def close(self) -> None:
        if self.launched:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def from_env() -> Dist:
    """A ``Dist`` for this process: torchrun's (initialising the process group, gloo on CPU, NCCL on GPU) when
    ``WORLD_SIZE`` is set, else the single-process identity."""
    if "WORLD_SIZE" not in os.environ:
        return Dist()
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), launched=True)


def resolve_device(setting: str, dist: Dist) -> torch.device:
    """``train.device``: ``auto`` is the GPU when PyTorch sees one (``cuda:LOCAL_RANK`` under torchrun), else
    the CPU."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and dist.launched:
        setting = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        from cohortrl.config import ConfigError

        raise ConfigError(f"config key 'train.device' = {setting!r}: PyTorch sees no CUDA GPU here; use auto or cpu")
    return torch.device(setting)


def group_seed(seed: int, step: int, group: int) -> int:
    """The sampling seed of one group: a function of the run's seed, the step and the group's global index,
    never of the number of processes."""
    return (seed * 1_000_003 + step) * 1_000_033 + group
