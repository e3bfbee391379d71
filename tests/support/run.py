"""The one way tests run mm: the installed `mm` executable in a real subprocess.

`run_mm(*args)` returns the CompletedProcess (returncode, stdout, stderr). ENV is the whole environment
(default: this process's); EXTRA_ENV is laid over it. `mm_argv(*args)` is the same command line for
tests that need a Popen (kill -9 mid-run) or a wrapper (strace, script for a TTY).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

MM_BIN = Path(sys.executable).parent / "mm"


def mm_argv(*args: object, prefix: tuple[str, ...] | list[str] = ()) -> list[str]:
    return [*prefix, str(MM_BIN), *map(str, args)]


def run_mm(*args: object, env: Mapping[str, str] | None = None, extra_env: Mapping[str, str] | None = None,
           timeout: float = 120, input: str | None = None, cwd: Path | None = None,
           prefix: tuple[str, ...] | list[str] = ()) -> subprocess.CompletedProcess:
    full_env = {**(os.environ if env is None else env), **(extra_env or {})}
    return subprocess.run(mm_argv(*args, prefix=prefix), env=full_env, capture_output=True, text=True,
                          timeout=timeout, input=input, cwd=cwd)
