"""The parity pass of `mm bundle --parity`: the parity index's digest of each data volume, taken while
the volume is written (pack._hash_then_publish), is the blake3 of the file on the disk; a volume whose digest was
not taken then is hashed by the parity pass (write_parity_volumes' DATA_BLAKE3); the parity written by a helper
thread (parity._ParityOut) hands its errors to the caller; Ctrl-C in the pass stops mm within the limit, and the
rerun writes the same volumes."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import blake3
import pytest

from mm.artifacts.bundle.pack import BundleOptions, create_bundle, write_parity_volumes
from mm.artifacts.bundle.parity import FileSource, Layout, encode
from mm.artifacts.bundle.volume import open_volume
from tests.test_bundle_parity import VOLUME_SIZE, data_volumes, make_model, mm, parity_volumes
from tests.test_interrupt import interrupt, one_line, start, wait_until

SLOW_ENCODE = """\
import time
from mm.artifacts.bundle import parity
_encode = parity.DirectEncoder._encode
def _slow(self, *args):
    time.sleep(0.5)
    return _encode(self, *args)
parity.DirectEncoder._encode = _slow
"""


def _file_b3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def _recorded(vols: Path) -> dict[str, str]:
    index = open_volume(parity_volumes(vols)[0]).parity
    return {d.file: d.blake3 for d in index.data}


def test_the_parity_index_records_each_data_volumes_blake3_as_on_the_disk(tmp_path):
    model = make_model(tmp_path / "model")
    create_bundle(model, BundleOptions((tmp_path / "vols",), VOLUME_SIZE, parity=2, stripe=4096))
    recorded = _recorded(tmp_path / "vols")
    assert recorded == {p.name: _file_b3(p) for p in data_volumes(tmp_path / "vols")}


def test_the_parity_pass_hashes_a_volume_whose_digest_it_was_not_given(tmp_path):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096))
    data = data_volumes(vols)
    first = open_volume(parity_volumes(vols)[0])
    for p in parity_volumes(vols):
        p.unlink()
    known = [_file_b3(data[0]), *[None] * (len(data) - 1)]
    write_parity_volumes(vols, name=first.parity.name, bundle_id=first.bundle_id,
                         manifest_bytes=(model / ".mm" / "manifest.json").read_bytes(), meta=[], mtime=0,
                         data_paths=data, parities=2, stripe=4096, data_blake3=known)
    assert _recorded(vols) == {p.name: _file_b3(p) for p in data}


def test_an_error_writing_parity_reaches_the_caller(tmp_path):
    for i in range(3):
        (tmp_path / f"d{i}").write_bytes(os.urandom(10_000 + i))
    layout = Layout(3, 2, 4096, tuple((tmp_path / f"d{i}").stat().st_size for i in range(3)))

    def full(_view) -> None:
        raise OSError(28, "No space left on device")

    sources = [FileSource(tmp_path / f"d{i}") for i in range(3)]
    with pytest.raises(OSError, match="No space left"):
        encode(layout, sources, [full, full])
    for src in sources:
        src.close()


def test_ctrl_c_in_the_parity_pass_stops_mm_and_the_rerun_writes_the_same_volumes(tmp_path):
    model = make_model(tmp_path / "model")
    reference, out = tmp_path / "reference", tmp_path / "vols"
    args = ("--volume-size", str(VOLUME_SIZE), "--parity", "2", "--no-sync")
    assert mm("bundle", model, "--out", reference, *args).returncode == 0
    hook = tmp_path / "slow-encode"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_ENCODE)
    proc = start("bundle", model, "--out", out, *args, env={**os.environ, "PYTHONPATH": str(hook)})
    wait_until(proc, lambda: out.is_dir() and any(".par" in p.name and p.name.endswith(".partial")
                                                 for p in out.iterdir()), "the parity pass begun")
    _, err, _ = interrupt(proc, signal.SIGINT, "bundle --parity SIGINT")
    one_line(err, "SIGINT")
    assert not parity_volumes(out)  # no parity volume under its final name
    r = mm("bundle", model, "--out", out, *args)
    assert r.returncode == 0, r.stderr
    volumes = sorted(p.name for p in out.glob("*.tar"))
    assert volumes == sorted(p.name for p in reference.glob("*.tar"))
    assert all((out / v).read_bytes() == (reference / v).read_bytes() for v in volumes)
