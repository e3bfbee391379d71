"""ModelScope mirrors: `mm mirror reconcile` and `mm fetch --source modelscope`, through the real modelscope SDK
against a local ModelScope server and the local Hub server, as real subprocesses.

Every CLI run carries a guard (ms_env) that refuses and logs any connection or DNS lookup beyond loopback;
the fixture fails the test if anything was logged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.fetching.fetch import FetchRequest, fetch
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from mm.artifacts.errors import BadValue
from mm.artifacts.fetching.mirror import (DIFFERENT, EXTRA, IDENTICAL, MISSING, MirrorFile, MirrorOptions, PinFile,
                                          compare, list_mirror_files, ms_api)
from tests.support.msserver import net_guard_env

MS_ID = "MiniMax/MiniMax-M3.1-Flash"
SHARD = "model-00003-of-00004.safetensors"


@pytest.fixture
def pin_manifest(model_repo, hub_server, tmp_path) -> Path:
    """An mm manifest of the pinned revision, made by a real (in-process) fetch from the local Hub."""
    fetch(FetchRequest(model_repo.repo_id, model_repo.head, tmp_path / "pinned", endpoint=hub_server.url))
    return manifest_path(tmp_path / "pinned")


def reconcile(run_mm, env, model_repo, *extra: str):
    r = run_mm("mirror", "reconcile", model_repo.repo_id, "--revision", model_repo.head, "--modelscope-id", MS_ID,
               "--json", *extra, env=env)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def statuses(report: dict) -> dict[str, str]:
    return {f["path"]: f["status"] for f in report["files"]}


def fetch_from_mirror(run_mm, env, model_repo, dest: Path, *extra: str):
    return run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", str(dest),
                  "--source", f"modelscope:{MS_ID}", "--json", *extra, env=env)


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# --- reconcile -------------------------------------------------------------------------------------

def test_identical_mirror_supplies_every_file_of_the_pin(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    assert set(statuses(report).values()) == {IDENTICAL} and set(statuses(report)) == set(pinned_files)
    assert (report["supplied_files"], report["supplied_bytes"]) == (len(pinned_files), sum(map(len, pinned_files.values())))
    assert report["complete"] and report["revision"] == model_repo.head
    by = {f["path"]: f["compared_by"] for f in report["files"]}
    assert by[SHARD] == "sha256" and by["config.json"] == "git-blob-sha1"


def test_mirror_with_a_different_config_json_reports_it_different(run_mm, ms_env, ms_server, model_repo, pinned_files):
    config = json.loads(pinned_files["config.json"])
    config["torch_dtype"] = "float16"  # same size would still differ by hash; a size change is the common case
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "config.json": json.dumps(config).encode()})
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    assert statuses(report)["config.json"] == DIFFERENT
    assert report["supplied_files"] == len(pinned_files) - 1 and not report["complete"]


def test_same_size_small_file_is_compared_by_its_git_blob_sha1(run_mm, ms_env, ms_server, model_repo, pinned_files):
    original = pinned_files["generation_config.json"]
    swapped = original.replace(b"0.95", b"0.96")
    assert len(swapped) == len(original) and swapped != original
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "generation_config.json": swapped})
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    entry = next(f for f in report["files"] if f["path"] == "generation_config.json")
    assert (entry["status"], entry["compared_by"]) == (DIFFERENT, "git-blob-sha1")
    assert ms_server.downloads("generation_config.json"), "a small file is judged by the mirror's bytes"
    assert not ms_server.downloads(SHARD), "LFS files are judged by the listing's sha256, not downloaded"


def test_extra_configuration_json_is_reported_extra_and_costs_nothing(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "configuration.json": b'{"framework": "pytorch"}\n'})
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    assert statuses(report)["configuration.json"] == EXTRA
    assert report["complete"] and report["counts"][EXTRA] == 1


def test_missing_shard_is_reported_missing_on_the_mirror(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", {p: b for p, b in pinned_files.items() if p != SHARD})
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    entry = next(f for f in report["files"] if f["path"] == SHARD)
    assert (entry["status"], entry["pin_size"], entry["mirror_size"]) == (MISSING, len(pinned_files[SHARD]), None)
    assert report["supplied_bytes"] == sum(map(len, pinned_files.values())) - len(pinned_files[SHARD])


def test_text_report_with_the_pins_defaults_names_statuses_and_the_verdict(run_mm, ms_env, ms_server, model_repo,
                                                                          pinned_files):
    ms_server.add_revision(MS_ID, "master", {p: b for p, b in pinned_files.items() if p != SHARD})
    r = run_mm("mirror", "reconcile", "--revision", model_repo.head, env=ms_env)  # repo and mirror id from the pin
    assert r.returncode == 0, r.stderr
    assert MISSING in r.stdout and IDENTICAL in r.stdout
    text = " ".join(r.stdout.split())
    assert f"modelscope:{MS_ID}@master can supply {len(pinned_files) - 1} of {len(pinned_files)} files" in text
    assert f"from the Hub: {SHARD}" in text


def test_small_file_whose_bytes_contradict_the_listing_is_not_counted(run_mm, ms_env, ms_server, model_repo, pinned_files):
    listed = {**pinned_files, "tokenizer_config.json": pinned_files["tokenizer_config.json"].replace(b"Fast", b"Slow")}
    ms_server.add_revision(MS_ID, "master", listed)
    ms_server.serve_instead(MS_ID, "master", "tokenizer_config.json", pinned_files["tokenizer_config.json"])
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 0, r.stderr
    entry = next(f for f in report["files"] if f["path"] == "tokenizer_config.json")
    assert entry["status"] == DIFFERENT and "listing" in entry["note"]


def test_empty_listing_is_a_clear_remote_error(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    ms_server.fail_listing(MS_ID, "success-false")  # HTTP 200, Success:false: the SDK reads an empty list
    r, _ = reconcile(run_mm, ms_env, model_repo)
    assert r.returncode == 4
    line = one_line_error(r)
    assert MS_ID in line and "empty" in line


def test_failed_listing_is_a_clear_remote_error(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    ms_server.fail_listing(MS_ID, 500)
    env = {**ms_env, "MODELSCOPE_REPO_TREE_PAGE_MAX_ATTEMPTS": "1"}  # the SDK would back off 7 s over 4 attempts
    r, _ = reconcile(run_mm, env, model_repo)
    assert r.returncode == 4
    line = one_line_error(r)
    assert MS_ID in line and "cannot list files" in line


def test_unknown_mirror_revision_is_a_clear_remote_error(run_mm, ms_env, ms_server, model_repo, pinned_files):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    r, _ = reconcile(run_mm, ms_env, model_repo, "--ms-revision", "v9.9")
    assert r.returncode == 4
    assert f"{MS_ID}@v9.9" in one_line_error(r)


def test_all_revisions_ranks_the_best_tag_first(run_mm, ms_env, ms_server, model_repo, pinned_files):
    config = pinned_files["config.json"].replace(b"bfloat16", b"float16")
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "config.json": config})
    ms_server.add_revision(MS_ID, "v1.0", {p: b for p, b in pinned_files.items() if p != SHARD}, kind="tag")
    ms_server.add_revision(MS_ID, "v1.1", {**pinned_files, "configuration.json": b"{}\n"}, kind="tag")
    ms_server.add_revision(MS_ID, "v2.0", pinned_files, kind="tag")
    ms_server.fail_listing(MS_ID, "success-false", revision="v2.0")  # an unlistable tag ranks last, with its error
    r, doc = reconcile(run_mm, ms_env, model_repo, "--all-revisions")
    assert r.returncode == 0, r.stderr
    n, total = len(pinned_files), sum(map(len, pinned_files.values()))
    assert [(c["ms_revision"], c["kind"], c["supplied_files"], c["supplied_bytes"]) for c in doc["ranking"]] == [
        ("v1.1", "tag", n, total),
        ("master", "branch", n - 1, total - len(pinned_files["config.json"])),
        ("v1.0", "tag", n - 1, total - len(pinned_files[SHARD])),
        ("v2.0", "tag", 0, 0),
    ]
    assert "empty" in doc["ranking"][-1]["error"] and all(c["error"] is None for c in doc["ranking"][:-1])
    assert doc["best"]["ms_revision"] == "v1.1" and doc["best"]["complete"]


def test_pin_manifest_gives_the_pin_without_the_hub(run_mm, ms_env, ms_server, model_repo, pinned_files, pin_manifest, unused_port):
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "config.json": b"{}\n"})
    offline = {**ms_env, "HF_ENDPOINT": f"http://127.0.0.1:{unused_port}"}
    r, report = reconcile(run_mm, offline, model_repo, "--pin-manifest", str(pin_manifest))
    assert r.returncode == 0, r.stderr
    assert report["pin_origin"].startswith("manifest:") and statuses(report)["config.json"] == DIFFERENT
    assert report["supplied_files"] == len(pinned_files) - 1
    assert ms_server.downloads() == [], "a manifest has every sha256: nothing needs downloading"


def test_listing_past_the_servers_3000_entry_cap_is_complete(ms_server, tmp_path, monkeypatch):
    for name, value in (("MODELSCOPE_HOME", tmp_path / "h"), ("MODELSCOPE_CACHE", tmp_path / "c"),
                        ("MODELSCOPE_DOWNLOAD_INTRA_CLOUD", "false")):
        monkeypatch.setenv(name, str(value))
    files = {f"d{i % 3}/f{i}.txt": str(i).encode() for i in range(3200)}
    ms_server.add_revision(MS_ID, "master", files)
    listed = list_mirror_files(MS_ID, "master", api=ms_api(ms_server.url))  # the real SDK, explicit local endpoint
    assert sorted(f.path for f in listed) == sorted(files)
    assert {q.query.get("Root") for q in ms_server.requests if q.path.endswith("/repo/files")} > {None}


def test_compare_matches_on_content_not_on_order():
    pin = [PinFile("b.safetensors", 3, sha256="ab" * 32), PinFile("a.json", 2, git_sha1="x")]
    mirror = [MirrorFile("z.json", 1, "00" * 32), MirrorFile("b.safetensors", 3, "AB" * 32), MirrorFile("a.json", 2, "11" * 32)]
    reports = compare(pin, mirror, read_mirror=lambda path: b"{}")
    assert [(r.path, r.status) for r in reports] == [("a.json", DIFFERENT), ("b.safetensors", IDENTICAL), ("z.json", EXTRA)]


# --- fetch from the mirror -------------------------------------------------------------------------

def test_fetch_from_an_identical_mirror_takes_nothing_from_the_hub_and_verifies(
        run_mm, ms_env, ms_server, hub_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m", "--mirror-only")
    assert r.returncode == 0, r.stderr
    assert files_under(tmp_path / "m") == pinned_files
    assert hub_server.total_bytes_served == 0
    m = read_manifest(manifest_path(tmp_path / "m"))
    assert m.revision == model_repo.head
    assert {f.source for f in m.files} == {f"modelscope:{MS_ID}@master"}
    assert run_mm("verify", str(tmp_path / "m"), env=ms_env).returncode == 0


def test_fetch_takes_from_the_hub_what_the_mirror_cannot_supply(
        run_mm, ms_env, ms_server, hub_server, model_repo, pinned_files, tmp_path):
    mirror = {p: b for p, b in pinned_files.items() if p != SHARD}
    mirror.update({"config.json": b"{}\n", "configuration.json": b"{}\n"})
    ms_server.add_revision(MS_ID, "master", mirror)
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert files_under(tmp_path / "m") == pinned_files  # no configuration.json: it is not in the pin
    sources = {f.path: f.source for f in read_manifest(manifest_path(tmp_path / "m")).files}
    assert sources[SHARD] == sources["config.json"] == "hub"
    assert {s for p, s in sources.items() if p not in (SHARD, "config.json")} == {f"modelscope:{MS_ID}@master"}
    assert not ms_server.downloads(SHARD)
    assert {r[1].split("/", 5)[-1] for r in hub_server.resolve_requests()} == {SHARD, "config.json"}
    verify = run_mm("verify", str(tmp_path / "m"), env=ms_env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_mirror_only_names_the_files_the_mirror_cannot_supply(run_mm, ms_env, ms_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", {**{p: b for p, b in pinned_files.items() if p != SHARD}, "config.json": b"{}\n"})
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m", "--mirror-only")
    assert r.returncode == 4
    doc = json.loads(r.stdout)
    assert not doc["ok"] and SHARD in doc["error"] and "config.json" in doc["error"]
    assert not any((tmp_path / "m").glob("*.safetensors"))


def test_mirror_bytes_that_contradict_the_listing_are_rejected_and_never_named_final(
        run_mm, ms_env, ms_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    forged = bytes(len(pinned_files[SHARD]))  # same size, listing still promises the real sha256
    ms_server.serve_instead(MS_ID, "master", SHARD, forged)
    r, report = reconcile(run_mm, ms_env, model_repo)
    assert statuses(report)[SHARD] == IDENTICAL  # the listing lies convincingly
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m", "--mirror-only")
    assert r.returncode == 5, r.stderr
    failed = [f for f in json.loads(r.stdout)["files"] if f["status"] == "failed"]
    assert [f["path"] for f in failed] == [SHARD] and "do not match" in failed[0]["error"]
    assert not (tmp_path / "m" / SHARD).exists()
    assert not [p for p in (tmp_path / "m").rglob("*") if p.is_file() and p.read_bytes() == forged]
    assert not read_manifest(manifest_path(tmp_path / "m")).by_path()[SHARD].proven  # expected, never claimed


def test_a_file_the_mirror_serves_wrong_is_taken_from_the_hub_instead(
        run_mm, ms_env, ms_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    ms_server.serve_instead(MS_ID, "master", SHARD, bytes(len(pinned_files[SHARD])))
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    outcome = next(f for f in json.loads(r.stdout)["files"] if f["path"] == SHARD)
    assert outcome["source"] == "hub" and "taken from the Hub instead" in outcome["note"]
    assert (tmp_path / "m" / SHARD).read_bytes() == pinned_files[SHARD]
    assert read_manifest(manifest_path(tmp_path / "m")).by_path()[SHARD].source == "hub"


def test_fetch_from_the_mirror_resumes_across_runs(run_mm, ms_env, ms_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    cut = len(pinned_files[SHARD]) // 2
    ms_server.cut_downloads(MS_ID, SHARD, cut)
    first = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m", "--mirror-only")
    assert first.returncode == 4, first.stderr
    assert not (tmp_path / "m" / SHARD).exists()
    ms_server.cut_downloads(MS_ID, SHARD, None)
    before = len(ms_server.downloads(SHARD))
    second = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m", "--mirror-only")
    assert second.returncode == 0, second.stderr
    resumed = ms_server.downloads(SHARD)[before:]
    assert [q.range for q in resumed] == [f"bytes={cut}-"]
    assert files_under(tmp_path / "m") == pinned_files
    outcome = next(f for f in json.loads(second.stdout)["files"] if f["path"] == SHARD)
    assert (outcome["resumed_from"], outcome["bytes_transferred"]) == (cut, len(pinned_files[SHARD]) - cut)
    assert {f["status"] for f in json.loads(second.stdout)["files"] if f["path"] != SHARD} == {"present"}


def test_mirror_only_with_a_pin_manifest_needs_no_hub(run_mm, ms_env, ms_server, model_repo, pinned_files, pin_manifest,
                                                     unused_port, tmp_path):
    ms_server.add_revision(MS_ID, "master", {**pinned_files, "configuration.json": b"{}\n"})
    offline = {**ms_env, "HF_ENDPOINT": f"http://127.0.0.1:{unused_port}"}
    r = fetch_from_mirror(run_mm, offline, model_repo, tmp_path / "m", "--mirror-only", "--pin-manifest", str(pin_manifest))
    assert r.returncode == 0, r.stderr
    assert files_under(tmp_path / "m") == pinned_files
    assert {f.source for f in read_manifest(manifest_path(tmp_path / "m")).files} == {f"modelscope:{MS_ID}@master"}
    verify = run_mm("verify", str(tmp_path / "m"), env=offline)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_mirror_fetch_with_the_hub_down_and_no_pin_manifest_is_a_clear_error(run_mm, ms_env, ms_server, model_repo,
                                                                           pinned_files, unused_port, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    offline = {**ms_env, "HF_ENDPOINT": f"http://127.0.0.1:{unused_port}"}
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", str(tmp_path / "m"),
               "--source", "modelscope", "--mirror-only", env=offline)
    assert r.returncode == 4
    line = one_line_error(r)
    assert "cannot reach the Hub" in line and "--pin-manifest" in line
    assert ms_server.downloads() == []


def test_mirror_only_without_a_mirror_source_is_a_usage_error(run_mm, ms_env, model_repo, tmp_path):
    r = run_mm("fetch", model_repo.repo_id, "--local-dir", str(tmp_path / "m"), "--mirror-only", env=ms_env)
    assert r.returncode == 2 and "--mirror-only" in r.stderr


# --- nothing leaves loopback -----------------------------------------------------------------------

def test_every_request_went_to_the_local_servers_only(run_mm, ms_env, ms_server, hub_server, model_repo, pinned_files, tmp_path):
    ms_server.add_revision(MS_ID, "master", pinned_files)
    r = fetch_from_mirror(run_mm, ms_env, model_repo, tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert ms_server.requests and {q.host.split(":")[0] for q in ms_server.requests} == {"127.0.0.1"}
    assert not (tmp_path / "net" / "net.log").exists()  # ms_env checks this after every test too


def test_the_network_guard_refuses_and_logs_a_public_address(tmp_path):
    env = {**os.environ, **net_guard_env(tmp_path)}
    probe = "import socket; socket.create_connection(('192.0.2.1', 443), timeout=1)"  # TEST-NET-1, never routed
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "network guard" in r.stderr
    assert "192.0.2.1" in (tmp_path / "net.log").read_text()


def test_mirror_only_and_pin_manifest_go_only_with_a_modelscope_source():
    for given in (dict(mirror_only=True, pin_manifest=None), dict(mirror_only=False, pin_manifest=Path("m.json"))):
        with pytest.raises(BadValue, match="--mirror-only and --pin-manifest need --source modelscope"):
            MirrorOptions.from_cli("hub", **given)
    assert MirrorOptions.from_cli("hub", False, None) is None
    assert MirrorOptions.from_cli("modelscope", True, None) == MirrorOptions("modelscope", mirror_only=True)
