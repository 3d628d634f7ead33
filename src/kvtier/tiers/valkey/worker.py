"""What the valkey tier's worker threads run: values encoded and sent, read back and verified.

A :class:`ValueIO` belongs to one tier. Its ``run_*`` methods run on the tier's writer and
reader threads (a copier thread takes half of a large load); they touch only the CPU rows of
their job, and hand their outcome back by appending ``(kind, outcome, extra)`` to ``done``,
which the scheduler thread folds in. A batch whose every key met an outage of the whole
server (:meth:`~kvtier.tiers.valkey.connection.ValkeyConnection.outage_of`) calls ``went_down``.
With a codec, a value's payload is the encoded block: encoded here on the writer thread, and
on the reader thread verified as received (checksum or MAC over what the server held) before
it is decoded into the CPU row.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvtier.base import OffloadKey
from kvtier.codecs import BlockCodec, CodecError
from kvtier.tiers.disk.format import (
    FLAG_ENCRYPTED,
    HEADER_BYTES,
    NO_CODEC,
    decode_header,
    header_flags,
    verify,
)
from kvtier.tiers.jobs import Failure, FailureKind, TierJobResult
from kvtier.tiers.secret import TierKeys, encode_block_header
from kvtier.tiers.valkey.connection import ValkeyConnection
from kvtier.tiers.valkey.probe import ProbeOutcome

__all__ = ["PARALLEL_COPY_BYTES", "ValueIO"]

logger = logging.getLogger(__name__)

#: a load of at least this many bytes of read values copies them on two threads
PARALLEL_COPY_BYTES = 8 << 20


def _value_bytes(values: list) -> int:
    """Bytes of the values among a batch's replies (not its misses or failures)."""
    return sum(len(value) for value in values if isinstance(value, np.ndarray))


def _unexpected(tier: str, job: str, error: BaseException) -> Failure:
    """Any thread: an exception nobody expected, logged with its traceback; the keys' reason."""
    logger.error("valkey tier %r: a %s failed unexpectedly", tier, job, exc_info=error)
    return Failure(FailureKind.UNEXPECTED, detail=type(error).__name__)


class ValueIO:
    """One tier's values on the wire: names, encoding, and the worker threads' jobs.

    ``tier``: the tier's name (for logs); ``rows``: the CPU tier's ``(num_rows, block_bytes)``
    uint8 view; ``keys``: the secret's keys, or None; ``digest``: the layout's digest;
    ``prefix``: the namespace and a colon; ``batch_keys``: keys per pipelined batch;
    ``codec``: the tier's codec, or None (payloads are the rows as they are).
    """

    def __init__(
        self,
        tier: str,
        conn: ValkeyConnection,
        rows: np.ndarray,
        keys: TierKeys | None,
        digest: bytes,
        prefix: bytes,
        batch_keys: int,
        ttl_s: float | None,
        copier: ThreadPoolExecutor,
        done: deque,
        went_down: Callable[[Failure], None],
        codec: BlockCodec | None = None,
    ):
        self.tier = tier
        self.conn = conn
        self.rows = rows
        self.keys = keys
        self.digest = digest
        self.prefix = prefix
        self.block_bytes = rows.shape[1]
        self.codec = codec
        self.descriptor = codec.descriptor if codec is not None else NO_CODEC
        #: the most payload bytes a value holds (exactly that unless the codec varies)
        self.payload_bytes = codec.max_encoded_bytes if codec is not None else self.block_bytes
        self.exact = codec is None or codec.fixed_size
        #: the longest value (exactly every value's length where ``exact``)
        self.value_bytes = HEADER_BYTES + self.payload_bytes
        # the longest value read whole: one of this layout stored without a codec, so that a
        # value of another codec is read far enough to be told by its header, not its length
        self.read_bytes = HEADER_BYTES + self.block_bytes
        self.batch_keys = batch_keys
        self.ttl_s = ttl_s
        self.copier = copier
        self.done = done
        self.went_down = went_down
        # the writer thread's ciphertext buffers, one per value of a batch (encrypt only)
        self.cipher_buffers: list[np.ndarray] = []
        # the writer thread's encoded payloads, one per value of a batch (with a codec)
        self.codec_buffers: list[np.ndarray] = []
        #: bytes of the values stored (header and payload: what went over the wire and what
        #: the server holds); added to by the writer thread alone
        self.sent_bytes = 0
        #: bytes of the values read back (probes and loads); added to by the reader thread alone
        self.received_bytes = 0

    def header_key(self, key: OffloadKey) -> bytes:
        """What stands for ``key`` in a value's name and header: the key, or with a secret its
        keyed digest (the public block hash would tell anyone which prefixes are cached)."""
        return key if self.keys is None else self.keys.name_digest(key)

    def name_of(self, key: OffloadKey) -> bytes:
        return self.prefix + self.header_key(key).hex().encode()

    def encode(self, key: OffloadKey, row: int, slot: int = 0) -> tuple[bytes, memoryview]:
        """The value of ``key``: its header page, then the CPU row itself (sent as it is), or
        encoded with the codec, or encrypting, its ciphertext, in the writer's buffers
        ``slot`` (one per value of a batch)."""
        payload = self.rows[row]
        if self.codec is not None:
            out = self._buffer(self.codec_buffers, slot)
            payload = out[: self.codec.encode_into(payload, out)]
        header = bytearray(HEADER_BYTES)
        keys = self.keys
        encode_block_header(
            header,
            layout_digest=self.digest,
            key=self.header_key(key),
            payload=payload,
            payload_bytes=len(payload),
            keys=keys,
            codec=self.descriptor,
        )
        if keys is None:
            return bytes(header), payload.data
        cipher = self._buffer(self.cipher_buffers, slot)[: len(payload)] if keys.encrypt else None
        sealed = keys.seal(header, payload, cipher)  # the ciphertext when encrypting, else the row
        return bytes(header), memoryview(sealed).cast("B")

    def _buffer(self, buffers: list[np.ndarray], slot: int) -> np.ndarray:
        """The writer's buffer ``slot`` of ``buffers`` (room for one payload). Reused from
        batch to batch: a fresh 2 MiB buffer per value cost more than the cipher (page faults:
        64 MiB of new buffers took 140 ms here, AES-GCM 15 ms)."""
        while len(buffers) <= slot:
            buffers.append(np.empty(self.payload_bytes, dtype=np.uint8))
        return buffers[slot]

    def run_store(self, result: TierJobResult, todo: list[tuple[OffloadKey, int]]) -> None:
        stored: list[OffloadKey] = []
        ttl = self.ttl_s
        outage = None
        try:
            for start in range(0, len(todo), self.batch_keys):
                chunk = todo[start : start + self.batch_keys]
                if outage is not None:
                    for key, _ in chunk:
                        result.failed[key] = outage
                    continue
                names = [self.name_of(key) for key, _ in chunk]
                values = [self.encode(key, row, slot) for slot, (key, row) in enumerate(chunk)]
                reasons = self.conn.set_many(names, values, ttl)
                for (key, _), (header, payload), reason in zip(chunk, values, reasons):
                    if reason is None:
                        stored.append(key)
                        self.sent_bytes += len(header) + payload.nbytes
                    else:
                        result.failed[key] = reason
                del values
                outage = self.conn.outage_of(reasons)
        except Exception as error:  # a bug or an unexpected client error: fail, never crash
            failure = _unexpected(self.tier, "store", error)
            for key, _ in todo:
                if key not in stored:
                    result.failed.setdefault(key, failure)
        if outage is not None:
            self.went_down(outage)
        result.ok.extend(stored)
        result.nbytes = len(stored) * self.block_bytes
        self.done.append(("store", result, stored))

    def place(
        self, key: OffloadKey, target: np.ndarray, value, checksum: int | None = None
    ) -> Failure | None:
        """Copy ``value``'s payload into ``target`` (a CPU row) and verify it there; why not, or None.

        ``checksum``: the payload checksum of a value whose header was checked already (when
        it was read at the end of a step); only the payload is checked then.
        """
        if isinstance(value, Failure):
            return value
        if not isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
            return Failure.MISSING
        view = memoryview(value)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        if self.codec is not None:
            return self._place_encoded(key, target, view)
        if checksum is not None and self.keys is None and len(view) == self.value_bytes:
            target[:] = np.frombuffer(view, dtype=np.uint8, offset=HEADER_BYTES)
            digest = xxhash.xxh3_64_intdigest(target)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
            return None if digest == checksum else Failure.corrupt("checksum")
        if len(view) < self.value_bytes:
            return Failure.corrupt("truncated")
        if len(view) > self.value_bytes:
            return Failure.corrupt("payload length")
        received = np.frombuffer(view, dtype=np.uint8, offset=HEADER_BYTES)
        source = None
        if self.keys is not None and header_flags(view) & FLAG_ENCRYPTED:
            source = received  # decrypted straight into the row: a copy first would cost as much
        else:
            target[:] = received
        # Verified where the bytes will be served from, after the copy: nothing else is trusted.
        reason = self._verify(key, view, target, source)
        return None if reason is None else Failure.corrupt(reason)

    def _verify(self, key: OffloadKey, view: memoryview, payload: np.ndarray, source=None) -> str | None:
        """:func:`~kvtier.tiers.disk.format.verify` of the value in ``view`` (its payload in
        ``payload``, or decrypted there from ``source``) as this tier reads it."""
        return verify(
            view[:HEADER_BYTES],
            payload,
            len(view),
            key=self.header_key(key),
            layout_digest=self.digest,
            payload_bytes=self.payload_bytes,
            keys=self.keys,
            source=source,
            codec=self.descriptor,
            exact=self.exact,
        )

    def _place_encoded(self, key: OffloadKey, target: np.ndarray, view: memoryview) -> Failure | None:
        """:meth:`place` with a codec: verify the stored payload where it was received (an
        encrypted one is decrypted there), then decode it into ``target``."""
        codec = self.codec
        assert codec is not None
        received = np.frombuffer(view, dtype=np.uint8, offset=min(HEADER_BYTES, len(view)))
        reason = self._verify(key, view, received)
        if reason is not None:
            return Failure.corrupt(reason)
        header = decode_header(view[:HEADER_BYTES])
        assert not isinstance(header, str)  # verified just above
        if len(received) != header.payload_bytes:
            return Failure.corrupt("payload length")  # bytes after the payload: not what a tier wrote
        try:
            codec.decode_into(received, target)
        except CodecError:
            return Failure.corrupt("codec")
        return None

    def place_all(
        self, pairs: list[tuple[OffloadKey, int]], values: dict[OffloadKey, tuple[np.ndarray, int]]
    ) -> dict:
        """:meth:`place` each key's read value (and checksum) into its row: key -> why not, or None."""
        rows = self.rows
        return {key: self.place(key, rows[row], *values[key]) for key, row in pairs}

    def run_load(
        self,
        result: TierJobResult,
        pairs: list[tuple[OffloadKey, int]],
        staged: dict[OffloadKey, tuple[np.ndarray, int]],
    ) -> None:
        try:
            fetch = [(key, row) for key, row in pairs if key not in staged and key not in result.failed]
            local = [(key, row) for key, row in pairs if key in staged]
            if len(local) > 1 and len(local) * self.value_bytes >= PARALLEL_COPY_BYTES:
                # Copy and checksum release the GIL: a second thread halves a large job's
                # time on an otherwise idle core (the server has nothing to do meanwhile).
                half = len(local) // 2
                theirs = self.copier.submit(self.place_all, local[:half], staged)
                reasons = {**self.place_all(local[half:], staged), **theirs.result()}
            else:
                reasons = self.place_all(local, staged)
            for key, _ in local:
                if reasons[key] is None:
                    result.ok.append(key)
                else:
                    result.failed[key] = reasons[key]
            outage: Failure | None = None
            for start in range(0, len(fetch), self.batch_keys):
                chunk = fetch[start : start + self.batch_keys]
                if outage is not None:
                    for key, _ in chunk:
                        result.failed[key] = outage
                    continue
                values = self.conn.get_many(
                    [self.name_of(key) for key, _ in chunk], self.value_bytes, self.read_bytes
                )
                self.received_bytes += _value_bytes(values)
                for (key, row), value in zip(chunk, values):
                    reason = self.place(key, self.rows[row], value)
                    if reason is None:
                        result.ok.append(key)
                    else:
                        result.failed[key] = reason
                outage = self.conn.outage_of(values)
            if outage is not None:
                self.went_down(outage)
        except Exception as error:
            failure = _unexpected(self.tier, "load", error)
            for key, _ in pairs:
                if key not in result.ok:
                    result.failed.setdefault(key, failure)
        result.nbytes = len(result.ok) * self.block_bytes
        self.done.append(("load", result, None))

    def check_header(self, key: OffloadKey, value: np.ndarray) -> str | int:
        """The cheap checks of a read value (all but the payload checksum, left to the load):
        why it is not this key's block of this layout, or its payload checksum."""
        if len(value) < HEADER_BYTES:
            return "truncated"
        header = decode_header(memoryview(value)[:HEADER_BYTES])  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        if isinstance(header, str):
            return header
        if header.codec != self.descriptor:
            return "other codec"
        if header.layout_digest != self.digest:
            return "other layout"
        if header.key != self.header_key(key):
            return "other key"
        if bool(header.flags) != (self.keys is not None):
            # the tag itself is checked on load, where the payload lands (see place)
            return "unkeyed" if self.keys is not None else "keyed (no secret here)"
        stored = header.payload_bytes
        if stored != self.payload_bytes if self.exact else stored > self.payload_bytes:
            return "payload length"
        if len(value) != HEADER_BYTES + stored:
            return "truncated" if len(value) < HEADER_BYTES + stored else "payload length"
        return header.checksum

    def run_probe(self, batch: int, keys: list[OffloadKey]) -> None:
        outcome = ProbeOutcome(batch)
        try:
            values = self.conn.get_many(
                [self.name_of(key) for key in keys], self.value_bytes, self.read_bytes
            )
            self.received_bytes += _value_bytes(values)
            for key, value in zip(keys, values):
                if isinstance(value, Failure):
                    if value.kind is FailureKind.CORRUPT:  # a value of the wrong length, never held
                        outcome.corrupt[key] = value
                    else:
                        outcome.failed[key] = value
                elif value is None:
                    outcome.missing.append(key)
                else:
                    checked = self.check_header(key, value)
                    if isinstance(checked, int):
                        outcome.found[key] = (value, checked)
                    else:
                        outcome.corrupt[key] = Failure.corrupt(checked)
            if len(outcome.found) * 2 < len(keys):
                # The values are slices of one array for the whole batch, and a held slice
                # keeps all of it: with few hits, copy them out so the batch can go (the held
                # bytes then are what the staging budget counts).
                outcome.found = {
                    key: (value.copy(), checksum) for key, (value, checksum) in outcome.found.items()
                }
            outage = self.conn.outage_of(values)
            if outage is not None:
                self.went_down(outage)
        except Exception as error:
            failure = _unexpected(self.tier, "probe", error)
            for key in keys:
                outcome.failed[key] = failure
        self.done.append(("probe", outcome, None))
