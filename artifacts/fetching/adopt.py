"""Adopt a directory another tool filled (`hf download`, rsync, a copy): hash every model file and write
its manifest; when the Hub answers, prove each file against its upstream identity first.

Offline (`mm manifest DIR --offline`) this never imports huggingface_hub.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ..errors import BadInput, BadValue, IntegrityError
from ..edges.fsutil import dir_lock, model_files
from ..paths import manifest_path, snapshot_of, state_root
from ..integrity.manifest import FileEntry, Manifest, entry_for_file, public_endpoint, write_manifest
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from ..units import is_commit
from ..integrity.hashing import bounded_map

if TYPE_CHECKING:
    from .download import RemoteFile

@dataclass(frozen=True)
class LocalManifest:
    manifest: Manifest
    manifest_path: str
    checked_upstream: bool
    note: str | None = None


def manifest_for_local_dir(local_dir: Path, repo_id: str, revision: str, *, endpoint: str | None = None,
                           token: str | None = None, offline: bool = False, jobs: int = 2,
                           progress: ProgressSink = NULL_PROGRESS, repo_type: str = "model") -> LocalManifest:
    """Hash every model file locally; when the Hub answers, prove each against its upstream identity."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise BadInput(f"{local_dir}: not a directory")
    remote, commit, note = None, revision, None
    if not offline:
        from .hub import Unreachable, hub_endpoint, list_remote_files, resolve_revision  # the Hub client: online only

        try:
            resolved = resolve_revision(repo_id, revision, endpoint=endpoint, token=token, repo_type=repo_type)
            commit = resolved.commit
            remote = {f.path: f for f in list_remote_files(repo_id, commit, endpoint=endpoint, token=token, repo_type=repo_type)}
        except Unreachable as e:
            note = f"Hub not reachable ({e.message}); files hashed locally without upstream identities"
    if remote is None and not is_commit(commit):
        raise BadValue(f"--revision {revision}: offline, only a full 40-hex commit can be recorded")
    paths = model_files(local_dir)
    if not paths:
        raise BadInput(f"{local_dir}: no files to record")
    _check_links(local_dir, paths)
    progress.begin(sum((local_dir / p).stat().st_size for p in paths), f"hash {local_dir.name}")

    def one(path: str) -> tuple[FileEntry, str | None]:
        upstream = remote[path].upstream if remote and path in remote else None
        with working_on(progress, path):
            result = entry_for_file(local_dir, path, upstream=upstream,
                                    want_git_sha1=bool(upstream and upstream.kind == "git-blob-sha1"))
        progress.advance(result[0].size)
        return result

    with dir_lock(local_dir, "mm manifest"):
        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                hashed = list(bounded_map(pool, one, paths, window=4 * max(1, jobs)))
        finally:
            progress.end()
        if remote is not None:
            _check_against_upstream(local_dir, hashed, remote)
        manifest = Manifest(repo_id=repo_id, revision=commit, files=tuple(e for e, _ in hashed), repo_type=repo_type,
                            requested_revision=revision, endpoint=public_endpoint(hub_endpoint(endpoint)) if remote is not None else None)
        del hashed  # a (entry, git sha1) pair a file
        manifest = manifest.with_files(manifest.files)
        write_manifest(manifest, manifest_path(local_dir), root=state_root(local_dir))
    return LocalManifest(manifest, str(manifest_path(local_dir)), remote is not None, note)


def _check_links(local_dir: Path, paths: list[str]) -> None:
    """In a Hugging Face cache snapshot every link must lead to that repo's blobs/ (the one allowance); a
    link elsewhere is refused before anything is hashed or written."""
    snapshot = snapshot_of(local_dir)
    if snapshot is None:
        return
    for rel in paths:
        full = local_dir / rel
        if full.is_symlink() and not snapshot.allows(os.path.realpath(full)):
            raise BadInput(f"{full}: a symlink in a Hugging Face cache snapshot that does not lead to a file of "
                           f"{snapshot.repo_folder}/blobs/ (it leads to {os.path.realpath(full)}); no manifest written")


def _check_against_upstream(local_dir: Path, hashed: list[tuple[FileEntry, str | None]], remote: Mapping[str, RemoteFile]) -> None:
    wrong = [e.path for e, git in hashed if e.path in remote and not remote[e.path].upstream.matches(e.sha256, git)]
    extra = [e.path for e, _ in hashed if e.path not in remote]
    missing = sorted(set(remote) - {e.path for e, _ in hashed})
    problems = [(wrong, "differ from the Hub"), (missing, "missing locally"), (extra, "not in the revision")]
    parts = [f"{len(paths)} {what} ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})" for paths, what in problems if paths]
    if parts:
        raise IntegrityError(f"{local_dir}: no manifest written: " + "; ".join(parts))
