"""Training learned reward models: an ORM (one-label sequence classifier) and a PRM (one-label token
classifier scored at step ends), initialised from a causal LM's backbone. ``cohortrl train-rm`` runs it.

Losses (pure functions over logits):
* ORM, pointwise labels y ∈ [0, 1]: BCE(σ(r), y) on the logit r at the exchange's last token.
* ORM, preference pairs: −log σ(r_chosen − r_rejected), the Bradley–Terry model (Bradley & Terry 1952) as
  InstructGPT trains its reward model (Ouyang et al. 2022, arXiv 2203.02155, eq. 1).
* PRM: BCE at the last token of each step (Lightman et al. 2023, arXiv 2305.20050), mean over steps.

The saved ORM loads with the ``reward_model`` reward function (`cohortrl.rewards.functions`), the saved PRM
with `cohortrl.reward_models.scoring.load_prm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from cohortrl.reward_models.labels import PairExample, PointExample, StepExample
from cohortrl.reward_models.scoring import chat_text, encode_steps


# ---------------------------------------------------------------------------------------------------- losses
def pointwise_loss(logits_B: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Mean BCE of σ(logit) against labels in [0, 1]. Shapes (B,), (B,)."""
    return F.binary_cross_entropy_with_logits(logits_B.float(), labels_B.float())


def bradley_terry_loss(chosen_B: torch.Tensor, rejected_B: torch.Tensor) -> torch.Tensor:
    """Mean −log σ(r_chosen − r_rejected) (Bradley & Terry 1952; arXiv 2203.02155 eq. 1). Shapes (B,), (B,)."""
    return -F.logsigmoid(chosen_B.float() - rejected_B.float()).mean()


def step_loss(logits_BL: torch.Tensor, labels_BL: torch.Tensor, step_mask_BL: torch.Tensor) -> torch.Tensor:
    """BCE at step-end tokens, averaged over every step in the batch (each step counts once, however long
    its response). ``step_mask_BL`` is 1 at the last token of each labelled step."""
    per_token = F.binary_cross_entropy_with_logits(logits_BL.float(), labels_BL.float(), reduction="none")
    mask = step_mask_BL.float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------------------------------- models
def build_reward_model(spec: str, kind: Literal["orm", "prm"], seed: int = 0, dtype: str = "float32"):
    """A one-label sequence (ORM) or token (PRM) classifier whose backbone is ``spec``'s causal LM
    (any `cohortrl.models.load_model` spec); returns ``(model, tokenizer)`` in train mode."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from cohortrl.models import load_model

    lm, tokenizer = load_model(spec, dtype=dtype, seed=seed)
    config = lm.config.__class__.from_dict(lm.config.to_dict())
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    cls = AutoModelForSequenceClassification if kind == "orm" else AutoModelForTokenClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls.from_config(config).to(lm.dtype)
    model.base_model.load_state_dict(lm.base_model.state_dict())
    return model.train(), tokenizer


# ---------------------------------------------------------------------------------------------------- batches
def orm_batch(tokenizer, prompts: list[str], completions: list[str], max_length: int) -> dict:
    """Right-padded chat texts (the classifier pools the last non-pad token; the end is kept if too long)."""
    sides = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    try:
        texts = [chat_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        return dict(tokenizer(texts, add_special_tokens=False, padding=True, truncation=True, max_length=max_length,
                              return_tensors="pt"))
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = sides


def prm_batch(tokenizer, examples: list[StepExample], max_length: int) -> dict:
    """input_ids / attention_mask (B, L), labels and step_mask (B, L): each labelled step's label at its end."""
    encoded = [encode_steps(tokenizer, e.prompt, e.steps, max_length) for e in examples]
    L = max(len(ids) for ids, _ in encoded)
    B = len(examples)
    input_ids = torch.full((B, L), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    labels, step_mask = torch.zeros(B, L), torch.zeros(B, L)
    for b, ((ids, where), e) in enumerate(zip(encoded, examples)):
        input_ids[b, : len(ids)], attention_mask[b, : len(ids)] = torch.tensor(ids), 1
        for t, y in zip(where, e.labels):
            if t is not None:  # a step cut off by max_length is not trained on
                labels[b, t], step_mask[b, t] = y, 1.0
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, step_mask=step_mask)


def batch_loss(model, tokenizer, examples: list, max_length: int) -> torch.Tensor:
    """The loss for one batch of examples of a single type (point, pair or step)."""
    device = next(model.parameters()).device
    first = examples[0]
    if isinstance(first, StepExample):
        batch = {k: v.to(device) for k, v in prm_batch(tokenizer, examples, max_length).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
        return step_loss(logits, batch["labels"], batch["step_mask"])
    if isinstance(first, PointExample):
        enc = orm_batch(tokenizer, [e.prompt for e in examples], [e.completion for e in examples], max_length)
        logits = model(**{k: v.to(device) for k, v in enc.items()}).logits[:, 0]
        return pointwise_loss(logits, torch.tensor([e.label for e in examples], device=device))
    if isinstance(first, PairExample):
        prompts = [e.prompt for e in examples] * 2
        enc = orm_batch(tokenizer, prompts, [e.chosen for e in examples] + [e.rejected for e in examples], max_length)
        logits = model(**{k: v.to(device) for k, v in enc.items()}).logits[:, 0]
        return bradley_terry_loss(logits[: len(examples)], logits[len(examples):])
    raise TypeError(f"no reward-model loss for {type(first).__name__}")


def train_on(model, tokenizer, examples: list, *, steps: int, batch_size: int = 8, lr: float = 1e-4,
             max_length: int = 512, seed: int = 0, log_every: int = 0) -> list[float]:
    """AdamW for ``steps`` updates on batches drawn by epochs over a seeded shuffle; returns the losses."""
    if not examples:
        raise ValueError("no training examples")
    model.train()
    config = getattr(model, "config", None)
    if config is not None:
        config.pad_token_id = tokenizer.pad_token_id  # the sequence classifier finds the last token by it
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    for step in range(steps):
        if len(order) < batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        idx, order = order[:batch_size], order[batch_size:]
        loss = batch_loss(model, tokenizer, [examples[i] for i in idx], max_length)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1:>4}: loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------------- config + run
@dataclass
class RewardModelConfig:
    """``cohortrl train-rm``: a YAML file of these keys, and/or ``key=value`` flags."""

    kind: Literal["orm", "prm"] = "prm"
    """orm: one score per response; prm: one score per step."""
    model: str = "tiny-llama"
    """Backbone: any `load_model` spec (tiny-llama, smollm2-135m-instruct, a directory, a hub id)."""
    data: str = "task:arithmetic"
    """A JSONL file, or task:FAMILY for labels from the gym's graders (perturbed reference solutions)."""
    data_kind: Literal["pointwise", "pairs", "steps"] = "steps"
    """Row type of a JSONL file. With task:FAMILY a PRM uses steps, and an ORM pointwise outcomes or, with
    ``pairs``, Bradley–Terry pairs (the reference against a perturbation of it); either ORM is evaluated on the
    same held-out pointwise outcomes (accuracy, AUROC), the pairs one on held-out pairs too."""
    level: int = 3
    """With task:FAMILY: the difficulty level."""
    n_train: int = 512
    """With task:FAMILY: number of generated training examples."""
    n_eval: int = 128
    """With task:FAMILY: number of held-out examples, generated from problems of another seed."""
    eval_data: str | None = None
    """Held-out JSONL file (same kind as data)."""
    steps: int = 200
    batch_size: int = 8
    lr: float = 3e-4
    max_length: int = 512
    seed: int = 0
    cpu_fast_path: Literal["auto", "off"] = "auto"
    """The CPU fast path's parts below (``cohortrl/cpu/``), as ``train.cpu_fast_path`` of a training run; ``off``:
    PyTorch's kernels and glibc's defaults, and no line of ``cohortrl/cpu/`` runs."""
    cpu_linear: Literal["auto", "onednn", "aten"] = "auto"
    """Kernel for fp32 linear layers on a CPU, as ``train.cpu_linear`` of a training run (``cohortrl/cpu/kernels.py``)."""
    cpu_allocator: Literal["auto", "retain", "system"] = "auto"
    """Freed CPU memory kept in the process for reuse, as ``train.cpu_allocator`` of a training run
    (``cohortrl/cpu/memory.py``)."""
    out: str = "runs/reward_model"
    """Output directory: the model (save_pretrained), its tokenizer, train_rm.json (losses and eval)."""


def load_rm_config(source: str | None, overrides: list[str]) -> RewardModelConfig:
    """A config from a YAML file (optional) plus ``key=value`` overrides; unknown keys fail with a hint."""
    import yaml

    from cohortrl.config import ConfigError, _build, apply_overrides

    data = {}
    if source:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"train-rm config file not found: {source} (give a YAML file or key=value flags)")
        data = yaml.safe_load(path.read_text()) or {}
    data = apply_overrides(data, overrides)
    names = {f.name for f in dataclasses.fields(RewardModelConfig)}
    for key in data:  # before _build, whose hint would point into the policy Config
        if key not in names:
            import difflib

            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown train-rm key '{key}'{hint}")
    cfg = _build(RewardModelConfig, data, "")
    for key, fast in (("cpu_linear", "onednn"), ("cpu_allocator", "retain")):
        if cfg.cpu_fast_path == "off" and getattr(cfg, key) == fast:
            raise ConfigError(f"train-rm key '{key}' = '{fast}' asks for part of the CPU fast path, which "
                              f"cpu_fast_path=off turns off; set {key}=auto or drop cpu_fast_path=off")
    return cfg


def _gym_pairs(cfg: RewardModelConfig) -> bool:
    """An ORM trained on Bradley–Terry pairs generated from the gym (``data=task:FAMILY data_kind=pairs``)."""
    return cfg.kind == "orm" and cfg.data.startswith("task:") and cfg.data_kind == "pairs"


def load_examples(cfg: RewardModelConfig) -> tuple[list, list]:
    """(train, held-out) examples for ``cfg``."""
    from cohortrl.reward_models.labels import as_pointwise, gym_pair_examples, gym_step_examples, load_jsonl

    if cfg.data.startswith("task:"):
        family = cfg.data.removeprefix("task:")
        held = gym_step_examples(family, cfg.n_eval, seed=cfg.seed + 10_000, level=cfg.level)
        if _gym_pairs(cfg):
            return gym_pair_examples(family, cfg.n_train, seed=cfg.seed, level=cfg.level), as_pointwise(held)
        train = gym_step_examples(family, cfg.n_train, seed=cfg.seed, level=cfg.level)
        if cfg.kind == "orm":
            train, held = as_pointwise(train), as_pointwise(held)
        return train, held
    kind = cfg.data_kind
    if (cfg.kind == "prm") != (kind == "steps"):
        from cohortrl.config import ConfigError

        raise ConfigError(f"config key 'data_kind' = {kind!r}: a {cfg.kind} needs "
                          f"{'steps' if cfg.kind == 'prm' else 'pointwise or pairs'} data")
    train = load_jsonl(cfg.data, kind)
    held = load_jsonl(cfg.eval_data, kind) if cfg.eval_data else []
    return train, held


def train_reward_model(cfg: RewardModelConfig) -> dict:
    """Train, save to ``cfg.out`` and evaluate on held-out data; returns the summary written to train_rm.json."""
    from cohortrl.rollout.hf import model_device

    train, held = load_examples(cfg)
    model, tokenizer = build_reward_model(cfg.model, cfg.kind, seed=cfg.seed)
    fast_path = None
    if cfg.cpu_fast_path != "off":  # with off nothing of cohortrl/cpu/ is imported, nor run
        from cohortrl import cpu

        fast_path = cpu.build(cfg, model_device(model), model, generates=False)  # None: nothing of it applies
    try:
        with fast_path.kernels(model) if fast_path is not None else contextlib.nullcontext():
            return _train_and_evaluate(cfg, model, tokenizer, train, held)
    finally:
        if fast_path is not None:
            fast_path.close()


def _train_and_evaluate(cfg: RewardModelConfig, model, tokenizer, train: list, held: list) -> dict:
    from cohortrl.reward_models.evaluate import evaluate_orm, evaluate_pairs, evaluate_prm

    t0 = time.process_time()
    losses = train_on(model, tokenizer, train, steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                      max_length=cfg.max_length, seed=cfg.seed)
    cpu_s = time.process_time() - t0
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary: dict = {"config": dataclasses.asdict(cfg), "train_cpu_s": cpu_s, "n_train": len(train),
                     "loss_first10": sum(losses[:10]) / len(losses[:10]), "loss_last10": sum(losses[-10:]) / len(losses[-10:])}
    if held and cfg.kind == "prm":
        summary["held_out"] = evaluate_prm(model, tokenizer, held, max_length=cfg.max_length)
    elif held and isinstance(held[0], PointExample):
        summary["held_out"] = evaluate_orm(model, tokenizer, held, max_length=cfg.max_length)
    elif held:
        summary["held_out"] = evaluate_pairs(model, tokenizer, held, max_length=cfg.max_length)
    if _gym_pairs(cfg):  # held out as pointwise outcomes above; as pairs here too
        from cohortrl.reward_models.labels import gym_pair_examples

        pairs = gym_pair_examples(cfg.data.removeprefix("task:"), cfg.n_eval, seed=cfg.seed + 10_000, level=cfg.level)
        summary["held_out_pairs"] = evaluate_pairs(model, tokenizer, pairs, max_length=cfg.max_length)
    (out / "train_rm.json").write_text(json.dumps({**summary, "losses": losses}, indent=1))
    return summary
