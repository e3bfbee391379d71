"""Kill an `mm` subprocess with SIGKILL just before its Nth file-system step, from the test side, so that a test can
stop a command at every point where it changes the disk (as slowio.py slows the copy loop down).

kill_at_step_env(DIR, N) returns the environment for an `mm` subprocess whose os.rename, os.replace, os.unlink,
os.rmdir, os.symlink, os.link and os.fsync count their calls and SIGKILL the process at call N, before it acts:
a sitecustomize on PYTHONPATH wraps them at start-up. Production code holds no hook for it. A run that does fewer
than N steps ends normally (exit 0), which tells the test it has tried every step.
"""
from __future__ import annotations

from pathlib import Path

KILL_AT_STEP = '''\
"""sitecustomize installed by tests: SIGKILL before the {n}th file-system step."""
import os
import signal

_count = [0]


def _step(fn):
    def counted(*args, **kwargs):
        _count[0] += 1
        if _count[0] == {n}:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return counted


for _name in ("rename", "replace", "unlink", "rmdir", "symlink", "link", "fsync"):
    _fn = getattr(os, _name)
    _wrapped = _step(_fn)
    for _supports in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks):
        if _fn in _supports:  # mm's calls relative to a directory descriptor (fsutil's rule) stay allowed
            _supports.add(_wrapped)
    setattr(os, _name, _wrapped)
'''


def kill_at_step_env(directory: Path, n: int) -> dict[str, str]:
    directory = Path(directory) / f"kill-at-{n}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(KILL_AT_STEP.format(n=n))
    return {"PYTHONPATH": str(directory)}
