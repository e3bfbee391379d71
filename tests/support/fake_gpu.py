"""A stand-in `nvidia-smi` for doctor tests: `install(bin_dir, gpus, cuda)` writes bin_dir/nvidia-smi.

It answers the two questions mm asks: `--query-gpu=index,name,compute_cap,driver_version --format=csv,noheader`
(one line per GPU) and plain `nvidia-smi` (the header with `Driver Version` and `CUDA Version`, like the real one).
Anything else exits 2, so a test notices when mm asks something the stand-in does not model.
"""
from __future__ import annotations

import shlex
from pathlib import Path

B300 = ("NVIDIA B300 SXM6 AC", "10.3", "590.48.01")
H100 = ("NVIDIA H100 80GB HBM3", "9.0", "590.48.01")
QUERY = "--query-gpu=index,name,compute_cap,driver_version"
MIG_QUERY = "--query-gpu=index,mig.mode.current"


def install(bin_dir: Path, gpus: list[tuple[str, str, str]], cuda: str = "13.4", mig: list[str] | None = None) -> Path:
    """MIG: each GPU's mig.mode.current (Enabled, Disabled, or [N/A] on a GPU without MIG); default Disabled."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    rows = "\n".join(f"{i}, {name}, {cc}, {driver}" for i, (name, cc, driver) in enumerate(gpus))
    migs = "\n".join(f"{i}, {m}" for i, m in enumerate(mig or ["Disabled"] * len(gpus)))
    driver = gpus[0][2] if gpus else "?"
    header = (f"+-----------------------------------------------------------------------------------------+\n"
              f"| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |\n"
              f"+-----------------------------------------------------------------------------------------+")
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n"
                   f'if [ "$*" = {shlex.quote(QUERY + " --format=csv,noheader")} ]; then printf "%s\\n" {shlex.quote(rows)}\n'
                   f'elif [ "$*" = {shlex.quote(MIG_QUERY + " --format=csv,noheader")} ]; then printf "%s\\n" {shlex.quote(migs)}\n'
                   f'elif [ $# -eq 0 ]; then printf "%s\\n" {shlex.quote(header)}\n'
                   'else echo "fake nvidia-smi: unsupported arguments: $*" >&2; exit 2\nfi\n')
    exe.chmod(0o755)
    return exe
