"""Supervised fine-tuning on the tiny model: only completion tokens carry loss (hand-checked masks and a
hand-computed cross-entropy), the three TRL data formats, bad rows named, exact resume, the CLI, and RL
(GRPO, PPO) starting from an SFT run's final/ with the SFT model as its KL reference."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cohortrl.config import Config, ConfigError
from cohortrl.data import DataError, render_prompt
from cohortrl.models import ModelLoadError, load_model
from cohortrl.rollout.hf import response_logprobs
from cohortrl.tools import ToolSetupError
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.loop import RunCompleteError
from cohortrl.trainers.run_dir import RunDirectoryError
from cohortrl.trainers.ppo import PPOTrainer
from cohortrl.trainers.sft import SFTTrainer, collate, completion_loss, held_out_row, row_segments, tokenize_example
from tests.golden.runs import SFT_SPAN_ROWS

REPO = Path(__file__).resolve().parents[2]
VOLATILE = ("time/", "tokens_per_s", "peak_rss_mb")


def sft_config(**sections) -> Config:
    base = {
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": "task:arithmetic", "train_size": 24, "eval_size": 4},
        "reward": {"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
        "sampling": {"max_new_tokens": 4},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 4, "batch_size": 4},
        "sft": {"batch_size": 4},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Config.from_dict(base)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def tokens(tokenizer, ids):
    return [tokenizer.decode([i]) for i in ids]


def example(tokenizer, row, system_prompt=None):
    return tokenize_example(tokenizer, row_segments(tokenizer, row, system_prompt, "row 0"), "row 0", 1024)


# ---------------------------------------------------------------------------------------------- the loss
def test_only_completion_tokens_carry_loss_on_a_hand_built_batch(tiny):
    model, tok = tiny
    a = example(tok, {"prompt": "What is 2 + 3?", "completion": "5"})
    b = example(tok, {"prompt": "Then what is 7 * 11 + 1?", "completion": "78"})
    # The prompt is rendered as generation renders it; the completion is what ChatML adds after it.
    assert tok.decode(a.prompt_ids) == render_prompt(tok, "What is 2 + 3?", None)
    assert tokens(tok, a.completion_ids) == ["5", "<|im_end|>", "\n"]
    assert tokens(tok, b.completion_ids) == ["7", "8", "<|im_end|>", "\n"]
    input_ids, attention, completion_ids, loss_mask = batch = collate([a, b], tok.pad_token_id)
    # Hand-checked: a's 3 completion tokens then one pad, b's 4; b's prompt is longer, so a's is left-padded.
    assert loss_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    Tp = input_ids.shape[1] - 4
    assert len(b.prompt_ids) == Tp > len(a.prompt_ids)
    assert attention[0].tolist() == [0] * (Tp - len(a.prompt_ids)) + [1] * (len(a.prompt_ids) + 3) + [0]

    # The loss, by hand: each sequence on its own, cross-entropy of completion token t given everything before it.
    nll = []
    for e in (a, b):
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        logits = model(input_ids=ids).logits[0]
        start = len(e.prompt_ids)
        nll.append(F.cross_entropy(logits[start - 1 : -1], ids[0, start:], reduction="sum"))
    n = 3 + 4
    want = (nll[0] + nll[1]) / n
    got = completion_loss(model, batch, n)
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_gradient_accumulation_gives_the_whole_batch_mean(tmp_path, cpu_path):
    # The same 4 examples as one micro-batch of 4 or two of 2: each token weighs 1/N with N counted over the
    # step, so loss and gradient agree; a mean taken per micro-batch would weigh the shorter one's tokens more.
    words = "the total force on the beam is the load times the length".split()
    rows = [{"prompt": f"Question {i}?", "completion": " ".join(words[:n])} for i, n in enumerate((1, 3, 6, 10))]
    out = []
    for batch_size, grad_accum in ((4, 1), (2, 2)):
        cfg = sft_config(data={"eval_size": None}, sft={"batch_size": batch_size, "grad_accum": grad_accum},
                         train=cpu_path.train)
        trainer = SFTTrainer(cfg, tmp_path / str(batch_size), train_dataset=rows)
        out.append(trainer.step())
    cpu_path.check(trainer, decodes=False)  # steps only, no evaluation
    assert out[0]["tokens"] == out[1]["tokens"]
    assert out[0]["loss"] == pytest.approx(out[1]["loss"], rel=1e-6)
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-5)


def test_a_step_divides_by_its_loss_tokens_on_rows_with_untrained_spans(tmp_path):
    """Rows whose completion holds tokens without loss (a calculator's result; a second user turn between two
    assistant turns): the step's loss is Σ −log p over the loss tokens divided by their count, worked out here
    with a plain forward of each example. On rows without such spans a division by the completions' length
    gives the same number; here it does not."""
    cfg = sft_config(data={"eval_size": None}, sft={"batch_size": 2, "grad_accum": 2})
    trainer = SFTTrainer(cfg, tmp_path, train_dataset=SFT_SPAN_ROWS[:4])  # two of each kind
    model = copy.deepcopy(trainer.model)  # the weights the step computes its loss with
    taken, take = [], trainer.stream.take
    trainer.stream.take = lambda n: taken.extend(take(n)) or taken[-n:]
    row = trainer.step()
    n_loss = sum(sum(e.loss_mask) for e in taken)
    assert len(taken) == 4 and n_loss < sum(len(e.completion_ids) for e in taken)  # untrained tokens inside
    nll = 0.0
    with torch.no_grad():
        for e in taken:
            ids = torch.tensor([e.prompt_ids + e.completion_ids])
            start = len(e.prompt_ids)
            per_token = F.cross_entropy(model(input_ids=ids).logits[0, start - 1:-1], ids[0, start:], reduction="none")
            nll += float((per_token * torch.tensor(e.loss_mask)).sum())
    assert row["tokens"] == n_loss
    assert row["loss"] == pytest.approx(nll / n_loss, rel=1e-5)


def test_no_loss_spans_exclude_every_token_they_touch(tiny):
    _, tok = tiny
    completion = "5 <result>7</result> ok"
    start = completion.index("<result>")
    e = example(tok, {"prompt": "Hi", "completion": completion, "no_loss_spans": [[start, completion.index(" ok")]]})
    assert tokens(tok, e.completion_ids) == ["5", " ", "<", "re", "sul", "t", ">", "7", "<", "/", "re", "sul", "t", ">",
                                             " ", "o", "k", "<|im_end|>", "\n"]
    assert e.loss_mask == [1, 1] + [0] * 12 + [1, 1, 1, 1, 1]


def test_no_token_straddles_a_no_loss_span(tiny):
    # The completion is tokenized in pieces split at the spans, so the trained tokens are exactly the text
    # outside them and the untrained ones exactly the spans. Tokenized whole, SmolLM2 reads "</call><result>"
    # with one "><" token: the ">" closing the call got no loss, and a warm start left its calls unclosed.
    _, tok = tiny
    completion = "5 <result>7</result> ok"
    start = completion.index("<result>")
    e = example(tok, {"prompt": "Hi", "completion": completion, "no_loss_spans": [[start + 1, start + 2]]})  # "r"
    trained = "".join(t for t, m in zip(tokens(tok, e.completion_ids), e.loss_mask) if m)
    untrained = "".join(t for t, m in zip(tokens(tok, e.completion_ids), e.loss_mask) if not m)
    assert untrained == "r"
    assert trained == "5 <esult>7</result> ok<|im_end|>\n"


# ---------------------------------------------------------------------------------------------- formats
def test_conversations_train_on_assistant_turns_only(tiny):
    _, tok = tiny
    chat = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "b?"}, {"role": "assistant", "content": "two"}]
    e = example(tok, {"messages": chat}, system_prompt="Be brief.")
    assert tok.decode(e.prompt_ids) == render_prompt(tok, chat[:1], "Be brief.")  # the system prompt as generation adds it
    trained = "".join(t for t, m in zip(tokens(tok, e.completion_ids), e.loss_mask) if m)
    untrained = "".join(t for t, m in zip(tokens(tok, e.completion_ids), e.loss_mask) if not m)
    assert trained == "one<|im_end|>\ntwo<|im_end|>\n"
    assert untrained == "<|im_start|>user\nb?<|im_end|>\n<|im_start|>assistant\n"
    # Conversational prompt + completion: the prompt's own assistant turn (a worked example) carries no loss.
    e = example(tok, {"prompt": chat[:3], "completion": chat[3:]})
    assert tok.decode(e.prompt_ids) == render_prompt(tok, chat[:3], None)
    assert tokens(tok, e.completion_ids) == ["t", "w", "o", "<|im_end|>", "\n"] and e.loss_mask == [1] * 5
    # Held out for evaluation, a conversation is asked its turns before the last assistant turn.
    assert held_out_row({"messages": chat, "answer": "2"}) == {"prompt": chat[:3], "completion": "two", "answer": "2"}


class FakeDataset:
    """What cohortrl reads of a datasets.Dataset (the package is not installed here)."""

    def __init__(self, rows):
        self.rows, self.column_names = rows, sorted(rows[0])

    def to_list(self):
        return [dict(r) for r in self.rows]


def user_rows(kind: str) -> list[dict]:
    out = []
    for a in range(8):
        q, ans = f"What is {a} + 1?", str(a + 1)
        if kind == "text":
            out.append({"prompt": q, "completion": f"ANSWER: {ans}", "answer": ans})
        elif kind == "messages":
            out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"ANSWER: {ans}"}]})
        else:
            out.append({"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": f"ANSWER: {ans}"}]})
    return out


@pytest.mark.parametrize("kind, container", [("text", "jsonl"), ("messages", "list"), ("conversational", "dataset")])
def test_each_format_trains_from_each_container(tmp_path, kind, container):
    rows = user_rows(kind)
    if container == "jsonl":
        dataset = tmp_path / "sft.jsonl"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
        dataset = str(dataset)
    else:
        dataset = rows if container == "list" else FakeDataset(rows)
    cfg = sft_config(data={"eval_size": 2} if kind == "text" else {"eval_size": None},
                     reward={"functions": [{"name": "accuracy"}], "correctness": "accuracy"})
    trainer = SFTTrainer(cfg, tmp_path / "run", train_dataset=dataset)
    assert len(trainer.stream.rows) == (6 if kind == "text" else 8)
    assert len(trainer.eval_rows) == (2 if kind == "text" else 0)  # own rows: held out only when asked
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rows_logged = trainer.train()
    steps = [r for r in rows_logged if "loss" in r]
    assert len(steps) == 2 and all(r["tokens"] > 0 and r["loss"] > 0 for r in steps)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    if kind == "text":  # the held-out rows were evaluated with the correctness function
        assert [r["eval/n"] for r in rows_logged if "eval/n" in r] == [2]


def test_task_rows_are_reference_solutions_and_never_held_out_problems(tmp_path):
    # Level 1 has a few hundred distinct problems: 300 training draws would meet most of 40 held-out ones.
    trainer = SFTTrainer(sft_config(data={"train_size": 300, "eval_size": 40}, eval={"n_prompts": 40}), tmp_path)
    held_out = {r["prompt"] for r in trainer.eval_rows}
    tok = trainer.tokenizer
    trained = {tok.decode(e.prompt_ids) for e in trainer.stream.rows}
    assert len(held_out) == 40 and not trained & {render_prompt(tok, p, None) for p in held_out}
    assert all(tok.decode(e.completion_ids).startswith("ANSWER: ") for e in trainer.stream.rows)



def test_with_the_calculator_a_warm_start_learns_the_call_form_and_never_the_results(tmp_path):
    cfg = sft_config(data={"source": "task:axial_stress", "train_size": 6, "eval_size": 2}, eval={"n_prompts": 2},
                     rollout={"tools": ["calculator"]}, sft={"batch_size": 2})
    trainer = SFTTrainer(cfg, tmp_path)
    tok = trainer.tokenizer
    # The prompt RL and evaluation show: the tools described after the (empty) system prompt.
    assert trainer.system_prompt.startswith("You can call tools.") and "calculator" in trainer.system_prompt
    for e in trainer.stream.rows:
        assert "You can call tools." in tok.decode(e.prompt_ids)
        text = tok.decode(e.completion_ids)
        assert text.startswith("A = <call>calculator: pi*") and "<result>" in text
        # The tokens that carry loss are the model's own: every "<result>VALUE</result>" is missing from them.
        learned = tok.decode([t for t, m in zip(e.completion_ids, e.loss_mask) if m])
        assert "<call>calculator:" in learned and "</call>" in learned
        assert "result>" not in learned and sum(e.loss_mask) < len(e.loss_mask)
    trainer.train()  # and it trains

def chat_tokenizer():
    """The tiny tokenizer with a Hermes-style template that can drive the chat protocol (tools by name only, so
    a gym prompt fits the tiny model)."""
    from cohortrl.models import build_tiny_tokenizer
    from tests.tools.test_chat import COMPACT_HERMES_TEMPLATE

    tok = build_tiny_tokenizer()
    tok.chat_template = COMPACT_HERMES_TEMPLATE
    return tok


def test_with_chat_tools_a_calculator_call_is_written_as_the_rollout_feeds_it():
    from cohortrl.tools import Toolset, resolve_tools
    from cohortrl.tools.chat import call_text
    from tests.tools.test_chat import TURN_AFTER, TURN_BEFORE

    tok = chat_tokenizer()
    schemas = Toolset(resolve_tools(["calculator"])).schemas()
    said = "x = " + call_text("calculator", {"expression": "2+3"})
    completion = f"{said}<tool_response>5</tool_response> m\nANSWER: 5"
    e = tokenize_example(tok, row_segments(tok, {"prompt": "Hi", "completion": completion}, None, "row 0", schemas),
                         "row 0", 1024)
    # the prompt as the chat protocol's rollout renders it: the template describes the tools
    assert tok.decode(e.prompt_ids) == render_prompt(tok, "Hi", None, schemas)
    assert "calculator" in tok.decode(e.prompt_ids)
    # hand-checked: the model's text through the call (trained), the template's tool turn around the result
    # (untrained), the model's next text and the end of its turn (trained)
    own = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn = own(TURN_BEFORE) + own("5") + own(TURN_AFTER)
    assert e.completion_ids == own(said) + turn + own(" m\nANSWER: 5<|im_end|>\n")
    assert e.loss_mask == [1] * len(own(said)) + [0] * len(turn) + [1] * len(own(" m\nANSWER: 5<|im_end|>\n"))
    untrained = [t for t, m in zip(e.completion_ids, e.loss_mask) if not m]
    assert tok.decode(untrained) == TURN_BEFORE + "5" + TURN_AFTER
    assert "<|im_end|>\n<|im_start|>tool\n<tool_response>\n5\n</tool_response>" in tok.decode(untrained)
    # no_loss_spans are for the text protocol's results
    with pytest.raises(DataError, match="no_loss_spans cannot be combined with chat-protocol tool calls"):
        row_segments(tok, {"prompt": "Hi", "completion": completion, "no_loss_spans": [[0, 1]]}, None, "row 0", schemas)


def test_a_chat_warm_start_example_is_token_for_token_the_rollout_of_its_text():
    """The SFT example of a completion and a chat-protocol rollout in which the model writes that completion's
    own text hold the same tokens, with loss exactly where the rollout's response_mask is 1."""
    from cohortrl.rollout.hf import Sampling, generate
    from cohortrl.tools import Toolset, resolve_tools
    from tests.rollout.test_chat_tools import TWO_CALLS, scripted_chat

    model, tok = scripted_chat({"two": TWO_CALLS})
    tools = Toolset(resolve_tools(["calculator"]))
    rollout, _ = generate(model, tok, [{"prompt": "two calls please"}], 1, Sampling(temperature=0.0, max_new_tokens=300),
                          tools=tools, max_prompt_tokens=1024)
    assert int(rollout.tool_calls[0]) == 2
    e = tokenize_example(tok, row_segments(tok, {"prompt": "two calls please", "completion": rollout.completions[0]},
                                           None, "row 0", tools.schemas()), "row 0", 2048)
    n = int(rollout.sequence_mask[0].sum())
    prompt = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    assert e.prompt_ids == prompt
    assert e.completion_ids[:n] == rollout.response_ids[0, :n].tolist()
    assert e.loss_mask[:n] == rollout.response_mask[0, :n].tolist()
    assert tokens(tok, e.completion_ids[n:]) == ["\n"] and e.loss_mask[n:] == [1]  # ChatML's newline after the end of turn


def test_a_warm_start_writes_the_protocol_rl_resolves(tmp_path):
    cfg = dict(data={"source": "task:axial_stress", "train_size": 4, "eval_size": 2}, eval={"n_prompts": 2},
               sft={"batch_size": 2}, train={"steps": 1})
    chat = SFTTrainer(sft_config(rollout={"tools": ["calculator"]}, **cfg), tmp_path / "chat",
                      model=load_model("tiny-llama")[0], tokenizer=chat_tokenizer())
    assert chat.protocol == "chat" and chat.system_prompt is None  # auto: the template can drive the chat protocol
    tok = chat.tokenizer
    for e in chat.stream.rows:
        prompt, text = tok.decode(e.prompt_ids), tok.decode(e.completion_ids)
        assert "You can call tools." not in prompt and "calculator" in prompt and "<tool_call>" in prompt
        assert text.startswith('A = <tool_call>\n{"name": "calculator", "arguments": {"expression": "pi*')
        assert "<call>" not in text and text.count("<|im_start|>tool\n<tool_response>\n") == 3
        learned = tok.decode([t for t, m in zip(e.completion_ids, e.loss_mask) if m])
        assert learned.count("</tool_call>") == 3 and "tool_response" not in learned and "<|im_start|>" not in learned
    chat.train()  # and it trains

    # text forced on the same model: the text protocol, as on a template without tool calling
    text = SFTTrainer(sft_config(rollout={"tools": ["calculator"], "tool_format": "text"}, **cfg), tmp_path / "text",
                      model=load_model("tiny-llama")[0], tokenizer=chat_tokenizer())
    plain = SFTTrainer(sft_config(rollout={"tools": ["calculator"]}, **cfg), tmp_path / "plain")
    assert text.protocol == plain.protocol == "text" and text.system_prompt.startswith("You can call tools.")
    assert [(e.prompt_ids, e.completion_ids, e.loss_mask) for e in text.stream.rows] == [
        (e.prompt_ids, e.completion_ids, e.loss_mask) for e in plain.stream.rows]
    # chat forced on a template that cannot: refused as RL refuses it
    with pytest.raises(ToolSetupError, match="rollout.tool_format is chat, but the model cannot use it"):
        SFTTrainer(sft_config(rollout={"tools": ["calculator"], "tool_format": "chat"}, **cfg), tmp_path / "no")


# ---------------------------------------------------------------------------------------------- bad data
@pytest.mark.parametrize("row, message", [
    ({"prompt": "What is 1 + 1?"}, "missing column(s) ['completion']"),
    ({"question": "q", "answer": "a"}, "missing column(s) ['prompt', 'completion']"),
    ({"prompt": "What is 1 + 1?", "completion": "  "}, "the completion is '  '"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "again"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, "assistant message 1 of the conversation is empty"),
    ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}]}, "starts with an assistant turn"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "x"}]}, "both be text or both be lists"),
    ({"prompt": "hi", "completion": "abc", "no_loss_spans": [[2, 9]]}, "no_loss_spans is"),
])
def test_bad_rows_name_the_row_and_the_problem(tiny, row, message):
    _, tok = tiny
    with pytest.raises(DataError) as e:
        tokenize_example(tok, row_segments(tok, row, None, "data.jsonl:7"), "data.jsonl:7", 1024)
    assert str(e.value).startswith("data.jsonl:7") and message in str(e.value)


def test_a_bad_row_stops_the_trainer_naming_its_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = user_rows("text")
    rows[2]["completion"] = ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for eval_size in (None, 7):  # a bad row is found whether it is trained on or held out
        with pytest.raises(DataError, match=rf"{path}:3: the completion is ''"):
            SFTTrainer(sft_config(data={"eval_size": eval_size}), tmp_path / "run", train_dataset=str(path))
    with pytest.raises(DataError, match="sft.max_length=8"):
        SFTTrainer(sft_config(sft={"max_length": 8}), tmp_path / "run2", train_dataset=user_rows("text"))
    with pytest.raises(ConfigError, match="'sft.max_length' = 4096: more than tiny-llama's context of 1024"):
        SFTTrainer(sft_config(sft={"max_length": 4096}), tmp_path / "run3")


def test_sft_config_is_validated_like_the_rest():
    with pytest.raises(ConfigError, match="unknown config key 'sft.batch_sise'; did you mean 'sft.batch_size'"):
        sft_config(sft={"batch_sise": 2})
    with pytest.raises(ConfigError, match="'sft.grad_accum' = 0"):
        sft_config(sft={"grad_accum": 0})
    with pytest.raises(ConfigError, match="'model.init' = '/no/such/run/final'"):
        sft_config(model={"init": "/no/such/run/final"})


# ---------------------------------------------------------------------------------------------- resume
def test_resume_reproduces_an_uninterrupted_run(tmp_path, cpu_path):
    # LoRA dropout draws random numbers every step and grad_accum splits each step: both must resume exactly.
    cfg = sft_config(model={"lora": {"enabled": True, "r": 4, "dropout": 0.1}}, sft={"batch_size": 2, "grad_accum": 2},
                     train={"steps": 3, "checkpoint_every": 1, **cpu_path.train},
                     eval={"every": 1, "n_prompts": 2})
    SFTTrainer(cfg, tmp_path / "whole").train()
    SFTTrainer(cfg, tmp_path / "split").train(steps=1)
    resumed = SFTTrainer.resume(tmp_path / "split")
    assert resumed.step_count == 1
    resumed.train()
    cpu_path.check(resumed)  # the resumed run keeps the saved config's path; the evaluations decode

    def rows(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE)} for x in lines]

    whole, split = rows("whole"), rows("split")
    assert len([r for r in whole if "loss" in r]) == 3 and len([r for r in whole if "eval/n" in r]) == 3
    assert whole == split
    assert (tmp_path / "split" / "curves.png").is_file()
    with pytest.raises(RunCompleteError, match="already done 3 step"):
        SFTTrainer.resume(tmp_path / "split").train()
    with pytest.raises(RunDirectoryError, match="already holds a run"):  # a new run never writes over an old one
        SFTTrainer(cfg, tmp_path / "whole")


# ---------------------------------------------------------------------------------------------- RL from SFT
@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """Two short SFT runs on the gym's arithmetic reference solutions: a LoRA adapter and full weights."""
    runs = {}
    for lora in (True, False):
        cfg = sft_config(model={"lora": {"enabled": lora, "r": 4}}, train={"steps": 3})
        runs[lora] = SFTTrainer(cfg, tmp_path_factory.mktemp(f"sft_lora_{lora}"))
        runs[lora].train()
    return runs


def logprobs(model, batch):
    input_ids, attention, completion_ids, _ = batch
    with torch.no_grad():
        return response_logprobs(model, input_ids, attention, completion_ids, share_prompts=False)[0]


@pytest.mark.parametrize("sft_lora, algorithm, rl_lora", [(True, "grpo", True), (False, "grpo", False), (True, "ppo", False)])
def test_rl_starts_from_an_sft_final_dir_and_keeps_the_sft_model_as_reference(tmp_path, sft_runs, tiny, sft_lora, algorithm, rl_lora):
    sft = sft_runs[sft_lora]
    cfg = Config.from_dict({
        "model": {"name": "tiny-llama", "system_prompt": None, "init": str(sft.run_dir / "final"),
                  "lora": {"enabled": rl_lora, "r": 4}},
        "data": {"source": "task:arithmetic", "train_size": 24, "eval_size": 4},
        "reward": {"functions": [{"name": "accuracy", "kwargs": {"mode": "last_number"}}]},
        "sampling": {"max_new_tokens": 4},
        "algorithm": {"name": algorithm, "group_size": 2 if algorithm == "grpo" else 1, "prompts_per_step": 2, "beta": 0.1},
        "train": {"steps": 1, "progress": False},
        "eval": {"before": False, "n_prompts": 0},
    })
    rl = (GRPOTrainer if algorithm == "grpo" else PPOTrainer)(cfg, tmp_path)
    batch = collate(sft.stream.rows[:3], sft.tokenizer.pad_token_id)
    want = logprobs(sft.model, batch)
    with rl.reference() as reference:
        got = logprobs(reference, batch)
    if sft_lora:  # the adapter merged into the weights: the same function up to float rounding
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    else:  # the full weights, loaded as saved
        assert torch.equal(got, want)
    base = logprobs(tiny[0], batch)
    assert (base - want).abs().max() > 1e-3  # SFT moved the model, so the reference could have been wrong
    if algorithm == "grpo":  # the policy starts where the reference is: no KL before the first update
        assert abs(rl.train()[0]["kl"]) < 1e-6


def test_an_sft_adapter_for_another_model_is_refused(sft_runs):
    with pytest.raises(ModelLoadError, match="does not fit model.name 'tiny-llama-4l'"):
        load_model("tiny-llama-4l", init=str(sft_runs[True].run_dir / "final"))


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_sft_trains_evaluates_and_refuses_a_finished_resume(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(sft_config().to_yaml())
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "cohortrl", "sft", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=600)

    out = run(str(config), "--run-dir", "r", "--steps", "2", "sft.batch_size=2")
    assert out.returncode == 0, out.stderr
    assert "step    2: held-out greedy accuracy" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and rows[0]["examples"] == 2
    assert (tmp_path / "r" / "final" / "model.safetensors").is_file() and (tmp_path / "r" / "curves.png").is_file()
    out = run("--run-dir", "r", "--resume", "--steps", "2")  # nothing left to do: said, and not a failure
    assert out.returncode == 0 and "already done 2 step(s)" in out.stdout, out.stderr
    assert not (tmp_path / "r" / "checkpoints" / "step_000003").exists()


def test_sft_with_kl_to_reference_says_where_to_measure_it_before_training(tmp_path):
    cfg = sft_config(eval={"kl_to_reference": True, "pass_k": 2})
    with pytest.raises(ConfigError, match="cohortrl sft keeps no reference model.*cohortrl eval RUN_DIR"):
        SFTTrainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
