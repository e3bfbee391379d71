"""Slow mm's copy loop (or its parity stripes) down from the test side, so that a kill -9 lands mid-copy.

slow_io_env(DIR) returns the environment for an `mm` subprocess whose ChunkPipe reads 4 KiB chunks and
pauses after each one: a sitecustomize on PYTHONPATH patches the class at start-up (as net_guard_env in
msserver.py installs the network guard). Production code holds no hook for it.
"""
from __future__ import annotations

from pathlib import Path

SLOW_IO = '''\
"""sitecustomize installed by tests: mm's bundle copy loop in 4 KiB chunks with a pause after each."""
import time

from mm.artifacts.bundle import copyio

CHUNK, DELAY = {chunk}, {delay}
_stream = copyio.ChunkPipe.stream


def _slow_stream(self, *args, **kwargs):
    for view in _stream(self, *args, **kwargs):
        yield view
        time.sleep(DELAY)


copyio.ChunkPipe.CHUNK = CHUNK
copyio.ChunkPipe.stream = _slow_stream
'''


def slow_io_env(directory: Path, chunk: int = 4096, delay: float = 0.003) -> dict[str, str]:
    directory = Path(directory) / "slow-io"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SLOW_IO.format(chunk=chunk, delay=delay))
    return {"PYTHONPATH": str(directory)}


SLOW_STRIPES = '''\
"""sitecustomize installed by tests: mm's parity code pauses after each stripe it encodes or rebuilds."""
import time

from mm.artifacts.bundle import parity

DELAY = {delay}
_stripes = parity._stripes


def _slow_stripes(produce, count):
    for item in _stripes(produce, count):
        yield item
        time.sleep(DELAY)


parity._stripes = _slow_stripes
'''


def slow_stripes_env(directory: Path, delay: float = 0.01) -> dict[str, str]:
    """The environment for an `mm` subprocess whose parity encode/rebuild pauses DELAY seconds per stripe."""
    directory = Path(directory) / "slow-stripes"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SLOW_STRIPES.format(delay=delay))
    return {"PYTHONPATH": str(directory)}
