"""Verify a shared tier's values on the server: ``kvtier check valkey://HOST:PORT[/DB]``.

An operator of the shared tier knows its URL, not the layouts of the engines that write to
it. Each value is checked from what it carries: its header (:mod:`kvtier.tiers.disk.format`)
must decode, name the key its name ends in (``<namespace>:<hex of the key>``), and hold a
payload of its stated length and checksum. What no single value can show is a value of
another layout in a namespace: every value of a namespace must carry the same layout digest,
and one that does not is a problem. Which digest is the namespace's: the one the caller
gives (``--layout``, or a tier's own check); for a default namespace (``kvtier:`` + the
first 8 bytes of the digest, in hex) the one its name names, if exactly one digest found
does; in a namespace whose values all carry one digest, that one. Otherwise nobody knows:
the namespace's mixed layouts are one problem, and ``fix`` deletes none of those values —
never a vote (whoever can write to the server can plant a majority of well-formed values).

Values written with a secret (keyed: :mod:`kvtier.tiers.secret`) are verified only by a
check given the same secret (``--secret-file``); without it they are counted as
``unverified``, neither healthy nor a problem (and never deleted by ``fix``). With it, an
unkeyed value, or one whose tag does not hold, is a problem.

:meth:`ValkeyTier.check` runs the same code (:func:`check_namespace`) with its own layout, so
there is one per-value verification, whoever asks.

Every function here blocks on the network (``timeout_s`` per batch of reads) and is called
from the command line or a tier's ``check``, never from the scheduler thread.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError, ValkeyCheckError
from kvtier.extras import install_hint
from kvtier.tiers.base import Failure, FailureKind
from kvtier.tiers.disk.format import HEADER_BYTES, decode_header, verify
from kvtier.tiers.secret import tier_keys
from kvtier.tiers.valkey.config import URL_SCHEMES, ValkeyTierConfig, parse, redact_url
from kvtier.tiers.valkey.connection import ValkeyConnection, fix_for, reason_of

__all__ = [
    "DEFAULT_NAMESPACES",
    "NamespaceReport",
    "ValkeyCheckReport",
    "check_namespace",
    "check_valkey",
    "is_valkey_target",
    "namespace_names",
    "verify_value",
]

#: what a check without ``--namespace`` scans: every namespace a tier derives from its layout
DEFAULT_NAMESPACES = "kvtier"
#: a check waits this long for one batch of reads (longer than a tier's 1 s: a check reads
#: whole batches of large values, and nothing waits on it)
CHECK_TIMEOUT_S = 10.0
#: the most value bytes one batch of reads holds
CHECK_BATCH_BYTES = 64 << 20
#: keys in the first batch of reads, before the values' length is known
_FIRST_BATCH_KEYS = 8
_DERIVED_RE = re.compile(r"kvtier:([0-9a-f]{16})")


@dataclass
class NamespaceReport:
    """What a check found in one namespace: healthy when ``problems`` is empty."""

    namespace: str
    #: values read and verified (a value evicted or expired since the scan is not counted)
    blocks_checked: int = 0
    #: bytes of those values (headers included)
    value_bytes: int = 0
    #: layout digest (hex) -> how many values carry it (only values whose header decodes)
    layout_digests: dict[str, int] = field(default_factory=dict)
    #: the digest the namespace's values must carry (hex; None when no header decoded)
    layout_digest: str | None = None
    #: ``name: reason``, one per bad value (and one line for a namespace of mixed layouts)
    problems: list[str] = field(default_factory=list)
    #: what ``fix=True`` did about them
    fixed: list[str] = field(default_factory=list)
    #: keyed values (written with a secret) a check without the secret cannot verify
    unverified: int = 0

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_record(self) -> dict[str, Any]:
        """The JSON object of this namespace (``namespaces[NAME]`` of the check's JSON line)."""
        return {
            "healthy": self.healthy,
            "blocks_checked": self.blocks_checked,
            "bytes": self.value_bytes,
            "layout_digest": self.layout_digest,
            "layout_digests": dict(self.layout_digests),
            "problems": list(self.problems),
            "fixed": list(self.fixed),
            "unverified": self.unverified,
        }


@dataclass
class ValkeyCheckReport:
    """What :func:`check_valkey` found, namespace by namespace (sorted by name)."""

    #: the server's URL, or the cluster's nodes joined by commas
    target: str
    namespaces: list[NamespaceReport] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return all(report.healthy for report in self.namespaces)

    @property
    def blocks_checked(self) -> int:
        return sum(report.blocks_checked for report in self.namespaces)

    @property
    def problems(self) -> list[str]:
        return [problem for report in self.namespaces for problem in report.problems]

    @property
    def fixed(self) -> list[str]:
        return [line for report in self.namespaces for line in report.fixed]

    def to_record(self) -> dict[str, Any]:
        """The JSON line: the disk check's fields (``path`` is the target), and ``namespaces``."""
        return {
            "path": self.target,
            "healthy": self.healthy,
            "blocks_checked": self.blocks_checked,
            "problems": self.problems,
            "fixed": self.fixed,
            "namespaces": {report.namespace: report.to_record() for report in self.namespaces},
        }


def is_valkey_target(path: str) -> bool:
    """Whether ``kvtier check``'s argument names a server (a URL the valkey tier accepts)
    rather than a disk store's directory."""
    return path.partition("://")[0] in URL_SCHEMES and "://" in path


def verify_value(
    value,
    key: bytes,
    *,
    layout_digest: bytes | None = None,
    payload_bytes: int | None = None,
    keys=None,
    codec: bytes | None = None,
    exact: bool = True,
) -> tuple[str | None, bytes | None]:
    """Why ``value`` is not ``key``'s block, or ``None``; and the layout digest its header carries.

    With ``layout_digest`` and ``payload_bytes`` (a tier that knows its layout) the value must
    be of that layout; without them (a check that does not), of the layout and length its own
    header names — whether that layout belongs in the namespace is the caller's question.
    ``codec``: the descriptor of the tier's codec (None: the one the header names), and
    ``exact``: whether every payload is ``payload_bytes`` long (else at most that).
    The digest is ``None`` when the header does not decode. Reasons are
    :func:`~kvtier.tiers.disk.format.verify`'s, and ``payload length`` for a value longer than
    its header says.
    """
    view = memoryview(value).cast("B")
    header = decode_header(view[:HEADER_BYTES])
    if isinstance(header, str):
        return header, None
    want_digest = header.layout_digest if layout_digest is None else layout_digest
    want_bytes = header.payload_bytes if payload_bytes is None else payload_bytes
    stored = min(header.payload_bytes, want_bytes)
    payload: memoryview | bytearray = view[HEADER_BYTES : HEADER_BYTES + stored]
    if keys is not None and header.flags and len(payload) == stored:
        payload = bytearray(payload)  # an encrypted payload is decrypted in place
    reason = verify(
        view[:HEADER_BYTES],
        payload,
        len(view),
        key=key,
        layout_digest=want_digest,
        payload_bytes=want_bytes,
        keys=keys,
        codec=header.codec if codec is None else codec,
        exact=exact,
    )
    if reason is None and len(view) > HEADER_BYTES + stored:
        reason = "payload length"  # trailing bytes: not what any tier wrote
    return reason, header.layout_digest


def _key_of(name: bytes, prefix: bytes) -> bytes | None:
    """The offload key a value's name ends in, or None if the name holds no hex key."""
    tail = name[len(prefix) :]
    try:
        return bytes.fromhex(tail.decode("ascii")) if tail else None
    except (UnicodeDecodeError, ValueError):
        return None


def _namespace_digest(namespace: str, digests: Counter) -> bytes | None:
    """The layout digest the namespace's values must carry when the caller named none, or
    None when that cannot be known (see the module docstring): never the most common one."""
    if len(digests) == 1:
        return next(iter(digests))
    derived = _DERIVED_RE.fullmatch(namespace)
    if derived is not None:
        named = [digest for digest in digests if digest[:8].hex() == derived.group(1)]
        if len(named) == 1:
            return named[0]
    return None


def check_namespace(
    conn: ValkeyConnection,
    namespace: str,
    names: Sequence[bytes],
    *,
    fix: bool = False,
    layout_digest: bytes | None = None,
    payload_bytes: int | None = None,
    batch_bytes: int = CHECK_BATCH_BYTES,
    keys=None,
    codec: bytes | None = None,
    exact: bool = True,
) -> NamespaceReport:
    """Read and verify the values ``names`` (all ``<namespace>:...``); with ``fix``, DEL the bad ones.

    ``layout_digest`` and ``payload_bytes``: the layout every value must be of (a tier's own
    check, or ``--layout``; ``payload_bytes`` may be None then; with ``codec`` and ``exact``
    as :func:`verify_value` takes them); without them the namespace's
    layout is inferred where the namespace's name or its values leave no doubt (module
    docstring), and otherwise values that differ only in layout are reported, not deleted.
    Reads go out in pipelined batches of at most ``batch_bytes`` of values. A value gone since the scan
    (evicted, expired) is skipped. Raises :class:`ValkeyCheckError` if the server stops
    answering, or answers a read with an error other than a key holding a non-string value.

    With ``fix``, a value rewritten by an engine between this read and the DEL is deleted
    too: a later miss, never a wrong block served.
    """
    report = NamespaceReport(namespace)
    prefix = (namespace + ":").encode()
    value_bytes = HEADER_BYTES + payload_bytes if payload_bytes is not None else 0
    batch_keys = max(1, batch_bytes // value_bytes) if value_bytes else _FIRST_BATCH_KEYS
    bad: dict[bytes, str] = {}
    found: list[tuple[bytes, bytes]] = []  # (name, digest) of values that passed on their own
    digests: Counter = Counter()
    typical = 0  # the length of the last value read
    start = 0
    while start < len(names):
        chunk = names[start : start + batch_keys]
        start += len(chunk)
        # most values of a namespace share one length: read them into one array per batch
        # a value longer than the layout's (or, unknown, than a batch) is read off and dropped
        values = conn.get_many(chunk, value_bytes or typical, max_bytes=value_bytes or batch_bytes)
        longest = 0
        for name, value in zip(chunk, values):
            if value is None:
                continue  # evicted or expired since the scan
            if isinstance(value, Failure):
                if value.kind is FailureKind.CORRUPT:  # longer than any value could be: not held
                    report.blocks_checked += 1
                    bad[name] = value.detail
                    continue
                if value != _WRONGTYPE:
                    raise ValkeyCheckError(
                        redact_url(conn.location),
                        f"reading {name.decode(errors='replace')} failed ({value})",
                        fix_for(
                            value, "make sure the server is up and answers GET, then run the check again"
                        ),
                    )
                report.blocks_checked += 1
                bad[name] = "not a string value"
                continue
            report.blocks_checked += 1
            report.value_bytes += len(value)
            longest = max(longest, len(value))
            typical = len(value)
            key = _key_of(name, prefix)
            if key is None:
                bad[name] = "name is not <namespace>:<hex key>"
                continue
            reason, digest = verify_value(
                value,
                key,
                layout_digest=layout_digest,
                payload_bytes=payload_bytes,
                keys=keys,
                codec=codec,
                exact=exact,
            )
            if reason == "keyed (no secret here)":
                report.unverified += 1  # only the secret can tell a keyed value from a forgery
                continue
            if digest is not None:
                digests[digest] += 1
            if reason is not None:
                bad[name] = reason
            elif digest is not None:  # a value that passed has a header, so a digest
                found.append((name, digest))
        if not value_bytes and longest:
            # the values' length is known now: batches of batch_bytes from here on
            batch_keys = max(1, batch_bytes // longest)
    want = layout_digest if layout_digest is not None else _namespace_digest(namespace, digests)
    report.layout_digest = want.hex() if want is not None else None
    report.layout_digests = {digest.hex(): count for digest, count in sorted(digests.items())}
    if want is not None:
        for name, digest in found:
            if digest != want:
                bad[name] = f"other layout ({digest.hex()}; the namespace's is {want.hex()})"
    report.problems = [f"{name.decode(errors='replace')}: {reason}" for name, reason in sorted(bad.items())]
    if want is None and len(digests) > 1:
        # Nothing here can say which layout is the namespace's: a vote would let anyone who
        # can write to the server outvote the real values and have --fix delete them.
        counts = ", ".join(f"{digest.hex()} x{count}" for digest, count in sorted(digests.items()))
        report.problems.append(
            f"{namespace}: mixed layouts ({counts}); none of those values deleted: give the "
            "namespace's layout with --layout DIGEST"
        )
    if fix and bad:
        doomed = sorted(bad)
        for at in range(0, len(doomed), 1000):
            try:
                conn.delete(doomed[at : at + 1000])
            except Exception as error:
                raise ValkeyCheckError(
                    redact_url(conn.location),
                    f"deleting bad values failed ({reason_of(error)})",
                    "make sure the server is up and accepts DEL, then run the check with --fix again",
                ) from None
        report.fixed = [f"{name.decode(errors='replace')}: deleted" for name in doomed]
    return report


def _namespace_of(name: bytes) -> str:
    """The namespace of a value's name: everything before its last ``:`` (keys are hex)."""
    return name.rpartition(b":")[0].decode(errors="replace")


def namespace_names(conn: ValkeyConnection, namespace: str | None = None) -> dict[str, list[bytes]]:
    """The value names on the server, sorted, by namespace: ``namespace``'s alone (an entry
    even when empty), or every ``kvtier:*`` namespace's. Lists them with SCAN (on each
    primary of a cluster), never KEYS, so the server keeps serving meanwhile.

    A name belongs to the namespace before its last ``:`` (keys are hex): the names of a
    nested namespace (``NS:sub:<key>``, which ``NS:*`` also matches) are not ``NS``'s.
    """
    # SCAN patterns are globs; a namespace holds none of * ? [ ] \ (the config parser refuses them)
    scan_prefix = (namespace if namespace is not None else DEFAULT_NAMESPACES) + ":"
    groups: dict[str, list[bytes]] = {} if namespace is None else {namespace: []}
    for name in set(conn.scan_names(scan_prefix.encode() + b"*")):  # SCAN may repeat a name
        owner = _namespace_of(name)
        if namespace is None or owner == namespace:
            groups.setdefault(owner, []).append(name)
    return {owner: sorted(names) for owner, names in groups.items()}


def check_valkey(
    url: str | None = None,
    *,
    cluster_nodes: Sequence[str] = (),
    namespace: str | None = None,
    fix: bool = False,
    timeout_s: float = CHECK_TIMEOUT_S,
    layout_digest: bytes | None = None,
    config: ValkeyTierConfig | None = None,
    secret_file: str | None = None,
) -> ValkeyCheckReport:
    """Verify every value of ``namespace`` (default: every ``kvtier:*`` namespace) on a server
    (``url``: any URL the valkey tier takes, TLS included) or a cluster (``cluster_nodes``),
    or the one a tier's ``config`` names (its credentials, TLS and, unless ``namespace``
    says otherwise, its namespace). Without a config the password comes from
    ``KVTIER_VALKEY_PASSWORD`` (or the URL).

    ``layout_digest``: the layout the checked namespaces' values must be of (``--layout``);
    without it, see the module docstring. ``secret_file``: the tiers' secret, to verify keyed
    values (without it they are counted as unverified; a ``config``'s own secret is used when
    it has one). Names are listed by :func:`namespace_names` (SCAN, never KEYS). Safe while
    engines use the tier. Raises :class:`~kvtier.errors.ConfigError` for a bad URL, node or
    namespace or a missing client, and :class:`ValkeyCheckError` if the server cannot be
    reached or answers with an error (its message says which: unreachable, credentials, TLS,
    an ACL).
    """
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("valkey") is None:
        raise ConfigError(
            "check",
            redact_url(url) or ",".join(cluster_nodes),
            "the valkey client installed",
            install_hint("valkey"),
        )
    if config is None:
        section: dict[str, Any] = {"kind": "valkey", "name": "check", "timeout_s": timeout_s}
        if cluster_nodes:
            section["cluster_nodes"] = list(cluster_nodes)
        else:
            section["url"] = url
        if namespace is not None:
            section["namespace"] = namespace
        config = parse(section, "check")
    else:
        namespace = namespace if namespace is not None else config.namespace
        config = dataclasses.replace(config, timeout_s=max(config.timeout_s, timeout_s))
    if secret_file is not None:
        config = dataclasses.replace(config, secret_file=secret_file)
    keys = tier_keys(config, "check")
    target = redact_url(config.location())
    conn = ValkeyConnection(config)
    try:
        try:
            conn.ping()
            groups = namespace_names(conn, namespace)
        except Exception as error:
            raise _unreachable(target, error) from None
        report = ValkeyCheckReport(target)
        for owner in sorted(groups):
            report.namespaces.append(
                check_namespace(conn, owner, groups[owner], fix=fix, layout_digest=layout_digest, keys=keys)
            )
        return report
    finally:
        conn.close()


#: a GET of a key that holds a list, a hash ...: a bad value, not a failed check
_WRONGTYPE = Failure(FailureKind.SERVER, detail="WRONGTYPE")


def _unreachable(target: str, error: BaseException) -> ValkeyCheckError:
    reason = reason_of(error)
    if reason.kind is FailureKind.UNAVAILABLE:
        return ValkeyCheckError(target, f"cannot reach the server ({reason})", fix_for(reason, ""))
    if reason.kind in (FailureKind.AUTH, FailureKind.TLS):
        what = "refused the credentials" if reason.kind is FailureKind.AUTH else "failed the TLS handshake"
        return ValkeyCheckError(target, f"the server {what} ({reason})", fix_for(reason, ""))
    return ValkeyCheckError(
        target,
        f"the server answered with an error ({reason})",
        fix_for(reason, "check the server's log"),
    )
