"""``python -m tests.call_spy ARGS``: the cohortrl CLI, with two kinds of call reported on stderr, each with the
rank that made it: the rollout engine's (``rollout.engine.HFEngine.generate``, the sampler's generation) as
``generate: rank R rows N``, and a checkpoint's reading (``trainers.checkpoint.load``) as
``checkpoint read: rank R``."""

import os
import sys

from cohortrl.rollout.engine import HFEngine
from cohortrl.trainers import checkpoint

RANK = os.environ.get("RANK", "0")
_generate, _load = HFEngine.generate, checkpoint.load


def generate(self, rows, *args, **kwargs):
    print(f"generate: rank {RANK} rows {len(rows)}", file=sys.stderr, flush=True)
    return _generate(self, rows, *args, **kwargs)


def load(path):
    print(f"checkpoint read: rank {RANK}", file=sys.stderr, flush=True)
    return _load(path)


if __name__ == "__main__":
    HFEngine.generate, checkpoint.load = generate, load
    from cohortrl.cli import main

    sys.exit(main(sys.argv[1:]))
