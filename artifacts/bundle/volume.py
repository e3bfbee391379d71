"""Reading a volume safely: its headers and metadata are judged before any data is read.

One reader for both kinds of volume: a data volume (index-volNNN.json first) and a parity volume
(index-parPPP.json first); each index says which data members it must hold, with their lengths and blake3.
Refused (nothing taken from the volume): unreadable index, a member that is not a regular file
(symlink, hard link, device, fifo, directory), a name not in the index, a size that disagrees with
the index, a member twice. Damaged (the rest is still usable): members missing or cut short.
"""
from __future__ import annotations

import os
import tarfile
from typing import BinaryIO
from dataclasses import dataclass, field, replace
from pathlib import Path

import blake3

from ..errors import BadInput
from ..edges.fsutil import file_kind
from ..edges.untrusted import Malformed
from ..integrity.manifest import MAX_MANIFEST_BYTES
from .format import MANIFEST_MEMBER, META, PARITY_RE, VOLUME_RE, b3, index_member, parity_index_member
from .index import Entry, Index, ParityIndex, load_index, parse_index, parse_parity_index

# mm's margin over the largest index mm writes: a volume lists at most MAX_FILES (a million) members, and a million
# tiny files made an index of 442 MB (about 440 bytes a member); mm bundle refuses a plan whose index would be larger.
MAX_INDEX_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Member:
    """Where a member's bytes lie in its volume: what mm keeps of a tar header (a TarInfo is ~1 KB, and a volume may
    hold a million members)."""

    name: str
    offset_data: int
    size: int
    mtime: int

    @classmethod
    def of(cls, info: tarfile.TarInfo) -> "Member":
        return cls(info.name, info.offset_data, info.size, int(info.mtime))


@dataclass
class Volume:
    """What one volume file holds, from its headers and metadata only (no data read yet)."""

    path: Path
    index: Index | None = None  # a data volume's
    parity: ParityIndex | None = None  # a parity volume's
    index_at: tuple[int, int] = (0, 0)  # (offset, size) of the index member's bytes in the volume file
    index_b3: str = ""  # of those bytes, as read and parsed
    manifest_at: Member | None = None  # where the manifest member lies (its bytes are read again when needed)
    manifest_b3: str = ""  # of those bytes, as read when the volume was opened
    data: dict[str, Member] = field(default_factory=dict)  # data member name -> where it lies
    meta: dict[str, Member] = field(default_factory=dict)  # MMBUNDLE/ member name -> where it lies
    refused: list[str] = field(default_factory=list)  # hostile or malformed: nothing is taken from it
    damaged: dict[str, str] = field(default_factory=dict)  # member -> why (missing, truncated, hash)
    hashed: dict[str, str] = field(default_factory=dict)  # member -> its blake3 as check.check_data read it

    @property
    def described(self) -> Index | ParityIndex | None:
        """Whichever index the volume has (the fields both kinds share: bundle_id, name, number, meta, ...)."""
        return self.index or self.parity

    @property
    def bundle_id(self) -> str | None:
        return self.described.bundle_id if self.described else None

    @property
    def number(self) -> int:
        return self.described.number if self.described else 0

    @property
    def is_parity(self) -> bool:
        return self.parity is not None

    @property
    def usable(self) -> bool:
        """Opened and checked with nothing refused or damaged."""
        return self.described is not None and not self.refused and not self.damaged

    @property
    def index_bytes(self) -> bytes:
        """The index member's bytes, read again from the volume (not held: a kilobyte a file), or b"" when they
        changed since the volume was opened."""
        offset, size = self.index_at
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        return data if b3(data) == self.index_b3 else b""

    @property
    def has_manifest(self) -> bool:
        """The volume holds its manifest, whole and with the blake3 its index records (when it was opened)."""
        return self.manifest_at is not None and MANIFEST_MEMBER not in self.damaged

    @property
    def manifest_bytes(self) -> bytes:
        """The manifest member's bytes, read again from the volume (not held: ~285 bytes a file, once a volume), or
        b"" when there is none or they changed since the volume was opened."""
        if self.manifest_at is None:
            return b""
        with open(self.path, "rb") as f:
            f.seek(self.manifest_at.offset_data)
            data = f.read(self.manifest_at.size)
        return data if len(data) == self.manifest_at.size and b3(data) == self.manifest_b3 else b""

    def reread_manifest(self) -> "_Reread":
        """The manifest member read again from the volume as a binary file, a chunk at a time (never held whole):
        at its end, BadInput when its bytes are not those hashed when the volume was opened."""
        at = self.manifest_at
        if at is None:
            raise BadInput(f"{self.path.name}: no {MANIFEST_MEMBER}")
        return _Reread(self.path, at.offset_data, at.size, self.manifest_b3, f"{self.path.name}: {MANIFEST_MEMBER}")

    def forget_members(self) -> None:
        """Drop the index's member records and where each member lies, once the volume is imported: the final
        check and the report need neither (~400 bytes a member, and a volume may hold a million)."""
        self.data.clear()
        if self.index is not None:
            self.index = replace(self.index, members=())

    def entries(self) -> tuple[Entry, ...]:
        return self.index.members if self.index else ()


def find_volumes(sources: list[Path]) -> list[Path]:
    """Volume files named on the command line, or found (not recursively) in the directories named."""
    found: list[Path] = []
    for src in sources:
        src = Path(src)
        if src.is_dir():
            found += sorted(p for p in src.iterdir() if (VOLUME_RE.match(p.name) or PARITY_RE.match(p.name))
                            and p.is_file())
        elif src.is_file():
            found.append(src)
        elif os.path.exists(src):  # a FIFO, a device such as /dev/zero, a socket
            raise BadInput(f"{src}: is {file_kind(os.stat(src).st_mode)}, not a volume file or a directory")
        else:
            raise BadInput(f"{src}: no such volume file or directory")
    if not found:
        raise BadInput(f"no bundle volumes (*.volNNN-of-MMM.tar, *.parNNN-of-MMM.tar) in {', '.join(str(s) for s in sources)}")
    unique = {os.path.realpath(p): p for p in found}
    return list(unique.values())


def _kind_of(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"a symlink to {info.linkname!r}"
    if info.islnk():
        return f"a hard link to {info.linkname!r}"
    if info.ischr() or info.isblk():
        return "a device node"
    if info.isfifo():
        return "a fifo"
    if info.isdir():
        return "a directory"
    if info.sparse is not None or info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return f"an unsupported member type {info.type!r}"
    return ""


class _HashedReader:
    """SIZE bytes of the binary file F as a file, hashed (blake3) as they are read: a document is parsed as it
    streams, never held whole (a volume's index is ~440 bytes a file, and a volume may hold a million files). Read to
    its end, DIGEST is their blake3; bytes cut short are BadInput naming NAME (tarfile's ReadError where a volume
    ends)."""

    _CHUNK = 1 << 20

    def __init__(self, f: BinaryIO | None, size: int, name: str):
        self.f, self.name, self.left, self.hasher = f, name, size, blake3.blake3()

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n) if self.f is not None and n else b""
        if len(data) != n:
            raise BadInput(f"{self.name} is truncated")
        self.left -= n
        self.hasher.update(data)
        return data

    @property
    def digest(self) -> str:
        """The blake3 of all SIZE bytes, once every byte is read (the rest is read now, a chunk at a time)."""
        while self.left:
            self.read(self._CHUNK)
        return self.hasher.hexdigest()


def _hashed_member(tf: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> _HashedReader:
    """A volume's member as a hashed file, refused over LIMIT bytes."""
    if info.size > limit:
        raise BadInput(f"{info.name} is {info.size} bytes, more than the {limit} allowed")
    return _HashedReader(tf.extractfile(info), info.size, info.name)


class _Reread(_HashedReader):
    """SIZE bytes at OFFSET of PATH read again, hashed as they are read; at their end (a read that returns b""),
    BadInput naming WHERE unless their blake3 is DIGEST (the volume changed since it was opened)."""

    def __init__(self, path: Path, offset: int, size: int, digest: str, where: str):
        f = open(path, "rb")
        f.seek(offset)
        super().__init__(f, size, where)
        self.expected = digest

    def read(self, n: int = -1) -> bytes:
        try:
            data = super().read(n)
        except BadInput:  # cut short: the volume changed
            data = None
        if data is None or (not data and not self.left and self.hasher.hexdigest() != self.expected):
            raise BadInput(f"{self.name}: changed since the volume was opened; refused, nothing written")
        return data

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "_Reread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_volumes(vols: list[Volume]) -> tuple[list[Volume], list[Volume]]:
    """(data volumes, parity volumes); a volume whose index could not be read counts as data (it is reported)."""
    return [v for v in vols if not v.is_parity], [v for v in vols if v.is_parity]


def open_volume(path: Path) -> Volume:
    """Read a volume's headers and metadata (data or parity); judge every member without extracting anything."""
    vol = Volume(Path(path))
    name = vol.path.name
    file_size = os.stat(vol.path).st_size
    try:
        with tarfile.open(vol.path, "r:") as tf:
            first = tf.next()
            parity = first is not None and first.name.startswith(f"{META}/index-par")
            if first is None or not (parity or first.name.startswith(f"{META}/index-vol")) or _kind_of(first):
                vol.refused.append(f"{name}: first member is not a bundle index (not an mm bundle volume?)")
                return vol
            stream = _hashed_member(tf, first, MAX_INDEX_BYTES)
            try:  # parsed as it is read: neither the index's bytes nor its text are held whole
                doc = load_index(stream, f"{name}: {first.name}", MAX_INDEX_BYTES)
            except Malformed as e:
                vol.refused.append(f"{name}: index {first.name}: {e.detail}")
                return vol
            vol.index_at, vol.index_b3 = (first.offset_data, first.size), stream.digest
            if parity:
                vol.parity = parse_parity_index(doc, f"{name}: {first.name}")
                own = parity_index_member(vol.number)
            else:
                vol.index = parse_index(doc, f"{name}: {first.name}")
                own = index_member(vol.number)
            if first.name != own:
                vol.refused.append(f"{name}: index member {first.name!r} does not match "
                                   f"{'parity' if parity else 'volume'} {vol.number}")
            # the index's own name for each member (the tar's copy of it is not kept)
            expected = {member: (member, length) for member, (length, _) in vol.described.data_members().items()}
            meta = vol.described.expected_meta()
            seen = {first.name}
            while (info := tf.next()) is not None:
                tf.members.clear()  # tarfile keeps every header it reads; mm keeps a Member of those it takes
                why = _kind_of(info)
                if why:
                    vol.refused.append(f"{name}: member {info.name!r} is {why}; refused")
                    continue
                if info.name in seen:
                    vol.refused.append(f"{name}: member {info.name!r} appears twice; refused")
                    continue
                seen.add(info.name)
                if info.name not in expected and info.name not in meta:
                    vol.refused.append(f"{name}: member {info.name!r} is not in the volume's index; refused")
                    continue
                if info.offset_data + info.size > file_size:
                    vol.damaged[info.name] = "truncated"
                    continue
                if info.name == MANIFEST_MEMBER:  # hashed, not held (Volume.manifest_bytes reads it again)
                    manifest = _hashed_member(tf, info, MAX_MANIFEST_BYTES)
                    vol.manifest_b3 = manifest.digest
                    if info.size:  # an empty member is no manifest (as "missing" below)
                        vol.manifest_at = Member.of(info)
                elif info.name in meta:
                    vol.meta[info.name] = Member.of(info)
                elif info.name in expected:
                    member, length = expected[info.name]
                    if info.size != length:
                        vol.refused.append(f"{name}: member {info.name!r} is {info.size} bytes in the tar but "
                                           f"{length} in the index; refused")
                        continue
                    vol.data[member] = Member(member, info.offset_data, info.size, int(info.mtime))
            for missing in sorted((set(expected) | meta) - seen):
                vol.damaged[missing] = "missing (volume truncated?)"
    except BadInput as e:
        vol.refused.append(e.message if e.message.startswith(name) else f"{name}: {e.message}")
    except (tarfile.TarError, OSError, EOFError) as e:
        if vol.described is None:
            vol.refused.append(f"{name}: not a readable tar volume ({e})")
        else:
            vol.damaged["(tar)"] = f"unreadable after the last good member ({e})"
    if vol.described is not None and vol.manifest_at and vol.manifest_b3 != vol.described.manifest_blake3:
        vol.damaged[MANIFEST_MEMBER] = "blake3 mismatch"
    elif vol.described is not None and not vol.manifest_at and MANIFEST_MEMBER not in vol.damaged:
        vol.damaged[MANIFEST_MEMBER] = "missing"
    return vol


def meta_bytes(vol: Volume, member: str, limit: int = 16 * 1024 * 1024) -> bytes | None:
    """A metadata member's bytes (the signature, RESTORE.txt), or None when it is absent, larger than LIMIT,
    cut short, or does not match the blake3 the volume's index records for it."""
    info = vol.meta.get(member)
    want = vol.described.meta.get(member) if vol.described else None
    if info is None or want is None or info.size > limit:
        return None
    with open(vol.path, "rb") as f:
        f.seek(info.offset_data)
        data = f.read(info.size)
    return data if len(data) == info.size and b3(data) == want else None
