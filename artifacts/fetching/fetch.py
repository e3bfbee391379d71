"""mm fetch: a pinned revision into a directory, every file proven, the manifest written.

The flow: resolve the revision and list its files on the Hub (artifacts/fetching/hub.py), or take both from a
source plan (the ModelScope mirror's reconciliation, artifacts/fetching/mirror.py); hand the files and their
sources to the download engine (artifacts/fetching/download.py); write DIR/.mm/manifest.json from what the
engine proved, under the engine's lock.

`--from BASE_DIR` (base_candidates): a file whose upstream identity and size are a file's of another revision's
directory on this host (by its manifest; without one, as in a Hugging Face cache snapshot, the file at the same path
with the same size) is adopted from there instead of downloaded (download.Session.adopt: reflinked where the file
system clones, else copied, hashed, checked against the pin's identity, named only then; a base file whose bytes
are not the pinned ones is downloaded instead).
"""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

from .download import JOURNAL, PARTIAL_DIR, FileOutcome, RemoteFile, Session, Source, Sources, same_size
from ..errors import BadInput, RemoteError
from ..paths import MM_DIR, state_root
from ..edges.fsutil import check_model_path, read_lock, unlink_file
from ..paths import Snapshot, snapshot_of
from .ranges import DEFAULT_CONNECTIONS
from ..edges import wire
from ..integrity.manifest import (FileEntry, Manifest, Partial, expected_entry, public_endpoint, read_manifest,
                                  write_manifest)
from ..paths import manifest_path
from ..pins import pin_for_repo
from ..edges.progress import NULL_PROGRESS, ProgressSink

if TYPE_CHECKING:
    from .hub import Resolved


@dataclass(frozen=True)
class FetchRequest:
    """What to fetch and where: the repo, revision and file patterns, the directory, the Hub to ask."""

    repo_id: str
    revision: str
    local_dir: Path
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    workers: int | None = None  # files at once; default: up to `connections`
    connections: int = DEFAULT_CONNECTIONS  # connections at once, over all files (ranges of one file, or many files)
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    repo_type: str = "model"
    base_dir: Path | None = None  # another revision's directory here: content it has is read from it (--from)


@dataclass(frozen=True)
class SourcePlan:
    """Decided before fetch by another source (the mirror): the pin's resolved commit and listing, and
    which files come from which source. The rest come from the Hub; with HUB_FALLBACK a file a source
    serves wrong is taken from the Hub too."""

    resolved: Resolved
    files: tuple[RemoteFile, ...]
    by_path: Mapping[str, Source] = field(default_factory=dict)
    hub_fallback: bool = True


@dataclass(frozen=True)
class DraftStatus:
    subfolder: str  # the pin's draft.subfolder, e.g. "dspark/"
    present: bool


@dataclass(frozen=True)
class FetchResult:
    repo_id: str
    requested_revision: str
    commit: str
    revision_kind: str
    local_dir: str
    manifest_path: str
    files: tuple[FileOutcome, ...]
    bytes_transferred: int
    seconds: float
    draft: DraftStatus | None  # None: the pin names no draft (or there is no pin)
    transfer: dict = field(default_factory=dict)  # connections (budget, most used), requests, retries by reason

    @property
    def failed(self) -> list[FileOutcome]:
        return [f for f in self.files if f.status == "failed"]


def fetch(req: FetchRequest, progress: ProgressSink = NULL_PROGRESS, *, plan: SourcePlan | None = None,
          refetch: frozenset[str] | None = None) -> FetchResult:
    """_fetch, with the reader's lock of the revision it takes files from (--from) held throughout
    (fsutil.read_lock: `mm gc` keeps it)."""
    with read_lock(Path(req.base_dir), "mm fetch --from") if req.base_dir is not None else nullcontext():
        return _fetch(req, progress, plan=plan, refetch=refetch)


def _fetch(req: FetchRequest, progress: ProgressSink = NULL_PROGRESS, *, plan: SourcePlan | None = None,
           refetch: frozenset[str] | None = None) -> FetchResult:
    """Fetch REQ. PLAN: sources decided beforehand (mirror). REFETCH: only these paths, downloaded again even
    when a good-looking final file exists (repair's scope)."""
    started = time.monotonic()
    wire.warm_tls()  # the CA bundle loads on the other core while the Hub client (huggingface_hub) is imported
    from .hub import HubSource, list_remote_files, resolve_revision, select

    gc.freeze()  # what is loaded by now (the Hub client, the engine) lives until exit: no collection walks it again,
    # neither the full ones a long fetch triggers nor the one at exit (30 ms of a fetch's CPU and wall)
    local_dir = Path(req.local_dir)
    if local_dir.exists() and not local_dir.is_dir():
        raise BadInput(f"{local_dir}: exists and is not a directory")
    if plan is not None:
        resolved, remote = plan.resolved, list(plan.files)
    else:
        resolved = resolve_revision(req.repo_id, req.revision, endpoint=req.endpoint, token=req.token,
                                    repo_type=req.repo_type)
        remote = list_remote_files(req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token,
                                   repo_type=req.repo_type)
    planned = select(remote, req.include, req.exclude)
    for f in planned:  # mm's own state lives in DIR/.mm/: a repo file there would be written over it
        check_model_path(f.path, f"{req.repo_id}@{resolved.commit[:12]} (exclude it with --exclude '.mm/*')")
    unlisted: list[FileOutcome] = []
    if refetch is not None:
        listed = {f.path for f in remote}
        unlisted = [FileOutcome(p, 0, "failed", "hub", error=f"the Hub no longer lists it at {resolved.commit[:12]}; "
                                                             f"it cannot be re-fetched", error_kind=RemoteError)
                    for p in sorted(refetch - listed)]
        planned = [f for f in planned if f.path in refetch]
    if not planned and not unlisted:
        raise BadInput(f"{req.repo_id}@{resolved.commit[:12]}: no files match the include/exclude patterns")
    hub = HubSource(req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token, repo_type=req.repo_type)
    from_base = base_candidates(req.base_dir, planned, local_dir) if req.base_dir is not None else {}
    sources = Sources(default=hub, by_path=plan.by_path if plan else {},
                      fallback=hub if plan is None or plan.hub_fallback else None, fallback_name="the Hub")

    with _new_state_dir(local_dir), Session(local_dir, "mm fetch") as session:
        results = session.run(planned, sources, refetch=refetch is not None, workers=req.workers,
                              connections=req.connections, progress=progress,
                              label=f"fetch {req.repo_id}@{resolved.commit[:12]}", candidates=from_base)
        entries = _manifest_entries(local_dir, refetch, remote, planned, session.known,
                                    [e for _, e in results if e is not None])
        manifest = Manifest(repo_id=req.repo_id, revision=resolved.commit, files=(), repo_type=req.repo_type,
                            requested_revision=resolved.requested, endpoint=public_endpoint(hub.endpoint),
                            partial=_partial(local_dir, req, refetch, remote, entries))
        write_manifest(manifest.with_files(list(entries.values())), manifest_path(local_dir), root=state_root(local_dir))
        session.finished()
        if refetch is None and not unlisted:  # repair re-verifies and stamps on its own terms
            _stamp_if_proven(local_dir, [o for o, _ in results], entries)

    outcomes = tuple(o for o, _ in results) + tuple(unlisted)
    return FetchResult(
        repo_id=req.repo_id, requested_revision=resolved.requested, commit=resolved.commit,
        revision_kind=resolved.kind, local_dir=str(local_dir), manifest_path=str(manifest_path(local_dir)),
        files=outcomes, bytes_transferred=sum(o.bytes_transferred for o in outcomes),
        seconds=time.monotonic() - started, draft=_draft_status(req.repo_id, entries), transfer=session.transfer,
    )


def _manifest_entries(local_dir: Path, refetch: frozenset[str] | None, remote: list[RemoteFile],
                      planned: list[RemoteFile], known: Mapping[str, FileEntry],
                      proven: list[FileEntry]) -> dict[str, FileEntry]:
    """What the manifest records: the revision as selected, not what happened to arrive.

    Every planned file has an entry: proven now, proven earlier with the same content (even if the file is
    gone now: verify names it missing), or, for a file that could not be fetched, its size and upstream
    identity only (unproven), so verify, bundle and launch see it as missing. A repair (REFETCH) starts
    from the manifest it repairs and never drops an entry of it.
    """
    by_path = {f.path: f for f in remote}
    if refetch is not None and manifest_path(local_dir).is_file():
        entries = {e.path: e for e in read_manifest(manifest_path(local_dir)).files}
    else:
        entries = {p: e for p, e in known.items() if p in by_path and e.upstream == by_path[p].upstream}
    entries.update({e.path: e for e in proven})
    for f in planned:
        if f.path not in entries:
            entries[f.path] = expected_entry(f.path, f.size, f.upstream)
    return entries


def base_candidates(base_dir: Path, files: list[RemoteFile], local_dir: Path) -> dict[str, Path]:
    """{path: BASE_DIR's file} for each file of FILES that a file of BASE_DIR may be: candidates the engine adopts
    (download.Session.adopt: cloned or copied in, hashed in one read, kept only when they match the pin's upstream
    identity, else downloaded). With a manifest in BASE_DIR, a candidate has the file's identity and size there (the
    LFS sha256, or the git blob sha1 of a small file), the same path preferred; without one, or for a file it gives no
    identity for (a Hugging Face cache snapshot, a manifest written offline), the file at the same path with the
    same size. Only regular files inside BASE_DIR (no symlink on the way) are named; in a cache snapshot, the blob
    a link resolves to in its own repo."""
    base_dir = Path(base_dir)
    if not base_dir.is_dir():
        raise BadInput(f"--from {base_dir}: not a directory")
    if os.path.realpath(base_dir) == os.path.realpath(local_dir):
        raise BadInput(f"--from {base_dir}: is the target directory itself")
    by_identity = _base_identities(base_dir)
    snap = snapshot_of(base_dir)
    root = os.path.realpath(base_dir)
    found = {}
    for f in files:
        same = by_identity.get((f.upstream.kind, f.upstream.value, f.size), []) if by_identity else []
        paths = sorted(same, key=lambda p: p != f.path) or [f.path]  # else the same path: adopt still checks it
        for candidate in paths:
            full = _base_file(base_dir, root, snap, candidate)
            if full is not None and same_size(full, f.size):
                found[f.path] = full
                break
    return found


def _base_identities(base_dir: Path) -> dict[tuple[str, str, int], list[str]] | None:
    """(identity kind, value, size) -> paths, from BASE_DIR's manifest; None when it has none."""
    if not manifest_path(base_dir).is_file():
        return None
    by_identity: dict[tuple[str, str, int], list[str]] = {}
    for e in read_manifest(manifest_path(base_dir)).files:
        if e.sha256:
            by_identity.setdefault(("lfs-sha256", e.sha256, e.size), []).append(e.path)
        if e.upstream is not None and e.upstream.kind == "git-blob-sha1":
            by_identity.setdefault((e.upstream.kind, e.upstream.value, e.size), []).append(e.path)
    return by_identity


def _base_file(base_dir: Path, root: str, snap: Snapshot | None, path: str) -> Path | None:
    """BASE_DIR/PATH when it is a file inside BASE_DIR reached through no link; in a cache snapshot, the blob its
    link resolves to (paths.Snapshot.allows); else None."""
    full = base_dir / path
    real = os.path.realpath(full)
    if real == os.path.join(root, *path.split("/")):
        return full
    return Path(real) if snap is not None and snap.allows(real) else None


def _stamp_if_proven(local_dir: Path, outcomes: list[FileOutcome], entries: dict) -> None:
    """Every file of the manifest proven against the pin (hashed as it arrived or was adopted, or proven by an
    earlier run and unchanged since, as unbundle counts it): `mm ls` then says so ("verified by mm fetch")."""
    from ..integrity.stamps import record_verified

    if outcomes and not any(o.status == "failed" for o in outcomes):
        record_verified(local_dir, True, len(entries), sum(e.size for e in entries.values()), 0, "mm fetch")


def _partial(local_dir: Path, req: FetchRequest, refetch: frozenset[str] | None, remote: list[RemoteFile],
             entries: Mapping[str, FileEntry]) -> Partial | None:
    """What the manifest says was asked for: None when it holds the whole revision, else the patterns (a
    repair keeps the ones of the fetch it repairs) and the revision's files they left out."""
    left_out = tuple(sorted({f.path for f in remote} - set(entries)))
    if not left_out:
        return None
    include, exclude = req.include, req.exclude
    if refetch is not None and manifest_path(local_dir).is_file():
        earlier = read_manifest(manifest_path(local_dir)).partial
        include, exclude = (earlier.include, earlier.exclude) if earlier else (include, exclude)
    return Partial(include=tuple(include), exclude=tuple(exclude), left_out=left_out)


@contextmanager
def _new_state_dir(local_dir: Path) -> Iterator[None]:
    """A run that fails before anything was kept leaves no empty .mm/ (nor an empty LOCAL_DIR it created).
    An interrupted run leaves everything: its journal names files proven (and published) before the stop."""
    created_dir = not local_dir.exists()
    created_state = not (local_dir / MM_DIR).exists()
    try:
        yield
    except BaseException as e:
        if created_state and not isinstance(e, KeyboardInterrupt):
            with suppress(OSError):
                partial = local_dir / PARTIAL_DIR
                journal = local_dir / JOURNAL
                if (partial.is_dir() and not any(partial.iterdir())
                        and (not journal.exists() or journal.stat().st_size == 0)):
                    partial.rmdir()
                    for leftover in ("lock", "journal.jsonl"):
                        unlink_file(local_dir, local_dir / MM_DIR / leftover)
                    (local_dir / MM_DIR).rmdir()
                    if created_dir:
                        local_dir.rmdir()
        raise


def _draft_status(repo_id: str, entries: Mapping[str, FileEntry]) -> DraftStatus | None:
    """Whether the pin's draft model (its draft.subfolder) has a safetensors file; None without one."""
    pin = pin_for_repo(repo_id)
    if pin is None or not pin.draft_subfolder:
        return None
    folder = pin.draft_subfolder.rstrip("/") + "/"
    return DraftStatus(folder, any(p.startswith(folder) and p.endswith(".safetensors") and e.proven
                                   for p, e in entries.items()))
