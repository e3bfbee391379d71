"""Real file systems for tests, mounted in a temporary directory (root only): an XFS image with reflinks on a loop
device (`mkfs.xfs -m reflink=1`, Debian's xfsprogs), and a tmpfs (no reflinks, no FIEMAP).

    with xfs_mount(tmp_path / "xfs") as mnt: ...
    with tmpfs_mount(tmp_path / "tmpfs", size=64 * 2**20) as mnt: ...

`require_mounts()` skips a test where they cannot be made (not root, no mkfs.xfs): CI runs as root and
`make tools` installs xfsprogs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

XFS_MIN = 300 * 2**20  # mkfs.xfs refuses smaller file systems


def require_mounts() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting an XFS image or a tmpfs needs root (CI runs as root)")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs not installed (Debian xfsprogs; `make tools` installs it)")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@contextmanager
def xfs_mount(where: Path, size: int = XFS_MIN) -> Iterator[Path]:
    """An XFS file system with reflink=1 in a sparse image under WHERE, mounted at WHERE/mnt."""
    where.mkdir(parents=True, exist_ok=True)
    image, mnt = where / "xfs.img", where / "mnt"
    with open(image, "wb") as f:
        f.truncate(max(size, XFS_MIN))
    _run("mkfs.xfs", "-q", "-m", "reflink=1", str(image))
    mnt.mkdir(exist_ok=True)
    _run("mount", "-o", "loop", str(image), str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)
        image.unlink(missing_ok=True)


@contextmanager
def tmpfs_mount(where: Path, size: int = 64 * 2**20) -> Iterator[Path]:
    """A tmpfs of SIZE bytes mounted at WHERE."""
    where.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=60)


def fill(mnt: Path, leave: int) -> Path:
    """A file that takes all of MNT's free space but LEAVE bytes (fallocate: nothing written)."""
    free = shutil.disk_usage(mnt).free
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave, 4096))
    return filler
