"""plan --prices on a case computed by hand; replay --model; the commands' bad input."""

import json

import pytest

from kvtier.cli.main import main
from kvtier.costs import CostModel, model_from_config, parse_gpu
from kvtier.costs.prices import Prices
from kvtier.costs.timing import tier_speeds
from kvtier.plan.money import money_plan
from kvtier.replay.trace import Request
from kvtier.replay.ttft import gpu_only_served
from kvtier_testing.costs import TINY

BLOCK_BYTES = 64 * 512  # 64 B/token x 512 tokens
MONTH_MS = 730 * 3600 * 1000  # the month of a GB-month price


def _money(target):
    gpu = parse_gpu("tflops=1,hbm=1,pcie=1,prefill=1000")  # a 512-token block computes in 0.512 s
    measured = {
        "dram": (BLOCK_BYTES / 0.032 / 1e9, "test"),  # a block loads from DRAM in 0.032 s
        "nvme": (
            BLOCK_BYTES / 0.968 / 1e9,
            "test",
        ),  # and from NVMe in 0.968 + 0.032 = 1 s: slower than computing
    }
    speeds = tier_speeds([("dram", "cpu"), ("nvme", "lmdb"), ("shared", "valkey")], gpu, measured)
    cost = CostModel(model_from_config(TINY), gpu, {s.name: s for s in speeds})
    # ten one-block requests over a month; a block-month of DRAM costs $1, NVMe is free
    requests = [Request(i * MONTH_MS // 9, 512, 0, (i,)) for i in range(10)]
    prices = Prices(gpu_per_hour=3600.0, dram_per_gb_month=1e9 / BLOCK_BYTES, nvme_per_gb_month=0.0)
    return money_plan(
        cost, prices, requests, [10, 20], [0.3, 0.5], [0.4, 0.5], gpu_hit_blocks=1, target=target
    )


def test_money_plan_by_hand():
    record = _money(0.9)
    rows = {(row["dram"], row["nvme"]): row for row in record["combinations"]}
    assert len(rows) == 9  # no shared price: DRAM x NVMe sizes, 0 included
    # DRAM of 10 serves h(10) - GPU = 0.3 - 0.1 of 10 refs: 2 blocks x (0.512 - 0.032) s, for $10
    assert rows[10, 0]["saved_s_online"] == pytest.approx(2 * 0.48)
    assert rows[10, 0]["dollars"] == pytest.approx(10)
    assert rows[10, 0]["saved_s_belady"] == pytest.approx(3 * 0.48)
    assert rows[20, 0]["saved_s_online"] == pytest.approx(4 * 0.48)
    # NVMe below DRAM's size adds nothing; larger, it serves blocks slower than computing them
    assert rows[20, 10]["saved_s_online"] == rows[20, 0]["saved_s_online"]
    assert rows[10, 20]["saved_s_online"] == pytest.approx(2 * 0.48 + 2 * (0.512 - 1.0))
    assert rows[0, 0]["saved_s_online"] == 0 and rows[0, 0]["saved_per_dollar"] is None
    assert rows[10, 0]["net_dollars"] == pytest.approx(2 * 0.48 * 3600 / 3600 - 10)
    # GPU time at $3600/hour is $1 a second: nothing here pays for its DRAM, so no tiers nets most
    assert (record["best_net"]["dram"], record["best_net"]["nvme"], record["best_net"]["net_dollars"]) == (
        0,
        0,
        0,
    )
    assert record["best_saved_s"] == pytest.approx(1.92)
    pick = record["recommend"]
    assert (pick["dram"], pick["nvme"]) == (20, 0)
    # 45% of the best is reached by DRAM of 10 (exactly half: 0.96 of 1.92) at half the price
    pick = _money(0.45)["recommend"]
    assert (pick["dram"], pick["nvme"]) == (10, 0)


def test_gpu_cache_alone_is_an_lru_of_prefixes():
    chains = [(1, 2), (1, 2), (3,), (1, 2)]
    requests = [Request(i, 512 * len(c), 0, c) for i, c in enumerate(chains)]
    assert gpu_only_served(requests, 2) == [
        {"computed": 2},
        {"gpu": 2, "computed": 0},
        {"computed": 1},
        {"computed": 2},
    ]


def _trace(tmp_path, n=40):
    lines = [
        json.dumps(
            {
                "timestamp": i * 200,
                "input_length": 1500,
                "output_length": 1,
                "hash_ids": [i % 3, 10 + i % 5, 100 + i],
            }
        )
        for i in range(n)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_prices_end_to_end(tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_per_hour: 3\ndram_per_gb_month: 3\nnvme_per_gb_month: 0.1\n")
    args = ["plan", str(_trace(tmp_path)), "--capacities", "4", "16", "--policies", "lru", "--jobs", "1"]
    args += [
        "--model",
        "Llama-3.1-8B",
        "--gpu",
        "H100",
        "--prices",
        str(prices),
        "--gpu-blocks",
        "3",
        "--json",
    ]
    assert main(args) == 0
    money = json.loads(capsys.readouterr().out)["money"]
    assert len(money["combinations"]) == 9 and money["gpu_blocks"] == 3
    best = max(row["saved_s_online"] for row in money["combinations"])
    assert money["recommend"]["saved_s_online"] >= 0.9 * best > 0
    # Belady hits more at every size; DRAM is above the break-even, so its blocks save more too
    # (NVMe is below it here: more hits there would cost time, so only DRAM-only stacks compare)
    dram_only = [row for row in money["combinations"] if row["nvme"] == 0]
    assert all(row["saved_s_belady"] >= row["saved_s_online"] - 1e-9 for row in dram_only)


def test_replay_model_prices_every_request(tmp_path, capsys):
    args = ["replay", str(_trace(tmp_path)), "--gpu-blocks", "4", "--no-progress"]
    args += ["--model", "Llama-3.1-8B", "--gpu", "H100,prefill=15000", "--deterministic"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "batching" in out and "GPU cache alone" in out and "break-even load speed: 1.97 GB/s" in out
    assert "CPU tier alone" in out  # the replay's baseline run, priced too
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    time = record["time"]
    # a GPU cache of 4 blocks never holds a request's head when the next one with it comes:
    # alone, all 40 x 1500 tokens are computed at 15,000 tokens/s; the CPU tier serves heads
    assert time["gpu_only"]["gpu_seconds"] == pytest.approx(4.0)
    assert 0 < time["stack"]["gpu_seconds"] < 4.0
    assert time["speedup"]["gpu_seconds"] > 1
    assert 0 < time["cpu_only"]["gpu_seconds"] < 4.0
    assert time["stack"]["load_seconds"] > 0
    busy = {run: time[run]["gpu_seconds"] + time[run]["load_seconds"] for run in ("stack", "gpu_only")}
    assert time["busy_seconds_saved"] == pytest.approx(busy["gpu_only"] - busy["stack"])
    assert time["stack"]["ttft_p50_s"] <= time["stack"]["ttft_p99_s"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["model", "Llama-4"], "Qwen3-32B"),
        (["model", "Llama-3.1-8B", "--gpu", "B200"], "H100, H200, A100, L40S"),
        (["replay", "--gpu", "H100"], "--model"),
        (["plan", "--prices", "examples/costs/prices.yaml"], "--model"),
        (["plan", "--model", "Llama-3.1-8B", "--prices", "/nonexistent.yaml"], "--prices"),
        (["model", "Llama-3.1-8B", "--bandwidth", "/nonexistent.jsonl"], "--bandwidth"),
        (["replay", "--model", "Llama-3.1-8B", "--arrival-scale", "0"], "--arrival-scale"),
        (["replay", "--arrival-scale", "4"], "--model"),
        (["replay", "--engines", "2", "--gpu", "H100"], "--model"),  # a fleet is priced too, with a model
        (
            [
                "plan",
                "--model",
                "Llama-3.1-8B",
                "--prices",
                "examples/costs/prices.yaml",
                "--cost-target",
                "2",
            ],
            "--cost-target",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_bad_prices_file_exits_2(tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_per_hour: -1\ndram_per_gb_month: 3\nnvme_per_gb_month: 0.1\n")
    assert main(["plan", "--model", "Llama-3.1-8B", "--prices", str(prices)]) == 2
    err = capsys.readouterr().err
    assert "gpu_per_hour" in err and "Traceback" not in err


def test_bad_config_json_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": "many"}')
    assert main(["model", str(path)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_model_command_prints_break_even_and_sweep(capsys):
    assert (
        main(["model", "DeepSeek-V3", "--gpu", "H100,prefill=8000", "--sweep", "1024", "8192", "--json"]) == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["break_even"]["break_even_gbps"] == pytest.approx(70272 * 8000 / 1e9)
    assert [row["prompt_tokens"] for row in record["sweep"]] == [1024, 8192]
    assert record["break_even"]["tiers"]["disk"]["below_break_even"] is False  # MLA: even this disk pays


def test_plan_with_a_model_alone_prints_the_break_even(tmp_path, capsys):
    args = ["plan", str(_trace(tmp_path)), "--capacities", "4", "--policies", "lru", "--jobs", "1"]
    assert main([*args, "--model", "Llama-3.1-8B", "--gpu", "H100,prefill=15000"]) == 0
    out = capsys.readouterr().out
    assert "break-even load speed: 1.97 GB/s" in out
    assert "warning: tier 'shared'" in out and "warning: tier 'dram'" not in out
