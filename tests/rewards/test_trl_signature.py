"""Reward functions are called exactly as TRL's GRPOTrainer calls them: by keyword, with prompts=,
completions=, completion_ids=, trainer_state= and every dataset column. The functions below are the kinds TRL's
documentation shows (a length reward, regex format rewards, a think-format reward, one that returns None for
samples it does not score, conversational variants), written out here so the tests need no TRL."""

import re

import pytest

from cohortrl import Config, GRPOTrainer
from cohortrl.rewards.scoring import RewardFunctionError, TrainerState, WeightedReward, register_reward_function, resolve, score


# ------------------------------------------------------------------------------------- TRL-style functions
def reward_len(completions, **kwargs):
    """Completions near 20 characters score best (the quickstart's kind of reward)."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward(completions, **kwargs):
    """1 for <think>...</think><answer>...</answer>, else 0 (text completions)."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c) else 0.0 for c in completions]


def chat_format_reward(completions, **kwargs):
    """The same check on conversational completions: each is a list holding one assistant message."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def think_format_reward(completions, **kwargs):
    """1 when the completion opens with one <think> block (no nested <think>) that is closed, else 0."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.fullmatch(r"<think>(?:(?!<think>).)*?</think>.*", t, re.DOTALL) else 0.0 for t in texts]


def math_only(completions, task, solution, **kwargs):
    """Scores only rows whose task column is 'math' (by the solution column); None for the rest."""
    return [None if t != "math" else float(c.strip() == s) for c, t, s in zip(completions, task, solution)]


def code_only(completions, task, **kwargs):
    return [None if t != "code" else float("def " in c) for c, t in zip(completions, task)]


PROMPTS = ["Add 2 and 3.", "Write a function.", "Say hi."]
COMPLETIONS = ["5", "def f(): pass", "<think>hm</think><answer>hi</answer>"]
COLUMNS = {"task": ["math", "code", "chat"], "solution": ["5", None, None]}


def scored(fn, prompts=PROMPTS, completions=COMPLETIONS, columns=None, name=None):
    return score([WeightedReward(name or fn.__name__, fn)], prompts, completions, dict(columns or COLUMNS))[1][name or fn.__name__]


# ------------------------------------------------------------------------------------- the call
def test_completions_only_functions_work():
    # reward_len: 20 - len: "5" -> -19, "def f(): pass" (13) -> -7, the think answer (36) -> -16
    assert scored(reward_len) == [-19.0, -7.0, -16.0]
    assert scored(format_reward) == [0.0, 0.0, 1.0]


def test_every_keyword_argument_arrives():
    seen = {}

    def spy(*, prompts, completions, completion_ids, trainer_state, task, **kwargs):  # keyword-only is fine
        seen.update(prompts=prompts, completion_ids=completion_ids, trainer_state=trainer_state, task=task, rest=kwargs)
        return [0.0] * len(completions)

    state = TrainerState(global_step=3, max_steps=10)
    columns = {**COLUMNS, "completion_ids": [[1], [2, 3], [4]], "trainer_state": state}
    scored(spy, columns=columns)
    assert seen["prompts"] == PROMPTS
    assert seen["completion_ids"] == [[1], [2, 3], [4]]
    assert seen["trainer_state"].global_step == 3 and seen["trainer_state"].max_steps == 10
    assert seen["task"] == ["math", "code", "chat"]
    assert seen["rest"] == {"solution": ["5", None, None]}


def test_none_for_unscored_samples_is_filled_by_another_function():
    rewards = [WeightedReward("math_only", math_only), WeightedReward("code_only", code_only, 0.5),
               WeightedReward("format_reward", format_reward)]
    totals, per_fn = score(rewards, PROMPTS, COMPLETIONS, dict(COLUMNS))
    assert per_fn["math_only"] == [1.0, None, None]
    assert per_fn["code_only"] == [None, 1.0, None]
    # sample 0: math 1 + format 0; sample 1: 0.5 * code 1 + format 0; sample 2: format 1 only
    assert totals == [1.0, 0.5, 1.0]


def test_a_sample_no_function_scores_is_an_error_not_a_zero():
    with pytest.raises(RewardFunctionError, match=r"^no reward function applies to sample 1 \(all returned None; prompt: 'Write a function.'\)"):
        score([WeightedReward("math_only", math_only)], PROMPTS, COMPLETIONS, dict(COLUMNS))


def test_conversational_prompts_and_completions_are_message_lists():
    prompts = [[{"role": "system", "content": "Think first."}, {"role": "user", "content": p}] for p in PROMPTS]
    got = {}

    def spy(prompts, completions, **kwargs):
        got.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    scored(spy, prompts=prompts)
    assert got["prompts"] == prompts
    assert got["completions"] == [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert scored(chat_format_reward, prompts=prompts) == [0.0, 0.0, 1.0]
    assert scored(think_format_reward, prompts=prompts) == [0.0, 0.0, 1.0]
    # the built-ins read conversational completions too
    accuracy = resolve("accuracy")
    assert scored(accuracy, prompts=prompts, completions=["ANSWER: 5", "ANSWER: 6", "7"], columns={"answer": ["5", "7", "7"]},
                  name="accuracy") == [1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------- errors
def test_parameters_named_otherwise_than_trl_get_a_clear_error():
    with pytest.raises(RewardFunctionError, match=(
        r"^reward function 'old' has parameter\(s\) \['p', 'c'\] that no argument fills: reward functions are called "
        r"by keyword with prompts, completions, task, solution; rename")):
        scored(lambda p, c, **kw: [0.0] * len(c), name="old")
    with pytest.raises(RewardFunctionError, match=r"has parameter\(s\) \['solution'\] that no argument fills"):
        scored(math_only, columns={"task": ["math"] * 3})


def test_a_function_without_kwargs_is_refused_when_named():
    with pytest.raises(RewardFunctionError, match=(
        r"reward function 'tight' has signature tight\(completions\); reward functions are called by keyword as in "
        r"TRL \(prompts=, completions=, completion_ids=, trainer_state= and every dataset column\), so it must take "
        r"\*\*kwargs")):
        @register_reward_function("tight")
        def tight(completions):
            return [0.0] * len(completions)


def test_an_exception_names_the_file_and_line(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def helper(c):\n"
        "    return {'x': 1}[c]\n"  # line 2: where the KeyError is raised
        "\n"
        "def picky(completions, **kwargs):\n"
        "    return [float(helper(c)) for c in completions]\n"  # line 5: the call inside the reward function
    )
    fn = resolve(f"{path}:picky")
    with pytest.raises(RewardFunctionError) as err:
        score([WeightedReward("picky", fn)], ["q0", "q1"], ["x", "y"], {})
    # the deepest frame in the function's own file: helper's line 2, on sample 1 ("y")
    assert str(err.value) == f"reward function 'picky' raised KeyError: 'y' at {path}:2 (in helper) on sample 1 (prompt: 'q1')"


# ------------------------------------------------------------------------------------- in a trainer
def test_trainer_calls_trl_functions_on_conversational_data(tmp_path):
    calls = []

    def recorder(prompts, completions, completion_ids, trainer_state, level, **kwargs):
        calls.append((prompts, completions, completion_ids, trainer_state, level))
        return [0.0] * len(completions)

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}],
             "level": i} for i in range(4)]
    config = Config(model={"name": "tiny-llama", "system_prompt": None}, sampling={"max_new_tokens": 4},
                    algorithm={"group_size": 2, "prompts_per_step": 2}, train={"steps": 1, "progress": False},
                    eval={"before": False})
    trainer = GRPOTrainer(config, tmp_path / "run", model="tiny-llama", reward_funcs=[recorder, reward_len], train_dataset=rows)
    assert trainer.eval_rows == []  # a user's rows are not held out unless asked
    trainer.train()
    prompts, completions, completion_ids, state, levels = calls[0]
    assert len(prompts) == len(completions) == len(completion_ids) == 4
    assert all(p in [r["prompt"] for r in rows] for p in prompts)
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    tok = trainer.tokenizer
    # completion_ids are the sampled tokens: they decode to the completion's text
    assert [tok.decode(ids, skip_special_tokens=True) for ids in completion_ids] == [
        tok.decode(tok(c[0]["content"], add_special_tokens=False)["input_ids"]) for c in completions]
    assert state.global_step == 0 and state.max_steps == 1
    assert set(levels) <= {0, 1, 2, 3}
