"""The vLLM backend without vLLM: a clear error when it is missing, the LoRA merge used for weight sync equals
PEFT's own merge, and the generator turns (stand-in) engine outputs into the same Rollout as the HF backend,
with the sampler's log-probs and truncation flags, and syncs weights into the engine's model."""

import copy
import sys
import types

import pytest
import torch

from cohortrl.config import SamplingConfig
from cohortrl.models import load_model
from cohortrl.rollout.vllm import VLLMGenerator, VLLMUnavailable, merged_state_dict


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
        VLLMGenerator(model, tokenizer)


def test_lora_merge_for_sync_equals_peft_merge():
    model, _ = lora_model()
    ours = merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(reference)
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6)
    assert any("lora" in k for k in model.state_dict())  # the training model keeps its adapter


class FakeVLLM:
    """The parts of vllm the backend uses: LLM(...).generate, SamplingParams, and the engine's model."""

    def __init__(self):
        self.loaded = []
        fake = self

        class Logprob:
            def __init__(self, logprob):
                self.logprob = logprob

        class LLM:
            def __init__(self, **kwargs):
                fake.init_kwargs = kwargs
                engine_model = types.SimpleNamespace(load_weights=lambda items: fake.loaded.append(dict(items)))
                runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=engine_model))
                self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=runner)))

            def generate(self, prompts, params, use_tqdm=False):
                fake.prompts, fake.params = prompts, params
                outs = []
                for p_index, _ in enumerate(prompts):
                    samples = []
                    for j in range(params.n):
                        ids = [5 + p_index, 6 + j, 7][: 1 + (j % 3)]
                        samples.append(types.SimpleNamespace(
                            token_ids=ids, text=f"p{p_index}s{j}", finish_reason="length" if len(ids) == 3 else "stop",
                            logprobs=[{t: Logprob(-0.1 * (k + 1))} for k, t in enumerate(ids)],
                        ))
                    outs.append(types.SimpleNamespace(outputs=samples))
                return outs

        class SamplingParams:
            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)

        self.module = types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams)


def test_generator_builds_the_rollout_and_syncs_weights(monkeypatch, tmp_path):
    fake = FakeVLLM()
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    model, tokenizer = lora_model()
    gen = VLLMGenerator(model, tokenizer, gpu_memory_utilization=0.5, seed=3)
    assert fake.init_kwargs["gpu_memory_utilization"] == 0.5 and fake.init_kwargs["seed"] == 3

    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "Name a colour."}]
    rollout, n_truncated = gen.generate(rows, 3, SamplingConfig(temperature=0.7, max_new_tokens=3), seed=11)
    assert fake.params.n == 3 and fake.params.logprobs == 0 and fake.params.seed == 11 and fake.params.max_tokens == 3
    assert n_truncated == 0 and rollout.batch_size == 6 and rollout.group_size == 3
    assert rollout.response_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]] * 2
    assert rollout.truncated.tolist() == [False, False, True] * 2
    assert rollout.response_ids[4, :2].tolist() == [6, 7]  # prompt 1, sample 1: ids [5 + 1, 6 + 1]
    sampling_logp = rollout.sampling_logp
    torch.testing.assert_close(sampling_logp[2], torch.tensor([-0.1, -0.2, -0.3]))
    assert sampling_logp[0, 1:].tolist() == [0.0, 0.0]
    assert [r["prompt"] for r in rollout.rows] == ["What is 2 + 2?"] * 3 + ["Name a colour."] * 3
    # The prompts go in unpadded, as token ids of the chat-formatted text.
    assert fake.prompts[0]["prompt_token_ids"][-1] != tokenizer.pad_token_id

    gen.sync_weights(model)
    assert sorted(fake.loaded[0]) == sorted(copy.deepcopy(model).merge_and_unload().state_dict())
