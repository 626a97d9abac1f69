"""Built-in reward functions, with the signature TRL users already write (they are called by keyword, see
``scoring.py``; completions are text, or for conversational data lists of messages):

    fn(prompts, completions, **dataset_columns) -> list[float | None]

``None`` means "this function does not apply to this sample". Each built-in is made by a factory that takes the
config's ``kwargs`` (``make_accuracy(mode="answer_line")``), so a YAML file can tune it.

>>> acc = make_accuracy()
>>> acc(["What is 2+3?"], ["2 + 3 = 5\\nANSWER: 5"], answer=["5"])
[1.0]
>>> make_format()(["q"], ["The answer is 5", "ANSWER: 5"])
[0.0, 1.0]
"""

from __future__ import annotations

import inspect
from typing import Callable

from cohortrl.grading.answers import ACCURACY_MODES, answers_match, commits_to_a_number, extract_answer
from cohortrl.rewards.grader_errors import contained
from cohortrl.tools import render

RewardFn = Callable[..., list]


def completion_text(completion) -> str:
    """A completion's text: the completion itself, or (conversational data, as TRL passes it) the content of its
    last message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _prompt(prompts: list, i: int):
    """The prompt of completion ``i`` for a grader-error record (the doctests pass one prompt for several)."""
    return prompts[i] if i < len(prompts) else None


def reading(fn: RewardFn, column: str) -> RewardFn:
    """``fn``, which takes the rows' columns as ``**columns``, declaring that it reads ``column``: the column
    becomes a keyword-only parameter of its signature, the way a reward function names what it reads
    (`cohortrl.rewards.scoring.reads`), for a built-in whose column is a setting known only when its factory runs.
    Calls are unchanged: the column still arrives in ``**columns``."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    rest = next(i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD)
    declared = inspect.Parameter(column, inspect.Parameter.KEYWORD_ONLY)
    fn.__signature__ = sig.replace(parameters=params[:rest] + [declared] + params[rest:])
    return fn


def make_accuracy(mode: str = "answer_line", rel_tol: float = 1e-6, answer_column: str = "answer") -> RewardFn:
    """1.0 when the committed answer (`cohortrl.grading.answers.extract_answer`: the gym's ANSWER-line rules,
    read in the response as rendered, ``cohortrl.tools.render``: tool results are not the model's) equals the
    reference (numeric with tolerance, else math-verify, `answers_match`), else 0.0."""
    if mode not in ACCURACY_MODES:
        raise ValueError(f"accuracy mode must be 'answer_line' or 'last_number', got {mode!r}")

    def accuracy(prompts, completions, **columns):
        if answer_column not in columns:
            raise KeyError(f"accuracy needs the dataset column '{answer_column}'; columns are {sorted(columns)}")
        out = []
        for i, (completion, gold) in enumerate(zip(completions, columns[answer_column])):
            if gold is None:
                out.append(None)
                continue
            grade = lambda: _accuracy_of(completion_text(completion), gold, mode, rel_tol)  # noqa: E731
            out.append(contained("accuracy", _prompt(prompts, i), completion, grade))
        return out

    return reading(accuracy, answer_column)


def _accuracy_of(completion: str, gold, mode: str, rel_tol: float) -> float:
    predicted = extract_answer(render(completion), mode)
    return float(predicted is not None and answers_match(predicted, gold, rel_tol=rel_tol))


def make_format() -> RewardFn:
    """1.0 when the response (rendered, as ``accuracy`` reads it) commits to exactly one ``ANSWER: <number>``
    line, as prompts ask (the gym's commitment rule, `cohortrl.grading.answers.commits_to_a_number`)."""

    def format_reward(prompts, completions, **columns):
        out = []
        for i, completion in enumerate(completions):
            out.append(contained("format", _prompt(prompts, i), completion, lambda: _format_of(completion_text(completion))))
        return out

    return format_reward


def _format_of(completion: str) -> float:
    return float(commits_to_a_number(render(completion)))


def make_overlong(cache_length: int = 16, max_length: int | None = None) -> RewardFn:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) on the response length in tokens.

    Needs the trainer's ``completion_lengths`` column; ``max_length`` defaults to ``max_new_tokens``.
    """
    import torch

    from cohortrl.algorithms import soft_overlong_penalty

    def overlong(prompts, completions, completion_lengths, max_new_tokens, **columns):
        L = max_length or max_new_tokens[0]
        lengths = torch.tensor(completion_lengths, dtype=torch.float32)
        return soft_overlong_penalty(lengths, max_length=L, cache_length=cache_length).tolist()

    return overlong


def make_task(field: str = "score") -> RewardFn:
    """A gym family's grade: ``score`` (outcome and step credit combined, the default), ``outcome``, or
    ``supported``: the outcome only when every required step is right too. The strict outcome pays a right
    ANSWER however it was reached; ``supported`` does not pay one its own steps contradict (a policy that
    learned to drop the exponent of an SF computed in the wrong units, 1.023e-06 -> ANSWER: 1.023, is paid by
    ``outcome`` and not by ``supported``: docs/engineering.md, round 3).

    The graded text is the response rendered (``cohortrl.tools.render``): a calculator call with its result
    reads ``EXPR = VALUE``, other tool calls are left out. A response without tool calls is graded as written;
    one that imitates the tags without tools earns nothing by it, since only the values it states are graded."""
    if field not in ("score", "outcome", "supported"):
        raise ValueError(f"task reward field must be 'score', 'outcome' or 'supported', got {field!r}")
    from cohortrl import tasks

    def task(prompts, completions, sample, **columns):
        out = []
        for i, (completion, s) in enumerate(zip(completions, sample)):
            family = tasks.get(s["family"])
            problem = family.sample_from_dict(s)  # outside `contained`: a bad sample row is the data's fault

            def grade() -> float:
                return float(getattr(family.grade(problem, render(completion_text(completion))), field))

            out.append(contained("task", _prompt(prompts, i), completion, grade))
        return out

    return task


def make_reward_model(model: str, batch_size: int = 16, max_length: int = 1024, device: str = "auto") -> RewardFn:
    """A learned outcome reward model (ORM): any ``AutoModelForSequenceClassification`` with one label (a
    local directory or a hub id) scores each exchange at its last token; the score is the reward.

    The exchange is the prompt as the user's turn and the completion as the assistant's, in the reward
    model's chat template (ChatML when it has none), as a model trained on chat data reads it. Sequences
    longer than ``max_length`` tokens keep their end, where the completion is. The model stays loaded,
    in eval mode, for the whole run: its memory adds to the policy's. ``device``: where it runs, chosen as
    the trainer chooses ``train.device`` (``auto``: the GPU when PyTorch sees one, this process's under torchrun).
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from cohortrl.distributed import process_device
    from cohortrl.models import prepare_tokenizer
    from cohortrl.reward_models.scoring import chat_text

    with torch.random.fork_rng(devices=[]):  # a head missing from the checkpoint would be drawn at random
        scorer = AutoModelForSequenceClassification.from_pretrained(model).eval()
    scorer.to(process_device(device, key="reward.functions[reward_model].kwargs.device"))
    if scorer.config.num_labels != 1:
        raise ValueError(f"reward_model {model!r} has {scorer.config.num_labels} labels; it needs one (a scalar score)")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(model))
    scorer.config.pad_token_id = tokenizer.pad_token_id  # the classifier finds the last token by this id
    # Right padding: every row starts at position 0 (the model's forward does not rebuild positions from
    # the mask), and the classifier pools the rightmost non-pad token, the exchange's last.
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"

    @torch.no_grad()
    def reward_model(prompts, completions, **columns):
        texts = [chat_text(tokenizer, p, completion_text(c)) for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[start : start + batch_size], add_special_tokens=False, padding=True, truncation=True,
                max_length=max_length, return_tensors="pt",
            ).to(scorer.device)
            scores += scorer(**enc).logits[:, 0].float().tolist()
        return scores

    return reward_model


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "accuracy": make_accuracy,
    "format": make_format,
    "overlong": make_overlong,
    "task": make_task,
    "reward_model": make_reward_model,
}
