"""Held-out evaluation: greedy pass@1 and sampled pass@k, scored by the run's correctness function."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import torch

from cohortrl.algorithms import exact_kl, masked_sum
from cohortrl.config import ConfigError
from cohortrl.data import problem_id
from cohortrl.rewards.error_categories import category_fractions, row_category
from cohortrl.rewards.scoring import TrainerState, WeightedReward, score_rollout
from cohortrl.rollout.hf import Sampling, generate, response_logits
from cohortrl.rollout.tools import toolset
from cohortrl.stats import mean_interval, wilson_interval

progress = logging.getLogger("cohortrl.progress")  # printed by the command line (cli._progress_on_stderr)

# Each evaluation's greedy responses, one row each with its step, the problem's id (``data.problem_id``), prompt,
# completion, correctness, error category, length in tokens and tool calls: what the model gets wrong, readable
# after the run, and what two runs' paired comparison is computed from (``cohortrl report``).
EVAL_RESPONSES = "eval_completions.jsonl"
# The held-out rows of a run whose rows were given in Python (a config file cannot name them), so that
# `cohortrl eval RUN_DIR` evaluates it on the same problems.
EVAL_ROWS = "eval_rows.jsonl"
ANSWERS = "answers.jsonl.gz"
# What a committed answer keeps of an evaluated response: the prompt is left out (the problem id names it, and
# the config regenerates it), the response is kept, compressed.
ANSWER_FIELDS = ("step", "id", "correct", "category", "length", "tool_calls", "completion")


def held_out_parts(rows: list[dict]) -> list[tuple[str, list[bool]]]:
    """The parts of a held-out set an evaluation also scores apart, each with which rows are in it: ``unseen`` and
    ``seen`` where the rows are marked (``data.exclude_from_training``), and ``level1``, ``level2``, ... where their
    problems span several levels (``data.levels``)."""
    parts = []
    marks = [row.get("unseen") for row in rows]
    if any(m is not None for m in marks):
        parts += [("unseen", [m is True for m in marks]), ("seen", [m is False for m in marks])]
    levels = [(row.get("sample") or {}).get("level") for row in rows]
    if len(set(levels) - {None}) > 1:
        parts += [(f"level{level}", [lv == level for lv in levels]) for level in sorted(set(levels) - {None})]
    return parts


def export_answers(run_dir: Path) -> Path | None:
    """``RUN_DIR/answers.jsonl.gz`` from the run's ``eval_completions.jsonl`` (every evaluation's answers,
    without prompts); byte-identical for the same answers (no time stamp in the gzip header). None when the run
    evaluated nothing."""
    source = Path(run_dir) / EVAL_RESPONSES
    if not source.is_file():
        return None
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    # ``unseen`` only where the run marked it (data.exclude_from_training), the sampled counts only where it drew
    # them (eval.pass_k): older answers files stay as they were.
    fields = (ANSWER_FIELDS + (("unseen",) if any("unseen" in r for r in rows) else ())
              + (("sampled_correct", "samples") if any("samples" in r for r in rows) else ()))
    text = "".join(json.dumps({k: r.get(k) for k in fields}) + "\n" for r in rows)
    out = Path(run_dir) / ANSWERS
    tmp = out.with_name(ANSWERS + ".tmp")
    with open(tmp, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(text.encode())
    tmp.replace(out)
    return out


def read_answers(run_dir: Path) -> list[dict]:
    """Every evaluated response of a run: its ``eval_completions.jsonl`` (the live file), or, in a committed
    copy without it, ``answers.jsonl.gz``."""
    packed, plain = Path(run_dir) / ANSWERS, Path(run_dir) / EVAL_RESPONSES
    if plain.is_file():
        text = plain.read_text()
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    correctness: WeightedReward,
    *,
    system_prompt: str | None,
    max_new_tokens: int,
    batch_size: int = 64,
    pass_k: int = 0,
    temperature: float = 1.0,
    max_prompt_tokens: int = 512,
    overlong_prompts: str = "reject",
    trainer_state: TrainerState | None = None,
    tools=None,
    responses: list | None = None,
    fast_path=None,
    reference=None,
) -> dict[str, float]:
    """Greedy accuracy with a 95% Wilson interval, and (if ``pass_k``) k samples per prompt at ``temperature``:
    pass@k and the sampled accuracy with a 95% interval over prompts. Sampling runs under a forked RNG so evaluating never changes the training
    run's random stream (a resumed run evaluates at different moments). A response is correct when the
    correctness function gives it at least 1 (its mean value, for functions that are not 0/1, is logged as
    ``eval/correctness_mean``). With ``tools`` (a ``Toolset``) the model may call them, as in training; the
    built-in ``task`` reward grades the rendered text (``tools.render``). ``fast_path``: the run's CPU fast path
    (``cpu.FastPath``), handed to generation, which decodes in fp32 whatever its ``decode_dtype`` (that is for
    training rollouts); None: plain transformers.

    On gym problems graded by keyed steps, ``eval/error/<category>`` is the fraction of greedy responses whose
    first error is of that category, and ``eval/unsupported_correct`` the fraction right by the outcome with a
    required step missing or wrong (``rewards/error_categories.py``). ``responses``, if given, receives one
    dict per greedy response: its problem id, prompt, completion, correctness, category, length and tool calls;
    with ``pass_k``, also how many of the k samples were right (``sampled_correct``) of ``samples``.

    ``reference`` (a ``setup.Reference``, with ``pass_k``): also the exact KL of the policy to it on the first
    sample of each prompt (``kl_to_reference``): ``eval/kl_to_reference`` per response token and
    ``eval/kl_to_reference_per_response``, the same measure for every run whatever its KL estimator or β."""
    out: dict[str, float] = {}
    first_response = len(responses) if responses is not None else 0
    kw = dict(system_prompt=system_prompt, max_prompt_tokens=max_prompt_tokens, overlong_prompts=overlong_prompts,
              tools=tools, fast_path=fast_path)
    correct, lengths, calls, categories = [], [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        rollout, _ = generate(model, tokenizer, chunk, 1, Sampling(temperature=0, max_new_tokens=max_new_tokens), **kw)
        _, per_fn = score_rollout([correctness], rollout, max_new_tokens, trainer_state=trainer_state)
        values = [float(v or 0.0) for v in per_fn[correctness.name]]
        kinds = [row_category(row, text) for row, text in zip(chunk, rollout.completions)]
        if responses is not None:
            chunk_calls = rollout.tool_calls.tolist() if rollout.tool_calls is not None else [0] * len(chunk)
            responses += [{"id": problem_id(row), "prompt": row["prompt"], "completion": text, "correct": v >= 1.0,
                           "category": kind, "length": length, "tool_calls": n_calls,
                           **({"unseen": row["unseen"]} if "unseen" in row else {})}
                          for row, text, v, kind, length, n_calls in zip(chunk, rollout.completions, values, kinds,
                                                                         rollout.lengths.tolist(), chunk_calls)]
        correct += values
        categories += kinds
        lengths += rollout.lengths.tolist()
        progress.info("held-out evaluation: %d/%d prompts (greedy)", len(correct), len(rows))
        calls += rollout.tool_calls.tolist() if rollout.tool_calls is not None else []
    n, hits = len(correct), int(sum(v >= 1.0 for v in correct))
    lo, hi = wilson_interval(hits, n)
    out.update({"eval/accuracy": hits / max(n, 1), "eval/accuracy_ci_low": lo, "eval/accuracy_ci_high": hi,
                "eval/correctness_mean": sum(correct) / max(n, 1), "eval/n": n, "eval/response_length_mean": sum(lengths) / max(len(lengths), 1)})
    for part, members in held_out_parts(rows):
        hits_part = [v >= 1.0 for v, member in zip(correct, members) if member]
        out[f"eval/accuracy_{part}"] = sum(hits_part) / max(len(hits_part), 1)
        out[f"eval/n_{part}"] = len(hits_part)
    if tools is not None:
        out["eval/tool_calls_per_response"] = sum(calls) / max(len(calls), 1)
    if categories and None not in categories:
        out.update({f"eval/{name}": value for name, value in category_fractions(categories).items()})
    if pass_k:
        # k samples per prompt give both pass@k (any of the k correct) and the sampled accuracy (mean over
        # the k), whose interval is taken over prompts: samples of one prompt are not independent.
        # every device's generator forked: a GPU run's sampling would otherwise advance the CUDA stream
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
            per_prompt, kl_rows = [], []
            per_batch = max(1, batch_size // pass_k)
            for start in range(0, len(rows), per_batch):
                chunk = rows[start : start + per_batch]
                sampling = Sampling(temperature=temperature, max_new_tokens=max_new_tokens)
                rollout, _ = generate(model, tokenizer, chunk, pass_k, sampling, **kw)
                _, per_fn = score_rollout([correctness], rollout, max_new_tokens, trainer_state=trainer_state)
                per_prompt.append((torch.tensor([float(v or 0.0) for v in per_fn[correctness.name]]) >= 1.0).float().view(-1, pass_k))
                if reference is not None:
                    kl_rows.append(kl_to_reference(model, reference, rollout.select(list(range(0, len(chunk) * pass_k, pass_k))),
                                                   temperature))
                progress.info("held-out evaluation: %d/%d prompts (%d samples each)", start + len(chunk), len(rows), pass_k)
        hits_PK = torch.cat(per_prompt)
        if responses is not None:  # one greedy response per row, in the rows' order
            greedy = responses[first_response:]
            assert len(greedy) == len(hits_PK), f"{len(greedy)} greedy responses for {len(hits_PK)} sampled prompts"
            for response, hits in zip(greedy, hits_PK.sum(-1).tolist()):
                response.update(sampled_correct=int(hits), samples=pass_k)
        mean, low, high = mean_interval(hits_PK.mean(-1).tolist())
        out[f"eval/pass@{pass_k}"] = hits_PK.max(-1).values.mean().item()
        out["eval/sampled_accuracy"] = mean
        out["eval/sampled_accuracy_ci_low"] = low
        out["eval/sampled_accuracy_ci_high"] = high
        if kl_rows:
            kl_sum = torch.cat([k for k, _ in kl_rows])
            n_tokens = torch.cat([n for _, n in kl_rows])
            out["eval/kl_to_reference"] = (kl_sum.sum() / n_tokens.sum().clamp(min=1)).item()
            out["eval/kl_to_reference_per_response"] = kl_sum.mean().item()
    return out


def kl_to_reference(model, reference, rollout, temperature: float, rows_per_pass: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's exact KL(π ‖ π_ref) summed over its tokens (``algorithms.exact_kl``, at the sampling
    temperature, as the training passes compare log-probs), and its number of tokens: (B,), (B,). Tool results
    inside a response are context, not counted. A few rows per pass: both models' whole-vocabulary logits exist."""
    sums, T = [], rollout.response_ids.shape[1]
    with torch.no_grad():
        for start in range(0, rollout.batch_size, rows_per_pass):
            part = rollout.select(list(range(start, min(start + rows_per_pass, rollout.batch_size))))
            ids, attention = part.input_ids(), part.attention_mask()
            logits_p = response_logits(model, ids, attention, T)
            with reference() as ref_model:
                logits_q = response_logits(ref_model, ids, attention, T)
            sums.append(masked_sum(exact_kl(logits_p, logits_q, temperature).cpu(), part.response_mask, dim=-1))
    return torch.cat(sums), rollout.response_mask.float().sum(-1)


def evaluate_config(model, tokenizer, rows: list[dict], correctness: WeightedReward, cfg,
                    trainer_state: TrainerState | None = None, tools=None, responses: list | None = None,
                    fast_path=None, reference=None) -> dict[str, float]:
    """``evaluate`` with the settings of a run config (``eval``, ``sampling``, ``model``, ``data``, ``rollout``
    sections): the one place the trainer and ``cohortrl eval`` read them. ``tools``: the run's ``Toolset``
    (default: built from ``rollout.tools``); ``fast_path``: the run's CPU fast path, or None; ``reference``: the
    run's π_ref, measured against when ``eval.kl_to_reference`` is set (and needed then)."""
    if not rows:  # an accuracy of 0 over 0 prompts would read as a measurement
        raise ConfigError("nothing to evaluate: there are no held-out rows (pass eval_dataset=, or set data.eval_size "
                          "and eval.n_prompts above 0)")
    e = cfg.eval
    if e.kl_to_reference and reference is None:
        raise ConfigError("eval.kl_to_reference is set but this evaluation has no reference model to measure against")
    return evaluate(
        model, tokenizer, rows, correctness, system_prompt=cfg.model.system_prompt,
        max_new_tokens=e.max_new_tokens or cfg.sampling.max_new_tokens, batch_size=e.batch_size,
        pass_k=e.pass_k, temperature=e.temperature, max_prompt_tokens=cfg.data.max_prompt_tokens,
        overlong_prompts=cfg.data.overlong_prompts, trainer_state=trainer_state,
        tools=tools if tools is not None else toolset(cfg.rollout), responses=responses, fast_path=fast_path,
        reference=reference if e.kl_to_reference else None,
    )
