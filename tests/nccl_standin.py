"""``python -m tests.nccl_standin ARGS``: the cohortrl CLI in a process where, as on a GPU machine, PyTorch reports
CUDA and NCCL is the GPU's backend, but NCCL is a stand-in that, like NCCL, serves CUDA tensors only.

The stand-in is a c10d backend registered for the ``cuda`` device type alone (its work is done by gloo), and
every backend string that names ``nccl`` gets it instead. A collective on a CPU tensor that the process group
maps to it fails as it would under NCCL (``No backend type associated with device type cpu``). Only
``torch.cuda.is_available`` (True) and ``torch.cuda.set_device`` (nothing to set) are faked; the run itself is
given ``train.device=cpu``. The stand-in prints the timeout its group was built with, once per rank."""

import sys

import torch
import torch.distributed as dist

STANDIN = "cudaonly"


def _create(store, rank, size, timeout):
    print(f"nccl stand-in: rank {rank} of {size}, timeout {timeout.total_seconds():g} s", file=sys.stderr, flush=True)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install() -> None:
    dist.Backend.register_backend(STANDIN, _create, devices=["cuda"])
    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        return init(backend.replace("nccl", STANDIN) if isinstance(backend, str) else backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    torch.cuda.is_available = lambda: True
    torch.cuda.set_device = lambda device: None


if __name__ == "__main__":
    install()
    from cohortrl.cli import main

    sys.exit(main(sys.argv[1:]))
