"""Benchmark: `mm fetch` vs `hf download` of the same >= 1 GiB repo from the local Hub server.

Runs alternate (hf, mm, hf, mm, ...) into fresh directories so both see the same machine load, and
prints the ratio of median wall times. mm also hashes every byte (blake3 + sha256), checks each file
against the Hub's identity and writes the manifest; hf download checks sizes only.
Goal (issue 2): mm <= 1.15 x hf download.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys

from tests.bench.common import bench_dir, peer_bin, run_measured, start_hub_server

ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "3"))
SHARDS = 4
SHARD_BYTES = 320 * 1024 * 1024  # 4 x 320 MiB = 1.25 GiB plus the draft


def main() -> None:
    work = bench_dir("fetch")
    with start_hub_server(work / "hub", shards=SHARDS, shard_bytes=SHARD_BYTES) as (url, repo_id, commit, total):
        env = dict(os.environ, HF_ENDPOINT=url, HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", NO_PROXY="127.0.0.1,localhost")
        env.pop("HF_TOKEN", None)
        hf = [peer_bin("hf"), "download", repo_id, "--revision", commit, "--quiet"]
        mm = [peer_bin("mm"), "fetch", repo_id, "--revision", commit, "--json"]
        times: dict[str, list[float]] = {"hf download": [], "mm fetch": []}
        peak = {}
        for i in range(ROUNDS):
            for name, cmd in (("hf download", hf), ("mm fetch", mm)):
                dest = work / f"out-{i}-{name.split()[0]}"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.rmtree(work / "hf-home", ignore_errors=True)
                seconds, rss = run_measured([*cmd, "--local-dir", str(dest)], env)
                times[name].append(seconds)
                peak[name] = max(peak.get(name, 0), rss)
                shutil.rmtree(dest, ignore_errors=True)
                print(f"  round {i + 1} {name:12s} {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s", flush=True)
    hf_t, mm_t = statistics.median(times["hf download"]), statistics.median(times["mm fetch"])
    print(f"repo: {total / 2**30:.2f} GiB in {SHARDS} shards + dspark/, {ROUNDS} interleaved rounds")
    print(f"hf download median {hf_t:.2f} s ({total / hf_t / 1e9:.2f} GB/s)")
    print(f"mm fetch    median {mm_t:.2f} s ({total / mm_t / 1e9:.2f} GB/s), peak RSS {peak['mm fetch'] / 2**20:.0f} MiB"
          f" (hf download {peak['hf download'] / 2**20:.0f} MiB)")
    print(f"RATIO mm fetch / hf download wall time = {mm_t / hf_t:.3f}  (goal <= 1.15)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
