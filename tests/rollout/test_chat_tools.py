"""Tool calls in the chat protocol, on the tiny model with the Hermes-style template of tests/tools/test_chat.py: a
scripted model's <tool_call> gets its result appended as the template renders a tool message, the masks leave
exactly the template's tool turn out of the loss, failing calls are answered with error texts, and graders read
the responses as they read the text protocol's."""

import re

import pytest
import torch

from cohortrl.models import build_tiny_model
from cohortrl.rollout.hf import Sampling, generate
from cohortrl.rollout.tools import tool_metrics
from cohortrl.tools import Toolset, render, resolve_tools
from tests.rollout.test_tools import HEADER, ScriptedLlama, boom
from tests.tools.test_chat import COMPACT_HERMES_TEMPLATE, HERMES_TEMPLATE, TURN_AFTER, TURN_BEFORE, shout

# The template's tool turn as it sits in the decoded response (special tokens kept).
_TURN = re.compile(re.escape(TURN_BEFORE) + r".*?" + re.escape(TURN_AFTER), re.DOTALL)


class ScriptedChatLlama(ScriptedLlama):
    """``ScriptedLlama`` (tests/rollout/test_tools.py) reading the chat protocol: the response starts at the first
    assistant header after the user's turn, and the template's tool turns in it are not the model's."""

    def _next_uncached(self, prefix: list[int]) -> int | None:
        text = self.tokenizer.decode(prefix)
        question, _, response = text.rpartition("<|im_start|>user\n")[2].partition(HEADER)
        if not _:
            return None
        written = _TURN.sub("", response)
        if TURN_BEFORE[:10] in written:  # inside a tool turn: its tokens are fed, whatever the model says
            return None
        script = next((s for key, s in self.scripts.items() if key in question), None)
        if script is None or not script.startswith(written):
            return None
        rest = script[len(written):]
        return self.tokenizer.eos_token_id if not rest else self.tokenizer(rest, add_special_tokens=False)["input_ids"][0]


def scripted_chat(scripts: dict[str, str]):
    base, tokenizer = build_tiny_model(seed=0)
    tokenizer.chat_template = HERMES_TEMPLATE
    model = ScriptedChatLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.generation_config = base.generation_config
    return model.setup(tokenizer, scripts, 1e4).eval(), tokenizer


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


AREA = f"A = {call('calculator', expression='pi*19^2/4')} mm^2\nANSWER: 283.5\n"
SHOUT = f"say {call('shout', text='hi there')} ok\n"


def test_a_chat_call_gets_the_template_tool_turn_and_only_the_model_is_trained():
    model, tok = scripted_chat({"area": AREA, "shout": SHOUT, "plain": "no tools\n"})
    tools = Toolset(resolve_tools(["calculator", shout]))
    rows = [{"prompt": "area please"}, {"prompt": "shout please"}, {"prompt": "plain please"}]
    rollout, _ = generate(model, tok, rows, 1, Sampling(temperature=1.0, max_new_tokens=160), tools=tools, max_prompt_tokens=1024)

    # the tools are described by the template, not by the text protocol's system-prompt addition
    prompt = tok.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()])
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "area please"}], tools=tools.schemas(),
                                             tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in prompt and "<call>" not in prompt

    # completions: the model's text, each tool turn as <tool_response>RESULT</tool_response>
    assert rollout.completions == [
        AREA.replace("</tool_call>", "</tool_call><tool_response>283.5</tool_response>"),
        SHOUT.replace("</tool_call>", "</tool_call><tool_response>HI THERE</tool_response>"),
        "no tools\n",
    ]
    assert render(rollout.completions[0]) == "A = pi*19^2/4 = 283.5 mm^2\nANSWER: 283.5\n"
    assert render(rollout.completions[0]) == render(
        "A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2\nANSWER: 283.5\n")
    assert rollout.tool_calls.tolist() == [1, 1, 0] and rollout.tool_errors.tolist() == [0, 0, 0]

    for i, (result, script) in enumerate([("283.5", AREA), ("HI THERE", SHOUT)]):
        ids, length = rollout.response_ids[i], int(rollout.sequence_mask[i].sum())
        tool = rollout.tool_mask[i].bool()
        # hand-built: the turn starts on the token after the one that completes </tool_call> ...
        done = next(k for k in range(1, length + 1) if "</tool_call>" in tok.decode(ids[:k]))
        # ... and is the template's text before the result, the result as text, the template's text after it
        turn = (tok(TURN_BEFORE, add_special_tokens=False)["input_ids"]
                + tok(result, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                + tok(TURN_AFTER, add_special_tokens=False)["input_ids"])
        expected = torch.zeros_like(tool)
        expected[done : done + len(turn)] = True
        assert torch.equal(tool, expected)
        assert ids[tool].tolist() == turn
        assert not (rollout.response_mask[i].bool() & tool).any()
        assert torch.equal(rollout.sequence_mask[i].bool(), rollout.response_mask[i].bool() | tool)
        assert int(rollout.lengths[i]) == length - len(turn)  # "generated" leaves the turn out
        # the model's tokens and the turn together are the conversation as the template renders it
        said, _, rest = script.partition("</tool_call>")
        whole = tok.apply_chat_template(
            [{"role": "user", "content": rows[i]["prompt"]}, {"role": "assistant", "content": said + "</tool_call>"},
             {"role": "tool", "content": result}, {"role": "assistant", "content": rest}],
            tools=tools.schemas(), tokenize=False)
        assert prompt.replace("area please", rows[i]["prompt"]) + tok.decode(ids[:length]) + "\n" == whole
    assert rollout.tool_mask[2].sum() == 0
    assert tool_metrics(rollout)["tools/calls_per_response"] == pytest.approx(2 / 3)


def test_bad_unknown_and_raising_calls_are_answered_with_errors():
    scripts = {
        "json": "<tool_call>{oops</tool_call>.", "unknown": f"{call('nope', x=1)}.", "raise": f"{call('boom', text='a')}.",
        "args": f"{call('calculator', expr='1')}.", "twice": f"{call('calculator', expression='1')},{call('calculator', expression='2')}.",
    }
    model, tok = scripted_chat(scripts)
    tools = Toolset(resolve_tools(["calculator", boom]), max_calls=1, timeout_s=5.0)
    rows = [{"prompt": key} for key in scripts]
    rollout, _ = generate(model, tok, rows, 1, Sampling(temperature=0.0, max_new_tokens=300), tools=tools, max_prompt_tokens=1024)
    results = [re.findall(r"<tool_response>(.*?)</tool_response>", c) for c in rollout.completions]
    assert [r[0][:60] for r in results] == [
        "error: the call is not valid JSON (Expecting property name e",
        "error: unknown tool 'nope' (tools: calculator, boom)",
        "error: RuntimeError: tool broke",
        "error: TypeError: calculator() got an unexpected keyword arg",
        "1",
    ]
    assert results[4][1] == "error: no more tool calls in this response (the limit is 1)"
    assert all(c.endswith("</tool_response>.") for c in rollout.completions)  # the model went on after every error
    assert rollout.tool_calls.tolist() == [1, 1, 1, 1, 2] and rollout.tool_errors.tolist() == [1, 1, 1, 1, 1]
    assert not (rollout.response_mask.bool() & rollout.tool_mask.bool()).any()


def test_a_turn_cut_by_the_budget_ends_the_response():
    model, tok = scripted_chat({"area": AREA})
    tools = Toolset(resolve_tools(["calculator"]))
    full, _ = generate(model, tok, [{"prompt": "area"}], 1, Sampling(temperature=0.0, max_new_tokens=160), tools=tools, max_prompt_tokens=1024)
    own = int(full.tool_mask[0].nonzero()[0])  # the model's tokens before the turn
    n_before = len(tok(TURN_BEFORE, add_special_tokens=False)["input_ids"])
    budget = own + n_before + 1  # the turn's head and the result's first token
    cut, _ = generate(model, tok, [{"prompt": "area"}], 1, Sampling(temperature=0.0, max_new_tokens=budget), tools=tools,
                      max_prompt_tokens=1024)
    assert bool(cut.truncated[0]) and int(cut.sequence_mask.sum()) == budget and int(cut.lengths[0]) == own
    first = tok.decode(tok("283.5", add_special_tokens=False, split_special_tokens=True)["input_ids"][:1])
    assert cut.completions[0] == AREA.partition("</tool_call>")[0] + "</tool_call><tool_response>" + first


# ---------------------------------------------------------------------------------------------- step rewards
TWO_CALLS = (f"A = {call('calculator', expression='pi*19^2/4')} mm^2\nB = {call('calculator', expression='2*3')} N\n"
             "ANSWER: 6\n")


def line_steps(prompts, completions, **columns):
    """A process reward for the test: every line of the completion is a step worth 1."""
    from cohortrl.step_spans import split_steps

    return [[(1.0, span) for span in split_steps(c)] for c in completions]


def test_step_rewards_land_on_the_token_that_ends_the_step_after_tool_turns(tmp_path):
    """The completion writes each tool turn as <tool_response>RESULT</tool_response> while the tokens hold the
    template's turn: a step's character span is mapped through the ends generation recorded, not by decoding
    the tokens, so each step reward lands on the model's token that completes the step's line."""
    from cohortrl.config import Config
    from cohortrl.rollout.types import token_char_ends
    from cohortrl.step_spans import step_end_tokens
    from cohortrl.trainers.grpo import GRPOTrainer
    from cohortrl.trainers.metrics import PhaseTimer

    model, tok = scripted_chat({"two": TWO_CALLS})
    tok.chat_template = COMPACT_HERMES_TEMPLATE  # the tools by name: the prompt fits the tiny model with the response
    cfg = Config(
        model={"name": "tiny-llama", "system_prompt": None},
        data={"eval_size": 0, "max_prompt_tokens": 512},
        sampling={"max_new_tokens": 300},
        rollout={"tools": ["calculator"]},
        reward={"process": {"name": "tests.rollout.test_chat_tools:line_steps"}},
        algorithm={"estimator": "grpo_process", "group_size": 2, "prompts_per_step": 1},
        train={"steps": 1, "progress": False},
        eval={"before": False, "n_prompts": 0},
    )
    trainer = GRPOTrainer(cfg, tmp_path, model=model, tokenizer=tok, reward_funcs=[lambda prompts, completions, **kw: [1.0] * len(completions)],
                          train_dataset=[{"prompt": "two calls please"}])
    batch = trainer.sampler.sample(trainer.step_count, PhaseTimer())  # with its step rewards (reward.process)
    rollout = batch.rollout
    completion = rollout.completions[0]
    assert completion == TWO_CALLS.replace(
        "</tool_call> mm", "</tool_call><tool_response>283.5</tool_response> mm").replace(
        "</tool_call> N", "</tool_call><tool_response>6</tool_response> N")
    assert [completion[a:b] for _, (a, b) in line_steps([""], [completion])[0]] == completion.rstrip("\n").split("\n")

    # Hand-built: the model's own runs of tokens (between tool turns), and in each the token completing a line.
    ids = rollout.response_ids[0].tolist()
    own = rollout.response_mask[0].tolist()
    runs, k = [], 0
    while k < len(ids):
        if own[k]:
            start = k
            while k < len(ids) and own[k]:
                k += 1
            runs.append(list(range(start, k)))
        k += 1

    def completing(run: list[int], text: str) -> int:
        return next(p for j, p in enumerate(run) if text in tok.decode([ids[q] for q in run[: j + 1]]))

    assert len(runs) == 3
    want = [completing(runs[1], " mm^2"), completing(runs[2], " N"), completing(runs[2], "ANSWER: 6")]
    assert batch.step_ends[0] == want and batch.step_ends[1] == want  # both responses of the group
    assert len(rollout.char_ends(0, tok)) == int(rollout.sequence_mask[0].sum())  # one end per token
    assert all(own[k] for k in want)
    # Decoding every token instead (what the trainer did before) reads the template's turns, longer than
    # <tool_response>RESULT</tool_response>, and puts every step's reward on an earlier token.
    spans = [span for _, span in line_steps([""], [completion])[0]]
    decoded = step_end_tokens(spans, token_char_ends(tok, ids[: int(rollout.sequence_mask[0].sum())]))
    assert all(d < w for d, w in zip(decoded, want))
    # select and concat keep each row's ends
    picked = rollout.select([1])
    assert picked.char_ends(0, tok) == rollout.char_ends(1, tok)
    joined = type(rollout).concat([picked, rollout], tok.pad_token_id)
    assert joined.char_ends(0, tok) == joined.char_ends(2, tok) == rollout.char_ends(0, tok)
