"""Seconds of prefill and of loads, and the break-even bandwidth, from the engine, GPU and tiers.

* Prefill of ``n`` tokens after ``h`` cached ones: with a measured rate, ``n / rate``; else
  ``max(FLOPs / (peak x MFU), weight bytes / HBM bandwidth)`` (a forward pass reads every
  weight at least once, which bounds a short prefill from below).
* A load of ``b`` bytes from the CPU tier: ``b / cpu``; from a lower tier: ``b / tier + b / cpu``
  (read up into the CPU tier, then copied to the GPU, one after the other as kvtier does);
  with a codec of ratio ``r`` decoding at ``d`` (one core): ``b / (r x tier) + b / d + b / cpu``
  (fewer bytes read, then decoded into the CPU row). Against the same tier without it, the
  codec loses load speed wherever ``tier > d x (1 - 1/r)``: what it buys on a faster tier is
  capacity and wire bytes, not speed (docs/tiers/codecs.md has the figures).
* Break-even bandwidth: ``KV bytes per token x prefill tokens/s``; a tier whose effective
  load speed is below it is slower than recomputing the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.costs.bandwidth import DEFAULT_LOAD_GBPS, HOST_LINK, CodecCost, codec_cost
from kvtier.costs.gpus import GPUSpec
from kvtier.costs.models import EngineModel
from kvtier.errors import ConfigError

__all__ = ["CostModel", "TierSpeed", "tier_speeds"]


@dataclass(frozen=True)
class TierSpeed:
    """A tier's load speed into GPU memory."""

    name: str
    kind: str
    #: the tier's own read speed, GB/s (for the CPU tier, the host-to-GPU copy)
    gbps: float
    #: GB/s of the whole path into the GPU (a lower tier's read, then the CPU tier's copy)
    effective_gbps: float
    source: str
    #: the codec the tier stores blocks with, its ratio and decode speed (None: no codec)
    codec: CodecCost | None = None

    @property
    def codec_loses_above_gbps(self) -> float | None:
        """The tier read speed above which its codec makes loads slower than no codec would
        (None without a codec): ``decode x (1 - 1/ratio)``."""
        if self.codec is None:
            return None
        return self.codec.decode_gbps * (1 - 1 / self.codec.ratio)


def tier_speeds(
    tiers: Iterable[tuple[str, str]],
    gpu: GPUSpec,
    measured: Mapping[str, tuple[float, str]] | None = None,
    codecs: Mapping[str, str] | None = None,
) -> list[TierSpeed]:
    """Each ``(name, kind)`` of a stack (the CPU tier first) with its load speed: a measured
    figure by tier name, then by kind, then the kind's default; :class:`ConfigError` for a
    kind without one. ``codecs``: tier name -> the codec it stores blocks with (its ratio and
    decode speed from a ``bench codec`` record among those, else the defaults)."""
    measured = measured or {}
    codecs = codecs or {}
    speeds: list[TierSpeed] = []
    host: float | None = None
    for name, kind in tiers:
        if name in measured or kind in measured:
            gbps, source = measured[name] if name in measured else measured[kind]
        elif kind in HOST_LINK:
            gbps, source = gpu.pcie_gbps, f"{gpu.name} PCIe per direction (datasheet, an upper bound)"
        elif kind in DEFAULT_LOAD_GBPS:
            gbps, source = DEFAULT_LOAD_GBPS[kind]
        else:
            raise ConfigError(
                f"tier {name!r} (kind {kind})",
                kind,
                f"a kind with a default speed ({', '.join([*HOST_LINK, *DEFAULT_LOAD_GBPS])}) or a measured one",
                f'give --bandwidth FILE with {{"{name}": GB/s}}',
            )
        codec = codec_cost(codecs[name], measured) if codecs.get(name, "none") != "none" else None
        # seconds per GB brought up from the tier: its read (of fewer bytes, with a codec) and decode
        read = 1 / gbps if codec is None else 1 / (gbps * codec.ratio) + 1 / codec.decode_gbps
        if host is None:
            host = gbps if kind in HOST_LINK else gpu.pcie_gbps
            effective = gbps if kind in HOST_LINK else 1 / (read + 1 / host)
        else:
            effective = 1 / (read + 1 / host)
        speeds.append(TierSpeed(name, kind, gbps, effective, source, codec))
    return speeds


@dataclass(frozen=True)
class CostModel:
    """The engine's model on a GPU over a stack's tiers: seconds of prefill and of loads."""

    model: EngineModel
    gpu: GPUSpec
    #: tier name -> its speed (the CPU tier and every lower tier of the stack)
    tiers: Mapping[str, TierSpeed]

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """GPU seconds to prefill ``tokens`` tokens after ``cached`` cached ones."""
        if tokens <= 0:
            return 0.0
        if self.gpu.prefill_tokens_per_s:
            return tokens / self.gpu.prefill_tokens_per_s
        compute = self.model.prefill_flops(tokens, cached) / (self.gpu.tflops * 1e12 * self.gpu.mfu)
        weights = self.model.weight_bytes / (self.gpu.hbm_gbps * 1e9)
        return max(compute, weights)

    def load_seconds(self, tier: str, tokens: int) -> float:
        """Seconds to bring ``tokens`` tokens' KV from ``tier`` into GPU memory (0 for ``gpu``)."""
        if tier == "gpu" or tokens <= 0:
            return 0.0
        return tokens * self.model.kv_bytes_per_token / (self.tiers[tier].effective_gbps * 1e9)

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        """Prefill rate over a whole prompt of ``prompt_tokens`` (the measured rate if given)."""
        if self.gpu.prefill_tokens_per_s:
            return self.gpu.prefill_tokens_per_s
        return self.gpu.tflops * 1e12 * self.gpu.mfu / self.model.prefill_flops_per_token(prompt_tokens)

    def break_even_gbps(self, prompt_tokens: int) -> float:
        """The load speed at which loading a token's KV takes as long as computing it."""
        return self.model.kv_bytes_per_token * self.prefill_tokens_per_s(prompt_tokens) / 1e9

    def break_even(self, prompt_tokens: int) -> dict[str, Any]:
        """The break-even figure and, per tier, its effective speed and whether it is below."""
        needed = self.break_even_gbps(prompt_tokens)
        return {
            "prompt_tokens": prompt_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s(prompt_tokens),
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "break_even_gbps": needed,
            "tiers": {
                name: {
                    "kind": speed.kind,
                    "gbps": speed.gbps,
                    "effective_gbps": speed.effective_gbps,
                    "speedup_vs_recompute": speed.effective_gbps / needed,
                    "below_break_even": speed.effective_gbps < needed,
                    "source": speed.source,
                    **_codec_figures(speed),
                }
                for name, speed in self.tiers.items()
            },
        }

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.describe(), "gpu": self.gpu.describe()}


def _codec_figures(speed: TierSpeed) -> dict[str, Any]:
    """A tier's codec in the break-even record: name, ratio, decode speed, and whether it
    makes loads slower than no codec would (the tier reads faster than the codec pays off)."""
    codec = speed.codec
    if codec is None:
        return {}
    loses_above = speed.codec_loses_above_gbps
    return {
        "codec": codec.name,
        "codec_ratio": codec.ratio,
        "decode_gbps": codec.decode_gbps,
        "codec_loses_above_gbps": loses_above,
        "codec_slows_loads": loses_above is not None and speed.gbps > loses_above,
        "codec_source": codec.source,
    }
