"""The model shapes the planner (``cohortrl/planner/__init__.py``) plans for: a Llama/Qwen-style decoder's sizes,
the published presets, and a shape read from a ``config.json`` or a cohortrl alias."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PlanError(ValueError):
    """Planner input that cannot be planned, with the reason and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP."""

    name: str
    hidden_size: int  # h
    num_layers: int  # L
    num_heads: int  # a
    num_kv_heads: int  # k
    intermediate_size: int  # f
    vocab_size: int  # V
    tie_embeddings: bool
    head_dim: int | None = None  # d; None: h / a
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def layer_matrix_params(self) -> int:
        """The weight matrices of one layer: q, k, v, o projections + gate, up, down."""
        h, d, a, k, f = self.hidden_size, self.d, self.num_heads, self.num_kv_heads, self.intermediate_size
        return h * a * d + 2 * h * k * d + a * d * h + 3 * h * f

    @property
    def layer_params(self) -> int:
        """The layer's matrices + two RMSNorm weights (+ q/k/v biases)."""
        d, a, k = self.d, self.num_heads, self.num_kv_heads
        return self.layer_matrix_params + 2 * self.hidden_size + (a * d + 2 * k * d if self.qkv_bias else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the LM head is the embedding matrix."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Ψ: embeddings + L layers + final norm + LM head (if untied)."""
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.lm_head_params

    @property
    def critic_params(self) -> int:
        """The backbone without the LM head, plus Linear(h, 1) with bias (``trainers/critic.ValueModel``)."""
        return self.params - self.lm_head_params + self.hidden_size + 1

    def lora_params(self, rank: int) -> int:
        """LoRA on all seven projections of every layer: r·(in + out) per matrix (Hu et al., arXiv 2106.09685)."""
        h, d, a, k, f = self.hidden_size, self.d, self.num_heads, self.num_kv_heads, self.intermediate_size
        per_layer = (h + a * d) + 2 * (h + k * d) + (a * d + h) + 2 * (h + f) + (f + h)
        return self.num_layers * rank * per_layer


# Published configs (config.json on the Hugging Face hub of each model).
PRESETS = {
    "0.5b": ModelShape("Qwen2.5-0.5B shape", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True),
    "1.5b": ModelShape("Qwen2.5-1.5B shape", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True),
    "7b": ModelShape("Llama-2-7B shape", 4096, 32, 32, 32, 11008, 32000, False),
    "8b": ModelShape("Llama-3-8B shape", 4096, 32, 32, 8, 14336, 128256, False),
    "70b": ModelShape("Llama-3-70B shape", 8192, 80, 64, 8, 28672, 128256, False),
}


def shape_from_config(config: dict, name: str) -> ModelShape:
    """A ModelShape from a transformers ``config.json`` dict (Llama, Qwen2, Mistral field names)."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if k not in config]
    if missing:
        raise PlanError(f"{name}: config.json lacks {missing}; the planner needs a Llama/Qwen-style decoder config")
    return ModelShape(
        name=name,
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim"),
        qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
    )


def resolve_shape(spec: str) -> ModelShape:
    """A preset (``7b``), a directory with a config.json, or a cohortrl alias (``tiny-llama``,
    ``smollm2-135m-instruct`` once converted)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text()), spec)
    from cohortrl.models import ALIASES, cohortrl_home

    alias = ALIASES.get(spec)
    if alias is not None and alias.tiny is not None:
        from cohortrl.models import build_tiny_tokenizer

        t = alias.tiny
        return ModelShape(spec, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size,
                          len(build_tiny_tokenizer()), tie_embeddings=True)
    if alias is not None:
        cached = cohortrl_home() / "models" / spec / "config.json"
        if not cached.is_file():
            raise PlanError(f"model '{spec}' is not converted yet; run `cohortrl models --load {spec}` once, then plan again")
        return shape_from_config(json.loads(cached.read_text()), spec)
    raise PlanError(
        f"unknown model '{spec}': give a size preset ({', '.join(PRESETS)}), a directory with a config.json, "
        f"or a cohortrl alias ({', '.join(ALIASES)})"
    )
