import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from kvtier_testing import key
from kvtier_testing.running import FUTURE_STATS, free_port, run_engine, stack_config
from kvtier_testing.store import KINDS, flip, holds, load, locate, open_tier, region, store
from kvtier_testing.users import throwaway_user

from kvtier import build_manager
from kvtier.config import CascadeConfig
from kvtier.errors import ConfigError, KvtierError
from kvtier.manager.stack import TierStackManager
from kvtier.metrics import LatencyHistogram, StatsCollector, serve_metrics
from kvtier.metrics.names import LIFE, METRICS, samples
from kvtier.metrics.exporter import MAX_CONNECTIONS
from kvtier.metrics.view import parse_text, read_series
from kvtier.tiers.disk.format import HEADER_BYTES
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend, MemoryTier

prometheus_client = pytest.importorskip("prometheus_client")


def registry_of(stats, job_seconds=None):
    registry = prometheus_client.CollectorRegistry()
    registry.register(StatsCollector(lambda: stats, job_seconds))
    return registry


class TestNames:
    def test_each_key_gets_its_conventional_series(self):
        get = registry_of(FUTURE_STATS).get_sample_value
        assert get("kvtier_lookups_blocks_total") == 100
        assert get("kvtier_lookup_hits_blocks_total", {"tier": "cpu"}) == 40
        assert get("kvtier_lookup_hits_blocks_total", {"tier": "nvme"}) == 10
        assert get("kvtier_lookup_misses_blocks_total", {"tier": "", "cause": "new"}) == 30
        assert get("kvtier_lookup_misses_blocks_total", {"tier": "nvme", "cause": "evicted"}) == 12
        assert get("kvtier_lookup_misses_blocks_total", {"tier": "shared", "cause": "unavailable"}) == 3
        assert get("kvtier_lookup_foreign_blocks_total", {"part": "namespace"}) == 5
        assert get("kvtier_miss_sketch_bytes") == 1 << 20
        assert get("kvtier_miss_sketch_capacity_keys") == 65536
        assert get("kvtier_miss_sketch_error_ratio") == 0.01
        assert get("kvtier_moved_bytes_total", {"tier": "nvme", "direction": "load"}) == 40960
        assert get("kvtier_moved_bytes_total", {"tier": "nvme", "direction": "store"}) == 81920
        assert get("kvtier_moved_blocks_total", {"tier": "nvme", "direction": "load"}) == 10
        assert get("kvtier_cpu_blocks", {"state": "free"}) == 3
        assert get("kvtier_evictions_blocks_total", {"tier": "cpu"}) == 9
        assert get("kvtier_drive_write_budget_bytes_per_second", {"tier": "nvme"}) == 5e6
        assert get("kvtier_drive_write_rate_bytes_per_second", {"tier": "nvme"}) == 4.5e6
        assert get("kvtier_admission_threshold", {"tier": "nvme"}) == 3
        assert get("kvtier_drive_projected_life_seconds", {"tier": "nvme"}) == 5.0 * 365.25 * 86400
        assert get("kvtier_drive_written_bytes_total", {"tier": "nvme"}) == 123456789
        assert get("kvtier_tier_failures_blocks_total", {"tier": "nvme", "reason": "ENOSPC"}) == 2
        assert get("kvtier_outages_total", {"tier": "shared"}) == 2
        assert get("kvtier_outage_seconds_total", {"tier": "shared"}) == 1.5
        assert get("kvtier_tier_down", {"tier": "shared"}) == 1

    def test_keys_nobody_maps_still_export_under_their_tier(self):
        get = registry_of(FUTURE_STATS).get_sample_value
        assert get("kvtier_stat", {"tier": "nvme", "stat": "weird_thing"}) == 7
        assert get("kvtier_stat", {"tier": "nvme", "stat": "failed_keys"}) == 2  # a total, not a reason
        assert get("kvtier_stat", {"tier": "shared", "stat": "server_used_memory"}) == 999
        assert get("kvtier_stat", {"tier": "cpu", "stat": "policy_protected_share"}) == 0.9

    def test_every_key_is_exported_exactly_once(self):
        exported = list(samples(FUTURE_STATS))
        series = [(s.metric.name, s.labels) for s in exported]
        assert len(series) == len(set(series))
        # every key but misses (which becomes the unattributed cause) yields at least one sample;
        # promotions yields two (a hit of its tier, and blocks loaded)
        assert len(exported) == len(FUTURE_STATS) - 1 + 1 + 1

    def test_misses_no_cause_claims_are_unattributed(self):
        get = registry_of(FUTURE_STATS).get_sample_value
        assert get("kvtier_lookup_misses_blocks_total", {"tier": "", "cause": "unattributed"}) == 50 - 47
        # a stack with miss_causes: off counts no cause: every miss unattributed
        today = registry_of({"misses": 6}).get_sample_value
        assert today("kvtier_lookup_misses_blocks_total", {"tier": "", "cause": "unattributed"}) == 6

    def test_one_figure_in_two_units_exports_one_series_and_keeps_the_other(self):
        stats = {"nvme.projected_life_days": 730.5, "nvme.projected_life_years": 2.0}
        exported = [s for s in samples(stats) if s.metric is LIFE]
        assert [s.value for s in exported] == [730.5 * 86400]
        get = registry_of(stats).get_sample_value
        assert get("kvtier_stat", {"tier": "nvme", "stat": "projected_life_years"}) == 2.0

    def test_every_exported_family_is_in_the_table(self):
        families = {m.name for m in registry_of(FUTURE_STATS).collect()}
        documented = {m.name.removesuffix("_total") for m in METRICS}
        assert families <= documented


class TestHistogram:
    def test_a_value_on_a_bound_counts_in_that_bucket(self):
        h = LatencyHistogram((0.001, 0.01))
        for seconds in (0.0005, 0.001, 0.002, 0.01, 5.0):
            h.observe(seconds)
        assert h.counts == [2, 2, 1]
        assert h.cumulative() == [(0.001, 2), (0.01, 4), (float("inf"), 5)]
        assert h.count == 5 and h.sum == pytest.approx(5.0135)

    def test_quantiles_interpolate_within_the_bucket_like_histogram_quantile(self):
        h = LatencyHistogram((1.0, 2.0, 4.0))
        for seconds in (0.5, 0.5, 1.5, 3.0):  # 2 in (0,1], 1 in (1,2], 1 in (2,4]
            h.observe(seconds)
        assert h.quantile(0.5) == 1.0  # rank 2 closes the first bucket
        assert h.quantile(0.75) == 2.0
        assert h.quantile(0.875) == 3.0  # rank 3.5: half way through (2,4]
        assert LatencyHistogram().quantile(0.5) is None
        with pytest.raises(ValueError, match="between 0 and 1"):
            h.quantile(1.5)

    def test_bounds_must_increase(self):
        with pytest.raises(ValueError, match="increasing"):
            LatencyHistogram((0.1, 0.01))


def test_the_stack_times_every_job_it_polls(tmp_path):
    engine = run_engine(tmp_path)
    try:
        stats = engine.manager.stats()
        seconds = engine.manager.job_seconds()
        assert stats["nvme.promote_jobs"] > 0 and stats["nvme.demote_jobs"] > 0
        assert seconds[("nvme", "load")].count == stats["nvme.promote_jobs"]
        assert seconds[("nvme", "store")].count == stats["nvme.demote_jobs"]
        assert stats["nvme.load_jobs_in_flight"] == stats["nvme.store_jobs_in_flight"] == 0
        registry = registry_of(stats, engine.manager.job_seconds)
        count = registry.get_sample_value(
            "kvtier_job_duration_seconds_count", {"tier": "nvme", "direction": "load"}
        )
        inf = registry.get_sample_value(
            "kvtier_job_duration_seconds_bucket", {"tier": "nvme", "direction": "load", "le": "+Inf"}
        )
        assert count == inf == stats["nvme.promote_jobs"]
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_tiers_failure_series_exist_at_0_before_the_first_failure(kind, tmp_path):
    """A dashboard shows 0 rather than "no data", and the first failure is an increase of a
    series already scraped (one that appears at 1 has no rate, so an alert would miss it)."""
    shm = region(4)
    tier = open_tier(kind, tmp_path / "store", shm.rows, 8)
    try:
        registry = prometheus_client.CollectorRegistry()
        registry.register(StatsCollector(lambda: {f"nvme.{k}": v for k, v in tier.stats().items()}))

        def failures(reason):
            return registry.get_sample_value(
                "kvtier_tier_failures_blocks_total", {"tier": "nvme", "reason": reason}
            )

        for reason in ("ENOSPC", "EIO", "EROFS", "EACCES", "full", "checksum"):
            assert failures(reason) == 0, reason
        assert store(tier, shm.rows, [key(1), key(2)]).success
        path, offset = locate(tier, key(1))
        flip(path, offset + HEADER_BYTES + 7)  # a payload byte: the block fails its checksum
        result = load(tier, shm.rows, [key(1), key(2)])
        assert result.ok == [key(2)] and holds(shm.rows, 1, key(2))
        assert failures("checksum") == 1 and failures("ENOSPC") == 0  # the series scraped at 0
    finally:
        tier.close()
        shm.close()


def test_jobs_in_flight_count_what_is_submitted_and_not_polled():
    backend = MemoryBackend(4, 64)
    tier = MemoryTier("nvme", backend.rows, 8)
    manager = TierStackManager(backend, LRUPolicy(4), [tier], CascadeConfig(write_policy="write_through"))
    from kvtier.base import ReqContext, make_offload_key

    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
    ctx = ReqContext("r")
    assert manager.prepare_store(keys, ctx) is not None
    manager.complete_store(keys, ctx)
    tier.paused = True  # the save stays in flight
    manager.on_schedule_end()  # write_through: the save is submitted now
    manager.on_schedule_end()
    stats = manager.stats()
    assert stats["nvme.store_jobs_in_flight"] == stats["nvme.demote_jobs"] == 1
    assert manager.job_seconds()[("nvme", "store")].count == 0
    tier.drain_jobs()
    manager.on_schedule_end()
    assert manager.stats()["nvme.store_jobs_in_flight"] == 0
    assert manager.job_seconds()[("nvme", "store")].count == 1
    manager.shutdown()


class TestEndpoint:
    def test_a_scrape_of_a_running_stack_matches_its_stats(self, tmp_path):
        port = free_port()
        engine = run_engine(tmp_path, {"port": port})
        try:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            stats = engine.manager.stats()
        finally:
            engine.close()
        scraped = {(name, tuple(sorted(labels.items()))): value for name, labels, value in parse_text(page)}
        compared = 0
        for sample in samples(stats):
            if sample.metric is LIFE:
                continue  # a rate over time since start: it moves between scrape and stats()
            labels = tuple(sorted(zip(sample.metric.labels, sample.labels)))
            assert scraped[(sample.metric.name, labels)] == pytest.approx(sample.value), sample
            compared += 1
        assert compared > 30
        assert (
            scraped[("kvtier_lookup_hits_blocks_total", (("tier", "nvme"),))] == stats["nvme.promotions"] > 0
        )
        with pytest.raises(OSError):  # shut down with the manager: the port is free again
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)

    def test_serve_metrics_takes_any_free_port_and_closes(self):
        backend = MemoryBackend(4, 64)
        manager = TierStackManager(
            backend, LRUPolicy(4), [MemoryTier("nvme", backend.rows, 8)], CascadeConfig()
        )
        endpoint = serve_metrics(manager, 0)
        try:
            assert endpoint.port > 0
            page = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
            assert 'kvtier_cpu_blocks{state="free"} 4.0' in page
            assert 'kvtier_tier_blocks{tier="nvme"} 0.0' in page
        finally:
            endpoint.close()
            manager.shutdown()

    def test_a_port_in_use_is_a_clear_error_and_nothing_is_left_open(self, tmp_path):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(KvtierError, match=f"cannot listen on 127.0.0.1:{port}.*metrics.port"):
                build_manager(stack_config(tmp_path, {"port": port}), 4096)
        # the stack was shut down: its CPU region is gone, a second build opens the same path
        build_manager(stack_config(tmp_path), 4096).shutdown()


# A second local user's flood: N connections to the endpoint, held open and idle
FLOOD = """
import socket, sys
held = [socket.create_connection((sys.argv[1], int(sys.argv[2]))) for _ in range(int(sys.argv[3]))]
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def other_user():
    """How to run a process as another local user: a throwaway one when root (with the
    system's python, which it may run), else this user (the bounds hold whoever connects)."""
    if os.geteuid() == 0 and shutil.which("useradd") and os.path.exists("/usr/bin/python3"):
        with throwaway_user("kvtflood", "-U") as entry:
            yield "/usr/bin/python3", {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    else:
        yield sys.executable, {}


def threads_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads and fds in /proc")
class TestEndpointBounds:
    """Issue #32, item 1: whoever connects, the endpoint costs the engine a bounded number of
    threads and descriptors, and no connection outlives its deadline."""

    def test_a_flood_of_idle_connections_costs_no_thread_and_few_fds(self, tmp_path, other_user):
        python, as_other = other_user
        port = free_port()
        engine = run_engine(tmp_path, {"port": port})
        flood = None
        try:
            threads, fds = threads_and_fds()
            flood = subprocess.Popen(
                [python, "-c", FLOOD, "127.0.0.1", str(port), "300"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd="/",
                **as_other,
            )
            assert flood.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # every connection accepted by now (and most closed again)
            flooded_threads, flooded_fds = threads_and_fds()
            assert flooded_threads <= threads + 1, (threads, flooded_threads)
            assert flooded_fds <= fds + MAX_CONNECTIONS + 2, (fds, flooded_fds)
            # the engine's own opens still work, and so do scrapes once the idle ones time out
            with open(tmp_path / "still-open.txt", "w") as opened:
                opened.write("x")
            deadline = time.monotonic() + 60  # a hang guard, not a speed test
            while True:
                try:
                    series = read_series(f"http://127.0.0.1:{port}/metrics")
                    break
                except KvtierError:
                    assert time.monotonic() < deadline, "no scrape got through"
                    time.sleep(0.5)
            assert any(name == "kvtier_lookups_blocks_total" for name, _, _ in series)
        finally:
            if flood is not None:
                flood.kill()
                flood.wait()
            engine.close()

    def test_a_request_dripped_byte_by_byte_is_cut_at_its_deadline(self, tmp_path):
        port = free_port()
        engine = run_engine(tmp_path, {"port": port})
        try:
            with socket.create_connection(("127.0.0.1", port)) as slow:
                slow.settimeout(30)
                cut = False
                for _ in range(30):  # 30 s at most: a hang guard
                    try:
                        slow.sendall(b"G")
                        time.sleep(1)
                    except OSError:
                        cut = True
                        break
                    slow.setblocking(False)
                    try:
                        cut = slow.recv(1) == b""
                    except BlockingIOError:
                        pass
                    except OSError:
                        cut = True
                    slow.setblocking(True)
                    if cut:
                        break
                assert cut, "the endpoint kept a dripping connection open for 30 s"
        finally:
            engine.close()

    def test_a_unix_socket_only_its_user_may_scrape(self, tmp_path, other_user):
        # a folder every user may reach (under /tmp, mode 755): the socket's mode must stop them
        folder = Path(tempfile.mkdtemp(prefix="kvtier-sock-", dir="/tmp"))
        folder.chmod(0o755)
        path = folder / "metrics.sock"
        engine = run_engine(tmp_path, {"unix_socket": str(path)})
        try:
            info = path.lstat()
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
            assert info.st_uid == os.geteuid()
            series = read_series(str(path))
            stats = engine.manager.stats()
            lookups = [value for name, _, value in series if name == "kvtier_lookups_blocks_total"]
            assert lookups == [stats["lookups"]] and lookups[0] > 0
            python, as_other = other_user
            if as_other:
                tried = subprocess.run(
                    [python, "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({str(path)!r})"],
                    capture_output=True,
                    text=True,
                    cwd="/",
                    **as_other,
                )
                assert tried.returncode != 0 and "PermissionError" in tried.stderr, tried.stderr
        finally:
            engine.close()
            assert not path.exists()  # removed with the endpoint
            folder.rmdir()

    def test_what_lies_at_the_socket_path_is_refused_unless_a_stale_socket(self, tmp_path):
        path = tmp_path / "metrics.sock"
        path.write_bytes(b"precious")
        with pytest.raises(ConfigError, match="metrics.unix_socket"):
            build_manager(stack_config(tmp_path, {"unix_socket": str(path)}), 4096)
        assert path.read_bytes() == b"precious"
        path.unlink()
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(path))
        stale.close()  # a dead engine's socket: taken over
        build_manager(stack_config(tmp_path, {"unix_socket": str(path)}), 4096).shutdown()
        tmp_path.chmod(0o777)
        try:
            with pytest.raises(ConfigError, match="metrics.unix_socket.*mode 777"):
                build_manager(stack_config(tmp_path, {"unix_socket": str(path)}), 4096)
        finally:
            tmp_path.chmod(0o700)


class TestStatsFile:
    def test_written_atomically_private_and_final_at_shutdown(self, tmp_path):
        path = tmp_path / "stats.json"
        engine = run_engine(tmp_path, {"stats_file": str(path), "stats_interval_s": 0.05})
        try:
            first = json.loads(path.read_text())  # written at start, before any step
            assert first["version"] == 1 and first["pid"] == os.getpid()
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        finally:
            engine.close()
        final = json.loads(path.read_text())
        assert final["stats"] == engine.manager.stats()  # the stack's figures once all was saved
        assert final["stats"]["nvme.promotions"] > 0
        load = final["job_seconds"]["nvme.load"]
        assert sum(load["counts"]) == final["stats"]["nvme.promote_jobs"]
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    @pytest.mark.parametrize("kind", ["fifo", "socket", "symlink", "other file", "foreign stats"])
    def test_what_lies_at_the_path_is_never_replaced(self, tmp_path, kind):
        """Issue #32, item 3: a device, FIFO, socket, link or another file at the path is
        refused before anything is written (the rename would replace it)."""
        path = tmp_path / "stats.json"
        target = tmp_path / "precious.txt"
        target.write_text("precious")
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            bound = socket.socket(socket.AF_UNIX)
            bound.bind(str(path))
            bound.close()
        elif kind == "symlink":
            path.symlink_to(target)
        elif kind == "other file":
            path.write_text("precious")
        else:  # a stats file of another version: not one kvtier wrote
            path.write_text(json.dumps({"version": 99, "stats": {}}))
        before = path.lstat()
        with pytest.raises(ConfigError, match=r"metrics\.stats_file.*writing the stats would replace it"):
            build_manager(stack_config(tmp_path, {"stats_file": str(path)}), 4096)
        after = path.lstat()
        assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)
        assert target.read_text() == "precious"
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    def test_a_previous_stats_file_is_replaced(self, tmp_path):
        path = tmp_path / "stats.json"
        engine = run_engine(tmp_path, {"stats_file": str(path), "stats_interval_s": 60})
        engine.close()
        first = json.loads(path.read_text())["time"]
        build_manager(stack_config(tmp_path, {"stats_file": str(path)}), 4096).shutdown()
        assert json.loads(path.read_text())["time"] > first

    def test_a_folder_others_may_write_is_refused(self, tmp_path):
        folder = tmp_path / "open"
        folder.mkdir()
        folder.chmod(0o1777)  # sticky or not: another user could take the name first
        with pytest.raises(ConfigError, match=r"metrics\.stats_file.*mode 1777.*folder of your own"):
            build_manager(stack_config(tmp_path, {"stats_file": str(folder / "stats.json")}), 4096)
        assert list(folder.iterdir()) == []

    def test_config_check_refuses_what_the_start_would(self, tmp_path, capsys):
        """Checked without touching anything: /dev/null itself is named, and stays a device."""
        from kvtier.cli.main import main

        config = tmp_path / "c.yaml"
        config.write_text(json.dumps(stack_config(tmp_path, {"stats_file": "/dev/null"})))
        assert main(["config", "check", str(config)]) == 1
        err = capsys.readouterr().err
        assert "invalid" in err and "metrics.stats_file" in err and "not a regular file" in err
        assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)

    def test_an_unwritable_path_fails_the_start(self, tmp_path):
        with pytest.raises(KvtierError, match=r"metrics\.stats_file.*a path in an existing folder.*create"):
            build_manager(
                stack_config(tmp_path, {"stats_file": str(tmp_path / "no" / "such" / "x.json")}), 4096
            )


class TestConfig:
    @pytest.mark.parametrize(
        ("section", "field"),
        [
            ({"port": "9400x"}, "metrics.port"),
            ({"port": 70000}, "metrics.port"),
            ({"stats_interval_s": 0}, "metrics.stats_interval_s"),
            ({"stats_file": ""}, "metrics.stats_file"),
            ({"prot": 9400}, "prot"),
        ],
    )
    def test_bad_values_name_the_field(self, tmp_path, section, field):
        from kvtier import load_config

        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(stack_config(tmp_path, section))

    def test_defaults_report_nothing(self, tmp_path):
        from kvtier import load_config

        metrics = load_config(stack_config(tmp_path)).metrics
        assert metrics.port is None and metrics.stats_file is None and metrics.addr == "127.0.0.1"


def test_the_docs_metrics_table_is_current():
    import importlib.util
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    spec = importlib.util.spec_from_file_location("gen_metrics", docs / "gen_metrics.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (docs / "reference" / "metrics.md").read_text() == gen.render(), (
        "docs/reference/metrics.md is stale: run python docs/gen_metrics.py"
    )


def test_what_the_policy_learnt_is_a_cpu_tier_figure():
    """chain's learnt share (and ARC's target) reach stats() and the exporter, labelled as
    the CPU tier's, and follow the policy as it changes its mind."""
    from kvtier.policies.arc import ARCPolicy
    from kvtier.policies.chain import ChainPolicy

    backend = MemoryBackend(4, 64)
    policy = ChainPolicy(4)
    manager = TierStackManager(backend, policy, [MemoryTier("nvme", backend.rows, 8)], CascadeConfig())
    registry = prometheus_client.CollectorRegistry()
    registry.register(StatsCollector(manager.stats))
    share = {"tier": "cpu", "stat": "policy_protected_share"}
    assert manager.stats()["policy_protected_share"] == policy.protected_share == 0.0
    assert registry.get_sample_value("kvtier_stat", share) == 0.0
    policy._set_share(0.9)  # what the tuner does when the 0.9 copy leads
    assert registry.get_sample_value("kvtier_stat", share) == 0.9
    assert manager.stats()["policy_share_changes"] == 0
    arc = TierStackManager(MemoryBackend(4, 64), ARCPolicy(4), [], CascadeConfig())
    assert arc.stats()["policy_target_t1_blocks"] == 0.0
    plain = TierStackManager(MemoryBackend(4, 64), LRUPolicy(4), [], CascadeConfig())
    assert "policy_protected_share" not in plain.stats()  # LRU learns nothing


def test_config_check_says_where_the_stack_reports(tmp_path):
    from kvtier import load_config
    from kvtier.config.describe import describe

    quiet = describe(load_config(stack_config(tmp_path)))
    assert quiet.splitlines()[-1] == "metrics: off"
    loud = describe(load_config(stack_config(tmp_path, {"port": 9400, "stats_file": "/run/s.json"})))
    assert loud.splitlines()[-1] == (
        "metrics: endpoint http://127.0.0.1:9400/metrics, stats_file /run/s.json every 5 s"
    )
