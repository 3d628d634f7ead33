"""The GPU's model: peak dense bf16 FLOPS, HBM and PCIe bandwidth, and how much of the peak a
prefill reaches (an MFU, or a measured prefill rate in tokens per second).

``--gpu`` takes a bundled name (:data:`BUNDLED_GPUS`, each figure from the vendor's datasheet),
explicit numbers (``tflops=989,hbm=3350,pcie=64``), or a name with overrides
(``H100,mfu=0.5``, ``H100,prefill=15000``, ``H100,prefill=15000,step=0.02``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["BUNDLED_GPUS", "DEFAULT_MFU", "GPUSpec", "parse_gpu"]

#: share of the peak dense FLOPS a prefill reaches when none is given: a middle figure for
#: long prompts in vLLM on Hopper; measure yours and pass ``prefill=TOKENS_PER_S`` or ``mfu=``
DEFAULT_MFU = 0.4


@dataclass(frozen=True)
class GPUSpec:
    """One GPU (or a group of them serving one model: give its summed figures)."""

    name: str
    #: peak dense bf16 tensor throughput, TFLOPS (without sparsity)
    tflops: float
    #: HBM bandwidth, GB/s (10^9 bytes)
    hbm_gbps: float
    #: host link bandwidth per direction, GB/s: what a load from host memory can reach at most
    pcie_gbps: float
    #: where the figures come from
    source: str = "given on the command line"
    #: model FLOPs utilisation of a prefill (share of ``tflops``)
    mfu: float = DEFAULT_MFU
    #: a measured prefill rate, tokens per second; when set it replaces the FLOPs model
    prefill_tokens_per_s: float | None = None
    #: seconds every forward pass costs whatever its length (launches, scheduling, sampling,
    #: reading the weights once): a one-token step's time, measured; added to each prefill in
    #: place of the weights-over-HBM floor; 0: the floor alone
    step_s: float = 0.0

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet)"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet)"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 (L40S datasheet)"

#: bundled GPUs. Dense bf16 is the datasheet's sparsity figure halved; PCIe is the
#: datasheet's bidirectional figure halved (Gen5 x16: 128 GB/s both ways, 64 one way)
BUNDLED_GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec("H100 SXM", tflops=989.0, hbm_gbps=3350.0, pcie_gbps=64.0, source=_H100),
    "H200": GPUSpec("H200 SXM", tflops=989.0, hbm_gbps=4800.0, pcie_gbps=64.0, source=_H200),
    "A100": GPUSpec("A100 80GB SXM", tflops=312.0, hbm_gbps=2039.0, pcie_gbps=32.0, source=_A100),
    "L40S": GPUSpec("L40S", tflops=362.05, hbm_gbps=864.0, pcie_gbps=32.0, source=_L40S),
}

_KEYS = {
    "tflops": "tflops",
    "hbm": "hbm_gbps",
    "pcie": "pcie_gbps",
    "mfu": "mfu",
    "prefill": "prefill_tokens_per_s",
    "step": "step_s",
}


def parse_gpu(text: str) -> GPUSpec:
    """The GPU ``--gpu`` names (see the module docstring); :class:`ConfigError` names the
    bundled GPUs and the keys for anything else."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    known = ", ".join(BUNDLED_GPUS)
    usage = f"a bundled GPU ({known}) and/or {', '.join(f'{key}=N' for key in _KEYS)}"
    if not parts:
        raise ConfigError("--gpu", text, usage, "e.g. --gpu H100 or --gpu tflops=989,hbm=3350,pcie=64")
    base: GPUSpec | None = None
    if "=" not in parts[0]:
        by_lower = {name.lower(): spec for name, spec in BUNDLED_GPUS.items()}
        name = parts.pop(0).lower().removesuffix("-sxm").removesuffix(" sxm")
        if name not in by_lower:
            raise ConfigError("--gpu", text, usage, f"name one of {known}, or give the figures")
        base = by_lower[name]
    values: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key.strip() not in _KEYS:
            raise ConfigError("--gpu", part, usage, "e.g. --gpu H100,mfu=0.5")
        try:
            number = float(raw)
        except ValueError:
            number = float("nan")
        if not number > 0 or number == float("inf") or (key.strip() == "mfu" and number > 1):
            raise ConfigError(
                f"--gpu {key.strip()}", raw, "a positive number (mfu: at most 1)", "e.g. mfu=0.4"
            )
        values[_KEYS[key.strip()]] = number
    if base is None:
        missing = [key for key in ("tflops", "hbm", "pcie") if _KEYS[key] not in values]
        if missing:
            raise ConfigError("--gpu", text, usage, f"give {', '.join(missing)} too, or name a bundled GPU")
        return GPUSpec("custom", **values)
    return dataclasses.replace(base, **values)
