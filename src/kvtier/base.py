"""The offloading contract kvtier implements (vLLM ``kv_offload``, the OffloadKey/ReqContext revision).

Two sides use these names:

* the **scheduler side** — an :class:`OffloadingManager` in the engine's scheduler process. It
  is pure bookkeeping: it decides which blocks live where, never moves bytes and never blocks
  on I/O. The engine calls it from one thread, under the engine's scheduler lock, so a manager
  needs no lock of its own for its own state.
* the **worker side** — :class:`OffloadingHandler` objects in each GPU worker process. They move
  bytes between the engine's KV cache and a tier, asynchronously, and report completions.

A block is named by an :data:`OffloadKey`; where it lives is described by a :class:`LoadStoreSpec`
that the manager hands to the worker through the engine. The worked example of the whole flow
is ``kvtier.manager.single.SingleTierManager`` with ``kvtier.tiers.cpu.backend.CPUBackend``.
"""

from __future__ import annotations

import ctypes
import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NewType, TypeVar

if TYPE_CHECKING:  # torch is only needed on the worker side; never import it here.
    import torch

__all__ = [
    "OffloadKey",
    "make_offload_key",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "ReqContext",
    "LoadTiers",
    "OffloadPolicy",
    "RequestOffloadingContext",
    "LoadStoreSpec",
    "PrepareStoreOutput",
    "OffloadingEvent",
    "OffloadingManager",
    "BlockStatus",
    "Backend",
    "TransferSpec",
    "TransferResult",
    "OffloadingHandler",
    "CanonicalKVCacheTensor",
    "CanonicalKVCacheRef",
    "CanonicalKVCaches",
    "OffloadingSpec",
]

# ---------------------------------------------------------------------------------------------
# Keys

OffloadKey = NewType("OffloadKey", bytes)
"""A block hash followed by its KV-group index as 4 big-endian bytes.

Plain ``bytes`` rather than a tuple: hashing and comparing one bytes object is cheaper than a
tuple of two, and a key is hashed on every manager call.
"""

_GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Join a block hash and a KV-group index into one key."""
    return OffloadKey(block_hash + group_idx.to_bytes(_GROUP_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of ``key``."""
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-group index part of ``key``."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big", signed=False)


# ---------------------------------------------------------------------------------------------
# Per-request context

_T = TypeVar("_T")


@dataclass
class ReqContext:
    """What the engine knows of one request, passed to every manager call made for it.

    ``kv_transfer_params`` are the request's own connector parameters (may be ``None``).
    A manager keeps per-request state with :meth:`set_state` / :meth:`get_state` (one slot per
    value type) instead of a dict of its own keyed by request id, so the state dies with the
    request and cannot leak. The engine may limit the tiers a request loads from the same way
    (:class:`LoadTiers`).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def set_state(self, value: Any) -> None:
        """Keep ``value`` for this request, replacing any earlier value of the same type."""
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        """The value of type ``cls`` kept by :meth:`set_state`, or ``None``."""
        return self._state.get(cls)


@dataclass(frozen=True)
class LoadTiers:
    """A request's limit on the lower tiers it may load from, kept in its :class:`ReqContext`
    (``ctx.set_state(LoadTiers(frozenset({"nvme"})))``); a request without one may load from
    every tier.

    ``names``: the lower tiers (by configured name) whose blocks it may have promoted; empty:
    none, so a block only a lower tier holds is a miss for it. The CPU tier always answers: it
    is where every load comes from (vLLM's ``load_tier_filter`` likewise filters only its
    secondary tiers), and a block some other request is promoting already answers "pending".
    """

    names: frozenset[str]


class OffloadPolicy(enum.Enum):
    """Which of a request's blocks the engine should offer for storing."""

    CHUNK_LEVEL = "chunk_level"
    """Only blocks the request computed itself; prefix hits are not offered again."""
    REQUEST_LEVEL = "request_level"
    """Every block of the request, prefix hits included."""


@dataclass
class RequestOffloadingContext:
    """What :meth:`OffloadingManager.on_new_request` answers: how to offload this request."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


# ---------------------------------------------------------------------------------------------
# Where blocks live


class LoadStoreSpec(ABC):
    """Where a batch of blocks lives, in a form a worker can read and write.

    Built by the scheduler side, sent to the worker side: keep it small and picklable.
    """

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name (``"GPU"``, ``"CPU"``, ...); handlers are routed by it."""


@dataclass
class PrepareStoreOutput:
    """The answer of :meth:`OffloadingManager.prepare_store`.

    ``keys_to_store`` are the offered keys that were not present (in offer order), ``store_spec``
    says where the worker must write them (same order), and ``evicted_keys`` were dropped to
    make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Blocks that became readable (``removed=False``) or were dropped (``removed=True``) on a medium.

    ``block_size`` is the tier's block size in bytes, so a consumer can turn events into bytes.
    ``metadata_only`` (with ``removed``): blocks whose store failed before they were ever
    readable. No stored event announced them, so a consumer that tracks what lookup can see
    skips it; one that kept state from the moment it asked for the store (vLLM's
    self-describing KV events) drops that state.
    """

    keys: list[OffloadKey]
    block_size: int
    medium: str
    removed: bool
    metadata_only: bool = False


# ---------------------------------------------------------------------------------------------
# The scheduler side


class OffloadingManager(ABC):
    """Decides which blocks are offloaded, and where; runs in the engine's scheduler process.

    Who calls it: the engine's scheduler (vLLM's offloading connector, or kvtier's own driver),
    from one thread, holding the scheduler's lock. The manager therefore keeps no lock for its
    own bookkeeping; a manager that runs background I/O must hand results over to that thread
    (poll them in :meth:`lookup` / :meth:`on_schedule_end`), never mutate state from elsewhere.

    No method may block on I/O: each call is bookkeeping proportional to the keys it names.

    Block states, as the engine sees them through this API:

    * absent — :meth:`lookup` is ``False``; :meth:`prepare_store` may take the key;
    * being written — after :meth:`prepare_store`, until :meth:`complete_store`; invisible to
      :meth:`lookup` and never evicted;
    * ready — :meth:`lookup` is ``True``; evictable unless pinned;
    * pinned — ready, between :meth:`prepare_load` and :meth:`complete_load`; never evicted, and
      its slot is never reused while a worker reads it.

    Implementations must keep these invariants (the stateful tests check them):

    * :meth:`prepare_store` skips keys already present (ready or being written), never evicts a
      key of its own offer, and either succeeds whole or changes nothing and returns ``None``;
    * ``complete_store(success=False)`` removes exactly the offered blocks that were still being
      written, and nothing else;
    * every block that becomes ready or is dropped yields an :class:`OffloadingEvent`, when
      events are enabled.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether ``key`` is offloaded and can be loaded now.

        ``True``: ready, :meth:`prepare_load` may follow. ``False``: not offloaded (or not
        readable yet). ``None``: unknown yet — the manager started something (say a read from a
        slower tier) and the engine should ask again in a later step.
        """

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` for reading and say where they are.

        The caller guarantees every key looked up ``True`` in this step. The blocks stay pinned
        (never evicted, slots never reused) until :meth:`complete_load` names them.
        """

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` as recently used (for eviction order); unknown keys are ignored.

        Separate from :meth:`prepare_load` so the engine can also refresh blocks it found in
        its own GPU prefix cache and does not need to read.
        """

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin ``keys`` after the worker finished reading them."""

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for the offered ``keys`` that are not present yet.

        Returns where to write them, and which keys were evicted for room; ``None`` if they
        cannot all be placed, in which case nothing changed. Reserved blocks are invisible to
        :meth:`lookup` and never evicted until :meth:`complete_store`.
        """

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The worker finished writing ``keys``.

        With ``success=True`` the blocks being written become ready. With ``success=False``
        those still being written are removed and their room freed; ready blocks stay.
        """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """The engine saw a request for the first time; answer how to offload it."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request finished (or was aborted); per-request state may be dropped."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Hand over the events gathered since the last call (each event once)."""
        return ()

    def on_schedule_end(self) -> None:
        """End of one scheduler step: the place to submit work batched during the step."""

    def reset_cache(self) -> None:
        """Forget every block (the engine's cache reset).

        The caller guarantees no transfer of this manager is in flight; ``complete_*`` calls
        for keys from before the reset are ignored.
        """

    def shutdown(self) -> None:
        """Release every resource (memory regions, files, threads). Idempotent."""


# ---------------------------------------------------------------------------------------------
# One tier's allocator


class BlockStatus(ctypes.Structure):
    """State of one allocated block, as the contract's ``Backend`` API hands it out.

    ``ref_cnt``: ``-1`` being written (not readable), ``0`` ready and evictable, ``>0`` pinned
    by that many reads. ``block_id``: the block's slot in its backend.

    kvtier's own managers keep the slot id and the count in their indexes instead of one of
    these per block (a ctypes object costs about 120 bytes, more than all the rest of a
    block's metadata); the class exists for code written against vLLM's ``Backend``.
    """

    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int = -1, ref_cnt: int = -1):
        super().__init__(ref_cnt, block_id)

    @property
    def is_ready(self) -> bool:
        """Whether the block may be read."""
        return self.ref_cnt >= 0


class Backend(ABC):
    """One tier's allocator: hands out and takes back fixed-size slots, and describes them.

    Who calls it: the manager that owns the tier, on the scheduler thread; a Backend is not
    shared between managers. It must not block on I/O: allocation is bookkeeping; the bytes
    are moved by workers (or by a mover's threads) using the :class:`LoadStoreSpec` it builds.

    A Backend does not track keys, readiness or eviction order: the manager does. The primitive
    API works on slot ids in batches (:meth:`allocate_block_ids` / :meth:`free_block_ids`); the
    contract's per-block API (:meth:`allocate_blocks` / :meth:`free` with :class:`BlockStatus`)
    is derived from it here, so a new tier implements only the four abstract methods.
    """

    def __init__(self, block_size: int, medium: str):
        #: bytes per block (one row of the tier)
        self.block_size = block_size
        #: the medium name its specs carry
        self.medium = medium

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """How many blocks :meth:`allocate_block_ids` can hand out now."""

    @abstractmethod
    def allocate_block_ids(self, count: int) -> list[int]:
        """Take ``count`` free slots. The caller checked :meth:`get_num_free_blocks` first."""

    @abstractmethod
    def free_block_ids(self, block_ids: Iterable[int]) -> None:
        """Give back slots from :meth:`allocate_block_ids`, each once, none still in use."""

    @abstractmethod
    def get_load_store_spec(
        self, keys: Iterable[OffloadKey], blocks: Iterable[int] | Iterable[BlockStatus]
    ) -> LoadStoreSpec:
        """Describe where ``keys`` live: ``blocks`` are their slot ids (or BlockStatus objects)."""

    def allocate_blocks(self, keys: Sequence[OffloadKey]) -> list[BlockStatus]:
        """Contract form of :meth:`allocate_block_ids`: one not-ready BlockStatus per key."""
        return [BlockStatus(block_id) for block_id in self.allocate_block_ids(len(keys))]

    def free(self, block: BlockStatus) -> None:
        """Contract form of :meth:`free_block_ids` for one block."""
        self.free_block_ids((block.block_id,))

    def shutdown(self) -> None:
        """Release the tier's resources. Idempotent."""


# ---------------------------------------------------------------------------------------------
# The worker side

TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""``(source, destination)`` of one transfer job."""


@dataclass
class TransferResult:
    """A finished transfer job: its id, whether every byte arrived, and how many bytes moved."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class OffloadingHandler(ABC):
    """Moves blocks in one direction (say GPU to CPU), asynchronously; runs in a worker process.

    Who calls it: the engine's worker, from one thread. :meth:`transfer_async` must return
    quickly (it queues work on a CUDA stream or a background thread); completions are reported
    by :meth:`get_finished`, in submission order per handler.
    """

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Queue the copy ``spec`` as job ``job_id``; ``False`` if it could not be queued."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, without waiting."""

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has finished."""


@dataclass
class CanonicalKVCacheTensor:
    """One KV-cache tensor viewed as ``(num_blocks, page_size_bytes)`` int8."""

    tensor: torch.Tensor
    #: bytes of one block's page, padding included
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """Which tensor a layer (or group of layers) uses, and its un-padded page size."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """The engine's KV cache: unique block tensors, and per KV group the tensors it uses."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


class OffloadingSpec(ABC):
    """Builds both sides of an offloading setup from one configuration.

    :meth:`get_manager` is called once in the scheduler process, :meth:`get_handlers` once in
    each worker process; both read the same configuration, so they agree on tiers and layout.
    """

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """``(source spec type, destination spec type, handler)`` for each direction served."""
