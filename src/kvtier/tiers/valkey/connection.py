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

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.tiers.base import Failure, FailureKind
from kvtier.tiers.valkey.config import ValkeyTierConfig
from kvtier.tiers.valkey.topology import REFRESH_MAX_S, ClusterHealth, NodeOutage

__all__ = ["ValkeyConnection", "fix_for", "is_outage", "reason_of"]

logger = logging.getLogger(__name__)

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
    # in the chain: a cluster client that reached no node raises its own error from the last one
    if any(isinstance(e, (errors.ConnectionError, OSError)) for e in chain):
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
            "on a cluster also CLUSTER SLOTS and ASKING, its check SCAN and DEL: +get +set +ping +info "
            "+cluster|slots +asking +scan +del)"
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
    same classes its cluster parser makes (``NoPermissionError`` for NOPERM, ``MovedError``
    and ``AskError`` with the node to ask ...), the code kept at the front of the text so
    :func:`reason_of` can name it."""
    from valkey.cluster import ClusterParser

    text = head.decode(errors="replace")
    error = ClusterParser.parse_error(text)
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


def _read_set_replies(connection, count: int, asking: bool = False) -> list:
    """The ``count`` replies of SETs through the client's parser: ``None`` for OK, an error
    reply as its exception. ``asking``: each SET came after an ASKING, whose error (if any)
    stands for the pair."""
    from valkey.exceptions import ResponseError

    replies: list = []
    for _ in range(count * 2 if asking else count):
        try:
            reply = connection.read_response()
        except ResponseError as error:  # that command's answer; the stream stays in step
            replies.append(error)
            continue
        replies.append(None if reply == b"OK" else ResponseError(f"ERR SET answered {reply!r}"[:80]))
    if asking:
        return [first if first is not None else second for first, second in zip(replies[::2], replies[1::2])]
    return replies


def _read_values(
    connection, count: int, expect_bytes: int = 0, max_bytes: int | None = None, asking: bool = False
) -> list:
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
    this way (bulk strings, or nulls, or errors; with ``asking``, each after an ASKING's
    ``+OK`` or error, the error then standing for the pair), and only on a connection whose
    parser has nothing buffered: every round trip reads all of its replies.
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
            refused = None  # the ASKING's error, if it got one
            if asking:
                head = line()
                if head[:1] == b"-":
                    refused = _reply_error(head[1:])
                elif head != b"+OK":
                    raise ClientConnectionError(f"unexpected reply to ASKING: {head[:40]!r}")
            head = line()
            kind = head[:1]
            if refused is not None:  # the GET went without ASKING: its answer does not count
                if kind == b"$" and int(head[1:]) >= 0:
                    skip(int(head[1:]) + 2)
                replies.append(refused)
                continue
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


#: ASKING in RESP: sent before each command redirected by an ASK
_ASKING = b"*1\r\n$6\r\nASKING\r\n"
#: a key redirected a second time (the slots are moving again): it is not read or written now
_REDIRECTED_AGAIN = Failure(FailureKind.UNAVAILABLE, detail="moved")
#: redirects a key follows in one batch before it fails (nodes disagree while a slot moves)
MAX_REDIRECTS = 3
#: a key of a slot no cluster node serves (as far as the slot map says)
_UNCOVERED = Failure(FailureKind.UNAVAILABLE, detail="uncovered")

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

    Thread-safe: the client keeps a pool of connections, one per thread in use. For a
    cluster, :attr:`health` (:mod:`~kvtier.tiers.valkey.topology`) holds the nodes that
    failed lately, whose keys fail without a round trip, and when :meth:`refresh_topology`
    should read the slot map again.
    """

    def __init__(self, config: ValkeyTierConfig):
        self._config = config
        self._client: Any = None  # Valkey or ValkeyCluster once connected
        self._lock = threading.Lock()  # guards the lazy creation of _client and _elsewhere
        self.health: ClusterHealth | None = ClusterHealth() if config.cluster_nodes else None
        self._seeds: list = []  # the configured nodes (ClusterNode), always asked for the map
        # nodes a redirect named that the slot map does not know yet (a new primary)
        self._elsewhere: dict[str, Any] = {}

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
            self._seeds = nodes
            # one attempt per call, as for a single server: see above
            return ValkeyCluster(startup_nodes=list(nodes), cluster_error_retry_attempts=0, **options)
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

    def _groups(self, names: Sequence[bytes]) -> list[tuple[str | None, Any, list[int]]]:
        """``(node name, client, indexes of names)`` per server the names live on (node name
        None for a standalone server, client None for the keys of slots no node serves)."""
        client = self.client
        if not self._config.cluster_nodes:
            return [(None, client, list(range(len(names))))]
        from valkey.exceptions import SlotNotCoveredError

        by_node: dict[str | None, tuple[Any, list[int]]] = {}
        for index, name in enumerate(names):
            try:
                node = client.get_node_from_key(name)
            except SlotNotCoveredError:
                node = None
            by_node.setdefault(None if node is None else node.name, (node, []))[1].append(index)
        return [
            (name, None if node is None else client.get_valkey_connection(node), indexes)
            for name, (node, indexes) in by_node.items()
        ]

    def _node_at(self, host: str, port: int) -> tuple[str, Any]:
        """The node name and client of the cluster node at ``host:port`` (a redirect's target)."""
        from valkey.cluster import PRIMARY, ClusterNode

        client = self.client
        node = client.nodes_manager.get_node(host=host, port=port)
        if node is None:
            with self._lock:
                node = self._elsewhere.setdefault(f"{host}:{port}", ClusterNode(host, port, PRIMARY))
        return node.name, client.get_valkey_connection(node)

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

        def read(connection, count, asking):
            return _read_values(connection, count, expect_bytes, max_bytes, asking)

        return self._batch(
            names, lambda index, name: [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)], read
        )

    def _batch(self, names: Sequence[bytes], pack, read) -> list:
        """One pipelined round trip per server: every name's command, then every reply.

        ``pack(index, name)`` gives the command's buffers, ``read(connection, count, asking)``
        the replies. A reply is a value, ``None``, or a :class:`~kvtier.tiers.base.Failure`; a
        server that cannot be reached fails all of its names.

        In a cluster, a key answered MOVED or ASK is sent again, to the node named (after
        ASKING, for ASK: a slot being migrated), in one round trip per node; a MOVED also
        asks for the slot map to be read again. While a slot changes owner the nodes can
        disagree for a moment and send a key back and forth: after :data:`MAX_REDIRECTS`
        redirects it fails as ``UNAVAILABLE`` (``moved``), counted in ``redirects_exhausted``.
        """
        from valkey.exceptions import AskError, MovedError

        out: list = [None] * len(names)
        try:
            groups = self._groups(names)
        except Exception as error:  # the cluster's topology could not be read
            if self.health is not None:
                self.health.unrouted(len(names))
            return [reason_of(error)] * len(names)
        sends = [(node, server, indexes, False) for node, server, indexes in groups]
        for hop in range(MAX_REDIRECTS + 1):
            redirects: dict[tuple[str, int, bool], list[int]] = {}
            for node, server, indexes, asking in sends:
                for index, reply in zip(
                    indexes, self._send(node, server, names, indexes, pack, read, asking)
                ):
                    if not isinstance(reply, AskError):  # a MovedError is an AskError too
                        out[index] = reason_of(reply) if isinstance(reply, Exception) else reply
                    elif hop == MAX_REDIRECTS:
                        out[index] = _REDIRECTED_AGAIN
                        assert self.health is not None  # only a cluster redirects
                        self.health.redirected_too_often()
                    else:
                        key = (reply.host, reply.port, not isinstance(reply, MovedError))
                        redirects.setdefault(key, []).append(index)
            sends = []
            for (host, port, asking), indexes in redirects.items():
                assert self.health is not None
                self.health.redirected(moved=not asking, count=len(indexes))
                sends.append((*self._node_at(host, port), indexes, asking))
            if not sends:
                break
        return out

    def _send(
        self, node: str | None, server, names, indexes: list[int], pack, read, asking: bool = False
    ) -> list:
        """One server's round trip for ``names[i]`` of ``indexes``: a reply each (a value,
        ``None``, an error reply's exception or a Failure). The keys of a cluster node that is
        down fail at once; a node that cannot be reached is marked down."""
        if server is None:
            if self.health is not None:
                self.health.unrouted(len(indexes))
            return [_UNCOVERED] * len(indexes)
        health = self.health
        if health is not None and node is not None:
            reason = health.down_reason(node)
            if reason is not None:
                return [reason] * len(indexes)
        chunks: list = []
        for index in indexes:
            if asking:
                chunks.append(_ASKING)
            chunks.extend(pack(index, names[index]))
        try:
            return _round_trip(server, _coalesce(chunks), len(indexes), lambda c, n: read(c, n, asking))
        except Exception as error:
            reason = reason_of(error)
            if health is not None and node is not None and reason.kind is FailureKind.UNAVAILABLE:
                if health.failed(node, reason):
                    logger.warning(
                        "valkey tier %r: cluster node %s unreachable (%s): the keys of its slots miss "
                        "until it answers or another node serves them (the slot map is read again "
                        "every %.0f s at most)",
                        self._config.name,
                        node,
                        reason.detail or reason,
                        REFRESH_MAX_S,
                    )
            return [reason] * len(indexes)

    def outage_of(self, replies: Sequence) -> Failure | None:
        """The failure that means the whole server is out of reach, if every reply of a
        batch (or job) failed with one: unreachable, credentials refused, TLS failed; else
        None. In a cluster, unreachable means every node serving slots is down: one dead
        node fails only its own keys."""
        first = replies[0] if replies else None
        if not isinstance(first, Failure) or not all(is_outage(reply) for reply in replies):
            return None
        health = self.health
        if health is None or first.kind is not FailureKind.UNAVAILABLE:
            return first
        serving = self._serving()  # empty: no slot map yet, no node ever reached
        return first if serving <= health.down_nodes.keys() else None

    def _serving(self) -> set[str]:
        """The names of the nodes the slot map sends keys to (the slots' primaries)."""
        client = self._client
        if client is None:
            return set()
        return {nodes[0].name for nodes in list(client.nodes_manager.slots_cache.values()) if nodes}

    def node_failure(self, name: bytes) -> Failure | None:
        """Why the cluster node serving ``name``'s slot is down, or None (also for a
        standalone server). No network: the scheduler thread asks this of a lookup."""
        health, client = self.health, self._client
        if health is None or client is None or not health.down_nodes:
            return None
        from valkey.crc import key_slot

        nodes = client.nodes_manager.slots_cache.get(key_slot(name))
        return health.down_reason(nodes[0].name) if nodes else None

    def refresh_topology(self) -> list[tuple[str, NodeOutage]]:
        """Read the cluster's slot map again and PING the down nodes it still sends keys to;
        the nodes whose outage this ended. Blocks (up to ``timeout_s`` a node asked): the
        tier runs it on its background thread when :meth:`ClusterHealth.read_due` says so.

        The map comes from the first node that answers CLUSTER SLOTS, asking the nodes that
        are not down first, then the configured ones (the client alone would ask only those
        it discovered, in their order, a stalled one first perhaps). Raises if none answers.
        """
        health = self.health
        assert health is not None  # a cluster's
        serving: set[str] | None = None
        answered: set[str] = set()
        try:
            client = self.client
            manager = client.nodes_manager
            known = {node.name: node for node in self._seeds}
            known.update(manager.nodes_cache)
            down = health.down_nodes
            manager.startup_nodes = {
                name: known[name] for name in sorted(known, key=lambda name: name in down)
            }
            manager.initialize()
            serving = self._serving()
            for name in serving & down.keys():
                node = manager.nodes_cache[name]
                try:
                    server = client.get_valkey_connection(node)
                    server.connection_pool.disconnect(inuse_connections=False)  # may be stale
                    server.ping()
                except Exception:  # still down
                    continue
                answered.add(name)
        finally:
            ended = health.read_done(serving, answered)
        for name, outage in ended:
            logger.info(
                "valkey tier %r: cluster node %s %s after %.1f s",
                self._config.name,
                name,
                "answers again" if name in answered else "no longer serves slots: another node took them",
                time.monotonic() - outage.since,
            )
        return ended

    def ping(self) -> None:
        """Raise unless the server (for a cluster: at least one node serving slots) answers.

        A cluster with a dead node still serves the other nodes' slots, so one answering
        node is enough; the dead node's keys fail one by one. The cluster's slot map is read
        again first: after an outage of every node, other nodes may serve the slots.
        """
        client = self.client
        if self.health is None:
            client.ping()
            return
        self.refresh_topology()
        down = self.health.down_nodes
        error: Exception | None = None
        for node in client.get_primaries():
            if node.name in down:
                continue
            try:
                client.get_valkey_connection(node).ping()
                return
            except Exception as exc:  # try the next node
                error = exc
        raise error or ConnectionError("every cluster node serving slots is down")

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
        if self.health is not None:
            infos = []
            down = self.health.down_nodes
            for node in client.get_primaries():
                if node.name in down:  # a stalled node would hold this thread for timeout_s
                    continue
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
        for _, server, indexes in self._groups(names):
            if server is None:
                continue  # a slot nobody serves: nothing to delete there
            pipe = server.pipeline(transaction=False)
            for index in indexes:
                pipe.delete(names[index])
            pipe.execute()

    def close(self) -> None:
        """Close every pooled connection."""
        with self._lock:
            client, self._client = self._client, None
            elsewhere, self._elsewhere = self._elsewhere, {}
        if client is not None:
            client.close()
        for node in elsewhere.values():
            if node.valkey_connection is not None:
                node.valkey_connection.close()
