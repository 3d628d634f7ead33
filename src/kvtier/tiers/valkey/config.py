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
  username: kvtier                   # the ACL user (default: the URL's, else "default")
  password_file: /etc/kvtier/valkey.pass  # yours alone (chmod 600); or KVTIER_VALKEY_PASSWORD
  tls: {ca_file: /etc/kvtier/ca.pem, cert_file: client.pem, key_file: client.key}
  secret_file: /etc/kvtier/secret    # optional: keyed MACs and names (docs/security.md)
  encrypt: aes-gcm                   # optional, with secret_file: values encrypted at rest
```

The password lives in a file or the environment, never in the configuration: the section
holds where it is (``password_file``), read when the tier connects, so no repr, log or
report of the configuration can print it. A password in the URL is still taken (the
file's, then the environment's, take precedence) and every printed URL has it replaced
by ``***`` (:func:`redact_url`). ``tls`` (or a ``valkeys://``/``rediss://`` URL) turns TLS
on, for a server and for a cluster alike.

The server owns capacity and eviction (``maxmemory`` with ``allkeys-lru``): the section takes
no ``capacity`` or ``eviction``, and refuses them with a fix rather than ignore them.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.config.parse import parse_tier
from kvtier.config.schema import TierConfig
from kvtier.config.units import format_size, parse_size
from kvtier.errors import ConfigError
from kvtier.extras import install_hint
from kvtier.registry import Registry
from kvtier.tiers.base import SecondaryTier
from kvtier.codecs import parse_codec_option
from kvtier.tiers.secret import parse_secret_options, read_private_file

__all__ = [
    "PASSWORD_ENV",
    "VALKEY_KINDS",
    "ValkeyTLS",
    "ValkeyTierConfig",
    "parse",
    "read_password",
    "redact_url",
]

#: the kinds this section serves: Redis speaks the same protocol
VALKEY_KINDS = ("valkey", "redis")
#: URL schemes accepted in ``url`` (redis schemes are read as their valkey twins)
URL_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
#: the environment variable a valkey tier takes its password from when it has no password_file
PASSWORD_ENV = "KVTIER_VALKEY_PASSWORD"
#: the longest password file read (a password, not a document)
_MAX_SECRET_BYTES = 4096
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
#: how long a key found missing answers False before the server is asked again
DEFAULT_MISS_TTL_S = 2.0
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NODE_RE = re.compile(r"(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class ValkeyTLS:
    """The ``tls:`` section: TLS to the server (or every cluster node), verified."""

    # PEM file of the CA(s) that signed the server's certificate; None: the system's CAs
    ca_file: str | None = None
    # PEM client certificate and its key, for a server that asks for one (mutual TLS)
    cert_file: str | None = None
    key_file: str | None = None
    # whether the server's certificate must name the host the URL (or node) names
    check_hostname: bool = True


@dataclass(frozen=True)
class ValkeyTierConfig(TierConfig):
    """A tier on a Valkey (or Redis) server or cluster, shared by every engine that names it.

    ``capacity_bytes`` is 0 (the server's ``maxmemory`` bounds it) and ``eviction`` is the
    server's policy; both are kept from :class:`TierConfig` only so that code listing a stack
    reads every tier alike.
    """

    # a standalone server: valkey://[user@]host:port/db, or unix:///path/to.sock (a password here
    # is taken but belongs in password_file or KVTIER_VALKEY_PASSWORD; printed as ***)
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
    # the ACL user to authenticate as; None: the URL's, else the server's "default" user
    username: str | None = None
    # a file holding the password (its first line), owned by this user and readable by no one
    # else; read when the tier connects. None: KVTIER_VALKEY_PASSWORD, else the URL's, else none
    password_file: str | None = None
    # TLS to the server or cluster; None: plain TCP (unless the URL is valkeys:// or rediss://)
    tls: ValkeyTLS | None = None
    # a file of >= 32 random bytes (mode 0600, this user's), the same on every engine sharing
    # the tier: values carry a keyed MAC (others are misses), names and the default namespace
    # are keyed; None: xxh3 checksums and names from the public block hashes
    secret_file: str | None = None
    # none, or aes-gcm: values are encrypted under secret_file
    encrypt: str = "none"
    # how values are stored: none (as they are), lossless (byte planes + zstd), or, lossy
    # and opt-in, int8, fp8, int4 (need the KV's element dtype); see docs/tiers/codecs.md
    codec: str = "none"

    #: the server bounds and evicts the tier: the section takes no capacity or eviction
    bounded_by_server: ClassVar[bool] = True

    @classmethod
    def parse_options(cls, section: Mapping[str, object], field: str, name: str) -> dict[str, object]:
        has_url, has_nodes = "url" in section, "cluster_nodes" in section
        if has_url == has_nodes:
            raise ConfigError(
                f"{field}.url",
                redact_url(str(section["url"])) if has_url else "<missing>",
                "exactly one of url: (one server) and cluster_nodes: (a cluster)",
                "write url: valkey://host:6379/0, or cluster_nodes: [host:7000, ...]",
            )
        options: dict[str, object] = {}
        if has_url:
            options["url"] = _parse_url(section["url"], f"{field}.url")
        else:
            options["cluster_nodes"] = _parse_nodes(section["cluster_nodes"], f"{field}.cluster_nodes")
        namespace = section.get("namespace")
        if namespace is not None and (
            not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace)
        ):
            raise ConfigError(
                f"{field}.namespace",
                namespace,
                "1-128 letters, digits and _ . : -",
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
                raise ConfigError(
                    f"{field}.max_inflight_bytes", size, "a size > 0", "write a size such as 256MiB"
                )
            options["max_inflight_bytes"] = size
        if "username" in section:
            username = section["username"]
            if not isinstance(username, str) or not username or any(c.isspace() for c in username):
                raise ConfigError(f"{field}.username", username, "an ACL user name", "write username: kvtier")
            options["username"] = username
        if section.get("password_file") is not None:
            path = section["password_file"]
            if not isinstance(path, str) or not path:
                raise ConfigError(
                    f"{field}.password_file",
                    path,
                    "a file's path",
                    "write password_file: /etc/kvtier/valkey.pass",
                )
            read_password(path, f"{field}.password_file")  # refused now, not at the first connection
            options["password_file"] = path
        if section.get("tls") is not None:
            options["tls"] = _parse_tls(section["tls"], f"{field}.tls")
            if str(options.get("url", "")).startswith("unix:"):
                raise ConfigError(
                    f"{field}.tls",
                    "(set)",
                    "TLS over TCP: a valkeys://host:port URL",
                    "drop tls: for a unix socket, or give the server's TCP address",
                )
        options.update(parse_secret_options(section, field))
        options.update(parse_codec_option(section, field))
        return options

    def location(self) -> str | None:
        """The server's URL with its password replaced by ``***``, or the cluster's nodes."""
        return redact_url(self.url) if self.url else ",".join(self.cluster_nodes)

    def options_text(self) -> str:
        """``describe``'s settings: never the URL (``location`` shows it, redacted), never a secret."""
        parts = [f"namespace={self.namespace or '(from the layout)'}", f"timeout_s={self.timeout_s}"]
        if self.ttl_s is not None:
            parts.append(f"ttl_s={self.ttl_s}")
        parts.append(f"max_inflight_bytes={format_size(self.max_inflight_bytes)}")
        if self.username:
            parts.append(f"username={self.username}")
        parts.append("password=" + self.password_source())
        if self.tls is not None or self.uses_tls:
            tls = self.tls or ValkeyTLS()
            parts.append(
                f"tls=ca_file:{tls.ca_file or '(system)'}"
                + (f",cert_file:{tls.cert_file}" if tls.cert_file else "")
            )
        return "  ".join(parts)

    @property
    def uses_tls(self) -> bool:
        """Whether connections are TLS: a ``tls:`` section, or a valkeys:// / rediss:// URL."""
        return self.tls is not None or bool(self.url and self.url.startswith(("valkeys://", "rediss://")))

    def password_source(self) -> str:
        """Where the password comes from, for ``describe`` (never the password itself)."""
        if self.password_file:
            return f"file {self.password_file}"
        if os.environ.get(PASSWORD_ENV):
            return f"${PASSWORD_ENV}"
        if self.url and urlsplit(self.url).password:
            return "in the URL (printed as ***; better: password_file)"
        return "none"

    def credentials(self) -> tuple[str | None, str | None]:
        """``(username, password)`` to connect with, read now (the password file, the
        environment, the URL's: the first that has one). Raises :class:`ConfigError` if
        the password file is gone or no longer private."""
        password = None
        if self.password_file:
            password = read_password(self.password_file, "password_file")
        elif os.environ.get(PASSWORD_ENV):
            password = os.environ[PASSWORD_ENV]
        return self.username, password

    def open_lower(self, rows: Any, fingerprint: Any, *, field: str, **options: Any) -> Any:
        """Open the tier over CPU rows ``rows`` (see ``ValkeyTier.open``); a
        :class:`ConfigError` with the install command when the ``valkey`` client is missing."""
        if importlib.util.find_spec("valkey") is None:  # the client the tier needs
            raise ConfigError(
                f"{field}.kind",
                self.kind,
                "a tier whose client is installed",
                install_hint("valkey"),
            )
        # By name, as the kind registry finds this section: the tier imports this module.
        cls = VALKEY_MEDIA.resolve(self.kind, field=f"{field}.kind")
        return cls.open(self, rows, fingerprint, field=field)  # type: ignore[attr-defined]


def redact_url(url: str | None) -> str:
    """``url`` with its password replaced by ``***`` (the user name kept), in the userinfo
    and in a ``password=`` query argument: the only form in which a server's URL is printed,
    logged or written to a report. Anything else comes back unchanged (a cluster's node
    list; ``None`` as "")."""
    if not url:
        return ""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = rest.rfind("@")  # the last @: an unquoted password may hold @ or /, a host never does
    if at >= 0:
        user, colon, _password = rest[:at].partition(":")
        rest = (f"{user}:***" if colon else user) + rest[at:]
    rest = _PASSWORD_ARG_RE.sub(r"\1***", rest)
    return f"{scheme}://{rest}"


_PASSWORD_ARG_RE = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def read_password(path: str, field: str) -> str:
    """The first line of the password file ``path``, opened and checked as a tier's secret
    file is (:func:`~kvtier.tiers.secret.read_private_file`: a regular file of this user's
    that no one else may read, never through a symlink nor waiting on a FIFO), UTF-8 text of
    at most 4 KiB; a :class:`ConfigError` naming ``field`` otherwise (a password another
    local user could read, swap or redirect is not a secret)."""
    fix = f"write the password alone: printf %s PASSWORD > {path}; chmod 600 {path}"
    text = read_private_file(path, field, max_bytes=_MAX_SECRET_BYTES, fix=fix)
    try:
        password = text.decode("utf-8").splitlines()[0] if text.strip() else ""
    except UnicodeDecodeError:
        raise ConfigError(field, path, "UTF-8 text whose first line is the password", fix) from None
    if not password:
        raise ConfigError(field, path, "a file whose first line is the password", fix)
    return password


def _parse_tls(value: object, field: str) -> ValkeyTLS:
    if value is True:
        return ValkeyTLS()
    if not isinstance(value, Mapping):
        raise ConfigError(
            field,
            value,
            "a mapping of ca_file, cert_file, key_file (or true: the system's CAs)",
            "write tls: {ca_file: /etc/kvtier/ca.pem}",
        )
    known = {f for f in ("ca_file", "cert_file", "key_file", "check_hostname")}
    for key in value:
        if key not in known:
            raise ConfigError(
                f"{field}.{key}",
                value[key],
                "one of " + ", ".join(sorted(known)),
                f"remove {key}, or spell it as one of those",
            )
    files: dict[str, str | None] = {}
    for key in ("ca_file", "cert_file", "key_file"):
        path = value.get(key)
        if path is not None and (not isinstance(path, str) or not os.path.isfile(path)):
            raise ConfigError(
                f"{field}.{key}", path, "the path of an existing PEM file", "give the file's path"
            )
        files[key] = path
    if (files["cert_file"] is None) != (files["key_file"] is None):
        raise ConfigError(
            f"{field}.cert_file",
            files["cert_file"],
            "cert_file and key_file together (mutual TLS)",
            "give both, or neither",
        )
    if files["key_file"] is not None:
        _check_private(files["key_file"], f"{field}.key_file")
    check_hostname = value.get("check_hostname", True)
    if not isinstance(check_hostname, bool):
        raise ConfigError(
            f"{field}.check_hostname", check_hostname, "true or false", "write check_hostname: true"
        )
    return ValkeyTLS(files["ca_file"], files["cert_file"], files["key_file"], check_hostname)


def _check_private(path: str, field: str) -> None:
    """A private key is as secret as a password: owned by this user, no group or other bits."""
    info = os.stat(path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ConfigError(
            field,
            path,
            f"a file owned by this user (uid {os.geteuid()}) and readable by no one else "
            f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})",
            f"chown {os.geteuid()} {path}; chmod 600 {path}",
        )


def _seconds(value: object, field: str, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        expected = "a number of seconds > 0" + (" or null" if allow_none else "")
        raise ConfigError(field, value, expected, "write a number such as 1.5")
    return float(value)


def _parse_url(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            field,
            value,
            "a server URL: " + ", ".join(f"{s}://" for s in URL_SCHEMES),
            "write url: valkey://host:6379/0 (or unix:///path/to/valkey.sock)",
        )
    try:
        parts = urlsplit(value)
    except ValueError as exc:  # an unclosed [ of an IPv6 address, among others
        raise ConfigError(
            field,
            redact_url(value),
            f"a server URL ({exc})",
            "write url: valkey://host:6379/0, or valkey://[::1]:6379/0",
        ) from None
    if parts.scheme not in URL_SCHEMES:
        raise ConfigError(
            field,
            redact_url(value),
            "a URL starting with one of " + ", ".join(f"{s}://" for s in URL_SCHEMES),
            "write url: valkey://host:6379/0",
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(
                field, redact_url(value), "unix:///absolute/path/to/socket", "add the socket's path"
            )
        return value
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1:
        raise ConfigError(
            field,
            redact_url(value),
            "scheme://host[:port][/db] with a host and a port 1-65535",
            "write url: valkey://host:6379/0",
        )
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(
            field, redact_url(value), "a database number after the host (/0)", "write /0 or leave it out"
        )
    return value


def _parse_nodes(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(
            field,
            value,
            "a non-empty list of host:port",
            "write cluster_nodes: [10.0.0.5:7000, 10.0.0.6:7000]",
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
    tier = parse_tier(section, field)
    if not isinstance(tier, ValkeyTierConfig):
        raise ConfigError(
            f"{field}.kind", tier.kind, "one of " + ", ".join(VALKEY_KINDS), "write kind: valkey"
        )
    return tier


#: valkey kind -> the tier class serving it ("module:Class", imported when a tier opens)
VALKEY_MEDIA: Registry[SecondaryTier] = Registry(
    "valkey-tier kind",
    SecondaryTier,
    {kind: "kvtier.tiers.valkey.tier:ValkeyTier" for kind in VALKEY_KINDS},
    module_key="module_path",
)
