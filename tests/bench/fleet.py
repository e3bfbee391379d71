"""Benchmark: a site's fan-out through real pull-through caches. Debian's docker-registry 2.8 as origin -> T1 -> T2
(proxy mode) on loopback, each behind a byte-counting proxy (tests/support/registry_chain.py); a ModelPack of
BLOBS shards of MIB MiB pushed to the origin.

1. `mm preheat` T1 then T2: bytes read per tier, and what the origin and T1 served (multiples of the artifact).
2. NODES concurrent `mm pull ORIGIN_REF --mirror T2` (T2 itself: its bytes need no counting, and the counting
   proxy's thread pair per connection would be what is measured) into separate directories (a "node" is a process here: on a
   small box they share its cores and disk): every one must exit 0 (its copy proven); the origin must have served
   each blob at most 2x and T1 at most 3x in all (goal); aggregate pull rate against NODES concurrent curl of the
   same blobs from T2 in the same run (goal >= 0.8x); peak RSS per node (goal < 150 MB). Each wave's CPU (user and
   system seconds per GiB, from wait4) and the bytes the nodes read back are printed, and, beside the goal, the
   ratio to curl followed by `sync` (mm's copies are on the disk when it ends; curl's are in the page cache).
3. A second wave of NODES: nothing more at the origin or T1 (manifests and headers only).
4. A fresh chain without preheat: NODES cold pulls through T2 all succeed; the origin's multiple printed.
5. A mirror serving a corrupted blob (first in --mirror order): named and skipped, every node still right.
6. T2 killed mid-pull (`--mirror T2 --mirror T1`): every node goes on from T1 and ends proven, none named ready
   unproven.

Environment: MM_BENCH_FLEET_BLOBS (default 4), MM_BENCH_FLEET_MIB (default 256), MM_BENCH_FLEET_NODES (default 32),
MM_BENCH_FLEET_ROUNDS (default 3: interleaved pairs of an mm wave and a curl wave; the rate goal is the median of
their ratios, RatioGoal), MM_BENCH_FLEET_SKIP_FAULTS=1 (leaves out steps 5 and 6), MM_BENCH_FLEET_RATE_ONLY=1 (steps 1 and 2 only: more rounds
of the rate goal inside a host's time limit), MM_BENCH_KEEP=1 keeps the data.
MM_BENCH_REGISTRY_BIN: the docker-registry binary (distribution 2.8) where it is not /usr/bin/docker-registry nor
on PATH. Needs on the host: python3 with mm installed (`pip install -e .[test]`: the bench imports tests.support),
that docker-registry binary, and curl; nothing else from Debian (peak RSS comes from wait4).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.bench.common import RatioGoal, bench_dir, make_bench_model, peer_bin
from tests.support.registry_chain import Chain

BLOBS = int(os.environ.get("MM_BENCH_FLEET_BLOBS", "4"))
MIB = int(os.environ.get("MM_BENCH_FLEET_MIB", "256"))
NODES = int(os.environ.get("MM_BENCH_FLEET_NODES", "32"))
ROUNDS = int(os.environ.get("MM_BENCH_FLEET_ROUNDS", "3"))
SKIP_FAULTS = os.environ.get("MM_BENCH_FLEET_SKIP_FAULTS") == "1"
RATE_ONLY = os.environ.get("MM_BENCH_FLEET_RATE_ONLY") == "1"
RATE_GOAL = RatioGoal("mm pull / curl aggregate rate from T2", 0.8, at_most=False)
REPO = "fleet/model"
SMALL = 256 * 1024  # what a warm pass may still move at a tier: manifests and headers (mm's margin)


def run(cmd: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)


# Each node runs under this small launcher, which forks it and reads its peak RSS from wait4. Not wait4 in this
# process: a child forked from it starts with this process's pages, and Linux keeps that high-water mark across
# exec, so every node would report at least this bench's own RSS (the model it made: over 300 MB).
LAUNCHER = ("import os, sys\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.execvp(sys.argv[2], sys.argv[2:])\n"
            "_, status, usage = os.wait4(pid, 0)\n"
            "open(sys.argv[1], 'w').write(f'{usage.ru_maxrss} {usage.ru_utime} {usage.ru_stime}')\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")


def wave(cmds: list[list], env: dict, rss_dir: Path) -> tuple[float, list[int], list[str]]:
    """Start every command at once; (wall seconds, exit codes, what each said went wrong), peak RSS of each in
    RSS_DIR (in KiB, from wait4 in LAUNCHER: no GNU time needed on the host). Outputs go to files in RSS_DIR, so no pipe fills."""
    rss_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    procs = []
    for i, cmd in enumerate(cmds):
        with open(rss_dir / f"{i}.out", "w") as out, open(rss_dir / f"{i}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, str(rss_dir / f"{i}.rss"),
                                           *map(str, cmd)], env=env, stdout=out, stderr=err))
    codes = [proc.wait() for proc in procs]  # the launcher wrote each node's peak RSS (KiB on Linux)
    wall = time.perf_counter() - start
    said = [trouble((rss_dir / f"{i}.out").read_text(), (rss_dir / f"{i}.err").read_text()) for i in range(len(cmds))]
    return wall, codes, said


def trouble(out: str, err: str) -> str:
    """A pull's failures and skipped sources (from its --json), else its stderr's tail."""
    try:
        doc = json.loads(out)
    except ValueError:
        return err[-400:]
    lines = [f"{f['path']}: {f['error']}" for f in doc.get("files", []) if f.get("status") == "failed"]
    lines += [f"skipped {s['source']} for {s['what']}: {s['reason']}" for s in doc.get("skipped", [])]
    return "; ".join(lines)[:600] or err[-400:]


def read_back(rss_dir: Path) -> str:
    """The bytes the nodes' pulls hashed from memory and read back from the disk (their --json transfer)."""
    window = back = 0
    for out in rss_dir.glob("*.out"):
        try:
            transfer = json.loads(out.read_text()).get("transfer") or {}
        except ValueError:
            continue
        window += transfer.get("hashed_from_window", 0)
        back += transfer.get("read_back", 0)
    return f"hashed from memory {window / 2**20:.0f} MiB, read back {back / 2**20:.0f} MiB in all"


def pull_seconds(rss_dir: Path) -> str:
    """The shortest and longest of the nodes' own pull times (their --json `seconds`: from the reference's resolve
    to the quick verify); the rest of the wave's wall time is each process starting (imports) and ending."""
    seconds = []
    for out in rss_dir.glob("*.out"):
        try:
            seconds.append(float(json.loads(out.read_text())["seconds"]))
        except (ValueError, KeyError, TypeError):
            continue
    return f"each node's pull {min(seconds):.1f}-{max(seconds):.1f} s" if seconds else "no node's pull time"


def peak_rss(rss_dir: Path) -> int:
    return max(int(p.read_text().split()[0]) * 1024 for p in rss_dir.glob("*.rss"))


def cpu(rss_dir: Path, nbytes: int) -> str:
    """The CPU the wave's processes spent (user and system, from wait4), per GiB they moved: where a wave is
    bound by the cores, this is what sets its rate (the registry's own share is the same for mm and curl)."""
    user = system = 0.0
    for p in rss_dir.glob("*.rss"):
        fields = p.read_text().split()
        user, system = user + float(fields[1]), system + float(fields[2])
    gib = nbytes / 2**30
    return f"CPU {user / gib:.2f} user + {system / gib:.2f} system s/GiB"


def report_trouble(codes: list[int], errs: list[str]) -> None:
    """The first failed node's reasons, and how many nodes passed a source over."""
    failed = [e for c, e in zip(codes, errs) if c]
    if failed:
        print(f"  {len(failed)} failed; the first: {failed[0]}")
    passed_over = [e for c, e in zip(codes, errs) if not c and "skipped" in e]
    if passed_over:
        print(f"  {len(passed_over)} nodes passed a source over; the first: {passed_over[0]}")


def pulls(ref: str, dests: list[Path], *args) -> list[list]:
    return [[peer_bin("mm"), "pull", ref, "--local-dir", d, "--json", *args] for d in dests]


def curls(url: str, digests: list[str], dests: list[Path]) -> list[list]:
    out = []
    for d in dests:
        d.mkdir(parents=True, exist_ok=True)
        cmd = [peer_bin("curl"), "-sS", "--fail", "--parallel", "--parallel-max", "4"]
        for i, digest in enumerate(digests):
            cmd += ["-o", d / f"blob-{i}", f"{url}/v2/{REPO}/blobs/{digest}"]
        out.append(cmd)
    return out


def clear(paths) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def main() -> None:
    work = bench_dir("fleet")
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               DOCKER_CONFIG=str(work / "docker-config"))
    env.pop("REGISTRY_AUTH_FILE", None)
    mm = peer_bin("mm")
    try:
        model = work / "model"
        make_bench_model(model, BLOBS, MIB << 20)
        files = read_manifest(manifest_path(model)).files
        digests = sorted({f"sha256:{f.sha256}" for f in files})
        total = sum(f.size for f in files)
        print(f"fleet: {BLOBS} x {MIB} MiB + small files ({total / 2**20:.0f} MiB), {NODES} nodes (processes on "
              f"{os.cpu_count()} cores), origin -> T1 -> T2 (docker-registry 2.8, proxy mode)", flush=True)
        with Chain(work / "chain") as chain:
            t1, t2 = chain.tiers
            ref = f"{chain.origin.host}/{REPO}:v1"
            assert run([mm, "push", model, ref, "--json"], env).returncode == 0
            chain.reset()
            start = time.perf_counter()
            got = run([mm, "preheat", ref, "--tier", t1.host, "--tier", t2.host, "--json"], env)
            assert got.returncode == 0, got.stderr
            report = json.loads(got.stdout)
            ref = f"{chain.origin.host}/{REPO}@{report['digest']}"  # by digest: a tag is asked upstream at every tier
            print(f"preheat: {time.perf_counter() - start:.1f} s; " + "; ".join(
                f"{t['tier']} read {t['bytes_read'] / 2**20:.0f} MiB ({t['fetched']} fetched, {t['warm']} warm; "
                f"{t['stored']} stored, {t['not_stored']} not, waited {t['waited']:.1f} s, "
                f"{sum(b['looks'] for b in t['blobs'])} looks)"
                for t in report["tiers"]), flush=True)
            for t in report["tiers"]:  # the blobs a look found still being stored (each such look moved blob bytes)
                late = [b for b in t["blobs"] if b["looks"] > 1]
                slowest = max(b["read_seconds"] for b in t["blobs"])
                print(f"  {t['tier']}: slowest read {slowest:.2f} s; looked at again: "
                      + (", ".join(f"{b['size'] / 2**20:.1f} MiB x{b['looks']} (stored after "
                                   f"{b['stored_after'] or 0:.2f} s)" for b in late) or "none"))
            print(f"  origin served {chain.origin.served / total:.4f}x ({chain.origin.served - 2 * total} bytes over "
                  f"2x), T1 {t1.served / total:.4f}x ({t1.served - 3 * total} bytes over 3x) the artifact")

            dests = [work / f"node-{i}" for i in range(NODES)]
            cdests = [work / f"curl-{i}" for i in range(NODES)]
            ratios, synced = [], []
            os.sync()  # the push's and the preheat's writes are not the first wave's to wait for
            for rnd in range(ROUNDS):
                wall, codes, errs = wave(pulls(ref, dests, "--mirror", t2.direct_host), env, work / "rss1")
                ok = sum(c == 0 for c in codes)
                mm_rate = NODES * total / wall
                print(f"wave 1, round {rnd + 1}: {ok}/{NODES} nodes proven in {wall:.1f} s, aggregate "
                      f"{mm_rate / 1e6:.0f} MB/s, peak RSS {peak_rss(work / 'rss1') / 1e6:.0f} MB per node (goal < "
                      f"150 MB), {read_back(work / 'rss1')}, {cpu(work / 'rss1', NODES * total)}, "
                      f"{pull_seconds(work / 'rss1')} (load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
                report_trouble(codes, errs)
                if rnd == 0:
                    origin_x, t1_x = chain.origin.served / total, t1.served / total
                    print(f"  origin served {origin_x:.2f}x (goal <= 2), T1 {t1_x:.2f}x (goal <= 3) the artifact, "
                          f"preheat included")
                clear(dests)
                cwall, ccodes, _ = wave(curls(f"http://{t2.direct_host}", digests, cdests), env, work / "rssc")
                start = time.perf_counter()
                os.sync()  # what curl left in the page cache, on the disk: what mm's fsync before naming costs it
                sync = time.perf_counter() - start
                clear(cdests)
                curl_rate = NODES * total / cwall
                print(f"  curl: {sum(c == 0 for c in ccodes)}/{NODES} in {cwall:.1f} s, aggregate "
                      f"{curl_rate / 1e6:.0f} MB/s, {cpu(work / 'rssc', NODES * total)}; mm / curl "
                      f"{mm_rate / curl_rate:.3f}; then sync {sync:.1f} s: mm / (curl + sync) "
                      f"{mm_rate * (cwall + sync) / (NODES * total):.3f}", flush=True)
                ratios.append(mm_rate / curl_rate)
                synced.append(mm_rate * (cwall + sync) / (NODES * total))
            print(RATE_GOAL.verdict(ratios), flush=True)
            print(f"  beside it (not the goal): mm / (curl, then sync of its files) {sorted(synced)[len(synced) // 2]:.2f} "
                  f"(median of {len(synced)}, spread {min(synced):.2f}-{max(synced):.2f}): mm's copies are on the disk "
                  f"when it ends, curl's in the page cache", flush=True)
            if RATE_ONLY:
                return

            before_o, before_t1 = chain.origin.served, t1.served
            wall, codes, errs = wave(pulls(ref, dests, "--mirror", t2.direct_host), env, work / "rss2")
            print(f"wave 2: {sum(c == 0 for c in codes)}/{NODES} proven in {wall:.1f} s; added at the origin "
                  f"{chain.origin.served - before_o} bytes, at T1 {t1.served - before_t1} bytes (manifests, headers)",
                  flush=True)
            report_trouble(codes, errs)
            clear(dests)

            if not SKIP_FAULTS:  # steps 5 and 6
                # a corrupted mirror first in the order: named, skipped for that blob
                with Chain(work / "bad", tiers=0) as bad:
                    assert run([mm, "push", model, f"{bad.origin.host}/{REPO}:v1", "--json"], env).returncode == 0
                    blob = bad.origin.registry.blob_path(f"sha256:{max(files, key=lambda f: f.size).sha256}")
                    data = bytearray(blob.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    blob.write_bytes(bytes(data))
                    got = run([mm, "pull", ref, "--local-dir", dests[0], "--mirror", bad.origin.host, "--mirror", t2.direct_host],
                              env)
                    named = f"skipped mirror {bad.origin.host}" in got.stderr and "does not match its digest" in got.stderr
                    print(f"corrupt mirror: exit {got.returncode}, named and skipped: {named}", flush=True)
                    clear(dests[:1])

                # T2 killed mid-pull: every node goes on from T1
                t2.proxy.rate = max(1 << 20, total // 8)
                dests_k = dests[:max(1, NODES // 4)]
                procs = [subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True) for cmd in pulls(ref, dests_k, "--mirror", t2.host, "--mirror", t1.host)]
                time.sleep(2)
                chain.kill(t2)
                results = [p.communicate() for p in procs]
                proven = sum(p.returncode == 0 and not json.loads(out)["verify_problems"] for p, (out, _) in zip(procs, results))
                ready_unproven = sum(p.returncode != 0 and manifest_path(d).exists() for p, d in zip(procs, dests_k))
                print(f"T2 killed mid-pull: {proven}/{len(dests_k)} nodes proven from the next source; named ready "
                      f"unproven: {ready_unproven}", flush=True)
                clear(dests_k)

        with Chain(work / "cold") as cold:
            got = run([mm, "push", model, f"{cold.origin.host}/{REPO}:v1", "--json"], env)
            assert got.returncode == 0, got.stderr
            ref = f"{cold.origin.host}/{REPO}@{json.loads(got.stdout)['digest']}"
            cold.reset()
            wall, codes, errs = wave(pulls(ref, dests, "--mirror", cold.tiers[1].direct_host), env, work / "rss3")
            print(f"cold, no preheat: {sum(c == 0 for c in codes)}/{NODES} nodes proven in {wall:.1f} s; origin "
                  f"served {cold.origin.served / total:.2f}x, T1 {cold.tiers[0].served / total:.2f}x the artifact "
                  f"(preheated: {origin_x:.2f}x, {t1_x:.2f}x)", flush=True)
            report_trouble(codes, errs)
            clear(dests)
    finally:
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
