"""Memory and time of mm's local commands on a revision of very many tiny files, beside tar on the same tree.

The tree: MM_BENCH_FILES files (default 120,000) of ~12 bytes, 1,000 to a directory, made once under
MM_BENCH_DIR (default bench-work/manyfiles; a tmpfs there keeps the disk out of the figures). Then, once each,
`mm manifest`, `mm verify`, `mm bundle` (one volume, no mm inside), `mm unbundle` and `tar -cf` / `tar -xf` of
the same tree. Printed for each: wall seconds, peak RSS (/usr/bin/time, tests/bench/common.run_usage) and the
peak RSS per file above mm's start-up RSS (`mm --help`), the share of the local memory bound (docs/memory.md: a
per-file budget over a fixed floor, since mm keeps a record per file) and the multiple of tar's peak RSS.
Not in `make bench`'s default list: a million files take tens of minutes.
Environment: MM_BENCH_FILES, MM_BENCH_DIR, MM_BENCH_KEEP=1 keeps the tree and the outputs,
MM_BENCH_STEPS (a comma list of manifest, verify, bundle, unbundle, tar; default all) runs only those steps, one
command at a time (bundle needs manifest's output, unbundle bundle's: a step list keeps the outputs),
MM_BENCH_MM: the mm to measure (default the one beside this Python), e.g. a wrapper around another checkout.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from tests.bench.common import bench_dir, load_average, run_usage

MM = (os.environ.get("MM_BENCH_MM") or (str(Path(sys.executable).parent / "mm")
                                         if (Path(sys.executable).parent / "mm").exists() else shutil.which("mm") or "mm"))
STEPS = ("manifest", "verify", "bundle", "unbundle", "tar")
FILES = int(os.environ.get("MM_BENCH_FILES", "120000"))
PER_DIR = 1000
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
LOCAL_FLOOR = 150 * 10**6  # the bound mm holds for network work, whatever a server sends (README, "Bounds")
PER_FILE = 3000  # bytes of peak RSS a file may add to local work (docs/memory.md: mm's own margin over the worst measured)


def make_tree(root: Path, files: int) -> None:
    """FILES tiny JSON files under ROOT (kept when a tree of that count is there)."""
    stamp = root.with_name(root.name + ".count")
    if stamp.is_file() and stamp.read_text() == str(files):
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for d in range(0, files, PER_DIR):
        folder = root / f"d{d // PER_DIR:05d}"
        folder.mkdir()
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(d, min(d + PER_DIR, files)):
                fd = os.open(f"f{i:07d}.json", flags, 0o644, dir_fd=dir_fd)
                os.write(fd, b'{"i": %d}\n' % i)
                os.close(fd)
        finally:
            os.close(dir_fd)
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
    steps = [s.strip() for s in os.environ.get("MM_BENCH_STEPS", ",".join(STEPS)).split(",") if s.strip()]
    if unknown := set(steps) - set(STEPS):
        sys.exit(f"MM_BENCH_STEPS: unknown step(s) {sorted(unknown)}; choose from {', '.join(STEPS)}")
    for d, step in ((out, "bundle"), (dest, "unbundle"), (tar_out, "tar")):
        if step in steps:
            shutil.rmtree(d, ignore_errors=True)
    out.mkdir(exist_ok=True)
    tar_out.mkdir(exist_ok=True)
    env = {**os.environ, "MM_BUNDLE_NO_MM": "1"}
    floor = run_usage([MM, "--help"], stats, env).peak_rss
    runs = [  # tar first: each mm figure is printed beside its peer's (reading the tree, or writing one)
        ("tar", "tar -cf", ["tar", "-cf", str(work / "tree.tar"), "-C", str(tree), "."]),
        ("tar", "tar -xf", ["tar", "-xf", str(work / "tree.tar"), "-C", str(tar_out)]),
        ("manifest", "mm manifest", [MM, "manifest", str(tree), "--repo", "bench/many-files", "--revision", COMMIT,
                                     "--json"]),
        ("verify", "mm verify", [MM, "verify", str(tree), "--json"]),
        ("bundle", "mm bundle", [MM, "bundle", str(tree), "--out", str(out), "--volume-size", "1T", "--name", "many",
                                 "--json"]),
        ("unbundle", "mm unbundle", [MM, "unbundle", str(out), "--dest", str(dest), "--json"]),
    ]
    peer = {"mm manifest": "tar -cf", "mm verify": "tar -cf", "mm bundle": "tar -cf", "mm unbundle": "tar -xf"}
    bound = LOCAL_FLOOR + PER_FILE * FILES
    peaks: dict[str, int] = {}
    worst = 0.0
    for step, name, argv in runs:
        if step not in steps:
            continue
        u = run_usage(argv, stats, env)
        peaks[name] = u.peak_rss
        per_file = max(0, u.peak_rss - floor) / FILES
        against = ""
        if name.startswith("mm"):
            worst = max(worst, per_file)
            against = f"  {u.peak_rss / bound:4.0%} of the bound, {'within' if u.peak_rss <= bound else 'OVER'}"
            if peer[name] in peaks:
                against += f"; {u.peak_rss / peaks[peer[name]]:.0f}x {peer[name]}"
        print(f"  {name:<12} {u.seconds:8.1f} s  peak RSS {u.peak_rss / 1e6:7.1f} MB  "
              f"({per_file:6.0f} B/file over mm's start-up {floor / 1e6:.0f} MB)  cpu {u.user + u.sys:.1f} s"
              f"{against}", flush=True)
    print(f"  worst mm command: {worst:.0f} B/file; bound {LOCAL_FLOOR / 1e6:.0f} MB + {PER_FILE} B/file = "
          f"{bound / 1e6:.0f} MB at {FILES} files", flush=True)
    if os.environ.get("MM_BENCH_KEEP") != "1" and "MM_BENCH_STEPS" not in os.environ:
        for d in (out, dest, tar_out, work / "tree.tar"):
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
