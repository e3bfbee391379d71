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
from dataclasses import dataclass, field
from pathlib import Path

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
    manifest_bytes: bytes = b""
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


def _read_member(tf: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    if info.size > limit:
        raise BadInput(f"{info.name} is {info.size} bytes, more than the {limit} allowed")
    f = tf.extractfile(info)
    data = f.read() if f else b""
    if len(data) != info.size:
        raise BadInput(f"{info.name} is truncated")
    return data


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
            data = _read_member(tf, first, MAX_INDEX_BYTES)
            vol.index_at, vol.index_b3 = (first.offset_data, first.size), b3(data)
            try:
                doc = load_index(data, f"{name}: {first.name}", MAX_INDEX_BYTES)
                del data
            except Malformed as e:
                vol.refused.append(f"{name}: index {first.name}: {e.detail}")
                return vol
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
                if info.name == MANIFEST_MEMBER:
                    vol.manifest_bytes = _read_member(tf, info, MAX_MANIFEST_BYTES)
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
    if vol.described is not None and vol.manifest_bytes and b3(vol.manifest_bytes) != vol.described.manifest_blake3:
        vol.damaged[MANIFEST_MEMBER] = "blake3 mismatch"
    elif vol.described is not None and not vol.manifest_bytes and MANIFEST_MEMBER not in vol.damaged:
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
