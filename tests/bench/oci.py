"""Benchmark: `mm push` / `mm pull` against the loopback docker-registry, with curl of the same blobs as the peer.

Push: mm push (HEAD, chunked PATCH uploads, manifest) vs curl uploading every blob in one PUT each, 4 at a
time, into fresh repositories. Pull: mm pull (sha256 + blake3 of every byte, fsync, atomic names, manifest,
quick verify) vs curl downloading every blob, 4 at a time, and vs the same curl run followed by `sync` of the files
it wrote (the durability mm pull has: where the disk is slower than the loopback, curl alone ends before its bytes
reach the disk, mm cannot). Runs alternate so both see the same load; the
figures that count are the ratios of the medians. Peak RSS is each child's own (wait4).

Fan-out: K = 1, 2, 4, 8 concurrent `mm pull` of one artifact into K directories; prints aggregate throughput
and the bytes the registry served (its access log) per puller, as a multiple of the artifact's size.

Goals: mm pull wall <= 1.1 x curl, peak RSS < 150 MB, fan-out bytes served per puller 1.0x.
Environment: MM_BENCH_ROUNDS (default 3), MM_BENCH_GIB (default 2.1), MM_BENCH_FANOUT_GIB (default 0.5),
MM_BENCH_KEEP=1 keeps the data.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.bench.common import RatioGoal, bench_dir, peer_bin, run_measured
from tests.support.modelgen import write_model
from tests.support.registry import Registry

ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "3"))
GIB = float(os.environ.get("MM_BENCH_GIB", "2.1"))
FANOUT_GIB = float(os.environ.get("MM_BENCH_FANOUT_GIB", "0.5"))
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
SHARDS = 8
PARALLEL = 4  # mm's default --workers, and curl's --parallel-max
BLOB_GET = re.compile(r'"GET /v2/(\S+)/blobs/sha256:[0-9a-f]{64} HTTP/1\.1" (200|206) (\d+)')


def make_model(root: Path, gib: float) -> Path:
    if not manifest_path(root).exists():
        shutil.rmtree(root, ignore_errors=True)
        write_model(root, shards=SHARDS, shard_bytes=int(gib * 2**30 / SHARDS), seed=7)
        manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", COMMIT, offline=True, jobs=2)
    return root


def curl_push(reg: Registry, repo: str, model: Path) -> list[str]:
    """One curl command that PUTs every file as a monolithic blob upload, PARALLEL at a time."""
    args = [peer_bin("curl"), "-sS", "--no-progress-meter", "--fail", "--parallel", "--parallel-max", str(PARALLEL),
            "-H", "Content-Type: application/octet-stream"]
    for f in read_manifest(manifest_path(model)).files:
        req = urllib.request.Request(f"{reg.url}/v2/{repo}/blobs/uploads/", method="POST")
        with urllib.request.urlopen(req) as resp:
            location = resp.headers["Location"]
        args += ["-T", str(model / f.path), f"{location}&digest=sha256:{f.sha256}", "-o", "/dev/null"]
    return args


def curl_pull(reg: Registry, repo: str, model: Path, dest: Path) -> list[str]:
    args = [peer_bin("curl"), "-sS", "--no-progress-meter", "--fail", "--parallel", "--parallel-max", str(PARALLEL)]
    for i, f in enumerate(read_manifest(manifest_path(model)).files):
        args += ["-o", str(dest / f"blob-{i}"), f"{reg.url}/v2/{repo}/blobs/sha256:{f.sha256}"]
    return args


def served(reg: Registry, repo: str, since: int) -> int:
    """Blob bytes the registry sent for REPO, from its access log after byte offset SINCE."""
    text = reg.log_text()[since:]
    return sum(int(m.group(3)) for m in BLOB_GET.finditer(text) if m.group(1) == repo)


def artifact_bytes(reg: Registry, repo: str, tag: str) -> int:
    req = urllib.request.Request(f"{reg.url}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req) as resp:
        doc = json.loads(resp.read())
    return sum(layer["size"] for layer in doc["layers"]) + doc["config"]["size"]


def push_pull(work: Path, reg: Registry, env: dict) -> None:
    model = make_model(work / "model", GIB)
    total = sum(f.size for f in read_manifest(manifest_path(model)).files)
    mm = peer_bin("mm")
    t: dict[str, list[float]] = {"curl push": [], "mm push": [], "curl pull": [], "curl pull + sync": [],
                                 "mm pull": []}
    rss: dict[str, int] = {}
    for i in range(ROUNDS):
        runs = [("curl push", lambda: curl_push(reg, f"peer/push{i}", model)),
                ("mm push", lambda: [mm, "push", str(model), f"{reg.host}/mm/push{i}:t", "--json"])]
        for name, cmd in (runs if i % 2 == 0 else runs[::-1]):
            seconds, peak = run_measured(cmd(), env)
            t[name].append(seconds)
            rss[name] = max(rss.get(name, 0), peak)
            print(f"  round {i + 1} {name:10s} {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s", flush=True)
        for name in ("curl pull", "mm pull")[:: 1 if i % 2 == 0 else -1]:
            dest = work / f"pull-{name.split()[0]}"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            cmd = (curl_pull(reg, "mm/push0", model, dest) if name == "curl pull"
                   else [mm, "pull", f"{reg.host}/mm/push0:t", "--local-dir", str(dest), "--json"])
            subprocess.run(["sync"], check=True)  # no dirty pages left from the run before
            seconds, peak = run_measured(cmd, env)
            t[name].append(seconds)
            rss[name] = max(rss.get(name, 0), peak)
            if name == "curl pull":  # the same durability as mm pull, which fsyncs each file before naming it
                flushed, _ = run_measured(["sync", *(str(p) for p in dest.rglob("*") if p.is_file())], env)
                t["curl pull + sync"].append(seconds + flushed)
            shutil.rmtree(dest, ignore_errors=True)
            print(f"  round {i + 1} {name:10s} {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s", flush=True)
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"model: {total / 2**30:.2f} GiB in {SHARDS} shards + dspark/, {ROUNDS} interleaved rounds, {PARALLEL} blobs at a time")
    for name in t:
        peak = f", peak RSS {rss[name] / 2**20:.0f} MiB" if name in rss else ""
        print(f"{name:10s} median {med[name]:6.2f} s ({total / med[name] / 1e9:.2f} GB/s){peak}")
    print(f"RATIO mm push / curl push wall time = {med['mm push'] / med['curl push']:.3f}")
    print(f"RATIO mm pull / curl pull wall time = {med['mm pull'] / med['curl pull']:.3f}  (goal <= 1.1)")
    print(RatioGoal("mm pull / curl pull, wall time", 1.1).verdict(
        [m / c for m, c in zip(t["mm pull"], t["curl pull"])]))
    print(f"RATIO mm pull / (curl pull + sync) wall time = {med['mm pull'] / med['curl pull + sync']:.3f}  "
          f"(the same durability: mm fsyncs each file; curl's files may still be in the page cache when it ends)")
    print(f"PEAK RSS mm push {rss['mm push'] / 1e6:.0f} MB, mm pull {rss['mm pull'] / 1e6:.0f} MB  (goal < 150 MB)")


def fan_out(work: Path, reg: Registry, env: dict) -> None:
    model = make_model(work / "fanout-model", FANOUT_GIB)
    mm = peer_bin("mm")
    ref = f"{reg.host}/fanout/model:t"
    run_measured([mm, "push", str(model), ref, "--json"], env)
    size = artifact_bytes(reg, "fanout/model", "t")
    print(f"fan-out: artifact {size / 2**30:.2f} GiB (all layers and config), K concurrent mm pull")
    for k in (1, 2, 4, 8):
        dests = [work / f"fanout-{k}-{j}" for j in range(k)]
        for d in dests:
            shutil.rmtree(d, ignore_errors=True)
        since = len(reg.log_text())
        start = time.perf_counter()
        # /usr/bin/time for each child's own peak RSS (see tests.bench.common.run_measured)
        procs = [subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", str(d) + ".rss", mm, "pull", ref, "--local-dir",
                                   str(d), "--json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for d in dests]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"mm pull failed: {p.stderr.read().decode()[-500:]}")
        wall = time.perf_counter() - start
        peaks = [int(Path(str(d) + ".rss").read_text().split()[-1]) * 1024 for d in dests]
        time.sleep(0.2)  # the access log line follows the response
        per_puller = served(reg, "fanout/model", since) / k / size
        print(f"  K={k}: wall {wall:6.2f} s, aggregate {k * size / wall / 1e9:5.2f} GB/s, registry served "
              f"{per_puller:.3f}x the artifact per puller, peak RSS {max(peaks) / 2**20:.0f} MiB", flush=True)
        for d in dests:
            shutil.rmtree(d, ignore_errors=True)
            Path(str(d) + ".rss").unlink(missing_ok=True)


def main() -> None:
    work = bench_dir("oci")
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               DOCKER_CONFIG=str(work / "docker-config"))
    env.pop("REGISTRY_AUTH_FILE", None)
    try:
        with Registry(work / "registry") as reg:
            push_pull(work, reg, env)
            fan_out(work, reg, env)
    finally:
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
