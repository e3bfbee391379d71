"""The fleet path: a site registry, pull-through caches in front of it (Debian's docker-registry 2.8 in proxy mode,
origin -> T1 -> T2 on 127.0.0.1), `mm preheat` warming them, and nodes pulling through them with `mm pull
--mirror`. Every figure is counted where it leaves each registry (tests/support/registry_chain.py)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.registry import Registry
from tests.support.registry_chain import Chain
from tests.support.run import mm_argv
from tests.test_oci import REV_A, env_for, make_model, mm, tree

MiB = 1 << 20
SHARD = 4 * MiB
REPO = "models/flash"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("fleet") / "model", 7, REV_A, shard_bytes=SHARD, shards=3)


@pytest.fixture
def chain(tmp_path, model):
    """origin -> T1 -> T2, the model pushed to the origin as REPO:v1, every counter at zero."""
    with Chain(tmp_path / "chain") as c:
        got = mm(tmp_path, "push", model, f"{c.origin.host}/{REPO}:v1")
        assert got.returncode == 0, got.stderr
        c.reset()
        yield c


def blob_bytes(model: Path) -> int:
    return sum(len(b) for b in tree(model).values())


def pull(tmp_path, ref, dest, *args) -> tuple[subprocess.CompletedProcess, dict]:
    got = mm(tmp_path, "pull", ref, "--local-dir", dest, "--json", *args)
    return got, (json.loads(got.stdout) if got.stdout.strip() else {})


def served_by(report: dict) -> set[str]:
    return {f["served_by"] for f in report["files"] if f["status"] == "downloaded"}


def skipped(report: dict) -> list[tuple[str, str]]:
    return [(s["source"], s["reason"]) for s in report["skipped"]]


# --- item 1: a cold pull-through cache ---------------------------------------------------------------------

def test_a_pull_through_a_cold_chain_succeeds_with_one_stream_per_blob(tmp_path, chain, model):
    got, report = pull(tmp_path, f"{chain.tiers[1].host}/{REPO}:v1", tmp_path / "node")
    assert got.returncode == 0, got.stderr
    assert tree(tmp_path / "node") == tree(model)
    assert report["bytes_transferred"] == blob_bytes(model)  # each blob once: no copies read and dropped


# --- item 2: mirrors ---------------------------------------------------------------------------------------

@pytest.fixture
def two_registries(tmp_path, model):
    """Two plain registries holding the model as REPO:v1 (mirror A, mirror B), each behind a counting proxy, and
    the reference's own registry (the origin) the same way."""
    with Chain(tmp_path / "a", tiers=0) as a, Chain(tmp_path / "b", tiers=0) as b, Chain(tmp_path / "o", tiers=0) as o:
        for c in (a, b, o):
            got = mm(tmp_path, "push", model, f"{c.origin.host}/{REPO}:v1")
            assert got.returncode == 0, got.stderr
            c.reset()
        yield a.origin, b.origin, o.origin


def test_mirrors_are_asked_in_order_and_the_first_that_answers_serves_every_blob(tmp_path, two_registries, model):
    a, b, origin = two_registries
    got, report = pull(tmp_path, f"{origin.host}/{REPO}:v1", tmp_path / "node", "--mirror", a.host, "--mirror", b.host)
    assert got.returncode == 0, got.stderr
    assert served_by(report) == {f"mirror {a.host}"} and report["skipped"] == []
    assert a.served > blob_bytes(model) and b.served == 0 and origin.served == 0
    assert tree(tmp_path / "node") == tree(model)


def test_a_mirror_serves_each_blob_as_one_stream_hashed_as_it_arrives(tmp_path, two_registries, model):
    a, _, origin = two_registries
    got, report = pull(tmp_path, f"{origin.host}/{REPO}:v1", tmp_path / "node", "--mirror", a.host)
    assert got.returncode == 0, got.stderr
    downloaded = [f for f in report["files"] if f["status"] == "downloaded"]
    assert max(f["size"] for f in downloaded) >= SHARD  # (big enough for 4 ranges from the reference's registry)
    transfer = report["transfer"]
    assert transfer["requests"] == len(downloaded)  # one request per blob, no ranges
    assert transfer["read_back"] == 0 and transfer["hashed_from_window"] == 0  # in order: hashed from the receive buffer
    assert tree(tmp_path / "node") == tree(model)


def test_a_mirror_that_is_down_is_named_and_the_next_source_serves(tmp_path, two_registries, model):
    a, b, origin = two_registries
    a.registry.stop()
    a.close_address()
    got, report = pull(tmp_path, f"{origin.host}/{REPO}:v1", tmp_path / "node", "--mirror", a.host, "--mirror", b.host)
    assert got.returncode == 0, got.stderr
    assert served_by(report) == {f"mirror {b.host}"} and origin.served == 0
    assert {source for source, _ in skipped(report)} == {f"mirror {a.host}"}
    assert all("cannot reach" in reason for _, reason in skipped(report))


def test_when_every_mirror_fails_the_references_own_registry_serves(tmp_path, two_registries, model):
    a, _, origin = two_registries
    a.registry.stop()
    a.close_address()
    got = mm(tmp_path, "pull", f"{origin.host}/{REPO}:v1", "--local-dir", tmp_path / "node", "--mirror", a.host)
    assert got.returncode == 0, got.stderr
    assert f"skipped mirror {a.host} for " in got.stderr and "cannot reach" in got.stderr
    assert f"served by: registry {origin.host}" in got.stdout
    assert tree(tmp_path / "node") == tree(model)


def test_no_fallback_never_reaches_the_references_own_registry(tmp_path, two_registries, model):
    a, _, origin = two_registries
    a.registry.stop()
    a.close_address()
    got = mm(tmp_path, "pull", f"{origin.host}/{REPO}:v1", "--local-dir", tmp_path / "node", "--mirror", a.host,
             "--no-fallback")
    assert got.returncode == 4, got.stderr
    assert f"mirror {a.host}" in got.stderr and "cannot reach" in got.stderr
    assert origin.served == 0
    assert not (tmp_path / "node" / ".mm" / "manifest.json").exists()


def test_no_fallback_without_a_mirror_is_a_usage_error(tmp_path, two_registries):
    _, _, origin = two_registries
    got = mm(tmp_path, "pull", f"{origin.host}/{REPO}:v1", "--local-dir", tmp_path / "node", "--no-fallback")
    assert got.returncode == 2 and "--no-fallback needs at least one --mirror" in got.stderr


def test_a_mirror_serving_a_corrupt_blob_is_named_and_skipped_for_that_blob(tmp_path, two_registries, model):
    a, b, origin = two_registries
    shard = sorted(p for p in tree(model) if p.endswith(".safetensors"))[0]
    digest = next("sha256:" + f["sha256"] for f in json.loads((model / ".mm" / "manifest.json").read_text())["files"]
                  if f["path"] == shard)
    data = a.registry.blob_path(digest)
    corrupt = bytearray(data.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF  # same size: only the digest tells
    data.write_bytes(bytes(corrupt))
    got, report = pull(tmp_path, f"{origin.host}/{REPO}:v1", tmp_path / "node", "--mirror", a.host, "--mirror", b.host)
    assert got.returncode == 0, got.stderr
    assert skipped(report) == [(f"mirror {a.host}", f"{shard}: blob {digest} from mirror {a.host} does not match "
                                                    f"its digest; not kept")]
    by_path = {f["path"]: f["served_by"] for f in report["files"]}
    assert by_path[shard] == f"mirror {b.host}"
    assert {v for k, v in by_path.items() if k != shard} == {f"mirror {a.host}"}
    assert tree(tmp_path / "node") == tree(model)


def test_a_registrys_credentials_never_reach_a_mirror(tmp_path, model):
    """The mirror asks for the same user and password as the registry: had mm sent the registry's credentials
    there, the mirror would have served. It is skipped, wanting a login, and the registry serves."""
    users = {"alice": "s3cret"}
    with Registry(tmp_path / "o", users=users) as origin, Registry(tmp_path / "m", users=users) as mirror:
        for reg in (origin, mirror):
            got = mm(tmp_path, "push", model, f"{reg.host}/{REPO}:v1", "--username", "alice", "--password-stdin",
                     input="s3cret\n")
            assert got.returncode == 0, got.stderr
        logged = len(mirror.log_text())
        got = mm(tmp_path, "pull", f"{origin.host}/{REPO}:v1", "--local-dir", tmp_path / "node", "--mirror",
                 mirror.host, "--username", "alice", "--password-stdin", "--json", input="s3cret\n")
        assert got.returncode == 0, got.stderr
        report = json.loads(got.stdout)
        assert served_by(report) == {f"registry {origin.host}"}
        assert skipped(report)[0][0] == f"mirror {mirror.host}" and "wants a login" in skipped(report)[0][1]
        assert "alice" not in mirror.log_text()[logged:]  # distribution logs the user of every authenticated request


def test_a_tier_killed_mid_pull_the_node_goes_on_from_the_next_source(tmp_path, chain, model):
    t1, t2 = chain.tiers
    got = mm(tmp_path, "preheat", f"{chain.origin.host}/{REPO}:v1", "--tier", t1.host, "--tier", t2.host)
    assert got.returncode == 0, got.stderr
    t2.proxy.rate = 2 * MiB  # slow enough to be killed part-way
    dest = tmp_path / "node"
    proc = subprocess.Popen(mm_argv("pull", f"{chain.origin.host}/{REPO}:v1", "--local-dir", dest, "--mirror", t2.host,
                                    "--mirror", t1.host, "--json"), env=env_for(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while t2.served < SHARD and time.monotonic() < deadline:
        time.sleep(0.05)
    chain.kill(t2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert f"mirror {t1.host}" in served_by(report)
    assert any(source == f"mirror {t2.host}" for source, _ in skipped(report))
    assert tree(dest) == tree(model)
    assert report["verify_problems"] == []


# --- item 3: preheat -------------------------------------------------------------------------------------

def preheat(tmp_path, chain) -> dict:
    got = mm(tmp_path, "preheat", f"{chain.origin.host}/{REPO}:v1", "--tier", chain.tiers[0].host,
             "--tier", chain.tiers[1].url, "--json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_preheat_reads_every_blob_once_from_each_cold_tier_and_says_so(tmp_path, chain, model):
    report = preheat(tmp_path, chain)
    total = report["total_bytes"]
    assert total >= blob_bytes(model)
    assert [(t["tier"], t["fetched"], t["warm"], t["bytes_read"]) for t in report["tiers"]] == [
        (chain.tiers[0].host, report["blobs"], 0, total), (chain.tiers[1].host, report["blobs"], 0, total)]
    # T1 fetched each blob from the origin twice (2.8's store copy and answer copy); T2 from T1 the same, plus
    # the preheat's own read of T1
    assert 2 * total <= chain.origin.served <= 2 * total + 256 * 1024
    assert 3 * total <= chain.tiers[0].served <= 3 * total + 256 * 1024


def test_preheat_on_a_warm_chain_moves_no_blob_bytes(tmp_path, chain):
    preheat(tmp_path, chain)
    chain.reset()
    report = preheat(tmp_path, chain)
    assert [(t["fetched"], t["warm"], t["bytes_read"]) for t in report["tiers"]] == [(0, report["blobs"], 0)] * 2
    assert chain.origin.served < 64 * 1024 and chain.tiers[0].served < 64 * 1024  # manifests and headers only


def test_after_preheat_nodes_add_nothing_at_the_origin_or_t1(tmp_path, chain, model):
    preheat(tmp_path, chain)
    chain.reset()
    procs = [subprocess.Popen(mm_argv("pull", f"{chain.origin.host}/{REPO}:v1", "--local-dir", tmp_path / f"n{i}",
                                      "--mirror", chain.tiers[1].host), env=env_for(tmp_path),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read()
    assert all(tree(tmp_path / f"n{i}") == tree(model) for i in range(4))
    # blob bytes: none; the manifest by tag is still asked upstream by each proxy (distribution checks tags)
    assert chain.origin.served < 64 * 1024 and chain.tiers[0].served < 64 * 1024


def test_preheat_names_a_tier_that_is_down(tmp_path, chain):
    chain.kill(chain.tiers[1])
    got = mm(tmp_path, "preheat", f"{chain.origin.host}/{REPO}:v1", "--tier", chain.tiers[0].host,
             "--tier", chain.tiers[1].host)
    assert got.returncode == 4
    assert chain.tiers[1].host in got.stderr and "cannot reach" in got.stderr


@pytest.mark.parametrize("command,option", [("pull", "--mirror"), ("preheat", "--tier")])
def test_a_mirror_or_tier_named_with_credentials_is_refused_without_echoing_them(tmp_path, command, option):
    extra = ("--local-dir", tmp_path / "node") if command == "pull" else ()
    got = mm(tmp_path, command, f"127.0.0.1:9/{REPO}:v1", *extra, option, "alice:s3cret@127.0.0.1:5000")
    assert got.returncode == 2 and f"{option} ***@127.0.0.1:5000: holds credentials" in got.stderr
    assert "s3cret" not in got.stderr + got.stdout
