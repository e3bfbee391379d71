"""Copy I/O shared by pack, unpack and check: a hashing read-ahead pipe, writeback that follows the copy, and the
read-back from the disk.

Nothing here knows about volumes or the index; every other module of the bundle package may use it.

The copy costs the kernel one copy of each byte, not two: the source is mapped (its page cache pages, no copy),
hashed where it lies and written from there (the one copy, into the destination's page cache). Reading into a
buffer and writing it out, as tar does, copies every byte twice; measured on these machines (1 GiB, page cache
warm): 1.28 s of sys time read+write against 0.32 s mapped, 0.42 s with the page faults counted.
"""
from __future__ import annotations

import functools
import mmap
import os
import queue
import threading
from pathlib import Path

import blake3

from ..edges.fsutil import libc_function
from ..integrity.hashing import SMALL_READ, ChangedDuringRead, lease, lease_broken, unlease

# blake3's own threads over each chunk: the writer thread spends its time in the kernel, so the
# hashing helper thread gets a second core (measured: bundle ~1.4x faster than one hashing thread).
HASH_THREADS = blake3.blake3.AUTO


# Bytes handed to the kernel per write() into the page cache, on a VM that reports free memory to its host. The
# kernel sizes a file's new page-cache folios by the write: 8 MiB writes get 2 MiB folios, cut from free blocks of
# 2 MiB. With virtio-balloon free page reporting (page_reporting_order 9: blocks of 2 MiB and more) the guest has
# handed exactly those back, and the first touch of each page faults on the host. Measured on such a VM: 1 GiB of
# fresh 2 MiB pages took 0.14-2.3 s to touch, in step with what the guest had just reported (192 MiB -> 0.14 s,
# 604 MiB -> 0.64 s), 4 KiB pages 0.25-0.38 s every time; a 2 GiB copy + fsync right after deleting a 2 GiB file
# (tests/bench/micro_io.py writesize, 3 rounds): 64 KiB writes 0.96-1.09 s, 256 KiB 1.02-1.15 s, 1 MiB 3.7-4.1 s,
# 8 MiB 4.3-4.6 s. Writes up to 256 KiB take folios from the free lists the guest keeps (blocks under 2 MiB are
# never reported), as tar's 10 KiB writes do; 64 KiB rather than 256 because 256 KiB had slow runs too in earlier
# rounds (2.1-2.7 s), 64 KiB none over 1.5 s. Elsewhere large writes are cheaper, so they stay whole: on the
# 16-core H200 host (no balloon device) a build writing 64 KiB pieces everywhere made bundle 2.95 s against
# 2.61 s and unbundle 3.30 s against 2.38 s (4.25 GiB, tests/bench/bundle.py), tar unchanged.
SMALL_WRITE = 64 * 1024
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
VIRTIO_ID_BALLOON = 5  # virtio spec 1.2, 5 "Device Types": the memory balloon
VIRTIO_BALLOON_F_REPORTING = 5  # virtio spec 1.2, 5.5.3: the guest reports free pages to the host


def reports_free_pages(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether this machine is a VM whose balloon device reports free pages to the host (sysfs: each virtio
    device's `device` id and its negotiated `features`, one 0/1 character per feature bit)."""
    try:
        for dev in devices.iterdir():
            try:
                if int((dev / "device").read_text().strip(), 16) != VIRTIO_ID_BALLOON:
                    continue
                bits = (dev / "features").read_text().strip()
            except (OSError, ValueError):
                continue
            if len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1":
                return True
    except OSError:  # no virtio bus: bare metal, or not Linux
        pass
    return False


@functools.cache
def write_size() -> int | None:
    """Most bytes per write() into the page cache: SMALL_WRITE where free pages are reported, else None (whole)."""
    return SMALL_WRITE if reports_free_pages() else None


def write_all(fd: int, data, offset: int | None = None) -> int:
    """Write all of DATA to FD, at OFFSET (pwrite) or at the file's position, in writes of at most write_size()
    bytes; returns how many (len(DATA)). An error names nothing: the caller knows the file."""
    view = memoryview(data)
    total = len(view)
    step = write_size() or total
    done = 0
    while done < total:
        piece = view[done: done + step]
        done += os.write(fd, piece) if offset is None else os.pwrite(fd, piece, offset + done)
    return total


class WriteBehind:
    """Writeback that follows a copy: every STEP bytes written, the kernel is told to write the range back now,
    without waiting. Left to itself it starts only when a tenth of RAM is dirty, and the fsync that publishes
    the file then finds nearly all of it still to write (measured, 2 GiB written then fsynced: 8.5 s; fdatasync
    every 128 MiB in a helper thread, as mm did before: 5.9 s; sync_file_range 2.7 s; fadvise 1.7 s, and a fifth
    of the sys time). With --no-sync too: there is no fsync to get ahead of, but dirty pages piling up throttle
    the writer (measured, bundle --no-sync 14.2 s against 5.3 s durable).

    DROP (bundle volumes, which go to another disk): posix_fadvise(DONTNEED) starts writeback of the dirty pages
    in the range and drops the pages already written back, so memory stays free for the source's pages and a
    later `mm bundle verify` reads the disk, not the page cache; each call covers the last few steps, dropping
    what the previous calls started. Otherwise (unbundled files, which the engine reads next; a data volume
    hashed whole once written, for a parity index) sync_file_range(SYNC_FILE_RANGE_WRITE) starts writeback and
    leaves the pages cached.

    Durability is not its job: neither call waits for the disk or flushes its cache. The one fsync before the
    rename (fsutil.publish) is what makes a file durable, so a crash leaves either no file under the final name
    or a complete one, as before."""

    STEP = 32 * 1024 * 1024
    BACK = 4  # steps each fadvise covers: pages still under writeback at one call are dropped by a later one

    def __init__(self, fd: int, start: int = 0, drop: bool = False):
        self.fd, self.start, self.pos, self.mark = fd, start, start, start
        self.drop = drop

    def wrote(self, n: int) -> None:
        self.pos += n
        if self.pos - self.mark >= self.STEP:
            self.push()

    def push(self) -> None:
        """Start writeback of what was written since the last push (best effort: errors show at the fsync)."""
        try:
            if self.drop:
                low = max(self.start, self.pos - self.BACK * self.STEP)
                os.posix_fadvise(self.fd, low, self.pos - low, os.POSIX_FADV_DONTNEED)
            elif (range_write := libc_function("sync_file_range", "c_int", "c_longlong", "c_longlong",
                                               "c_uint")) is not None:
                range_write(self.fd, self.mark, self.pos - self.mark, 2)  # SYNC_FILE_RANGE_WRITE
        except OSError:
            pass
        self.mark = self.pos


class ChunkPipe:
    """Hashes the next chunks of a file in a helper thread while the caller writes the current one.

    blake3/sha256 and os.write release the GIL, so on two cores hashing hides behind the write. The file is
    mapped under a read lease (hashing.lease: a writer or a truncation waits for us, so the mapping cannot lose
    its pages under us: SIGBUS); at most DEPTH chunks are mapped at a time, each dropped from our page tables
    once written (the page cache keeps it), so memory stays flat whatever the size. Where no lease is granted
    (the file is open for writing elsewhere, a file system without leases) or MAPPED is False, the chunks are
    read into DEPTH reused page-aligned buffers instead.
    """

    CHUNK = 8 * 1024 * 1024
    DEPTH = 3

    def __init__(self):
        self._maps = [mmap.mmap(-1, self.CHUNK) for _ in range(self.DEPTH)]
        self._free: queue.Queue = queue.Queue()
        for m in self._maps:
            self._free.put(m)

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a stream abandoned by an exception still holds a view; GC frees it
                pass

    def stream(self, path: Path, offset: int, length: int, hashers=(), mapped: bool = True, drop: bool = False):
        """Yield views of LENGTH bytes of PATH from OFFSET, each already fed to every hasher in HASHERS. DROP: once a
        view is used, its pages leave the page cache (posix_fadvise DONTNEED; clean pages only, so nothing is lost):
        for a file read once, e.g. a bundle volume on its way into a model (the next write reuses that memory)."""
        fd = os.open(path, os.O_RDONLY)
        leased = False
        try:
            if length <= min(self.CHUNK, SMALL_READ):  # one read here: a lease, a mapping and a helper thread cost
                data = os.pread(fd, length, offset)    # more than a small file's bytes (a revision may hold a million)
                if len(data) != length:
                    raise EOFError(f"{path}: ended {length - len(data)} bytes early")
                for h in hashers:
                    h.update(data)
                yield data
                if drop:
                    drop_cached(fd, offset, length)
                return
            leased = mapped and length > 0 and lease(fd)
            if not leased:
                yield from self._pipe(lambda ready, stop: self._produce_read(fd, path, offset, length, hashers,
                                                                            ready, stop, drop))
                return
            if os.fstat(fd).st_size < offset + length:
                raise EOFError(f"{path}: ended {offset + length - os.fstat(fd).st_size} bytes early")
            head = offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
            mapping = mmap.mmap(fd, head + length, offset=offset - head, access=mmap.ACCESS_READ)
            try:
                yield from self._pipe(lambda ready, stop: self._produce_mapped(mapping, fd, path, head, length,
                                                                              hashers, ready, stop, drop,
                                                                              offset - head))
            finally:
                try:
                    mapping.close()
                except BufferError:  # the caller still holds a view: the mapping goes with it (unleased, below)
                    pass
        finally:
            if leased:  # explicitly: a mapping the caller still holds would keep the open file, and the lease
                unlease(fd)
            os.close(fd)

    def _pipe(self, produce):
        """Run PRODUCE(ready, stop) in a helper thread; yield the views it queues, handing each back once used."""
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def run() -> None:
            try:
                produce(ready, stop)
                ready.put(None)
            except BaseException as e:  # handed to the consumer
                ready.put(e)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                view, n, done = item
                try:
                    yield view[:n]
                finally:
                    view.release()
                    done()
        finally:
            stop.set()
            while worker.is_alive() or not ready.empty():
                try:
                    item = ready.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    item[0].release()
                    item[2]()
            worker.join()

    def _produce_read(self, fd: int, path: Path, offset: int, length: int, hashers, ready, stop,
                      drop: bool = False) -> None:
        left, pos = length, offset

        def done(buf, start: int, n: int) -> None:
            if drop:  # from the chunk before on: a large folio across their boundary goes now
                low = max(offset, start - self.CHUNK)
                drop_cached(fd, low, start + n - low)
            self._free.put(buf)

        while left and not stop.is_set():
            buf = self._free.get()
            view = memoryview(buf)
            n = os.preadv(fd, [view[: min(len(buf), left)]], pos)
            if not n:
                view.release()
                self._free.put(buf)
                raise EOFError(f"{path}: ended {left} bytes early")
            for h in hashers:
                h.update(view[:n])
            ready.put((view, n, lambda buf=buf, start=pos, n=n: done(buf, start, n)))
            left, pos = left - n, pos + n

    def _produce_mapped(self, mapping: mmap.mmap, fd: int, path: Path, head: int, length: int, hashers, ready,
                        stop, drop: bool = False, file_start: int = 0) -> None:
        """Chunks of MAPPING's bytes from HEAD on (LENGTH of them), at most DEPTH in use; the mapping starts at
        FILE_START of the file."""
        whole = memoryview(mapping)
        slots = threading.Semaphore(self.DEPTH)

        def done(start: int, end: int) -> None:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)  # our page tables only: the cache keeps them
            if drop:  # and now, unmapped, out of the cache too; from the chunk before on: a large folio across
                low = max(0, start - self.CHUNK)  # their boundary, still mapped by this chunk last time, goes now
                drop_cached(fd, file_start + low, end - low)
            slots.release()

        try:
            for start in range(0, head + length, self.CHUNK):  # chunks on page boundaries of the mapping
                end = min(start + self.CHUNK, head + length)
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                if end < head + length:
                    mapping.madvise(mmap.MADV_WILLNEED, end, min(self.CHUNK, head + length - end))
                view = whole[max(start, head):end]
                for h in hashers:
                    h.update(view)
                if lease_broken(fd):
                    view.release()
                    raise ChangedDuringRead(f"{path}: another process opened it for writing or cut it while it "
                                            f"was being read")
                ready.put((view, len(view), lambda s=start, e=end: done(s, e)))
        finally:
            whole.release()


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Drop the clean cached pages of FD's range (LENGTH 0: to its end; best effort: a page still dirty or mapped
    elsewhere stays)."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def device_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from storage so far (/proc/self/io read_bytes: page cache hits
    count nothing), or None where the kernel keeps no such count."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def read_back(path: Path, size: int, pipe: ChunkPipe, hashers) -> int | None:
    """Hash PATH's SIZE bytes as the disk holds them: fsync the file (only clean pages can be dropped), drop its
    pages from the page cache (posix_fadvise DONTNEED), then read it again through PIPE, feeding HASHERS. Returns
    the bytes the kernel fetched from the storage device meanwhile (SIZE when every page came from the disk; less
    on a file system without a device, e.g. tmpfs, or where the pages could not be dropped), or None where the
    kernel does not count them. The caller reads nothing else meanwhile, so the count is this file's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    before = device_read_bytes()
    for _ in pipe.stream(path, 0, size, hashers, mapped=False):  # plain reads: each one a visible syscall
        pass
    after = device_read_bytes()
    return None if before is None or after is None else after - before
