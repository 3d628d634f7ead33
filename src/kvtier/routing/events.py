"""KV events as the router's index reads them: blocks stored on or removed from a medium.

Three sources speak the same facts in different shapes, and :func:`block_events` turns each
into :class:`BlockEvent` values:

* **vLLM's KV events** (``vllm/distributed/kv_events.py``), as a router gets them off ZMQ and
  decodes them with any msgpack library: a ``KVEventBatch`` is ``[ts, events, dp_rank]``, each
  event a map tagged by ``type`` (vLLM 0.33: ``{"type": "BlockStored", "block_hashes": [...],
  "medium": "GPU", ...}``), or an array whose first element is the tag (older releases), or
  vLLM's own ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` objects. ``medium`` None
  is the GPU (the engine's own prefix cache).
* **kvtier's** :class:`~kvtier.base.OffloadingEvent` (``take_events``): each key's block hash
  (:func:`~kvtier.base.get_offload_block_hash`) on the tier's medium. A ``metadata_only``
  removal retracts a store no one was told of, and is skipped.
* **the replay engine's GPU cache**, which reports in kvtier's shape on medium ``"GPU"``.

A block hash is kept as it comes (``bytes`` or ``int``): the router must hash a request's
blocks the way its engines publish them (vLLM publishes bytes unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set). Events of KV groups other than the one
routed on (``group``, default 0: vLLM's first group, a full-attention model's only one) are
skipped. Unknown event types (a newer vLLM's) are skipped too; a known type missing a field
raises :class:`ValueError` naming it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtier.base import OffloadingEvent, get_offload_block_hash, get_offload_group_idx
from kvtier.errors import shown_value

__all__ = ["ALL_CLEARED", "BlockEvent", "batch_events", "block_events"]

#: the medium of an event that names none: vLLM's own GPU prefix cache
GPU_MEDIUM = "GPU"
#: :attr:`BlockEvent.kind` of vLLM's ``AllBlocksCleared`` (its GPU prefix cache was reset)
ALL_CLEARED = "cleared"

# vLLM's positional order of each event's fields, for events encoded as arrays
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": ALL_CLEARED}


@dataclass(frozen=True)
class BlockEvent:
    """Blocks that became readable (``stored``) or left (``removed``) one medium of an engine;
    or, ``cleared``, every block of its GPU cache left."""

    kind: str
    medium: str
    block_hashes: Sequence[Hashable] = ()


def block_events(event: object, group: int = 0) -> Iterator[BlockEvent]:
    """``event`` (one of the shapes in the module docstring) as :class:`BlockEvent` values
    (none for another KV group's, a retraction, or an unknown type)."""
    if isinstance(event, BlockEvent):
        yield event
        return
    if isinstance(event, OffloadingEvent):
        if event.removed and event.metadata_only:
            return
        hashes = [get_offload_block_hash(key) for key in event.keys if get_offload_group_idx(key) == group]
        if hashes:
            yield BlockEvent("removed" if event.removed else "stored", event.medium, hashes)
        return
    name, fields = _fields(event)
    if name not in _KINDS:
        return
    kind = _KINDS[name]
    if kind == ALL_CLEARED:
        yield BlockEvent(ALL_CLEARED, GPU_MEDIUM)
        return
    if (fields.get("group_idx") or 0) != group:
        return
    listed = fields.get("block_hashes")
    if not isinstance(listed, (list, tuple)):
        raise ValueError(f"a {name} event's block_hashes is {shown_value(listed)}; expected a list of hashes")
    medium = fields.get("medium") or GPU_MEDIUM
    if not isinstance(medium, str):
        raise ValueError(f"a {name} event's medium is {shown_value(medium)}; expected a string such as 'GPU'")
    if listed:
        yield BlockEvent(kind, medium, listed)


def batch_events(batch: object, group: int = 0) -> Iterator[BlockEvent]:
    """Every event of a ``KVEventBatch`` (``[ts, events, ...]``, a map with ``events``, or an
    object with ``.events``) as :class:`BlockEvent` values."""
    if isinstance(batch, Mapping):
        events = batch.get("events")
    elif isinstance(batch, (list, tuple)):
        events = batch[1] if len(batch) > 1 else None
    else:
        events = getattr(batch, "events", None)
    if not isinstance(events, Iterable) or isinstance(events, (str, bytes, Mapping)):
        raise ValueError(f"a KV event batch is [ts, events, ...]; got {shown_value(batch)}")
    for event in events:
        yield from block_events(event, group)


def _fields(event: object) -> tuple[object, Mapping[str, object]]:
    """The event's type name and its fields by name, whatever its shape."""
    if isinstance(event, Mapping):
        return event.get("type"), event
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        names = _FIELDS.get(event[0], ())
        return event[0], dict(zip(names, event[1:]))
    if event is None or isinstance(event, (str, bytes, int, float, list, tuple)):
        raise ValueError(
            f"not a KV event: {shown_value(event)}; expected a map with 'type' (vLLM 0.33), an "
            "array led by the type's name, vLLM's event objects, or kvtier's OffloadingEvent"
        )
    name = type(event).__name__
    return name, {field: getattr(event, field, None) for field in (*_FIELDS.get(name, ()), "group_idx")}
