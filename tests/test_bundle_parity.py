"""Parity volumes and signed bundles: real tar volumes of real safetensors, real pyeclib, real ssh-keygen.

The bundle under test has k=5 small data volumes and m=2 parity volumes (volume size 500 kB).
"""
from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from mm.artifacts.bundle.check import verify_volumes
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.bundle.repair import repair_volumes
from mm.artifacts.bundle.unpack import Outcome, UnbundleOptions, unbundle
from mm.artifacts.bundle.volume import open_volume
from mm.artifacts.errors import ProblemsFound
from mm.artifacts.fetching.adopt import manifest_for_local_dir
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm
from tests.support.slowio import slow_stripes_env

VOLUME_SIZE = 500_000
REVISION = "ce7f4df87d2e05262f5775f373dac4772f134041"


def mm(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real mm (tests.support.run), without the caller's ssh-agent."""
    base = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    return run_mm(*args, env=base, extra_env=env)


def make_model(root: Path, seed: int = 0) -> Path:
    write_model(root, shards=3, shard_bytes=600 * 1024, seed=seed)
    manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", REVISION, offline=True)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def data_volumes(d: Path) -> list[Path]:
    return sorted(d.glob("*.vol*-of-*.tar"))


def parity_volumes(d: Path) -> list[Path]:
    return sorted(d.glob("*.par*-of-*.tar"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("src") / "model")


@pytest.fixture(scope="module")
def bundled(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vols")
    r = mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE, "--parity", "2", "--no-sync")
    assert r.returncode == 0, r.stderr
    assert len(data_volumes(out)) == 5 and len(parity_volumes(out)) == 2
    return out


@pytest.fixture
def vols(bundled, tmp_path) -> Path:
    """A fresh copy of the bundle's seven volume files for this test to lose and damage."""
    d = tmp_path / "disks"
    d.mkdir()
    for p in data_volumes(bundled) + parity_volumes(bundled):
        shutil.copy2(p, d / p.name)
    return d


def flip_byte_in_member(volume: Path, member_prefix: str = "segments/") -> str:
    v = open_volume(volume)
    name, info = next((n, i) for n, i in v.data.items() if n.startswith(member_prefix) or member_prefix == "")
    with open(volume, "r+b") as f:
        f.seek(info.offset_data + info.size // 2)
        b = f.read(1)
        f.seek(info.offset_data + info.size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    return name


# --- writing -------------------------------------------------------------------------------------------

def test_parity_volumes_are_self_describing_fit_the_media_and_verify_alone(bundled):
    for p in parity_volumes(bundled):
        assert p.stat().st_size <= VOLUME_SIZE
        with tarfile.open(p) as tf:
            names = tf.getnames()
        assert names[0].startswith("MMBUNDLE/index-par") and "MMBUNDLE/manifest.json" in names
        r = mm("bundle", "verify", p)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"OK       {p}  (parity {p.name[-14:-11].lstrip('0')} of 2)" in r.stdout
    restore = tarfile.open(data_volumes(bundled)[0]).extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    assert "Rebuilding needs mm" in restore and "A complete set of data" in restore and "needs no mm" in restore


def test_bundle_verify_says_which_missing_volumes_parity_recovers(vols):
    vs = data_volumes(vols)
    for n in (2, 4):
        vs[n - 1].unlink()
    r = mm("bundle", "verify", vols)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "missing: 2, 4" in r.stdout and "volumes 2 and 4 missing: recoverable with parity 1-2" in r.stdout


def test_a_damaged_data_volume_is_reported_as_recoverable(vols):
    flip_byte_in_member(data_volumes(vols)[2])
    r = mm("bundle", "verify", vols)
    assert r.returncode == 1
    assert "CORRUPT" in r.stdout and "volume 3 damaged: recoverable with parity 1" in r.stdout


# --- every single and every pair of the seven volumes lost ------------------------------------------------

LOSSES = [c for n in (1, 2) for c in itertools.combinations(range(7), n)]


@pytest.mark.parametrize("lost", LOSSES, ids=["-".join(map(str, c)) for c in LOSSES])
def test_every_single_and_pair_lost_is_rebuilt_and_repaired_byte_identical(bundled, model, tmp_path, lost):
    everything = data_volumes(bundled) + parity_volumes(bundled)
    disks = tmp_path / "disks"
    disks.mkdir()
    for i, p in enumerate(everything):
        if i not in lost:
            shutil.copy2(p, disks / p.name)
    report = unbundle([disks], tmp_path / "dest", UnbundleOptions(sync=False))
    assert report.outcome is Outcome.IMPORTED and report.complete, (report.refused, report.corrupt, report.recovery)
    assert tree(tmp_path / "dest") == tree(model)
    assert report.rebuilt == sorted(i + 1 for i in lost if i < 5)
    fixed = repair_volumes([disks], sync=False)
    assert sorted(Path(p).name for p in fixed.rebuilt) == sorted(everything[i].name for i in lost if i < 5)
    assert sorted(Path(p).name for p in fixed.parity_rewritten) == sorted(everything[i].name for i in lost if i >= 5)
    for p in everything:
        assert (disks / p.name).read_bytes() == p.read_bytes(), p.name


def test_unbundle_says_what_it_rebuilt(vols, model, tmp_path):
    vs = data_volumes(vols)
    vs[1].unlink()
    vs[3].unlink()
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt from parity 1, 2: volume(s) 2, 4 (each checked whole, then imported)" in r.stdout
    assert "verify" in r.stdout and "OK" in r.stdout
    assert tree(tmp_path / "dest") == tree(model)
    assert not (tmp_path / "dest" / ".mm" / "unbundle").exists()


def test_a_corrupt_member_is_rebuilt_from_parity(vols, model, tmp_path):
    vol = data_volumes(vols)[1]
    flip_byte_in_member(vol)
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{vol.name}: damaged; rebuilt from parity and imported" in r.stderr
    assert tree(tmp_path / "dest") == tree(model)


def test_repair_volume_writes_a_lost_volume_back_byte_identical(vols, bundled):
    lost = data_volumes(vols)[2]
    lost.unlink()
    r = mm("bundle", "repair-volume", vols)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rebuilt  {lost}" in r.stdout
    assert lost.read_bytes() == (bundled / lost.name).read_bytes()


def test_a_lost_parity_volume_needs_nothing_rebuilt(vols, model, tmp_path):
    parity_volumes(vols)[0].unlink()
    r = mm("bundle", "verify", vols)
    assert r.returncode == 0 and "parity: 2 volume(s); missing: 1" in r.stdout
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0 and "rebuilt" not in r.stdout
    assert tree(tmp_path / "dest") == tree(model)


def test_more_lost_than_parity_names_what_is_needed(vols, tmp_path):
    vs = data_volumes(vols)
    for n in (1, 3, 5):
        vs[n - 1].unlink()
    r = mm("bundle", "verify", vols)
    assert "volumes 1, 3 and 5 missing: NOT recoverable (only parity 1-2 usable); bring back any 1 of: " \
           "volume 1, volume 3, volume 5" in r.stdout
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 8, r.stderr  # what could be imported is; the rest waits for more volumes
    assert "cannot rebuild yet" in r.stdout and "bring back any 1 of them" in r.stdout
    assert "still missing: volume(s) 1, 3, 5" in r.stdout
    r = mm("bundle", "repair-volume", vols)
    assert r.returncode == 1 and "bring back any 1 of them" in r.stderr and "Traceback" not in r.stderr


def test_parity_of_another_bundle_is_refused(vols, tmp_path):
    other = make_model(tmp_path / "other", seed=7)
    out = tmp_path / "other-vols"
    assert mm("bundle", other, "--out", out, "--volume-size", VOLUME_SIZE, "--parity", "2",
              "--no-sync").returncode == 0
    for p in parity_volumes(vols):
        p.unlink()
    foreign = parity_volumes(out)[0]
    shutil.copy2(foreign, vols / foreign.name)
    data_volumes(vols)[0].unlink()
    r = mm("bundle", "verify", vols)
    assert r.returncode == 1 and f"FOREIGN  {vols / foreign.name}" in r.stdout
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 5
    assert f"{foreign.name}: parity of bundle" in r.stderr and "refused" in r.stderr
    assert "still missing: volume(s) 1" in r.stdout


def test_a_rebuild_killed_mid_way_is_finished_by_a_rerun(model, tmp_path):
    """kill -9 while a lost volume is being rebuilt (4 KiB stripes, a pause after each: ~120 stripes to go);
    the partial rebuilt volume never gets a name, and the rerun rebuilds it and completes."""
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    lost = data_volumes(vols)[1]
    lost.unlink()
    dest = tmp_path / "dest"
    rebuilt_dir = dest / ".mm" / "unbundle" / "rebuilt"
    proc = subprocess.Popen(mm_argv("unbundle", vols, "--dest", dest), env={**os.environ, **slow_stripes_env(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not (
            rebuilt_dir.is_dir() and any(p.name.endswith(".partial") for p in rebuilt_dir.iterdir())):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name for p in rebuilt_dir.iterdir()] == [f".{lost.name}.partial"]  # killed mid-rebuild, nothing named
    r = mm("unbundle", vols, "--dest", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt from parity 1: volume(s) 2" in r.stdout
    assert tree(dest) == tree(model)


def test_sittings_rebuild_once_enough_volumes_have_arrived(vols, model, tmp_path):
    """Disks 1 and 2 arrive and go back; later 3, 5 and a parity disk arrive, 4 is lost: 4 is rebuilt from what
    1 and 2 left in DEST, 3, 5 and the parity."""
    dest = tmp_path / "dest"
    vs, ps = data_volumes(vols), parity_volumes(vols)
    first, second = tmp_path / "sitting1", tmp_path / "sitting2"
    first.mkdir()
    second.mkdir()
    for p in vs[:2] + ps[:1]:
        shutil.copy2(p, first / p.name)
    r = mm("unbundle", first, "--dest", dest)
    assert r.returncode == 8 and "still missing: volume(s) 3, 4, 5" in r.stdout
    assert "cannot rebuild yet" in r.stdout
    for p in (vs[2], vs[4], ps[0]):
        shutil.copy2(p, second / p.name)
    r = mm("unbundle", second, "--dest", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt from parity 1: volume(s) 4" in r.stdout and tree(dest) == tree(model)


def test_small_stripes_many_per_volume_rebuild_exactly(model, tmp_path):
    out = tmp_path / "vols"
    create_bundle(model, BundleOptions((out,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    originals = {p.name: p.read_bytes() for p in data_volumes(out)}
    vs = data_volumes(out)
    vs[0].unlink()
    vs[-1].unlink()
    fixed = repair_volumes([out], sync=False)
    assert len(fixed.rebuilt) == 2
    assert {p.name: p.read_bytes() for p in data_volumes(out)} == originals
    assert verify_volumes([out]).ok


def test_not_recoverable_is_problems_found(vols):
    for p in data_volumes(vols)[:3]:
        p.unlink()
    with pytest.raises(ProblemsFound):
        repair_volumes([vols], sync=False)


# --- signatures in bundles ------------------------------------------------------------------------

@pytest.fixture
def signed_bundle(model, keys, tmp_path) -> Path:
    src = tmp_path / "signed-model"
    shutil.copytree(model, src)
    assert mm("sign", src, "--key", keys["alice"]).returncode == 0
    out = tmp_path / "signed-vols"
    r = mm("bundle", src, "--out", out, "--volume-size", VOLUME_SIZE, "--parity", "1", "--no-sync")
    assert r.returncode == 0, r.stderr
    assert "signature travels in every volume" in r.stdout
    return out


def test_the_signature_travels_in_every_volume_and_unbundle_restores_it(signed_bundle, keys, tmp_path, model):
    for p in data_volumes(signed_bundle) + parity_volumes(signed_bundle):
        with tarfile.open(p) as tf:
            assert "MMBUNDLE/manifest.json.sig" in tf.getnames(), p.name
        assert json.loads(tarfile.open(p).extractfile(tarfile.open(p).getnames()[0]).read())["meta"][
            "MMBUNDLE/manifest.json.sig"]
    dest = tmp_path / "dest"
    r = mm("unbundle", signed_bundle, "--dest", dest, "--require-signature", "--allowed-signers", keys["allowed"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "signature: good, signed by alice@example.com (ssh-ed25519 key SHA256:" in r.stdout
    assert (dest / ".mm" / "manifest.json.sig").is_file()
    assert mm("verify", dest, "--allowed-signers", keys["allowed"]).returncode == 0


def test_unbundle_require_signature_refuses_unsigned_before_writing(bundled, keys, tmp_path):
    dest = tmp_path / "dest"
    r = mm("unbundle", bundled, "--dest", dest, "--require-signature", "--allowed-signers", keys["allowed"])
    assert r.returncode == 5 and "not signed" in r.stderr
    assert not dest.exists()


def test_unbundle_refuses_a_signer_not_allowed_before_writing(model, keys, tmp_path):
    src = tmp_path / "m"
    shutil.copytree(model, src)
    assert mm("sign", src, "--key", keys["mallory"]).returncode == 0
    out = tmp_path / "v"
    assert mm("bundle", src, "--out", out, "--volume-size", VOLUME_SIZE, "--no-sync").returncode == 0
    dest = tmp_path / "dest"
    r = mm("unbundle", out, "--dest", dest, "--require-signature", "--allowed-signers", keys["allowed"])
    assert r.returncode == 5 and "does not allow" in r.stderr
    assert not dest.exists()


def test_bundle_refuses_a_signature_the_manifest_no_longer_matches(model, keys, tmp_path):
    src = tmp_path / "m"
    shutil.copytree(model, src)
    assert mm("sign", src, "--key", keys["alice"]).returncode == 0
    mpath = src / ".mm" / "manifest.json"
    mpath.write_text(mpath.read_text().replace('"repo_type"', ' "repo_type"', 1))
    r = mm("bundle", src, "--out", tmp_path / "v", "--volume-size", VOLUME_SIZE)
    assert r.returncode == 5 and "changed after it was signed" in r.stderr


def test_restore_txt_signature_line_runs_with_tar_and_ssh_keygen_alone(signed_bundle, keys, tmp_path):
    work = tmp_path / "restore-here"
    work.mkdir()
    for p in data_volumes(signed_bundle):
        shutil.copy2(p, work / p.name)
    text = tarfile.open(data_volumes(signed_bundle)[0]).extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    script = text.split("--- begin restore script ---\n")[1].split("--- end restore script ---")[0]
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(["sh", "-c", script], cwd=work, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln.strip() for ln in text.splitlines() if "ssh-keygen -Y verify" in ln and "cd restore/MMBUNDLE" in ln)
    line = line.replace("-f allowed_signers", f"-f {keys['allowed']}").replace("-I ID", "-I alice@example.com")
    r = subprocess.run(["sh", "-c", line], cwd=work, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert 'Good "mm-manifest" signature for alice@example.com' in r.stdout + r.stderr


# --- hostile parity volumes -----------------------------------------------------------------------------

def rewrite_parity_index(volume: Path, change) -> None:
    """Rewrite VOLUME (a parity volume) with its index document changed by CHANGE, every other member as it was."""
    with tarfile.open(volume) as tf:
        members = [(info, tf.extractfile(info).read()) for info in tf.getmembers()]
    doc = json.loads(members[0][1])
    change(doc)
    data = json.dumps(doc).encode()
    members[0][0].size = len(data)
    members[0] = (members[0][0], data)
    tmp = volume.with_name(volume.name + ".new")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        for info, body in members:
            tf.addfile(info, io.BytesIO(body))
    tmp.replace(volume)


def test_a_parity_index_naming_a_file_outside_the_bundle_is_refused_and_nothing_is_written(vols, tmp_path):
    for p in parity_volumes(vols):
        rewrite_parity_index(p, lambda doc: doc["data"][0].update(file="notes.txt"))
    data_volumes(vols)[0].unlink()
    r = mm("bundle", "verify", parity_volumes(vols)[0])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "malformed parity index (data volume 1 is named 'notes.txt'" in r.stdout
    r = mm("bundle", "repair-volume", vols, "--out", tmp_path / "out")
    assert r.returncode == 3 and "no usable parity volume" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "notes.txt").exists() and not (vols / "notes.txt").exists()


def test_a_parity_index_with_a_huge_stripe_is_refused(vols):
    p = parity_volumes(vols)[0]
    rewrite_parity_index(p, lambda doc: doc.update(stripe=1 << 30))
    r = mm("bundle", "verify", p)
    assert r.returncode == 1 and "malformed parity index (stripe 1073741824 is not a multiple of 64 up to" in r.stdout


def test_a_sitting_of_parity_volumes_alone_rebuilds_the_last_lost_volume(vols, model, tmp_path):
    """Disks 1-4 arrive and go back, disk 5 is lost; a later sitting brings the parity disk alone."""
    dest = tmp_path / "dest"
    vs, ps = data_volumes(vols), parity_volumes(vols)
    first, second = tmp_path / "sitting1", tmp_path / "sitting2"
    first.mkdir()
    second.mkdir()
    for p in vs[:4]:
        shutil.copy2(p, first / p.name)
    r = mm("unbundle", first, "--dest", dest)
    assert r.returncode == 8 and "still missing: volume(s) 5" in r.stdout
    shutil.copy2(ps[1], second / ps[1].name)
    r = mm("unbundle", second, "--dest", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt from parity 2: volume(s) 5" in r.stdout and tree(dest) == tree(model)


def test_a_damaged_parity_stream_is_left_out_and_the_other_parity_rebuilds(vols, model, tmp_path):
    flip_byte_in_member(parity_volumes(vols)[0], "parity/")
    data_volumes(vols)[2].unlink()
    r = mm("unbundle", vols, "--dest", tmp_path / "dest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: parity 1: damaged (its bytes do not match the parity index); left out of the rebuild" in r.stderr
    assert "rebuilt from parity 2: volume(s) 3" in r.stdout and tree(tmp_path / "dest") == tree(model)


def test_parity_of_another_bundle_is_refused_even_when_nothing_needs_rebuilding(vols, tmp_path):
    other = make_model(tmp_path / "other", seed=7)
    out = tmp_path / "other-vols"
    assert mm("bundle", other, "--out", out, "--volume-size", VOLUME_SIZE, "--parity", "1",
              "--no-sync").returncode == 0
    foreign = parity_volumes(out)[0]
    r = mm("unbundle", *data_volumes(vols), foreign, "--dest", tmp_path / "dest")
    assert r.returncode == 5 and f"refused: {foreign.name}: parity of bundle" in r.stderr
    assert "verify" in r.stdout  # the bundle's own volumes were all imported


def test_repair_volume_of_a_file_that_is_no_volume_names_it(tmp_path):
    junk = tmp_path / "vol.tar"
    junk.write_bytes(b"junk\n")
    r = mm("bundle", "repair-volume", junk, "--out", tmp_path / "out")
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip() == f"mm: no usable parity volume of an mm bundle among {junk}"
