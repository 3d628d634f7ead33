"""``reason_of``: the client's exceptions and error replies as typed failure reasons, and the
names they are counted and printed under."""

from __future__ import annotations

import ssl

import pytest

from kvtier.tiers.base import Failure, FailureKind

errors = pytest.importorskip("valkey.exceptions")
connection = pytest.importorskip("kvtier.tiers.valkey.connection")


def wrapped(inner: BaseException, outer: BaseException) -> BaseException:
    """``outer`` as if raised while handling ``inner``, as the client wraps socket errors."""
    outer.__context__ = inner
    return outer


@pytest.mark.parametrize(
    ("error", "kind", "detail"),
    [
        (errors.TimeoutError("Timeout reading from 127.0.0.1:1"), FailureKind.UNAVAILABLE, "timeout"),
        (
            wrapped(ConnectionRefusedError(111, "refused"), errors.ConnectionError("Error 111 connecting")),
            FailureKind.UNAVAILABLE,
            "refused",
        ),
        (errors.ConnectionError("Connection closed by server."), FailureKind.UNAVAILABLE, "closed"),
        (
            errors.AuthenticationError("invalid username-password pair or user is disabled."),
            FailureKind.AUTH,
            "wrong credentials",
        ),
        (errors.AuthenticationError("Authentication required."), FailureKind.AUTH, "no credentials"),
        (
            wrapped(
                ssl.SSLCertVerificationError(1, "certificate verify failed"),
                errors.ConnectionError("Error 1"),
            ),
            FailureKind.TLS,
            "certificate",
        ),
        (wrapped(ssl.SSLEOFError(8, "EOF"), errors.ConnectionError("Error 8")), FailureKind.TLS, "handshake"),
        (
            errors.NoPermissionError("User ro has no permissions to run the 'set' command"),
            FailureKind.DENIED,
            "set",
        ),
        (
            errors.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
            FailureKind.SERVER,
            "OOM",
        ),
        (
            errors.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
            FailureKind.SERVER,
            "WRONGTYPE",
        ),
        (errors.ResponseError("ERR something refused"), FailureKind.SERVER, "ERR"),  # a reply, not an outage
        (TimeoutError("timed out"), FailureKind.UNAVAILABLE, "timeout"),
        (ValueError("a bug"), FailureKind.UNEXPECTED, "ValueError"),
    ],
)
def test_reason_of(error, kind, detail):
    reason = connection.reason_of(error)
    assert reason == Failure(kind, detail=detail)
    assert connection.is_outage(reason) == (
        kind in (FailureKind.UNAVAILABLE, FailureKind.AUTH, FailureKind.TLS)
    )


def test_error_replies_read_by_the_tier_keep_their_class_and_code():
    reply = connection._reply_error(b"NOPERM User ro has no permissions to run the 'get' command")
    assert isinstance(reply, errors.NoPermissionError)
    assert connection.reason_of(reply) == Failure(FailureKind.DENIED, detail="get")
    assert (
        connection.reason_of(connection._reply_error(b"NOAUTH Authentication required.")).kind
        is FailureKind.AUTH
    )


def test_names_and_counters_agree():
    for reason, text, counter in [
        (Failure(FailureKind.UNAVAILABLE, detail="timeout"), "unavailable: timeout", "unavailable_timeout"),
        (Failure(FailureKind.UNAVAILABLE), "unavailable", "unavailable"),
        (
            Failure(FailureKind.AUTH, detail="wrong credentials"),
            "auth: wrong credentials",
            "auth_wrong_credentials",
        ),
        (Failure(FailureKind.TLS, detail="certificate"), "tls: certificate", "tls_certificate"),
        (Failure(FailureKind.DENIED, detail="set"), "denied: set", "denied_set"),
        (Failure(FailureKind.SERVER, detail="OOM"), "server: OOM", "server_OOM"),
        (Failure.corrupt("payload length"), "corrupt: payload length", "payload_length"),
    ]:
        assert (str(reason), reason.counter) == (text, counter)
        assert not reason.block_gone or reason.kind is FailureKind.CORRUPT
