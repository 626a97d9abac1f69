"""The vLLM backend without vLLM: a clear error when it is missing, the LoRA merge used for weight sync equals
PEFT's own merge, and against a stand-in with vLLM's public interface (``vllm_standin.py``): the generator
builds the same Rollout as the HF backend with the sampled distribution's log-probs, weights reach the engine
through ``collective_rpc`` every step, importance weights of identical policies at temperature 0.7 are 1, and
torchrun with vLLM is refused."""

import copy
import sys

import pytest
import torch

from cohortrl.config import SamplingConfig
from cohortrl.models import load_model
from cohortrl.rollout.hf import response_logprobs
from cohortrl.rollout.vllm import VLLMEngine, VLLMUnavailable, merged_state_dict, weight_buckets
from tests.rollout import vllm_standin


def lora_model():
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model("tiny-llama")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # PEFT starts B at 0; a trained adapter is not
    return model, tokenizer


def test_missing_vllm_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    model, tokenizer = load_model("tiny-llama")
    with pytest.raises(VLLMUnavailable, match=r"sampling.backend=vllm needs the vllm package and a CUDA GPU .*use sampling.backend=hf on a CPU"):
        VLLMEngine(model, tokenizer)


def test_lora_merge_for_sync_equals_peft_merge():
    model, _ = lora_model()
    ours = merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(reference)
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6)
    assert any("lora" in k for k in model.state_dict())  # the training model keeps its adapter


@pytest.fixture
def standin(monkeypatch):
    """The stand-in ``vllm`` (``vllm_standin.py``: vLLM's public interface, the engine out of reach)."""
    module = vllm_standin.module()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_generator_builds_the_rollout_with_the_sampled_distributions_logprobs(standin):
    """The Rollout the HF backend builds, from the engine's outputs: masks, truncation flags, rows; the sampler's
    log-probs are those of the distribution sampled from (temperature 0.7), which the trainer's own forward at
    that temperature reproduces. With a seed per row, a group samples what it samples alone under its seed."""
    model, tokenizer = load_model("tiny-llama")
    gen = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.5, seed=3)
    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "Name a colour."}]
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=5)
    rollout, n_truncated = gen.generate(rows, 3, sampling, seeds=[11, 12])
    assert n_truncated == 0 and rollout.batch_size == 6 and rollout.group_size == 3
    assert [r["prompt"] for r in rollout.rows] == ["What is 2 + 2?"] * 3 + ["Name a colour."] * 3
    lengths = rollout.response_mask.sum(-1)
    assert rollout.truncated.tolist() == (lengths == 5).tolist()
    ours, _ = response_logprobs(model, rollout.input_ids(), rollout.attention_mask(), rollout.response_ids, temperature=0.7)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.sampling_logp[mask], ours[mask], rtol=0, atol=1e-4)
    assert not rollout.sampling_logp[~mask].any()
    alone, _ = gen.generate(rows[1:], 3, sampling, seeds=[12])
    assert alone.completions == rollout.completions[3:]


def test_weights_reach_the_engine_through_collective_rpc_only(standin):
    """Sync goes through ``LLM.collective_rpc`` (the stand-in's engine is out of the caller's reach), in buckets,
    the LoRA adapter merged as PEFT merges it: afterwards the engine samples as the merged model does."""
    model, tokenizer = lora_model()
    plain, _ = load_model("tiny-llama")
    gen = VLLMEngine(plain, tokenizer)  # the engine starts from other weights (no adapter)
    gen.sync_weights(model)
    assert gen.llm.rpc_calls == ["cohortrl_load_weights"]
    merged = copy.deepcopy(model).merge_and_unload()
    rows = [{"prompt": "What is 2 + 2?"}]
    rollout, _ = gen.generate(rows, 2, SamplingConfig(temperature=0.7, max_new_tokens=4))
    ours, _ = response_logprobs(merged, rollout.input_ids(), rollout.attention_mask(), rollout.response_ids, temperature=0.7)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.sampling_logp[mask], ours[mask], rtol=0, atol=1e-4)


def test_weight_buckets_keep_every_tensor_in_order_within_the_size():
    state = {f"w{i}": torch.zeros(n) for i, n in enumerate((10, 10, 30, 5, 5))}  # 40, 40, 120, 20, 20 bytes
    buckets = weight_buckets(state, bucket_bytes=80)
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]


def test_grpo_with_vllm_syncs_each_step_and_weighs_identical_policies_at_1(standin, tmp_path, addition_jsonl):
    """Three GRPO steps sampled by the (stand-in) engine at temperature 0.7: before steps 2 and 3 the updated
    weights reach the engine, so the engine's policy is the trainer's and every truncated importance weight
    min(π_old / π_vLLM, C) is 1 to float rounding. With log-probs before temperature (vLLM's default,
    ``raw_logprobs``, planted) the mean weight of a step was 0.991: this tiny model's near-uniform distributions
    change little with temperature, a trained model's much more."""
    from tests.trainers.test_grpo import tiny_config

    from cohortrl.trainers.grpo import GRPOTrainer

    cfg = tiny_config(addition_jsonl, sampling={"backend": "vllm", "temperature": 0.7, "max_new_tokens": 6},
                      train={"steps": 3, "progress": False}, eval={"n_prompts": 0})
    trainer = GRPOTrainer(cfg, tmp_path / "run")
    rows = [r for r in trainer.train() if "loss" in r]
    assert len(rows) == 3
    assert trainer.engine.llm.rpc_calls == ["cohortrl_load_weights"] * 2
    for row in rows:
        assert row["is_weight_mean"] == pytest.approx(1.0, abs=1e-4), row["is_weight_mean"]
    trainer.close()


def test_vllm_under_torchrun_is_refused_in_one_line(addition_jsonl):
    from tests.trainers.test_grpo import tiny_config

    from cohortrl.config import ConfigError
    from cohortrl.distributed import Dist
    from cohortrl.trainers.loop import _check_distributed

    cfg = tiny_config(addition_jsonl, sampling={"backend": "vllm"})
    with pytest.raises(ConfigError, match=r"^config key 'sampling.backend' = 'vllm': not supported under torchrun .*; "
                                          r"run it in one process, or use sampling.backend=hf under torchrun$"):
        _check_distributed(cfg, "grpo", Dist(rank=0, world=2, launched=True))
    _check_distributed(tiny_config(addition_jsonl), "grpo", Dist(rank=0, world=2, launched=True))


def record_syncs(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Each weight sync's tensors by name, as the engine's workers received them: a spy on the worker extension's
    method (which runs inside the stand-in's engine, after the process boundary), one dict per ``sync_weights``."""
    from cohortrl.rollout.vllm import WeightSyncExtension

    syncs: list[dict] = []
    load, sync = WeightSyncExtension.cohortrl_load_weights, VLLMEngine.sync_weights

    def recording_load(worker, weights):
        syncs[-1].update({name: value.clone() for name, value in weights})
        return load(worker, weights)

    def recording_sync(generator, model):
        syncs.append({})
        return sync(generator, model)

    monkeypatch.setattr(WeightSyncExtension, "cohortrl_load_weights", recording_load)
    monkeypatch.setattr(VLLMEngine, "sync_weights", recording_sync)
    return syncs
