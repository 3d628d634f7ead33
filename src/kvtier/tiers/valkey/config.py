"""The ``valkey`` tier's configuration section: parsed once into :class:`ValkeyTierConfig`.

```yaml
- name: shared
  kind: valkey                       # or redis: the same tier, for a Redis server
  url: valkey://10.0.0.5:6379/0      # valkey:// redis:// (TLS: valkeys:// rediss://), unix:///path
  # cluster_nodes: [10.0.0.5:7000, 10.0.0.6:7000]   # instead of url, for a cluster
  namespace: llama3-8b               # default: derived from the layout fingerprint
  ttl_s: 86400                       # optional: values expire after this many seconds
  timeout_s: 1.0                     # a job waits at most this long for the server
  max_inflight_bytes: 256MiB         # bytes of one pipelined batch, and of reads held for loads
  secret_file: /etc/kvtier/secret    # optional: keyed MACs and names (see README "Security")
  encrypt: aes-gcm                   # optional, with secret_file: values encrypted at rest
```

The server owns capacity and eviction (``maxmemory`` with ``allkeys-lru``): the section takes
no ``capacity`` or ``eviction``, and refuses them with a fix rather than ignore them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.config import TierConfig, parse_size
from kvtier.errors import ConfigError
from kvtier.tiers.secret import parse_secret_options

__all__ = ["VALKEY_KINDS", "ValkeyTierConfig", "parse"]

#: the kinds this section serves: Redis speaks the same protocol
VALKEY_KINDS = ("valkey", "redis")
#: URL schemes accepted in ``url`` (redis schemes are read as their valkey twins)
URL_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
#: how long a key found missing answers False before the server is asked again
DEFAULT_MISS_TTL_S = 2.0
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NODE_RE = re.compile(r"(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class ValkeyTierConfig(TierConfig):
    """A tier on a Valkey (or Redis) server or cluster, shared by every engine that names it.

    ``capacity_bytes`` is 0 (the server's ``maxmemory`` bounds it) and ``eviction`` is the
    server's policy; both are kept from :class:`TierConfig` only so that code listing a stack
    reads every tier alike.
    """

    # a standalone server: valkey://[user:password@]host:port/db, or unix:///path/to.sock
    url: str | None = None
    # a cluster, instead of url: a few of its nodes as host:port (the rest are discovered)
    cluster_nodes: tuple[str, ...] = ()
    # prefix of every key; None: "kvtier:" and the layout fingerprint's digest, so two models
    # or layouts never read each other's values
    namespace: str | None = None
    # values expire this long after they are written; None: they live until evicted
    ttl_s: float | None = None
    # a job (or a step's batch of reads) that has not heard from the server in this long fails
    timeout_s: float = DEFAULT_TIMEOUT_S
    # the most bytes in one pipelined batch, and the most bytes of read values held for loads
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    # a key the server did not have answers False for this long before it is asked again
    miss_ttl_s: float = DEFAULT_MISS_TTL_S
    # a file of >= 32 random bytes (mode 0600, this user's), the same on every engine sharing
    # the tier: values carry a keyed MAC (others are misses), names and the default namespace
    # are keyed; None: xxh3 checksums and names from the public block hashes
    secret_file: str | None = None
    # none, or aes-gcm: values are encrypted under secret_file
    encrypt: str = "none"

    #: the server bounds and evicts the tier: the section takes no capacity or eviction
    bounded_by_server: ClassVar[bool] = True

    @classmethod
    def parse_options(cls, section: Mapping[str, object], field: str, name: str) -> dict[str, object]:
        has_url, has_nodes = "url" in section, "cluster_nodes" in section
        if has_url == has_nodes:
            raise ConfigError(
                f"{field}.url", section.get("url", "<missing>"),
                "exactly one of url: (one server) and cluster_nodes: (a cluster)",
                "write url: valkey://host:6379/0, or cluster_nodes: [host:7000, ...]",
            )
        options: dict[str, object] = {}
        if has_url:
            options["url"] = _parse_url(section["url"], f"{field}.url")
        else:
            options["cluster_nodes"] = _parse_nodes(section["cluster_nodes"], f"{field}.cluster_nodes")
        namespace = section.get("namespace")
        if namespace is not None and (not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace)):
            raise ConfigError(
                f"{field}.namespace", namespace, "1-128 letters, digits and _ . : -",
                "write a name such as llama3-8b, or leave it out to derive one from the layout",
            )
        options["namespace"] = namespace
        if "ttl_s" in section:
            options["ttl_s"] = _seconds(section["ttl_s"], f"{field}.ttl_s", allow_none=True)
        for key in ("timeout_s", "miss_ttl_s"):
            if key in section:
                options[key] = _seconds(section[key], f"{field}.{key}", allow_none=False)
        if "max_inflight_bytes" in section:
            size = parse_size(section["max_inflight_bytes"], f"{field}.max_inflight_bytes")
            if size <= 0:
                raise ConfigError(f"{field}.max_inflight_bytes", size, "a size > 0", "write a size such as 256MiB")
            options["max_inflight_bytes"] = size
        options.update(parse_secret_options(section, field))
        return options

    def location(self) -> str | None:
        return self.url or ",".join(self.cluster_nodes)

    def open_lower(self, rows: Any, fingerprint: Any, *, field: str, **options: Any) -> Any:
        from kvtier.tiers.valkey import open_valkey

        return open_valkey(self, rows, fingerprint, field=field)


def _seconds(value: object, field: str, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        expected = "a number of seconds > 0" + (" or null" if allow_none else "")
        raise ConfigError(field, value, expected, "write a number such as 1.5")
    return float(value)


def _parse_url(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            field, value, "a server URL: " + ", ".join(f"{s}://" for s in URL_SCHEMES),
            "write url: valkey://host:6379/0 (or unix:///path/to/valkey.sock)",
        )
    parts = urlsplit(value)
    if parts.scheme not in URL_SCHEMES:
        raise ConfigError(
            field, value, "a URL starting with one of " + ", ".join(f"{s}://" for s in URL_SCHEMES),
            "write url: valkey://host:6379/0",
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(field, value, "unix:///absolute/path/to/socket", "add the socket's path")
        return value
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1:
        raise ConfigError(
            field, value, "scheme://host[:port][/db] with a host and a port 1-65535",
            "write url: valkey://host:6379/0",
        )
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(field, value, "a database number after the host (/0)", "write /0 or leave it out")
    return value


def _parse_nodes(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(
            field, value, "a non-empty list of host:port", "write cluster_nodes: [10.0.0.5:7000, 10.0.0.6:7000]"
        )
    nodes = []
    for index, node in enumerate(value):
        match = _NODE_RE.fullmatch(node) if isinstance(node, str) else None
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise ConfigError(
                f"{field}[{index}]", node, "host:port with a port 1-65535", "write such as 10.0.0.5:7000"
            )
        nodes.append(node)
    return tuple(nodes)


def parse(section: Mapping, field: str) -> ValkeyTierConfig:
    """The ``valkey`` (or ``redis``) tier section at ``field`` as a :class:`ValkeyTierConfig`.

    The same parser a whole configuration goes through (:func:`kvtier.config.parse_tier`),
    for code that builds one valkey tier on its own (benchmarks, the fleet replay). Raises
    :class:`~kvtier.errors.ConfigError` naming the key, the value, what is valid and the fix.
    """
    from kvtier.config import parse_tier

    tier = parse_tier(section, field)
    if not isinstance(tier, ValkeyTierConfig):
        raise ConfigError(f"{field}.kind", tier.kind, "one of " + ", ".join(VALKEY_KINDS), "write kind: valkey")
    return tier
