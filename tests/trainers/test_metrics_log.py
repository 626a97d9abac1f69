import json
import sys
import types

import pytest

from cohortrl.trainers.metrics import MetricsLog, wilson_interval


def test_metrics_rows_go_to_jsonl_and_tensorboard(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, key, value, step):
            scalars.append((key, value, step))

        def flush(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "reward_mean": 0.5, "note": "x"})
    log.write({"step": 2, "reward_mean": 0.75})
    log.truncate_after(1)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert scalars == [("reward_mean", 0.5, 1), ("reward_mean", 0.75, 2)]


def test_missing_tensorboard_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match=r"pip install 'cohortrl\[tensorboard\]'"):
        MetricsLog(tmp_path, tensorboard=True)


def test_wilson_interval_hand_worked():
    # p = 0.5, n = 100, z = 1.96: centre = (0.5 + 0.019208) / 1.038416 = 0.5; half = 1.96·sqrt(0.0025 + 0.000096)/1.038416
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
