"""Shared benchmark plumbing: work dirs, peer tools, measured child runs, a local Hub server."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


def bench_dir(name: str) -> Path:
    path = ROOT / "bench-work" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def peer_bin(name: str) -> str:
    """A console script installed beside this Python (mm, hf), else from PATH (b3sum: also the one carried to the
    GPU host, .devcarry/vb/b3sum); mm: else a launcher of this checkout's mm (mm_bin)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    if name == "mm":
        return mm_bin()
    carried = ROOT / ".devcarry" / "vb" / name
    return shutil.which(name) or (str(carried) if carried.exists() else name)


# The mm package is this checkout's root (setup.cfg: package_dir mm = .); bound by hand, so no other `mm` on the
# path (an installed copy, another checkout's on PYTHONPATH) can stand in for it.
_BIND_MM = ("import sys, types\n"
            "mm = types.ModuleType('mm')\n"
            "mm.__path__ = [{root!r}]\n"
            "sys.modules['mm'] = mm\n")


_BOUND = False  # bind_mm had to bind this checkout: an mm installed beside this Python is another's


def bind_mm() -> None:
    """Make `import mm` in this process load this checkout, where no installed mm does (a host with mm's
    dependencies on PYTHONPATH and the checkout copied over, as the GPU host)."""
    global _BOUND
    try:
        import mm
        if str(ROOT) in list(getattr(mm, "__path__", [])):
            return
    except ImportError:
        pass
    _BOUND = True
    for name in [n for n in sys.modules if n == "mm" or n.startswith("mm.")]:
        del sys.modules[name]
    exec(_BIND_MM.format(root=str(ROOT)), {})


def mm_bin() -> str:
    """The `mm` the benchmarks run: the console script beside this Python where this checkout is installed there
    (the venv of `make install-test`), else bench-work/bin/mm, a launcher of this checkout's mm for this Python."""
    local = Path(sys.executable).parent / "mm"
    if local.exists() and not _BOUND:
        return str(local)
    launcher = bench_dir("bin") / "mm"
    launcher.write_text(f"#!{sys.executable}\n" + _BIND_MM.format(root=str(ROOT))
                        + "from mm.__main__ import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    return str(launcher)


# Where GNU time is not installed (the GPU host), each command runs under this small launcher instead, which forks
# it and writes its peak RSS (KiB) from wait4. Not wait4 in the benchmark itself: a child forked from it starts with
# its pages, and Linux keeps that high-water mark across exec. The launcher's own (~10 MB) is the floor it reports.
RSS_LAUNCHER = ("import os, sys\n"
                "pid = os.fork()\n"
                "if pid == 0:\n"
                "    os.execvp(sys.argv[2], sys.argv[2:])\n"
                "_, status, usage = os.wait4(pid, 0)\n"
                "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
                "sys.exit(os.waitstatus_to_exitcode(status))\n")


def rss_timer(out: str) -> list[str]:
    """The prefix that runs a command and writes its peak RSS in KiB (the last word) to the file OUT: GNU time,
    else RSS_LAUNCHER."""
    if Path("/usr/bin/time").exists():
        return ["/usr/bin/time", "-f", "%M", "-o", out]
    return [sys.executable, "-S", "-c", RSS_LAUNCHER, out]


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None, stdout: Path | None = None) -> tuple[float, int]:
    """Run CMD to completion; return its wall seconds and its own peak RSS in bytes.
    STDOUT: a file to keep the child's standard output in (e.g. `--json`), else it is dropped.

    RSS comes from /usr/bin/time (GNU time), not from our own wait4: a child forked from this (large) process
    carries our RSS into its ru_maxrss until it execs.
    """
    import tempfile

    with tempfile.NamedTemporaryFile("r", prefix="mm-bench-rss-") as rss, open(stdout or os.devnull, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.run([*rss_timer(rss.name), *cmd], env=env, cwd=cwd,
                              stdout=out, stderr=subprocess.PIPE)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
        return seconds, int(rss.read().split()[-1]) * 1024


@contextmanager
def start_hub_server(root: Path, shards: int, shard_bytes: int, server_args: tuple[str, ...] = ()
                     ) -> Iterator[tuple[str, str, str, int]]:
    """The local Hub server as a separate process (as a user would see it); yields url, repo, commit, bytes.
    SERVER_ARGS: more hubserver options, e.g. ("--conn-rate", "20000000", "--redirect-lfs", "--no-draft")."""
    from tests.support.gitrepo import tree_sizes

    shutil.rmtree(root, ignore_errors=True)
    repo_id = "MiniMaxAI/MiniMax-M3.1-Flash"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hubserver", "--root", str(root), "--make-model",
                             repo_id, "--shards", str(shards), "--shard-bytes", str(shard_bytes), *server_args],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.match(r"HUB_URL=(\S+)", line)
        if not match:
            raise RuntimeError(f"hub server did not start: {line!r}")
        commit = subprocess.run(["git", "-C", str(root / repo_id), "rev-parse", "main"], capture_output=True,
                                text=True, check=True).stdout.strip()
        total = sum(tree_sizes(root / repo_id, commit).values())
        yield match.group(1), repo_id, commit, total
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def make_bench_model(root: Path, shards: int, shard_bytes: int) -> int:
    """A MiniMax-shaped model of SHARDS x SHARD_BYTES with its manifest (kept if already there); its payload bytes."""
    from mm.artifacts.integrity.hashing import hash_file
    from mm.artifacts.integrity.manifest import FileEntry, Manifest, write_manifest
    from mm.artifacts.paths import manifest_path
    from tests.support.modelgen import write_model

    if manifest_path(root).is_file():
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".mm" not in p.parts)
    files = write_model(root, shards=shards, shard_bytes=shard_bytes)
    entries = []
    for f in files:
        d = hash_file(root / f, blake3_threads=-1)
        entries.append(FileEntry(f, d.size, d.blake3, d.sha256, None, "local"))
    write_manifest(Manifest("MiniMaxAI/MiniMax-M3.1-Flash", "ce7f4df87d2e05262f5775f373dac4772f134041",
                            tuple(entries)), manifest_path(root))
    return sum(e.size for e in entries)


def run_timed(cmd: list[str], stats: Path, env: dict | None = None, stdout: Path | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one command measured by /usr/bin/time, a small parent: Linux carries
    a parent's peak RSS into a forked child's rusage, and a benchmark process may have held large buffers.
    ENV: the command's environment (default: this one); STDOUT: a file for its output (default: none kept)."""
    if not os.path.exists("/usr/bin/time"):  # a host without GNU time: the child's own rusage (wait4)
        return _run_wait4(cmd, env, stdout)
    with open(stdout or os.devnull, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.run([*rss_timer(str(stats)), *cmd], env=env, stdout=out,
                              stderr=subprocess.PIPE)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return seconds, int(stats.read_text().split()[-1]) * 1024


def _run_wait4(cmd: list[str], env: dict | None, stdout: Path | None) -> tuple[float, int]:
    """run_timed without /usr/bin/time: the child's peak RSS from wait4 (it includes this process's RSS at the fork,
    so it is an upper bound where this process is larger than the command)."""
    import tempfile

    with open(stdout or os.devnull, "wb") as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read().decode()[-500:]}")
    return seconds, usage.ru_maxrss * 1024


@dataclass(frozen=True)
class Usage:
    """What one child command cost: wall seconds, its own peak RSS, CPU seconds in user and kernel mode, and the
    bytes it made the kernel read from and write to storage (ru_inblock/ru_oublock, 512-byte units on Linux: page
    cache hits count nothing, so a read that should have come from the cache shows here)."""

    seconds: float
    peak_rss: int
    user: float
    sys: float
    read_from_disk: int
    written_to_disk: int


def run_usage(cmd: list[str], stats: Path, env: dict | None = None, stdout: Path | None = None) -> Usage:
    """run_timed, plus the child's CPU and storage I/O from getrusage(RUSAGE_CHILDREN) before and after (it counts
    every descendant reaped meanwhile: /usr/bin/time waits for the command)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds, peak = run_timed(cmd, stats, env, stdout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Usage(seconds, peak, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                 (after.ru_inblock - before.ru_inblock) * 512, (after.ru_oublock - before.ru_oublock) * 512)


def drop_caches_between_steps() -> bool:
    """MM_BENCH_DROP_CACHES=1: every step starts with the page cache dropped (`sync`, then `echo 3 >
    /proc/sys/vm/drop_caches`), its input read from the disk: the figure for a host whose model does not fit in
    its memory. Root only: anyone else is told so before anything runs."""
    if os.environ.get("MM_BENCH_DROP_CACHES", "") in ("", "0"):
        return False
    if os.geteuid() != 0:
        raise SystemExit("MM_BENCH_DROP_CACHES=1 needs root (it writes /proc/sys/vm/drop_caches)")
    try:
        drop_caches()  # once now: a host whose kernel will not drop them (a sandbox) is told before anything runs
    except OSError as e:
        raise SystemExit(f"MM_BENCH_DROP_CACHES=1: cannot drop the page cache here: {e}") from None
    return True


def drop_caches() -> None:
    """Write back every dirty page, then drop the page cache, dentries and inodes."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def load_average() -> str:
    """The 1/5/15-minute load averages, as printed beside every figure (the machines are shared)."""
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def round_order(names: list[str], rnd: int) -> list[str]:
    """The order of round RND's runs: every round starts elsewhere and steps through NAMES by another stride
    (coprime with their count), so no run always follows the same predecessor. What ran just before matters on a
    shared VM: a run that frees or dirties gigabytes changes what the next one finds (page cache, free memory the
    guest has handed back to the host)."""
    n = len(names)
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    stride = strides[rnd % len(strides)]
    return [names[(rnd + i * stride) % n] for i in range(n)]


def returned_to_host() -> int | None:
    """Bytes of free memory this VM's guest has handed back to its host so far (virtio-balloon free page
    reporting), or None where the kernel does not count them. A run that needs fresh memory right after gigabytes
    were handed back faults each page back in from the host (copyio.write_size): the benches print this beside the
    times that vary."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text()) * 1024
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class RatioGoal:
    """One speed goal as a ratio to a peer run in the same rounds: `mm / peer` at most (or at least) BOUND."""

    name: str
    bound: float
    at_most: bool = True  # False: the ratio must reach BOUND (a rate), True: stay under it (a time)
    unit: str = "x"  # what the figures are: "x" a ratio to a peer; " MB/s", " MB" where the issue sets a rate or a size

    def verdict(self, ratios: list[float]) -> str:
        """The line `make bench` prints: the median of the per-round ratios, their spread and round count, and
        whether the goal is met. Within 10% of the bound, the median of at least 5 rounds decides; a bound inside
        the spread is said so (the figure is noise here: judge it on a quieter machine)."""
        ordered = sorted(ratios)
        n = len(ordered)
        median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        low, high = ordered[0], ordered[-1]
        met = median <= self.bound if self.at_most else median >= self.bound
        sign = "<=" if self.at_most else ">="
        if abs(median - self.bound) <= 0.1 * self.bound and n < 5:
            state = f"undecided: within 10% of the bound, needs 5 rounds (has {n})"
        elif low <= self.bound <= high:
            state = f"{'met' if met else 'NOT met'} on the median, but the bound is inside the spread"
        else:
            state = "met" if met else "NOT met"
        u = self.unit
        return (f"  goal {self.name}: {median:.2f}{u} (median of {n}, spread {low:.2f}-{high:.2f}{u}), "
                f"goal {sign} {self.bound:.2f}{u}: {state}")
