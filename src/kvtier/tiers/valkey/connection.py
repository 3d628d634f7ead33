"""The valkey tier's view of its server: pipelined SET and GET of many keys, with per-key errors.

One class serves a standalone server and a cluster. A cluster's keys are grouped by the node
that owns their slot and each group goes out as one pipeline to that node, so a dead node
fails only its own keys and the others are still served (the client's cluster pipeline does
not: docs/design/valkey-client.md#rejected-designs).

Every method blocks on the network for at most ``timeout_s`` per batch and is called on the
tier's own threads, never on the scheduler thread. The client is ``valkey`` (redis-py's
fork, with the ``libvalkey`` C reply parser when installed; not GLIDE:
docs/design/valkey-client.md): its
pools, connections, URL parsing and cluster topology are used as they are, but the two
commands that move blocks are packed and read here, on a pooled connection, so that a block
is never copied on its way: SET sends the CPU row itself to the socket, and GET reads each
value from the socket straight into an array of its own.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.tiers.base import Failure, FailureKind
from kvtier.tiers.valkey.config import ValkeyTierConfig

__all__ = ["ValkeyConnection", "fix_for", "is_outage", "reason_of"]

#: the failure kinds that mean the server (or a node) could not be used at all: the tier
#: goes into an outage on them (a wrong password or a bad certificate fails every key alike)
OUTAGE_KINDS = frozenset((FailureKind.UNAVAILABLE, FailureKind.AUTH, FailureKind.TLS))


def _chain(error: BaseException | None):
    """``error`` and the exceptions it was raised from or during (the client wraps OSErrors)."""
    seen = 0
    while error is not None and seen < 8:
        yield error
        error = error.__cause__ or error.__context__
        seen += 1


def reason_of(error: BaseException) -> Failure:
    """A key's failure reason for ``error``: a client exception or an error reply.

    ``UNAVAILABLE`` (``timeout``, ``refused``, ``closed``, ``connection``) when the server
    could not be reached, ``AUTH`` when it refused the credentials, ``TLS`` when the
    handshake failed, ``DENIED`` for an ACL's ``NOPERM`` (``detail``: the command),
    ``SERVER`` for any other error reply (``detail``: its code), else ``UNEXPECTED``.
    """
    import socket
    import ssl

    import valkey.exceptions as errors

    chain = list(_chain(error))
    text = str(error)
    if any(isinstance(e, errors.AuthenticationError) for e in chain) or text.startswith(
        ("WRONGPASS", "NOAUTH")
    ):
        required = "required" in text.lower() or text.startswith("NOAUTH")
        return Failure(FailureKind.AUTH, detail="no credentials" if required else "wrong credentials")
    if any(isinstance(e, ssl.SSLError) for e in chain) or "[SSL" in text:
        bad_cert = (
            any(isinstance(e, ssl.SSLCertVerificationError) for e in chain) or "CERTIFICATE" in text.upper()
        )
        return Failure(FailureKind.TLS, detail="certificate" if bad_cert else "handshake")
    if any(isinstance(e, (errors.TimeoutError, socket.timeout)) for e in chain):
        return Failure(FailureKind.UNAVAILABLE, detail="timeout")
    if isinstance(error, errors.NoPermissionError) or text.startswith("NOPERM"):
        match = re.search(r"run the '([A-Za-z|]+)' command", text)
        if match:
            return Failure(FailureKind.DENIED, detail=match.group(1).lower())
        return Failure(FailureKind.DENIED, detail="key" if "key" in text else "command")
    if isinstance(error, (errors.ConnectionError, OSError)):
        if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in text.lower():
            return Failure(FailureKind.UNAVAILABLE, detail="refused")
        closed = "closed" in text.lower() or any(
            isinstance(e, (BrokenPipeError, ConnectionResetError)) for e in chain
        )
        return Failure(FailureKind.UNAVAILABLE, detail="closed" if closed else "connection")
    if isinstance(error, errors.ResponseError):
        code = text.split(" ", 1)[0]
        if not _ERROR_CODE_RE.fullmatch(code):
            code = {errors.OutOfMemoryError: "OOM", errors.ReadOnlyError: "READONLY"}.get(type(error), "ERR")
        return Failure(FailureKind.SERVER, detail=code)
    return Failure(FailureKind.UNEXPECTED, detail=type(error).__name__)


def fix_for(reason: Failure, default: str) -> str:
    """The fix a message gives for a failure ``reason`` (:func:`reason_of`): credentials, TLS
    files, an ACL, a server to start, or ``default``."""
    if reason.kind is FailureKind.AUTH:
        return (
            "give the user name and password the server's ACL knows: username: and password_file: "
            "in the tier's config, or KVTIER_VALKEY_PASSWORD in the environment (never on the command line)"
        )
    if reason.kind is FailureKind.TLS:
        return (
            "give the CA that signed the server's certificate (the tier's tls: ca_file:; kvtier check "
            "--config FILE), and cert_file:/key_file: if the server asks for a client certificate"
        )
    if reason.kind is FailureKind.DENIED:
        if reason.detail == "key":
            return "grant this user the tier's keys in the server's ACL (~NAMESPACE:*, e.g. ~kvtier:*)"
        return (
            f"grant this user {reason.detail.upper()} in the server's ACL (the tier needs GET SET PING INFO, "
            "its check SCAN and DEL: +get +set +ping +info +scan +del)"
        )
    if reason.kind is FailureKind.UNAVAILABLE:
        return (
            "start the server, or give its address: valkey://HOST:PORT[/DB] (valkeys:// for TLS), "
            "or --cluster HOST:PORT,... for a cluster"
        )
    return default


#: an error reply's code: its first word, in capitals (``ERR``, ``OOM``, ``WRONGTYPE`` ...)
_ERROR_CODE_RE = re.compile(r"[A-Z][A-Z_]{1,31}")


def _reply_error(head: bytes) -> Exception:
    """The client's exception for an error reply's line (``head`` without its ``-``): the
    same classes its own parser makes (``NoPermissionError`` for NOPERM ...), the code kept
    at the front of the text so :func:`reason_of` can name it."""
    from valkey._parsers.base import BaseParser

    text = head.decode(errors="replace")
    error = BaseParser.parse_error(text)
    error.args = (text,)
    return error


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
        replies.append(None if reply == b"OK" else ResponseError(f"ERR SET answered {reply!r}"[:80]))
    return replies


def _read_values(connection, count: int, expect_bytes: int = 0, max_bytes: int | None = None) -> list:
    """The ``count`` replies of GETs, read from the socket here: each value into an array (one
    copy out of the kernel, or two for a value that arrived with the one before, no zero
    fill), ``None`` for a missing key, an error reply as its exception. A value of at most
    ``expect_bytes`` is a slice of one array allocated for the whole batch (one allocation,
    not one per value), so a batch holds at most ``count * expect_bytes`` of values.

    A value longer than ``max_bytes`` (default ``expect_bytes``, when given) is never held:
    it is read off the socket in pieces of the read buffer and thrown away, and its reply is
    ``Failure.corrupt("payload length")``: whoever can write under a tier's names can
    announce any length (alternatives rejected: docs/design/valkey-client.md#rejected-designs).

    Not the client's parser, which copies every value twice more. Only GET replies are read
    this way (bulk strings, or nulls, or errors), and only on a connection whose parser has
    nothing buffered: every round trip reads all of its replies.
    """

    from valkey.exceptions import ConnectionError as ClientConnectionError
    from valkey.exceptions import TimeoutError as ClientTimeoutError

    if max_bytes is None:
        max_bytes = expect_bytes or None
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
            if end - start > _MAX_LINE_BYTES:
                raise ClientConnectionError(
                    "a reply line longer than any GET reply: the connection is out of step"
                )
            fill()

    def skip(left: int) -> None:
        nonlocal start
        while True:
            have = min(left, end - start)
            start += have
            left -= have
            if not left:
                return
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
                if max_bytes is not None and length > max_bytes:
                    skip(length + 2)  # the value and its CRLF, a buffer at a time
                    replies.append(Failure.corrupt("payload length"))
                    continue
                if batch is not None and length <= expect_bytes:
                    value = batch[index * expect_bytes : index * expect_bytes + length]
                else:
                    value = np.empty(length, dtype=np.uint8)
                target = memoryview(value)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
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
                replies.append(_reply_error(head[1:]))
            else:
                raise ClientConnectionError(f"unexpected reply to GET: {head[:40]!r}")
    except TimeoutError:
        raise ClientTimeoutError("timeout reading from the server") from None
    except OSError as error:
        raise ClientConnectionError(f"reading from the server: {error}") from None
    if start != end:
        raise ClientConnectionError("more replies than commands: the connection is out of step")
    return replies


#: the longest reply line a GET can get (an error's text); longer means the stream is wrong
_MAX_LINE_BYTES = 64 << 10


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


def is_outage(reason: object) -> bool:
    """Whether a key's failure reason means the server could not be used at all (unreachable,
    credentials refused, TLS handshake failed)."""
    return isinstance(reason, Failure) and reason.kind in OUTAGE_KINDS


class ValkeyConnection:
    """A client for the server or cluster that ``config`` names, built lazily on first use.

    Thread-safe: the client keeps a pool of connections, one per thread in use.
    """

    def __init__(self, config: ValkeyTierConfig):
        self._config = config
        self._client: Any = None  # Valkey or ValkeyCluster once connected
        self._lock = threading.Lock()  # guards the lazy creation of _client

    @property
    def location(self) -> str:
        """The server's URL, or the cluster's nodes joined by commas (for messages)."""
        return self._config.location() or ""

    # -- the client ---------------------------------------------------------------------------

    def _connect(self):
        import valkey
        from valkey.backoff import NoBackoff
        from valkey.connection import ConnectionPool, SSLConnection, parse_url
        from valkey.retry import Retry

        config = self._config
        # No retries inside the client: the tier backs off and reconnects on its own, and a
        # retried batch would hold the thread past timeout_s.
        options: dict = dict(
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        username, password = config.credentials()  # read now: the config holds no secret
        if username is not None:
            options["username"] = username
        if password is not None:
            options["password"] = password
        if config.uses_tls:
            tls = config.tls
            options.update(ssl_cert_reqs="required")
            if tls is not None:
                options.update(
                    ssl_ca_certs=tls.ca_file,
                    ssl_certfile=tls.cert_file,
                    ssl_keyfile=tls.key_file,
                    ssl_check_hostname=tls.check_hostname,
                )
        if config.cluster_nodes:
            from valkey.cluster import ClusterNode, ValkeyCluster

            nodes = []
            for node in config.cluster_nodes:
                host, _, port = node.rpartition(":")
                nodes.append(ClusterNode(host.strip("[]"), int(port)))
            if config.uses_tls:
                options["ssl"] = True
            # one attempt per call, as for a single server: see above
            return ValkeyCluster(startup_nodes=nodes, cluster_error_retry_attempts=0, **options)
        # The URL's own settings first, then the tier's: a password from the file or the
        # environment wins over one in the URL (the client's from_url does the opposite).
        assert config.url is not None  # the section has a url or cluster_nodes
        settings = {**parse_url(config.url), **options}
        if config.uses_tls and settings.get("connection_class") is not SSLConnection:
            if "path" in settings:
                from kvtier.errors import ConfigError

                raise ConfigError(
                    "url", config.location(), "a TCP URL for TLS", "TLS needs valkeys://host:port"
                )
            settings["connection_class"] = SSLConnection
        client = valkey.Valkey(connection_pool=ConnectionPool(**settings))
        client.auto_close_connection_pool = True
        return client

    @property
    def client(self):
        """The ``valkey`` client (``Valkey`` or ``ValkeyCluster``); connects on first use."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _groups(self, names: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
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

    def set_many(
        self, names: Sequence[bytes], values: Sequence[Sequence], ttl_s: float | None
    ) -> list[Failure | None]:
        """SET each name to its value (expiring after ``ttl_s``); per name ``None`` or the
        :class:`~kvtier.tiers.base.Failure` it failed with (:func:`reason_of`).

        A value is a sequence of buffers sent back to back (the tier's header page, then the
        CPU row itself): the commands are packed here so that the row goes to the socket as
        it is, not copied twice as the client's ``pipeline().set`` would.
        """
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        expire = b"" if px is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
        argc = 3 if px is None else 5
        return self._batch(
            names, lambda index, name: _pack_set(argc, name, values[index], expire), _read_set_replies
        )

    def get_many(
        self, names: Sequence[bytes], expect_bytes: int = 0, max_bytes: int | None = None
    ) -> list[np.ndarray | None | Failure]:
        """GET each name: its value (a uint8 array), ``None`` if the server has no such key, or
        the :class:`~kvtier.tiers.base.Failure` the read failed with. ``expect_bytes``: the
        length most values have; a value longer than ``max_bytes`` (default
        ``expect_bytes``) is read and discarded, never held, and answers
        ``Failure.corrupt("payload length")`` (see :func:`_read_values`)."""

        def read(connection, count):
            return _read_values(connection, count, expect_bytes, max_bytes)

        return self._batch(
            names, lambda index, name: [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)], read
        )

    def _batch(self, names: Sequence[bytes], pack, read) -> list:
        """One pipelined round trip per server: every name's command, then every reply.

        ``pack(index, name)`` gives the command's buffers, ``read(connection, count)`` the
        replies. A reply is a value, ``None``, or a :class:`~kvtier.tiers.base.Failure`; a
        server that cannot be reached fails all of its names.
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
            pools = [
                node.valkey_connection.connection_pool
                for node in client.get_nodes()
                if node.valkey_connection
            ]
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
            ("used_memory", "maxmemory", "evicted_keys", "keyspace_hits", "keyspace_misses", "expired_keys"),
            0,
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
