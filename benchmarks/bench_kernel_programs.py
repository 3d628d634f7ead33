"""How many programs (SMs) the kernel copy engine needs, and what it costs the model. CUDA only.

    python benchmarks/bench_kernel_programs.py [--json] [--programs 1,2,4,8,12,16,32,64,all]
                                               [--runs 5] [--layers 32]

Part one, throughput. For 16 KiB and 64 KiB pages, jobs of 32 and 256 blocks, both
directions: the median time of one job through the real handlers (``transfer_async`` to
``wait``, as ``kvtier bench transfer`` times them) on the kernel engine at each program count,
and, measured in the same rounds, the DMA engine (``cuMemcpyBatchAsync``) and one contiguous
pinned copy of the same bytes (the baseline every ratio is taken against). ``best_programs``
is the smallest count within 5% of the fastest, the figure :data:`PROGRAMS` should follow.

Part two, what the copies take from the model. Matrix products (bf16, 8192 cubed) run on the
compute stream alone, then again while store or load jobs of 256 blocks run beside them on
the copy stream, both released at once by a wait queued on the compute stream first;
``compute_slowdown`` is the products' time with copies over their time alone (1.0: the
copies cost the model nothing), and ``copies_outlasted`` says whether the copies were still
running when the products ended (if not, the figure understates the cost). Measured for DMA and for the kernel at
:data:`PROGRAMS` and at one program per SM.

Prints a table per part, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import sys
from statistics import median
from typing import Any

import numpy as np
import torch

from kvtier.bench.report import print_json, print_table
from kvtier.bench.transfer import Clock, fill_layer
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.cpu.region import SharedRegion
from kvtier.worker.canonical import canonicalize
from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers
from kvtier.worker.engines.kernel import PROGRAMS

KiB = 1024
PAGES = (16 * KiB, 64 * KiB)
BATCHES = (32, 256)
NEAR_BEST = 0.95
PRODUCTS = 16  # matrix products per interference measurement (about 25 ms on an H100)
BESIDE_BYTES = 2 << 30  # bytes copied beside them (about 40 ms over PCIe 5)
GATE_CYCLES = 200_000_000  # a compute-stream wait (about 0.1 s) while the copies are queued


class Setup:
    """One page size's GPU layers, pinned CPU rows, and a DMA and a kernel handler pair."""

    def __init__(self, page: int, layers: int, num_blocks: int):
        self.page = page
        self.block_bytes = layers * page
        self.caches = [
            torch.empty((num_blocks, page), dtype=torch.int8, device="cuda") for _ in range(layers)
        ]
        for index, layer in enumerate(self.caches):
            fill_layer(layer, index, torch)
        kv = canonicalize(self.caches)
        self.region = SharedRegion.create(num_blocks, self.block_bytes)
        self.region.pin("on")
        self.dma = CpuGpuOffloadingHandlers(kv, self.region, 1, engine="cuda")
        self.kernel = CpuGpuOffloadingHandlers(kv, self.region, 1, engine="kernel")
        self.host = self.dma.buffers.cpu
        self.device_buffer = torch.empty(num_blocks * self.block_bytes, dtype=torch.int8, device="cuda")
        rng = np.random.default_rng(0)
        self.store_ids = rng.permutation(num_blocks)
        self.load_ids = rng.permutation(num_blocks)
        self.job_ids = iter(range(1 << 62))

    def submit(self, pair: CpuGpuOffloadingHandlers, count: int, store: bool) -> tuple:
        """Queue one job of ``count`` blocks through ``pair``; return (handler, job id)."""
        rows = CPULoadStoreSpec(np.arange(count))
        job_id = next(self.job_ids)
        if store:
            handler = pair.gpu_to_cpu_handler
            spec = (GPULoadStoreSpec(self.store_ids[:count], [count]), rows)
        else:
            handler = pair.cpu_to_gpu_handler
            spec = (rows, GPULoadStoreSpec(self.load_ids[:count], [count]))
        if not handler.transfer_async(job_id, spec):
            raise RuntimeError(f"job {job_id} was not queued")
        return handler, job_id

    def job(self, pair: CpuGpuOffloadingHandlers, count: int, store: bool) -> None:
        """One job, to completion; raises unless it succeeded."""
        handler, job_id = self.submit(pair, count, store)
        finish(handler, [job_id])

    def baseline(self, count: int, store: bool) -> None:
        nbytes = count * self.block_bytes
        if store:
            self.host[:nbytes].copy_(self.device_buffer[:nbytes], non_blocking=True)
        else:
            self.device_buffer[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def close(self) -> None:
        self.kernel.shutdown()
        self.dma.shutdown()
        self.region.close()


def finish(handler: Any, job_ids: list[int]) -> None:
    """Wait for the jobs (all on ``handler``); raise unless each finished cleanly."""
    handler.wait(set(job_ids))
    results = handler.get_finished()
    if sorted(r.job_id for r in results) != sorted(job_ids) or not all(r.success for r in results):
        raise RuntimeError(f"jobs {job_ids} did not finish cleanly: {results}")


def set_programs(setup: Setup, programs: int) -> None:
    for handler in (setup.kernel.gpu_to_cpu_handler, setup.kernel.cpu_to_gpu_handler):
        handler.engine.programs = programs


def throughput(setup: Setup, programs: list[int], runs: int, clock: Clock) -> list[dict]:
    rows = []
    for count in BATCHES:
        nbytes = count * setup.block_bytes
        for store in (True, False):
            timed = {
                "baseline": lambda count=count, store=store: setup.baseline(count, store),
                "dma": lambda count=count, store=store: setup.job(setup.dma, count, store),
            }
            for p in programs:
                timed[p] = lambda p=p, count=count, store=store: (
                    set_programs(setup, p),
                    setup.job(setup.kernel, count, store),
                )
            seconds = {key: [] for key in timed}
            for _ in range(runs):  # interleaved rounds: drift hits every variant alike
                for key, action in timed.items():
                    seconds[key].append(clock.time(action))
            gbps = {key: nbytes / median(values) / 1e9 for key, values in seconds.items()}
            kernel = {p: gbps[p] for p in programs}
            fastest = max(kernel.values())
            best = min(p for p in programs if kernel[p] >= NEAR_BEST * fastest)
            rows.append(
                {
                    "page_bytes": setup.page,
                    "batch_blocks": count,
                    "direction": "d2h" if store else "h2d",
                    "baseline_gbps": gbps["baseline"],
                    "dma_ratio": gbps["dma"] / gbps["baseline"],
                    "kernel_ratio": {str(p): kernel[p] / gbps["baseline"] for p in programs},
                    "best_programs": best,
                    "best_kernel_ratio": kernel[best] / gbps["baseline"],
                }
            )
    return rows


def interference(setup: Setup, sms: int, runs: int) -> list[dict]:
    """The products' time beside copies over their time alone, per engine and direction."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.current_stream()
    # jobs of 256 blocks, enough of them to outlast the products at PCIe speed
    copies = max(1, BESIDE_BYTES // (256 * setup.block_bytes))

    def products(beside=None) -> tuple[float, bool]:
        """The products' time in ms, and whether copies were still running when they ended."""
        torch.cuda.synchronize()
        # A gate on the compute stream: every job queued now waits for it (a job waits for
        # the compute stream's earlier work), so copies and products start together when it
        # opens, however long the host takes to plan and submit the jobs.
        torch.cuda._sleep(GATE_CYCLES)
        pair, store = beside or (None, True)
        jobs = [setup.submit(pair, 256, store) for _ in range(copies)] if beside else []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for _ in range(PRODUCTS):
            torch.mm(a, b)
        end.record(compute)
        end.synchronize()
        outlasted = False
        if jobs:
            handler = jobs[0][0]
            done_early = handler.get_finished()  # polls only: what ended before the products
            outlasted = len(done_early) < len(jobs)
            if not all(r.success for r in done_early):
                raise RuntimeError(f"a copy beside the products failed: {done_early}")
            left = [job_id for _, job_id in jobs if job_id not in {r.job_id for r in done_early}]
            if left:
                finish(handler, left)
        return start.elapsed_time(end), outlasted

    products()  # warm-up: cuBLAS picks its kernel
    alone = median(products()[0] for _ in range(runs))
    rows = []
    engines = [("dma", setup.dma, None), ("kernel", setup.kernel, PROGRAMS), ("kernel", setup.kernel, sms)]
    for name, pair, programs in engines:
        if programs is not None:
            set_programs(setup, programs)
        for store in (True, False):
            measured = [products((pair, store)) for _ in range(runs)]
            rows.append(
                {
                    "page_bytes": setup.page,
                    "engine": name,
                    "programs": programs,
                    "direction": "d2h" if store else "h2d",
                    "compute_slowdown": median(ms for ms, _ in measured) / alone,
                    # False: the copies ended first, so the slowdown is diluted
                    "copies_outlasted": all(outlasted for _, outlasted in measured),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--programs", default="1,2,4,8,12,16,32,64,all")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernel_programs: needs a CUDA device (it times a GPU kernel)", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernel_programs: needs Triton (pip install triton)", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        programs = sorted({sms if p == "all" else int(p) for p in args.programs.split(",")})
    except ValueError:
        parser.error(f"--programs: a comma-separated list of counts or 'all', got {args.programs!r}")
    if programs[0] < 1 or args.runs < 1 or args.layers < 1:
        parser.error("--programs, --runs and --layers must be >= 1")

    clock = Clock(torch, True)
    speed, cost = [], []
    for page in PAGES:
        setup = Setup(page, args.layers, max(BATCHES))
        try:
            for store in (True, False):  # first use of every path, untimed
                setup.job(setup.dma, max(BATCHES), store)
                setup.job(setup.kernel, max(BATCHES), store)
                setup.baseline(max(BATCHES), store)
            speed += throughput(setup, programs, args.runs, clock)
            cost += interference(setup, sms, args.runs)
        finally:
            setup.close()
            del setup
            gc.collect()
    record = {
        "bench": "kernel_programs",
        "device": torch.cuda.get_device_name(),
        "sms": sms,
        "default_programs": PROGRAMS,
        "layers": args.layers,
        "runs": args.runs,
        "throughput": speed,
        "interference": cost,
    }
    out = sys.stdout
    if not args.json:
        flat = [
            {
                **{k: v for k, v in row.items() if k != "kernel_ratio"},
                **{f"p{p}": ratio for p, ratio in row["kernel_ratio"].items()},
            }
            for row in speed
        ]
        print_table(flat, list(flat[0]), out)
        print_table(cost, list(cost[0]), out)
    print_json(record, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
