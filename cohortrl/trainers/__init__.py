"""The training loops: one shared step (``loop.py``) and a small subclass per algorithm (``grpo.py``,
``ppo.py``). ``make_trainer`` picks the one ``algorithm.name`` asks for."""

from __future__ import annotations

from pathlib import Path


def make_trainer(config, run_dir: str | Path, *, model=None, tokenizer=None, resume: bool = False):
    """A ``GRPOTrainer`` or ``PPOTrainer`` for ``config.algorithm.name``, with the same interface:
    ``.train(steps=None)``, ``.step()``, ``.evaluate()``, ``.save_checkpoint()``."""
    from cohortrl.trainers.grpo import GRPOTrainer
    from cohortrl.trainers.ppo import PPOTrainer

    trainers = {"grpo": GRPOTrainer, "ppo": PPOTrainer}
    return trainers[config.algorithm.name](config, run_dir, model=model, tokenizer=tokenizer, resume=resume)
