"""``cohortrl explain RUN_DIR --step N``: one traced step (``trace.py``) told as a walk-through, in a terminal
(``explain_text``, at most 100 columns) or as one self-contained HTML page (``explain_html``).

The story is the step's own order: what was sampled → each reward function's score and the total → the
advantages, with the group's arithmetic → the objective per token (ratio, clipping, KL, the aggregation's
weight) → the step's loss, reconciled with the loss ``metrics.jsonl`` logged for the step (``reconcile``).
Every number shown is one the step computed and the trace recorded, except the group arithmetic, which is
recomputed from the recorded rewards to show the formula at work next to the advantages the step used.
"""

from __future__ import annotations

import html
import math
import re
import textwrap
from pathlib import Path

import torch

from cohortrl.trainers.trace import CLIP_SIDES, contribution, kl_mean, load_trace, reconcile

WIDTH = 100  # the terminal form's widest line
HIGH_KL_FLOOR = 1e-3  # the page marks a token's KL as high only above this (nats), whatever the step's spread

# What each estimator computes, named once (docs/algorithms.md has the derivations).
ESTIMATOR_FORMULAS = {
    "grpo": "A_i = (r_i - mean_g r) / (std_g r + eps)   [GRPO, arXiv 2402.03300 sec. 4.1.2]",
    "grpo_batch": "A_i = (r_i - mean_g r) / (std_batch r + eps)   [group baseline, batch scale]",
    "dr_grpo": "A_i = r_i - mean_g r   [Dr. GRPO, arXiv 2503.20783: no std]",
    "rloo": "A_i = r_i - mean_(j != i) r_j   [RLOO, arXiv 2402.14740]",
    "reinforce_pp": "A_t = whiten(sum_(s >= t) r_s) over the batch   [REINFORCE++, arXiv 2501.03262]",
    "reinforce_pp_baseline": "A_t = whiten(sum_(s >= t) r_s - mean_g r)   [REINFORCE++ with a group baseline]",
    "grpo_process": "A_t = sum of the group-normalised step rewards of the steps ending at or after t   "
                    "[arXiv 2402.03300 sec. 4.1.3]",
    "grpo_combined": "A_t = outcome A_i + coef x process A_t   [outcome and process supervision together]",
}
AGGREGATION_WEIGHTS = {
    "seq-mean-token-mean": "w_t = 1 / (N x |o_i|): each response weighs the same   [GRPO eq. 3]",
    "token-mean": "w_t = 1 / (sum_i |o_i|): each token weighs the same   [DAPO]",
    "seq-mean-token-sum-norm": "w_t = 1 / (N x norm_length): a constant   [Dr. GRPO]",
}
# Each algorithm's extra per-token loss (its object's ``extra_loss``): (its token-table column, the trace's name, its name)
EXTRA_TERMS = {"ppo": ("value", "extra/value_loss", "value loss term"), "rft": ("-logp", "extra/nll", "supervised term")}
KL_TERM = ("KL_t", "extra/kl", "KL term")
KL_FORMULAS = {
    "k1": "KL_t = logp - logp_ref   [k1]",
    "k2": "KL_t = (logp - logp_ref)^2 / 2   [k2]",
    "k3": "KL_t = exp(logp_ref - logp) - (logp_ref - logp) - 1   [k3]",
}


def logged_row(run_dir: str | Path, step: int) -> dict | None:
    """The row ``metrics.jsonl`` logged for training step ``step`` (None when it has none)."""
    from cohortrl.trainers.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("step") == step and "loss" in r]
    return rows[-1] if rows else None


# ---------------------------------------------------------------------------------------------- the numbers
def _rows_of(update: dict) -> torch.Tensor:
    """(B,) bool: the rows this update trained on (its tensors are NaN elsewhere)."""
    return ~torch.isnan(update["tensors"]["weight"][:, 0])


def token_view(trace: dict) -> dict[str, torch.Tensor]:
    """(B, T) per-token numbers of each response from the first update that trained it (later epochs see the
    same tokens again under a moved policy; the loss reconciliation sums them all)."""
    B, T = trace["response_ids"].shape
    view, update_of = {}, torch.full((B,), -1)
    for k, u in enumerate(trace["updates"]):
        new = _rows_of(u) & (update_of < 0)
        update_of[new] = k
        for name, x in u["tensors"].items():
            if name not in view:
                view[name] = torch.full((B, T), float("nan")) if x.is_floating_point() else torch.zeros((B, T), dtype=x.dtype)
            view[name][new] = x[new].to(view[name].dtype)
    view["update"] = update_of
    return view


def group_arithmetic(rewards_G: list[float], eps: float) -> dict:
    """The group's mean, sample std (n − 1, as torch's default) and each response's (r − mean) / (std + eps)."""
    G = len(rewards_G)
    mean = sum(rewards_G) / G
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / (G - 1)) if G > 1 else 0.0
    return {"mean": mean, "std": std, "centred": [r - mean for r in rewards_G],
            "scaled": [(r - mean) / (std + eps) for r in rewards_G]}


def formula_advantages(estimator: str, rewards_G: list[float], rewards_all: list[float], eps: float):
    """An outcome estimator's A_i worked out by hand from the group's rewards (``rewards_all``: the batch's, for
    grpo_batch's std), as (the column's name, the values); None for an estimator whose advantages vary along
    the response (they are shown per token)."""
    G, g = len(rewards_G), group_arithmetic(rewards_G, eps)
    if estimator == "grpo":
        return "(r - mean)/(std + eps)", g["scaled"]
    if estimator == "dr_grpo":
        return "r - mean", g["centred"]
    if estimator == "grpo_batch":
        std_all = group_arithmetic(rewards_all, eps)["std"]
        return "(r - mean)/(std_batch + eps)", [c / (std_all + eps) for c in g["centred"]]
    if estimator == "rloo" and G > 1:
        return "r - mean of the others", [r - (sum(rewards_G) - r) / (G - 1) for r in rewards_G]
    return None


# ---------------------------------------------------------------------------------------------- terminal
def _f(x, width: int = 7, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    x = float(x)
    text = f"{x:.{digits}f}"
    if len(text) > width or (x != 0 and abs(x) < 10 ** -digits):
        text = f"{x:.1e}"
    return text.rjust(width)


def _tok(s: str, width: int) -> str:
    text = repr(s)[1:-1]
    return (text if len(text) <= width else text[: width - 1] + "~").ljust(width)


def _mark(trace: dict, i: int, t: int) -> str:
    """A token's role in the loss: L (trained), t (a tool's result), - (the model's, outside the loss)."""
    if trace["tool_mask"] is not None and trace["tool_mask"][i, t]:
        return "t"
    return "L" if trace["loss_mask"][i, t] else "-"


def explain_text(trace: dict, logged: dict | None, prompt: int = 0, run_dir: str = "RUN_DIR") -> str:
    """The terminal walk-through of prompt ``prompt``'s group in ``trace`` (lines of at most ``WIDTH``)."""
    s, G = trace["settings"], trace["settings"]["group_size"]
    P = len(trace["prompts"])
    if not 0 <= prompt < P:
        raise ValueError(f"--prompt {prompt}: step {trace['step']} traced prompts 0 to {P - 1}")
    ppo = trace["algorithm"] == "ppo"
    rows = range(prompt * G, prompt * G + G)
    view = token_view(trace)
    out: list[str] = []
    add = out.append
    name = {"ppo": "PPO", "grpo": "GRPO", "rft": "RFT"}.get(trace["algorithm"], trace["algorithm"])
    how = "critic + GAE" if ppo else f"estimator {s['estimator']}"
    add(f"cohortrl explain: step {trace['step']}, {name} ({how}, aggregation {s['aggregation']})")
    out += _wrap(f"run: {run_dir}", WIDTH)
    add(f"prompt {prompt} of {P} (--prompt K shows another):")
    out += [f"  {line}" for line in _wrap(trace["prompts"][prompt], WIDTH - 2)]

    add("")
    add(f"1. sampled: G = {G} response(s) at temperature {s['temperature']}, at most {s['max_new_tokens']} new tokens")
    add("   #  tokens  ends       tool calls  completion")
    for i in rows:
        ends = "budget" if trace["truncated"][i] else "eos/stop"
        calls = int(trace["tool_calls"][i]) if trace["tool_calls"] is not None else 0
        add(f"  {i - rows.start:2d}  {int(trace['response_mask'][i].sum()):6d}  {ends:<9}  {calls:10d}  "
            f"{_tok(trace['completions'][i], WIDTH - 40)}".rstrip())

    add("")
    weights = trace["reward_weights"]
    add("2. rewards: r_i = sum_f w_f x score_f(response i)")
    names = list(trace["per_fn"])
    short = [_short(n) for n in names]
    add("   #  " + "  ".join(f"{n} x{weights.get(full, 1.0):g}"[:24].rjust(max(10, min(24, len(n) + 5)))
                             for n, full in zip(short, names)) + "        r_i")
    for i in rows:
        vals = "  ".join(_f(trace["per_fn"][full][i], max(10, min(24, len(n) + 5)))
                         for n, full in zip(short, names))
        add(f"  {i - rows.start:2d}  {vals}  {_f(float(trace['rewards'][i]), 9, 4)}")
    if trace.get("step_rewards") is not None:
        add("   step rewards (reward.process), score@token where the step ends:")
        for i in rows:
            steps = ", ".join(f"{v:.2f}@{e}" for v, e in zip(trace["step_rewards"][i], trace["step_ends"][i]))
            out += [f"  {i - rows.start:2d}  {line}" for line in _wrap(steps or "(no steps)", WIDTH - 6)]

    add("")
    if ppo:
        _ppo_advantages(trace, rows, view, add)
    else:
        _group_advantages(trace, prompt, rows, add)

    add("")
    _objective(trace, rows, view, add)

    add("")
    _loss(trace, logged, prompt, rows, add)
    return "\n".join(part for line in out for part in _fit(line.rstrip()))


def _fit(line: str) -> list[str]:
    """``line`` in lines of at most ``WIDTH``: broken at a space, continued under its own indentation + 2."""
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    parts = []
    while len(line) > WIDTH:
        cut = line.rfind(" ", len(indent), WIDTH + 1)
        cut = cut if cut > len(indent) else WIDTH
        parts.append(line[:cut].rstrip())
        line = indent + line[cut:].lstrip()
    return [*parts, line]


def _short(name: str) -> str:
    """A reward function's name without its file path (``path/to/file.py:fn`` → ``fn``)."""
    return name.rsplit(":", 1)[-1].rsplit("/", 1)[-1]


def _wrap(text: str, width: int) -> list[str]:
    """``text``'s lines in lines of at most ``width``, broken between words (only a word longer than ``width``
    is cut); blank lines kept."""
    return [part for raw in str(text).splitlines() or [""]
            for part in textwrap.wrap(raw, width, break_on_hyphens=False) or [""]]


def _group_advantages(trace, prompt: int, rows, add) -> None:
    s = trace["settings"]
    add(f"3. advantages ({s['estimator']}):")
    add(f"   {ESTIMATOR_FORMULAS.get(s['estimator'], 'the registered estimator ' + s['estimator'])}")
    rewards_B = trace["detail"].get("shaped_rewards", trace["rewards"])
    if "shaped_rewards" in trace["detail"]:
        add(f"   kl_in_reward: the estimator saw r_i - beta x sum_t KL_t (KL of the sampling policy), beta = {s['beta']}")
    r = [float(x) for x in rewards_B[rows.start: rows.stop]]
    g = group_arithmetic(r, s["eps"])
    terms = " + ".join(f"{x:.3f}" for x in r) if len(r) <= 8 else f"{r[0]:.3f} + ... + {r[-1]:.3f}"
    add(f"   mean_g = ({terms}) / {len(r)} = {g['mean']:.4f}")
    add(f"   std_g = sqrt(sum (r_i - mean_g)^2 / (G - 1)) = {g['std']:.4f}   eps = {s['eps']:g}")
    name, by_hand = formula_advantages(s["estimator"], r, [float(x) for x in rewards_B], s["eps"]) or ("", [None] * len(r))
    add(f"   #        r_i   r_i - mean  {name:>28}   A (first token, as trained)")
    for k, i in enumerate(rows):
        m = trace["response_mask"][i].bool()
        a0 = float(trace["advantages"][i][m][0]) if m.any() else float("nan")
        add(f"  {k:2d}  {_f(r[k], 9, 4)}  {_f(g['centred'][k], 11, 4)}  {_f(by_hand[k], 28, 4)}   {_f(a0, 10, 4)}")
    add(f"   identical rewards (on the correctness signal): {identical_group_effect(trace, prompt)}")


def identical_group_effect(trace: dict, prompt: int) -> str:
    """Whether prompt ``prompt``'s group had identical correctness rewards, and what that left of its gradient,
    read from what the step trained on: A = 0 zeroes the clipped surrogate, but an extra term in the loss (GRPO's
    beta x KL_t, RFT's supervised term) still acts on the group's tokens, and a filtered group is out of the loss."""
    flags = trace["identical"]
    if flags is None or len(flags) <= prompt or not bool(flags[prompt]):
        return "no"
    G, s = trace["settings"]["group_size"], trace["settings"]
    rows = torch.zeros(len(trace["rewards"]), dtype=torch.bool)
    rows[prompt * G: prompt * G + G] = True
    trained = trace["loss_mask"][rows].bool()
    if not trained.any():
        return "yes; dropped from the loss (zero_variance=filter): no gradient from this group"
    if trace["advantages"][rows][trained].abs().max() > 0:  # the estimator saw other rewards (kl_in_reward, ...)
        return "yes, but the estimator's rewards differ (A != 0): it still carries a policy gradient"
    if trace["algorithm"] == "grpo" and s["beta"] > 0 and not s["kl_in_reward"]:
        kl = kl_mean(trace, rows)
        return (f"yes; A = 0, so its policy term is 0, but its KL term (beta = {s['beta']:g}, mean KL_t "
                f"{kl:.2g} here) still pulls its tokens towards the reference")
    if reconcile(trace, rows)["extra"] != 0:
        return f"yes; A = 0, so its policy term is 0; its {EXTRA_TERMS.get(trace['algorithm'], KL_TERM)[2]} still acts"
    return "yes; A = 0 and no other term in the loss: this group carries no learning signal"


def whitening(trace: dict) -> dict | None:
    """PPO's whitening of the GAE advantages, recomputed from the trace: mean and std over every trained token
    of the batch (``masked_whiten`` on the loss mask), as the step applied it; None when it was off."""
    if not trace["settings"]["whiten_advantages"]:
        return None
    m = trace["loss_mask"].bool()
    a = trace["detail"]["gae_advantages"][m].double()
    return {"mean": float(a.mean()), "std": float(a.std()) if a.numel() > 1 else 0.0, "tokens": int(m.sum())}


def _ppo_advantages(trace, rows, view, add) -> None:
    s, d = trace["settings"], trace["detail"]
    beta = float(d["kl_coef"]) if "kl_coef" in d else s["beta"]
    add("3. advantages (PPO: the critic's values and GAE, no group baseline):")
    # The reward's KL is the sampling policy's (ppo.py measures it on log pi_old), not the updated policy's.
    kl_formula = re.sub(r"logp(?!_)", "logp_old", KL_FORMULAS[s["kl_kind"]])
    add(f"   r_t = -beta x KL_t (+ the score on the last token), beta = {beta:.4g}")
    add(f"   KL_t of the policy that sampled: {kl_formula}")
    add(f"   delta_t = r_t + gamma V_(t+1) - V_t;  A_t = sum_l (gamma lam)^l delta_(t+l);  R_t = A_t + V_t")
    add("   t+1: the next token the model wrote (GAE skips a tool's result; its V_t is not used: shown -)")
    w = whitening(trace)
    add(f"   gamma = {s['gamma']}, lam = {s['lam']}; A whitened over the batch: {w is not None}")
    if w is not None:
        add(f"   A_t(train) = (A_t(GAE) - {w['mean']:.4f}) / ({w['std']:.4f} + eps): mean and std over the "
            f"batch's {w['tokens']} trained tokens, every response's, so a token with A_t(GAE) below the mean "
            f"is pushed down even in a response that scored 1")
    response = trace["response_mask"].bool()
    for i in rows:
        add(f"   response {i - rows.start}: score {float(d['score'][i]):.4f}")
        add("      t  token         m       KL_t        r_t        V_t   A_t(GAE)  A_t(train)        R_t")
        for t in range(len(trace["tokens"][i])):
            cells = [_f(float(x[i, t]), 9, 4) for x in (d["kl"], d["token_rewards"], trace["values"],
                                                       d["gae_advantages"], trace["advantages"], trace["returns"])]
            if not response[i, t]:
                cells[2] = "-".rjust(9)
            add(f"    {t:3d}  {_tok(trace['tokens'][i][t], 12)}  {_mark(trace, i, t)}  " + "  ".join(cells))


def _objective(trace, rows, view, add) -> None:
    s = trace["settings"]
    U = len(trace["updates"])
    add(f"4. objective per token ({U} update(s); shown: the first update that trained each response):")
    add(f"   rho_t = exp(log pi - log pi_old); L_clip = -min(rho A, clip(rho, 1 - {s['clip_low']}, "
        f"1 + {s['clip_high']}) A)  [PPO eq.7]")
    if s["dual_clip"] is not None:
        add(f"   dual clip: L_clip <= -{s['dual_clip']} A where A < 0   [arXiv 1912.09729]")
    if trace["algorithm"] == "ppo":
        add(f"   L_t = L_clip + {s['vf_coef']} x value loss 1/2 max((V - R)^2, (V_clip - R)^2)")
    elif trace["algorithm"] == "rft":
        add("   L_t = -log pi(token) at temperature 1 on the passed responses (A = 0: the surrogate adds 0)")
    elif trace["algorithm"] == "grpo" and s["beta"] > 0 and not s["kl_in_reward"]:
        add(f"   L_t = L_clip + beta KL_t, beta = {s['beta']}; {KL_FORMULAS[s['kl_kind']]}")
    add(f"   {AGGREGATION_WEIGHTS[s['aggregation']]}")
    add("   m: L in the loss, t a tool's result, - outside the loss; clip: the side the clip cut")
    extra, extra_name, _ = EXTRA_TERMS.get(trace["algorithm"], KL_TERM)
    for i in rows:
        if view["update"][i] < 0:
            add(f"   response {i - rows.start}: not trained (no update held it)")
            continue
        c = torch.nan_to_num(view["contribution"][i].double()).sum()
        add(f"   response {i - rows.start}: sum_t w_t L_t = {float(c):.6g}")
        add(_token_row("t", "token", "m", "A", "logp_old", "logp", "logp_ref", "ratio", "clip", extra, "w", "w L_t"))
        for t in range(len(trace["tokens"][i])):
            get = lambda name: float(view[name][i, t]) if name in view else None  # noqa: E731
            ref = float(trace["ref_logp"][i, t]) if trace["ref_logp"] is not None else None
            side = CLIP_SIDES[int(view["clip"][i, t])] if "clip" in view else ""
            ex = get(extra_name)
            add(_token_row(str(t), _tok(trace["tokens"][i][t], 10), _mark(trace, i, t),
                           _f(float(trace["advantages"][i, t]), 8), _f(get("old_logp"), 9), _f(get("logp"), 8),
                           _f(ref, 9), _f(get("ratio"), 6), side, _f(ex, 8, 4), _f(get("weight"), 8, 6),
                           _f(get("contribution"), 10, 5)))


def _token_row(*cells: str) -> str:
    """One line of the objective's token table (the header too): fixed widths, 95 columns."""
    widths = (7, 10, 1, 8, 9, 8, 9, 6, 4, 8, 8, 10)
    return " ".join(c.ljust(w) if k in (1, 2) else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))


def _loss(trace, logged, prompt: int, rows, add) -> None:
    G = trace["settings"]["group_size"]
    B = trace["response_ids"].shape[0]
    mine = torch.zeros(B, dtype=torch.bool)
    mine[rows.start: rows.stop] = True
    part, whole = reconcile(trace, mine), reconcile(trace)
    extra = EXTRA_TERMS.get(trace["algorithm"], KL_TERM)[2]
    add(f"5. the step's loss: L = (1/U) sum_updates sum_(i,t) w_t L_t, U = {whole['updates']} update(s)")
    add(f"   this prompt's {G} responses: {part['loss']:.6g} (policy {part['policy']:.6g}, {extra} {part['extra']:.6g})")
    add(f"   all {len(trace['prompts'])} prompt(s):            {whole['loss']:.6g} (policy {whole['policy']:.6g}, "
        f"{extra} {whole['extra']:.6g})")
    if logged is None:
        add("   metrics.jsonl has no row for this step: nothing to reconcile with")
        return
    add(f"   logged loss (metrics.jsonl): {logged['loss']:.6g}; traced - logged = {whole['loss'] - logged['loss']:.2g}")
    add(f"   (float32 rounding of a sum whose terms |w_t L_t| add up to {whole['abs']:.3g})")
    if logged.get("kl") is not None and whole["kl"] is not None:
        add(f"   logged kl: {logged['kl']:.6g}; traced mean KL_t over response tokens: {whole['kl']:.6g}")


# ---------------------------------------------------------------------------------------------- HTML
CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}
pre.prompt{background:#f7f7f7;padding:.5em;white-space:pre-wrap}
.responses{display:grid;gap:10px;grid-template-columns:repeat(auto-fit,minmax(220px,1fr))}
.response{border:1px solid #bbb;padding:6px;font-family:monospace;white-space:pre-wrap;line-height:1.9}
.response h3{font-family:system-ui,sans-serif;font-size:.9em;margin:0 0 4px 0}
.tok{padding:1px 0;border-radius:2px}
.clip{outline:2px solid #d08000}.highkl{text-decoration:underline wavy #7030a0}
.masked{color:#999;text-decoration:line-through}.tool{color:#666;font-style:italic;background:#e8e8ff}
.legend span{margin-right:1.2em}
"""


def _shade(x: float, scale: float) -> str:
    """Background for a token's A·ρ: green for a push up, red for a push down, by size relative to ``scale``."""
    if math.isnan(x) or scale <= 0:
        return "transparent"
    alpha = min(1.0, abs(x) / scale) * 0.6
    return f"rgba(0,160,0,{alpha:.3f})" if x > 0 else f"rgba(220,0,0,{alpha:.3f})"


def explain_html(trace: dict, logged: dict | None, run_dir: str = "RUN_DIR") -> str:
    """One self-contained page for the traced step: every prompt's group table and its responses side by side."""
    s, G, e = trace["settings"], trace["settings"]["group_size"], html.escape
    view = token_view(trace)
    pushed = trace["advantages"].double() * torch.nan_to_num(view["ratio"].double(), nan=1.0) if "ratio" in view \
        else trace["advantages"].double()
    scale = float(pushed[trace["loss_mask"].bool()].abs().max()) if trace["loss_mask"].any() else 0.0
    kl = view.get("extra/kl", trace["detail"].get("kl"))
    kl_tokens = kl[trace["loss_mask"].bool()] if kl is not None else torch.zeros(0)
    # the step's top 5%, but never below 1e-3 nats: at the first step π_θ is π_ref and every KL_t is ~0
    high_kl = max(float(torch.quantile(kl_tokens.double(), 0.95)), HIGH_KL_FLOOR) if len(kl_tokens) else float("inf")
    whole = reconcile(trace)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>cohortrl explain: step {trace['step']}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Step {trace['step']} of {e(str(run_dir))}: {e(trace['algorithm'])}</h1>",
             "<p>" + e(", ".join(f"{k} {v}" for k, v in s.items() if v is not None)) + "</p>",
             "<p class='legend'><span>shade: A&middot;&rho; (green up, red down)</span>"
             "<span class='tok clip'>clipped</span>"
             f"<span class='tok highkl'>KL_t &ge; {high_kl:.3g} (the step's 95th percentile, at least {HIGH_KL_FLOOR:g})</span>"
             "<span class='tok masked'>outside the loss</span><span class='tok tool'>a tool's result</span></p>",
             "<h2>Loss decomposition</h2>", _html_loss_table(trace, logged, whole)]
    for k, prompt in enumerate(trace["prompts"]):
        rows = range(k * G, k * G + G)
        parts.append(f"<h2>Prompt {k}</h2><pre class='prompt'>{e(prompt)}</pre>")
        parts.append(_html_group_table(trace, k, rows))
        parts.append("<div class='responses'>")
        for i in rows:
            parts.append(_html_response(trace, view, i, i - rows.start, pushed, scale, kl, high_kl))
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_loss_table(trace, logged, whole) -> str:
    G = trace["settings"]["group_size"]
    B = trace["response_ids"].shape[0]
    head = ("<table class='loss'><tr><th class='l'>rows</th><th>policy term</th><th>extra term</th>"
            "<th>loss share (1/U &Sigma; w&middot;L)</th></tr>")
    body = []
    for k in range(len(trace["prompts"])):
        rows = torch.zeros(B, dtype=torch.bool)
        rows[k * G: k * G + G] = True
        r = reconcile(trace, rows)
        body.append(f"<tr><td class='l'>prompt {k}</td><td>{r['policy']:.6g}</td><td>{r['extra']:.6g}</td>"
                    f"<td>{r['loss']:.6g}</td></tr>")
    body.append(f"<tr><th class='l'>traced step</th><th>{whole['policy']:.6g}</th><th>{whole['extra']:.6g}</th>"
                f"<th>{whole['loss']:.6g}</th></tr>")
    if logged is not None:
        body.append(f"<tr><td class='l'>logged (metrics.jsonl)</td><td>{logged.get('policy_loss') or 0:.6g}</td><td></td>"
                    f"<td>{logged['loss']:.6g}</td></tr>")
        body.append(f"<tr><td class='l'>traced &minus; logged (float32 rounding of terms whose |w&middot;L| add up to "
                    f"{whole['abs']:.3g})</td><td></td><td></td><td>{whole['loss'] - logged['loss']:.2g}</td></tr>")
    return head + "".join(body) + "</table>"


def _fmt(v) -> str:
    """A number for the page (4 significant digits), a text as it is, None as nothing."""
    return "" if v is None else v if isinstance(v, str) else f"{float(v):.4g}"


def _html_group_table(trace, k: int, rows) -> str:
    s = trace["settings"]
    names = list(trace["per_fn"])
    head = ("<table class='group'><tr><th>#</th>" + "".join(f"<th>{html.escape(_short(n))}</th>" for n in names)
            + "<th>r</th><th>r &minus; mean</th><th>A (first token)</th><th>tokens</th><th>&Sigma; w&middot;L</th></tr>")
    body = []
    mean = float(trace["group_mean"][k])
    for j, i in enumerate(rows):
        m = trace["response_mask"][i].bool()
        a0 = float(trace["advantages"][i][m][0]) if m.any() else float("nan")
        share = sum(contribution(u, torch.arange(len(trace["rewards"])) == i) for u in trace["updates"])
        share /= max(1, len(trace["updates"]))
        vals = "".join(f"<td>{_fmt(trace['per_fn'][n][i])}</td>" for n in names)
        body.append(f"<tr><td>{j}</td>{vals}<td>{float(trace['rewards'][i]):.4g}</td>"
                    f"<td>{float(trace['rewards'][i]) - mean:.4g}</td><td>{a0:.4g}</td><td>{int(m.sum())}</td>"
                    f"<td>{share:.4g}</td></tr>")
    foot = (f"</table><p>group mean {mean:.4g}, std {float(trace['group_std'][k]):.4g}; identical rewards: "
            f"{html.escape(identical_group_effect(trace, k))}; estimator {html.escape(s['estimator'])}</p>")
    return head + "".join(body) + foot


def _html_response(trace, view, i: int, j: int, pushed, scale: float, kl, high_kl: float) -> str:
    spans = []
    for t, tok in enumerate(trace["tokens"][i]):
        tool = trace["tool_mask"] is not None and bool(trace["tool_mask"][i, t])
        in_loss = bool(trace["loss_mask"][i, t])
        classes = ["tok"]
        if tool:
            classes.append("tool")
        elif not in_loss:
            classes.append("masked")
        if "clip" in view and int(view["clip"][i, t]):
            classes.append("clip")
        if kl is not None and in_loss and float(kl[i, t]) >= high_kl:
            classes.append("highkl")
        numbers = {"A": trace["advantages"][i, t], **{n: view[n][i, t] for n in ("ratio", "logp", "old_logp", "weight",
                                                                                 "contribution", "extra/kl") if n in view}}
        if "clip" in view and int(view["clip"][i, t]):
            numbers["clip"] = CLIP_SIDES[int(view["clip"][i, t])]
        title = "; ".join(f"{n} {_fmt(v)}" for n, v in numbers.items())
        bg = _shade(float(pushed[i, t]), scale) if in_loss else "transparent"
        spans.append(f"<span class='{' '.join(classes)}' style='background:{bg}' title='{html.escape(title)}'>"
                     f"{html.escape(tok)}</span>")
    head = (f"<h3>response {j}: r = {float(trace['rewards'][i]):.4g}"
            f"{' (hit the budget)' if trace['truncated'][i] else ''}</h3>")
    return f"<div class='response'>{head}{''.join(spans)}</div>"


def explain(run_dir: str | Path, step: int, prompt: int = 0, html_path: str | Path | None = None) -> str:
    """The terminal walk-through of ``run_dir``'s traced step ``step``; with ``html_path``, also that page."""
    trace = load_trace(run_dir, step)
    logged = logged_row(run_dir, step)
    if html_path is not None:
        Path(html_path).write_text(explain_html(trace, logged, str(run_dir)))
    return explain_text(trace, logged, prompt, str(run_dir))
