"""cohortrl: reinforcement-learning post-training of LLMs (GRPO and PPO), with a deterministic engineering gym.

The package layout follows one training step, in order of dependence:
``algorithms`` (pure tensor math) → ``rollout`` (generation) → ``rewards`` (scoring) → ``tasks`` (the gym)
→ ``trainers`` (the loops). Lower layers never import higher ones.
"""

__version__ = "0.1.0"
