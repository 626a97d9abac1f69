"""cohortrl: reinforcement-learning post-training of LLMs (GRPO and PPO, after optional supervised fine-tuning),
with a deterministic engineering gym.

The package layout follows one training step, in order of dependence:
``algorithms`` (pure tensor math) → ``rollout`` (generation) → ``rewards`` (scoring) → ``tasks`` (the gym)
→ ``trainers`` (the loops). Lower layers never import higher ones.
"""

__version__ = "0.1.0"

# The Python API, imported on first use so that `import cohortrl` (and the CLI's light commands) stay fast.
_API = {
    "Config": "cohortrl.config",
    "ConfigError": "cohortrl.config",
    "GRPOTrainer": "cohortrl.trainers.grpo",
    "PPOTrainer": "cohortrl.trainers.ppo",
    "SFTTrainer": "cohortrl.trainers.sft",
    "GRPOConfig": "cohortrl.trl_config",  # TRL's names and defaults: `from cohortrl import GRPOConfig, GRPOTrainer`
    "SFTConfig": "cohortrl.trl_config",
    "make_trainer": "cohortrl.trainers",
    "Callback": "cohortrl.trainers.callbacks",
    "EarlyStopping": "cohortrl.trainers.callbacks",
    "load_model": "cohortrl.models",
    "register_reward_function": "cohortrl.rewards.scoring",
    "register_advantage_estimator": "cohortrl.algorithms",
    "register_policy_loss": "cohortrl.algorithms",
    "register_task": "cohortrl.tasks",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'cohortrl' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_API[name])
    return getattr(module, "register" if name == "register_task" else name)
