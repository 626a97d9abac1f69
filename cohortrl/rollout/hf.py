"""Generation and log-probabilities with Hugging Face transformers (the ``hf`` backend: any device, one process
or torchrun).

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

import contextlib
import copy
import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cohortrl.config import SamplingConfig
from cohortrl.data import prompt_messages, prompt_preview, render_prompt
from cohortrl.rollout.tools import ToolSession, tool_protocol
from cohortrl.rollout.types import Rollout
from cohortrl.tools import Toolset, tool_prompt


# One description of sampling for the config, the trainer and evaluation: the config's own dataclass.
Sampling = SamplingConfig


class PromptTooLongError(ValueError):
    pass


def encode_prompts(tokenizer, prompts: list[str], system_prompt: str | None, max_prompt_tokens: int, overlong: str,
                   tools: list[dict] | None = None):
    """Tokenise chat-formatted prompts, left-padded. Returns (ids (P, Tp), mask (P, Tp), n_truncated).
    ``tools``: JSON schemas the chat template describes (``data.render_prompt``)."""
    encoded = [_prompt_ids(tokenizer, p, system_prompt, tools) for p in prompts]
    n_truncated = 0
    for i, ids in enumerate(encoded):
        if len(ids) > max_prompt_tokens:
            if overlong == "reject":
                raise _too_long(f"prompt {i}", len(ids), max_prompt_tokens, prompts[i])
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


def _prompt_ids(tokenizer, prompt: str, system_prompt: str | None, tools: list[dict] | None) -> list[int]:
    # The chat template already holds the special tokens; adding BOS again would shift the distribution.
    return tokenizer(render_prompt(tokenizer, prompt, system_prompt, tools), add_special_tokens=False)["input_ids"]


def _too_long(what: str, n: int, max_prompt_tokens: int, prompt: str) -> PromptTooLongError:
    return PromptTooLongError(
        f"{what} has {n} tokens after the chat template, more than data.max_prompt_tokens={max_prompt_tokens}: "
        f"{prompt_preview(prompt)!r}. Raise data.max_prompt_tokens or set data.overlong_prompts=truncate."
    )


def prompt_framing(tokenizer, system_prompt: str | None, tools: Toolset | None) -> tuple[str | None, list[dict] | None]:
    """(system prompt, tool schemas) as ``generate`` renders prompts with ``tools``: the text protocol describes
    them after the system prompt, the chat protocol hands their schemas to the chat template."""
    if tools is None:
        return system_prompt, None
    if tool_protocol(tools, tokenizer) == "chat":
        return system_prompt, tools.schemas()
    return tool_prompt(system_prompt, tools), None


def check_prompt_lengths(tokenizer, prompts: list[str], what: str, *, system_prompt: str | None, max_prompt_tokens: int,
                         tools: Toolset | None = None) -> None:
    """Raise ``PromptTooLongError`` for the first of ``prompts`` (named ``what`` and its index) that ``generate``
    would reject, rendered as it will be: a trainer checks its prompts before step 1, not when one is drawn
    (or the held-out set is evaluated) hours into a run."""
    system_prompt, schemas = prompt_framing(tokenizer, system_prompt, tools)
    # Rendering a prompt through the chat template is the slow part (milliseconds each). A text prompt whose
    # own tokens plus the template's frame stay a margin below the budget cannot exceed it once rendered (only
    # the tokens at the frame's two seams can merge differently), so only the others are rendered.
    frame = len(_prompt_ids(tokenizer, "", system_prompt, schemas))
    texts = [p for p in prompts if isinstance(p, str)]
    own = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and len(next(own)) + frame + 16 <= max_prompt_tokens:
            continue
        n = len(_prompt_ids(tokenizer, prompt, system_prompt, schemas))
        if n > max_prompt_tokens:
            raise _too_long(f"{what} {i}", n, max_prompt_tokens, prompt)


def model_device(model) -> torch.device:
    """The device of a model's parameters (plain, PEFT or DDP-wrapped alike)."""
    return next(model.parameters()).device


def eos_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a response: the generation config's EOS id(s) and the tokenizer's."""
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
    record: bool = False,
    tools: Toolset | None = None,
    fast_path=None,
    seeds: list[int] | None = None,
    decode_dtype: torch.dtype = torch.float32,
) -> tuple[Rollout, int]:
    """Sample ``group_size`` responses for each row's ``prompt``. Returns (rollout, prompts truncated).

    ``seeds``: one per row; each group then draws its uniforms from a generator of its own seeded with it, so its
    random draws do not depend on which other rows share the batch (torchrun: ``distributed.group_seed``); its
    logits still depend on the batch to float rounding (padding, batch-size-dependent kernels). None: every row
    draws from the process's random stream.

    ``fast_path``: the run's CPU fast path (``cpu.FastPath``), or None: plain transformers throughout. Where it
    runs the lean decoder, ``record`` keeps its forward for the update's backward (``rollout.replay``, a
    ``cpu/replay.py`` ``Recording``; None where it does not run). ``decode_dtype``: the lean decoder's products'
    (a training rollout's ``FastPath.decode_dtype``; evaluation leaves fp32); with bf16 products and no recording,
    each sampled token's log-probability under them is in ``rollout.sampling_logp``, for the update's importance
    weights.
    ``tools``: the model may call them (``rollout/tools.py``), in the protocol ``tool_protocol`` picks: the text
    protocol describes them after the system prompt, the chat protocol hands their schemas to the chat template;
    their results are in the responses as tokens marked by ``rollout.tool_mask``."""
    if seeds is not None and len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} prompts: generate takes one seed per prompt (its group's)")
    session = None
    framed_system_prompt, schemas = prompt_framing(tokenizer, system_prompt, tools)
    if tools is not None:
        group_rows = [row for row in rows for _ in range(group_size)]
        if schemas is not None:  # the chat protocol: the template renders the calls and results
            messages = [prompt_messages(row["prompt"], system_prompt) for row in group_rows]
            session = ToolSession(tools, tokenizer, group_rows, messages, schemas)
        else:
            session = ToolSession(tools, tokenizer, group_rows)
    prompt_ids, prompt_mask, n_truncated = encode_prompts(
        tokenizer, [r["prompt"] for r in rows], framed_system_prompt, max_prompt_tokens, overlong_prompts, schemas
    )
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, Tp), groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    eos_ids = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    record = record and fast_path is not None and fast_path.decoder_for(model) is not None
    # each prompt prefilled once for its group (nothing to share with one response per prompt); a recording
    # decoder runs the prompts itself, also once each
    shared = group_size > 1 and prompt_ids.shape[1] > 1 and not record
    cache = prefill_cache(model, prompt_ids, prompt_mask) if shared else None
    out, lengths, sampling_logp, *recording = generate_ids(
        model, tokenizer, prompt_ids, prompt_mask, sampling, eos_ids, cache, record=record, tools=session,
        fast_path=fast_path, generators=group_generators(seeds, model_device(model)), decode_dtype=decode_dtype)
    model.train(was_training)
    response_ids = out[:, prompt_ids.shape[1] :]
    tool_mask = session.tool_mask(response_ids.shape[1]) if session is not None else None
    response_mask, truncated, completions = _finish(response_ids, lengths, tokenizer, eos_ids, sampling, tool_mask)
    completion_ends = None
    if schemas is not None:  # the chat protocol: tool turns as <tool_response>RESULT</tool_response>
        completions, completion_ends = session.completions(response_ids, lengths)
    tool_calls, tool_errors = session.counts() if session is not None else (None, None)
    sequence_mask = response_mask if tool_mask is None else response_mask | tool_mask
    response_ids = response_ids.masked_fill(sequence_mask == 0, tokenizer.pad_token_id)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=truncated,
        completions=completions,
        group_size=group_size,
        rows=[row for row in rows for _ in range(group_size)],
        sampling_logp=None if sampling_logp is None else sampling_logp.masked_fill(response_mask == 0, 0.0),
        replay=recording[0] if record else None,
        tool_mask=tool_mask,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        completion_ends=completion_ends,
    )
    return rollout, n_truncated


def group_generators(seeds: list[int] | None, device: torch.device) -> list[torch.Generator] | None:
    """One random generator per seed (a group's), on the device that samples; None for no seeds."""
    if seeds is None:
        return None
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


def generate_ids(model, tokenizer, prompt_ids, prompt_mask, sampling: Sampling, eos_ids: list[int], cache=None,
                 record: bool = False, tools: ToolSession | None = None, fast_path=None,
                 generators: list[torch.Generator] | None = None, decode_dtype: torch.dtype = torch.float32):
    """Autoregressive sampling with the KV cache, from ``cache`` (``prefill_cache``) if given: ids (B, Tp + T)
    on the CPU, each row padded after its EOS or stop string, each row's response length (B,), its ending
    token included, and the sampled tokens' log-probabilities (B, T) where the lean decoder's products are not
    fp32 (``decode_dtype``) and it does not record, else None; with ``record`` (the lean decoder only), a fourth
    value: its ``Recording``. The loop ends
    when every row has ended. The lengths are recorded, not read back from the
    padding: a model may sample the pad token inside a response (SmolLM2 pads with ``<|endoftext|>``). With
    ``tools``, a row in the middle of a tool result is fed its next token instead of what it sampled (the lean
    decoder and a recording take it like any fed token); such a token never ends the row. ``generators``: one per
    group of B / len(generators) contiguous rows, which draw their uniforms from it (``_uniforms``).

    Our own loop rather than ``model.generate``: on a CPU, transformers' sampler (``torch.multinomial``) draws an
    exponential variate for every vocabulary entry at every step, half the decoding time of a small model with
    a 49k vocabulary; ``_sample`` draws from the same distribution with one uniform per row. Per step, as
    transformers does it: logits in fp32, EOS masked before ``min_new_tokens``, then temperature, top-k, top-p."""
    device = model_device(model)
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    B, name = ids.shape[0], cache_argument(model)
    next_position = mask.sum(-1, keepdim=True)  # the first response token's position
    # the run's fast path: the lean decoder (cpu/decoder.py) for a Llama-family fp32 model on oneDNN; else transformers'
    lean = fast_path.decoder_for(model, decode_dtype) if fast_path is not None else None
    # the sampler's own numerics, for the update's importance weights (a recording holds them itself)
    own_logp = lean is not None and decode_dtype != torch.float32 and not record
    if record and (lean is None or cache is not None):
        raise ValueError("recording needs the lean decoder (cpu/decoder.py) and no transformers cache")
    prefix = None
    if record and ids.shape[1] > 1:  # the decoder runs the first Tp − 1 columns, each distinct prompt once
        prefix = _unique_prompts(ids[:, :-1], mask[:, :-1])
    elif lean is not None and cache is None and ids.shape[1] > 1:
        cache = _prefill(model, ids[:, :-1], mask[:, :-1])  # the lean step takes one token per row
    cache = cache if cache is not None else DynamicCache()
    seen = prefix[0].shape[1] if prefix is not None else cache.get_seq_length()
    feed, positions = ids[:, seen:], _positions(mask)[:, seen:]
    if lean is not None:
        later = torch.arange(max(sampling.max_new_tokens - 1, 0), device=device)  # sampled tokens fed back, but the last
        fed_positions = torch.cat([positions, next_position + later], 1)
        if record:
            decoder, cache = lean(model, None, mask, fed_positions, prefix=prefix, record=True,
                                  temperature=sampling.temperature), None
        else:
            decoder, cache = lean(model, cache, mask, fed_positions), None  # the transformers cache is copied in, freed
    eos = torch.tensor(eos_ids, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), sampling.max_new_tokens, dtype=torch.long, device=device)
    stop_window = max((len(s) for s in sampling.stop), default=0) + 2  # tokens enough to hold any stop string
    tokens: list[torch.Tensor] = []
    logp: list[torch.Tensor] = []
    # on the fast path's oneDNN kernel, transformers' forward reads the weights laid out for B-row products
    with fast_path.decoding_weights(model, B) if lean is None and fast_path is not None else contextlib.nullcontext():
        for t in range(sampling.max_new_tokens):
            if lean is not None:
                logits = decoder.step(feed[:, -1])
            else:
                logits = model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                               logits_to_keep=1, **{name: cache}).logits[:, -1].float()
            logz = _scaled(logits, sampling.temperature).logsumexp(-1) if own_logp else None  # before EOS is masked
            if t < sampling.min_new_tokens:
                logits[:, eos] = float("-inf")
            token = _sample(logits, sampling, None if t == 0 else (~ended).nonzero().squeeze(-1), generators)
            fed = torch.zeros_like(ended)
            if tools is not None:
                token, fed = tools.feed(token)
            token = token.masked_fill(ended, tokenizer.pad_token_id)
            if record:
                decoder.sampled(token)
            if own_logp:  # logits still unmasked where EOS was not (response_logprobs scores what the model gave)
                logp.append(_scaled(logits, sampling.temperature).gather(-1, token[:, None]).squeeze(-1) - logz)
            tokens.append(token)
            ended |= torch.isin(token, eos) & ~fed
            if sampling.stop and t + 1 >= sampling.min_new_tokens:
                recent = torch.stack(tokens[-stop_window:], dim=1).cpu()
                for i in (~ended & ~fed).nonzero().flatten().tolist():
                    text = tokenizer.decode(recent[i], skip_special_tokens=True)
                    ended[i] = any(stop in text for stop in sampling.stop)
            lengths = torch.where(ended & (lengths == sampling.max_new_tokens), t + 1, lengths)
            if tools is not None:
                tools.after_step(token, ended)
            if ended.all():
                break
            feed, positions = token.unsqueeze(-1), next_position + t
            if lean is None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            else:
                decoder.end_rows(ended)  # ended rows leave its products
    ids_out = torch.cat([prompt_ids, torch.stack(tokens, dim=1).cpu()], dim=1)
    sampling_logp = torch.stack(logp, dim=1).cpu() if own_logp else None
    if record:
        return ids_out, lengths.cpu(), sampling_logp, fast_path.recording(decoder, prefix, mask)
    return ids_out, lengths.cpu(), sampling_logp


def _scaled(logits_BV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits at the temperature the update scores tokens with (greedy decoding: 1, as ``response_logprobs``)."""
    temperature = float(temperature or 1.0)
    return logits_BV / temperature if temperature != 1.0 else logits_BV


def _sample(logits_BV: torch.Tensor, sampling: Sampling, rows: torch.Tensor | None = None,
            generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """One token per row from fp32 logits: argmax at temperature 0, else temperature, top-k, top-p (the
    smallest set of tokens whose probability reaches top_p, as transformers' TopPLogitsWarper keeps it).
    ``rows``: draw for these rows only (the others get token 0: rows that have ended), each with the
    uniform it would get in a draw for every row, so the random stream does not depend on which rows ended.
    ``generators``: where the uniforms come from (``_uniforms``)."""
    B = logits_BV.shape[0]
    uniform_B1 = None if sampling.temperature == 0 else _uniforms(B, logits_BV.device, generators)
    if rows is None or len(rows) == B:
        return _draw(logits_BV, sampling, uniform_B1)
    token_B = torch.zeros(B, dtype=torch.long, device=logits_BV.device)
    return token_B.index_copy_(0, rows, _draw(logits_BV[rows], sampling, None if uniform_B1 is None else uniform_B1[rows]))


def _uniforms(B: int, device: torch.device, generators: list[torch.Generator] | None) -> torch.Tensor:
    """One fp64 uniform per row, (B, 1): from the process's random stream, or with ``generators`` (one per group
    of B / len(generators) contiguous rows) each group's from its own generator, which then draws exactly what
    a call sampling that group alone from a stream seeded the same way would."""
    if generators is None:
        return torch.rand(B, 1, dtype=torch.float64, device=device)
    per_group = B // len(generators)
    return torch.cat([torch.rand(per_group, 1, dtype=torch.float64, device=device, generator=g) for g in generators])


def _draw(logits_BV: torch.Tensor, sampling: Sampling, uniform_B1: torch.Tensor | None) -> torch.Tensor:
    """``_sample`` of every row; ``uniform_B1`` (B, 1) fp64: the draws' uniforms (None at temperature 0)."""
    if sampling.temperature == 0:
        return logits_BV.argmax(-1)
    if sampling.temperature != 1.0:
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
    cdf_BV = logits_BV.softmax(-1).cumsum(-1, dtype=torch.float64)  # cast inside the scan: no fp64 copy of the probabilities
    u_B1 = uniform_B1 * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1).clamp(max=cdf_BV.shape[-1] - 1)


@torch.no_grad()
def generate_modes(model, tokenizer, prompts: list[str], samplings: dict[str, Sampling], *,
                   system_prompt: str | None = None, max_prompt_tokens: int = 512) -> dict[str, list[str]]:
    """One completion per prompt under each of several samplings (say greedy and sampled), the prompts
    prefilled once for all of them: {name: completions}. For evaluations that compare decoding modes."""
    prompt_ids, prompt_mask, _ = encode_prompts(tokenizer, prompts, system_prompt, max_prompt_tokens, "reject")
    eos_ids = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    cache = prefill_cache(model, prompt_ids, prompt_mask) if prompt_ids.shape[1] > 1 else None
    out = {}
    for name, sampling in samplings.items():
        ids, lengths, _ = generate_ids(model, tokenizer, prompt_ids, prompt_mask, sampling, eos_ids,
                                       copy.deepcopy(cache) if cache is not None else None)  # generate appends to its cache
        out[name] = _finish(ids[:, prompt_ids.shape[1] :], lengths, tokenizer, eos_ids, sampling)[2]
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
    cache = _prefill(model, ids_U[:, :-1], mask_U[:, :-1])
    cache.batch_select_indices(index_B)
    return cache


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor) -> DynamicCache:
    """A KV cache of ``ids`` (left-padded rows), from one forward pass."""
    cache = DynamicCache()
    model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True, logits_to_keep=1,
          **{cache_argument(model): cache})
    return cache


def _finish(response_ids: torch.Tensor, lengths_B: torch.Tensor, tokenizer, eos_ids: list[int], sampling: Sampling,
            tool_mask: torch.Tensor | None = None):
    """Response mask (each row's first ``length`` tokens: through its EOS or stop string, less the tokens of
    ``tool_mask``), truncation flags and decoded texts (tool results included)."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids))
    sequence_mask = (torch.arange(response_ids.shape[1]) < lengths_B[:, None]).long()
    completions = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(response_ids, sequence_mask)
    ]
    response_mask = sequence_mask if tool_mask is None else sequence_mask * (1 - tool_mask)
    ended = (is_eos & response_mask.bool()).any(-1)
    stopped = torch.tensor([any(s in c for s in sampling.stop) for c in completions], dtype=torch.bool)
    truncated = (sequence_mask.sum(-1) >= sampling.max_new_tokens) & ~ended & ~stopped
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
    chunk_bytes: int | None = None,
):
    """Log-probabilities of the response tokens under ``model``: (B, T), plus per-token entropy (B, T) if asked,
    on the model's device. Positions outside the response part of ``attention_mask`` (padding after EOS) get 0.

    ``input_ids`` is [left-padded prompt | right-padded response]. Position ids are rebuilt from the mask so a
    left-padded row sees the same positions as during generation. Logits are divided by the sampling
    temperature so the ratio compares the distribution that was actually sampled from.

    The LM head runs only on real response tokens, ``chunk_bytes`` of logits at a time (default
    ``LOGPROB_CHUNK_BYTES``), in :class:`_HeadLogProbs`, which recomputes each chunk in backward instead of keeping
    it: the (B, T, V) logits tensor (V = 49,152 for SmolLM2) never exists. Under DDP and FSDP2 the trainer calls
    this inside the wrapped module's forward (``distributed.forward_inside``), where ``model`` is the plain
    model, so the head runs in chunks there too. Where the head cannot be applied outside the model (``model``
    itself wrapped by DDP or FSDP2, a head that is not a plain ``nn.Linear``, logit soft-capping or scaling),
    the model's own head computes the full logits of the last T + 1 positions instead; the numbers are the same.

    ``share_prompts``: rows with the same prompt (a group) run it through the model once (see the module
    docstring): two decoder calls, or one where no prompt repeats, so the number of calls depends on the rows.
    The trainer turns it off only under FSDP2 over several processes, where every layer's forward is a
    collective that each rank must run as often as the others; DDP's hooks run once around the whole call.
    """
    T = response_ids.shape[1]
    device = model_device(model)  # the batch lives on the CPU; the forward runs where the model is
    input_ids, attention_mask, response_ids = input_ids.to(device), attention_mask.to(device), response_ids.to(device)
    Tp = input_ids.shape[1] - T
    prompts = _unique_prompts(input_ids[:, :Tp], attention_mask[:, :Tp]) if share_prompts and Tp > 0 else None
    shared = prompts is not None and len(prompts[0]) < len(input_ids)
    head = _plain_lm_head(model)
    if head is None:
        if shared:
            logits_BTV = _states_sharing_prompts(model, input_ids, attention_mask, T, *prompts, logits=True)
        else:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                        logits_to_keep=T + 1, use_cache=False)
            logits_BTV = out.logits[:, :-1]
        return _logprobs_from_logits(logits_BTV, response_ids, temperature, with_entropy)

    decoder, linear, product = head
    if shared:
        hidden_BTH = _states_sharing_prompts(decoder, input_ids, attention_mask, T, *prompts, logits=False)
    else:
        hidden_BTH = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                             use_cache=False).last_hidden_state[:, Tp - 1:-1]
    real_N = attention_mask[:, Tp:].reshape(-1).nonzero().squeeze(-1)  # response tokens, not the padding after EOS
    chunk = max(1, (chunk_bytes or LOGPROB_CHUNK_BYTES) // (4 * linear.weight.shape[0]))
    logp_N, entropy_N = _HeadLogProbs.apply(hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[real_N], linear.weight,
                                           linear.bias, response_ids.reshape(-1)[real_N], float(temperature or 1.0),
                                           chunk, with_entropy, LOGPROB_KEEP_BYTES, product)

    def per_token(values_N):  # back to (B, T), 0 on the padding
        return torch.zeros(response_ids.numel(), device=device).index_put((real_N,), values_N).view(response_ids.shape)

    return per_token(logp_N), per_token(entropy_N) if with_entropy else None


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """The full next-token logits at each of the last ``T`` (response) positions: (B, T, V), on the model's device.
    The whole vocabulary of every position exists at once, so call it on a few rows at a time; the training
    passes use ``response_logprobs``, which never builds it."""
    device = model_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                logits_to_keep=T + 1, use_cache=False)
    return out.logits[:, :-1]


# Logits of at most this many bytes (fp32) exist at once in the chunked LM head: 32 MiB is 170 positions of
# SmolLM2's 49,152-entry vocabulary, big enough for efficient matrix products, small next to the model.
LOGPROB_CHUNK_BYTES = 32 * 2**20
# Under this size the probabilities of every response token are kept from forward to backward (75 MB for
# SmolLM2's 384 tokens of benchmarks/vs_trl.py): backward then skips recomputing the logits.
LOGPROB_KEEP_BYTES = 128 * 2**20


def micro_batched_logprobs(model, input_ids, attention_mask, response_ids, micro_batches: list[torch.Tensor], *,
                           temperature: float) -> torch.Tensor:
    """``response_logprobs`` of every row, one micro-batch of row positions at a time, gathered on the CPU, where
    a rollout and its targets live (each micro-batch moves to the model's device): (B, T)."""
    parts = []
    for idx in micro_batches:
        logp, _ = response_logprobs(model, input_ids[idx], attention_mask[idx], response_ids[idx], temperature=temperature)
        parts.append(logp.cpu())
    return torch.cat(parts)


def _logprobs_from_logits(logits_BTV, response_ids, temperature, with_entropy):
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


def _plain_lm_head(model):
    """(decoder, head) when the head is a plain ``nn.Linear`` on the decoder's last hidden state that we may
    apply ourselves; None for a model DDP or FSDP2 wraps, seen from outside its forward (their hooks belong to
    that forward, and outside it an FSDP2 head's weight is a shard; ``distributed.forward_inside`` runs the
    caller inside it, where the model is plain), or when the model changes its logits after the head
    (Gemma-2's soft-capping, Cohere's logit scale)."""
    from cohortrl.distributed import _fsdp_modules

    if hasattr(model, "module") or not hasattr(model, "get_decoder") or _fsdp_modules(model):
        return None
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    head = model.get_output_embeddings()
    product = _linear_product(head)
    if product is None:
        return None
    return model.get_decoder(), head, product


def _linear_product(layer):
    """The function a plain linear layer computes: ``F.linear`` for an ``nn.Linear``; a subclass that changes
    only the kernel names its own as ``product`` (the CPU fast path's ``OneDNNLinear``, while a step runs).
    None for anything else (a subclass with its own forward, a LoRA layer)."""
    if type(layer) is torch.nn.Linear:
        return F.linear
    return getattr(type(layer), "product", None) if isinstance(layer, torch.nn.Linear) else None


class _HeadLogProbs(torch.autograd.Function):
    """log softmax((h Wᵀ + b) / temperature)[target] for N hidden states, ``chunk`` rows of logits at a time.

    Backward uses d log p / d logits = (onehot(target) − softmax) / temperature. When a gradient is needed and
    the N × V probabilities fit in ``keep_bytes``, forward keeps them (one fp32 buffer, filled chunk by
    chunk) and backward turns them into the logits' gradient in place; otherwise forward keeps only the
    log-normaliser log Z per row and backward recomputes each chunk's logits, one more product with the
    head's weight. Either way the (B, T, V) logits of the whole batch never exist. The logits are made in
    the model's dtype and cast to fp32, as ``model(...).logits.float()`` would be; ``product`` is the head
    layer's function (``_linear_product``), so they come from the kernel the layer itself runs on."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, target_N, temperature, chunk, with_entropy, keep_bytes, product):
        N, V = hidden_NH.shape[0], weight_VH.shape[0]
        logp_N = torch.empty(N, device=hidden_NH.device)
        logz_N = torch.empty(N, device=hidden_NH.device)
        entropy_N = torch.empty(N, device=hidden_NH.device) if with_entropy else None
        keep = any(ctx.needs_input_grad[:3]) and N * V * 4 <= keep_bytes
        probs_NV = torch.empty(N, V, device=hidden_NH.device) if keep else None
        for s in range(0, N, chunk):
            # In place, one (chunk, V) tensor (two for the entropy unless kept): log Z = max + log Σ exp(logits − max).
            shifted = _chunk_logits(product, hidden_NH[s:s + chunk], weight_VH, bias_V, temperature)
            top = shifted.amax(-1, keepdim=True)
            shifted.sub_(top)  # ≤ 0: exp cannot overflow
            target = shifted.gather(-1, target_N[s:s + chunk, None]).squeeze(-1)
            if keep:  # p = e / Σe into the kept buffer; H = log Σe − Σ p·shifted
                e = torch.exp(shifted, out=probs_NV[s:s + chunk])
                total = e.sum(-1)
                e.div_(total[:, None])
                if with_entropy:
                    entropy_N[s:s + chunk] = total.log() - torch.bmm(e[:, None], shifted[:, :, None]).flatten()
            elif with_entropy:  # H = log Σe − Σ e·shifted / Σe, with e = exp(shifted)
                e = shifted.exp()
                total = e.sum(-1)
                entropy_N[s:s + chunk] = total.log() - e.mul_(shifted).sum(-1) / total
            else:
                total = shifted.exp_().sum(-1)
            log_total = total.log()
            logz_N[s:s + chunk] = top.squeeze(-1) + log_total
            logp_N[s:s + chunk] = target - log_total
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, target_N, logz_N)
        ctx.temperature, ctx.chunk, ctx.probs_NV, ctx.product = temperature, chunk, probs_NV, product
        if with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy):
        hidden_NH, weight_VH, bias_V, target_N, logz_N = ctx.saved_tensors
        probs_NV, ctx.probs_NV = ctx.probs_NV, None  # used up in place below: a second backward recomputes
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = None  # the first chunk's product writes it: no zero-filled (V, H) pass
        grad_b = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        for s in range(0, hidden_NH.shape[0], ctx.chunk):
            h = hidden_NH[s:s + ctx.chunk]
            g = grad_logp_N[s:s + ctx.chunk].float()
            # d logp / d logits_v = (onehot_v − p_v) / temperature, times the upstream gradient g
            if probs_NV is not None:
                grad_logits = probs_NV[s:s + ctx.chunk]
            else:
                grad_logits = _chunk_logits(ctx.product, h, weight_VH, bias_V, ctx.temperature).sub_(logz_N[s:s + ctx.chunk, None]).exp_()
            grad_logits.mul_(-g[:, None]).scatter_add_(-1, target_N[s:s + ctx.chunk, None], g[:, None])
            if ctx.temperature not in (0, 1):
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden_NH.dtype)
            if need_h:
                grad_h[s:s + ctx.chunk] = grad_logits @ weight_VH
            if need_w:
                if grad_w is None:
                    grad_w = grad_logits.t().float() @ h.float()
                else:
                    grad_w.addmm_(grad_logits.t().float(), h.float())
            if need_b:
                grad_b += grad_logits.float().sum(0)
        if need_w:
            grad_w = torch.zeros_like(weight_VH) if grad_w is None else grad_w.to(weight_VH.dtype)  # None: no rows
        grad_b = grad_b.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _chunk_logits(product, h_NH, weight_VH, bias_V, temperature: float) -> torch.Tensor:
    logits = product(h_NH, weight_VH, bias_V).float()  # the head layer's own kernel (``_linear_product``)
    return logits.div_(temperature) if temperature not in (0, 1) else logits


def _states_sharing_prompts(model, input_ids, attention_mask, T: int, ids_UT, mask_UT, index_B, *, logits: bool):
    """The states that predict each response token, (B, T, ·), with each distinct prompt run once: logits from
    the causal LM (``logits=True``) or last hidden states from its decoder.

    Call 1: the U distinct prompts; their last position predicts response token 0, and their keys and values
    fill a cache. The cache is indexed out to the B rows. Call 2: response tokens 0 … T−2 of every row against
    that cache predict tokens 1 … T−1. Positions and the attention mask are those of the full sequence.

    With the decoder (``logits=False``: a plain model, see ``_plain_lm_head``) both calls take their token
    embeddings from one lookup: in backward the embedding's gradient, a dense (vocabulary × hidden) tensor, is
    then made once instead of twice (113 MB for SmolLM2). The causal-LM path may be wrapped (DDP, FSDP2),
    whose hooks belong to the model's own forward: it passes token ids."""
    Tp = input_ids.shape[1] - T
    cache, name = DynamicCache(), cache_argument(model)
    last = {"logits_to_keep": 1} if logits else {}
    responses = input_ids[:, Tp:-1]
    if logits:
        prompt_in, response_in = {"input_ids": ids_UT}, {"input_ids": responses}
    else:
        embeds = model.get_input_embeddings()(torch.cat([ids_UT.flatten(), responses.flatten()]))
        prompt_embeds, response_embeds = embeds.split([ids_UT.numel(), responses.numel()])
        H = embeds.shape[-1]
        prompt_in = {"inputs_embeds": prompt_embeds.view(*ids_UT.shape, H)}
        response_in = {"inputs_embeds": response_embeds.view(*responses.shape, H)}
    out = model(**prompt_in, attention_mask=mask_UT, position_ids=_positions(mask_UT), use_cache=True,
                **last, **{name: cache})
    first_B = _states(out, logits)[:, -1:][index_B]  # (B, 1, ·)
    if T == 1:
        return first_B
    cache.batch_select_indices(index_B)
    out = model(**response_in, attention_mask=attention_mask[:, :-1], position_ids=_positions(attention_mask)[:, Tp:-1],
                use_cache=True, **{name: cache})
    return torch.cat([first_B, _states(out, logits)], dim=1)


def _states(out, logits: bool) -> torch.Tensor:
    return out.logits if logits else out.last_hidden_state
