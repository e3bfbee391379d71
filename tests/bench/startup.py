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

Goals: `mm --version` and `mm verify --help` under 60 ms, `mm verify DIR --quick` under 150 ms (median of
20 runs). MM_BENCH_STARTUP_BEFORE=DIR: another checkout (e.g. `git worktree add /tmp/before main`), built and
installed the same way and timed in the same rounds, for before/after pairs. MM_BENCH_ROUNDS (default 20).
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

from tests.bench.common import ROOT, bench_dir, make_bench_model

GOALS_MS = {"--version": 60, "verify --help": 60, "verify DIR --quick": 150, "verify DIR --quick (terminal)": 150}


def install_wheel(checkout: Path, work: Path) -> Path:
    """Build CHECKOUT's wheel (its tracked and new files only, as tests/wheel_check.sh does), install it into a
    fresh venv under WORK, and return that venv's `mm`."""
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=checkout, check=True,
                           capture_output=True).stdout
    pack = subprocess.Popen(["tar", "--null", "-T", "-", "-cf", "-"], cwd=checkout, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    unpack = subprocess.Popen(["tar", "-xf", "-", "-C", str(src)], stdin=pack.stdout)
    pack.stdin.write(files)
    pack.stdin.close()
    if pack.wait() or unpack.wait():
        raise RuntimeError(f"could not copy {checkout}")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(src)],
                   check=True)
    wheel = next((work / "dist").glob("mm-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", where], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "mm_bench_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies, from here
    return venv / "bin" / "mm"


def run_once(cmd: list[str], terminal: bool) -> tuple[float, float, int, bytes]:
    """Wall seconds, CPU seconds (user + system: the child's own rusage, which moves less with the machine's load),
    exit code and error output of CMD, its output to /dev/null or (TERMINAL) to a 100x30 pseudo-terminal, as a
    user at a shell sees it (rich and the progress bar on)."""
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
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
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        output = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status), output


def time_rounds(commands: dict[str, list[str]], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each command per round; each round runs every command once, starting one further
    along. A name ending in "(terminal)" runs on a pseudo-terminal."""
    names = list(commands)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
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
    installs = {"wheel": install_wheel(ROOT, work / "wheel"), "editable": Path(sys.executable).parent / "mm"}
    if before := os.environ.get("MM_BENCH_STARTUP_BEFORE"):
        installs["before (wheel)"] = install_wheel(Path(before).resolve(), work / "before")
    commands = {"python -c pass": [sys.executable, "-c", "pass"], "python -c 'import click'":
                [sys.executable, "-c", "import click"], "b3sum --version": ["b3sum", "--version"]}
    for label, mm in installs.items():
        commands[f"{label}: mm --version"] = [str(mm), "--version"]
        commands[f"{label}: mm verify --help"] = [str(mm), "verify", "--help"]
        commands[f"{label}: mm verify DIR --quick"] = [str(mm), "verify", str(model), "--quick"]
        commands[f"{label}: mm verify DIR --quick (terminal)"] = [str(mm), "verify", str(model), "--quick"]
    load = os.getloadavg()
    times = time_rounds(commands, rounds)
    floor = statistics.median(wall for wall, _ in times["python -c pass"])
    click = statistics.median(wall for wall, _ in times["python -c 'import click'"])
    print(f"start-up, median of {rounds} interleaved rounds ({files}-file model; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {os.getloadavg()[0]:.2f} after):")
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        goal = next((g for case, g in GOALS_MS.items() if name.endswith(f"mm {case}")), None)
        verdict = "" if goal is None else f"  goal < {goal} ms: {'met' if wall * 1000 < goal else 'NOT met'}"
        beside_click = f", {wall / click:4.2f}x import click" if ": mm " in name else ""
        print(f"  {name:<47} {wall * 1000:7.1f} ms ({cpu * 1000:5.1f} ms CPU)  {wall / floor:5.2f}x python -c pass"
              f"{beside_click}{verdict}")


if __name__ == "__main__":
    main()
