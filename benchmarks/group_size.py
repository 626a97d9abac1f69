"""Group-size study (issue #10): for G in {2, 4, 8, 16}, what a GRPO step costs and what its gradient is worth.

Three measurements on one pool of samples from the policy (SmolLM2-135M-Instruct with a fresh LoRA adapter, as
a run's first step sees it), on the gym's arithmetic level 1, at the training temperature:

1. **Zero-variance groups.** With a binary reward and per-prompt success rate p, a group of G responses is all
   right or all wrong (no policy gradient, only the KL term acts) with probability p^G + (1 − p)^G
   (ALGORITHMS.md, "Group size and zero-variance groups"). Each prompt's p̂ comes from its ``--samples``
   responses; the observed fraction counts disjoint groups of G cut from the same responses.
2. **Gradient variance.** Each sampled response i gets its gradient h_i = ∇_θ (1/|o_i|) Σ_t log π_θ(o_i,t)
   over the LoRA parameters (dropout off). At the first step of on-policy GRPO the ratio is 1, no clipping
   binds and the k3 KL term has zero gradient (π_θ = π_ref), so a step's gradient is exactly
   g = (1/(P·G)) Σ_i A_i h_i with A_i the group-normalised advantage (seq-mean-token-mean aggregation). A
   draw picks P prompts from the pool and G of each prompt's responses, both with replacement: the pool
   stands for the task's prompts and the policy's responses, so a draw's prompt-sampling variance scales as 1/P
   at every P (drawing all K pool prompts without replacement would have none). Over ``--draws`` draws per setting:
   tr Cov(g) (the summed variance of the gradient's coordinates), ‖E g‖², their ratio (signal-to-noise: how
   many steps' noise equals one step's signal) and the cosine of each g to the pool's full gradient g* (all S
   responses of all K prompts, A from each prompt's S). Everything is computed from the Gram matrix
   H Hᵀ of the per-response gradients: g·g' = wᵀ (H Hᵀ) w'.
3. **Rollout latency** of one step's generation (P prompts x G responses, each prompt prefilled once for its
   group), the median of ``--repeats`` timings of each distinct (P, G).

Two regimes for 2 and 3: equal total responses (P·G = ``--responses``, P = responses / G) and equal prompts per
step (P = ``--prompts-per-step``, P·G grows with G).

    PYTHONPATH=. .venv/bin/python benchmarks/group_size.py --out docs/group_size_smollm2

Writes OUT.md (tables, machine, command) and OUT.png. What it does not measure: later steps (the pool is the
initial policy's), other tasks or rewards, and GPU latency (on a GPU, decoding a batch is nearly flat in its
size until compute-bound, so the latency ratios here, where a 2-core CPU is compute-bound from the start,
overstate what a larger G costs there).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from cohortrl.algorithms import group_advantages


def all_same_probability(p: float, group_size: int) -> float:
    """P(all G equal) for Bernoulli(p) rewards: p^G + (1 − p)^G."""
    return p**group_size + (1 - p) ** group_size


def predicted_zero_variance(success_rates: list[float], group_size: int) -> float:
    """Expected fraction of zero-variance groups over prompts with the given success rates."""
    return sum(all_same_probability(p, group_size) for p in success_rates) / len(success_rates)


def observed_zero_variance(correct_by_prompt: list[list[float]], group_size: int) -> float | None:
    """Fraction of disjoint groups of ``group_size`` (within each prompt's samples) whose rewards are all equal."""
    groups = [c[i:i + group_size] for c in correct_by_prompt for i in range(0, len(c) - group_size + 1, group_size)]
    return sum(len(set(g)) == 1 for g in groups) / len(groups) if groups else None


# ---------------------------------------------------------------------------------------------- gradient draws
def draw_weights(correct_KS: torch.Tensor, prompts: int, group_size: int, draws: int, generator: torch.Generator,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w (draws, K·S) such that one draw's GRPO gradient is g = Σ_i w_i h_i, and each draw's fraction of
    zero-variance groups (draws,).

    ``correct_KS`` (K, S): the pool's rewards, S responses for each of K prompts (response k·S + s has
    gradient h_{k·S+s}). A draw takes ``prompts`` prompts and ``group_size`` responses of each, both with
    replacement (a prompt drawn twice is two groups); w_i = A_i / (P·G) summed over the times response i was drawn, A from ``group_advantages``
    (the trainer's GRPO estimator: group mean and std)."""
    K, S = correct_KS.shape
    if prompts > K:
        raise ValueError(f"{prompts} prompts per draw but the pool has {K}; sample a larger pool (--pool-prompts)")
    chosen_RP = torch.randint(K, (draws, prompts), generator=generator)
    picks_RPG = torch.randint(S, (draws, prompts, group_size), generator=generator)
    rewards = correct_KS[chosen_RP.unsqueeze(-1), picks_RPG]  # (R, P, G)
    adv = group_advantages(rewards.reshape(-1).double(), group_size, "group", eps).view(draws, prompts, group_size)
    index = (chosen_RP.unsqueeze(-1) * S + picks_RPG).reshape(draws, -1)
    w = torch.zeros(draws, K * S, dtype=torch.float64)
    w.scatter_add_(1, index, adv.reshape(draws, -1) / (prompts * group_size))
    constant = (rewards == rewards[..., :1]).all(-1)  # (R, P)
    return w, constant.double().mean(-1)


def pool_weights(correct_KS: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """w* for the pool's full gradient g*: every response once, A from all S responses of its prompt."""
    K, S = correct_KS.shape
    return group_advantages(correct_KS.reshape(-1).double(), S, "group", eps) / (K * S)


def gradient_stats(w_RM: torch.Tensor, gram_MM: torch.Tensor, w_ref: torch.Tensor) -> dict:
    """From draw weights and the Gram matrix of the per-response gradients: tr Cov(g) and ‖E g‖² over the
    draws, their ratio (SNR), and the mean cosine of g to g* = Σ w_ref,i h_i (0 for a draw with g = 0)."""
    mean = w_RM.mean(0)
    centred = w_RM - mean
    trace_cov = ((centred @ gram_MM) * centred).sum(-1).mean().item() * len(w_RM) / max(1, len(w_RM) - 1)
    mean_sq = (mean @ gram_MM @ mean).item()
    norms_sq = ((w_RM @ gram_MM) * w_RM).sum(-1)
    ref_sq = (w_ref @ gram_MM @ w_ref).item()
    dots = w_RM @ gram_MM @ w_ref
    ok = norms_sq > 0
    cos = torch.where(ok, dots / (norms_sq.clamp_min(1e-300) * ref_sq).sqrt(), torch.zeros_like(dots))
    return {"trace_cov": trace_cov, "mean_sq": mean_sq, "snr": mean_sq / trace_cov if trace_cov > 0 else float("inf"),
            "cos_ref": cos.mean().item(), "ref_sq": ref_sq, "zero_grad_frac": (~ok).double().mean().item()}


# ---------------------------------------------------------------------------------------------- the model part
def build(args):
    from cohortrl.config import Config
    from cohortrl.data import load_rows
    from cohortrl.trainers.setup import build_policy

    cfg = Config.from_dict({
        "model": {"name": args.model, "lora": {"enabled": True, "r": 16, "alpha": 32}, "system_prompt": "Be brief."},
        "data": {"source": "task:arithmetic", "level": args.level, "train_size": max(args.pool_prompts, 10), "eval_size": 0},
        "reward": {"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}], "correctness": "accuracy"},
    })
    torch.manual_seed(0)
    model, tokenizer = build_policy(cfg.model, seed=0)
    model.eval()  # no LoRA dropout: the only randomness is the sampled responses
    rows, _ = load_rows(cfg.data, seed=0)
    return model, tokenizer, rows[: args.pool_prompts]


def sample_pool(model, tokenizer, rows, args):
    """S responses per prompt, their 0/1 correctness (K, S) and per-response gradients H (K·S, D)."""
    from cohortrl.rewards.scoring import WeightedReward, resolve
    from cohortrl.rollout.hf import Sampling, generate, response_logprobs
    from cohortrl.rewards.scoring import score_rollout

    torch.manual_seed(1)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.tokens)
    rollout, _ = generate(model, tokenizer, rows, args.samples, sampling, system_prompt="Be brief.")
    accuracy = WeightedReward("accuracy", resolve("accuracy", {"mode": "last_number"}))
    _, per_fn = score_rollout([accuracy], rollout, args.tokens)
    correct = torch.tensor([float(v or 0.0) for v in per_fn["accuracy"]]).view(len(rows), args.samples)

    # A fresh adapter has B = 0, so the gradient of every A matrix is exactly 0 (dL/dA = B^T (dL/dy) x^T): only
    # the B matrices carry the step's gradient. Keeping only them halves H (K·S x 2.5M floats for SmolLM2 with
    # every linear layer adapted) without changing any inner product; the first response checks the claim.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in named if "lora_A" not in n]
    zero_grad = [p for n, p in named if "lora_A" in n]
    ids, attn, mask = rollout.input_ids(), rollout.attention_mask(), rollout.response_mask
    n_params = sum(p.numel() for p in params)
    H = torch.empty(rollout.batch_size, n_params)
    t0 = time.perf_counter()
    for i in range(rollout.batch_size):
        logp, _ = response_logprobs(model, ids[i:i + 1], attn[i:i + 1], rollout.response_ids[i:i + 1],
                                    temperature=args.temperature)
        objective = (logp * mask[i:i + 1]).sum() / mask[i].sum().clamp_min(1)  # (1/|o|) Σ_t log π
        grads = torch.autograd.grad(objective, params + (zero_grad if i == 0 else []), allow_unused=True)
        if i == 0 and any(g is not None and g.abs().max() > 0 for g in grads[len(params):]):
            raise RuntimeError("a LoRA A matrix has a nonzero gradient: the adapter is not freshly initialised")
        H[i] = torch.cat([g.reshape(-1) for g in grads[:len(params)]])
    return rollout, correct, H, n_params, time.perf_counter() - t0


def time_generation(model, tokenizer, rows, prompts: int, group_size: int, args, repeats: int) -> float:
    from cohortrl.rollout.hf import Sampling, generate

    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.tokens)
    times = []
    for r in range(repeats):
        torch.manual_seed(100 + r)
        t0 = time.perf_counter()
        generate(model, tokenizer, rows[:prompts], group_size, sampling, system_prompt="Be brief.")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- report
def settings(args) -> list[tuple[str, int, int]]:
    out = [("equal P·G", args.responses // g, g) for g in args.groups]
    out += [("equal P", args.prompts_per_step, g) for g in args.groups]
    return out


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.3f}" if y > 0 else "-"  # a pool where every prompt's responses agree has no gradient at all


def plot(path: Path, groups, zero_rows, grad_rows, latency, rates, correct_lists):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    ax = axes[0]
    ps = torch.linspace(0, 1, 101)
    for i, g in enumerate(groups):
        ax.plot(ps, [all_same_probability(float(p), g) for p in ps], color=f"C{i}", label=f"G={g}: p^G+(1-p)^G")
        per_prompt = [(p, observed_zero_variance([c], g)) for p, c in zip(rates, correct_lists)]
        ax.scatter([p for p, o in per_prompt if o is not None], [o for p, o in per_prompt if o is not None],
                   color=f"C{i}", s=12, alpha=0.6)
    ax.set(xlabel="prompt success rate p (from its samples)", ylabel="zero-variance fraction",
           title="zero-variance groups vs p (dots: observed per prompt)")
    ax.legend(fontsize=7)
    for ax, key, title in ((axes[1], "snr", "gradient SNR  ‖E g‖² / tr Cov g"),
                           (axes[2], "cos_ref", "mean cos(g, pool gradient g*)")):
        for regime, style in (("equal P·G", "o-"), ("equal P", "s--")):
            pts = [(r["G"], r[key]) for r in grad_rows if r["regime"] == regime]
            ax.plot(*zip(*pts), style, label=regime)
        ax.set(xscale="log", xlabel="G", title=title)
        ax.minorticks_off()
        ax.set_xticks(groups, [str(g) for g in groups])
        ax.legend(fontsize=8)
    ax = axes[3]
    for regime, style in (("equal P·G", "o-"), ("equal P", "s--")):
        pts = [(g, latency[(regime, g)]) for g in groups]
        ax.plot(*zip(*pts), style, label=regime)
    ax.set(xscale="log", xlabel="G", ylabel="s", title="generation time per step (this CPU)")
    ax.minorticks_off()
    ax.set_xticks(groups, [str(g) for g in groups])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def measure(args) -> dict:
    """Everything that needs the model: the pool's rewards, the Gram matrix of its per-response gradients and
    the generation timings. With ``--cache`` they are saved there, and read back instead of measured again
    when the file exists (to re-analyse or re-plot without 10 minutes of CPU)."""
    if args.cache and Path(args.cache).is_file():
        return torch.load(args.cache)
    model, tokenizer, rows = build(args)
    rollout, correct, H, n_params, grad_s = sample_pool(model, tokenizer, rows, args)
    gram = (H @ H.T).double()  # (K·S, K·S): every statistic needs only these inner products
    del H
    time_generation(model, tokenizer, rows, 1, 2, args, repeats=1)  # warm-up
    latency = {}
    for _, P, g in settings(args):
        if (P, g) not in latency:  # the regimes share (P, G) = (prompts-per-step, responses / prompts-per-step)
            latency[(P, g)] = time_generation(model, tokenizer, rows, P, g, args, args.repeats)
    measured = {"correct": correct, "gram": gram, "mean_length": rollout.lengths.float().mean().item(),
                "n_params": n_params, "grad_s": grad_s, "latency": latency}
    if args.cache:
        torch.save(measured, args.cache)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--level", type=int, default=1, help="arithmetic task difficulty")
    parser.add_argument("--pool-prompts", type=int, default=16, help="K: prompts in the pool")
    parser.add_argument("--samples", type=int, default=16, help="S: responses per pool prompt (a multiple of every G)")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--responses", type=int, default=32, help="P·G in the equal-responses regime")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="P in the equal-prompts regime")
    parser.add_argument("--draws", type=int, default=4000, help="draws per setting for the gradient statistics")
    parser.add_argument("--repeats", type=int, default=3, help="timings per latency setting (median)")
    parser.add_argument("--cache", help="save what needs the model here (a .pt file), or read it if it exists")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", help="write OUT.md and OUT.png (default: print the tables only)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    measured = measure(args)
    correct, gram = measured["correct"], measured["gram"]
    rates = correct.mean(-1).tolist()
    correct_lists = correct.tolist()
    w_ref = pool_weights(correct)

    lines = [f"# Group-size study: {args.model}, arithmetic level {args.level}", ""]
    lines.append(f"Pool: K = {args.pool_prompts} prompts x S = {args.samples} responses at temperature "
                 f"{args.temperature}, up to {args.tokens} tokens; mean success rate {correct.mean():.3f}; "
                 f"mean response length {measured['mean_length']:.1f} tokens; per-prompt p̂: "
                 + ", ".join(f"{p:.2f}" for p in rates) + ".")
    lines.append(f"Per-response gradients over the {measured['n_params']:,} LoRA B parameters (the A matrices' "
                 f"gradients are exactly 0 at a fresh adapter): {measured['grad_s']:.0f} s for {len(gram)} responses.")
    lines += ["", "## Zero-variance groups", "",
              "| G | predicted mean p̂^G + (1 − p̂)^G | observed (disjoint groups of G) | groups observed |", "|---:|---:|---:|---:|"]
    zero_rows = []
    for g in args.groups:
        obs = observed_zero_variance(correct_lists, g)
        n = sum(len(c) // g for c in correct_lists)
        zero_rows.append((g, predicted_zero_variance(rates, g), obs))
        lines.append(f"| {g} | {zero_rows[-1][1]:.3f} | {'-' if obs is None else f'{obs:.3f}'} | {n} |")

    gen = torch.Generator().manual_seed(0)
    grad_rows = []
    for regime, P, g in settings(args):
        w, zero_frac = draw_weights(correct, P, g, args.draws, gen)
        stats = gradient_stats(w, gram, w_ref)
        grad_rows.append({"regime": regime, "P": P, "G": g, "zero_groups": zero_frac.mean().item(), **stats})
    lines += ["", f"## Gradient of the first GRPO step ({args.draws} draws per row)", "",
              "| regime | P | G | P·G | zero-variance groups | zero gradient | tr Cov g / ‖g*‖² | ‖E g‖² / ‖g*‖² | SNR ‖E g‖² / tr Cov | mean cos(g, g*) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in grad_rows:
        lines.append(f"| {r['regime']} | {r['P']} | {r['G']} | {r['P'] * r['G']} | {r['zero_groups']:.3f} | "
                     f"{r['zero_grad_frac']:.3f} | {_ratio(r['trace_cov'], r['ref_sq'])} | {_ratio(r['mean_sq'], r['ref_sq'])} | "
                     f"{r['snr']:.3f} | {r['cos_ref']:.3f} |")

    latency = {(regime, g): measured["latency"][(P, g)] for regime, P, g in settings(args)}
    lines += ["", f"## Generation time per step (median of {args.repeats}, this machine)", "",
              "| regime | P | G | P·G | seconds | responses / s |", "|---|---:|---:|---:|---:|---:|"]
    for regime, P, g in settings(args):
        t = latency[(regime, g)]
        lines.append(f"| {regime} | {P} | {g} | {P * g} | {t:.2f} | {P * g / t:.2f} |")

    lines += ["", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} torch threads; torch {torch.__version__}, Python {platform.python_version()}.",
              "", "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/group_size.py " + " ".join(sys.argv[1:]) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(out.with_suffix(".png"), args.groups, zero_rows, grad_rows, latency, rates, correct_lists)
        out.with_suffix(".md").write_text(text.replace("\n## Zero", f"\n![plots]({out.name}.png)\n\n## Zero", 1))


if __name__ == "__main__":
    main()
