"""`make bench`: run every benchmark in this folder, each printing ratios against a peer tool run
side by side in the same process (the machines are shared and noisy, so only ratios are meaningful)."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["fetch", "verify", "bundle"]


def main() -> int:
    names = sys.argv[1:] or BENCHMARKS
    for name in names:
        print(f"\n=== bench: {name} ===", flush=True)
        importlib.import_module(f"tests.bench.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
