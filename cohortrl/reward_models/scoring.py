"""Learned reward models at scoring time: an outcome reward model (ORM) scores a whole exchange, a process
reward model (PRM) scores each step of it.

* ORM: ``AutoModelForSequenceClassification`` with one label; the logit at the exchange's last token is the
  score (what the built-in ``reward_model`` reward loads, `cohortrl.rewards.functions.make_reward_model`).
* PRM: ``AutoModelForTokenClassification`` with one label; σ(logit) at the last token of each step is the
  probability that the step is right (Lightman et al. 2023, arXiv 2305.20050, score steps at their end).

Both read the exchange the way a chat model does: the prompt as the user's turn, the response as the
assistant's, in the model's chat template. A PRM's response is its steps joined by newlines.
"""

from __future__ import annotations

from pathlib import Path

import torch

STEP_SEPARATOR = "\n"


def chat_text(tokenizer, prompt, response: str) -> str:
    """The exchange as a reward model reads it, in its chat template: a text prompt as the user's turn (a
    conversation as it stands), then the response as the assistant's. The one rendering that training
    (`reward_models.train`), the PRM and the ``reward_model`` reward function (`make_reward_model`) use."""
    asked = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": response}], tokenize=False)


def step_char_ends(tokenizer, prompt: str, steps: list[str]) -> tuple[str, list[int]]:
    """The chat text of ``steps`` joined by newlines, and the character index of each step's last character.

    Empty steps are refused: a step with no characters has no last token to be scored at.
    """
    for i, step in enumerate(steps):
        if not step:
            raise ValueError(f"step {i} is empty; every step needs at least one character (drop empty steps)")
    response = STEP_SEPARATOR.join(steps)
    text = chat_text(tokenizer, prompt, response)
    # The template may change the prompt's text but copies the response verbatim; find it from the end,
    # since the response comes after the prompt.
    start = text.rfind(response)
    if start < 0:
        raise ValueError("the chat template did not copy the response verbatim; cannot place step ends")
    ends, pos = [], start
    for step in steps:
        pos += len(step)
        ends.append(pos - 1)
        pos += len(STEP_SEPARATOR)
    return text, ends


def token_containing(offsets: list[tuple[int, int]], char: int) -> int | None:
    """Index of the token whose character span holds ``char``; a step that ends mid-token is read at the
    token that contains its last character (that token is the first to see the whole step).

    If ``char`` falls between token spans (a tokenizer that trims whitespace from its offsets), the last
    token starting at or before it; None when every token starts after it or no token reaches it
    (truncated away).
    """
    best = None
    for t, (start, end) in enumerate(offsets):
        if start == end:  # special tokens carry empty spans
            continue
        if start <= char < end:
            return t
        if start <= char:
            best = t
    if best is None or (offsets and max(e for _, e in offsets) <= char):
        return None
    return best


def encode_steps(tokenizer, prompt: str, steps: list[str], max_length: int | None = None):
    """Token ids of the exchange and each step's end-token index (None for a step cut off by ``max_length``:
    truncation keeps the start, where the prompt is, and a step that is not seen whole cannot be judged).

    Returns ``(input_ids, step_token_index)`` with ``len(step_token_index) == len(steps)``.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("step positions need a fast tokenizer (offset mappings); load it with use_fast=True")
    text, ends = step_char_ends(tokenizer, prompt, steps)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    if max_length is not None and len(ids) > max_length:
        ids, offsets = ids[:max_length], offsets[:max_length]
    return ids, [token_containing(offsets, c) for c in ends]


# ---------------------------------------------------------------------------------------------------- scoring
def load_prm(path: str | Path, dtype: torch.dtype = torch.float32):
    """A saved PRM directory → ``(model, tokenizer)`` in eval mode."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from cohortrl.models import prepare_tokenizer

    with torch.random.fork_rng(devices=[]):  # a head missing from the checkpoint would be drawn at random
        model = AutoModelForTokenClassification.from_pretrained(path, dtype=dtype).eval()
    if model.config.num_labels != 1:
        raise ValueError(f"PRM {str(path)!r} has {model.config.num_labels} labels; a PRM needs one (a per-token logit)")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    return model, tokenizer


@torch.no_grad()
def prm_step_logits(model, tokenizer, prompts: list[str], steps: list[list[str]], batch_size: int = 16,
                    max_length: int | None = None) -> list[list[float]]:
    """The PRM's logit at each step's last token, for many exchanges at once: ``steps[i]`` are the steps of
    the response to ``prompts[i]``. Exchanges are right-padded into batches of ``batch_size`` (a causal
    model's logit at a real token does not see the padding after it). A step cut off by ``max_length``
    gets NaN (unseen, so unjudged); an exchange without steps gets ``[]`` and costs no forward pass."""
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in prompts]
    todo = [i for i, s in enumerate(steps) if s]
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        encoded = [encode_steps(tokenizer, prompts[i], steps[i], max_length) for i in chunk]
        L = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(chunk), L), tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(chunk), L, dtype=torch.long)
        for b, (ids, _) in enumerate(encoded):
            input_ids[b, : len(ids)], attention_mask[b, : len(ids)] = torch.tensor(ids), 1
        logits_BL = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits[..., 0].float().cpu()
        for b, (i, (_, where)) in enumerate(zip(chunk, encoded)):
            out[i] = [logits_BL[b, t].item() if t is not None else float("nan") for t in where]
    return out


def prm_step_scores(model, tokenizer, prompt: str, steps: list[str], max_length: int | None = None) -> list[float]:
    """σ(logit) at each step's last token: the PRM's probability that each step is right.
    A step cut off by ``max_length`` scores NaN (unseen, so unjudged)."""
    (logits,) = prm_step_logits(model, tokenizer, [prompt], [steps], max_length=max_length)
    return torch.sigmoid(torch.tensor(logits, dtype=torch.float32)).tolist()  # NaN stays NaN


@torch.no_grad()
def orm_scores(model, tokenizer, prompts: list[str], completions: list[str], batch_size: int = 16,
               max_length: int = 1024) -> list[float]:
    """An ORM's logit per exchange, read at the last token as `make_reward_model` reads it (right padding,
    the end kept when too long)."""
    side = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    model.config.pad_token_id = tokenizer.pad_token_id
    device = next(model.parameters()).device
    try:
        texts = [chat_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], add_special_tokens=False, padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt").to(device)
            out += model(**enc).logits[:, 0].float().tolist()
        return out
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = side
