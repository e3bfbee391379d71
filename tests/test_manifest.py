"""The manifest format: validated paths, atomic writes, clear errors for damaged documents."""
from __future__ import annotations

import json

import pytest

from mm.artifacts.errors import BadInput
from mm.artifacts.integrity.manifest import (FileEntry, Manifest, Upstream, export_sums, read_manifest, to_json,
                                             write_manifest)

COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
H64 = "ab" * 32


def manifest_with(*paths: str) -> Manifest:
    return Manifest(repo_id="o/r", revision=COMMIT, files=tuple(FileEntry(p, 1, H64, H64) for p in paths))


def test_round_trip_keeps_every_field(tmp_path):
    m = Manifest(repo_id="o/r", revision=COMMIT, requested_revision="ce7f4df", endpoint="http://127.0.0.1:1",
                 files=(FileEntry("a/b.safetensors", 3, H64, H64, Upstream("lfs-sha256", H64), "hub"),))
    write_manifest(m, tmp_path / "manifest.json")
    assert read_manifest(tmp_path / "manifest.json") == m


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up", "a/../b", "a\\b", "./a", "a//b", "a\nb"])
def test_unsafe_paths_are_refused(tmp_path, bad):
    with pytest.raises(BadInput, match="path"):
        write_manifest(manifest_with(bad), tmp_path / "manifest.json")
    assert not (tmp_path / "manifest.json").exists()


def test_duplicate_paths_are_refused(tmp_path):
    with pytest.raises(BadInput, match="duplicate path 'a'"):
        write_manifest(manifest_with("a", "a"), tmp_path / "manifest.json")


def test_short_revision_is_refused(tmp_path):
    with pytest.raises(BadInput, match="not a full 40-hex commit"):
        write_manifest(Manifest(repo_id="o/r", revision="ce7f4df", files=()), tmp_path / "manifest.json")


def test_truncated_manifest_names_the_file(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(to_json(manifest_with("a"))[:40])
    with pytest.raises(BadInput, match=f"{path}: manifest is not valid JSON"):
        read_manifest(path)


def test_foreign_json_is_not_a_manifest(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"files": []}))
    with pytest.raises(BadInput, match="not an mm manifest"):
        read_manifest(path)


def test_rewrite_leaves_no_temporary_files(tmp_path):
    write_manifest(manifest_with("a"), tmp_path / "manifest.json")
    write_manifest(manifest_with("a", "b"), tmp_path / "manifest.json")
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_sums_export_is_in_coreutils_format():
    text = export_sums(manifest_with("a", "d/b"), "sha256")
    assert text == f"{H64}  a\n{H64}  d/b\n"


def test_endpoint_credentials_are_never_recorded():
    from mm.artifacts.integrity.manifest import public_endpoint

    assert public_endpoint("https://user:hf_secret@hub.local:8443/x") == "https://hub.local:8443/x"


def test_adopting_a_directory_offline_never_loads_the_hub_client(tmp_path):
    """Tests of verify and bundle build manifests this way; so does `mm manifest DIR --offline`."""
    import subprocess
    import sys

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}\n")
    code = ("import sys; from mm.artifacts.fetching.adopt import manifest_for_local_dir; "
            f"manifest_for_local_dir({str(tmp_path / 'm')!r}, 'o/r', {COMMIT!r}, offline=True); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('huggingface_hub', 'httpx', 'httpx2')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert read_manifest(tmp_path / "m" / ".mm" / "manifest.json").revision == COMMIT


def tiny_files(root, count: int) -> None:
    for i in range(count):
        d = root / f"d{i // 1000:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:06d}.json").write_text(f'{{"i": {i}}}\n')


def test_mm_manifest_memory_grows_by_a_bounded_amount_per_file(tmp_path):
    """docs/memory.md's per-file budget for local work, checked on its slope: peak RSS at 10,000 files less that at
    2,000, per file added (the figures at 120,000 and a million come from `python -m tests.bench.run manyfiles`)."""
    import os

    from tests.support.memory import peak_rss
    from tests.support.run import mm_argv

    peaks = {}
    for count in (2000, 10000):
        root = tmp_path / str(count)
        tiny_files(root, count)
        code, peaks[count] = peak_rss(mm_argv("manifest", root, "--repo", "a/b", "--revision", "c" * 40, "--json"),
                                      os.environ, timeout=300)
        assert code == 0
    per_file = (peaks[10000] - peaks[2000]) / 8000
    assert per_file < 2500, f"{per_file:.0f} bytes a file ({peaks})"
