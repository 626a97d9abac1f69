"""Every config error path, with the exact message, before any model is loaded."""

import re

import pytest
import yaml

from cohortrl.config import Config, ConfigError, apply_overrides

ERRORS = [
    ({"algorithm": {"group_sise": 4}}, "unknown config key 'algorithm.group_sise'; did you mean 'algorithm.group_size'?"),
    ({"algoritm": {}}, "unknown config key 'algoritm'; did you mean 'algorithm'?"),
    ({"model": {"lora": {"rank": 4}}}, "unknown config key 'model.lora.rank'; did you mean 'model.lora.r'?"),
    ({"group_size": 3}, "unknown config key 'group_size'; did you mean 'algorithm.group_size'?"),
    ({"reward": {"functions": [{"name": "accuracy", "weigth": 2}]}},
     "unknown config key 'reward.functions[0].weigth'; did you mean 'reward.functions[0].weight'?"),
    ({"zzz": 1}, "unknown config key 'zzz'; valid keys here: algorithm, data, eval, imports, model, optim, reward, rollout, sampling, sft, train"),
    ({"algorithm": {"group_size": "four"}}, "config key 'algorithm.group_size': expected int, got 'four' (str)"),
    ({"train": {"steps": 2.5}}, "config key 'train.steps': expected int, got 2.5 (float)"),
    ({"model": {"lora": {"enabled": "yes"}}}, "config key 'model.lora.enabled': expected bool, got 'yes' (str)"),
    ({"sampling": {"stop": "abc"}}, "config key 'sampling.stop': expected a list of str, got 'abc' (str)"),
    ({"model": "x"}, "config key 'model': expected a mapping, got 'x' (str)"),
    ({"algorithm": {"aggregation": "mean"}},
     "config key 'algorithm.aggregation': expected one of 'seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm', got 'mean' (str)"),
    ({"algorithm": {"dual_clip": "3"}}, "config key 'algorithm.dual_clip': expected float or null, got '3' (str)"),
    ({"algorithm": {"group_size": 1}},
     "config key 'algorithm.group_size' = 1: estimator 'grpo' normalises within a group and needs at least 2 responses "
     "per prompt; set algorithm.group_size >= 2 or use algorithm.estimator=reinforce_pp"),
    ({"algorithm": {"group_size": 0, "estimator": "reinforce_pp"}}, "config key 'algorithm.group_size' = 0: must be at least 1"),
    ({"algorithm": {"clip_high": 0.1}},
     "config key 'algorithm.clip_high' = 0.1: must be >= algorithm.clip_low (0.2); clip-higher widens the upper bound, never narrows it"),
    ({"algorithm": {"clip_low": 1.5, "clip_high": 2.0}}, "config key 'algorithm.clip_low' = 1.5: must be in [0, 1) (the ratio is clipped at 1 - clip_low)"),
    ({"algorithm": {"beta": -0.1}}, "config key 'algorithm.beta' = -0.1: the KL coefficient must be >= 0 (0 disables the KL term)"),
    ({"algorithm": {"dual_clip": 0.5}}, "config key 'algorithm.dual_clip' = 0.5: must be > 1 (typically 3) or null"),
    ({"algorithm": {"estimator": "grp"}},
     "config key 'algorithm.estimator' = 'grp': unknown name; did you mean 'grpo'? registered: grpo, grpo_batch, dr_grpo, rloo, "
     "reinforce_pp, reinforce_pp_baseline, grpo_process, grpo_combined"),
    ({"algorithm": {"policy_loss": "ppo"}}, "config key 'algorithm.policy_loss' = 'ppo': unknown name; registered: clip, gspo"),
    ({"algorithm": {"minibatches": 3}}, "config key 'algorithm.minibatches' = 3: must divide the batch of prompts_per_step x group_size = 32 responses"),
    ({"algorithm": {"minibatches": 8}},
     "config key 'algorithm.minibatches' = 8: each minibatch must hold whole groups of 8; use a divisor of prompts_per_step (4)"),
    ({"algorithm": {"epochs": 0}}, "config key 'algorithm.epochs' = 0: must be at least 1"),
    ({"algorithm": {"micro_batch_size": -1}}, "config key 'algorithm.micro_batch_size' = -1: must be >= 0"),
    ({"algorithm": {"max_resample_draws": -1}}, "config key 'algorithm.max_resample_draws' = -1: must be >= 0"),
    ({"algorithm": {"retire_solved": -1}}, "config key 'algorithm.retire_solved' = -1: must be >= 0 (0 keeps every prompt; 1 retires one at its first group answered right by every response)"),
    ({"algorithm": {"norm_length": 0}}, "config key 'algorithm.norm_length' = 0: must be > 0 or null"),
    ({"algorithm": {"eps": 0}}, "config key 'algorithm.eps' = 0.0: must be > 0"),
    ({"algorithm": {"prompts_per_step": 0}}, "config key 'algorithm.prompts_per_step' = 0: must be at least 1"),
    ({"sampling": {"temperature": -1}}, "config key 'sampling.temperature' = -1.0: must be >= 0 (0 = greedy)"),
    ({"sampling": {"top_p": 0}}, "config key 'sampling.top_p' = 0.0: must be in (0, 1]"),
    ({"sampling": {"top_k": -1}}, "config key 'sampling.top_k' = -1: must be >= 0 (0 disables top-k)"),
    ({"sampling": {"max_new_tokens": 0}}, "config key 'sampling.max_new_tokens' = 0: must be at least 1"),
    ({"optim": {"lr": 0}}, "config key 'optim.lr' = 0.0: must be > 0"),
    ({"optim": {"betas": [0.9]}}, "config key 'optim.betas' = [0.9]: must be two numbers in [0, 1)"),
    ({"optim": {"warmup_steps": -1}}, "config key 'optim.warmup_steps' = -1: must be >= 0"),
    ({"optim": {"max_grad_norm": -1}}, "config key 'optim.max_grad_norm' = -1.0: must be >= 0 (0 disables clipping)"),
    ({"optim": {"schedule": "step"}}, "config key 'optim.schedule': expected one of 'constant', 'linear', 'cosine', got 'step' (str)"),
    ({"data": {"level": 0}}, "config key 'data.level' = 0: levels start at 1"),
    ({"data": {"train_size": -1}}, "config key 'data.train_size' = -1: must be >= 0"),
    ({"data": {"eval_size": -1}}, "config key 'data.eval_size' = -1: must be >= 0"),
    ({"data": {"source": "jsonl:x.jsonl", "eval_level": 1}},
     "config key 'data.eval_level' = 1: applies to task: sources only (other sources: give the held-out rows as eval_dataset= or a jsonl)"),
    ({"data": {"source": "task:axial_stress", "eval_level": 0}},
     "config key 'data.eval_level' = 0: levels start at 1"),
    ({"data": {"source": "jsonl:x.jsonl", "exclude_from_training": {"function": ["f"]}}},
     "config key 'data.exclude_from_training' = {'function': ['f']}: applies to task: sources only (a dataset's own rows: split them yourself)"),
    ({"data": {"source": "task:python_function", "exclude_from_training": {"function": "f"}}},
     "config key 'data.exclude_from_training' = {'function': 'f'}: must map a sample field to a non-empty list of values, e.g. {function: [circle_area]}"),
    ({"data": {"max_prompt_tokens": 0}}, "config key 'data.max_prompt_tokens' = 0: must be at least 1"),
    ({"data": {"source": "csv:x.csv"}}, "config key 'data.source' = 'csv:x.csv': must be task:NAME, jsonl:PATH, hf:DATASET_ID or python:NAME"),
    ({"eval": {"every": -1}}, "config key 'eval.every' = -1: must be >= 0"),
    ({"eval": {"n_prompts": -1}}, "config key 'eval.n_prompts' = -1: must be >= 0"),
    ({"eval": {"pass_k": -1}}, "config key 'eval.pass_k' = -1: must be >= 0"),
    ({"eval": {"batch_size": 0}}, "config key 'eval.batch_size' = 0: must be at least 1"),
    ({"train": {"steps": -1}}, "config key 'train.steps' = -1: must be >= 0"),
    ({"train": {"checkpoint_every": -1}}, "config key 'train.checkpoint_every' = -1: must be >= 0"),
    ({"train": {"max_nonfinite_steps": -1}}, "config key 'train.max_nonfinite_steps' = -1: must be >= 0 (0: never stop)"),
    ({"reward": {"timeout_s": -1}}, "config key 'reward.timeout_s' = -1.0: must be >= 0 (0: no limit)"),
    ({"model": {"lora": {"r": 0}}}, "config key 'model.lora.r' = 0: must be at least 1"),
    ({"reward": {"functions": []}}, "config key 'reward.functions' = []: needs at least one reward function"),
    ({"reward": {"functions": [{"name": ""}]}}, "config key 'reward.functions[0].name' = '': must name a reward function"),
    ({"reward": {"functions": [{"name": "accuracy"}, {"name": "accuracy"}]}},
     "config key 'reward.functions' = ['accuracy']: each reward function may appear once (its name keys its metrics)"),
    ({"reward": {"correctness": "format"}}, "config key 'reward.correctness' = 'format': must be the name of one of reward.functions (accuracy)"),
    ({"sampling": {"vllm_max_model_len": 0}}, "config key 'sampling.vllm_max_model_len' = 0: must be at least 1"),
    ({"sampling": {"backend": "vllm", "vllm_max_model_len": 512}},
     "config key 'sampling.vllm_max_model_len' = 512: shorter than data.max_prompt_tokens + sampling.max_new_tokens "
     "(576), the longest sequence a rollout makes; raise it to 576 or more"),
]


@pytest.mark.parametrize("data, message", ERRORS, ids=[m.split(":")[0][:60] for _, m in ERRORS])
def test_config_errors_name_the_key_the_value_and_the_fix(data, message):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(data)
    assert str(err.value) == message


def test_defaults_are_valid_and_yaml_round_trips(tmp_path):
    cfg = Config()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert Config.from_yaml(path) == cfg


def test_overrides_parse_values_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  group_size: 4\n")
    cfg = Config.from_yaml(path, ["algorithm.group_size=6", "algorithm.beta=0", "sampling.stop=[\"\\n\\n\"]", "model.lora.enabled=true"])
    assert (cfg.algorithm.group_size, cfg.algorithm.beta, cfg.model.lora.enabled) == (6, 0.0, True)
    assert cfg.sampling.stop == ["\n\n"]


def test_a_bare_off_in_yaml_is_the_setting_off_not_false(tmp_path):
    # PyYAML follows YAML 1.1 and reads `cpu_fast_path: off` as False; a setting whose values include "off" means it.
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  cpu_fast_path: off\n")
    assert Config.from_yaml(path).train.cpu_fast_path == "off"
    assert Config.from_dict(apply_overrides({}, ["train.cpu_fast_path=off"])).train.cpu_fast_path == "off"
    with pytest.raises(ConfigError, match=r"config key 'train.cpu_fast_path': expected one of 'auto', 'off', got True"):
        Config.from_dict({"train": {"cpu_fast_path": True}})  # on: not one of its values


def test_exponent_floats_without_a_dot_are_numbers_as_meant():
    # PyYAML follows YAML 1.1 and reads `lr: 1e-4` as the string '1e-4'; users mean 0.0001.
    cfg = Config.from_dict(apply_overrides({"optim": {"lr": "3E-5"}}, ["algorithm.beta=1e-3", "algorithm.clip_low=+2e-1"]))
    assert (cfg.optim.lr, cfg.algorithm.beta, cfg.algorithm.clip_low) == (3e-5, 1e-3, 0.2)
    # Only numbers: other strings still fail with the key named, and ints still want an int.
    with pytest.raises(ConfigError, match=r"config key 'optim.lr': expected float, got 'e-4' \(str\)"):
        Config.from_dict({"optim": {"lr": "e-4"}})
    with pytest.raises(ConfigError, match=r"config key 'algorithm.group_size': expected int, got '1e1' \(str\)"):
        Config.from_dict({"algorithm": {"group_size": "1e1"}})


def test_override_errors():
    with pytest.raises(ConfigError, match=r"override 'algorithm.group_size' must look like key.path=value"):
        apply_overrides({}, ["algorithm.group_size"])
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.gruop_size'; did you mean 'algorithm.group_size'\?"):
        Config.from_dict(apply_overrides({}, ["algorithm.gruop_size=2"]))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml \(give the path of a YAML file"):
        Config.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [1, 2\n")
    with pytest.raises(ConfigError, match=r"config file .*bad.yaml is not valid YAML"):
        Config.from_yaml(bad)
    seq = tmp_path / "seq.yaml"
    seq.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections, got list"):
        Config.from_yaml(seq)


def test_a_python_object_tag_in_a_config_file_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(path)
    assert str(err.value) == (
        f"config file {path} uses a YAML tag that safe loading refuses (could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system'); config files hold plain data only (mappings, lists, "
        "strings, numbers): remove the tag"
    )
    assert not marker.exists()
    # An override is parsed the same safe way: the tag stays a string and nothing runs.
    with pytest.raises(ConfigError, match="config key 'train.seed': expected int"):
        Config.from_dict(apply_overrides({}, [f"train.seed=!!python/object/apply:os.system ['touch {marker}']"]))
    assert not marker.exists()


def test_every_shipped_config_is_valid(tmp_path, monkeypatch):
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert configs
    # A config that starts from a supervised run (model.init) needs that run's final/ to exist, as it would
    # after its documented `cohortrl sft` command: stand one in, relative to the working directory.
    monkeypatch.chdir(tmp_path)
    for path in configs:
        init = yaml.safe_load(path.read_text()).get("model", {}).get("init")
        if init:
            (tmp_path / init).mkdir(parents=True, exist_ok=True)
            (tmp_path / init / "adapter_config.json").write_text("{}")
        Config.from_yaml(path)


def test_the_process_reward_experiment_configs_differ_only_in_the_step_source():
    """configs/process_*.yaml are matched runs: same model, data, budget and outcome reward."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    runs = {name: Config.from_yaml(root / f"process_{name}.yaml").to_dict() for name in ("outcome", "sum", "min", "prm")}
    processes = {name: d["reward"].pop("process") for name, d in runs.items()}
    assert all(d == runs["outcome"] for d in runs.values())
    assert processes["outcome"]["coef"] == 0.0  # a probe: plain GRPO advantages, detectors logged
    assert {(p["name"], p["credit"]) for name, p in processes.items() if name != "outcome"} == {
        ("task_steps", "sum"), ("task_steps", "min"), ("learned_prm", "min")}


# PPO (algorithm.name=ppo): its own section, validated only when PPO is chosen; G = 1 is allowed.
PPO_ERRORS = [
    ({"gamma": 1.5}, "config key 'algorithm.ppo.gamma' = 1.5: must be in [0, 1]"),
    ({"lam": -0.1}, "config key 'algorithm.ppo.lam' = -0.1: must be in [0, 1]"),
    ({"vf_coef": 0}, "config key 'algorithm.ppo.vf_coef' = 0.0: must be > 0 (the critic learns only from the value loss)"),
    ({"value_clip": 0}, "config key 'algorithm.ppo.value_clip' = 0.0: must be > 0 or null (no clipping)"),
    ({"critic_lr": 0}, "config key 'algorithm.ppo.critic_lr' = 0.0: must be > 0 or null (use optim.lr)"),
    ({"critic_warmup_steps": -1}, "config key 'algorithm.ppo.critic_warmup_steps' = -1: must be >= 0"),
    ({"critic_warmup_ev": 1.5}, "config key 'algorithm.ppo.critic_warmup_ev' = 1.5: must be at most 1 (a perfect "
     "critic explains all the variance) or null"),
    ({"critic_warmup_ev": 0.3}, "config key 'algorithm.ppo.critic_warmup_steps' = 0: must be > 0 with critic_warmup_ev: "
     "it is the most warm-up steps to wait"),
    ({"target_kl": 0}, "config key 'algorithm.ppo.target_kl' = 0.0: must be > 0 (nats per response)"),
    ({"horizon": 0}, "config key 'algorithm.ppo.horizon' = 0: must be at least 1"),
    ({"missing_eos_penalty": -1},
     "config key 'algorithm.ppo.missing_eos_penalty' = -1.0: is subtracted from the reward, so give it as a number >= 0 (or null to disable)"),
    ({"critic_init": "/no/such/rm"},
     "config key 'algorithm.ppo.critic_init' = '/no/such/rm': must be 'policy' or a directory with a sequence-classification "
     "checkpoint (config.json not found there)"),
    ({"kl_controller": "pid"}, "config key 'algorithm.ppo.kl_controller': expected one of 'fixed', 'adaptive', got 'pid' (str)"),
    ({"gama": 1.0}, "unknown config key 'algorithm.ppo.gama'; did you mean 'algorithm.ppo.gamma'?"),
]


@pytest.mark.parametrize("ppo, message", PPO_ERRORS, ids=[m.split(":")[0][:60] for _, m in PPO_ERRORS])
def test_ppo_config_errors_name_the_key_the_value_and_the_fix(ppo, message):
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"algorithm": {"name": "ppo", "ppo": ppo}})
    assert str(err.value) == message


def test_an_explained_variance_warm_up_needs_a_constant_schedule():
    ppo = {"name": "ppo", "ppo": {"critic_warmup_steps": 10, "critic_warmup_ev": 0.3}}
    assert Config.from_dict({"algorithm": ppo}).algorithm.ppo.critic_warmup_ev == 0.3
    with pytest.raises(ConfigError, match="optim.schedule' = 'cosine': must be constant with algorithm.ppo.critic_warmup_ev"):
        Config.from_dict({"algorithm": ppo, "optim": {"schedule": "cosine"}})


def test_ppo_allows_one_response_per_prompt_and_grpo_does_not():
    cfg = Config.from_dict({"algorithm": {"name": "ppo", "group_size": 1, "prompts_per_step": 8}})
    assert cfg.algorithm.group_size == 1
    with pytest.raises(ConfigError, match="estimator 'grpo' normalises within a group"):
        Config.from_dict({"algorithm": {"name": "grpo", "group_size": 1}})


def test_unknown_algorithm_name_and_zero_variance_with_groups_of_one():
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"algorithm": {"name": "dpo"}})
    assert str(err.value) == "config key 'algorithm.name': expected one of 'grpo', 'ppo', 'rft', got 'dpo' (str)"
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"algorithm": {"name": "ppo", "group_size": 1, "zero_variance": "filter"}})
    assert str(err.value) == (
        "config key 'algorithm.zero_variance' = 'filter': a group of one response always has zero variance, so every "
        "group would be dropped; set algorithm.group_size >= 2 or algorithm.zero_variance=keep"
    )



def test_ppo_settings_are_checked_even_when_grpo_runs():
    with pytest.raises(ConfigError, match=r"'algorithm.ppo.gamma' = 2.0: must be in \[0, 1\]"):
        Config.from_dict({"algorithm": {"ppo": {"gamma": 2.0}}})


def test_one_kl_estimator_with_a_default_per_trainer_and_the_old_ppo_key_still_loads(caplog):
    assert Config.from_dict({}).algorithm.kl_kind == "k3"  # GRPO: k3 in the loss
    assert Config.from_dict({"algorithm": {"name": "ppo"}}).algorithm.kl_kind == "k1"  # PPO: k1 in the reward
    assert Config.from_dict({"algorithm": {"name": "ppo", "kl_estimator": "k3"}}).algorithm.kl_kind == "k3"
    # A saved PPO config from before holds both keys; PPO used its own, so that one wins.
    old = Config.from_dict({"algorithm": {"name": "ppo", "kl_estimator": "k3", "ppo": {"kl_estimator": "k2"}}})
    assert old.algorithm.kl_kind == "k2"
    assert "'algorithm.ppo.kl_estimator' is deprecated: write algorithm.kl_estimator" in caplog.text
    assert Config.from_dict({"algorithm": {"ppo": {"kl_estimator": "k1"}}}).algorithm.kl_kind == "k3"  # unused by GRPO
    with pytest.raises(ConfigError, match="config key 'algorithm.kl_estimator': expected one of 'k1', 'k2', 'k3'"):
        Config.from_dict({"algorithm": {"name": "ppo", "ppo": {"kl_estimator": "k4"}}})


@pytest.mark.parametrize("algorithm, message", [
    ({"policy_loss": "gspo", "estimator": "reinforce_pp"},
     "config key 'algorithm.policy_loss' = 'gspo': needs one advantage per response, but estimator 'reinforce_pp' gives advantages that vary"),
    ({"policy_loss": "gspo", "estimator": "grpo_combined"}, "but estimator 'grpo_combined' gives advantages that vary along the response"),
    ({"policy_loss": "gspo", "name": "ppo"}, "but PPO's GAE gives advantages that vary along the response"),
    ({"name": "ppo", "estimator": "rloo"},
     "config key 'algorithm.estimator' = 'rloo': is GRPO's setting; PPO's advantages are GAE from its critic"),
])
def test_the_registry_refuses_what_an_estimator_or_loss_cannot_do(algorithm, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.from_dict({"algorithm": algorithm, "reward": {"process": {"name": "task_steps"}}})


def test_config_asks_the_registry_what_a_users_estimator_and_loss_need():
    from cohortrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from cohortrl.algorithms import register_advantage_estimator, register_policy_loss

    @register_advantage_estimator("test_needs_steps", groups=True, steps=True)
    def needs_steps(**kwargs):
        return None

    @register_policy_loss("test_sequence_loss", sequence_advantages=True)
    def sequence_loss(**kwargs):
        return None

    try:
        with pytest.raises(ConfigError, match="'algorithm.estimator' = 'test_needs_steps': uses step rewards"):
            Config.from_dict({"algorithm": {"estimator": "test_needs_steps"}})
        with pytest.raises(ConfigError, match="'algorithm.group_size' = 1: estimator 'test_needs_steps' normalises"):
            Config.from_dict({"algorithm": {"estimator": "test_needs_steps", "group_size": 1},
                              "reward": {"process": {"name": "task_steps"}}})
        with pytest.raises(ConfigError, match="'test_sequence_loss': needs one advantage per response"):
            Config.from_dict({"algorithm": {"estimator": "reinforce_pp", "policy_loss": "test_sequence_loss"}})
        assert Config.from_dict({"algorithm": {"policy_loss": "test_sequence_loss"}}).algorithm.estimator == "grpo"
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_needs_steps", None)
        POLICY_LOSSES.pop("test_sequence_loss", None)
