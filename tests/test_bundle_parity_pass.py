"""The parity pass of `mm bundle --parity`: the parity index's proof of each data volume, taken while the volume is
written (pack._write_volume, proof.py), is the proof of the file on the disk read back from its bytes; a volume whose
proof was not taken then is proven by the parity pass (write_parity_volumes' PROVEN); the parity written by a helper
thread (parity._ParityOut) hands its errors to the caller; Ctrl-C in the pass stops mm within the limit, and the
rerun writes the same volumes."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mm.artifacts.bundle.pack import BundleOptions, Proven, create_bundle, write_parity_volumes
from mm.artifacts.bundle.parity import FileSource, Layout, encode, file_identity
from mm.artifacts.bundle.proof import TarProof
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


def _head(path: Path) -> int:
    """The metadata members a data volume starts with, as its own index lists them."""
    return len(open_volume(path).index.expected_meta())


def _file_proof(path: Path, data: bytes | None = None) -> str:
    """The volume's proof from its bytes on the disk (or DATA), cut where its tar headers say."""
    proof = TarProof(_head(path))
    proof.update(path.read_bytes() if data is None else data)
    return proof.hexdigest()


def _recorded(vols: Path) -> dict[str, tuple[int, str]]:
    index = open_volume(parity_volumes(vols)[0]).parity
    return {d.file: (d.head, d.digest) for d in index.data}


def test_the_parity_index_records_each_data_volumes_proof_as_its_bytes_on_the_disk_give_it(tmp_path):
    model = make_model(tmp_path / "model")
    create_bundle(model, BundleOptions((tmp_path / "vols",), VOLUME_SIZE, parity=2, stripe=4096))
    recorded = _recorded(tmp_path / "vols")
    assert open_volume(parity_volumes(tmp_path / "vols")[0]).parity.schema == "mm-bundle-parity/2"
    assert recorded == {p.name: (_head(p), _file_proof(p)) for p in data_volumes(tmp_path / "vols")}


def test_a_volume_proof_changes_with_any_byte_of_the_volume(tmp_path):
    model = make_model(tmp_path / "model")
    create_bundle(model, BundleOptions((tmp_path / "vols",), VOLUME_SIZE, parity=1, stripe=4096))
    vol = data_volumes(tmp_path / "vols")[0]
    data, want = vol.read_bytes(), _recorded(tmp_path / "vols")[vol.name][1]
    member = next(iter(open_volume(vol).data.values()))
    # a tar header byte, a member's byte, a padding byte, the end of the archive, one byte more, one byte less
    for at in (member.offset_data - 512 + 100, member.offset_data + 7, member.offset_data + member.size, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 0x01
        assert _file_proof(vol, bytes(changed)) != want
    assert _file_proof(vol, data + bytes(1)) != want and _file_proof(vol, data[:-1]) != want


def test_the_parity_pass_proves_a_volume_whose_proof_it_was_not_given(tmp_path):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096))
    data = data_volumes(vols)
    first = open_volume(parity_volumes(vols)[0])
    for p in parity_volumes(vols):
        p.unlink()
    known = [Proven(_file_proof(data[0]), _head(data[0]), file_identity(data[0])), *[None] * (len(data) - 1)]
    write_parity_volumes(vols, name=first.parity.name, bundle_id=first.bundle_id,
                         manifest_bytes=(model / ".mm" / "manifest.json").read_bytes(), meta=[], mtime=0,
                         data_paths=data, parities=2, stripe=4096, proven=known)
    assert _recorded(vols) == {p.name: (_head(p), _file_proof(p)) for p in data}


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
