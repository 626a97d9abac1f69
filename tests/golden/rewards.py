"""Reward functions of the golden runs, in a file of their own so a config can name them by path (the process
reward is loaded as ``path/to/rewards.py:letter_words``). Chosen for the tiny random model: each one is
right for a fair share of its responses, so groups have reward variance and every estimator has work to do."""


def starts_with_letter(prompts, completions, **columns):
    """About 40% of the tiny random model's responses."""
    return [1.0 if c[:1].isalpha() else 0.0 for c in completions]


def starts_with_vowel(prompts, completions, **columns):
    """Rarer: with weight 0.5 beside ``starts_with_letter`` it makes the total reward take three values, so
    estimators that scale differently (std, G/(G-1), whitening) give different advantages."""
    return [1.0 if c[:1].lower() in "aeiou" else 0.0 for c in completions]


def letter_words(prompts, completions, **columns):
    """A process reward: every whitespace-separated word is a step, worth 1 when it starts with a letter."""
    out = []
    for c in completions:
        steps, pos = [], 0
        for word in c.split():
            start = c.index(word, pos)
            pos = start + len(word)
            steps.append((1.0 if word[0].isalpha() else 0.0, (start, pos)))
        out.append(steps)
    return out
