"""kvtier.costs: the formulas on published configs, the break-even figures, the prefill queue."""

import json

import pytest

from kvtier.costs import CostModel, load_model, model_from_config, parse_gpu
from kvtier.costs.bandwidth import read_bandwidth_file
from kvtier.costs.models import BUNDLED_MODELS
from kvtier.costs.prices import load_prices
from kvtier.costs.queue import percentile, request_service, run_queue
from kvtier.costs.sweep import hit_sweep
from kvtier.costs.timing import tier_speeds
from kvtier.errors import ConfigError
from kvtier_testing.costs import TINY


def test_kv_bytes_per_token_of_the_bundled_models():
    assert load_model("Llama-3.1-8B").kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert load_model("llama-3.1-70b").kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert load_model("Qwen3-8B").kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert load_model("Qwen3-32B").kv_bytes_per_token == 64 * 2 * 8 * 128 * 2  # head_dim 128, not 5120/64
    deepseek = load_model("DeepSeek-V3")
    assert deepseek.mla and deepseek.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert load_model("Llama-3.1-8B", kv_dtype="float8_e4m3fn").kv_bytes_per_token == 65536


def test_parameter_counts_match_the_published_sizes():
    # the models' cards: 8.03 B, 70.6 B; DeepSeek-V3: 671 B in all, 37 B activated per token
    assert load_model("Llama-3.1-8B").params == pytest.approx(8.03e9, rel=0.005)
    assert load_model("Llama-3.1-70B").params == pytest.approx(70.6e9, rel=0.005)
    deepseek = load_model("DeepSeek-V3")
    assert deepseek.params == pytest.approx(671e9, rel=0.01)
    assert 35e9 < deepseek.active_params < 38e9  # 37 B counts the embedding and head too
    assert deepseek.active_params < deepseek.params / 15


def test_prefill_flops_formula_and_its_context_term():
    model = model_from_config(TINY)
    active = model.active_params
    attention = model.attention_flops_per_position
    assert attention == 2 * 1 * 1 * (8 + 8)
    # 3 tokens after 2 cached attend to 3, 4 and 5 positions
    assert model.prefill_flops(3, cached=2) == 3 * 2 * active + attention * (3 + 4 + 5)
    assert model.prefill_flops(5) == model.prefill_flops(2) + model.prefill_flops(3, cached=2)
    assert model.prefill_flops_per_token(1000) > model.prefill_flops_per_token(10)  # grows with context


# The published break-even figures are bytes/token x prefill tokens/s at 15,000 tokens/s
# (Llama-3.1-8B) and 8,000 tokens/s (DeepSeek-V3), with a bf16 KV cache.
@pytest.mark.parametrize(
    ("name", "rate", "published"), [("Llama-3.1-8B", 15000, 1.97), ("DeepSeek-V3", 8000, 0.56)]
)
def test_break_even_reproduces_the_published_figures(name, rate, published):
    cost = CostModel(load_model(name), parse_gpu(f"H100,prefill={rate}"), {})
    assert cost.break_even_gbps(8192) == pytest.approx(published, rel=0.01)


def test_break_even_warns_for_a_tier_below_it():
    gpu = parse_gpu("H100,prefill=15000")
    speeds = tier_speeds([("cpu", "cpu"), ("disk", "lmdb")], gpu, {"lmdb": (1.0, "test")})
    figures = CostModel(load_model("Llama-3.1-8B"), gpu, {s.name: s for s in speeds}).break_even(4096)
    assert figures["tiers"]["cpu"]["below_break_even"] is False
    disk = figures["tiers"]["disk"]
    assert disk["effective_gbps"] == pytest.approx(1 / (1 / 1.0 + 1 / 64))  # read up, then over PCIe
    assert disk["below_break_even"] is True


def test_a_config_json_reads_like_the_bundled_entry(tmp_path):
    fields = dict(BUNDLED_MODELS["Llama-3.1-8B"])
    del fields["source"]
    fields.update({"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": fields}))  # a multimodal config nests it
    model = load_model(str(path))
    bundled = load_model("Llama-3.1-8B")
    assert (model.kv_bytes_per_token, model.params, model.active_params) == (
        bundled.kv_bytes_per_token,
        bundled.params,
        bundled.active_params,
    )


@pytest.mark.parametrize(
    ("content", "named"),
    [("{not json", "JSON"), ("[1, 2]", "JSON object"), ('{"hidden_size": 8}', "num_hidden_layers")],
)
def test_a_bad_config_json_is_named(tmp_path, content, named):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=named):
        load_model(str(path))


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ConfigError, match="Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B, Qwen3-32B, DeepSeek-V3"):
        load_model("Llama-4")
    with pytest.raises(ConfigError, match="H100, H200, A100, L40S"):
        parse_gpu("B200")
    with pytest.raises(ConfigError, match="pcie"):
        parse_gpu("tflops=989,hbm=3350")
    with pytest.raises(ConfigError, match="mfu"):
        parse_gpu("H100,mfu=1.5")
    assert parse_gpu("tflops=100,hbm=1000,pcie=10,mfu=0.5").mfu == 0.5
    assert parse_gpu("h100-sxm").tflops == 989


def _tiny_cost(**measured):
    # prefill 1000 tokens/s; the CPU tier loads 64 B/token x 2000 tokens/s
    gpu = parse_gpu("tflops=1,hbm=1,pcie=1,prefill=1000")
    speeds = tier_speeds([("cpu", "cpu"), ("disk", "files")], gpu, {"cpu": (128e-6, "test"), **measured})
    return CostModel(model_from_config(TINY), gpu, {s.name: s for s in speeds})


def test_the_prefill_queue_on_a_hand_computed_trace():
    cost = _tiny_cost()
    requests = [  # (arrival s, prompt tokens, blocks by source)
        (0.0, 1024, {"computed": 2}),  # 1.024 s of prefill
        (0.5, 1024, {"cpu": 2}),  # load 1024 tokens (0.512 s) + the last token (0.001 s), waits till 1.024
        (5.0, 600, {"gpu": 1, "computed": 1}),  # 88 tokens left to compute
        (6.0, 1000, {"cpu": 1, "computed": 1}),  # load 512 (0.256 s) + compute 488 (0.488 s)
    ]
    services = [request_service(cost, tokens, served) for _, tokens, served in requests]
    assert services[1] == pytest.approx((0.512, 0.001))
    result = run_queue([arrival for arrival, _, _ in requests], services)
    assert result.ttft_s == pytest.approx([1.024, 1.537 - 0.5, 0.088, 0.744])
    assert result.compute_s == pytest.approx(1.024 + 0.001 + 0.088 + 0.488)
    assert result.load_s == pytest.approx(0.512 + 0.256)
    assert result.makespan_s == pytest.approx(6.744)
    assert percentile(result.ttft_s, 50) == pytest.approx(0.744)  # nearest rank: the 2nd of 4
    assert percentile(result.ttft_s, 99) == pytest.approx(1.037)


def test_flops_path_bounded_below_by_reading_the_weights():
    model = model_from_config(TINY)
    gpu = parse_gpu("tflops=1,hbm=1,pcie=1,mfu=0.5")
    cost = CostModel(model, gpu, {})
    assert cost.prefill_seconds(1) == pytest.approx(model.weight_bytes / 1e9)  # the floor
    tokens = 10**6
    assert cost.prefill_seconds(tokens) == pytest.approx(model.prefill_flops(tokens) / 0.5e12)


def test_a_step_cost_is_added_to_every_prefill():
    model = model_from_config(TINY)
    measured = CostModel(model, parse_gpu("tflops=1,hbm=1,pcie=1,prefill=1000,step=0.05"), {})
    assert measured.prefill_seconds(1) == pytest.approx(0.05 + 0.001)
    assert measured.prefill_seconds(2000, cached=500) == pytest.approx(0.05 + 2.0)
    assert measured.prefill_seconds(0) == 0  # no pass at all
    # the measured step replaces the floor of reading the weights (it read them once)
    flops = CostModel(model, parse_gpu("tflops=1,hbm=1e-9,pcie=1,mfu=0.5,step=0.05"), {})
    assert flops.prefill_seconds(1) == pytest.approx(0.05 + model.prefill_flops(1) / 0.5e12)
    assert flops.prefill_seconds(64, cached=10) == pytest.approx(0.05 + model.prefill_flops(64, 10) / 0.5e12)
    # with every block hit the last token is still computed: one pass, its fixed cost included
    assert request_service(measured, 1024, {"gpu": 2})[1] == pytest.approx(0.051)
    with pytest.raises(ConfigError, match="step"):
        parse_gpu("H100,step=-1")


def test_a_transformers_5_config_names_its_dtype_dtype():
    fields = {key: value for key, value in TINY.items() if key != "torch_dtype"}
    assert model_from_config(fields).weight_dtype_bytes == 2  # bfloat16 unless said
    assert model_from_config({**fields, "dtype": "float32"}).weight_dtype_bytes == 4
    assert model_from_config({**fields, "torch_dtype": "float16", "dtype": "float32"}).weight_dtype_bytes == 2


def test_hit_sweep_gain_grows_with_the_prompt():
    cost = CostModel(
        load_model("Llama-3.1-8B"),
        parse_gpu("H100"),
        {s.name: s for s in tier_speeds([("cpu", "cpu")], parse_gpu("H100"))},
    )
    rows = hit_sweep(cost, "cpu", [512, 4096, 32768])
    gains = [row["speedup"] for row in rows]
    assert 1 < gains[0] < gains[1] < gains[2]


def test_bandwidth_from_bench_records(tmp_path):
    path = tmp_path / "bench.jsonl"
    lines = [
        "a table line first",
        json.dumps({"bench": "transfer", "rows": [{"h2d_gbps": 20.0}, {"h2d_gbps": 41.5}]}),
        json.dumps({"bench": "disk", "backend": "lmdb", "read_gbps": 3.2}),
        json.dumps({"bench": "remote", "64k_tier_load_gbps": 0.6, "2048k_tier_load_gbps": 2.5}),
    ]
    path.write_text("\n".join(lines))
    found = read_bandwidth_file(path)
    assert {kind: gbps for kind, (gbps, _) in found.items()} == {"cpu": 41.5, "lmdb": 3.2, "valkey": 2.5}
    path.write_text('{"lmdb": -1}')
    with pytest.raises(ConfigError, match="lmdb"):
        read_bandwidth_file(path)


def test_prices_file(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("gpu_per_hour: 2\ndram_per_gb_month: 3\nnvme_per_gb_month: 0.1\nsources: {a: b}\n")
    prices = load_prices(path)
    assert (prices.gpu_per_hour, prices.shared_per_gb_month) == (2.0, None)
    path.write_text("gpu_per_hour: 2\ndram_per_gb_month: lots\nnvme_per_gb_month: 0.1\n")
    with pytest.raises(ConfigError, match="dram_per_gb_month"):
        load_prices(path)
    path.write_text("gpu_per_hour: 2\ndram_per_gb_mnth: 3\nnvme_per_gb_month: 0.1\n")
    with pytest.raises(ConfigError, match="dram_per_gb_mnth"):
        load_prices(path)


def test_the_example_prices_file_loads():
    from pathlib import Path

    prices = load_prices(Path(__file__).resolve().parents[2] / "examples" / "costs" / "prices.yaml")
    assert prices.gpu_per_hour > 0 and prices.shared_per_gb_month is not None
