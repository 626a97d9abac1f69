"""A built-in grader that fails on a completion scores it 0 instead of stopping the run.

The built-in graders (the gym's families behind the ``task`` reward, ``accuracy`` and ``format``) must
return a score for any text a policy writes, and the fuzz suite (tests/tasks/test_grader_fuzz.py) checks
that they do. If one still raises, that is a bug in the grader, not in the run: the completion scores 0, the
failure is logged at WARNING, and a record of it (reward, prompt, completion, traceback) waits here until
the trainer writes it to ``RUN_DIR/grader_errors.jsonl`` and counts it in the step's ``grader_errors``
metric. A user's own reward function is not contained: its exception stops the run (``scoring.py``),
because there the fix is the user's. Time is another matter: any reward, built-in or the user's, that does
not return within ``reward.timeout_s`` on a completion scores that completion 0 and is recorded here
(`timed_out`), since the text that made it slow is the policy's, and the run goes on.

    score = contained("task", prompt, completion, lambda: family.grade(sample, completion).score)
    drain()  # -> [{"reward", "prompt", "completion", "error", "traceback"}, ...], oldest first
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

# Records kept between drains. A trainer drains every step, far below this; a process that grades without
# a trainer never drains, and keeps only the newest (each failure was logged when it happened).
MAX_KEPT = 1000
# Reward pool workers send their records back with the scores under this key (``pool.py``).
POOL_KEY = "__grader_errors__"
FILE = "grader_errors.jsonl"  # in the run directory, one record per line with its "step"

_lock = threading.Lock()
_records: deque[dict] = deque(maxlen=MAX_KEPT)


def contained(reward: str, prompt: Any, completion: Any, grade: Callable[[], Any], failed: Any = 0.0) -> Any:
    """``grade()``, or ``failed`` (a score of 0 in the reward's own shape) if it raises: the failure is logged
    and kept for `drain`."""
    try:
        return grade()
    except Exception as e:  # noqa: BLE001  (any bug in a built-in grader: reported, never fatal)
        record({"reward": reward, "prompt": prompt, "completion": completion,
                "error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()})
        log.warning("built-in reward '%s' failed on a completion (%s: %s); it scores 0 (the trainer writes the "
                    "completion and traceback to RUN_DIR/grader_errors.jsonl)", reward, type(e).__name__, str(e)[:200])
        return failed


def timed_out(reward: str, prompt: Any, completion: Any, timeout_s: float) -> None:
    """Record a reward call on one completion that did not return within ``reward.timeout_s``: the completion
    scores as failed (``scoring._call``, ``pool.RewardPool``) and the run goes on."""
    error = f"RewardTimeoutError: no result within reward.timeout_s={timeout_s:g} s"
    record({"reward": reward, "prompt": prompt, "completion": completion, "error": error, "traceback": ""})
    log.warning("reward '%s' did not return within reward.timeout_s=%g s on a completion; it scores 0 (the "
                "trainer writes the completion to RUN_DIR/grader_errors.jsonl)", reward, timeout_s)


def record(entry: dict) -> None:
    with _lock:
        _records.append(entry)


def drain() -> list[dict]:
    """Every record kept since the last drain, oldest first; the store is empty afterwards."""
    with _lock:
        out = list(_records)
        _records.clear()
    return out
