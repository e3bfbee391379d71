"""mm verify on the GPU host (16 cores, or pinned to fewer): peak RSS (VmHWM, wait4's ru_maxrss, and the peaks of
RssAnon and RssFile sampled every 2 ms) and wall time against b3sum --check, page cache warm or dropped, in
interleaved rounds; the goals printed by common.RatioGoal.

Run from a checkout with python3 alone (no venv, no pytest): mm's dependencies on PYTHONPATH (or SITE), b3sum on
PATH (or KIT/b3sum, or .devcarry/vb/b3sum). The mm timed is this checkout's; KIT may hold before/mm and after/mm
(mm packages, e.g. main's and a branch's) to time both side by side instead. Environment: GIB (8), SHARD_MIB (768:
11 shards, hashed one at a time on all cores; 256: 32 shards, one per core in rounds), ROUNDS (3; a goal within
10% of its bound needs 5), WORK (/tmp/vb), KIT (default: none), SITE (a folder of wheels installed with `pip
install --target`), CPUS (e.g. 0,1: the timed runs pinned to those cores, the model made on all; mm then hashes
on as many threads as it is allowed cores), COLD=1 (root: sync and drop the page cache before every timed run, so
each reads the model from the disk: the model-scale goal's condition), NO_HEAD=1 (each mm is also timed, in the same
rounds, as "... no head": its console entry without the head start of `mm verify DIR`, artifacts/integrity/early.py).
Goals: warm, the whole `mm verify` at least 0.9x the speed of `b3sum --check` (the issue sets it at 8 GiB on 2
cores) and mm's own hashing (the seconds its --json reports, start-up left out) at least 1.0x; cold at model
scale (32 GiB and more), the whole command at least 1.0x. E.g., 2 cores of the GPU host:
  CPUS=0,1 GIB=8 ROUNDS=5 python3 tests/bench/verify_cores.py
"""
import fcntl, json, os, shutil, statistics, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.bench.common import _BIND_MM, RatioGoal, bind_mm, drop_caches, peer_bin, round_order  # noqa: E402
KIT = Path(os.environ["KIT"]) if os.environ.get("KIT") else None
COLD = os.environ.get("COLD") == "1"
GIB = float(os.environ.get("GIB", "8")); ROUNDS = int(os.environ.get("ROUNDS", "3"))
WORK = Path(os.environ.get("WORK", "/tmp/vb")); MODEL = WORK / "model"
SHARD = int(os.environ.get("SHARD_MIB", "768")) * 1024 * 1024
SITE = os.environ.get("SITE", "")
CPUS = {int(c) for c in os.environ["CPUS"].split(",")} if os.environ.get("CPUS") else None


def mm_runs() -> dict:
    """Each mm to time: name -> (the command that runs `mm` with the arguments after it, its environment)."""
    path = [p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p]
    kit = {f"mm {which}": KIT / which / "mm" for which in ("before", "after") if KIT and (KIT / which / "mm").is_dir()}
    env = {**os.environ, "PYTHONPATH": ":".join(path)}
    runs = {name: ([sys.executable, "-c", _BIND_MM.format(root=str(package)) + "from mm.__main__ import main; "
                    "sys.exit(main())"], env) for name, package in (kit or {"mm": REPO}).items()}
    if os.environ.get("NO_HEAD") == "1":  # __main__.main less its early.begin: the garbage collector off, the tree
        runs.update({f"{name} no head": ([sys.executable, "-c", _BIND_MM.format(root=str(package)) + "import gc; "
                                          "gc.disable(); from mm.cli import main; main()"], env)
                     for name, package in (kit or {"mm": REPO}).items()})
    return runs


def gen():
    import numpy as np
    from safetensors.numpy import save_file
    sys.path[:0] = [SITE] if SITE else []
    bind_mm()
    from mm.artifacts.integrity.hashing import hash_file
    from mm.artifacts.integrity.manifest import FileEntry, Manifest, export_sums, write_manifest
    from mm.artifacts.paths import manifest_path
    n = max(1, round(GIB * 1024**3 / SHARD))
    rng = np.random.default_rng(1)
    (MODEL / "dspark").mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] + ["dspark/model.safetensors"]
    for i, name in enumerate(names):
        size = SHARD if i < n else SHARD // 4
        save_file({"w": np.frombuffer(rng.bytes(size), dtype=np.uint8)}, str(MODEL / name))
    (MODEL / "config.json").write_text('{"model_type": "minimax_m3"}\n')
    rels = sorted(p.relative_to(MODEL).as_posix() for p in MODEL.rglob("*") if p.is_file())
    with ThreadPoolExecutor(16) as pool:
        ds = list(pool.map(lambda r: hash_file(MODEL / r), rels))
    m = Manifest("MiniMaxAI/MiniMax-M3.1-Flash", "ce7f4df87d2e05262f5775f373dac4772f134041",
                 tuple(FileEntry(r, d.size, d.blake3, d.sha256) for r, d in zip(rels, ds)))
    write_manifest(m, manifest_path(MODEL))
    (MODEL / ".mm" / "B3SUMS").write_text(export_sums(m, "blake3"))
    return sum(d.size for d in ds)

def peak_status(pid, peak, stop) -> None:
    """Raise each field of PEAK (e.g. RssAnon, RssFile, kB) to the most /proc/PID/status shows, every 2 ms, until
    STOP() is true."""
    while not stop():
        try:
            for line in open(f"/proc/{pid}/status"):
                k, _, v = line.partition(":")
                if k in peak:
                    peak[k] = max(peak[k], int(v.split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.002)

def measure(cmd, env):
    """wall s, VmHWM kB (from the last sample), max RssAnon kB, max RssFile kB, ru_maxrss kB (wait4)."""
    if COLD:
        drop_caches()
    pin = (lambda: os.sched_setaffinity(0, CPUS)) if CPUS else None
    proc = subprocess.Popen(cmd, env=env, cwd=MODEL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pin)
    t = time.perf_counter()
    peak = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    done = threading.Event()
    th = threading.Thread(target=peak_status, args=(proc.pid, peak, done.is_set)); th.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    done.set(); th.join()
    err = proc.stderr.read().decode()[-300:]
    out = proc.stdout.read().decode()
    if status != 0:
        print("FAILED", cmd, status, err, flush=True)
    inner = None
    if out.startswith("{"):
        inner = json.loads(out).get("seconds")
    return wall, peak, ru.ru_maxrss, inner

def main():
    print("cpus", os.cpu_count(), "python", sys.version.split()[0], "uname", os.uname().release, flush=True)
    probe = WORK / "lease-probe"; WORK.mkdir(parents=True, exist_ok=True); probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK); print("read lease: granted (mm maps files)")
    except OSError as e:
        print("read lease: refused (mm reads files into buffers):", e)
    os.close(fd)
    if COLD and os.geteuid() != 0:
        sys.exit("COLD=1 needs root (it writes /proc/sys/vm/drop_caches)")
    b3sum = str(KIT / "b3sum") if KIT and (KIT / "b3sum").exists() else peer_bin("b3sum")
    if not shutil.which(b3sum):
        sys.exit(f"no b3sum here ({b3sum}): put it on PATH or in KIT")
    t = time.perf_counter()
    if not (MODEL / ".mm" / "B3SUMS").exists() or os.environ.get("REGEN") == "1":
        shutil.rmtree(MODEL, ignore_errors=True)
        # in a child: a parent that held the data would lend its RSS to each child's rusage
        gen_out = subprocess.run([sys.executable, __file__, "gen"], capture_output=True, text=True)
        if gen_out.returncode:
            sys.exit("gen failed: " + gen_out.stderr[-2000:])
    total = sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file() and ".mm" not in p.parts)
    print(f"data {total / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", flush=True)
    if COLD:
        try:
            drop_caches()
        except OSError as e:
            sys.exit(f"COLD=1: cannot drop the page cache here: {e}")
    else:
        subprocess.run(f"cat $(find {MODEL} -type f) > /dev/null", shell=True)
    cores = CPUS or os.sched_getaffinity(0)
    if CPUS and os.sched_getaffinity(0) - CPUS:  # this process (its RSS sampler) keeps off the timed runs' cores
        os.sched_setaffinity(0, os.sched_getaffinity(0) - CPUS)
    print(f"timed runs on {len(cores)} of {os.cpu_count()} cores: {sorted(cores)}", flush=True)
    mms = mm_runs()
    import compileall  # timed as installed: byte-compiled (a host may set PYTHONDONTWRITEBYTECODE=1)
    for root in [REPO] if "mm" in mms else [KIT / w / "mm" for w in ("before", "after") if (KIT / w / "mm").is_dir()]:
        compileall.compile_dir(root, maxlevels=0, quiet=1)
        for package in ("artifacts", "commands"):
            compileall.compile_dir(root / package, quiet=1)
    tools = {name: (cmd + ["verify", "--json", str(MODEL)], env) for name, (cmd, env) in mms.items()}
    tools["b3sum"] = ([b3sum, "--check", ".mm/B3SUMS"], os.environ)
    res = {k: [] for k in tools}
    for r in range(ROUNDS):
        for name in round_order(list(tools), r):
            if not COLD:  # what other work evicted since
                subprocess.run(f"cat $(find {MODEL} -type f) > /dev/null", shell=True)
            res[name].append(measure(*tools[name]))
        print("round", r + 1, {k: round(v[-1][0], 2) for k, v in res.items()}, "load %.1f" % os.getloadavg()[0], flush=True)
    start = {k: statistics.median(measure(cmd + ["verify", "--help"], env)[0] for _ in range(3))
             for k, (cmd, env) in mms.items()}
    bare = statistics.median(measure([sys.executable, "-c", "pass"], os.environ)[0] for _ in range(3))
    print(f"python3 -c pass: {bare:.3f} s")
    state = "cold (caches dropped before each run)" if COLD else "warm"
    print(f"\n{total / 2**30:.2f} GiB {state}, {len(cores)} cpus, {ROUNDS} rounds, load {os.getloadavg()[0]:.1f}")
    b3 = statistics.median(x[0] for x in res["b3sum"])
    for k, v in res.items():
        w = statistics.median(x[0] for x in v)
        pk = {f: max(x[1][f] for x in v) / 1024 for f in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
        print(f"{k:<10} median {w:.2f} s ({total / w / 1e9:.2f} GB/s) = {b3 / w:.2f} x b3sum; runs "
              + ", ".join(f"{x[0]:.2f}" for x in v)
              + f"; peak MB: ru_maxrss {max(x[2] for x in v) / 1024:.0f}, VmHWM {pk['VmHWM']:.0f}, "
                f"VmRSS {pk['VmRSS']:.0f}, RssAnon {pk['RssAnon']:.0f}, RssFile {pk['RssFile']:.0f}"
              + (f"; start-up (verify --help) {start[k]:.2f} s; its own hashing (JSON seconds) "
                 f"{statistics.median(x[3] for x in v):.2f} s" if k in start else ""))
    whole = 1.0 if COLD else 0.9
    for k in mms:
        ratios = [b[0] / m[0] for m, b in zip(res[k], res["b3sum"])]  # per round: b3sum's time over mm's, a speed ratio
        print(RatioGoal(f"{k} verify speed / b3sum --check ({'cold' if COLD else 'warm'}, whole command)", whole,
                        at_most=False).verdict(ratios))
        if not COLD:
            inner = [b[0] / m[3] for m, b in zip(res[k], res["b3sum"])]
            print(RatioGoal(f"{k} verify's own hashing speed / b3sum --check (warm, start-up left out)", 1.0,
                            at_most=False).verdict(inner))
    if os.environ.get("KEEP") != "1":
        shutil.rmtree(MODEL, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["gen"]:
        print(gen())
    else:
        main()
