"""The local Hub double speaks what the real huggingface_hub client expects (no mocks: the real client)."""
from __future__ import annotations

import hashlib
import http.client
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from urllib.parse import urlsplit

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from mm.artifacts.integrity.hashing import git_blob_sha1
from tests.support.gitrepo import lfs_object_path, make_model_repo, parse_lfs_pointer
from tests.support.hubserver import HubServer, xet_hash_for

SHARD = "model-00002-of-00004.safetensors"
ROOT = Path(__file__).resolve().parents[1]


def api(server: HubServer, token: str | bool = False) -> HfApi:
    return HfApi(endpoint=server.url, token=token)


def plain_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(root).parts}


def get(server: HubServer, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def resolve_path(repo, rev: str, path: str) -> str:
    return f"/{repo.repo_id}/resolve/{rev}/{path}"


# --- the git repositories ---

def test_large_files_are_lfs_pointers_with_objects_under_git_lfs(model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    pointer = subprocess.run(["git", "-C", str(model_repo.path), "cat-file", "blob", f"main:{SHARD}"],
                             capture_output=True, check=True).stdout
    oid = hashlib.sha256(data).hexdigest()
    assert parse_lfs_pointer(pointer) == (oid, len(data))
    assert lfs_object_path(model_repo.path, oid).read_bytes() == data


def test_weights_are_unchanged_since_the_first_upload_only_readme_differs(model_repo):
    out = subprocess.run(["git", "-C", str(model_repo.path), "diff", "--name-only", *model_repo.commits],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["README.md"]


def test_same_content_gives_the_same_commit_shas(tmp_path):
    a = make_model_repo(tmp_path / "a", shards=1, shard_bytes=16 * 1024, draft=False)
    b = make_model_repo(tmp_path / "b", shards=1, shard_bytes=16 * 1024, draft=False)
    assert a.commits == b.commits and len(set(a.commits)) == 2


# --- metadata API through HfApi ---

def test_repo_info_reports_lfs_sha256_and_blob_ids_that_match_the_files(hub_server, model_repo):
    info = api(hub_server).repo_info(model_repo.repo_id, revision=model_repo.commits[-1], files_metadata=True)
    files = plain_files(model_repo.source_dirs[-1])
    assert info.sha == model_repo.commits[-1]
    assert {s.rfilename for s in info.siblings} == set(files)
    for s in info.siblings:
        data = files[s.rfilename]
        assert s.size == len(data)
        if s.rfilename.endswith(".safetensors"):
            assert s.lfs.sha256 == hashlib.sha256(data).hexdigest() and s.lfs.size == len(data)
        else:
            assert s.lfs is None and s.blob_id == git_blob_sha1(data)


def test_recursive_tree_lists_every_file_and_directory_with_last_commit(hub_server, model_repo):
    entries = list(api(hub_server).list_repo_tree(model_repo.repo_id, revision="main", recursive=True, expand=True))
    by_path = {e.path: e for e in entries}
    assert set(by_path) == set(plain_files(model_repo.source_dirs[-1])) | {"dspark"}
    assert by_path["README.md"].last_commit.oid == model_repo.commits[1]
    assert by_path[SHARD].last_commit.oid == model_repo.commits[0]
    assert by_path[SHARD].lfs.sha256 == hashlib.sha256((model_repo.source_dirs[-1] / SHARD).read_bytes()).hexdigest()


def test_tree_of_a_folder_lists_only_its_entries(hub_server, model_repo):
    entries = api(hub_server).list_repo_tree(model_repo.repo_id, path_in_repo="dspark", revision="v1.0")
    expected = sorted(f"dspark/{p.name}" for p in (model_repo.source_dirs[0] / "dspark").iterdir())
    assert sorted(e.path for e in entries) == expected


def test_paths_info_returns_the_known_paths_and_skips_missing_ones(hub_server, model_repo):
    got = api(hub_server).get_paths_info(model_repo.repo_id, ["config.json", "dspark", "nope.bin"], revision="v1.0")
    assert [(type(e).__name__, e.path) for e in got] == [("RepoFile", "config.json"), ("RepoFolder", "dspark")]


def test_refs_list_the_main_branch_and_the_tag(hub_server, model_repo):
    refs = api(hub_server).list_repo_refs(model_repo.repo_id)
    assert {(b.name, b.target_commit) for b in refs.branches} == set(model_repo.branches.items())
    assert {(t.name, t.target_commit) for t in refs.tags} == set(model_repo.tags.items())


def test_commits_are_listed_newest_first(hub_server, model_repo):
    commits = api(hub_server).list_repo_commits(model_repo.repo_id, revision="main")
    assert [c.commit_id for c in commits] == model_repo.commits[::-1]
    assert commits[-1].title == "first upload"


def test_long_commit_lists_are_paged_and_the_client_follows_the_pages(hub_server, ambiguous_repo, hub_root):
    repo_id, _ = ambiguous_repo
    commits = api(hub_server).list_repo_commits(repo_id)
    expected = subprocess.run(["git", "-C", str(hub_root / repo_id), "rev-list", "main"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert [c.commit_id for c in commits] == expected
    assert len([p for _, p, _ in hub_server.requests if "/commits/" in p]) == -(-len(expected) // 50)


def test_tree_pages_are_followed_to_the_last_entry(hub_server, model_repo):
    hub_server.tree_page_size = 3
    entries = list(api(hub_server).list_repo_tree(model_repo.repo_id, revision="main", recursive=True))
    assert len(entries) == len(plain_files(model_repo.source_dirs[-1])) + 1  # + dspark/
    assert len([p for _, p, _ in hub_server.requests if "/tree/" in p]) == -(-len(entries) // 3)


# --- revisions ---

def test_short_sha_resolves_to_the_full_commit(hub_server, model_repo):
    info = api(hub_server).repo_info(model_repo.repo_id, revision=model_repo.commits[0][:7])
    assert info.sha == model_repo.commits[0]


def test_ambiguous_prefix_is_revision_not_found_saying_ambiguous(hub_server, ambiguous_repo):
    repo_id, prefix = ambiguous_repo
    with pytest.raises(RevisionNotFoundError, match="ambiguous"):
        api(hub_server).repo_info(repo_id, revision=prefix)


def test_unknown_revision_is_revision_not_found(hub_server, model_repo):
    with pytest.raises(RevisionNotFoundError):
        api(hub_server).repo_info(model_repo.repo_id, revision="no-such-branch")


def test_unknown_repo_is_repository_not_found(hub_server, model_repo):
    with pytest.raises(RepositoryNotFoundError):
        api(hub_server).repo_info("nobody/nothing")


def test_missing_file_is_entry_not_found(hub_server, model_repo, tmp_path):
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(model_repo.repo_id, "no-such-file.json", revision=model_repo.commits[-1],
                        endpoint=hub_server.url, cache_dir=tmp_path / "c", local_dir=tmp_path / "d", token=False)


# --- downloads ---

def test_snapshot_download_of_a_tag_gives_identical_bytes(hub_server, model_repo, tmp_path):
    snapshot_download(model_repo.repo_id, revision="v1.0", local_dir=tmp_path / "d", cache_dir=tmp_path / "c",
                      endpoint=hub_server.url, token=False)
    assert plain_files(tmp_path / "d") == plain_files(model_repo.source_dirs[0])
    assert hub_server.bytes_served[SHARD] == (model_repo.source_dirs[0] / SHARD).stat().st_size


def test_hf_download_cli_fetches_a_commit_into_a_local_dir(hub_server, hub_env, model_repo, tmp_path):
    commit = model_repo.commits[-1]
    r = subprocess.run([str(Path(sys.executable).parent / "hf"), "download", model_repo.repo_id, "--revision", commit,
                        "--local-dir", str(tmp_path / "d")], env=hub_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert plain_files(tmp_path / "d") == plain_files(model_repo.source_dirs[-1])
    assert any(m == "HEAD" and commit in p for m, p, _ in hub_server.requests)


def test_resolve_headers_carry_commit_etag_and_linked_size(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD))
    assert status == 200 and body == data
    assert headers["X-Repo-Commit"] == model_repo.commits[-1]
    assert headers["X-Linked-Etag"] == headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert headers["X-Linked-Size"] == headers["Content-Length"] == str(len(data))
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", "config.json"))
    assert headers["ETag"] == f'"{git_blob_sha1(body)}"' and "X-Linked-Etag" not in headers


def test_range_request_returns_206_with_those_bytes(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=1000-"})
    assert status == 206 and body == data[1000:]
    assert headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    status, _, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20]
    assert hub_server.bytes_served[SHARD] == len(data) - 1000 + 10


def test_range_past_the_end_is_416(hub_server, model_repo):
    status, headers, _ = get(hub_server, resolve_path(model_repo, "main", "config.json"), {"Range": "bytes=999999-"})
    assert status == 416 and headers["Content-Range"].startswith("bytes */")


# --- tokens ---

def test_private_repo_is_repository_not_found_without_the_token(hub_server, private_repo):
    repo_id, _, _ = private_repo
    with pytest.raises(RepositoryNotFoundError):
        api(hub_server).repo_info(repo_id)


def test_private_repo_is_served_with_the_bearer_token(hub_server, private_repo, tmp_path):
    repo_id, commit, token = private_repo
    path = hf_hub_download(repo_id, "config.json", revision=commit, endpoint=hub_server.url, token=token,
                           cache_dir=tmp_path / "c", local_dir=tmp_path / "d")
    assert Path(path).read_text() == '{"model_type": "test"}\n'
    assert hub_server.auth_headers_seen >= 2  # HEAD + GET


def test_wrong_token_is_refused(hub_server, private_repo):
    repo_id, _, _ = private_repo
    with pytest.raises(HfHubHTTPError) as err:
        api(hub_server, token="hf_wrong").repo_info(repo_id)
    assert err.value.response.status_code == 401


# --- fault hooks ---

def test_corrupt_hook_serves_other_bytes_under_the_real_etag(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.corrupt[SHARD] = bytes(len(data))
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD))
    assert body == bytes(len(data)) and headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'


def test_cut_after_drops_the_connection_once_then_serves_normally(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.cut_after[SHARD] = 1000
    with pytest.raises(http.client.IncompleteRead) as cut:
        get(hub_server, resolve_path(model_repo, "main", SHARD))
    assert cut.value.partial == data[:1000]
    assert get(hub_server, resolve_path(model_repo, "main", SHARD))[2] == data


def test_hf_client_retries_after_a_cut_and_gets_the_whole_file(hub_server, model_repo, tmp_path):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.cut_after[SHARD] = len(data) // 2
    path = hf_hub_download(model_repo.repo_id, SHARD, revision=model_repo.commits[-1], endpoint=hub_server.url,
                           token=False, cache_dir=tmp_path / "c", local_dir=tmp_path / "d")
    assert Path(path).read_bytes() == data
    assert [m for m, _, _ in hub_server.resolve_requests(SHARD)] == ["HEAD", "GET", "GET"]
    # huggingface_hub 2.4 reads 10 MB chunks, so a cut inside the first chunk restarts from byte 0
    assert hub_server.bytes_served[SHARD] == len(data) // 2 + len(data)


def test_rate_limited_body_is_still_the_exact_content(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.rate_limit = 8 * 1024 * 1024
    status, _, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=5-"})
    assert status == 206 and body == data[5:]


def test_down_hook_answers_503(hub_server, model_repo):
    hub_server.down = True
    assert get(hub_server, f"/api/models/{model_repo.repo_id}")[0] == 503


def test_stopped_server_refuses_connections(hub_root, model_repo):
    server = HubServer(hub_root).start()
    port = int(server.url.rsplit(":", 1)[1])
    assert get(server, f"/api/models/{model_repo.repo_id}")[0] == 200
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# --- WAN hooks: bridge, Xet, throttle, rate limits, broken Range ---

def get_url(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", parts.path + ("?" + parts.query if parts.query else ""), headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_xet_repo_lists_xet_hash_beside_the_lfs_oid(hub_server, model_repo):
    hub_server.xet_repos.add(model_repo.repo_id)
    files = {f.path: f for f in api(hub_server).list_repo_tree(model_repo.repo_id, revision="main", recursive=True)
             if hasattr(f, "blob_id")}
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    assert files[SHARD].lfs.sha256 == hashlib.sha256(data).hexdigest()
    assert files[SHARD].xet_hash == xet_hash_for(files[SHARD].lfs.sha256)
    assert files["config.json"].xet_hash is None  # small non-LFS files stay plain git blobs


def test_xet_resolve_head_gives_the_client_xet_data_and_the_bridge_location(hub_server, model_repo):
    hub_server.xet_repos.add(model_repo.repo_id)
    url = hf_hub_url(model_repo.repo_id, SHARD, revision=model_repo.commits[-1], endpoint=hub_server.url)
    meta = get_hf_file_metadata(url, token=False, endpoint=hub_server.url)
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    assert meta.xet_file_data.file_hash == xet_hash_for(hashlib.sha256(data).hexdigest())
    assert meta.xet_file_data.refresh_route.startswith(f"{hub_server.url}/api/models/{model_repo.repo_id}/xet-read-token/")
    assert meta.location.startswith(hub_server.bridge_url + "/blobs/") and meta.size == len(data)


def test_bridge_honours_range_and_never_sees_the_token(hub_server, private_repo, tmp_path):
    repo_id, commit, token = private_repo
    hub_server.redirect_lfs = True
    got_path = hf_hub_download(repo_id, "model.safetensors", revision=commit, endpoint=hub_server.url, token=token,
                          cache_dir=tmp_path / "c", local_dir=tmp_path / "d")
    status, headers, _ = get(hub_server, f"/{repo_id}/resolve/{commit}/model.safetensors",
                             {"Authorization": f"Bearer {token}"})
    assert status == 302
    full = get_url(headers["Location"])[2]
    status, got, body = get_url(headers["Location"], {"Range": "bytes=100-199"})
    assert status == 206 and body == full[100:200] and got["Content-Range"] == f"bytes 100-199/{len(full)}"
    assert Path(got_path).read_bytes() == full
    assert hub_server.bridge_auth_headers_seen == 0
    assert {r[0] for r in hub_server.served_for("model.safetensors")} == {"bridge"}


def test_signed_url_expires_with_403_or_410_and_a_forged_one_is_403(hub_server, model_repo):
    hub_server.redirect_lfs = True
    hub_server.signed_url_ttl = -1
    location = get(hub_server, resolve_path(model_repo, "main", SHARD))[1]["Location"]
    assert get_url(location)[0] == 403
    hub_server.expired_status = 410
    assert get_url(location)[0] == 410
    hub_server.signed_url_ttl = 60
    location = get(hub_server, resolve_path(model_repo, "main", SHARD))[1]["Location"]
    assert get_url(location)[0] == 200
    assert get_url(location.replace("sig=", "sig=0"))[0] == 403


def test_too_many_answers_429_with_retry_after_then_serves(hub_server, model_repo):
    hub_server.too_many[SHARD] = 2
    hub_server.retry_after = 3
    for _ in range(2):
        status, headers, _ = get(hub_server, resolve_path(model_repo, "main", SHARD))
        assert status == 429 and headers["Retry-After"] == "3"
    assert get(hub_server, resolve_path(model_repo, "main", SHARD))[0] == 200
    assert [r[3] for r in hub_server.served_for(SHARD)] == [429, 429, 200]


def test_fail_times_answers_503_then_serves(hub_server, model_repo):
    hub_server.fail_times[SHARD] = 1
    assert get(hub_server, resolve_path(model_repo, "main", SHARD))[0] == 503
    assert get(hub_server, resolve_path(model_repo, "main", SHARD))[0] == 200


def test_ignore_range_answers_200_with_the_whole_body(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.ignore_range.add(SHARD)
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=1000-"})
    assert status == 200 and body == data and "Content-Range" not in headers
    assert hub_server.served_for(SHARD)[-1][2:] == ("bytes=1000-", 200, len(data))


def test_shift_range_answers_206_starting_elsewhere_with_an_honest_content_range(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.shift_range[SHARD] = 300
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=1000-1999"})
    assert status == 206 and headers["Content-Range"] == f"bytes 700-1999/{len(data)}" and body == data[700:2000]
    hub_server.shift_range[SHARD] = -300
    status, headers, body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=1000-1999"})
    assert headers["Content-Range"] == f"bytes 1300-1999/{len(data)}" and body == data[1300:2000]


def test_corrupt_at_flips_one_byte_in_whatever_range_covers_it(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.corrupt_at[SHARD] = 5000
    body = get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=4000-5999"})[2]
    assert body[:1000] == data[4000:5000] and body[1000] == data[5000] ^ 0xFF and body[1001:] == data[5001:6000]
    assert get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=0-999"})[2] == data[:1000]


def test_per_connection_throttle_serves_exact_bytes_on_both_listeners(hub_server, model_repo):
    data = (model_repo.source_dirs[-1] / SHARD).read_bytes()
    hub_server.conn_rate = 16 * 1024 * 1024
    assert get(hub_server, resolve_path(model_repo, "main", SHARD), {"Range": "bytes=7-"})[2] == data[7:]
    hub_server.redirect_lfs = True
    location = get(hub_server, resolve_path(model_repo, "main", SHARD))[1]["Location"]
    assert get_url(location)[2] == data
    assert [(r[0], r[4]) for r in hub_server.served_for(SHARD)] == [("hub", len(data) - 7), ("bridge", len(data))]


# --- the command line ---

def test_cli_builds_a_model_prints_the_url_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hubserver", "--root", str(tmp_path / "hub"),
                             "--make-model", "--shards", "1", "--shard-bytes", "65536"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("HUB_URL=http://127.0.0.1:")
        info = HfApi(endpoint=line.split("=", 1)[1], token=False).repo_info("MiniMaxAI/MiniMax-M3.1-Flash",
                                                                            files_metadata=True)
        assert "model-00001-of-00001.safetensors" in {s.rfilename for s in info.siblings}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
