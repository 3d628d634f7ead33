"""Rewrites the figure tables in the README and docs from the commands that measure them.

Each table sits between ``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->`` and is
rewritten in every file that holds it:

- ``plan-synthetic``, ``plan-conversation`` (docs/policies.md): ``kvtier plan`` on the bundled
  traces, deterministic; ``tests/test_docs.py`` recomputes a row of each and compares it.
- ``replay-exact`` (README.md, docs/getting-started.md): ``kvtier replay --deterministic``,
  which repeats exactly; a slow test recomputes it and compares the whole block.
- ``replay-runs`` (the same files): plain ``kvtier replay`` runs, whose CPU/disk split and
  rate vary from run to run: written as the range seen, dated, with the machine.

``python docs/gen_tables.py [NAME ...]`` rewrites those named (default: all; a few minutes
on 2 cores); ``--check`` only recomputes the deterministic ones and exits 1 naming any that
differ from what is committed.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: where each table is written
FILES = {
    "plan-synthetic": ("docs/policies.md",),
    "plan-conversation": ("docs/policies.md",),
    "replay-exact": ("README.md", "docs/getting-started.md"),
    "replay-runs": ("README.md", "docs/getting-started.md"),
}
#: the sizes each plan table simulates, and the trace it reads
PLAN_TABLES = {
    "plan-synthetic": (None, (500, 1000, 2000, 5000, 10000, 20000)),
    "plan-conversation": ("conversation", (500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)),
}
#: how many plain replays ``replay-runs`` spans
PLAIN_RUNS = 3


def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} .*?-->\n)(.*?)(<!-- end: {re.escape(name)} -->)", re.S
    )


def committed(name: str, path: str) -> str:
    """The text of table ``name`` as committed in ``path`` (between its markers)."""
    found = _block(name).search((ROOT / path).read_text())
    if found is None:
        raise SystemExit(f"{path} has no block {name}: add its two marker lines")
    return found.group(2)


def _write(name: str, body: str) -> None:
    for path in FILES[name]:
        text = (ROOT / path).read_text()
        committed(name, path)  # both markers are there
        (ROOT / path).write_text(_block(name).sub(lambda m: m.group(1) + body + m.group(3), text, count=1))


def plan_record(name: str, capacities: Sequence[int] | None = None, jobs: int = 0) -> dict[str, Any]:
    """``kvtier plan`` of table ``name`` (at ``capacities`` of its sizes, default all; in
    ``jobs`` processes, default one per CPU)."""
    from kvtier.plan.run import plan

    trace, sizes = PLAN_TABLES[name]
    return plan(trace, capacities or sizes, out=io.StringIO(), jobs=jobs or os.cpu_count() or 1)


def plan_rows(record: dict[str, Any]) -> list[str]:
    """One Markdown row per simulated size: each policy's hit ratio (the best in bold), the
    reuse oracle, Belady and the ceiling, as ``kvtier plan`` prints them."""
    policies = list(record["hit_ratio"])
    rows = []
    for i, blocks in enumerate(record["capacities"]):
        ratios = [record["hit_ratio"][policy][i] for policy in policies]
        cells = [f"**{r:.4f}**" if r == max(ratios) else f"{r:.4f}" for r in ratios]
        cells += [f"{record['reuse_oracle'][i]:.4f}", f"{record['opt'][i]:.4f}", f"{record['ceiling']:.4f}"]
        rows.append(f"| {blocks:,} | " + " | ".join(cells) + " |")
    return rows


def plan_table(record: dict[str, Any]) -> str:
    header = ["blocks", *record["hit_ratio"], "reuse oracle", "Belady", "ceiling"]
    return (
        "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *plan_rows(record)]) + "\n"
    )


def replay_record(deterministic: bool) -> dict[str, Any]:
    """``kvtier replay [--deterministic]`` on its defaults, run in a temporary folder."""
    from kvtier.replay.run import replay

    with tempfile.TemporaryDirectory(prefix="kvtier-tables-") as folder:
        here = os.getcwd()
        os.chdir(folder)  # the default stack's disk goes in the working folder
        try:
            return replay(progress=False, out=io.StringIO(), deterministic=deterministic)
        finally:
            os.chdir(here)


def replay_exact(record: dict[str, Any]) -> str:
    """The hits per tier of ``kvtier replay --deterministic``, and what else repeats."""
    refs, ceiling = record["block_refs"], record["ceiling_hit_ratio"]
    kinds = dict(tier.split(":") for tier in record["tiers"])
    rows = [
        f"| tier | hits | share of {refs:,} block refs |",
        "| --- | --- | --- |",
        *(
            f"| {tier}{f' ({kinds[tier]})' if kinds.get(tier, tier) != tier else ''} | {hits:,} | "
            f"{hits / refs:.4f} |"
            for tier, hits in record["hits"].items()
        ),
    ]
    total = sum(record["hits"].values())
    rows.append(
        f"| **all tiers** | **{total:,}** | **{total / refs:.4f} = {record['hit_ratio'] / ceiling:.4f} "
        f"of the {ceiling:.4f} ceiling** (CPU tier alone: {record['cpu_only_hit_ratio']:.4f}) |"
    )
    return "\n".join(rows) + (
        f"\n\n{record['dropped_blocks']:,} blocks dropped while the disk had room, "
        f"{record['corrupt_blocks']:,} corrupt, {record['verified_blocks']:,} loads verified byte "
        "for byte.\n"
    )


def _span(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}-{fmt.format(high)}"


def replay_runs(records: Sequence[dict[str, Any]], when: str) -> str:
    """What plain ``kvtier replay`` runs did: each tier's hits and the rate, as ranges."""
    tiers = ", ".join(f"{tier} {_span([r['hits'][tier] for r in records])}" for tier in records[0]["hits"])
    totals = _span([sum(r["hits"].values()) for r in records])
    return (
        textwrap.fill(
            f"Without `--deterministic` (the command above), {len(records)} runs of `kvtier replay` here "
            f"({when}; 2 cores shared with other jobs, no GPU) gave {tiers} hits, {totals} in all; "
            f"{_span([r['blocks_per_s'] for r in records])} block refs per second "
            f"({_span([r['elapsed_s'] for r in records], '{:.1f}')} s, of which the simulated engine's own "
            f"work {_span([r['engine_s'] for r in records], '{:.1f}')} s).",
            width=95,
        )
        + "\n"
    )


#: the tables: name -> what renders it (the deterministic ones take no date)
def _makers() -> dict[str, Callable[[], str]]:
    when = datetime.date.today().strftime("%Y-%m-%d")
    return {
        "plan-synthetic": lambda: plan_table(plan_record("plan-synthetic")),
        "plan-conversation": lambda: plan_table(plan_record("plan-conversation")),
        "replay-exact": lambda: replay_exact(replay_record(deterministic=True)),
        "replay-runs": lambda: replay_runs([replay_record(False) for _ in range(PLAIN_RUNS)], when),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="of " + ", ".join(FILES) + " (default: all)")
    parser.add_argument(
        "--check", action="store_true", help="compare the deterministic tables, write nothing"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(FILES))
    if unknown:
        parser.error(f"no table {', '.join(unknown)}: give some of {', '.join(FILES)}")
    makers = _makers()
    names = args.names or list(FILES)
    if args.check:
        names = [name for name in names if name != "replay-runs"]
    stale = []
    for name in names:
        body = makers[name]()
        if args.check:
            stale += [path for path in FILES[name] if committed(name, path) != body]
        else:
            _write(name, body)
            print(f"{name}: written to {', '.join(FILES[name])}")
    for path in stale:
        print(f"{path}: a table differs from what its command prints now: run python docs/gen_tables.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
