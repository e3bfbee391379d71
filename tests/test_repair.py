"""mm repair (and mm verify --upstream): a model fetched from the local Hub server, damaged, repaired."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mm.artifacts.errors import BadInput
from mm.artifacts.integrity.manifest import Manifest, read_manifest
from mm.artifacts.paths import manifest_path
from mm.artifacts.fetching.refetch import repair_dir
from mm.artifacts.integrity.verify import verify_dir
from tests.support.run import run_mm

SHARD2 = "model-00002-of-00004.safetensors"
SHARD3 = "model-00003-of-00004.safetensors"
DRAFT_SHARD = "dspark/model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def pristine(_hub_server_session, model_repo, tmp_path_factory) -> Path:
    """One real `mm fetch` from the local Hub per module; each test damages its own copy."""
    dest = tmp_path_factory.mktemp("pristine") / "MiniMax-M3.1-Flash"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(dest.parent / "hf-home"), NO_PROXY="127.0.0.1")
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=env)
    assert r.returncode == 0, r.stderr
    return dest


@pytest.fixture
def fetched(pristine, tmp_path) -> Path:
    dest = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(pristine, dest, symlinks=True)
    return dest


def identity(root: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every payload file."""
    return {p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_repair_restores_exactly_the_damaged_files_and_touches_no_good_one(run_mm, hub_env, hub_server, model_repo, fetched):
    flip_middle_byte(fetched / SHARD2)
    (fetched / SHARD3).unlink()
    os.truncate(fetched / "config.json", 10)
    os.truncate(fetched / DRAFT_SHARD, 0)
    damaged = {SHARD2, SHARD3, "config.json", DRAFT_SHARD}
    before = identity(fetched)
    hub_server.reset()

    r = run_mm("repair", fetched, env=hub_env)

    assert r.returncode == 0, r.stdout + r.stderr
    restored = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("RESTORED")}
    assert restored == damaged
    assert "OK" in r.stdout
    for path in damaged:
        assert (fetched / path).read_bytes() == model_repo.read(path), path
    after = identity(fetched)
    assert {p: after[p] for p in before if p not in damaged} == {p: v for p, v in before.items() if p not in damaged}
    downloaded = {req[1].split("/", 5)[-1] for req in hub_server.resolve_requests()}
    assert downloaded == damaged
    assert run_mm("verify", fetched).returncode == 0


def test_repair_of_an_intact_model_downloads_nothing(run_mm, hub_env, hub_server, fetched):
    before = identity(fetched)
    hub_server.reset()
    r = run_mm("repair", fetched, env=hub_env)
    assert r.returncode == 0, r.stderr
    assert "nothing to re-fetch" in r.stdout
    assert hub_server.resolve_requests() == [] and identity(fetched) == before


def test_repair_leaves_extra_files_and_names_them(run_mm, hub_env, fetched):
    (fetched / SHARD2).rename(fetched / "model-2.safetensors")
    r = run_mm("repair", fetched, env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr  # an extra file is reported, not failed (verify --strict fails)
    assert any(ln.startswith(f"RESTORED   {SHARD2}") for ln in r.stdout.splitlines())
    assert any(ln.startswith("EXTRA      model-2.safetensors:") for ln in r.stdout.splitlines())
    assert (fetched / "model-2.safetensors").exists()


def test_repair_with_the_hub_down_fails_with_exit_4_and_keeps_the_damage_in_view(run_mm, hub_env, hub_server, fetched):
    flip_middle_byte(fetched / SHARD2)
    damaged_bytes = (fetched / SHARD2).read_bytes()
    hub_server.down = True
    r = run_mm("repair", fetched, env=hub_env)
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stderr.startswith("mm: ") and len(r.stderr.strip().splitlines()) == 1
    assert (fetched / SHARD2).read_bytes() == damaged_bytes
    hub_server.down = False
    v = run_mm("verify", fetched)
    assert v.returncode == 1 and f"HASH       {SHARD2}:" in v.stdout


def test_repair_without_a_manifest_cannot_run_exit_3(run_mm, hub_env, fetched):
    manifest_path(fetched).unlink()
    r = run_mm("repair", fetched, env=hub_env)
    assert r.returncode == 3 and "no manifest here" in r.stderr


def test_repair_json_reports_before_and_after(run_mm, hub_env, fetched):
    (fetched / SHARD3).unlink()
    r = run_mm("repair", fetched, "--json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["restored"] == [SHARD3]
    assert doc["before"]["counts"] == {"missing": 1, "index": 1} and doc["after"]["problems"] == []


class CopySource:
    """A second repair source (the seam a bundle will use): copies files from a pristine directory."""

    label = "copy"

    def __init__(self, pristine: Path):
        self.pristine = pristine
        self.asked: frozenset[str] = frozenset()

    def restore(self, model_dir: Path, manifest: Manifest, paths: frozenset[str], progress) -> None:
        self.asked = paths
        for rel in paths:
            tmp = model_dir / (rel + ".tmp")
            shutil.copyfile(self.pristine / rel, tmp)
            os.replace(tmp, model_dir / rel)


def test_repair_takes_another_source_through_the_seam(fetched, tmp_path):
    pristine = tmp_path / "pristine"
    shutil.copytree(fetched, pristine)
    (fetched / SHARD3).unlink()
    source = CopySource(pristine)
    report = repair_dir(fetched, source=source)
    assert report.ok and report.source == "copy" and source.asked == {SHARD3}
    assert [p.kind for p in report.before.problems] == ["missing", "index"]


def test_repair_library_refuses_a_directory_without_manifest(tmp_path):
    with pytest.raises(BadInput, match="no manifest here"):
        repair_dir(tmp_path)


# --- verify --upstream ---------------------------------------------------------------------------

def test_upstream_verify_of_a_fetched_model_is_ok(run_mm, hub_env, fetched):
    manifest_path(fetched).unlink()  # the Hub's identities alone
    m_repo = "MiniMaxAI/MiniMax-M3.1-Flash"
    r = run_mm("verify", "--upstream", fetched, "--repo", m_repo, "--revision", "main", env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"hub:{m_repo}@" in r.stdout and "OK" in r.stdout


def test_upstream_verify_finds_a_flipped_byte_by_the_lfs_sha256(run_mm, hub_env, fetched):
    flip_middle_byte(fetched / SHARD2)
    (fetched / "README.md").write_text("changed\n")
    r = run_mm("verify", "--upstream", fetched, env=hub_env)  # repo and commit from the manifest
    assert r.returncode == 1
    assert any(ln.startswith(f"HASH       {SHARD2}: sha256 (Hub LFS) expected") for ln in r.stdout.splitlines())
    assert any(ln.startswith("SIZE       README.md:") or ln.startswith("HASH       README.md: git blob sha1")
               for ln in r.stdout.splitlines())


def test_upstream_verify_with_the_hub_down_is_a_remote_error_exit_4(run_mm, hub_env, hub_server, fetched):
    hub_server.down = True
    r = run_mm("verify", "--upstream", fetched, env=hub_env)
    assert r.returncode == 4 and r.stderr.startswith("mm: ")


def test_upstream_and_manifest_agree_on_a_good_model(fetched, hub_env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub_env["HF_ENDPOINT"])
    assert verify_dir(fetched).ok
    m = read_manifest(manifest_path(fetched))
    assert m.by_path()[SHARD2].upstream.kind == "lfs-sha256"


def test_repair_refuses_corrupt_download_with_exit_5_and_the_file_stays_missing(run_mm, hub_env, hub_server, model_repo, fetched):
    (fetched / SHARD3).unlink()
    good = model_repo.read(SHARD3)
    hub_server.corrupt[SHARD3] = bytes(b ^ 0x55 for b in good)  # same length, wrong bytes
    r = run_mm("repair", fetched, env=hub_env)
    assert r.returncode == 5, r.stdout + r.stderr
    assert SHARD3 in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (fetched / SHARD3).exists()
    v = run_mm("verify", fetched)
    assert v.returncode == 1 and f"MISSING    {SHARD3}:" in v.stdout, v.stdout
