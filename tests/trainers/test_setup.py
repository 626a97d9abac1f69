"""What a trainer is built from reaches what it builds: the model section reaches ``load_model``, functions
given in Python (tools) reach the rollout, the policy's seed decides a random model's weights. The step's own
wiring is in ``test_wiring.py``; the optimiser and LR schedule in ``test_optimizer.py``."""

import json

import pytest
import torch

from cohortrl.rewards.scoring import RewardFunctionError
from cohortrl.trainers import rl, setup
from cohortrl.trainers.grpo import GRPOTrainer
from tests.trainers.test_grpo import FNS, tiny_config


def spy_on_load_model(module, monkeypatch, tmp_path) -> tuple[list, str]:
    """Record ``module.load_model``'s calls; returns them and a ``model.init`` directory the config accepts
    (the spy loads without it: only that it is passed on matters)."""
    calls, real = [], module.load_model

    def spy(name, **kwargs):
        calls.append((name, kwargs))
        return real(name, **{**kwargs, "init": None})

    monkeypatch.setattr(module, "load_model", spy)
    init = tmp_path / "sft" / "final"
    init.mkdir(parents=True)
    (init / "config.json").write_text("{}")  # what the config's check looks for; never loaded here
    return calls, str(init)


def test_the_model_section_reaches_load_model(tmp_path, addition_jsonl, monkeypatch):
    calls, init = spy_on_load_model(setup, monkeypatch, tmp_path)
    cfg = tiny_config(addition_jsonl, model={"dtype": "bfloat16", "init": str(init)}, train={"seed": 3, "steps": 1})
    trainer = GRPOTrainer(cfg, tmp_path / "run")
    assert calls == [("tiny-llama", {"dtype": "bfloat16", "seed": 3, "init": [str(init)]})]  # no chain under it
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("seed, same", [(0, True), (1, False)])
def test_train_seed_decides_a_random_models_initial_weights(tmp_path, addition_jsonl, seed, same):
    first = GRPOTrainer(tiny_config(addition_jsonl, train={"seed": 0}), tmp_path / "a")
    second = GRPOTrainer(tiny_config(addition_jsonl, train={"seed": seed}), tmp_path / "b")
    pairs = zip(first.model.state_dict().values(), second.model.state_dict().values())
    assert all(torch.equal(x, y) for x, y in pairs) == same


def test_a_tool_given_in_python_reaches_the_rollout(tmp_path, addition_jsonl):
    """A function defined in a test has no importable name: it is found only through what was passed in."""

    def shout(text: str) -> str:
        """Upper-case the text.

        Args:
            text: what to upper-case
        """
        return text.upper()

    trainer = GRPOTrainer(tiny_config(addition_jsonl, train={"steps": 1}), tmp_path, tools=[shout])
    assert [t.name for t in trainer.tools.tools] == ["shout"]
    assert trainer.sampler.engine.tools is trainer.tools  # the rollout engine runs them


def test_a_process_reward_function_gets_the_reward_timeout(tmp_path, addition_jsonl):
    from tests.golden.runs import PROCESS_REWARD

    cfg = tiny_config(addition_jsonl, reward={"process": PROCESS_REWARD, "timeout_s": 7.0},
                      algorithm={"estimator": "grpo_process"}, train={"steps": 1})
    trainer = GRPOTrainer(cfg, tmp_path)
    assert trainer.process.name == PROCESS_REWARD["name"] and trainer.process.timeout_s == 7.0
    assert trainer.sampler.process is trainer.process


def test_the_vllm_engine_gets_the_configured_memory_share_and_seed(tmp_path, addition_jsonl, monkeypatch):
    """With the stand-in engine of ``tests/rollout/vllm_standin.py`` in place of vllm."""
    import sys

    from tests.rollout import vllm_standin

    module, engine_args = vllm_standin.module(), {}

    class RecordingLLM(vllm_standin.LLM):
        def __init__(self, **kwargs):
            engine_args.update(kwargs)
            super().__init__(**kwargs)

    module.LLM = RecordingLLM
    monkeypatch.setitem(sys.modules, "vllm", module)
    cfg = tiny_config(addition_jsonl, sampling={"backend": "vllm", "vllm_gpu_memory_utilization": 0.55,
                                                "vllm_max_model_len": 1024}, train={"seed": 5, "steps": 1})
    GRPOTrainer(cfg, tmp_path)
    assert engine_args["gpu_memory_utilization"] == 0.55 and engine_args["seed"] == 5
    assert engine_args["max_model_len"] == 1024


def test_reward_workers_score_the_functions_loaded_by_name(tmp_path, addition_jsonl):
    """``reward.workers``: the functions named in the config run in worker processes; a function given in
    Python stays in the trainer (it may not be importable by name)."""
    from tests.trainers.reward_fns import starts_with_vowel

    by_name = GRPOTrainer(tiny_config(addition_jsonl, reward={"workers": 1}, train={"steps": 1}), tmp_path / "a")
    try:
        assert [s[0] for s in by_name.sampler.pool.specs] == [by_name.cfg.reward.functions[0].name]
        assert by_name.sampler.pool.workers == 1
    finally:
        by_name.close()
    in_memory = GRPOTrainer(tiny_config(addition_jsonl, reward={"workers": 1}, train={"steps": 1}), tmp_path / "b",
                            reward_funcs=[starts_with_vowel])
    try:
        assert in_memory.sampler.pool is None
    finally:
        in_memory.close()


def test_build_policy_loads_what_the_model_section_names(tmp_path, addition_jsonl, monkeypatch):
    """The SFT trainer's path: no model given, so ``build_policy`` loads it."""
    calls, init = spy_on_load_model(setup, monkeypatch, tmp_path)
    cfg = tiny_config(addition_jsonl, model={"dtype": "bfloat16", "init": str(init)})
    model, _ = setup.build_policy(cfg.model, seed=3)
    assert calls == [("tiny-llama", {"dtype": "bfloat16", "seed": 3, "init": [str(init)]})]  # no chain under it
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.training


def lora_policy(addition_jsonl):
    lora = {"enabled": True, "r": 4, "alpha": 12, "dropout": 0.25, "target_modules": ["o_proj", "up_proj"]}
    return setup.build_policy(tiny_config(addition_jsonl, model={"lora": lora}).model, seed=0)[0]


def test_the_lora_section_reaches_the_adapter(addition_jsonl):
    from peft import PeftModelForCausalLM
    from peft.tuners.lora import LoraLayer

    model = lora_policy(addition_jsonl)
    assert isinstance(model, PeftModelForCausalLM)  # task_type CAUSAL_LM: generate() and the LM head's loss
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    # not PEFT's default for a Llama (q_proj, v_proj): the configured modules, in every layer
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"o_proj", "up_proj"}
    assert len(adapted) == 2 * model.config.num_hidden_layers
    for m in adapted.values():
        assert m.r["default"] == 4 and m.lora_A["default"].weight.shape[0] == 4
        assert m.scaling["default"] == 12 / 4  # alpha / r
        assert m.lora_dropout["default"].p == 0.25
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_the_reference_is_a_frozen_copy_or_with_lora_the_policy_without_its_adapter(addition_jsonl):
    from peft.tuners.lora import LoraLayer

    from cohortrl.models import load_model

    policy, _ = load_model("tiny-llama")
    reference = setup.Reference(policy, lora=False)
    with reference() as model:
        assert model is reference.model and model is not policy and not model.training
    own = {p.data_ptr() for p in policy.parameters()}
    assert all(not p.requires_grad and p.data_ptr() not in own for p in reference.model.parameters())
    for p, q in zip(policy.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)

    policy = lora_policy(addition_jsonl)
    reference = setup.Reference(policy, lora=True)
    assert reference.model is None  # no second copy: the base weights never change
    layer = next(m for m in policy.modules() if isinstance(m, LoraLayer))
    with reference() as model:
        assert model is policy and layer.disable_adapters
    assert not layer.disable_adapters


@pytest.mark.parametrize("reward, rows, message", [
    ({"name": "accuracy"}, {"prompt": "What is 2 + 3?", "solution": "5"},
     "reward function 'accuracy' reads the column(s) ['answer'], which the training rows do not have (they have: "
     "solution); add the column(s) to the data, set data.answer_column to the column holding the reference answers, "
     "or change the function (a parameter without a default is read as the column of its name)"),
    ({"name": "accuracy", "kwargs": {"answer_column": "gold"}}, {"prompt": "What is 2 + 3?", "answer": "5"},
     "reward function 'accuracy' reads the column(s) ['gold'], which the training rows do not have (they have: "
     "answer); add the column(s) to the data, "
     "or change the function (a parameter without a default is read as the column of its name)"),
    ({"name": "task"}, {"prompt": "What is 2 + 3?", "answer": "5"},
     "reward function 'task' reads the column(s) ['sample'], which the training rows do not have (they have: "
     "answer); add the column(s) to the data, train on a gym task (data.source: task:NAME), whose rows carry "
     "'sample', "
     "or change the function (a parameter without a default is read as the column of its name)"),
    ({"name": f"{FNS}:reads_difficulty"}, {"prompt": "What is 2 + 3?", "answer": "5"},
     f"reward function '{FNS}:reads_difficulty' reads the column(s) ['difficulty'], which the training rows do not "
     "have (they have: answer); add the column(s) to the data, "
     "or change the function (a parameter without a default is read as the column of its name)"),
])
def test_a_reward_that_reads_a_column_the_rows_lack_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, reward, rows, message
):
    """A reward declares the columns it reads (its named parameters; accuracy's is its answer_column setting), and
    the trainer refuses rows without them at setup, with the fix, instead of a KeyError in the first step."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**rows, "prompt": f"What is {i} + 3?"}) + "\n" for i in range(20)))
    calls, _ = spy_on_load_model(setup, monkeypatch, tmp_path)
    cfg = tiny_config(data, reward={"functions": [reward], "correctness": reward["name"]}, eval={"n_prompts": 0})
    with pytest.raises(RewardFunctionError) as refused:
        GRPOTrainer(cfg, tmp_path / "run")
    assert str(refused.value) == message
    assert calls == []  # refused before any model loaded
    assert not (tmp_path / "run").exists()  # and the run directory it claimed is gone


def test_the_rows_a_reward_reads_pass_and_held_out_rows_are_checked_too(tmp_path, addition_jsonl, monkeypatch):
    ok = tiny_config(addition_jsonl, reward={"functions": [{"name": "accuracy"}], "correctness": "accuracy"})
    assert GRPOTrainer(ok, tmp_path / "ok").rewards[0].name == "accuracy"  # the rows have 'answer'
    held_out = [{"prompt": "What is 2 + 3?"}]  # no answer: the correctness reward cannot score it
    with pytest.raises(RewardFunctionError, match=r"^reward function 'accuracy' reads the column\(s\) \['answer'\], "
                                                  r"which the held-out rows do not have \(they have: only the prompt\)"):
        GRPOTrainer(ok, tmp_path / "held_out", eval_dataset=held_out)


def test_a_process_reward_that_reads_a_column_the_rows_lack_is_refused(tmp_path, addition_jsonl):
    cfg = tiny_config(addition_jsonl, algorithm={"estimator": "grpo_process"}, reward={"process": {"name": "task_steps"}})
    with pytest.raises(RewardFunctionError, match=r"^reward function 'task_steps' reads the column\(s\) \['sample'\], "
                                                  r"which the training rows do not have"):
        GRPOTrainer(cfg, tmp_path / "run")
