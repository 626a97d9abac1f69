import json
import sys
import types

import pytest

from cohortrl.trainers.callbacks import TensorBoardCallback, WandbCallback
from cohortrl.stats import wilson_interval
from cohortrl.trainers.metrics import MetricsLog, by_level


def test_metrics_rows_go_to_jsonl_and_resume_drops_later_rows(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"step": 1, "reward_mean": 0.5, "note": "x"})
    log.write({"step": 2, "reward_mean": 0.75})
    log.truncate_after(1)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward_mean": 0.5, "note": "x"}
    ]


def test_tensorboard_callback_writes_every_numeric_metric(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, key, value, step):
            scalars.append((key, value, step))

        def flush(self):
            pass

        def close(self):
            scalars.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    tb = TensorBoardCallback(tmp_path)
    tb.on_step_end(None, {"step": 1, "reward_mean": 0.5, "note": "x", "zero_variance_frac": None, "flag": True})
    tb.on_evaluate(None, {"step": 2, "eval/accuracy": 0.75})
    tb.on_train_end(None, [])
    assert scalars == [("reward_mean", 0.5, 1), ("eval/accuracy", 0.75, 2), "closed"]


def test_missing_tensorboard_or_wandb_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match=r"pip install 'cohortrl\[tensorboard\]'"):
        TensorBoardCallback(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match=r"train.wandb=true needs the wandb package: pip install wandb"):
        WandbCallback({}, tmp_path)


def test_wandb_callback_logs_scalars_by_step(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append((values, step))

        def finish(self):
            calls.append("finished")

    def init(project, name, config, dir):
        calls.append((project, name, config))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    cb = WandbCallback({"train": {"steps": 3}}, tmp_path / "run-a")
    cb.on_step_end(None, {"step": 3, "loss": 1.5, "kl": None})
    cb.on_train_end(None, [])
    assert calls == [("proj", "run-a", {"train": {"steps": 3}}), ({"loss": 1.5}, 3), "finished"]


def test_wilson_interval_hand_worked():
    # p = 0.5, n = 100, z = 1.96: centre = (0.5 + 0.019208) / 1.038416 = 0.5; half = 1.96·sqrt(0.0025 + 0.000096)/1.038416
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)


def test_by_level_splits_accuracy_and_the_advantage_mass_by_level():
    """Hand-worked: level 1's rows hold |A| 0.5 + 0.5 and 0.5 over 3 response tokens (the 9s are padding), level
    2's 2 + 2 + 2 and 1 + 1 over 5; shares 1.5 / 9.5 and 8 / 9.5. A level absent from the batch gets None."""
    import torch

    rollout = types.SimpleNamespace(rows=[{"sample": {"level": 1}}] * 2 + [{"sample": {"level": 2}}] * 2,
                                    response_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]))
    advantages = torch.tensor([[0.5, 0.5, 9.0], [-0.5, 9.0, 9.0], [2.0, 2.0, 2.0], [-1.0, -1.0, 9.0]])
    out = by_level(types.SimpleNamespace(sum=lambda totals: totals), rollout, [1.0, 0.0, 1.0, None], advantages, [1, 2, 3])
    assert out == pytest.approx({
        "level1/accuracy": 0.5, "level1/advantage_abs_mean": 0.5, "level1/advantage_share": 1.5 / 9.5,
        "level2/accuracy": 0.5, "level2/advantage_abs_mean": 1.6, "level2/advantage_share": 8 / 9.5,
        "level3/accuracy": None, "level3/advantage_abs_mean": None, "level3/advantage_share": 0.0})
