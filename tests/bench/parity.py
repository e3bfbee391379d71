"""Parity: `mm bundle --parity 2` over 10 data volumes against the same bundle without parity (interleaved
rounds, same disk, page cache warm), and the rebuild of one lost data volume. Every bundle is made with --no-mm:
mm's own wheelhouse (fetched by pip, from the index or its cache) is no part of what parity costs, and the GPU host
has no index.

Figures:
  ratio bundle --parity 2 / bundle        wall time, durable (fsync) and --no-sync; goal <= 1.4 at any load; each
                                          round's ratio with the load average, and the bytes each run read from the
                                          disk (ru_inblock): a parity pass that finds the data volumes' pages gone
                                          from the page cache reads them from the disk
  rebuild MB/s                            one lost volume's bytes / wall of the rebuild itself
                                          (rebuild_data_volumes: read 9 data + 1 parity volume, decode, write,
                                          blake3 of the result); goal >= 300 MB/s
  repair-volume MB/s                      the same volume's bytes / wall of `mm bundle repair-volume`, which first
                                          hashes every volume given (checks them) before rebuilding
  peak RSS of mm bundle --parity 2 and mm bundle repair-volume; goal < 150 MB
Per run it also prints what the kernel did meanwhile (/proc/vmstat, /proc/stat: the whole VM, other users included):
pages read in from the disk and major faults (a parity pass that re-reads evicted volumes shows here), pages
reclaimed by kswapd and by the run itself (direct reclaim), the CPU time the host took from this VM (steal), and the
free memory at its start: the figures that explain a round whose ratio stands out.
Each round takes the four bundle runs in another order (common.round_order): what ran just before changes what
the next run pays for fresh memory on this VM (copyio.write_size). Each run starts with the model read into the page
cache and no dirty pages.
Every goal is printed by common.RatioGoal: the median of the rounds' figures, their spread, the verdict.
Sizes: MM_BENCH_PARITY_SHARDS x MM_BENCH_PARITY_SHARD_BYTES (default 4 x 512 MiB), volumes of a tenth of that;
MM_BENCH_ROUNDS rounds (2; a goal within 10% of its bound needs 5). MM_BENCH_PARITY_STEPS=rebuild: only the
rebuild and repair-volume rounds, from one parity bundle made before them (the bundle ratios are left out). On the
16-core GPU host, e.g.
  MM_BENCH_ROUNDS=5 MM_BENCH_PARITY_SHARDS=8 MM_BENCH_PARITY_SHARD_BYTES=2147483648 python3 -m tests.bench.run parity
(16 GiB: about 3 x that on the disk, the model and two bundles at a time).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.bench.common import (RatioGoal, bench_dir, load_average, make_bench_model, peer_bin, returned_to_host,
                                round_order, run_timed, run_usage)

_VMSTAT = ("pgpgin", "pgmajfault", "pgsteal_kswapd", "pgsteal_direct", "allocstall_movable", "allocstall_normal")


def _kernel_counters() -> dict[str, int]:
    """The /proc/vmstat counters above, free memory (bytes) and the VM's steal time (clock ticks, all CPUs)."""
    got = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, value = line.split()
        if key in _VMSTAT or key == "nr_free_pages":
            got[key] = int(value)
    got["nr_free_pages"] *= os.sysconf("SC_PAGE_SIZE")
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    got["steal"] = int(cpu[8]) if len(cpu) > 8 else 0
    return got


def _kernel_delta(before: dict[str, int], after: dict[str, int]) -> str:
    ticks = os.sysconf("SC_CLK_TCK")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in (*_VMSTAT, "steal")}
    return (f"free {before['nr_free_pages'] / 1e9:.1f} GB, read in {d['pgpgin'] * 1024 / 1e9:.2f} GB, "
            f"majfault {d['pgmajfault']}, reclaimed {d['pgsteal_kswapd'] * 4096 / 1e9:.2f}+"
            f"{d['pgsteal_direct'] * 4096 / 1e9:.2f} GB (kswapd+direct, {d['allocstall_movable'] + d['allocstall_normal']} "
            f"stalls), steal {d['steal'] / ticks:.2f} s")

MM = Path(peer_bin("mm"))
SHARDS = int(os.environ.get("MM_BENCH_PARITY_SHARDS", "4"))
SHARD_BYTES = int(os.environ.get("MM_BENCH_PARITY_SHARD_BYTES", str(512 * 1024**2)))
ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "2"))
REBUILD_ONLY = os.environ.get("MM_BENCH_PARITY_STEPS", "all") == "rebuild"


def _make_model(root: Path) -> int:
    return make_bench_model(root, SHARDS, SHARD_BYTES)


def main() -> None:
    work = bench_dir("parity")
    src = work / "model"
    print(f"bench parity: writing a {SHARDS} x {SHARD_BYTES / 2**20:.0f} MiB model into {src} ...", flush=True)
    total = _make_model(src)
    volume_size = str(total // 10 + 200_000)  # ten data volumes (plus a last one for the metadata, at most)
    subprocess.run(["cat", *[str(p) for p in src.rglob("*") if p.is_file()]], stdout=subprocess.DEVNULL, check=True)
    rows: dict[str, list[float]] = {k: [] for k in ("bundle", "bundle-parity", "bundle-nosync", "bundle-parity-nosync",
                                                     "rebuild", "repair-volume")}
    disk_read: dict[str, list[int]] = {k: [] for k in rows}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    returned: dict[str, list[tuple[int, int]]] = {k: [] for k in rows}  # handed to the host: before the run, during
    kernel: dict[str, list[str]] = {k: [] for k in rows}
    since = returned_to_host()
    loads: list[str] = []
    rss: dict[str, list[int]] = {"bundle --parity 2": [], "repair-volume": []}  # per round
    lost_bytes = 0
    count = 0
    # one untimed bundle first: the first run after the model is made took 4.4-5.2 s against 2.0-2.3 (user time
    # 3.1-3.4 s against 1.3-1.4) in every run of this bench, so round 1's ratio said nothing
    warm = work / "vols-warm-up"
    if not REBUILD_ONLY:
        run_usage([str(MM), "bundle", str(src), "--out", str(warm), "--volume-size", volume_size, "--no-mm"],
                  work / "time.txt")
        shutil.rmtree(warm, ignore_errors=True)
    else:  # the volumes every round rebuilds one of
        run_usage([str(MM), "bundle", str(src), "--out", str(work / "vols-bundle-parity-nosync"), "--volume-size",
                   volume_size, "--no-mm", "--parity", "2", "--no-sync"], work / "time.txt")
    for rnd in range(ROUNDS):
        before = load_average()
        runs = {} if REBUILD_ONLY else {"bundle": [], "bundle-parity": ["--parity", "2"], "bundle-nosync": ["--no-sync"],
                                        "bundle-parity-nosync": ["--parity", "2", "--no-sync"]}
        order = round_order(list(runs), rnd)
        rss["bundle --parity 2"].append(0)
        for label in order:
            extra = runs[label]
            out = work / f"vols-{label}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            subprocess.run(["cat", *map(str, sorted(src.rglob("*")))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # warm
            handed = returned_to_host()
            counters = _kernel_counters()
            run = run_usage([str(MM), "bundle", str(src), "--out", str(out), "--volume-size", volume_size, "--no-mm",
                             *extra],
                            work / "time.txt")
            kernel[label].append(_kernel_delta(counters, _kernel_counters()))
            after = returned_to_host()
            if handed is not None and since is not None and after is not None:
                returned[label].append((handed - since, after - handed))
            since = after
            s, peak = run.seconds, run.peak_rss
            rows[label].append(s)
            cpu[label].append((run.user, run.sys))
            disk_read[label].append(run.read_from_disk)
            if "parity" in label:
                rss["bundle --parity 2"][-1] = max(rss["bundle --parity 2"][-1], peak)
        vols = work / "vols-bundle-parity-nosync"
        data = sorted(vols.glob("*.vol*-of-*.tar"))
        count = len(data)
        lost = data[len(data) // 2]
        keep = work / "lost.tar"
        shutil.move(lost, keep)
        lost_bytes = keep.stat().st_size
        s = _rebuild_in_process(vols, lost.name)
        rows["rebuild"].append(s)
        assert (vols / lost.name).read_bytes() == keep.read_bytes(), "rebuilt volume differs"
        (vols / lost.name).unlink()
        s, peak = run_timed([str(MM), "bundle", "repair-volume", str(vols), "--no-sync"], work / "time.txt")
        rows["repair-volume"].append(s)
        rss["repair-volume"].append(peak)
        assert (vols / lost.name).read_bytes() == keep.read_bytes(), "repaired volume differs"
        keep.unlink()
        loads.append(f"{before} -> {load_average()}")
        print(f"  round {rnd + 1} ({loads[-1]}), order {' | '.join(order)}:\n    "
              + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items() if v)
              + ("" if REBUILD_ONLY else  # what follows is of the bundle runs
                 "\n    user+sys: " + ", ".join(f"{k} {u:.2f}+{y:.2f}s" for k, v in cpu.items() if v for u, y in v[-1:])
                 + "\n    read from disk: " + ", ".join(f"{k} {v[-1] / 1e9:.2f} GB" for k, v in disk_read.items() if v)
                 + "\n    memory the guest handed back to the host before / during each run: "
                 + ", ".join(f"{k} {v[-1][0] / 1e9:.2f} / {v[-1][1] / 1e9:.2f} GB" for k, v in returned.items()
                             if len(v) > rnd))
              + "".join(f"\n    kernel during {k}: {v[-1]}" for k, v in kernel.items() if len(v) > rnd)
              + ("" if REBUILD_ONLY else
                 f"\n    ratios this round: durable {rows['bundle-parity'][-1] / rows['bundle'][-1]:.2f}, --no-sync "
                 f"{rows['bundle-parity-nosync'][-1] / rows['bundle-nosync'][-1]:.2f}; CPU (user+sys): durable "
                 f"{sum(cpu['bundle-parity'][-1]) / sum(cpu['bundle'][-1]):.2f}, --no-sync "
                 f"{sum(cpu['bundle-parity-nosync'][-1]) / sum(cpu['bundle-nosync'][-1]):.2f}"), flush=True)

    gb = total / 1e9
    print(f"bench parity: {total / 2**30:.2f} GiB model, {count} data volumes of {int(volume_size) / 1e6:.0f} MB, "
          f"{ROUNDS} interleaved rounds")
    for k in ("bundle", "bundle-parity", "bundle-nosync", "bundle-parity-nosync")[:0 if REBUILD_ONLY else 4]:
        print(f"  {k:<22} {gb / min(rows[k]):6.2f} GB/s  (best {min(rows[k]):.2f} s)")
    pairs = (("bundle-parity", "bundle", "durable"), ("bundle-parity-nosync", "bundle-nosync", "--no-sync"))
    for mine, peer, what in pairs[:0 if REBUILD_ONLY else 2]:
        per_round = ", ".join(f"{m / p:.2f} (load {load.split()[1]})" for m, p, load in zip(rows[mine], rows[peer], loads))
        print(f"  ratio bundle --parity 2 / bundle ({what}), rounds: {per_round}")
    best = min(rows["repair-volume"])
    print(f"  mm bundle repair-volume (checks every volume first) {lost_bytes / best / 1e6:6.0f} MB/s of volume (best)")
    print(f"  rebuild one lost volume of {lost_bytes / 1e6:.0f} MB from {count - 1} data + 1 parity volumes (reads "
          f"{count} x the volume)")
    print("  load average per round: " + "; ".join(loads))
    for mine, peer, what in pairs[:0 if REBUILD_ONLY else 2]:
        print(RatioGoal(f"bundle --parity 2 / bundle ({what})", 1.4).verdict(
            [m / p for m, p in zip(rows[mine], rows[peer])]))
    print(RatioGoal("rebuild of one lost volume", 300, at_most=False, unit=" MB/s").verdict(
        [lost_bytes / s / 1e6 for s in rows["rebuild"]]))
    for k, v in rss.items():
        if REBUILD_ONLY and k == "bundle --parity 2":
            continue
        print(RatioGoal(f"peak RSS of mm {k}", 150, unit=" MB").verdict([b / 2**20 for b in v]))
    if not os.environ.get("MM_BENCH_KEEP"):
        shutil.rmtree(work, ignore_errors=True)


def _rebuild_in_process(vols: Path, lost_name: str) -> float:
    """Wall seconds of rebuild_data_volumes alone, volumes opened and judged beforehand (as unbundle has them)."""
    from mm.artifacts.bundle.check import parity_set
    from mm.artifacts.bundle.parity import FileSource
    from mm.artifacts.bundle.unpack import rebuild_data_volumes
    from mm.artifacts.bundle.volume import open_volume

    pvols = parity_set([open_volume(p) for p in sorted(vols.glob("*.par*-of-*.tar"))], None).usable
    index = pvols[0].parity
    lost = next(d.number for d in index.data if d.file == lost_name)
    sources = {d.number: FileSource(vols / d.file, read_once=True) for d in index.data if d.number != lost}
    t = time.perf_counter()
    rebuild_data_volumes(pvols, sources, [lost], vols, sync=False)
    seconds = time.perf_counter() - t
    for s in sources.values():
        s.close()
    return seconds


if __name__ == "__main__":
    main()
