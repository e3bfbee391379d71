"""Benchmark: `mm fetch` against aria2c and `hf download`, from a real CDN behind the test Hub's redirect.

The Hub API and the small files come from the local Hub server (tests/support/hubserver.py); every LFS file is
redirected (302) to nginx (the Debian package), which serves the repo's .git/lfs/objects with sendfile and caps each
connection with `limit_rate`, as a CDN does. So the CDN is not the bottleneck, and all three clients get the same
server. Peers, interleaved round by round in the same run (the machine is shared: only ratios mean something):

- aria2c -x16 -s16 -k16M (Debian aria2, its other defaults): downloads, does not hash, does not fsync;
- hf download (huggingface_hub's CLI, its defaults): downloads into its cache, checks sizes;
- mm fetch (its defaults): downloads, hashes blake3 and sha256 of every byte in the pass that writes it (and the git
  sha1 of non-LFS files; an LFS file's git blob is its pointer, so hashing its content with sha1 would prove
  nothing), checks each file against the Hub's identity, fsyncs, writes the manifest.

Cases: 20 MB/s per connection (MM_BENCH_CAP_MB) with one 1 GiB file and with 8 x 128 MiB; uncapped loopback with
one 1 GiB file. Printed per case: each round's times and the load average before it; the median wall time of each
tool; RATIO mm speed / aria2c speed (goal >= 1.0), mm / (aria2c then `sync` of its files: the durability mm has,
where the disk is slower than the link) and mm / hf download; CPU-seconds per GiB (user + sys, the child's rusage)
of mm (goal <= 2) and aria2c, and mm's against its work done by peers in the same rounds (aria2c's, plus b3sum in
one thread and `openssl dgst -sha256` over aria2c's files); peak RSS (goal < 150 MB); the bytes each tool made the
kernel read from and write to storage per byte fetched (ru_inblock/ru_oublock: mm writes with O_DIRECT and hashes
what landed ahead of its hashing frontier from an in-memory window, reading back, direct too, only what the window
could not hold; on a disk slower than the link that read-back shares the disk).
The goals are printed as RatioGoal lines (tests/bench/common.py: the median of the per-round ratios, their spread,
the verdict): mm / (aria2c + sync) speed at least 1.0 in the uncapped case, mm's CPU per GiB at most 0.8x the peers'
in every case; beside them the bytes mm read back to hash per byte fetched (its --json `transfer.read_back`: what
landed ahead of the hashing frontier while the in-memory window was full). In the uncapped case a fourth tool, "mm
all at once", is mm fetch with a file's other connections started with its first request instead of once a 206
proved that Range works (what a cold pull-through cache needs): its ratio to mm fetch says what that wait costs a
big file (MM_BENCH_GATE=0 leaves it out).
MM_BENCH_ROUNDS (default 5) rounds; MM_BENCH_CASES picks cases by number (e.g. "1,3"); MM_BENCH_HF=0 leaves
hf download out (its single stream takes about 54 s a round on the capped 1 GiB case). mm is byte-compiled first,
as a wheel install is (these machines set PYTHONDONTWRITEBYTECODE=1), so a run on its own times what `make bench`
times.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.bench.common import RatioGoal, bench_dir, peer_bin, run_usage, start_hub_server

ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "5"))
WITH_GATE = os.environ.get("MM_BENCH_GATE", "1") != "0"
CAP = int(float(os.environ.get("MM_BENCH_CAP_MB", "20")) * 1e6)  # bytes/s per connection
WITH_HF = os.environ.get("MM_BENCH_HF", "1") != "0"
GIB = 1 << 30
MIB = 1 << 20
RSS_GOAL = 150e6
CPU_GOAL = 2.0
SPEED_GOAL = RatioGoal("mm fetch / (aria2c + sync) speed, uncapped", 1.0, at_most=False)  # issue: time to a proven model
CPU_PEERS_GOAL = 0.8  # mm's CPU per GiB at most this times the peers doing the same work
GATE_GOAL = 1.05  # the first range alone costs a big file at most this (mm's margin: inside a round's noise)
# mm fetch with a file's connections all started at once (not after a 206): what the wait for the proof costs
ALL_AT_ONCE = ("import mm.artifacts.fetching.ranges as r\n"
               "init = r._File.__init__\n"
               "def at_once(self, *a, **k):\n"
               "    init(self, *a, **k)\n"
               "    self.honoured = True\n"
               "r._File.__init__ = at_once\n"
               "from mm.__main__ import main\n"
               "main()")
ARIA2 = ["-x16", "-s16", "-k16M"]
# The two hashes mm computes over every byte, each by a peer tool in one thread over aria2c's files (read from the
# page cache): what mm's work costs this CPU when done the peers' way. OpenSSL is what hashlib's sha256 runs (coreutils'
# sha256sum here has its own, slower code).
HASH_PEERS = {"b3sum, 1 thread": ["b3sum", "--num-threads", "1"], "openssl sha256": ["openssl", "dgst", "-sha256"]}


CASES = {
    1: ("20 MB/s per connection, one 1 GiB file", 1, GIB, CAP),
    2: ("20 MB/s per connection, 8 x 128 MiB", 8, 128 * MIB, CAP),
    3: ("uncapped loopback, one 1 GiB file", 1, GIB, 0),
}


def main() -> None:
    from tests.bench.run import byte_compile_mm

    byte_compile_mm()  # mm as installed (run on its own too: `python -m tests.bench.fetch`), as `make bench` does
    picked = [int(c) for c in os.environ.get("MM_BENCH_CASES", ",".join(map(str, CASES))).split(",") if c]
    for number in picked:
        name, shards, shard_bytes, cap = CASES[number]
        case(f"{number}. {name}", shards, shard_bytes, cap)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def nginx(objects: Path, port: int, rate: int, work: Path) -> Iterator[str]:
    """nginx serving OBJECTS under /lfs/ on 127.0.0.1:PORT, each connection capped at RATE bytes/s (0: none);
    yields the base URL."""
    prefix = work / "nginx"
    shutil.rmtree(prefix, ignore_errors=True)
    (prefix / "tmp").mkdir(parents=True)
    user = "user root root;" if os.geteuid() == 0 else ""
    temp = "\n".join(f"  {kind}_temp_path {prefix}/tmp/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (prefix / "nginx.conf").write_text(f"""{user}
worker_processes auto;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  default_type application/octet-stream;
{temp}
  server {{
    listen 127.0.0.1:{port};
    location /lfs/ {{
      alias {objects}/;
      limit_rate {rate};
    }}
  }}
}}
""")
    proc = subprocess.Popen(["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"nginx did not start: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/lfs"
    finally:
        proc.terminate()
        proc.wait()


@contextmanager
def cdn_repo(work: Path, shards: int, shard_bytes: int, cap: int) -> Iterator[tuple[str, str, str, int, list[str]]]:
    """The test Hub (a generated repo of SHARDS x SHARD_BYTES) redirecting its LFS files to nginx capped at CAP
    bytes/s per connection; yields (hub URL, repo id, commit, bytes, file paths)."""
    from tests.support.gitrepo import tree_sizes

    port = free_port()
    server_args = ("--no-draft", "--redirect-to", f"http://127.0.0.1:{port}/lfs")
    with start_hub_server(work / "hub", shards=shards, shard_bytes=shard_bytes, server_args=server_args) as (
            url, repo_id, commit, total):
        with nginx(work / "hub" / repo_id / ".git" / "lfs" / "objects", port, cap, work):
            yield url, repo_id, commit, total, sorted(tree_sizes(work / "hub" / repo_id, commit))


def case(name: str, shards: int, shard_bytes: int, cap: int) -> None:
    print(f"--- {name} ---", flush=True)
    work = bench_dir(f"fetch-{shards}x{shard_bytes >> 20}-{cap}")
    with cdn_repo(work, shards, shard_bytes, cap) as (url, repo_id, commit, total, files):
        env = dict(os.environ, HF_ENDPOINT=url, HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", NO_PROXY="127.0.0.1,localhost")
        env.pop("HF_TOKEN", None)
        urls = work / "aria2.txt"
        urls.write_text("".join(f"{url}/{repo_id}/resolve/{commit}/{p}\n  out={p}\n" for p in files))
        tools = {
            "aria2c": lambda dest: ["aria2c", *ARIA2, "-q", "--auto-file-renaming=false", "--allow-overwrite=true",
                                    "-d", str(dest), "-i", str(urls)],
            "mm fetch": lambda dest: [peer_bin("mm"), "fetch", repo_id, "--revision", commit, "--local-dir", str(dest),
                                      "--json"],
        }
        if WITH_HF:
            tools["hf download"] = lambda dest: [peer_bin("hf"), "download", repo_id, "--revision", commit, "--quiet"]
        if WITH_GATE and not cap:
            tools["mm all at once"] = lambda dest: [sys.executable, "-c", ALL_AT_ONCE, "fetch", repo_id, "--revision",
                                                    commit, "--local-dir", str(dest), "--json"]
        wall: dict[str, list[float]] = {t: [] for t in tools}
        synced: list[float] = []  # aria2c, then `sync` of the files it wrote: the durability mm fetch has
        cpu: dict[str, list[float]] = {t: [] for t in tools}
        disk: dict[str, list[tuple[int, int]]] = {t: [] for t in tools}  # bytes read from and written to storage
        rss: dict[str, int] = {}
        hashing: dict[str, list[float]] = {peer: [] for peer in HASH_PEERS}  # their CPU-seconds over the repo
        loads = []
        read_back: list[float] = []  # bytes mm read back from the disk to hash, per byte fetched (its --json)
        for i in range(ROUNDS):
            for tool, cmd in tools.items():
                dest = work / "out"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.rmtree(work / "hf-home", ignore_errors=True)
                load = os.getloadavg()[0]
                loads.append(load)
                report = work / "mm.json" if tool.startswith("mm") else None
                subprocess.run(["sync"], check=True)  # no dirty pages left from the run before
                usage = run_usage(cmd(dest), work / "time.txt", env, stdout=report)
                seconds, cpu_s, peak = usage.seconds, usage.user + usage.sys, usage.peak_rss
                if tool == "aria2c":
                    synced.append(seconds + run_usage(["sync", *(str(dest / p) for p in files)], work / "time.txt",
                                                      env).seconds)
                    for peer, hash_cmd in HASH_PEERS.items():  # the hashing aria2c does not do, on its files
                        done = run_usage([*hash_cmd, *(str(dest / p) for p in files)], work / "time.txt", env,
                                         stdout=work / "sums.txt")
                        hashing[peer].append(done.user + done.sys)
                if report is not None:
                    doc = json.loads(report.read_text())
                    if not doc["ok"]:
                        raise RuntimeError(f"mm fetch failed: {report.read_text()[-800:]}")
                    if tool == "mm fetch":
                        read_back.append(doc["transfer"]["read_back"] / total)
                got = sum((dest / p).stat().st_size for p in files if (dest / p).is_file())
                if tool != "hf download" and got != total:
                    raise RuntimeError(f"{tool} left {got} of {total} bytes")
                wall[tool].append(seconds)
                cpu[tool].append(cpu_s)
                disk[tool].append((usage.read_from_disk, usage.written_to_disk))
                rss[tool] = max(rss.get(tool, 0), peak)
                print(f"  round {i + 1} {tool:12s} {seconds:6.2f} s  {total / seconds / 1e6:7.0f} MB/s  "
                      f"CPU {cpu_s:5.2f} s (user {usage.user:.2f}, sys {usage.sys:.2f})  RSS {peak / 1e6:5.0f} MB  "
                      f"disk read {usage.read_from_disk / 1e6:5.0f} MB, written {usage.written_to_disk / 1e6:5.0f} MB  "
                      f"(load {load:.1f})", flush=True)
                shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(work / "hf-home", ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    gib = total / GIB
    med = {t: statistics.median(v) for t, v in wall.items()}
    print(f"repo: {gib:.2f} GiB in {shards} file(s) + small files, {ROUNDS} interleaved rounds, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    for tool in tools:
        read = statistics.median(r for r, _ in disk[tool])
        written = statistics.median(w for _, w in disk[tool])
        print(f"{tool:12s} median {med[tool]:6.2f} s ({total / med[tool] / 1e6:5.0f} MB/s), "
              f"{statistics.median(cpu[tool]) / gib:.2f} CPU-s/GiB, peak RSS {rss[tool] / 1e6:.0f} MB, "
              f"storage read {read / total:.2f} and written {written / total:.2f} bytes per byte fetched")
    print(f"RATIO mm fetch / aria2c speed = {med['aria2c'] / med['mm fetch']:.2f}x  (goal >= 1.0)")
    print(f"RATIO mm fetch / (aria2c + sync) speed = {statistics.median(synced) / med['mm fetch']:.2f}x  (aria2c "
          f"{med['aria2c']:.2f} s, then sync of its files: {statistics.median(synced):.2f} s; mm fsyncs each file "
          f"before naming it, aria2c never does)")
    if WITH_HF:
        print(f"RATIO mm fetch / hf download speed = {med['hf download'] / med['mm fetch']:.2f}x")
    if not cap:
        print(SPEED_GOAL.verdict([a / m for a, m in zip(synced, wall["mm fetch"])]))
    print(f"  read back from the disk to hash: {statistics.median(read_back):.2f} bytes per byte fetched (median, "
          f"spread {min(read_back):.2f}-{max(read_back):.2f}; what landed ahead of the frontier, the window full)")
    if "mm all at once" in wall:
        print(RatioGoal("mm fetch / mm all at once, time (the first range alone until a 206)", GATE_GOAL).verdict(
            [m / a for m, a in zip(wall["mm fetch"], wall["mm all at once"])]))
    per_gib = {t: statistics.median(v) / gib for t, v in {**cpu, **hashing}.items()}
    floor = per_gib["aria2c"] + sum(per_gib[peer] for peer in HASH_PEERS)
    print(f"CPU mm fetch {per_gib['mm fetch']:.2f} CPU-s/GiB (goal <= {CPU_GOAL}), "
          f"aria2c {per_gib['aria2c']:.2f}; peak RSS mm {rss['mm fetch'] / 1e6:.0f} MB "
          f"(goal < {RSS_GOAL / 1e6:.0f})")
    print(f"CPU of mm's work done by peers, same rounds: aria2c {per_gib['aria2c']:.2f} (receive, write) + "
          + " + ".join(f"{peer} {per_gib[peer]:.2f}" for peer in HASH_PEERS)
          + f" = {floor:.2f} CPU-s/GiB; mm fetch = {per_gib['mm fetch'] / floor:.2f}x that", flush=True)
    peers = [a + sum(hashing[p][i] for p in HASH_PEERS) for i, a in enumerate(cpu["aria2c"])]
    print(RatioGoal("mm fetch CPU / its work done by peers", CPU_PEERS_GOAL).verdict(
        [m / p for m, p in zip(cpu["mm fetch"], peers)]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
