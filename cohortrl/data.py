"""Prompts for training and evaluation: gym tasks, JSONL files and Hugging Face datasets, as rows of dicts.

Every row has ``prompt`` and usually ``answer``; other columns are passed to reward functions by name (TRL's
convention). Rows from a gym task also carry ``sample`` (the task sample as a dict).

A prompt is either text (the user's message) or, as in TRL's conversational format, a conversation: a list of
``{"role": ..., "content": ...}`` messages, rendered with the model's chat template (:func:`render_prompt`).
One dataset holds one kind or the other, not both.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from dataclasses import replace
from pathlib import Path

log = logging.getLogger("cohortrl")


class DataError(ValueError):
    pass


ROLES = ("system", "user", "assistant", "tool")
# Held-out prompts drawn from a gym task or a hub dataset's eval split when data.eval_size is not set.
DEFAULT_EVAL_SIZE = 200


def is_conversation(prompt) -> bool:
    """Whether ``prompt`` is in TRL's conversational format (a list of messages) rather than text."""
    return isinstance(prompt, list)


def check_prompt(prompt, where: str, column: str | None = None) -> None:
    """Raise :class:`DataError` naming ``where`` (and the ``column`` read) unless ``prompt`` is non-empty text or a well-formed conversation:
    messages with a known ``role`` and text ``content``, at least one of them from the user."""
    what = "the prompt" if column is None else f"the prompt (column {column!r})"
    if isinstance(prompt, str) and not prompt.strip() or not isinstance(prompt, (str, list)) or not prompt:
        raise DataError(
            f"{where}: {what} is {repr(prompt)[:100]}; it must be non-empty text or a "
            "list of {'role': ..., 'content': ...} messages (fix or remove the row, or set data.prompt_column)"
        )
    if isinstance(prompt, str):
        return
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"} or "role" not in message:
            raise DataError(
                f"{where}: message {j} of the conversation is {str(message)[:100]!r}; each message must be a dict "
                "with 'role' and 'content' (and nothing else but an optional 'name')"
            )
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has role {message['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(
                f"{where}: message {j} ({message['role']}) has content {message.get('content')!r}; it must be text"
            )
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: the conversation has no user message; give at least one {{'role': 'user', ...}}")


def prompt_messages(prompt, system_prompt: str | None = None) -> list[dict]:
    """The prompt as chat messages: text becomes the user's turn after ``system_prompt`` (when not None); a
    conversation is copied as it stands, ``system_prompt`` going first only if it has no system message."""
    messages = [dict(m) for m in prompt] if is_conversation(prompt) else [{"role": "user", "content": prompt}]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(tokenizer, prompt, system_prompt: str | None = None, tools: list[dict] | None = None) -> str:
    """The prompt as the model sees it, through its chat template, ready for the assistant's answer.

    The messages are :func:`prompt_messages`. A conversation that ends with an assistant message is continued
    inside that message (``continue_final_message``, as TRL does), otherwise the assistant's header is added.
    ``tools``: JSON schemas the template describes itself (``apply_chat_template(tools=...)``; docs/tools.md's
    chat protocol); None leaves them out."""
    messages = prompt_messages(prompt, system_prompt)
    extra = {"tools": tools} if tools is not None else {}
    if messages[-1]["role"] == "assistant":
        return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, **extra)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def prompt_key(prompt) -> str:
    """A hashable identity of a prompt (text or conversation), for de-duplication and held-out exclusion."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def problem_id(row: dict) -> str:
    """A stable name of a held-out problem, the key on which two evaluations are paired: a gym sample's own id,
    else a hash of its prompt (the same prompt is the same problem in every run that draws it)."""
    sample_id = (row.get("sample") or {}).get("id")
    return sample_id or "sha1:" + hashlib.sha1(prompt_key(row["prompt"]).encode()).hexdigest()[:16]


def prompt_preview(prompt, limit: int = 200) -> str:
    """A prompt shortened for error messages: the text, or a conversation's last message."""
    text = prompt if isinstance(prompt, str) else f"[{len(prompt)} messages] ... {prompt[-1].get('content', '')}"
    return text[:limit]


def draw_seed(cfg, run_seed: int) -> int:
    """The seed that draws a ``config.DataConfig``'s problems and held-out split: ``data.seed``, else the run's."""
    return run_seed if cfg.seed is None else cfg.seed


def load_rows(cfg, seed: int, rows: list[dict] | None = None, eval_rows: list[dict] | None = None):
    """(train rows, held-out eval rows) for a ``config.DataConfig``; eval prompts never appear in train.
    ``seed`` is the run's ``train.seed``, used unless ``data.seed`` is set (:func:`draw_seed`).

    ``rows`` are the Python API's in-memory rows (``data.source = python:NAME``). A user's own rows (in Python or
    a JSONL file) are all trained on unless ``data.eval_size`` is set, which holds that many out; ``eval_rows``
    are used as the held-out set instead. Gym tasks and hub datasets hold out ``data.eval_size`` prompts
    (default :data:`DEFAULT_EVAL_SIZE`)."""
    seed = draw_seed(cfg, seed)
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
        train, held_out = (loaded, []) if eval_rows is not None else _split(loaded, cfg.eval_size or 0, seed)
    elif kind == "task":
        train, held_out = _task_rows(arg, cfg, seed)
    elif kind == "jsonl":
        loaded = _jsonl_rows(Path(arg), cfg)
        train, held_out = (loaded, []) if eval_rows is not None else _split(loaded, cfg.eval_size or 0, seed)
    elif kind == "hf":
        train, held_out = _hf_rows(arg, cfg)
    else:
        raise DataError(f"data.source {cfg.source!r}: use task:NAME, jsonl:PATH, hf:DATASET_ID or python:NAME")
    if eval_rows is not None:
        held_out = [_rename(_transformed(dict(r), cfg, f"eval_dataset row {i}"), cfg, f"eval_dataset row {i}") for i, r in enumerate(eval_rows)]
    if cfg.train_size and kind != "task":
        train = train[: cfg.train_size]
    eval_prompts = {prompt_key(r["prompt"]) for r in held_out}
    train = [r for r in train if prompt_key(r["prompt"]) not in eval_prompts]
    if not train:
        raise DataError(f"data.source {cfg.source!r} left no training prompts after holding out {len(held_out)} for evaluation")
    for rows, what in ((train, "training"), (held_out, "evaluation")):
        for i, r in enumerate(rows):
            check_prompt(r["prompt"], f"{what} row {i} of {cfg.source!r}")
    _check_one_format(train, held_out, cfg.source)
    return train, held_out


def _check_one_format(train: list[dict], held_out: list[dict], source: str) -> None:
    """Text and conversational prompts in one dataset are refused, naming the first row of the rarer kind."""
    rows = [(f"training row {i}", r) for i, r in enumerate(train)] + [(f"evaluation row {i}", r) for i, r in enumerate(held_out)]
    chats = [where for where, r in rows if is_conversation(r["prompt"])]
    texts = [where for where, r in rows if not is_conversation(r["prompt"])]
    if not chats or not texts:
        return
    odd, usual, odd_kind, usual_kind = (chats, texts, "a conversation", "text") if len(chats) <= len(texts) else (
        texts, chats, "text", "a conversation")
    raise DataError(
        f"{odd[0]} of {source!r} has {odd_kind} as its prompt, but {usual[0]} (and {len(usual) - 1} more) has "
        f"{usual_kind}; a dataset's prompts must all be text or all be conversations (lists of messages)"
    )


def _task_rows(name: str, cfg, seed: int):
    if cfg.levels:  # a mix: each level drawn as that level alone would draw it, an equal share of each part
        family = _family(name)
        for level in cfg.levels:
            try:
                family.check_level(level)
            except ValueError as e:
                raise DataError(f"data.levels={cfg.levels}: {e}; list only those") from None
        parts = [_task_rows(name, replace(cfg, level=level, levels=[], train_size=_share(cfg.train_size, i, len(cfg.levels)),
                                          eval_size=_share(_eval_size(cfg), i, len(cfg.levels))), seed)
                 for i, level in enumerate(cfg.levels)]
        return _interleave([train for train, _ in parts]), [row for _, held_out in parts for row in held_out]
    return _one_level_rows(name, cfg, seed)


def _family(name: str):
    from cohortrl import tasks

    try:
        return tasks.get(name)
    except KeyError as e:  # the registry's message names the known families and the closest one
        raise DataError(f"data.source 'task:{name}': {e.args[0]}") from None


def _share(total: int, i: int, n: int) -> int:
    """Part ``i`` of ``total`` split as evenly as it goes into ``n``, the first parts taking the remainder."""
    return total // n + (i < total % n)


def _eval_size(cfg) -> int:
    return DEFAULT_EVAL_SIZE if cfg.eval_size is None else cfg.eval_size


def _interleave(parts: list[list]) -> list:
    """One row of each part in turn until all are used (a batch read in order gets every part)."""
    out = []
    for i in range(max(map(len, parts), default=0)):
        out += [part[i] for part in parts if i < len(part)]
    return out


def _one_level_rows(name: str, cfg, seed: int):
    eval_level = cfg.level if cfg.eval_level is None else cfg.eval_level
    family = _family(name)
    for setting, level in (("data.level", cfg.level), ("data.eval_level", eval_level)):
        try:
            family.check_level(level)
        except ValueError as e:
            raise DataError(f"{setting}={level}: {e}; set {setting} to one of them") from None

    def rows(n, s, level=cfg.level):
        return [{"prompt": x.prompt, "answer": x.answer, "sample": x.to_dict()} for x in family.sample(n, s, level)]

    # Easy levels have small pools of distinct problems: draw until eval_size distinct prompts are found.
    eval_size = _eval_size(cfg)
    held_out, drawn = [], eval_size
    while len(held_out) < eval_size:
        held_out = _dedupe(rows(drawn, seed + 1_000_003, eval_level))[:eval_size]
        if len(held_out) < eval_size and drawn >= 8 * eval_size:
            raise DataError(
                f"task {name!r} level {eval_level} has only about {len(held_out)} distinct prompts; "
                f"lower data.eval_size (now {eval_size}) or raise the level"
            )
        drawn *= 2
    if not cfg.exclude_from_training:
        return rows(cfg.train_size, seed), held_out
    excluded = _excluded(cfg.exclude_from_training, name, [r["sample"] for r in held_out])
    train, drawn = [], cfg.train_size
    while len(train) < cfg.train_size:  # keep drawing past the excluded problems until train_size are kept
        train = [r for r in rows(drawn, seed) if not excluded(r["sample"])][: cfg.train_size]
        if len(train) < cfg.train_size and drawn >= 8 * cfg.train_size:
            raise DataError(f"data.exclude_from_training {cfg.exclude_from_training} leaves task {name!r} level "
                            f"{cfg.level} almost no training problems; exclude fewer values")
        drawn *= 2
    return train, [{**r, "unseen": excluded(r["sample"])} for r in held_out]


def _excluded(spec: dict[str, list], task: str, held_out: list[dict]):
    """A predicate on a sample's dict: does one of ``spec``'s fields hold one of its values? Each field must be
    a sample field or an ``extra`` field of the held-out samples, and each value must occur among them, so that
    a misspelling stops the run instead of excluding nothing."""
    def value(sample: dict, name: str):
        return sample[name] if name in sample else sample.get("extra", {}).get(name)

    for name, values in spec.items():
        seen = {str(value(s, name)) for s in held_out if value(s, name) is not None}
        if not seen:
            raise DataError(f"data.exclude_from_training: task {task!r} samples have no field {name!r}; "
                            f"use one of {sorted(set(held_out[0]) - {'extra'} | set(held_out[0].get('extra', {})))}")
        missing = [v for v in values if str(v) not in seen]
        if missing:
            raise DataError(f"data.exclude_from_training: no held-out problem of task {task!r} has {name} "
                            f"{missing[0]!r}; its held-out problems have {sorted(seen)}")
    return lambda sample: any(str(value(sample, n)) in {str(v) for v in vs} for n, vs in spec.items())


def _dedupe(rows):
    seen, out = set(), []
    for r in rows:
        if prompt_key(r["prompt"]) not in seen:
            seen.add(prompt_key(r["prompt"]))
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
    check_prompt(row[cfg.prompt_column], where, cfg.prompt_column)
    out = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.answer_column)}
    out["prompt"] = row[cfg.prompt_column]
    if cfg.answer_column in row:
        out["answer"] = row[cfg.answer_column]
    return out


def _jsonl_rows(path: Path, cfg) -> list[dict]:
    return [_rename(row, cfg, where) for where, row in _read_jsonl(path, cfg)]


def _read_jsonl(path: Path, cfg) -> list[tuple[str, dict]]:
    """(where, row) for each line of a JSONL file, ``data.transform`` applied; ``where`` is ``path:line``."""
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
            rows.append((f"{path}:{lineno}", _transformed(row, cfg, f"{path}:{lineno}")))
    if not rows:
        raise DataError(f"{path} holds no rows")
    return rows


def _split(rows: list[dict], eval_size: int, seed: int):
    if not eval_size:
        return list(rows), []
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
                for i, r in enumerate(ds[cfg.eval_split])][: DEFAULT_EVAL_SIZE if cfg.eval_size is None else cfg.eval_size]
    return train, held_out


def load_examples(cfg, seed: int, rows: list[dict] | None = None):
    """(training, held-out) rows of a ``jsonl:`` or ``python:`` source as they are, each as ``(where, row)``
    with ``where`` naming it for error messages: ``data.transform`` applied, no column renamed or required,
    ``data.eval_size`` held out and ``data.train_size`` kept as :func:`load_rows` does. For rows that are not
    prompts (supervised fine-tuning's prompt/completion pairs and conversations), which their trainer checks."""
    kind, _, arg = cfg.source.partition(":")
    if kind == "python":
        if rows is None:
            raise DataError(f"data.source {cfg.source!r} means the rows were given in Python: pass train_dataset=")
        named = [(f"{cfg.source} row {i}", _transformed(dict(r), cfg, f"{cfg.source} row {i}")) for i, r in enumerate(rows)]
    elif kind == "jsonl":
        named = _read_jsonl(Path(arg), cfg)
    else:
        raise DataError(f"data.source {cfg.source!r}: these rows are read from jsonl:PATH or python:NAME (train_dataset=)")
    if not named:
        raise DataError(f"data.source {cfg.source!r} holds no rows")
    train, held_out = _split(named, cfg.eval_size or 0, draw_seed(cfg, seed))
    return (train[: cfg.train_size] if cfg.train_size else train), held_out


class PromptStream:
    """An endless, seeded, resumable stream over training rows: shuffled each epoch, position saved in checkpoints.

    ``retire_after`` > 0 (``algorithm.retire_solved``): a row is skipped from then on once :meth:`solved` has
    been told that many times that its group was answered right by every response. The epoch's shuffle is the
    same with or without retirement, so two runs differ only by the rows skipped."""

    def __init__(self, rows: list[dict], seed: int, retire_after: int = 0):
        self.rows, self.seed, self.retire_after = rows, seed, retire_after
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)
        self.solved_counts: dict[str, int] = {}  # problem id -> groups answered right by every response
        self.retired: set[str] = set()
        self._keys = [problem_id(r) for r in rows] if retire_after else []
        self._distinct = len(set(self._keys))
        self._all_retired_said = False

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        skip = bool(self.retired) and not self._everything_retired()
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            i = self._order[self.index]
            self.index += 1
            if not (skip and self._keys[i] in self.retired):
                out.append(self.rows[i])
        return out

    def _everything_retired(self) -> bool:
        if len(self.retired) < self._distinct:
            return False
        if not self._all_retired_said:
            log.warning("every one of the %d training prompts is retired (algorithm.retire_solved=%d): sampling "
                        "all of them again", len(self.rows), self.retire_after)
            self._all_retired_said = True
        return True

    def solved(self, rows: list[dict]) -> None:
        """``rows``' groups were each answered right by every response: count them, retiring a row at
        ``retire_after`` (nothing happens with retirement off)."""
        if not self.retire_after:
            return
        for row in rows:
            key = problem_id(row)
            self.solved_counts[key] = self.solved_counts.get(key, 0) + 1
            if self.solved_counts[key] >= self.retire_after:
                self.retired.add(key)

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "index": self.index, "n_rows": len(self.rows)}
        if self.retire_after:
            state["solved_counts"] = dict(sorted(self.solved_counts.items()))
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["n_rows"] != len(self.rows):
            raise DataError(f"checkpoint was taken on {state['n_rows']} training rows, the data now has {len(self.rows)}")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)
        self.solved_counts = dict(state.get("solved_counts", {}))
        self.retired = {k for k, c in self.solved_counts.items() if self.retire_after and c >= self.retire_after}
