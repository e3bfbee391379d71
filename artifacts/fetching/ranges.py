"""Ranged downloads: one file over several connections, a range map that survives kill -9, hashing in file order.

A file is cut into byte ranges (``range_size``) fetched by up to ``file_share`` connections at once, drawn from
one budget (``Connections``, ``mm fetch --connections``) shared by every file of the fetch: one huge shard gets
all of them, many small files get one each. The last ranges of a file are shorter, so its connections finish
together. (A range in flight is never split: the bytes a server has already pushed past a new end would be
received for nothing, megabytes per connection on a fast link.)

Bytes are written at their offset in the partial file and recorded in a ``RangeMap`` saved beside it
(``<partial>.ranges``, rewritten by rename at most every ``SAVE_SECONDS``), so a rerun after kill -9 asks only for
the gaps. Every byte is received into a pooled receive buffer (``BUFFER``, one socket read at a time:
``Answer.read``) and written from it at the offset its answer proved, with O_DIRECT where the file system allows
it (``Disk``: no copy into the page cache; the unaligned edges of a write are buffered). Hashing stays one pass
over each byte, in file order (``OrderedHasher``): bytes that land exactly at the hashed frontier are hashed from
that buffer; bytes that land ahead of it are kept in memory near the frontier (the window, at most ``WINDOW``
buffers in all) and hashed from there once the contiguous prefix reaches them; what the window cannot hold is
read back (direct), and counted. Memory is bounded by the buffers: one per connection in use, the window's, two per
file being read back, at most ``HASHING_AT_ONCE`` files at once, whatever the file sizes.

Answers are hostile until proven, for every source (the Hub, its CDN, a mirror, an OCI registry): a body is used
only at the offsets its answer proves (``prove``: a 200 is the whole file from byte 0; a 206 needs a
``Content-Range: bytes S-E/SIZE`` that fits the file; anything else, ``bytes banana``, ``bytes */N`` or none, is
refused before a byte is written or recorded). A 200 to a Range request means the server does not honour Range
for that file now (a pull-through cache on a miss, a mirror that ignores it): that answer becomes the file's
single stream (as aria2c does), bytes already here are read and dropped, no other connection is used for the
file any more, and the file's byte budget covers, once, what was received so far plus what the answer declares
(the file's size): a cold cache costs one more stream, not a failure. A 206 whose Content-Range starts earlier is used at its true
offsets, becoming the file's single stream when the gap is large; a body that starts after the offset asked is
refused and, after a second time, the whole file is asked for without Range. A file's first request goes
alone; its other connections start once a 206 proved that the server honours Range. Failures are retried per range with backoff (``Retry-After``
honoured) within a per-range limit and a budget for the whole fetch. Each file has its own budget too: bytes
received at most 1.5x its size plus ``BUDGET_MARGIN``, requests at most twice its planned ranges plus
``REQUEST_MARGIN``; past either the file fails (exit 4: the server answers wrongly) and keeps its partial. A
connection that averages less than ``MM_NET_MIN_RATE`` over ``MM_NET_RATE_WINDOW`` (artifacts/edges/wire.py) is cut
and the range retried on a fresh one. Workers loop while the file has no error (``_File.error``) and no stop
was asked (artifacts/edges/interrupt.py); bytes already in a buffer are kept either way.
"""
from __future__ import annotations

import bisect
import errno
import http.client
import json
import math
import mmap
import os
import re
import threading
import time
from collections import Counter, deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Protocol

from ..edges import wire
from ..errors import BadInput, MMError, RemoteError, RetryLater
from ..edges.fsutil import atomic_write_bytes, check_inside, open_file, read_local_file, unlink_file
from ..integrity.hashing import Digests, SideThread, StreamHasher
from ..edges import interrupt  # the stop flag: workers return within a chunk, the map is saved (interrupt.py)
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..edges.untrusted import load_json, shown

MiB = 1 << 20
DEFAULT_CONNECTIONS = 32  # the most at once; Connections opens 16 and adds more while they pay
RANGE_MAX = 16 * MiB  # ranges no longer than this keep the hashing frontier close behind the downloads
RANGE_MIN = 1 * MiB  # a file smaller than this is one request
SKIP_LIMIT = RANGE_MIN  # a body starting further than this before the asked offset becomes the file's single stream
BUFFER = 2 * MiB  # each connection's receive buffer: written (and hashed at the frontier) when full...
ALIGN = 4096  # O_DIRECT's alignment (file offset, length and memory address; a page, the largest logical block)
FLUSH_SECONDS = 0.1  # ...or this old, so a kill loses little
SAVE_SECONDS = 0.2  # the range map is saved at most this often per file (and when the file ends)
HASH_READ = 4 * MiB  # each of the frontier hasher's two read-back buffers (one hashed while the next is read): few GIL
# acquisitions per byte, so the hasher keeps up beside 16-32 receiving threads
HASHING_AT_ONCE = 2  # files read back for hashing at once (each with two buffers): one per core
WINDOW = 8  # blocks (BUFFER each) the window holds at most, all files together: 16 MiB, mm's own margin for the 150 MB
# bound. Beside it, one receive buffer per connection (at most DEFAULT_CONNECTIONS: 64 MiB) and the hashers' read-back
# buffers (lent only while reading back). On the uncapped 1 GiB fetch of the 2-core VM (32 connections), peak RSS
# was 114-115 MB without a window and 135-145 MB with 12 blocks: 8 keeps ~10 MB more below the bound
WINDOW_WAIT = 1.0  # the longest a connection waits for the hasher to free a block of the window (mm's margin: far
# inside the minimum-rate window, so a wait never gets a connection cut as slow)
WINDOW_POLL = 0.01  # how often a waiting connection looks again at the frontier
WINDOW_SPAN = WINDOW * BUFFER  # a file's window holds only bytes this close to its hashing frontier (the next to be
# hashed): what the whole window can hold
WRITEBACK = 32 * MiB  # behind the hashing frontier, pages are handed to writeback in windows of this size
BUDGET_FACTOR = 1.5  # a file may receive 1.5x its size (a range re-sent, a 200 to a Range request)...
BUDGET_MARGIN = RANGE_MAX  # ...plus one more full range: mm's margin, so a small file survives one whole re-send
REQUEST_MARGIN = 64  # a file may make twice its planned requests plus this many: mm's margin (the floor of the
# fetch-wide retry budget), so transient 5xx/429 hit the fetch's retry budget first
IOV_MAX = 1024
MAX_MAP_BYTES = 48 * MiB  # a range map: at most 1,000,000 intervals of two 12-digit numbers (from_json's bound)
RANGE_RETRIES = 6  # failed attempts in a row (no byte gained) before a range, and its file, give up
BACKOFF_MAX = 30.0
RETRY_AFTER_MAX = 120.0
MAP_SCHEMA = "mm-ranges/1"
WRONG_ANSWERS = ("bad-range", "wrong-length", "wrong-range", "short-body", "slow")  # retry reasons that are the server's


class TransferCut(RetryLater):
    """The connection broke mid-body; what arrived is on disk and the transfer can continue."""

    def __init__(self, message: str):
        super().__init__(message, "cut")


@dataclass(frozen=True)
class Answer:
    """A source's answer to a request for bytes: what the server said, and its body.

    STATUS 200 is the whole file from byte 0; 206 is the bytes CONTENT_RANGE names (``prove`` checks both).
    READ(view) fills VIEW with what one read brought (at most len(view) bytes; 0: the body ended) and raises
    TransferCut when the connection breaks. LENGTH: the Content-Length the server announced, if any."""

    status: int
    content_range: str | None
    read: Callable[[memoryview], int]
    length: int | None = None
    peer: str = ""  # who answered (an origin, scheme://host:port), for messages; "" names the source


class RangeSource(Protocol):
    label: str  # recorded as the manifest entry's "source"

    def stream(self, path: str, start: int, end: int | None = None) -> ContextManager[Answer]:
        """Ask for bytes [start, end) of PATH (end None: to the end; start 0 and end None: no Range header).

        Yields the Answer (the engine proves where its bytes belong). Raises RetryLater for what may pass,
        RemoteError for what will not."""


_CONTENT_RANGE = re.compile(r"bytes (\d{1,20})-(\d{1,20})/(\d{1,20}|\*)")


def prove(answer: Answer, size: int, where: str) -> tuple[int, int]:
    """[start, end) of the file that ANSWER's body holds, as its status and headers prove; RetryLater (nothing
    written, nothing recorded) when they prove nothing: a 206 without a Content-Range, or with one that is not
    `bytes S-E/SIZE` inside this file, a Content-Length that disagrees, another status."""
    if answer.status == 200:
        if answer.length is not None and answer.length != size:
            raise RetryLater(f"{where} answered 200 with Content-Length {answer.length} for a file of {size} bytes; "
                             f"none of its bytes kept", "wrong-length", after=0)
        return 0, size
    m = _CONTENT_RANGE.fullmatch((answer.content_range or "").strip())
    if answer.status == 206 and m:
        start, end = int(m[1]), int(m[2]) + 1
        if start < end <= size and m[3] in ("*", str(size)) and answer.length in (None, end - start):
            return start, end
    said = "no Content-Range" if answer.content_range is None else f"Content-Range {shown(answer.content_range, 60)!r}"
    length = f" and Content-Length {answer.length}" if answer.length is not None else ""
    raise RetryLater(f"{where} answered {answer.status} with {said}{length}, which does not say where its bytes "
                     f"belong in a file of {size} bytes; none of its bytes kept", "bad-range", after=0)


def http_answer(raw: "wire.RawAnswer", where: str) -> Answer:
    """The Answer of an http.client answer (wire.open_raw): a read that fails is a TransferCut."""

    def read(view: memoryview) -> int:
        try:
            return raw.readinto(view)
        except (OSError, http.client.HTTPException) as e:
            raise TransferCut(f"{where}: transfer cut ({type(e).__name__})") from None

    encoding = (raw.header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":  # offsets into compressed bytes are not offsets into the file
        raise RemoteError(f"{where} answered with Content-Encoding {shown(encoding, 40)!r} although mm asked for "
                          f"identity; refused")
    return Answer(raw.status, raw.header("Content-Range"), read, raw.length, raw.where)


def chunk_reader(chunks: Iterator[bytes]) -> Callable[[memoryview], int]:
    """A READ over an iterator of chunks (a client library that hands out bytes objects): one copy per byte."""
    left = memoryview(b"")

    def read(view: memoryview) -> int:
        nonlocal left
        while not left:
            chunk = next(chunks, None)
            if chunk is None:
                return 0
            left = memoryview(chunk)
        n = min(len(view), len(left))
        view[:n] = left[:n]
        left = left[n:]
        return n

    return read


# --- the range map -------------------------------------------------------------------------------

class RangeMap:
    """Which bytes of a file are on disk: sorted, disjoint, non-touching [start, end) intervals."""

    def __init__(self, size: int, done: list[tuple[int, int]] | tuple = ()):
        self.size = size
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in done:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        start, end = max(0, start), min(self.size, end)
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)  # first interval that ends at or after start (touching merges)
        j = bisect.bisect_right(self._starts, end)  # intervals before j start at or before end
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    @property
    def done(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    @property
    def complete(self) -> bool:
        return self.prefix() == self.size

    def prefix(self) -> int:
        """End of the contiguous run of bytes from offset 0."""
        return self._ends[0] if self._starts and self._starts[0] == 0 else 0

    def gaps(self, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
        end = self.size if end is None else min(end, self.size)
        out, pos = [], start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        for s, e in zip(self._starts[i:], self._ends[i:]):
            if s >= end:
                break
            if s > pos:
                out.append((pos, min(s, end)))
            pos = max(pos, e)
        if pos < end:
            out.append((pos, end))
        return out

    def to_json(self, identity: str) -> dict:
        return {"schema": MAP_SCHEMA, "identity": identity, "size": self.size, "done": self.intervals()}

    @classmethod
    def from_json(cls, doc: object, size: int, identity: str) -> "RangeMap | None":
        """The map in DOC if it is well formed and for this file (identity and size), else None."""
        if not isinstance(doc, dict) or doc.get("schema") != MAP_SCHEMA or doc.get("identity") != identity:
            return None
        if doc.get("size") != size or not isinstance(doc.get("done"), list) or len(doc["done"]) > 1_000_000:
            return None
        rmap = cls(size)
        for item in doc["done"]:
            if (not isinstance(item, list) or len(item) != 2 or not all(type(v) is int for v in item)
                    or not 0 <= item[0] < item[1] <= size):
                return None
            rmap.add(item[0], item[1])
        return rmap


def state_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".ranges")


def load_state(partial: Path, size: int, identity: str, root: Path | None = None) -> RangeMap:
    """What a partial file already holds. A partial without a map is a prefix (mm's earlier sequential format).

    ROOT: the target directory the partial lies under (default: the partial's own directory, already proven by
    the caller); nothing is read, written or deleted through a symlink below it (fsutil's target rule)."""
    root = root or partial.parent
    spath = state_path(partial)
    check_inside(root, spath)
    check_inside(root, partial)
    if spath.exists():
        try:
            doc = read_local_file(spath, what="range map", max_bytes=MAX_MAP_BYTES)
            rmap = RangeMap.from_json(load_json(doc, str(spath)), size, identity)
        except (OSError, BadInput):  # a map mm cannot read is no map: the partial is started again
            rmap = None
        if rmap is not None and partial.is_file():
            return rmap
    elif partial.is_file() and partial.stat().st_size <= size:
        return RangeMap(size, [(0, partial.stat().st_size)])
    unlink_file(root, partial)  # a partial we cannot account for is started again
    return RangeMap(size)


def save_state(partial: Path, rmap: RangeMap, identity: str, root: Path | None = None) -> None:
    """Rename into place (a kill leaves the old map or the new one). No fsync: a kill -9 keeps the page cache,
    and after a power cut a map ahead of the data is caught by the whole-file hash before anything is named."""
    spath = state_path(partial)
    atomic_write_bytes(spath, json.dumps(rmap.to_json(identity)).encode(), root=root or partial.parent, sync=False)


def clear_state(partial: Path, root: Path | None = None) -> None:
    unlink_file(root or partial.parent, partial)
    unlink_file(root or partial.parent, state_path(partial))


# --- planning --------------------------------------------------------------------------------------

def range_size(size: int, connections: int) -> int:
    """How long each range of a file is: the file spread over every connection, within [RANGE_MIN, RANGE_MAX],
    a multiple of ALIGN (so that ranges start aligned: their bytes go to disk direct from the first)."""
    return min(RANGE_MAX, max(RANGE_MIN, -(-size // (max(1, connections) * ALIGN)) * ALIGN))


def file_share(size: int, connections: int) -> int:
    """How many connections one file may use at once: all of them for a big file, one for a small one."""
    return max(1, min(connections, math.ceil(size / RANGE_MIN)))


def plan_ranges(gaps: list[tuple[int, int]], size: int, tail: int = 0, head: int = 0) -> list[tuple[int, int]]:
    """The gaps cut into ranges of at most SIZE bytes, in file order; a short remainder joins the range before
    it. The last TAIL ranges (the connections that finish a file together) are halved down to RANGE_MIN, so
    they end close together and no connection idles long at the end of a file. The first HEAD ranges (the
    connections that start a file together) grow in a staircase, range k being (k + 1) / HEAD of SIZE (at least
    RANGE_MIN), when the file holds at least 4 x HEAD ranges: side by side at one rate, each range then ends
    before the next one, so the contiguous prefix (what the hasher may read) grows from the first second instead
    of waiting for a whole first row of full ranges (on a 1 GiB fetch the hasher sat idle ~0.15 s, then had the
    most left to do after the last byte)."""
    out = []
    for start, end in gaps:
        cuts = list(range(start, end, size))
        if head and not out and len(cuts) >= 4 * head:
            steps = [max(RANGE_MIN, size * (k + 1) // head // ALIGN * ALIGN) for k in range(head)]
            stairs = [start + sum(steps[:k]) for k in range(head)]
            cuts = stairs + list(range(stairs[-1] + steps[-1], end, size))
        if len(cuts) > 1 and end - cuts[-1] < size // 4:
            cuts.pop()
        out.extend(zip(cuts, cuts[1:] + [end]))
    if tail:
        head, last = out[:-tail], out[-tail:]
        out = head
        for s, e in last:
            half = (e - s) // 2 // ALIGN * ALIGN
            out.extend([(s, s + half), (s + half, e)] if half >= RANGE_MIN else [(s, e)])
    return out


# --- shared budget and accounting ------------------------------------------------------------------

class Connections:
    """The fetch's connection budget: a range holds one slot while its request is open.

    TOTAL is the most connections at once (`--connections`). The fetch opens up to START of them, then adds
    connections only while they pay: when ranges are waiting for a slot, the limit doubles, and it is
    kept if the aggregate rate over the next window grew by at least GROWTH_PAYS of the proportional gain,
    else it goes back and stays. Behind a per-connection cap (a CDN) every added connection adds its cap;
    where one connection is not capped (a LAN, the loopback), more connections only cost CPU."""

    START = 16
    WINDOW = 0.5  # seconds of transfer per rate measurement; the first window (connections opening) is skipped
    GROWTH_PAYS = 0.25

    def __init__(self, total: int, start: int | None = None, clock=time.monotonic):
        self.total = max(1, total)
        self.limit = min(self.total, max(1, start or self.START))
        self._busy = 0
        self._waiting = 0
        self._cv = threading.Condition()
        self.peak = 0
        self._clock = clock
        self._bytes = 0
        self._window: tuple[float, int] | None = None  # (start time, bytes then) of the window being measured
        self._warm = False
        self._before: tuple[int, float] | None = None  # (limit, rate) before the last growth, until it is judged
        self._settled = self.limit >= self.total

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._cv:
            self._waiting += 1
            while self._busy >= self.limit:
                self._cv.wait()
            self._waiting -= 1
            self._busy += 1
            self.peak = max(self.peak, self._busy)
        try:
            yield
        finally:
            with self._cv:
                self._busy -= 1
                self._cv.notify()

    def landed(self, n: int) -> None:
        """N more bytes arrived (any file): the measure of whether more connections pay."""
        with self._cv:
            self._bytes += n
            if not self._settled:
                self._adjust(self._clock())

    def _adjust(self, now: float) -> None:
        if self._window is None:
            self._window = (now, self._bytes)
            return
        began, before = self._window
        if now - began < self.WINDOW:
            return
        rate = (self._bytes - before) / (now - began)
        self._window = (now, self._bytes)
        if not self._warm:  # the first window is connections opening, redirects, slow start: not a rate
            self._warm = True
            return
        if self._before is not None:
            limit, earlier = self._before
            self._before = None
            if rate < earlier * (1 + self.GROWTH_PAYS * (self.limit - limit) / limit):
                self.limit, self._settled = limit, True  # ranges in flight finish; no new one until below
                return
        if self._waiting and self.limit < self.total:
            self._before = (self.limit, rate)
            self.limit = min(self.total, 2 * self.limit)
            self._cv.notify_all()
        elif self.limit >= self.total:
            self._settled = True


@dataclass
class TransferStats:
    """What the fetch did on the wire (for --json): requests, retries by reason, the retry budget."""

    retry_budget: int = 256
    requests: int = 0
    retries: Counter = field(default_factory=Counter)
    retried: list = field(default_factory=list)  # [{"path", "offset", "reason"}], the first RETRIED_KEPT
    from_window: int = 0  # bytes landed ahead of a hashing frontier and hashed from memory (OrderedHasher's window)
    read_back: int = 0  # ... and read back from the disk to be hashed, the window being full
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    RETRIED_KEPT = 100

    def request(self) -> None:
        with self._lock:
            self.requests += 1

    def retry(self, path: str, offset: int, reason: str) -> bool:
        """Record a retry; False when the budget is spent."""
        with self._lock:
            if sum(self.retries.values()) >= self.retry_budget:
                return False
            self.retries[reason] += 1
            if len(self.retried) < self.RETRIED_KEPT:
                self.retried.append({"path": path, "offset": offset, "reason": reason})
            return True

    def hashed(self, from_window: int, read_back: int) -> None:
        """A file's bytes that landed ahead of its hashing frontier: hashed from the window, or read back."""
        with self._lock:
            self.from_window += from_window
            self.read_back += read_back

    def report(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "retries": sum(self.retries.values()), "retry_budget": self.retry_budget,
                    "retries_by_reason": dict(self.retries), "retried": list(self.retried),
                    "hashed_from_window": self.from_window, "read_back": self.read_back}


# --- the partial file on disk ---------------------------------------------------------------------

class Buffers:
    """Page-aligned buffers of one SIZE, lent and kept for the next borrower: their pages are faulted in once per
    process, not once per file and connection, and the memory they hold is the most ever lent at once. LIMIT:
    at most that many lent at once (a borrower waits; each gives them back within one piece of work)."""

    def __init__(self, size: int, limit: int | None = None):
        self.size, self.limit = size, limit
        self._free: list[memoryview] = []
        self._lent = 0
        self._spared = 0  # of them, lent through spare()
        self._cv = threading.Condition(threading.Lock())

    def spare(self, most: int) -> memoryview | None:
        """One buffer, unless MOST or more are out through `spare` already (then None, at once: the caller does
        without). Given back with `give_back`."""
        with self._cv:
            if self._spared >= most:
                return None
            self._lent += 1
            self._spared += 1
            if self._free:
                return self._free.pop()
        return memoryview(mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))

    def await_spare(self, most: int, seconds: float) -> None:
        """Return once fewer than MOST are out through `spare`, or after SECONDS."""
        with self._cv:
            if self._spared >= most:
                self._cv.wait(seconds)

    def give_back(self, view: memoryview) -> None:
        """A buffer from `spare`, for the next borrower: one waiting thread is woken (not every one: a herd of
        connections waking for each block freed cost more CPU than the window saved)."""
        with self._cv:
            self._free.append(view)
            self._lent -= 1
            self._spared -= 1
            if self.limit is None:
                self._cv.notify()
            else:
                self._cv.notify_all()

    @contextmanager
    def lend(self, count: int = 1) -> Iterator[list[memoryview]]:
        with self._cv:
            while self.limit is not None and self._lent + count > self.limit:
                self._cv.wait()
            self._lent += count
            views = [self._free.pop() for _ in range(min(count, len(self._free)))]
        views += [memoryview(mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))  # (not shmem)
                  for _ in range(count - len(views))]
        try:
            yield views
        finally:
            with self._cv:
                self._free.extend(views)
                self._lent -= count
                self._cv.notify_all()


_RECEIVE = Buffers(BUFFER + ALIGN)  # a connection's receive buffer (one per connection in use: Connections bounds them),
# and the window's blocks (bytes landed ahead of a hashing frontier, kept for it: OrderedHasher), at most WINDOW
_HASHING = Buffers(HASH_READ + ALIGN, limit=2 * HASHING_AT_ONCE)  # the read-back buffers of the frontier hashers


class Disk:
    """The partial file's descriptors: FD (buffered) and, where the filesystem allows it, DIRECT, an O_DIRECT
    descriptor of the same open inode. Received bytes go to disk straight from the connection's buffer through
    DIRECT (no copy into the page cache, no writeback of it later: that copy and its inode lock were most of a
    fetch's CPU); the unaligned edges of a write go through FD. The kernel keeps the two coherent (a direct read
    or write first writes back and drops the cached pages it overlaps). A filesystem that refuses O_DIRECT, or
    one of its writes, gets buffered writes for the rest of the file."""

    def __init__(self, fd: int):
        self.fd = fd
        self.direct: int | None = None
        if hasattr(os, "O_DIRECT"):
            try:  # the open file itself (/proc), not its name again: nothing can be swapped in between
                self.direct = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                pass
        self._opened = self.direct  # closed with the file only: another thread may still be writing through it

    def reserve(self, size: int) -> None:
        """Allocate the file's SIZE bytes up front (fallocate(2); its size becomes SIZE), so that no direct write
        extends the file or fills a hole: ext4 runs those one at a time under the inode lock for the whole disk
        write, and aligned overwrites of allocated blocks side by side. Without fallocate support (or room: the
        writes will say so) nothing is allocated; without direct I/O nothing is needed."""
        if self.direct is None or os.fstat(self.fd).st_size >= size:
            return
        import ctypes  # fallocate(2) itself: os.posix_fallocate falls back to writing every block where unsupported

        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.fallocate(self.fd, 0, 0, size)

    def write(self, pieces: list[memoryview], offset: int, length: int) -> None:
        """PIECES (LENGTH bytes) at OFFSET: the ALIGN-aligned middle direct, the edges buffered."""
        end = offset + length
        lo, hi = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN
        direct = self.direct
        if direct is not None and hi > lo:
            try:
                _pwrite_all(direct, _slice(pieces, lo - offset, hi - offset), lo)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = None  # (a piece not aligned in memory, a filesystem with larger blocks)
            else:
                if lo > offset:
                    _pwrite_all(self.fd, _slice(pieces, 0, lo - offset), offset)
                if end > hi:
                    _pwrite_all(self.fd, _slice(pieces, hi - offset, length), hi)
                return
        _pwrite_all(self.fd, pieces, offset)

    def read(self, view: memoryview, offset: int, need: int) -> None:
        """At least NEED bytes of the file from OFFSET into VIEW (OSError if the file is shorter): direct when
        OFFSET and VIEW's length are aligned (VIEW, in memory too: the caller's page-aligned buffer), so bytes
        written direct are not copied through the page cache either. The read may go past NEED, up to VIEW's end."""
        direct = self.direct if offset % ALIGN == 0 and len(view) % ALIGN == 0 else None
        got = 0
        while got < need:
            fd = direct if direct is not None and got % ALIGN == 0 else self.fd
            try:
                n = os.preadv(fd, [view[got:]], offset + got)
            except OSError as e:
                if fd == self.fd or e.errno != errno.EINVAL:
                    raise
                direct = None
                continue
            if n <= 0:
                raise OSError(f"partial file shorter than its range map at byte {offset + got}")
            got += n

    def close(self) -> None:
        self.direct = None
        if self._opened is not None:
            os.close(self._opened)
        os.close(self.fd)


# --- hashing in file order -------------------------------------------------------------------------

class OrderedHasher:
    """Feeds a StreamHasher every byte of a file in order while ranges land in any order.

    ``written(offset, pieces, length)`` is called once PIECES are on disk at OFFSET, while the caller still holds
    them in its buffer; it records them in the range map. Bytes that land exactly at the frontier while nobody is
    hashing are hashed from that buffer. Bytes that land ahead of it (or while the hashing thread is busy) are copied
    into a block of the window, the bytes landed and not hashed yet that are kept in memory (at most WINDOW_SPAN from
    the frontier; blocks from the receive buffers' pool, at most WINDOW in all), and the hashing thread hashes
    them from there once the contiguous prefix reaches them: on a disk slower than the link, nothing is read back.
    Where no block is to be had, a block of this file further from the frontier is given up for the nearer bytes
    (its bytes are on disk already); what the window does not hold is read back (direct) when the prefix reaches
    it, and counted (``read_back``). Behind the frontier, pages are handed to writeback and dropped from the page
    cache (``WRITEBACK``), once hashed and written: the fsync before a file is named waits for little and a 252 GB
    fetch does not push the host's cache out."""

    def __init__(self, disk: Disk, rmap: RangeMap, hasher: StreamHasher, lock: threading.Condition, start: int = 0):
        self._disk, self._fd, self._rmap, self._hasher = disk, disk.fd, rmap, hasher
        self._cv = lock  # shared with the file's state: guards rmap too
        self.hashed = 0
        self._kicked = self._dropped = start  # writeback: started up to _kicked, dropped up to _dropped
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._held: dict[int, tuple[int, memoryview, memoryview]] = {}  # the window: start -> (end, bytes, block)
        self.read_back = 0  # bytes hashed from a read of the disk (the window had no room for them)
        self.from_window = 0  # bytes hashed from the window
        self._side = SideThread()  # every hash of a piece there, while this file's hashing thread reads the next
        # piece back; one thread for both hashes, so sha256 reads each slice from the cache blake3 just brought it
        # into (hashing.CACHE_SLICE: 0.15 CPU-s of a 1 GiB fetch against blake3 and sha256 on two threads)
        self._thread = threading.Thread(target=self._catch_up, name="mm-hash", daemon=True)
        self._thread.start()

    def written(self, offset: int, pieces: list[memoryview], length: int) -> None:
        """PIECES (LENGTH bytes in all) are on disk at OFFSET: to the range map, then hashed or held."""
        end = offset + length
        block = None
        # (unlocked reads: a hint only; what is decided is decided again under the lock)
        if not (offset == self.hashed and not self._busy) and length <= _RECEIVE.size:
            block = self._block(offset, end)
            if block is not None:
                at = 0
                for piece in pieces:
                    block[at:at + len(piece)] = piece
                    at += len(piece)
        with self._cv:
            self._rmap.add(offset, end)
            fast = offset == self.hashed and not self._busy and not self._closed
            if fast:
                self._busy = True
            else:
                if block is not None and not self._closed:
                    self._held[offset] = (end, block[:length], block)
                    block = None
                if self._rmap.prefix() > self.hashed:  # else the hashing thread has nothing new to do: not woken
                    self._cv.notify_all()
        if block is not None:
            _RECEIVE.give_back(block)
        if not fast:
            return
        try:  # (in a receiving thread: the other connections keep the cores busy, no hand-off to the side thread)
            for piece in pieces:
                self._hasher.update(piece)
        finally:
            self._advance(end)

    def _block(self, offset: int, end: int) -> memoryview | None:
        """A block of the window for bytes [OFFSET, END), or None: they will be read back from the disk.

        Bytes within WINDOW_SPAN of the frontier get a spare buffer of the pool, else this file's block furthest
        from the frontier when it lies beyond them (its bytes will be read back instead). While the hashing thread
        is behind (busy on bytes already here: hashing, not the network, is what the file waits for), a connection
        whose bytes find no block, or lie beyond the span, waits for the frontier to come closer and a block to be
        freed, at most WINDOW_WAIT: it stops reading its socket meanwhile, which costs the file nothing, and its
        bytes are not read back. Past the wait, or while the hasher waits for the network, it does not wait."""
        deadline = None
        while True:
            near = end - self.hashed <= WINDOW_SPAN
            if near:
                block = _RECEIVE.spare(WINDOW)
                if block is not None:
                    return block
            with self._cv:
                if near:
                    far = max(self._held, default=-1)
                    if far > offset:
                        return self._held.pop(far)[2]
                behind = self._busy and not self._closed and self._rmap.prefix() - self.hashed >= BUFFER
            now = time.monotonic()
            deadline = deadline or now + WINDOW_WAIT
            if not behind or now >= deadline or interrupt.requested():
                return None
            if near:  # woken by a block freed (one thread per block), or to look again at the frontier
                _RECEIVE.await_spare(WINDOW, min(deadline - now, WINDOW_POLL))
            else:
                interrupt.STOP.wait(min(deadline - now, WINDOW_POLL))

    def _advance(self, end: int, keep: bool = False) -> None:
        """Bytes up to END are hashed; KEEP: the caller goes on hashing (it holds the next bytes already)."""
        with self._cv:
            self.hashed = end
            self._busy = keep
            self._cv.notify_all()
        if end - self._kicked >= WRITEBACK:  # only the hashing thread of the moment gets here
            self._writeback(end)

    def _writeback(self, end: int) -> None:
        """Start writing [kicked, end) to disk, and drop [dropped, kicked) (written by now) from the page cache:
        posix_fadvise(DONTNEED) starts writeback of dirty pages and frees clean ones."""
        try:
            if self._kicked > self._dropped:  # (a length of 0 would mean "to the end of the file")
                os.posix_fadvise(self._fd, self._dropped, self._kicked - self._dropped, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(self._fd, self._kicked, end - self._kicked, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        self._dropped, self._kicked = self._kicked, end

    def _catch_up(self) -> None:
        """Hash what landed ahead of the frontier once the contiguous prefix reaches it: from the window where it
        holds the bytes, else read back (direct where it can, Disk.read) in HASH_READ pieces, each next piece read
        while the last one is hashed. The two read-back buffers are borrowed only while there is something to read
        back (HASHING_AT_ONCE files at most)."""
        try:
            while self._await_work():
                with ExitStack() as lent:
                    self._hash_behind(lent)
        except BaseException as e:  # reported by finish()
            with self._cv:
                self._error, self._busy, self._closed = e, False, True
                self._cv.notify_all()

    def _await_work(self) -> bool:
        """Wait until the prefix is past the frontier and nobody hashes; then this thread does (False: closed)."""
        with self._cv:
            while not self._closed and (self._busy or self._rmap.prefix() <= self.hashed):
                self._cv.wait()
            self._busy = not self._closed
            return self._busy

    def _hash_behind(self, lent: ExitStack) -> None:
        """Hash from the frontier while the prefix is ahead of it; returns having given the frontier back."""
        bufs: list[memoryview] = []

        def buffer(which: int) -> memoryview:
            if not bufs:
                bufs.extend(lent.enter_context(_HASHING.lend(2)))
            return bufs[which]

        with self._cv:
            start, stop = self.hashed, self._rmap.prefix()
        which, ahead = 0, None
        end, chunk, block = self._next(start, stop, buffer, which)
        try:
            while True:
                ahead = None
                self._side.begin(self._hasher.update, chunk)
                try:
                    with self._cv:
                        stop = self._rmap.prefix() if not self._closed else end
                    if stop > end:
                        which = 1 - which  # (the chunk being hashed is in the other buffer, or in the window)
                        ahead = self._next(end, stop, buffer, which)
                finally:
                    self._side.end()
                if block is not None:
                    block, done = None, block
                    _RECEIVE.give_back(done)
                self._advance(end, keep=ahead is not None)
                if ahead is None:
                    return
                end, chunk, block = ahead
        finally:  # (a failure: the window's blocks in hand go back to the pool all the same)
            for spare in (block, ahead[2] if ahead is not None and ahead[2] is not block else None):
                if spare is not None:
                    _RECEIVE.give_back(spare)

    def _next(self, start: int, stop: int, buffer: Callable[[int], memoryview], which: int
              ) -> tuple[int, memoryview, memoryview | None]:
        """The bytes from START (at most to STOP, the prefix): (their end, the bytes, the window's block holding
        them or None)."""
        with self._cv:
            held = self._held.pop(start, None)
            if held is None:
                stop = min([stop, *(s for s in self._held if s > start)])  # read back only up to the window's next
        if held is not None:
            self.from_window += held[0] - start
            return held
        end = min(stop, start + HASH_READ)
        self.read_back += end - start
        return end, self._read(buffer(which), start, end), None

    def _read(self, buf: memoryview, start: int, end: int) -> memoryview:
        """Bytes [START, END) of the file, read into BUF from the ALIGN boundary below START."""
        at = start - start % ALIGN
        view = buf[:-((at - end) // ALIGN) * ALIGN]
        self._disk.read(view, at, end - at)
        return view[start - at:end - at]

    def finish(self, size: int) -> Digests:
        """Wait until every byte is hashed; the digests."""
        with self._cv:
            while self.hashed < size and self._error is None:
                if self._closed:
                    break
                self._cv.wait()
            self._closed = True
            self._cv.notify_all()
        self._stop()
        if self._error is not None:
            raise RemoteError(f"cannot read back the partial file for hashing: {self._error}")
        if self.hashed < size:
            raise RemoteError(f"hashing stopped at byte {self.hashed} of {size}")
        return self._hasher.digests()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._stop()

    def _stop(self) -> None:
        """The hashing threads ended; the window's blocks back to the pool."""
        self._thread.join()
        self._side.close()
        with self._cv:
            held, self._held = list(self._held.values()), {}
        for _, _, block in held:
            _RECEIVE.give_back(block)


# --- one file --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RangedJob:
    path: str  # the file's path in the repo (what the source is asked for)
    size: int
    partial: Path
    identity: str  # upstream identity: the range map is trusted only for the same content
    hasher: StreamHasher
    root: Path | None = None  # the target directory PARTIAL lies under (fsutil's rule); default: its directory


@dataclass(frozen=True)
class RangedResult:
    digests: Digests
    transferred: int  # body bytes received (a re-sent or skipped byte counts)
    resumed_from: int  # bytes already on disk from an earlier run
    ranges: int  # range requests that delivered bytes
    connections: int  # most connections this file used at once
    read_back: int = 0  # bytes hashed from a read of the disk: landed ahead of the frontier, the window full


class _Range:
    __slots__ = ("pos", "end", "landed")

    def __init__(self, pos: int, end: int):
        self.pos, self.end, self.landed = pos, end, 0


class _File:
    """The state shared by the connections working on one file."""

    def __init__(self, job: RangedJob, source: RangeSource, rmap: RangeMap, disk: Disk, stats: TransferStats,
                 progress: ProgressSink, rsize: int, share: int, connections: "Connections", most: int = 1):
        self.job, self.source, self.rmap, self.disk, self.stats, self.progress = job, source, rmap, disk, stats, progress
        self.connections = connections
        self.most = most  # threads (connections) this file may use at once
        self.threads = 1  # threads working on it now, the caller's included (_spread starts the others)
        self.waiting = 0  # of them, waiting for a slot of the budget
        self.workers: list[threading.Thread] = []  # the threads _spread started, for download() to join
        self.limits = wire.limits()
        self.lock = threading.Condition()
        self.pending: deque[tuple[int, int]] = deque(plan_ranges(rmap.gaps(), rsize, tail=share if share > 1 else 0,
                                                                 head=share if share > 1 else 0))
        self.inflight: set[_Range] = set()
        self.sequential = False  # one response is streaming the whole rest of the file
        self.no_range = False  # a Range request was answered with the whole file: the rest of it is one stream
        self.honoured = most <= 1  # an answer proved the server honours Range (a 206): more connections may start
        self.whole_file = False  # the server answers Range at the wrong offset: ask without Range
        self.wrong_offsets = 0
        self.error: MMError | None = None
        self.transferred = 0
        self.requests = 0
        self.byte_budget = int(BUDGET_FACTOR * job.size) + BUDGET_MARGIN
        self.request_budget = 2 * len(self.pending) + REQUEST_MARGIN
        self.ranges_landed: set[_Range] = set()
        self.peak = 0
        self._save_lock = threading.Lock()
        self._saved_at = time.monotonic()
        self.hasher = OrderedHasher(disk, rmap, job.hasher, self.lock, start=rmap.prefix())

    @property
    def where(self) -> str:
        return f"{self.job.path}: {self.source.label}"

    # -- handing out work --

    def take(self) -> _Range | None:
        with self.lock:
            if self.error is not None or (self.no_range and self.inflight):
                return None  # (the stream holds the rest of the file)
            while self.pending and not self.sequential:
                start, end = self.pending.popleft()
                gaps = self.rmap.gaps(start, end)
                if not gaps:
                    continue
                self.pending.extendleft(reversed(gaps[1:]))
                return self._start(_Range(*gaps[0]))
            return None

    def _start(self, r: _Range) -> _Range:
        self.inflight.add(r)
        self.peak = max(self.peak, len(self.inflight))
        return r

    def release(self, r: _Range) -> None:
        with self.lock:
            self.inflight.discard(r)
            if r.pos < r.end and self.error is None:
                self.pending.appendleft((r.pos, r.end))

    def fail(self, e: MMError) -> None:
        with self.lock:
            if self.error is None:
                self.error = e

    # -- the file's budget --

    def request(self) -> None:
        """One more request for this file, within its budget (RemoteError past it)."""
        self.stats.request()
        with self.lock:
            self.requests += 1
            over = self.requests > self.request_budget
        if over:
            self._over_budget(f"more than {self.request_budget} requests (twice the {self.request_budget - REQUEST_MARGIN >> 1}"
                              f" planned, plus {REQUEST_MARGIN})")

    def received(self, n: int) -> None:
        """N more body bytes arrived (kept or not), within the file's budget (RemoteError past it)."""
        if not n:
            return
        with self.lock:
            self.transferred += n
            over = self.transferred > self.byte_budget
        if over:
            self._over_budget(f"{self.transferred} bytes received, more than its budget of {self.byte_budget} "
                              f"({BUDGET_FACTOR}x its {self.job.size} bytes plus {BUDGET_MARGIN >> 20} MiB)")

    def _over_budget(self, what: str) -> None:
        e = RemoteError(f"{self.where} answers wrongly: {what}; the file is given up, its partial kept "
                        f"({self.rmap.done} of {self.job.size} bytes)")
        self.fail(e)
        raise e

    # -- landing bytes --

    def commit(self, r: _Range, offset: int, pieces: list[memoryview], length: int) -> None:
        """PIECES (LENGTH body bytes from OFFSET) to disk where no other response put them yet (one pwritev, no
        copy in between), then to the range map and the hasher (from the same buffer)."""
        end = offset + length
        with self.lock:
            gaps = self.rmap.gaps(offset, end)
        for s, e in gaps:
            part = pieces if (s, e) == (offset, end) else _slice(pieces, s - offset, e - offset)
            self.disk.write(part, s, e - s)
            self.hasher.written(s, part, e - s)  # (which records it in the range map)
            self.progress.advance(e - s)
            self.connections.landed(e - s)
        with self.lock:
            r.pos = max(r.pos, end)
            r.landed += length
            if gaps:
                self.ranges_landed.add(r)
        self.save()

    def save(self, force: bool = False) -> None:
        """The range map to disk, at most every SAVE_SECONDS: the time is checked again under the lock, so
        connections that all found it due save once, not once each."""
        if not force and time.monotonic() - self._saved_at < SAVE_SECONDS:
            return
        with self._save_lock:
            now = time.monotonic()
            if not force and now - self._saved_at < SAVE_SECONDS:
                return  # another connection saved it while this one waited for the lock
            with self.lock:
                snapshot = RangeMap(self.rmap.size, self.rmap.intervals())
            save_state(self.job.partial, snapshot, self.job.identity, self.job.root)
            self._saved_at = now


def download(job: RangedJob, source: RangeSource, connections: Connections, stats: TransferStats | None = None,
             progress: ProgressSink = NULL_PROGRESS) -> RangedResult:
    """Fetch the gaps of JOB's partial file over up to file_share() connections; hash every byte in order.

    Returns the digests of the whole file; the caller checks them against the upstream identity and names the
    file (or clears the partial). On a failure the partial and its map are kept for the next run."""
    stats = stats if stats is not None else TransferStats()
    rmap = load_state(job.partial, job.size, job.identity, job.root)
    resumed = rmap.done
    save_state(job.partial, rmap, job.identity, job.root)  # before any write: a map-less partial is read as a prefix
    share = file_share(job.size, connections.total)
    limit = getattr(source, "max_connections", None)
    if limit:
        share = min(share, limit)
    disk = Disk(open_file(job.root or job.partial.parent, job.partial, os.O_RDWR | os.O_CREAT, 0o644))
    f = None
    try:
        disk.reserve(job.size)
        planned = min(share, connections.limit)  # ranges sized for the connections open now (more may come)
        rsize = range_size(job.size, planned) if share > 1 else job.size  # one connection: one request per gap
        f = _File(job, source, rmap, disk, stats, progress, rsize, planned if share > 1 else 1, connections, share)
        progress.advance(resumed)
        _work(f)
        while True:  # a thread is listed by the one that started it, before that one ends: none is missed
            with f.lock:
                if not f.workers:
                    break
                worker = f.workers.pop()
            worker.join()
        if interrupt.requested():  # stopped: the partial and its map (saved below) are the work kept
            f.hasher.close()
            interrupt.check()
        if f.error is None and not f.rmap.complete:
            f.error = RemoteError(f"{job.path}: download from {source.label} stopped with "
                                  f"{job.size - f.rmap.done} bytes missing; run again to resume")
        if f.error is not None:
            f.hasher.close()
            raise f.error
        digests = f.hasher.finish(job.size)  # (no fsync here: the caller names the file through fsutil.publish,
        # which fsyncs it once, at the end)
    finally:
        if f is not None:
            f.save(force=True)
        disk.close()
    stats.hashed(f.hasher.from_window, f.hasher.read_back)
    return RangedResult(digests, f.transferred, resumed, len(f.ranges_landed), f.peak, f.hasher.read_back)


def _work(f: _File) -> None:
    """One connection's loop: take a range, fetch it into a receive buffer; until the file is done or has an
    error (a failure, or a cancellation set there)."""
    try:
        while f.error is None and not interrupt.requested():
            with _slot(f), _RECEIVE.lend() as (view,):
                r = f.take()
                if r is None:
                    return
                _spread(f)
                try:
                    _run_range(f, r, view)
                except MMError as e:
                    f.fail(e)
                except OSError as e:
                    f.fail(RemoteError(f"{f.job.partial}: cannot write the partial file: {e.strerror or e}"))
                finally:
                    f.release(r)
    finally:
        with f.lock:
            f.threads -= 1


@contextmanager
def _slot(f: _File) -> Iterator[None]:
    """A slot of the connection budget for one of F's threads; while one of them waits, F starts no more."""
    with f.lock:
        f.waiting += 1
    waiting = True
    try:
        with f.connections.slot():
            with f.lock:
                f.waiting -= 1
            waiting = False
            yield
    finally:
        if waiting:
            with f.lock:
                f.waiting -= 1


def _spread(f: _File) -> None:
    """One more thread for F (called by one that just got a slot and a range) while F has ranges nobody took, none of
    its threads waits for a slot, and its share allows. So a file's threads follow the slots it gets: one per
    connection in use, plus at most one waiting (which is also what tells the budget that more connections are
    wanted), instead of every file starting its whole share up front: 8 files of 128 MiB started 31 threads each,
    most of them only to wait and end, and each start and end is a round of GIL hand-offs (10,000 futex calls and
    0.1 CPU-s of a 1 GiB fetch). A file's first request goes alone: the others start once an answer proved that the
    server honours Range (a 206). A pull-through cache answers a miss with the whole blob to every request, and
    fetches it from its upstream once per request (distribution's proxy does not merge concurrent misses): one
    request on a cold cache, not sixteen."""
    with f.lock:
        if (f.error is not None or f.waiting or f.sequential or f.no_range or not f.honoured or not f.pending
                or f.threads >= f.most):
            return
        f.threads += 1
    worker = threading.Thread(target=_work, args=(f,), name="mm-range", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no thread to be had (a process limit): the file goes on with the threads it has
        with f.lock:
            f.threads -= 1
        return
    with f.lock:  # (before this thread can end: download() joins until the list stays empty)
        f.workers.append(worker)


def _run_range(f: _File, r: _Range, view: memoryview) -> None:
    failures = 0
    while r.pos < r.end and f.error is None and not interrupt.requested():
        before = r.landed
        try:
            _attempt(f, r, view)
            if interrupt.requested():
                return
            with f.lock:  # another response (a whole-file stream) may have landed the rest of R meanwhile
                gaps = f.rmap.gaps(r.pos, r.end)
                r.pos = gaps[0][0] if gaps else r.end
            if r.pos < r.end and r.landed == before:
                with f.lock:
                    if f.sequential:
                        return  # another response streams the rest of the file; this range is handed back
                raise RetryLater(f"{f.where} ended the body at byte {r.pos}", "short-body")
        except RetryLater as e:
            # a cut for slowness is a failure even when a few bytes came: a trickle never resets the count
            failures = 0 if r.landed > before and e.reason != "slow" else failures + 1
            if failures > RANGE_RETRIES or not f.stats.retry(f.job.path, r.pos, e.reason):
                why = f"{failures} failed attempts in a row" if failures > RANGE_RETRIES else "retry budget spent"
                if e.reason in WRONG_ANSWERS:
                    why += ": the server answers wrongly"
                raise RemoteError(f"{e.message} ({why}); the partial is kept, run again to resume") from None
            backoff = min(BACKOFF_MAX, f.limits.backoff * 2 ** (failures - 1)) if failures else 0.0
            if interrupt.STOP.wait(min(RETRY_AFTER_MAX, max(0.0, e.after if e.after is not None else backoff))):
                return  # stopped while waiting to retry


def _attempt(f: _File, r: _Range, view: memoryview) -> None:
    """One request for the rest of R; what arrives lands at the offsets its answer proves (module docstring)."""
    job = f.job
    start, end = (0, None) if f.whole_file else (r.pos, r.end if r.end < job.size else None)
    f.request()
    with f.source.stream(job.path, start, end) as answer:
        where = f"{job.path}: {answer.peer}" if answer.peer else f.where
        body_start, body_end = prove(answer, job.size, where)
        ranged = start > 0 or end is not None
        if answer.status == 206 and not f.honoured:
            with f.lock:
                f.honoured = True
            _spread(f)  # the file's other connections start now, not before: see _spread
        if body_start > r.pos:
            with f.lock:
                f.wrong_offsets += 1
                f.whole_file = f.whole_file or f.wrong_offsets >= 2
            raise RetryLater(f"{where} answered a request for byte {r.pos} from byte {body_start}",
                             "wrong-range", after=0)
        sequential = False
        whole = answer.status == 200 and ranged  # the server does not honour Range for this file now
        if whole or r.pos - body_start > SKIP_LIMIT:
            with f.lock:
                if f.sequential:
                    return  # another response already streams the whole file
                f.sequential = sequential = True
                if whole and not f.no_range:  # once per file: a cold cache costs one more stream, not a failure
                    f.no_range = True  # what was received so far, and what this answer declares (prove: the size)
                    f.byte_budget = max(f.byte_budget, f.transferred + job.size)
                gaps = f.rmap.gaps(body_start)  # bytes already here are read and dropped, not written again
                if not gaps:
                    f.sequential = False
                    return  # every byte is here already
                r.pos, r.end = gaps[0][0], job.size
        try:
            _land(f, r, body_start, body_end, answer.read, view, where)
        finally:
            if sequential:
                with f.lock:
                    f.sequential = False


def _land(f: _File, r: _Range, at: int, body_end: int, read: Callable[[memoryview], int], view: memoryview,
          where: str) -> None:
    """Read a body holding bytes [AT, BODY_END) of the file into VIEW (one socket read at a time) and land the
    part R still needs: bytes before R.pos are read and dropped, bytes up to R's end are written from VIEW at
    their offset once it is full or FLUSH_SECONDS old; nothing past R's end (or the body's) is read. A connection
    slower than the minimum rate over a window is cut (RetryLater: retried on a fresh connection)."""
    lim = f.limits
    stop = min(body_end, r.end)
    lo = hi = 0  # VIEW[lo:hi] holds the file's bytes from batch_at; lo = batch_at % ALIGN (see below)
    batch_at = at
    received = 0
    now = began = window_at = time.monotonic()
    window_bytes = 0
    try:
        while at < stop and f.error is None and not interrupt.requested():
            if at < r.pos:  # before the range: read and dropped
                n = read(view[:min(len(view), r.pos - at)])
            else:
                if hi == lo:  # a new batch, placed so that a file offset and its place in VIEW agree modulo ALIGN:
                    lo = hi = at % ALIGN  # its aligned middle goes to disk direct, and a full VIEW ends aligned
                    batch_at = at
                n = read(view[hi:hi + min(len(view) - hi, stop - at)])
                hi += n
            if not n:
                break
            at += n
            received += n
            window_bytes += n
            now = time.monotonic()
            if hi > lo and (hi == len(view) or at >= stop or now - began >= FLUSH_SECONDS):
                f.commit(r, batch_at, [view[lo:hi]], hi - lo)
                lo = hi = 0
                began = now
                f.received(received)
                received = 0
            if now - window_at >= lim.rate_window:
                if window_bytes < lim.min_rate * (now - window_at):
                    raise RetryLater(f"{where} sent {window_bytes} bytes in {now - window_at:.1f} s, less than "
                                     f"MM_NET_MIN_RATE ({lim.min_rate:g} bytes/s); cut, to be asked again on a fresh "
                                     f"connection", "slow", after=0)
                window_at, window_bytes = now, 0
    except OSError:  # the partial cannot be written: nothing more is tried
        lo = hi = 0
        raise
    finally:
        if hi > lo:  # what arrived before a cut, a stop or another connection's failure is kept (its place is proven)
            f.commit(r, batch_at, [view[lo:hi]], hi - lo)
        f.received(received)


def _slice(pieces: list[memoryview], start: int, end: int) -> list[memoryview]:
    """Bytes [START, END) of the concatenation of PIECES, as views."""
    out, pos = [], 0
    for piece in pieces:
        lo, hi = max(start, pos), min(end, pos + len(piece))
        if hi > lo:
            out.append(piece[lo - pos:hi - pos])
        pos += len(piece)
        if pos >= end:
            break
    return out


def _pwrite_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    """Write PIECES at OFFSET (pwritev; what a short write left, piece by piece)."""
    total = sum(len(p) for p in pieces)
    done = os.pwritev(fd, pieces[:IOV_MAX], offset) if pieces else 0
    if done == total:
        return
    for piece in _slice(pieces, done, total):
        written = 0
        while written < len(piece):
            written += os.pwrite(fd, piece[written:], offset + done + written)
        done += len(piece)
