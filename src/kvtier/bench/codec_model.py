"""``kvtier bench codec --model``: what each codec costs a real model, through a real tier.

Protocol, per text of :data:`~kvtier.bench.codec_texts.TEXTS`: the model computes in fp32 (in
bf16 the rounding of every later sum moves the logits more than int8's error does, and would
hide it); the KV it stores is rounded to ``kv_dtype`` (bf16 by default, what a bf16 engine
holds). :func:`~kvtier.integrations.transformers.reload_logits` stores the first
``prefix_tokens`` through a stack of a CPU tier over a ``files`` tier with ``codec: NAME``,
closes it (the blocks are encoded on their way to disk), opens it again and scores the next
``continuation_tokens`` by teacher forcing over the prefix loaded back from disk (decoded, and
checked as every load is). The reference is the same continuation over the in-memory prefix
rounded to ``kv_dtype``, at the same split, so a difference is the codec's alone (``none``
gives none).

Per codec, over every position of every text: ``kl_mean``, KL(reference || codec) of the
next-token distributions, nats; ``kl_max`` its largest; ``ppl_delta``, the codec's perplexity
of the continuation's tokens minus the reference's; ``greedy_agreement``, the share of
positions whose most likely token is the reference's. The ratio and the encode/decode GB/s
per core are :func:`kvtier.bench.codec.run`'s, on the prefixes' own KV blocks (what the tier
encoded).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np
import torch

from kvtier.bench import codec as codec_bench
from kvtier.bench.codec_texts import TEXTS
from kvtier.codecs import CODEC_NAMES
from kvtier.errors import KvtierError
from kvtier.integrations.transformers import TieredPrefixCache, load_model, reload_logits
from kvtier.integrations.transformers.cache import DEFAULT_BLOCK_TOKENS
from kvtier.integrations.transformers.layout import weights_digest

__all__ = ["CONTINUATION_TOKENS", "PREFIX_TOKENS", "quality", "run"]

#: tokens of each text stored through the codec (12 blocks of 32)
PREFIX_TOKENS = 384
#: tokens scored after it
CONTINUATION_TOKENS = 96


_CPU = {"name": "cpu", "kind": "cpu", "capacity": "256MiB"}


def _stack(path: str, codec: str) -> dict[str, Any]:
    """A CPU tier over a ``files`` tier at ``path`` storing with ``codec``."""
    return {
        "tiers": [_CPU, {"name": "disk", "kind": "files", "path": path, "capacity": "1GiB", "codec": codec}]
    }


class _Totals:
    """One codec's sums over every scored position."""

    def __init__(self) -> None:
        self.kl = self.kl_max = self.nll = self.nll_reference = 0.0
        self.positions = self.scored = self.agree = 0
        self.by_text: dict[str, float] = {}

    def add(self, text: str, tiered: torch.Tensor, memory: torch.Tensor, continuation: Sequence[int]) -> None:
        got = torch.log_softmax(tiered.double(), -1)
        want = torch.log_softmax(memory.double(), -1)
        kl = (want.exp() * (want - got)).sum(-1)
        # position i predicts continuation[i + 1]; the last position's token is not known
        targets = torch.tensor(continuation[1:]).unsqueeze(1)
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.by_text[text] = float(kl.mean())
        self.nll -= float(got[:-1].gather(1, targets).sum())
        self.nll_reference -= float(want[:-1].gather(1, targets).sum())
        self.positions += len(kl)
        self.scored += len(targets)
        self.agree += int((tiered.argmax(-1) == memory.argmax(-1)).sum())

    def figures(self) -> dict[str, Any]:
        ppl, reference = (math.exp(nll / self.scored) for nll in (self.nll, self.nll_reference))
        return {
            "kl_mean": self.kl / self.positions,
            "kl_max": self.kl_max,
            "ppl_delta": ppl - reference,
            "ppl_reference": reference,
            "greedy_agreement": self.agree / self.positions,
            "kl_by_text": self.by_text,
        }


def quality(
    model: Any,
    tokenizer: Any,
    *,
    codecs: Sequence[str] = CODEC_NAMES,
    texts: Mapping[str, str] = TEXTS,
    prefix_tokens: int = PREFIX_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
    kv_dtype: str = "bfloat16",
) -> tuple[dict[str, dict[str, Any]], list[np.ndarray]]:
    """``(figures per codec, KV rows)``: each codec's model error (see the module docstring)
    and the prefixes' KV blocks as the tiers store them (uint8 numpy rows).

    ``model`` computes in its own dtype (give fp32). Raises :class:`KvtierError` for a text
    shorter than the prefix and continuation, a prefix that is not whole blocks, or a prefix
    that did not come back from the disk tier whole.
    """
    if prefix_tokens < 1 or prefix_tokens % DEFAULT_BLOCK_TOKENS or continuation_tokens < 2:
        raise KvtierError(
            f"the prefix must be whole blocks of {DEFAULT_BLOCK_TOKENS} tokens and the continuation "
            f"at least 2 tokens (got {prefix_tokens} and {continuation_tokens})"
        )
    weights = weights_digest(model)  # hashed once, not twice per reload
    blocks = prefix_tokens // DEFAULT_BLOCK_TOKENS
    totals = {name: _Totals() for name in codecs}
    rows: list[np.ndarray] = []
    for text_name, text in texts.items():
        ids = [int(t) for t in tokenizer(text)["input_ids"]]
        if len(ids) < prefix_tokens + continuation_tokens:
            raise KvtierError(
                f"text {text_name!r} has {len(ids)} tokens: the prefix and continuation need "
                f"{prefix_tokens + continuation_tokens}"
            )
        prefix, continuation = ids[:prefix_tokens], ids[prefix_tokens : prefix_tokens + continuation_tokens]
        with TieredPrefixCache(model, {"tiers": [_CPU]}, model_id=weights, kv_dtype=kv_dtype) as cache:
            computed = cache.prefill(prefix, store=False)
            rows.extend(cache.block_rows(computed.cache, range(blocks)).numpy())
        for name in codecs:
            with tempfile.TemporaryDirectory(prefix="kvtier-codec-") as folder:
                reloaded = reload_logits(
                    model, _stack(folder, name), prefix, continuation, model_id=weights, kv_dtype=kv_dtype
                )
            if reloaded.cached_tokens != prefix_tokens or reloaded.hits != {"disk": blocks}:
                raise KvtierError(
                    f"codec {name}, text {text_name!r}: {reloaded.cached_tokens} of {prefix_tokens} prefix "
                    f"tokens came back (hits {reloaded.hits}); see the stats: {reloaded.stats}"
                )
            totals[name].add(text_name, reloaded.tiered, reloaded.memory, continuation)
    return {name: total.figures() for name, total in totals.items()}, rows


def run(
    model_name: str,
    *,
    codecs: Sequence[str] = CODEC_NAMES,
    rounds: int = 5,
    dtype: str = "bfloat16",
    out: TextIO | None = None,
    json_line: bool = False,
) -> dict[str, Any]:
    """Load ``model_name`` (see :func:`~kvtier.integrations.transformers.load_model`) in fp32
    on one torch thread, measure :func:`quality` with its KV stored in ``dtype``, then each
    codec's ratio and speed on those KV blocks (:func:`kvtier.bench.codec.run`, which prints
    the table and returns the record)."""
    torch.set_num_threads(1)  # GB/s per core; two threads spin on a small machine
    model, tokenizer = load_model(model_name, "float32")
    names = ["none", *[name for name in codecs if name != "none"]]
    figures, rows = quality(model, tokenizer, codecs=names, kv_dtype=dtype)
    size = len(rows[0])
    return codec_bench.run(
        codecs=names,
        block_sizes=[size],
        rounds=rounds,
        dtype=dtype,
        blocks={size: rows},
        quality=figures,
        model={
            "name": model_name,
            "compute": "float32",
            "kv_dtype": dtype,
            "texts": list(TEXTS),
            "prefix_tokens": PREFIX_TOKENS,
            "continuation_tokens": CONTINUATION_TOKENS,
            "tier": "files",
        },
        data=f"{model_name}'s KV",
        out=out,
        json_line=json_line,
    )
