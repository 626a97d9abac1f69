"""Reward functions used by the trainer tests, loaded by path the way a user's own file is."""


def starts_with_digit(prompts, completions, **columns):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def raises_unless_letter(prompts, completions, **columns):
    out = []
    for c in completions:
        if not c[:1].isalpha():
            raise ValueError(f"cannot parse {c[:5]!r}")
        out.append(1.0)
    return out


def returns_nan(prompts, completions, **columns):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


def wrong_length(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def not_applicable(prompts, completions, **columns):
    return [None] * len(completions)


def starts_with_letter(prompts, completions, **columns):
    """About 40% of the tiny random model's responses: groups of 4 are a mix of informative and all-same."""
    return [1.0 if c[:1].isalpha() else 0.0 for c in completions]


def constant(prompts, completions, **columns):
    return [1.0] * len(completions)


def hangs(prompts, completions, **columns):
    import time

    time.sleep(3)  # far past the test's reward.timeout_s; the abandoned thread ends soon after
    return [0.0] * len(completions)


def starts_with_vowel(prompts, completions, **columns):
    """Rarer than a letter: many groups of 4 are all-wrong, so resampling has work to do."""
    return [1.0 if c[:1].lower() in "aeiou" else 0.0 for c in completions]


def starts_with_letter_logging_lengths(prompts, completions, completion_lengths, trainer_state, **columns):
    """``starts_with_letter``, appending each call's rank, step and response lengths (tokens) to the JSONL file
    named by ``COHORTRL_TEST_LENGTHS``: a two-process test reads from it whether its ranks' padded widths differed."""
    import json
    import os

    with open(os.environ["COHORTRL_TEST_LENGTHS"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "step": trainer_state.global_step,
                            "lengths": list(completion_lengths)}) + "\n")
    return starts_with_letter(prompts, completions)


def always_zero(prompts, completions, **columns):
    return [0.0] * len(completions)


def raises_from_step_2(prompts, completions, trainer_state, **columns):
    """``constant`` for the first step, then an error: the run has shown a progress bar when it fails."""
    if trainer_state.global_step >= 1:
        raise ValueError("broken from step 2 on")
    return constant(prompts, completions)


def reads_difficulty(prompts, completions, difficulty, **columns):
    """Reads the column ``difficulty`` by naming it (TRL's convention)."""
    return [float(d) for d in difficulty]


def answer_is_even(prompts, completions, answer, **columns):
    """Right for every response to a prompt whose answer is even, wrong for every other: which prompts a run
    solves is known in advance (``algorithm.retire_solved``'s test)."""
    return [1.0 if int(a) % 2 == 0 else 0.0 for a in answer]
