"""On the air-gapped side, advice points at the volumes the directory came from, never at the Hub: a partial import
names the volume still to come (and exits 8, so `mm unbundle DISK --dest D && mm launch D` stops there), and a file
changed after a complete import is restored by running unbundle again from the same volumes."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mm.artifacts.bundle.format import volume_filename
from tests.support.run import run_mm
from tests.test_bundle import make_model, volumes_in

OFFLINE = {"HF_HUB_OFFLINE": "1"}
NAME = "MiniMax-M3.1-Flash-ce7f4df87d2e"  # the bundle's default name: the repo's and the revision's
WAITING = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("remedy-src") / "model")


@pytest.fixture(scope="module")
def disks(model, tmp_path_factory) -> tuple[Path, Path, int]:
    """The model in 3 volumes: volume 1 on disk1, the rest on disk2 (as a user carries them)."""
    out = tmp_path_factory.mktemp("remedy-vols")
    r = run_mm("bundle", model, "--out", out, "--volume-size", "1M", "--no-mm")
    assert r.returncode == 0, r.stderr
    vols = volumes_in(out)
    assert len(vols) >= 2
    disk1, disk2 = out / "disk1", out / "disk2"
    disk1.mkdir(), disk2.mkdir()
    shutil.move(vols[0], disk1 / vols[0].name)
    for v in vols[1:]:
        shutil.move(v, disk2 / v.name)
    return disk1, disk2, len(vols)


def test_a_partial_import_exits_8_and_names_the_volume_still_to_come(disks, tmp_path):
    disk1, disk2, count = disks
    dest = tmp_path / "dest"
    r = run_mm("unbundle", disk2, "--dest", dest)
    assert r.returncode == WAITING, r.stdout + r.stderr
    first = volume_filename(NAME, 1, count)
    assert f"next: volume(s) 1 of {count} of bundle {NAME} not imported yet ({first}): mm unbundle <where it is> " \
           f"--dest {dest}" in r.stdout
    assert f"(the others were read from {disk2})" in r.stdout


def test_a_partial_import_reports_waiting_in_json(disks, tmp_path):
    _, disk2, _ = disks
    import json
    r = run_mm("unbundle", disk2, "--dest", tmp_path / "dest", "--json")
    doc = json.loads(r.stdout)
    assert (r.returncode, doc["exit_code"], doc["outcome"], doc["ok"]) == (WAITING, WAITING, "waiting", False)


def test_verify_of_a_partial_import_offline_names_the_missing_volume_not_the_hub(disks, tmp_path):
    disk1, disk2, count = disks
    dest = tmp_path / "dest"
    run_mm("unbundle", disk2, "--dest", dest)
    r = run_mm("verify", dest, extra_env=OFFLINE)
    assert r.returncode == 1
    assert f"next: volume(s) 1 of {count} of bundle {NAME} not imported yet" in r.stdout
    assert "mm repair" not in r.stdout + r.stderr and "Hub" not in r.stdout


def test_the_quick_verify_gate_of_a_partial_import_names_the_missing_volume(disks, tmp_path):
    _, disk2, count = disks
    dest = tmp_path / "dest"
    run_mm("unbundle", disk2, "--dest", dest)
    r = run_mm("bundle", dest, "--out", tmp_path / "again", "--volume-size", "1M", "--no-mm", extra_env=OFFLINE)
    assert r.returncode == 1
    assert f"volume(s) 1 of {count} of bundle {NAME} not imported yet" in r.stderr and "mm repair" not in r.stderr


def test_the_partial_import_completes_with_the_volume_it_named(disks, tmp_path, model):
    disk1, disk2, _ = disks
    dest = tmp_path / "dest"
    run_mm("unbundle", disk2, "--dest", dest)
    r = run_mm("unbundle", disk1, "--dest", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (dest / "config.json").read_bytes() == (model / "config.json").read_bytes()


def hand_edit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[1] ^= 0x20  # same size, other bytes
    path.write_bytes(bytes(data))


@pytest.fixture
def imported(disks, tmp_path) -> Path:
    disk1, disk2, _ = disks
    dest = tmp_path / "dest"
    r = run_mm("unbundle", disk1, disk2, "--dest", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    return dest


def test_verify_of_a_hand_edited_file_after_import_says_unbundle_again_restores_it(disks, imported):
    disk1, disk2, _ = disks
    hand_edit(imported / "config.json")
    r = run_mm("verify", imported, extra_env=OFFLINE)
    assert r.returncode == 1
    assert f"next: mm unbundle {disk1} {disk2} --dest {imported}   (imports again from bundle {NAME}'s volumes the " \
           f"1 file(s) changed or missing since the import, then verifies)" in r.stdout
    assert "mm repair" not in r.stdout


def test_running_unbundle_again_restores_exactly_the_hand_edited_file(disks, imported, model):
    disk1, disk2, _ = disks
    hand_edit(imported / "config.json")
    r = run_mm("unbundle", disk1, disk2, "--dest", imported)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 file(s) imported" in r.stdout
    assert (imported / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert run_mm("verify", imported).returncode == 0


def test_running_unbundle_again_restores_a_deleted_file(disks, imported, model):
    disk1, disk2, _ = disks
    (imported / "config.json").unlink()
    r = run_mm("unbundle", disk1, disk2, "--dest", imported)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (imported / "config.json").read_bytes() == (model / "config.json").read_bytes()


def test_repair_offline_of_an_imported_dir_names_its_volumes(disks, imported):
    disk1, disk2, _ = disks
    hand_edit(imported / "config.json")
    r = run_mm("repair", imported, extra_env=OFFLINE)
    assert r.returncode == 4
    assert f"came from a bundle, whose volumes restore it: mm unbundle {disk1} {disk2} --dest {imported}" in r.stderr


@pytest.mark.parametrize("record", [b"{", b"[]", b'{"volumes": -1, "name": 5}', b'{"read_from": {"1": 7}}',
                                    b'{"volumes": 99999999999999999999}'])
def test_a_damaged_import_record_gives_no_advice_and_never_stops_an_import(disks, imported, model, record):
    disk1, disk2, _ = disks
    (imported / ".mm" / "imported.json").write_bytes(record)
    hand_edit(imported / "config.json")
    v = run_mm("verify", imported, extra_env=OFFLINE)
    assert v.returncode == 1 and "Traceback" not in v.stdout + v.stderr
    assert "mm unbundle" not in v.stdout  # nothing it says is believed
    r = run_mm("unbundle", disk1, disk2, "--dest", imported)
    # without the record's stamps the changed file is found by the final check's hash, and named
    assert r.returncode == 1 and "config.json: hash" in r.stdout and "Traceback" not in r.stdout + r.stderr
