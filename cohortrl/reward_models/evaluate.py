"""Judging reward models: step accuracy and AUROC on held-out labels, and best-of-N reranking on the gym.

AUROC is written out (no scikit-learn dependency for one formula): the Mann–Whitney U statistic over the
ranks of the scores, U / (n_pos · n_neg) (Hanley & McNeil 1982, Radiology 143:29), ties taking mid-ranks.
"""

from __future__ import annotations

import math
import random
from collections import Counter

from cohortrl.reward_models.labels import PairExample, PointExample, StepExample
from cohortrl.stats import wilson_interval


def auroc(scores: list[float], labels: list[float]) -> float:
    """P(score of a random positive > score of a random negative), ties counting ½.

    AUROC = (R_pos − n_pos(n_pos + 1)/2) / (n_pos · n_neg), R_pos the sum of the positives' (mid-)ranks.
    Labels are thresholded at 0.5. NaN when either class is empty.
    """
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores but {len(labels)} labels")
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # tied scores share the mean of the ranks they span
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    positive = [y >= 0.5 for y in labels]
    n_pos = sum(positive)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum = sum(r for r, p in zip(ranks, positive) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def auroc_interval(a: float, n_pos: int, n_neg: int, z: float = 1.96) -> tuple[float, float]:
    """Approximate 95% interval for an AUROC of ``a`` from n_pos positives and n_neg negatives: a ± z·SE with
    Hanley & McNeil's (1982) SE² = [A(1 − A) + (n_pos − 1)(Q1 − A²) + (n_neg − 1)(Q2 − A²)] / (n_pos·n_neg),
    Q1 = A / (2 − A), Q2 = 2A² / (1 + A); clipped to [0, 1]. It tells "beats chance" (the interval excludes
    0.5) from noise on a few hundred held-out labels; the formula assumes smooth score distributions."""
    if n_pos == 0 or n_neg == 0 or math.isnan(a):
        return (float("nan"), float("nan"))
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = math.sqrt(max(0.0, a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg))
    return (max(0.0, a - z * se), min(1.0, a + z * se))


def _auroc_with_interval(scores: list[float], labels: list[float]) -> dict:
    a = auroc(scores, labels)
    n_pos = sum(y >= 0.5 for y in labels)
    return {"auroc": a, "auroc_ci95": auroc_interval(a, n_pos, len(labels) - n_pos)}


def accuracy_at_half(probs: list[float], labels: list[float]) -> float:
    """Fraction of predictions on the right side of 0.5."""
    return sum((p >= 0.5) == (y >= 0.5) for p, y in zip(probs, labels)) / len(labels)


def evaluate_prm(model, tokenizer, examples: list[StepExample], max_length: int = 512) -> dict:
    """Held-out step accuracy, AUROC and the base rate (accuracy of always guessing the majority label)."""
    from cohortrl.reward_models.scoring import prm_step_scores

    probs, labels = [], []
    for e in examples:
        for p, y in zip(prm_step_scores(model, tokenizer, e.prompt, e.steps, max_length), e.labels):
            if not math.isnan(p):
                probs.append(p)
                labels.append(y)
    majority = sum(y >= 0.5 for y in labels) / len(labels)
    return {"n_steps": len(labels), "step_accuracy": accuracy_at_half(probs, labels), **_auroc_with_interval(probs, labels),
            "majority_baseline": max(majority, 1 - majority)}


def evaluate_orm(model, tokenizer, examples: list[PointExample], max_length: int = 512) -> dict:
    """Held-out accuracy of σ(score) ≥ 0.5 and AUROC of the scores against outcome labels."""
    from cohortrl.reward_models.scoring import orm_scores

    scores = orm_scores(model, tokenizer, [e.prompt for e in examples], [e.completion for e in examples],
                        max_length=max_length)
    labels = [e.label for e in examples]
    majority = sum(y >= 0.5 for y in labels) / len(labels)
    return {"n": len(labels), "accuracy": accuracy_at_half([1 / (1 + math.exp(-s)) for s in scores], labels),
            **_auroc_with_interval(scores, labels), "majority_baseline": max(majority, 1 - majority)}


def evaluate_pairs(model, tokenizer, examples: list[PairExample], max_length: int = 512) -> dict:
    """Held-out preference accuracy: how often the ORM scores the chosen response above the rejected one."""
    from cohortrl.reward_models.scoring import orm_scores

    prompts = [e.prompt for e in examples]
    chosen = orm_scores(model, tokenizer, prompts, [e.chosen for e in examples], max_length=max_length)
    rejected = orm_scores(model, tokenizer, prompts, [e.rejected for e in examples], max_length=max_length)
    wins = sum(c > r for c, r in zip(chosen, rejected))
    return {"n_pairs": len(examples), "pair_accuracy": wins / len(examples),
            "pair_accuracy_ci95": wilson_interval(wins, len(examples))}  # chance is 0.5


# ---------------------------------------------------------------------------------------------------- best of N
def majority_vote(answers: list[str | None], rng: random.Random) -> int:
    """Index of a candidate whose answer is the most common (ties broken at random; None never wins
    unless every candidate has none)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return rng.randrange(len(answers))
    top = max(counts.values())
    return rng.choice([i for i, a in enumerate(answers) if a is not None and counts[a] == top])


def argmax_random_ties(values: list[float], rng: random.Random) -> int:
    best = max(values)
    return rng.choice([i for i, v in enumerate(values) if v == best])


def best_of_n(family_name: str, n_problems: int, n_candidates: int, *, level: int = 3, seed: int = 0,
              prm=None, orm=None, max_length: int = 512, p_intact: float = 0.25) -> dict:
    """Accuracy of picking one of ``n_candidates`` gym perturbations per problem by: PRM min and product of
    step scores, ORM score, majority vote on the final answer, a random pick, and an oracle (any correct).

    ``prm`` / ``orm`` are ``(model, tokenizer)`` pairs or None (method skipped).
    """
    from cohortrl import tasks
    from cohortrl.grading.answers import extract_answer
    from cohortrl.reward_models.labels import gym_candidates
    from cohortrl.reward_models.scoring import orm_scores, prm_step_scores

    family = tasks.get(family_name)
    rng = random.Random(f"best-of-n/{family_name}/{seed}/{level}")
    picks: dict[str, list[float]] = {m: [] for m in ("random", "majority", "oracle")}
    if prm is not None:
        picks["prm_min"], picks["prm_product"] = [], []
    if orm is not None:
        picks["orm"] = []
    for sample in family.sample(n_problems, seed=seed, level=level):
        candidates = gym_candidates(family, sample, n_candidates, rng, p_intact)
        outcomes = [family.grade(sample, c).outcome for c in candidates]
        picks["random"].append(outcomes[rng.randrange(n_candidates)])
        picks["oracle"].append(max(outcomes))
        picks["majority"].append(outcomes[majority_vote([extract_answer(c) for c in candidates], rng)])
        if prm is not None:
            steps = [[line for line in c.split("\n") if line.strip()] for c in candidates]
            scores = [prm_step_scores(*prm, sample.prompt, s, max_length) for s in steps]
            picks["prm_min"].append(outcomes[argmax_random_ties([min(s) for s in scores], rng)])
            picks["prm_product"].append(outcomes[argmax_random_ties([math.prod(s) for s in scores], rng)])
        if orm is not None:
            values = orm_scores(*orm, [sample.prompt] * n_candidates, candidates, max_length=max_length)
            picks["orm"].append(outcomes[argmax_random_ties(values, rng)])
    return {m: sum(v) / len(v) for m, v in picks.items()}
