"""`make bench`: run every benchmark in this folder, each printing ratios against a peer tool run
side by side in the same process (the machines are shared and noisy, so only ratios are meaningful)."""
from __future__ import annotations

import compileall
import importlib
import sys
from pathlib import Path

from tests.bench.common import bind_mm

BENCHMARKS = ["startup", "fetch", "verify", "bundle", "parity", "oci", "delta", "fleet"]
ON_REQUEST = ["manyfiles"]  # `python -m tests.bench.run manyfiles`: a million tiny files take tens of minutes


def byte_compile_mm() -> None:
    """Time mm as installed: pip byte-compiles what it installs, but these machines set PYTHONDONTWRITEBYTECODE=1,
    so an editable mm would otherwise recompile its own modules on every start (~60 ms, more than its imports)."""
    import mm.cli

    compileall.compile_dir(Path(mm.cli.__file__).parent, quiet=1)  # the installed package (a link tree when editable)


def main() -> int:
    names = sys.argv[1:] or BENCHMARKS
    bind_mm()
    byte_compile_mm()
    for name in names:
        print(f"\n=== bench: {name} ===", flush=True)
        importlib.import_module(f"tests.bench.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
