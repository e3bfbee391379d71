"""Benchmark mm's start-up: `mm --version`, `mm verify --help`, and `mm verify DIR --quick` on a 14-file model.

mm is timed as users run it: a real wheel built from this checkout, installed (not editable, byte-compiled by pip)
into a fresh venv under bench-work/startup, and this venv's editable mm (byte-compiled by run.py: these machines
set PYTHONDONTWRITEBYTECODE=1). The peers are `python -c pass` of the same interpreter (the floor of any Python
tool), `python -c 'import click'` (the floor of a click command line: what `mm verify --help` cannot go
below) and `b3sum --version` (a native tool's). The quick verify runs twice: output to /dev/null (a script's
pre-flight check) and to a pseudo-terminal (a user at a shell: rich and the progress bar on). Every command runs
once per round, in a rotating order (the machines are shared and noisy); each figure is the median of the rounds,
wall time with the CPU time beside it (which moves less with the load), and the ratio to the floor (for mm's
commands also to `import click`: the goals below were set where that took 38.7 ms, and it moves with the machine).

Goals (ratios to `python -c 'import click'` in the same round, judged on the wheel): `mm verify --help` at
most 1.3x, `mm verify DIR --quick` (output to /dev/null: a script's pre-flight check) at most 1.8x; each printed
as the median of the per-round ratios with their spread (tests/bench/common.py RatioGoal). The terminal case
and `mm --help` (which loads every command module for its list) are printed as ratios beside them, without a goal.
MM_BENCH_STARTUP_BEFORE=DIR: another checkout (e.g. `git worktree add /tmp/before main`), built and installed
the same way and timed in the same rounds, for before/after pairs (its goal lines are printed too).
MM_BENCH_ROUNDS (default 20). MM_BENCH_STARTUP_EDITABLE=0 leaves out this venv's editable mm (fewer runs a round).
The wheel venv reads mm's dependencies from this venv (a .pth line), so no package index is needed.
"""
from __future__ import annotations

import fcntl
import os
import pty
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import termios
import time
from pathlib import Path

from tests.bench.common import ROOT, RatioGoal, bench_dir, make_bench_model, peer_bin, round_order

CLICK = "python -c 'import click'"
# Issue-level goals: each mm command's time over `import click`'s in the same round
GOALS = {"mm verify --help": RatioGoal("`mm verify --help` / `import click`", 1.3),
         "mm verify DIR --quick": RatioGoal("`mm verify DIR --quick` (14 files) / `import click`", 1.8)}


def install_wheel(checkout: Path, work: Path) -> Path:
    """Build CHECKOUT's wheel (its tracked and new files only, as tests/wheel_check.sh does), install it into a
    fresh venv under WORK, and return that venv's `mm`."""
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    try:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=checkout, check=True,
                               capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without git (the GPU host): all but builds
        shutil.rmtree(src)
        shutil.copytree(checkout, src, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", ".devcarry", "bench-work", "demo-work", "build", "*.egg-info", "__pycache__"))
        files = None
    if files is not None:
        pack = subprocess.Popen(["tar", "--null", "-T", "-", "-cf", "-"], cwd=checkout, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        unpack = subprocess.Popen(["tar", "-xf", "-", "-C", str(src)], stdin=pack.stdout)
        pack.stdin.write(files)
        pack.stdin.close()
        if pack.wait() or unpack.wait():
            raise RuntimeError(f"could not copy {checkout}")
    offline = ["--no-build-isolation"] if _builds_here() else []  # a host with no package index (the GPU host)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", str(work / "dist"),
                    str(src)], check=True)
    wheel = next((work / "dist").glob("mm-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # no ensurepip needed
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
                    str(wheel)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", where], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "mm_bench_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies, from here
    return venv / "bin" / "mm"


def _builds_here() -> bool:
    """Whether this Python holds what pyproject.toml's build needs (setuptools >= 68 and wheel), so the wheel can
    be built without fetching them."""
    import importlib.util

    try:
        import setuptools
        from packaging.version import Version
    except ImportError:
        return False
    return Version(setuptools.__version__) >= Version("68") and importlib.util.find_spec("wheel") is not None


def _child_env() -> dict[str, str]:
    """This environment, less the PYTHONPATH entries that hold another `mm` (it would be imported instead of the
    one installed in the venv timed)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "mm").exists()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_once(cmd: list[str], terminal: bool) -> tuple[float, float, int, bytes]:
    """Wall seconds, CPU seconds (user + system: the child's own rusage, which moves less with the machine's load),
    exit code and error output of CMD, its output to /dev/null or (TERMINAL) to a 100x30 pseudo-terminal, as a
    user at a shell sees it (rich and the progress bar on)."""
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=_child_env())
        os.close(slave)
        output = b""
        while True:  # until the child closes the terminal (EIO)
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        os.close(master)
    else:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=_child_env())
        output = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status), output


def time_rounds(commands: dict[str, list[str]], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each command per round; each round runs every command once, starting one further
    along by another stride (common.round_order). A name ending in "(terminal)" runs on a pseudo-terminal."""
    names = list(commands)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            wall, cpu, code, output = run_once(commands[name], terminal=name.endswith("(terminal)"))
            if code != 0:
                said = output.decode(errors="replace")[-300:]
                raise RuntimeError(f"{' '.join(commands[name])} exited {code}: {said}")
            times[name].append((wall, cpu))
    return times


def main() -> None:
    rounds = int(os.environ.get("MM_BENCH_ROUNDS", "20"))
    work = bench_dir("startup")
    model = work / "model"
    make_bench_model(model, shards=4, shard_bytes=256 * 1024)
    files = sum(1 for p in model.rglob("*") if p.is_file() and ".mm" not in p.relative_to(model).parts)
    installs = {"wheel": install_wheel(ROOT, work / "wheel")}
    editable = Path(sys.executable).parent / "mm"
    if os.environ.get("MM_BENCH_STARTUP_EDITABLE", "1") != "0" and editable.exists() and peer_bin("mm") == str(editable):
        installs["editable"] = editable
    if before := os.environ.get("MM_BENCH_STARTUP_BEFORE"):
        installs["before (wheel)"] = install_wheel(Path(before).resolve(), work / "before")
    commands = {"python -c pass": [sys.executable, "-c", "pass"], CLICK: [sys.executable, "-c", "import click"],
                "b3sum --version": [peer_bin("b3sum"), "--version"]}
    for label, mm in installs.items():
        commands[f"{label}: mm --version"] = [str(mm), "--version"]
        commands[f"{label}: mm --help"] = [str(mm), "--help"]
        commands[f"{label}: mm verify --help"] = [str(mm), "verify", "--help"]
        commands[f"{label}: mm verify DIR --quick"] = [str(mm), "verify", str(model), "--quick"]
        commands[f"{label}: mm verify DIR --quick (terminal)"] = [str(mm), "verify", str(model), "--quick"]
    load = os.getloadavg()
    times = time_rounds(commands, rounds)
    floor = statistics.median(wall for wall, _ in times["python -c pass"])
    print(f"start-up, median of {rounds} interleaved rounds ({files}-file model; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {os.getloadavg()[0]:.2f} after):")
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        beside_click = f", {statistics.median(_per_round(times, name)):4.2f}x import click" if ": mm " in name else ""
        print(f"  {name:<47} {wall * 1000:7.1f} ms ({cpu * 1000:5.1f} ms CPU)  {wall / floor:5.2f}x python -c pass"
              f"{beside_click}")
    for label in installs:
        print(f"{label}:")
        for case, goal in GOALS.items():
            print(goal.verdict(_per_round(times, f"{label}: {case}")))
            cpu_goal = RatioGoal(f"{goal.name} in CPU time (moves less with the load)", goal.bound)
            print(cpu_goal.verdict(_per_round(times, f"{label}: {case}", cpu=True)))


def _per_round(times: dict[str, list[tuple[float, float]]], name: str, cpu: bool = False) -> list[float]:
    """NAME's wall (or CPU) time over `import click`'s, round by round (both ran in the same round, near each
    other)."""
    at = 1 if cpu else 0
    return [mine[at] / peer[at] for mine, peer in zip(times[name], times[CLICK])]


if __name__ == "__main__":
    main()
