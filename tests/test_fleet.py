"""The fleet path: a site registry, pull-through caches in front of it (Debian's docker-registry 2.8 in proxy mode,
origin -> T1 -> T2 on 127.0.0.1), `mm preheat` warming them, and nodes pulling through them with `mm pull
--mirror`. Every figure is counted where it leaves each registry (tests/support/registry_chain.py)."""
from __future__ import annotations

import json
import queue
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


def test_preheat_reads_every_blob_once_from_each_cold_tier_and_leaves_it_stored_there(tmp_path, chain, model):
    from mm.artifacts.oci.client import Client
    from mm.artifacts.oci.reference import Reference
    report = preheat(tmp_path, chain)
    total, n = report["total_bytes"], report["blobs"]
    assert total >= blob_bytes(model)
    assert [(t["tier"], t["fetched"], t["warm"], t["bytes_read"], t["stored"], t["not_stored"])
            for t in report["tiers"]] == [(hop.host, n, 0, total, n, 0) for hop in chain.tiers]
    # T1 fetched each blob from the origin twice (2.8's store copy and answer copy); T2 from T1 the same, plus
    # the preheat's own read of T1; the looks found every blob stored: nothing more
    assert 2 * total <= chain.origin.served <= 2 * total + 256 * 1024
    assert 3 * total <= chain.tiers[0].served <= 3 * total + 256 * 1024
    chain.reset()
    for hop in chain.tiers:  # a look is answered 304 by the tier itself: nothing asked upstream
        with Client(Reference(hop.direct_host, REPO)) as tier:
            assert [tier.blob_in_store(b["digest"], 10) for b in report["tiers"][0]["blobs"]] == [None] * n
    assert chain.origin.served == chain.tiers[0].served == 0


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


BIG_BLOB = 256 * MiB  # streamed by the upstream below as fast as the tier takes it; a look must stop it early
LOOK_COST = 16 * MiB  # what a look at a tier still storing may move at its upstream: the TCP buffers between the
# two fill before the tier's first write to mm fails, whatever mm does (measured here: 1 to 5 MiB; mm's margin)


def test_a_look_at_a_tier_still_storing_moves_only_what_fills_the_buffers_to_its_upstream(tmp_path):
    from mm.artifacts.errors import RetryLater
    from mm.artifacts.oci.client import Client
    from mm.artifacts.oci.reference import Reference
    from tests.support.hostile import HostileServer
    digest = "sha256:" + "ab" * 32
    gets, sent = [], queue.Queue()

    def upstream(req, out):  # its first two blob GETs (the tier's store copy and its answer copy) never end
        if req.path == "/v2/":
            return out.send(200, {"Content-Type": "application/json"}, b"{}")
        head = {"Content-Length": str(BIG_BLOB), "Docker-Content-Digest": digest}
        if req.method == "HEAD":
            return out.head(200, head)
        gets.append(req)
        out.head(200, head)
        if len(gets) <= 2:
            return out.stall(60)
        n = 0
        try:
            for _ in range(BIG_BLOB // MiB):
                out.body(bytes(MiB))
                n += MiB
        finally:
            sent.put(n)  # what this copy handed to the kernel before the tier closed it

    with HostileServer(upstream) as origin, Registry(tmp_path / "t1", proxy=origin.url) as t1, \
            Client(Reference(t1.host, REPO)) as tier:
        with pytest.raises(RetryLater):  # a cold tier: the look starts its store, whose copy stalls, as does the answer
            tier.blob_in_store(digest, 1.0)
        answers = [tier.blob_in_store(digest, 10) for _ in range(3)]
        costs = [sent.get(timeout=30) for _ in answers]
    assert all("from its upstream (200" in a for a in answers), answers
    assert max(costs) < LOOK_COST, costs


class StoringTier:
    """A tier as the wait sees it: every blob still being stored (answered from its upstream) until STORED_AT on
    the CLOCK, then from its own store."""

    def __init__(self, stored_at: float):
        self.stored_at, self.now, self.asked = stored_at, [0.0], []

    def clock(self) -> float:
        return self.now[0]

    def sleep(self, seconds: float) -> None:
        self.now[0] += seconds

    def blob_in_store(self, digest: str, within: float) -> str | None:
        self.asked.append((round(self.now[0], 2), digest))
        return None if self.now[0] >= self.stored_at else "it answered from its upstream (200, no ETag)"


def test_a_blob_still_being_stored_postpones_the_looks_at_the_others_so_the_big_one_is_asked_once():
    from mm.artifacts.oci.preheat import BlobAtTier, wait_stored
    small, big = (BlobAtTier(f"sha256:{c * 64}", size, "fetched", size, read_seconds=0.4)
                  for c, size in (("a", 1024), ("b", 256 * MiB)))
    tier = StoringTier(stored_at=1.0)
    got = wait_stored(tier, (big, small), clock=tier.clock, sleep=tier.sleep)
    # the smallest first, the slowest read's time after the reads ended, then the pause doubles: 0.4 s, 1.2 s
    assert tier.asked == [(0.4, small.digest), (1.2, small.digest), (1.2, big.digest)]
    assert [(b.stored, b.looks, round(b.stored_after, 2)) for b in got] == [(True, 1, 1.2), (True, 2, 1.2)]
