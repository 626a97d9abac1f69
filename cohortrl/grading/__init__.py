"""Grading primitives shared by the gym (`cohortrl.tasks`) and the reward functions (`cohortrl.rewards`).

- ``answer_format``: the one response format (``KEY = ... = value unit`` steps, ``ANSWER:``, ``VERDICT:``) and
  its one parser, numbers as written, GSM8K's free-text arithmetic statements;
- ``answers``: the committed answer of a free-form response and comparing it with a reference (the built-in
  ``accuracy`` / ``format`` rewards);
- ``units``: the one tolerance-and-units rule;
- ``sandbox`` (+ ``sandbox_server``): running model-written code out of process.

This layer imports nothing else from cohortrl, so both layers above can use it (docs/architecture.md).
"""
