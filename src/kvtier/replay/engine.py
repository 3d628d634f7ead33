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

import hashlib
import os
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from kvtier.base import OffloadingEvent, OffloadKey, ReqContext, TransferResult, make_offload_key
from kvtier.errors import KvtierError
from kvtier.mediums import GPULoadStoreSpec
from kvtier.replay.trace import Request

__all__ = ["ReplayEngine", "ReplayCounts", "block_key", "block_bytes_of"]

#: how long the engine waits for pending lookups or busy tiers before giving up on them
MAX_WAIT_S = 30.0


def block_key(hash_id: int) -> OffloadKey:
    """The offload key of trace block ``hash_id`` (a 32-byte hash, KV group 0, like vLLM's)."""
    return make_offload_key(hashlib.sha256(hash_id.to_bytes(8, "little")).digest(), 0)


def block_bytes_of(key: OffloadKey, nbytes: int, kv_like: bool = False) -> np.ndarray:
    """The bytes block ``key`` "computes" to: its SHA-512 repeated, so no other key's match
    (``kv_like``: read as bf16, every value finite, of magnitude 2^-7 to 2^-3)."""
    return np.frombuffer(_payload(key, nbytes, kv_like), dtype=np.int8)


def _payload(key: OffloadKey, nbytes: int, kv_like: bool = False) -> bytes:
    # bytes repetition is one C-level copy; np.resize did the same in a Python loop of numpy
    # calls and was most of the engine's own time.
    digest = hashlib.sha512(key).digest()
    if kv_like:
        # each bf16's high byte: sign, and an exponent of 0x78 to 0x7B, so a lossy codec
        # sees values (random bytes hold NaN and infinity), without a cost per block
        digest = bytes(b if i % 2 == 0 else (b & 0x81) | 0x3C for i, b in enumerate(digest))
    return (digest * -(-nbytes // len(digest)))[:nbytes]


@dataclass
class ReplayCounts:
    """What the replay saw, block by block (the tiers' own counters come from the manager)."""

    requests: int = 0
    block_refs: int = 0
    #: hits by tier name: "gpu", the CPU tier's name, then each lower tier's
    hits: dict[str, int] = field(default_factory=dict)
    verified_blocks: int = 0
    #: of those, blocks that came through a lossy codec: equal to its decode of what was stored
    codec_verified_blocks: int = 0
    mismatched_blocks: int = 0
    computed_blocks: int = 0
    stored_blocks: int = 0
    refused_stores: int = 0
    #: stores that found the CPU tier full of unsaved blocks and waited for the tiers
    store_waits: int = 0
    failed_transfers: int = 0
    #: blocks dropped from the CPU tier that no lower tier held at that moment
    dropped_blocks: int = 0
    steps: int = 0
    #: seconds the engine spent on its own work: making and checking block payloads
    engine_s: float = 0.0
    #: the worker's finished copy jobs by direction ("store", "load"): jobs, bytes, and the
    #: seconds the copy engine measured for them (on CUDA between events on the job's stream)
    copies: dict[str, dict[str, float]] = field(
        default_factory=lambda: {d: {"jobs": 0, "bytes": 0, "seconds": 0.0} for d in ("store", "load")}
    )
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


class ReplayEngine:
    """The simulated engine over a :class:`~kvtier.spec.TieredOffloadingSpec`'s two sides.

    ``spec`` builds the manager (scheduler side) and, from the engine's KV cache, the
    handlers (worker side); the engine calls both from its one thread.
    """

    def __init__(self, spec, gpu_blocks: int, device: str = "cpu", *, deterministic: bool = False):
        """``deterministic``: end every step with every copy and every tier job done (see
        :meth:`step`), so the same trace and stack give the same figures each run."""
        import torch

        from kvtier.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
        from kvtier.worker.worker import OffloadingWorker

        self.block_bytes = spec.block_bytes
        self.gpu_blocks = gpu_blocks
        self.deterministic = deterministic
        self._gpu = _gpu_cache(
            torch, gpu_blocks, self.block_bytes, device
        )  # before the stack: nothing to undo
        self.manager = spec.get_manager()
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(self._gpu, self.block_bytes)],
            [[CanonicalKVCacheRef(0, self.block_bytes)]],
        )
        self.worker = OffloadingWorker.from_spec(spec, caches)
        # One numpy element per block (a void of block_bytes): fancy indexing then copies
        # whole rows, where an int8 view would copy byte by byte.
        self._host_rows = (
            self._gpu.numpy().view(np.dtype((np.void, self.block_bytes)))[:, 0] if device == "cpu" else None
        )
        self._gpu_cache: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> GPU block, LRU
        self._keys: dict[int, OffloadKey] = {}  # trace block id -> key, each hashed once
        #: store copies in flight: job id -> (keys, request context, the GPU blocks it reads)
        self._storing: dict[int, tuple[list[OffloadKey], ReqContext, list[int]]] = {}
        #: GPU blocks a store copy still reads: neither evicted nor reused until it finishes
        self._copying: set[int] = set()
        #: of those, blocks whose key has since been computed again into another block: they
        #: leave the cache at once and come free when their copy ends
        self._orphans: set[int] = set()
        self._finished: dict[int, TransferResult] = {}  # handler results not yet taken
        self._free_gpu = list(range(gpu_blocks - 1, -1, -1))
        self._job_ids = itertools.count(1)
        self._cpu_name = spec.config.tiers[0].name
        self._lower = getattr(self.manager, "tiers", [])  # a single-tier manager has none
        self._lower_names = [tier.name for tier in self._lower]
        #: payloads are bf16 values (lossy codecs need them) where the layout says bf16
        self._kv_like = getattr(spec, "kv_dtype", "uint8") == "bfloat16"
        #: the lossy codecs of the lower tiers: a block may come back as their decode
        self._lossy = [
            codec for codec in (getattr(tier, "codec", None) for tier in self._lower) if codec and codec.lossy
        ]
        self.counts = ReplayCounts(hits={"gpu": 0, self._cpu_name: 0, **dict.fromkeys(self._lower_names, 0)})
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
                    self._wait_for_stores()
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

    def _transfer(self, spec) -> bool:
        """Run one copy to its end (a load: the engine needs its bytes now)."""
        job_id = next(self._job_ids)
        if not self.worker.transfer_async(job_id, spec):
            return False
        self.worker.wait({job_id})
        self._collect()
        return self._finished.pop(job_id).success

    def _collect(self) -> None:
        """Take the handlers' finished jobs; complete the stores among them."""
        finished = self._finished
        for result in self.worker.get_finished():
            finished[result.job_id] = result
            if result.success:
                copies = self.counts.copies["store" if result.job_id in self._storing else "load"]
                copies["jobs"] += 1
                copies["bytes"] += result.transfer_size or 0
                copies["seconds"] += result.transfer_time or 0.0
        for job_id in [job_id for job_id in self._storing if job_id in finished]:
            self._finish_store(job_id, finished.pop(job_id).success)

    def _finish_store(self, job_id: int, ok: bool) -> None:
        keys, ctx, blocks = self._storing.pop(job_id)
        self.manager.complete_store(keys, ctx, success=ok)
        self._copying.difference_update(blocks)
        if self._orphans:
            freed = self._orphans.intersection(blocks)
            self._orphans -= freed
            self._free_gpu.extend(freed)
        if ok:
            self.counts.stored_blocks += len(keys)
        else:
            self.counts.failed_transfers += 1

    def _wait_for_stores(self) -> None:
        """Wait for every store copy in flight and complete them."""
        if self._storing:
            self.worker.wait(set(self._storing))
            self._collect()

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
            self._wait_for_stores()
        elif self._storing:
            self._collect()
        self.manager.on_schedule_end()
        if self.deterministic:
            self._wait_for_tiers()
        self.counts.steps += 1
        for event in self.manager.take_events():
            if self.kv_events is not None:
                self.kv_events.append(event)
            if event.removed and not event.metadata_only and event.medium == "CPU" and self._lower:
                self.counts.dropped_blocks += sum(
                    1 for key in event.keys if not any(tier.lookup(key) for tier in self._lower)
                )

    def _served_by(self, key: OffloadKey) -> str:
        """The lower tier a promoted key came from: the first that holds it (the manager
        promotes from the first tier, in stack order, that has the key)."""
        for tier in self._lower:
            if tier.lookup(key):
                return tier.name
        return self._lower_names[0]

    def _lookup_prefix(self, keys: list[OffloadKey], ctx: ReqContext) -> tuple[int, set[OffloadKey]]:
        """How many of ``keys`` (in order) the offloading tiers can load now, and which keys
        were pending (being promoted from a lower tier) at some point.

        Like vLLM's connector, an answer holds only for the step it was given in: while any
        key is pending (``None``), the engine runs a step and asks about the whole prefix
        again. Keys already found are touched first, so the step's promotions make room by
        evicting other blocks rather than them.
        """
        manager = self.manager
        deadline = time.monotonic() + MAX_WAIT_S
        promoted: set[OffloadKey] = set()
        before: tuple | None = None
        is_promoting = getattr(manager, "is_promoting", lambda key: False)
        while True:
            found = 0
            waiting = []
            for key in keys:
                answer = manager.lookup(key, ctx)
                if answer is False:
                    break
                if answer is None:
                    waiting.append(key)
                    promoted.add(key)
                elif not waiting:
                    found += 1
            if not waiting or time.monotonic() >= deadline:
                return found, promoted
            if found:
                manager.touch(keys[:found], ctx)
            self.step()  # submits the reads
            # The request blocks on the tiers until an answer changes, as an engine's request
            # waits in its queue: never an empty step that finds the same None again (a remote
            # tier's answers take a round trip, and stepping through it is millions of steps).
            # (a key going from "unknown" to "being promoted" is progress, though both are None)
            now = (found, len(waiting), waiting[0], sum(map(is_promoting, waiting)))
            if now == before:
                self._wait_for_tiers()  # the reads are done, no answer moved: wait for the rest
            else:
                self._wait_for_loads()
            before = now
            self.step()  # takes their results: the next scan sees the promoted blocks

    def _wait_for_loads(self) -> None:
        """Block until the lower tiers finished their reads (promotions, and the reads that
        answer lookups); their saves go on meanwhile.

        A request waits for its promotions only, as in vLLM: a save queued beside the reads
        (with its flush and index commit) is not on the request's path.
        """
        for tier in self._lower:
            tier.wait_loads()

    def _wait_for_tiers(self) -> None:
        """Block until the lower tiers finished what they were given (reads and saves).

        For room to store: the CPU tier is full of blocks being saved below. Blocking, not
        polling: spinning on lookups (even yielding with ``sleep(0)``) starves the tiers'
        threads of the GIL on a busy machine, and short sleeps last a scheduler tick there.
        """
        for tier in self._lower:
            tier.drain_jobs()

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

        loaded, promoted = self._lookup_prefix(keys[gpu_hits:], ctx)
        hits = keys[gpu_hits : gpu_hits + loaded]
        served = {"gpu": gpu_hits} if gpu_hits else {}
        if hits:
            if self._load(hits, gpu_hits, ctx, keep):
                for key in hits:
                    tier = self._served_by(key) if key in promoted else self._cpu_name
                    counts.hits[tier] += 1
                    served[tier] = served.get(tier, 0) + 1
            else:
                loaded = 0  # nothing arrived: the engine computes those blocks instead
        keep.update(hits[:loaded])

        computed = keys[gpu_hits + loaded :]
        if computed:
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
            self._store(offer, ctx)
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
        manager = self.manager
        blocks = self._allocate_gpu(len(hits), keep)
        cpu_spec = manager.prepare_load(hits, ctx)
        gpu_spec = GPULoadStoreSpec(blocks, [len(blocks)], [first_index])
        ok = self._transfer((cpu_spec, gpu_spec))
        manager.complete_load(hits, ctx)
        if not ok:
            counts.failed_transfers += 1
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

    def _store(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        manager = self.manager
        out = manager.prepare_store(keys, ctx)
        if out is None and getattr(manager, "has_pending_work", lambda: False)():
            # The CPU tier is full of blocks still being saved below. The trace's requests
            # arrive minutes apart in reality and back to back here, so give the tiers' threads
            # the time a real arrival gap would have, then offer once more.
            self.counts.store_waits += 1
            deadline = time.monotonic() + MAX_WAIT_S
            while manager.has_pending_work() and time.monotonic() < deadline:
                self.step()
                self._wait_for_tiers()
            self.step()
            out = manager.prepare_store(keys, ctx)
        if out is None:
            self.counts.refused_stores += len(keys)
            return
        if not out.keys_to_store:
            return
        blocks = [self._gpu_cache[key] for key in out.keys_to_store]
        gpu_spec = GPULoadStoreSpec(blocks, [len(blocks)])
        job_id = next(self._job_ids)
        if not self.worker.transfer_async(job_id, (gpu_spec, out.store_spec)):
            manager.complete_store(out.keys_to_store, ctx, success=False)
            self.counts.failed_transfers += 1
            return
        self._storing[job_id] = (out.keys_to_store, ctx, blocks)
        self._copying.update(blocks)

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
            self.run_request(index, request)
            if progress is not None:
                progress(1)
            if (index + 1) % every == 0:
                self._sample(index + 1)
        self._wait_for_stores()  # the run ends when what it started has finished
        while getattr(self.manager, "has_pending_work", lambda: False)():
            self._wait_for_tiers()
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
            counts.cause_timeline.append(dict(causes.counts))

    def close(self) -> None:
        """Stop the handlers and the manager (the manager saves dirty CPU blocks below)."""
        self._wait_for_stores()
        self.worker.shutdown()
        self.manager.shutdown()
