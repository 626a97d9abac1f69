"""PPO end to end on the tiny model: steps with rule rewards and with a learned reward model, the critic learns
a fixed batch's returns, the adaptive controller steers β, a trivially learnable reward is learned, and runs
resume exactly — all on the step GRPO uses."""

from pathlib import Path

import pytest
import torch

from cohortrl.config import Config
from cohortrl.rewards.functions import make_reward_model
from cohortrl.trainers import make_trainer
from cohortrl.trainers.grpo import GRPOTrainer
from cohortrl.trainers.metrics import PhaseTimer
from cohortrl.trainers.ppo import PPOTrainer

FNS = Path(__file__).parent / "reward_fns.py"
VOLATILE = ("time/", "tokens_per_s", "peak_rss_mb")


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def ppo_config(data, fn="starts_with_letter", **sections) -> Config:
    base = {
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": f"jsonl:{data}", "eval_size": 8},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": f"{FNS}:{fn}"}], "correctness": f"{FNS}:{fn}"},
        "algorithm": {"name": "ppo", "group_size": 1, "prompts_per_step": 8, "beta": 0.05},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Config.from_dict(base)


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    """A randomly initialised one-label LlamaForSequenceClassification with the tiny tokenizer, saved as any
    user's reward model would be."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from cohortrl.models import ALIASES, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tokenizer, spec = build_tiny_tokenizer(), ALIASES["tiny-llama"].tiny
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_make_trainer_picks_the_algorithm(tmp_path, addition_jsonl):
    assert type(make_trainer(ppo_config(addition_jsonl), tmp_path / "ppo")) is PPOTrainer
    grpo = ppo_config(addition_jsonl, algorithm={"name": "grpo", "group_size": 4, "prompts_per_step": 2})
    assert type(make_trainer(grpo, tmp_path / "grpo")) is GRPOTrainer


@pytest.mark.parametrize("lora", [False, True])
def test_a_few_steps_with_rule_rewards_move_policy_and_critic(tmp_path, addition_jsonl, lora, cpu_path):
    cfg = ppo_config(addition_jsonl, model={"lora": {"enabled": lora, "r": 4}}, algorithm={"epochs": 2, "minibatches": 2},
                     train=cpu_path.train)
    trainer = PPOTrainer(cfg, tmp_path)
    policy_before, critic_before = params_of(trainer), {n: p.detach().clone() for n, p in trainer.algorithm.critic.named_parameters()}
    rows = trainer.train()
    assert rows[0]["kl"] == 0.0  # the sampling policy is the reference before the first update
    for r in rows:
        for key in ("loss", "policy_loss", "value_loss", "entropy", "grad_norm", "critic_grad_norm", "kl", "advantage_abs_mean"):
            assert torch.isfinite(torch.tensor(float(r[key]))), key
        assert r["zero_variance_frac"] is None  # G = 1: no groups to speak of
    assert any(not torch.equal(policy_before[n], p) for n, p in params_of(trainer).items())
    assert all(not torch.equal(critic_before[n], p) for n, p in trainer.algorithm.critic.named_parameters() if "value_head" in n)
    # With LoRA the critic is still a full, separate, trainable copy; the reference is the adapter switched off.
    assert not any("lora_" in n for n, _ in trainer.algorithm.critic.named_parameters())
    assert all(p.requires_grad for p in trainer.algorithm.critic.parameters())
    assert (trainer.reference.model is None) == lora
    cpu_path.check(trainer, rows)  # PPO's update runs its own forward on either path


def test_reward_model_scores_at_the_last_token_whatever_the_padding(tiny_reward_model):
    rm = make_reward_model(str(tiny_reward_model), batch_size=8)
    prompts, completions = ["What is 2 + 3?", "What is 7 + 1?", "Sum?"], ["5", "It is 8 because 7 plus 1 is 8.", ""]
    together = rm(prompts, completions)
    alone = [rm([p], [c])[0] for p, c in zip(prompts, completions)]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 4) for s in together)) == 3


def test_a_few_steps_with_a_reward_model_and_a_critic_from_it(tmp_path, addition_jsonl, tiny_reward_model):
    cfg = ppo_config(
        addition_jsonl,
        reward={"functions": [{"name": "reward_model", "kwargs": {"model": str(tiny_reward_model)}}], "correctness": "reward_model"},
        algorithm={"ppo": {"critic_init": str(tiny_reward_model), "missing_eos_penalty": 1.0}},
    )
    trainer = PPOTrainer(cfg, tmp_path)
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model)
    torch.testing.assert_close(trainer.algorithm.critic.value_head.weight, rm.score.weight)  # InstructGPT: V from the RM
    rows = trainer.train()
    for r in rows:
        assert torch.isfinite(torch.tensor([r["loss"], r["value_loss"], r["reward_mean"]])).all()
        assert r["reward_std"] > 0  # the reward model tells responses apart
    # The first step's values are the reward model's scores read at every response token.
    assert rows[0]["value_mean"] != 0.0


def test_critic_loss_falls_on_a_fixed_batch_while_the_policy_warms_up(tmp_path, addition_jsonl, monkeypatch):
    """λ = γ = 1 and β = 0 make the return of every token the response's reward: a fixed regression target."""
    cfg = ppo_config(
        addition_jsonl, algorithm={"beta": 0.0, "ppo": {"lam": 1.0, "critic_warmup_steps": 100, "critic_lr": 3e-3, "vf_coef": 1.0}},
    )
    trainer = PPOTrainer(cfg, tmp_path)
    batch = trainer.sampler.sample(trainer.step_count, PhaseTimer())
    assert 0 < sum(batch.rewards) < len(batch.rewards)
    monkeypatch.setattr(trainer.sampler, "sample", lambda step, timer, record=False: batch)
    policy_before = params_of(trainer)
    losses = [trainer.step()["value_loss"] for _ in range(12)]
    assert losses[-1] < 0.3 * losses[0], losses
    assert all(torch.equal(policy_before[n], p) for n, p in params_of(trainer).items())  # warm-up: policy untouched


def test_the_warm_up_ends_at_the_first_step_whose_explained_variance_reaches_the_target(tmp_path, addition_jsonl,
                                                                                        monkeypatch):
    """critic_warmup_ev: the policy is untouched while the critic's explained variance of the Monte-Carlo returns
    on the step's rollouts (values from before its update) is below the target, and trains from the step that
    reaches it on. λ 0.95: the gate reads the Monte-Carlo return, not the λ-return the critic trains on."""
    cfg = ppo_config(addition_jsonl, algorithm={"beta": 0.0, "ppo": {
        "lam": 0.95, "critic_warmup_steps": 100, "critic_warmup_ev": 0.5, "critic_lr": 3e-3, "vf_coef": 1.0}})
    trainer = PPOTrainer(cfg, tmp_path)
    batch = trainer.sampler.sample(trainer.step_count, PhaseTimer())
    monkeypatch.setattr(trainer.sampler, "sample", lambda step, timer, record=False: batch)
    rows, policies = [], [params_of(trainer)]
    while not rows or rows[-1]["critic_ready"] == 0.0:
        assert len(rows) < 30, [r["explained_variance_mc"] for r in rows]
        rows.append(trainer.step())
        policies.append(params_of(trainer))
    *warm_up, first = rows
    assert warm_up, "the critic reached the target before any warm-up step"
    assert all(r["explained_variance_mc"] < 0.5 and r["policy_loss"] is None for r in warm_up)
    assert all(torch.equal(policies[0][n], p) for n, p in policies[-2].items())  # untouched through the warm-up
    assert first["explained_variance_mc"] >= 0.5 and first["policy_loss"] is not None
    assert any(not torch.equal(policies[-2][n], p) for n, p in policies[-1].items())  # that step trained it
    assert trainer.algorithm.state_dict()["critic_ready"] is True  # a resumed run does not warm up again


def test_the_gate_reads_the_monte_carlo_return_which_a_critic_unrelated_to_the_reward_does_not_explain():
    """Why the warm-up's gate is not the logged explained_variance: GAE's λ-return is built from V, so a V that is
    a random constant per response, unrelated to the score, explains most of the λ-return's variance."""
    from cohortrl.algorithms import gae_advantages, outcome_token_rewards
    from cohortrl.trainers.ppo import _explained_variance

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(64, 200)
    rewards = outcome_token_rewards((torch.rand(64, generator=g) < 0.5).float(), mask)
    values = torch.randn(64, 1, generator=g).expand(64, 200)  # knows nothing of the score
    _, lam_returns = gae_advantages(rewards, values, mask, 1.0, 0.95)
    _, mc_returns = gae_advantages(rewards, values, mask, 1.0, 1.0)
    assert _explained_variance(values, lam_returns, mask) > 0.5
    assert _explained_variance(values, mc_returns, mask) < 0.0


def test_adaptive_controller_moves_beta_toward_the_target(tmp_path, addition_jsonl):
    """β grows while the measured KL is above the target and shrinks while below (Ziegler et al.):
    β_{k+1} = β_k (1 + clip(KL_k / target − 1, ±0.2) · B / horizon)."""
    target, horizon, B = 0.05, 16, 8
    cfg = ppo_config(
        addition_jsonl, train={"steps": 5},
        algorithm={"beta": 0.1, "ppo": {"kl_controller": "adaptive", "target_kl": target, "horizon": horizon}},
    )
    rows = PPOTrainer(cfg, tmp_path).train()
    assert rows[0]["kl_per_response"] == 0.0 and rows[0]["kl_coef"] == 0.1
    for now, after in zip(rows, rows[1:]):
        error = min(max(now["kl_per_response"] / target - 1, -0.2), 0.2)
        assert after["kl_coef"] == pytest.approx(now["kl_coef"] * (1 + error * B / horizon), rel=1e-9)
    moves = [after["kl_coef"] - now["kl_coef"] for now, after in zip(rows, rows[1:])]
    assert moves[0] < 0 and max(moves) > 0, moves  # down at KL = 0, up once the policy has drifted past the target


def test_learns_a_trivially_learnable_reward(tmp_path, addition_jsonl):
    """Reward 1 when the response starts with a digit (about 3% of the random model's responses), one
    response per prompt: only the critic's baseline and GAE tell good tokens from bad."""
    cfg = ppo_config(
        addition_jsonl, fn="starts_with_digit", algorithm={"prompts_per_step": 32, "beta": 0.0}, train={"steps": 50},
    )
    rewards = [r["reward_mean"] for r in PPOTrainer(cfg, tmp_path).train()]
    assert sum(rewards[:5]) / 5 < 0.15
    assert sum(rewards[-5:]) / 5 > 0.7, rewards


def test_resume_after_step_k_reproduces_the_uninterrupted_run(tmp_path, addition_jsonl):
    cfg = ppo_config(
        addition_jsonl, train={"steps": 4, "checkpoint_every": 2},
        algorithm={"epochs": 2, "minibatches": 2, "ppo": {"kl_controller": "adaptive", "horizon": 16, "target_kl": 0.05,
                                                          "critic_warmup_steps": 1}},
    )
    full = PPOTrainer(cfg, tmp_path / "full").train()
    PPOTrainer(cfg, tmp_path / "split").train(steps=2)
    resumed = PPOTrainer(cfg, tmp_path / "split", resume=True).train()
    a, b = ({r["step"]: r for r in rows} for rows in (full, resumed))
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key, value in a[step].items():
            if key.startswith(VOLATILE):
                continue
            assert (b[step][key] is None) if value is None else b[step][key] == pytest.approx(value, abs=1e-6), (step, key)
