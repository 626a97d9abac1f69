"""Generation with vLLM (GPU only): a colocated engine beside the trainer, weights synced after updates.

``sampling.backend: vllm`` swaps this engine in for the HF one (``rollout/engine.py``'s interface); the trainer
does not know which engine it has beyond one difference: vLLM returns the log-probability of every sampled token
under *its* numerics (kernels, precision), which differ slightly from the trainer's. The trainer therefore
computes log π_old with its own forward pass and corrects the mismatch with truncated importance sampling
(``algorithms.truncated_importance_weights``).

Only vLLM's public interfaces are used (the ``vllm`` extra pins the version, see ``pyproject.toml``):

* the engine is ``vllm.LLM`` with ``logprobs_mode="processed_logprobs"``: the log-probs of the distribution
  actually sampled from, after temperature (vLLM V1's default, ``raw_logprobs``, is before temperature, while
  the trainer's log π_old divides the logits by the temperature, so at T ≠ 1 every importance weight would be
  biased). Top-p and top-k are applied too; the trainer's log π_old does not truncate, so with
  ``sampling.top_p`` < 1 or ``top_k`` > 0 the weights carry that difference as well;
* weight sync is ``LLM.collective_rpc``, vLLM's call into its workers, on a method this module mixes into
  each worker through the engine argument ``worker_extension_cls`` (``WeightSyncExtension``; vLLM's RLHF
  examples use the same hook). It works whether vLLM V1 runs its engine in a subprocess (its default) or in
  the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The weights travel as CPU tensors, in buckets
  of ``SYNC_BUCKET_BYTES``, because the engine process receives them serialised (a CUDA tensor cannot be);
  a step's sync therefore copies the model to host memory and back once.

After each optimiser step the policy's weights go to the engine; a LoRA policy is merged on the fly
(W + B·A·α/r, computed from the adapter's tensors, without touching the training model), so the engine always
serves one plain set of weights.

Under torchrun this backend is refused when the run starts (``trainers/loop.py``): each rank would start its own
engine, and FSDP2 would hand it sharded weights.

Not run in this repository's CI (no GPU, no vLLM); tests exercise this file against a stand-in ``vllm``
module with the same public interface (``tests/rollout/vllm_standin.py``).
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


SYNC_BUCKET_BYTES = 1 << 29  # 512 MiB of weights per collective_rpc call: bounds the serialised copy in flight


class WeightSyncExtension:
    """Mixed into each vLLM worker (``LLM(worker_extension_cls=...)``): ``self`` is the worker, and its
    ``model_runner.model`` the engine's model, whose ``load_weights`` takes (Hugging Face name, tensor) pairs."""

    def cohortrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


def weight_buckets(state: dict[str, torch.Tensor], bucket_bytes: int = SYNC_BUCKET_BYTES) -> list[list[tuple[str, torch.Tensor]]]:
    """The (name, CPU tensor) pairs of ``state`` in consecutive buckets of at most ``bucket_bytes`` (a tensor
    larger than that is a bucket of its own)."""
    buckets, bucket, size = [], [], 0
    for name, value in state.items():
        nbytes = value.numel() * value.element_size()
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, value.detach().to("cpu").contiguous()))
        size += nbytes
    return buckets + ([bucket] if bucket else [])


class VLLMEngine:
    """A colocated vLLM engine holding a copy of the policy's weights (a ``rollout.engine.RolloutEngine``).
    ``max_model_len``: ``sampling.vllm_max_model_len``, the longest prompt + response it holds a cache for."""

    own_numerics = True  # its log-probs come from vLLM's kernels: the trainer corrects with importance weights
    syncs_weights = True

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
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
        )

    def sync_weights(self, model) -> None:
        """The policy's current weights (merged, for LoRA) into every worker of the engine."""
        for bucket in weight_buckets(merged_state_dict(model)):
            self.llm.collective_rpc("cohortrl_load_weights", args=(bucket,))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def generate(self, rows: list[dict], group_size: int, sampling, *, system_prompt=None, max_prompt_tokens=512,
                 overlong_prompts="reject", seeds: list[int] | None = None, record: bool = False):
        """(rollout, prompts truncated): the same Rollout as ``rollout.hf.generate``, plus the sampler's log-probs
        of the sampled tokens in ``rollout.sampling_logp``. ``seeds``: each prompt's request gets its own
        ``SamplingParams`` with its seed (vLLM pairs a list of them with the prompts one by one). ``record`` asks
        for nothing here: vLLM's forward is not one the update can differentiate (``rollout.replay`` stays None)."""
        prompt_ids, prompt_mask, n_truncated = encode_prompts(
            self.tokenizer, [r["prompt"] for r in rows], system_prompt, max_prompt_tokens, overlong_prompts
        )
        greedy = sampling.temperature == 0
        params = [self.vllm.SamplingParams(
            n=group_size, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True, logprobs=0, seed=seed,
        ) for seed in (seeds if seeds is not None else [None])]
        prompts = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(prompt_ids, prompt_mask)]
        outputs = self.llm.generate(prompts, params if seeds is not None else params[0], use_tqdm=False)
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


    def close(self) -> None:
        """The engine's weights directory goes (vLLM's own processes end with the ``LLM`` object)."""
        self._dir.cleanup()


__all__ = ["VLLMEngine", "VLLMUnavailable", "WeightSyncExtension", "merged_state_dict", "weight_buckets"]
