"""``kvtier stats`` against a real running stack: its endpoint and its stats file."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvtier_testing.running import FUTURE_STATS, free_port, run_engine

import kvtier
from kvtier.cli.main import main
from kvtier.manager.causes import CAUSES

ROOT = Path(__file__).resolve().parent.parent


def check_against(summary: dict, stats: dict) -> None:
    """The numbers ``kvtier stats --json`` printed are the stack's own."""
    assert summary["lookups"] == stats["lookups"]
    assert summary["hit_blocks"] == stats["cpu_hits"]
    assert summary["miss_blocks"] == stats["misses"] > 0
    # every miss has its cause (kvtier.manager.causes): none is left unattributed
    assert summary["misses"] == {**{c: stats[f"miss_{c}"] for c in CAUSES}, "unattributed": 0}
    cpu, nvme = summary["tiers"]["cpu"], summary["tiers"]["nvme"]
    assert cpu["blocks"] == stats["ready_blocks"] and cpu["hits"] == stats["cpu_hits"]
    assert cpu["evictions"] == stats["evictions"] > 0
    assert nvme["hits"] == nvme["load_blocks"] == stats["nvme.promotions"] > 0
    assert nvme["store_blocks"] == stats["nvme.demotions"] > 0
    assert nvme["load_bytes"] == stats["nvme.promoted_bytes"]
    assert nvme["store_bytes"] == stats["nvme.demoted_bytes"]
    assert nvme["blocks"] == stats["nvme.blocks"] and nvme["capacity_blocks"] == stats["nvme.capacity_blocks"]
    assert nvme["admitted_blocks"] == stats["nvme.admitted_blocks"]
    assert nvme["load_failed_blocks"] == stats["nvme.promote_failures"]
    assert 0 < nvme["load_p50_s"] <= nvme["load_p99_s"]


def test_from_the_endpoint_the_numbers_are_the_stacks(tmp_path, capsys):
    port = free_port()
    engine = run_engine(tmp_path, {"port": port})
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert main(["stats", url, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        check_against(summary, engine.manager.stats())
        assert main(["stats", url]) == 0
        text = capsys.readouterr().out
        # HOST:PORT, as metrics.port is written: the same endpoint, not a file of that name
        assert main(["stats", f"127.0.0.1:{port}", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["lookups"] == summary["lookups"]
    finally:
        engine.close()
    # the ratio says what it divides (a replay's counts the GPU's hits too)
    assert "hit ratio = hits / (hits + misses)" in text and "GPU's own hits are not counted" in text
    stats = engine.manager.stats()
    nvme_row = next(line for line in text.splitlines() if line.startswith("nvme "))
    cells = nvme_row.split()
    assert cells[1:6] == [
        str(stats["nvme.blocks"]),
        str(stats["nvme.capacity_blocks"]),
        str(stats["nvme.promotions"]),
        str(stats["nvme.promotions"]),
        str(stats["nvme.demotions"]),
    ]
    causes = [line.split() for line in text.split("misses by cause:")[1].splitlines()]
    assert ["new", str(stats["miss_new"])] in [cells[:2] for cells in causes]
    assert ["unattributed", "0"] in [cells[:2] for cells in causes]


def test_from_the_stats_file_the_numbers_are_the_stacks(tmp_path, capsys):
    path = tmp_path / "stats.json"
    engine = run_engine(tmp_path, {"stats_file": str(path), "stats_interval_s": 60})
    engine.close()  # the final snapshot: what stats() answers from now on
    assert main(["stats", str(path), "--json"]) == 0
    check_against(json.loads(capsys.readouterr().out), engine.manager.stats())


def test_host_port_is_an_endpoint_unless_such_a_file_exists(tmp_path, monkeypatch):
    from kvtier.metrics.view import endpoint_or_path

    assert endpoint_or_path("127.0.0.1:9400") == "http://127.0.0.1:9400/metrics"
    assert endpoint_or_path("[::1]:9400/other") == "http://[::1]:9400/other"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "host:1").write_text("{}")
    assert endpoint_or_path("host:1") == "host:1"  # a file of that name is read as a file


def test_a_reader_that_leaves_ends_it_quietly(tmp_path):
    """`kvtier stats FILE | head`: the pipe's reader gone is the end, not a traceback."""
    path = tmp_path / "stats.json"
    run_engine(tmp_path, {"stats_file": str(path), "stats_interval_s": 60}).close()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "stats", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": KVTIER_SRC},
    )
    process.stdout.close()  # gone before kvtier writes a line
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == 128 + signal.SIGPIPE
    assert err == ""


def test_the_endpoint_and_the_file_agree(tmp_path, capsys):
    port, path = free_port(), tmp_path / "stats.json"
    engine = run_engine(tmp_path, {"port": port, "stats_file": str(path), "stats_interval_s": 60})
    try:
        from kvtier.metrics.report import snapshot, write_atomically

        # the same moment as the scrape below (the thread would write only in 60 s)
        write_atomically(str(path), json.dumps(snapshot(engine.manager)))
        assert main(["stats", str(path), "--json"]) == 0
        from_file = json.loads(capsys.readouterr().out)
        assert main(["stats", f"http://127.0.0.1:{port}/metrics", "--json"]) == 0
        from_endpoint = json.loads(capsys.readouterr().out)
    finally:
        engine.close()
    for summary in (from_file, from_endpoint):  # a projected life moves with the clock
        summary["tiers"]["nvme"].pop("projected_life_s", None)
    assert from_file == from_endpoint


def test_miss_causes_budget_and_outages_are_printed(tmp_path, capsys):
    """A stats file as a kvtier that counts miss causes, a write budget and a shared tier's
    outages writes it (their keys by the shared convention)."""
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"version": 1, "time": 0, "pid": 1, "stats": FUTURE_STATS, "job_seconds": {}}))
    assert main(["stats", str(path)]) == 0
    text = capsys.readouterr().out
    causes = text.split("misses by cause:\n")[1].split("\n\n")[0].splitlines()
    printed = {
        line.split()[0]: (float(line.split()[1]), line.split()[2]) for line in causes if "," not in line
    }
    assert printed == {
        "new": (30, "60.0%"),
        "evicted": (12, "24.0%"),
        "foreign": (5, "10.0%"),
        "unattributed": (3, "6.0%"),  # 50 misses, 47 of them with a cause
    }
    assert "foreign, namespace differs: 5" in text
    assert "nvme: misses it caused: evicted 12" in text
    assert "nvme: writes 4.3 MiB/s of a 4.8 MiB/s budget; projected life 5.0 years" in text
    assert "shared: server DOWN, 2 outages" in text
    assert main(["stats", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["misses"] == {"new": 30, "evicted": 12, "foreign": 5, "unattributed": 3}
    assert summary["hit_ratio"] == 40 / 90
    assert summary["tiers"]["nvme"]["budget_bytes_per_s"] == 5e6
    assert summary["tiers"]["shared"]["misses"] == {"unavailable": 3}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: str(tmp / "missing.json"), "no such file"),
        (lambda tmp: _write(tmp / "garbage.json", "not json {"), "is not JSON"),
        (lambda tmp: _write(tmp / "other.json", '{"version": 99}'), "not a kvtier stats file"),
        (lambda tmp: f"http://127.0.0.1:{free_port()}/metrics", "cannot read .* is the engine running"),
    ],
)
def test_bad_sources_are_a_clear_error_and_exit_2(tmp_path, capsys, make, message):
    assert main(["stats", make(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier stats: ") and "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_an_endpoint_that_is_not_kvtiers_is_refused(capsys):
    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"# TYPE up gauge\nup 1\n"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            """No request log on the test's stderr, which the test reads."""

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert main(["stats", f"http://127.0.0.1:{server.server_port}/metrics"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert "serves no kvtier_ metrics" in capsys.readouterr().err


def test_watch_must_be_positive(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "x.json"), "--watch", "0"]) == 2
    assert "--watch takes seconds > 0" in capsys.readouterr().err


def test_watch_refreshes_until_ctrl_c_then_exits_0(tmp_path):
    path = tmp_path / "stats.json"
    engine = run_engine(tmp_path, {"stats_file": str(path), "stats_interval_s": 60})
    engine.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "stats", str(path), "--watch", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Ctrl-C as at a terminal: a suite started in the background by a shell without job
        # control (`scripts/check.sh &`) ignores SIGINT, and a Python that starts with it
        # ignored never raises KeyboardInterrupt: the child would outlive the test
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while seen.count("kvtier stats ") < 2 and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert seen.count("kvtier stats ") >= 2  # refreshed at least once
        assert "\x1b[2J" in seen  # each refresh clears the screen first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "Traceback" not in err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- hostile sources (issue #32, item 4) ------------------------------------------------------

#: the kvtier under test (the subprocesses run the same code as this one)
KVTIER_SRC = str(Path(kvtier.__file__).resolve().parents[1])
KVTIER_PAGE = b"# TYPE kvtier_lookups_blocks_total counter\nkvtier_lookups_blocks_total 7.0\n"


class Hostile(http.server.BaseHTTPRequestHandler):
    """Answers as ``self.server.answer`` says; counts the requests it got."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.server.requests += 1
        self.server.answer(self)

    def log_message(self, *args):
        """No request log on the test's stderr."""


def hostile_server(answer):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    server.answer, server.requests = answer, 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stats_cli(*args, timeout=60, memory_bytes=None):
    """``kvtier stats`` in a process of its own; a hang or a memory blow-up ends it."""

    def limit():
        if memory_bytes is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = {**os.environ, "PYTHONPATH": KVTIER_SRC}
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "stats", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier stats {args} still ran after {timeout} s")


def refused(result, message):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("kvtier stats: "), result.stderr
    import re

    assert re.search(message, result.stderr), result.stderr


def test_a_redirect_to_another_port_is_not_followed():
    elsewhere = hostile_server(lambda h: (h.send_response(200), h.end_headers(), h.wfile.write(KVTIER_PAGE)))

    def redirect(h):
        h.send_response(302)
        h.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}/metrics")
        h.send_header("Content-Length", "0")
        h.end_headers()

    server = hostile_server(redirect)
    try:
        result = stats_cli(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        elsewhere.shutdown()
    refused(result, r"answered 302 .*a redirect to http://127\.0\.0\.1:\d+/metrics")
    assert server.requests == 1 and elsewhere.requests == 0


def test_a_server_dripping_one_byte_at_a_time_meets_one_deadline():
    def drip(h):
        h.send_response(200)
        h.end_headers()
        for _ in range(60):
            try:
                h.wfile.write(b"#")
                h.wfile.flush()
            except OSError:
                return
            time.sleep(1)

    server = hostile_server(drip)
    try:
        result = stats_cli(f"http://127.0.0.1:{server.server_port}/metrics", timeout=40)
    finally:
        server.shutdown()
    refused(result, r"gave no whole answer within 5 s")


def test_an_endless_answer_is_cut_at_the_size_cap():
    line = b"kvtier_lookups_blocks_total 1.0\n" * 32768  # 1 MiB a write

    def endless(h):
        h.send_response(200)
        h.end_headers()
        for _ in range(64):  # 64 MiB at most, so an uncapped reader finishes
            try:
                h.wfile.write(line)
            except OSError:
                return

    server = hostile_server(endless)
    try:
        result = stats_cli(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
    refused(result, r"answered more than \d+ bytes")


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (
            b'kvtier_job_duration_seconds_bucket{tier="nvme",direction="load",le="soon"} 1\n',
            "bucket without a number as le",
        ),
        (b"kvtier_lookups_blocks_total NaN\n", "kvtier_lookups_blocks_total is nan"),
        (b"kvtier_lookups_blocks_total -4\n", "the counter kvtier_lookups_blocks_total is -4"),
        (
            b'kvtier_job_duration_seconds_bucket{tier="nvme",direction="load",le="0.1"} 5\n'
            b'kvtier_job_duration_seconds_bucket{tier="nvme",direction="load",le="+Inf"} 2\n',
            "buckets of kvtier_job_duration_seconds_bucket shrink",
        ),
    ],
    ids=["le", "nan", "negative", "buckets"],
)
def test_an_endpoint_answering_what_kvtier_never_writes_is_refused(page, message):
    def answer(h):
        body = KVTIER_PAGE + page
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    server = hostile_server(answer)
    try:
        result = stats_cli(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
    refused(result, message)


def _stats_file(tmp_path, stats=None, job_seconds=None, raw=None):
    path = tmp_path / "stats.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        document = {
            "version": 1,
            "time": 0,
            "pid": 1,
            "stats": stats or {"lookups": 3},
            "job_seconds": job_seconds or {},
        }
        path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: _stats_file(tmp, raw=b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
        (lambda tmp: _stats_file(tmp, raw=b'{"version": 1, "stats": {"lookups": 1}}\xff\xfe'), "not UTF-8"),
        (lambda tmp: _stats_file(tmp, raw=b'{"version": 1, "stats": {"lookups": NaN}}'), "holds NaN"),
        (lambda tmp: _stats_file(tmp, {"lookups": -5}), "the counter kvtier_lookups_blocks_total is -5"),
        (
            lambda tmp: _stats_file(
                tmp, job_seconds={"nvme.load": {"bounds": [0.1, 1.0], "counts": [5, -3, 0], "sum": 1}}
            ),
            "do not make a histogram",
        ),
        (
            lambda tmp: _stats_file(
                tmp, job_seconds={"nvme.load": {"bounds": [0.1, 1.0], "counts": [5], "sum": 1}}
            ),
            "do not make a histogram",
        ),
    ],
    ids=["deep", "utf8", "nan", "negative", "negative-bucket", "short-counts"],
)
def test_a_stats_file_holding_what_kvtier_never_writes_is_refused(tmp_path, make, message):
    refused(stats_cli(make(tmp_path)), message)


def test_a_fifo_and_a_device_are_refused_without_waiting_or_reading_for_ever(tmp_path):
    fifo = tmp_path / "stats.json"
    os.mkfifo(fifo)  # no writer will ever come: a plain open would wait for one
    refused(stats_cli(fifo, timeout=30), "not a regular file")
    # read-only, and a memory cap makes an unbounded read fail instead of filling the machine
    refused(stats_cli("/dev/zero", timeout=30, memory_bytes=2 << 30), "not a regular file")


def test_watch_of_infinite_seconds_is_refused(tmp_path):
    refused(stats_cli(_stats_file(tmp_path), "--watch", "inf"), r"--watch takes seconds > 0 and <= 86400")
