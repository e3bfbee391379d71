"""Hashing schedules in one process against `b3sum --check`, on the cores it is pinned to (warm page cache):
which way of spreading blake3 over cores and files mm's verify should take where the data is cached.

    CPUS=0,1 FILES=11 SHARD_MIB=768 ROUNDS=7 WORK=/tmp/hg python3 tests/bench/hash_schedules.py

Each schedule hashes the same files (FILES of SHARD_MIB, written once into WORK and read once to warm them), in
rounds whose order rotates; the figure is each one's median with its ratio to b3sum's. On two cores of the H200
host mm's own schedule (one file per thread, 32 MiB windows) made 0.85x and 0.96x b3sum in two runs, and mm's
windows of 64 MiB with both threads on one file at a time 1.03x (docs/verify.md).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.bench.common
from tests.bench.common import bind_mm, peer_bin  # noqa: E402

CPUS = {int(c) for c in os.environ.get("CPUS", "0,1").split(",")}
FILES = int(os.environ.get("FILES", "11"))
SHARD = int(os.environ.get("SHARD_MIB", "768")) * 1024 * 1024
ROUNDS = int(os.environ.get("ROUNDS", "7"))
WORK = Path(os.environ.get("WORK", "/tmp/hg"))


def write_files() -> list[Path]:
    """FILES files of SHARD bytes that differ from each other (one byte a block), written once."""
    WORK.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(64 * 1024 * 1024))
    paths = []
    for i in range(FILES):
        path = WORK / f"shard-{i:02d}"
        paths.append(path)
        if path.exists() and path.stat().st_size == SHARD:
            continue
        with open(path, "wb") as f:
            for j in range(SHARD // len(block)):
                block[-1] = (i * 31 + j) % 256
                f.write(block)
    return paths


def one_file_per_thread(paths: list[Path], hash_one) -> None:
    """One file per thread, as many threads as cores: the next file to whichever thread is free."""
    queue, lock = list(paths), threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                path = queue.pop(0)
            hash_one(path)
    threads = [threading.Thread(target=work) for _ in CPUS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    bind_mm()
    import blake3
    from mm.artifacts.integrity.hashing import blake3_file

    b3sum = peer_bin("b3sum")
    if not shutil.which(b3sum):
        sys.exit(f"no b3sum here ({b3sum}): put it on PATH")
    paths = write_files()
    sums = "".join(f"{blake3_file(p, threads=blake3.blake3.AUTO)}  {p.name}\n" for p in paths)
    (WORK / "B3SUMS").write_text(sums)
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)  # warm
    os.sched_setaffinity(0, CPUS)
    cores = len(CPUS)
    ways = {
        "b3sum --check": lambda: subprocess.run([b3sum, "--check", "--quiet", "B3SUMS"], cwd=WORK, check=True),
        "mm's windows (32 MiB), one file per thread": lambda: one_file_per_thread(paths, lambda p: blake3_file(p)),
        "whole-file mapping, one file per thread": lambda: one_file_per_thread(
            paths, lambda p: blake3.blake3().update_mmap(p)),
        "whole-file mapping, all threads on one file": lambda: [
            blake3.blake3(max_threads=cores).update_mmap(p) for p in paths],
        "mm's windows (64 MiB), all threads on one file": lambda: [
            blake3_file(p, threads=cores, window=64 * 1024 * 1024) for p in paths],
    }
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            started = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - started)
    gib = FILES * SHARD / 2**30
    peer = statistics.median(times["b3sum --check"])
    print(f"{gib:.2f} GiB warm in {FILES} files, {cores} cores {sorted(CPUS)}, {ROUNDS} rounds")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"  {name:48s} median {median:.3f} s ({gib / median:.2f} GiB/s) = {peer / median:.2f}x b3sum; "
              f"runs {' '.join(f'{t:.2f}' for t in runs)}")


if __name__ == "__main__":
    main()
