"""mm fetch: a pinned revision into a directory, every file proven, the manifest written.

The flow: resolve the revision and list its files on the Hub (artifacts/hub.py), or take both from a
source plan (the ModelScope mirror's reconciliation, artifacts/mirror.py); hand the files and their
sources to the download engine (artifacts/download.py); write DIR/.mm/manifest.json from what the
engine proved, under the engine's lock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .download import FileOutcome, RemoteFile, Session, Source, Sources, prepare_dir
from .ranges import DEFAULT_CONNECTIONS
from .errors import BadInput
from .hub import HubSource, Resolved, list_remote_files, resolve_revision, select
from .manifest import Manifest, manifest_path, public_endpoint, write_manifest
from .pins import pin_for_repo
from .progress import NULL_PROGRESS, ProgressSink


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
    """Fetch REQ. PLAN: sources decided beforehand (mirror). REFETCH: only these paths, downloaded again even
    when a good-looking final file exists (repair's scope)."""
    started = time.monotonic()
    local_dir = Path(req.local_dir)
    prepare_dir(local_dir)
    if plan is not None:
        resolved, remote = plan.resolved, list(plan.files)
    else:
        resolved = resolve_revision(req.repo_id, req.revision, endpoint=req.endpoint, token=req.token,
                                    repo_type=req.repo_type)
        remote = list_remote_files(req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token,
                                   repo_type=req.repo_type)
    planned = select(remote, req.include, req.exclude)
    if refetch is not None:
        planned = [f for f in planned if f.path in refetch]
    if not planned:
        raise BadInput(f"{req.repo_id}@{resolved.commit[:12]}: no files match the include/exclude patterns")
    hub = HubSource(req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token, repo_type=req.repo_type)
    sources = Sources(default=hub, by_path=plan.by_path if plan else {},
                      fallback=hub if plan is None or plan.hub_fallback else None, fallback_name="the Hub")

    with Session(local_dir, "mm fetch") as session:
        results = session.run(planned, sources, refetch=refetch is not None, workers=req.workers,
                              connections=req.connections, progress=progress,
                              label=f"fetch {req.repo_id}@{resolved.commit[:12]}")
        # Entries proven earlier stay when the revision has the same content at that path, even if the file
        # is gone now: the manifest records the revision, so a missing file stays expected (verify names it).
        by_path = {f.path: f for f in remote}
        entries = {p: e for p, e in session.known.items() if p in by_path and e.upstream == by_path[p].upstream}
        entries.update({e.path: e for _, e in results if e is not None})
        manifest = Manifest(repo_id=req.repo_id, revision=resolved.commit, files=(), repo_type=req.repo_type,
                            requested_revision=resolved.requested, endpoint=public_endpoint(hub.endpoint))
        write_manifest(manifest.with_files(list(entries.values())), manifest_path(local_dir))
        session.finished()

    outcomes = tuple(o for o, _ in results)
    return FetchResult(
        repo_id=req.repo_id, requested_revision=resolved.requested, commit=resolved.commit,
        revision_kind=resolved.kind, local_dir=str(local_dir), manifest_path=str(manifest_path(local_dir)),
        files=outcomes, bytes_transferred=sum(o.bytes_transferred for o in outcomes),
        seconds=time.monotonic() - started, draft=_draft_status(req.repo_id, entries), transfer=session.transfer,
    )


def _draft_status(repo_id: str, entries: Mapping[str, object]) -> DraftStatus | None:
    """Whether the pin's draft model (its draft.subfolder) has a safetensors file; None without one."""
    pin = pin_for_repo(repo_id)
    if pin is None or not pin.draft_subfolder:
        return None
    folder = pin.draft_subfolder.rstrip("/") + "/"
    return DraftStatus(folder, any(p.startswith(folder) and p.endswith(".safetensors") for p in entries))
