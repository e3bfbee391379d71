"""The hash manifest: one JSON document per (repo, revision), kept at <model dir>/.mm/manifest.json.

Schema `mm-manifest/1`:
{
  "schema": "mm-manifest/1",
  "repo_id": "MiniMaxAI/MiniMax-M3.1-Flash", "repo_type": "model",
  "revision": "<40-hex commit>", "requested_revision": "ce7f4df",
  "endpoint": "https://huggingface.co", "created": "2026-11-30T04:41:10Z",
  "files": [{"path": "model-00001-of-00004.safetensors", "size": 123,
             "blake3": "..." | null, "sha256": "..." | null,
             "upstream": {"kind": "lfs-sha256" | "git-blob-sha1", "value": "..."} | null,
             "source": "hub" | "modelscope:<id>@<rev>" | "local" | "bundle:<id>"}]
}
Files are sorted by path. Secrets never enter it (the endpoint is stored without credentials).
A partial fetch (`--include`/`--exclude`) adds, still under schema `mm-manifest/1`:
  "partial": {"include": ["*.json"], "exclude": [], "left_out": ["model-00001-of-00004.safetensors", ...]}
the patterns asked for and the revision's files left out. The key is optional and absent from a whole
revision's manifest (byte for byte the same as before it existed); an older mm ignores it and judges a partial
directory as a whole one (reports the shards its index names as missing), never the other way round.
The manifest describes the revision, not what happened to arrive: a file the fetch could not get is still
listed, with its size and upstream identity and "blake3": null (not yet proven here), so verify, bundle and
launch see it as missing (or, once it is there, check it against the upstream identity).
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Iterator
from urllib.parse import urlsplit, urlunsplit

from ..errors import BadInput
from ..paths import MM_DIR, manifest_path
from ..edges.fsutil import atomic_write_bytes, atomic_write_text, check_model_path, json_record, open_local_file
from ..edges.untrusted import At, load_json_stream
from ..units import is_commit

SCHEMA = "mm-manifest/1"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
UPSTREAM_KINDS = ("lfs-sha256", "git-blob-sha1")
MAX_FILES = 1_000_000  # entries in one manifest
MAX_MANIFEST_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Upstream:
    """What the Hub published for a file: the LFS sha256, or the git blob sha1 of a small file."""

    kind: str  # "lfs-sha256" | "git-blob-sha1"
    value: str

    def matches(self, sha256: str | None, git_sha1: str | None) -> bool:
        got = sha256 if self.kind == "lfs-sha256" else git_sha1
        return got == self.value


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    blake3: str | None  # None: listed by the revision but never proven here (a failed fetch)
    sha256: str | None
    upstream: Upstream | None = None
    source: str = "hub"
    xet_hash: str | None = None  # the Hub's Xet hash for a Xet-backed file, as listed (recorded, not checked)

    @property
    def proven(self) -> bool:
        return self.blake3 is not None


def expected_entry(path: str, size: int, upstream: Upstream) -> FileEntry:
    """The entry of a file the revision lists but that was not fetched: size and upstream identity only."""
    return FileEntry(path=path, size=size, blake3=None,
                     sha256=upstream.value if upstream.kind == "lfs-sha256" else None, upstream=upstream, source="hub")


@dataclass(frozen=True)
class Partial:
    """A partial fetch: the patterns asked for, and the revision's files they left out (not judged by verify)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    def asked(self) -> str:
        """The selection as the user typed it: --include '*.json' --exclude 'x'."""
        import shlex

        return " ".join([f"--include {shlex.quote(p)}" for p in self.include] +
                        [f"--exclude {shlex.quote(p)}" for p in self.exclude]) or "a selection"


@dataclass(frozen=True)
class Manifest:
    repo_id: str
    revision: str
    files: tuple[FileEntry, ...]
    repo_type: str = "model"
    requested_revision: str | None = None
    endpoint: str | None = None
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    schema: str = SCHEMA
    partial: Partial | None = None  # None: the whole revision was asked for

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def with_files(self, files: list[FileEntry] | tuple[FileEntry, ...]) -> "Manifest":
        return replace(self, files=tuple(sorted(files, key=lambda f: f.path)))

    @property
    def unproven(self) -> tuple[FileEntry, ...]:
        """Files the revision lists that were never fetched and proven here."""
        return tuple(f for f in self.files if not f.proven)


def public_endpoint(endpoint: str | None) -> str | None:
    """Drop any user:password@ from an endpoint URL before it is recorded or shown."""
    if not endpoint:
        return endpoint
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def to_json(manifest: Manifest) -> str:
    """The manifest's JSON (indent 2)."""
    return "".join(json_chunks(manifest))


def json_chunks(manifest: Manifest) -> Iterator[str]:
    """The manifest's JSON (indent 2), rendered a file at a time: a copy of every entry as a dict at once (asdict),
    json's list of every chunk, or the whole text cost hundreds of bytes a file, and a revision may hold a
    million files."""
    ordered = {k: getattr(manifest, k) for k in ("schema", "repo_id", "repo_type", "revision", "requested_revision",
                                                  "endpoint", "created")}
    if manifest.partial is not None:
        ordered["partial"] = {k: list(v) for k, v in asdict(manifest.partial).items()}
    if not manifest.files:
        yield json.dumps({**ordered, "files": []}, indent=2) + "\n"
        return
    head = json.dumps({**ordered, "files": [None]}, indent=2)
    before, after = head.rsplit("null", 1)
    yield before
    for i, f in enumerate(manifest.files):
        yield (",\n    " if i else "") + json_record(_file_doc(f), 2, "    ")
    yield after + "\n"


def _file_doc(f: FileEntry) -> dict:
    doc = {k: getattr(f, k) for k in ("path", "size", "blake3", "sha256", "upstream", "source")}
    if doc["upstream"] is not None:
        doc["upstream"] = asdict(doc["upstream"])
    if f.xet_hash is not None:
        doc["xet_hash"] = f.xet_hash
    return doc


def write_manifest(manifest: Manifest, path: Path, *, root: Path | None = None) -> None:
    """Write PATH atomically; ROOT: the model directory it lies in (nothing below it written through a link;
    default PATH's own directory)."""
    validate(manifest, str(path))
    atomic_write_bytes(Path(path), _batched(json_chunks(manifest)), root=root or Path(path).parent)


def _batched(chunks: Iterator[str], size: int = 1 << 20) -> Iterator[bytes]:
    """CHUNKS as UTF-8, about SIZE bytes at a time."""
    batch: list[str] = []
    held = 0
    for chunk in chunks:
        batch.append(chunk)
        held += len(chunk)
        if held >= size:
            yield "".join(batch).encode("utf-8")
            batch, held = [], 0
    yield "".join(batch).encode("utf-8")


def read_manifest(path: Path) -> Manifest:
    path = Path(path)
    if not os.path.lexists(path):
        raise BadInput(f"{path}: no manifest here (run `mm fetch` or `mm manifest` first)")
    with open_local_file(path, what="manifest", max_bytes=MAX_MANIFEST_BYTES) as f:
        try:
            return _read(f, str(path))
        except OSError as e:
            raise BadInput(f"{path}: cannot read manifest: {e.strerror or e}") from None


def from_json(data: bytes | str, where: str) -> Manifest:
    """A manifest from the bytes of a document read from WHERE (a file, a bundle member)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return _read(io.BytesIO(data), where)


def from_file(f: BinaryIO, where: str) -> Manifest:
    """A manifest read from the binary file F (a bundle member, read as it streams) from WHERE."""
    return _read(f, where)


def _read(f: BinaryIO, where: str) -> Manifest:
    """The manifest in the binary file F, its entries typed as they are read (load_json_stream)."""
    files_at = At(where).key("files")
    doc = load_json_stream(f, where, key="files", item=lambda raw, i: entry_from_dict(raw, files_at.index(i)),
                           max_items=MAX_FILES, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    return from_dict(doc, where)


def from_dict(doc: object, where: str) -> Manifest:
    at = At(where)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise BadInput(f"{where}: not an mm manifest (expected schema {SCHEMA!r})")
    files = at.get_list(doc, "files", max_len=MAX_FILES)
    manifest = Manifest(
        repo_id=at.get_str(doc, "repo_id", max_len=256),
        revision=at.get_str(doc, "revision", max_len=64),
        files=tuple(f if isinstance(f, FileEntry) else entry_from_dict(f, at.key("files").index(i))
                    for i, f in enumerate(files)),
        repo_type=at.get_str(doc, "repo_type", "model", max_len=32),
        requested_revision=at.get_str(doc, "requested_revision", None, max_len=256),
        endpoint=at.get_str(doc, "endpoint", None, max_len=2048),
        created=at.get_str(doc, "created", "", max_len=64),
        partial=_partial_from_dict(doc, at),
    )
    validate(manifest, where)
    return manifest


def _partial_from_dict(doc: dict, at: At) -> Partial | None:
    part = at.get_obj(doc, "partial", None)
    if part is None:
        return None
    here = at.key("partial")

    def strings(key: str, max_len: int) -> tuple[str, ...]:
        values = here.get_list(part, key, [], max_len=MAX_FILES)
        return tuple(here.key(key).index(i).str(v, max_len, empty=False) for i, v in enumerate(values))

    return Partial(include=strings("include", 1024), exclude=strings("exclude", 1024), left_out=strings("left_out", 4096))


def entry_from_dict(d: object, at: At | None = None) -> FileEntry:
    """One `files` entry, every field typed and bounded (AT names the document and the entry on failure)."""
    at = at or At("manifest entry")
    d = at.obj(d)
    up = at.get_obj(d, "upstream", None)
    if up is not None:
        up_at = at.key("upstream")
        kind = up_at.get_str(up, "kind", max_len=32)
        if kind not in UPSTREAM_KINDS:
            raise up_at.key("kind").fail(f"unknown upstream kind {kind!r} (expected {' or '.join(UPSTREAM_KINDS)})")
        upstream = Upstream(kind=kind, value=up_at.get_str(up, "value", max_len=128))
    else:
        upstream = None
    return FileEntry(
        path=at.get_str(d, "path", max_len=4096, empty=False),
        size=at.get_int(d, "size"),
        blake3=at.get_str(d, "blake3", None, max_len=64),
        sha256=at.get_str(d, "sha256", None, max_len=64),
        upstream=upstream,
        source=sys.intern(at.get_str(d, "source", "hub", max_len=512)),  # a few values, a million entries
        xet_hash=at.get_str(d, "xet_hash", None, max_len=64),
    )


def validate(manifest: Manifest, where: str) -> None:
    if not is_commit(manifest.revision):
        raise BadInput(f"{where}: revision {manifest.revision!r} is not a full 40-hex commit")
    seen: set[str] = set()
    for f in manifest.files:
        check_model_path(f.path, where)
        if f.path in seen:
            raise BadInput(f"{where}: duplicate path {f.path!r}")
        seen.add(f.path)
        if f.size < 0 or any(d is not None and not HEX64.match(d) for d in (f.blake3, f.sha256)):
            raise BadInput(f"{where}: bad size or digest for {f.path!r}")
        if f.blake3 is None and f.upstream is None:
            raise BadInput(f"{where}: {f.path!r} has neither a blake3 nor an upstream identity to check it against")
        if f.xet_hash is not None and not HEX64.match(f.xet_hash):
            raise BadInput(f"{where}: bad xet_hash for {f.path!r}")
    for path in manifest.partial.left_out if manifest.partial else ():
        check_model_path(path, where)
        if path in seen:
            raise BadInput(f"{where}: {path!r} is both a file of the manifest and left out of it (partial.left_out)")


def export_sums(manifest: Manifest, algorithm: str) -> str:
    """Lines that `sha256sum -c` / `b3sum --check` accept, run from the model directory."""
    return "".join(export_sums_chunks(manifest, algorithm))


def export_sums_chunks(manifest: Manifest, algorithm: str) -> Iterator[str]:
    """export_sums's text, about a megabyte at a time (a line a file, and a revision may hold a million); a
    manifest it cannot be made from is refused here, before the first chunk."""
    if algorithm not in ("sha256", "blake3"):
        raise BadInput(f"unknown checksum format {algorithm!r} (use sha256 or blake3)")
    if unproven := manifest.unproven:
        # a sums file without them would let `sha256sum -c` pass on an incomplete model
        raise BadInput(f"{manifest.repo_id}@{manifest.revision[:12]}: {len(unproven)} file(s) of the revision were "
                       f"never fetched here (e.g. {unproven[0].path}); run `mm repair DIR` first")
    return _sums_lines(manifest.files, algorithm)


def _sums_lines(files: tuple[FileEntry, ...], algorithm: str) -> Iterator[str]:
    lines: list[str] = []
    for f in files:
        lines.append(f"{f.sha256 if algorithm == 'sha256' else f.blake3}  {f.path}\n")
        if len(lines) >= 8192:
            yield "".join(lines)
            lines = []
    yield "".join(lines)


def entry_for_file(root: Path, relpath: str, upstream: Upstream | None = None, source: str = "local",
                   want_git_sha1: bool = False) -> tuple[FileEntry, str | None]:
    """Hash one local file in one pass; returns the entry and its git blob sha1 when asked."""
    from .hashing import hash_file  # here: reading a manifest (a quick verify) hashes nothing

    d = hash_file(Path(root) / relpath, sha256=True, git_sha1=want_git_sha1)
    return FileEntry(path=relpath, size=d.size, blake3=d.blake3, sha256=d.sha256 or "", upstream=upstream,
                     source=source), d.git_sha1


SUMS_FILES = {"sha256": "SHA256SUMS", "blake3": "B3SUMS"}


def export_sums_files(model_dir: Path, algorithms: tuple[str, ...]) -> list[str]:
    """Write DIR/.mm/SHA256SUMS and/or B3SUMS from the manifest; returns the paths written."""
    manifest = read_manifest(manifest_path(model_dir))
    written = []
    for algorithm in algorithms:
        target = Path(model_dir) / MM_DIR / SUMS_FILES[algorithm]
        atomic_write_text(target, export_sums(manifest, algorithm), root=Path(model_dir))
        written.append(str(target))
    return written
