"""Each lower-tier codec's ratio and encode/decode GB/s on one core, against memcpy, same run.

    python benchmarks/bench_codec.py [--json] [--codecs lossless int8 ...] [--block-bytes N ...]
        [--mib 32] [--rounds 5] [--dtype bfloat16]
    python benchmarks/bench_codec.py --model smollm2 [--json] [--codecs ...] [--rounds 5]

The same as ``kvtier bench codec``; see ``kvtier.bench.codec`` for the protocol (synthetic bf16
KV; GB/s per CPU-second of the measuring thread, at 64 KiB, 512 KiB and 2 MiB blocks, so how
the cost grows with the block shows), and ``kvtier.bench.codec_model`` for ``--model`` (the
model's own KV blocks, and each codec's KL, perplexity change and top-1 agreement with a
prefix stored in a files tier through the codec and loaded back). Prints a table; the JSON
line with ``--json``.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "codec", *sys.argv[1:]], table_and_json=True))
