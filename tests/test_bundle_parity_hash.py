"""The parity index's digest of each data volume: taken while the volume is written (pack._hash_then_publish), it
must be the blake3 of the file on the disk, as the parity pass used to compute it; a volume whose digest was not
taken then is hashed by the parity pass (write_parity_volumes' DATA_BLAKE3)."""
from __future__ import annotations

from pathlib import Path

import blake3

from mm.artifacts.bundle.pack import create_bundle, write_parity_volumes
from mm.artifacts.bundle.volume import open_volume
from tests.test_bundle_parity import VOLUME_SIZE, data_volumes, make_model, parity_volumes


def _file_b3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def _recorded(vols: Path) -> dict[str, str]:
    index = open_volume(parity_volumes(vols)[0]).parity
    return {d.file: d.blake3 for d in index.data}


def test_the_parity_index_records_each_data_volumes_blake3_as_on_the_disk(tmp_path):
    model = make_model(tmp_path / "model")
    create_bundle(model, tmp_path / "vols", VOLUME_SIZE, parity=2, stripe=4096)
    recorded = _recorded(tmp_path / "vols")
    assert recorded == {p.name: _file_b3(p) for p in data_volumes(tmp_path / "vols")}


def test_the_parity_pass_hashes_a_volume_whose_digest_it_was_not_given(tmp_path):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, vols, VOLUME_SIZE, parity=2, stripe=4096)
    data = data_volumes(vols)
    first = open_volume(parity_volumes(vols)[0])
    for p in parity_volumes(vols):
        p.unlink()
    known = [_file_b3(data[0]), *[None] * (len(data) - 1)]
    write_parity_volumes(vols, name=first.parity.name, bundle_id=first.bundle_id,
                         manifest_bytes=(model / ".mm" / "manifest.json").read_bytes(), meta=[], mtime=0,
                         data_paths=data, parities=2, stripe=4096, data_blake3=known)
    assert _recorded(vols) == {p.name: _file_b3(p) for p in data}
