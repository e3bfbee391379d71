"""mm verify on a many-core machine (the 16-core device machine): peak RSS (VmHWM, wait4's ru_maxrss, and the
peaks of RssAnon and RssFile sampled every 2 ms) and wall time against b3sum --check, page cache warm, interleaved
rounds, for two copies of mm side by side ("before" and "after": the mm package of each, e.g. main's and a branch's).

Self-contained (no venv, no pytest): the folder holding it also holds before/mm, after/mm, b3sum (Debian's binary)
and whl/ with the blake3 wheel for the device's Python (see /work/.library/device/README.md: carry the folder,
`pip install --target /tmp/site whl/*.whl`, then SITE=/tmp/site). Environment: GIB (8), SHARD_MIB (768: 11
shards, hashed one at a time on all cores; 256: 32 shards, one per core in rounds), ROUNDS (3), WORK (/tmp/vb),
KIT (the folder with before/, after/, b3sum; default: this file's folder), COLD=1 (as root: sync and drop the page
cache before every measured run, so each reads the model from the disk: the model-scale goal's condition).
"""
import fcntl, os, signal, statistics, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
HERE = Path(os.environ.get("KIT") or Path(__file__).resolve().parent)
COLD = os.environ.get("COLD") == "1"
GIB = float(os.environ.get("GIB", "8")); ROUNDS = int(os.environ.get("ROUNDS", "3"))
WORK = Path(os.environ.get("WORK", "/tmp/vb")); MODEL = WORK / "model"
SHARD = int(os.environ.get("SHARD_MIB", "768")) * 1024 * 1024
SITE = os.environ.get("SITE", "")

def env_for(which):
    return {**os.environ, "PYTHONPATH": f"{HERE / which}:{SITE}", "PYTHONDONTWRITEBYTECODE": "1"}

def gen():
    import numpy as np
    from safetensors.numpy import save_file
    sys.path[:0] = [str(HERE / "after"), SITE]
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

def drop_caches():
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")

def measure(cmd, env):
    """wall s, VmHWM kB (from the last sample), max RssAnon kB, max RssFile kB, ru_maxrss kB (wait4)."""
    if COLD:
        drop_caches()
    proc = subprocess.Popen(cmd, env=env, cwd=MODEL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
        import json
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
    t = time.perf_counter()
    gen_out = subprocess.run([sys.executable, __file__, "gen"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{HERE / 'after'}:{SITE}"})
    if gen_out.returncode:
        sys.exit("gen failed: " + gen_out.stderr[-2000:])
    total = int(gen_out.stdout.split()[-1])  # in a child: a parent that held the data would lend its RSS to each child's rusage
    print(f"data {total / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", flush=True)
    if not COLD:
        subprocess.run(f"cat $(find {MODEL} -type f) > /dev/null", shell=True)
    mm = [sys.executable, "-c", "import sys; from mm.cli import main; sys.argv[0] = 'mm'; main()"]
    tools = {"mm before": (mm + ["verify", "--json", str(MODEL)], env_for("before")),
             "mm after": (mm + ["verify", "--json", str(MODEL)], env_for("after")),
             "b3sum": ([str(HERE / "b3sum"), "--check", ".mm/B3SUMS"], os.environ)}
    res = {k: [] for k in tools}
    names = list(tools)
    for r in range(ROUNDS):
        for name in names[r % 3:] + names[:r % 3]:
            res[name].append(measure(*tools[name]))
        print("round", r + 1, {k: round(v[-1][0], 2) for k, v in res.items()}, "load %.1f" % os.getloadavg()[0], flush=True)
    start = {k: statistics.median(measure(mm + ["verify", "--help"], env_for(k.split()[1]))[0] for _ in range(3)) for k in ("mm before", "mm after")}
    bare = statistics.median(measure([sys.executable, "-c", "pass"], os.environ)[0] for _ in range(3))
    print(f"python3 -c pass: {bare:.3f} s")
    print(f"\n{total / 2**30:.2f} GiB {'cold (caches dropped before each run)' if COLD else 'warm'}, {os.cpu_count()} cpus, {ROUNDS} rounds, load {os.getloadavg()[0]:.1f}")
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

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.bench.common import RatioGoal
    for k in ("mm before", "mm after"):
        ratios = [b[0] / m[0] for m, b in zip(res[k], res["b3sum"])]  # per round: b3sum's time over mm's, a speed ratio
        print(RatioGoal(f"{k} speed / b3sum --check ({'cold' if COLD else 'warm'})", 1.0, at_most=False).verdict(ratios))

if __name__ == "__main__":
    if sys.argv[1:] == ["gen"]:
        print(gen())
    else:
        main()
