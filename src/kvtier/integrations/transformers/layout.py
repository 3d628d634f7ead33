"""How a transformers model's KV cache becomes kvtier blocks, and which models it can hold.

A block is ``tokens_per_block`` consecutive tokens of every layer. Its page for layer ``l`` is
that layer's K then V for those tokens, ``(2, kv_heads, tokens, head_dim)`` in the model's
dtype, so one block of every layer is one CPU row of ``layers x page_bytes`` bytes: for
SmolLM2-135M in bf16 (30 layers, 3 KV heads, head_dim 64) a 32-token block is 737,280 bytes.

The layout fingerprint that every lower tier stamps on these blocks names the model (its
architecture and a digest of its weights, unless the caller names it), the dtype, the block
size and the page sizes, so blocks written by another model, another fine-tune or another
dtype are never read (a ``foreign`` miss). Only caches whose every layer is a plain
``DynamicLayer`` of K and V with one shape fit this layout: sliding-window, chunked, linear
or shared-KV layers, and latent attention (MLA), are refused with a :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.errors import ConfigError
from kvtier.tiers.disk.format import LayoutFingerprint

__all__ = ["DTYPES", "ModelKVLayout", "weights_digest"]

#: the model dtypes a block holds (their names as ``torch`` spells them)
DTYPES = ("float32", "bfloat16", "float16")


def weights_digest(model: Any) -> str:
    """16 hex digits naming the model's weights (xxh3-128 of every parameter and buffer's
    name, shape and bytes): two checkpoints of one architecture differ here. ~40 ms for
    SmolLM2-135M on a CPU; a large model on a GPU copies each tensor to the host once."""
    import torch

    digest = xxhash.xxh3_128()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        host = tensor.detach().contiguous().cpu()
        digest.update(host.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ModelKVLayout:
    """The block layout of one model in one dtype (build it with :meth:`of_model`)."""

    #: the architecture (``model_type``, such as ``llama``)
    architecture: str
    #: what names the weights: their :func:`weights_digest`, or the caller's ``model_id``
    weights: str
    #: decoder layers holding a KV cache
    layers: int
    kv_heads: int
    head_dim: int
    #: ``float32``, ``bfloat16`` or ``float16``
    dtype: str
    tokens_per_block: int

    @property
    def element_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's K and V for one block."""
        return 2 * self.kv_heads * self.tokens_per_block * self.head_dim * self.element_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer (one CPU row)."""
        return self.layers * self.page_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.tokens_per_block

    def fingerprint(self) -> LayoutFingerprint:
        """What the lower tiers stamp on every block of this layout."""
        return LayoutFingerprint(
            model=f"transformers:{self.architecture}:{self.weights};layers={self.layers};kv_heads={self.kv_heads};"
            f"head_dim={self.head_dim}",
            dtype=self.dtype,
            tokens_per_block=self.tokens_per_block,
            page_bytes=(self.page_bytes,) * self.layers,
            rank=0,
            world_size=1,
            block_bytes=self.block_bytes,
        )

    @classmethod
    def of_model(
        cls, model: Any, tokens_per_block: int, model_id: str | None = None, dtype: str | None = None
    ) -> ModelKVLayout:
        """The layout of ``model`` (a transformers causal LM), its KV stored in ``dtype``
        (default: the model's current dtype).

        ``model_id``: the name the fingerprint gives the weights; by default their
        :func:`weights_digest` (give a name that changes whenever the weights do, to skip
        hashing a large model). Raises :class:`ConfigError` for a model whose cache the
        layout cannot hold, or a dtype other than :data:`DTYPES`.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        config = model.config.get_text_config(decoder=True)
        kind = getattr(config, "model_type", type(model).__name__)
        if getattr(config, "kv_lora_rank", None):
            raise ConfigError(
                "model",
                kind,
                "a model whose cache holds per-head K and V (MHA or GQA)",
                "latent attention (MLA) caches a compressed latent that this block layout does not hold",
            )
        others = sorted(
            {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
            - {DynamicLayer.__name__}
        )
        if others:
            raise ConfigError(
                "model",
                kind,
                "a model whose every layer keeps a full-attention DynamicLayer cache",
                f"its cache has {', '.join(others)} layers (sliding-window, chunked, linear or "
                "shared-KV attention), whose K and V this block layout cannot hold",
            )
        own = str(model.dtype).removeprefix("torch.")
        for field, name in (("model dtype", own), ("kv_dtype", dtype or own)):
            if name not in DTYPES:
                raise ConfigError(
                    field, name, f"one of {', '.join(DTYPES)}", "load, cast or store the KV in one of them"
                )
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(
            architecture=str(kind),
            weights=model_id or weights_digest(model),
            layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            dtype=dtype or own,
            tokens_per_block=tokens_per_block,
        )
