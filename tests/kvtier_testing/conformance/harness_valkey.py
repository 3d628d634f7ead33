"""Conformance harnesses of the valkey kind (a server, a 3-node cluster) and of ``redis``.

The servers are real ``valkey-server`` processes on loopback (``kvtier.tiers.valkey.server``):
one server and one cluster for the whole suite, each test under a namespace of its own. The
medium is disturbed the way a deployment is: values rewritten or deleted by another client, a
server killed (down), stopped with SIGSTOP (a hung server: timeouts; briefly: slow reads), or
out of memory under ``noeviction`` (full).
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import ClassVar

import xxhash
from kvtier_testing.conformance.tier_harness import Harness, register

from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint, encode_header_into
from kvtier.tiers.valkey.server import LocalValkeyCluster

#: a job's patience with the server in most scenarios: generous, so a loaded machine never
#: turns a scenario into a timeout
TIMEOUT_S = 2.0
#: the timeout scenario's: the server hangs longer than this
SHORT_TIMEOUT_S = 0.5
#: the slow-read scenario's: the server is held for far less than this
LONG_TIMEOUT_S = 30.0
#: what the suite's servers may hold, restored after the full scenario
MAXMEMORY = 256 << 20


class ValkeyHarness(Harness):
    kind = "valkey"
    counters: ClassVar[dict[str, str | None]] = {
        "stored": "stored_blocks",
        "loaded": "loaded_blocks",
        "missing": "failed_missing",
        "corrupt": "corrupt_values",
        "failed": "failed_keys",
        "full": "failed_server_OOM",
        "down": "outages",
        "stored_bytes": "sent_value_bytes",
    }
    cluster = False
    reads_when_down = "miss"  # its first failure puts it in an outage: lookups answer False

    def __init__(self, request, tmp_path):
        super().__init__(request, tmp_path)
        self.namespace = "conformance-" + uuid.uuid4().hex[:12]
        self.timeout_s = TIMEOUT_S
        self.private = False
        self.target = None

    @property
    def servers(self):
        return self.target.servers if self.cluster else [self.target]

    def place(self, scenario):
        super().place(scenario)
        self.timeout_s = {"timeout": SHORT_TIMEOUT_S, "slow": LONG_TIMEOUT_S}.get(scenario, TIMEOUT_S)
        if self.cluster and scenario in ("down", "replay down"):
            # a killed cluster cannot be joined again in place: this test's own
            binary = self.request.getfixturevalue("valkey_binary")
            self.target = self.exits.enter_context(LocalValkeyCluster(3, binary, maxmemory=MAXMEMORY))
            self.private = True

    def section(self, blocks, block_bytes):
        if self.target is None:
            self.target = self.request.getfixturevalue(
                "shared_valkey_cluster" if self.cluster else "shared_valkey_server"
            )
        where = {"cluster_nodes": self.target.nodes} if self.cluster else {"url": self.target.url}
        return {"kind": self.kind, **where, "namespace": self.namespace, "timeout_s": self.timeout_s}

    # -- damage, by another client ---------------------------------------------------------------

    def _client(self, tier):
        return tier._conn.client

    def remove(self, tier, keys):
        client = self._client(tier)
        for k in keys:
            assert client.delete(tier._name(k)) == 1

    def _rewrite(self, tier, keys, change):
        client = self._client(tier)
        for k in keys:
            value = client.get(tier._name(k))
            assert value is not None and len(value) > HEADER_BYTES  # shorter than a block with a codec
            client.set(tier._name(k), change(k, bytearray(value)))

    def corrupt(self, tier, keys):
        def flip(k, value):
            value[(HEADER_BYTES + len(value)) // 2] ^= 0x5A
            return bytes(value)

        self._rewrite(tier, keys, flip)

    def truncate(self, tier, keys):
        self._rewrite(tier, keys, lambda k, value: bytes(value[: HEADER_BYTES + 100]))

    def relayout(self, tier, keys):
        other = LayoutFingerprint(
            model="another-model",
            dtype="bfloat16",
            tokens_per_block=16,
            page_bytes=(tier.block_bytes,),
            rank=0,
            world_size=1,
            block_bytes=tier.block_bytes,
        )

        def rewrite(k, value):
            header = bytearray(HEADER_BYTES)
            body = bytes(value[HEADER_BYTES:])
            encode_header_into(
                header,
                layout_digest=other.digest(),
                key=k,
                payload_bytes=tier.block_bytes,
                checksum=xxhash.xxh3_64_intdigest(body),
            )
            return bytes(header) + body

        self._rewrite(tier, keys, rewrite)

    def listed(self, tier):
        names = tier._conn.scan_names((self.namespace + ":*").encode())
        return sorted({bytes.fromhex(name.rsplit(b":", 1)[1].decode()) for name in names})

    # -- the server disturbed --------------------------------------------------------------------

    def go_down(self, tier):
        for server in self.servers:
            server.kill()

    def come_back(self, tier):
        if self.cluster:
            return False  # its nodes would come back empty and unjoined: a new cluster
        self.target.start()  # the same port, empty (nothing is persisted)
        return True

    def recovered(self, tier):
        return not tier.down

    def _signal(self, which):
        for server in self.servers:
            if server.pid is not None:
                os.kill(server.pid, which)

    def hang(self, tier):
        self._signal(signal.SIGSTOP)

    def unhang(self, tier):
        self._signal(signal.SIGCONT)

    def fill(self, tier):
        for server in self.servers:
            client = server.client()
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)  # every write is refused: OOM

    def unfill(self, tier):
        for server in self.servers:
            client = server.client()
            client.config_set("maxmemory", MAXMEMORY)
            client.config_set("maxmemory-policy", "allkeys-lru")

    def hold_reads(self, tier):
        self._signal(signal.SIGSTOP)

    def release_reads(self, tier):
        self._signal(signal.SIGCONT)

    def close(self):
        if self.target is not None and not self.private:
            # never leave the suite's shared server stopped or full, whatever the test did
            self._signal(signal.SIGCONT)
            if not self.cluster and self.target.pid is None:
                self.target.start()  # killed, and the test ended before it came back
            if self.scenario == "full":
                self.unfill(None)
        super().close()


@register
class ValkeyServerHarness(ValkeyHarness):
    label = "valkey"


@register
class ValkeyClusterHarness(ValkeyHarness):
    label = "valkey-cluster"
    cluster = True


@register
class RedisHarness(ValkeyHarness):
    """``kind: redis`` is the valkey tier under the other name; a valkey server speaks it."""

    kind = label = "redis"
