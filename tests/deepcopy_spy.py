"""``python -m tests.deepcopy_spy ARGS``: the cohortrl CLI, with every ``copy.deepcopy`` of a torch module reported on
stderr as ``deepcopy: <class> <n> parameter elements`` (what a whole copy of a model costs a rank)."""

import copy
import sys

import torch

_deepcopy = copy.deepcopy


def deepcopy(obj, *args, **kwargs):
    if isinstance(obj, torch.nn.Module):
        n = sum(p.numel() for p in obj.parameters())
        print(f"deepcopy: {type(obj).__name__} {n} parameter elements", file=sys.stderr, flush=True)
    return _deepcopy(obj, *args, **kwargs)


if __name__ == "__main__":
    copy.deepcopy = deepcopy
    from cohortrl.cli import main

    sys.exit(main(sys.argv[1:]))
