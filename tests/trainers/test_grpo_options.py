"""GRPO options not covered by the estimator matrix: truncation masking, stop strings, the resample bound, the KL
penalty in the reward."""

import json
import logging

import pytest
import torch

from cohortrl.algorithms import group_advantages
from cohortrl.config import ConfigError
from cohortrl.models import load_model
from cohortrl.rollout.hf import Sampling, generate
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.metrics import PhaseTimer
from cohortrl.trainers.step import logprobs
from tests.trainers.test_grpo import assert_resumed_as_uninterrupted, tiny_config


def test_mask_truncated_drops_truncated_responses_from_the_loss(tmp_path, addition_jsonl):
    # 4 new tokens: the random tiny model almost never stops that early, so (nearly) every response is truncated
    cfg = tiny_config(addition_jsonl, sampling={"max_new_tokens": 4}, algorithm={"mask_truncated": True}, train={"steps": 1})
    row = GRPOTrainer(cfg, tmp_path).train()[0]
    assert row["trained_responses"] == round((1 - row["truncation_rate"]) * 8)
    assert row["truncation_rate"] > 0


def test_stop_strings_end_responses_at_the_token_that_completes_them():
    model, tok = load_model("tiny-llama")
    torch.manual_seed(0)
    rows = [{"prompt": "What is 1 + 2?"}] * 4
    free, _ = generate(model, tok, rows, 2, Sampling(max_new_tokens=24))
    torch.manual_seed(0)
    stopped, _ = generate(model, tok, rows, 2, Sampling(max_new_tokens=24, stop=(" ",)))
    for ids, mask, text in zip(stopped.response_ids, stopped.response_mask, stopped.completions):
        n = int(mask.sum())
        assert " " in text  # the stop string is kept in the response ...
        assert " " not in tok.decode(ids[: n - 1])  # ... and generation ended at the first token completing it
    assert not stopped.truncated.any()
    assert stopped.lengths.float().mean() < free.lengths.float().mean()


def test_resample_stops_at_its_bound_and_warns(tmp_path, addition_jsonl, caplog):
    cfg = tiny_config(
        addition_jsonl, fn="constant", algorithm={"zero_variance": "resample", "max_resample_draws": 2}, train={"steps": 1}
    )
    with caplog.at_level(logging.WARNING, logger="cohortrl"):
        row = GRPOTrainer(cfg, tmp_path).train()[0]
    assert row["resample_draws"] == 2 and row["zero_variance_frac"] == 1.0
    assert "only 0 informative group(s) of 2 after 2 extra draws" in caplog.text


def test_retired_prompts_leave_the_stream_and_stay_out_across_a_resume(tmp_path, one_thread):
    """``algorithm.retire_solved=1``: a prompt whose group every response answered right is not drawn again;
    the others keep coming round, epoch after epoch; a run resumed from a checkpoint keeps what was retired."""
    data = tmp_path / "sums.jsonl"  # 8 training prompts after 4 held out; which are solved: the answer's parity
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(12)))
    cfg = tiny_config(data, fn="answer_is_even", data={"eval_size": 4}, algorithm={"retire_solved": 1},
                      train={"steps": 4, "checkpoint_every": 2}, eval={"n_prompts": 0})
    sampler = GRPOTrainer(cfg, tmp_path / "sampled").sampler
    drawn, retired = [], []
    for step in range(8):  # 16 prompts: two epochs' worth without retirement
        batch = sampler.sample(step, PhaseTimer())
        drawn.append([r["prompt"] for r in batch.rollout.rows[::4]])  # one row per group of 4
        retired.append(batch.retired_prompts)
    times = {p: sum(d.count(p) for d in drawn) for p in set().union(*map(set, drawn))}
    even = {p for p in times if int(p.split()[2]) % 2 == 1}  # a + 1 even
    assert len(times) == 8 and 0 < len(even) < 8  # every training prompt came round (the split drew 3 even ones)
    assert all(times[p] == 1 for p in even)  # ... and the solved ones never again
    assert all(times[p] >= 2 for p in set(times) - even)  # the others keep coming
    assert retired == sorted(retired) and retired[-1] == len(even)
    assert sorted(sampler.stream.state_dict()["solved_counts"].values()) == [1] * len(even)

    full = assert_resumed_as_uninterrupted(cfg, tmp_path, 2)
    assert [r["retired_prompts"] for r in full if "loss" in r][1] > 0  # something to restore at the checkpoint


@pytest.mark.parametrize("steps, warned", [(4, True), (5, False)])
def test_retiring_says_when_the_run_never_comes_round_to_a_prompt_again(tmp_path, one_thread, caplog, steps, warned):
    """8 training prompts, 2 a step: 4 steps draw each once (retirement cannot skip anything, said once before
    step 1); a 5th step comes round again."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(12)))
    cfg = tiny_config(data, fn="answer_is_even", data={"eval_size": 4}, algorithm={"retire_solved": 1},
                      train={"steps": steps}, eval={"n_prompts": 0})
    with caplog.at_level(logging.WARNING, logger="cohortrl"):
        GRPOTrainer(cfg, tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "retire_solved" in r.getMessage()]
    assert said == ([f"algorithm.retire_solved=1 cannot act: {steps} steps draw at most 8 of the 8 training prompts, "
                     "none of them twice; retiring solved prompts matters once a run comes round to its prompts again "
                     "(more train.steps or a smaller data.train_size)"] if warned else [])


def test_kl_in_reward_moves_the_penalty_from_the_loss_into_the_group_normalised_reward(tmp_path, addition_jsonl):
    beta = 0.5
    cfg = tiny_config(addition_jsonl, algorithm={"beta": beta, "kl_in_reward": True, "kl_estimator": "k1"}, train={"steps": 1})
    trainer = GRPOTrainer(cfg, tmp_path)
    trainer.train()  # one update: the policy now differs from the reference, so the KL is not 0
    batch = trainer.sampler.sample(trainer.step_count, PhaseTimer())
    rollout, mask = batch.rollout, batch.rollout.response_mask
    ids, attn = rollout.input_ids(), rollout.attention_mask()
    with torch.no_grad(), trainer.reference() as ref_model:
        ref_logp = logprobs(ref_model, rollout, trainer.cfg.algorithm.micro_batch_size, trainer.sampling.temperature)
    with torch.no_grad():
        old_logp = logprobs(trainer.model, rollout, trainer.cfg.algorithm.micro_batch_size, trainer.sampling.temperature)
    rewards = torch.tensor(batch.rewards)
    targets = trainer.algorithm.targets(batch, rewards, mask, ref_logp, old_logp, PhaseTimer())

    # by hand: k1 = log π_old − log π_ref summed over each response, r' = r − β·Σ k1, GRPO over groups of 4
    kl_sum = ((old_logp - ref_logp) * mask).sum(-1)
    assert kl_sum.abs().max() > 1e-3, "the update did not move the policy; the test would not see the KL"
    expected = group_advantages(rewards - beta * kl_sum, 4, "group", cfg.algorithm.eps)
    torch.testing.assert_close(targets.advantages, expected.unsqueeze(-1) * mask)
    assert targets.metrics["kl_reward_per_response"] == pytest.approx(kl_sum.mean().item(), rel=1e-5)

    # ... and the loss has no KL term left (the KL is still logged)
    logp = old_logp.clone().requires_grad_()
    extra, logged = trainer.algorithm.extra_loss(torch.arange(len(mask)), mask, logp, ids, attn, targets)
    assert extra is None and "kl" in logged
    step = [r for r in trainer.train(2) if "loss" in r][-1]
    assert step["kl_reward_per_response"] != 0 and torch.isfinite(torch.tensor(step["loss"]))


def test_kl_in_reward_is_refused_where_it_means_nothing(addition_jsonl):
    with pytest.raises(ConfigError, match="kl_in_reward"):
        tiny_config(addition_jsonl, algorithm={"beta": 0.0, "kl_in_reward": True})
    with pytest.raises(ConfigError, match="kl_in_reward"):
        tiny_config(addition_jsonl, algorithm={"name": "ppo", "group_size": 1, "kl_in_reward": True})


def test_response_lengths_are_logged_by_outcome(tmp_path, addition_jsonl):
    row = GRPOTrainer(tiny_config(addition_jsonl, fn="starts_with_letter", train={"steps": 1}), tmp_path).train()[0]
    right, wrong = row["response_length_correct_mean"], row["response_length_incorrect_mean"]
    assert right is not None or wrong is not None
    n_right = round(row["accuracy"] * 8)  # 0/1 reward: the accuracy counts the correct responses
    parts = [(right or 0.0) * n_right, (wrong or 0.0) * (8 - n_right)]
    assert sum(parts) / 8 == pytest.approx(row["response_length_mean"])
