"""A traced step (``train.trace_steps``, ``trainers/trace.py``) records what the step computed, and changes none
of it:

* the traced per-token contributions w·L sum to the logged loss and policy loss, the traced KL averages to the
  logged KL, and the traced clipping sides count to the logged clip fractions, on the tiny model under GRPO,
  Dr. GRPO, a process reward, two epochs of two minibatches (ratios away from 1, clipping), PPO (the critic's
  frozen warm-up step and a trained one), RFT's supervised loss and a run whose responses call a tool;
* each token's contribution is its weight times its policy loss plus the algorithm's extra loss; tokens
  outside the loss (a tool's result) contribute exactly 0;
* the advantages of a hand-built group (a reward function that returns fixed numbers) are the formula's;
* a run with tracing on logs the same numbers as one without, and tracing off writes nothing.

The runs are the golden runs' settings (``tests/golden/runs.py``), trained once per module.
"""

import copy

import pytest
import torch

from cohortrl.config import Config, ConfigError
from cohortrl.trainers import make_trainer
from cohortrl.trainers.trace import CLIP_SIDES, TRACE_DIR, load_trace, reconcile
from tests.golden.rewards import starts_with_letter, starts_with_vowel
from tests.golden.runs import BASE, PROCESS_REWARD, ROWS, RUNS, THREADS
from tests.trainers.test_grpo import VOLATILE

TRACED = {  # name: (the golden run's settings, more settings)
    "grpo": (RUNS["grpo"], {}),
    "dr_grpo": (RUNS["dr_grpo"], {"algorithm": {"estimator": "dr_grpo", "aggregation": "seq-mean-token-sum-norm"}}),
    "grpo_process": (RUNS["grpo_process"], {}),
    "grpo_epochs2": (RUNS["grpo_epochs2"], {"algorithm": {"epochs": 2, "minibatches": 2, "clip_low": 0.1,
                                                          "clip_high": 0.4, "dual_clip": 1.5}}),
    "kl_in_reward": (RUNS["kl_in_reward"], {}),
    "ppo": (RUNS["ppo"], {}),
    "rft": ({"algorithm": {"name": "rft", "beta": 0.0}}, {}),
}


@pytest.fixture(autouse=True)
def one_thread_no_plots(monkeypatch):
    monkeypatch.setattr("cohortrl.trainers.loop.plot_curves", lambda run_dir: None)
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def config(name: str, trace_steps=(1, 2), steps: int = 2) -> dict:
    cfg = copy.deepcopy(BASE)
    run, more = TRACED[name]
    for section in {**run, **more}:
        cfg[section] = {**cfg.get(section, {}), **run.get(section, {}), **more.get(section, {})}
    cfg["train"] = {**cfg["train"], "steps": steps, "trace_steps": list(trace_steps)}
    return cfg


def train(run_dir, cfg, **kwargs) -> list[dict]:
    trainer = make_trainer(cfg, run_dir, reward_funcs=kwargs.pop("reward_funcs", [starts_with_letter, starts_with_vowel]),
                           reward_weights=kwargs.pop("reward_weights", [1.0, 0.5]), train_dataset=ROWS, **kwargs)
    try:
        return [r for r in trainer.train() if "loss" in r]
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory):
    """Each run of ``TRACED`` (and one with tools), trained once: name → (run directory, logged step rows)."""
    cache = {}

    def get(name):
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(name)
            torch.set_num_threads(THREADS)
            cache[name] = (run_dir, tool_run(run_dir) if name == "tools" else train(run_dir, config(name)))
        return cache[name]

    return get


def tool_run(run_dir) -> list[dict]:
    """GRPO on the scripted tiny model that calls the calculator in every response (tests/rollout/test_tools.py)."""
    from cohortrl.trainers.grpo import GRPOTrainer
    from tests.rollout.test_tools import _says_five, scripted

    model, tok = scripted({"What is": "x = <call>calculator: 2+3</call>\nANSWER: 5\n"}, bias=10.0)
    cfg = Config(model={"name": "tiny-llama", "system_prompt": None}, data={"eval_size": 0},
                 sampling={"max_new_tokens": 56}, rollout={"tools": ["calculator"]},
                 algorithm={"group_size": 4, "prompts_per_step": 2, "beta": 0.04}, optim={"lr": 1e-3},
                 train={"steps": 1, "progress": False, "trace_steps": [1]}, eval={"before": False, "n_prompts": 0})
    rows = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(12)]
    trainer = GRPOTrainer(cfg, run_dir, model=model, tokenizer=tok, reward_funcs=[_says_five], train_dataset=rows)
    try:
        return [r for r in trainer.train() if "loss" in r]
    finally:
        trainer.close()


def close(traced: float, logged: float, scale: float) -> bool:
    """Equal to float32 rounding of a sum whose terms have absolute sum ``scale``."""
    return abs(traced - logged) <= 1e-6 * scale + 1e-9


@pytest.mark.parametrize("name", [*TRACED, "tools"])
def test_traced_contributions_sum_to_the_logged_loss_kl_and_clip_fractions(traced_runs, name):
    run_dir, rows = traced_runs(name)
    for row in rows:
        if name == "tools" and row["step"] != 1:
            continue
        trace = load_trace(run_dir, row["step"])
        assert trace["step"] == row["step"] and trace["updates"]
        r = reconcile(trace)
        scale = r["abs"] * len(trace["updates"])
        assert close(r["loss"], row["loss"], scale), (r["loss"], row["loss"])
        if row["policy_loss"] is not None:
            assert close(r["policy"], row["policy_loss"], scale), (r["policy"], row["policy_loss"])
            assert abs(r["loss"] - r["policy"] - r["extra"]) <= 1e-6 * scale + 1e-9
        if name == "rft":  # no KL term, nothing logged as kl
            assert r["kl"] is None and "kl" not in row
        else:
            assert r["kl"] == pytest.approx(row["kl"], rel=1e-5, abs=1e-9)
        loss_tokens = int(trace["loss_mask"].sum()) * trace["settings"]["epochs"]
        for k, side in ((1, "low"), (2, "high")):
            clipped = sum(int(((u["tensors"]["clip"] == k) & (torch.nan_to_num(u["tensors"]["loss_mask"]) > 0)).sum())
                          for u in trace["updates"] if "clip" in u["tensors"])
            if row[f"clip_frac_{side}"] is not None:
                assert clipped / loss_tokens == pytest.approx(row[f"clip_frac_{side}"], abs=1e-7), side
            if name == "grpo_epochs2":  # at LR 1e-2 the second epoch's ratios pass both clip bounds
                assert clipped > 0, side
        if name == "grpo_epochs2" and row["step"] == 1:  # and one passes the dual clip's c = 1.5
            assert any(int((u["tensors"]["clip"] == 3).sum()) for u in trace["updates"])
        for u in trace["updates"]:
            t = u["tensors"]
            trained = ~torch.isnan(t["weight"])
            if "clip" in t:
                assert_clip_sides_are_where_the_loss_was_cut(trace, t)
            # each token: w · (policy loss + extra loss), 0 where its weight is 0 (outside the loss)
            total_BT = t["policy_loss"] + (t["extra_loss"] if "extra_loss" in t else 0)
            expected = torch.where(t["weight"] != 0, t["weight"] * total_BT, 0.0)
            assert torch.allclose(t["contribution"][trained], expected[trained], rtol=1e-6, atol=1e-12)
            assert (t["contribution"][trained & (t["loss_mask"] == 0)] == 0).all()


def assert_clip_sides_are_where_the_loss_was_cut(trace, t) -> None:
    """Each side's tokens carry the clipped surrogate's value at that side's bound: low −(1 − ε_low)·A, high
    −(1 + ε_high)·A, dual −c·A; an unclipped token −ρ·A."""
    s, A = trace["settings"], trace["advantages"]
    in_loss = torch.nan_to_num(t["loss_mask"]) > 0
    bound = {0: t["ratio"], 1: torch.full_like(A, 1 - s["clip_low"]), 2: torch.full_like(A, 1 + s["clip_high"]),
             3: torch.full_like(A, s["dual_clip"] or float("nan"))}
    for side, ratio in bound.items():
        where = in_loss & (t["clip"] == side)
        assert torch.allclose(t["policy_loss"][where], -(ratio * A)[where], rtol=1e-5, atol=1e-7), CLIP_SIDES[side]


def test_a_run_with_tools_traces_the_tool_results_outside_the_loss(traced_runs):
    run_dir, rows = traced_runs("tools")
    trace = load_trace(run_dir, 1)
    tool = trace["tool_mask"].bool()
    assert tool.any() and int(trace["tool_calls"].sum()) > 0
    update = trace["updates"][0]["tensors"]
    assert (trace["loss_mask"][tool] == 0).all() and (update["contribution"][tool] == 0).all()
    assert (update["weight"][tool] == 0).all()
    # the tool's result is among the response's tokens as text (the calculator answered 5)
    i = int(tool.any(-1).nonzero()[0])
    text = "".join(tok for tok, is_tool in zip(trace["tokens"][i], tool[i].tolist()) if is_tool)
    assert "5" in text


def test_ppo_traces_the_critic_the_kl_penalised_token_rewards_gae_and_returns(traced_runs):
    run_dir, rows = traced_runs("ppo")
    from cohortrl.algorithms import gae_advantages, outcome_token_rewards

    for step in (1, 2):
        trace, d = load_trace(run_dir, step), load_trace(run_dir, step)["detail"]
        s, mask = trace["settings"], trace["response_mask"]
        # r_t = score on the last token − β·KL_t; A, R = GAE(r, V); the step trained on A whitened
        expected_r = outcome_token_rewards(d["score"], mask) - float(d["kl_coef"]) * d["kl"]
        assert torch.allclose(d["token_rewards"], expected_r, atol=1e-6)
        adv, ret = gae_advantages(d["token_rewards"], trace["values"], mask, s["gamma"], s["lam"])
        assert torch.equal(adv, d["gae_advantages"]) and torch.equal(ret, trace["returns"])
        assert not torch.equal(trace["advantages"], d["gae_advantages"])  # whitened
    frozen = load_trace(run_dir, 1)["updates"][0]["tensors"]
    assert "logp" not in frozen and "extra/value_loss" in frozen  # the critic's warm-up step: no policy term


def positional(prompts, completions, **columns):
    """A hand-built batch of two groups of four: group 0 scores 1, 0, 0.5, 0; group 1 scores 1 each."""
    return [[1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0][i % 8] for i in range(len(completions))]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_a_hand_built_groups_advantages_in_the_trace_are_the_formula(tmp_path, estimator):
    cfg = config("grpo", trace_steps=[1], steps=1)
    cfg["algorithm"]["estimator"] = estimator
    train(tmp_path, cfg, reward_funcs=[positional], reward_weights=[1.0])
    trace = load_trace(tmp_path, 1)
    # group 0: mean (1 + 0 + 0.5 + 0) / 4 = 0.375; deviations 0.625, −0.375, 0.125, −0.375;
    # sample std sqrt((0.390625 + 0.140625 + 0.015625 + 0.140625) / 3) = sqrt(0.2291667) = 0.4787136
    deviations = torch.tensor([0.625, -0.375, 0.125, -0.375])
    expected = deviations / (0.4787136 + 1e-6) if estimator == "grpo" else deviations  # Dr. GRPO: no std
    expected = torch.cat([expected, torch.zeros(4)])  # group 1 scores alike: advantage 0
    assert trace["group_mean"].tolist() == pytest.approx([0.375, 1.0])
    assert trace["group_std"].tolist() == pytest.approx([0.4787136, 0.0], abs=1e-6)
    assert trace["identical"].tolist() == [False, True]
    mask = trace["response_mask"].bool()
    for i in range(8):
        assert trace["advantages"][i][mask[i]] == pytest.approx(float(expected[i]), abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "grpo_epochs2", "ppo"])
def test_tracing_on_logs_the_same_numbers_as_tracing_off(tmp_path, name, cpu_fast_path_pass):
    on = train(tmp_path / "on", config(name))
    off = train(tmp_path / "off", config(name, trace_steps=()))
    assert len(on) == len(off) == 2
    assert (tmp_path / "on" / TRACE_DIR / "step_2.pt").exists() and not (tmp_path / "off" / TRACE_DIR).exists()
    if name == "grpo":  # the CPU fast path's update through decoding's recorded forward was traced, too
        assert all(r["rollout_forward_reused"] for r in on) == (cpu_fast_path_pass == "auto")
    for a, b in zip(on, off):
        assert {k: v for k, v in a.items() if not k.startswith(VOLATILE)} == {
            k: v for k, v in b.items() if not k.startswith(VOLATILE)}


def test_a_resumed_run_may_trace_steps_the_first_part_did_not(tmp_path):
    """Tracing changes no number, so --resume accepts a new train.trace_steps (the config check allows it)."""
    cfg = config("grpo", trace_steps=(), steps=2)
    trainer = make_trainer(cfg, tmp_path, reward_funcs=[starts_with_letter], train_dataset=ROWS)
    trainer.train(steps=1)
    trainer.close()
    cfg["train"]["trace_steps"] = [2]
    rows = train(tmp_path, cfg, reward_funcs=[starts_with_letter], reward_weights=[1.0], resume=True)
    assert [r["step"] for r in rows] == [2]
    assert load_trace(tmp_path, 2)["step"] == 2 and not (tmp_path / TRACE_DIR / "step_1.pt").exists()


def test_trace_steps_are_counted_from_one():
    with pytest.raises(ConfigError, match="train.trace_steps"):
        Config.from_dict({"train": {"trace_steps": [0, 2]}})
    assert CLIP_SIDES[1:] == ("low", "high", "dual")
