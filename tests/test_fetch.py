"""mm fetch: pinned, verified, resumable downloads from a local Hub server, through the real client."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.support.run import mm_argv

SHARD = "model-00002-of-00004.safetensors"


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def fetch(run_mm, hub_env, model_repo, dest: Path, *extra: str, revision: str | None = None):
    rev = revision or model_repo.commits[-1]
    return run_mm("fetch", model_repo.repo_id, "--revision", rev, "--local-dir", str(dest), *extra, env=hub_env)


def test_full_sha_fetch_gives_identical_files_and_a_manifest(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert files_under(tmp_path / "m") == files_under(model_repo.source_dirs[-1])
    m = read_manifest(manifest_path(tmp_path / "m"))
    assert m.revision == model_repo.commits[-1]
    assert {f.path for f in m.files} == set(files_under(model_repo.source_dirs[-1]))
    shard = m.by_path()[SHARD]
    assert shard.upstream.kind == "lfs-sha256" and shard.upstream.value == shard.sha256
    assert m.by_path()["config.json"].upstream.kind == "git-blob-sha1"


def test_short_sha_resolves_to_the_full_commit(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", "--json", revision=model_repo.commits[0][:7])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["commit"] == model_repo.commits[0]
    assert read_manifest(manifest_path(tmp_path / "m")).revision == model_repo.commits[0]


def test_branch_is_pinned_to_its_commit_and_says_so(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", revision="main")
    assert r.returncode == 0, r.stderr
    assert f"main (a moving branch) -> {model_repo.branches['main']}" in r.stdout
    m = read_manifest(manifest_path(tmp_path / "m"))
    assert (m.revision, m.requested_revision) == (model_repo.branches["main"], "main")


def test_tag_resolves_to_its_commit(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", revision="v1.0")
    assert r.returncode == 0, r.stderr
    assert read_manifest(manifest_path(tmp_path / "m")).revision == model_repo.tags["v1.0"]


def test_unknown_revision_is_a_one_line_error_with_exit_4(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", revision="no-such-branch")
    assert r.returncode == 4
    assert r.stderr.strip().count("\n") == 0 and "no-such-branch" in r.stderr and "Traceback" not in r.stderr
    assert not manifest_path(tmp_path / "m").exists()


def test_ambiguous_short_sha_is_refused(run_mm, hub_env, ambiguous_repo, tmp_path):
    repo_id, prefix = ambiguous_repo
    r = run_mm("fetch", repo_id, "--revision", prefix, "--local-dir", str(tmp_path / "m"), env=hub_env)
    assert r.returncode == 4
    assert "ambiguous" in r.stderr and prefix in r.stderr


def test_include_and_exclude_select_files(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", "--include", "*.json", "--include", "dspark/*",
              "--exclude", "dspark/config.json")
    assert r.returncode == 0, r.stderr
    got = set(files_under(tmp_path / "m"))
    assert "config.json" in got and "dspark/model-00001-of-00001.safetensors" in got
    assert "dspark/config.json" not in got and SHARD not in got


def test_wrong_bytes_fail_that_file_only_and_nothing_claims_it(run_mm, hub_env, model_repo, hub_server, tmp_path):
    size = (model_repo.source_dirs[-1] / SHARD).stat().st_size
    hub_server.corrupt[SHARD] = b"\x00" * size
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m")
    assert r.returncode == 5
    assert SHARD in r.stderr and "do not match" in r.stderr
    assert not (tmp_path / "m" / SHARD).exists()
    assert not list((tmp_path / "m" / ".mm" / "partial").iterdir())
    m = read_manifest(manifest_path(tmp_path / "m"))
    # the manifest still expects it (the revision lists it) but nothing claims its bytes were proven
    assert not m.by_path()[SHARD].proven and m.by_path()["config.json"].proven


def test_connection_cut_mid_file_continues_from_the_cut(run_mm, hub_env, model_repo, hub_server, tmp_path):
    size = (model_repo.source_dirs[-1] / SHARD).stat().st_size
    hub_server.cut_after[SHARD] = size // 2
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / SHARD).read_bytes() == (model_repo.source_dirs[-1] / SHARD).read_bytes()
    assert hub_server.bytes_served[SHARD] <= size + 64 * 1024  # the second request asked only for the rest


def test_kill_9_then_rerun_resumes_with_range(run_mm, hub_env, big_repo, hub_server, tmp_path):
    repo_id, commit, big_file, size = big_repo
    dest = tmp_path / "m"
    hub_server.rate_limit = 2 * 1024 * 1024  # bytes/s, so the kill lands mid-file
    proc = subprocess.Popen(mm_argv("fetch", repo_id, "--revision", commit, "--local-dir", dest, "--connections", "1"),
                            env=hub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_partial(dest, minimum=size // 4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    [state] = (dest / ".mm" / "partial").glob("*.ranges")
    [[start, done]] = json.loads(state.read_text())["done"]  # one connection: one run of bytes from 0
    assert start == 0 and size // 4 <= done < size
    hub_server.reset()
    r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(dest), "--connections", "1", env=hub_env)
    assert r.returncode == 0, r.stderr
    gets = [rng for method, _, rng in hub_server.resolve_requests(big_file) if method == "GET"]
    assert gets == [f"bytes={done}-"]  # one request, for exactly what was missing
    assert read_manifest(manifest_path(dest)).by_path()[big_file].size == size
    assert not list((dest / ".mm" / "partial").iterdir())


def _wait_for_partial(dest: Path, minimum: int, timeout: float = 60) -> int:
    """Wait until the range maps of DEST's partial files record at least MINIMUM bytes; return how many."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = 0
        for state in (dest / ".mm" / "partial").glob("*.ranges") if (dest / ".mm" / "partial").exists() else ():
            try:
                got += sum(e - s for s, e in json.loads(state.read_text())["done"])
            except (OSError, ValueError):
                pass  # replaced while read
        if got >= minimum:
            return got
        time.sleep(0.05)
    raise AssertionError("the fetch never wrote a partial file")


def test_second_fetch_downloads_nothing(run_mm, hub_env, model_repo, hub_server, tmp_path):
    assert fetch(run_mm, hub_env, model_repo, tmp_path / "m").returncode == 0
    hub_server.reset()
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", "--json")
    assert r.returncode == 0, r.stderr
    assert hub_server.total_bytes_served == 0
    assert {f["status"] for f in json.loads(r.stdout)["files"]} == {"present"}


def test_concurrent_fetch_into_the_same_directory_is_refused(run_mm, hub_env, big_repo, hub_server, tmp_path):
    repo_id, commit, _, size = big_repo
    dest = tmp_path / "m"
    hub_server.rate_limit = 256 * 1024  # bytes/s: the first fetch still runs (32 s) when the second has started on a busy box
    first = subprocess.Popen(mm_argv("fetch", repo_id, "--revision", commit, "--local-dir", dest, "--connections", "1"),
                             env=hub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_partial(dest, minimum=1)
        r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(dest), env=hub_env)
        assert r.returncode == 6
        holder = f"`mm fetch {repo_id} --revision {commit} --local-dir {dest} --connections 1` (pid {first.pid})"
        assert f"{holder} is writing it" in r.stderr, r.stderr
    finally:
        first.kill()
        first.wait()


def test_server_down_is_a_clear_error_with_exit_4(run_mm, hub_env, model_repo, tmp_path, unused_port):
    env = dict(hub_env, HF_ENDPOINT=f"http://127.0.0.1:{unused_port}")
    r = fetch(run_mm, env, model_repo, tmp_path / "m")
    assert r.returncode == 4
    assert "cannot reach the Hub" in r.stderr and "Traceback" not in r.stderr


def test_token_is_sent_but_never_written_anywhere(run_mm, hub_env, private_repo, tmp_path):
    repo_id, commit, token = private_repo
    dest = tmp_path / "m"
    r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(dest), "--json", env=dict(hub_env, HF_TOKEN=token))
    assert r.returncode == 0, r.stderr
    assert token not in r.stdout + r.stderr
    for p in dest.rglob("*"):
        if p.is_file():
            assert token.encode() not in p.read_bytes(), p


def test_private_repo_without_token_is_refused(run_mm, hub_env, private_repo, tmp_path):
    repo_id, commit, _ = private_repo
    r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(tmp_path / "m"), env=hub_env)
    assert r.returncode == 4 and "token" in r.stderr


def test_output_says_whether_the_dspark_draft_is_present(run_mm, hub_env, model_repo, tmp_path):
    with_draft = fetch(run_mm, hub_env, model_repo, tmp_path / "a")
    without = fetch(run_mm, hub_env, model_repo, tmp_path / "b", "--exclude", "dspark/*")
    assert "DSpark draft (dspark/): present" in with_draft.stdout
    assert "DSpark draft (dspark/): MISSING" in without.stdout


def test_a_model_without_a_pinned_draft_prints_no_draft_line(run_mm, hub_env, big_repo, tmp_path):
    repo_id, commit, _, _ = big_repo  # no pin names this repo, so no draft is expected
    text = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(tmp_path / "a"), env=hub_env)
    assert text.returncode == 0, text.stderr
    assert "draft" not in text.stdout.lower()
    doc = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(tmp_path / "a"), "--json", env=hub_env)
    assert json.loads(doc.stdout)["draft"] is None


def test_stale_partial_files_are_cleaned(run_mm, hub_env, model_repo, tmp_path):
    stale = tmp_path / "m" / ".mm" / "partial" / ("0" * 64 + ".part")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by an older revision")
    assert fetch(run_mm, hub_env, model_repo, tmp_path / "m").returncode == 0
    assert not stale.exists()


def test_json_output_is_one_document(run_mm, hub_env, model_repo, tmp_path):
    r = fetch(run_mm, hub_env, model_repo, tmp_path / "m", "--json")
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["draft"] == {"subfolder": "dspark/", "present": True}
    assert doc["commit"] == model_repo.commits[-1]


def test_exported_sums_pass_sha256sum_and_b3sum(run_mm, hub_env, model_repo, tmp_path):
    dest = tmp_path / "m"
    assert fetch(run_mm, hub_env, model_repo, dest).returncode == 0
    assert run_mm("manifest", "export", str(dest), env=hub_env).returncode == 0
    for tool in (["sha256sum", "-c", ".mm/SHA256SUMS"], ["b3sum", "--check", ".mm/B3SUMS"]):
        ok = subprocess.run(tool, cwd=dest, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    with open(dest / SHARD, "r+b") as f:
        f.write(b"X")
    for tool in (["sha256sum", "--quiet", "-c", ".mm/SHA256SUMS"], ["b3sum", "--quiet", "--check", ".mm/B3SUMS"]):
        bad = subprocess.run(tool, cwd=dest, capture_output=True, text=True)
        assert bad.returncode != 0 and SHARD in bad.stdout


def test_manifest_for_an_hf_download_directory_matches_fetch(run_mm, hub_env, model_repo, tmp_path):
    commit = model_repo.commits[-1]
    hf = subprocess.run([str(Path(sys.executable).parent / "hf"), "download", model_repo.repo_id, "--revision", commit,
                         "--local-dir", str(tmp_path / "hf")], env=hub_env, capture_output=True, text=True)
    assert hf.returncode == 0, hf.stderr
    r = run_mm("manifest", str(tmp_path / "hf"), "--repo", model_repo.repo_id, "--revision", commit[:8], env=hub_env)
    assert r.returncode == 0, r.stderr
    assert "checked against the Hub" in r.stdout
    assert fetch(run_mm, hub_env, model_repo, tmp_path / "mm").returncode == 0
    ours = read_manifest(manifest_path(tmp_path / "mm"))
    theirs = read_manifest(manifest_path(tmp_path / "hf"))
    assert theirs.revision == ours.revision
    assert [(f.path, f.sha256, f.blake3, f.upstream) for f in theirs.files] == \
           [(f.path, f.sha256, f.blake3, f.upstream) for f in ours.files]


def test_manifest_refuses_a_directory_that_differs_from_the_hub(run_mm, hub_env, model_repo, tmp_path):
    dest = tmp_path / "m"
    assert fetch(run_mm, hub_env, model_repo, dest).returncode == 0
    manifest_path(dest).unlink()
    (dest / "config.json").write_text("{}\n")
    r = run_mm("manifest", str(dest), "--repo", model_repo.repo_id, "--revision", model_repo.commits[-1], env=hub_env)
    assert r.returncode == 5
    assert "config.json" in r.stderr and "differ from the Hub" in r.stderr
    assert not manifest_path(dest).exists()


def test_offline_manifest_needs_a_full_commit(run_mm, hub_env, model_repo, tmp_path):
    r = run_mm("manifest", str(model_repo.source_dirs[-1]), "--repo", model_repo.repo_id, "--revision", "main",
               "--offline", env=hub_env)
    assert r.returncode == 2 and "full 40-hex commit" in r.stderr


def test_not_enough_disk_is_refused_before_downloading(run_mm, hub_env, model_repo, hub_server, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        r = fetch(run_mm, hub_env, model_repo, small / "m")
        assert r.returncode == 7
        assert "not enough free disk" in r.stderr and str(small / "m") in r.stderr
        assert hub_server.total_bytes_served == 0
    finally:
        subprocess.run(["umount", str(small)])


def test_without_a_repo_the_pinned_model_is_fetched(run_mm, hub_env, model_repo, tmp_path):
    r = run_mm("fetch", "--revision", model_repo.commits[0][:7], "--local-dir", str(tmp_path / "m"), env=hub_env)
    assert r.returncode == 0, r.stderr
    assert read_manifest(manifest_path(tmp_path / "m")).repo_id == "MiniMaxAI/MiniMax-M3.1-Flash"


def test_without_a_revision_the_pinned_commit_is_asked_for(run_mm, hub_env, model_repo, tmp_path):
    r = run_mm("fetch", "--local-dir", str(tmp_path / "m"), env=hub_env)
    assert r.returncode == 4  # the local Hub has no commit ce7f4df...; the request proves which one was asked
    assert "MiniMaxAI/MiniMax-M3.1-Flash@ce7f4df87d2e05262f5775f373dac4772f134041" in r.stderr


def test_moving_to_a_new_revision_downloads_only_what_changed(run_mm, hub_env, model_repo, hub_server, tmp_path):
    dest = tmp_path / "m"
    assert fetch(run_mm, hub_env, model_repo, dest, revision="v1.0").returncode == 0
    hub_server.reset()
    r = fetch(run_mm, hub_env, model_repo, dest, revision=model_repo.commits[-1])
    assert r.returncode == 0, r.stderr
    assert set(hub_server.bytes_served) == {"README.md"}  # the weights are unchanged since the first upload
    m = read_manifest(manifest_path(dest))
    assert m.revision == model_repo.commits[-1]
    assert files_under(dest) == files_under(model_repo.source_dirs[-1])
