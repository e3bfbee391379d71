"""The launch script finds the image by identity after `docker load`, never pulls.

Stand-in docker with a real image store: the classic store (keeps the image ID, drops repo digests on load) and the
containerd store (keeps the repo digests an OCI archive names). Archives come from `mm image save` against the
real docker-registry holding the two-platform test image.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mm.artifacts.serving import image as mm_image
from tests.support import fake_docker
from tests.support.oci_image import containerd_save_archive
from tests.test_launch import make_model_dir, mm


@pytest.fixture(scope="module")
def saved(pinned_image, tmp_path_factory) -> Path:
    """`mm image save` of the pinned test image for linux/amd64: archive + record."""
    out = tmp_path_factory.mktemp("img") / "sglang.tar"
    mm_image.save_image(pinned_image.ref, out, "linux/amd64", tls_verify=False)
    return out


@pytest.fixture
def model(tmp_path) -> Path:
    return make_model_dir(tmp_path / "models")


def docker_with(tmp_path: Path, store: str) -> dict:
    bin_dir, state = tmp_path / "bin", tmp_path / "docker-state"
    fake_docker.install(bin_dir, state, store=store)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DOCKER_PLATFORM": "linux/amd64"}


def docker(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=60)


def script_for(model: Path, ref: str, tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "start.sh"
    r = mm("launch", model, "--hardware", "b300", "--image", ref, "--out", out, *extra)
    assert r.returncode == 0, r.stderr
    return out


def run_script(script: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def runs(tmp_path: Path) -> list[list[str]]:
    calls = (tmp_path / "docker-state" / "calls.jsonl").read_text().splitlines()
    return [c for c in map(json.loads, calls) if c[0] == "run"]


def test_classic_store_drops_the_repo_digest_and_the_script_starts_the_recorded_image_id(pinned_image, saved, model, tmp_path):
    env = docker_with(tmp_path, "classic")
    assert docker(env, "load", "-i", str(saved)).returncode == 0
    assert docker(env, "image", "inspect", pinned_image.ref).returncode == 1  # moby#22011: gone after load
    script = script_for(model, pinned_image.ref, tmp_path, "--image-archive", saved)
    image_id = pinned_image.image.platforms["linux/amd64"].config
    assert f"image_id={image_id}" in script.read_text()
    started = run_script(script, env)
    assert started.returncode == 0, started.stderr
    assert f"running image {image_id} as {image_id} (pull never)" in started.stdout
    [run] = runs(tmp_path)
    assert run[run.index("--pull") + 1] == "never" and image_id in run


def test_containerd_store_keeps_the_repo_digest_and_the_script_starts_the_pinned_reference(pinned_image, model, tmp_path):
    env = docker_with(tmp_path, "containerd")
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "cd.tar")
    assert docker(env, "load", "-i", str(archive)).returncode == 0
    script = script_for(model, pinned_image.ref, tmp_path)
    started = run_script(script, env)
    assert started.returncode == 0, started.stderr
    assert f"running image {pinned_image.image.index_digest} as {pinned_image.ref} (pull never)" in started.stdout


def test_the_script_loads_the_archive_when_the_image_is_absent_and_checks_the_loaded_id(pinned_image, saved, model, tmp_path):
    env = docker_with(tmp_path, "classic")
    script = script_for(model, pinned_image.ref, tmp_path, "--image-archive", saved)
    started = run_script(script, env)
    assert started.returncode == 0, started.stderr
    assert f"loading the image from {saved}" in started.stderr
    assert f"running image {pinned_image.image.platforms['linux/amd64'].config}" in started.stdout


@pytest.mark.parametrize("store", ["classic", "containerd"])
def test_a_wrong_image_in_the_archive_is_refused_in_both_stores(pinned_image, other_image, saved, model, tmp_path, store):
    env = docker_with(tmp_path, store)
    # the record says "pinned image", the archive holds another one (swapped on the way)
    wrong = tmp_path / "sglang.tar"
    containerd_save_archive(other_image, pinned_image.repo, wrong)
    shutil.copy(mm_image.record_path(saved), mm_image.record_path(wrong))
    script = script_for(model, pinned_image.ref, tmp_path, "--image-archive", wrong)
    started = run_script(script, env)
    assert started.returncode == 1
    assert started.stderr.strip().splitlines()[-1] == (
        f"mm: {wrong}: loaded, but this host still lacks {pinned_image.ref} (image ID "
        f"{pinned_image.image.platforms['linux/amd64'].config}); the archive holds another image")
    assert runs(tmp_path) == []


def test_without_the_image_the_script_stops_naming_the_unbundled_archive_to_load(pinned_image, saved, model, tmp_path):
    env = docker_with(tmp_path, "classic")
    payload = model.with_name(model.name + ".payload") / "image"  # where `mm unbundle` puts it by default
    payload.mkdir(parents=True)
    shutil.copy(saved, payload / saved.name)
    shutil.copy(mm_image.record_path(saved), payload / mm_image.record_path(saved).name)
    script = script_for(model, pinned_image.ref, tmp_path)
    started = run_script(script, env)
    assert started.returncode == 1
    image_id = pinned_image.image.platforms["linux/amd64"].config
    assert started.stderr.strip().splitlines() == [
        f"mm: image {pinned_image.ref} (image ID {image_id}) is not on this host: docker load -i {(payload / saved.name).resolve()}"]
    assert runs(tmp_path) == []
    # after the load the payload step names, the same script starts it
    assert docker(env, "load", "-i", str(payload / saved.name)).returncode == 0
    assert run_script(script, env).returncode == 0


def test_an_archive_whose_record_names_another_image_is_refused_at_launch(pinned_image, saved, model, tmp_path):
    other_ref = pinned_image.repo + "@sha256:" + "0" * 64
    r = mm("launch", model, "--hardware", "b300", "--image", other_ref, "--image-archive", saved)
    assert r.returncode == 7
    assert f"records {pinned_image.ref}, not the image this plan runs ({other_ref})" in r.stderr


def test_warmup_finds_the_loaded_image_by_its_recorded_id_on_the_classic_store(pinned_image, saved, model, tmp_path, unused_port):
    from tests.test_warmup import warmup

    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state, store="classic")
    missing, _ = warmup(model, state, unused_port, "--image", pinned_image.ref, "--image-archive", saved)
    assert missing.returncode == 3
    assert f"is not on this host: docker load -i {saved.resolve()}" in missing.stderr
    env = docker_with(tmp_path, "classic")
    assert docker(env, "load", "-i", str(saved)).returncode == 0
    result, _ = warmup(model, state, unused_port, "--image", pinned_image.ref, "--image-archive", saved)
    assert result.returncode == 0, result.stdout + result.stderr
    image_id = pinned_image.image.platforms["linux/amd64"].config
    started = [c for c in runs(tmp_path) if "-d" in c]
    assert len(started) == 1 and image_id in started[0] and started[0][started[0].index("--pull") + 1] == "never"


def test_a_bundled_archive_of_another_image_is_named_in_the_script(pinned_image, saved, model, tmp_path):
    """Carried with `mm bundle --allow-other-image`: the start script says so."""
    payload = model.with_name(model.name + ".payload") / "image"
    payload.mkdir(parents=True)
    shutil.copy(saved, payload / saved.name)
    shutil.copy(mm_image.record_path(saved), payload / mm_image.record_path(saved).name)
    other_ref = pinned_image.repo + "@sha256:" + "0" * 64
    script = script_for(model, other_ref, tmp_path).read_text()
    assert f"# Warning: {payload / saved.name} is {pinned_image.ref}, not the image this plan runs ({other_ref})" in script
    assert "image_id=''" in script
