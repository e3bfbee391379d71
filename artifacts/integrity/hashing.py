"""One read pass, several digests: blake3 (fast re-checks), sha256 (the Hub's LFS oid), git blob sha1.

Measured on the 2-core machines (DESIGN.md): blake3 `update_mmap` runs at storage speed; sha256 over an
mmap in 1-16 MiB slices releases the GIL, so the two run side by side in two threads for the price of
sha256 alone.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import blake3

# the window reader lives in reading.py (cheap to import, for verify's head start); named here for its users too
from .reading import SMALL_READ, ChangedDuringRead, lease, lease_broken, mapped_windows, unlease  # noqa: F401

# hashlib is imported inside the functions that use it: loading OpenSSL costs ~8 ms (this project's 2-core EPYC VM,
# 21 runs) of a command that computes no sha256, such as `mm verify --quick` or a blake3-only verify.

SLICE = 8 * 1024 * 1024
# StreamHasher gives each slice of this size to every hash in turn, so only the first reads it from memory: on these
# VMs sha256 costs 0.56 CPU-s per GiB of cached bytes and 0.88-0.93 of bytes out of the cache (32-256 MiB buffers);
# a fetch of 8 x 128 MiB, whose hashing thread ran blake3 and sha256 side by side over the same 4 MiB, fell from
# 2.01 to 1.86 CPU-s (median of 6 interleaved pairs, docs/fetch.md)
CACHE_SLICE = 256 * 1024


@dataclass(frozen=True)
class Digests:
    size: int
    blake3: str
    sha256: str | None = None
    git_sha1: str | None = None


def git_blob_header(size: int) -> bytes:
    return b"blob %d\x00" % size


def git_blob_sha1(data: bytes) -> str:
    import hashlib
    return hashlib.sha1(git_blob_header(len(data)) + data).hexdigest()


class StreamHasher:
    """Hashes bytes as they stream past (a download, a tar member), so nothing is read twice.

    git_sha1 needs the final size up front (git hashes a header with the length first).
    """

    def __init__(self, sha256: bool = True, git_size: int | None = None, blake3_threads: int = 1):
        import hashlib
        self._b3 = blake3.blake3(max_threads=blake3_threads)
        self._sha = hashlib.sha256() if sha256 else None
        self._git = None
        if git_size is not None:
            self._git = hashlib.sha1(git_blob_header(git_size))
        self._slice = CACHE_SLICE if blake3_threads == 1 else None  # blake3's own threads want the whole chunk
        self.size = 0

    def update(self, chunk: bytes | memoryview) -> None:
        """Every digest of CHUNK, a CACHE_SLICE at a time: each hash after the first reads it from the core's cache."""
        if self._slice is None or len(chunk) <= self._slice:
            self._update(chunk)
            return
        with memoryview(chunk) as view:
            for at in range(0, len(view), self._slice):
                self._update(view[at:at + self._slice])

    def _update(self, chunk: bytes | memoryview) -> None:
        self._b3.update(chunk)
        if self._sha is not None:
            self._sha.update(chunk)
        if self._git is not None:
            self._git.update(chunk)
        self.size += len(chunk)

    def copy(self) -> "StreamHasher":
        """An independent hasher with the same state (to try a continuation and keep it only if it checks)."""
        twin = StreamHasher.__new__(StreamHasher)
        twin._b3 = self._b3.copy()
        twin._sha = self._sha.copy() if self._sha is not None else None
        twin._git = self._git.copy() if self._git is not None else None
        twin._slice = self._slice
        twin.size = self.size
        return twin

    def digests(self) -> Digests:
        return Digests(
            size=self.size,
            blake3=self._b3.hexdigest(),
            sha256=self._sha.hexdigest() if self._sha is not None else None,
            git_sha1=self._git.hexdigest() if self._git is not None else None,
        )


def bounded_map(pool, fn: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map(FN, ITEMS), in order, with at most WINDOW calls submitted ahead of the one whose result is taken:
    Executor.map submits every item at once, a Future (~1 KB) each, all alive until the end, for every file of a
    revision that may hold a million. Where one call fails, those not started yet are cancelled."""
    from collections import deque

    pending: deque = deque()
    try:
        for item in items:
            if len(pending) >= window:
                yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


class SideThread:
    """A thread that runs one call at a time for its owner (``begin``, then ``end`` waits and re-raises)."""

    def __init__(self, name: str = "mm-hash-side"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, arg = job
            try:
                fn(arg)
                self._done.put(None)
            except BaseException as e:  # handed to end()
                self._done.put(e)

    def begin(self, fn: Callable, arg: object) -> None:
        self._jobs.put((fn, arg))

    def end(self) -> None:
        if (error := self._done.get()) is not None:
            raise error

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def hash_file(path: Path, sha256: bool = True, git_sha1: bool = False, blake3_threads: int = 1) -> Digests:
    """Digest a file in one read: blake3 in this thread, sha256/sha1 over the same mmap in another.

    blake3_threads: 1 when the caller already hashes several files in parallel; blake3.AUTO for one big file.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size <= SMALL_READ:  # one read, hashed here: a lease, a mapping and a thread cost more than the hashing
            data = os.read(f.fileno(), size)
            if len(data) != size:
                raise ChangedDuringRead(f"{path}: {len(data)} bytes read of {size}: the file was cut while being read")
            return _hash_bytes(data, sha256, git_sha1)
        if not lease(f.fileno()):  # the mapping could lose its pages under us (SIGBUS): read instead
            return _hash_read(path, size, sha256, git_sha1, blake3_threads)
        if os.fstat(f.fileno()).st_size != size:
            raise ChangedDuringRead(f"{path}: its size changed while it was being opened")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            side: dict[str, str] = {}
            worker = None
            if sha256 or git_sha1:
                worker = threading.Thread(target=_side_digests, args=(mm, size, sha256, git_sha1, side))
                worker.start()
            b3 = blake3.blake3(max_threads=blake3_threads)
            b3.update(mm)
            if worker is not None:
                worker.join()
        if lease_broken(f.fileno()):
            raise ChangedDuringRead(f"{path}: another process opened it for writing or cut it while it was being hashed")
        return Digests(size=size, blake3=b3.hexdigest(), sha256=side.get("sha256"), git_sha1=side.get("git_sha1"))


def _hash_read(path: Path, size: int, sha256: bool, git_sha1: bool, blake3_threads: int) -> Digests:
    hasher = StreamHasher(sha256=sha256, git_size=size if git_sha1 else None, blake3_threads=blake3_threads)
    for piece in mapped_windows(path, SLICE):
        hasher.update(piece)
    if hasher.size != size:
        raise ChangedDuringRead(f"{path}: {hasher.size} bytes read of {size}: the file changed while being hashed")
    return hasher.digests()


def _side_digests(mm: mmap.mmap, size: int, sha256: bool, git_sha1: bool, out: dict[str, str]) -> None:
    import hashlib
    hashers = {}
    if sha256:
        hashers["sha256"] = hashlib.sha256()
    if git_sha1:
        hashers["git_sha1"] = hashlib.sha1(git_blob_header(size))
    view = memoryview(mm)
    try:
        for start in range(0, size, SLICE):
            piece = view[start : start + SLICE]
            for h in hashers.values():
                h.update(piece)
            piece.release()
    finally:
        view.release()
    out.update({name: h.hexdigest() for name, h in hashers.items()})


def _hash_bytes(data: bytes, sha256: bool, git_sha1: bool) -> Digests:
    import hashlib
    return Digests(
        size=len(data),
        blake3=blake3.blake3(data).hexdigest(),
        sha256=hashlib.sha256(data).hexdigest() if sha256 else None,
        git_sha1=git_blob_sha1(data) if git_sha1 else None,
    )


def blake3_file(path: Path | str, threads: int = 1, on_bytes: Callable[[int], None] | None = None,
                window: int = 32 * 1024 * 1024) -> str:
    """blake3 alone, at storage speed (the verify path), with memory bounded whatever the file size.

    threads: 1 when the caller hashes several files in parallel; blake3.AUTO (-1) for one big file.
    See mapped_windows for the memory bound and the SIGBUS caveat.
    """
    h = blake3.blake3(max_threads=threads)
    for piece in mapped_windows(path, window, on_bytes):
        h.update(piece)
    return h.hexdigest()


def upstream_digest(path: Path | str, kind: str, on_bytes: Callable[[int], None] | None = None,
                    window: int = SLICE) -> str:
    """The Hub's identity of a local file: kind "lfs-sha256" (sha256) or "git-blob-sha1", memory bounded."""
    import hashlib
    if kind == "lfs-sha256":
        h = hashlib.sha256()
    elif kind == "git-blob-sha1":
        h = hashlib.sha1(git_blob_header(os.stat(path).st_size))
    else:
        raise ValueError(f"unknown upstream identity kind {kind!r}")
    for piece in mapped_windows(path, window, on_bytes):
        h.update(piece)
    return h.hexdigest()
