"""``kvtier bench transfer`` runs, verifies its round trip and reports every figure."""

import json

from kvtier.cli.main import main


def test_bench_transfer_json_has_every_figure(capsys):
    assert (
        main(
            [
                "bench",
                "transfer",
                "--json",
                "--device",
                "cpu",
                "--max-batch",
                "4",
                "--layers",
                "2",
                "--runs",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "transfer" and record["device"] == "cpu" and record["engine"] == "thread"
    assert record["verified"] is True
    combos = [(row["layout"], row["page_bytes"], row["batch_blocks"]) for row in record["rows"]]
    assert combos == [
        (name, page, batch)
        for name, page in (("llama3-8b", 65536), ("small-page", 16384))
        for batch in (1, 2, 4)
    ]
    for row in record["rows"]:
        for figure in (
            "d2h_gbps",
            "h2d_gbps",
            "baseline_gbps",
            "baseline_d2h_gbps",
            "baseline_h2d_gbps",
        ):
            assert row[figure] > 0
        assert row["d2h_ratio"] == row["d2h_gbps"] / row["baseline_d2h_gbps"]
        assert row["baseline_gbps"] == min(row["baseline_d2h_gbps"], row["baseline_h2d_gbps"])


def test_bench_transfer_table(capsys):
    assert (
        main(
            [
                "bench",
                "transfer",
                "--device",
                "cpu",
                "--max-batch",
                "1",
                "--layers",
                "1",
                "--runs",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert "round trip verified: True" in lines[0]
    assert lines[1].split()[:3] == ["layout", "page_bytes", "batch_blocks"]
    assert not any(line.startswith("{") for line in lines)  # the JSON line only with --json
