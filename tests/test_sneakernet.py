"""The sneakernet itself: the plan first, free space per disk, several disks, nothing of mm's on the
media, RESTORE.txt's result usable by mm, leftovers in one line.

Disks are real file systems with real free space: each test that needs one runs mm in a private mount namespace
(`unshare -m`) where fresh tmpfs mounts of a given size stand for the removable disks.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from mm.artifacts.bundle import wheelhouse
from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle.pack import MAX_VOLUMES, refuse_too_many_volumes
from mm.artifacts.errors import BadValue
from mm.artifacts.integrity.manifest import FileEntry, Manifest, write_manifest
from mm.artifacts.paths import manifest_path
from mm.artifacts.pins import default_pin
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm

PIN = default_pin()
VOLUME_SIZE = 500_000  # five data volumes of the model below


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A small MiniMax-shaped checkpoint of the pinned revision (so `mm launch` takes it), 2.2 MB."""
    root = tmp_path_factory.mktemp("sneakernet") / "MiniMax-M3.1-Flash"
    write_model(root, shards=3, shard_bytes=600 * 1024)
    manifest_for_local_dir(root, PIN.repo_id, PIN.revision, offline=True)
    return root


def volumes(d: Path) -> list[str]:
    return sorted(p.name for p in Path(d).iterdir() if p.name.endswith(".tar"))


def on_disks(tmp_path: Path, disks: dict[str, int], script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the sh SCRIPT where each tmp_path/NAME is a fresh tmpfs of SIZE bytes (a private mount namespace: the
    disks are gone when the script ends, so it copies out what the test reads). $MM is the installed mm."""
    mounts = " && ".join(f"mkdir -p {tmp_path / name} && mount -t tmpfs -o size={size} tmpfs {tmp_path / name}"
                         for name, size in disks.items())
    unshare = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-Urm"]
    env = {**os.environ, "MM": mm_argv()[0]}
    return subprocess.run([*unshare, "sh", "-c", f"set -e; {mounts}; {script}"], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


# --- the plan first ---------------------------------------------------------------------------------------

def big_manifest_dir(root: Path, size: int) -> Path:
    """A model directory whose manifest names one SIZE-byte file (sparse: nothing is ever read from it)."""
    root.mkdir(parents=True)
    with open(root / "weights.bin", "wb") as f:
        f.truncate(size)
    write_manifest(Manifest(PIN.repo_id, PIN.revision, (FileEntry("weights.bin", size, "0" * 64, "0" * 64),)),
                   manifest_path(root))
    return root


def test_a_volume_too_small_for_the_index_is_a_usage_error_naming_a_size_that_works(tmp_path):
    model = tmp_path / "small"
    write_model(model, shards=2)
    manifest_for_local_dir(model, PIN.repo_id, PIN.revision, offline=True)
    r = run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "10K", "--yes", "--no-mm")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("mm: --volume-size 10.0 kB is too small: ") and " kB of each volume" in r.stderr
    assert r.stderr.strip().endswith("; use --volume-size 1M or more"), r.stderr
    assert run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "1M", "--no-mm").returncode == 0


def test_a_volume_size_typo_is_refused_before_any_work_naming_the_count(tmp_path):
    model = big_manifest_dir(tmp_path / "big", 2_100_000_000)
    r = run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "100K",
               extra_env={"MM_BUNDLE_NO_MM": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert r.returncode == 2, r.stderr  # a bad option value: the usage code
    assert r.stderr.strip() == ("mm: --volume-size 100.0 kB: 2.1 GB would take 21,000 volumes, more than 10,000 "
                                "(a typo, e.g. 100K for 100G?); use --volume-size 1M or more, or give --yes to "
                                "write them all")
    assert not (tmp_path / "disk").exists()
    assert not (tmp_path / "xdg").exists()  # refused before mm's wheelhouse was built (minutes, on a cold cache)


def test_yes_lets_a_plan_of_more_than_10000_volumes_through():
    with pytest.raises(BadValue, match="10,001 volumes"):
        refuse_too_many_volumes(MAX_VOLUMES + 1, 10**5, 10**9, yes=False)
    refuse_too_many_volumes(MAX_VOLUMES + 1, 10**5, 10**9, yes=True)
    refuse_too_many_volumes(MAX_VOLUMES, 10**5, 10**9, yes=False)


def test_the_plan_is_printed_before_the_volumes_are_written(model, tmp_path):
    r = run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "0.5M")
    assert r.returncode == 0, r.stderr
    plan = r.stderr.splitlines()
    assert plan[0] == "plan: model: 13 file(s), 2.2 MB carried"
    assert plan[1].startswith("  in 5 volume(s) of up to 500.0 kB (the last ") and " on disk (" in plan[1]
    assert plan[2].startswith(f"  {tmp_path / 'disk'}: volumes 1-5 (") and " to write, " in plan[2]
    assert r.stdout.splitlines()[0].startswith("wrote ")  # stdout keeps the results


# --- free space and several disks -------------------------------------------------------------------------

def test_a_disk_too_small_is_refused_before_anything_is_written(model, tmp_path):
    r = on_disks(tmp_path, {"disk1": 1_200_000}, f"""
        $MM bundle {model} --out disk1 --volume-size {VOLUME_SIZE} >out.txt 2>err.txt || echo $? >rc.txt
        ls -A disk1 >listing.txt""")
    assert r.returncode == 0, r.stderr
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "rc.txt").read_text().strip() == "7", err
    assert "disk1: not enough free disk: mm bundle (volumes 1-5) needs " in err
    assert err.strip().endswith("add a disk (another --out) or free space; nothing written")
    assert (tmp_path / "listing.txt").read_text() == ""  # not a volume, not a partial file


def test_a_volume_larger_than_the_disk_is_refused_naming_a_volume_size_that_fits(model, tmp_path):
    r = on_disks(tmp_path, {"disk1": 1_200_000, "disk2": 2_000_000}, f"""
        $MM bundle {model} --out disk1 --out disk2 --volume-size 3M >out.txt 2>err.txt || echo $? >rc.txt
        ls -A disk1 disk2 >listing.txt""")
    assert r.returncode == 0, r.stderr
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "rc.txt").read_text().strip() == "7", err
    assert " is larger than this disk's free space: use --volume-size 1M or less; nothing written" in err, err
    assert "add a disk" not in err and " more, " not in err  # "needs X" is what it needs, not X more
    r = on_disks(tmp_path, {"disk1": 1_200_000, "disk2": 2_000_000}, f"""
        $MM bundle {model} --out disk1 --out disk2 --volume-size 1M >out.txt 2>err.txt""")
    assert r.returncode == 0, r.stderr  # the size it named works


def test_mm_s_own_wheels_that_do_not_fit_are_named_with_no_mm(model, tmp_path, wheelhouse_dir):
    wheels = sum(f.stat().st_size for f in wheelhouse_dir.rglob("*") if f.is_file())
    r = on_disks(tmp_path, {"disk1": 3_000_000 + wheels // 2}, f"""
        MM_BUNDLE_NO_MM=0 $MM bundle {model} --out disk1 --volume-size 1G --wheelhouse {wheelhouse_dir} >out.txt 2>err.txt \
            || echo $? >rc.txt""")
    assert r.returncode == 0, r.stderr
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "rc.txt").read_text().strip() == "7", err
    assert "of it is mm's own installer and wheels: --no-mm leaves them out" in err, err


def test_two_disks_are_filled_in_order_and_read_back_from_both_mount_points(model, tmp_path):
    """disk1 holds two volumes; the rest and the parity volume go to disk2. verify and unbundle take both
    mount points; a rerun keeps every volume where it is; a volume lost on disk1 is rebuilt from disk2's parity."""
    dest = tmp_path / "dest"
    r = on_disks(tmp_path, {"disk1": 1_100_000, "disk2": 4_000_000}, f"""
        b() {{ $MM bundle {model} --out disk1 --out disk2 --volume-size {VOLUME_SIZE} --parity 1; }}
        b >out.txt 2>err.txt
        ls disk1 >disk1.txt; ls disk2 >disk2.txt
        $MM bundle verify disk1 disk2 >verify.txt
        b >rerun.txt 2>/dev/null
        $MM unbundle disk1 disk2 --dest {dest} >unbundle.txt
        rm disk1/*.vol002-of-005.tar
        $MM unbundle disk1 disk2 --dest {dest}.rebuilt >rebuilt.txt""")
    assert r.returncode == 0, r.stderr + (tmp_path / "err.txt").read_text()
    name = f"MiniMax-M3.1-Flash-{PIN.revision[:12]}"
    assert (tmp_path / "disk1.txt").read_text().split() == [f"{name}.vol00{n}-of-005.tar" for n in (1, 2)]
    assert (tmp_path / "disk2.txt").read_text().split() == [f"{name}.par001-of-001.tar"] + [
        f"{name}.vol00{n}-of-005.tar" for n in (3, 4, 5)]
    plan = (tmp_path / "err.txt").read_text().splitlines()
    assert plan[2].startswith("  disk1: volumes 1-2 (") and plan[3].startswith("  disk2: volumes 3-5, parity 1 (")
    assert plan[5] == ("note: disk2 holds 4 volumes of the bundle and parity rebuilds any 1: losing that whole disk "
                       "is not recoverable (a disk per 1 volume(s) is)")  # parity over disks: what it protects
    assert (tmp_path / "out.txt").read_text().splitlines()[-1].endswith("mm bundle verify disk1 disk2")
    verify = (tmp_path / "verify.txt").read_text()
    assert verify.count("OK ") == 6 and "5 volume(s); missing: none" in verify
    assert [line.split()[0] for line in (tmp_path / "rerun.txt").read_text().splitlines()[:6]] == ["kept"] * 5 + [
        "wrote"]  # the parity volume is written again from the kept volumes
    assert "verify " + str(dest) + ": OK" in (tmp_path / "unbundle.txt").read_text()
    rebuilt = (tmp_path / "rebuilt.txt").read_text()
    assert "rebuilt from parity 1: volume(s) 2" in rebuilt and ": OK" in rebuilt


# --- nothing of mm's on the media -------------------------------------------------------------------------

def test_the_wheelhouse_cache_is_in_the_xdg_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wheelhouse.cache_dir() == tmp_path / "xdg" / "mm"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the specification: a relative path is ignored
    assert wheelhouse.cache_dir() == Path.home() / ".cache" / "mm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert wheelhouse.cache_dir() == Path.home() / ".cache" / "mm"


def test_a_build_a_kill_left_in_the_cache_is_removed_and_a_running_one_kept(tmp_path):
    root = tmp_path / "wheelhouse"
    (root / "build-left").mkdir(parents=True)
    (root / "build-left" / "wheel.whl").write_bytes(b"x")
    (root / "build-running").mkdir()
    fd = os.open(root / "build-running", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as bundle_wheelhouse holds its build
        wheelhouse._remove_abandoned_builds(root)
    finally:
        os.close(fd)
    assert sorted(p.name for p in root.iterdir()) == ["build-running"]


# --- RESTORE.txt ------------------------------------------------------------------------------------------

def test_restore_txt_script_leaves_a_model_mm_verifies_and_launches(model, tmp_path):
    r = run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    work = tmp_path / "work"
    shutil.copytree(tmp_path / "disk", work)
    with tarfile.open(work / volumes(work)[0]) as tf:
        text = tf.extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    (work / "restore.sh").write_text(text.split("--- begin restore script ---\n")[1].split("--- end restore")[0])
    restored = subprocess.run(["sh", "restore.sh"], cwd=work, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin"}, timeout=60)  # real tar, cat, sha256sum: no mm
    assert restored.returncode == 0, restored.stderr
    model_dir = work / "restore" / "model"
    assert (model_dir / ".mm" / "manifest.json").read_bytes() == manifest_path(model).read_bytes()
    verified = run_mm("verify", model_dir)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    launched = run_mm("launch", model_dir, "--hardware", "b300")
    assert launched.returncode == 0, launched.stderr
    assert "docker run" in launched.stdout


# --- leftovers --------------------------------------------------------------------------------------------

def test_leftovers_of_an_earlier_run_are_one_note_line(model, tmp_path):
    out = tmp_path / "disk"
    assert run_mm("bundle", model, "--out", out, "--volume-size", "250K").returncode == 0
    earlier = volumes(out)
    r = run_mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {len(earlier)} volume file(s) of an earlier, different run of bundle "
                     f"MiniMax-M3.1-Flash-{PIN.revision[:12]} in {out} (e.g. {earlier[0]}); remove them before "
                     f"copying the disks"]
    assert len(earlier) > 5  # one line, however many


def test_bundle_json_carries_the_plan_in_bytes(model, tmp_path):
    r = run_mm("bundle", model, "--out", tmp_path / "a", "--out", tmp_path / "b", "--volume-size", VOLUME_SIZE,
               "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    plan = doc["plan"]
    assert plan["volumes"] == 5 and plan["volume_size"] == VOLUME_SIZE and plan["largest"] <= VOLUME_SIZE
    assert [d["volumes"] for d in plan["disks"]] == [[1, 2, 3, 4, 5], []]  # one file system: the first has room
    assert doc["outs"] == [str(tmp_path / "a"), str(tmp_path / "b")] and isinstance(doc["seconds"], float)


def test_unbundle_into_a_store_says_mm_use_and_does_not_reinstall_the_running_mm(model, tmp_path, wheelhouse_dir):
    out = tmp_path / "disk"
    made = run_mm("bundle", model, "--out", out, "--volume-size", "1G", "--wheelhouse", wheelhouse_dir,
                  extra_env={"MM_BUNDLE_NO_MM": "0"})
    assert made.returncode == 0, made.stderr
    root = tmp_path / "models"
    dest = root / PIN.repo_id / PIN.revision[:12]
    r = run_mm("unbundle", out, "--dest", dest)
    assert r.returncode == 0, r.stderr
    nexts = [line for line in r.stdout.splitlines() if line.startswith("next: ")]
    assert any(line.startswith("next: sh ") and line.endswith("is the mm running here") for line in nexts), nexts
    use = f"mm use {PIN.repo_id} {PIN.revision[:12]} --root {root}"
    assert nexts[-1].startswith(f"next: {use}   # "), nexts
    assert run_mm(*use.split()[1:]).returncode == 0  # the command it names works as printed
