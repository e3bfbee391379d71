"""Memory and time of mm's local commands on a revision of very many tiny files, beside tar on the same tree.

The tree: MM_BENCH_FILES files (default 120,000) of ~12 bytes, 1,000 to a directory, made once under
MM_BENCH_DIR (default bench-work/manyfiles; a tmpfs there keeps the disk out of the figures). Then, once each,
`mm manifest`, `mm verify`, `mm bundle` (one volume, no mm inside), `mm unbundle` and `tar -cf` / `tar -xf` of
the same tree. Printed for each: wall seconds, peak RSS (/usr/bin/time, tests/bench/common.run_usage) and the
peak RSS per file above mm's start-up RSS (`mm --help`): the local memory bound (docs/memory.md) is a per-file
budget over a fixed floor, since mm's formats (one manifest, one index per volume, each a JSON document of
every file) are read and written whole.
Not in `make bench`'s default list: a million files take tens of minutes.
Environment: MM_BENCH_FILES, MM_BENCH_DIR, MM_BENCH_KEEP=1 keeps the tree and the outputs.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from tests.bench.common import bench_dir, load_average, run_usage

MM = str(Path(sys.executable).parent / "mm")
FILES = int(os.environ.get("MM_BENCH_FILES", "120000"))
PER_DIR = 1000
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
LOCAL_FLOOR = 150 * 10**6  # the bound mm holds for network work, whatever a server sends (README, "Bounds")
PER_FILE = 5000  # bytes of peak RSS a file may add to local work (docs/memory.md: 4.7 KB measured, mm's own margin)


def make_tree(root: Path, files: int) -> None:
    """FILES tiny JSON files under ROOT (kept when a tree of that count is there)."""
    stamp = root.with_name(root.name + ".count")
    if stamp.is_file() and stamp.read_text() == str(files):
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(files):
        if i % PER_DIR == 0:
            (root / f"d{i // PER_DIR:05d}").mkdir()
        with open(root / f"d{i // PER_DIR:05d}" / f"f{i:07d}.json", "w") as f:
            f.write(f'{{"i": {i}}}\n')
    stamp.write_text(str(files))


def main() -> None:
    work = Path(os.environ["MM_BENCH_DIR"]) if os.environ.get("MM_BENCH_DIR") else bench_dir("manyfiles")
    work.mkdir(parents=True, exist_ok=True)
    tree, out, dest, tar_out = work / "tree", work / "volumes", work / "dest", work / "tar-dest"
    stats = work / "time.stats"
    started = time.perf_counter()
    make_tree(tree, FILES)
    print(f"{FILES} files in {tree} (made in {time.perf_counter() - started:.0f} s; "
          f"{os.statvfs(work).f_files - os.statvfs(work).f_ffree} inodes used there); {os.cpu_count()} cores, "
          f"{load_average()}", flush=True)
    for d in (out, dest, tar_out):
        shutil.rmtree(d, ignore_errors=True)
    out.mkdir()
    tar_out.mkdir()
    env = {**os.environ, "MM_BUNDLE_NO_MM": "1"}
    floor = run_usage([MM, "--help"], stats, env).peak_rss
    runs = [
        ("mm manifest", [MM, "manifest", str(tree), "--repo", "bench/many-files", "--revision", COMMIT, "--json"]),
        ("mm verify", [MM, "verify", str(tree), "--json"]),
        ("mm bundle", [MM, "bundle", str(tree), "--out", str(out), "--volume-size", "1T", "--name", "many",
                       "--json"]),
        ("mm unbundle", [MM, "unbundle", str(out), "--dest", str(dest), "--json"]),
        ("tar -cf", ["tar", "-cf", str(work / "tree.tar"), "-C", str(tree), "."]),
        ("tar -xf", ["tar", "-xf", str(work / "tree.tar"), "-C", str(tar_out)]),
    ]
    worst = 0
    for name, argv in runs:
        u = run_usage(argv, stats, env)
        per_file = max(0, u.peak_rss - floor) / FILES
        if name.startswith("mm"):
            worst = max(worst, per_file)
        print(f"  {name:<12} {u.seconds:8.1f} s  peak RSS {u.peak_rss / 1e6:7.1f} MB  "
              f"({per_file:6.0f} B/file over mm's start-up {floor / 1e6:.0f} MB)  cpu {u.user + u.sys:.1f} s",
              flush=True)
    bound = LOCAL_FLOOR + PER_FILE * FILES
    print(f"  worst mm command: {worst:.0f} B/file; bound {LOCAL_FLOOR / 1e6:.0f} MB + {PER_FILE} B/file = "
          f"{bound / 1e6:.0f} MB at {FILES} files", flush=True)
    if os.environ.get("MM_BENCH_KEEP") != "1":
        for d in (out, dest, tar_out, work / "tree.tar"):
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
