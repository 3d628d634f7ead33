"""``kvtier soak``: mixed load over a CPU + disk stack with faults injected on a schedule.

:mod:`kvtier.soak.blocks` makes keys and self-checking payloads, :mod:`kvtier.soak.store_process`
runs the processes that are killed or share a store, :mod:`kvtier.soak.run` drives the soak.
"""

__all__: list[str] = []
