"""Reading a volume safely: its headers and metadata are judged before any data is read.

Refused (nothing taken from the volume): unreadable index, a member that is not a regular file
(symlink, hard link, device, fifo, directory), a name not in the index, a size that disagrees with
the index, a member twice. Damaged (the rest is still usable): members missing or cut short.
"""
from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from .format import MANIFEST_MEMBER, META, VOLUME_RE, b3, index_member
from .index import Entry, Index, parse_index

MAX_INDEX_BYTES = 256 * 1024 * 1024


@dataclass
class Volume:
    """What one volume file holds, from its headers and metadata only (no data read yet)."""

    path: Path
    index: Index | None = None
    index_bytes: bytes = b""
    manifest_bytes: bytes = b""
    data: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # data member name -> header
    meta: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # MMBUNDLE/ member name -> header
    refused: list[str] = field(default_factory=list)  # hostile or malformed: nothing is taken from it
    damaged: dict[str, str] = field(default_factory=dict)  # member -> why (missing, truncated, hash)

    @property
    def bundle_id(self) -> str | None:
        return self.index.bundle_id if self.index else None

    @property
    def number(self) -> int:
        return self.index.volume if self.index else 0

    def entries(self) -> tuple[Entry, ...]:
        return self.index.members if self.index else ()


def find_volumes(sources: list[Path]) -> list[Path]:
    """Volume files named on the command line, or found (not recursively) in the directories named."""
    found: list[Path] = []
    for src in sources:
        src = Path(src)
        if src.is_dir():
            found += sorted(p for p in src.iterdir() if VOLUME_RE.match(p.name) and p.is_file())
        elif src.is_file():
            found.append(src)
        else:
            raise BadInput(f"{src}: no such volume file or directory")
    if not found:
        raise BadInput(f"no bundle volumes (*.volNNN-of-MMM.tar) in {', '.join(str(s) for s in sources)}")
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


def open_volume(path: Path) -> Volume:
    """Read a volume's headers and metadata; judge every member without extracting anything."""
    vol = Volume(Path(path))
    name = vol.path.name
    file_size = os.stat(vol.path).st_size
    try:
        with tarfile.open(vol.path, "r:") as tf:
            first = tf.next()
            if first is None or not first.name.startswith(f"{META}/index-vol") or _kind_of(first):
                vol.refused.append(f"{name}: first member is not a bundle index (not an mm bundle volume?)")
                return vol
            vol.index_bytes = _read_member(tf, first, MAX_INDEX_BYTES)
            try:
                doc = json.loads(vol.index_bytes)
            except ValueError:
                vol.refused.append(f"{name}: index {first.name} is not valid JSON")
                return vol
            vol.index = parse_index(doc, f"{name}: {first.name}")
            if first.name != index_member(vol.number):
                vol.refused.append(f"{name}: index member {first.name!r} does not match volume {vol.number}")
            expected = {e.member: e.length for e in vol.entries()}
            meta = vol.index.expected_meta()
            seen = {first.name}
            for info in tf:
                if info is first:  # iterating a TarFile yields the members already read, too
                    continue
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
                    vol.manifest_bytes = _read_member(tf, info, MAX_INDEX_BYTES)
                elif info.name in meta:
                    vol.meta[info.name] = info
                elif info.name in expected:
                    if info.size != expected[info.name]:
                        vol.refused.append(f"{name}: member {info.name!r} is {info.size} bytes in the tar but "
                                           f"{expected[info.name]} in the index; refused")
                        continue
                    vol.data[info.name] = info
            for missing in sorted((set(expected) | meta) - seen):
                vol.damaged[missing] = "missing (volume truncated?)"
    except BadInput as e:
        vol.refused.append(e.message if e.message.startswith(name) else f"{name}: {e.message}")
    except (tarfile.TarError, OSError, EOFError) as e:
        if vol.index is None:
            vol.refused.append(f"{name}: not a readable tar volume ({e})")
        else:
            vol.damaged["(tar)"] = f"unreadable after the last good member ({e})"
    if vol.index is not None and vol.manifest_bytes and b3(vol.manifest_bytes) != vol.index.manifest_blake3:
        vol.damaged[MANIFEST_MEMBER] = "blake3 mismatch"
    elif vol.index is not None and not vol.manifest_bytes and MANIFEST_MEMBER not in vol.damaged:
        vol.damaged[MANIFEST_MEMBER] = "missing"
    return vol
