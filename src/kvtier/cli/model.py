"""``kvtier model``: an engine on a GPU over a stack: KV bytes and FLOPs per token, the
break-even load speed per tier, and TTFT loading a whole prompt from a tier vs recomputing it."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from kvtier.cli.common import report
from kvtier.cli.costing import add_cost_options, time_model
from kvtier.config.load import env_config_path
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier model``: its options."""
    parser = sub.add_parser(
        "model",
        help="an engine on a GPU: KV bytes/token, break-even load speed per tier, TTFT of a hit vs a recompute",
        description="Print an LLM's KV bytes and prefill FLOPs per token, the prefill rate on a GPU, the "
        "break-even load speed (bytes/token x prefill tokens/s) against each tier of a stack, and a sweep "
        "of prompt lengths: TTFT recomputing a prompt vs loading it all from the CPU tier.",
    )
    add_cost_options(parser, model_required=True)
    parser.add_argument(
        "--config",
        metavar="CFG",
        help="kvtier YAML whose tiers to judge (default: $KVTIER_CONFIG, else cpu + lmdb)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=8192, help="prompt length for the break-even (default 8192)"
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        metavar="N",
        help="prompt lengths of the sweep (default 512 ... 65536)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        priced = time_model(args)
        if args.prompt_tokens < 1 or any(n < 1 for n in args.sweep or []):
            raise KvtierError("--prompt-tokens and --sweep take positive token counts")
        config = args.config or env_config_path()
        report(args, lambda out: describe(priced, config, args.prompt_tokens, args.sweep, out))
    except KvtierError as exc:
        print(f"kvtier model: {exc}", file=sys.stderr)
        return 2
    return 0


def describe(
    priced: Any, config: str | None, prompt_tokens: int, sweep: list[int] | None, out: TextIO
) -> dict:
    """Print the model, the break-even per tier and the sweep; the JSON record (printed by
    :func:`~kvtier.cli.common.report` with ``--json``)."""
    from kvtier.bench.report import print_table
    from kvtier.config import load_config
    from kvtier.costs.sweep import DEFAULT_PROMPTS, hit_sweep
    from kvtier.costs.timing import CostModel, tier_speeds
    from kvtier.replay.ttft import print_break_even

    model, gpu, measured = priced
    tiers = (
        [(t.name, t.kind) for t in load_config(config).tiers]
        if config
        else [("cpu", "cpu"), ("disk", "lmdb")]
    )
    cost = CostModel(model, gpu, {s.name: s for s in tier_speeds(tiers, gpu, measured)})
    figures = cost.break_even(prompt_tokens)
    rows = hit_sweep(cost, tiers[0][0], sweep or DEFAULT_PROMPTS)
    record = {**cost.describe(), "break_even": figures, "sweep": rows}
    print(
        f"{model.name}: {model.kv_bytes_per_token} KV bytes/token ({'MLA' if model.mla else 'GQA/MHA'}), "
        f"{model.params / 1e9:.2f} B parameters, {model.active_params / 1e9:.2f} B active in the layers, "
        f"{model.prefill_flops_per_token(prompt_tokens) / 1e9:.2f} GFLOP/token over {prompt_tokens}-token prompts",
        file=out,
    )
    print(
        f"GPU {gpu.name}: {gpu.tflops:g} TFLOPS bf16 dense, HBM {gpu.hbm_gbps:g} GB/s, PCIe {gpu.pcie_gbps:g} GB/s",
        file=out,
    )
    print_break_even(figures, out)
    print(f"one request alone: TTFT recomputing the prompt vs loading it from tier {tiers[0][0]!r}", file=out)
    print_table(rows, list(rows[0]), out)
    return record
