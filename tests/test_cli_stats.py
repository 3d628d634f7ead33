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
    finally:
        engine.close()
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
