"""One read pass, several digests: blake3 (fast re-checks), sha256 (the Hub's LFS oid), git blob sha1.

Measured on the 2-core machines (DESIGN.md): blake3 `update_mmap` runs at storage speed; sha256 over an
mmap in 1-16 MiB slices releases the GIL, so the two run side by side in two threads for the price of
sha256 alone.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import blake3

SLICE = 8 * 1024 * 1024


@dataclass(frozen=True)
class Digests:
    size: int
    blake3: str
    sha256: str | None = None
    git_sha1: str | None = None


def git_blob_header(size: int) -> bytes:
    return b"blob %d\x00" % size


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(git_blob_header(len(data)) + data).hexdigest()


class StreamHasher:
    """Hashes bytes as they stream past (a download, a tar member), so nothing is read twice.

    git_sha1 needs the final size up front (git hashes a header with the length first).
    """

    def __init__(self, sha256: bool = True, git_size: int | None = None):
        self._b3 = blake3.blake3()
        self._sha = hashlib.sha256() if sha256 else None
        self._git = None
        if git_size is not None:
            self._git = hashlib.sha1(git_blob_header(git_size))
        self.size = 0

    def update(self, chunk: bytes | memoryview) -> None:
        self._b3.update(chunk)
        if self._sha is not None:
            self._sha.update(chunk)
        if self._git is not None:
            self._git.update(chunk)
        self.size += len(chunk)

    def digests(self) -> Digests:
        return Digests(
            size=self.size,
            blake3=self._b3.hexdigest(),
            sha256=self._sha.hexdigest() if self._sha is not None else None,
            git_sha1=self._git.hexdigest() if self._git is not None else None,
        )


def hash_file(path: Path, sha256: bool = True, git_sha1: bool = False, blake3_threads: int = 1) -> Digests:
    """Digest a file in one read: blake3 in this thread, sha256/sha1 over the same mmap in another.

    blake3_threads: 1 when the caller already hashes several files in parallel; blake3.AUTO for one big file.
    """
    path = Path(path)
    size = os.stat(path).st_size
    if size == 0:
        return _hash_bytes(b"", sha256, git_sha1)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
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
        return Digests(size=size, blake3=b3.hexdigest(), sha256=side.get("sha256"), git_sha1=side.get("git_sha1"))


def _side_digests(mm: mmap.mmap, size: int, sha256: bool, git_sha1: bool, out: dict[str, str]) -> None:
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
    return Digests(
        size=len(data),
        blake3=blake3.blake3(data).hexdigest(),
        sha256=hashlib.sha256(data).hexdigest() if sha256 else None,
        git_sha1=git_blob_sha1(data) if git_sha1 else None,
    )


def blake3_file(path: Path, threads: int = 1) -> str:
    """blake3 alone, at storage speed (the verify path)."""
    path = Path(path)
    if os.stat(path).st_size == 0:
        return blake3.blake3(b"").hexdigest()
    h = blake3.blake3(max_threads=threads)
    h.update_mmap(str(path))
    return h.hexdigest()
