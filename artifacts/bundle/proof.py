"""The proof of a data volume's exact bytes that a parity index (schema mm-bundle-parity/2) records, built from the
blake3 each member already has and the few bytes between members (tar headers, padding, the end of the archive):
writing a bundle with parity needs no second hash pass over its volumes.

A volume file is cut into its HEAD (its first H tar members: the index and the metadata after it; H is recorded
beside the proof) and its BODY (everything after, to the file's end). Each part is a run of stretches: the data
of a regular-file tar member ("member"), and the bytes between them ("raw": tar and pax headers, padding, the
end-of-archive blocks, anything after those). A part's digest is

    blake3(the part's raw bytes, concatenated) || blake3(its records)

with one record per stretch, in order: b"R" + u64le(length) for a raw stretch, b"M" + u64le(length) + the
member's 32-byte blake3 for a member. The proof is

    blake3(b"mm-volume-proof/1\\n" || head digest || body digest), in hex.

The records and the raw bytes give back every byte of a part, so two files with one proof are one file (blake3
being collision resistant) however each was cut: the cut decides only whether a genuine copy matches. The writer
knows every stretch as it writes (pack.py); a reader takes the cut from the tar headers as the bytes stream by
(TarProof), so a volume rebuilt from parity is proven while it is written, and an input of a rebuild while it is read.
Two parts because the head's members (the index above all) are final only once the last member is written, while
the body is proven as it is written.
"""
from __future__ import annotations

import tarfile

import blake3

PREFIX = b"mm-volume-proof/1\n"
BLOCK = 512
MAX_HEAD = 64  # metadata members at a volume's head: mm writes at most 6 (index, manifest, signature, SHA256SUMS,
# RESTORE.txt, payload sums); mm's own margin for a reader of hostile input
_MAX_PAX = 1024 * 1024  # a pax header mm writes holds a path and a size: a few KB (mm's own margin)
_THREADED = 1024 * 1024  # a member at least this large is hashed on blake3's threads (its own gain threshold)


class ProofPart:
    """One part (head or body) of a volume proof, fed its stretches in file order."""

    def __init__(self):
        self._raw = blake3.blake3()
        self._records = blake3.blake3()
        self._buf = bytearray()
        self._pending = 0  # bytes of the raw stretch not yet closed by a member

    def raw(self, data) -> None:
        if len(data):
            self._raw.update(data)
            self._pending += len(data)

    def member(self, length: int, digest: bytes | str) -> None:
        self._close_raw()
        self._buf += b"M" + length.to_bytes(8, "little") + (bytes.fromhex(digest) if isinstance(digest, str) else digest)
        if len(self._buf) >= 65536:
            self._records.update(self._buf)
            self._buf.clear()

    def _close_raw(self) -> None:
        if self._pending:
            self._buf += b"R" + self._pending.to_bytes(8, "little")
            self._pending = 0

    def digest(self) -> bytes:
        self._close_raw()
        self._records.update(self._buf)
        self._buf.clear()
        return self._raw.digest() + self._records.digest()


class VolumeProof:
    """A volume's proof from its stretches: HEAD and BODY, each fed in file order (either may be fed first)."""

    def __init__(self):
        self.head, self.body = ProofPart(), ProofPart()

    def hexdigest(self) -> str:
        return blake3.blake3(PREFIX + self.head.digest() + self.body.digest()).hexdigest()


class TarProof:
    """A VolumeProof taken from a volume's bytes as they stream by (update(), in order, from the first byte; then
    hexdigest() once), the cut read from the tar headers: after HEAD members the body begins. A byte stream that is
    no tar (a bad header checksum, an unknown member type) is still proven exactly: from there on it is raw."""

    def __init__(self, head: int):
        self._proof = VolumeProof()
        self._part = self._proof.head if head > 0 else self._proof.body
        self._head, self._members = head, 0
        self._state = "header"
        self._header = bytearray()
        self._left = 0  # bytes left in the current data, pax data or padding
        self._pax: bytearray | None = None  # a pax header's records, kept to read its size
        self._pax_size: int | None = None
        self._hasher = None
        self._length = self._size = 0
        self._counts = False  # the data being read is a member's (not a pax header's)

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if self._state == "trail":
                self._part.raw(view)
                return
            if self._state == "header":
                take = min(BLOCK - len(self._header), len(view))
                self._header += view[:take]
                view = view[take:]
                if len(self._header) == BLOCK:
                    self._read_header()
                continue
            take = min(self._left, len(view))
            part, view = view[:take], view[take:]
            self._left -= take
            if self._state == "member":
                self._hasher.update(part)
            else:
                self._part.raw(part)
                if self._state == "pax" and self._pax is not None:
                    self._pax += part
            if self._left == 0:
                self._data_done()

    def _read_header(self) -> None:
        block = bytes(self._header)
        self._header.clear()
        self._part.raw(block)
        if block == bytes(BLOCK):
            self._state = "trail"  # the end of the archive: all raw from here
            return
        try:
            if tarfile.nti(block[148:156]) not in tarfile.calc_chksums(block):
                raise tarfile.InvalidHeaderError("bad checksum")
            size = tarfile.nti(block[124:136])
        except (tarfile.HeaderError, ValueError):
            self._state = "trail"
            return
        kind = block[156:157]
        if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            self._state, self._counts = "pax", False
            self._pax = bytearray() if kind == tarfile.XHDTYPE and size <= _MAX_PAX else None
        else:
            if self._pax_size is not None:
                size, self._pax_size = self._pax_size, None
            self._counts = True
            if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
                self._state, self._length = "member", size
                self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if size >= _THREADED else 1)
            else:
                self._state = "other"
        self._left = self._size = size
        if size == 0:
            self._data_done()

    def _data_done(self) -> None:
        """The current data (or its padding) is read."""
        if self._state == "pad":
            self._member_done()
            return
        if self._state == "member":
            self._part.member(self._length, self._hasher.digest())
            self._hasher = None
        elif self._state == "pax" and self._pax is not None:
            self._pax_size = _pax_size(bytes(self._pax))
            self._pax = None
        pad = -self._size % BLOCK
        self._state, self._left = "pad", pad
        if pad == 0:
            self._member_done()

    def _member_done(self) -> None:
        self._state = "header"
        if self._counts:
            self._members += 1
            if self._members == self._head:
                self._part = self._proof.body

    def hexdigest(self) -> str:
        if self._state == "header" and self._header:
            self._part.raw(bytes(self._header))
            self._header.clear()
        elif self._state == "member":  # cut short: what was read of the member, as it is
            self._part.member(self._length - self._left, self._hasher.digest())
            self._state = "trail"
        return self._proof.hexdigest()


def _pax_size(records: bytes) -> int | None:
    """The size a pax extended header gives the next member, or None (none given, or unreadable)."""
    pos, size = 0, None
    try:
        while pos < len(records):
            space = records.index(b" ", pos)
            length = int(records[pos:space])
            if length <= 0:
                return None
            key, _, value = records[space + 1: pos + length - 1].partition(b"=")
            if key == b"size":
                size = int(value)
            pos += length
    except ValueError:
        return None
    return size if size is not None and size >= 0 else None


def prove_file(path, head: int, known: dict[str, str]) -> str:
    """The proof of the volume file PATH, its members' blake3 taken from KNOWN (member name -> blake3 hex, as a check
    just hashed them) where given, else hashed here; only the bytes between members are read for it. The cut is
    tarfile's reading of the headers, which is TarProof's for every volume mm writes (any other cut of another
    file only fails to match)."""
    import os

    proof = VolumeProof()
    part = proof.head if head > 0 else proof.body
    count, pos = 0, 0
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
        size = os.fstat(f.fileno()).st_size

        def raw(start: int, end: int) -> None:
            while start < end:
                chunk = os.pread(f.fileno(), min(end - start, 1024 * 1024), start)
                if not chunk:
                    return
                part.raw(chunk)
                start += len(chunk)

        while (info := tf.next()) is not None:
            tf.members.clear()  # headers only: a volume may hold a million members
            raw(pos, info.offset_data)
            end = info.offset_data + info.size
            if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
                digest = known.get(info.name)
                if digest is None:
                    h = blake3.blake3(max_threads=blake3.blake3.AUTO if info.size >= _THREADED else 1)
                    at = info.offset_data
                    while at < end and (chunk := os.pread(f.fileno(), min(end - at, 1024 * 1024), at)):
                        h.update(chunk)
                        at += len(chunk)
                    digest = h.hexdigest()
                part.member(info.size, digest)
            else:
                raw(info.offset_data, end)
            pos = end + (-info.size % BLOCK)
            raw(end, pos)
            count += 1
            if count == head:
                part = proof.body
        raw(pos, size)
    return proof.hexdigest()
