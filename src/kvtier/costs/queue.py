"""A discrete-event model of the GPU's prefill queue: one server, first come first served.

Each request arrives at its trace timestamp and waits for the requests before it; its
service is its hits' load time (from the tier that served each block) plus its missed
tokens' prefill; its time to first token is its finish minus its arrival. Modelled: the
queue. Not modelled: batching (requests prefilled together share a forward pass), decode
steps interleaved with prefills, loads overlapping other requests' compute, chunked prefill.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.costs.timing import CostModel

__all__ = ["QueueResult", "percentile", "request_service", "run_queue"]

#: the trace format's tokens per block (Mooncake ``hash_ids``)
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class QueueResult:
    """TTFT per request, and where the GPU's time went."""

    ttft_s: list[float]
    #: seconds the GPU spent computing prefills
    compute_s: float
    #: seconds of loads (on the request's path, so the server is busy through them)
    load_s: float
    #: the last request's finish, seconds from the first arrival
    makespan_s: float

    def summary(self) -> dict[str, float]:
        return {
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p90_s": percentile(self.ttft_s, 90),
            "ttft_p99_s": percentile(self.ttft_s, 99),
            "ttft_mean_s": sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0,
            "gpu_seconds": self.compute_s,
            "load_seconds": self.load_s,
            "makespan_s": self.makespan_s,
        }


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``share``% at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(share / 100 * len(ordered)))
    return ordered[rank - 1]


def request_service(
    cost: CostModel, input_tokens: int, served: Mapping[str, int], block_tokens: int = BLOCK_TOKENS
) -> tuple[float, float]:
    """``(load seconds, compute seconds)`` of one request whose blocks came from ``served``
    (block counts by source: ``gpu``, a tier's name, ``computed``; hits lead, in any order
    of sources, as a prefix).

    The hit blocks are the prompt's first ones; the last block may be partial (``input_tokens``
    need not be a multiple of ``block_tokens``). At least one token is computed, as an engine
    recomputes a prompt's last token to get its logits when every block hits.
    """
    hit_blocks = sum(count for source, count in served.items() if source != "computed")
    full = (input_tokens + block_tokens - 1) // block_tokens
    hit_tokens = min(hit_blocks * block_tokens, input_tokens) if hit_blocks < full else input_tokens
    load = 0.0
    left = hit_tokens
    for source, count in served.items():
        if source in ("gpu", "computed") or not count:
            continue
        tokens = min(count * block_tokens, left)
        load += cost.load_seconds(source, tokens)
        left -= tokens
    cached = min(hit_tokens, max(0, input_tokens - 1))
    return load, cost.prefill_seconds(input_tokens - cached, cached)


def run_queue(arrivals_s: Sequence[float], services: Sequence[tuple[float, float]]) -> QueueResult:
    """Serve each request (``(load s, compute s)``) at its arrival, first come first served."""
    finish = 0.0
    ttft: list[float] = []
    compute_total = load_total = 0.0
    start_time = min(arrivals_s) if arrivals_s else 0.0
    for arrival, (load, compute) in sorted(zip(arrivals_s, services), key=lambda pair: pair[0]):
        start = max(arrival, finish)
        finish = start + load + compute
        ttft.append(finish - arrival)
        compute_total += compute
        load_total += load
    return QueueResult(ttft, compute_total, load_total, finish - start_time)
