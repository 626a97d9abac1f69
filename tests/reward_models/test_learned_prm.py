"""A learned PRM as a step source (``learned_prm``): its scores are `prm_step_scores` on the steps
`split_steps` finds, each with its step's span; batched scoring matches one-at-a-time; process GRPO runs
on it end to end; the gym's step grader can skip its commitment gate."""

import math

import pytest

from cohortrl import tasks
from cohortrl.reward_models.labels import gym_step_examples
from cohortrl.reward_models.scoring import load_prm, prm_step_logits, prm_step_scores
from cohortrl.reward_models.train import build_reward_model, train_on
from cohortrl.rewards.process import make_task_steps, resolve_process
from cohortrl.step_spans import split_steps
from cohortrl.trainers.grpo import GRPOTrainer
from tests.trainers.test_grpo import tiny_config


@pytest.fixture(scope="module")
def tiny_prm(tmp_path_factory):
    """A tiny-llama PRM trained a few steps on gym step labels (arithmetic level 2), saved as train-rm does."""
    out = tmp_path_factory.mktemp("prm")
    model, tok = build_reward_model("tiny-llama", "prm", seed=0)
    train_on(model, tok, gym_step_examples("arithmetic", 16, seed=0, level=2), steps=4, batch_size=4, lr=1e-3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


COMPLETIONS = [
    "s1 = 2 + 8 = 10\ns2 = 10 - 6 = 4\nANSWER: 4",
    "  First I add.\n\ns1 = 10\n",  # leading blanks and an empty line: spans are trimmed, blanks skipped
    "",  # no steps at all
    "s1 = 10; s2 = 4; ANSWER: 4",
]


def test_learned_prm_scores_are_prm_step_scores_on_split_steps(tiny_prm):
    prm, tok = load_prm(tiny_prm)
    prompts = ["Compute 2 + 8 - 6."] * len(COMPLETIONS)
    fn = resolve_process("learned_prm", {"model": str(tiny_prm), "batch_size": 3})
    out = fn(prompts, COMPLETIONS)
    assert [len(x) for x in out] == [3, 2, 0, 1]
    for completion, steps in zip(COMPLETIONS, out):
        spans = [span for _, span in steps]
        assert spans == split_steps(completion)
        texts = [completion[a:b] for a, b in spans]
        expected = prm_step_scores(prm, tok, "Compute 2 + 8 - 6.", texts) if texts else []
        assert [s for s, _ in steps] == pytest.approx(expected, abs=1e-5)
    assert [COMPLETIONS[1][a:b] for a, b in split_steps(COMPLETIONS[1])] == ["First I add.", "s1 = 10"]

    # Steps by regex instead of lines: "s1 = 10;", "s2 = 4;", "ANSWER: 4".
    by_regex = resolve_process("learned_prm", {"model": str(tiny_prm), "regex": ";"})(prompts[:1], COMPLETIONS[3:])[0]
    assert [COMPLETIONS[3][a:b] for _, (a, b) in by_regex] == ["s1 = 10;", "s2 = 4;", "ANSWER: 4"]

    # score: logit gives the raw logit; threshold a 0/1 verdict on σ(logit).
    logits = resolve_process("learned_prm", {"model": str(tiny_prm), "score": "logit"})(prompts[:1], COMPLETIONS[:1])[0]
    probs = [s for s, _ in out[0]]
    assert [1 / (1 + math.exp(-x)) for x, _ in logits] == pytest.approx(probs, abs=1e-6)
    cut = sorted(probs)[1]  # the middle score: one step below, two at or above
    hard = resolve_process("learned_prm", {"model": str(tiny_prm), "threshold": cut})(prompts[:1], COMPLETIONS[:1])[0]
    assert [s for s, _ in hard] == [float(p >= cut) for p in probs]
    with pytest.raises(ValueError, match="score must be 'prob' or 'logit'"):
        resolve_process("learned_prm", {"model": str(tiny_prm), "score": "odds"})


def test_batched_prm_logits_equal_one_at_a_time_and_mark_cut_steps(tiny_prm):
    prm, tok = load_prm(tiny_prm)
    steps = [["s1 = 2 + 8 = 10", "s2 = 10 - 6 = 4"], ["ANSWER: 4"], [], ["a", "b", "c", "d"]]
    prompts = ["Compute 2 + 8 - 6."] * len(steps)
    batched = prm_step_logits(prm, tok, prompts, steps, batch_size=4)
    for p, s, got in zip(prompts, steps, batched):
        assert got == pytest.approx(prm_step_logits(prm, tok, [p], [s])[0], abs=1e-5)
    cut = prm_step_logits(prm, tok, prompts[:1], steps[:1], max_length=20)[0]
    assert math.isnan(cut[1])  # the second step does not fit in 20 tokens: unjudged
    # The step source gives such a step 0 (unseen steps earn nothing).
    fn = resolve_process("learned_prm", {"model": str(tiny_prm), "max_length": 20})
    assert fn(prompts[:1], ["\n".join(steps[0])])[0][1][0] == 0.0


def test_task_steps_without_the_commitment_gate_reads_stated_steps():
    family = tasks.get("arithmetic")
    sample = family.sample(1, seed=0, level=2)[0]  # s1 = 2 + 8 = 10, s2 = 10 - 6 = 4
    unanswered = "s1 = 2 + 8 = 10\ns2 = 10 - 6 = 5"  # s1 right, s2 wrong, no ANSWER line
    rows = [sample.to_dict()]
    gated = make_task_steps()([sample.prompt], [unanswered], sample=rows)[0]
    stated = make_task_steps(require_commit=False)([sample.prompt], [unanswered], sample=rows)[0]
    assert [s for s, _ in gated] == [0.0, 0.0]
    assert [s for s, _ in stated] == [1.0, 0.0]
    assert [unanswered[a:b] for _, (a, b) in stated] == ["s1 = 2 + 8 = 10", "s2 = 10 - 6 = 5"]
    honest = sample.reference_solution  # committed: both gates agree
    assert make_task_steps()([sample.prompt], [honest], sample=rows) == make_task_steps(False)([sample.prompt], [honest], sample=rows)


def test_process_grpo_trains_on_a_learned_prm(tmp_path, tiny_prm):
    cfg = tiny_config(
        tmp_path / "unused.jsonl",
        data={"source": "task:arithmetic", "level": 2, "train_size": 50, "eval_size": 8},
        reward={"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}], "correctness": "accuracy",
                "process": {"name": "learned_prm", "kwargs": {"model": str(tiny_prm)}, "credit": "min",
                            "require_answer": False}},
        algorithm={"estimator": "grpo_process"},
        sampling={"max_new_tokens": 12},
    )
    trainer = GRPOTrainer(cfg, tmp_path / "run")
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["steps_per_response"] > 0
        assert 0 < r["step_reward_mean"] < 1  # PRM probabilities, ungated (require_answer off)
        assert math.isfinite(r["loss"]) and r["advantage_abs_mean"] > 0
