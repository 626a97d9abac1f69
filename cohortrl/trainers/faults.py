"""Deterministic fault injection for the crash-and-resume tests: ``COHORTRL_FAULT="phase:count"`` makes the
process kill itself (SIGKILL, no cleanup, as an OOM killer or a pre-empted machine would) the count-th time
it reaches the named point. Several points may be given, comma-separated (``generate:3,update:1``).

The points, in the order a step meets them: ``generate`` (before a prompt batch is sampled), ``update`` (after
the backward pass, before the optimiser step), ``checkpoint-manifest`` (a checkpoint's or ``final/``'s files
written and synced, its manifest not yet), ``checkpoint-write`` (the manifest written too, the directory not
yet renamed into place), ``final-written`` (``final/`` in place, the curves and the exit still to come). Unset,
a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "COHORTRL_FAULT"
POINTS = ("generate", "update", "checkpoint-manifest", "checkpoint-write", "final-written")

_seen: dict[str, int] = {}


def parse(spec: str) -> dict[str, int]:
    """``"generate:3,update:1"`` -> ``{"generate": 3, "update": 1}``."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        phase, _, count = item.partition(":")
        if phase not in POINTS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{ENV}={spec!r}: each item must be PHASE:COUNT with PHASE one of {', '.join(POINTS)} and COUNT >= 1")
        out[phase] = int(count)
    return out


def point(phase: str) -> None:
    """Kill this process here if ``COHORTRL_FAULT`` asks for it at this visit of ``phase``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    _seen[phase] = _seen.get(phase, 0) + 1
    if parse(spec).get(phase) == _seen[phase]:
        os.kill(os.getpid(), signal.SIGKILL)
