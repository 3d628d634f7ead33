"""The engine, GPU and tier-speed options that ``replay``, ``plan`` and ``model`` share."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["add_cost_options", "time_model"]


def add_cost_options(parser: argparse.ArgumentParser, model_required: bool = False) -> None:
    """``--model``, ``--gpu``, ``--kv-dtype``, ``--bandwidth`` (``--model`` is positional
    ``MODEL`` when ``model_required``)."""
    from kvtier.costs.gpus import BUNDLED_GPUS, DEFAULT_MFU
    from kvtier.costs.models import BUNDLED_MODELS

    models = ", ".join(BUNDLED_MODELS)
    if model_required:
        parser.add_argument("model", metavar="MODEL", help=f"a config.json path or one of {models}")
    else:
        parser.add_argument(
            "--model",
            metavar="M",
            help=f"price the run in time: a Hugging Face config.json or one of {models}",
        )
    parser.add_argument(
        "--gpu",
        metavar="G",
        help=f"the GPU: one of {', '.join(BUNDLED_GPUS)} or tflops=N,hbm=GB/s,pcie=GB/s; add ,mfu=X "
        f"(default {DEFAULT_MFU}) or ,prefill=TOKENS_PER_S (measured), and ,step=SECONDS (a forward "
        "pass's fixed cost, measured) (default H100)",
    )
    parser.add_argument(
        "--kv-dtype", metavar="DTYPE", help="KV cache dtype when not the weights' (e.g. float8_e4m3fn)"
    )
    parser.add_argument(
        "--bandwidth",
        metavar="FILE",
        help='tier load speeds: kvtier bench transfer/disk/remote --json lines, or {"kind": GB/s}',
    )


def time_model(args: argparse.Namespace) -> Any:
    """``(EngineModel, GPUSpec, measured speeds)`` from the options, or ``None`` without a model.

    Raises :class:`ConfigError` for a bad name, file or figure, or ``--gpu``/``--bandwidth``
    given without a model."""
    from kvtier.costs.bandwidth import read_bandwidth_file
    from kvtier.costs.gpus import parse_gpu
    from kvtier.costs.models import load_model

    if args.model is None:
        for flag, value in (
            ("--gpu", args.gpu),
            ("--bandwidth", args.bandwidth),
            ("--kv-dtype", args.kv_dtype),
        ):
            if value is not None:
                raise ConfigError(flag, value, "used with --model", "add --model NAME (e.g. Llama-3.1-8B)")
        return None
    model = load_model(args.model, args.kv_dtype)
    gpu = parse_gpu(args.gpu or "H100")
    measured = read_bandwidth_file(args.bandwidth) if args.bandwidth else {}
    return model, gpu, measured
