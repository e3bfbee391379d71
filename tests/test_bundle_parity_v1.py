"""Bundles whose parity index has schema mm-bundle-parity/1 (each data volume by its whole-file blake3) are still
read, verified, rebuilt from and repaired. The volumes are a fixture made by mm before schema 2 (tests/bundle_v1/:
`mm bundle MODEL --volume-size 100000 --parity 1 --no-mm --name tiny` of a two-shard model, 4 data volumes and
1 parity volume, 370 kB): written by the old code, not imitated."""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from mm.artifacts.bundle.volume import open_volume
from tests.test_bundle_parity import data_volumes, mm, parity_volumes

FIXTURE = Path(__file__).parent / "bundle_v1" / "tiny-parity1-v1.tar.gz"


@pytest.fixture
def old(tmp_path) -> Path:
    d = tmp_path / "disks"
    d.mkdir()
    with tarfile.open(FIXTURE) as tf:
        tf.extractall(d, filter="data")
    return d


def test_an_old_parity_volume_reads_and_verifies(old):
    pv = open_volume(parity_volumes(old)[0])
    assert pv.parity.schema == "mm-bundle-parity/1" and pv.usable
    assert all(d.head is None for d in pv.parity.data)
    r = mm("bundle", "verify", old)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "parity 1 of 1" in r.stdout


def test_unbundle_rebuilds_a_lost_volume_from_old_parity(old, tmp_path):
    data_volumes(old)[1].unlink()
    dest = tmp_path / "dest"
    r = mm("unbundle", old, "--dest", dest, "--no-sync")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt" in r.stdout
    r = mm("verify", dest)
    assert r.returncode == 0, r.stdout + r.stderr


def lose_and_repair(disks: Path, lost: Path, out: Path) -> None:
    """LOST goes; repair-volume writes it into OUT, byte for byte what it was."""
    want = lost.read_bytes()
    lost.unlink()
    r = mm("bundle", "repair-volume", disks, "--out", out, "--no-sync")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / lost.name).read_bytes() == want


def test_repair_volume_writes_a_lost_volume_back_byte_identical_from_old_parity(old, tmp_path):
    lose_and_repair(old, data_volumes(old)[2], tmp_path / "out")


def test_a_lost_old_parity_volume_is_written_again_in_schema_2_and_rebuilds(old, tmp_path):
    """With every parity volume lost, repair-volume writes them again from the data volumes: in the current
    schema, which proves the old data volumes as well."""
    parity_volumes(old)[0].unlink()
    r = mm("bundle", "repair-volume", old, "--no-sync")
    assert r.returncode == 0, r.stdout + r.stderr
    assert open_volume(parity_volumes(old)[0]).parity.schema == "mm-bundle-parity/2"
    lose_and_repair(old, data_volumes(old)[0], tmp_path / "out")


def test_a_lost_parity_volume_beside_an_old_one_is_written_back_in_the_old_schema_byte_identical(tmp_path):
    """A bundle with two old parity volumes loses one: repair-volume writes it again as the other's kin (schema 1),
    byte for byte what the old code wrote."""
    from mm.artifacts.bundle.pack import BundleOptions, create_bundle, write_parity_volumes
    from mm.artifacts.bundle.index import PARITY_SCHEMA_V1
    from tests.test_bundle_parity import VOLUME_SIZE, make_model

    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    first = open_volume(parity_volumes(vols)[0])
    manifest_bytes = first.manifest_bytes  # read from the volume (not held by it): before the volume is deleted
    for p in parity_volumes(vols):
        p.unlink()
    write_parity_volumes(vols, name=first.parity.name, bundle_id=first.bundle_id, manifest_bytes=manifest_bytes,
                         meta=[], mtime=int(first.data[first.parity.member].mtime), data_paths=data_volumes(vols),
                         parities=2, stripe=4096, sync=False, schema=PARITY_SCHEMA_V1)
    lost = parity_volumes(vols)[1]
    want = lost.read_bytes()
    lost.unlink()
    r = mm("bundle", "repair-volume", vols, "--no-sync")
    assert r.returncode == 0, r.stdout + r.stderr
    assert lost.read_bytes() == want and open_volume(lost).parity.schema == PARITY_SCHEMA_V1
