"""Tool calls inside rollouts, on the tiny model: a scripted model's calls get the right results appended, the
masks put exactly the tool tokens outside the loss, failing tools are answered with error texts, and a GRPO
run with tools trains and resumes exactly."""

import re

import pytest
import torch
from transformers import LlamaForCausalLM

from cohortrl.cpu import FastPath, kernels
from cohortrl.algorithms import aggregate, get_policy_loss
from cohortrl.cpu.kernels import linear_kernels
from cohortrl.models import build_tiny_model, load_model
from cohortrl.rollout.hf import Sampling, generate, response_logprobs
from cohortrl.rollout.tools import ToolSession, tool_metrics
from cohortrl.rollout.types import Rollout
from cohortrl.tools import Toolset, render, resolve_tools
from tests.cpu.test_decoder import PROMPTS
from tests.cpu.test_replay import build, grads

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch build has no oneDNN linear op")

HEADER = "<|im_start|>assistant\n"


class _Head(torch.nn.Linear):
    """The LM head as a subclass: the trainer then runs the model's own forward (where the script's bias is
    added) instead of applying a plain head itself, and the lean decoder steps aside."""


class ScriptedLlama(LlamaForCausalLM):
    """The tiny random Llama, its logits pushed towards writing a script: at every position, ``bias`` is added to
    the logit of the script's next token given the response so far, tool results skipped (they are not the
    model's). The script is chosen by a key found in the user's message. A large bias writes the script exactly; a
    moderate one strays now and then, so a group's responses differ and carry a gradient.

    The bias depends on every token before a position. With a KV cache, the token ids seen so far are kept in one
    more layer of the cache, which the model's own layers never read, so the cached decoding steps, the
    shared-prompt log-probs (which index the cache out to a group's rows) and a full forward all see the same."""

    def setup(self, tokenizer, scripts: dict[str, str], bias: float):
        self.tokenizer, self.scripts, self.bias, self._memo = tokenizer, scripts, bias, {}
        head = _Head(self.config.hidden_size, self.config.vocab_size, bias=False)
        head.weight = self.model.embed_tokens.weight  # tied, as in the tiny model
        self.lm_head = head
        return self

    def forward(self, input_ids=None, cache=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        ids = input_ids
        if cache is not None:
            as_float = input_ids.float()[:, None, :, None]
            seen, _ = cache.update(as_float, as_float, self.config.num_hidden_layers)
            ids = seen[:, 0, :, 0].long()
        k = out.logits.shape[1]
        bias = torch.zeros_like(out.logits)
        for b in range(ids.shape[0]):
            for j in range(k):
                target = self._next(ids[b, : ids.shape[1] - k + j + 1].tolist())
                if target is not None:
                    bias[b, j, target] = self.bias
        out.logits = out.logits + bias
        return out

    def _next(self, prefix: list[int]) -> int | None:
        key = tuple(prefix)  # the same prefixes come back in every pass over a batch: decode each once
        if key not in self._memo:
            self._memo[key] = self._next_uncached(prefix)
        return self._memo[key]

    def _next_uncached(self, prefix: list[int]) -> int | None:
        text = self.tokenizer.decode(prefix)
        if HEADER not in text:
            return None
        prompt, _, response = text.rpartition(HEADER)
        if response.count("<result>") > response.count("</result>"):
            return None  # inside a tool result: the tokens are fed, whatever the model says
        question = prompt.rpartition("<|im_start|>user\n")[2]  # not the system prompt, which lists the tools
        script = next((s for key, s in self.scripts.items() if key in question), None)
        written = re.sub(r"<result>.*?</result>", "", response, flags=re.DOTALL)
        if script is None or not script.startswith(written):
            return None
        rest = script[len(written):]
        return self.tokenizer.eos_token_id if not rest else self.tokenizer(rest, add_special_tokens=False)["input_ids"][0]


def scripted(scripts: dict[str, str], bias: float = 1e4, seed: int = 0):
    base, tokenizer = build_tiny_model(seed=seed)
    model = ScriptedLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.generation_config = base.generation_config
    return model.setup(tokenizer, scripts, bias).eval(), tokenizer


def shout(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: what to repeat
    """
    return text.upper()


def boom(text: str) -> str:
    """Fail.

    Args:
        text: ignored
    """
    raise RuntimeError("tool broke")


def hang(text: str) -> str:
    """Never return in time.

    Args:
        text: ignored
    """
    import time

    time.sleep(30)


def flood(text: str) -> str:
    """Return far too much.

    Args:
        text: ignored
    """
    return "x" * 10_000


AREA = "A = <call>calculator: pi*19^2/4</call> mm^2\nANSWER: <call>calculator: 2+3</call>\n"
AREA_DONE = "A = <call>calculator: pi*19^2/4</call><result>283.5</result> mm^2\nANSWER: <call>calculator: 2+3</call><result>5</result>\n"


def test_a_scripted_model_gets_the_right_results_appended_and_masked():
    scripts = {"area": AREA, "shout": "say <call>shout: hi there</call> ok\n", "plain": "no tools\n"}
    model, tok = scripted(scripts)
    rows = [{"prompt": "area please"}, {"prompt": "shout please"}, {"prompt": "plain please"}]
    tools = Toolset(resolve_tools(["calculator", shout]))
    rollout, _ = generate(model, tok, rows, 2, Sampling(temperature=1.0, max_new_tokens=120), tools=tools)
    expected = [AREA_DONE] * 2 + ["say <call>shout: hi there</call><result>HI THERE</result> ok\n"] * 2 + ["no tools\n"] * 2
    assert rollout.completions == expected
    assert render(rollout.completions[0]) == "A = pi*19^2/4 = 283.5 mm^2\nANSWER: 2+3 = 5\n"
    assert rollout.tool_calls.tolist() == [2, 2, 1, 1, 0, 0]
    assert rollout.tool_errors.tolist() == [0] * 6
    for i in range(6):
        ids, tool = rollout.response_ids[i], rollout.tool_mask[i].bool()
        # the tool's tokens are exactly the <result> parts, and outside the model's own tokens
        spans = re.findall(r"<result>.*?</result>", rollout.completions[i])
        assert tok.decode(ids[tool]) == "".join(spans)
        assert not (rollout.response_mask[i].bool() & tool).any()
        assert torch.equal(rollout.sequence_mask[i].bool(), rollout.response_mask[i].bool() | tool)
        model_text = tok.decode(ids[rollout.response_mask[i].bool()], skip_special_tokens=True)
        assert model_text == re.sub(r"<result>.*?</result>", "", rollout.completions[i])
        assert int(rollout.lengths[i]) == int(rollout.response_mask[i].sum())  # "generated" leaves tools out
    metrics = tool_metrics(rollout)
    assert metrics["tools/calls_per_response"] == pytest.approx(1.0)  # (2 + 2 + 1 + 1 + 0 + 0) / 6
    assert metrics["tools/error_rate"] == 0.0
    assert metrics["tools/result_tokens_mean"] == pytest.approx(float(rollout.tool_mask.sum()) / 6)


def test_failing_tools_answer_with_errors_and_the_response_goes_on():
    scripts = {"raise": "<call>boom: a</call>.", "hang": "<call>hang: b</call>.", "flood": "<call>flood: c</call>.",
               "unknown": "<call>nope: d</call>.", "twice": "<call>calculator: 1</call>,<call>calculator: 2</call>."}
    model, tok = scripted(scripts)
    tools = Toolset(resolve_tools(["calculator", boom, hang, flood]), max_calls=1, timeout_s=0.5)
    rows = [{"prompt": key} for key in scripts]  # one batch: the calls of one step run together
    rollout, _ = generate(model, tok, rows, 1, Sampling(temperature=0.0, max_new_tokens=100), tools=tools)
    results = [re.findall(r"<result>(.*?)</result>", c) for c in rollout.completions]
    assert results == [
        ["error: RuntimeError: tool broke"],
        ["error: no result within 0.5 s"],
        ["error: the result is 10000 characters long; the limit is 1000"],
        ["error: unknown tool 'nope' (tools: calculator, boom, hang, flood)"],
        ["1", "error: no more tool calls in this response (the limit is 1)"],
    ]
    assert all(c.endswith("</result>.") for c in rollout.completions)  # the model wrote on after every error
    assert rollout.tool_calls.tolist() == [1, 1, 1, 1, 2]
    assert rollout.tool_errors.tolist() == [1, 1, 1, 1, 1]
    assert tool_metrics(rollout)["tools/error_rate"] == pytest.approx(5 / 6)


def spell_eos(text: str) -> str:
    """Return the end-of-turn token's text.

    Args:
        text: ignored
    """
    return "<|im_end|> done"


def test_a_result_never_ends_the_response_even_if_it_spells_eos():
    model, tok = scripted({"eos": "<call>spell_eos: x</call> after\n"})
    tools = Toolset(resolve_tools([spell_eos]))
    rollout, _ = generate(model, tok, [{"prompt": "eos"}], 1, Sampling(temperature=0.0, max_new_tokens=80), tools=tools)
    assert rollout.completions[0].endswith(" after\n")
    assert tok.eos_token_id not in rollout.response_ids[0][rollout.tool_mask[0].bool()].tolist()


def test_the_budget_counts_tool_tokens_and_truncates():
    model, tok = scripted({"area": AREA})
    tools = Toolset(resolve_tools(["calculator"]))
    rollout, _ = generate(model, tok, [{"prompt": "area"}], 1, Sampling(temperature=0.0, max_new_tokens=40), tools=tools)
    # the call is the first 31 tokens; its result (16 tokens) is cut at the budget
    assert int(rollout.sequence_mask.sum()) == 40
    assert int(rollout.lengths[0]) == 31 and int(rollout.tool_mask.sum()) == 9 and bool(rollout.truncated[0])


class _ForcedCalls(ToolSession):
    """A "call" after the third token of every other row, whatever the model wrote: the random tiny models never
    write one, and the fast paths below must handle the fed tokens of its (error) result like any others."""

    def _call_finished(self, i: int) -> bool:
        return i % 2 == 0 and len(self.history[i]) == 3


def _forced_rollout(model, tok, monkeypatch, record=False, lean=True):
    monkeypatch.setattr("cohortrl.rollout.hf.ToolSession", _ForcedCalls)
    rows = [{"prompt": p} for p in PROMPTS]
    with linear_kernels("onednn"):
        torch.manual_seed(0)
        rollout, _ = generate(model, tok, rows, 2, Sampling(temperature=0.8, max_new_tokens=24), record=record,
                              tools=Toolset(resolve_tools(["calculator"])),
                              fast_path=FastPath("onednn", "system") if lean else None)
    assert rollout.tool_mask[0::2].sum() > 0 and rollout.tool_mask[1::2].sum() == 0
    return rollout


@needs_onednn
def test_the_lean_decoder_feeds_tool_tokens_as_transformers_does(monkeypatch):
    model, tok = load_model("tiny-llama-4l", seed=4)
    lean = _forced_rollout(model, tok, monkeypatch)
    plain = _forced_rollout(model, tok, monkeypatch, lean=False)
    assert torch.equal(lean.response_ids, plain.response_ids)
    assert torch.equal(lean.tool_mask, plain.tool_mask) and torch.equal(lean.response_mask, plain.response_mask)


@needs_onednn
@pytest.mark.parametrize("name", ["tiny-llama-4l", "tied", "qwen2+lora"])
def test_the_replayed_backward_skips_tool_tokens_as_autograd_does(name, monkeypatch):
    """train.reuse_rollout_forward with tools: log-probs, entropies and every gradient from decoding's
    recording equal autograd's through transformers over the same responses, tool results included."""
    model, tok = build(name)
    rollout = _forced_rollout(model, tok, monkeypatch, record=True)
    ids, mask, response_ids = rollout.input_ids(), rollout.attention_mask(), rollout.response_ids
    with linear_kernels("onednn"):
        torch.manual_seed(1)
        weights = torch.randn(response_ids.shape) * rollout.response_mask  # any loss through the model's tokens
        model.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(model, ids, mask, response_ids, temperature=0.8, with_entropy=True)
        (weights * logp).sum().backward()
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        logp_r, entropy_r = rollout.replay.logprobs(response_ids, rollout.response_mask, 0.8)
        leaf = logp_r.clone().requires_grad_()
        (weights * leaf).sum().backward()
        rollout.replay.backward(leaf.grad, response_ids, 0.8)
        got = grads(model)
    keep = rollout.response_mask.bool()
    torch.testing.assert_close(logp_r[keep], logp.detach()[keep], rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy_r[keep], entropy[keep], rtol=0, atol=2e-5)
    assert set(got) == set(expected) and expected
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-4 * g.abs().max(), msg=lambda m: f"{n}: {m}")


def test_the_loss_mask_excludes_exactly_the_tool_tokens():
    """A hand-built batch: one response whose tokens 3-5 came from a tool. The loss, its gradient and the
    aggregation see only the model's tokens; the forward still attends to the tool's."""
    model, tok = build_tiny_model(seed=3)
    prompt = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    response = torch.tensor([[40, 41, 42, 43, 44, 45, 46, 47, 2, 0]])  # 8 tokens, EOS (2), one pad
    tool_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 1, 0]])
    rollout = Rollout(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      response_ids=response, response_mask=response_mask, truncated=torch.tensor([False]),
                      completions=[""], group_size=1, tool_mask=tool_mask, tool_calls=torch.tensor([1]),
                      tool_errors=torch.tensor([0]))
    assert rollout.attention_mask()[0, len(prompt):].tolist() == [1] * 9 + [0]  # the tool tokens are attended to
    assert rollout.lengths.tolist() == [6]
    logp, _ = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), response)
    full = torch.log_softmax(model(torch.tensor([prompt + response[0, :9].tolist()])).logits[0, len(prompt) - 1 : -1], -1)
    torch.testing.assert_close(logp[0, :9], full.gather(-1, response[0, :9, None]).squeeze(-1), rtol=0, atol=1e-5)

    logp = logp.detach().requires_grad_()
    loss_BT, _ = get_policy_loss("clip")(logp=logp, old_logp=logp.detach(), advantages=torch.ones_like(logp),
                                         response_mask=rollout.response_mask, clip_low=0.2, clip_high=0.2, dual_clip=None)
    for mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"):
        (grad,) = torch.autograd.grad(aggregate(loss_BT, rollout.response_mask, mode, 10), logp, retain_graph=True)
        assert (grad[0] != 0).tolist() == rollout.response_mask[0].bool().tolist(), mode


def test_the_trainer_trains_on_model_tokens_only_and_logs_tool_metrics(tmp_path):
    from cohortrl.trainers.grpo import GRPOTrainer

    trainer = _tool_trainer(tmp_path, steps=1)
    seen = {}
    generate_, loss_ = trainer.sampler._generate, trainer.policy_loss

    def keep_rollout(rows, seed, record):
        seen["rollout"] = generate_(rows, seed, record)[0]
        return seen["rollout"], 0

    def keep_mask(**kw):
        seen["mask"] = kw["response_mask"].clone()
        return loss_(**kw)

    trainer.sampler._generate, trainer.policy_loss = keep_rollout, keep_mask
    row = trainer.step()
    rollout = seen["rollout"]
    assert rollout.tool_mask.sum() > 0
    assert torch.equal(seen["mask"], rollout.response_mask)  # the loss mask has holes at the tool tokens
    assert not (seen["mask"].bool() & rollout.tool_mask.bool()).any()
    assert row["tools/calls_per_response"] > 0 and row["tools/error_rate"] is not None
    assert row["response_length_mean"] == pytest.approx(rollout.lengths.float().mean().item())
    assert isinstance(trainer, GRPOTrainer)


def _tool_trainer(run_dir, steps: int, resume: bool = False):
    from cohortrl.config import Config
    from cohortrl.trainers.grpo import GRPOTrainer

    model, tok = scripted({"What is": "x = <call>calculator: 2+3</call>\nANSWER: 5\n"}, bias=10.0)
    rows = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(12)]
    cfg = Config(
        model={"name": "tiny-llama", "system_prompt": None},
        data={"eval_size": 0},
        sampling={"max_new_tokens": 56},
        rollout={"tools": ["calculator"]},
        algorithm={"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        optim={"lr": 1e-3},
        train={"steps": steps, "progress": False, "checkpoint_every": 1},
        eval={"before": False, "n_prompts": 0},
    )
    return GRPOTrainer(cfg, run_dir, model=model, tokenizer=tok, reward_funcs=[_says_five], train_dataset=rows,
                       resume=resume)


def _says_five(prompts, completions, **columns):
    return [float("ANSWER: 5" in render(c)) for c in completions]


def test_a_grpo_run_with_tools_resumes_exactly(tmp_path):
    full = _tool_trainer(tmp_path / "full", steps=2).train()
    _tool_trainer(tmp_path / "split", steps=2).train(steps=1)
    resumed = _tool_trainer(tmp_path / "split", steps=2, resume=True).train()
    a = {r["step"]: r for r in full if "loss" in r}
    b = {r["step"]: r for r in resumed if "loss" in r}
    assert sorted(b) == [2]
    assert a[2]["tools/calls_per_response"] > 0 and a[2]["grad_norm"] > 0
    for step in (2,):
        for key, value in a[step].items():
            if key.startswith(("time/", "tokens_per_s", "peak_rss_mb")):
                continue
            assert b[step][key] == pytest.approx(value, abs=1e-6), (step, key)
