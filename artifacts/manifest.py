"""The hash manifest: one JSON document per (repo, revision), kept at <model dir>/.mm/manifest.json.

Schema `mm-manifest/1`:
{
  "schema": "mm-manifest/1",
  "repo_id": "MiniMaxAI/MiniMax-M3.1-Flash", "repo_type": "model",
  "revision": "<40-hex commit>", "requested_revision": "ce7f4df",
  "endpoint": "https://huggingface.co", "created": "2026-11-30T04:41:10Z",
  "files": [{"path": "model-00001-of-00004.safetensors", "size": 123,
             "blake3": "...", "sha256": "...",
             "upstream": {"kind": "lfs-sha256" | "git-blob-sha1", "value": "..."} | null,
             "source": "hub" | "modelscope:<id>@<rev>" | "local" | "bundle:<id>"}]
}
Files are sorted by path. Secrets never enter it (the endpoint is stored without credentials).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .errors import BadInput
from .fsutil import MM_DIR, atomic_write_text, check_relpath
from .hashing import hash_file

SCHEMA = "mm-manifest/1"
MANIFEST_NAME = "manifest.json"
HEX40 = re.compile(r"^[0-9a-f]{40}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Upstream:
    """What the Hub published for a file: the LFS sha256, or the git blob sha1 of a small file."""

    kind: str  # "lfs-sha256" | "git-blob-sha1"
    value: str

    def matches(self, sha256: str | None, git_sha1: str | None) -> bool:
        got = sha256 if self.kind == "lfs-sha256" else git_sha1
        return got == self.value


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    blake3: str
    sha256: str
    upstream: Upstream | None = None
    source: str = "hub"
    xet_hash: str | None = None  # the Hub's Xet hash for a Xet-backed file, as listed (recorded, not checked)


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

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def with_files(self, files: list[FileEntry] | tuple[FileEntry, ...]) -> "Manifest":
        return replace(self, files=tuple(sorted(files, key=lambda f: f.path)))


def manifest_path(model_dir: Path) -> Path:
    return Path(model_dir) / MM_DIR / MANIFEST_NAME


def public_endpoint(endpoint: str | None) -> str | None:
    """Drop any user:password@ from an endpoint URL before it is recorded or shown."""
    if not endpoint:
        return endpoint
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def to_json(manifest: Manifest) -> str:
    doc = asdict(manifest)
    ordered = {k: doc[k] for k in ("schema", "repo_id", "repo_type", "revision", "requested_revision", "endpoint", "created")}
    ordered["files"] = [{k: v for k, v in f.items() if k != "xet_hash" or v is not None} for f in doc["files"]]
    return json.dumps(ordered, indent=2) + "\n"


def write_manifest(manifest: Manifest, path: Path) -> None:
    validate(manifest, str(path))
    atomic_write_text(Path(path), to_json(manifest))


def read_manifest(path: Path) -> Manifest:
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: no manifest here (run `mm fetch` or `mm manifest` first)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read manifest: {e}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: manifest is not valid JSON (line {e.lineno}: {e.msg})") from None
    return from_dict(doc, str(path))


def from_dict(doc: object, where: str) -> Manifest:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise BadInput(f"{where}: not an mm manifest (expected schema {SCHEMA!r})")
    try:
        files = tuple(entry_from_dict(f) for f in doc["files"])
        manifest = Manifest(
            repo_id=str(doc["repo_id"]),
            revision=str(doc["revision"]),
            files=files,
            repo_type=str(doc.get("repo_type", "model")),
            requested_revision=doc.get("requested_revision"),
            endpoint=doc.get("endpoint"),
            created=str(doc.get("created", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed manifest entry ({e!r})") from None
    validate(manifest, where)
    return manifest


def entry_from_dict(d: dict) -> FileEntry:
    up = d.get("upstream")
    return FileEntry(
        path=str(d["path"]),
        size=int(d["size"]),
        blake3=str(d["blake3"]),
        sha256=str(d["sha256"]),
        upstream=Upstream(kind=str(up["kind"]), value=str(up["value"])) if up else None,
        source=str(d.get("source", "hub")),
        xet_hash=str(d["xet_hash"]) if d.get("xet_hash") is not None else None,
    )


def validate(manifest: Manifest, where: str) -> None:
    if not HEX40.match(manifest.revision):
        raise BadInput(f"{where}: revision {manifest.revision!r} is not a full 40-hex commit")
    seen: set[str] = set()
    for f in manifest.files:
        check_relpath(f.path, where)
        if f.path in seen:
            raise BadInput(f"{where}: duplicate path {f.path!r}")
        seen.add(f.path)
        if f.size < 0 or not HEX64.match(f.blake3) or not HEX64.match(f.sha256):
            raise BadInput(f"{where}: bad size or digest for {f.path!r}")
        if f.xet_hash is not None and not HEX64.match(f.xet_hash):
            raise BadInput(f"{where}: bad xet_hash for {f.path!r}")


def export_sums(manifest: Manifest, algorithm: str) -> str:
    """Lines that `sha256sum -c` / `b3sum --check` accept, run from the model directory."""
    if algorithm not in ("sha256", "blake3"):
        raise BadInput(f"unknown checksum format {algorithm!r} (use sha256 or blake3)")
    lines = []
    for f in manifest.files:
        digest = f.sha256 if algorithm == "sha256" else f.blake3
        lines.append(f"{digest}  {f.path}")
    return "\n".join(lines) + ("\n" if lines else "")


def entry_for_file(root: Path, relpath: str, upstream: Upstream | None = None, source: str = "local",
                   want_git_sha1: bool = False) -> tuple[FileEntry, str | None]:
    """Hash one local file in one pass; returns the entry and its git blob sha1 when asked."""
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
        atomic_write_text(target, export_sums(manifest, algorithm))
        written.append(str(target))
    return written
