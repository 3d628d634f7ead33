"""Time and money: an explicit model of the engine (KV bytes and prefill FLOPs per token), the
GPU (peak FLOPS, HBM and PCIe bandwidth) and the tiers' load speeds, from which the break-even
bandwidth per tier, a prefill queue's time to first token and GPU-seconds per dollar follow.

Library only: ``kvtier replay --model/--gpu``, ``kvtier plan --prices`` and ``kvtier model``
use it; nothing here imports a tool. Formulas and their sources: docs/time-and-money.md.
"""

from kvtier.costs.gpus import BUNDLED_GPUS, GPUSpec, parse_gpu
from kvtier.costs.models import BUNDLED_MODELS, EngineModel, load_model, model_from_config
from kvtier.costs.timing import CostModel, TierSpeed

__all__ = [
    "BUNDLED_GPUS",
    "BUNDLED_MODELS",
    "CostModel",
    "EngineModel",
    "GPUSpec",
    "TierSpeed",
    "load_model",
    "model_from_config",
    "parse_gpu",
]
