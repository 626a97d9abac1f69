"""The rollout engine: what samples a step's responses, behind one interface (:class:`RolloutEngine`).

A trainer builds its engine once (:func:`build_engine`, from ``sampling.backend``) and its sampler calls two
methods: ``generate`` (P rows → a :class:`Rollout` of P·G responses, with the tools and, for an engine whose
numerics are not the trainer's, the log-probability of every sampled token) and ``sync_weights`` (after the
policy changed, before the next ``generate``). What the trainer does differently per engine is read from two
attributes: ``own_numerics`` (its ``rollout.sampling_logp`` come from other kernels or precision: the trainer
computes log π_old with its own forward and corrects with truncated importance weights, unless the update
differentiates the engine's own recorded forward) and ``syncs_weights`` (it samples from its own copy of the
weights, so the sampler calls ``sync_weights`` after every update, and nothing records the policy's forward).

The engines:

- :class:`HFEngine` (``hf``): transformers' forward on the policy itself, in the trainer's process, any device;
  the tools run inside its decoding loop. Handed the run's CPU fast path (``cpu.FastPath``), its decoding step is
  the fast path's lean decoder wherever that computes the model (``rollout/hf.py``'s ``generate_ids`` asks the
  object), and it can record that forward for the update's replayed backward (``record``). Its numerics are its
  own where the fast path's lean decoder multiplies in bf16 (``FastPath.decode_dtype``, training rollouts only);
- ``rollout.vllm.VLLMEngine`` (``vllm``): a colocated vLLM engine with its own copy of the weights, synced in
  memory after each optimiser step; GPU only, no tools (refused by the config).

A new engine (SGLang, a remote server) is a class with these four members, entered in :func:`build_engine`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cohortrl.rollout.hf import Sampling, generate
from cohortrl.rollout.types import Rollout


class RolloutEngine(Protocol):
    # It samples with numerics other than the trainer's: rollout.sampling_logp holds its log-probs (None where a
    # recording of that decoding is kept instead: the update differentiates it, so its log-probs are π_old).
    own_numerics: bool
    syncs_weights: bool  # it samples from its own copy of the weights: sync_weights after the policy changes

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling, *, system_prompt: str | None,
                 max_prompt_tokens: int, overlong_prompts: str, seeds: list[int] | None = None,
                 record: bool = False) -> tuple[Rollout, int]:
        """``group_size`` responses to each row's ``prompt``, groups contiguous, in one batched call: (rollout,
        prompts truncated). ``seeds``: one per row, the seed its group samples with whatever else is in the
        batch (None: the engine's random stream); ``record``: keep the decoding forward for the update (an
        engine that cannot leaves ``rollout.replay`` None)."""
        ...

    def sync_weights(self, model) -> None:
        """The policy's current weights into the engine (a no-op for an engine that samples with the policy)."""
        ...

    def close(self) -> None:
        ...


class HFEngine:
    """transformers' forward on the policy itself (``rollout/hf.py``), with the run's tools and CPU fast path."""

    syncs_weights = False

    def __init__(self, model, tokenizer, *, tools=None, fast_path=None):
        self.model, self.tokenizer, self.tools, self.fast_path = model, tokenizer, tools, fast_path
        self.decode_dtype = fast_path.decode_dtype if fast_path is not None else torch.float32
        # fp32: the trainer's own model and kernels, log π_old of an on-policy step is decoding's; bf16 products
        # are other numerics (a recording of them is what the update differentiates, the trainer decides)
        self.own_numerics = self.decode_dtype != torch.float32

    def generate(self, rows, group_size, sampling, *, system_prompt, max_prompt_tokens, overlong_prompts, seeds=None,
                 record=False):
        return generate(self.model, self.tokenizer, rows, group_size, sampling, system_prompt=system_prompt,
                        max_prompt_tokens=max_prompt_tokens, overlong_prompts=overlong_prompts, record=record,
                        tools=self.tools, fast_path=self.fast_path, seeds=seeds, decode_dtype=self.decode_dtype)

    def sync_weights(self, model) -> None:
        pass  # it samples with the policy itself

    def close(self) -> None:
        pass


def build_engine(cfg, model, tokenizer, *, tools=None, fast_path=None) -> RolloutEngine:
    """The engine ``sampling.backend`` names, for ``model`` (the policy, unwrapped)."""
    s = cfg.sampling
    if s.backend == "vllm":
        from cohortrl.rollout.vllm import VLLMEngine

        return VLLMEngine(model, tokenizer, gpu_memory_utilization=s.vllm_gpu_memory_utilization, seed=cfg.train.seed,
                          max_model_len=s.vllm_max_model_len)
    return HFEngine(model, tokenizer, tools=tools, fast_path=fast_path)
