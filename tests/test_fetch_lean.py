"""What keeps a fetch's fixed and per-file costs down without changing what it proves: a file's
connection threads follow the slots it gets, body reads on a plain socket wait for a batch of bytes (SO_RCVLOWAT)
but never past the body's end nor into the next answer's headers, a full sha is resolved in one request, the
environment's proxies are read once per fetch, and the hasher keeps up with the bytes."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest

from mm.artifacts.edges import wire
from mm.artifacts.fetching.ranges import Connections, MiB, download
from tests.test_ranges import MemorySource, check_digests, job, payload


# --- threads follow the slots ---------------------------------------------------------------------

class CountingSource(MemorySource):
    """MemorySource that records the most connection threads alive while a range is asked for."""

    def __init__(self, data: bytes, **kwargs):
        super().__init__(data, **kwargs)
        self.most_threads = 0

    @contextmanager
    def stream(self, path, start, end=None):
        alive = sum(1 for t in threading.enumerate() if t.name == "mm-range")
        self.most_threads = max(self.most_threads, alive)
        with super().stream(path, start, end) as answer:
            yield answer


def test_a_file_starts_a_thread_per_slot_it_gets_plus_one_waiting_not_its_whole_share(tmp_path):
    data = payload(32 * MiB, seed=11)  # 32 ranges of 1 MiB: a share of 32 connections
    source = CountingSource(data, delay=0.002)
    budget = Connections(32, start=4)  # 4 slots open; the rest are opened only if they pay
    budget._settled = True  # (held at 4 for the test)
    check_digests(download(job(tmp_path, data), source, budget), data)
    # the caller's thread is not named mm-range: 3 more in slots, at most one waiting (31 before)
    assert source.most_threads <= 4


# --- body reads in batches, never past the body -------------------------------------------------------

def keep_alive_server(answers: list[list[tuple[float, bytes]]]) -> str:
    """A plain HTTP/1.1 server on 127.0.0.1 answering the requests of one kept-alive connection in turn: answer i
    is a 200 whose body is the pieces of ANSWERS[i], each sent after its pause (seconds); the connection stays open
    after each body. Returns its URL."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for pieces in answers:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % sum(len(p) for _, p in pieces))
                for pause, piece in pieces:
                    time.sleep(pause)
                    conn.sendall(piece)
            time.sleep(5)
        finally:
            conn.close()
            srv.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/f"


def read_body(raw: wire.RawAnswer, view_size: int = 2 * MiB) -> bytes:
    view = memoryview(bytearray(view_size))
    out = bytearray()
    while n := raw.readinto(view):
        out += view[:n]
    return bytes(out)


def test_a_read_waits_for_a_batch_only_where_the_rest_of_the_body_holds_twice_it():
    # (a reader that took some bytes, then waits, is woken only by a whole batch more: the body must still hold it)
    fast = 100e6  # bytes/s: 5 MB in LOWAT_SECONDS, so a batch of LOWAT_MAX (1 MiB)
    assert wire.batch_size(fast, 2 * MiB, 2 * MiB) == MiB
    assert wire.batch_size(fast, 2 * MiB, 2 * MiB - 1) == 1
    assert wire.batch_size(fast, MiB - 1, 64 * MiB) == 1  # nor past what the read asks for


def test_a_batch_is_what_the_connection_brings_in_50_ms():
    assert wire.batch_size(20e6, 2 * MiB, 64 * MiB) == 512 << 10  # 1 MB in 50 ms: 512 KiB, a power of 2
    assert wire.batch_size(1e6, 2 * MiB, 64 * MiB) == 1  # 50 KB: below LOWAT_MIN, reads take what arrived


def test_the_next_answer_on_a_kept_connection_is_read_from_its_first_byte(monkeypatch):
    # A body may end on a read that waited for a batch (SO_RCVLOWAT set): the next answer's headers are 40 bytes,
    # and a socket still waiting for a batch would not even report them readable until MM_NET_TIMEOUT.
    monkeypatch.setenv("MM_NET_TIMEOUT", "5")
    url = keep_alive_server([[(0, b"first")], [(0, b"second")]])
    raw = wire.open_raw(url, {}, "test server")
    try:
        assert read_body(raw) == b"first"
        raw._wait_for(wire.LOWAT_MAX)  # (as the body's last read left it)
    finally:
        raw.close()
    began = time.monotonic()
    again = wire.open_raw(url, {}, "test server")  # the same connection, kept
    try:
        assert read_body(again) == b"second"
        assert time.monotonic() - began < 2
    finally:
        again.close()


def test_reads_of_a_fast_body_bring_batches_not_whatever_arrived(monkeypatch):
    monkeypatch.setenv("MM_NET_TIMEOUT", "5")
    pieces = [(0.005, payload(128 << 10, seed=i)) for i in range(64)]  # 8 MiB in 128 KiB pieces, 5 ms apart
    url = keep_alive_server([pieces])
    raw = wire.open_raw(url, {}, "test server")
    sizes = []
    try:
        view = memoryview(bytearray(2 * MiB))
        while n := raw.readinto(view):
            sizes.append(n)
    finally:
        raw.close()
    assert sum(sizes) == 8 * MiB
    # ~25 MB/s: each read waits for what 50 ms bring (a batch of 0.5-1 MiB), not one 128 KiB piece per read (64)
    assert len(sizes) < 32


# --- start-up: fewer requests and less work per request ----------------------------------------------

def test_a_full_sha_is_resolved_in_one_request(hub_server, model_repo):
    from mm.artifacts.fetching.hub import resolve_revision

    commit = model_repo.commits[0]
    before = len(hub_server.requests)
    resolved = resolve_revision(model_repo.repo_id, commit, endpoint=hub_server.url)
    assert (resolved.commit, resolved.kind) == (commit, "commit")
    assert [path for _, path, _ in hub_server.requests[before:]] == [
        f"/api/models/{model_repo.repo_id}/revision/{commit}"]  # no list of refs first


def test_a_fetch_of_a_full_sha_that_is_no_commit_says_revision_not_found(run_mm, hub_env, model_repo, tmp_path):
    missing = "0123456789abcdef0123456789abcdef01234567"
    r = run_mm("fetch", model_repo.repo_id, "--revision", missing, "--local-dir", str(tmp_path / "m"), env=hub_env)
    assert r.returncode == 4, r.stderr
    assert f"{model_repo.repo_id}@{missing}: revision not found on the Hub" in r.stderr


def test_proxies_are_read_from_the_environment_once(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxies = wire.Proxies()
    assert proxies.for_url("http://cdn.example/a") == "http://proxy.invalid:3128"
    monkeypatch.setenv("NO_PROXY", "cdn.example")
    assert proxies.for_url("http://cdn.example/b") == "http://proxy.invalid:3128"  # kept for the fetch
    assert wire.Proxies().for_url("http://cdn.example/b") is None  # a new fetch reads it again


# --- the hasher keeps up: a prefix from the first second, reads beside both hashes --------------------------

def test_the_first_ranges_of_a_big_file_grow_so_that_side_by_side_they_end_in_file_order():
    from mm.artifacts.fetching.ranges import RANGE_MIN, plan_ranges

    ranges = plan_ranges([(0, 1 << 30)], 16 * MiB, tail=16, head=16)
    sizes = [e - s for s, e in ranges[:17]]
    assert sizes[0] == RANGE_MIN and sizes == sorted(sizes) and sizes[15] == sizes[16] == 16 * MiB
    assert [s for s, _ in ranges[1:]] == [e for _, e in ranges[:-1]] and ranges[-1][1] == 1 << 30  # no gap, no overlap


def test_a_file_of_few_ranges_keeps_them_even():
    from mm.artifacts.fetching.ranges import plan_ranges

    assert plan_ranges([(0, 64 * MiB)], 4 * MiB, head=16) == plan_ranges([(0, 64 * MiB)], 4 * MiB)  # 16 < 4 x 16


def test_hashing_in_cache_slices_gives_the_digests_of_one_pass():
    import hashlib

    import blake3

    from mm.artifacts.integrity.hashing import CACHE_SLICE, StreamHasher

    data = payload(9 * MiB + 123, seed=7)
    hasher = StreamHasher(sha256=True, git_size=len(data))
    cuts = [0, 4 * MiB + 5, 4 * MiB + 5 + CACHE_SLICE - 1, len(data)]  # many slices and a short last one; one short
    for start, end in zip(cuts, cuts[1:]):
        hasher.update(memoryview(data)[start:end])
    digests = hasher.digests()
    assert (digests.size, digests.blake3, digests.sha256) == (
        len(data), blake3.blake3(data).hexdigest(), hashlib.sha256(data).hexdigest())
    assert digests.git_sha1 == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
