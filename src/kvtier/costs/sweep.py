"""One request alone on the GPU, prompt length swept: recompute it, or load it all from a tier.

The setup of vLLM's published CPU-offloading result (Llama-3.1-8B on one H100, a prompt
whose every block is in CPU memory, TTFT 2-22x lower than recomputing it, the gain growing
with the prompt): here the model's estimate of the same ratio, so the two can be compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.costs.timing import CostModel

__all__ = ["DEFAULT_PROMPTS", "hit_sweep"]

#: prompt lengths (tokens) swept when none are given
DEFAULT_PROMPTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def hit_sweep(cost: CostModel, tier: str, prompts: Sequence[int] = DEFAULT_PROMPTS) -> list[dict[str, Any]]:
    """Per prompt length: TTFT recomputing the prompt, TTFT loading it from ``tier`` (all
    but the last token, which is computed), and their ratio."""
    rows = []
    for tokens in prompts:
        recompute = cost.prefill_seconds(tokens)
        loaded = cost.load_seconds(tier, tokens) + cost.prefill_seconds(1, tokens - 1)
        rows.append(
            {
                "prompt_tokens": tokens,
                "recompute_s": recompute,
                f"{tier}_hit_s": loaded,
                "speedup": recompute / loaded if loaded else float("inf"),
            }
        )
    return rows
