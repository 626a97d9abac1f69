"""GRPO end to end on the tiny model: every estimator x aggregation x zero-variance setting runs, the KL is
exactly 0 before the first update, a trivially learnable reward is learned, micro-batches give one batch's
gradient in every aggregation mode, runs resume exactly (LoRA and resampling runs too), checkpoints are atomic,
and bad reward functions stop the run with a precise error."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from cohortrl.algorithms import aggregate, token_weights
from cohortrl.config import Config, ConfigError
from cohortrl.rewards.scoring import RewardFunctionError
from cohortrl.trainers import checkpoint
from cohortrl.trainers.grpo import GRPOTrainer, RunStateError

FNS = Path(__file__).parent / "reward_fns.py"
OUTCOME_ESTIMATORS = ["grpo", "grpo_batch", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
AGGREGATIONS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
VOLATILE = ("time/", "tokens_per_s", "peak_rss_mb")


def tiny_config(data_file: Path, fn: str = "starts_with_letter", **sections) -> Config:
    base = {
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": f"jsonl:{data_file}", "eval_size": 8},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": f"{FNS}:{fn}"}], "correctness": f"{FNS}:{fn}"},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 8, "batch_size": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Config.from_dict(base)


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("estimator, aggregation, zero_variance, cpu_path", [
    (estimator, aggregation, zero_variance, path)
    for zero_variance in ("keep", "filter", "resample") for aggregation in AGGREGATIONS
    for estimator in OUTCOME_ESTIMATORS for path in ("fast", "plain") if path == "fast" or zero_variance == "keep"
], indirect=["cpu_path"])
def test_every_estimator_aggregation_and_zero_variance_setting_trains(
    tmp_path, addition_jsonl, estimator, aggregation, zero_variance, cpu_path
):
    """On the fast path every setting; on the plain path (train.cpu_fast_path=off) every estimator x aggregation
    with zero_variance=keep (filter and resample change which rows reach the update, not the path's forward)."""
    cfg = tiny_config(
        addition_jsonl,
        algorithm={"estimator": estimator, "aggregation": aggregation, "zero_variance": zero_variance, "group_size": 4},
        train=cpu_path.train, eval={"n_prompts": 0},
    )
    trainer = GRPOTrainer(cfg, tmp_path)
    before = params_of(trainer)
    rows = trainer.train()
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "policy_loss", "kl", "grad_norm", "entropy"))
        assert 0 <= r["zero_variance_frac"] <= 1
    changed = any(not torch.equal(before[n], p) for n, p in params_of(trainer).items())
    assert changed, "no parameter moved in two steps"
    cpu_path.check(trainer, steps, replays=zero_variance != "resample")  # resample joins draws: no recording


@pytest.mark.parametrize("reuse", [False, True])
def test_kl_is_exactly_zero_before_the_first_update(tmp_path, addition_jsonl, reuse):
    for lora in (False, True):
        cfg = tiny_config(addition_jsonl, algorithm={"beta": 0.1}, model={"lora": {"enabled": lora, "r": 4}},
                          train={"steps": 1, "reuse_rollout_forward": reuse})
        row = GRPOTrainer(cfg, tmp_path / str(lora)).train()[0]
        if reuse:  # the policy's log-probs come from decoding's kernels, the reference's from a forward: rounding
            assert abs(row["kl"]) < 1e-9
        else:
            assert row["kl"] == 0.0


def test_lora_reference_is_the_base_model_without_a_copy(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, model={"lora": {"enabled": True, "r": 4}})
    trainer = GRPOTrainer(cfg, tmp_path)
    assert trainer.reference.model is None
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_no_reference_model_when_beta_is_zero(tmp_path, addition_jsonl):
    trainer = GRPOTrainer(tiny_config(addition_jsonl, algorithm={"beta": 0.0}), tmp_path)
    assert trainer.reference is None


def test_learns_a_trivially_learnable_reward(tmp_path, addition_jsonl):
    """Reward 1 when the response starts with a digit (about 3% of the random model's responses). A sign or
    masking error anywhere in rollout -> reward -> advantage -> loss -> update keeps this near 0."""
    cfg = tiny_config(
        addition_jsonl, fn="starts_with_digit",
        algorithm={"group_size": 8, "prompts_per_step": 4, "beta": 0.0}, train={"steps": 30}, eval={"n_prompts": 0},
    )
    rewards = [r["reward_mean"] for r in GRPOTrainer(cfg, tmp_path).train()]
    assert sum(rewards[:5]) / 5 < 0.15
    assert sum(rewards[-5:]) / 5 > 0.7, rewards


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_give_the_same_gradient_as_one_batch(tmp_path, addition_jsonl, one_thread, aggregation):
    """8 rows in micro-batches of 3, 3 and 2 (unequal, so a per-micro-batch mean differs from the batch's for
    every mode, not only by a common factor) against one batch of 8: the gradient AdamW steps with is the same."""
    grads = []
    for micro in (0, 3):
        cfg = tiny_config(addition_jsonl, algorithm={"micro_batch_size": micro, "aggregation": aggregation}, train={"steps": 1})
        trainer = GRPOTrainer(cfg, tmp_path / str(micro))
        seen = {}  # the gradient AdamW steps with (the trainer frees .grad after the step)
        trainer.optimizer.register_step_pre_hook(lambda *_: seen.update(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
        trainer.train()
        assert all(p.grad is None for p in trainer.model.parameters())  # freed once used
        grads.append(seen)
    scale = max(g.abs().max().item() for g in grads[0].values())
    assert scale > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_token_weights_reproduce_aggregate_on_any_split(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    w = token_weights(mask, mode, norm_length=5)
    whole = aggregate(loss, mask, mode, norm_length=5)
    split = sum((w[i : i + 2] * loss[i : i + 2]).sum() for i in range(0, 6, 2))
    torch.testing.assert_close(split, whole)


def test_resume_after_step_k_reproduces_the_uninterrupted_run(tmp_path, addition_jsonl, cpu_path):
    cfg = tiny_config(addition_jsonl, train={"steps": 4, "checkpoint_every": 2, **cpu_path.train},
                      algorithm={"epochs": 2, "minibatches": 2})
    full = GRPOTrainer(cfg, tmp_path / "full").train()
    GRPOTrainer(cfg, tmp_path / "split").train(steps=2)
    trainer = GRPOTrainer(cfg, tmp_path / "split", resume=True)
    resumed = trainer.train()
    cpu_path.check(trainer, full + resumed)  # two epochs of minibatches: no update reuses decoding's forward
    def by_step(rows):
        return {r["step"]: r for r in rows if "loss" in r}
    a, b = by_step(full), by_step(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key, value in a[step].items():
            if key.startswith(VOLATILE):
                continue
            assert b[step][key] == pytest.approx(value, abs=1e-6), (step, key)
    logged = [json.loads(line)["step"] for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in logged if s] == [1, 2, 2, 3, 4, 4]  # train rows and the evaluations at the two ends


def assert_resumed_as_uninterrupted(cfg, run_dir: Path, k: int) -> list[dict]:
    """Train ``cfg`` uninterrupted, and again stopped after step ``k`` and resumed, under ``run_dir``: every
    later step's numbers agree (as in the test above) and the trained weights are the same, bit for bit.
    Returns the uninterrupted run's rows."""
    full_trainer = GRPOTrainer(cfg, run_dir / "full")
    full = full_trainer.train()
    GRPOTrainer(cfg, run_dir / "split").train(steps=k)
    trainer = GRPOTrainer(cfg, run_dir / "split", resume=True)
    resumed = trainer.train()
    a, b = ({r["step"]: r for r in rows if "loss" in r} for rows in (full, resumed))
    assert sorted(b) == list(range(k + 1, cfg.train.steps + 1))
    for step in b:
        for key, value in a[step].items():
            if not key.startswith(VOLATILE):
                assert b[step][key] == pytest.approx(value, abs=1e-6), (step, key)
    weights = params_of(trainer)
    for name, p in params_of(full_trainer).items():
        assert torch.equal(weights[name], p), name
    return full


def test_a_resumed_resample_run_reproduces_the_uninterrupted_run(tmp_path, addition_jsonl, one_thread):
    """``zero_variance: resample`` draws more prompts in a step whose groups are all-same, so the data stream is
    further on than steps x prompts_per_step at the checkpoint: the resume continues from where it really is.
    Groups of 2, so that all-same groups (and extra draws) are frequent."""
    cfg = tiny_config(addition_jsonl, algorithm={"zero_variance": "resample", "group_size": 2},
                      train={"steps": 3, "checkpoint_every": 2}, eval={"n_prompts": 0})
    full = assert_resumed_as_uninterrupted(cfg, tmp_path, 2)
    extra = [r["resample_draws"] for r in full if "loss" in r]
    assert sum(extra[:2]) > 0, extra  # draws beyond the first before the checkpoint: else nothing to restore


def test_a_resumed_lora_run_reproduces_the_uninterrupted_run(tmp_path, addition_jsonl, one_thread):
    """The adapter's weights and their AdamW moments come back (2 epochs x 2 minibatches: four updates a step);
    the reference is the base model, the adapter switched off, before and after."""
    cfg = tiny_config(addition_jsonl, model={"lora": {"enabled": True, "r": 4}}, algorithm={"epochs": 2, "minibatches": 2},
                      train={"steps": 3, "checkpoint_every": 2}, eval={"n_prompts": 0})
    assert_resumed_as_uninterrupted(cfg, tmp_path, 2)


def test_resuming_a_finished_run_says_so(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, train={"steps": 1})
    GRPOTrainer(cfg, tmp_path).train()
    with pytest.raises(RunStateError, match="already done 1 step"):
        GRPOTrainer(cfg, tmp_path, resume=True).train()


def test_resume_with_a_different_config_names_the_keys(tmp_path, addition_jsonl):
    GRPOTrainer(tiny_config(addition_jsonl, train={"steps": 1}), tmp_path).train()
    other = tiny_config(addition_jsonl, train={"steps": 3}, algorithm={"beta": 0.5})
    with pytest.raises(ConfigError, match=r"algorithm.beta: 0.04 -> 0.5"):
        GRPOTrainer(other, tmp_path, resume=True)


def test_resume_of_a_run_saved_before_a_setting_existed_takes_the_settings_default(tmp_path, addition_jsonl):
    from cohortrl.trainers.loop import config_hash, config_hashes

    cfg = tiny_config(addition_jsonl, train={"steps": 2, "checkpoint_every": 1})
    GRPOTrainer(cfg, tmp_path).train(steps=1)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["data"]["exclude_from_training"]  # as a config.yaml written before the setting was added
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    # its checkpoint's manifest as the version that wrote it hashed the config: every setting as saved
    manifest = tmp_path / "checkpoints" / "step_000001" / checkpoint.MANIFEST
    written = json.loads(manifest.read_text())
    written["config_hash"] = config_hashes(saved)[1]
    assert written["config_hash"] != config_hash(saved) == config_hash(cfg.to_dict())  # defaults left out
    manifest.write_text(json.dumps(written))
    rows = GRPOTrainer(cfg, tmp_path, resume=True).train()
    assert [r["step"] for r in rows if "loss" in r] == [2]
    saved["data"]["exclude_from_training"] = {"answer": ["3"]}  # a value other than the default is a change
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match=r"data.exclude_from_training.answer: \['3'\] -> None"):
        GRPOTrainer(cfg, tmp_path, resume=True)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {"x": torch.ones(2)})

    def crash(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        checkpoint.save(tmp_path, 2, {"x": torch.zeros(2)})
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path).name == "step_000001"
    assert torch.equal(checkpoint.load(checkpoint.latest(tmp_path))["x"], torch.ones(2))
    assert not list(checkpoint.checkpoint_dir(tmp_path).glob(".tmp-*"))


@pytest.mark.parametrize(
    "fn, message",
    [
        ("raises_unless_letter", r"reward function '.*raises_unless_letter' raised ValueError: cannot parse .* on sample \d+ \(prompt: 'What is"),
        ("returns_nan", r"reward function '.*returns_nan' returned nan for sample 1 \(prompt: 'What is"),
        ("wrong_length", r"reward function '.*wrong_length' returned 7 values for 8 completions"),
        ("not_applicable", r"no reward function applies to sample 0"),
    ],
)
def test_bad_reward_functions_stop_the_run_with_a_precise_error(tmp_path, addition_jsonl, fn, message):
    trainer = GRPOTrainer(tiny_config(addition_jsonl, fn=fn), tmp_path)
    with pytest.raises(RewardFunctionError, match=message):
        trainer.train()


def test_metrics_and_curves_are_written(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, eval={"before": True, "n_prompts": 8, "pass_k": 2})
    GRPOTrainer(cfg, tmp_path).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    assert {"eval/accuracy", "eval/pass@2", "eval/accuracy_ci_low"} <= set(rows[0])
    # each evaluated problem keeps how many of its 2 samples were right, and they make the logged sampled accuracy
    from cohortrl.trainers.evaluate import read_answers

    answers = [r for r in read_answers(tmp_path) if r["step"] == 0]
    assert len(answers) == 8 and all(r["samples"] == 2 and r["sampled_correct"] in (0, 1, 2) for r in answers)
    assert rows[0]["eval/sampled_accuracy"] == pytest.approx(sum(r["sampled_correct"] for r in answers) / 16)
    fn_key = f"reward/{FNS}:starts_with_letter"
    assert rows[1][f"{fn_key}_std"] >= 0 and f"{fn_key}_mean" in rows[1]
    for key in ("reward_mean", "accuracy", "zero_variance_frac", "kl", "clip_frac_low", "clip_frac_high", "entropy",
                "response_length_mean", "response_length_max", "truncation_rate", "policy_loss", "grad_norm", "lr",
                "time/generate", "time/score", "time/reference", "time/train", "tokens_per_s", "peak_rss_mb"):
        assert key in rows[1], key
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "final" / "config.json").exists()


@pytest.mark.fast_path
@pytest.mark.parametrize("setting", ["auto", "aten"])
def test_steps_and_evaluations_run_under_the_configured_linear_kernel(tmp_path, addition_jsonl, monkeypatch, setting):
    """``train.cpu_linear``: auto sends a CPU step's and evaluation's linear layers to oneDNN (where the build
    has it), aten leaves PyTorch's own; either way the policy's layers are plain ``nn.Linear`` again afterwards
    and F.linear was never replaced."""
    from cohortrl.cpu import kernels

    original = torch.nn.functional.linear
    calls = []
    real = kernels._onednn
    monkeypatch.setattr(kernels, "_onednn", lambda *a: calls.append(1) or real(*a))
    trainer = GRPOTrainer(tiny_config(addition_jsonl, train={"steps": 1, "cpu_linear": setting}), tmp_path)
    want = "onednn" if setting == "auto" and kernels.onednn_available() else "aten"
    assert (trainer.fast_path.linear if trainer.fast_path is not None else "aten") == want
    trainer.step()
    after_step = len(calls)
    trainer.evaluate()
    assert torch.nn.functional.linear is original  # never replaced: the policy's own layers are switched, and back
    assert {type(m) for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    if want == "onednn":
        assert after_step > 0 and len(calls) > after_step  # the step's and the evaluation's products
    else:
        assert calls == []
