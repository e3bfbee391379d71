"""The parity pass of `mm bundle --parity` leaves the page cache as a plain bundle does (issue 23): the data volumes'
pages, kept in memory for the pass to read, leave the cache once it has read them, instead of staying there after mm
exits (2.2 GB for a 2 GB model, which the next command had to reclaim, and which a later `mm bundle verify` read
instead of the disk). Residency is read with util-linux's fincore (mincore(2) on each file)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_bundle_parity import VOLUME_SIZE, data_volumes, make_model, mm, parity_volumes


def _resident(paths: list[Path]) -> int:
    """Bytes of PATHS in the page cache."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in out.split())


@pytest.fixture
def droppable(tmp_path):
    """Skip where this file system keeps pages that posix_fadvise(DONTNEED) is asked to drop (tmpfs)."""
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) is not installed")
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, os.urandom(1 << 20))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident([probe]):
        pytest.skip("this file system keeps dropped pages (tmpfs?)")
    probe.unlink()


def test_the_data_volumes_pages_leave_the_page_cache_after_the_parity_pass(tmp_path, droppable):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    r = mm("bundle", model, "--out", vols, "--volume-size", str(VOLUME_SIZE), "--parity", "2", "--no-mm")
    assert r.returncode == 0, r.stderr
    data = data_volumes(vols)
    assert len(data) >= 3 and len(parity_volumes(vols)) == 2
    # a volume's last page may stay when its size is not a multiple of the page (fadvise drops whole pages)
    assert _resident(data) <= len(data) * os.sysconf("SC_PAGE_SIZE"), sum(p.stat().st_size for p in data)
