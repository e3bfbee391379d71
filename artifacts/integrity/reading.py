"""How verify reads its files: which file on which core (hash_schedule), in windows of what size (window_size),
and the windows themselves (mapped_windows, under a read lease).

Its imports are few and cheap on purpose: the head start of `mm verify DIR` (early.py) reads files with it before
the command tree loads, and every module imported first delays the first byte hashed (hashing.py, with dataclasses,
pathlib and typing, cost ~20 ms of a start on this project's 2-core VM; this module ~2 ms).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import signal

from ..errors import BadInput

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (~2 ms before the first byte)
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable, Iterator, Protocol, TypeVar

    class Planned(Protocol):
        """What hash_schedule looks at in a file to hash (verify.Expected)."""

        size: int
        algorithm: str

    F = TypeVar("F", bound=Planned)

SMALL_READ = 1024 * 1024  # files up to this size are read, not mapped (hashing.blake3_file and mapped_windows)
BIG_FILE = 64 * 1024 * 1024  # below this, a file is always hashed on one core (threads cost more than they save)
# Below this, a file is hashed in the calling thread, one after another: two threads hashing files this small spend
# their time waiting on each other for the GIL (measured, 8,192 files of 1 KiB: 0.09 s in one thread, 0.18 s in
# two; 16 KiB: 0.032 against 0.035 s; 64 KiB: 0.039 against 0.026 s). 10,000 small files: 0.51-0.56 s, 0.21-0.25 s so.
SMALL_FILE = 16 * 1024
# Bytes of file windows mapped (or read into buffers) at once over all hashing threads: a thread's part, between
# 2 and 64 MiB. A file hashed alone on all cores has the whole budget: blake3's threads split each window, and
# fewer, larger windows cost less (measured on 16 cores, 11 shards of 768 MiB warm, hashing alone: 0.251 s with
# 32 MiB windows, 0.224 s with 64 MiB, 0.202 s mapping each file whole as b3sum does, whose RSS is the file).
WINDOW_BUDGET = 64 * 1024 * 1024
MAX_WINDOW = WINDOW_BUDGET
MIN_WINDOW = 2 * 1024 * 1024
ROUND_SPREAD = 1.5  # largest / smallest file in one round of files hashed one per core


def window_size(jobs: int) -> int:
    """Each hashing thread's window: its part of WINDOW_BUDGET, within [MIN_WINDOW, MAX_WINDOW]."""
    return max(MIN_WINDOW, min(MAX_WINDOW, WINDOW_BUDGET // max(1, jobs)))


def hash_schedule(files: list[F], jobs: int) -> tuple[list[F], list[F]]:
    """(files to hash one per core, largest first; files to hash one at a time in the calling thread: large blake3
    files, each on all cores, then the small ones, SMALL_FILE).

    Large files go one per core in rounds of JOBS files of similar size (within ROUND_SPREAD), so the
    cores finish together; the rest would leave cores idle while one file runs on a single thread.
    """
    big = sorted((e for e in files if e.size >= BIG_FILE and e.algorithm == "blake3"), key=lambda e: -e.size)
    rounds = 0
    while rounds + jobs <= len(big) and big[rounds].size <= ROUND_SPREAD * big[rounds + jobs - 1].size:
        rounds += jobs
    small = [e for e in files if e.size < SMALL_FILE]
    one_at_a_time = big[rounds:] + small
    later = {id(e) for e in big[rounds:]}  # small files are told by their size: no set of a million entries
    return (sorted((e for e in files if e.size >= SMALL_FILE and id(e) not in later), key=lambda e: -e.size),
            one_at_a_time)


class ChangedDuringRead(BadInput):
    """The file was truncated, or opened for writing, by another process while it was being hashed."""


def lease(fd: int) -> bool:
    """Take a read lease on FD: while it is held, another process that opens the file for writing or
    truncates it waits (up to /proc/sys/fs/lease-break-time) until we let go, so a mapping of the file can
    never lose its pages under us (which would kill the process with SIGBUS). The break is announced with
    SIGURG, whose default action is to ignore it; the reader polls lease_broken() between windows.
    False when the kernel will not grant one (the file is open for writing somewhere, another owner without
    CAP_LEASE, a file system without leases): the caller then reads instead of mapping."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        return True
    except (OSError, AttributeError):
        return False


def unlease(fd: int) -> None:
    """Give a lease back before the descriptor is closed (a mapping still held keeps the open file, and its lease)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass


def lease_broken(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return True


def mapped_windows(path: Path | str, window: int, on_bytes: Callable[[int], None] | None = None) -> Iterator[memoryview | bytes]:
    """A file's bytes as consecutive views, each byte read once, peak RSS about one window.

    Small files are read with one os.read (cheaper than a mapping, and mmap rejects empty files).
    Larger ones are mmapped under a read lease (see _lease); each window's page mappings are dropped once
    the consumer is done with it (MADV_DONTNEED on a read-only file mapping frees only our page-table
    entries; the page cache keeps the data), so RSS stays near one window instead of the file's size as
    with `update_mmap`. The next window is prefetched (WILLNEED) unless it is cached. on_bytes(n) follows each
    window. Without a lease the file is read (pread into one aligned buffer) instead: a truncation then
    shows as a short read. Either way a file cut or opened for writing meanwhile raises ChangedDuringRead.
    """
    fd = os.open(path, os.O_RDONLY)  # not open(): its buffered reader costs as much as hashing a small file
    try:
        yield from fd_windows(fd, path, window, on_bytes)
    finally:
        os.close(fd)  # releases the lease: a writer waiting for it goes on


def fd_windows(fd: int, path: Path | str, window: int,
               on_bytes: Callable[[int], None] | None = None) -> Iterator[memoryview | bytes]:
    """mapped_windows of the file open as FD (named PATH in errors), which the caller opened and closes."""
    size = os.fstat(fd).st_size
    if size <= SMALL_READ:
        data = os.read(fd, size)
        if len(data) != size:
            raise ChangedDuringRead(f"{path}: {len(data)} bytes read of {size}: the file was cut while being read")
        yield data
        if on_bytes is not None:
            on_bytes(len(data))
        return
    if not lease(fd):
        yield from _read_windows(fd, path, size, window, on_bytes)
        return
    if os.fstat(fd).st_size != size:
        raise ChangedDuringRead(f"{path}: its size changed while it was being opened")
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            here = cached(fd, 0) and cached(fd, min(window, size) - 1)  # this window's pages in the page cache
            for start in range(0, size, window):
                length = min(window, size - start)
                ahead = min(window, size - start - length)
                next_cached = bool(ahead) and cached(fd, start + length) and cached(fd, start + length + ahead - 1)
                if ahead and not next_cached:
                    mm.madvise(mmap.MADV_WILLNEED, start + length, ahead)
                if here:
                    populate(mm, start, length)
                here = next_cached
                piece = view[start : start + length]
                try:
                    yield piece
                finally:
                    piece.release()
                mm.madvise(mmap.MADV_DONTNEED, start, length)
                if on_bytes is not None:
                    on_bytes(length)
                if lease_broken(fd):
                    raise ChangedDuringRead(f"{path}: another process opened it for writing or cut it while it "
                                            f"was being read")
        finally:
            view.release()


# Linux 5.14's MADV_POPULATE_READ (Python 3.11's mmap has no name for it): a cached window's pages mapped in one call
# rather than a fault at a time while blake3 reads them. Measured on this project's 2-core VM, 3.94 GiB warm, hashing
# in process, interleaved: 0.828 CPU-s against 0.862 (8 rounds each, median; ~60,000 faults), 0.338-0.340 s against
# 0.345-0.352 in a quieter run. Only for windows found cached: on pages still to be read it would wait for the disk
# holding the GIL (mmap.madvise keeps it).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_populate_refused = False  # the kernel has no MADV_POPULATE_READ (EINVAL): faults as before


def populate(mm: mmap.mmap, start: int, length: int) -> None:
    """Map LENGTH bytes of MM from START (cached pages) now; nothing when the kernel cannot (then never again)."""
    global _populate_refused
    if _populate_refused:
        return
    try:
        mm.madvise(MADV_POPULATE_READ, start, length)
    except OSError as e:
        import errno
        if e.errno == errno.EINVAL:
            _populate_refused = True
        # anything else (a page gone meanwhile): blake3's own reads fault it in, as without


_PROBE = bytearray(1)  # what cached() reads into (shared: its content is never looked at)


def cached(fd: int, offset: int) -> bool:
    """Whether the page of FD at OFFSET is in the page cache: a one-byte read told not to wait (RWF_NOWAIT).
    The prefetch of the next window (MADV_WILLNEED) is asked only where it is not: for pages already there, the
    kernel still looks each one up, a window at a time (8,192 lookups for 32 MiB, every byte of a warm verify)."""
    try:
        return os.preadv(fd, [_PROBE], offset, os.RWF_NOWAIT) == 1
    except (OSError, AttributeError):  # EAGAIN: not cached; or no RWF_NOWAIT here: prefetch as before
        return False


def _read_windows(fd: int, path: Path | str, size: int, window: int,
                  on_bytes: Callable[[int], None] | None) -> Iterator[memoryview]:
    """The read path of mapped_windows: pread into one page-aligned buffer (2.3x faster than a bytearray)."""
    buf = mmap.mmap(-1, window)
    view = memoryview(buf)
    try:
        pos = 0
        while pos < size:
            want = min(window, size - pos)
            got = os.preadv(fd, [view[:want]], pos)
            if got == 0:
                raise ChangedDuringRead(f"{path}: ended at byte {pos} of {size}: the file was cut while being read")
            piece = view[:got]
            try:
                yield piece
            finally:
                piece.release()
            pos += got
            if on_bytes is not None:
                on_bytes(got)
    finally:
        view.release()
        buf.close()
