"""A small engine that drives the real offloading stack the way vLLM's connector does.

It owns a "GPU" KV cache (a CUDA tensor, or a CPU tensor standing in without CUDA) of
``gpu_blocks`` blocks with its own LRU prefix cache, and per request:

1. takes the longest prefix already in its GPU cache;
2. looks the next keys up in the offloading manager, in prefix order, until the first miss; a
   ``None`` (being promoted from a lower tier) counts as a pending hit, and the engine runs
   scheduler steps until every pending answer is ``True`` or ``False`` — the prefix ends at
   the first ``False``;
3. loads the hits into free GPU blocks through the real CPU->GPU handler, and compares every
   loaded block byte for byte with what was stored (a block that came through a lossy codec
   of a lower tier, with that codec's decode of what was stored: its own, never another
   block's);
4. "computes" the rest: writes each block's deterministic bytes (derived from its key);
5. offers the computed blocks for storing — with the GPU prefix before them when nothing
   was loaded, as vLLM 0.33's connector does (a present block offered again is how the
   manager learns it is in use: the connector never calls ``touch``) — and starts their
   GPU->CPU copy through the real handler; then finishes the request and ends the step. Like vLLM's connector, it does not
   wait for the copy: the store completes at the first step after the handler reports it,
   and until then its GPU blocks are neither evicted nor reused.

Requests run back to back, one at a time, whatever the trace's timestamps, so the figures are
about what the tiers hold and move, not about queueing; the timestamps serve only as the clock
of the tiers' write budgets (``admit: budget``), which are rates in the trace's time. When it has nothing to
do but wait, it blocks, as a request waits in an engine's queue, rather than sleeping,
polling or stepping empty: on the tiers' ``wait_loads`` for a promotion or a remote tier's
answer (on ``drain_jobs`` if a round of reads moved no answer), on ``drain_jobs`` for room
to store, and on the store copies in flight for free GPU blocks. On a busy machine a short
sleep lasts far longer than asked, and a replay would measure the scheduler's naps; empty
steps over a remote tier were 800 per request.

The engine's own work — making each computed block's bytes and checking each loaded one —
is timed apart (``ReplayCounts.engine_s``), so what is left of the elapsed time is the
stack's: the manager, the tiers, the handlers.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from kvtier.base import OffloadingEvent, OffloadKey, ReqContext, make_offload_key
from kvtier.cli.signals import deferred_stop
from kvtier.driver import DriverCounts, StackDriver
from kvtier.errors import KvtierError
from kvtier.mediums import GPULoadStoreSpec
from kvtier.replay.trace import Request

__all__ = ["ReplayEngine", "ReplayCounts", "block_key", "block_bytes_of"]


def block_key(hash_id: int) -> OffloadKey:
    """The offload key of trace block ``hash_id`` (a 32-byte hash, KV group 0, like vLLM's)."""
    return make_offload_key(hashlib.sha256(hash_id.to_bytes(8, "little")).digest(), 0)


def block_bytes_of(key: OffloadKey, nbytes: int, kv_like: bool = False) -> np.ndarray:
    """The bytes block ``key`` "computes" to: its SHA-512 repeated, so no other key's match
    (``kv_like``: bf16 values, every one finite: the SHA-512's, then a stretch of synthetic
    KV the key picks, which ``lossless`` compresses as it does real KV, about 1.4x, where the
    repeated hash would shrink to almost nothing)."""
    return np.frombuffer(_payload(key, nbytes, kv_like), dtype=np.int8)


@functools.lru_cache(maxsize=4)
def _kv_pool(nbytes: int) -> bytes:
    """Synthetic bf16 KV (:func:`kvtier.bench.codec.synthetic_kv`) the kv-like payloads of
    ``nbytes`` take their stretch from: made once, at least twice a block."""
    from kvtier.bench.codec import synthetic_kv

    return synthetic_kv(max(4 << 20, 2 * nbytes)).tobytes()


def _payload(key: OffloadKey, nbytes: int, kv_like: bool = False) -> bytes:
    # bytes repetition and slicing are C-level copies; np.resize did the same in a Python
    # loop of numpy calls and was most of the engine's own time.
    digest = hashlib.sha512(key).digest()
    if not kv_like:
        return (digest * -(-nbytes // len(digest)))[:nbytes]
    # each bf16's high byte: sign, and an exponent of 0x78 to 0x7B (random bytes hold NaN
    # and infinity); the hash keeps every key's block its own
    digest = bytes(b if i % 2 == 0 else (b & 0x81) | 0x3C for i, b in enumerate(digest))
    rest = nbytes - len(digest)
    if rest <= 0:
        return digest[:nbytes]
    pool = _kv_pool(nbytes)
    start = int.from_bytes(digest[:8], "little") % (len(pool) - rest) & ~1  # whole bf16 values
    return digest + pool[start : start + rest]


@dataclass
class ReplayCounts(DriverCounts):
    """What the replay saw, block by block (the tiers' own counters come from the manager;
    the copies' and stores' from :class:`~kvtier.driver.DriverCounts`)."""

    requests: int = 0
    block_refs: int = 0
    #: hits by tier name: "gpu", the CPU tier's name, then each lower tier's
    hits: dict[str, int] = field(default_factory=dict)
    verified_blocks: int = 0
    #: of those, blocks that came through a lossy codec: equal to its decode of what was stored
    codec_verified_blocks: int = 0
    mismatched_blocks: int = 0
    computed_blocks: int = 0
    #: blocks dropped from the CPU tier that no lower tier held at that moment
    dropped_blocks: int = 0
    steps: int = 0
    #: seconds the engine spent on its own work: making and checking block payloads
    engine_s: float = 0.0
    #: seconds closing the stack took (saving what only the CPU tier held), after the run
    shutdown_s: float = 0.0
    #: bytes that closing the stack wrote to each lower tier (by tier name)
    shutdown_bytes_written: dict[str, int] = field(default_factory=dict)
    #: (requests done, cumulative hits by tier, cumulative block refs), one per sample
    timeline: list[tuple[int, dict[str, int], int]] = field(default_factory=list)
    #: the manager's cumulative misses by cause at each sample of ``timeline`` (empty: the
    #: stack counts no causes)
    cause_timeline: list[dict[str, int]] = field(default_factory=list)
    #: per request, in order: its blocks by where they came from ("gpu", a tier's name,
    #: "computed"), in prefix order; what a time model (``kvtier replay --model``) prices
    served: list[dict[str, int]] = field(default_factory=list)


def _gpu_cache(torch: Any, gpu_blocks: int, block_bytes: int, device: str) -> Any:
    """The simulated GPU cache, zeroed; a KvtierError naming ``--gpu-blocks`` when it is more
    than the machine's memory (on the CPU: refused before a zeroing that would take it all)
    or the device cannot allocate it."""
    wanted = gpu_blocks * block_bytes
    fix = "lower --gpu-blocks (or --block-bytes)"
    if device == "cpu" and hasattr(os, "sysconf"):
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if wanted > memory:
            raise KvtierError(
                f"--gpu-blocks {gpu_blocks} of {block_bytes} bytes is {wanted / 2**30:.1f} GiB, more "
                f"than this machine's {memory / 2**30:.1f} GiB of memory: {fix}"
            )
    try:
        return torch.zeros((gpu_blocks, block_bytes), dtype=torch.int8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch's allocation failures (CUDA's too)
        raise KvtierError(
            f"--gpu-blocks {gpu_blocks} of {block_bytes} bytes ({wanted / 2**30:.1f} GiB) cannot be "
            f"allocated on {device} ({str(exc).splitlines()[0][:120]}): {fix}"
        ) from None


class ReplayEngine(StackDriver):
    """The simulated engine over a :class:`~kvtier.spec.TieredOffloadingSpec`'s two sides.

    ``spec`` builds the manager (scheduler side) and, from the engine's KV cache, the
    handlers (worker side); the engine drives both from its one thread
    (:class:`~kvtier.driver.StackDriver`).
    """

    counts: ReplayCounts

    def __init__(self, spec, gpu_blocks: int, device: str = "cpu", *, deterministic: bool = False):
        """``deterministic``: end every step with every copy and every tier job done (see
        :meth:`step`), so the same trace and stack give the same figures each run."""
        import torch

        from kvtier.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

        self.block_bytes = spec.block_bytes
        self.gpu_blocks = gpu_blocks
        self.deterministic = deterministic
        # before the stack: nothing to undo when it cannot be allocated
        self._gpu = _gpu_cache(torch, gpu_blocks, self.block_bytes, device)
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(self._gpu, self.block_bytes)],
            [[CanonicalKVCacheRef(0, self.block_bytes)]],
        )
        super().__init__(spec, caches, ReplayCounts())
        # One numpy element per block (a void of block_bytes): fancy indexing then copies
        # whole rows, where an int8 view would copy byte by byte.
        self._host_rows = (
            self._gpu.numpy().view(np.dtype((np.void, self.block_bytes)))[:, 0] if device == "cpu" else None
        )
        self._gpu_cache: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> GPU block, LRU
        self._keys: dict[int, OffloadKey] = {}  # trace block id -> key, each hashed once
        #: GPU blocks a store copy still reads: neither evicted nor reused until it finishes
        self._copying: set[int] = set()
        #: of those, blocks whose key has since been computed again into another block: they
        #: leave the cache at once and come free when their copy ends
        self._orphans: set[int] = set()
        self._free_gpu = list(range(gpu_blocks - 1, -1, -1))
        self.counts.hits = {"gpu": 0, self.cpu_name: 0, **dict.fromkeys(self.lower_names, 0)}
        #: payloads are bf16 values (lossy codecs need them) where the layout says bf16
        self._kv_like = getattr(spec, "kv_dtype", "uint8") == "bfloat16"
        #: the lossy codecs of the lower tiers: a block may come back as their decode
        self._lossy = [
            codec for codec in (getattr(tier, "codec", None) for tier in self.lower) if codec and codec.lossy
        ]
        #: the trace's time (seconds) at the request in hand; None before the first
        self.trace_s: float | None = None
        #: when a list (a router reads this engine's KV events): every block its GPU cache
        #: and its stack stored or removed, in order, until :meth:`take_kv_events`
        self.kv_events: list[OffloadingEvent] | None = None

    # -- the GPU side ----------------------------------------------------------------------

    def _allocate_gpu(self, count: int, keep: set[OffloadKey]) -> list[int]:
        """``count`` free GPU blocks, evicting cached blocks (least recently used first) other
        than ``keep`` (the blocks the request in hand uses) and those a store copy reads.

        Like an engine's queue, a request that fits the cache on its own waits for the store
        copies in flight rather than fail: their blocks come free (or evictable) when they
        end. The caller keeps ``len(keep) + count <= gpu_blocks``, so after that wait every
        other block can go.
        """
        while len(self._free_gpu) < count:
            copying = self._copying
            for victim, block in self._gpu_cache.items():
                if victim not in keep and block not in copying:
                    del self._gpu_cache[victim]
                    self._free_gpu.append(block)
                    if self.kv_events is not None:
                        self.kv_events.append(
                            OffloadingEvent([victim], self.block_bytes, GPULoadStoreSpec.medium(), True)
                        )
                    break
            else:
                if self._storing:  # blocks still being copied out: theirs come free then
                    self.wait_for_stores()
                    continue
                raise KvtierError(  # an engine bug: the caller checks the request fits
                    f"a request needs {count} GPU blocks but only {len(self._free_gpu)} are free "
                    f"of {self.gpu_blocks} ({len(keep)} held for it)"
                )
        taken = self._free_gpu[-count:] if count else []
        del self._free_gpu[len(self._free_gpu) - count :]
        return taken

    def _cache_put(self, keys: list[OffloadKey], blocks: list[int]) -> None:
        """Cache ``keys`` in GPU ``blocks`` (most recently used). A key cached already, out of
        its request's prefix and so computed or loaded again, gives up its old block: free
        now, or once the store copy reading it ends (replacing the entry alone leaked it)."""
        cache = self._gpu_cache
        if self.kv_events is not None:
            new = [key for key in keys if key not in cache]
            if new:
                self.kv_events.append(
                    OffloadingEvent(new, self.block_bytes, GPULoadStoreSpec.medium(), False)
                )
        for key, block in zip(keys, blocks):
            old = cache.pop(key, None)
            if old is not None:
                if old in self._copying:
                    self._orphans.add(old)
                else:
                    self._free_gpu.append(old)
            cache[key] = block

    def _write_gpu(self, blocks: list[int], payload: bytes) -> None:
        """Write ``payload`` (one row per block, concatenated) into GPU ``blocks``."""
        if self._host_rows is not None:
            self._host_rows[blocks] = np.frombuffer(payload, dtype=self._host_rows.dtype)
        else:
            import torch

            values = np.frombuffer(payload, dtype=np.int8).reshape(len(blocks), self.block_bytes)
            index = torch.tensor(blocks, device=self._gpu.device)
            self._gpu[index] = torch.from_numpy(values.copy()).to(self._gpu.device)

    def _read_gpu(self, blocks: list[int]) -> bytes:
        """GPU ``blocks``' bytes, concatenated."""
        if self._host_rows is not None:
            return self._host_rows[blocks].tobytes()
        import torch

        return self._gpu[torch.tensor(blocks, device=self._gpu.device)].cpu().numpy().tobytes()

    def _copy_ended(self, blocks: list[int]) -> None:
        self._copying.difference_update(blocks)
        if self._orphans:
            freed = self._orphans.intersection(blocks)
            self._orphans -= freed
            self._free_gpu.extend(freed)

    # -- the scheduler side --------------------------------------------------------------------

    def step(self) -> None:
        """End one scheduler step; count CPU-tier drops that no lower tier could have served.

        Deterministic, the step first waits for the store copies in flight and ends by
        waiting for the tier jobs it submitted: what the manager sees at each step no longer
        depends on how fast threads and disks happened to be. Otherwise (the default, as an
        engine runs) copies and saves overlap the next requests, and which blocks are clean
        at a given step, so the split of hits between the CPU tier and the tiers below,
        changes from run to run; the total does not.
        """
        if self.deterministic:
            self.wait_for_stores()
        super().step()
        if self.deterministic:
            self.wait_for_tiers()
        self.counts.steps += 1
        for event in self.manager.take_events():
            if self.kv_events is not None:
                self.kv_events.append(event)
            if event.removed and not event.metadata_only and event.medium == "CPU" and self.lower:
                self.counts.dropped_blocks += sum(
                    1 for key in event.keys if not any(tier.lookup(key) for tier in self.lower)
                )

    def run_request(self, index: int, request: Request) -> None:
        """Serve one request end to end (see the module docstring)."""
        counts = self.counts
        first = self.trace_s is None
        self.trace_s = request.timestamp_ms / 1000
        if first and hasattr(self.manager, "use_clock"):
            # Write budgets run on the trace's time (from its first request), not on how
            # fast this machine replays it: see docs/design/write-budget.md.
            self.manager.use_clock(self._trace_clock)
        known = self._keys
        keys = [known.get(h) or known.setdefault(h, block_key(h)) for h in request.hash_ids]
        counts.requests += 1
        counts.block_refs += len(keys)
        ctx = ReqContext(f"req-{index}")
        manager = self.manager
        manager.on_new_request(ctx)

        gpu_hits = 0
        while gpu_hits < len(keys) and keys[gpu_hits] in self._gpu_cache:
            self._gpu_cache.move_to_end(keys[gpu_hits])
            gpu_hits += 1
        counts.hits["gpu"] += gpu_hits
        # Only the blocks the request uses are held: its later keys that happen to be cached
        # are computed or loaded again (the prefix broke before them), into new blocks.
        keep = set(keys[:gpu_hits])

        loaded, promoted, counted = self.lookup_prefix(keys[gpu_hits:], ctx)
        hits = keys[gpu_hits : gpu_hits + loaded]
        served = {"gpu": gpu_hits} if gpu_hits else {}
        if hits:
            if self._load(hits, gpu_hits, ctx, keep):
                for tier, count in self.served(hits, promoted).items():
                    counts.hits[tier] += count
                    served[tier] = count
            else:
                loaded = 0  # nothing arrived: the engine computes those blocks instead
        keep.update(hits[:loaded])

        computed = keys[gpu_hits + loaded :]
        if computed:
            # every block computed but those the manager counted when it said False: the ones
            # after the miss were never looked up, a failed load's were hits until then
            behind = [key for index, key in enumerate(computed, loaded) if index not in counted]
            if behind and hasattr(manager, "missed_behind"):
                manager.missed_behind(behind, ctx)
            blocks = self._allocate_gpu(len(computed), keep)
            start = time.perf_counter()
            nbytes = self.block_bytes
            kv_like = self._kv_like
            self._write_gpu(blocks, b"".join([_payload(key, nbytes, kv_like) for key in computed]))
            counts.engine_s += time.perf_counter() - start
            self._cache_put(computed, blocks)
            counts.computed_blocks += len(computed)
            served["computed"] = len(computed)
        counts.served.append(served)
        # vLLM's connector (chunk-level offloading) offers a request's blocks from its first
        # unless it loaded some, then from the first after the loaded ones.
        offer = computed if loaded else keys[:gpu_hits] + computed
        if offer:
            gpu_cache = self._gpu_cache
            self._copying.update(self.store(offer, ctx, lambda keys: [gpu_cache[key] for key in keys]))
        manager.on_request_finished(ctx)
        self.step()

    def take_kv_events(self) -> list[OffloadingEvent]:
        """The KV events gathered since the last call (none unless :attr:`kv_events` is on)."""
        events = self.kv_events or []
        if self.kv_events is not None:
            self.kv_events = []
        return events

    def _trace_clock(self) -> float:
        return self.trace_s or 0.0

    def _load(self, hits: list[OffloadKey], first_index: int, ctx: ReqContext, keep: set) -> bool:
        """Load ``hits`` into GPU blocks and verify them; whether the transfer succeeded."""
        counts = self.counts
        blocks = self._allocate_gpu(len(hits), keep)
        if not self.load(hits, blocks, first_index, ctx):
            self._free_gpu.extend(blocks)
            return False
        start = time.perf_counter()
        nbytes = self.block_bytes
        expected = [_payload(key, nbytes, self._kv_like) for key in hits]
        got = self._read_gpu(blocks)
        if got == b"".join(expected):  # the common case: one comparison for the whole load
            counts.verified_blocks += len(hits)
        else:
            for i, want in enumerate(expected):
                block = got[i * nbytes : (i + 1) * nbytes]
                if block == want:
                    counts.verified_blocks += 1
                elif block in self._decodes(want):
                    counts.verified_blocks += 1
                    counts.codec_verified_blocks += 1
                else:
                    counts.mismatched_blocks += 1
        counts.engine_s += time.perf_counter() - start
        self._cache_put(hits, blocks)
        return True

    def _decodes(self, block: bytes) -> set[bytes]:
        """What ``block`` may come back as through the stack's lossy codecs: each one's decode
        of it, and of the others' (a block one tier decoded may be stored in another). A
        decoded block encodes to itself again (a codec's promise), so no longer chain adds any."""
        found: set[bytes] = set()
        frontier = [block]
        for _ in self._lossy:
            frontier = [
                decoded
                for source in frontier
                for codec in self._lossy
                if (decoded := codec.decode(codec.encode(np.frombuffer(source, dtype=np.uint8))).tobytes())
                not in found
            ]
            found.update(frontier)
        return found

    def run(
        self,
        requests: Iterable[Request],
        progress: Callable[[int], None] | None = None,
        samples: int = 200,
        total: int | None = None,
    ) -> float:
        """Serve every request; the elapsed seconds. ``progress(n)`` after each request."""
        total = total or 0
        every = max(1, total // samples) if total else 50
        start = time.perf_counter()
        for index, request in enumerate(requests):
            # A stop signal (kvtier's commands turn SIGTERM and SIGHUP into an exception)
            # waits for the request's end: raised inside it, it could cut the manager's or a
            # tier's books in two (a job counted and never queued), and the shutdown that
            # follows would wait for ever for what never runs.
            with deferred_stop():
                self.run_request(index, request)
            if progress is not None:
                progress(1)
            if (index + 1) % every == 0:
                self._sample(index + 1)
        with deferred_stop():
            self.wait_for_stores()  # the run ends when what it started has finished
            while getattr(self.manager, "has_pending_work", lambda: False)():
                self.wait_for_tiers()
                self.step()
            self.step()
        self._sample(self.counts.requests)
        return time.perf_counter() - start

    def _sample(self, done: int) -> None:
        """One point of the timelines: hits so far, and misses by cause where counted."""
        counts = self.counts
        counts.timeline.append((done, dict(counts.hits), counts.block_refs))
        causes = getattr(self.manager, "miss_causes", None)
        if causes is not None:
            counts.cause_timeline.append(causes.totals())
