"""Generation with vLLM (GPU only): a colocated engine in the trainer's process, weights synced after updates.

``sampling.backend: vllm`` swaps this in for ``rollout.hf.generate``; the trainer does not know which backend
it has beyond one difference: vLLM returns the log-probability of every sampled token under *its* numerics
(kernels, precision), which differ slightly from the trainer's. The trainer therefore computes log π_old with
its own forward pass and corrects the mismatch with truncated importance sampling
(``algorithms.truncated_importance_weights``).

Weight sync: after each optimiser step the policy's weights are written into the engine's model with the
model's own ``load_weights``; a LoRA policy is merged on the fly (W + B·A·α/r, computed from the adapter's
tensors, without touching the training model), so the engine always serves one plain set of weights.

Not run in this repository's CI (no GPU, no vLLM); tests exercise this file against a stand-in ``vllm``
module (``tests/rollout/test_vllm_backend.py``).
"""

from __future__ import annotations

import tempfile

import torch

from cohortrl.rollout.hf import encode_prompts
from cohortrl.rollout.types import Rollout


class VLLMUnavailable(RuntimeError):
    pass


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise VLLMUnavailable(
            "sampling.backend=vllm needs the vllm package and a CUDA GPU (pip install vllm); "
            "use sampling.backend=hf on a CPU"
        ) from None
    return vllm


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The policy's weights as a plain model's state dict: a PEFT LoRA model is merged (W + scale·B·A) into the
    base names; the training model is not modified."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if not hasattr(model, "peft_config"):
        return state
    merged = {}
    lora_parts = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            module, _, rest = key.partition(".lora_A." if ".lora_A." in key else ".lora_B.")
            lora_parts.setdefault(module, {})["A" if ".lora_A." in key else "B"] = value
            continue
        if "lora_" in key:  # dropout / embedding adapters carry no weights we merge
            continue
        merged[key] = value
    config = next(iter(model.peft_config.values()))
    scale = config.lora_alpha / config.r
    for module, parts in lora_parts.items():
        base = f"{module}.base_layer.weight"
        merged[base] = merged[base] + scale * (parts["B"] @ parts["A"]).to(merged[base].dtype)
    # PEFT prefixes: base_model.model.<name>; base_layer.weight -> weight.
    return {_plain_name(k): v for k, v in merged.items()}


def _plain_name(key: str) -> str:
    key = key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".")


def _engine_model(llm):
    """The torch model inside a colocated engine (the attribute path differs between vLLM versions)."""
    paths = (
        "llm_engine.model_executor.driver_worker.model_runner.model",  # V0 engine
        "llm_engine.model_executor.driver_worker.worker.model_runner.model",  # V1, in-process executor
    )
    for path in paths:
        obj = llm
        try:
            for attr in path.split("."):
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            continue
    raise VLLMUnavailable(
        "cannot reach the model inside this vLLM engine to sync weights (tried "
        + ", ".join(paths)
        + "); set VLLM_ENABLE_V1_MULTIPROCESSING=0 for a colocated engine, or pin a vLLM version listed in docs/distributed.md"
    )


class VLLMGenerator:
    """A colocated vLLM engine holding a copy of the policy's weights."""

    def __init__(self, model, tokenizer, *, gpu_memory_utilization: float = 0.3, seed: int = 0, max_model_len: int = 2048):
        vllm = _import_vllm()
        self.vllm, self.tokenizer = vllm, tokenizer
        # The engine loads from a directory: write the current (merged) weights once, then sync in memory.
        self._dir = tempfile.TemporaryDirectory(prefix="cohortrl-vllm-")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.save_pretrained(self._dir.name, state_dict=merged_state_dict(model))
        tokenizer.save_pretrained(self._dir.name)
        self.llm = vllm.LLM(
            model=self._dir.name, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            max_model_len=max_model_len, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        )

    def sync_weights(self, model) -> None:
        _engine_model(self.llm).load_weights(merged_state_dict(model).items())
        if hasattr(self.llm, "reset_prefix_cache"):  # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()

    def generate(self, rows: list[dict], group_size: int, sampling, *, system_prompt=None, max_prompt_tokens=512,
                 overlong_prompts="reject", seed: int | None = None):
        """(rollout, prompts truncated): the same Rollout as ``rollout.hf.generate``, plus the sampler's log-probs
        of the sampled tokens in ``rollout.sampling_logp``."""
        prompt_ids, prompt_mask, n_truncated = encode_prompts(
            self.tokenizer, [r["prompt"] for r in rows], system_prompt, max_prompt_tokens, overlong_prompts
        )
        greedy = sampling.temperature == 0
        params = self.vllm.SamplingParams(
            n=group_size, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True, logprobs=0, seed=seed,
        )
        prompts = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(prompt_ids, prompt_mask)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = [s for out in outputs for s in out.outputs]  # groups contiguous, in prompt order
        T = max(1, max(len(s.token_ids) for s in samples))
        pad = self.tokenizer.pad_token_id
        response_ids = torch.full((len(samples), T), pad, dtype=torch.long)
        response_mask = torch.zeros((len(samples), T), dtype=torch.long)
        sampling_logp = torch.zeros((len(samples), T))
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            response_ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
            response_mask[i, :n] = 1
            # logprobs=0 returns, per position, a dict holding at least the sampled token's Logprob.
            sampling_logp[i, :n] = torch.tensor([pos[tok].logprob for tok, pos in zip(s.token_ids, s.logprobs)])
        truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool)
        rollout = Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
            response_ids=response_ids,
            response_mask=response_mask,
            truncated=truncated,
            completions=[s.text for s in samples],
            group_size=group_size,
            rows=[row for row in rows for _ in range(group_size)],
            sampling_logp=sampling_logp,
        )
        return rollout, n_truncated


__all__ = ["VLLMGenerator", "VLLMUnavailable", "merged_state_dict"]
