"""Peak memory of a command, as the kernel counts it.

A child's peak RSS starts at its parent's (Linux keeps the high-water mark across fork and exec), and a test
process holds test files in memory: a small Python in between starts the command and reports its own peak.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Mapping

_PEAK_RSS = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); _, status, usage = os.wait4(p.pid, 0); "
             "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)")


def peak_rss(argv: list[str], env: Mapping[str, str], timeout: float = 120) -> tuple[int, int]:
    """(exit code, peak RSS in bytes) of ARGV."""
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, *map(str, argv)], env=dict(env), capture_output=True,
                         text=True, timeout=timeout, check=True).stdout.split()
    return int(out[0]), int(out[1])


_MEASURED = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(p.pid, 0); "
             "open(sys.argv[1], 'w').write(str(usage.ru_maxrss * 1024)); sys.exit(os.waitstatus_to_exitcode(status) & 255)")


def run_with_peak_rss(argv: list[str], env: Mapping[str, str], timeout: float, cwd=None,
                      input: str | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """(CompletedProcess with ARGV's exit code, stdout and stderr; ARGV's peak RSS in bytes). On TIMEOUT the whole
    process group is killed and subprocess.TimeoutExpired raised."""
    import os
    import signal
    import tempfile

    with tempfile.NamedTemporaryFile("r", prefix="mm-rss-") as rss:
        proc = subprocess.Popen([sys.executable, "-c", _MEASURED, rss.name, *map(str, argv)], env=dict(env), cwd=cwd,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        text = rss.read().strip()
        return subprocess.CompletedProcess(argv, proc.returncode, out, err), int(text or 0)
