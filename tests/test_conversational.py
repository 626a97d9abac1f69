"""Conversational datasets (TRL's format: ``prompt`` is a list of {role, content} messages) are rendered with the
model's chat template for GRPO, PPO and evaluation; malformed or mixed ones are refused naming the row. User rows
are held out only when asked; gym tasks keep their held-out split."""

import json

import pytest

from cohortrl import Config, GRPOTrainer, PPOTrainer
from cohortrl.config import DataConfig
from cohortrl.data import DEFAULT_EVAL_SIZE, DataError, load_rows, render_prompt
from cohortrl.models import build_tiny_tokenizer, load_model
from cohortrl.rewards.scoring import WeightedReward
from cohortrl.trainers.evaluate import evaluate


def chat(question: str, system: str | None = "Answer with a number.") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


CHAT_ROWS = [{"prompt": chat(f"What is {i} + 2?"), "answer": str(i + 2)} for i in range(6)]


def contains_answer(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]


# ------------------------------------------------------------------------------------- rendering
def test_render_prompt_text_and_conversations():
    tok = build_tiny_tokenizer()  # ChatML
    assert render_prompt(tok, "hi", "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # a conversation's own system message wins over the configured one
    assert render_prompt(tok, chat("hi", "Own."), "Be brief.") == (
        "<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # without one, the configured system prompt goes first; None adds nothing
    assert render_prompt(tok, chat("hi", None), "Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert render_prompt(tok, chat("hi", None), None) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a multi-turn conversation ending in a partial assistant turn is continued inside it
    turns = [*chat("hi", None), {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "It is"}]
    assert render_prompt(tok, turns, None) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\nIt is")


# ------------------------------------------------------------------------------------- errors
def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


@pytest.mark.parametrize("prompt, message", [
    ([], "is []; it must be non-empty text or a list of {'role': ..., 'content': ...} messages"),
    ([{"role": "user"}], "message 0 (user) has content None; it must be text"),
    ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'; use one of system, user, assistant, tool"),
    (["hello"], "message 0 of the conversation is 'hello'; each message must be a dict with 'role' and 'content'"),
    ([{"role": "user", "content": "x", "extra": 1}], "message 0 of the conversation is"),
    ([{"role": "system", "content": "x"}], "the conversation has no user message"),
])
def test_malformed_conversations_name_the_row(tmp_path, prompt, message):
    source = write_jsonl(tmp_path / "d.jsonl", [CHAT_ROWS[0], {"prompt": prompt}])
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=source), seed=0)
    assert str(err.value).startswith(f"{tmp_path / 'd.jsonl'}:2")
    assert message in str(err.value)


def test_mixed_text_and_conversations_are_refused(tmp_path):
    rows = [*CHAT_ROWS[:3], {"prompt": "What is 1 + 1?", "answer": "2"}]
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source="python:rows"), seed=0, rows=rows)
    assert str(err.value) == (
        "training row 3 of 'python:rows' has text as its prompt, but training row 0 (and 2 more) has a conversation; "
        "a dataset's prompts must all be text or all be conversations (lists of messages)")


def test_conversations_are_held_out_by_content(tmp_path):
    # the same conversation in train and eval_rows is trained on only once: held-out prompts never appear in training
    train, held_out = load_rows(DataConfig(source="python:rows"), seed=0, rows=CHAT_ROWS, eval_rows=CHAT_ROWS[:2])
    assert [r["prompt"] for r in held_out] == [r["prompt"] for r in CHAT_ROWS[:2]]
    assert [r["prompt"] for r in train] == [r["prompt"] for r in CHAT_ROWS[2:]]


# ------------------------------------------------------------------------------------- held-out rows
def test_user_rows_are_held_out_only_when_asked(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    for cfg in (DataConfig(source="python:rows"), DataConfig(source=source)):
        train, held_out = load_rows(cfg, seed=0, rows=rows)
        assert (len(train), len(held_out)) == (20, 0)
    train, held_out = load_rows(DataConfig(source=source, eval_size=5), seed=0)
    assert (len(train), len(held_out)) == (15, 5)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_gym_tasks_keep_their_held_out_split():
    train, held_out = load_rows(DataConfig(source="task:arithmetic", level=2, train_size=10), seed=0)
    assert len(held_out) == DEFAULT_EVAL_SIZE == 200 and len(train) == 10


# ------------------------------------------------------------------------------------- trainers and evaluation
def tiny(**sections) -> Config:
    base = {"model": {"name": "tiny-llama", "system_prompt": "Be brief."}, "sampling": {"max_new_tokens": 4},
            "algorithm": {"group_size": 2, "prompts_per_step": 2}, "train": {"steps": 1, "progress": False},
            "eval": {"before": False, "n_prompts": 2, "batch_size": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Config(**base)


def test_grpo_and_ppo_train_on_conversations(tmp_path):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(prompts)
        return [0.5] * len(completions)

    for name, cls, algorithm in (("grpo", GRPOTrainer, {}), ("ppo", PPOTrainer, {"name": "ppo", "group_size": 1})):
        seen.clear()
        trainer = cls(tiny(algorithm=algorithm), tmp_path / name, reward_funcs=[spy, contains_answer],
                      train_dataset=CHAT_ROWS[2:], eval_dataset=CHAT_ROWS[:2])
        rows = trainer.train()
        assert rows[0]["step"] == 1 and rows[-1]["eval/n"] == 2, name
        assert all(p in [r["prompt"] for r in CHAT_ROWS[2:]] for p in seen[0]), name


def test_evaluation_renders_conversations_with_the_chat_template():
    model, tok = load_model("tiny-llama")
    got = []

    def spy(prompts, completions, **kwargs):
        got.append((prompts, completions))
        return [1.0] * len(completions)

    out = evaluate(model, tok, CHAT_ROWS[:3], WeightedReward("spy", spy), system_prompt=None, max_new_tokens=3, batch_size=2)
    assert out["eval/n"] == 3 and out["eval/accuracy"] == 1.0
    assert [p for prompts, _ in got for p in prompts] == [r["prompt"] for r in CHAT_ROWS[:3]]
    assert all(c[0]["role"] == "assistant" for _, completions in got for c in completions)


def test_too_few_rows_for_a_step_says_nothing_was_held_out(tmp_path):
    with pytest.raises(DataError, match=r"has 1 training prompt\(s\) after holding out data.eval_size=\(unset: 200 from a gym "
                                        r"task, none from your rows\) for evaluation, fewer than one step's algorithm.prompts_per_step=2"):
        GRPOTrainer(tiny(), tmp_path / "run", train_dataset=CHAT_ROWS[:1], reward_funcs=[contains_answer])
    assert not (tmp_path / "run").exists()
