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

from ..errors import BadInput
from ..fsutil import check_relpath
from .fields import digest, integer, record, string
from .format import MANIFEST_MEMBER, META, data_member, index_member
from .payloads import PREFIXES, Payloads, parse_payloads, payloads_document

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

    def to_doc(self) -> dict:
        doc = {"schema": INDEX_SCHEMA, **{f: getattr(self, f) for f in
                                          ("bundle_id", "name", "volume", "volumes", "volume_size", "repo_id",
                                           "revision", "manifest_blake3", "meta")}}
        doc["payloads"] = payloads_document(self.payloads)
        doc["members"] = [asdict(e) for e in self.members]
        return doc


def _entry(raw: object, where: str) -> Entry:
    raw = record(raw, "a member record")
    kind, path = string(raw, "kind"), string(raw, "path")
    if kind not in PREFIXES:
        raise ValueError(f"unknown kind {kind!r}")
    check_relpath(path, where)
    e = Entry(string(raw, "member"), kind, path, integer(raw, "offset"), integer(raw, "length"), integer(raw, "size"),
              integer(raw, "segment", 1), integer(raw, "segments", 1), digest(raw, "blake3"),
              digest(raw, "file_blake3", optional=True), digest(raw, "file_sha256", optional=True))
    if e.offset + e.length > e.size or e.segment > e.segments:
        raise ValueError(f"{path}: offset/length/segment out of range")
    if e.member != data_member(kind, path, e.segment, e.segments):
        raise ValueError(f"member name {e.member!r} does not match {kind} {path!r}")
    return e


def parse_index(doc: object, where: str) -> Index:
    """Check an index document and return it typed; BadInput naming WHERE (the volume) on anything off."""
    if not isinstance(doc, dict) or doc.get("schema") != INDEX_SCHEMA:
        raise BadInput(f"{where}: not an mm bundle index (expected schema {INDEX_SCHEMA!r})")
    try:
        volume, volumes = integer(doc, "volume", 1), integer(doc, "volumes", 1)
        if volume > volumes:
            raise ValueError(f"volume {volume} of {volumes}")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        for name in meta:
            check_relpath(name, where)
            if not name.startswith(META + "/"):
                raise ValueError(f"metadata member {name!r} outside {META}/")
            digest(meta, name)
        members = doc["members"]
        if not isinstance(members, list):
            raise ValueError("members is not a list")
        return Index(string(doc, "bundle_id"), string(doc, "name"), volume, volumes, integer(doc, "volume_size"),
                     string(doc, "repo_id"), string(doc, "revision"), digest(doc, "manifest_blake3"), dict(meta),
                     parse_payloads(doc["payloads"], where), tuple(_entry(e, where) for e in members))
    except BadInput as e:
        raise BadInput(f"{where}: index names an unsafe path ({e.message})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed index ({e})") from None
