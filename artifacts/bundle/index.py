"""The per-volume index (schema mm-bundle-index/1) as typed records, parsed once and checked while parsed.

  {"schema", "bundle_id", "name", "volume", "volumes", "volume_size", "repo_id", "revision",
   "manifest_blake3", "meta": {member: blake3},
   "payloads": {...} (payloads.py),
   "members": [{"member", "kind", "path", "offset", "length", "size", "segment", "segments",
                "blake3" (this piece), "file_blake3", "file_sha256"}]}
Digests that are known only after the data is written (a piece's blake3, a payload's whole-file hashes) are
written as 64 zeros first and patched in place when the volume is complete: the JSON keeps its length.
A volume's index is hostile until parse_index accepts it: every type, range, path and member name is checked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..errors import BadInput
from ..fsutil import check_relpath
from .fields import MAX_NAME, MAX_TEXT, digest, integer, record, string
from .format import MANIFEST_MEMBER, META, data_member, index_member
from .payloads import MODEL_KIND, PREFIXES, Payloads, files_expected, parse_payloads, payloads_document

if TYPE_CHECKING:
    from ..manifest import Manifest

INDEX_SCHEMA = "mm-bundle-index/1"


@dataclass(frozen=True)
class Entry:
    """One member of a volume: a whole file, or one piece (segment) of a file split across volumes."""

    member: str
    kind: str
    path: str
    offset: int
    length: int
    size: int
    segment: int
    segments: int
    blake3: str  # of this member's bytes
    file_blake3: str | None  # of the whole file: on its last piece (on every piece of a model file)
    file_sha256: str | None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.path)

    @property
    def is_last(self) -> bool:
        return self.segment == self.segments

    @property
    def whole(self) -> bool:
        return self.segments == 1


@dataclass(frozen=True)
class Index:
    bundle_id: str
    name: str
    volume: int
    volumes: int
    volume_size: int
    repo_id: str
    revision: str
    manifest_blake3: str
    meta: dict[str, str]
    payloads: Payloads
    members: tuple[Entry, ...]

    def expected_meta(self) -> set[str]:
        return set(self.meta) | {index_member(self.volume), MANIFEST_MEMBER}

    BUNDLE_WIDE = ("name", "volumes", "volume_size", "repo_id", "revision", "manifest_blake3", "payloads")

    def differs_from(self, other: Index) -> str | None:
        """The first bundle-wide field (the same in every volume of one bundle) where OTHER says otherwise."""
        return next((f for f in self.BUNDLE_WIDE if getattr(self, f) != getattr(other, f)), None)

    def to_doc(self) -> dict:
        doc = {"schema": INDEX_SCHEMA, **{f: getattr(self, f) for f in
                                          ("bundle_id", "name", "volume", "volumes", "volume_size", "repo_id",
                                           "revision", "manifest_blake3", "meta")}}
        doc["payloads"] = payloads_document(self.payloads)
        doc["members"] = [asdict(e) for e in self.members]
        return doc


MAX_VOLUMES = 99_999  # volumes in one bundle (the name holds at least three digits, the count can grow)


def _entry(raw: object, where: str, volumes: int, volume_size: int) -> Entry:
    raw = record(raw, "a member record")
    kind, path = string(raw, "kind", max_len=64), string(raw, "path", max_len=MAX_NAME)
    if kind not in PREFIXES:
        raise ValueError(f"unknown kind {kind!r}")
    check_relpath(path, where)
    size = integer(raw, "size")
    offset = integer(raw, "offset", high=size)
    segments = integer(raw, "segments", 1, high=volumes)  # a piece per volume at most
    e = Entry(string(raw, "member", max_len=2 * MAX_NAME), kind, path, offset, integer(raw, "length", high=size - offset),
              size, integer(raw, "segment", 1, high=segments), segments, digest(raw, "blake3"),
              digest(raw, "file_blake3", optional=True), digest(raw, "file_sha256", optional=True))
    if e.whole and (e.offset, e.length) != (0, e.size):
        raise ValueError(f"{path}: a whole file of {e.size} bytes stored as {e.length} bytes at offset {e.offset}")
    if e.length > volume_size or e.size > e.segments * volume_size:
        # no piece is larger than a volume, and a file of N pieces is at most N volumes
        raise ValueError(f"{path}: size {e.size} (this piece {e.length}) cannot fit {e.segments} piece(s) in "
                         f"volumes of {volume_size} bytes")
    if e.member != data_member(kind, path, e.segment, e.segments):
        raise ValueError(f"member name {e.member[:200]!r} does not match {kind} {path!r}")
    return e


def parse_index(doc: object, where: str) -> Index:
    """Check an index document and return it typed; BadInput naming WHERE (the volume) on anything off.

    Beyond types and paths: every size is bounded by what the bundle can hold (a whole file is stored whole,
    a piece fits a volume, the payloads fit the volumes), so an index cannot make unbundle reserve or wait for
    more than the volumes carry. Whether the sizes agree with the manifest and the payload records is
    Index.disagreements (the manifest is a separate member)."""
    if not isinstance(doc, dict) or doc.get("schema") != INDEX_SCHEMA:
        raise BadInput(f"{where}: not an mm bundle index (expected schema {INDEX_SCHEMA!r})")
    try:
        volumes = integer(doc, "volumes", 1, high=MAX_VOLUMES)
        volume = integer(doc, "volume", 1, high=volumes)
        volume_size = integer(doc, "volume_size", 1)
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        for name in meta:
            if len(name) > MAX_NAME:
                raise ValueError(f"metadata member name of {len(name)} characters")
            check_relpath(name, where)
            if not name.startswith(META + "/"):
                raise ValueError(f"metadata member {name!r} outside {META}/")
            digest(meta, name)
        members = doc["members"]
        if not isinstance(members, list):
            raise ValueError("members is not a list")
        payloads = parse_payloads(doc["payloads"], where)
        carried = sum(files_expected(payloads).values())
        if carried > volume_size * volumes:
            raise ValueError(f"payloads of {carried} bytes cannot fit {volumes} volume(s) of {volume_size} bytes")
        return Index(string(doc, "bundle_id", max_len=MAX_TEXT, empty=False),
                     string(doc, "name", max_len=255, empty=False), volume, volumes, volume_size,
                     string(doc, "repo_id", max_len=MAX_TEXT), string(doc, "revision", max_len=MAX_TEXT),
                     digest(doc, "manifest_blake3"), dict(meta), payloads,
                     tuple(_entry(e, where, volumes, volume_size) for e in members))
    except BadInput as e:
        raise BadInput(f"{where}: index names an unsafe path ({e.message})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed index ({_missing(e)})") from None


def _missing(e: Exception) -> str:
    return f"{e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else str(e)


def disagreements(index: Index, manifest: Manifest | None) -> list[str]:
    """Entries that disagree with what they stand for: a model file with the manifest (path, size, whole-file
    hashes), a payload file with the payload records (kind, path, size). Sizes in an index are never trusted
    alone: what unbundle writes (and the free-space check counts) comes from the manifest and the records."""
    files = manifest.by_path() if manifest is not None else {}
    carried = files_expected(index.payloads)
    problems = []
    for e in index.members:
        if e.kind == MODEL_KIND:
            f = files.get(e.path)
            if manifest is not None and f is None:
                problems.append(f"member {e.member!r} is not a file of the manifest")
            elif f is not None and (f.size, f.blake3, f.sha256) != (e.size, e.file_blake3, e.file_sha256):
                problems.append(f"member {e.member!r} says {e.size} bytes, the manifest {f.size} (or the hashes differ)")
        elif carried.get(e.key) != e.size:
            problems.append(f"member {e.member!r} ({e.size} bytes) is not a {e.kind} file the payload records list")
    return problems
