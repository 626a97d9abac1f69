"""GRPO options not covered by the estimator matrix: truncation masking, stop strings, the resample bound."""

import logging

import torch

from cohortrl.models import load_model
from cohortrl.rollout.hf import Sampling, generate
from cohortrl.trainers.grpo import GRPOTrainer
from tests.trainers.test_grpo import tiny_config


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
