"""TRL's spellings on the trainer constructors: args= with GRPOConfig field names, peft_config= a PEFT
LoraConfig; and config-key errors that name cohortrl's key for TRL's."""

import pytest
from peft import LoraConfig

from cohortrl import Config, ConfigError, GRPOTrainer
from cohortrl.trainers.inputs import resolve_inputs
from cohortrl.trl_names import TRL_NAMES

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]


def resolved(**kwargs) -> Config:
    return resolve_inputs(Config(model={"name": "tiny-llama"}), "grpo", **kwargs).config


def test_grpo_config_names_map_onto_the_config():
    cfg = resolved(args={
        "num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 3e-6,
        "max_completion_length": 48, "max_prompt_length": 256, "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28,
        "temperature": 0.9, "top_k": None, "num_iterations": 2, "max_steps": 7, "seed": 3, "report_to": "none",
        "lr_scheduler_type": "cosine", "adam_beta2": 0.99, "loss_type": "dr_grpo", "scale_rewards": "none",
        "importance_sampling_level": "sequence", "mask_truncated_completions": True, "save_steps": 5, "bf16": True,
        "gradient_checkpointing": True,
    })
    a, s, o = cfg.algorithm, cfg.sampling, cfg.optim
    assert (a.group_size, a.prompts_per_step) == (4, 4)  # 8 completions x 2 accumulation / 4 generations
    assert (o.lr, o.schedule, o.betas) == (3e-6, "cosine", [0.9, 0.99])
    assert (s.max_new_tokens, s.temperature, s.top_k, cfg.data.max_prompt_tokens) == (48, 0.9, 0, 256)
    assert (a.beta, a.clip_low, a.clip_high, a.epochs) == (0.0, 0.2, 0.28, 2)
    assert (a.aggregation, a.estimator, a.policy_loss, a.mask_truncated) == ("seq-mean-token-sum-norm", "dr_grpo", "gspo", True)
    assert (cfg.train.steps, cfg.train.seed, cfg.train.checkpoint_every, cfg.train.tensorboard, cfg.train.wandb) == (7, 3, 5, False, False)
    assert cfg.model.dtype == "bfloat16" and cfg.train.activation_checkpointing
    assert resolved(args={"epsilon": 0.3}).algorithm.clip_high == 0.3  # epsilon alone sets both sides


@pytest.mark.parametrize("args, message", [
    ({"logging_steps": 5}, "args=: TRL field(s) ['logging_steps'] have no cohortrl config equivalent"),
    ({"per_device_train_batch_size": 6, "num_generations": 4}, "args=: per_device_train_batch_size x gradient_accumulation_steps = 6 completions is not a multiple of num_generations = 4"),
    ({"loss_type": "sapo"}, "args=: TRL's loss_type='sapo' has no cohortrl equivalent; use one of"),
    ({"report_to": "mlflow"}, "args=: TRL's report_to='mlflow' has no cohortrl equivalent"),
])
def test_args_without_an_equivalent_are_refused(args, message):
    with pytest.raises(ConfigError) as err:
        resolved(args=args)
    assert str(err.value).startswith(message)


def test_a_grpo_config_object_is_refused_with_the_reason():
    class GRPOConfigLike:
        num_generations = 8

    with pytest.raises(ConfigError, match=r"^args= must be cohortrl's GRPOConfig or SFTConfig .* got GRPOConfigLike$"):
        resolved(args=GRPOConfigLike())


def test_reward_weights_in_args_weight_the_functions():
    def a(completions, **kwargs):
        return [0.0] * len(completions)

    def b(completions, **kwargs):
        return [0.0] * len(completions)

    cfg = resolved(reward_funcs=[a, b], args={"reward_weights": [0.5, 2.0]})
    assert [f.weight for f in cfg.reward.functions] == [0.5, 2.0]


def test_peft_lora_config_becomes_model_lora(tmp_path):
    cfg = resolved(peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["v_proj", "q_proj"]))
    lora = cfg.model.lora
    assert (lora.enabled, lora.r, lora.alpha, lora.dropout, lora.target_modules) == (True, 4, 8, 0.05, ["q_proj", "v_proj"])
    assert resolved(peft_config=LoraConfig(r=4, target_modules="all-linear")).model.lora.target_modules == Config().model.lora.target_modules
    with pytest.raises(ConfigError, match=r"^peft_config= sets \['use_dora'\], which cohortrl's LoRA"):
        resolved(peft_config=LoraConfig(r=4, use_dora=True))
    config = Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4}, algorithm={"group_size": 2, "prompts_per_step": 2},
                    train={"steps": 1, "progress": False}, eval={"before": False})
    trainer = GRPOTrainer(config, tmp_path / "run", train_dataset=ROWS, peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and "q_proj" in n for n in trained)


@pytest.mark.parametrize("trl, ours", [("num_generations", "algorithm.group_size"), ("learning_rate", "optim.lr"),
                                       ("max_completion_length", "sampling.max_new_tokens"), ("beta", "algorithm.beta"),
                                       ("per_device_train_batch_size", "algorithm.prompts_per_step"),
                                       ("report_to", "train.tensorboard / train.wandb")])
def test_config_key_errors_name_ours_for_trls(trl, ours):
    assert TRL_NAMES[trl][0] == ours
    with pytest.raises(ConfigError) as err:
        Config.from_dict({trl: 1})
    assert str(err.value).startswith(f"unknown config key '{trl}': '{trl}' is TRL's name; cohortrl's is '{ours}'")
    with pytest.raises(ConfigError, match=f"^unknown config key 'train.{trl}': '{trl}' is TRL's name"):
        Config.from_dict({"train": {trl: 1}})  # in a section too
