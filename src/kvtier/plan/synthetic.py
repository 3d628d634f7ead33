"""A synthetic Mooncake-format trace of a different shape, to check policies off the bundled one."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_synthetic_trace"]


def write_synthetic_trace(path: str | Path, requests: int = 6000, seed: int = 1) -> Path:
    """Write ``requests`` records mixing three populations; the path.

    * shared system prompts (40 of them, 2-12 blocks) chosen by a Zipf-like law (weight
      1/rank), each followed by a private question of 1-6 blocks, never reused;
    * multi-turn conversations: each turn repeats the whole previous prompt and appends 1-4
      blocks; a conversation lasts 2-10 turns and its turns are spread over the trace,
      interleaved with everything else (so reuse distances vary widely);
    * one-off long documents (20-120 blocks) never seen again, a scan that floods a cache.

    Unlike the bundled trace (long chains with long reuse distances), prefixes here are
    short and hot, and the flood is explicit. Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    prompts = [fresh(rng.randint(2, 12)) for _ in range(40)]
    weights = [1 / (rank + 1) for rank in range(len(prompts))]
    live: list[list[int]] = []  # conversations: their prompt so far
    turns_left: list[int] = []
    records = []
    for index in range(requests):
        kind = rng.random()
        if kind < 0.45:
            chain = rng.choices(prompts, weights)[0] + fresh(rng.randint(1, 6))
        elif kind < 0.85:
            if live and rng.random() < 0.75:
                at = rng.randrange(len(live))
                chain = live[at] = live[at] + fresh(rng.randint(1, 4))
                turns_left[at] -= 1
                if turns_left[at] == 0:
                    live.pop(at)
                    turns_left.pop(at)
            else:
                chain = fresh(rng.randint(2, 8))
                live.append(chain)
                turns_left.append(rng.randint(1, 9))
        else:
            chain = fresh(rng.randint(20, 120))
        records.append(
            {
                "timestamp": index * 100,
                "input_length": 512 * len(chain),
                "output_length": 1,
                "hash_ids": chain,
            }
        )
    path = Path(path)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path
