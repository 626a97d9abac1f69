"""Prompts for training and evaluation: gym tasks, JSONL files and Hugging Face datasets, as rows of dicts.

Every row has ``prompt`` (the user message) and usually ``answer``; other columns are passed to reward
functions by name (TRL's convention). Rows from a gym task also carry ``sample`` (the task sample as a dict).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path


class DataError(ValueError):
    pass


def load_rows(cfg, seed: int, rows: list[dict] | None = None, eval_rows: list[dict] | None = None):
    """(train rows, held-out eval rows) for a ``config.DataConfig``; eval prompts never appear in train.

    ``rows`` are the Python API's in-memory rows (``data.source = python:NAME``); they are split into train and
    held-out exactly as a JSONL file's rows are, unless ``eval_rows`` are given (then used as held-out)."""
    kind, _, arg = cfg.source.partition(":")
    if kind == "python":
        if rows is None:
            raise DataError(
                f"data.source {cfg.source!r} means the rows were given in Python: pass train_dataset= to the trainer "
                "(a config file alone cannot hold them; use jsonl:PATH to run it from the command line)"
            )
        loaded = [_rename(_transformed(dict(r), cfg, f"{cfg.source} row {i}"), cfg, f"{cfg.source} row {i}") for i, r in enumerate(rows)]
        if not loaded:
            raise DataError(f"data.source {cfg.source!r}: train_dataset holds no rows")
        train, held_out = (loaded, []) if eval_rows is not None else _split(loaded, cfg.eval_size, seed)
    elif kind == "task":
        train, held_out = _task_rows(arg, cfg, seed)
    elif kind == "jsonl":
        train, held_out = (_jsonl_rows(Path(arg), cfg), []) if eval_rows is not None else _split(_jsonl_rows(Path(arg), cfg), cfg.eval_size, seed)
    elif kind == "hf":
        train, held_out = _hf_rows(arg, cfg)
    else:
        raise DataError(f"data.source {cfg.source!r}: use task:NAME, jsonl:PATH, hf:DATASET_ID or python:NAME")
    if eval_rows is not None:
        held_out = [_rename(_transformed(dict(r), cfg, f"eval_dataset row {i}"), cfg, f"eval_dataset row {i}") for i, r in enumerate(eval_rows)]
    if cfg.train_size and kind != "task":
        train = train[: cfg.train_size]
    eval_prompts = {r["prompt"] for r in held_out}
    train = [r for r in train if r["prompt"] not in eval_prompts]
    if not train:
        raise DataError(f"data.source {cfg.source!r} left no training prompts after holding out {len(held_out)} for evaluation")
    for rows, what in ((train, "training"), (held_out, "evaluation")):
        for i, r in enumerate(rows):
            if not isinstance(r["prompt"], str) or not r["prompt"].strip():
                raise DataError(f"{what} row {i} of {cfg.source!r} has an empty prompt")
    return train, held_out


def _task_rows(name: str, cfg, seed: int):
    from cohortrl import tasks

    family = tasks.get(name)

    def rows(n, s):
        return [{"prompt": x.prompt, "answer": x.answer, "sample": x.to_dict()} for x in family.sample(n, s, cfg.level)]

    # Easy levels have small pools of distinct problems: draw until eval_size distinct prompts are found.
    held_out, drawn = [], cfg.eval_size
    while len(held_out) < cfg.eval_size:
        held_out = _dedupe(rows(drawn, seed + 1_000_003))[: cfg.eval_size]
        if len(held_out) < cfg.eval_size and drawn >= 8 * cfg.eval_size:
            raise DataError(
                f"task {name!r} level {cfg.level} has only about {len(held_out)} distinct prompts; "
                f"lower data.eval_size (now {cfg.eval_size}) or raise data.level"
            )
        drawn *= 2
    return rows(cfg.train_size, seed), held_out


def _dedupe(rows):
    seen, out = set(), []
    for r in rows:
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append(r)
    return out


@functools.lru_cache(maxsize=8)
def _transform_fn(ref: str):
    import inspect

    from cohortrl.user_code import load_object

    fn = load_object(ref, "data.transform", DataError)
    try:
        inspect.signature(fn).bind({})
    except TypeError:
        raise DataError(f"data.transform '{ref}' has signature {fn.__name__}{inspect.signature(fn)}; it must take one row (a dict) and return a dict") from None
    except ValueError:
        pass  # a builtin without a signature: its call will tell
    return fn


def _transformed(row: dict, cfg, where: str) -> dict:
    """``data.transform`` applied to one row (the identity when unset)."""
    if not cfg.transform:
        return row
    fn = _transform_fn(cfg.transform)
    try:
        out = fn(row)
    except Exception as e:
        raise DataError(f"data.transform '{cfg.transform}' raised {type(e).__name__} on {where}: {e}") from e
    if not isinstance(out, dict):
        raise DataError(
            f"data.transform '{cfg.transform}' returned {type(out).__name__} for {where}; it must return the row as a dict"
        )
    return out


def _rename(row: dict, cfg, where: str) -> dict:
    missing = [c for c in (cfg.prompt_column,) if c not in row]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; columns found: {sorted(row)} (set data.prompt_column)")
    prompt = row[cfg.prompt_column]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(
            f"{where}: the prompt (column {cfg.prompt_column!r}) is {prompt!r}; it must be non-empty text "
            "(fix or remove the row, or set data.prompt_column)"
        )
    out = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.answer_column)}
    out["prompt"] = row[cfg.prompt_column]
    if cfg.answer_column in row:
        out["answer"] = row[cfg.answer_column]
    return out


def _jsonl_rows(path: Path, cfg) -> list[dict]:
    if not path.is_file():
        raise DataError(f"data file not found: {path} (data.source=jsonl:PATH needs an existing JSONL file)")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e}); convert the file to UTF-8") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text.rstrip("\r\n"))  # so a line cut short reports its own column, not the next line's
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(_rename(_transformed(row, cfg, f"{path}:{lineno}"), cfg, f"{path}:{lineno}"))
    if not rows:
        raise DataError(f"{path} holds no rows")
    return rows


def _split(rows: list[dict], eval_size: int, seed: int):
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    if eval_size >= len(rows):
        raise DataError(f"data.eval_size={eval_size} leaves no training rows out of {len(rows)}; lower it")
    return [rows[i] for i in order[eval_size:]], [rows[i] for i in order[:eval_size]]


def _hf_rows(dataset_id: str, cfg):
    try:
        import datasets
    except ImportError:
        raise DataError("data.source=hf:... needs the `datasets` package: pip install 'cohortrl[hub]'") from None
    name, _, subset = dataset_id.partition("@")  # hf:openai/gsm8k@main
    ds = datasets.load_dataset(name, subset or None)
    train = [_rename(_transformed(dict(r), cfg, f"{name}[{cfg.split}] row {i}"), cfg, f"{name}[{cfg.split}] row {i}")
             for i, r in enumerate(ds[cfg.split])]
    held_out = [_rename(_transformed(dict(r), cfg, f"{name}[{cfg.eval_split}] row {i}"), cfg, f"{name}[{cfg.eval_split}] row {i}")
                for i, r in enumerate(ds[cfg.eval_split])][: cfg.eval_size]
    return train, held_out


class PromptStream:
    """An endless, seeded, resumable stream over training rows: shuffled each epoch, position saved in checkpoints."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "n_rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        if state["n_rows"] != len(self.rows):
            raise DataError(f"checkpoint was taken on {state['n_rows']} training rows, the data now has {len(self.rows)}")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)
