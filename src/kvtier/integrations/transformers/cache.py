"""kvtier as the prefix cache of a transformers causal LM: load the cached prefix, prefill the rest.

Per prompt, :class:`TieredPrefixCache`:

1. names each full block of the prompt's tokens by a hash chained over the blocks before it
   (as vLLM's prefix cache does), so a block's key names its whole prefix;
2. looks the keys up through kvtier's manager in prefix order (:class:`~kvtier.driver.StackDriver`:
   a block found only in a lower tier is promoted to the CPU tier first), keeping at least the
   prompt's last token to compute, since its logits are what the prefill is for;
3. copies the hits from the CPU tier into its paged KV tensor (the model's "GPU" blocks, one
   ``(blocks, 2, kv_heads, tokens, head_dim)`` tensor per layer) through kvtier's own CPU->GPU
   handler, and from there into a fresh ``DynamicCache``;
4. prefills the rest of the prompt over that cache;
5. copies the new full blocks from the ``DynamicCache`` into the paged tensor and stores them
   through the GPU->CPU handler (then the stack saves them below, as it does for vLLM).

Only steps 3 and 5's copies between the paged tensor and the ``DynamicCache`` are this
module's own (the part of an engine's attention that reads and writes its paged cache). The
paged tensor holds ``staging_blocks`` blocks; longer prefixes move through it in turns.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.config import KvtierConfig, load_config
from kvtier.driver import StackDriver
from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.transformers.layout import ModelKVLayout
from kvtier.spec import TieredOffloadingSpec
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.worker.canonical import canonicalize

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_STAGING_BLOCKS",
    "Generation",
    "Prefill",
    "TieredPrefixCache",
    "block_hashes",
    "cache_prefix",
    "forward",
    "layer_states",
]

#: tokens per block when the configuration sets no ``block_size_tokens``
DEFAULT_BLOCK_TOKENS = 32
#: blocks of the paged KV tensor that loads and stores go through
DEFAULT_STAGING_BLOCKS = 64
#: the hash the chain of a prompt's first block starts from (fixed, so every process agrees)
_ROOT = hashlib.sha256(b"kvtier transformers prefix v1").digest()


def block_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """The hash of each full block of ``token_ids``: SHA-256 of the previous block's hash and
    this block's token ids (int64, little-endian), so equal hashes mean equal prefixes."""
    tokens = np.asarray(token_ids, dtype="<i8")
    hashes = []
    parent = _ROOT
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        parent = hashlib.sha256(parent + tokens[start : start + tokens_per_block].tobytes()).digest()
        hashes.append(parent)
    return hashes


def forward(model: Any, token_ids: Sequence[int], cache: DynamicCache, logits: int = 1) -> torch.Tensor:
    """Run ``token_ids`` through ``model`` after what ``cache`` holds (which it extends); the
    logits of the last ``logits`` positions (0: every position), ``(positions, vocab)``."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits)
    return out.logits[0]


def cache_prefix(model: Any, cache: DynamicCache, tokens: int, kv_dtype: str | None = None) -> DynamicCache:
    """A new ``DynamicCache`` holding a copy of the first ``tokens`` tokens of ``cache``: the
    in-memory cache at a given split, which a reload through the tiers must equal. With
    ``kv_dtype``, each value is rounded to that dtype and back, as the tiers store it."""
    copy = DynamicCache(config=model.config)
    stored = getattr(torch, kv_dtype) if kv_dtype else model.dtype
    for index, layer in enumerate(layer_states(cache)):
        keys, values = (states[:, :, :tokens].to(stored).to(model.dtype, copy=True) for states in layer)
        copy.update(keys, values, index)
    return copy


def layer_states(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached ``(keys, values)``, each ``(batch, kv_heads, tokens, head_dim)``;
    :class:`KvtierError` for a layer that holds none (a cache this layout cannot hold)."""
    states = []
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise KvtierError(
                f"layer {index} of the model's cache holds no keys and values ({type(layer).__name__})"
            )
        states.append((keys, values))
    return states


@dataclass
class Prefill:
    """One prompt's prefill over the tiers."""

    #: logits of the last positions asked for, ``(positions, vocab)``
    logits: torch.Tensor
    #: the model's cache after the prompt (loaded prefix, then the computed rest)
    cache: DynamicCache
    prompt_tokens: int
    #: tokens whose KV came from the tiers (a multiple of the block size)
    cached_tokens: int
    #: blocks loaded, by the tier that served them
    hits: dict[str, int]
    #: seconds of the lookup and the loads, then of the model's forward pass
    load_s: float
    compute_s: float


@dataclass
class Generation:
    """A greedy generation after a prefill over the tiers."""

    #: the generated token ids (ending with an end-of-sequence token if one came)
    tokens: list[int]
    #: the logits each token was chosen from, ``(len(tokens), vocab)``
    logits: torch.Tensor
    #: seconds from the call to the first token (hashing, lookup, loads, prefill, sampling)
    ttft_s: float
    #: seconds of the decode steps after the first token
    decode_s: float
    prompt_tokens: int
    cached_tokens: int
    hits: dict[str, int]
    #: blocks the stack took from this generation (prompt and output)
    stored_blocks: int
    load_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: the tokens after the first, per second."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s else 0.0


class _ModelSpec(TieredOffloadingSpec):
    """The standalone spec with the model's layout fingerprint on every block."""

    def __init__(self, config: KvtierConfig, layout: ModelKVLayout, engine: str):
        super().__init__(
            config,
            gpu_block_size_tokens=layout.tokens_per_block,
            page_bytes=[layout.page_bytes] * layout.layers,
            engine=engine,
        )
        self.layout = layout

    def fingerprint(self) -> LayoutFingerprint:
        return self.layout.fingerprint()


class TieredPrefixCache:
    """kvtier's stack (built from ``config``) as the prefix cache of ``model``, batch size 1.

    ``config``: anything :func:`kvtier.load_config` takes; its ``block_size_tokens`` is the
    block size (default :data:`DEFAULT_BLOCK_TOKENS`). ``model_id`` names the weights in the
    layout fingerprint (default: their digest, see
    :meth:`~kvtier.integrations.transformers.layout.ModelKVLayout.of_model`).
    ``staging_blocks``: blocks of the paged KV tensor, on the model's device. ``kv_dtype``:
    the dtype the tiers store the KV in (default: the model's), such as ``bfloat16`` for a
    model computing in ``float32``: stored values are rounded to it, loaded ones cast back.

    Who calls it: one thread, one prompt at a time. Raises :class:`ConfigError` for a model
    whose cache the block layout cannot hold, or a bad configuration. :meth:`close` saves
    what only the CPU tier holds to the tiers below (it is also a context manager).
    """

    def __init__(
        self,
        model: Any,
        config: KvtierConfig | dict | str,
        *,
        model_id: str | None = None,
        staging_blocks: int = DEFAULT_STAGING_BLOCKS,
        engine: str = "auto",
        kv_dtype: str | None = None,
    ):
        parsed = load_config(config)
        tokens = parsed.block_size_tokens or DEFAULT_BLOCK_TOKENS
        if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) or staging_blocks < 1:
            raise ConfigError("staging_blocks", staging_blocks, "a positive number of blocks")
        self.model = model
        self.layout = ModelKVLayout.of_model(model, tokens, model_id, kv_dtype)
        layout = self.layout
        shape = (staging_blocks, 2, layout.kv_heads, tokens, layout.head_dim)
        stored = getattr(torch, layout.dtype)
        self._pages = [torch.zeros(shape, dtype=stored, device=model.device) for _ in range(layout.layers)]
        self.spec = _ModelSpec(parsed, layout, engine)
        self.driver: StackDriver | None = StackDriver(self.spec, canonicalize(self._pages))
        #: the stack's manager (its counters stay readable after :meth:`close`)
        self.manager = self.driver.manager
        self.staging_blocks = staging_blocks
        self._requests = itertools.count()

    @property
    def tokens_per_block(self) -> int:
        return self.layout.tokens_per_block

    def block_keys(self, token_ids: Sequence[int]) -> list[OffloadKey]:
        """The offload key of each full block of ``token_ids``."""
        return [make_offload_key(h, 0) for h in block_hashes(token_ids, self.tokens_per_block)]

    def prefill(self, token_ids: Sequence[int], *, logits: int = 1, store: bool = True) -> Prefill:
        """Prefill ``token_ids`` over the longest prefix the tiers hold; with ``store``, store
        its new full blocks. ``logits``: how many last positions' logits to keep (0: all)."""
        ids = _token_list(token_ids)
        ctx = self._begin()
        try:
            result = self._prefill(ids, ctx, logits)
            if store:
                self._store(ids, result.cache, result.cached_tokens // self.tokens_per_block, ctx)
        finally:
            self._end(ctx)
        return result

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, *, tiers: bool = True) -> Generation:
        """Greedy generation of up to ``max_new_tokens`` tokens after ``token_ids``, stopping at
        the model's end-of-sequence token. With ``tiers=False`` the tiers are neither read nor
        written: the prompt is computed in full (the baseline ``--verify`` compares against).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError("max_new_tokens", max_new_tokens, "a positive number of tokens")
        ids = _token_list(token_ids)
        start = time.perf_counter()
        ctx = self._begin()
        try:
            if tiers:
                first = self._prefill(ids, ctx, 1)
            else:
                cache = DynamicCache(config=self.model.config)
                logits = forward(self.model, ids, cache)
                first = Prefill(logits, cache, len(ids), 0, {}, 0.0, time.perf_counter() - start)
            chosen = [first.logits[-1]]
            tokens = [int(chosen[-1].argmax())]
            ttft = time.perf_counter() - start
            stop = _stop_tokens(self.model)
            while len(tokens) < max_new_tokens and tokens[-1] not in stop:
                chosen.append(forward(self.model, tokens[-1:], first.cache)[-1])
                tokens.append(int(chosen[-1].argmax()))
            decode = time.perf_counter() - start - ttft
            stored = 0
            if tiers:
                # the cache holds the prompt and every output token but the last (never fed)
                sequence = ids + tokens[:-1]
                stored = self._store(sequence, first.cache, first.cached_tokens // self.tokens_per_block, ctx)
        finally:
            self._end(ctx)
        return Generation(
            tokens=tokens,
            logits=torch.stack(chosen),
            ttft_s=ttft,
            decode_s=decode,
            prompt_tokens=len(ids),
            cached_tokens=first.cached_tokens,
            hits=first.hits,
            stored_blocks=stored,
            load_s=first.load_s,
        )

    def block_rows(self, cache: DynamicCache, blocks: Sequence[int]) -> torch.Tensor:
        """What the tiers store for ``blocks`` (block indices of the tokens ``cache`` holds):
        ``(len(blocks), block_bytes)`` uint8 rows, each every layer's page in turn, in the
        layout's dtype (the bytes a lower tier's codec encodes), on the CPU."""
        rows = []
        for start in range(0, len(blocks), self.staging_blocks):
            chunk = [int(block) for block in blocks[start : start + self.staging_blocks]]
            self._write_pages(cache, chunk)
            n = len(chunk)
            pages = [page[:n].reshape(n, -1).view(torch.uint8) for page in self._pages]
            rows.append(torch.cat(pages, dim=1).cpu())
        return torch.cat(rows)

    def stats(self) -> dict[str, float]:
        """The manager's counters (hits and misses by cause, bytes per tier ...), also after
        :meth:`close`."""
        manager = self.manager
        return manager.stats() if hasattr(manager, "stats") else {}

    def close(self) -> None:
        """Finish the copies, save what only the CPU tier holds below, stop the stack. Idempotent."""
        if self.driver is not None:
            driver, self.driver = self.driver, None
            driver.close()

    def __enter__(self) -> TieredPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request ---------------------------------------------------------------------------

    def _active(self) -> StackDriver:
        if self.driver is None:
            raise KvtierError("this TieredPrefixCache is closed; make a new one")
        return self.driver

    def _begin(self) -> ReqContext:
        ctx = ReqContext(f"prompt-{next(self._requests)}")
        self._active().manager.on_new_request(ctx)
        return ctx

    def _end(self, ctx: ReqContext) -> None:
        driver = self._active()
        driver.manager.on_request_finished(ctx)
        driver.step()

    def _prefill(self, ids: list[int], ctx: ReqContext, logits: int) -> Prefill:
        driver = self._active()
        start = time.perf_counter()
        # the last token is always computed: its logits are what the prefill is for
        keys = self.block_keys(ids[: len(ids) - 1])
        found, promoted, _ = driver.lookup_prefix(keys, ctx)
        cache = DynamicCache(config=self.model.config)
        loaded = self._load(keys[:found], ctx, cache)
        hits = driver.served(keys[:loaded], promoted)
        cached = loaded * self.tokens_per_block
        loaded_at = time.perf_counter()
        out = forward(self.model, ids[cached:], cache, logits)
        return Prefill(out, cache, len(ids), cached, hits, loaded_at - start, time.perf_counter() - loaded_at)

    def _load(self, keys: list[OffloadKey], ctx: ReqContext, cache: DynamicCache) -> int:
        """Load ``keys`` (each looked up ``True``) into ``cache`` through the paged tensor;
        how many arrived (a failed copy ends the prefix there: the rest is computed)."""
        driver = self._active()
        layout = self.layout
        parts: list[list[torch.Tensor]] = [[] for _ in self._pages]
        done = 0
        for chunk in _chunks(keys, self.staging_blocks):
            if not driver.load(chunk, list(range(len(chunk))), done, ctx):
                break
            n = len(chunk)
            for layer, page in enumerate(self._pages):
                # (n, 2, heads, T, dim) -> (2, heads, n * T, dim): a copy, the pages are reused
                parts[layer].append(
                    page[:n].permute(1, 2, 0, 3, 4).reshape(2, layout.kv_heads, -1, layout.head_dim)
                )
            done += n
        if done:
            for layer, pieces in enumerate(parts):
                kv = (torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]).to(self.model.dtype)
                cache.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), layer)
        return done

    def _store(self, ids: list[int], cache: DynamicCache, first_block: int, ctx: ReqContext) -> int:
        """Offer the full blocks of ``ids`` from ``first_block`` on (their KV is in ``cache``)
        and store those the stack takes; how many it took."""
        driver = self._active()
        self._check(cache, len(ids))
        keys = self.block_keys(ids)
        position = {key: index for index, key in enumerate(keys)}
        before = driver.counts.stored_blocks

        def write(taken: list[OffloadKey]) -> list[int]:
            self._write_pages(cache, [position[key] for key in taken])
            return list(range(len(taken)))

        for chunk in _chunks(keys[first_block:], self.staging_blocks):
            driver.store(chunk, ctx, write)
            driver.wait_for_stores()  # the next chunk reuses the paged tensor
        return driver.counts.stored_blocks - before

    def _write_pages(self, cache: DynamicCache, blocks: list[int]) -> None:
        """Copy the KV of the request's ``blocks`` from ``cache`` into pages 0, 1, ..."""
        tokens = self.tokens_per_block
        layout = self.layout
        index = (torch.tensor(blocks)[:, None] * tokens + torch.arange(tokens)).view(-1)
        index = index.to(self._pages[0].device)
        n = len(blocks)
        for page, layer in zip(self._pages, layer_states(cache)):
            for half, states in enumerate(layer):
                picked = states[0].index_select(1, index).view(layout.kv_heads, n, tokens, layout.head_dim)
                page[:n, half].copy_(picked.transpose(0, 1))

    def _check(self, cache: DynamicCache, tokens: int) -> None:
        """The cache holds what the layout says, or :class:`KvtierError` naming the difference."""
        layout = self.layout
        want = ((1, layout.kv_heads, tokens, layout.head_dim), self.model.dtype)
        layers = layer_states(cache)
        if len(layers) != layout.layers:
            raise KvtierError(f"the model's cache has {len(layers)} layers, the block layout {layout.layers}")
        for index, layer in enumerate(layers):
            for name, states in zip(("keys", "values"), layer):
                got = (tuple(states.shape), states.dtype)
                if got != want:
                    raise KvtierError(
                        f"layer {index}'s cached {name} are {got}, the block layout expects {want}: "
                        "a model this layout cannot hold"
                    )


def _token_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """Token ids as a list: a sequence of ints, or a tensor of shape ``(n,)`` or ``(1, n)``."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise ConfigError(
                "token_ids",
                tuple(token_ids.shape),
                "one prompt: shape (n,) or (1, n)",
                "pass one prompt at a time",
            )
        ids = [int(t) for t in token_ids.tolist()]
    else:
        ids = [int(t) for t in token_ids]
    if not ids:
        raise ConfigError("token_ids", ids, "at least one token")
    return ids


def _stop_tokens(model: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}


def _chunks(keys: list[OffloadKey], size: int) -> Iterator[list[OffloadKey]]:
    for start in range(0, len(keys), size):
        yield keys[start : start + size]
