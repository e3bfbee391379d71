"""The bundle volume format: names, tar headers, member sizes, volume sizes.

A volume is one POSIX tar (pax format) named `<name>.vol<NNN>-of-<MMM>.tar`. Its first members describe it,
so that a volume alone says what the bundle is even when the rest of it is damaged:

  MMBUNDLE/index-volNNN.json   this volume's index (schema mm-bundle-index/1, see index.py)
  MMBUNDLE/manifest.json       the model's manifest, byte for byte
  MMBUNDLE/manifest.json.sig   its SSH signature (namespace mm-manifest), when the model is signed
  MMBUNDLE/SHA256SUMS          `sha256sum -c` lines for the model files (run inside the restored model dir)
  MMBUNDLE/RESTORE.txt         how to restore with tar, cat and sha256sum alone
  MMBUNDLE/payload-volNNN.sha256  sha256 lines of payload files whose last byte is in this volume (if any)
then the data: a whole file as `model/<path>` (or `<payload kind prefix>/<path>`, see payloads.py),
a piece of a file split across volumes as `segments/<same>.segNNNN`.

A parity volume (`mm bundle --parity M`) is named `<name>.parPPP-of-MMM.tar` and is self-describing the same way:
  MMBUNDLE/index-parPPP.json   its index (schema mm-bundle-parity/1, see index.py)
  MMBUNDLE/manifest.json, MMBUNDLE/manifest.json.sig (when signed), MMBUNDLE/RESTORE.txt
  parity/parityPPP.bin         parity stream PPP over the data volume files (parity.py: stripes, code)

Sizes (`--volume-size`) are DECIMAL, as disks are sold: 4G = 4,000,000,000 bytes. Binary units are spelled
KiB, MiB, GiB, TiB (4GiB = 4,294,967,296 bytes).
"""
from __future__ import annotations

import json
import re
import tarfile
from typing import Callable, Iterable, Iterator

import blake3

from ..edges.fsutil import json_record
from ..units import MAX_SIZE
from .payloads import PREFIXES

META = "MMBUNDLE"
MANIFEST_MEMBER = f"{META}/manifest.json"
SIG_MEMBER = f"{META}/manifest.json.sig"  # the manifest's SSH signature, when the model is signed (signing.py)
SUMS_MEMBER = f"{META}/SHA256SUMS"
RESTORE_MEMBER = f"{META}/RESTORE.txt"
PLACEHOLDER = "0" * 64
BLOCK = 512
END_OF_ARCHIVE = 2 * BLOCK
MAX_VOLUME_SIZE = MAX_SIZE
VOLUME_RE = re.compile(r"^(?P<name>.+)\.vol(?P<num>\d{3,})-of-(?P<count>\d{3,})\.tar$")
PARITY_RE = re.compile(r"^(?P<name>.+)\.par(?P<num>\d{3,})-of-(?P<count>\d{3,})\.tar$")

def index_member(volume: int) -> str:
    return f"{META}/index-vol{volume:03d}.json"


def parity_index_member(parity: int) -> str:
    return f"{META}/index-par{parity:03d}.json"


def parity_data_member(parity: int) -> str:
    return f"parity/parity{parity:03d}.bin"


def parity_filename(name: str, parity: int, parities: int) -> str:
    width = max(3, len(str(parities)))
    return f"{name}.par{parity:0{width}d}-of-{parities:0{width}d}.tar"


def payload_sums_member(volume: int) -> str:
    return f"{META}/payload-vol{volume:03d}.sha256"


def volume_filename(name: str, volume: int, volumes: int) -> str:
    width = max(3, len(str(volumes)))
    return f"{name}.vol{volume:0{width}d}-of-{volumes:0{width}d}.tar"


def file_member(kind: str, path: str) -> str:
    """Where a whole file of KIND sits in the tar, and under ./restore once restored with tar alone."""
    return f"{PREFIXES[kind]}/{path}"


def data_member(kind: str, path: str, segment: int, segments: int) -> str:
    """Where a file (or one piece of it) sits in the tar; derived, never trusted from the tar itself."""
    if segments == 1:
        return file_member(kind, path)
    return f"segments/{file_member(kind, path)}.seg{segment:0{max(4, len(str(segments)))}d}"


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def tar_header(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, mtime, 0o644, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


USTAR_NAME = 100  # POSIX ustar: the name field's bytes; a longer name (or one not ASCII) takes a pax header
USTAR_NUMBER = 8**11  # a size or mtime of 11 octal digits; larger ones take a pax header


def member_bytes(name: str, size: int, mtime: int = 0) -> int:
    """Bytes a member takes in the tar: header(s) plus data padded to the block size. A name tarfile writes as a
    plain ustar header (ASCII, 100 bytes at most, size and mtime in 11 octal digits) takes one block, counted
    without building it (the planner counts every member of a bundle of a million files)."""
    if len(name) <= USTAR_NAME and name.isascii() and 0 <= size < USTAR_NUMBER and 0 <= mtime < USTAR_NUMBER:
        return BLOCK + padded(size)
    return len(tar_header(name, size, mtime)) + padded(size)


def render_json(doc: dict, **lists: Iterable) -> bytes:
    """json.dumps(DOC, indent=1) + "\n", byte for byte, where DOC's keys named in LISTS (top-level keys, in DOC's
    order) get their list from LISTS, an element at a time (render_json_chunks)."""
    return b"".join(render_json_chunks(doc, **lists))


def render_json_chunks(doc: dict, **lists: Iterable) -> Iterator[bytes]:
    """render_json's bytes, about a megabyte at a time: json's indenting encoder makes a list of every token of the
    whole document first, kilobytes a file, and an index may list a million files."""
    if not lists:
        yield (json.dumps(doc, indent=1) + "\n").encode()
        return
    marks = {k: f"\x00mm-list-{k}\x00" for k in lists}
    rest = json.dumps({k: [marks[k]] if k in marks else v for k, v in doc.items()}, indent=1)
    out: list[bytes] = []
    held = 0
    for k in (k for k in doc if k in marks):
        before, rest = rest.split(f"[\n  {json.dumps(marks[k])}\n ]", 1)
        out.append(before.encode())
        sep = b"[\n  "
        for element in lists[k]:
            out += [sep, json_record(element, 1, "  ").encode()]
            held += len(out[-1])
            sep = b",\n  "
            if held >= 1 << 20:
                yield b"".join(out)
                out, held = [], 0
        out.append(b"[]" if sep == b"[\n  " else b"\n ]")
    out.append(rest.encode() + b"\n")
    yield b"".join(out)


class Rendered:
    """A document written a chunk at a time (MAKE renders it afresh each time): its length is known, and its bytes
    are written, without holding them whole."""

    def __init__(self, make: Callable[[], Iterator[bytes]]):
        self.make = make
        self._len: int | None = None

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(len(c) for c in self.make())
        return self._len

    def chunks(self) -> Iterator[bytes]:
        return self.make()


def b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()
