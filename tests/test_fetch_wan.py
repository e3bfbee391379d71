"""mm fetch at WAN speed: ranges over many connections, the Hub's redirect to a signed bridge URL,
Xet-backed repos, rate limits and servers that answer Range wrongly; the real mm against the local Hub."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.support.gitrepo import commit_dir
from tests.support.hubserver import xet_hash_for
from tests.support.memory import peak_rss
from tests.support.run import mm_argv

BIG = "model.safetensors"
MiB = 1 << 20


def _tensor_file(path: Path, nbytes: int, seed: int) -> None:
    data = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    save_file({"weight": data}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def one_file_repo(hub_root, tmp_path_factory) -> tuple[str, str, dict[str, bytes]]:
    """(repo_id, commit, {path: bytes}): one 32 MiB shard plus config.json."""
    src = tmp_path_factory.mktemp("wan-one")
    (src / "config.json").write_text('{"model_type": "test"}\n')
    _tensor_file(src / BIG, 32 * MiB, seed=13)
    commit = commit_dir(hub_root / "test-org/wan-one", src, "first upload")
    return "test-org/wan-one", commit, {p.name: p.read_bytes() for p in src.iterdir()}


@pytest.fixture(scope="session")
def eight_file_repo(hub_root, tmp_path_factory) -> tuple[str, str, dict[str, bytes]]:
    """(repo_id, commit, {path: bytes}): eight 3 MiB shards plus config.json."""
    src = tmp_path_factory.mktemp("wan-eight")
    (src / "config.json").write_text('{"model_type": "test"}\n')
    for k in range(1, 9):
        _tensor_file(src / f"model-{k:05d}-of-00008.safetensors", 3 * MiB, seed=100 + k)
    commit = commit_dir(hub_root / "test-org/wan-eight", src, "first upload")
    return "test-org/wan-eight", commit, {p.name: p.read_bytes() for p in src.iterdir()}


@pytest.fixture(scope="session")
def bigger_than_the_memory_bound_repo(hub_root, tmp_path_factory) -> tuple[str, str, str]:
    """(repo_id, commit, sha256 of the shard): one 160 MiB shard, more than mm may hold in memory (150 MB)."""
    src = tmp_path_factory.mktemp("wan-big")
    _tensor_file(src / BIG, 160 * MiB, seed=14)
    sha = hashlib.sha256((src / BIG).read_bytes()).hexdigest()
    commit = commit_dir(hub_root / "test-org/wan-big", src, "first upload", move_lfs=True)
    return "test-org/wan-big", commit, sha


def fetch(run_mm, env, repo, dest: Path, *extra: str):
    repo_id, commit, _ = repo
    return run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(dest), "--json", *extra, env=env)


def payload(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and ".mm" not in p.relative_to(dest).parts}


def asked(range_header: str | None, size: int) -> int:
    """How many bytes a request asked for."""
    if not range_header:
        return size
    first, _, last = range_header.removeprefix("bytes=").partition("-")
    return (int(last) + 1 if last else size) - int(first)


def ranges_done(dest: Path) -> int:
    total = 0
    for state in (dest / ".mm" / "partial").glob("*.ranges"):
        try:
            total += sum(e - s for s, e in json.loads(state.read_text())["done"])
        except (OSError, ValueError):
            pass
    return total


# --- throughput shape: one big file, many files ---

def test_one_big_file_is_fetched_over_many_connections_through_the_redirect(run_mm, hub_env, hub_server, one_file_repo,
                                                                            tmp_path):
    hub_server.conn_rate = 8 * MiB
    hub_server.redirect_lfs = True
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    doc = json.loads(r.stdout)
    big = next(f for f in doc["files"] if f["path"] == BIG)
    assert big["connections"] > 1 and big["ranges"] > 1
    assert doc["transfer"]["connections"] == 32 and doc["transfer"]["connections_used"] > 1
    served = hub_server.served_for(BIG)
    assert {row[0] for row in served if row[3] == 206} == {"bridge"}  # ranges go to the redirect's target
    assert sum(row[4] for row in served) == len(one_file_repo[2][BIG])  # every byte once
    assert hub_server.bridge_auth_headers_seen == 0


def test_eight_files_share_the_connections(run_mm, hub_env, hub_server, eight_file_repo, tmp_path):
    hub_server.conn_rate = 2 * MiB
    r = fetch(run_mm, hub_env, eight_file_repo, tmp_path / "m", "--connections", "12")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == eight_file_repo[2]
    doc = json.loads(r.stdout)
    assert doc["transfer"]["connections"] == 12 and 8 <= doc["transfer"]["connections_used"] <= 12
    assert doc["transfer"]["connections_kept"] == 12  # a budget under 16 is opened as given, never changed
    assert hub_server.total_bytes_served == sum(len(b) for b in eight_file_repo[2].values())


def test_one_connection_fetches_each_file_in_one_request(run_mm, hub_env, hub_server, eight_file_repo, tmp_path):
    r = fetch(run_mm, hub_env, eight_file_repo, tmp_path / "m", "--connections", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["transfer"]["connections_used"] == 1
    for path in eight_file_repo[2]:
        assert [row[2] for row in hub_server.served_for(path)] == [None]  # no Range header: the whole file


def test_peak_memory_stays_under_150_mb_for_a_file_bigger_than_that(hub_env, hub_server,
                                                                   bigger_than_the_memory_bound_repo, tmp_path):
    repo_id, commit, sha = bigger_than_the_memory_bound_repo
    hub_server.redirect_lfs = True
    returncode, peak = peak_rss(mm_argv("fetch", repo_id, "--revision", commit, "--local-dir", tmp_path / "m"), hub_env)
    assert returncode == 0
    assert hashlib.sha256((tmp_path / "m" / BIG).read_bytes()).hexdigest() == sha
    assert len(hub_server.served_for(BIG, "bridge")) > 1  # ranges over several connections
    assert peak < 150e6, peak


# --- kill -9 with several ranges in flight ---

def test_kill_9_with_ranges_in_flight_then_rerun_fetches_only_what_was_missing(run_mm, hub_env, hub_server,
                                                                            one_file_repo, tmp_path):
    repo_id, commit, files = one_file_repo
    size, dest = len(files[BIG]), tmp_path / "m"
    hub_server.conn_rate = 2 * MiB
    proc = subprocess.Popen(mm_argv("fetch", repo_id, "--revision", commit, "--local-dir", dest, "--connections", "4"),
                            env=hub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while ranges_done(dest) < size // 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight = [row for row in hub_server.served_for(BIG) if row[3] == 206 and row[4] < asked(row[2], size)]
        assert len(in_flight) >= 2  # several ranges were being served when the kill landed
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    first_run = hub_server.bytes_served.get(BIG, 0)
    missing = size - ranges_done(dest)
    assert 0 < missing < size
    hub_server.reset()
    r = fetch(run_mm, hub_env, one_file_repo, dest)
    assert r.returncode == 0, r.stderr
    assert payload(dest) == files
    rerun = hub_server.bytes_served[BIG]
    assert rerun <= 1.25 * missing  # only the gaps of the range map
    assert first_run + rerun <= size + 0.25 * missing  # little was received and then lost to the kill
    assert json.loads(r.stdout)["files"][1]["resumed_from"] == size - missing
    assert not list((dest / ".mm" / "partial").iterdir())


# --- signed URLs, Xet, tokens ---

def test_a_signed_url_expiring_mid_download_is_resolved_again(run_mm, hub_env, hub_server, one_file_repo, tmp_path):
    hub_server.redirect_lfs = True
    hub_server.signed_url_ttl = 1.0
    hub_server.conn_rate = 4 * MiB  # two connections, ranges of 8 MiB: the second ones are asked for after ~2 s
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "2")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    expired = [row for row in hub_server.served_for(BIG, "bridge") if row[3] == 403]
    assert expired and json.loads(r.stdout)["transfer"]["retries_by_reason"]["expired"] == len(expired)
    resolves = [m for m, _, _ in hub_server.resolve_requests(BIG) if m == "GET"]
    assert len(resolves) > 1  # resolved again after the expiry


@pytest.mark.parametrize("status", [403, 410])
def test_expiry_status_403_or_410_both_re_resolve(run_mm, hub_env, hub_server, one_file_repo, tmp_path, status):
    hub_server.redirect_lfs = True
    hub_server.signed_url_ttl = 0.5
    hub_server.expired_status = status
    hub_server.conn_rate = 8 * MiB
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "2")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    expired = [row for row in hub_server.served_for(BIG, "bridge") if row[3] == status]
    assert expired and json.loads(r.stdout)["transfer"]["retries_by_reason"] == {"expired": len(expired)}


def test_xet_backed_repo_is_fetched_through_the_bridge_and_its_xet_hash_recorded(run_mm, hub_env, hub_server,
                                                                               one_file_repo, tmp_path):
    repo_id, _, files = one_file_repo
    hub_server.xet_repos.add(repo_id)
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == files
    entries = read_manifest(manifest_path(tmp_path / "m")).by_path()
    sha = hashlib.sha256(files[BIG]).hexdigest()
    assert entries[BIG].upstream.value == sha == entries[BIG].sha256  # lfs.oid still checked
    assert entries[BIG].xet_hash == xet_hash_for(sha)
    assert entries["config.json"].xet_hash is None
    assert '"xet_hash"' in manifest_path(tmp_path / "m").read_text()
    assert {row[0] for row in hub_server.served_for(BIG)} == {"bridge"}


@pytest.mark.parametrize("redirect", ["xet bridge", "lfs cdn"])
def test_the_hub_token_never_reaches_the_other_origin(run_mm, hub_env, hub_server, private_repo, tmp_path, redirect):
    repo_id, commit, token = private_repo
    if redirect == "xet bridge":
        hub_server.xet_repos.add(repo_id)
    else:
        hub_server.redirect_lfs = True
    r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", str(tmp_path / "m"), "--json",
               env=dict(hub_env, HF_TOKEN=token))
    assert r.returncode == 0, r.stderr
    assert hub_server.served_for("model.safetensors", "bridge") and hub_server.bridge_auth_headers_seen == 0
    assert hub_server.auth_headers_seen > 0
    assert token not in r.stdout + r.stderr


# --- rate limits and 5xx ---

def test_429_with_retry_after_is_retried_then_succeeds(run_mm, hub_env, hub_server, one_file_repo, tmp_path):
    hub_server.too_many[BIG] = 2
    hub_server.retry_after = 1
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "4")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    t = json.loads(r.stdout)["transfer"]
    assert t["retries_by_reason"] == {"429": 2} and t["retries"] == 2 and t["retry_budget"] >= 64
    assert {x["path"] for x in t["retried"]} == {BIG}
    assert hub_server.bytes_served[BIG] == len(one_file_repo[2][BIG])  # nothing lost, nothing twice


def test_5xx_on_ranges_is_retried_without_losing_bytes(run_mm, hub_env, hub_server, one_file_repo, tmp_path):
    hub_server.fail_times[BIG] = 3
    hub_server.cut_after[BIG] = 3 * MiB
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "4")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    reasons = json.loads(r.stdout)["transfer"]["retries_by_reason"]
    assert reasons["503"] == 3 and reasons["cut"] == 1
    assert hub_server.bytes_served[BIG] <= len(one_file_repo[2][BIG]) + 64 * 1024


def test_a_hub_that_keeps_answering_503_fails_the_file_naming_it_and_keeps_the_partial(run_mm, hub_env, hub_server,
                                                                                     eight_file_repo, tmp_path):
    path = "model-00003-of-00008.safetensors"
    hub_server.cut_after[path] = MiB  # the first answer breaks after 1 MiB, every later one is a 503
    hub_server.fail_after[path] = 1
    r = fetch(run_mm, hub_env, eight_file_repo, tmp_path / "m", "--connections", "1")
    assert r.returncode == 4
    failed = [f for f in json.loads(r.stdout)["files"] if f["status"] == "failed"]
    assert [f["path"] for f in failed] == [path] and "run again to resume" in failed[0]["error"]
    assert not (tmp_path / "m" / path).exists()
    assert ranges_done(tmp_path / "m") == MiB  # the bytes that came before the 503s are kept


# --- servers that answer Range wrongly ---

def test_a_server_ignoring_range_is_one_stream_never_appended_as_the_range(run_mm, hub_env, hub_server, one_file_repo,
                                                                          tmp_path):
    """What a pull-through cache does on a miss: the file is one stream, every byte of it sent once."""
    hub_server.ignore_range.add(BIG)
    size = len(one_file_repo[2][BIG])
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "8")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    served = hub_server.served_for(BIG)
    assert [row[3] for row in served] == [200]
    assert json.loads(r.stdout)["files"][1]["bytes_transferred"] == size


def test_a_server_ignoring_range_after_a_kill_restarts_from_byte_0_and_keeps_the_file_right(
        run_mm, hub_env, hub_server, one_file_repo, tmp_path):
    repo_id, commit, files = one_file_repo
    dest = tmp_path / "m"
    hub_server.conn_rate = 4 * MiB
    proc = subprocess.Popen(mm_argv("fetch", repo_id, "--revision", commit, "--local-dir", dest, "--connections", "4"),
                            env=hub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while ranges_done(dest) < len(files[BIG]) // 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    hub_server.reset()
    hub_server.ignore_range.add(BIG)
    r = fetch(run_mm, hub_env, one_file_repo, dest)
    assert r.returncode == 0, r.stderr
    assert payload(dest) == files
    assert len(hub_server.served_for(BIG)) <= 16


def test_a_206_starting_before_the_offset_asked_uses_the_bytes_at_their_offsets(run_mm, hub_env, hub_server,
                                                                                one_file_repo, tmp_path):
    hub_server.shift_range[BIG] = 300
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "4")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    requests = hub_server.served_for(BIG)
    assert len(requests) <= 4 + len(one_file_repo[2][BIG]) // MiB  # bounded: no request loop
    assert hub_server.bytes_served[BIG] <= 1.5 * len(one_file_repo[2][BIG])


def test_a_206_starting_after_the_offset_asked_falls_back_to_the_whole_file(run_mm, hub_env, hub_server,
                                                                            one_file_repo, tmp_path):
    hub_server.shift_range[BIG] = -4096
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "4")
    assert r.returncode == 0, r.stderr
    assert payload(tmp_path / "m") == one_file_repo[2]
    assert any(row[2] is None and row[3] == 200 for row in hub_server.served_for(BIG))  # asked without Range
    assert len(hub_server.served_for(BIG)) <= 20


def test_wrong_bytes_in_one_range_fail_that_file_by_name_and_nothing_is_named(run_mm, hub_env, hub_server,
                                                                              one_file_repo, tmp_path):
    hub_server.corrupt_at[BIG] = 20 * MiB + 17
    r = run_mm("fetch", one_file_repo[0], "--revision", one_file_repo[1], "--local-dir", str(tmp_path / "m"),
               env=hub_env)
    assert r.returncode == 5
    assert f"FAILED {BIG}" in r.stderr and "do not match" in r.stderr
    assert not (tmp_path / "m" / BIG).exists()
    assert not list((tmp_path / "m" / ".mm" / "partial").iterdir())  # neither the partial nor its range map
    assert (tmp_path / "m" / "config.json").exists()


def test_ranges_of_a_file_reuse_their_connections(run_mm, hub_env, hub_server, one_file_repo, tmp_path):
    """A range after a range goes over the same kept-alive connection: no new TCP (and, on a real CDN, TLS)
    handshake per range. 32 MiB in 1 MiB ranges over 4 connections: 32 requests, at most a handful of connections."""
    hub_server.redirect_lfs = True
    r = fetch(run_mm, hub_env, one_file_repo, tmp_path / "m", "--connections", "4")
    assert r.returncode == 0, r.stderr
    ranges = [row for row in hub_server.served_for(BIG, "bridge") if row[3] == 206]
    assert len(ranges) >= 8
    # without reuse: one bridge connection per range plus the Hub's; with it: one per mm connection plus the Hub's
    assert hub_server.connections <= len(ranges) // 2 + 4, (hub_server.connections, len(ranges))
