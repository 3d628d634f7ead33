"""kvtier as the prefix cache of a Hugging Face transformers causal LM, the only part of kvtier
that imports transformers (kvtier's ``transformers`` extra: transformers, gguf, accelerate).

:class:`TieredPrefixCache` loads a prompt's longest cached prefix from kvtier's stack into
the model's ``DynamicCache``, prefills the rest and stores the new blocks; the bytes go
through kvtier's own worker handlers and CPU tier, as they do for vLLM.
:func:`reload_logits` stores a prefix through a stack, reopens it and returns the
continuation's logits loaded through the tiers beside the in-memory cache's (what a codec's
cost is measured with). :func:`load_model` loads a model folder, a GGUF file or ``smollm2``.
docs/transformers.md has a worked example.
"""

from kvtier.integrations.transformers.cache import (
    Generation,
    Prefill,
    TieredPrefixCache,
    block_hashes,
    cache_prefix,
    forward,
)
from kvtier.integrations.transformers.layout import ModelKVLayout
from kvtier.integrations.transformers.models import load_model
from kvtier.integrations.transformers.reload import Reloaded, reload_logits

__all__ = [
    "Generation",
    "ModelKVLayout",
    "Prefill",
    "Reloaded",
    "TieredPrefixCache",
    "block_hashes",
    "cache_prefix",
    "forward",
    "load_model",
    "reload_logits",
]
