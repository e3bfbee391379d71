"""Benchmark: `mm fetch` vs `hf download` (both with their defaults) of the same repo from the local Hub server.

Runs alternate (hf, mm, hf, mm, ...) into fresh directories so both see the same machine load, and
prints the ratio of median wall times. mm also hashes every byte (blake3 + sha256), checks each file
against the Hub's identity and writes the manifest; hf download checks sizes only.

1. Loopback, no cap: 4 x 320 MiB shards + the draft. Goal: mm's wall time <= 0.92 x hf download's.
2. WAN (issue 13): the server caps each TCP connection (MM_BENCH_CAP_MB, default 20 MB/s) and redirects LFS
   files to its bridge origin, like the Hub's CDN. A repo of one 1 GiB shard (goal: mm >= 4x faster) and a
   repo of 8 shards, 1 GiB in all (goal: >= 2x). Printed: connections used, throughput per connection, ratio.
Peak RSS goal for mm: < 150 MB.

The goals are for mm's defaults: up to 32 connections, 16 to start with, more only while they raise the
aggregate rate (artifacts/ranges.py Connections). Loopback and the 8-shard repo also run `mm fetch --connections
16` (16 fixed), printed apart: what adding connections buys behind a per-connection cap, and what probing costs
where there is none. (16 fixed against hf download's 8 workers can reach at most ~1.8x on the 8-shard repo once
start-up is counted: 3.4 s of wire time + ~0.4-0.75 s against 6.7 s + ~0.8 s.)
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys

from tests.bench.common import bench_dir, peer_bin, run_measured, start_hub_server

ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "3"))
CAP = int(float(os.environ.get("MM_BENCH_CAP_MB", "20")) * 1e6)  # bytes/s per connection
GIB = 1 << 30
RSS_GOAL = 150e6
MORE = ("--connections", "16")  # the variant printed apart (see above)


def main() -> None:
    loopback(more=MORE)
    wan("one 1 GiB shard", shards=1, shard_bytes=GIB, goal=4.0)
    wan("8 shards, 1 GiB", shards=8, shard_bytes=GIB // 8, goal=2.0, more=MORE)


def loopback(more: tuple[str, ...] = ()) -> None:
    print("--- loopback, no per-connection cap ---", flush=True)
    times, peak, _, total = _rounds("fetch", shards=4, shard_bytes=320 * 1024 * 1024, server_args=(), more=more)
    hf_t = statistics.median(times["hf download"])
    print(f"repo: {total / 2**30:.2f} GiB in 4 shards + dspark/, {ROUNDS} interleaved rounds")
    print(f"hf download median {hf_t:.2f} s ({total / hf_t / 1e9:.2f} GB/s), peak RSS {peak['hf download'] / 1e6:.0f} MB")
    for tool in [t for t in times if t.startswith("mm fetch")]:
        mm_t = statistics.median(times[tool])
        print(f"{tool} median {mm_t:.2f} s ({total / mm_t / 1e9:.2f} GB/s), peak RSS {peak[tool] / 1e6:.0f} MB"
              f" (goal < {RSS_GOAL / 1e6:.0f})")
        goal_note = "goal <= 0.92" if tool == "mm fetch" else "not the goal's defaults"
        print(f"RATIO {tool} / hf download wall time = {mm_t / hf_t:.3f}  ({goal_note})", flush=True)


def wan(name: str, shards: int, shard_bytes: int, goal: float, more: tuple[str, ...] = ()) -> None:
    """MORE: mm options for one more interleaved variant, printed apart (not the goal's: defaults are)."""
    print(f"--- WAN: {CAP / 1e6:.0f} MB/s per connection, redirect to the bridge; {name} ---", flush=True)
    server_args = ("--conn-rate", str(CAP), "--redirect-lfs", "--no-draft")
    times, peak, transfers, total = _rounds(f"fetch-wan-{shards}", shards, shard_bytes, server_args, more)
    hf_t = statistics.median(times["hf download"])
    print(f"repo: {total / 2**30:.2f} GiB in {shards} shard(s), {ROUNDS} interleaved rounds")
    print(f"hf download median {hf_t:.2f} s ({total / hf_t / 1e6:.0f} MB/s)")
    for tool in [t for t in times if t.startswith("mm fetch")]:
        mm_t = statistics.median(times[tool])
        used = statistics.median(t["connections_used"] for t in transfers[tool])
        kept = statistics.median(t["connections_kept"] for t in transfers[tool])
        retries = sum(t["retries"] for t in transfers[tool])
        print(f"{tool} median {mm_t:.2f} s ({total / mm_t / 1e6:.0f} MB/s), {used:.0f} connections used ({kept:.0f} kept)"
              f" ({total / mm_t / used / 1e6:.1f} MB/s per connection), {retries} retries,"
              f" peak RSS {peak[tool] / 1e6:.0f} MB (goal < {RSS_GOAL / 1e6:.0f})")
        goal_note = f"goal >= {goal}x" if tool == "mm fetch" else "not the goal's defaults"
        print(f"RATIO hf download / {tool} wall time = {hf_t / mm_t:.2f}x  ({goal_note})", flush=True)


def _rounds(name: str, shards: int, shard_bytes: int, server_args: tuple[str, ...], more: tuple[str, ...] = ()):
    work = bench_dir(name)
    transfers: dict[str, list[dict]] = {}
    with start_hub_server(work / "hub", shards=shards, shard_bytes=shard_bytes, server_args=server_args) as (
            url, repo_id, commit, total):
        env = dict(os.environ, HF_ENDPOINT=url, HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", NO_PROXY="127.0.0.1,localhost")
        env.pop("HF_TOKEN", None)
        hf = [peer_bin("hf"), "download", repo_id, "--revision", commit, "--quiet"]
        mm = [peer_bin("mm"), "fetch", repo_id, "--revision", commit, "--json"]
        tools = [("hf download", hf), ("mm fetch", mm)] + ([(f"mm fetch {' '.join(more)}", [*mm, *more])] if more else [])
        times: dict[str, list[float]] = {tool: [] for tool, _ in tools}
        peak: dict[str, int] = {}
        for i in range(ROUNDS):
            for tool, cmd in tools:
                dest = work / f"out-{i}-{tool.split()[0]}"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.rmtree(work / "hf-home", ignore_errors=True)
                report = work / "mm.json"
                is_mm = tool.startswith("mm fetch")
                seconds, rss = run_measured([*cmd, "--local-dir", str(dest)], env, stdout=report if is_mm else None)
                if is_mm:
                    transfers.setdefault(tool, []).append(json.loads(report.read_text())["transfer"])
                times[tool].append(seconds)
                peak[tool] = max(peak.get(tool, 0), rss)
                shutil.rmtree(dest, ignore_errors=True)
                print(f"  round {i + 1} {tool:28s} {seconds:6.2f} s  {total / seconds / 1e6:7.0f} MB/s"
                      f"  RSS {rss / 1e6:5.0f} MB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return times, peak, transfers, total


if __name__ == "__main__":
    sys.exit(main())
