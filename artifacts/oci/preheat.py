"""mm preheat REF --tier URL [--tier URL ...]: warm a chain of pull-through caches with an artifact, nearest the
origin first, so that the nodes pulling through the last tier find every blob there.

The reference names the origin; its manifest is resolved there once (tag -> digest). Then each tier, in the order
given (T1, whose upstream is the origin, first; then T2, whose upstream is T1; ...), gets the manifest by digest
and one request per blob: a GET of the blob's first byte (`Range: bytes=0-0`).

- A tier that holds the blob answers 206 with that byte: warm, nothing more moves (one byte per blob per tier).
- A tier that does not answers 200 with the whole blob (distribution's proxy ignores Range on a miss and streams
  what it fetches from its upstream while it stores it): that answer is read to its end, through sha256 (a
  fixed buffer, nothing stored), and its digest and length checked. The tier stores the blob as it passes.

Why not a HEAD first: distribution serves HEAD with the same handler as GET (registry/handlers/blob.go), and on a
miss its proxy (registry/proxy/proxyblobstore.go, ServeBlob) starts the same fetch into its store plus a second
copy from the upstream for the answer, whose body a HEAD then throws away: a HEAD on a cold tier moves the blob
twice and proves nothing. The one-byte GET is the probe and the warm-up in one request, and on a miss the bytes
that pass are the ones checked.

Then, before the next tier is asked (and, after the last tier, before the preheat is done), each blob a tier
fetched is waited for until the tier serves it from its own store (Client.blob_in_store: a conditional one-byte
GET answered 304 by a stored blob). A pull-through cache stores a miss in the background while it streams it
(proxyblobstore.go, storeLocal: its own fetch from the upstream, then a commit that fsyncs the blob), and a request
that arrives before that commit is served by yet another fetch from the upstream: without the wait, on a fast host
the next tier's two fetches per miss reached the origin again. The wait costs a request per look; a look while the
tier is still storing costs what the TCP buffers between the tier and its upstream take in before the tier sees mm
close (megabytes on loopback), so the looks are spaced from the time the blobs took to pass, and they end at a
deadline: a blob not stored by then is reported, and the preheat goes on.

Reports, per tier: blobs already there, blobs fetched, blob bytes read from the tier (measured here, at the
client), blobs stored and the time waited for them, and failures (a tier that is down, refuses, or sends bytes
whose digest fails: exit 4 or 5, the other blobs still go on).
"""
from __future__ import annotations

import hashlib
import http.client
import time
from dataclasses import dataclass, replace
from typing import Callable

from ..edges import interrupt, wire
from ..errors import IntegrityError, MMError, RemoteError, RetryLater
from ..edges.untrusted import shown
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from .client import Client, Credentials, Transport
from .reference import Reference, parse_reference
from . import modelpack
from .pull import _require_tag_or_digest

READ = 1 << 20  # the buffer a blob passes through on its way to sha256: the only memory a blob of any size takes
# When to look whether a tier stored what it fetched (mm's own margins). The tier's own copy of each blob ran beside
# the answer mm read, so it ended about when that read did; its commits then fsync the blobs. A tier whose disk
# writes at least as fast as the blob came in has done that within the time the blob took to pass: so the first look
# is the slowest read's time after the tier's reads ended (at least STORE_FIRST); after each "not yet" the pause
# doubles. No look after STORE_FLOOR plus three times the slowest read (a disk at a third of that rate), unless the
# tier is broken or hostile: then it has held the preheat at most that, then STORE_FLOOR more for one last look at
# each blob left.
STORE_FIRST = 0.2  # seconds
STORE_FLOOR = 2.0  # seconds


@dataclass(frozen=True)
class BlobAtTier:
    digest: str
    size: int
    status: str  # "warm" (the tier had it) | "fetched" (read whole, digest checked) | "failed"
    bytes_read: int = 0
    error: str | None = None
    error_kind: type[MMError] | None = None
    read_seconds: float = 0.0  # how long the tier took to send it (fetched blobs)
    stored: bool | None = None  # fetched: whether the tier then served it from its own store (None: not asked)
    looks: int = 0  # stored-yet questions asked
    stored_after: float | None = None  # seconds from the end of the tier's reads until a look found it stored
    not_stored: str | None = None  # why not: what the tier answered to the last question


@dataclass(frozen=True)
class TierReport:
    tier: str  # host[:port]
    blobs: tuple[BlobAtTier, ...]
    seconds: float  # the manifest and the blobs' reads
    waited: float = 0.0  # seconds from the end of the tier's reads until it had stored what it fetched (or gave up)

    @property
    def bytes_read(self) -> int:
        return sum(b.bytes_read for b in self.blobs)

    @property
    def warm(self) -> int:
        return sum(b.status == "warm" for b in self.blobs)

    @property
    def fetched(self) -> int:
        return sum(b.status == "fetched" for b in self.blobs)

    @property
    def failed(self) -> list[BlobAtTier]:
        return [b for b in self.blobs if b.status == "failed"]

    @property
    def stored(self) -> int:
        return sum(b.stored is True for b in self.blobs)

    @property
    def unstored(self) -> list[BlobAtTier]:
        return [b for b in self.blobs if b.stored is False]


@dataclass(frozen=True)
class PreheatReport:
    reference: str
    digest: str  # the manifest digest the reference resolved to at the origin
    blobs: int
    total_bytes: int  # of the artifact's blobs (config and layers)
    tiers: tuple[TierReport, ...]
    seconds: float

    @property
    def failed(self) -> list[BlobAtTier]:
        return [b for t in self.tiers for b in t.failed]


def preheat(reference: str, tiers: tuple[tuple[str, Transport], ...], credentials: Credentials | None = None,
            transport: Transport = Transport(), workers: int = 4,
            progress: ProgressSink = NULL_PROGRESS) -> PreheatReport:
    """Warm TIERS ((host, transport), nearest the origin first) with REFERENCE's artifact; see the module docstring.
    CREDENTIALS go to the origin only; each tier gets its own auth-file entry, or none."""
    from .client import load_credentials

    started = time.monotonic()
    ref = parse_reference(reference)
    _require_tag_or_digest(ref, reference)
    with Client(ref, credentials, transport) as origin:  # the manifest only: no blob of it is read at the origin
        data, _, digest = origin.get_manifest(ref)
    parsed = modelpack.parse(data, str(ref.at(digest)))
    layers = (parsed.config, *parsed.files, *(x for x in (parsed.mm_layer, parsed.sig_layer) if x))
    blobs = sorted({d.digest: d for d in layers}.values(), key=lambda d: -d.size)  # the same bytes: one blob
    total = sum(d.size for d in blobs)
    reports = []
    progress.begin(total * len(tiers), f"preheat {ref.repository}@{digest[7:19]} at {len(tiers)} tier(s)",
                   files=len(blobs) * len(tiers), unit="blob")  # each blob counted once at each tier
    try:
        for host, tier_transport in tiers:
            interrupt.check()
            began = time.monotonic()
            with Client(Reference(host, ref.repository), load_credentials(host), tier_transport) as tier:
                tier.get_manifest(Reference(host, ref.repository, None, digest))  # checked against the digest

                def one(d) -> BlobAtTier:
                    with working_on(progress, f"{host} {d.digest[7:19]}"):
                        return warm_blob(tier, d.digest, d.size, progress.advance)

                with interrupt.worker_pool(workers) as pool:
                    done = tuple(pool.map(one, blobs))
                read = time.monotonic()
                with working_on(progress, f"{host}: waiting until it has stored what it fetched"):
                    done = wait_stored(tier, done)
            reports.append(TierReport(host, done, read - began, time.monotonic() - read))
    finally:
        progress.end()
    return PreheatReport(str(ref), digest, len(blobs), total, tuple(reports), time.monotonic() - started)


def warm_blob(tier: Client, digest: str, size: int, advance: Callable[[int], None]) -> BlobAtTier:
    """One request for DIGEST at TIER (its first byte): "warm" when the tier answers with that byte, "fetched"
    when it answers with the whole blob, read here through sha256 and checked."""
    where = f"{tier.ref.name}@{digest}"
    began = time.monotonic()
    try:
        with tier.open_blob(digest, 0, 1 if size else None) as raw:
            if raw.status == 206 and size:
                expected = f"bytes 0-0/{size}"
                said = (raw.header("Content-Range") or "").strip()
                if said != expected:
                    raise RemoteError(f"{where}: answered 206 with Content-Range {shown(said, 60)!r}, not "
                                      f"{expected!r}")
                raw.read_capped(1, "a one-byte range")
                advance(size)
                return BlobAtTier(digest, size, "warm")
            got = _stream_sha256(raw, size, where, advance)
    except RetryLater as e:
        return BlobAtTier(digest, size, "failed", error=e.message, error_kind=RemoteError)
    except MMError as e:
        return BlobAtTier(digest, size, "failed", getattr(e, "read", 0), e.message, type(e))
    return BlobAtTier(digest, size, "fetched", got, read_seconds=time.monotonic() - began)


def wait_stored(tier: Client, blobs: tuple[BlobAtTier, ...], clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], object] = interrupt.STOP.wait) -> tuple[BlobAtTier, ...]:
    """BLOBS, each one TIER fetched marked stored once the tier serves it from its own store, or not stored (with
    what the tier answered) at the deadline; see STORE_FIRST and STORE_FLOOR. One look at a time, smallest blob
    first: a look at a blob still being stored costs at most that blob, or the buffers to the tier's upstream, and
    the tier commits its blobs side by side, so one still storing says the others may be too: then every look
    waits the pause, which doubles."""
    start = clock()
    todo = sorted((i for i, b in enumerate(blobs) if b.status == "fetched"), key=lambda i: blobs[i].size)
    if not todo:
        return blobs
    slowest = max(blobs[i].read_seconds for i in todo)
    pause = max(STORE_FIRST, slowest)
    due, deadline = start + pause, start + STORE_FLOOR + 3 * slowest
    looks = dict.fromkeys(todo, 0)
    after: dict[int, float] = {}
    why: dict[int, str | None] = {}
    while todo:
        wait = due - clock()
        if wait > 0:
            sleep(wait)
        interrupt.check()
        i = todo[0]
        left = deadline - clock()
        if left < -STORE_FLOOR:  # the last looks (one per blob left, after the deadline) had their time too
            why.update((k, why.get(k) or "not asked before the deadline") for k in todo)
            break
        looks[i] += 1
        try:  # a last look, after the deadline, gets STORE_FIRST for its answer
            why[i] = tier.blob_in_store(blobs[i].digest, max(left, STORE_FIRST))
        except MMError as e:  # (a look that fails is a "not yet": the blob itself was proven when it passed)
            why[i] = e.message
        if why[i] is None:
            after[i] = clock() - start
            todo.pop(0)
        elif left <= 0:
            todo.pop(0)
        else:
            pause *= 2
            due = min(clock() + pause, deadline)
    return tuple(replace(b, stored=why[i] is None, looks=looks[i], stored_after=after.get(i),
                         not_stored=why[i]) if i in looks else b for i, b in enumerate(blobs))


def _stream_sha256(raw: "wire.RawAnswer", size: int, where: str, advance: Callable[[int], None]) -> int:
    """Read RAW's body (the whole blob) through sha256 in one fixed buffer; its length and digest checked. A body
    longer than SIZE is not read past it; one slower than MM_NET_MIN_RATE over MM_NET_RATE_WINDOW is cut."""
    if raw.length is not None and raw.length != size:
        raise RemoteError(f"{where}: answered with {raw.length} bytes for a blob of {size}")
    lim = wire.limits()
    view = memoryview(bytearray(READ))
    sha = hashlib.sha256()
    got = window_bytes = 0
    window_at = time.monotonic()
    while got < size:
        if interrupt.requested():
            interrupt.check()
        try:
            n = raw.readinto(view[:min(READ, size - got)])
        except (OSError, http.client.HTTPException) as e:
            raise _Read(RemoteError, f"{where}: transfer cut after {got} of {size} bytes ({type(e).__name__})", got)
        if not n:
            raise _Read(RemoteError, f"{where}: the body ended after {got} of {size} bytes", got)
        sha.update(view[:n])
        got += n
        window_bytes += n
        advance(n)
        now = time.monotonic()
        if now - window_at >= lim.rate_window:
            if window_bytes < lim.min_rate * (now - window_at):
                raise _Read(RemoteError, f"{where}: sent {window_bytes} bytes in {now - window_at:.1f} s, less than "
                                         f"MM_NET_MIN_RATE ({lim.min_rate:g} bytes/s)", got)
            window_at, window_bytes = now, 0
    if "sha256:" + sha.hexdigest() != where.rsplit("@", 1)[1]:
        raise _Read(IntegrityError, f"{where}: the bytes the tier sent do not match the blob's digest (the tier may "
                                    f"hold a bad copy: check its upstream)", got)
    return got


def _Read(kind: type[MMError], message: str, read: int) -> MMError:
    """KIND(MESSAGE), carrying the bytes READ before it (the tier's figure counts them)."""
    e = kind(message)
    e.read = read
    return e
