"""Scoring a rollout: call every reward function, check what it returns, and combine with weights.

Reward functions are called exactly as TRL's ``GRPOTrainer`` calls them, by keyword::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)

so a function written for TRL (``def reward_len(completions, **kwargs)``) works unchanged. For conversational
data (prompts that are lists of messages) ``prompts`` are those lists and each completion is
``[{"role": "assistant", "content": text}]``, as in TRL. cohortrl adds two columns of its own,
``completion_lengths`` (tokens) and ``max_new_tokens``.

A reward function that raises, returns the wrong number of values, or returns NaN / inf / a non-number
stops the run with a :class:`RewardFunctionError` naming the function, the sample index and the prompt (and,
for an exception, the file and line that raised) — never a silent zero. One that does not return within
``reward.timeout_s`` does not stop it: the batch is scored again one completion at a time, and a completion
it still does not return on scores 0 (failed) and is recorded as a grader error (``grader_errors.py``), as
the built-in graders' failures are. A slow reward is the policy's text meeting a costly grader, which
training must survive. ``None`` means "not scored by this function"; a sample that no function scores
stops the run.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from cohortrl.data import is_conversation, prompt_preview
from cohortrl.rewards import grader_errors
from cohortrl.rewards.functions import BUILTIN_REWARDS
from cohortrl.user_code import check_reward_signature, load_object

# The keyword arguments every call carries besides the rows' own columns (TRL's names and cohortrl's two,
# `rollout_columns`).
GIVEN = ("prompts", "completions", "completion_ids", "trainer_state", "completion_lengths", "max_new_tokens")


class RewardFunctionError(RuntimeError):
    pass


class RewardTimeoutError(RewardFunctionError):
    """A reward function that did not return within ``reward.timeout_s``."""


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as ``trainer_state``: the attributes of transformers' ``TrainerState`` that
    reward functions read (``global_step``: training steps done before this batch, ``max_steps``: the run's
    total), with the same names, so schedules written for TRL (``trainer_state.global_step / max_steps``) work."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class WeightedReward:
    name: str
    fn: Callable[..., list]
    weight: float = 1.0
    timeout_s: float | None = None  # per call; None or 0: wait for ever


def resolve(name: str, kwargs: dict | None = None) -> Callable[..., list]:
    """A built-in or registered reward by name (its factory gets ``kwargs``), or user code as ``module:function``
    / ``path/to/file.py:function`` (a plain reward function, or a factory when ``kwargs`` are given)."""
    return resolve_named(name, kwargs, BUILTIN_REWARDS, "reward function")


def resolve_named(name: str, kwargs: dict | None, registry: dict[str, Callable], what: str) -> Callable:
    """``registry[name](**kwargs)``, or the user function ``name`` names (called as a factory when ``kwargs``
    are given), checked for the reward signature. ``what`` names the kind in errors."""
    kwargs = kwargs or {}
    if name in registry:
        fn = registry[name](**kwargs)
    elif ":" not in name:
        raise RewardFunctionError(
            f"unknown {what} '{name}': use a registered one ({', '.join(registry)}), "
            "'module:function' or 'path/to/file.py:function'"
        )
    else:
        fn = load_object(name, what, RewardFunctionError)
        if not callable(fn):
            raise RewardFunctionError(f"{what} '{name}' is a {type(fn).__name__}, not a function")
        if kwargs:  # a factory: its kwargs come from the config, it returns the function
            try:
                fn = fn(**kwargs)
            except TypeError as e:
                raise RewardFunctionError(f"{what} factory '{name}' does not take kwargs {sorted(kwargs)}: {e}") from None
    check_reward_signature(fn, name, RewardFunctionError)
    return fn


def register_reward_function(name: str):
    """Decorator: make a plain reward function selectable by ``name`` in ``reward.functions``. A config's
    ``kwargs`` for it are bound as keyword arguments (``functools.partial``)."""

    def decorator(fn):
        if name in BUILTIN_REWARDS and getattr(BUILTIN_REWARDS[name], "__wrapped_reward__", None) is not fn:
            raise RewardFunctionError(f"reward function name '{name}' is already registered; pick another name")
        check_reward_signature(fn, name, RewardFunctionError)

        def factory(**kwargs):
            return functools.partial(fn, **kwargs) if kwargs else fn

        factory.__wrapped_reward__ = fn
        BUILTIN_REWARDS[name] = factory
        return fn

    return decorator


def _as_list(values, name: str, expected: int) -> list:
    """A reward function's return value as a list of ``expected`` values, or the error saying what it is."""
    if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
        raise RewardFunctionError(f"reward function '{name}' returned {type(values).__name__}; it must return a list of floats or None")
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != expected:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} values for {expected} completions; it must return one per completion"
        )
    return values


def _check(values, name: str, prompts: list[str], expected: int) -> list[float | None]:
    values = _as_list(values, name, expected)
    for i, v in enumerate(values):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"reward function '{name}' returned {v!r} ({type(v).__name__}) for sample {i} (prompt: {prompt_preview(prompts[i])!r}); "
                "rewards must be numbers or None"
            )
        if not math.isfinite(v):
            raise RewardFunctionError(
                f"reward function '{name}' returned {v} for sample {i} (prompt: {prompt_preview(prompts[i])!r}); rewards must be finite"
            )
    return [None if v is None else float(v) for v in values]


def call_with_timeout(fn, timeout_s: float | None, name: str, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, or :class:`RewardFunctionError` if it has not returned after ``timeout_s``.

    The call runs in a daemon thread. Python cannot kill a thread, so a hung call keeps running in the
    background until the process ends (a daemon thread does not keep the process alive); code that may hang
    or must be killed belongs in the sandbox (``cohortrl.grading.sandbox``), which runs it in a process."""
    if not timeout_s:
        return fn(*args, **kwargs)
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            result["error"] = e

    thread = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        n = len(kwargs["completions"]) if "completions" in kwargs else len(args[0])
        raise RewardTimeoutError(
            f"reward function '{name}' did not return within reward.timeout_s={timeout_s:g} s on {n} "
            "sample(s); it may hang (its thread is left running in the background). Fix the function or raise "
            "reward.timeout_s"
        )
    if "error" in result:
        raise result["error"]
    return result["value"]


def trl_completions(prompts: list, completions: list) -> list:
    """Completions as TRL hands them to reward functions: text for text prompts; for conversational prompts
    one assistant message each, ``[{"role": "assistant", "content": text}]``."""
    if not prompts or not is_conversation(prompts[0]):
        return completions
    return [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]


def reads(fn) -> list[str]:
    """What a reward function declares it reads: its named parameters without a default (TRL's convention, ``def
    f(completions, answer, **kwargs)`` reads the column ``answer``); a built-in's include the column its settings
    name (`cohortrl.rewards.functions.reading`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty]


def _unfilled(fn, kwargs: dict) -> list[str]:
    """Parameters of ``fn`` without a default that no keyword argument fills (a column the data lacks, or a
    parameter named otherwise than TRL names it, such as ``def f(p, c, **kw)``)."""
    return [name for name in reads(fn) if name not in kwargs]


def check_columns(functions: dict[str, Callable], rows: list[dict], what: str) -> None:
    """Refuse, before the first step, a reward function (``functions``: name -> function) that reads a column
    the ``rows`` do not have, which would otherwise stop the run when it is first called. ``what`` names the rows
    in the error ("training rows")."""
    if not rows:
        return  # none of these rows will be scored
    have = {key for row in rows for key in row} - {"prompt"}  # the prompt reaches a function as `prompts`
    for name, fn in functions.items():
        missing = [c for c in reads(fn) if c not in have and c not in GIVEN]
        if missing:
            raise RewardFunctionError(
                f"reward function '{name}' reads the column(s) {missing}, which the {what} do not have (they have: "
                f"{', '.join(sorted(have)) or 'only the prompt'}); {_column_fix(missing)}"
            )


def _column_fix(missing: list[str]) -> str:
    fixes = ["add the column(s) to the data"]
    if "answer" in missing:
        fixes.append("set data.answer_column to the column holding the reference answers")
    if "sample" in missing:
        fixes.append("train on a gym task (data.source: task:NAME), whose rows carry 'sample'")
    return ", ".join(fixes + ["or change the function (a parameter without a default is read as the column of its name)"])


def raised_at(error: BaseException, fn) -> str:
    """``file:line`` where ``error`` was raised: the deepest frame in ``fn``'s own file (where the user's code
    went wrong), else the deepest frame of all. Paths under the working directory are shown relative to it."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    code = getattr(inspect.unwrap(fn.func if isinstance(fn, functools.partial) else fn), "__code__", None)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    frame = (own or frames)[-1]
    path = frame.filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{frame.lineno} (in {frame.name})"


def _call(fn, name: str, prompts, completions, columns, timeout_s: float | None = None, failed=0.0) -> list:
    """``fn`` called as TRL calls a reward function (see the module docstring), with errors that name the
    function, the first sample it fails on and the file and line that raised. ``failed``: the value of a
    completion the function does not return on within ``timeout_s`` (a score of 0 in the function's shape)."""
    clash = sorted(set(columns) & {"prompts", "completions"})
    if clash:
        raise RewardFunctionError(f"the data has column(s) {clash}, names reward functions get for the batch; rename the column(s)")
    kwargs = {"prompts": prompts, "completions": trl_completions(prompts, completions), **columns}
    unfilled = _unfilled(fn, kwargs)
    if unfilled:
        raise RewardFunctionError(
            f"reward function '{name}' has parameter(s) {unfilled} that no argument fills: reward functions are called "
            f"by keyword with {', '.join(k for k in kwargs)}; rename the parameter(s) or add the column(s) to the data"
        )
    try:
        return call_with_timeout(fn, timeout_s, name, **kwargs)
    except RewardTimeoutError:
        return _one_at_a_time(fn, name, prompts, kwargs, timeout_s, failed)
    except Exception as batch_error:
        # Find the first sample that fails on its own, so the error can name it.
        for i in range(len(prompts)):
            try:
                call_with_timeout(fn, timeout_s, name, **_sample(kwargs, i))
            except RewardTimeoutError:
                continue  # slow on this one, not failing: the failing one is further on
            except Exception as e:
                raise _raised_on(fn, name, e, i, prompts) from e
        raise RewardFunctionError(
            f"reward function '{name}' raised {type(batch_error).__name__}: {batch_error} at {raised_at(batch_error, fn)} "
            "on the batch"
        ) from batch_error


def _raised_on(fn, name: str, error: Exception, i: int, prompts) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward function '{name}' raised {type(error).__name__}: {error} at {raised_at(error, fn)} on sample {i} "
        f"(prompt: {prompt_preview(prompts[i])!r})"
    )


def _sample(kwargs: dict, i: int) -> dict:
    """The keyword arguments of a batch call cut to sample ``i`` (every list argument to its one entry)."""
    return {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}


def _one_at_a_time(fn, name: str, prompts, kwargs: dict, timeout_s: float, failed) -> list:
    """``fn`` on each sample alone, after the batch did not return within ``timeout_s``: a sample it does not
    return on again scores ``failed`` and is recorded as a grader error; the others keep their values. (The
    timed-out threads run on in the background: Python cannot stop a thread. A function that holds the
    interpreter lock cannot even be waited for here; in the reward pool, ``reward.workers``, its worker
    process is killed instead.)"""
    out = []
    for i in range(len(prompts)):
        one = _sample(kwargs, i)
        try:
            values = call_with_timeout(fn, timeout_s, name, **one)
        except RewardTimeoutError:
            grader_errors.timed_out(name, prompts[i], one["completions"][0], timeout_s)
            out.append(failed)
            continue
        except Exception as e:
            raise _raised_on(fn, name, e, i, prompts) from e
        out += _as_list(values, name, 1)
    return out


def score(
    rewards: list[WeightedReward], prompts: list[str], completions: list[str], columns: dict[str, list],
    computed: dict[str, list] | None = None,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Total reward per completion (weighted sum of the functions that apply) and each function's values.
    ``computed`` holds values some functions already returned elsewhere (the reward pool); they are checked
    like the rest."""
    computed = computed or {}
    per_fn = {}
    for r in rewards:
        values = computed[r.name] if r.name in computed else _call(r.fn, r.name, prompts, completions, columns, r.timeout_s)
        per_fn[r.name] = _check(values, r.name, prompts, len(completions))
    totals = []
    for i in range(len(completions)):
        applied = [(r.weight, per_fn[r.name][i]) for r in rewards if per_fn[r.name][i] is not None]
        if not applied:
            raise RewardFunctionError(
                f"no reward function applies to sample {i} (all returned None; prompt: {prompt_preview(prompts[i])!r}); "
                "add a reward function that scores it or remove the sample from the data"
            )
        totals.append(sum(w * v for w, v in applied))
    return totals, per_fn


def rollout_columns(rollout, max_new_tokens: int, trainer_state: TrainerState | None = None) -> dict:
    """The keyword arguments reward functions receive for a ``rollout.types.Rollout`` besides prompts and
    completions (TRL's): the rows' columns (everything but the prompt), ``completion_ids`` (every token of the
    completion's text, tool results included), ``completion_lengths``, ``trainer_state`` and ``max_new_tokens``."""
    cols = {k: [row.get(k) for row in rollout.rows] for k in rollout.rows[0] if k != "prompt"}
    cols["completion_ids"] = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.response_ids, rollout.sequence_mask)]
    cols["completion_lengths"] = rollout.lengths.tolist()
    cols["max_new_tokens"] = [max_new_tokens] * rollout.batch_size
    cols["trainer_state"] = trainer_state or TrainerState()
    return cols


def score_rollout(rewards: list[WeightedReward], rollout, max_new_tokens: int, computed: dict | None = None,
                  trainer_state: TrainerState | None = None) -> tuple[list[float], dict[str, list[float | None]]]:
    """``score`` on a rollout's prompts and completions, with ``rollout_columns``."""
    cols = rollout_columns(rollout, max_new_tokens, trainer_state)
    return score(rewards, [r["prompt"] for r in rollout.rows], rollout.completions, cols, computed)
