"""How bundle and unbundle use the page cache (issue 23): writes into it in pieces of at most 64 KiB (copyio.WRITE,
small page-cache folios), and unbundle leaves the volumes it has read out of it (their memory takes the model)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from mm.artifacts.bundle.copyio import WRITE
from tests.test_bundle_io import model, strace_works, traced_bundle, traced_unbundle, vols  # noqa: F401 - fixtures
from tests.support.run import run_mm


def _cached_bytes(path: Path) -> int:
    """Bytes of PATH in the page cache (util-linux fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def _write_sizes(calls) -> list[int]:
    return [int(ret) for _, name, _, ret in calls if name in ("write", "pwrite64") and ret.lstrip("-").isdigit()]


def test_bundle_writes_its_volumes_in_pieces_of_at_most_64_kib(traced_bundle):
    _, calls = traced_bundle
    sizes = _write_sizes(calls)
    assert sum(sizes) > 9 * 1024 * 1024 and max(sizes) == WRITE == 64 * 1024


def test_unbundle_writes_the_model_in_pieces_of_at_most_64_kib(traced_unbundle):
    _, calls, _ = traced_unbundle
    sizes = _write_sizes(calls)
    assert sum(sizes) > 9 * 1024 * 1024 and max(sizes) == WRITE


def test_unbundle_leaves_the_volumes_it_read_out_of_the_page_cache(vols, tmp_path):
    volumes = sorted(vols.glob("*.tar"))
    subprocess.run(["cat", *map(str, volumes)], stdout=subprocess.DEVNULL, check=True)  # all cached
    before = sum(_cached_bytes(v) for v in volumes)
    assert before >= sum(v.stat().st_size for v in volumes) * 0.9
    r = run_mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0, r.stderr
    assert sum(_cached_bytes(v) for v in volumes) < before * 0.1
