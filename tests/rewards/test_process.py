"""Process rewards: the guards cap, bound, de-duplicate and gate step rewards; planted hacks (padding repeated
steps, restating givens, stopping without an answer) earn no more than the honest solution under the gym's
step grader or a naive per-line PRM once guarded, and the detectors flag them; the trainer runs process GRPO
(sum and min credit, combined with the outcome) and PPO with step rewards."""

import dataclasses
import pytest
import torch

from cohortrl import tasks
from cohortrl.algorithms import process_advantages
from cohortrl.rewards.process import guard_steps, make_task_steps, step_detectors
from cohortrl.step_spans import split_steps
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.ppo import PPOTrainer
from tests.trainers.test_grpo import tiny_config


def test_guards_cap_bound_deduplicate_and_require_an_answer():
    text = "a = 1\na = 1\nb = 2\nc = 3\nANSWER: 3"
    spans = split_steps(text)
    steps = [(5.0, spans[0]), (1.0, spans[1]), (1.0, spans[2]), (1.0, spans[3]), (0.5, None)]
    guarded = guard_steps(text, steps, cap=1.0, max_steps=4, require_answer=True)
    assert [s for s, _ in guarded] == [1.0, 0.0, 1.0, 1.0, 0.0]  # capped, repeat zeroed, fifth step unpaid
    no_answer = text.rsplit("\n", 1)[0]
    assert [s for s, _ in guard_steps(no_answer, steps[:4], cap=1.0, max_steps=4, require_answer=True)] == [0.0] * 4
    negative = [(-1.0, spans[0])]
    assert guard_steps(no_answer, negative, cap=1.0, max_steps=4, require_answer=True)[0][0] == -1.0  # only positives gated
    # an ANSWER line in a tool's result is not the model's commitment (#50)
    in_a_result = no_answer + "\n<call>echo: x</call><result>\nANSWER: 3</result>"
    assert [s for s, _ in guard_steps(in_a_result, steps[:4], cap=1.0, max_steps=4, require_answer=True)] == [0.0] * 4


def naive_line_prm(completion: str):
    """A learned-PRM stand-in that likes any line with an '=' in it: the kind of step reward padding farms."""
    return [(1.0 if "=" in completion[a:b] else 0.0, (a, b)) for a, b in split_steps(completion)]


def first_token_advantages(completions, step_lists, credit):
    """A_{i,0} for a group of responses whose steps end on tokens 0, 1, 2, ... in order (the order is all
    that matters to the credit rule)."""
    rewards = [[score for score, _ in steps] for steps in step_lists]
    ends = [list(range(len(r))) for r in rewards]
    T = max(len(r) for r in rewards)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rewards])
    return process_advantages(rewards, ends, mask, group_size=len(rewards), eps=0.0, credit=credit)[:, 0].tolist()


def test_planted_hacks_earn_no_more_than_the_honest_solution_and_are_flagged():
    family = tasks.get("arithmetic")
    sample = family.sample(1, seed=3, level=3)[0]
    honest = sample.reference_solution
    step_lines = honest.splitlines()[:-1]
    padded = "\n".join(step_lines + step_lines * 4 + [honest.splitlines()[-1]])  # every correct step repeated
    givens = "\n".join([f"x{i} = {i}" for i in range(6)] + [honest])  # distinct filler 'facts' first
    unanswered = "\n".join(step_lines)  # the steps, no ANSWER line
    grader = make_task_steps()
    rows = [sample.to_dict()]

    def task_steps(c):
        return guard_steps(c, grader([sample.prompt], [c], sample=rows)[0], cap=1.0, max_steps=8, require_answer=True)

    # The gym's step grader pays each required step once: no hack earns more than the honest solution.
    honest_task = sum(s for s, _ in task_steps(honest))
    assert honest_task == len(sample.steps)
    for hack in (padded, givens, unanswered):
        assert sum(s for s, _ in task_steps(hack)) <= honest_task
    assert sum(s for s, _ in task_steps(unanswered)) == 0

    # A naive PRM that likes every line with '=': unguarded, padding pays several times over; the guards
    # (repeats earn nothing) bring repeated steps back to the honest total.
    def naive(c):
        return guard_steps(c, naive_line_prm(c), cap=1.0, max_steps=8, require_answer=True)

    assert sum(s for s, _ in naive_line_prm(padded)) > 2 * sum(s for s, _ in naive_line_prm(honest))
    assert sum(s for s, _ in naive(padded)) <= sum(s for s, _ in naive(honest))
    assert sum(s for s, _ in naive(unanswered)) == 0
    # Distinct filler lines are not repeats: under sum credit they do raise the advantage (bounded only by
    # max_steps); min-form credit (PURE) is what stops them: the worst step ahead does not improve.
    sum_adv = first_token_advantages([honest, givens], [naive(honest), naive(givens)], "sum")
    min_adv = first_token_advantages([honest, givens], [naive(honest), naive(givens)], "min")
    assert sum_adv[1] > sum_adv[0]
    assert min_adv[1] <= min_adv[0]

    # The detectors flag each hack.
    honest_d = step_detectors([honest], [[1.0] * len(sample.steps)], [1.0], 1.0)
    padded_d = step_detectors([padded], [[1.0] * len(sample.steps)], [1.0], 1.0)
    givens_d = step_detectors([givens], [[1.0] * len(sample.steps)], [1.0], 1.0)
    assert padded_d["steps_per_response"] > 3 * honest_d["steps_per_response"]
    assert padded_d["unique_step_ratio"] < 0.5 < honest_d["unique_step_ratio"] == 1.0
    assert givens_d["steps_per_response"] > 2 * honest_d["steps_per_response"]


def test_detectors_hand_worked():
    d = step_detectors(["a\nb\na", "c"], [[1.0, 0.0], [1.0]], [1.0, 0.0], process_coef=0.5)
    assert d["steps_per_response"] == 2.0  # 4 lines over 2 responses
    assert d["unique_step_ratio"] == 3 / 4  # {a, b} + {c} distinct of 4 lines
    assert d["step_reward_mean"] == pytest.approx(2 / 3)
    assert d["step_reward_share"] == pytest.approx(0.5 * 2 / (0.5 * 2 + 1.0))
    # mean step reward per response (0.5, 1.0) against outcomes (1, 0): perfectly anti-correlated
    assert d["step_outcome_corr"] == pytest.approx(-1.0)


@pytest.mark.parametrize("estimator, credit", [("grpo_process", "min"), ("grpo_combined", "sum")])
def test_process_grpo_trains_on_gym_step_rewards(tmp_path, estimator, credit):
    cfg = tiny_config(
        tmp_path / "unused.jsonl",
        data={"source": "task:arithmetic", "level": 2, "train_size": 50, "eval_size": 8},
        reward={"functions": [{"name": "task"}], "correctness": "task",
                "process": {"name": "task_steps", "credit": credit, "coef": 0.5}},
        algorithm={"estimator": estimator},
        sampling={"max_new_tokens": 12},
    )
    rows = [r for r in GRPOTrainer(cfg, tmp_path / "run").train() if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["steps_per_response"] > 0 and 0 <= r["unique_step_ratio"] <= 1
        assert r["step_reward_mean"] == 0.0  # a random tiny model never commits to an answer: gated to 0
        assert r["error/format"] == 1.0 and r["unsupported_correct"] == 0.0  # the step's own error categories


def test_ppo_places_step_rewards_on_step_end_tokens(tmp_path):
    cfg = tiny_config(
        tmp_path / "unused.jsonl",
        data={"source": "task:arithmetic", "level": 2, "train_size": 50, "eval_size": 8},
        reward={"functions": [{"name": "task"}], "correctness": "task", "process": {"name": "task_steps", "coef": 2.0}},
        algorithm={"name": "ppo", "group_size": 1, "beta": 0.0},
        sampling={"max_new_tokens": 12}, train={"steps": 1},
    )
    trainer = PPOTrainer(cfg, tmp_path / "run")
    batch = trainer.sampler.sample(trainer.step_count, __import__("cohortrl.trainers.metrics", fromlist=["PhaseTimer"]).PhaseTimer())
    batch = dataclasses.replace(batch, step_rewards=[[1.0, 0.5] for _ in range(batch.rollout.batch_size)],
                                step_ends=[[0, 1] for _ in range(batch.rollout.batch_size)])
    rewards = trainer.algorithm.token_rewards(batch, torch.zeros(batch.rollout.batch_size))
    assert rewards[:, 0].tolist() == [2.0] * batch.rollout.batch_size and rewards[:, 1].tolist() == [1.0] * batch.rollout.batch_size


def test_statement_reading_credits_free_text_steps_and_resists_farming():
    """read=statements: "2 + 8 = 10" counts for s1 with or without the key; the gsm8k guards hold."""
    family = tasks.get("arithmetic")
    sample = family.sample(1, seed=0, level=2)[0]
    assert sample.prompt.startswith("Compute 2 + 8 - 6.")  # s1 = 2 + 8 = 10, s2 = 10 - 6 = 4
    rows = [sample.to_dict()]
    read = make_task_steps(require_commit=False, read="statements")

    def credit(c):
        return [s for s, _ in read([sample.prompt], [c], sample=rows)[0]]

    assert credit("First 2 + 8 = 10, then 10 - 6 = 4.") == [1.0, 1.0]
    assert credit(sample.reference_solution) == [1.0, 1.0]
    assert credit("2 + 8 = 10\n10 - 6 = 5") == [1.0, 0.0]  # a wrong statement credits nothing
    assert credit("10 - 6 = 4") == [0.0, 0.0]  # 10 is not a number of the question nor derived yet
    assert credit("2 + 8 = 10\n2 + 8 = 11\n10 - 6 = 4") == [0.0, 1.0]  # a contradicted statement earns nothing
    assert credit("3 + 7 = 10\n4 + 0 = 4") == [0.0, 0.0]  # ungrounded operands, an identity
    # Farming: repeats count once, and only the first 2R + 2 = 6 statements are read
    honest = "2 + 8 = 10\n10 - 6 = 4"
    farmed = "\n".join(["2 + 8 = 10"] * 5 + ["8 - 6 = 2", "2 + 6 = 8", "10 - 6 = 4"])
    assert sum(credit(farmed)) <= sum(credit(honest)) == 2
    # With the commitment gate on, nothing counts until the ANSWER line is there
    gated = make_task_steps(read="statements")
    assert [s for s, _ in gated([sample.prompt], [honest], sample=rows)[0]] == [0.0, 0.0]
    assert [s for s, _ in gated([sample.prompt], [honest + "\nANSWER: 4"], sample=rows)[0]] == [1.0, 1.0]
    # A step whose own calculation is an identity ("0 + 2") is credited by writing it; elsewhere identities earn nothing
    zero = next(x for x in family.sample(200, seed=11, level=2) if x.extra["calculations"][1].startswith("0 + "))
    assert [r.correct for r in family.grade_statements(zero, zero.reference_solution)] == [True, True]
    # Every reference earns full statement credit (arithmetic levels 2-5)
    for level in (2, 3, 4, 5):
        for x in family.sample(300, seed=5, level=level):
            assert all(r.correct for r in family.grade_statements(x, x.reference_solution)), x.reference_solution
    # Families whose steps carry units have no statement reading: a clear error, not zeros
    beam = tasks.get("beam_bending").sample(1, seed=0, level=1)[0]
    with pytest.raises(ValueError, match="not free-text statements"):
        read([beam.prompt], ["1 + 1 = 2"], sample=[beam.to_dict()])
    with pytest.raises(ValueError, match="read must be 'keyed' or 'statements'"):
        make_task_steps(read="lines")


def test_rewrite_reading_credits_both_steps_of_a_chain_only_when_asked():
    """SmolLM2 writes two operations as one chain, "2 + 8 - 6 = 10 - 6 = 4": read plainly its first "=" is the
    wrong "2 + 8 - 6 = 10" and only the second step counts; with rewrites it also states "2 + 8 = 10"."""
    sample = tasks.get("arithmetic").sample(1, seed=0, level=2)[0]  # s1 = 2 + 8 = 10, s2 = 10 - 6 = 4
    rows = [sample.to_dict()]
    plain = make_task_steps(require_commit=False, read="statements")
    rewrites = make_task_steps(require_commit=False, read="statements", rewrites=True)

    def credit(read, c):
        return [s for s, _ in read([sample.prompt], [c], sample=rows)[0]]

    chain = "2 + 8 - 6 = 10 - 6 = 4"
    assert credit(plain, chain) == [0.0, 0.0]  # 10 was never derived, so "10 - 6 = 4" is not grounded either
    assert credit(rewrites, chain) == [1.0, 1.0]
    (s1, span), (s2, _) = rewrites([sample.prompt], [chain], sample=rows)[0]
    assert chain[span[0]:span[1]] == "2 + 8 - 6 = 10"  # the rewritten expression up to the value written for it
    assert credit(rewrites, "2 + 8 - 6 = 11 - 6 = 5") == [0.0, 0.0]  # a wrong value is no rewrite
    assert credit(rewrites, "First 2 + 8 = 10, then 10 - 6 = 4.") == [1.0, 1.0]  # plain statements as before
    with pytest.raises(ValueError, match="give read: statements with it"):
        make_task_steps(rewrites=True)


def test_a_grader_that_raises_scores_every_step_0_and_is_reported(monkeypatch):
    from cohortrl.rewards import grader_errors

    family = tasks.get("axial_stress")
    sample = family.sample(1, seed=0, level=1)[0]
    fn = make_task_steps()
    honest = fn(prompts=["p"], completions=[sample.reference_solution], sample=[sample.to_dict()])
    assert [score for score, _ in honest[0]] == [1.0] * len(sample.steps)

    def broken(self, s, completion):
        raise OverflowError("a planted grader bug")

    monkeypatch.setattr(type(family), "grade", broken)
    grader_errors.drain()
    out = fn(prompts=["p"], completions=[sample.reference_solution], sample=[sample.to_dict()])
    assert out == [[(0.0, None)] * len(sample.steps)]
    (record,) = grader_errors.drain()
    assert record["reward"] == "task_steps" and record["prompt"] == "p" and "planted grader bug" in record["error"]


@pytest.mark.parametrize("protocol", ["text", "chat"])
def test_steps_written_as_calculator_calls_earn_their_reward_on_the_generated_text(protocol):
    """A step stated through the calculator (`A = <call>calculator: ...</call><result>...</result> mm^2`) is
    graded as the outcome is, rendered; its span points into the completion as generated, covering the call
    and its result, so the reward lands where the step is complete and not on the rendered text's offsets."""
    from cohortrl.tools import render, with_calculator

    family = tasks.get("axial_stress")
    sample = family.sample(1, seed=0, level=2)[0]
    fn = make_task_steps()
    completion = with_calculator(sample.reference_solution, protocol=protocol)
    assert completion.count("calculator") >= len(sample.steps)  # every required step is a call
    (steps,) = fn(prompts=["p"], completions=[completion], sample=[sample.to_dict()])
    assert [score for score, _ in steps] == [1.0] * len(sample.steps)
    rendered = render(completion)
    rendered_spans = [step.span for step in family.grade(family.sample_from_dict(sample.to_dict()), rendered).steps]
    closing = "</result>" if protocol == "text" else "</tool_response>"
    for (_, (a, b)), (ra, rb) in zip(steps, rendered_spans):
        assert render(completion[a:b]) == rendered[ra:rb]  # the same step, call and result included
        assert closing in completion[a:b]
    # without tool calls the spans are the grader's own
    (plain,) = fn(prompts=["p"], completions=[sample.reference_solution], sample=[sample.to_dict()])
    assert [span for _, span in plain] == [s.span for s in family.grade(sample, sample.reference_solution).steps]
