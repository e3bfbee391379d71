"""Bundle and unbundle >= 4 GiB (several ~1 GiB shards), interleaved with `tar -cf` and `tar -xf` of the same
directory, on the same disk, page cache warm. Prints throughputs, the ratios mm/tar, and mm's peak RSS.

mm fsyncs every volume and file it writes (and unbundle ends with a full verify); tar does neither. So each
mm figure is set against the tar run of the same durability: `mm bundle` against `tar -cf` + `sync FILE`,
`mm bundle --no-sync` against plain `tar -cf` (both hash every byte), and the same for unbundle and `tar -xf`
(unbundle also ends with a full verify); durable mm against plain tar is printed beside for reference.
On these machines the disk, not the CPU, sets the durable figures (~0.4 GB/s); tar without sync
returns while up to a fifth of RAM is still dirty in the page cache.
Goal (issue 5): >= 0.8 x tar, peak RSS < 150 MB.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from tests.bench.common import make_bench_model, run_timed

WORK = Path(__file__).resolve().parents[2] / "bench-work" / "bundle"
MM = Path(sys.executable).parent / "mm"
SHARDS = int(os.environ.get("MM_BENCH_BUNDLE_SHARDS", "4"))
SHARD_BYTES = int(os.environ.get("MM_BENCH_BUNDLE_SHARD_BYTES", str(1024**3)))
VOLUME_SIZE = "1.5G"  # decimal: each 1 GiB shard lands whole or split across two volumes
ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "2"))


def _make_model(root: Path) -> int:
    return make_bench_model(root, SHARDS, SHARD_BYTES)


def _run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one command (common.run_timed: measured by /usr/bin/time)."""
    seconds, peak = run_timed(cmd, WORK / "time.txt")
    return seconds, peak // 1024


def _files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file()]


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / "model"
    print(f"bench bundle: writing a {SHARDS} x {SHARD_BYTES / 2**30:.2f} GiB model into {src} ...", flush=True)
    total = _make_model(src)
    tar_file, tar_out = WORK / "model.tar", WORK / "tar-x"
    vols, dest = WORK / "vols", WORK / "dest"
    subprocess.run(["cat", *_files(src)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    rows: dict[str, list[float]] = {k: [] for k in ("tar-c", "tar-c+sync", "bundle", "bundle-nosync", "tar-x",
                                                     "tar-x+sync", "unbundle", "unbundle-nosync")}
    rss = {"bundle": 0, "unbundle": 0}
    for rnd in range(ROUNDS):
        for d in (tar_out, vols, dest):
            shutil.rmtree(d, ignore_errors=True)
        tar_file.unlink(missing_ok=True)
        s, _ = _run(["tar", "-cf", str(tar_file), "-C", str(src), "."])
        s_sync, _ = _run(["sync", str(tar_file)])
        rows["tar-c"].append(s)
        rows["tar-c+sync"].append(s + s_sync)
        s, peak = _run([str(MM), "bundle", str(src), "--out", str(vols), "--volume-size", VOLUME_SIZE, "--no-mm"])
        rows["bundle"].append(s)
        rss["bundle"] = max(rss["bundle"], peak)
        staging = WORK / "vols-nosync"
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(["sync"], check=True)  # start from no dirty pages, as the tar -cf run did
        s, peak = _run([str(MM), "bundle", str(src), "--out", str(staging), "--volume-size", VOLUME_SIZE, "--no-sync", "--no-mm"])
        rows["bundle-nosync"].append(s)
        rss["bundle"] = max(rss["bundle"], peak)
        shutil.rmtree(staging)
        subprocess.run(["sync"], check=True)
        tar_out.mkdir()
        s, _ = _run(["tar", "-xf", str(tar_file), "-C", str(tar_out)])
        s_sync, _ = _run(["sync", *_files(tar_out)])
        rows["tar-x"].append(s)
        rows["tar-x+sync"].append(s + s_sync)
        s, peak = _run([str(MM), "unbundle", str(vols), "--dest", str(dest)])
        rows["unbundle"].append(s)
        rss["unbundle"] = max(rss["unbundle"], peak)
        scratch = WORK / "dest-nosync"
        shutil.rmtree(scratch, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        s, peak = _run([str(MM), "unbundle", str(vols), "--dest", str(scratch), "--no-sync"])
        rows["unbundle-nosync"].append(s)
        rss["unbundle"] = max(rss["unbundle"], peak)
        shutil.rmtree(scratch)
        subprocess.run(["sync"], check=True)
        print(f"  round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()), flush=True)
    best = {k: min(v) for k, v in rows.items()}
    gb = total / 1e9
    print(f"bench bundle: {total / 2**30:.2f} GiB, {SHARDS} shards, volumes of {VOLUME_SIZE}, {ROUNDS} interleaved rounds")
    for k, s in best.items():
        print(f"  {k:<15} {gb / s:6.2f} GB/s  (best {s:.2f} s)")

    def ratio(peer: str, mine: str) -> float:  # median of the per-round ratios: each pair ran side by side
        return statistics.median(p / m for p, m in zip(rows[peer], rows[mine]))
    print(f"  ratio bundle/tar-c+sync            {ratio('tar-c+sync', 'bundle'):.2f}   goal >= 0.8 (both durable)")
    print(f"  ratio bundle --no-sync/tar-c       {ratio('tar-c', 'bundle-nosync'):.2f}   goal >= 0.8 (neither durable)")
    print(f"  ratio bundle/tar-c                 {ratio('tar-c', 'bundle'):.2f}   (durable vs not: for reference)")
    print(f"  ratio unbundle/tar-x+sync          {ratio('tar-x+sync', 'unbundle'):.2f}   goal >= 0.8 (both durable)")
    print(f"  ratio unbundle --no-sync/tar-x     {ratio('tar-x', 'unbundle-nosync'):.2f}   goal >= 0.8 (neither durable)")
    print(f"  ratio unbundle/tar-x               {ratio('tar-x', 'unbundle'):.2f}   (durable vs not: for reference)")
    print(f"  peak RSS mm bundle {rss['bundle'] / 1024:.0f} MB, mm unbundle {rss['unbundle'] / 1024:.0f} MB   goal < 150 MB")
    if not os.environ.get("MM_BENCH_KEEP"):
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
