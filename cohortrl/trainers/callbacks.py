"""Hooks into the training loop: custom logging, early stopping, anything that reacts to a step's numbers.

A callback is any object with some of these methods (``Callback`` has them all as no-ops):

    on_step_end(trainer, metrics)   after every training step; ``metrics`` is the row written to metrics.jsonl
    on_evaluate(trainer, metrics)   after every held-out evaluation (keys ``eval/...``)
    on_save(trainer, path)          after a checkpoint (or the final model) is written to ``path``
    on_train_end(trainer, rows)     once, after the loop, with every row logged this call of ``train()``

To stop training early, call ``trainer.stop(reason)`` from a hook: the loop finishes the current step, writes
a checkpoint (so the run can be resumed), saves the final model and returns. The TensorBoard and Weights &
Biases loggers are callbacks too (``train.tensorboard`` / ``train.wandb`` add them).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


class Callback:
    def on_step_end(self, trainer, metrics: dict) -> None:
        pass

    def on_evaluate(self, trainer, metrics: dict) -> None:
        pass

    def on_save(self, trainer, path: Path) -> None:
        pass

    def on_train_end(self, trainer, rows: list[dict]) -> None:
        pass


def _scalars(row: dict) -> dict[str, float]:
    """The numeric entries of a metrics row (None, strings and the step itself left out)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TensorBoardCallback(Callback):
    """Every numeric metric as a TensorBoard scalar, under ``RUN_DIR/tensorboard``."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("train.tensorboard=true needs the tensorboard package: pip install 'cohortrl[tensorboard]'") from None
        self.writer = SummaryWriter(str(log_dir))

    def _write(self, row: dict) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def on_step_end(self, trainer, metrics):
        self._write(metrics)

    def on_evaluate(self, trainer, metrics):
        self._write(metrics)

    def on_train_end(self, trainer, rows):
        self.writer.close()


class WandbCallback(Callback):
    """Every numeric metric to Weights & Biases; the run config goes with it. Optional: needs ``wandb``."""

    def __init__(self, config: dict, run_dir: str | Path, project: str | None = None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("train.wandb=true needs the wandb package: pip install wandb") from None
        self.wandb = wandb
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT", "cohortrl"), name=Path(run_dir).name, config=config,
            dir=str(run_dir),
        )

    def on_step_end(self, trainer, metrics):
        self.run.log(_scalars(metrics), step=metrics["step"])

    def on_evaluate(self, trainer, metrics):
        self.run.log(_scalars(metrics), step=metrics["step"])

    def on_train_end(self, trainer, rows):
        self.run.finish()


class EarlyStopping(Callback):
    """Stop when ``monitor`` (an evaluation metric by default) has not improved by more than ``min_delta`` for
    ``patience`` evaluations in a row."""

    def __init__(self, monitor: str = "eval/accuracy", patience: int = 3, mode: str = "max", min_delta: float = 0.0):
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping mode must be 'max' or 'min', got {mode!r}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best = -math.inf if mode == "max" else math.inf
        self.bad = 0

    def _check(self, trainer, metrics: dict) -> None:
        value = metrics.get(self.monitor)
        if value is None:
            return
        better = value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta
        if better:
            self.best, self.bad = value, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            trainer.stop(f"{self.monitor} has not improved on {self.best:.4g} for {self.patience} measurement(s)")

    def on_step_end(self, trainer, metrics):
        if not self.monitor.startswith("eval/"):
            self._check(trainer, metrics)

    def on_evaluate(self, trainer, metrics):
        if self.monitor.startswith("eval/"):
            self._check(trainer, metrics)
