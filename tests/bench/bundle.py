"""Bundle and unbundle >= 4 GiB (several ~1 GiB shards), interleaved with `tar -cf` and `tar -xf` of the same
directory, on the same disk, page cache warm (each run's input read into it just before). Prints time ratios mm/tar,
the CPU each spent (user and sys, from getrusage of the children), the bytes each read from the disk, mm's peak RSS,
and the load average of each round.

mm fsyncs every volume and file it writes; tar does neither. So each mm figure is set against the tar run of the
same durability: `mm bundle` against `tar -cf` + `sync FILE`, `mm bundle --no-sync` against plain `tar -cf` (mm
hashes every byte, tar does not), and the same for unbundle and `tar -xf` + `sync FILES`. Every run starts with
no dirty pages (`sync` before it), as the tar run did.
Each round takes the eight runs in another order (common.round_order), so no run always follows the same one: on
this VM a run right after one that freed gigabytes of page cache pays for memory the guest had handed back to the
host (docs/bundle.md, "Copying and durability"). Each round's ratios are printed with its load average.
Goals: durable mm bundle and mm unbundle at most 1.05 x the time of tar + sync; peak RSS < 150 MB; each printed by
common.RatioGoal (median of the rounds, spread, verdict).
Environment: MM_BENCH_BUNDLE_SHARDS (4), MM_BENCH_BUNDLE_SHARD_BYTES (1 GiB), MM_BENCH_ROUNDS (2), MM_BENCH_KEEP=1,
MM_BENCH_BUNDLE_STEPS (the mm runs to time, each beside its tar peer, comma-separated: default all four, e.g.
`unbundle` for the durable unbundle goal alone),
MM_BENCH_DROP_CACHES=1 (root: each run starts with the page cache dropped instead of its input read into it, the
durable unbundle goal's setting on the 16-core GPU host, e.g.
  MM_BENCH_ROUNDS=5 MM_BENCH_DROP_CACHES=1 MM_BENCH_BUNDLE_SHARDS=4 MM_BENCH_BUNDLE_SHARD_BYTES=2147483648 \
      python3 -m tests.bench.run bundle
needs about 4 x the model on the disk: the model, the archive and volumes the extractions read, one output).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from pathlib import Path

from tests.bench.common import (RatioGoal, Usage, drop_caches, drop_caches_between_steps, load_average, peer_bin,
                                make_bench_model, returned_to_host, round_order, run_usage)

WORK = Path(__file__).resolve().parents[2] / "bench-work" / "bundle"
MM = Path(peer_bin("mm"))
SHARDS = int(os.environ.get("MM_BENCH_BUNDLE_SHARDS", "4"))
SHARD_BYTES = int(os.environ.get("MM_BENCH_BUNDLE_SHARD_BYTES", str(1024**3)))
VOLUME_SIZE = "1.5G"  # decimal: each 1 GiB shard lands whole or split across two volumes
ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "2"))
PAIRS = PAIRS_ALL = [  # (mm run, its tar peer, goal on the time ratio mm/peer or None)
    ("bundle", "tar -cf + sync", 1.05),
    ("bundle --no-sync", "tar -cf", None),
    ("unbundle", "tar -xf + sync", 1.05),
    ("unbundle --no-sync", "tar -xf", None),
]
_STEPS = os.environ.get("MM_BENCH_BUNDLE_STEPS", "")
if _STEPS:
    PAIRS = [pair for pair in PAIRS if pair[0] in _STEPS.split(",")]
    if not PAIRS:
        raise SystemExit(f"MM_BENCH_BUNDLE_STEPS={_STEPS!r}: name runs of " + ", ".join(m for m, _, _ in PAIRS_ALL))


def _files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file()]


def _sum(a: Usage, b: Usage) -> Usage:
    return Usage(a.seconds + b.seconds, max(a.peak_rss, b.peak_rss), a.user + b.user, a.sys + b.sys,
                 a.read_from_disk + b.read_from_disk, a.written_to_disk + b.written_to_disk)


def _fresh(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    subprocess.run(["sync"], check=True)  # no dirty pages left from the run before


def _warm(*paths: Path) -> None:
    """Read the inputs of the next run into the page cache: mm bundle leaves its volumes out of it (they go to
    another disk), tar -cf leaves its archive in; each reader starts warm, as the bundle runs do. Twice: pages read
    once stay on the kernel's inactive list and are the first to go when the run's own writes need memory (the
    volumes, read once, were: mm unbundle then read 1.3-1.6 GB of them from the disk, tar none of its archive,
    which tar had written and the warm-up read)."""
    files = [str(f) for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    for _ in range(2):
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


def _runs(src: Path) -> dict[str, tuple[Path, Path, object]]:
    """Each run by name: (its input, its output, how to run it). The extractions read an archive and volumes made
    once before the rounds, so the runs do not depend on each other and every round can take them in another
    order (round_order)."""
    tar_in, vols_in, out = WORK / "model.tar", WORK / "vols", WORK / "out"
    t = lambda cmd: run_usage(cmd, WORK / "time.txt")  # noqa: E731
    bundle = lambda dst, *extra: t([str(MM), "bundle", str(src), "--out", str(dst), "--volume-size",  # noqa: E731
                                    VOLUME_SIZE, "--no-mm", *extra])

    def tar_x(dst: Path, sync: bool) -> Usage:
        dst.mkdir()
        x = t(["tar", "-xf", str(tar_in), "-C", str(dst)])
        return _sum(x, t(["sync", *_files(dst)])) if sync else x

    runs = {
        "tar -cf": (src, out / "cf.tar", lambda dst: t(["tar", "-cf", str(dst), "-C", str(src), "."])),
        "tar -cf + sync": (src, out / "cf-sync.tar", lambda dst: _sum(
            t(["tar", "-cf", str(dst), "-C", str(src), "."]), t(["sync", str(dst)]))),
        "bundle": (src, out / "vols", lambda dst: bundle(dst)),
        "bundle --no-sync": (src, out / "vols-nosync", lambda dst: bundle(dst, "--no-sync")),
        "tar -xf": (tar_in, out / "tar-x", lambda dst: tar_x(dst, False)),
        "tar -xf + sync": (tar_in, out / "tar-x-sync", lambda dst: tar_x(dst, True)),
        "unbundle": (vols_in, out / "dest", lambda dst: t([str(MM), "unbundle", str(vols_in), "--dest", str(dst)])),
        "unbundle --no-sync": (vols_in, out / "dest-nosync", lambda dst: t(
            [str(MM), "unbundle", str(vols_in), "--dest", str(dst), "--no-sync"])),
    }
    return {name: run for name, run in runs.items() if any(name in pair[:2] for pair in PAIRS)}


def one_round(src: Path, rnd: int, cold: bool = False) -> tuple[dict[str, Usage], dict[str, tuple[int, int]]]:
    """Every run once, in this round's order; each starts with its own output gone, no dirty pages (sync) and its
    input in the page cache (COLD: the page cache dropped instead), and its output is deleted once it is measured."""
    runs = _runs(src)
    got: dict[str, Usage] = {}
    handed: dict[str, tuple[int, int]] = {}
    for name in round_order(list(runs), rnd):
        given, dst, run = runs[name]
        dst.parent.mkdir(parents=True, exist_ok=True)
        since = returned_to_host()
        _fresh(dst)
        drop_caches() if cold else _warm(given)
        now = returned_to_host()
        got[name] = run(dst)
        after = returned_to_host()
        if since is not None and now is not None and after is not None:
            handed[name] = (now - since, after - now)
        _fresh(dst)
    return {name: got[name] for name in runs}, handed


def _prepare_inputs(src: Path) -> None:
    """The archive and the volumes the extractions read, made once (durable, then left on the disk)."""
    tar_in, vols_in = WORK / "model.tar", WORK / "vols"
    _fresh(tar_in, vols_in)
    subprocess.run(["tar", "-cf", str(tar_in), "-C", str(src), "."], check=True)
    subprocess.run([str(MM), "bundle", str(src), "--out", str(vols_in), "--volume-size", VOLUME_SIZE, "--no-mm"],
                   check=True, capture_output=True)
    subprocess.run(["sync"], check=True)


def main() -> None:
    cold = drop_caches_between_steps()
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / "model"
    print(f"bench bundle: writing a {SHARDS} x {SHARD_BYTES / 2**30:.2f} GiB model into {src} ...", flush=True)
    total = make_bench_model(src, SHARDS, SHARD_BYTES)
    subprocess.run(["cat", *_files(src)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    _prepare_inputs(src)
    rounds: list[dict[str, Usage]] = []
    loads: list[str] = []
    for rnd in range(ROUNDS):
        before = load_average()
        got, handed = one_round(src, rnd, cold)
        rounds.append(got)
        loads.append(f"{before} -> {load_average()}")
        print(f"  round {rnd + 1} ({loads[-1]}), order {' | '.join(round_order(list(rounds[-1]), rnd))}:\n    "
              + ", ".join(f"{k} {u.seconds:.2f}s" for k, u in rounds[-1].items()), flush=True)
        print("    ratios this round: " + ", ".join(f"{mine} / {peer} {rounds[-1][mine].seconds / rounds[-1][peer].seconds:.2f}"
                                            for mine, peer, _ in PAIRS), flush=True)
        if handed:  # free page reporting: what the next run's fresh memory then faults back in from the host
            print("    memory the guest handed back to the host before / during each run: "
                  + ", ".join(f"{k} {a / 1e9:.2f} / {b / 1e9:.2f} GB" for k, (a, b) in handed.items()), flush=True)
    gb = total / 1e9
    print(f"bench bundle: {total / 2**30:.2f} GiB, {SHARDS} shards, volumes of {VOLUME_SIZE}, {ROUNDS} interleaved rounds"
          f"{', page cache dropped before each run' if cold else ', inputs in the page cache'}")
    print(f"  {'run':<20} {'GB/s':>6} {'wall s':>7} {'user s':>7} {'sys s':>6} {'disk read GB':>12}   (medians)")
    for name in rounds[0]:
        med = lambda f: statistics.median(f(r[name]) for r in rounds)  # noqa: E731
        print(f"  {name:<20} {gb / med(lambda u: u.seconds):6.2f} {med(lambda u: u.seconds):7.2f} "
              f"{med(lambda u: u.user):7.2f} {med(lambda u: u.sys):6.2f} {med(lambda u: u.read_from_disk) / 1e9:12.2f}")
    for mine, peer, goal in PAIRS:  # median of the per-round ratios: each pair ran side by side
        ratio = statistics.median(r[mine].seconds / r[peer].seconds for r in rounds)
        sys_ratio = statistics.median(r[mine].sys / max(r[peer].sys, 0.01) for r in rounds)
        per_round = ", ".join(f"{r[mine].seconds / r[peer].seconds:.2f} (load {load.split()[1]})"
                              for r, load in zip(rounds, loads))
        print(f"  ratio {mine} / {peer:<16} {ratio:5.2f} x the time (rounds: {per_round}); sys time {sys_ratio:.2f} x")
    for mine, peer, goal in PAIRS:
        if goal:
            print(RatioGoal(f"{mine} / {peer}", goal).verdict([r[mine].seconds / r[peer].seconds for r in rounds]))
    peaks = [max(r[mine].peak_rss for mine, _, _ in PAIRS) / 1e6 for r in rounds]
    print(RatioGoal("peak RSS of mm bundle/unbundle", 150, unit=" MB").verdict(peaks))
    print("  load average per round: " + "; ".join(loads))
    if not os.environ.get("MM_BENCH_KEEP"):
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
