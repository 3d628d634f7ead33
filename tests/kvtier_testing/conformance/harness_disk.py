"""Conformance harnesses of the disk kinds, ``lmdb`` and ``files``.

Damage is done to the real files (``kvtier_testing.store.locate`` finds a block's bytes); a full
disk is a real 4 MiB tmpfs that another file fills, a dead disk a real ext4 stopped with
``EXT4_IOC_SHUTDOWN`` (``kvtier_testing/fault_fs.py``; both need root and skip without it).
"""

from __future__ import annotations

import os
import threading
from typing import ClassVar

import xxhash
from kvtier_testing.fault_fs import ext4, tmpfs
from kvtier_testing.fault_fs import fill as fill_filesystem
from kvtier_testing.fault_fs import shutdown as shutdown_filesystem
from kvtier_testing.store import flip, locate
from kvtier_testing.conformance.tier_harness import Harness, register

from kvtier.tiers.disk.blockio import aligned_buffer
from kvtier.tiers.disk.format import (
    HEADER_BYTES,
    LayoutFingerprint,
    decode_header,
    encode_header_into,
    on_disk_block_bytes,
)

#: how long a held read waits at most for its release (a test that forgets fails, never hangs)
HOLD_LIMIT_S = 30.0


class DiskHarness(Harness):
    counters: ClassVar[dict[str, str | None]] = {
        "stored": "stored",
        "loaded": "loaded",
        "missing": "missing",
        "corrupt": "corrupt",
        "failed": "failed_keys",
        "full": "failed_ENOSPC",
        "down": "failed_EIO",
        "stored_bytes": "codec_stored_bytes",
    }

    def __init__(self, request, tmp_path):
        super().__init__(request, tmp_path)
        self.root = tmp_path
        self._filler = None
        self._gate: threading.Event | None = None

    def place(self, scenario: str) -> None:
        super().place(scenario)
        if scenario == "replay down":
            self.cannot(
                "a dead disk under replay",
                "a stopped filesystem fails the store's open, an error at "
                "start (a replay cannot stop it mid-run)",
            )
        if scenario == "full":
            self.root = self.exits.enter_context(tmpfs(self.tmp_path / "mnt", "4m"))
        elif scenario == "down":
            self.root = self.exits.enter_context(ext4(self.tmp_path / "ext4.img", self.tmp_path / "mnt"))

    def section(self, blocks: int, block_bytes: int) -> dict:
        return {
            "kind": self.kind,
            "path": str(self.root / "store"),
            "fsync": "batch",
            "threads": 2,
            "capacity": blocks * on_disk_block_bytes(block_bytes),
        }

    # -- damage ----------------------------------------------------------------------------------

    def victim(self, tier, keys):
        if tier.kind == "lmdb":  # the block lying last in the slab: cutting the slab hits it alone
            return max(keys, key=lambda k: locate(tier, k)[1])
        return super().victim(tier, keys)

    def remove(self, tier, keys):
        if tier.kind == "lmdb":  # the index entry goes, as another process's eviction does
            with tier._env.begin(write=True) as txn:
                for k in keys:
                    assert txn.delete(k, db=tier._blocks)
        else:
            for k in keys:
                os.unlink(tier._shown(tier._path_of(k, tier._policy.get(k))))

    def corrupt(self, tier, keys):
        for k in keys:
            path, offset = locate(tier, k)
            with open(path, "rb") as stream:  # the payload stored: shorter than a block with a codec
                stream.seek(offset)
                header = decode_header(stream.read(HEADER_BYTES))
            assert not isinstance(header, str)
            flip(path, offset + HEADER_BYTES + header.payload_bytes // 2)

    def truncate(self, tier, keys):
        for k in keys:
            path, offset = locate(tier, k)
            os.truncate(path, offset + HEADER_BYTES + 100)

    def relayout(self, tier, keys):
        other = LayoutFingerprint(
            model="another-model",
            dtype="bfloat16",
            tokens_per_block=16,
            page_bytes=(tier.block_bytes,),
            rank=0,
            world_size=1,
            block_bytes=tier.block_bytes,
        )
        for k in keys:
            path, offset = locate(tier, k)
            with open(path, "rb") as stream:
                stream.seek(offset + HEADER_BYTES)
                body = stream.read(tier.block_bytes)
            page = aligned_buffer(HEADER_BYTES)
            encode_header_into(
                page,
                layout_digest=other.digest(),
                key=k,
                payload_bytes=tier.block_bytes,
                checksum=xxhash.xxh3_64_intdigest(body),
            )
            with open(path, "r+b") as stream:
                stream.seek(offset)
                stream.write(page[:])

    def listed(self, tier):
        return list(tier._policy)

    # -- the medium disturbed --------------------------------------------------------------------

    def go_down(self, tier):
        shutdown_filesystem(self.root)  # every I/O on it is EIO from now on

    def come_back(self, tier):
        return False  # a stopped ext4 needs an unmount and e2fsck: a restart, not this tier

    def hang(self, tier):
        self.cannot("timeout", f"{self.kind} is a local disk with no timeout (a held read waits: slow read)")

    def fill(self, tier):
        self._filler = fill_filesystem(self.root)

    def unfill(self, tier):
        os.unlink(self._filler)

    def hold_reads(self, tier):
        # The tier's reads queue on its I/O threads as usual; each one waits at the gate before
        # it touches the file, as behind a device that takes its time.
        gate = self._gate = threading.Event()
        read = tier._load_block

        def held(job, index):
            gate.wait(HOLD_LIMIT_S)
            return read(job, index)

        tier._load_block = held

    def release_reads(self, tier):
        self._gate.set()


@register
class LMDBHarness(DiskHarness):
    kind = label = "lmdb"


@register
class FilesHarness(DiskHarness):
    kind = label = "files"
