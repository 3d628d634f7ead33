"""Worker processes standing in for the ranks of a tensor/pipeline-parallel engine.

Each rank is a real process (multiprocessing, ``spawn``: nothing inherited from the test
process, as with vLLM's workers) with its own stand-in GPU cache of CPU tensors. It builds
:class:`kvtier.TieredOffloadingSpec` with its own ``rank``, attaches to the CPU tier's shared
region by path and runs store and load jobs on its :class:`kvtier.worker.OffloadingWorker`,
told what to do over a pipe. The test process is the scheduler: it holds the manager and
combines the ranks' results with :class:`kvtier.worker.RankResultAggregator`.

What a rank's cache holds is derived from (tag, shard, layer): ranks with the same shard (the
replicas of an MLA cache) hold the same bytes, different shards different bytes, and the test
process can compute every expected byte without asking a rank.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import traceback
from collections.abc import Sequence

import numpy as np

#: bytes per GPU block of the stand-in cache's two layers (unequal, so tensor offsets matter)
PAGES = (1024, 3072)
GPU_BLOCK_TOKENS = 16
#: GPU blocks per offloaded block (block_size_tokens = 32)
FACTOR = 2
NUM_GPU_BLOCKS = 40


def chunk_bytes(tag: int, shard: int, layer: int) -> np.ndarray:
    """The bytes one layer of one rank's shard holds for block ``tag``: FACTOR pages."""
    seed = hashlib.blake2b(f"{tag}/{shard}/{layer}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.integers(0, 256, FACTOR * PAGES[layer], dtype=np.uint8)


def expected_row(tag: int, num_shards: int) -> np.ndarray:
    """A whole CPU row of block ``tag``, written from the layout the docs describe: the
    shards side by side, each one layer after the other, each layer FACTOR pages."""
    return np.concatenate(
        [chunk_bytes(tag, shard, layer) for shard in range(num_shards) for layer in range(len(PAGES))]
    )


class _Rank:
    """One rank's state inside its process."""

    def __init__(self) -> None:
        self.layers = None
        self.spec = None
        self.worker = None
        self.kwargs: dict = {}

    def configure(self, config, world_size: int, rank: int, kv_replicas: int, device: str = "cpu") -> dict:
        import torch

        if device == "cuda":  # a GPU per rank where there are several (one machine: all on 0)
            device = f"cuda:{rank % torch.cuda.device_count()}"
        self.layers = [torch.zeros((NUM_GPU_BLOCKS, page), dtype=torch.int8, device=device) for page in PAGES]
        self.kwargs = dict(
            config=config,
            gpu_block_size_tokens=GPU_BLOCK_TOKENS,
            page_bytes=list(PAGES),
            world_size=world_size,
            rank=rank,
            kv_replicas=kv_replicas,
            engine="auto",  # CPU tensors: the copy thread; CUDA tensors: CUDA streams
        )
        self._attach()
        (handlers,) = self.spec._handler_sets  # built by the worker above
        return {
            "shard": self.spec.shard.shard,
            "writes": self.spec.shard.writes,
            "pinned": handlers.region.pinned,
        }

    def _attach(self) -> None:
        from kvtier import TieredOffloadingSpec
        from kvtier.worker import OffloadingWorker, canonicalize

        self.spec = TieredOffloadingSpec(**self.kwargs)
        self.worker = OffloadingWorker.from_spec(self.spec, canonicalize(self.layers))

    def restart(self) -> None:
        """What an engine restart does to this rank: handlers gone, region detached, the GPU
        cache lost; then a new spec attaches to the new region at the same path."""
        self.worker.shutdown()
        self.spec.shutdown()
        for layer in self.layers:
            layer.zero_()
        self._attach()

    def fill(self, gpu_ids: Sequence[int], tags: Sequence[int]) -> None:
        """Write block ``tags[i]``'s bytes into GPU blocks ``gpu_ids[FACTOR*i : FACTOR*(i+1)]``."""
        import torch

        shard = self.spec.shard.shard
        for i, tag in enumerate(tags):
            ids = list(gpu_ids[FACTOR * i : FACTOR * (i + 1)])
            for layer, (tensor, page) in enumerate(zip(self.layers, PAGES)):
                data = chunk_bytes(tag, shard, layer).view(np.int8).reshape(FACTOR, page)
                tensor[ids] = torch.from_numpy(data.copy()).to(tensor.device)

    def scribble(self, gpu_ids: Sequence[int], value: int) -> None:
        for tensor in self.layers:
            tensor[list(gpu_ids)] = value

    def read(self, gpu_ids: Sequence[int]) -> list[bytes]:
        """Per offloaded block (FACTOR GPU blocks), its bytes in chunk_bytes order per layer."""
        out = []
        for i in range(len(gpu_ids) // FACTOR):
            ids = list(gpu_ids[FACTOR * i : FACTOR * (i + 1)])
            out.append(b"".join(tensor[ids].cpu().numpy().tobytes() for tensor in self.layers))
        return out

    def transfer(self, job_id: int, store: bool, gpu_ids, cpu_ids, fail: bool) -> list[tuple]:
        from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec

        gpu = GPULoadStoreSpec(list(gpu_ids), group_sizes=[len(gpu_ids)])
        cpu = CPULoadStoreSpec(list(cpu_ids))
        if fail:
            self._break_next_job(store)
        spec = (gpu, cpu) if store else (cpu, gpu)
        assert self.worker.transfer_async(job_id, spec)
        self.worker.wait({job_id})
        return [(r.job_id, r.success, r.transfer_size) for r in self.worker.get_finished()]

    def _break_next_job(self, store: bool) -> None:
        """The next job of this direction fails in its copy, as a DMA error would."""
        pair = ("GPU", "CPU") if store else ("CPU", "GPU")
        engine = self.worker._handlers[pair].engine
        original = engine.copy

        def broken(*descriptors):
            engine.copy = original
            raise OSError("injected copy failure")

        engine.copy = broken

    def release(self) -> None:
        """Stop this rank's worker and detach from the region (the next configure starts anew)."""
        if self.worker is not None:
            self.worker.shutdown()
            self.spec.shutdown()
        self.worker = self.spec = None


def rank_main(conn) -> None:
    """The loop of one rank process: (command, kwargs) in, ("ok", value) or ("error", text) out."""
    rank = _Rank()
    while True:
        command, kwargs = conn.recv()
        if command == "exit":
            rank.release()
            conn.send(("ok", None))
            return
        try:
            value = getattr(rank, command)(**kwargs)
            conn.send(("ok", value))
        except BaseException as exc:  # noqa: BLE001 - reported to the test process, which fails
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RankPool:
    """``size`` spawned rank processes, reused by every topology of a test module."""

    def __init__(self, size: int):
        context = multiprocessing.get_context("spawn")
        self.conns = []
        self.processes = []
        for _ in range(size):
            parent, child = context.Pipe()
            process = context.Process(target=rank_main, args=(child,), daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)

    def call(self, ranks: Sequence[int], command: str, per_rank=None, **kwargs) -> list:
        """Send ``command`` to each of ``ranks`` (all at once, so they work in parallel) and
        return their answers in rank order. ``per_rank(r)`` adds rank-specific arguments."""
        for r in ranks:
            extra = per_rank(r) if per_rank is not None else {}
            self.conns[r].send((command, {**kwargs, **extra}))
        answers = []
        for r in ranks:
            status, value = self.conns[r].recv()
            if status != "ok":
                raise AssertionError(f"rank {r} failed {command}: {value}")
            answers.append(value)
        return answers

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            if process.is_alive():
                try:
                    conn.send(("exit", {}))
                    conn.recv()
                except (EOFError, OSError):
                    pass  # the rank died on its own; join (and kill) below reap it
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
