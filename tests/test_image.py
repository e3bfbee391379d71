"""mm image save: the pinned image by digest, without a Docker daemon, with the chain that proves it."""
from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import pytest

from mm.artifacts.serving import image as mm_image
from tests.support.oci_image import containerd_save_archive
from tests.support.registry import Registry


@pytest.mark.parametrize("platform", ["linux/amd64", "linux/arm64"])
def test_save_writes_the_platform_image_by_digest_and_records_the_chain(pinned_image, run_mm, tmp_path, platform):
    out = tmp_path / "sglang.tar"
    proc = run_mm("image", "save", pinned_image.ref, "--platform", platform, "--out", out, "--insecure-registry")
    assert proc.returncode == 0, proc.stderr
    want = pinned_image.image.platforms[platform]
    [held] = mm_image.read_archive(out)
    assert held.config == want.config and held.platform == platform
    record = json.loads((tmp_path / "sglang.tar.mm-image.json").read_text())
    assert record["reference"] == pinned_image.ref and record["platform"] == platform
    assert (record["platform_manifest"], record["config"]) == (want.manifest, want.config)
    assert [layer["digest"] for layer in record["layers"]] == want.layers
    assert record["archive"]["sha256"] == mm_image._file_sha256(out) and record["archive"]["file"] == "sglang.tar"
    assert f"image ID  {want.config}" in proc.stdout
    with tarfile.open(out) as tf:
        tags = json.loads(tf.extractfile("manifest.json").read())[0]["RepoTags"]
    assert tags == [f"{pinned_image.repo}:mm-{pinned_image.image.index_digest[7:19]}-{platform.split('/')[1]}"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_save_as_oci_archive(pinned_image, run_mm, tmp_path):
    out = tmp_path / "sglang.oci.tar"
    proc = run_mm("image", "save", pinned_image.ref, "--platform", "linux/arm64", "--format", "oci-archive",
                  "--out", out, "--insecure-registry", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "oci-archive" and doc["chain"]["config"] == pinned_image.image.platforms["linux/arm64"].config
    assert [img.config for img in mm_image.read_archive(out)] == [pinned_image.image.platforms["linux/arm64"].config]


def test_save_refuses_a_reference_without_a_digest(pinned_image, run_mm, tmp_path):
    proc = run_mm("image", "save", f"{pinned_image.repo}:dev", "--out", tmp_path / "x.tar")
    assert proc.returncode == 3
    assert proc.stderr.strip() == f"mm: '{pinned_image.repo}:dev': give the image by digest (REPO@sha256:<64 hex>)"


def test_save_of_a_single_platform_image_for_another_platform_is_refused(pinned_image, run_mm, tmp_path):
    amd64_only = f"{pinned_image.repo}@{pinned_image.image.platforms['linux/amd64'].manifest}"
    proc = run_mm("image", "save", amd64_only, "--platform", "linux/arm64", "--out", tmp_path / "x.tar",
                  "--insecure-registry")
    assert proc.returncode == 7
    assert "a single-platform image for linux/amd64, not linux/arm64" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_save_with_the_registry_down_is_a_remote_error(run_mm, tmp_path, unused_port):
    ref = f"127.0.0.1:{unused_port}/lmsysorg/sglang@sha256:" + "ab" * 32
    proc = run_mm("image", "save", ref, "--out", tmp_path / "x.tar", "--insecure-registry")
    assert proc.returncode == 4
    assert proc.stderr.startswith(f"mm: {ref}: ") and len(proc.stderr.strip().splitlines()) == 1
    assert "level=" not in proc.stderr and "connection refused" in proc.stderr  # skopeo's message, not its log frame
    assert not list(tmp_path.iterdir())


def test_save_refuses_a_registry_serving_another_index_under_the_pinned_digest(pinned_image, run_mm, tmp_path):
    with Registry(tmp_path / "reg") as reg:
        repo = f"{reg.host}/lmsysorg/sglang"
        subprocess.run(["skopeo", "copy", "--quiet", "--all", "--preserve-digests", "--dest-tls-verify=false",
                        f"oci:{pinned_image.image.layout}:dev", f"docker://{repo}:dev"], check=True, capture_output=True)
        index = reg.blob_path(pinned_image.image.index_digest)
        index.write_bytes(index.read_bytes().replace(b'"schemaVersion": 2', b'"schemaVersion":2'))
        proc = run_mm("image", "save", f"{repo}@{pinned_image.image.index_digest}", "--out", tmp_path / "x.tar",
                      "--insecure-registry")
    assert proc.returncode == 5
    assert "the registry served a manifest whose sha256 is" in proc.stderr
    assert not (tmp_path / "x.tar").exists()


# --- proving an archive is the pinned image ----------------------------------------------------------

@pytest.fixture(scope="module")
def saved_amd64(pinned_image, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "sglang.tar"
    mm_image.save_image(pinned_image.ref, out, "linux/amd64", tls_verify=False)
    return out


def test_prove_against_the_registry(pinned_image, saved_amd64, tmp_path):
    copy = tmp_path / "img.tar"  # no record beside it: the registry answers
    shutil.copy(saved_amd64, copy)
    proof = mm_image.prove_archive(copy, pinned_image.ref, tls_verify=False)
    assert proof.proven and proof.how == "registry"
    assert proof.config == pinned_image.image.platforms["linux/amd64"].config


def test_prove_offline_from_the_record_and_refuse_offline_without_it(pinned_image, saved_amd64, tmp_path, unused_port):
    offline_ref = pinned_image.ref.replace(pinned_image.registry.host, f"127.0.0.1:{unused_port}")
    record = json.loads(mm_image.record_path(saved_amd64).read_text())
    record["reference"] = offline_ref  # the same pin, its registry out of reach
    shutil.copy(saved_amd64, tmp_path / "img.tar")
    (tmp_path / "img.tar.mm-image.json").write_text(json.dumps(record))
    proof = mm_image.prove_archive(tmp_path / "img.tar", offline_ref, tls_verify=False)
    assert proof.proven and proof.how == "record"
    (tmp_path / "img.tar.mm-image.json").unlink()
    with pytest.raises(mm_image.BadInput, match="no record img.tar.mm-image.json beside it"):
        mm_image.prove_archive(tmp_path / "img.tar", offline_ref, tls_verify=False)


def test_prove_refuses_another_image(pinned_image, other_image, tmp_path):
    archive = containerd_save_archive(other_image, pinned_image.repo, tmp_path / "other.tar")
    proof = mm_image.prove_archive(archive, pinned_image.ref, tls_verify=False)
    assert not proof.proven
    assert f"holds image {', '.join(sorted(p.config for p in other_image.platforms.values()))}" in proof.detail


def test_a_containerd_save_of_the_pinned_index_proves_too(pinned_image, tmp_path):
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "cd.tar")
    images = mm_image.read_archive(archive)
    assert {i.platform for i in images} == {"linux/amd64", "linux/arm64"}
    assert all(i.repo_digests == [pinned_image.ref] for i in images)
    assert mm_image.prove_archive(archive, pinned_image.ref, tls_verify=False).proven
