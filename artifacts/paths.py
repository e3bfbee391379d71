"""Every place mm keeps something on disk: a model directory's own files (DIR/.mm/: the manifest, its signature,
the lock, the partials and push state), a store's `current` pointer, and mm's state directory outside a Hugging Face
cache.

The Hugging Face cache layout (`hf download` without --local-dir), where a user points mm at a snapshot:

    HF_HUB_CACHE/models--OWNER--NAME/
        blobs/<upstream identity>         the bytes, one file per content, shared by every snapshot
        snapshots/<commit>/<path>         symlinks: ../../blobs/<identity> (one more ../ per directory level)
        refs/main                         the commit a branch pointed at

mm reads such a snapshot (`mm manifest`, `verify`, `bundle`, `launch`, `push`) and never writes into the cache:
it is hf's (`hf cache scan/verify/delete` manage it, its blobs are shared between snapshots, and it is often
shared or read-only). So a snapshot's `.mm/` (manifest, signature, lock, push state) is kept outside the cache,
in mm's state directory: $XDG_STATE_HOME/mm/hf-cache/<repo folder>/<commit>-<hash of the snapshot's real
path>/ (default ~/.local/state/...). The commands that write model files (fetch, repair, unbundle, pull)
refuse a snapshot before writing anything.

Symlinks: the one allowance. Inside a snapshot, a symlink is followed only when it resolves to a regular file
directly in that repo's own blobs/ (a real directory, not a link); any other link is judged as in any other
directory (a link leaving it is a problem, never followed).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import Refused

MM_DIR = ".mm"  # a model directory's own files: DIR/.mm/
MANIFEST_NAME = "manifest.json"
POINTER = "current"  # a store's pointer: ROOT/<repo id>/current -> <revision dir>
UNBUNDLE_DIR = f"{MM_DIR}/unbundle"  # an import in progress: its state, partial files, rebuilt volumes
UNBUNDLE_STATE = f"{UNBUNDLE_DIR}/state.json"
IMPORT_RECORD = f"{MM_DIR}/imported.json"  # what a finished import left: its bundle, volumes and file stamps

REPO_FOLDER = re.compile(r"^(models|datasets|spaces)--[^/]+$")


@dataclass(frozen=True)
class Snapshot:
    path: str  # the snapshot directory, real path
    repo_folder: str  # models--OWNER--NAME
    blobs: str  # the repo's blobs/, real path
    revision: str  # the snapshot's folder name: the commit

    @property
    def repo_id(self) -> str:
        return self.repo_folder.split("--", 1)[1].replace("--", "/")

    def allows(self, target: str) -> bool:
        """TARGET (a symlink's real path) is a regular file directly in this repo's blobs/."""
        if os.path.dirname(target) != self.blobs:
            return False
        try:
            return stat.S_ISREG(os.stat(target).st_mode)
        except OSError:
            return False


def snapshot_of(path: Path | str) -> Snapshot | None:
    """The snapshot PATH is (snapshots/<commit> of a repo folder holding a real blobs/ directory), else None."""
    real = os.path.realpath(path)
    snapshots = os.path.dirname(real)
    repo_root = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not REPO_FOLDER.match(os.path.basename(repo_root)):
        return None
    blobs = os.path.join(repo_root, "blobs")
    try:
        if not stat.S_ISDIR(os.lstat(blobs).st_mode) or not os.path.isdir(real):
            return None
    except OSError:
        return None
    return Snapshot(real, os.path.basename(repo_root), blobs, os.path.basename(real))


def mm_state_home() -> Path:
    """mm's state directory for Hugging Face cache snapshots: $XDG_STATE_HOME/mm/hf-cache (the XDG default
    ~/.local/state when unset)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "mm" / "hf-cache"


def state_dir(model_dir: Path | str, mm_dir: str = MM_DIR) -> Path:
    """Where mm keeps MODEL_DIR's own files (manifest, signature, lock, push state): MODEL_DIR/.mm, or, for a
    Hugging Face cache snapshot, a directory of mm's state outside the cache."""
    snap = snapshot_of(model_dir)
    if snap is None:
        return Path(model_dir) / mm_dir
    import hashlib  # here: see hashing.py

    key = hashlib.sha256(snap.path.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return mm_state_home() / snap.repo_folder / f"{snap.revision}-{key}"


def refuse_snapshot(path: Path | str, what: str) -> None:
    """WHAT (e.g. "mm fetch") writes model files: never into hf's cache. Raises Refused before anything is written."""
    snap = snapshot_of(path)
    if snap is not None:
        raise Refused(f"{path}: a Hugging Face cache snapshot ({snap.repo_id}@{snap.revision[:12]}); {what} does not "
                      f"write into hf's cache: give a directory of its own (e.g. --local-dir), or read the snapshot "
                      f"where it lies with `mm manifest` / `mm verify`")


def state_root(model_dir: Path) -> Path:
    """The root that MODEL_DIR's own files (manifest, signature, lock, push state) are written under: MODEL_DIR,
    whose .mm/ holds them, or, for a Hugging Face cache snapshot, mm's hf-cache state directory outside hf's cache
    (that directory itself, so a link planted below it, at a repo's or a snapshot's folder, is refused as under
    any target)."""
    own = state_dir(model_dir, MM_DIR)
    return Path(model_dir) if own == Path(model_dir) / MM_DIR else mm_state_home()


def manifest_path(model_dir: Path) -> Path:
    """DIR/.mm/manifest.json; for a Hugging Face cache snapshot, kept outside the cache."""
    return state_dir(model_dir, MM_DIR) / MANIFEST_NAME


PAYLOAD_SUFFIX = ".payload"  # DEST.payload/: what a bundle carried beside the model (mm's wheels, an image, caches)


def payload_dir(model_dir: Path) -> Path:
    """MODEL_DIR.payload/, beside the model directory: where unbundle puts payloads by default."""
    return model_dir.parent / f"{model_dir.name}{PAYLOAD_SUFFIX}"


def store_root_of(revision_dir: Path, repo_id: str) -> Path | None:
    """The model root ROOT when REVISION_DIR is ROOT/<REPO_ID>/<revision dir> (a store's layout), else None."""
    parts = repo_id.split("/")
    here = Path(os.path.abspath(revision_dir))
    if len(here.parts) <= len(parts) + 1 or list(here.parts[-1 - len(parts):-1]) != parts:
        return None
    return here.parents[len(parts)]


def is_pointer(path: Path) -> bool:
    """PATH is a store's `current` pointer (a symlink to a sibling revision directory)."""
    path = Path(path)
    if path.name != POINTER or not path.is_symlink():
        return False
    target = os.readlink(path)
    return "/" not in target and manifest_path(path.parent / target).is_file()
