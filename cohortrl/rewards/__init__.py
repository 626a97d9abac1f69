"""Scoring responses: built-in reward functions (``functions``), resolving and checking them (``scoring``),
process (step) rewards (``process``). The grading rules they share with the gym live in `cohortrl.grading`.

A reward function has TRL's signature, ``fn(prompts, completions, **columns) -> list[float | None]``;
``register_reward_function("name")`` makes a user's own selectable by name from a config."""

from cohortrl.rewards.scoring import RewardFunctionError, register_reward_function, resolve

__all__ = ["RewardFunctionError", "register_reward_function", "resolve"]
