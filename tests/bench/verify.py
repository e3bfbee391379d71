"""Benchmark `mm verify` against `b3sum --check` and `sha256sum -c` on >= 4 GiB of real safetensors shards.

Page cache warm, runs interleaved in rotating order (the machines are shared and noisy, so the
figures that count are the ratios of runs made side by side). Prints throughputs, the ratios
mm/b3sum and mm/sha256sum, and mm's peak RSS (the child's ru_maxrss). Then times `mm verify --quick`
on a repo of 10,000 small files, against `find -printf '%s'` (a bare size listing) and `b3sum --check`.

Goals: mm >= 0.9 x b3sum (1.0 x asked at 8 GiB warm), >= 4 x sha256sum, peak RSS < 150 MB
(RssAnon and RssFile printed apart: mapped file pages are page cache, not memory of mm's own).
On many cores tests/bench/verify_cores.py measures the same on a device machine, before and after a change.
Environment: MM_BENCH_GIB (default 8), MM_BENCH_ROUNDS (default 3), MM_BENCH_KEEP=1 keeps the data.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mm.artifacts.integrity.hashing import hash_file
from mm.artifacts.integrity.manifest import FileEntry, Manifest, export_sums, read_manifest, write_manifest
from mm.artifacts.paths import manifest_path
from tests.bench.common import RatioGoal, peer_bin
from tests.support.modelgen import write_model

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench-work" / "verify"
MM = peer_bin("mm")
B3SUM = peer_bin("b3sum")
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
SHARD_BYTES = 768 * 1024 * 1024
SMALL_FILES = 10_000


PEAKS: dict[str, dict[str, int]] = {}  # command's first words -> the peaks of RssAnon and RssFile (kB) seen


def _sample_rss(timer: subprocess.Popen, key: str) -> None:
    """Peaks of RssAnon (the process's own memory) and RssFile (mapped file pages: page cache it maps, no memory
    of its own) of the command /usr/bin/time runs, from /proc/PID/status every 2 ms."""
    from tests.bench.verify_cores import peak_status

    peaks = PEAKS.setdefault(key, {"RssAnon": 0, "RssFile": 0})
    child: list[str] = []
    while not child and timer.poll() is None:
        try:
            child = Path(f"/proc/{timer.pid}/task/{timer.pid}/children").read_text().split()
        except OSError:
            pass
        time.sleep(0.001)
    if child:
        peak_status(child[0], peaks, lambda: timer.poll() is not None)


def run(cmd: list[str], cwd: Path) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of one child; raises if it fails.

    RSS comes from /usr/bin/time, not from our own wait4: a child forked from this (large) process
    would carry our RSS into its ru_maxrss until it execs. Its parts are sampled beside (PEAKS).
    """
    import threading

    rss_file = WORK / "rss.txt"
    started = time.perf_counter()
    timer = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd], cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = threading.Thread(target=_sample_rss, args=(timer, " ".join(Path(c).name for c in cmd[:2])))
    sampler.start()
    stdout, stderr = timer.communicate()
    seconds = time.perf_counter() - started
    sampler.join()
    if timer.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} exited {timer.returncode}: {stderr.decode()[-500:]}")
    return seconds, int(rss_file.read_text().split()[-1]) * 1024, stdout.decode()


def make_manifest(root: Path, jobs: int = 2) -> Manifest:
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and not p.relative_to(root).as_posix().startswith(".mm/"))

    def entry(rel: str) -> FileEntry:
        d = hash_file(root / rel)
        return FileEntry(path=rel, size=d.size, blake3=d.blake3, sha256=d.sha256)

    with ThreadPoolExecutor(jobs) as pool:
        m = Manifest(repo_id="MiniMaxAI/MiniMax-M3.1-Flash", revision=COMMIT, files=tuple(pool.map(entry, paths)))
    write_manifest(m, manifest_path(root))
    (root / ".mm" / "B3SUMS").write_text(export_sums(m, "blake3"))
    (root / ".mm" / "SHA256SUMS").write_text(export_sums(m, "sha256"))
    return m


def build_shards(gib: float) -> tuple[Path, int]:
    model = WORK / "model"
    stamp = WORK / f"model-{gib}.ready"
    if not stamp.exists():
        shutil.rmtree(WORK, ignore_errors=True)
        shards = max(1, round(gib * 1024**3 / SHARD_BYTES))
        print(f"generating {shards} shards of ~{SHARD_BYTES >> 20} MiB in {model} ...", flush=True)
        write_model(model, shards=shards, shard_bytes=SHARD_BYTES, draft=True, seed=1)
        make_manifest(model)
        stamp.touch()
    total = read_manifest(manifest_path(model)).total_bytes
    return model, total


def build_small_repo() -> Path:
    repo = WORK / "small"
    stamp = WORK / "small.ready"
    if not stamp.exists():
        shutil.rmtree(repo, ignore_errors=True)
        for i in range(SMALL_FILES):
            d = repo / f"d{i // 100:03d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i:05d}.json").write_bytes(os.urandom(256 + i % 1024))
        make_manifest(repo)
        stamp.touch()
    return repo


def warm(root: Path) -> None:
    """Pull every file into the page cache again: on a shared machine other work evicts it between runs."""
    files = [str(p) for p in root.rglob("*") if p.is_file()]
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *files[i:i + 500]], stdout=subprocess.DEVNULL, check=True)


def interleaved(tools: dict[str, list[str]], cwd: Path, rounds: int) -> dict[str, list[tuple[float, int, str]]]:
    """Each tool once a round, the order rotating, the page cache re-warmed before every run."""
    results: dict[str, list[tuple[float, int, str]]] = {name: [] for name in tools}
    names = list(tools)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            warm(cwd)
            results[name].append(run(tools[name], cwd))
    return results


def main() -> None:
    gib = float(os.environ.get("MM_BENCH_GIB", "8"))
    rounds = int(os.environ.get("MM_BENCH_ROUNDS", "3"))
    WORK.mkdir(parents=True, exist_ok=True)
    model, total = build_shards(gib)
    print(f"data: {total / 1024**3:.2f} GiB in {len(list(model.rglob('*.safetensors')))} safetensors files; "
          f"{os.cpu_count()} cores; {rounds} interleaved rounds; page cache re-warmed before every run", flush=True)
    tools = {
        "mm verify": [MM, "verify", "--json", str(model)],
        "b3sum --check": [B3SUM, "--check", ".mm/B3SUMS"],
        "sha256sum -c": ["sha256sum", "-c", ".mm/SHA256SUMS"],
    }
    res = interleaved(tools, model, rounds)
    rate = {name: total / statistics.median(s for s, _, _ in runs) for name, runs in res.items()}
    for name, runs in res.items():
        times = ", ".join(f"{s:.2f}" for s, _, _ in runs)
        print(f"  {name:<14} {rate[name] / 1e9:6.2f} GB/s (median; runs {times} s), peak RSS {max(m for _, m, _ in runs) / 1e6:.0f} MB")
    mm_rss = max(m for _, m, _ in res["mm verify"])
    inner = statistics.median(json.loads(o)["bytes_per_second"] for _, _, o in res["mm verify"])
    per_round = lambda peer: [p[0] / m[0] for m, p in zip(res["mm verify"], res[peer])]  # noqa: E731 - speed ratios
    print(RatioGoal("mm verify speed / b3sum --check (whole command, warm)", 0.9, at_most=False).verdict(
        per_round("b3sum --check")))
    print(RatioGoal("mm verify's own hashing speed / b3sum --check (its --json seconds, start-up left out)", 1.0,
                    at_most=False).verdict([p[0] / json.loads(m[2])["seconds"]
                                            for m, p in zip(res["mm verify"], res["b3sum --check"])]))
    print(RatioGoal("mm verify speed / sha256sum -c", 4, at_most=False).verdict(per_round("sha256sum -c")))
    print(RatioGoal("mm verify peak RSS", 150, unit=" MB").verdict([m / 1e6 for _, m, _ in res["mm verify"]]))
    print(f"  mm peak RSS        = {mm_rss / 1e6:.0f} MB; sampled peaks: "
          + "; ".join(f"{k}: RssAnon {v['RssAnon'] / 1024:.0f} MB, RssFile {v['RssFile'] / 1024:.0f} MB"
                      for k, v in PEAKS.items()))
    print(f"  {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    startup = statistics.median(run([MM, "--help"], model)[0] for _ in range(3))
    print(f"  mm start-up alone (mm --help): {startup:.2f} s; mm's own hashing rate, start-up excluded: "
          f"{inner / 1e9:.2f} GB/s = {inner / rate['b3sum --check']:.2f} x b3sum", flush=True)

    small = build_small_repo()
    quick = {
        "mm verify --quick": [MM, "verify", "--quick", str(small)],
        "find -printf %s": ["find", str(small), "-type", "f", "-printf", "%s %p\n"],
        "mm verify": [MM, "verify", str(small)],
        "b3sum --check": [B3SUM, "--check", ".mm/B3SUMS"],
    }
    res = interleaved(quick, small, rounds)
    med = {name: statistics.median(s for s, _, _ in runs) for name, runs in res.items()}
    print(f"{SMALL_FILES} small files:")
    for name, s in med.items():
        print(f"  {name:<18} {s:.2f} s (median)")
    print(f"  ratio mm --quick / find = {med['mm verify --quick'] / med['find -printf %s']:.1f} x the time "
          f"(mm start-up {startup:.2f} s of it)")
    print(f"  ratio mm verify / b3sum --check = {med['mm verify'] / med['b3sum --check']:.2f} x the time")
    if os.environ.get("MM_BENCH_KEEP") != "1":
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
