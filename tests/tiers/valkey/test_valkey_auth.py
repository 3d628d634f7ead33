"""Credentials and TLS for the shared tier (issue #22, item 4): ACL users on a real server, a
password from a private file or the environment and never printed, typed reasons for refused
credentials, denied commands and failed TLS handshakes, and TLS (one-way and mutual) through a
TLS-terminating proxy in front of the plain server."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from kvtier_testing.valkey_tier import BLOCK_BYTES, finish, settle
from kvtier_testing import key, payload
from tls_proxy import TLSProxy, make_pki

from kvtier.cli.main import main
from kvtier.config import describe, load_config
from kvtier.errors import ConfigError
from kvtier.tiers.base import Failure, FailureKind, TierJob
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.tiers.valkey.config import PASSWORD_ENV, parse, redact_url
from kvtier.tiers.valkey.tier import ValkeyTier

SECRET = "s3cret-Pa55-word"
WRONG = "not-the-password"


@pytest.fixture(autouse=True)
def _no_password_in_env(monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


@pytest.fixture
def acl_server(valkey_server):
    """The fixture's server with ACL users: ``kv`` (everything on ns:* and the bench's keys),
    ``ro`` (reads only)."""
    raw = valkey_server.client()
    raw.execute_command("ACL", "SETUSER", "kv", "on", f">{SECRET}", "~ns:*", "~kvtier-bench:*", "+@all")
    raw.execute_command(
        "ACL", "SETUSER", "ro", "on", f">{SECRET}", "~ns:*", "+get", "+ping", "+info", "+scan"
    )
    return valkey_server


def secret_file(tmp_path, text=SECRET, mode=0o600):
    path = tmp_path / "valkey.pass"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


def section(server_or_url, **options):
    url = server_or_url if isinstance(server_or_url, str) else server_or_url.url
    return {"kind": "valkey", "name": "shared", "url": url, "namespace": "ns", "timeout_s": 2.0, **options}


def open_with(options, rows=None):
    rows = rows if rows is not None else np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    config = parse(options, "tiers[1]")
    return ValkeyTier.open(config, rows, LayoutFingerprint.standalone(BLOCK_BYTES)), rows


def round_trip(tier, rows, keys) -> bool:
    """Store ``keys`` through ``tier``, read them back through a second view of it: exact?"""
    for index, k in enumerate(keys):
        rows[index] = payload(k, BLOCK_BYTES)
    tier.submit_store(TierJob(1, tuple(keys), tuple(range(len(keys)))))
    (stored,) = finish(tier)
    if not stored.success:
        return False
    rows[:] = 0
    tier._forget_server()
    tier._missing.clear()
    if settle(tier, keys) != [True] * len(keys):
        return False
    tier.submit_load(TierJob(2, tuple(keys), tuple(range(len(keys)))))
    (loaded,) = finish(tier)
    return loaded.success and all(
        np.array_equal(rows[i], payload(k, BLOCK_BYTES)) for i, k in enumerate(keys)
    )


# -- the password file ---------------------------------------------------------------------------


def test_a_password_file_readable_by_others_is_refused_with_the_fix(tmp_path, valkey_server):
    path = secret_file(tmp_path, mode=0o644)
    with pytest.raises(ConfigError) as caught:
        parse(section(valkey_server, username="kv", password_file=path), "tiers[1]")
    assert "password_file" in str(caught.value) and f"chmod 600 {path}" in str(caught.value)
    assert "0644" in str(caught.value) and SECRET not in str(caught.value)


def test_a_password_file_owned_by_someone_else_is_refused(tmp_path, valkey_server):
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another user needs root")
    path = secret_file(tmp_path)
    os.chown(path, 65534, -1)  # nobody
    with pytest.raises(ConfigError) as caught:
        parse(section(valkey_server, username="kv", password_file=path), "tiers[1]")
    assert "owned by this user" in str(caught.value) and "chown" in str(caught.value)


def test_a_missing_password_file_is_refused(tmp_path, valkey_server):
    with pytest.raises(ConfigError, match="password_file"):
        parse(section(valkey_server, password_file=str(tmp_path / "absent")), "tiers[1]")


# the password file is opened as a secret_file is (issue #32, item 5): parsing needs no server
URL = "valkey://127.0.0.1:6379/0"


def test_a_password_file_that_is_a_symlink_is_refused_and_its_target_never_sent(tmp_path):
    target = secret_file(tmp_path)  # a private file of this user's: another user aims a link at it
    link = tmp_path / "planted.pass"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.password_file.*not a symlink") as caught:
        parse(section(URL, password_file=str(link)), "tiers[1]")
    assert SECRET not in str(caught.value)


def test_a_password_file_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    import threading

    fifo = tmp_path / "valkey.pass"
    os.mkfifo(fifo, 0o600)
    outcome = []

    def parse_it():
        try:
            parse(section(URL, password_file=str(fifo)), "tiers[1]")
            outcome.append("parsed")
        except ConfigError as exc:
            outcome.append(str(exc))

    parser = threading.Thread(target=parse_it, daemon=True)
    parser.start()
    parser.join(timeout=20)  # a hang guard: an open for reading waits for a writer
    if parser.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the stuck open go
        parser.join(timeout=20)
        pytest.fail("reading the password file waited on a FIFO")
    assert len(outcome) == 1 and "password_file" in outcome[0] and "a regular file" in outcome[0], outcome


def test_a_password_file_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "valkey.pass"
    path.write_bytes(b"\xff\xfepass\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.password_file.*UTF-8"):
        parse(section(URL, password_file=str(path)), "tiers[1]")


# -- ACL users -----------------------------------------------------------------------------------


def test_an_acl_user_with_a_password_file_round_trips(acl_server, tmp_path):
    config = parse(section(acl_server, username="kv", password_file=secret_file(tmp_path)), "tiers[1]")
    assert SECRET not in repr(config) and SECRET not in config.options_text()
    tier, rows = open_with(section(acl_server, username="kv", password_file=secret_file(tmp_path)))
    try:
        assert not tier.down and round_trip(tier, rows, [key(i) for i in range(3)])
    finally:
        tier.close()


def test_the_password_from_the_environment(acl_server, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    tier, rows = open_with(section(acl_server, username="kv"))
    try:
        assert not tier.down and round_trip(tier, rows, [key(i) for i in range(2)])
        assert parse(section(acl_server, username="kv"), "t").password_source() == f"${PASSWORD_ENV}"
    finally:
        tier.close()


def test_a_wrong_password_is_an_auth_failure_with_its_own_fix(acl_server, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tier, _ = open_with(section(acl_server, username="kv", password_file=secret_file(tmp_path, WRONG)))
    try:
        assert tier.down  # an outage, with the reason
        tier.submit_store(TierJob(1, (key(1),), (0,)))
        (result,) = finish(tier)
        assert result.failed == {key(1): Failure(FailureKind.AUTH, detail="wrong credentials")}
        assert tier.stats()["failed_auth_wrong_credentials"] == 1
        (warning,) = [r.getMessage() for r in caplog.records if "valkey tier" in r.getMessage()]
        assert "refused the credentials" in warning and "password_file" in warning
        assert "start the server" not in warning and WRONG not in warning
    finally:
        tier.close()


def test_a_wrong_password_in_a_check_says_credentials_and_prints_no_password(acl_server, capsys):
    url = f"valkey://kv:{WRONG}@127.0.0.1:{acl_server.port}/0"
    assert main(["check", url, "--namespace", "ns"]) == 8  # could not check
    err = capsys.readouterr().err
    assert "refused the credentials" in err and "start the server" not in err and WRONG not in err
    assert "visible to every local user" in err  # the command line is the wrong place for it


def test_a_denied_command_is_counted_and_warned_once(acl_server, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    tier, _ = open_with(section(acl_server, username="ro"))
    try:
        for job in (1, 2):
            tier.submit_store(TierJob(job, (key(job),), (0,)))
            (result,) = finish(tier)
            assert result.failed == {key(job): Failure(FailureKind.DENIED, detail="set")}
        assert tier.stats()["failed_denied_set"] == 2 and not tier.down
        warnings = [r.getMessage() for r in caplog.records if "denies" in r.getMessage()]
        assert len(warnings) == 1 and "SET" in warnings[0]
        assert settle(tier, [key(9)]) == [False]  # reads are allowed: a plain miss
    finally:
        tier.close()


# -- no output prints the password ---------------------------------------------------------------


def test_no_output_prints_the_password(acl_server, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    url = f"valkey://kv:{SECRET}@127.0.0.1:{acl_server.port}/0"
    assert redact_url(url) == f"valkey://kv:***@127.0.0.1:{acl_server.port}/0"
    config_file = tmp_path / "stack.yaml"
    config_file.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 16MiB, pin_memory: 'off'}\n"
        f"  - {{name: shared, kind: valkey, url: '{url}', namespace: ns}}\n"
    )
    assert main(["config", "check", str(config_file)]) == 0
    assert SECRET not in describe(load_config(str(config_file)))
    assert main(["check", url, "--namespace", "ns"]) == 0
    assert main(["check", url, "--namespace", "ns", "--json"]) == 0
    assert main(["check", "--config", str(config_file), "--json"]) == 0
    assert main(["bench", "remote", "--url", url, "--mib", "1", "--rounds", "1", "--json"]) == 0
    tier, _ = open_with(section(url))
    tier.close()
    acl_server.kill()  # the outage warning names the server too
    tier, _ = open_with(section(url))
    assert tier.down and tier.stats()
    tier.close()
    out, err = capsys.readouterr()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "kv:***@" in out and "kv:***@" in logged
    assert SECRET not in out and SECRET not in err and SECRET not in logged
    assert json.loads(out.strip().splitlines()[-1])["server"] == "local valkey-server"  # bench on loopback


def test_check_takes_the_tier_from_a_config_file(acl_server, tmp_path, capsys):
    path = secret_file(tmp_path)
    config_file = tmp_path / "stack.yaml"
    config_file.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 16MiB, pin_memory: 'off'}\n"
        f"  - {{name: shared, kind: valkey, url: '{acl_server.url}', namespace: ns, username: kv,"
        f" password_file: '{path}'}}\n"
    )
    tier, rows = open_with(section(acl_server, username="kv", password_file=path))
    try:
        assert round_trip(tier, rows, [key(1), key(2)])
    finally:
        tier.close()
    assert main(["check", "--config", str(config_file), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["blocks_checked"] == 2 and list(record["namespaces"]) == ["ns"]
    assert main(["check", "--config", str(config_file), "--tier", "nope"]) == 2  # bad input
    assert "--tier" in capsys.readouterr().err


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("other-pki"), name="other")


def tls_section(proxy, ca, **tls):
    return section(f"valkey://127.0.0.1:{proxy.port}/0", tls={"ca_file": str(ca), **tls})


def test_tls_with_the_right_ca_round_trips(valkey_server, pki):
    with TLSProxy(valkey_server.port, pki) as proxy:
        tier, rows = open_with(tls_section(proxy, pki.ca))
        try:
            assert not tier.down and round_trip(tier, rows, [key(i) for i in range(3)])
        finally:
            tier.close()


def test_tls_with_a_wrong_ca_is_a_tls_failure(valkey_server, pki, stranger_pki, caplog):
    caplog.set_level(logging.WARNING)
    with TLSProxy(valkey_server.port, pki) as proxy:
        tier, _ = open_with(tls_section(proxy, stranger_pki.ca))
        try:
            assert tier.down
            tier.submit_store(TierJob(1, (key(1),), (0,)))
            (result,) = finish(tier)
            assert result.failed == {key(1): Failure(FailureKind.TLS, detail="certificate")}
            (warning,) = [r.getMessage() for r in caplog.records if "valkey tier" in r.getMessage()]
            assert "TLS handshake" in warning and "ca_file" in warning and "start the server" not in warning
        finally:
            tier.close()


def test_mutual_tls_needs_the_client_certificate(valkey_server, pki):
    with TLSProxy(valkey_server.port, pki, client_ca=pki.ca) as proxy:
        without, _ = open_with(tls_section(proxy, pki.ca))
        try:
            assert without.down
            without.submit_store(TierJob(1, (key(1),), (0,)))
            (result,) = finish(without)
            assert result.failed[key(1)].kind is FailureKind.TLS
        finally:
            without.close()
        tier, rows = open_with(
            tls_section(proxy, pki.ca, cert_file=str(pki.client_cert), key_file=str(pki.client_key))
        )
        try:
            assert not tier.down and round_trip(tier, rows, [key(i) for i in range(2)])
        finally:
            tier.close()


def test_a_client_key_readable_by_others_is_refused(valkey_server, pki, tmp_path):
    key_file = tmp_path / "client.key"
    key_file.write_bytes(pki.client_key.read_bytes())
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        parse(section(valkey_server, tls={"cert_file": str(pki.client_cert), "key_file": str(key_file)}), "t")


# -- a cluster: credentials and TLS ---------------------------------------------------------------


def cluster_section(nodes, **options):
    return {
        "kind": "valkey",
        "name": "shared",
        "cluster_nodes": list(nodes),
        "namespace": "ns",
        "timeout_s": 2.0,
        **options,
    }


def test_a_cluster_with_an_acl_user(valkey_cluster, monkeypatch):
    for server in valkey_cluster.servers:
        server.client().execute_command("ACL", "SETUSER", "kv", "on", f">{SECRET}", "~ns:*", "+@all")
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    rows = np.zeros((6, BLOCK_BYTES), dtype=np.uint8)
    tier, rows = open_with(cluster_section(valkey_cluster.nodes, username="kv"), rows)
    try:
        keys = [key(i) for i in range(6)]
        assert not tier.down and round_trip(tier, rows, keys)
        assert sum(server.client().dbsize() for server in valkey_cluster.servers) == 6
    finally:
        tier.close()
    monkeypatch.setenv(PASSWORD_ENV, WRONG)
    tier, _ = open_with(cluster_section(valkey_cluster.nodes, username="kv"))
    try:
        assert tier.down
        tier.submit_store(TierJob(1, (key(1),), (0,)))
        (result,) = finish(tier)
        assert result.failed[key(1)].kind is FailureKind.AUTH
    finally:
        tier.close()


def test_a_cluster_over_tls(valkey_cluster, pki):
    """Each node behind a TLS proxy, and announcing the proxy's port, so that the slot map the
    client reads (CLUSTER SLOTS) sends it through TLS to every node."""
    import time

    proxies = [TLSProxy(server.port, pki) for server in valkey_cluster.servers]
    try:
        for server, proxy in zip(valkey_cluster.servers, proxies):
            client = server.client()
            client.config_set("cluster-announce-port", proxy.port)
            client.config_set("cluster-announce-bus-port", server.port + 10000)
        wanted = {proxy.port for proxy in proxies}
        deadline = time.monotonic() + 10
        while True:
            maps = [server.client().execute_command("CLUSTER", "SLOTS") for server in valkey_cluster.servers]
            if {node[1] for slots in maps for entry in slots for node in entry[2:]} == wanted:
                break
            assert time.monotonic() < deadline, "the nodes never announced their TLS ports"
            time.sleep(0.05)
        rows = np.zeros((6, BLOCK_BYTES), dtype=np.uint8)
        tier, rows = open_with(cluster_section([p.node for p in proxies], tls={"ca_file": str(pki.ca)}), rows)
        try:
            assert not tier.down and round_trip(tier, rows, [key(i) for i in range(6)])
            assert all(server.client().dbsize() > 0 for server in valkey_cluster.servers)
        finally:
            tier.close()
    finally:
        for proxy in proxies:
            proxy.close()


@pytest.mark.slow  # two engine processes, each importing torch
def test_a_fleet_replay_prints_no_password(acl_server, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acl_server.client().execute_command("ACL", "SETUSER", "kv", "~kvtier-fleet-*")
    url = f"valkey://kv:{SECRET}@127.0.0.1:{acl_server.port}/0"
    assert main(["replay", "--engines", "2", "--limit", "20", "--no-progress", "--valkey", url]) == 0
    table = capsys.readouterr()
    assert (
        main(["replay", "--engines", "2", "--limit", "20", "--no-progress", "--json", "--valkey", url]) == 0
    )
    record = capsys.readouterr()
    for captured in (table, record):
        assert SECRET not in captured.out and SECRET not in captured.err
    assert json.loads(record.out.strip().splitlines()[-1])["shared_tier"] == redact_url(url)
    assert "kv:***@" in table.out


def test_no_credentials_for_a_server_that_wants_them_is_an_auth_failure(valkey_server, tmp_path):
    valkey_server.client().config_set("requirepass", SECRET)  # the default user needs a password now
    tier, _ = open_with(section(valkey_server))
    try:
        assert tier.down
        tier.submit_load(TierJob(1, (key(1),), (0,)))
        (result,) = finish(tier)
        assert result.failed == {key(1): Failure(FailureKind.AUTH, detail="no credentials")}
    finally:
        tier.close()
    tier, rows = open_with(section(valkey_server, password_file=secret_file(tmp_path)))
    try:
        assert not tier.down and round_trip(tier, rows, [key(1)])
    finally:
        tier.close()
