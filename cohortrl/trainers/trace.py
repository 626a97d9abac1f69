"""One training step recorded token by token (``train.trace_steps``), for ``cohortrl explain``.

``step.rl_step`` builds a ``StepTrace`` only for a traced step (``start_trace``) and hands it the step's own
tensors at three points: the scored batch with its targets (after step 4), each micro-batch's loss (step 5),
and the end of the step. The trace detaches and copies what the step computed and derives only what is read
from it afterwards (the ratio and its clipping side, from the same log-probs the loss used); nothing it does
feeds back into the step, so a traced step's loss, gradient and metrics are the untraced step's.

The file, RUN_DIR/traces/step_N.pt, is a ``torch.save`` of plain tensors, lists, strings and numbers
(``load_trace`` reads it with ``weights_only=True``). Shapes as in ``rollout/types.py``: B responses, P prompts,
G per prompt, T response tokens. Per update (μ epochs × minibatches of it: ``updates``), (B, T) tensors that
are NaN on the rows that update did not train on.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cohortrl.algorithms import masked_fill_padding, masked_mean, needs_sequence_advantages

TRACE_DIR = "traces"
CLIP_SIDES = ("", "low", "high", "dual")  # the values of an update's ``clip`` tensor, by index


def trace_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / TRACE_DIR / f"step_{step}.pt"


def load_trace(run_dir: str | Path, step: int) -> dict:
    """The trace of step ``step`` in ``run_dir``; FileNotFoundError naming the traced steps there and the fix."""
    path = trace_path(run_dir, step)
    if not path.exists():
        found = sorted(int(p.stem.split("_")[1]) for p in (Path(run_dir) / TRACE_DIR).glob("step_*.pt"))
        have = f"traced steps there: {', '.join(map(str, found))}" if found else "no step of it was traced"
        raise FileNotFoundError(f"no trace of step {step} in {run_dir} ({have}); train with "
                                f"--trace-steps {step} (train.trace_steps: [{step}]) to record it")
    return torch.load(path, weights_only=True)


def clip_sides(ratio_BT, advantages_BT, mask_BT, clip_low: float, clip_high: float, dual_clip: float | None):
    """(B, T) int8 index into ``CLIP_SIDES``: where the clipped surrogate (``algorithms.policy_loss``) cut the
    gradient: low (A < 0, ρ < 1 − ε_low), high (A > 0, ρ > 1 + ε_high), dual (A < 0, ρ > c); 0 elsewhere."""
    side = torch.zeros(ratio_BT.shape, dtype=torch.int8)
    side[(advantages_BT < 0) & (ratio_BT < 1 - clip_low)] = 1
    side[(advantages_BT > 0) & (ratio_BT > 1 + clip_high)] = 2
    if dual_clip is not None:
        side[(advantages_BT < 0) & (ratio_BT > dual_clip)] = 3
    return side * mask_BT.bool()


def _prompt_text(prompt) -> str:
    """A row's prompt as text: a string as it is, a conversation as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt or [])


def _cpu(x):
    return None if x is None else x.detach().to("cpu", copy=True)


class StepTrace:
    """The recording of one step; ``data`` is what ``save`` writes."""

    def __init__(self, step: int, cfg, tokenizer, algorithm: str, reward_weights: dict[str, float]):
        a = cfg.algorithm
        self.tokenizer = tokenizer
        self.sequence_ratio = needs_sequence_advantages(a.policy_loss)  # GSPO clips the response's mean ratio
        self.clip = (a.clip_low, a.clip_high, a.dual_clip)
        self.data = {
            "version": 1, "step": step, "algorithm": algorithm,
            "settings": {
                "estimator": a.estimator, "aggregation": a.aggregation, "policy_loss": a.policy_loss, "beta": a.beta,
                "kl_kind": a.kl_kind, "kl_in_reward": a.kl_in_reward, "clip_low": a.clip_low,
                "clip_high": a.clip_high, "dual_clip": a.dual_clip, "eps": a.eps, "group_size": a.group_size,
                "epochs": a.epochs, "minibatches": a.minibatches, "norm_length": a.norm_length,
                "max_new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.sampling.temperature,
                "zero_variance": a.zero_variance, "mask_truncated": a.mask_truncated,
                "process_coef": cfg.reward.process.coef if cfg.reward.process is not None else None,
                "gamma": a.ppo.gamma, "lam": a.ppo.lam, "vf_coef": a.ppo.vf_coef,
                "whiten_advantages": a.ppo.whiten_advantages,
            },
            "reward_weights": dict(reward_weights),
            "updates": [],
        }

    # ------------------------------------------------------------------------------------------ after step 4
    def scored(self, batch, rewards_B, keep_B, loss_mask, targets) -> None:
        """The rollout, its rewards, the group statistics and the targets the update trains on."""
        r, G = batch.rollout, batch.rollout.group_size
        seq_mask = r.sequence_mask
        lengths = [int(m.nonzero().max()) + 1 if m.any() else 0 for m in seq_mask]  # through the last token, holes too
        rewards_PG = rewards_B.view(-1, G)
        self.data.update(
            prompts=[_prompt_text(r.rows[k * G].get("prompt")) if r.rows else "" for k in range(r.batch_size // G)],
            prompt_texts=[self.tokenizer.decode(ids[m.bool()].tolist()) for ids, m in zip(r.prompt_ids[::G], r.prompt_mask[::G])],
            completions=list(r.completions),
            response_ids=_cpu(r.response_ids),
            tokens=[[self.tokenizer.decode([t]) for t in ids[:n].tolist()] for ids, n in zip(r.response_ids, lengths)],
            response_mask=_cpu(r.response_mask), loss_mask=_cpu(loss_mask), keep=_cpu(keep_B),
            tool_mask=_cpu(r.tool_mask), tool_calls=_cpu(r.tool_calls), truncated=_cpu(r.truncated),
            rewards=_cpu(rewards_B), per_fn={k: list(v) for k, v in batch.per_fn.items()},
            group_mean=rewards_PG.mean(-1), group_std=rewards_PG.std(-1) if G > 1 else torch.zeros(len(rewards_PG)),
            identical=_cpu(batch.zero_variance),
            step_rewards=batch.step_rewards, step_ends=batch.step_ends,
            advantages=_cpu(targets.advantages), ref_logp=_cpu(targets.ref_logp), old_logp=_cpu(targets.old_logp),
            sampling_logp=_cpu(r.sampling_logp), is_weights=_cpu(targets.is_weights),
            values=_cpu(targets.old_values), returns=_cpu(targets.returns),
            detail={k: _cpu(v) for k, v in targets.detail.items()},
        )

    # ------------------------------------------------------------------------------------------ step 5
    def begin_update(self) -> None:
        """A new optimiser update (one minibatch of one epoch) starts."""
        B, T = self.data["response_ids"].shape
        self.data["updates"].append({"shape": (B, T), "tensors": {}})

    def micro_batch(self, mb, logp, old_logp, advantages, policy_BT, extra_BT, extra_metrics: dict, contribution_BT) -> None:
        """Micro-batch ``mb`` of the current update: the log-probs the loss saw (None while the policy is frozen),
        the per-token policy loss (after importance weights) and the algorithm's extra loss, its per-token
        metrics (GRPO's KL, PPO's value loss), and each token's contribution w·L to the loss."""
        if mb.padding:  # torchrun's zero-weight stand-in: no row of the batch
            return
        per_token = {"weight": mb.weights, "loss_mask": mb.loss_mask, "response_mask": mb.response_mask,
                     "policy_loss": policy_BT, "contribution": contribution_BT,
                     **{f"extra/{k}": v for k, v in extra_metrics.items()}}
        if extra_BT is not None:
            per_token["extra_loss"] = extra_BT
        if logp is not None:
            log_ratio = masked_fill_padding(logp.detach() - old_logp.detach(), mb.loss_mask)
            if self.sequence_ratio:
                log_ratio = masked_mean(log_ratio, mb.loss_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
            ratio = torch.exp(log_ratio)
            per_token.update(logp=logp, old_logp=old_logp, ratio=ratio,
                             clip=clip_sides(ratio.cpu(), advantages.cpu(), mb.loss_mask.cpu(), *self.clip))
        update = self.data["updates"][-1]
        for name, value in per_token.items():
            value = value.detach().cpu()
            if name not in update["tensors"]:
                dtype = value.dtype if value.dtype in (torch.int8, torch.bool) else torch.float32
                fill = 0 if dtype in (torch.int8, torch.bool) else float("nan")
                update["tensors"][name] = torch.full(update["shape"], fill, dtype=dtype)
            update["tensors"][name][mb.rows] = value.to(update["tensors"][name].dtype)

    # ------------------------------------------------------------------------------------------ the end
    def save(self, run_dir: str | Path) -> Path:
        """Write RUN_DIR/traces/step_N.pt (atomically: a crash leaves the old file or none)."""
        path = trace_path(run_dir, self.data["step"])
        path.parent.mkdir(parents=True, exist_ok=True)
        for update in self.data["updates"]:
            update["shape"] = list(update["shape"])
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.data, tmp)
        os.replace(tmp, path)
        return path


# ---------------------------------------------------------------------------------------------- reading it
def _wsum(update: dict, name: str, rows: torch.Tensor | None = None) -> float:
    """Σ w·x over the update's rows (``rows``: only those), x an update tensor; 0 where w is 0, as the step sums."""
    t = update["tensors"]
    if name not in t:
        return 0.0
    w, x = t["weight"].double(), t[name].double()
    keep = ~torch.isnan(w) & (w != 0)
    if rows is not None:
        keep &= rows.unsqueeze(-1)
    return float(torch.where(keep, w * x, 0.0).sum())


def reconcile(trace: dict, rows: torch.Tensor | None = None) -> dict:
    """The step's loss from its recorded tokens: L = (1/U) Σ_updates Σ_t w_t·L_t, split into the policy term and
    the algorithm's extra term (GRPO's β·KL, PPO's value loss), with Σ|w·L| (``abs``); and the KL the step
    logs. ``rows`` (B,) bool: the share of those responses only."""
    updates, U = trace["updates"], max(1, len(trace["updates"]))
    out = {"updates": len(updates),
           "loss": sum(contribution(u, rows) for u in updates) / U,
           "policy": sum(_wsum(u, "policy_loss", rows) for u in updates) / U,
           "extra": sum(_wsum(u, "extra_loss", rows) for u in updates) / U,
           "abs": sum(contribution(u, rows, absolute=True) for u in updates) / U}
    out["kl"] = kl_mean(trace)
    return out


def contribution(update: dict, rows: torch.Tensor | None = None, absolute: bool = False) -> float:
    """Σ w·L of one update's tokens (``rows`` (B,) bool: of those responses only; ``absolute``: Σ |w·L|, the
    scale of the sum's float rounding)."""
    c = update["tensors"]["contribution"].double()
    c = c.abs() if absolute else c
    if rows is not None:
        c = c[rows]
    return float(torch.nan_to_num(c).sum())


def kl_mean(trace: dict, rows: torch.Tensor | None = None) -> float | None:
    """The KL the step logs: PPO's, of the sampling policy in the reward; GRPO's, of each update's policy in the
    loss, over every update's response tokens (``rows`` (B,) bool: of those responses only)."""
    if "kl" in trace["detail"]:  # PPO: the penalty's KL, per response token
        kl, m = trace["detail"]["kl"].double(), trace["response_mask"].bool()
        if rows is not None:
            m = m & rows.unsqueeze(-1)
        return float(kl[m].sum() / max(1, int(m.sum())))
    total, count = 0.0, 0
    for u in trace["updates"]:
        t = u["tensors"]
        if "extra/kl" not in t:
            return None
        m = torch.nan_to_num(t["response_mask"]).bool()
        if rows is not None:
            m = m & rows.unsqueeze(-1)
        total += float(t["extra/kl"].double()[m].sum())
        count += int(m.sum())
    return total / max(1, count)
