"""Supervised fine-tuning (SFT), the stage before RL: cross-entropy on the completion's tokens only.

One step takes ``sft.batch_size x sft.grad_accum`` examples, runs forward and backward over them in
micro-batches of ``sft.batch_size``, and takes one AdamW step on the mean negative log-likelihood over all
their loss tokens: each micro-batch adds Σ −log p / N with N counted over the whole step, so the accumulated
gradient is the whole batch's, however it is split. Then grad-norm clipping, the optimiser and the LR
schedule, as in the RL trainers.

Rows (``data.source`` or ``train_dataset=``), one example each:

* ``task:NAME``: the gym family's training problems, each sample's ``reference_solution`` as the completion.
  The held-out problems are drawn by ``data.load_rows`` exactly as the RL trainers draw them, so they are
  disjoint from the training problems by the same rule (separate seeds, and any training prompt equal to a
  held-out one dropped).
* TRL's SFT formats: ``prompt`` + ``completion`` as text; ``messages``, a conversation with loss on every
  assistant turn; ``prompt`` + ``completion`` as message lists, with loss on the completion's assistant turns.

The context before each assistant turn is rendered by ``data.render_prompt``, the function generation and
evaluation use, so the model learns to answer exactly the text it is later asked with; an assistant turn is
what the chat template adds after that context (the content and the end-of-turn token).

A text completion's row may carry ``no_loss_spans``, (start, end) character pairs into the completion (a tool's
``<result>...</result>``, say): the completion is tokenized in pieces split at them, and a span's tokens carry no
loss (``split_at_spans``: no token straddles the boundary between the model's text and a span).

With tools, a warm start writes tool calls in the protocol the RL rollout uses for the same config and tokenizer
(``rollout.tools.tool_protocol``). Text: the tools described after the system prompt, calls as
``<call>...</call>``, each ``<result>...</result>`` without loss (``no_loss_spans``). Chat: the prompt rendered with
the tools' schemas, and a text completion's calls in the form graders read
(``<tool_call>...</tool_call><tool_response>RESULT</tool_response>``, ``tools.chat.split_exchanges``) laid out as
the rollout feeds them: the model's text up to each call (trained), then the chat template's tool turn
(``chat.tool_turn``: its text around the result, the result tokenized as text), without loss, then the model's
next text; the same tokens a rollout of that text holds, with loss where its ``response_mask`` is 1.

Shared with the RL trainers rather than copied: the run around the steps (``loop.Trainer``: train loop,
evaluation schedule, checkpoints and resume, metrics rows, callbacks, final save), the inputs (``inputs.py``),
the model, LoRA, optimiser and schedule (``setup.py``), the optimiser step with its non-finite guard
(``setup.optimizer_step``), response log-probs (``rollout/hf.py``) and held-out evaluation (``evaluate.py``).
One process only for now.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cohortrl import distributed
from cohortrl.algorithms import masked_sum
from cohortrl.config import ConfigError
from cohortrl.data import (
    DataError, PromptStream, check_prompt, load_examples, load_rows, prompt_key, prompt_messages, render_prompt,
)
from cohortrl.rewards.scoring import WeightedReward, check_columns, resolve
from cohortrl.rollout.hf import prompt_framing, response_logprobs
from cohortrl.rollout.tools import tool_protocol, toolset
from cohortrl.tools import chat, result_spans, with_calculator
from cohortrl.trainers import guards
from cohortrl.trainers.evaluate import evaluate_config
from cohortrl.trainers.inputs import as_config, from_trl_order, resolve_inputs
from cohortrl.trainers.loop import Trainer, _release_run_dir_on_failure, config_hash
from cohortrl.trainers.metrics import peak_rss_mb
from cohortrl.trainers.run_dir import claim as claim_run_dir
from cohortrl.trainers.setup import (
    Optimised, allocate_optimizer_state, build_fast_path, build_optimizer, build_policy, build_scheduler, fast_kernels,
    optimizer_step, trained_on,
)

log = logging.getLogger("cohortrl")


# ---------------------------------------------------------------------------------------------- examples
@dataclass
class Segment:
    """A piece of an example's rendered text; a ``trained`` piece carries loss except on its ``no_loss`` spans."""

    text: str
    trained: bool
    no_loss: list[tuple[int, int]] = field(default_factory=list)  # (start, end) character spans of ``text``
    as_text: bool = False  # special-token strings in it are text (a tool's result, tokenized as the rollout feeds it)


@dataclass
class Example:
    """One tokenised row, cut where the loss starts: what the model reads, then what it is trained to write."""

    prompt_ids: list[int]  # (Tp,) context before the first loss token
    completion_ids: list[int]  # (T,) from the first to the last loss token
    loss_mask: list[int]  # (T,) 1 where the token carries loss


def row_segments(tokenizer, row: dict, system_prompt: str | None, where: str,
                 tools: list[dict] | None = None) -> list[Segment]:
    """A row in one of TRL's SFT formats as rendered segments; a malformed row raises :class:`DataError`
    naming ``where``. ``tools``: the chat protocol's JSON schemas, given to the chat template (None: the text
    protocol, or no tools); a text completion's tool calls are then laid out as the rollout feeds them."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: an SFT row must be a dict, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        check_prompt(messages, f"{where} (column 'messages')")
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: the conversation in 'messages' has no assistant turn to train on; add one or remove the row")
        return _conversation_segments(tokenizer, messages[:first], messages[first:], system_prompt, where, tools=tools)
    missing = [c for c in ("prompt", "completion") if c not in row]
    if missing:
        raise DataError(
            f"{where}: missing column(s) {missing}; an SFT row holds 'prompt' and 'completion' (text, or lists of "
            f"messages) or 'messages' (a conversation); columns found: {sorted(row)}"
        )
    prompt, completion = row["prompt"], row["completion"]
    check_prompt(prompt, f"{where} (column 'prompt')")
    if isinstance(prompt, str) != isinstance(completion, str):
        raise DataError(f"{where}: 'prompt' and 'completion' must both be text or both be lists of messages")
    if isinstance(completion, str):
        if not completion.strip():
            raise DataError(f"{where}: the completion is {completion!r}; it must be non-empty text (fix or remove the row)")
        spans = _spans(row.get("no_loss_spans", []), completion, where)
        if tools is not None and chat.split_exchanges(completion)[0]:
            if spans:
                raise DataError(f"{where}: no_loss_spans cannot be combined with chat-protocol tool calls in the "
                                "completion (their <tool_response> parts carry no loss already); remove no_loss_spans")
            return _tool_call_segments(tokenizer, prompt, completion, system_prompt, tools, where)
        assistant = {"role": "assistant", "content": completion}
        return _conversation_segments(tokenizer, [{"role": "user", "content": prompt}], [assistant], system_prompt, where,
                                      spans, tools)
    if "no_loss_spans" in row:
        raise DataError(f"{where}: no_loss_spans applies to a text completion; this row's completion is a list of messages")
    check_prompt(prompt + completion, f"{where} (prompt + completion)")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}: the completion has no assistant turn to train on; add one or remove the row")
    return _conversation_segments(tokenizer, prompt, completion, system_prompt, where, tools=tools)


def _conversation_segments(tokenizer, context: list[dict], completion: list[dict], system_prompt, where, spans=(),
                           tools=None):
    """``context + completion`` through the chat template, cut into untrained text and the completion's
    assistant turns (trained; ``spans`` are character spans of the last turn's content; ``tools``: schemas the
    template describes)."""
    if not context:
        raise DataError(f"{where}: the conversation starts with an assistant turn; it needs a user turn before it")
    messages = [*context, *completion]
    if system_prompt is not None and messages[0]["role"] != "system":  # where render_prompt puts it
        messages.insert(0, {"role": "system", "content": system_prompt})
    added = len(messages) - len(context) - len(completion)  # the system message, if inserted
    segments, done = [], ""
    for i in range(len(messages) - len(completion), len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        if not messages[i]["content"].strip():
            raise DataError(f"{where}: assistant message {i - added} of the conversation is empty; give it text or remove the row")
        before = render_prompt(tokenizer, messages[:i], system_prompt, tools)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **({"tools": tools} if tools is not None else {}))
        if not before.startswith(done) or not through.startswith(before):
            raise DataError(
                f"{where}: the model's chat template does not render this conversation as a sequence of growing "
                "prefixes, so the assistant's tokens cannot be told apart; use text prompt/completion rows"
            )
        turn = through[len(before):]
        no_loss = []
        if spans and i == len(messages) - 1:
            start = turn.find(messages[i]["content"])
            if start < 0:
                raise DataError(f"{where}: the chat template changes the completion's text, so no_loss_spans cannot be placed")
            no_loss = [(start + s, start + e) for s, e in spans]
        segments += [Segment(before[len(done):], False), Segment(turn, True, no_loss)]
        done = through
    return segments


def _tool_call_segments(tokenizer, prompt, completion: str, system_prompt, tools: list[dict], where) -> list[Segment]:
    """A text completion holding chat-protocol calls, each followed by ``<tool_response>RESULT</tool_response>``,
    as a rollout of it holds it (``rollout.tools.ToolSession``): the prompt rendered with the tools, then per call
    the model's text through the call (trained) and the template's tool turn around the result (``chat.tool_turn``,
    the result tokenized as text; untrained), then the model's last text and the template's end of turn (trained)."""
    exchanges, rest = chat.split_exchanges(completion)
    dialog = prompt_messages(prompt, system_prompt)
    segments = [Segment(render_prompt(tokenizer, prompt, system_prompt, tools), False)]
    for said, result in exchanges:
        name = chat.called_name(said)
        try:
            before, after = chat.tool_turn(tokenizer, dialog, tools, name, said)
        except Exception as e:  # noqa: BLE001  (a template may raise anything)
            raise DataError(f"{where}: the chat template cannot render the tool turn after this completion's call "
                            f"({type(e).__name__}: {e}); use rollout.tool_format=text") from None
        segments += [Segment(said, True), Segment(before, False), Segment(result, False, as_text=True), Segment(after, False)]
        dialog = chat.continue_dialog(dialog, said, result, name)
    # what the template adds for the model's last text: the text and the end of its turn
    opened = tokenizer.apply_chat_template(dialog, tools=tools, tokenize=False, add_generation_prompt=True)
    through = tokenizer.apply_chat_template([*dialog, {"role": "assistant", "content": rest}], tools=tools, tokenize=False)
    if not through.startswith(opened):
        raise DataError(
            f"{where}: the model's chat template does not render this conversation as a sequence of growing prefixes, "
            "so the end of the assistant's last turn cannot be told apart; use rollout.tool_format=text"
        )
    return [*segments, Segment(through[len(opened):], True)]


def _spans(value, completion: str, where: str) -> list[tuple[int, int]]:
    """A row's ``no_loss_spans``, checked: (start, end) pairs with 0 <= start < end <= len(completion)."""
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) for x in p) and 0 <= p[0] < p[1] <= len(completion)
        for p in value
    )
    if not ok:
        raise DataError(
            f"{where}: no_loss_spans is {str(value)[:100]!r}; give a list of [start, end] character positions in the "
            f"completion, 0 <= start < end <= {len(completion)}"
        )
    return [(s, e) for s, e in value]


def split_at_spans(seg: Segment) -> list[Segment]:
    """A trained segment with ``no_loss`` spans as its pieces: the text between spans (trained) and each span
    (untrained, tokenized as text, as the rollout feeds a tool's result). Tokenized together, a token could
    straddle a boundary: SmolLM2 reads ``</call><result>`` as ``</``, ``call``, ``><``, ``result``, ``>``, so
    the ``>`` that closes a call would share a token with the result, get no loss, and never be learned
    (docs/engineering.md, round 3). Apart, the pieces are the tokens a rollout holds: the model's
    ``...</call>``, then the result's own tokens."""
    pieces, at = [], 0
    for start, end in sorted(seg.no_loss):
        start = max(start, at)
        if start > at:
            pieces.append(Segment(seg.text[at:start], seg.trained))
        if end > start:
            pieces.append(Segment(seg.text[start:end], False, as_text=True))
        at = max(at, end)
    if at < len(seg.text):
        pieces.append(Segment(seg.text[at:], seg.trained))
    return pieces


def tokenize_example(tokenizer, segments: list[Segment], where: str, max_length: int) -> Example:
    """Each segment tokenised on its own (a turn's tokens are then the ones the model writes after its context,
    as in generation), with the loss mask; checked against ``max_length``."""
    ids: list[int] = []
    mask: list[int] = []
    for seg in segments:
        for piece in split_at_spans(seg) if seg.no_loss else [seg]:
            as_text = {"split_special_tokens": True} if piece.as_text else {}  # as ToolSession tokenizes a result
            piece_ids = tokenizer(piece.text, add_special_tokens=False, **as_text)["input_ids"]
            ids += piece_ids
            mask += [int(piece.trained)] * len(piece_ids)
    if 1 not in mask:
        raise DataError(f"{where}: no completion token is left to train on (no_loss_spans cover the whole completion)")
    if len(ids) > max_length:
        raise DataError(
            f"{where}: {len(ids)} tokens after the chat template, more than sft.max_length={max_length}; raise "
            "sft.max_length or shorten or remove the row"
        )
    first, last = mask.index(1), len(mask) - mask[::-1].index(1)
    return Example(ids[:first], ids[first:last], mask[first:last])


def collate(examples: list[Example], pad_id: int):
    """[left-padded prompt | right-padded completion], as ``response_logprobs`` takes a batch: input ids and
    attention mask (B, Tp + T), completion ids (B, T) and the loss mask (B, T)."""
    Tp = max(len(e.prompt_ids) for e in examples)
    T = max(len(e.completion_ids) for e in examples)
    ids = torch.full((len(examples), Tp + T), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), Tp + T), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, e in enumerate(examples):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        ids[i, Tp - p : Tp + c] = torch.tensor(e.prompt_ids + e.completion_ids, dtype=torch.long)
        attention[i, Tp - p : Tp + c] = 1
        loss_mask[i, :c] = torch.tensor(e.loss_mask, dtype=torch.long)
    return ids, attention, ids[:, Tp:], loss_mask


def completion_loss(model, batch, n_tokens: int) -> torch.Tensor:
    """Σ −log p(token) over the batch's loss tokens, divided by ``n_tokens`` (the whole step's count)."""
    input_ids, attention_mask, completion_ids, loss_mask = batch
    logp_BT, _ = response_logprobs(model, input_ids, attention_mask, completion_ids, share_prompts=False)
    return -masked_sum(logp_BT, loss_mask.to(logp_BT.device)) / n_tokens


def held_out_row(row: dict) -> dict:
    """An SFT row as a prompt row for ``evaluate``: the context the model answers (a ``messages`` row's turns
    before its last assistant turn), the reference completion and the row's other columns."""
    if "messages" not in row:
        return dict(row)
    last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    rest = {k: v for k, v in row.items() if k != "messages"}
    return {**rest, "prompt": row["messages"][:last], "completion": row["messages"][last]["content"]}


# ---------------------------------------------------------------------------------------------- the trainer
class SFTTrainer(Trainer):
    """Supervised fine-tuning in the RL trainers' run (``loop.Trainer``): run directory, loop, checkpoints."""

    name = "sft"
    command = "sft"

    @_release_run_dir_on_failure
    def __init__(self, config=None, run_dir: str | Path | None = None, *, model=None, tokenizer=None,
                 train_dataset=None, eval_dataset=None, callbacks=(), tools=None, resume: bool = False,
                 overwrite: bool = False, args=None, peft_config=None):
        """``config``: a ``Config``, a dict of sections, a YAML path, or None. ``model``: a spec (overrides
        ``model.name``) or a loaded model with its ``tokenizer``. ``train_dataset``: rows in one of the formats
        above (a list of dicts, a ``datasets.Dataset``, a ``.jsonl`` path) or a gym task name.
        ``eval_dataset``: held-out prompt rows scored by ``reward.correctness`` (default: a gym task's held-out
        problems; for your own rows, ``data.eval_size`` of them, else none). ``resume``: continue the run in
        ``run_dir`` from its last checkpoint; ``overwrite``: ``run_dir`` may hold another run, whose files are
        deleted first (without either, such a directory is refused, as by the RL trainers). ``tools``: as for
        the RL trainers (replace ``rollout.tools``): the warm start then writes tool calls in the protocol RL's
        rollouts use with this config and tokenizer (``rollout.tools.tool_protocol``), with the same prompt, gym
        references in the calculator's call form (``tools.with_calculator``), and no loss on what a tool
        returns (the model never writes it): each ``<result>...</result>`` in the text protocol, each tool
        turn of the chat template in the chat protocol. TRL's spellings, as for the RL trainers: ``args``, a
        ``cohortrl.SFTConfig`` (TRL's fields and defaults; its ``output_dir`` is ``run_dir``) or a dict of TRL
        field names; ``peft_config``; and TRL's order, ``SFTTrainer(model, args, ...)``."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("cohortrl sft runs in one process; start it without torchrun")
        config, run_dir, model, args = from_trl_order(config, run_dir, model, args, "args")
        cfg = as_config(config)
        if cfg.eval.kl_to_reference:
            raise ConfigError("config key 'eval.kl_to_reference' = True: cohortrl sft keeps no reference model to measure "
                              "against; measure a finished SFT run with cohortrl eval RUN_DIR eval.kl_to_reference=true")
        inputs = resolve_inputs(cfg, cfg.algorithm.name, model=model, tokenizer=tokenizer, train_dataset=train_dataset,
                                eval_dataset=eval_dataset, tools=tools, args=args, peft_config=peft_config, run_dir=run_dir)
        cfg = self.cfg = inputs.config
        self.tools = toolset(cfg.rollout, inputs.tools)  # None without tools; resolved before the model loads
        run_dir = inputs.run_dir
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"sft-{time.strftime('%Y%m%d-%H%M%S')}"
        self._run_claim = claim_run_dir(self.run_dir, resume=resume, overwrite=overwrite)  # locked while in use
        self.config_hash = config_hash(cfg.to_dict())  # in every manifest, as the RL trainers write it (cohortrl verify)
        self.dist = distributed.Dist()  # one process: the identity the shared helpers expect
        self.device = distributed.resolve_device(cfg.train.device, self.dist)
        self._seed_process(self._run_claim.resumes)  # False when a resume finds no checkpoint: the run starts

        if inputs.model is None:
            self.trained_on = trained_on(cfg.model)  # before the load: the weights it is about to read
        self.model, self.tokenizer = build_policy(cfg.model, cfg.train.seed, inputs.model, inputs.tokenizer,
                                                  activation_checkpointing=cfg.train.activation_checkpointing)
        self.model.to(self.device)
        # every step's and evaluation's kernel; no training rollouts, so train.cpu_decode_dtype does not apply
        self.fast_path = build_fast_path(replace(cfg.train, cpu_decode_dtype="float32"), self.device, self.model)
        # The prompt and call form RL and evaluation will use with this tokenizer (rollout/hf.py's generate): in
        # the text protocol the tools' description follows the system prompt, in the chat protocol the template
        # describes their schemas.
        self.protocol = tool_protocol(self.tools, self.tokenizer) if self.tools else None
        self.system_prompt, self.tool_schemas = prompt_framing(self.tokenizer, cfg.model.system_prompt, self.tools)
        n_ctx = getattr(self.model.config, "max_position_embeddings", None)
        if n_ctx is not None and cfg.sft.max_length > n_ctx:
            raise ConfigError(f"config key 'sft.max_length' = {cfg.sft.max_length}: more than {cfg.model.name}'s context "
                              f"of {n_ctx} tokens (max_position_embeddings); lower it")
        examples, eval_rows = self._load_data(inputs)
        self.stream = PromptStream(examples, cfg.train.seed)
        self.eval_rows = eval_rows[: cfg.eval.n_prompts]
        guards.check_prompts_fit(cfg, self.tokenizer, self.tools, {"held-out prompt": self.eval_rows})
        fn = next(f for f in cfg.reward.functions if f.name == cfg.reward.correctness)
        self.correctness = WeightedReward(fn.name, resolve(fn.name, fn.kwargs), fn.weight, cfg.reward.timeout_s)
        check_columns({fn.name: self.correctness.fn}, self.eval_rows, "held-out rows")
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        allocate_optimizer_state(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimised = {"policy": Optimised("grad_norm", params, self.optimizer, self.scheduler)}
        self.step_count = 0
        self.nonfinite_in_a_row = 0
        self._open_run(self._run_claim.resumes, callbacks)

    def _load_data(self, inputs) -> tuple[list[Example], list[dict]]:
        """(tokenised training examples, held-out prompt rows); every bad row is an error naming it."""
        cfg = self.cfg
        if cfg.data.source.startswith("task:"):
            train, held_out = load_rows(cfg.data, cfg.train.seed, eval_rows=inputs.eval_rows)
            named = [(f"{cfg.data.source} problem {r['sample']['id']}",
                      {"prompt": r["prompt"], "completion": self._reference(r["sample"]["reference_solution"])})
                     for r in train]
        else:
            named, held = load_examples(cfg.data, cfg.train.seed, inputs.train_rows)
            for where, row in held:  # held-out SFT rows are checked as strictly as trained ones
                row_segments(self.tokenizer, self._tool_row(row), self.system_prompt, where, self.tool_schemas)
            held_out = [held_out_row(r) for _, r in held] if inputs.eval_rows is None else [dict(r) for r in inputs.eval_rows]
            for i, r in enumerate(held_out):
                check_prompt(r.get("prompt"), f"held-out row {i}")
        segments = [(where, row_segments(self.tokenizer, self._tool_row(row), self.system_prompt, where, self.tool_schemas))
                    for where, row in named]
        # Held-out prompts are never trained on (for task rows load_rows has already made sure).
        held_keys = {prompt_key(r["prompt"]) for r in held_out}
        kept = [(w, s) for (w, s), (_, row) in zip(segments, named) if prompt_key(held_out_row(row)["prompt"]) not in held_keys]
        if len(kept) < len(segments):
            log.warning("%d training row(s) left out: their prompt is also a held-out prompt", len(segments) - len(kept))
        if not kept:
            raise DataError(f"data.source {cfg.data.source!r} has no training row whose prompt is not held out")
        return [tokenize_example(self.tokenizer, s, w, cfg.sft.max_length) for w, s in kept], held_out

    def _reference(self, reference: str) -> str:
        """A gym reference solution as the completion to learn: in the calculator's call form of the run's
        protocol when the run has the calculator, so the warm start writes what RL's rollouts will run."""
        if self.tools is not None and any(t.name == "calculator" for t in self.tools.tools):
            return with_calculator(reference, self.protocol)
        return reference

    def _tool_row(self, row: dict) -> dict:
        """With tools on, a text completion's tool results carry no loss (unless the row says otherwise)."""
        completion = row.get("completion")
        if self.tools is None or not isinstance(completion, str) or "no_loss_spans" in row:
            return row
        spans = result_spans(completion)
        return {**row, "no_loss_spans": spans} if spans else row

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One optimiser step on ``sft.batch_size x sft.grad_accum`` examples. Returns its metrics."""
        s = self.cfg.sft
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        micro_batches = [self.stream.take(s.batch_size) for _ in range(s.grad_accum)]
        n_tokens = sum(sum(e.loss_mask) for mb in micro_batches for e in mb)  # the mean's N, over the whole step
        loss_total, seen = 0.0, 0
        with fast_kernels(self.fast_path, self.model):
            for examples in micro_batches:
                batch = collate(examples, self.tokenizer.pad_token_id)
                loss = completion_loss(self.model, batch, n_tokens)
                loss.backward()
                loss_total += loss.item()
                seen += int(batch[1].sum())
        # no optimiser or scheduler step on a NaN/inf: their state stays exactly as before
        finite, norms = optimizer_step([self.optimised["policy"]], loss_total, self.cfg.optim.max_grad_norm)
        self._count_nonfinite(finite)
        elapsed = time.perf_counter() - t0
        return {
            "loss": loss_total,  # mean −log p over the step's loss tokens
            "tokens": n_tokens,  # loss tokens
            "examples": s.batch_size * s.grad_accum,
            "epoch": self.stream.epoch,
            "grad_norm": norms["grad_norm"] if finite else None,
            "lr": lr,
            "skipped_nonfinite": int(not finite),
            "time/step": elapsed,
            "tokens_per_s": seen / elapsed,  # every token read, prompt and completion
            "peak_rss_mb": peak_rss_mb(),
        }

    def _count_nonfinite(self, finite: bool) -> None:
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        if not finite:
            log.warning("step %d: non-finite loss or gradient; update skipped", self.step_count + 1)
        limit = self.cfg.train.max_nonfinite_steps
        if limit and self.nonfinite_in_a_row >= limit:
            raise guards.NonfiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient and were skipped "
                f"(train.max_nonfinite_steps={limit}); lower optim.lr or check the data"
            )

    # ------------------------------------------------------------------------------------------ the run (loop.Trainer)
    def evaluate(self, responses: list | None = None, rows: list[dict] | None = None) -> dict:
        """Held-out accuracy by ``reward.correctness``, as the RL trainers measure it; ``responses`` receives each
        greedy response (``evaluate.evaluate``); ``rows``: these held-out rows instead of the run's."""
        with fast_kernels(self.fast_path, self.model):
            return evaluate_config(self.model, self.tokenizer, self.eval_rows if rows is None else rows,
                                   self.correctness, self.cfg,
                                   tools=self.tools, responses=responses, fast_path=self.fast_path)

    def _extra_state(self) -> dict:
        return {"nonfinite_in_a_row": self.nonfinite_in_a_row}

    def _load_extra_state(self, state: dict) -> None:
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
