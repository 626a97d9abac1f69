"""Generation and log-probabilities with Hugging Face transformers (the CPU / single-process backend).

``generate`` turns P dataset rows into a :class:`Rollout` of P·G responses: the chat template is applied, each
prompt is prefilled once and its KV cache shared by its G responses (groups contiguous), and one left-padded
batch is decoded token by token with the cache; decoding ends when every sequence has produced EOS or a stop
string, or at the budget.

``response_logprobs`` scores responses the same way: the G responses of a group share one prompt, so the
prompt goes through the model once per group and its keys and values are indexed out to the G rows (gradients
flow back through the index). The numbers are the ones a full forward of each [prompt | response] gives; the
prompt's share of the compute drops by a factor of G.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache

from cohortrl.config import SamplingConfig
from cohortrl.rollout.types import Rollout


# One description of sampling for the config, the trainer and evaluation: the config's own dataclass.
Sampling = SamplingConfig


class PromptTooLongError(ValueError):
    pass


def chat_text(tokenizer, prompt: str, system_prompt: str | None) -> str:
    """The prompt as the model sees it: chat template applied, ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer, prompts: list[str], system_prompt: str | None, max_prompt_tokens: int, overlong: str):
    """Tokenise chat-formatted prompts, left-padded. Returns (ids (P, Tp), mask (P, Tp), n_truncated)."""
    texts = [chat_text(tokenizer, p, system_prompt) for p in prompts]
    # The chat template already holds the special tokens; adding BOS again would shift the distribution.
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    n_truncated = 0
    for i, ids in enumerate(encoded):
        if len(ids) > max_prompt_tokens:
            if overlong == "reject":
                raise PromptTooLongError(
                    f"prompt {i} has {len(ids)} tokens after the chat template, more than "
                    f"data.max_prompt_tokens={max_prompt_tokens}: {prompts[i][:200]!r}. "
                    "Raise data.max_prompt_tokens or set data.overlong_prompts=truncate."
                )
            encoded[i] = ids[-max_prompt_tokens:]  # keep the end: the question and the assistant header
            n_truncated += 1
    Tp = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    ids_PT = torch.full((len(encoded), Tp), pad, dtype=torch.long)
    mask_PT = torch.zeros((len(encoded), Tp), dtype=torch.long)
    for i, ids in enumerate(encoded):
        ids_PT[i, Tp - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask_PT[i, Tp - len(ids) :] = 1
    return ids_PT, mask_PT, n_truncated


def model_device(model) -> torch.device:
    """The device of a model's parameters (plain, PEFT or DDP-wrapped alike)."""
    return next(model.parameters()).device


def _eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


@torch.no_grad()
def generate(
    model,
    tokenizer,
    rows: list[dict],
    group_size: int,
    sampling: Sampling,
    *,
    system_prompt: str | None = None,
    max_prompt_tokens: int = 512,
    overlong_prompts: str = "reject",
) -> tuple[Rollout, int]:
    """Sample ``group_size`` responses for each row's ``prompt``. Returns (rollout, prompts truncated)."""
    prompt_ids, prompt_mask, n_truncated = encode_prompts(
        tokenizer, [r["prompt"] for r in rows], system_prompt, max_prompt_tokens, overlong_prompts
    )
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, Tp), groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    eos_ids = _eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    # each prompt prefilled once for its group (nothing to share with one response per prompt)
    cache = prefill_cache(model, prompt_ids, prompt_mask) if group_size > 1 and prompt_ids.shape[1] > 1 else None
    out = _generate_ids(model, tokenizer, prompt_ids, prompt_mask, sampling, eos_ids, cache)
    model.train(was_training)
    response_ids = out[:, prompt_ids.shape[1] :]
    response_mask, truncated, completions = _finish(response_ids, tokenizer, eos_ids, sampling)
    response_ids = response_ids.masked_fill(response_mask == 0, tokenizer.pad_token_id)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=truncated,
        completions=completions,
        group_size=group_size,
        rows=[row for row in rows for _ in range(group_size)],
    )
    return rollout, n_truncated


def _generate_ids(model, tokenizer, prompt_ids, prompt_mask, sampling: Sampling, eos_ids: list[int], cache=None):
    """Autoregressive sampling with the KV cache, from ``cache`` (``prefill_cache``) if given: ids (B, Tp + T)
    on the CPU, each row padded after its EOS or stop string; the loop ends when every row has ended.

    Our own loop rather than ``model.generate``: on a CPU, transformers' sampler (``torch.multinomial``) draws an
    exponential variate for every vocabulary entry at every step, half the decoding time of a small model with
    a 49k vocabulary; ``_sample`` draws from the same distribution with one uniform per row. Per step, as
    transformers does it: logits in fp32, EOS masked before ``min_new_tokens``, then temperature, top-k, top-p."""
    device = model_device(model)
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    B, name = ids.shape[0], cache_argument(model)
    cache = cache if cache is not None else DynamicCache()
    seen = cache.get_seq_length()
    feed, positions = ids[:, seen:], _positions(mask)[:, seen:]
    next_position = mask.sum(-1, keepdim=True)  # the first response token's position
    eos = torch.tensor(eos_ids, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    stop_window = max((len(s) for s in sampling.stop), default=0) + 2  # tokens enough to hold any stop string
    tokens: list[torch.Tensor] = []
    for t in range(sampling.max_new_tokens):
        logits = model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{name: cache}).logits[:, -1].float()
        if t < sampling.min_new_tokens:
            logits[:, eos] = float("-inf")
        token = _sample(logits, sampling)
        token = token.masked_fill(ended, tokenizer.pad_token_id)
        tokens.append(token)
        ended |= torch.isin(token, eos)
        if sampling.stop and t + 1 >= sampling.min_new_tokens:
            recent = torch.stack(tokens[-stop_window:], dim=1).cpu()
            for i in (~ended).nonzero().flatten().tolist():
                text = tokenizer.decode(recent[i], skip_special_tokens=True)
                ended[i] = any(stop in text for stop in sampling.stop)
        if ended.all():
            break
        feed, positions = token.unsqueeze(-1), next_position + t
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    return torch.cat([prompt_ids, torch.stack(tokens, dim=1).cpu()], dim=1)


def _sample(logits_BV: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row from fp32 logits: argmax at temperature 0, else temperature, top-k, top-p (the
    smallest set of tokens whose probability reaches top_p, as transformers' TopPLogitsWarper keeps it)."""
    if sampling.temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k and sampling.top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, sampling.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1)  # ascending
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        logits_BV = logits_BV.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    # Inverse-CDF draw: one uniform per row. torch.multinomial draws an exponential variate per vocabulary
    # entry instead, which costs more than a small model's forward. fp64 keeps tiny probabilities exact.
    cdf_BV = logits_BV.softmax(-1).double().cumsum(-1)
    u_B1 = torch.rand(cdf_BV.shape[0], 1, dtype=cdf_BV.dtype, device=cdf_BV.device) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1).clamp(max=cdf_BV.shape[-1] - 1)


@torch.no_grad()
def generate_modes(model, tokenizer, prompts: list[str], samplings: dict[str, Sampling], *,
                   system_prompt: str | None = None, max_prompt_tokens: int = 512) -> dict[str, list[str]]:
    """One completion per prompt under each of several samplings (say greedy and sampled), the prompts
    prefilled once for all of them: {name: completions}. For evaluations that compare decoding modes."""
    prompt_ids, prompt_mask, _ = encode_prompts(tokenizer, prompts, system_prompt, max_prompt_tokens, "reject")
    eos_ids = _eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    cache = prefill_cache(model, prompt_ids, prompt_mask) if prompt_ids.shape[1] > 1 else None
    out = {}
    for name, sampling in samplings.items():
        ids = _generate_ids(model, tokenizer, prompt_ids, prompt_mask, sampling, eos_ids,
                            copy.deepcopy(cache) if cache is not None else None)  # generate appends to its cache
        out[name] = _finish(ids[:, prompt_ids.shape[1] :], tokenizer, eos_ids, sampling)[2]
    model.train(was_training)
    return out


def cache_argument(model) -> str:
    """The name a model's forward (and ``generate``) takes its KV cache under: ``cache`` from transformers 5,
    ``past_key_values`` before."""
    inner = model.module if hasattr(model, "module") else model  # DDP
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _unique_prompts(ids_BT: torch.Tensor, mask_BT: torch.Tensor):
    """The distinct (ids, mask) rows and, per row, the index of its distinct row: (ids_UT, mask_UT, index_B)."""
    rows = torch.cat([ids_BT, mask_BT.to(ids_BT.dtype)], dim=-1)
    unique, index_B = torch.unique(rows, dim=0, return_inverse=True)
    return unique[:, : ids_BT.shape[1]], unique[:, ids_BT.shape[1] :].to(mask_BT.dtype), index_B


def _positions(mask_BT: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: real tokens count from 0 (padding gets 0; it is masked anyway)."""
    return (mask_BT.cumsum(-1) - 1).clamp(min=0)


def prefill_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """A KV cache holding each distinct prompt's first Tp − 1 tokens, computed once and indexed out to every row
    that has it (a group); decoding then runs only the last prompt token per row before sampling."""
    device = model_device(model)
    ids_U, mask_U, index_B = _unique_prompts(prompt_ids.to(device), prompt_mask.to(device))
    cache = DynamicCache()
    model(input_ids=ids_U[:, :-1], attention_mask=mask_U[:, :-1], position_ids=_positions(mask_U[:, :-1]),
          use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    cache.batch_select_indices(index_B)
    return cache


def _finish(response_ids: torch.Tensor, tokenizer, eos_ids: list[int], sampling: Sampling):
    """Response mask (through the first EOS, inclusive; padding after a stop string excluded), truncation flags
    and decoded texts."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids))
    is_pad = response_ids == tokenizer.pad_token_id
    # A token belongs to the response if no EOS came strictly before it and it is not post-stop padding.
    eos_before = (is_eos.cumsum(-1) - is_eos.long()) > 0
    pad_from = (is_pad & ~is_eos).cumsum(-1) > 0
    response_mask = (~eos_before & ~pad_from).long()
    completions = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(response_ids, response_mask)
    ]
    ended = (is_eos & response_mask.bool()).any(-1)
    stopped = torch.tensor([any(s in c for s in sampling.stop) for c in completions], dtype=torch.bool)
    truncated = (response_mask.sum(-1) >= sampling.max_new_tokens) & ~ended & ~stopped
    return response_mask, truncated, completions


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
):
    """Log-probabilities of the response tokens under ``model``: (B, T), plus per-token entropy (B, T) if asked,
    on the model's device.

    ``input_ids`` is [left-padded prompt | right-padded response]; only the last T+1 positions go through the
    LM head (``logits_to_keep``), which matters when V is large. Position ids are rebuilt from the mask so a
    left-padded row sees the same positions as during generation. Logits are divided by the sampling
    temperature so the ratio compares the distribution that was actually sampled from.

    ``share_prompts``: rows with the same prompt (a group) run it through the model once (see the module
    docstring); it needs two forward calls per backward, which DDP does not allow, so the trainer turns it off
    for the gradient forward under torchrun.
    """
    T = response_ids.shape[1]
    device = model_device(model)  # the batch lives on the CPU; the forward runs where the model is
    input_ids, attention_mask, response_ids = input_ids.to(device), attention_mask.to(device), response_ids.to(device)
    Tp = input_ids.shape[1] - T
    prompts = _unique_prompts(input_ids[:, :Tp], attention_mask[:, :Tp]) if share_prompts and Tp > 0 else None
    if prompts is not None and len(prompts[0]) < len(input_ids):
        logits_BTV = _logits_sharing_prompts(model, input_ids, attention_mask, T, *prompts)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                    logits_to_keep=T + 1, use_cache=False)
        logits_BTV = out.logits[:, :-1]
    logits_BTV = logits_BTV.float()
    if temperature not in (0, 1):
        logits_BTV = logits_BTV / temperature
    logz_BT = logits_BTV.logsumexp(-1)
    logp_BT = logits_BTV.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) - logz_BT
    if not with_entropy:
        return logp_BT, None
    with torch.no_grad():
        probs = (logits_BTV - logz_BT.unsqueeze(-1)).exp()
        entropy_BT = logz_BT - (probs * logits_BTV).sum(-1)
    return logp_BT, entropy_BT


def _logits_sharing_prompts(model, input_ids, attention_mask, T: int, ids_UT, mask_UT, index_B) -> torch.Tensor:
    """The logits that predict each response token, (B, T, V), with each distinct prompt run once.

    Call 1: the U distinct prompts; their last position predicts response token 0, and their keys and values
    fill a cache. The cache is indexed out to the B rows. Call 2: response tokens 0 … T−2 of every row against
    that cache predict tokens 1 … T−1. Positions and the attention mask are those of the full sequence."""
    Tp = input_ids.shape[1] - T
    cache, name = DynamicCache(), cache_argument(model)
    first_U = model(input_ids=ids_UT, attention_mask=mask_UT, position_ids=_positions(mask_UT), use_cache=True,
                    logits_to_keep=1, **{name: cache}).logits
    first_B = first_U[index_B]  # (B, 1, V)
    if T == 1:
        return first_B
    cache.batch_select_indices(index_B)
    rest = model(input_ids=input_ids[:, Tp:-1], attention_mask=attention_mask[:, :-1],
                 position_ids=_positions(attention_mask)[:, Tp:-1], use_cache=True, **{name: cache}).logits
    return torch.cat([first_B, rest], dim=1)
