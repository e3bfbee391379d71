"""Delta bundles: a site that imported revision A from full volumes receives revision B, which changes
three small files and renames one shard, as a delta of under 1% of the full bundle, and rebuilds B from its copy
of A: by reflink on XFS, by copy on tmpfs, by hard link when asked; byte-identical to a fresh fetch of B.

Everything real: the test Hub serves both commits to `mm fetch`, volumes are real tar files, XFS is a real image on
a loop device (`mkfs.xfs -m reflink=1`), the RESTORE.txt script runs under sh.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.edges.sharing import layout, shared_bytes
from mm.artifacts.units import human_bytes
from tests.support.fsimages import fill, require_mounts, tmpfs_mount, xfs_mount
from tests.support.gitrepo import commit_dir
from tests.support.modelgen import write_model
from tests.support.run import run_mm

REPO = "delta-org/delta-model"
SHARD = "model-00002-of-00004.safetensors"
RENAMED = "model-00002-of-00004.v2.safetensors"
CHANGED = ("model.safetensors.index.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class Update:
    a: str  # commit of revision A
    b: str  # commit of revision B
    conn_a: Path  # A as fetched on the connected host
    conn_b: Path  # B, a fresh fetch
    full: Path  # A's full volumes
    delta: Path  # B's delta volumes against A
    env: dict


def payload(root: Path) -> dict[str, bytes]:
    """Every model file under ROOT with its bytes (mm's own .mm/ excluded)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def tar_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


def write_revision_b(src_a: Path, src_b: Path) -> None:
    """B = A with one shard renamed (the index follows), a new chat template and new sampling defaults."""
    shutil.copytree(src_a, src_b)
    (src_b / SHARD).rename(src_b / RENAMED)
    index = json.loads((src_b / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: RENAMED if v == SHARD else v for k, v in index["weight_map"].items()}
    (src_b / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src_b / "tokenizer_config.json").read_text())
    (src_b / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}) + "\n")
    (src_b / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.9}\n')


@pytest.fixture(scope="module")
def update(hub_root, _hub_server_session, tmp_path_factory) -> Update:
    """Revisions A and B on the test Hub; A fetched and bundled whole, B fetched fresh and bundled as a delta of A."""
    work = tmp_path_factory.mktemp("delta")
    src_a, src_b = work / "src-a", work / "src-b"
    write_model(src_a, shards=4, shard_bytes=4 * 2**20, seed=22)
    write_revision_b(src_a, src_b)
    a = commit_dir(hub_root / REPO, src_a, "first upload")
    b = commit_dir(hub_root / REPO, src_b, "chat template, sampling defaults; shard 2 renamed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(work / "hf-home"), NO_PROXY="127.0.0.1",
               no_proxy="127.0.0.1", MM_BUNDLE_NO_MM="1")
    conn_a, conn_b = work / "connected" / "A", work / "connected" / "B"
    ok(run_mm("fetch", REPO, "--revision", a, "--local-dir", conn_a, env=env))
    ok(run_mm("fetch", REPO, "--revision", b, "--local-dir", conn_b, env=env))
    full, delta = work / "full", work / "delta"
    ok(run_mm("bundle", conn_a, "--out", full, "--volume-size", "8M", env=env))
    ok(run_mm("bundle", conn_b, "--base", conn_a, "--out", delta, "--volume-size", "8M", env=env))
    return Update(a, b, conn_a, conn_b, full, delta, env)


def mm(update: Update, *args) -> subprocess.CompletedProcess:
    return run_mm(*args, env=update.env)


def import_a(update: Update, dest: Path) -> Path:
    ok(mm(update, "unbundle", update.full, "--dest", dest))
    return dest


# --- the delta itself -------------------------------------------------------------------------------------

def test_the_delta_of_three_small_files_and_a_rename_is_under_one_percent_of_the_full_bundle(update):
    assert tar_bytes(update.delta) < 0.01 * tar_bytes(update.full), (tar_bytes(update.delta), tar_bytes(update.full))


def test_bundle_verify_says_delta_of_which_base_and_how_much_comes_from_it(update):
    r = ok(mm(update, "bundle", "verify", update.delta, "--json"))
    d = json.loads(r.stdout)["delta"]
    carried = {f"model/{p}" for p in CHANGED}
    assert (d["base_repo_id"], d["base_revision"], d["files_carried"]) == (REPO, update.a, len(carried))
    assert d["bytes_from_base"] == sum(len(v) for p, v in payload(update.conn_b).items() if p not in CHANGED)
    text = ok(mm(update, "bundle", "verify", update.delta)).stdout
    assert f"delta of base {REPO}@{update.a[:12]}" in text and "--from BASE_DIR" in text


def small_wheelhouse(out: Path, wheel_bytes: int = 300_000) -> Path:
    """What `mm bundle --only-mm --out OUT` writes, in small: install-mm.sh and one set of one wheel (its bytes
    stand in for mm's ~40 MB of wheels), whose index and lock agree with it."""
    import hashlib
    from mm.artifacts.bundle import wheelhouse as wh
    wheels = out / wh.WHEELHOUSE_DIR / wh.WHEELS_DIR
    wheels.mkdir(parents=True)
    data = os.urandom(wheel_bytes)
    (wheels / "mm-0.1.0-py3-none-any.whl").write_bytes(data)
    wheel = {"file": "mm-0.1.0-py3-none-any.whl", "name": "mm", "version": "0.1.0", "size": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    name = "linux-x86_64-cp311"
    (out / wh.WHEELHOUSE_DIR / name).mkdir()
    (out / wh.WHEELHOUSE_DIR / name / wh.LOCK_NAME).write_text(f"mm==0.1.0 --hash=sha256:{wheel['sha256']}\n")
    (out / wh.WHEELHOUSE_DIR / wh.INDEX_NAME).write_text(json.dumps(
        {"schema": wh.SCHEMA, "mm_version": "0.1.0",
         "sets": [{"name": name, "lock": f"{name}/{wh.LOCK_NAME}", "wheels": [wheel]}]}))
    (out / wh.INSTALL_SCRIPT).write_text("#!/bin/sh\n")
    return out


def test_the_plan_and_the_summaries_say_the_models_carried_bytes_apart_from_mm_and_the_disk(update, tmp_path):
    """One delta, one figure for it everywhere ("carried"); mm's wheels and the volume files' size named apart."""
    carried = sum(len(v) for p, v in payload(update.conn_b).items() if p in CHANGED)
    wheels = small_wheelhouse(tmp_path / "mm-wheels")
    r = ok(run_mm("bundle", update.conn_b, "--base", update.conn_a, "--out", tmp_path / "out", "--volume-size", "8M",
                  "--wheelhouse", wheels, env={**update.env, "MM_BUNDLE_NO_MM": "0"}))
    on_disk = tar_bytes(tmp_path / "out")
    plan = r.stderr.splitlines()
    assert plan[0].startswith(f"plan: model: {len(CHANGED)} file(s), {human_bytes(carried)} carried (")
    assert "; mm itself (installer and wheels): 4 file(s), 300." in plan[0]  # its script, index, lock and wheel
    assert plan[1].startswith("  in 1 volume(s) of up to 8.0 MB: ") and f"{human_bytes(on_disk)} on disk" in plan[1]
    summary = next(line for line in r.stdout.splitlines() if line.startswith("bundle "))
    assert f"{human_bytes(on_disk)} on disk" in summary
    assert f"model: {len(CHANGED)} file(s), {human_bytes(carried)} carried" in summary
    assert f"{len(CHANGED)} file(s), {human_bytes(carried)} carried" in r.stdout.split("delta of base")[1]
    checked = ok(mm(update, "bundle", "verify", tmp_path / "out")).stdout
    assert f"checked 1 volume file(s), {human_bytes(on_disk)} on disk: " in checked and " of members hashed (" in checked
    assert f"{len(CHANGED)} file(s), {human_bytes(carried)} carried" in checked.split("delta of base")[1]


# --- unbundle --from: reflink, copy, link --------------------------------------------------------------------

def test_unbundle_from_on_xfs_takes_the_base_files_by_reflink_and_matches_a_fresh_fetch(update, tmp_path):
    require_mounts()
    with xfs_mount(tmp_path / "xfs") as mnt:
        a_dir, b_dir = mnt / REPO / update.a[:12], mnt / REPO / update.b[:12]
        import_a(update, a_dir)
        used = shutil.disk_usage(mnt).used
        r = ok(mm(update, "unbundle", update.delta, "--dest", b_dir, "--from", a_dir, "--json"))
        doc = json.loads(r.stdout)
        assert doc["verify"]["ok"] and doc["complete"]
        assert (doc["delta"]["mode"], doc["delta"]["copied_bytes"]) == ("reflink", 0)
        assert sorted(doc["imported"]) == sorted(f"model/{p}" for p in CHANGED)
        assert doc["verify"]["hashed_now"]["files"] == 0  # each taken file was hashed once, as it was taken
        assert payload(b_dir) == payload(update.conn_b)
        renamed = layout(b_dir / RENAMED)
        assert shared_bytes([renamed], [layout(a_dir / SHARD)]) == renamed.allocated > 4 * 2**20
        assert shutil.disk_usage(mnt).used - used < 2 * 2**20  # the model is 18 MB; B added its three small files
        ok(mm(update, "fetch", REPO, "--revision", update.b, "--local-dir", mnt / "fetched", "--from", a_dir))
        fetched = layout(mnt / "fetched" / RENAMED)  # the connected side's --from reflinks too
        assert shared_bytes([fetched], [layout(a_dir / SHARD)]) == fetched.allocated


def test_unbundle_from_on_tmpfs_copies_and_with_link_hard_links(update, tmp_path):
    require_mounts()
    with tmpfs_mount(tmp_path / "tmpfs", size=128 * 2**20) as mnt:
        a_dir = import_a(update, mnt / "A")
        r = ok(mm(update, "unbundle", update.delta, "--dest", mnt / "B", "--from", a_dir))
        assert "taken from the base" in r.stdout and "by copy (no reflink on this file system)" in r.stdout
        assert payload(mnt / "B") == payload(update.conn_b)
        assert os.stat(mnt / "B" / RENAMED).st_ino != os.stat(a_dir / SHARD).st_ino
        doc = json.loads(ok(mm(update, "unbundle", update.delta, "--dest", mnt / "B2", "--from", a_dir, "--link",
                               "--json")).stdout)
        assert (doc["delta"]["mode"], doc["verify"]["ok"]) == ("link", True)
        assert os.stat(mnt / "B2" / RENAMED).st_ino == os.stat(a_dir / SHARD).st_ino
        assert payload(mnt / "B2") == payload(update.conn_b)


def test_free_space_counts_only_what_is_copied(update, tmp_path):
    require_mounts()
    model = sum(len(v) for v in payload(update.conn_a).values())
    with xfs_mount(tmp_path / "xfs") as mnt:  # room for B's small files, not for a copy of A
        a_dir = import_a(update, mnt / "A")
        fill(mnt, leave=model // 3)
        ok(mm(update, "unbundle", update.delta, "--dest", mnt / "B", "--from", a_dir))
    with tmpfs_mount(tmp_path / "tmpfs", size=model + model // 3) as mnt:
        a_dir = import_a(update, mnt / "A")
        r = mm(update, "unbundle", update.delta, "--dest", mnt / "B", "--from", a_dir)
        assert r.returncode == 7 and "not enough free disk" in r.stderr, r.stderr
        assert payload(mnt / "B") == {}


# --- hostile deltas ------------------------------------------------------------------------------------------

def edited_delta(update: Update, out: Path, edit) -> Path:
    """A copy of the delta volume whose index (its take list) EDIT changed."""
    src = next(update.delta.glob("*.tar"))
    out.mkdir()
    with tarfile.open(src) as tin, tarfile.open(out / src.name, "w", format=tarfile.PAX_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read()
            if info.name.startswith("MMBUNDLE/index-vol"):
                doc = json.loads(data)
                edit({t["path"]: t for t in doc["delta"]["take"]})
                data = json.dumps(doc, indent=1).encode()
                info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return out


def test_a_base_directory_holding_another_revision_is_refused_before_anything_is_written(update, tmp_path):
    r = mm(update, "unbundle", update.delta, "--dest", tmp_path / "B", "--from", update.conn_b)
    assert r.returncode == 3 and "not the delta's base" in r.stderr and update.a[:12] in r.stderr, r.stderr
    assert payload(tmp_path / "B") == {}
    r = mm(update, "unbundle", update.delta, "--dest", tmp_path / "B")
    assert r.returncode == 3 and "give --from BASE_DIR" in r.stderr


def test_a_take_naming_a_file_the_base_does_not_hold_is_refused(update, tmp_path):
    def edit(take):
        take[RENAMED]["base_path"] = "model-00009-of-00004.safetensors"
    r = mm(update, "unbundle", edited_delta(update, tmp_path / "vols", edit), "--dest", tmp_path / "B",
           "--from", update.conn_a)
    assert r.returncode == 3 and "which the base" in r.stderr and "does not hold" in r.stderr, r.stderr
    assert payload(tmp_path / "B") == {}


def test_a_take_from_a_base_file_of_other_content_is_refused(update, tmp_path):
    def edit(take):
        take[RENAMED]["base_path"] = "model-00003-of-00004.safetensors"  # same size, other bytes
    r = mm(update, "unbundle", edited_delta(update, tmp_path / "vols", edit), "--dest", tmp_path / "B",
           "--from", update.conn_a)
    assert r.returncode == 3 and "other hashes than the base manifest" in r.stderr, r.stderr
    assert payload(tmp_path / "B") == {}


def test_a_take_whose_hashes_disagree_with_the_manifest_refuses_the_volume(update, tmp_path):
    def edit(take):
        take[RENAMED]["sha256"] = "0" * 64
    vols = edited_delta(update, tmp_path / "vols", edit)
    r = mm(update, "bundle", "verify", vols)
    assert r.returncode == 1 and "the manifest says" in r.stdout, r.stdout
    r = mm(update, "unbundle", vols, "--dest", tmp_path / "B", "--from", update.conn_a)
    assert r.returncode == 3 and payload(tmp_path / "B") == {}


@pytest.mark.parametrize("path", ["zzz.json", ".mm/evil", ".mm-partial/x", "\u202enosj.txt"])
def test_a_take_of_a_path_the_manifest_lacks_is_refused_by_unbundle_as_by_bundle_verify(update, tmp_path, path):
    def edit(take):
        take[RENAMED]["path"] = path
    vols = edited_delta(update, tmp_path / "vols", edit)
    r = mm(update, "bundle", "verify", vols)
    assert r.returncode == 1 and "the manifest has no such file" in r.stdout, r.stdout + r.stderr
    r = mm(update, "unbundle", vols, "--dest", tmp_path / "B", "--from", update.conn_a)
    assert r.returncode == 3 and "the manifest has no such file" in r.stderr, r.stderr
    assert payload(tmp_path / "B") == {}


def test_a_base_file_damaged_after_its_verify_is_not_taken_and_a_rerun_completes(update, tmp_path):
    base = tmp_path / "A"
    shutil.copytree(update.conn_a, base)
    shard = base / "model-00003-of-00004.safetensors"
    good = shard.read_bytes()
    with open(shard, "r+b") as f:  # same size, one byte off, far from the header: verify --quick passes
        f.seek(len(good) - 100)
        f.write(bytes([good[-100] ^ 0xFF]))
    ok(mm(update, "verify", "--quick", base))
    r = mm(update, "unbundle", update.delta, "--dest", tmp_path / "B", "--from", base)
    assert r.returncode == 5 and f"{shard}: does not match the base manifest" in r.stderr, r.stderr
    assert not (tmp_path / "B" / shard.name).exists() and (tmp_path / "B" / RENAMED).is_file()
    shard.write_bytes(good)
    r = ok(mm(update, "unbundle", update.delta, "--dest", tmp_path / "B", "--from", base))
    assert "verify" in r.stdout and "OK" in r.stdout
    assert payload(tmp_path / "B") == payload(update.conn_b)


# --- without mm, in sittings, with parity ---------------------------------------------------------------------

def restore_script(volume: Path) -> str:
    with tarfile.open(volume) as tf:
        text = tf.extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    return text.split("--- begin restore script ---\n")[1].split("--- end restore script ---")[0]


def test_restore_txt_of_a_delta_names_the_base_and_its_script_rebuilds_b_from_it(update, tmp_path):
    vol = next(update.delta.glob("*.tar"))
    with tarfile.open(vol) as tf:
        text = tf.extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    assert "DELTA" in text and update.a in text and "sh restore.sh BASE_DIR" in text
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(vol, site)
    (site / "restore.sh").write_text(restore_script(vol))
    r = subprocess.run(["sh", "restore.sh"], cwd=site, capture_output=True, text=True)
    assert r.returncode != 0 and "usage: sh restore.sh BASE_DIR" in r.stderr
    r = subprocess.run(["sh", "restore.sh", str(update.conn_a)], cwd=site, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert payload(site / "restore" / "model") == payload(update.conn_b)


def test_a_delta_in_two_sittings_with_its_second_volume_rebuilt_from_parity(update, tmp_path):
    base = tmp_path / "A2"  # A with other bytes in the shard B renames: the delta carries 4 MiB, over volumes
    shutil.copytree(update.conn_a, base)
    with open(base / SHARD, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"other data")
    manifest_for_local_dir(base, REPO, update.a, offline=True)
    vols = tmp_path / "vols"
    ok(mm(update, "bundle", update.conn_b, "--base", base, "--out", vols, "--volume-size", "2M", "--parity", "1"))
    data = sorted(vols.glob("*.vol*.tar"))
    assert len(data) >= 3
    dest = tmp_path / "B"
    first = json.loads(mm(update, "unbundle", data[0], "--dest", dest, "--from", base, "--json").stdout)
    assert (first["exit_code"], first["complete"]) == (8, False)
    assert first["delta"]["taken"] == first["delta"]["files_from_base"] > 0
    second = json.loads(mm(update, "unbundle", *data[2:], *vols.glob("*.par*.tar"), "--dest", dest,
                           "--from", base, "--json").stdout)
    assert (second["exit_code"], second["complete"], second["rebuilt"]) == (0, True, [2]), second
    assert (second["delta"]["taken"], second["verify"]["ok"]) == (0, True)
    assert payload(dest) == payload(update.conn_b)


# --- the connected side: fetch --from ----------------------------------------------------------------------------

def test_fetch_from_reads_what_the_base_has_and_downloads_only_what_changed(update, tmp_path, hub_server):
    r = ok(mm(update, "fetch", REPO, "--revision", update.b, "--local-dir", tmp_path / "B", "--from", update.conn_a,
              "--json"))
    doc = json.loads(r.stdout)
    status = {f["path"]: f["status"] for f in doc["files"]}
    assert {p for p, s in status.items() if s == "downloaded"} == set(CHANGED)
    assert status[RENAMED] == "adopted" and len(status) == len(payload(update.conn_b))
    changed = sum(len((update.conn_b / p).read_bytes()) for p in CHANGED)
    assert hub_server.total_bytes_served == changed
    assert payload(tmp_path / "B") == payload(update.conn_b)
    ok(mm(update, "verify", tmp_path / "B"))


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("delta"), "without a delta record"),
    (lambda d: d.update(schema="mm-bundle-index/1"), "with a delta record"),
    (lambda d: d["delta"].update(take={}), "take is not a list"),
    (lambda d: d["delta"]["base"].update(revision="main"), "not a full 40-hex commit"),
    (lambda d: d["delta"]["base"].update(manifest_sha256="x" * 64), "not a 64-digit hex digest"),
    (lambda d: d["delta"]["take"][0].update(base_path="../../etc/passwd"), "unsafe path"),
    (lambda d: d["delta"]["take"][0].update(path="/abs"), "unsafe path"),
    (lambda d: d["delta"]["take"][0].update(size=-1), "outside"),
    (lambda d: d["delta"]["take"].append(dict(d["delta"]["take"][0])), "takes one path twice"),
])
def test_a_hostile_delta_record_is_refused_naming_the_volume(update, edit, says):
    from mm.artifacts.bundle.index import parse_index
    from mm.artifacts.errors import BadInput

    vol = next(update.delta.glob("*.tar"))
    with tarfile.open(vol) as tf:
        doc = json.loads(tf.extractfile(next(m for m in tf.getmembers() if "index-vol" in m.name)).read())
    edit(doc)
    with pytest.raises(BadInput) as e:
        parse_index(doc, vol.name)
    assert vol.name in e.value.message and says in e.value.message, e.value.message


# --- the target rule and hostile bases ----------------------------------------------------------------------------

def test_unbundle_from_never_writes_through_a_link_planted_in_dest(update, tmp_path):
    a_dir = import_a(update, tmp_path / "A")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / ".mm").symlink_to(outside)
    r = mm(update, "unbundle", update.delta, "--dest", tmp_path / "B", "--from", a_dir)
    assert r.returncode == 3 and "symlink" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(outside.iterdir()) == []


def test_a_base_file_swapped_for_a_fifo_is_refused_without_blocking(update, tmp_path):
    base = tmp_path / "A"
    shutil.copytree(update.conn_a, base)
    shard = base / "model-00003-of-00004.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    r = run_mm("unbundle", update.delta, "--dest", tmp_path / "B", "--from", base, env=update.env, timeout=60)
    assert r.returncode == 3 and f"{shard.name} (unreadable: not a regular file)" in r.stderr, r.stderr
    assert not (tmp_path / "B" / shard.name).exists()


def test_readback_reads_back_the_copied_base_files_too(update, tmp_path):
    a_dir = import_a(update, tmp_path / "A")
    doc = json.loads(ok(mm(update, "unbundle", update.delta, "--dest", tmp_path / "B", "--from", a_dir, "--readback",
                           "--json")).stdout)
    assert doc["delta"]["mode"] in ("copy", "reflink")
    copied = doc["delta"]["taken"] if doc["delta"]["mode"] == "copy" else 0
    assert doc["verify"]["read_back"]["files"] == len(CHANGED) + copied
    assert doc["verify"]["hashed_now"]["files"] == 0 and doc["verify"]["ok"]


def test_a_fetch_that_proves_every_file_is_listed_as_verified_by_mm_fetch(update, tmp_path):
    root = tmp_path / "models"
    ok(mm(update, "fetch", REPO, "--revision", update.b, "--local-dir", root / REPO / update.b[:12], "--from",
          update.conn_a))
    doc = json.loads(ok(mm(update, "ls", root, "--json")).stdout)
    [rev] = doc["revisions"]
    assert rev["verified"]["ok"] and rev["verified"]["by"] == "mm fetch" and rev["verified"]["current"]
