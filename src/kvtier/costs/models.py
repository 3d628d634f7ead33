"""The engine's model: KV bytes per token and prefill FLOPs per token, from a ``config.json``.

A model is read from Hugging Face ``config.json`` field names (``num_hidden_layers``,
``num_key_value_heads``, ``head_dim``, ``torch_dtype`` or ``dtype``, ``kv_lora_rank``, ``n_routed_experts``,
...), whether they come from a file or from :data:`BUNDLED_MODELS` (the same fields, copied
from each model's published config). Only what the formulas need is read; the formulas:

* KV bytes per token: ``layers x 2 x kv_heads x head_dim x dtype bytes``; with multi-head
  latent attention (``kv_lora_rank`` set): ``layers x (kv_lora_rank + qk_rope_head_dim) x
  dtype bytes`` (the latent and the shared rotary key are what is cached).
* Prefill FLOPs of the token at position ``t`` (0-based): ``2 x active_params + attention x
  (t + 1)``, where ``active_params`` counts the matrix weights one token goes through in the
  decoder layers (the routed experts it is sent to, not all of them; not the embedding, a
  lookup; not the LM head, applied to a prompt's last token only) and ``attention = 2 x layers
  x heads x (qk_head_dim + v_head_dim)`` (scores and weighted values, 2 FLOPs per
  multiply-add). A prompt of ``n`` tokens after ``h`` cached ones costs
  ``2 x active_params x n + attention x (n (2h + n + 1) / 2)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["BUNDLED_MODELS", "EngineModel", "load_model", "model_from_config"]

#: bytes per element of the ``torch_dtype`` names a config.json uses
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class EngineModel:
    """What the cost model needs of an LLM; build it with :func:`model_from_config`."""

    name: str
    layers: int
    #: attention (query) heads
    heads: int
    #: heads of cached K and V (GQA); for MLA the latent is shared by every head
    kv_heads: int
    head_dim: int
    #: query/key and value widths per head, for the attention FLOPs
    qk_head_dim: int
    v_head_dim: int
    #: bytes per cached element (the KV cache dtype; ``torch_dtype`` unless told otherwise)
    kv_dtype_bytes: int
    #: bytes per weight (``torch_dtype``): the weights a forward pass reads from HBM
    weight_dtype_bytes: int
    #: MLA's cached latent width and rotary key width; both 0 without MLA
    kv_lora_rank: int
    qk_rope_head_dim: int
    #: every weight, embedding and LM head included
    params: int
    #: decoder-layer matrix weights one token passes through (see the module docstring)
    active_params: int
    #: where the figures come from (a file path or the published config's URL)
    source: str

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_bytes_per_token(self) -> int:
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def attention_flops_per_position(self) -> int:
        """FLOPs one token spends per earlier position it attends to (itself included)."""
        return 2 * self.layers * self.heads * (self.qk_head_dim + self.v_head_dim)

    def prefill_flops(self, tokens: int, cached: int = 0) -> float:
        """FLOPs to prefill ``tokens`` tokens that follow ``cached`` tokens already in the cache."""
        if tokens <= 0:
            return 0.0
        positions = (
            tokens * (2 * cached + tokens + 1) / 2
        )  # sum of (t + 1) over t in [cached, cached + tokens)
        return 2.0 * self.active_params * tokens + self.attention_flops_per_position * positions

    def prefill_flops_per_token(self, prompt_tokens: int) -> float:
        """Mean prefill FLOPs per token over a whole prompt of ``prompt_tokens`` tokens."""
        return (
            self.prefill_flops(prompt_tokens) / prompt_tokens
            if prompt_tokens > 0
            else 2.0 * self.active_params
        )

    @property
    def weight_bytes(self) -> int:
        return self.params * self.weight_dtype_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "mla": self.mla,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "params": self.params,
            "active_params": self.active_params,
            "attention_flops_per_position": self.attention_flops_per_position,
            "source": self.source,
        }


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


#: config.json fields of the bundled models, copied from each model's published config.json
#: (``source``); only the fields the cost model reads
BUNDLED_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {
        "source": _hf("meta-llama/Llama-3.1-8B"),
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Llama-3.1-70B": {
        "source": _hf("meta-llama/Llama-3.1-70B"),
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "source": _hf("Qwen/Qwen3-8B"),
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-32B": {
        "source": _hf("Qwen/Qwen3-32B"),
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "DeepSeek-V3": {
        "source": _hf("deepseek-ai/DeepSeek-V3"),
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def load_model(name_or_path: str, kv_dtype: str | None = None) -> EngineModel:
    """A bundled model by name (case-insensitive), or the ``config.json`` at a path.

    ``kv_dtype`` (a ``torch_dtype`` name): the KV cache's dtype when it differs from the
    weights' (an fp8 KV cache). Raises :class:`ConfigError` naming the known models for an
    unknown name, and the field for a config.json that lacks one or has a bad value.
    """
    by_lower = {name.lower(): name for name in BUNDLED_MODELS}
    path = Path(name_or_path)
    if name_or_path.lower() in by_lower and not path.exists():
        name = by_lower[name_or_path.lower()]
        fields = dict(BUNDLED_MODELS[name])
        return model_from_config(fields, name=name, source=fields.pop("source"), kv_dtype=kv_dtype)
    if not path.is_file():
        raise ConfigError(
            "--model",
            name_or_path,
            f"a config.json path or one of {', '.join(BUNDLED_MODELS)}",
            "name a bundled model, or the config.json of a Hugging Face model",
        )
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            "--model", str(path), f"a JSON config.json ({exc})", "give a model's config.json"
        ) from exc
    if not isinstance(fields, dict):
        raise ConfigError("--model", str(path), "a JSON object (a config.json)", "give a model's config.json")
    return model_from_config(fields, name=path.parent.name or path.name, source=str(path), kv_dtype=kv_dtype)


def _int(fields: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = fields.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{where}: {key}",
            value,
            "a non-negative integer",
            f"set {key} as the model's config.json has it",
        )
    return value


def _dtype_bytes(name: Any, where: str, key: str) -> int:
    text = str(name).removeprefix("torch.")
    if text not in DTYPE_BYTES:
        raise ConfigError(f"{where}: {key}", name, f"one of {', '.join(DTYPE_BYTES)}", "e.g. bfloat16")
    return DTYPE_BYTES[text]


def model_from_config(
    fields: dict[str, Any], name: str = "model", source: str = "config.json", kv_dtype: str | None = None
) -> EngineModel:
    """An :class:`EngineModel` from a config.json's fields (a multimodal config's
    ``text_config`` is used when the top level has no ``num_hidden_layers``)."""
    if "num_hidden_layers" not in fields and isinstance(fields.get("text_config"), dict):
        fields = fields["text_config"]
    where = source
    layers = _int(fields, "num_hidden_layers", where)
    hidden = _int(fields, "hidden_size", where)
    heads = _int(fields, "num_attention_heads", where)
    if layers == 0 or hidden == 0 or heads == 0:
        raise ConfigError(
            f"{where}: num_hidden_layers/hidden_size/num_attention_heads", 0, "positive", "fix config"
        )
    kv_heads = _int(fields, "num_key_value_heads", where, heads)
    head_dim = (
        _int(fields, "head_dim", where, hidden // heads)
        if fields.get("head_dim") is not None
        else hidden // heads
    )
    intermediate = _int(fields, "intermediate_size", where)
    vocab = _int(fields, "vocab_size", where, 0)
    # transformers 5 writes ``dtype`` where earlier versions wrote ``torch_dtype``
    dtype_key = "torch_dtype" if "torch_dtype" in fields or "dtype" not in fields else "dtype"
    weight_bytes = _dtype_bytes(fields.get(dtype_key, "bfloat16"), where, dtype_key)
    kv_bytes = _dtype_bytes(kv_dtype, "--kv-dtype", "kv_dtype") if kv_dtype else weight_bytes

    kv_lora = _int(fields, "kv_lora_rank", where, 0) if fields.get("kv_lora_rank") is not None else 0
    if kv_lora:  # multi-head latent attention (DeepSeek-V2/V3)
        rope = _int(fields, "qk_rope_head_dim", where)
        nope = _int(fields, "qk_nope_head_dim", where)
        v_dim = _int(fields, "v_head_dim", where)
        qk_dim = rope + nope
        q_lora = _int(fields, "q_lora_rank", where, 0) if fields.get("q_lora_rank") is not None else 0
        query = hidden * q_lora + q_lora * heads * qk_dim if q_lora else hidden * heads * qk_dim
        attention = (
            query + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
        )
    else:
        rope = 0
        qk_dim = v_dim = head_dim
        attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden

    dense_mlp = 3 * hidden * intermediate  # gate, up and down projections (SwiGLU)
    experts = fields.get("n_routed_experts") or fields.get("num_experts") or 0
    total_layers = active_layers = 0
    for index in range(layers):
        if experts and _is_moe_layer(fields, index, where):
            expert = 3 * hidden * _int(fields, "moe_intermediate_size", where)
            per_token = _int(fields, "num_experts_per_tok", where)
            shared = (
                _int(fields, "n_shared_experts", where, 0)
                if fields.get("n_shared_experts") is not None
                else 0
            )
            shared_params = shared * expert
            if fields.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert
                shared_params = 3 * hidden * _int(fields, "shared_expert_intermediate_size", where)
            router = hidden * experts
            total_layers += attention + experts * expert + shared_params + router
            active_layers += attention + per_token * expert + shared_params + router
        else:
            total_layers += attention + dense_mlp
            active_layers += attention + dense_mlp
    embedding = vocab * hidden
    head = 0 if fields.get("tie_word_embeddings", False) else vocab * hidden
    return EngineModel(
        name=name,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        qk_head_dim=qk_dim,
        v_head_dim=v_dim,
        kv_dtype_bytes=kv_bytes,
        weight_dtype_bytes=weight_bytes,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        params=total_layers + embedding + head,
        active_params=active_layers,
        source=source,
    )


def _is_moe_layer(fields: dict[str, Any], index: int, where: str) -> bool:
    """Whether decoder layer ``index`` has routed experts: DeepSeek's ``first_k_dense_replace``
    and ``moe_layer_freq``, or Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``."""
    if "first_k_dense_replace" in fields or "moe_layer_freq" in fields:
        first = _int(fields, "first_k_dense_replace", where, 0)
        every = max(1, _int(fields, "moe_layer_freq", where, 1))
        return index >= first and index % every == 0
    step = max(1, _int(fields, "decoder_sparse_step", where, 1))
    return index not in (fields.get("mlp_only_layers") or []) and (index + 1) % step == 0
