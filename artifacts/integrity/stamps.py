"""When a model directory was last verified in full: DIR/.mm/verified.json, written by `mm verify`, `mm fetch` and
`mm unbundle`, read by `mm ls`. Keyed to the manifest as it was (its sha256), so a changed manifest shows the
stamp as not current."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..edges.fsutil import atomic_write_json, open_local_file, read_local_file
from ..edges.untrusted import At, load_json
from ..paths import MM_DIR, manifest_path, state_dir, state_root
from ..units import iso_time
from .manifest import MAX_MANIFEST_BYTES

STAMP = "verified.json"
STAMP_SCHEMA = "mm-verified/1"
def record_verified(model_dir: Path, ok: bool, files: int, nbytes: int, problems: int, by: str) -> None:
    """Note in DIR/.mm/verified.json that DIR was verified in full now, against its manifest as it is (its sha256).
    Best effort: a directory mm cannot write (a read-only mount, a link planted under it) keeps no stamp."""
    try:
        digest = _manifest_sha256(manifest_path(model_dir))
        atomic_write_json(_stamp_path(model_dir), {
            "schema": STAMP_SCHEMA, "time": iso_time(time.time()), "ok": ok, "manifest_sha256": digest,
            "files": files, "bytes": nbytes, "problems": problems, "by": by}, root=state_root(model_dir))
    except (OSError, BadInput):
        pass


def _manifest_sha256(path: Path) -> str:
    """The sha256 of the manifest at PATH, read a megabyte at a time (not held: ~285 bytes a file, and the import or
    verify that stamps it holds its records)."""
    h, left = hashlib.sha256(), MAX_MANIFEST_BYTES + 1
    with open_local_file(path, what="manifest", max_bytes=MAX_MANIFEST_BYTES) as f:
        while left and (chunk := f.read(min(left, 1 << 20))):
            h.update(chunk)
            left -= len(chunk)
    if not left:
        raise BadInput(f"{path}: manifest grew past the {MAX_MANIFEST_BYTES} bytes mm reads for it while it was read")
    return h.hexdigest()


def _stamp_path(model_dir: Path) -> Path:
    """Beside the manifest (for a Hugging Face cache snapshot, in mm's state directory outside the cache)."""
    return state_dir(model_dir, MM_DIR) / STAMP


@dataclass(frozen=True)
class Verified:
    time: str
    ok: bool
    current: bool  # for the manifest as it is now (False: the manifest changed since)
    by: str


def read_verified(model_dir: Path, manifest_bytes: bytes) -> Verified | None:
    path = _stamp_path(model_dir)
    try:
        doc = load_json(read_local_file(path, what="verification stamp", max_bytes=64 * 1024), str(path),
                        max_bytes=64 * 1024)
        at = At(str(path))
        at.obj(doc)
        if doc.get("schema") != STAMP_SCHEMA:
            return None
        return Verified(at.get_str(doc, "time", max_len=64), at.get_bool(doc, "ok"),
                        at.get_str(doc, "manifest_sha256", max_len=64) == hashlib.sha256(manifest_bytes).hexdigest(),
                        at.get_str(doc, "by", max_len=64))
    except (OSError, BadInput):
        return None
