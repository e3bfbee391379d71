"""How bundle and unbundle use the page cache: on a VM that reports free pages to its host, writes into
it in pieces of at most 64 KiB (small page-cache folios; copyio.write_size), whole chunks elsewhere; unbundle
leaves the volumes it has read out of it there (their memory takes the model), cached elsewhere as tar does; and a
bundle with parity keeps its data volumes cached for the parity pass only where memory is cheap (no free page
reporting), else drops them as written and the pass reads the model files (either way the parity is the volumes'
own); unbundle's rebuild reads its inputs once and leaves them out of it too."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mm.artifacts.bundle import pack, unpack
from mm.artifacts.bundle.copyio import SMALL_WRITE, reports_free_pages, write_size
from mm.artifacts.bundle.parity import FileSource
from mm.artifacts.bundle.volume import open_volume
from tests.test_bundle_parity import VOLUME_SIZE, data_volumes, make_model, parity_volumes
from tests.test_bundle_io import model, strace_works, traced_bundle, traced_unbundle, vols  # noqa: F401 - fixtures
from tests.support.run import run_mm

MiB = 1024 * 1024


def _cached_bytes(path: Path) -> int:
    """Bytes of PATH in the page cache (util-linux fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def _write_sizes(calls) -> list[int]:
    return [int(ret) for _, name, _, ret in calls if name in ("write", "pwrite64") and ret.lstrip("-").isdigit()]


def _as_this_machine_wants(sizes: list[int]) -> bool:
    """64 KiB pieces where free pages are reported (this project's VMs), whole 8 MiB chunks elsewhere."""
    return max(sizes) == SMALL_WRITE if write_size() else max(sizes) > SMALL_WRITE


def test_bundle_writes_its_volumes_in_pieces_the_machine_suits(traced_bundle):
    _, calls = traced_bundle
    sizes = _write_sizes(calls)
    assert sum(sizes) > 9 * 1024 * 1024 and _as_this_machine_wants(sizes)


def test_unbundle_writes_the_model_in_pieces_the_machine_suits(traced_unbundle):
    _, calls, _ = traced_unbundle
    sizes = _write_sizes(calls)
    assert sum(sizes) > 9 * 1024 * 1024 and _as_this_machine_wants(sizes)


def _virtio(root: Path, name: str, device: str, features: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "device").write_text(device + "\n")
    (root / name / "features").write_text(features + "\n")


def test_a_balloon_that_reports_free_pages_is_recognised(tmp_path):
    _virtio(tmp_path, "virtio0", "0x0002", "1" * 64)  # a block device: its bit 5 means something else
    _virtio(tmp_path, "virtio1", "0x0005", "01100101" + "0" * 56)  # balloon: stats, deflate on OOM, reporting
    assert reports_free_pages(tmp_path)


def test_a_balloon_without_reporting_or_no_balloon_is_not(tmp_path):
    _virtio(tmp_path / "a", "virtio0", "0x0005", "01100001" + "0" * 56)
    _virtio(tmp_path / "b", "virtio0", "0x0002", "1" * 64)
    _virtio(tmp_path / "c", "virtio0", "not a number", "1" * 64)
    assert not any(reports_free_pages(tmp_path / d) for d in ("a", "b", "c", "missing"))


@pytest.mark.parametrize("reported", [True, False], ids=["free-pages-reported", "no-reporting"])
def test_unbundle_leaves_the_volumes_it_read_out_of_the_page_cache_only_where_memory_goes_back(
        vols, tmp_path, monkeypatch, reported):
    monkeypatch.setattr(unpack, "reports_free_pages", lambda: reported)
    volumes = sorted(vols.glob("*.tar"))
    subprocess.run(["cat", *map(str, volumes)], stdout=subprocess.DEVNULL, check=True)  # all cached
    before = sum(_cached_bytes(v) for v in volumes)
    assert before >= sum(v.stat().st_size for v in volumes) * 0.9
    report = unpack.unbundle([vols], tmp_path / "dest")
    assert report.outcome is unpack.Outcome.IMPORTED, report
    after = sum(_cached_bytes(v) for v in volumes)
    assert after < before * 0.1 if reported else after > before * 0.9


@pytest.mark.parametrize("reported", [True, False], ids=["free-pages-reported", "no-reporting"])
def test_a_parity_bundle_keeps_its_volumes_cached_only_where_memory_is_cheap(tmp_path, monkeypatch, reported):
    monkeypatch.setattr(pack, "reports_free_pages", lambda: reported)
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    pack.create_bundle(model, pack.BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096))
    data = data_volumes(vols)
    cached = sum(_cached_bytes(v) for v in data) / sum(v.stat().st_size for v in data)
    assert cached < 0.1 if reported else cached > 0.9
    first = open_volume(parity_volumes(vols)[0])
    recorded = [st.digest for st in first.parity.streams]
    again = tmp_path / "again"
    again.mkdir()
    written = pack.write_parity_volumes(again, name=first.parity.name, bundle_id=first.bundle_id,
                                        manifest_bytes=(model / ".mm" / "manifest.json").read_bytes(), meta=[],
                                        mtime=0, data_paths=data, parities=2, stripe=4096)
    assert [[st.digest for st in open_volume(path).parity.streams] for _, path in written] == [recorded] * 2


def test_unbundle_rebuilds_from_parity_volumes_it_leaves_out_of_the_page_cache(tmp_path):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    pack.create_bundle(model, pack.BundleOptions((vols,), VOLUME_SIZE, parity=1, stripe=4096))  # one: the rebuild reads it
    data_volumes(vols)[2].unlink()
    parity = parity_volumes(vols)
    subprocess.run(["cat", *map(str, parity)], stdout=subprocess.DEVNULL, check=True)  # cached
    r = run_mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0 and "rebuilt" in r.stdout, r.stdout + r.stderr
    assert sum(_cached_bytes(v) for v in parity) < 0.1 * sum(v.stat().st_size for v in parity)


def test_a_source_read_once_drops_the_pages_behind_the_reader_and_the_rest_at_its_end_each_time(tmp_path, monkeypatch):
    monkeypatch.setattr(FileSource, "DROP_BEHIND", 256 * 1024)
    path = tmp_path / "stream"
    with path.open("wb") as f:  # in 64 KiB writes: page-cache folios no larger (only whole folios leave the cache)
        for _ in range(32):
            f.write(os.urandom(64 * 1024))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the cache may drop them
    source = FileSource(path, read_once=True)
    for offset in range(0, MiB, 64 * 1024):
        source.pread(offset, 64 * 1024)
    assert MiB <= _cached_bytes(path) <= MiB + FileSource.DROP_BEHIND  # what is ahead stays
    for offset in range(MiB, 2 * MiB, 64 * 1024):
        source.pread(offset, 64 * 1024)
    assert _cached_bytes(path) == 0
    for offset in range(0, 2 * MiB, 64 * 1024):  # read again from the start (a rebuild run again): the same
        source.pread(offset, 64 * 1024)
    source.close()
    assert _cached_bytes(path) == 0
