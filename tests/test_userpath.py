"""The user's path (issue 21): work already on disk is used, verify says what a user means, the conventions a
newcomer brings. Every test runs the real `mm` (and the real `hf` CLI where a user would) against the local Hub."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.manifest import manifest_path, read_manifest
from tests.support.run import run_mm

ROOT = Path(__file__).resolve().parents[1]
HF = Path(sys.executable).parent / "hf"
SHARD = "model-00002-of-00004.safetensors"


def hf_download(env: dict, repo_id: str, revision: str, *args: str) -> subprocess.CompletedProcess:
    """The real `hf download` (huggingface_hub's CLI) against the local Hub."""
    r = subprocess.run([str(HF), "download", repo_id, "--revision", revision, *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def hf_local_dir(_hub_server_session, model_repo, tmp_path_factory) -> tuple[Path, dict]:
    """`hf download --local-dir` of the repo's head, once per module; tests copy it."""
    root = tmp_path_factory.mktemp("hf-local")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(root / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               NO_PROXY="127.0.0.1")
    hf_download(env, model_repo.repo_id, model_repo.head, "--local-dir", str(root / "model"))
    return root / "model", env


@pytest.fixture
def filled(hf_local_dir, tmp_path) -> Path:
    dest = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(hf_local_dir[0], dest)
    return dest


@pytest.fixture(scope="module")
def fetched(_hub_server_session, model_repo, hf_local_dir, tmp_path_factory) -> Path:
    """A directory `mm fetch` completed (adopting the hf download: no second download), once per module."""
    dest = tmp_path_factory.mktemp("fetched") / "MiniMax-M3.1-Flash"
    shutil.copytree(hf_local_dir[0], dest)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hf_local_dir[1])
    assert r.returncode == 0, r.stderr
    return dest


@pytest.fixture
def model(fetched, tmp_path) -> Path:
    dest = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(fetched, dest)
    return dest


# --- work already on disk is used, never redone ----------------------------------------------------------

def test_fetch_adopts_what_an_hf_download_already_wrote_without_downloading_it(run_mm, hub_env, hub_server,
                                                                               model_repo, filled):
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    n = len(model_repo.files)
    assert doc["counts"] == {"downloaded": 0, "adopted": n, "present": 0, "failed": 0}
    assert doc["bytes_transferred"] == 0
    m = read_manifest(manifest_path(filled))
    assert all(e.proven and e.source == "local" for e in m.files) and len(m.files) == n
    text = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, env=hub_env)
    assert f"0 adopted" in text.stdout and f"{n} already present" in text.stdout, text.stdout


def test_fetch_summary_line_counts_adopted_files(run_mm, hub_env, model_repo, filled):
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, env=hub_env)
    assert r.returncode == 0, r.stderr
    assert f"0 downloaded, {len(model_repo.files)} adopted (" in r.stdout and "already on disk, hashed here" in r.stdout


def test_fetch_downloads_over_a_file_on_disk_whose_bytes_differ_and_says_so(run_mm, hub_env, model_repo, filled):
    flip_byte(filled / SHARD)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"]["downloaded"] == 1 and doc["counts"]["adopted"] == len(model_repo.files) - 1
    shard = next(f for f in doc["files"] if f["path"] == SHARD)
    assert shard["status"] == "downloaded" and "not the pinned one" in shard["note"]
    assert (filled / SHARD).read_bytes() == model_repo.read(SHARD)


def test_fetch_never_adopts_through_a_planted_symlink(run_mm, hub_env, model_repo, filled, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(filled / SHARD, outside)
    (filled / SHARD).symlink_to(outside)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    doc = json.loads(r.stdout)
    assert next(f for f in doc["files"] if f["path"] == SHARD)["status"] != "adopted", r.stdout


def test_repair_hashes_only_the_files_it_restored(run_mm, hub_env, model):
    flip_byte(model / SHARD)
    r = run_mm("repair", model, "--json", env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["restored"] == [SHARD]
    assert doc["after"]["bytes_checked"] == (model / SHARD).stat().st_size  # not the whole model a second time
    assert doc["after"]["ok"] is True


def test_repair_of_a_healthy_directory_verifies_once(run_mm, hub_env, model):
    r = run_mm("repair", model, env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "re-verify" not in r.stdout and r.stdout.count("hashed at") == 1, r.stdout
    assert "nothing to re-fetch" in r.stdout


# --- verify says what a user means ----------------------------------------------------------------------

def test_a_users_own_file_is_reported_and_passes(run_mm, model):
    (model / "notes.txt").write_text("my notes\n")
    r = run_mm("verify", model)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EXTRA      notes.txt: not in the manifest" in r.stdout
    assert "OK; 1 extra file(s) reported, not failed (--strict fails on them)" in r.stdout


def test_strict_makes_an_extra_file_fail(run_mm, model):
    (model / "notes.txt").write_text("my notes\n")
    r = run_mm("verify", model, "--strict", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["ok"] is False


def test_a_partial_fetch_is_recorded_and_verify_judges_what_was_asked(run_mm, hub_env, model_repo, tmp_path):
    dest = tmp_path / "configs"
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest,
               "--include", "*.json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(manifest_path(dest).read_text())
    assert doc["schema"] == "mm-manifest/1" and doc["partial"]["include"] == ["*.json"]
    left_out = {p for p in model_repo.files if not p.endswith(".json")}
    assert set(doc["partial"]["left_out"]) == left_out
    v = run_mm("verify", dest)
    assert v.returncode == 0, v.stdout + v.stderr
    assert f"partial fetch (--include '*.json'): {len(left_out)} file(s) of the revision left out" in v.stdout
    assert "INDEX" not in v.stdout and "DRAFT" not in v.stdout


def test_a_whole_fetch_writes_no_partial_key(model):
    assert "partial" not in json.loads(manifest_path(model).read_text())


def test_a_partial_fetch_still_fails_on_damage_to_what_was_asked(run_mm, hub_env, model_repo, tmp_path):
    dest = tmp_path / "configs"
    run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, "--include", "*.json",
           env=hub_env)
    (dest / "config.json").unlink()
    v = run_mm("verify", dest)
    assert v.returncode == 1 and "MISSING    config.json" in v.stdout, v.stdout


def test_verify_that_finds_damage_names_mm_repair(run_mm, model):
    flip_byte(model / SHARD)
    r = run_mm("verify", model)
    assert r.returncode == 1
    assert f"next: mm repair {model}" in r.stdout, r.stdout
    assert json.loads(run_mm("verify", model, "--json").stdout)["next"].startswith(f"next: mm repair {model}")


def test_quick_verify_summary_and_readme_say_the_same(run_mm, model):
    r = run_mm("verify", model, "--quick")
    assert r.returncode == 0
    said = "presence, sizes, readability and shard headers"
    assert said in r.stdout and f"--quick` checks {said}" in (ROOT / "README.md").read_text()


# --- the Hugging Face cache layout (`hf download` without --local-dir) ----------------------------------

def tree(root: Path) -> dict[str, str]:
    """Every path under ROOT (links as their target, files by size): to prove nothing was written there."""
    return {p.relative_to(root).as_posix(): (os.readlink(p) if p.is_symlink() else str(p.stat().st_size))
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def hf_cache(_hub_server_session, model_repo, tmp_path_factory) -> Path:
    """HF_HOME after a real `hf download` of the head commit into the cache, once per module."""
    home = tmp_path_factory.mktemp("hf-cache") / "hf-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")
    hf_download(env, model_repo.repo_id, model_repo.head)
    return home


@pytest.fixture
def snapshot(hf_cache, model_repo, tmp_path, hub_env) -> tuple[Path, dict]:
    """(this test's copy of the cache's snapshot, an environment whose XDG_STATE_HOME is this test's)."""
    home = tmp_path / "hf-home"
    shutil.copytree(hf_cache, home, symlinks=True)
    snap = home / "hub" / f"models--{model_repo.repo_id.replace('/', '--')}" / "snapshots" / model_repo.head
    assert (snap / SHARD).is_symlink()
    return snap, dict(hub_env, XDG_STATE_HOME=str(tmp_path / "state"))


def test_manifest_of_a_cache_snapshot_is_kept_outside_the_cache(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    cache = snap.parents[2]
    before = tree(cache)
    r = run_mm("manifest", snap, "--json", env=env)  # repo and revision come from the layout
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["checked_upstream"] is True and doc["revision"] == model_repo.head
    assert Path(doc["manifest_path"]).is_relative_to(tmp_path / "state" / "mm" / "hf-cache")
    assert tree(cache) == before  # nothing of mm's inside hf's cache
    v = run_mm("verify", snap, env=env)
    assert v.returncode == 0 and v.stdout.count("\n") == 1, v.stdout + v.stderr


def test_verify_of_a_cache_snapshot_finds_a_damaged_blob(run_mm, snapshot):
    snap, env = snapshot
    assert run_mm("manifest", snap, env=env).returncode == 0
    flip_byte(Path(os.path.realpath(snap / SHARD)))
    v = run_mm("verify", snap, env=env)
    assert v.returncode == 1 and f"HASH       {SHARD}" in v.stdout, v.stdout


def test_a_link_in_a_snapshot_that_leaves_its_blobs_is_refused(run_mm, snapshot, tmp_path):
    snap, env = snapshot
    assert run_mm("manifest", snap, env=env).returncode == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (snap / "extra.json").symlink_to(outside)
    v = run_mm("verify", snap, env=env)  # the allowance is hf's links into its own blobs/, nothing else
    assert v.returncode == 1 and "SYMLINK    extra.json: points outside the model directory" in v.stdout, v.stdout
    m = run_mm("manifest", snap, "--offline", env=env)
    assert m.returncode == 3 and "does not lead to a file of" in m.stderr, m.stderr


def test_a_cache_snapshot_bundles_unbundles_and_launches(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    assert run_mm("manifest", snap, env=env).returncode == 0
    b = run_mm("bundle", snap, "--out", tmp_path / "disk", "--volume-size", "100M", "--no-mm", env=env)
    assert b.returncode == 0, b.stderr
    u = run_mm("unbundle", tmp_path / "disk", "--dest", tmp_path / "restored", env=env)
    assert u.returncode == 0, u.stdout + u.stderr
    assert all((tmp_path / "restored" / p).read_bytes() == model_repo.read(p) for p in model_repo.files)
    launch = run_mm("launch", snap, "--hardware", "b300", "--format", "json", env=env)
    assert launch.returncode == 0, launch.stderr
    plan = json.loads(launch.stdout)
    mounts = dict(m.rsplit(":", 2)[:2] for m in plan["mounts"] if m.endswith(":ro"))
    blobs = {container: host for host, container in mounts.items()}["/blobs"]
    model_at = plan["container_model_path"]
    for link in (p for p in snap.rglob("*") if p.is_symlink()):  # every hf link resolves inside the container
        in_container = Path(model_at) / link.relative_to(snap)
        target = os.path.normpath(in_container.parent / os.readlink(link))
        assert target.startswith("/blobs/") and (Path(blobs) / target.removeprefix("/blobs/")).is_file(), target
    assert all(not m.startswith(str(snap.parents[1])) for m in plan["mounts"] if not m.endswith(":ro"))


def test_a_cache_snapshot_pushes_to_a_registry(run_mm, snapshot, registry):
    snap, env = snapshot
    assert run_mm("manifest", snap, env=env).returncode == 0
    before = tree(snap.parents[2])
    r = run_mm("push", snap, f"{registry.host}/userpath/snapshot:v1", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert tree(snap.parents[2]) == before


def test_writers_refuse_a_cache_snapshot_before_writing(run_mm, snapshot, model_repo):
    snap, env = snapshot
    before = tree(snap.parents[2])
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", snap, env=env)
    assert r.returncode == 7 and "a Hugging Face cache snapshot" in r.stderr, r.stderr
    assert tree(snap.parents[2]) == before
