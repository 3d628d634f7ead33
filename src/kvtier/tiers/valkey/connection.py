"""The valkey tier's view of its server: pipelined SET and GET of many keys, with per-key errors.

One class serves a standalone server and a cluster. A cluster's keys are grouped by the node
that owns their slot and each group goes out as one pipeline to that node, so a dead node
fails only its own keys and the others are still served. (Rejected: the client's cluster
pipeline — it treats a connection error to one node as the whole batch's, and retries it
against a topology refresh that a dead node without replicas never satisfies.)

Every method blocks on the network for at most ``timeout_s`` per batch and is called on the
tier's own threads, never on the scheduler thread. The client is ``valkey`` (redis-py's
fork, with the ``libvalkey`` C reply parser when installed; README says why not GLIDE): its
pools, connections, URL parsing and cluster topology are used as they are, but the two
commands that move blocks are packed and read here, on a pooled connection, so that a block
is never copied on its way: SET sends the CPU row itself to the socket, and GET reads each
value from the socket straight into an array of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvtier.tiers.valkey.config import ValkeyTierConfig

__all__ = ["ValkeyConnection", "UNAVAILABLE", "TIMEOUT", "is_outage", "reason_of"]

#: the failure reasons of keys a batch could not reach the server for
UNAVAILABLE = "unavailable"
TIMEOUT = "timeout"


def reason_of(error: BaseException) -> str:
    """A key's short failure reason for ``error`` (``"timeout"``, ``"unavailable"``, the server's words)."""
    import valkey.exceptions as errors

    if isinstance(error, errors.TimeoutError):
        return TIMEOUT
    if isinstance(error, (errors.ConnectionError, OSError)):
        return UNAVAILABLE
    text = str(error).split("\n")[0][:80]
    return f"server: {text}" if text else f"server: {type(error).__name__}"


def _pack_set(argc: int, name: bytes, parts: Sequence, expire: bytes) -> list:
    """The buffers of ``SET name <parts joined> [PX ms]`` in RESP, the parts not copied."""
    length = sum(len(part) for part in parts)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(name), name, length)
    first, *rest = parts
    if len(first) <= 8192:  # a small first part (the header page) rides with the command head
        return [head + bytes(first), *rest, b"\r\n" + expire]
    return [head, *parts, b"\r\n" + expire]


def _read_set_replies(connection, count: int) -> list:
    """The ``count`` replies of SETs through the client's parser: ``None`` for OK, an error
    reply as its exception."""
    from valkey.exceptions import ResponseError

    replies: list = []
    for _ in range(count):
        try:
            reply = connection.read_response()
        except ResponseError as error:  # that command's answer; the stream stays in step
            replies.append(error)
            continue
        replies.append(None if reply == b"OK" else ResponseError(f"SET answered {reply!r}"[:80]))
    return replies


def _read_values(connection, count: int, expect_bytes: int = 0) -> list:
    """The ``count`` replies of GETs, read from the socket here: each value into an array (one
    copy out of the kernel, or two for a value that arrived with the one before, no zero
    fill), ``None`` for a missing key, an error reply as its exception. A value of
    ``expect_bytes`` is a slice of one array allocated for the whole batch (one allocation
    instead of one per value: a third of the reading time for 64 KiB values).

    Why not the client's parser: it copies every value twice more (into its read buffer,
    then into a new ``bytes``), a third of a load's cost for 2 MiB values. Only GET replies
    are read this way (bulk strings, or nulls, or errors), and only on a connection whose
    parser has nothing buffered: every round trip reads all of its replies.
    """
    import socket

    from valkey.exceptions import ConnectionError as ClientConnectionError
    from valkey.exceptions import ResponseError
    from valkey.exceptions import TimeoutError as ClientTimeoutError

    sock = connection._sock  # noqa: SLF001 - the connection this round trip holds alone
    buffer = bytearray(_READ_BUFFER_BYTES)
    batch = np.empty(count * expect_bytes, dtype=np.uint8) if expect_bytes else None
    view = memoryview(buffer)
    start = end = 0

    def fill() -> None:
        nonlocal start, end
        if start == end:
            start = end = 0
        elif end == len(buffer):  # move the unread tail to the front
            view[: end - start] = view[start:end]
            start, end = 0, end - start
        received = sock.recv_into(view[end:])
        if received == 0:
            raise ClientConnectionError("the server closed the connection")
        end += received

    def line() -> bytes:
        nonlocal start
        while True:
            at = buffer.find(b"\r\n", start, end)
            if at >= 0:
                text = bytes(view[start:at])
                start = at + 2
                return text
            fill()

    replies: list = []
    try:
        for index in range(count):
            head = line()
            kind = head[:1]
            if kind == b"$":
                length = int(head[1:])
                if length < 0:
                    replies.append(None)
                    continue
                if length == expect_bytes:
                    value = batch[index * length : (index + 1) * length]
                else:
                    value = np.empty(length, dtype=np.uint8)
                target = memoryview(value)
                have = min(length, end - start)
                target[:have] = view[start : start + have]
                start += have
                while have < length:
                    received = sock.recv_into(target[have:])
                    if received == 0:
                        raise ClientConnectionError("the server closed the connection")
                    have += received
                while end - start < 2:
                    fill()
                start += 2  # the value's CRLF
                replies.append(value)
            elif kind == b"_":  # RESP3's null
                replies.append(None)
            elif kind == b"-":
                replies.append(ResponseError(head[1:].decode(errors="replace")))
            else:
                raise ClientConnectionError(f"unexpected reply to GET: {head[:40]!r}")
    except socket.timeout:
        raise ClientTimeoutError("timeout reading from the server") from None
    except OSError as error:
        raise ClientConnectionError(f"reading from the server: {error}") from None
    if start != end:
        raise ClientConnectionError("more replies than commands: the connection is out of step")
    return replies


def _coalesce(chunks: list, small: int = 1 << 16) -> list:
    """``chunks`` with runs of small buffers joined: one ``sendall`` per run, not per command
    (a 2048-GET batch made 2048 system calls); large buffers (CPU rows) pass uncopied."""
    out: list = []
    run: list = []
    for chunk in chunks:
        if len(chunk) < small:
            run.append(chunk)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(chunk)
    if run:
        out.append(b"".join(run))
    return out


#: bytes read from the socket at a time for reply headers (and small values that come with them)
_READ_BUFFER_BYTES = 1 << 20


def _round_trip(server, chunks: list, count: int, read) -> list:
    """Send ``chunks`` (``count`` packed commands) on one pooled connection; the ``count``
    replies read by ``read``. Raises if the connection fails."""
    pool = server.connection_pool
    connection = pool.get_connection("PIPELINE")
    try:
        connection.send_packed_command(chunks, check_health=False)
        return read(connection, count)
    except BaseException:
        # replies may be left unread: the connection is out of step, never reuse it
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def is_outage(reason: str) -> bool:
    """Whether a key's failure reason means the server could not be reached at all."""
    return reason in (UNAVAILABLE, TIMEOUT)


class ValkeyConnection:
    """A client for the server or cluster that ``config`` names, built lazily on first use.

    Thread-safe: the client keeps a pool of connections, one per thread in use.
    """

    def __init__(self, config: ValkeyTierConfig):
        self._config = config
        self._client = None
        self._lock = threading.Lock()  # guards the lazy creation of _client

    @property
    def location(self) -> str:
        """The server's URL, or the cluster's nodes joined by commas (for messages)."""
        return self._config.location() or ""

    # -- the client ---------------------------------------------------------------------------

    def _connect(self):
        import valkey
        from valkey.backoff import NoBackoff
        from valkey.retry import Retry

        config = self._config
        # No retries inside the client: the tier backs off and reconnects on its own, and a
        # retried batch would hold the thread past timeout_s.
        options = dict(
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        if config.cluster_nodes:
            from valkey.cluster import ClusterNode, ValkeyCluster

            nodes = []
            for node in config.cluster_nodes:
                host, _, port = node.rpartition(":")
                nodes.append(ClusterNode(host.strip("[]"), int(port)))
            # one attempt per call, as for a single server: see above
            return ValkeyCluster(startup_nodes=nodes, cluster_error_retry_attempts=0, **options)
        url = self._config.url
        return valkey.Valkey.from_url(url, **options)

    @property
    def client(self):
        """The ``valkey`` client (``Valkey`` or ``ValkeyCluster``); connects on first use."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _groups(self, names: Sequence[bytes]) -> list[tuple[object, list[int]]]:
        """``(client, indexes of names)`` per server the names live on."""
        client = self.client
        if not self._config.cluster_nodes:
            return [(client, list(range(len(names))))]
        by_node: dict[str, tuple[object, list[int]]] = {}
        for index, name in enumerate(names):
            node = client.get_node_from_key(name)
            entry = by_node.get(node.name)
            if entry is None:
                entry = by_node[node.name] = (client.get_valkey_connection(node), [])
            entry[1].append(index)
        return list(by_node.values())

    # -- batches ------------------------------------------------------------------------------

    def set_many(self, names: Sequence[bytes], values: Sequence[Sequence], ttl_s: float | None) -> list[str | None]:
        """SET each name to its value (expiring after ``ttl_s``); per name ``None`` or the reason it failed.

        A value is a sequence of buffers sent back to back (the tier's header page, then the
        CPU row itself): the commands are packed here so that the row goes to the socket as
        it is. (Rejected: the client's ``pipeline().set`` — its C packer copies every value
        into one command buffer, and the value would first have to be joined into one
        ``bytes``: two copies of every block before the first byte is sent.)
        """
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        expire = b"" if px is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
        argc = 3 if px is None else 5
        return self._batch(names, lambda index, name: _pack_set(argc, name, values[index], expire), _read_set_replies)

    def get_many(self, names: Sequence[bytes], expect_bytes: int = 0) -> list[bytes | None | str]:
        """GET each name: its value (a uint8 array), ``None`` if the server has no such key, or
        a failure reason (str). ``expect_bytes``: the length most values have (see
        :func:`_read_values`)."""

        def read(connection, count):
            return _read_values(connection, count, expect_bytes)

        return self._batch(
            names, lambda index, name: [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)], read
        )

    def _batch(self, names: Sequence[bytes], pack, read) -> list:
        """One pipelined round trip per server: every name's command, then every reply.

        ``pack(index, name)`` gives the command's buffers, ``read(connection, count)`` the
        replies. A reply is a value, ``None``, or a failure reason (str); a server that cannot
        be reached fails all of its names.
        """
        out: list = [None] * len(names)
        try:
            groups = self._groups(names)
        except Exception as error:  # the cluster's topology could not be read
            return [reason_of(error)] * len(names)
        for server, indexes in groups:
            chunks: list = []
            for index in indexes:
                chunks.extend(pack(index, names[index]))
            chunks = _coalesce(chunks)
            try:
                replies = _round_trip(server, chunks, len(indexes), read)
            except Exception as error:
                reason = reason_of(error)
                for index in indexes:
                    out[index] = reason
                continue
            for index, reply in zip(indexes, replies):
                out[index] = reason_of(reply) if isinstance(reply, Exception) else reply
        return out

    def ping(self) -> None:
        """Raise unless the server (for a cluster: at least one primary) answers.

        A cluster with a dead node still serves the other nodes' slots, so one answering
        node is enough; the dead node's keys fail one by one.
        """
        client = self.client
        if not self._config.cluster_nodes:
            client.ping()
            return
        error: Exception | None = None
        for node in client.get_primaries():
            try:
                client.get_valkey_connection(node).ping()
                return
            except Exception as exc:  # try the next node
                error = exc
        raise error or ConnectionError("the cluster has no primary node")

    def drop_idle_connections(self) -> None:
        """Close the pooled connections nobody is using: after an outage they may lead to a
        server that restarted, and the first batch on one would fail (they reopen on use)."""
        client = self._client
        if client is None:
            return
        if self._config.cluster_nodes:
            pools = [node.valkey_connection.connection_pool for node in client.get_nodes() if node.valkey_connection]
        else:
            pools = [client.connection_pool]
        for pool in pools:
            pool.disconnect(inuse_connections=False)

    def server_figures(self) -> dict[str, int]:
        """The server's memory and hit counters, summed over a cluster's nodes."""
        client = self.client
        if self._config.cluster_nodes:
            infos = []
            for node in client.get_primaries():
                try:
                    infos.append(client.get_valkey_connection(node).info())
                except Exception:  # a dead node: the others' figures still count
                    continue
        else:
            infos = [client.info()]
        figures = dict.fromkeys(
            ("used_memory", "maxmemory", "evicted_keys", "keyspace_hits", "keyspace_misses", "expired_keys"), 0
        )
        for info in infos:
            for name in figures:
                value = info.get(name, 0)
                figures[name] += int(value) if isinstance(value, (int, float)) else 0
        return figures

    def scan_names(self, pattern: bytes, count: int = 1000) -> list[bytes]:
        """Every key name matching ``pattern``, by SCAN (blocks; for the checks in
        :mod:`kvtier.tiers.valkey.check`). A name may come twice."""
        client = self.client
        if self._config.cluster_nodes:
            names: list[bytes] = []
            for node in client.get_primaries():
                names.extend(client.get_valkey_connection(node).scan_iter(match=pattern, count=count))
            return names
        return list(client.scan_iter(match=pattern, count=count))

    def delete(self, names: Sequence[bytes]) -> None:
        """DEL ``names`` (blocks; for the checks' ``fix``)."""
        for server, indexes in self._groups(names):
            pipe = server.pipeline(transaction=False)
            for index in indexes:
                pipe.delete(names[index])
            pipe.execute()

    def close(self) -> None:
        """Close every pooled connection."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
