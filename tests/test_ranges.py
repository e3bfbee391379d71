"""artifacts/fetching/ranges.py: range map, planning, in-order hashing and the answers a server should not give.

A byte source of our own (the RangeSource protocol over bytes in memory) stands in for the network here; the
same paths through the real client and the local Hub server are in test_fetch_wan.py."""
from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from contextlib import contextmanager

import blake3
import pytest

from mm.artifacts.errors import RemoteError
from mm.artifacts.integrity.hashing import StreamHasher, git_blob_header
from mm.artifacts.fetching import ranges
from mm.artifacts.fetching.ranges import (BUDGET_FACTOR, BUDGET_MARGIN, BUFFER, MiB, RANGE_MAX, SAVE_SECONDS, Answer,
                                          Connections, RangedJob, RangeMap, RetryLater, TransferStats, chunk_reader,
                                          download, file_share, load_state, plan_ranges, prove, range_size, save_state,
                                          state_path)


# --- the range map ---

def test_range_map_merges_touching_and_overlapping_intervals():
    m = RangeMap(100)
    for s, e in [(10, 20), (30, 40), (20, 25), (35, 50), (0, 5), (60, 70), (45, 61)]:
        m.add(s, e)
    assert m.intervals() == [(0, 5), (10, 25), (30, 70)]
    assert m.done == 5 + 15 + 40 and m.prefix() == 5
    assert m.gaps() == [(5, 10), (25, 30), (70, 100)]
    assert m.gaps(12, 33) == [(25, 30)]
    m.add(0, 100)
    assert m.complete and m.gaps() == []


def test_range_map_round_trips_and_refuses_another_file_or_nonsense():
    m = RangeMap(1000, [(0, 100), (500, 600)])
    doc = json.loads(json.dumps(m.to_json("abc")))
    assert RangeMap.from_json(doc, 1000, "abc").intervals() == [(0, 100), (500, 600)]
    assert RangeMap.from_json(doc, 1000, "other") is None  # another upstream identity
    assert RangeMap.from_json(doc, 999, "abc") is None  # another size
    for bad in ([[0, 2000]], [[5, 5]], [[1.5, 3]], [[True, 3]], [[0]], "x"):
        assert RangeMap.from_json({**doc, "done": bad}, 1000, "abc") is None


def test_state_of_a_partial_without_a_map_is_its_prefix_and_a_damaged_map_restarts(tmp_path):
    partial = tmp_path / "x.part"
    partial.write_bytes(b"a" * 300)
    assert load_state(partial, 1000, "id").intervals() == [(0, 300)]  # mm's earlier sequential partials
    save_state(partial, RangeMap(1000, [(0, 100), (700, 800)]), "id")
    assert load_state(partial, 1000, "id").intervals() == [(0, 100), (700, 800)]
    state_path(partial).write_text("{not json")
    assert load_state(partial, 1000, "id").done == 0 and not partial.exists()


# --- planning ---

def test_one_huge_file_gets_every_connection_and_a_small_file_one():
    assert file_share(1 << 30, 16) == 16 and range_size(1 << 30, 16) == RANGE_MAX
    assert file_share(100_000, 16) == 1
    assert range_size(64 * MiB, 16) == 4 * MiB and file_share(64 * MiB, 16) == 16
    assert plan_ranges([(0, 10), (20, 45)], 10) == [(0, 10), (20, 30), (30, 40), (40, 45)]
    assert plan_ranges([(0, 41)], 10) == [(0, 10), (10, 20), (20, 30), (30, 41)]  # no 1-byte tail request
    ranges = plan_ranges([(0, 64 * MiB)], 8 * MiB, tail=4)  # the last 4 ranges halved: connections finish together
    assert [e - s for s, e in ranges] == [8 * MiB] * 4 + [4 * MiB] * 8 and ranges[-1][1] == 64 * MiB


# --- how many connections: start with 16, add more while they pay ---

class Demand:
    """N threads each holding a slot of CONNECTIONS until stopped (those past the limit wait: the demand)."""

    def __init__(self, connections: Connections, n: int):
        self.connections, self.stop, self.holding = connections, threading.Event(), 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _hold(self) -> None:
        with self.connections.slot():
            with self._lock:
                self.holding += 1
            self.stop.wait()

    def settle(self, holding: int) -> None:
        deadline = time.monotonic() + 10
        while self.holding != holding and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.holding == holding

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def windows(connections: Connections, clock: list[float], rates: list[float]) -> None:
    """One measurement window per rate (bytes/s), on the fake CLOCK (the first bytes open the first window)."""
    connections.landed(0)
    for rate in rates:
        for _ in range(4):  # quarters of a window: exact in binary, so a window ends exactly on its last step
            clock[0] += Connections.WINDOW / 4
            connections.landed(int(rate * Connections.WINDOW / 4))


def test_connections_are_added_while_the_aggregate_rate_grows_with_them():
    clock = [0.0]
    c = Connections(64, clock=lambda: clock[0])
    demand = Demand(c, 80)
    try:
        demand.settle(16)  # 16 to start with
        windows(c, clock, [100e6, 320e6])  # opening (not judged), then the rate at 16
        demand.settle(32)  # ranges were waiting: the limit doubled
        windows(c, clock, [640e6])  # the 16 more paid
        demand.settle(64)
        windows(c, clock, [1280e6, 1280e6])
        assert c.limit == 64 and c.peak == 64
    finally:
        demand.end()


def test_connections_added_that_do_not_raise_the_rate_are_given_back_for_good():
    clock = [0.0]
    c = Connections(32, clock=lambda: clock[0])
    demand = Demand(c, 40)
    try:
        windows(c, clock, [100e6, 300e6])
        demand.settle(32)
        windows(c, clock, [340e6])  # +13% for twice the connections: not worth their CPU
        assert c.limit == 16
        windows(c, clock, [300e6] * 4)
        assert c.limit == 16 and c.peak == 32
    finally:
        demand.end()


def test_connections_are_not_added_without_ranges_waiting_for_one():
    clock = [0.0]
    c = Connections(32, clock=lambda: clock[0])
    demand = Demand(c, 8)  # eight small files, one connection each
    try:
        demand.settle(8)
        for rate in [100e6] + [160e6] * 4:
            windows(c, clock, [rate])
            assert c.limit == 16
        assert c.peak == 8
    finally:
        demand.end()


def test_an_explicit_budget_of_16_or_less_is_used_as_given():
    c = Connections(12)
    assert c.limit == 12
    clock = [0.0]
    c = Connections(12, clock=lambda: clock[0])
    demand = Demand(c, 20)
    try:
        windows(c, clock, [100e6, 100e6, 300e6, 900e6])  # would be judged worth growing
        demand.settle(12)
        assert c.limit == 12
    finally:
        demand.end()


# --- downloads from a source in memory ---

class MemorySource:
    """RangeSource over bytes in memory; `answer(start, end, n)` may change what request n gets."""

    label = "memory"

    def __init__(self, data: bytes, chunk: int = 64 * 1024, delay: float = 0.0, answer=None):
        self.data, self.chunk, self.delay, self.answer = data, chunk, delay, answer
        self.requests: list[tuple[int, int | None]] = []
        self.sent = 0
        self._lock = threading.Lock()

    @contextmanager
    def stream(self, path, start, end=None):
        with self._lock:
            self.requests.append((start, end))
            n = len(self.requests)
        body_start, body_end, cut = start, len(self.data) if end is None else end, None
        if self.answer is not None:
            body_start, body_end, cut = self.answer(start, end, n, body_start, body_end)
        size = len(self.data)
        whole = body_start == 0 and body_end >= size
        yield Answer(200 if whole else 206, None if whole else f"bytes {body_start}-{body_end - 1}/{size}",
                     chunk_reader(self._chunks(body_start, body_end, cut)))

    def _chunks(self, start, end, cut):
        pos = start
        while pos < end:
            if cut is not None and pos - start >= cut:
                raise RetryLater("cut", "cut")
            piece = self.data[pos:min(end, pos + self.chunk)]
            with self._lock:
                self.sent += len(piece)
            pos += len(piece)
            if self.delay:
                time.sleep(self.delay)
            yield piece


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def job(tmp_path, data: bytes, lfs: bool = True) -> RangedJob:
    hasher = StreamHasher(sha256=True, git_size=None if lfs else len(data))
    return RangedJob("w.bin", len(data), tmp_path / "w.part", "id-1", hasher)


def check_digests(result, data: bytes, git: bool = False):
    assert result.digests.size == len(data)
    assert result.digests.sha256 == hashlib.sha256(data).hexdigest()
    assert result.digests.blake3 == blake3.blake3(data).hexdigest()
    if git:
        assert result.digests.git_sha1 == hashlib.sha1(git_blob_header(len(data)) + data).hexdigest()


def test_many_connections_give_the_same_digests_as_one_read(tmp_path):
    data = payload(20 * MiB + 12345)
    src = MemorySource(data, delay=0.0005)
    result = download(job(tmp_path, data, lfs=False), src, Connections(8))
    check_digests(result, data, git=True)
    assert (tmp_path / "w.part").read_bytes() == data
    assert result.connections > 1 and result.transferred == len(data) and src.sent == len(data)
    assert all(end is None or end - start <= range_size(len(data), 8) for start, end in src.requests)


def test_one_connection_asks_once_for_the_whole_file_however_big(tmp_path):
    data = payload(RANGE_MAX * 2 + 5)
    src = MemorySource(data, chunk=1 << 20)
    check_digests(download(job(tmp_path, data), src, Connections(1)), data)
    assert src.requests == [(0, None)]  # no Range header: what a mirror that ignores range ends gets too


def first_range_crawls(data: bytes) -> MemorySource:
    """A source whose first range (from byte 0) crawls while the others land at once: they land ahead of the
    hashing frontier."""
    src = MemorySource(data, chunk=256 * 1024)
    original = src._chunks

    def chunks(start, end, cut):
        for piece in original(start, end, cut):
            if start == 0:
                time.sleep(0.01)
            yield piece
    src._chunks = chunks
    return src


def test_ranges_landing_out_of_order_are_hashed_in_file_order(tmp_path):
    data = payload(8 * MiB)
    check_digests(download(job(tmp_path, data), first_range_crawls(data), Connections(8)), data)


def test_ranges_landing_ahead_of_the_frontier_are_hashed_from_memory_not_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(ranges, "WINDOW", 64)  # room for every piece, however small a slow machine's batches get
    data = payload(16 * MiB)
    stats = TransferStats()
    result = download(job(tmp_path, data), first_range_crawls(data), Connections(8), stats)
    check_digests(result, data)
    assert result.read_back == 0
    report = stats.report()
    assert report["read_back"] == 0 and report["hashed_from_window"] >= 8 * MiB  # most bytes landed ahead


def test_bytes_the_full_window_cannot_hold_are_read_back_from_disk_and_hashed_right(tmp_path, monkeypatch):
    monkeypatch.setattr(ranges, "WINDOW", 1)
    data = payload(16 * MiB)
    stats = TransferStats()
    result = download(job(tmp_path, data), first_range_crawls(data), Connections(8), stats)
    check_digests(result, data)
    report = stats.report()
    assert result.read_back == report["read_back"] > 0
    assert report["read_back"] + report["hashed_from_window"] <= len(data)


def test_the_window_never_holds_more_than_its_blocks_whatever_order_ranges_land_in(tmp_path, monkeypatch):
    monkeypatch.setattr(ranges, "WINDOW", 4)
    most = []
    spare = ranges._RECEIVE.spare

    def counted(limit):
        view = spare(limit)
        most.append(ranges._RECEIVE._spared)
        return view
    monkeypatch.setattr(ranges._RECEIVE, "spare", counted)
    data = payload(24 * MiB)
    check_digests(download(job(tmp_path, data), first_range_crawls(data), Connections(8)), data)
    assert most and max(most) <= 4
    assert ranges._RECEIVE._spared == ranges._RECEIVE._lent == 0  # every block back in the pool once the file is done


def test_a_rerun_asks_only_for_the_gaps_of_the_range_map(tmp_path):
    data = payload(6 * MiB)
    partial = tmp_path / "w.part"
    with open(partial, "wb") as f:
        f.write(data[:MiB])
        f.seek(3 * MiB)
        f.write(data[3 * MiB:4 * MiB])
    save_state(partial, RangeMap(len(data), [(0, MiB), (3 * MiB, 4 * MiB)]), "id-1")
    src = MemorySource(data)
    result = download(job(tmp_path, data), src, Connections(4))
    check_digests(result, data)
    assert result.resumed_from == 2 * MiB and src.sent == 4 * MiB
    assert all(s >= MiB and not (3 * MiB <= s < 4 * MiB) for s, _ in src.requests)


def test_a_server_ignoring_range_is_used_from_byte_0_never_appended(tmp_path):
    data = payload(12 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (0, len(data), None))
    result = download(job(tmp_path, data), src, Connections(8))
    check_digests(result, data)
    assert len(src.requests) <= 8 and src.sent <= 8 * len(data)


def test_a_200_to_a_range_request_becomes_the_files_one_stream(tmp_path):
    """A pull-through cache on a miss: every Range request gets the whole file. The first answer is the stream;
    no other connection is opened for the file, and no byte arrives twice."""
    data = payload(12 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (0, len(data), None))
    result = download(job(tmp_path, data), src, Connections(8))
    check_digests(result, data)
    assert len(src.requests) == 1 and src.sent == len(data) and result.transferred == len(data)


def test_a_200_to_a_resumed_range_reads_past_the_bytes_kept_and_ends_right(tmp_path):
    data = payload(6 * MiB)
    partial = tmp_path / "w.part"
    partial.write_bytes(data[:2 * MiB])  # a killed run's prefix
    save_state(partial, RangeMap(len(data), [(0, 2 * MiB)]), "id-1")
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (0, len(data), None))
    result = download(job(tmp_path, data), src, Connections(8))
    check_digests(result, data)
    assert len(src.requests) == 1 and result.resumed_from == 2 * MiB
    assert result.transferred == len(data)  # the kept prefix read and dropped once: one stream in all


def test_a_200_stream_cut_part_way_goes_on_as_one_stream_within_the_budget(tmp_path):
    data = payload(6 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (0, len(data), 4 * MiB if n == 1 else None))
    stats = TransferStats()
    result = download(job(tmp_path, data), src, Connections(8), stats)
    check_digests(result, data)
    assert len(src.requests) == 2 and src.sent == 4 * MiB + len(data)  # the second stream skips the first's bytes
    assert stats.report()["retries_by_reason"] == {"cut": 1}


def test_a_206_starting_before_the_offset_asked_uses_the_bytes_at_their_offsets(tmp_path):
    data = payload(6 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (max(0, start - 300), be, None))
    result = download(job(tmp_path, data), src, Connections(4))
    check_digests(result, data)
    assert len(src.requests) == len(plan_ranges([(0, len(data))], range_size(len(data), 4)))


def test_a_206_starting_after_the_offset_asked_falls_back_to_the_whole_file(tmp_path):
    data = payload(6 * MiB)

    def later(start, end, n, bs, be):
        return (bs + 1000, be, None) if end is not None or start else (bs, be, None)
    src = MemorySource(data, answer=later)
    stats = TransferStats()
    result = download(job(tmp_path, data), src, Connections(4), stats)
    check_digests(result, data)
    assert (0, None) in src.requests and len(src.requests) <= 12
    assert stats.report()["retries_by_reason"]["wrong-range"] >= 2


def test_a_server_always_answering_at_the_wrong_offset_fails_after_bounded_requests(tmp_path):
    data = payload(3 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (bs + 1, be, None) if start else (5, be, None))
    with pytest.raises(RemoteError, match="failed attempts in a row"):
        download(job(tmp_path, data), src, Connections(4))
    assert len(src.requests) <= 4 * 8


def test_cuts_are_retried_from_where_they_stopped_without_losing_bytes(tmp_path):
    data = payload(4 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (bs, be, 300_000 if n <= 3 else None))
    stats = TransferStats()
    result = download(job(tmp_path, data), src, Connections(4), stats)
    check_digests(result, data)
    assert src.sent == len(data) and stats.report()["retries"] == 3


def test_the_retry_budget_bounds_the_whole_fetch_and_keeps_the_partial(tmp_path):
    data = payload(2 * MiB)
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (bs, be, 0))
    stats = TransferStats(retry_budget=2)
    with pytest.raises(RemoteError, match="retry budget spent"):
        download(job(tmp_path, data), src, Connections(1), stats)
    assert stats.report()["retries"] == 2 and state_path(tmp_path / "w.part").exists()


def test_a_body_longer_than_the_file_is_never_read_past_the_file_end(tmp_path):
    data = payload(MiB // 2)
    src = MemorySource(data + b"extra", chunk=len(data) + 5)
    check_digests(download(job(tmp_path, data), src, Connections(2)), data)
    assert (tmp_path / "w.part").read_bytes() == data


# --- answers are proven before a byte is kept; each file has a budget ---

@pytest.mark.parametrize("status,content_range,length,span", [
    (200, None, None, (0, 1000)),
    (200, None, 1000, (0, 1000)),
    (206, "bytes 10-19/1000", 10, (10, 20)),
    (206, "bytes 990-999/*", None, (990, 1000)),
    (206, "bytes banana", None, None),
    (206, "bytes */1000", None, None),
    (206, None, None, None),
    (206, "bytes 10-19/999", None, None),  # another file's size
    (206, "bytes 20-10/1000", None, None),
    (206, "bytes 990-1000/1000", None, None),  # past the end of the file
    (206, "bytes 10-19/1000", 11, None),  # Content-Length disagrees
    (200, None, 1001, None),
    (206, "bytes 0-9/1000, 20-29/1000", None, None),  # multipart, not asked for
])
def test_an_answer_is_used_only_where_its_status_and_headers_prove_it_belongs(status, content_range, length, span):
    answer = Answer(status, content_range, lambda view: 0, length)
    if span is None:
        with pytest.raises(RetryLater, match="none of its bytes kept"):
            prove(answer, 1000, "f: hostile")
    else:
        assert prove(answer, 1000, "f: hostile") == span


class ProvesNothing(MemorySource):
    @contextmanager
    def stream(self, path, start, end=None):
        self.requests.append((start, end))
        yield Answer(206, "bytes banana", chunk_reader(iter([self.data[:MiB]])))


def test_bytes_of_an_answer_that_proves_nothing_are_never_written_nor_recorded(tmp_path):
    data = payload(3 * MiB)
    with pytest.raises(RemoteError, match="bytes banana"):
        download(job(tmp_path, data), ProvesNothing(data), Connections(4))
    assert json.loads(state_path(tmp_path / "w.part").read_text())["done"] == []
    assert (tmp_path / "w.part").read_bytes().strip(b"\0") == b""


def test_a_file_that_receives_more_than_its_byte_budget_fails_saying_the_server_answers_wrongly(tmp_path):
    data = payload(4 * MiB)
    # every request answered with the whole file from byte 0, cut a little past the offset asked: progress each
    # time, but every answer re-sends everything before it
    src = MemorySource(data, answer=lambda start, end, n, bs, be: (0, len(data), start + 256 * 1024))
    with pytest.raises(RemoteError, match="answers wrongly: .* bytes received, more than its budget"):
        download(job(tmp_path, data), src, Connections(1), TransferStats(retry_budget=10_000))
    assert src.sent <= BUDGET_FACTOR * len(data) + BUDGET_MARGIN + BUFFER


def test_a_file_that_needs_more_than_its_request_budget_fails_saying_the_server_answers_wrongly(tmp_path):
    data = payload(2 * MiB)
    src = MemorySource(data, chunk=100, answer=lambda start, end, n, bs, be: (bs, be, 100))  # 100 bytes an answer
    with pytest.raises(RemoteError, match="answers wrongly: more than 68 requests"):
        download(job(tmp_path, data), src, Connections(2), TransferStats(retry_budget=10_000))
    assert len(src.requests) <= 68 + 2


def test_a_trickle_is_cut_by_the_minimum_rate_and_asked_again_on_a_fresh_request(tmp_path, monkeypatch):
    monkeypatch.setenv("MM_NET_MIN_RATE", "100000")
    monkeypatch.setenv("MM_NET_RATE_WINDOW", "0.2")
    data = payload(MiB // 2)
    slow_first = MemorySource(data, chunk=1000, answer=lambda start, end, n, bs, be: (bs, be, None))
    original = slow_first._chunks

    def chunks(start, end, cut):
        for piece in original(start, end, cut):
            if len(slow_first.requests) == 1:
                time.sleep(0.05)  # 20 KB/s on the first request only
            yield piece
    slow_first._chunks = chunks
    stats = TransferStats()
    check_digests(download(job(tmp_path, data), slow_first, Connections(1), stats), data)
    assert stats.report()["retries_by_reason"] == {"slow": 1} and len(slow_first.requests) == 2


def test_a_trickle_that_never_speeds_up_fails_the_file_after_bounded_attempts(tmp_path, monkeypatch):
    monkeypatch.setenv("MM_NET_MIN_RATE", "100000")
    monkeypatch.setenv("MM_NET_RATE_WINDOW", "0.1")
    monkeypatch.setenv("MM_NET_BACKOFF", "0.01")
    data = payload(MiB // 2)
    with pytest.raises(RemoteError, match="less than MM_NET_MIN_RATE .* failed attempts in a row"):
        download(job(tmp_path, data), MemorySource(data, chunk=500, delay=0.02), Connections(1))


def test_the_range_map_is_saved_at_most_every_save_seconds_however_many_connections(tmp_path, monkeypatch):
    from mm.artifacts.fetching import ranges
    saves = []
    real = ranges.save_state
    monkeypatch.setattr(ranges, "save_state", lambda *a: (saves.append(time.monotonic()), real(*a)))
    data = payload(24 * MiB)
    started = time.monotonic()
    check_digests(download(job(tmp_path, data), MemorySource(data, chunk=64 * 1024, delay=0.03), Connections(16)),
                  data)
    seconds = time.monotonic() - started
    assert seconds > 0.6  # long enough for the bound to mean something
    assert len(saves) <= seconds / SAVE_SECONDS + 3, (len(saves), seconds)  # + the first, the last, one in between
    periodic = saves[1:-1]  # between the save before any write and the forced one at the end
    assert all(b - a >= 0.9 * SAVE_SECONDS for a, b in zip(periodic, periodic[1:])), periodic  # no burst of saves
