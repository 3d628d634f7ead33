"""Each lower-tier codec's ratio and encode/decode GB/s on one core, against memcpy, same run.

    python benchmarks/bench_codec.py [--json] [--codecs lossless int8 ...] [--block-bytes N ...]
        [--mib 32] [--rounds 5] [--dtype bfloat16]

The same as ``kvtier bench codec``; see ``kvtier.bench.codec`` for the protocol (synthetic bf16
KV; GB/s per CPU-second of the measuring thread, at 64 KiB, 512 KiB and 2 MiB blocks, so how
the cost grows with the block shows). Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "codec", *sys.argv[1:]], table_and_json=True))
