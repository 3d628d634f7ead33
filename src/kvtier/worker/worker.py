"""Routes each transfer job of a worker to the handler serving its (source, destination) media.

vLLM's offloading connector holds one :class:`OffloadingWorker` per worker process and
submits every job to it; standalone drivers (``kvtier replay``, the examples) do the same.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingHandler,
    OffloadingSpec,
    TransferResult,
    TransferSpec,
)

__all__ = ["OffloadingWorker"]


class OffloadingWorker:
    """Handlers by medium pair, and one place to submit, poll and wait for jobs.

    Who calls it: the engine's worker, from one thread. :meth:`transfer_async` and
    :meth:`get_finished` never wait; :meth:`wait` and :meth:`shutdown` block.
    """

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], OffloadingHandler] = {}
        self._job_handlers: dict[int, OffloadingHandler] = {}

    @classmethod
    def from_spec(cls, spec: OffloadingSpec, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """A worker holding every handler ``spec.get_handlers(kv_caches)`` yields."""
        worker = cls()
        for src_type, dst_type, handler in spec.get_handlers(kv_caches):
            worker.register_handler(src_type, dst_type, handler)
        return worker

    def register_handler(
        self,
        src_type: type[LoadStoreSpec],
        dst_type: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Send jobs from ``src_type``'s medium to ``dst_type``'s to ``handler``.

        A pair is served by one handler; registering a pair twice raises ``ValueError``.
        """
        pair = (src_type.medium(), dst_type.medium())
        if pair in self._handlers:
            raise ValueError(f"transfers {pair[0]} -> {pair[1]} already have a handler")
        self._handlers[pair] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Queue job ``job_id`` on the handler of its media; the handler's answer.

        Raises ``ValueError`` for a pair no handler serves, a job id still in flight, or a
        spec the handler finds malformed; nothing is queued then.
        """
        src, dst = spec
        pair = (src.medium(), dst.medium())
        handler = self._handlers.get(pair)
        if handler is None:
            served = ", ".join(f"{a}->{b}" for a, b in self._handlers) or "none"
            raise ValueError(f"no handler for transfers {pair[0]} -> {pair[1]} (served: {served})")
        if job_id in self._job_handlers:
            raise ValueError(f"job {job_id} is still in flight")
        queued = handler.transfer_async(job_id, spec)
        if queued:
            self._job_handlers[job_id] = handler
        return queued

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, of every handler (each handler's in its order)."""
        results: list[TransferResult] = []
        for handler in self._unique_handlers():
            results += handler.get_finished()
        for result in results:
            self._job_handlers.pop(result.job_id, None)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every named job in flight has finished; unknown ids are ignored."""
        by_handler: dict[int, tuple[OffloadingHandler, set[int]]] = {}
        for job_id in job_ids:
            handler = self._job_handlers.get(job_id)
            if handler is not None:
                by_handler.setdefault(id(handler), (handler, set()))[1].add(job_id)
        for handler, ids in by_handler.values():
            handler.wait(ids)

    def shutdown(self) -> None:
        """Shut every handler down (each once), waiting for queued jobs."""
        for handler in self._unique_handlers():
            shutdown = getattr(handler, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _unique_handlers(self) -> list[OffloadingHandler]:
        seen: dict[int, OffloadingHandler] = {}
        for handler in self._handlers.values():
            seen.setdefault(id(handler), handler)
        return list(seen.values())
