"""A stand-in ``vllm`` module for CPU tests, with the public interface cohortrl uses and nothing else.

What it keeps of vLLM (V1, the version the ``vllm`` extra pins):

* ``LLM(model=DIR, ...)`` loads the model from a directory; unknown engine arguments are refused;
  ``logprobs_mode`` defaults to ``raw_logprobs`` (log-probs of the model's logits, before temperature), and
  ``processed_logprobs`` gives those of the distribution sampled from (after temperature);
* the engine runs in its own "process": the model lives in a worker that the trainer cannot reach; the only
  way in is ``LLM.collective_rpc(method, args=...)``, whose arguments cross a pickle boundary as they would the
  process boundary, calling a method of the worker class extended by ``worker_extension_cls`` (resolved by its
  qualified name, mixed into the worker's bases), where ``self.model_runner.model.load_weights`` takes
  (name, tensor) pairs;
* ``LLM.generate(prompts, SamplingParams, use_tqdm=...)`` samples ``n`` completions per ``prompt_token_ids``
  (one ``SamplingParams`` for every prompt, or a list paired with the prompts one by one; a request with a
  ``seed`` samples from a generator of its own) with temperature, stopping at EOS, a stop string or
  ``max_tokens``; each position's ``logprobs`` maps the sampled token to a ``Logprob``;
  ``reset_prefix_cache()`` exists.

It samples with plain transformers on the CPU, one token at a time without a cache: slow, but only tiny models
use it. A stop string ends a sample at the token that completes it (``finish_reason`` "stop"). Top-p, top-k and
min_tokens are not implemented (refused where they would change a sample)."""

from __future__ import annotations

import importlib
import pickle
import types
from dataclasses import dataclass, field

import torch

ENGINE_ARGS = {"model", "gpu_memory_utilization", "seed", "max_model_len", "dtype", "logprobs_mode", "worker_extension_cls"}
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    seed: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _EngineModel:
    """The engine's model: a transformers model and vLLM's ``load_weights`` (Hugging Face names)."""

    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, value in weights:
                if name in params:  # a tied lm_head arrives too; vLLM skips what the model does not hold
                    params[name].copy_(value)
                    loaded.add(name)
        return loaded


class _Worker:
    def __init__(self, path: str, dtype: torch.dtype):
        self.model_runner = types.SimpleNamespace(model=_EngineModel(path, dtype))


class LLM:
    def __init__(self, **engine_args):
        unknown = sorted(set(engine_args) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"stand-in vllm.LLM: unknown engine arguments {unknown}")
        self.logprobs_mode = engine_args.get("logprobs_mode", "raw_logprobs")
        assert self.logprobs_mode in LOGPROBS_MODES, self.logprobs_mode
        worker_cls = _Worker
        if engine_args.get("worker_extension_cls"):
            module, _, name = engine_args["worker_extension_cls"].rpartition(".")
            extension = getattr(importlib.import_module(module), name)
            worker_cls = type("ExtendedWorker", (_Worker, extension), {})
        dtype = getattr(torch, engine_args.get("dtype", "float32"))
        self.__worker = worker_cls(engine_args["model"], dtype)  # name-mangled: the engine process's, not the caller's
        self.__generator = torch.Generator().manual_seed(engine_args.get("seed", 0))
        from transformers import AutoTokenizer

        self.__tokenizer = AutoTokenizer.from_pretrained(engine_args["model"])
        self.rpc_calls: list[str] = []  # what a test reads: the methods called, in order

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs or {})))  # the process boundary
        self.rpc_calls.append(method)
        fn = getattr(self.__worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.__worker, *a, **k))
        return [fn(*args, **kwargs)]

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams], use_tqdm=True):
        each = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        model = self.__worker.model_runner.model.hf
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        outputs = []
        for i, (prompt, p) in enumerate(zip(prompts, each)):
            if p.top_p != 1.0 or p.top_k not in (0, -1) or p.min_tokens:
                raise NotImplementedError("the stand-in samples with temperature and stop strings only")
            generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else self.__generator
            request = RequestOutput(str(i), list(prompt["prompt_token_ids"]))
            for j in range(p.n):
                ids, logprobs, finish = list(request.prompt_token_ids), [], "length"
                for _ in range(p.max_tokens):
                    with torch.no_grad():
                        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    processed = torch.log_softmax(logits / p.temperature, -1)
                    token = int(torch.multinomial(processed.exp(), 1, generator=generator))
                    raw = torch.log_softmax(logits, -1)
                    value = (processed if self.logprobs_mode == "processed_logprobs" else raw)[token].item()
                    logprobs.append({token: Logprob(value, rank=1)})
                    ids.append(token)
                    text = self.__tokenizer.decode(ids[len(request.prompt_token_ids):], skip_special_tokens=True)
                    found = [(text.index(s), s) for s in p.stop or [] if s in text]
                    if token in eos or found:
                        finish = "stop"
                        break
                response = ids[len(request.prompt_token_ids):]
                if found:  # the text ends at the first stop string, kept or not as asked
                    at, stop = min(found)
                    text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                request.outputs.append(CompletionOutput(j, text, response,
                                                        sum(lp[t].logprob for lp, t in zip(logprobs, response)), logprobs, finish))
            outputs.append(request)
        return outputs


def module() -> types.ModuleType:
    """A fresh ``vllm`` module object, for ``sys.modules``."""
    m = types.ModuleType("vllm")
    m.LLM, m.SamplingParams, m.Logprob = LLM, SamplingParams, Logprob
    return m
