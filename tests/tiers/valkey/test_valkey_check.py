"""``kvtier check valkey://...``: a shared tier's values verified on a real server, per namespace,
without the engines' layout; ``--fix`` deletes exactly the bad ones."""

from __future__ import annotations

import json

import numpy as np
from kvtier_testing.valkey_tier import BLOCK_BYTES, finish, open_tier, settle
from kvtier_testing import key, payload

from kvtier.cli.main import main
from kvtier.tiers.base import TierJob
from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint
from kvtier.errors import ValkeyCheckError
from kvtier.tiers.valkey.check import check_valkey

OTHER = LayoutFingerprint("other-model", "bfloat16", 16, (BLOCK_BYTES,), 0, 1, BLOCK_BYTES)


def stored_tier(url, keys, fingerprint=None, **options):
    """A tier that has stored each key's own bytes (closed again: the server keeps them)."""
    rows = np.zeros((len(keys), BLOCK_BYTES), dtype=np.uint8)
    for index, k in enumerate(keys):
        rows[index] = payload(k, BLOCK_BYTES)
    tier = open_tier(url, rows, fingerprint, **options)
    tier.submit_store(TierJob(1, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    assert result.success
    return tier


def name(namespace, k) -> bytes:
    return (namespace + ":" + k.hex()).encode()


def loads_exact(url, keys, namespace=None, fingerprint=None) -> bool:
    """Whether a fresh tier finds and loads every key byte for byte."""
    rows = np.zeros((len(keys), BLOCK_BYTES), dtype=np.uint8)
    options = {} if namespace is None else {"namespace": namespace}
    tier = open_tier(url, rows, fingerprint, **options)
    try:
        if settle(tier, keys) != [True] * len(keys):
            return False
        tier.submit_load(TierJob(2, tuple(keys), tuple(range(len(keys)))))
        (result,) = finish(tier)
        return result.success and all(
            np.array_equal(rows[i], payload(k, BLOCK_BYTES)) for i, k in enumerate(keys)
        )
    finally:
        tier.close()


def test_a_healthy_namespace_checks_healthy(valkey_server):
    keys = [key(i) for i in range(6)]
    tier = stored_tier(valkey_server.url, keys)
    tier.close()
    digest = LayoutFingerprint.standalone(BLOCK_BYTES).digest().hex()
    for namespace in (None, tier.namespace):  # every kvtier:* namespace, or this one
        report = check_valkey(valkey_server.url, namespace=namespace)
        assert report.healthy and report.blocks_checked == 6 and report.problems == []
        (found,) = report.namespaces
        assert found.namespace == tier.namespace and found.blocks_checked == 6
        assert found.value_bytes == 6 * (HEADER_BYTES + BLOCK_BYTES)
        assert found.layout_digest == digest and found.layout_digests == {digest: 6}


def test_bad_values_are_reported_and_fix_deletes_exactly_them(valkey_server):
    keys = [key(i) for i in range(8)]
    tier = stored_tier(valkey_server.url, keys)
    ns = tier.namespace
    raw = valkey_server.client()
    value = {k: raw.get(name(ns, k)) for k in keys}
    altered = bytearray(value[keys[0]])
    altered[HEADER_BYTES + 1000] ^= 0xFF
    raw.set(name(ns, keys[0]), bytes(altered))  # a flipped payload byte
    raw.set(name(ns, keys[1]), value[keys[1]][: HEADER_BYTES + 100])  # truncated
    moved = key(99)
    raw.rename(name(ns, keys[2]), name(ns, moved))  # another key's value under this name
    # a value of another layout, under its own key, copied into this namespace
    stranger = key(50)
    other = stored_tier(valkey_server.url, [stranger], OTHER)
    other.close()
    raw.set(name(ns, stranger), raw.get(name(other.namespace, stranger)))
    good = keys[3:]
    expected = {
        name(ns, keys[0]).decode(): "checksum",
        name(ns, keys[1]).decode(): "truncated",
        name(ns, moved).decode(): "other key",
        name(ns, stranger).decode(): "other layout",
    }

    report = check_valkey(valkey_server.url, namespace=ns)
    (found,) = report.namespaces
    assert not report.healthy and found.blocks_checked == len(good) + 4
    problems = dict(line.split(": ", 1) for line in found.problems)
    assert {n: r.split(" (")[0] for n, r in problems.items()} == expected
    # the namespace is the layout its name derives from; the stranger's layout is named
    mine, theirs = tier._digest.hex(), OTHER.digest().hex()  # noqa: SLF001
    assert found.layout_digest == mine and theirs in problems[name(ns, stranger).decode()]
    # the truncated value's header still decodes: 7 values of this layout, 1 of the other
    assert found.layout_digests == {mine: len(good) + 3, theirs: 1}
    assert report.fixed == [] and raw.dbsize() == len(good) + 4 + 1  # nothing deleted yet

    # The tier's own, layout-aware check runs the same verification: the same verdicts.
    tier_report = tier.check()
    assert dict(line.split(": ", 1) for line in tier_report.problems) == expected
    assert tier_report.blocks_checked == found.blocks_checked
    tier.close()

    fixed = check_valkey(valkey_server.url, namespace=ns, fix=True)
    assert sorted(line.split(": ")[0] for line in fixed.fixed) == sorted(expected)
    assert all(raw.exists(n.encode()) == 0 for n in expected)
    assert sorted(raw.keys(ns + ":*")) == sorted(name(ns, k) for k in good)
    assert raw.exists(name(other.namespace, stranger)) == 1  # another namespace: untouched
    again = check_valkey(valkey_server.url, namespace=ns)
    assert again.healthy and again.blocks_checked == len(good)
    assert loads_exact(valkey_server.url, good)


def test_a_named_namespace_of_one_layout_takes_it_and_fix_deletes_the_bad(valkey_server):
    keys = [key(i) for i in range(4)]
    stored_tier(valkey_server.url, keys, namespace="llama").close()
    raw = valkey_server.client()
    raw.set(b"llama:not-hex", b"x" * 10)  # not <namespace>:<hex key>
    raw.hset(name("llama", key(61)), "field", "value")  # not a string at all
    raw.set(name("llama:nested", key(62)), raw.get(name("llama", keys[0])))  # another namespace

    report = check_valkey(valkey_server.url, namespace="llama", fix=True)
    (found,) = report.namespaces
    assert found.layout_digest == LayoutFingerprint.standalone(BLOCK_BYTES).digest().hex()
    assert found.blocks_checked == 6  # the nested namespace's value is not llama's
    reasons = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in found.problems}
    assert reasons == {
        "llama:not-hex": "name is not <namespace>:<hex key>",
        name("llama", key(61)).decode(): "not a string value",
    }
    assert len(found.fixed) == 2
    assert sorted(raw.keys("llama:*")) == sorted(
        [*(name("llama", k) for k in keys), name("llama:nested", key(62))]
    )
    assert loads_exact(valkey_server.url, keys, namespace="llama")


def test_fix_never_deletes_by_majority(valkey_server, capsys):
    """Five well-formed values of another layout planted beside four real ones: without the
    namespace's layout nothing of either is deleted; told the layout, the planted go."""
    real = [key(i) for i in range(4)]
    stored_tier(valkey_server.url, real, namespace="llama").close()
    planted = [key(100 + i) for i in range(5)]
    stored_tier(valkey_server.url, planted, OTHER, namespace="elsewhere").close()
    raw = valkey_server.client()
    for k in planted:
        raw.set(name("llama", k), raw.get(name("elsewhere", k)))
    mine, theirs = LayoutFingerprint.standalone(BLOCK_BYTES).digest().hex(), OTHER.digest().hex()

    report = check_valkey(valkey_server.url, namespace="llama", fix=True)
    (found,) = report.namespaces
    assert not report.healthy and found.layout_digest is None
    assert found.layout_digests == {mine: 4, theirs: 5}
    (problem,) = found.problems
    assert problem.startswith("llama: mixed layouts") and "--layout" in problem
    assert found.fixed == [] and raw.dbsize() == 4 + 5 + 5  # nothing deleted
    assert main(["check", valkey_server.url, "--namespace", "llama", "--fix"]) == 4  # left
    out = capsys.readouterr().out
    assert "mixed layouts" in out and "after --fix: 1 problems left" in out and raw.dbsize() == 14
    assert loads_exact(valkey_server.url, real, namespace="llama")

    assert main(["check", valkey_server.url, "--namespace", "llama", "--layout", "zz"]) == 2
    assert "--layout" in capsys.readouterr().err
    assert (
        main(["check", valkey_server.url, "--namespace", "llama", "--layout", mine, "--fix", "--json"]) == 1
    )  # fsck's "problems fixed": the check after the repair finds none
    record = json.loads(capsys.readouterr().out)
    assert record["problems_left"] == []
    assert sorted(line.split(": ")[0] for line in record["fixed"]) == sorted(
        name("llama", k).decode() for k in planted
    )
    assert sorted(raw.keys("llama:*")) == sorted(name("llama", k) for k in real)
    assert check_valkey(valkey_server.url, namespace="llama").healthy
    assert loads_exact(valkey_server.url, real, namespace="llama")


def test_two_namespaces_are_reported_separately(valkey_server):
    a = stored_tier(valkey_server.url, [key(i) for i in range(3)])
    b = stored_tier(valkey_server.url, [key(i) for i in range(10, 12)], OTHER)
    a.close()
    b.close()
    valkey_server.client().set(name(b.namespace, key(10)), b"garbage")
    report = check_valkey(valkey_server.url)
    by_name = {found.namespace: found for found in report.namespaces}
    assert sorted(by_name) == sorted([a.namespace, b.namespace])
    assert by_name[a.namespace].healthy and by_name[a.namespace].blocks_checked == 3
    assert by_name[a.namespace].layout_digest == LayoutFingerprint.standalone(BLOCK_BYTES).digest().hex()
    assert by_name[b.namespace].blocks_checked == 2
    assert by_name[b.namespace].layout_digest == OTHER.digest().hex()
    assert by_name[b.namespace].problems == [name(b.namespace, key(10)).decode() + ": truncated"]
    assert report.problems == by_name[b.namespace].problems and report.blocks_checked == 5


def test_a_cluster_is_checked_on_every_node(valkey_cluster):
    keys = [key(i) for i in range(12)]
    tier = stored_tier(valkey_cluster.nodes, keys)
    tier.close()
    bad = name(tier.namespace, keys[5])
    for server in valkey_cluster.servers:  # the node that owns the key takes the raw SET
        client = server.client()
        if client.execute_command(
            "CLUSTER", "COUNTKEYSINSLOT", client.execute_command("CLUSTER", "KEYSLOT", bad)
        ):
            client.set(bad, b"garbage")
    report = check_valkey(cluster_nodes=valkey_cluster.nodes, fix=True)
    assert report.blocks_checked == 12 and report.problems == [bad.decode() + ": truncated"]
    assert report.fixed == [bad.decode() + ": deleted"]
    assert check_valkey(cluster_nodes=valkey_cluster.nodes).blocks_checked == 11


def test_an_unreachable_server_is_a_clear_error(server_binary, capsys):
    try:
        check_valkey("valkey://127.0.0.1:1/0")
    except ValkeyCheckError as error:
        assert "valkey://127.0.0.1:1/0" in str(error) and "start the server" in str(error)
    else:
        raise AssertionError("an unreachable server checked")
    for url in ("valkey://127.0.0.1:1/0", "valkeys://127.0.0.1:1"):
        assert main(["check", url]) == 8  # could not check
        err = capsys.readouterr().err
        assert url in err and "cannot reach the server" in err and "Fix:" in err
    assert main(["check", "valkey://127.0.0.1:1/0", "--json"]) == 8
    record = json.loads(capsys.readouterr().out)
    assert record["healthy"] is False and "cannot reach" in record["error"]
    assert record["path"] == "valkey://127.0.0.1:1/0"


def test_the_cli_prints_one_json_line_and_exits_by_health(valkey_server, capsys):
    keys = [key(i) for i in range(3)]
    tier = stored_tier(valkey_server.url, keys)
    tier.close()
    assert main(["check", valkey_server.url, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["healthy"] is True and record["blocks_checked"] == 3 and record["path"] == valkey_server.url
    assert record["namespaces"][tier.namespace]["bytes"] == 3 * (HEADER_BYTES + BLOCK_BYTES)

    bad = name(tier.namespace, keys[1])
    valkey_server.client().set(bad, b"garbage")
    assert main(["check", valkey_server.url, "--namespace", tier.namespace, "--fix", "--json"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert set(record) == {
        "path",
        "healthy",
        "blocks_checked",
        "problems",
        "fixed",
        "problems_left",
        "namespaces",
    }
    assert record["problems"] == [bad.decode() + ": truncated"] and record["fixed"] == [
        bad.decode() + ": deleted"
    ]
    namespace = record["namespaces"][tier.namespace]
    assert namespace["blocks_checked"] == 3 and namespace["problems"] == record["problems"]

    assert main(["check", valkey_server.url]) == 0  # fixed: healthy, as a table
    out = capsys.readouterr().out
    assert f"{tier.namespace}: 2 blocks" in out and "healthy" in out
