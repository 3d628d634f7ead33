"""Write the synthetic Mooncake-format trace used to check policies off the bundled trace.

    python benchmarks/synthetic_trace.py OUT.jsonl [--requests 6000] [--seed 1]
    kvtier plan OUT.jsonl --capacities 250 500 1000 2000 5000 10000 20000

See ``kvtier.plan.synthetic`` for its shape.
"""

import argparse

from kvtier.plan.synthetic import write_synthetic_trace

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(write_synthetic_trace(args.out, args.requests, args.seed))
