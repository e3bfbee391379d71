"""Copy I/O shared by pack, unpack and check: a read-ahead, hashing pipe and early writeback.

Nothing here knows about volumes or the index; every other module of the bundle package may use it.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
from pathlib import Path

import blake3

# blake3's own threads over each chunk: the writer thread spends its time in the kernel, so the
# hashing helper thread gets a second core (measured: bundle ~1.4x faster than one hashing thread).
HASH_THREADS = blake3.blake3.AUTO


class EarlyFlush:
    """Starts writeback while a copy goes on (fdatasync in a helper thread every STEP bytes), so the fsync
    that publishes the file finds little left to do; left to itself the kernel starts only when a tenth
    of RAM is dirty. Measured on the 4 GiB bench: bundle ~25% faster. Call wait() before closing FD."""

    STEP = 128 * 1024 * 1024

    def __init__(self, fd: int, enabled: bool = True):
        self.fd = fd
        self.enabled = enabled  # off when the file will not be fsynced either (nothing to get ahead of)
        self._since = 0
        self._thread: threading.Thread | None = None

    def wrote(self, n: int) -> None:
        if not self.enabled:
            return
        self._since += n
        if self._since >= self.STEP and (self._thread is None or not self._thread.is_alive()):
            self._since = 0
            self._thread = threading.Thread(target=self._sync, daemon=True)
            self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError:  # the caller's own fsync reports a real failure
            pass

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class ChunkPipe:
    """Reads and hashes the next chunks in a helper thread while the caller writes the current one.

    blake3/sha256 and os.write all release the GIL, so on two cores hashing hides behind the write.
    A few page-aligned buffers (DEPTH x CHUNK) are reused: memory stays flat whatever the size.
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

    def stream(self, path: Path, offset: int, length: int, hashers=()):
        """Yield views of LENGTH bytes of PATH from OFFSET, each already fed to every hasher in HASHERS."""
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                with open(path, "rb", buffering=0) as f:
                    f.seek(offset)
                    left = length
                    while left and not stop.is_set():
                        buf = self._free.get()
                        view = memoryview(buf)
                        n = f.readinto(view[: min(len(buf), left)])
                        if not n:
                            view.release()
                            self._free.put(buf)
                            raise EOFError(f"{path}: ended {left} bytes early")
                        for h in hashers:
                            h.update(view[:n])
                        ready.put((buf, view, n))
                        left -= n
                ready.put(None)
            except BaseException as e:  # handed to the consumer
                ready.put(e)

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                buf, view, n = item
                try:
                    yield view[:n]
                finally:
                    view.release()
                    self._free.put(buf)
        finally:
            stop.set()
            while worker.is_alive() or not ready.empty():
                try:
                    item = ready.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    item[1].release()
                    self._free.put(item[0])
            worker.join()


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
    for _ in pipe.stream(path, 0, size, hashers):
        pass
    after = device_read_bytes()
    return None if before is None or after is None else after - before
