"""The trainers: one RL step, one function in one file (``step.py``), run by the RL trainer (``rl.py``) with one
small object per algorithm (``algorithm.py``; ``grpo.py``, ``ppo.py``, ``rft.py``: rejection-sampling fine-tuning,
the supervised baseline), each with its trainer class; ``make_trainer`` picks the one ``algorithm.name`` asks for. Supervised
fine-tuning, the stage before RL, is ``sft.py``. Every trainer runs in ``loop.Trainer`` (train loop,
evaluation schedule, checkpoints and resume, logs, final save)."""

from __future__ import annotations

from pathlib import Path


def make_trainer(config, run_dir: str | Path | None = None, **kwargs):
    """A ``GRPOTrainer``, ``PPOTrainer`` or ``RFTTrainer`` for the config's ``algorithm.name``, with the same interface:
    ``.train(steps=None)``, ``.step()``, ``.evaluate()``, ``.save()``, ``.save_checkpoint()``. ``config`` is
    a ``Config``, a dict of sections or a YAML path; ``kwargs`` are the trainers' keyword arguments."""
    from cohortrl.trainers.grpo import GRPOTrainer
    from cohortrl.trainers.inputs import as_config
    from cohortrl.trainers.ppo import PPOTrainer
    from cohortrl.trainers.rft import RFTTrainer

    config = as_config(config)
    trainers = {"grpo": GRPOTrainer, "ppo": PPOTrainer, "rft": RFTTrainer}
    return trainers[config.algorithm.name](config, run_dir, **kwargs)
