"""The per-volume index (schema mm-bundle-index/1) as typed records, parsed once and checked while parsed.

  {"schema", "bundle_id", "name", "volume", "volumes", "volume_size", "repo_id", "revision",
   "manifest_blake3", "meta": {member: blake3},
   "payloads": {...} (payloads.py),
   "members": [{"member", "kind", "path", "offset", "length", "size", "segment", "segments",
                "blake3" (this piece), "file_blake3", "file_sha256"}]}
Digests that are known only after the data is written (a piece's blake3, a payload's whole-file hashes) are
written as 64 zeros first and patched in place when the volume is complete: the JSON keeps its length.
A bundle made with `--parity M` adds "parity": {"parities", "stripe", "code"} (ParityNote) to every data
volume's index, so that a data volume alone says how many parity volumes exist and how to make them again.
A delta bundle (`mm bundle --base`, delta.py) has schema mm-bundle-delta/1 (a mm that does not know deltas refuses
it rather than import part of a model) and adds "delta" (DeltaNote) to every data volume's index:
  {"base": {"repo_id", "revision", "manifest_sha256"}, "take": [{"path", "base_path", "size", "sha256", "blake3"}]}
the base manifest's identity (the sha256 of the document, and its revision) and, for each model file the volumes
do not carry, the base file it is taken from (same content, maybe another path).

A parity volume's index (schema mm-bundle-parity/2, ParityIndex):
  {"schema", "bundle_id", "name", "parity", "parities", "volumes", "code", "stripe", "manifest_blake3",
   "meta": {member: blake3}, "member": "parity/parityPPP.bin",
   "data": [{"number", "file", "size", "head", "proof"}] (every data volume FILE: its proof, proof.py, over
            its HEAD metadata members and the rest),
   "streams": [{"number", "size", "blake3"}] (every parity stream)}
so that any one parity volume knows every data volume's exact bytes (a rebuilt volume is byte-identical or
refused) and every other parity stream. Schema mm-bundle-parity/1 (read, no longer written) records each data
volume's whole-file blake3 instead: "data": [{"number", "file", "size", "blake3"}].
A volume's index is hostile until parse_index / parse_parity_index accepts it: every type, range, path and
member name is checked.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, BinaryIO

import blake3

from ..errors import BadInput
from ..edges.fsutil import check_model_path, check_relpath
from ..edges.untrusted import load_json_stream
from .fields import MAX_NAME, MAX_TEXT, digest, integer, plain_name, record, string
from .format import (
    MANIFEST_MEMBER, META, data_member, index_member, parity_data_member, parity_index_member, volume_filename,
)
from .parity import CODEC, MAX_STRIPE, MAX_TOTAL, Layout
from .proof import MAX_HEAD, TarProof
from .payloads import MODEL_KIND, PREFIXES, Payloads, files_expected, parse_payloads, payloads_document
from ..units import is_commit

if TYPE_CHECKING:
    from ..integrity.manifest import Manifest

INDEX_SCHEMA = "mm-bundle-index/1"
DELTA_SCHEMA = "mm-bundle-delta/1"
PARITY_SCHEMA = "mm-bundle-parity/2"  # data volumes by their proof (proof.py)
PARITY_SCHEMA_V1 = "mm-bundle-parity/1"  # data volumes by their whole-file blake3
MAX_VOLUMES = 99_999  # data volumes in one bundle (the name holds at least three digits, the count can grow)


@dataclass(frozen=True, slots=True)
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

    def to_doc(self) -> dict:
        """The member's record, as asdict() makes it without its deep copy of every value (a million members)."""
        return {"member": self.member, "kind": self.kind, "path": self.path, "offset": self.offset,
                "length": self.length, "size": self.size, "segment": self.segment, "segments": self.segments,
                "blake3": self.blake3, "file_blake3": self.file_blake3, "file_sha256": self.file_sha256}

    @property
    def is_last(self) -> bool:
        return self.segment == self.segments

    @property
    def whole(self) -> bool:
        return self.segments == 1


@dataclass(frozen=True)
class ParityNote:
    """A data volume's note of the bundle's parity volumes: how many, and the code and stripe they use."""

    parities: int
    stripe: int
    code: str


@dataclass(frozen=True, slots=True)
class Take:
    """A model file a delta does not carry: PATH in the new revision is BASE_PATH's bytes in the base."""

    path: str
    base_path: str
    size: int
    sha256: str
    blake3: str


@dataclass(frozen=True)
class DeltaNote:
    """What a delta bundle needs from the destination: the base revision (by its manifest's sha256) and the
    files taken from it."""

    base_repo_id: str
    base_revision: str
    base_manifest_sha256: str
    take: tuple[Take, ...]

    @property
    def taken_bytes(self) -> int:
        return sum(t.size for t in self.take)

    def summary(self, manifest: Manifest | None) -> dict:
        """What the delta needs and carries, for bundle, bundle verify and unbundle reports (delta.describe)."""
        taken = {t.path for t in self.take}
        carried = [f for f in manifest.files if f.path not in taken] if manifest is not None else None
        return {"base_repo_id": self.base_repo_id, "base_revision": self.base_revision,
                "base_manifest_sha256": self.base_manifest_sha256, "files_from_base": len(self.take),
                "bytes_from_base": self.taken_bytes, "files_carried": len(carried) if carried is not None else None,
                "bytes_carried": sum(f.size for f in carried) if carried is not None else None}

    def to_doc(self) -> dict:
        return {"base": {"repo_id": self.base_repo_id, "revision": self.base_revision,
                         "manifest_sha256": self.base_manifest_sha256},
                "take": [asdict(t) for t in self.take]}


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
    parity: ParityNote | None = None
    delta: DeltaNote | None = None

    @property
    def number(self) -> int:
        return self.volume

    def expected_meta(self) -> set[str]:
        return set(self.meta) | {index_member(self.volume), MANIFEST_MEMBER}

    def data_members(self) -> dict[str, tuple[int, str]]:
        """Data member -> (length, blake3), as the tar must hold them."""
        return {e.member: (e.length, e.blake3) for e in self.members}

    BUNDLE_WIDE = ("name", "volumes", "volume_size", "repo_id", "revision", "manifest_blake3", "payloads", "parity",
                   "delta")

    def differs_from(self, other: Index) -> str | None:
        """The first bundle-wide field (the same in every volume of one bundle) where OTHER says otherwise."""
        return next((f for f in self.BUNDLE_WIDE if getattr(self, f) != getattr(other, f)), None)

    def to_doc(self, members: bool = True) -> dict:
        doc = {"schema": DELTA_SCHEMA if self.delta else INDEX_SCHEMA, **{f: getattr(self, f) for f in
                                          ("bundle_id", "name", "volume", "volumes", "volume_size", "repo_id",
                                           "revision", "manifest_blake3", "meta")}}
        doc["payloads"] = payloads_document(self.payloads)
        doc["members"] = [e.to_doc() for e in self.members] if members else None
        if self.parity is not None:
            doc["parity"] = asdict(self.parity)
        if self.delta is not None:
            doc["delta"] = self.delta.to_doc()
        return doc


@dataclass(frozen=True)
class Stream:
    """One stream a parity index describes: a whole data volume file (FILE set), or a parity stream. DIGEST: a
    parity stream's blake3; a data volume's proof with its HEAD (proof.py), or its whole-file blake3 (HEAD None:
    schema mm-bundle-parity/1)."""

    number: int  # 1-based data volume or parity number
    size: int
    digest: str
    file: str | None = None
    head: int | None = None

    def hasher(self):
        """What digests this stream's bytes (update, hexdigest) as DIGEST does."""
        return TarProof(self.head) if self.head is not None else blake3.blake3()


@dataclass(frozen=True)
class ParityIndex:
    bundle_id: str
    name: str
    parity: int
    parities: int
    volumes: int
    code: str
    stripe: int
    manifest_blake3: str
    meta: dict[str, str]
    member: str
    data: tuple[Stream, ...]
    streams: tuple[Stream, ...]
    schema: str = PARITY_SCHEMA

    @property
    def number(self) -> int:
        return self.parity

    def stream(self, i: int) -> Stream:
        """Stream I as Layout counts them: 0..k-1 the data volumes, k.. the parity streams."""
        return self.data[i] if i < self.volumes else self.streams[i - self.volumes]

    @property
    def layout(self) -> Layout:
        return Layout(self.volumes, self.parities, self.stripe, tuple(d.size for d in self.data))

    def expected_meta(self) -> set[str]:
        return set(self.meta) | {parity_index_member(self.parity), MANIFEST_MEMBER}

    def data_members(self) -> dict[str, tuple[int, str]]:
        return {self.member: (self.layout.parity_length, self.streams[self.parity - 1].digest)}

    def same_set(self, other: ParityIndex) -> bool:
        """Both describe the same data volumes and parity streams (two parity volumes of one encoding)."""
        fields = ("bundle_id", "volumes", "parities", "code", "stripe", "data", "streams", "schema")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def to_doc(self) -> dict:
        v1 = self.schema == PARITY_SCHEMA_V1
        return {"schema": self.schema, **{f: getattr(self, f) for f in
                                         ("bundle_id", "name", "parity", "parities", "volumes", "code", "stripe",
                                          "manifest_blake3", "meta", "member")},
                "data": [{"number": d.number, "file": d.file, "size": d.size,
                          **({"blake3": d.digest} if v1 else {"head": d.head, "proof": d.digest})} for d in self.data],
                "streams": [{"number": s.number, "size": s.size, "blake3": s.digest} for s in self.streams]}


def _entry(raw: object, where: str, volumes: int | None = None, volume_size: int | None = None) -> Entry:
    """A member record typed and checked on its own; what depends on the volumes (_fits) when they are given."""
    raw = record(raw, "a member record")
    kind, path = string(raw, "kind", max_len=64), string(raw, "path", max_len=MAX_NAME)
    if kind not in PREFIXES:
        raise ValueError(f"unknown kind {kind!r}")
    check_model_path(path, where)
    size = integer(raw, "size")
    offset = integer(raw, "offset", high=size)
    segments = integer(raw, "segments", 1)
    piece, whole = digest(raw, "blake3"), digest(raw, "file_blake3", optional=True)
    e = Entry(string(raw, "member", max_len=2 * MAX_NAME), sys.intern(kind), path, offset,
              integer(raw, "length", high=size - offset), size, integer(raw, "segment", 1, high=segments), segments,
              piece, piece if whole == piece else whole,  # one string for a whole file's two equal digests
              digest(raw, "file_sha256", optional=True))
    if e.whole and (e.offset, e.length) != (0, e.size):
        raise ValueError(f"{path}: a whole file of {e.size} bytes stored as {e.length} bytes at offset {e.offset}")
    if e.member != data_member(kind, path, e.segment, e.segments):
        raise ValueError(f"member name {e.member[:200]!r} does not match {kind} {path!r}")
    return e if volumes is None or volume_size is None else _fits(e, volumes, volume_size)


def _fits(e: Entry, volumes: int, volume_size: int) -> Entry:
    if e.segments > volumes:  # a piece per volume at most
        raise ValueError(f"segments {e.segments} is outside [1, {volumes}]")
    if e.length > volume_size or e.size > e.segments * volume_size:
        # no piece is larger than a volume, and a file of N pieces is at most N volumes
        raise ValueError(f"{e.path}: size {e.size} (this piece {e.length}) cannot fit {e.segments} piece(s) in "
                         f"volumes of {volume_size} bytes")
    return e


def load_index(f: BinaryIO, where: str, max_bytes: int) -> object:
    """The index document read from the binary file F (a volume's member, hashed as it streams) as load_json reads
    it (Malformed when it is not JSON within mm's limits), with each of its members typed as it is read (an Entry;
    what depends on the volumes is checked by parse_index): the bytes, the text and a dict per member would cost
    a kilobyte and more a file, and a volume may hold a million files."""
    def member(raw: object, _: int) -> Entry:
        try:
            return _entry(raw, where)
        except BadInput as e:
            raise BadInput(f"{where}: index names an unsafe path ({e.message})") from None
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{where}: malformed index ({_missing(e)})") from None

    return load_json_stream(f, where, key="members", item=member, max_items=max_bytes,
                            max_bytes=max_bytes)


def _meta(doc: dict, where: str) -> dict[str, str]:
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("meta is not an object")
    for name in meta:
        if not isinstance(name, str) or len(name) > MAX_NAME:
            raise ValueError(f"metadata member name of {len(name)} characters")
        check_relpath(name, where)
        if not name.startswith(META + "/"):
            raise ValueError(f"metadata member {name!r} outside {META}/")
        digest(meta, name)
    return dict(meta)


def _stripe(raw: dict) -> int:
    stripe = integer(raw, "stripe", 64)
    if stripe % 64 or stripe > MAX_STRIPE:
        raise ValueError(f"stripe {stripe} is not a multiple of 64 up to {MAX_STRIPE}")
    return stripe


def _parity_note(raw: object, volumes: int) -> ParityNote | None:
    if raw is None:
        return None
    raw = record(raw, "parity")
    note = ParityNote(integer(raw, "parities", 1, high=MAX_TOTAL), _stripe(raw), string(raw, "code", max_len=64))
    if volumes + note.parities > MAX_TOTAL:
        raise ValueError(f"{volumes} data and {note.parities} parity volumes: more than {MAX_TOTAL}")
    return note


def _take(raw: object, where: str) -> Take:
    raw = record(raw, "a take-from-base record")
    return Take(check_relpath(string(raw, "path"), where), check_relpath(string(raw, "base_path"), where),
                integer(raw, "size"), digest(raw, "sha256"), digest(raw, "blake3"))


def _delta_note(raw: object, where: str) -> DeltaNote:
    raw = record(raw, "delta")
    base = record(raw["base"], "delta base")
    revision = string(base, "revision", max_len=40)
    if not is_commit(revision):
        raise ValueError(f"delta base revision {revision!r} is not a full 40-hex commit")
    take = raw["take"]
    if not isinstance(take, list):
        raise ValueError("delta take is not a list")
    note = DeltaNote(string(base, "repo_id", max_len=MAX_TEXT), revision, digest(base, "manifest_sha256"),
                     tuple(_take(t, where) for t in take))
    if len({t.path for t in note.take}) != len(note.take):
        raise ValueError("delta takes one path twice")
    return note


def parse_index(doc: object, where: str) -> Index:
    """Check an index document and return it typed; BadInput naming WHERE (the volume) on anything off.

    Beyond types and paths: every size is bounded by what the bundle can hold (a whole file is stored whole,
    a piece fits a volume, the payloads fit the volumes), so an index cannot make unbundle reserve or wait for
    more than the volumes carry. Whether the sizes agree with the manifest and the payload records is
    `disagreements` (the manifest is a separate member)."""
    if not isinstance(doc, dict) or doc.get("schema") not in (INDEX_SCHEMA, DELTA_SCHEMA):
        raise BadInput(f"{where}: not an mm bundle index (expected schema {INDEX_SCHEMA!r} or {DELTA_SCHEMA!r})")
    is_delta = doc["schema"] == DELTA_SCHEMA
    try:
        if is_delta != ("delta" in doc):
            raise ValueError(f"schema {doc['schema']} with{'out' if is_delta else ''} a delta record")
        volumes = integer(doc, "volumes", 1, high=MAX_VOLUMES)
        volume = integer(doc, "volume", 1, high=volumes)
        volume_size = integer(doc, "volume_size", 1)
        meta = _meta(doc, where)
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
                     digest(doc, "manifest_blake3"), meta, payloads,
                     tuple(_fits(e if isinstance(e, Entry) else _entry(e, where), volumes, volume_size)
                           for e in members),
                     _parity_note(doc.get("parity"), volumes), _delta_note(doc["delta"], where) if is_delta else None)
    except BadInput as e:
        raise BadInput(f"{where}: index names an unsafe path ({e.message})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed index ({_missing(e)})") from None


def _missing(e: Exception) -> str:
    return f"{e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else str(e)


def _streams(raw: object, count: int, what: str, where: str, proofs: bool = False) -> tuple[Stream, ...]:
    """The records of DATA (data volumes: by their proof and head where PROOFS, else their whole-file blake3) or
    of STREAMS (parity streams, by their blake3)."""
    if not isinstance(raw, list) or len(raw) != count:
        raise ValueError(f"{what} does not list every one of {count}")
    out = []
    for n, item in enumerate(raw, 1):
        item = record(item, f"{what} record")
        if integer(item, "number", 1) != n:
            raise ValueError(f"{what} record {n} is out of order")
        file = plain_name(item, "file", where, "data volume file") if what == "data" else None
        if proofs:
            out.append(Stream(n, integer(item, "size"), digest(item, "proof"), file, integer(item, "head", 1, high=MAX_HEAD)))
        else:
            out.append(Stream(n, integer(item, "size"), digest(item, "blake3"), file))
    return tuple(out)


def parse_parity_index(doc: object, where: str) -> ParityIndex:
    """Check a parity volume's index and return it typed; BadInput naming WHERE on anything off."""
    if not isinstance(doc, dict) or doc.get("schema") not in (PARITY_SCHEMA, PARITY_SCHEMA_V1):
        raise BadInput(f"{where}: not an mm parity index (expected schema {PARITY_SCHEMA!r} or {PARITY_SCHEMA_V1!r})")
    schema = doc["schema"]
    try:
        parity, parities = integer(doc, "parity", 1, high=MAX_TOTAL), integer(doc, "parities", 1, high=MAX_TOTAL)
        volumes = integer(doc, "volumes", 1, high=MAX_VOLUMES)
        if parity > parities or volumes + parities > MAX_TOTAL:
            raise ValueError(f"parity {parity} of {parities} over {volumes} data volumes")
        index = ParityIndex(string(doc, "bundle_id", max_len=MAX_TEXT, empty=False),
                            string(doc, "name", max_len=255, empty=False), parity, parities, volumes,
                            string(doc, "code", max_len=64), _stripe(doc), digest(doc, "manifest_blake3"),
                            _meta(doc, where), string(doc, "member", max_len=MAX_NAME),
                            _streams(doc["data"], volumes, "data", where, proofs=schema == PARITY_SCHEMA),
                            _streams(doc["streams"], parities, "streams", where), schema)
        if index.member != parity_data_member(parity):
            raise ValueError(f"member {index.member!r} is not {parity_data_member(parity)!r}")
        for d in index.data:  # a rebuilt volume is written under this name: only ever the bundle's own
            if d.file != volume_filename(index.name, d.number, volumes):
                raise ValueError(f"data volume {d.number} is named {d.file!r}, not "
                                 f"{volume_filename(index.name, d.number, volumes)!r}")
        if any(s.size != index.layout.parity_length for s in index.streams):
            raise ValueError("a parity stream's size does not match the data volumes' layout")
    except BadInput as e:
        raise BadInput(f"{where}: parity index names an unsafe path ({e.message})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed parity index ({_missing(e)})") from None
    if index.code != CODEC:
        raise BadInput(f"{where}: parity made with code {index.code!r}; this mm reads {CODEC!r} only")
    return index


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
    if index.delta is not None:
        problems += take_disagreements(index.delta, manifest) if manifest is not None else []
        carried_paths = {e.path for e in index.members if e.kind == MODEL_KIND}
        problems += [f"delta takes {t.path!r} from the base, and the volume carries it too"
                     for t in index.delta.take if t.path in carried_paths]
    return problems


def share_manifest_strings(index: Index, files: dict) -> None:
    """Make INDEX's model entries hold the manifest's own path and digest strings (FILES: its entries by path),
    where they are equal (disagreements has checked they are): one copy of each per file, not two, for the
    import's length (a volume may hold a million files)."""
    for e in index.members:
        f = files.get(e.path) if e.kind == MODEL_KIND else None
        if f is None:
            continue
        object.__setattr__(e, "path", f.path)
        for mine, theirs in (("blake3", "blake3"), ("file_blake3", "blake3"), ("file_sha256", "sha256")):
            if getattr(e, mine) == getattr(f, theirs):
                object.__setattr__(e, mine, getattr(f, theirs))


def take_disagreements(note: DeltaNote, manifest: Manifest) -> list[str]:
    """Takes that are not a file of MANIFEST with the same size and hashes (bundle-wide: the same in every volume)."""
    files = manifest.by_path()
    problems = []
    for t in note.take:
        f = files.get(t.path)
        if f is None:
            problems.append(f"delta takes {t.path!r} from the base, but the manifest has no such file")
        elif (f.size, f.sha256, f.blake3) != (t.size, t.sha256, t.blake3):
            problems.append(f"delta takes {t.path!r} from the base as {t.size} bytes, the manifest says {f.size} "
                            f"(or the hashes differ)")
    return problems


def unaccounted(manifest: Manifest, indexes: list[Index]) -> list[str]:
    """The model files of MANIFEST that INDEXES, the indexes of every data volume of one bundle, neither carry
    whole (every piece of a split file) nor take from a delta's base. The signed manifest is the truth about the
    files; an index only says where each one is, and with every volume at hand it must say it for each."""
    pieces: dict[str, int] = {}  # path -> the segments seen, bit N for segment N (not a set a file: a million)
    count: dict[str, int] = {}
    for idx in indexes:
        for e in idx.members:
            if e.kind == MODEL_KIND:
                pieces[e.path] = pieces.get(e.path, 0) | (1 << e.segment)
                count[e.path] = e.segments
    taken = {t.path for idx in indexes[:1] if idx.delta is not None for t in idx.delta.take}
    return sorted(f.path for f in manifest.files if f.path not in taken
                  and (f.path not in count or pieces[f.path] != (1 << (count[f.path] + 1)) - 2))
