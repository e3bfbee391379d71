"""Run mm on a real pseudo-terminal (util-linux `script`) and read what a user would see.

`run_on_tty(*args)` returns a TtyRun: the exit status, the raw bytes the terminal received (every frame of every
progress bar) and the screen as it stands at the end (pyte, a VT100 emulator, plays the bytes back), so a test
can assert both "no frame ever showed more than 100%" and "no finished bar is left on the screen".
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Mapping

import pyte

from tests.support.run import mm_argv

COLUMNS = 140
ROWS = 400  # tall enough that nothing scrolls off: the final screen is the whole run
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class TtyRun:
    returncode: int
    raw: str
    screen: list[str]  # the lines on the screen at the end, trailing blank lines dropped

    @property
    def frames(self) -> list[str]:
        """Every line the terminal was ever sent (each redraw of a bar is a line), escape codes removed."""
        return [line for line in re.split(r"[\r\n]+", ANSI.sub("", self.raw)) if line.strip()]

    @property
    def text(self) -> str:
        return "\n".join(self.screen)


def run_on_tty(*args: object, env: Mapping[str, str] | None = None, extra_env: Mapping[str, str] | None = None,
               timeout: float = 120, cwd=None, columns: int = COLUMNS) -> TtyRun:
    command = f"stty cols {columns} rows {ROWS}; exec {shlex.join(mm_argv(*args))}"
    full_env = {**(os.environ if env is None else env), **(extra_env or {})}
    full_env.pop("COLUMNS", None)
    full_env.pop("LINES", None)
    r = subprocess.run(["script", "-q", "-e", "-c", command, "/dev/null"], env=full_env, capture_output=True,
                       timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    raw = r.stdout.decode("utf-8", "replace")
    screen = pyte.Screen(columns, ROWS)
    stream = pyte.Stream(screen)
    stream.feed(raw.replace("\n", "\r\n") if "\r\n" not in raw else raw)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return TtyRun(r.returncode, raw, lines)
