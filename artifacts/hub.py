"""Hugging Face Hub: resolve a revision to its commit, list files with upstream identities, fetch.

huggingface_hub does the talking (HfApi for the API, its shared HTTP session, headers, token and error
mapping). mm owns what the client lacks: resume across runs (partial files kept in DIR/.mm/partial and
continued with HTTP Range), hashing every byte in the pass that writes it (blake3, sha256, git sha1),
checking each file against the Hub's LFS sha256 / git blob sha1 before it gets its final name, and the
manifest.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ContextManager, Iterator, Mapping, Protocol, Sequence

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, hf_raise_for_status, http_stream_backoff

from .errors import BadInput, IntegrityError, MMError, RemoteError
from .fsutil import MM_DIR, check_relpath, dir_lock, payload_files, publish, require_free_space
from .hashing import Digests, StreamHasher
from .manifest import (FileEntry, Manifest, Upstream, entry_for_file, entry_from_dict, manifest_path, public_endpoint,
                       read_manifest, write_manifest)
from .progress import NULL_PROGRESS, ProgressSink

CHUNK = 8 * 1024 * 1024
WRITE_BATCH = 1024 * 1024
HEX = re.compile(r"^[0-9a-f]+$")
PARTIAL_DIR = f"{MM_DIR}/partial"
JOURNAL = f"{MM_DIR}/journal.jsonl"
CUT_RETRIES = 5  # a connection cut mid-file is resumed in-process this many times before giving up


# --- what the Hub says -----------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    repo_id: str
    requested: str
    commit: str
    kind: str  # "commit" | "short-commit" | "branch" | "tag"


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None = None

    @property
    def upstream(self) -> Upstream:
        if self.lfs_sha256:
            return Upstream(kind="lfs-sha256", value=self.lfs_sha256)
        return Upstream(kind="git-blob-sha1", value=self.blob_id)


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


class Unreachable(RemoteError):
    """No answer from the Hub at all (connection refused, DNS, offline mode), as opposed to a refusal."""


@contextmanager
def hub_errors(repo_id: str, revision: str | None = None) -> Iterator[None]:
    """Turn the client's exceptions into one-line RemoteErrors (no URL query strings, no token)."""
    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        yield
    except RevisionNotFoundError:
        raise RemoteError(f"{at}: revision not found on the Hub") from None
    except GatedRepoError:
        raise RemoteError(f"{repo_id}: gated repository; accept its terms on the Hub and use a token (HF_TOKEN or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise RemoteError(f"{repo_id}: repository not found on the Hub, or private and the token is missing or refused") from None
    except EntryNotFoundError as e:
        raise RemoteError(f"{at}: file not found on the Hub ({_first_line(e)})") from None
    except OfflineModeIsEnabled:
        raise Unreachable(f"{at}: HF_HUB_OFFLINE is set; the Hub cannot be reached in offline mode") from None
    except HfHubHTTPError as e:
        raise RemoteError(f"{at}: Hub request failed: {_first_line(e)}") from None
    except httpx2.HTTPError as e:
        raise Unreachable(f"{at}: cannot reach the Hub at {public_endpoint(hub_endpoint())}: {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _api(endpoint: str | None, token: str | None) -> HfApi:
    # token=None lets huggingface_hub take HF_TOKEN or the stored login; mm never reads or keeps it.
    return HfApi(endpoint=hub_endpoint(endpoint), token=token, library_name="mm")


def resolve_revision(repo_id: str, revision: str, *, endpoint: str | None = None, token: str | None = None,
                     repo_type: str = "model") -> Resolved:
    """Resolve a full sha, short sha, branch or tag to the full 40-hex commit, once."""
    api = _api(endpoint, token)
    rev = revision.strip()
    if not rev:
        raise BadInput("--revision: empty revision")
    with hub_errors(repo_id, rev):
        refs = api.list_repo_refs(repo_id, repo_type=repo_type)
        for kind, group in (("branch", refs.branches), ("tag", refs.tags)):
            for ref in group:
                if rev in (ref.name, ref.ref):
                    return Resolved(repo_id, rev, ref.target_commit, kind)
        if HEX.match(rev) and len(rev) == 40:
            info = api.repo_info(repo_id, revision=rev, repo_type=repo_type)
            return Resolved(repo_id, rev, info.sha, "commit")
        if HEX.match(rev) and len(rev) >= 4:
            return Resolved(repo_id, rev, _unique_commit(api, repo_id, rev, refs, repo_type), "short-commit")
    raise RemoteError(f"{repo_id}@{rev}: unknown revision (not a branch, tag or commit of this repository)")


def _unique_commit(api: HfApi, repo_id: str, prefix: str, refs, repo_type: str) -> str:
    """Match a short sha against every commit reachable from a branch or tag; refuse ambiguity."""
    seen: set[str] = set()
    for ref in [*refs.branches, *refs.tags]:
        seen.update(c.commit_id for c in api.list_repo_commits(repo_id, revision=ref.target_commit, repo_type=repo_type))
    matches = sorted(c for c in seen if c.startswith(prefix))
    if len(matches) > 1:
        shown = ", ".join(m[:12] for m in matches[:5])
        raise RemoteError(f"{repo_id}@{prefix}: ambiguous short revision, matches {len(matches)} commits ({shown}); give more hex digits")
    if matches:
        return matches[0]
    # Not reachable from a branch or tag (e.g. a PR commit): let the Hub resolve it, and check it did.
    info = api.repo_info(repo_id, revision=prefix, repo_type=repo_type)
    if not info.sha or not info.sha.startswith(prefix):
        raise RemoteError(f"{repo_id}@{prefix}: unknown revision")
    return info.sha


def list_remote_files(repo_id: str, commit: str, *, endpoint: str | None = None, token: str | None = None,
                      repo_type: str = "model") -> list[RemoteFile]:
    """Every file of the commit with its size and upstream identity, sorted by path."""
    api = _api(endpoint, token)
    with hub_errors(repo_id, commit):
        entries = [e for e in api.list_repo_tree(repo_id, revision=commit, recursive=True, repo_type=repo_type)
                   if isinstance(e, RepoFile)]
    files = []
    for e in entries:
        check_relpath(e.path, f"{repo_id}@{commit[:12]} listing")
        files.append(RemoteFile(path=e.path, size=int(e.size), blob_id=e.blob_id,
                                lfs_sha256=e.lfs.sha256 if e.lfs else None))
    return sorted(files, key=lambda f: f.path)


def select(files: Sequence[RemoteFile], include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[RemoteFile]:
    return list(filter_repo_objects(files, allow_patterns=list(include) or None,
                                    ignore_patterns=list(exclude) or None, key=lambda f: f.path))


# --- where bytes come from ---------------------------------------------------------------------

class FileSource(Protocol):
    label: str  # recorded as the manifest entry's "source"

    def stream(self, path: str, offset: int) -> ContextManager[tuple[int, Iterator[bytes]]]:
        """Open PATH at OFFSET; yield (start, chunks), start being the offset actually honoured."""


class HubSource:
    def __init__(self, repo_id: str, commit: str, *, endpoint: str | None = None, token: str | None = None,
                 repo_type: str = "model"):
        self.repo_id, self.commit, self.repo_type = repo_id, commit, repo_type
        self.endpoint = hub_endpoint(endpoint)
        self._headers = build_hf_headers(token=token, library_name="mm")
        self.label = "hub"

    @contextmanager
    def stream(self, path: str, offset: int) -> Iterator[tuple[int, Iterator[bytes]]]:
        url = hf_hub_url(self.repo_id, path, revision=self.commit, repo_type=self.repo_type, endpoint=self.endpoint)
        headers = dict(self._headers)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        with hub_errors(self.repo_id, self.commit[:12]):
            with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     retry_on_status_codes=(408, 429, 500, 502, 503, 504)) as response:
                hf_raise_for_status(response)
                # iter_bytes() without a size hands over bytes as they arrive: nothing buffered is lost on a cut.
                yield content_start(response.status_code, response.headers.get("Content-Range")), response.iter_bytes()


def content_start(status: int, content_range: str | None) -> int:
    """The byte offset a response body starts at: 0 for a 200, the range start for a 206."""
    if status == 206 and content_range:
        m = re.match(r"bytes (\d+)-", content_range)
        if m:
            return int(m.group(1))
    return 0


# --- fetch -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FetchRequest:
    repo_id: str
    revision: str
    local_dir: Path
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    workers: int = 4
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    repo_type: str = "model"
    only_paths: frozenset[str] | None = None  # restrict to these (repair)
    refetch: bool = False  # download only_paths even if a good-looking final file exists (repair)
    sources: Mapping[str, FileSource] = field(default_factory=dict)  # per-path byte sources (mirror)
    hub_fallback: bool = True  # a file another source served wrong is taken from the Hub instead
    remote_files: tuple[RemoteFile, ...] | None = None  # already listed (mirror reconciliation)
    resolved: Resolved | None = None


@dataclass(frozen=True)
class FileOutcome:
    path: str
    size: int
    status: str  # "downloaded" | "present" | "failed"
    source: str
    bytes_transferred: int = 0
    resumed_from: int = 0
    error: str | None = None
    exit_code: int = 0
    note: str | None = None


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
    draft_present: bool
    draft_subfolder: str

    @property
    def failed(self) -> list[FileOutcome]:
        return [f for f in self.files if f.status == "failed"]


def fetch(req: FetchRequest, progress: ProgressSink = NULL_PROGRESS, draft_subfolder: str = "dspark/") -> FetchResult:
    started = time.monotonic()
    local_dir = Path(req.local_dir)
    _prepare_dir(local_dir)
    resolved = req.resolved or resolve_revision(req.repo_id, req.revision, endpoint=req.endpoint, token=req.token,
                                                repo_type=req.repo_type)
    remote = list(req.remote_files) if req.remote_files is not None else list_remote_files(
        req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token, repo_type=req.repo_type)
    planned = select(remote, req.include, req.exclude)
    if req.only_paths is not None:
        planned = [f for f in planned if f.path in req.only_paths]
    if not planned:
        raise BadInput(f"{req.repo_id}@{resolved.commit[:12]}: no files match the include/exclude patterns")
    hub = HubSource(req.repo_id, resolved.commit, endpoint=req.endpoint, token=req.token, repo_type=req.repo_type)

    with dir_lock(local_dir, "mm fetch"):
        known = _known_entries(local_dir)
        _clean_stale_partials(local_dir, planned)
        _check_free_space(local_dir, planned, known, req)
        progress.begin(sum(f.size for f in planned), f"fetch {req.repo_id}@{resolved.commit[:12]}")
        journal = _Journal(local_dir / JOURNAL)

        def one(f: RemoteFile) -> tuple[FileOutcome, FileEntry | None]:
            source = req.sources.get(f.path, hub)
            return _fetch_file(local_dir, f, source, hub, known, req, progress, journal)

        try:
            with ThreadPoolExecutor(max_workers=max(1, req.workers)) as pool:
                results = list(pool.map(one, planned))
        finally:
            progress.end()
        # Entries proven earlier stay when the revision has the same content at that path, even if the file
        # is gone now: the manifest records the revision, so a missing file stays expected (verify names it).
        by_path = {f.path: f for f in remote}
        entries = {p: e for p, e in known.items() if p in by_path and e.upstream == by_path[p].upstream}
        entries.update({e.path: e for _, e in results if e is not None})
        manifest = Manifest(repo_id=req.repo_id, revision=resolved.commit, files=(), repo_type=req.repo_type,
                            requested_revision=resolved.requested, endpoint=public_endpoint(hub.endpoint))
        write_manifest(manifest.with_files(list(entries.values())), manifest_path(local_dir))
        journal.clear()

    outcomes = tuple(o for o, _ in results)
    draft = draft_subfolder.rstrip("/") + "/"
    return FetchResult(
        repo_id=req.repo_id, requested_revision=resolved.requested, commit=resolved.commit,
        revision_kind=resolved.kind, local_dir=str(local_dir), manifest_path=str(manifest_path(local_dir)),
        files=outcomes, bytes_transferred=sum(o.bytes_transferred for o in outcomes),
        seconds=time.monotonic() - started,
        draft_present=any(p.startswith(draft) and p.endswith(".safetensors") for p in entries),
        draft_subfolder=draft,
    )


def _prepare_dir(local_dir: Path) -> None:
    if local_dir.exists() and not local_dir.is_dir():
        raise BadInput(f"{local_dir}: exists and is not a directory")
    try:
        (local_dir / PARTIAL_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{local_dir}: cannot create the download directory: {e.strerror}") from None


def _known_entries(local_dir: Path) -> dict[str, FileEntry]:
    """Entries proven earlier: the manifest (of any revision), plus the journal of a run that was killed.

    They are trusted only where the upstream identity (a content hash) and size match the listing, so a
    new revision re-downloads only the files whose content changed.
    """
    entries: dict[str, FileEntry] = {}
    mpath = manifest_path(local_dir)
    if mpath.exists():
        try:
            entries.update(read_manifest(mpath).by_path())
        except BadInput:
            pass  # a damaged manifest is rewritten from what this run proves
    entries.update(_Journal(local_dir / JOURNAL).entries())
    return entries


def _check_free_space(local_dir: Path, planned: Sequence[RemoteFile], known: Mapping[str, FileEntry],
                      req: FetchRequest) -> None:
    """Refuse up front rather than fail hours later with a full disk."""
    needed = 0
    for f in planned:
        if _is_present(local_dir, f, known) and not (req.refetch and req.only_paths is not None):
            continue
        partial = _partial_path(local_dir, f)
        needed += f.size - (partial.stat().st_size if partial.exists() else 0)
    require_free_space([(local_dir, needed)], "the download")


def _partial_path(local_dir: Path, f: RemoteFile) -> Path:
    # Keyed by the upstream identity, so a partial file can never be continued with another revision's bytes.
    return local_dir / PARTIAL_DIR / f"{f.upstream.value}.part"


def _clean_stale_partials(local_dir: Path, planned: Sequence[RemoteFile]) -> None:
    keep = {_partial_path(local_dir, f).name for f in planned}
    for p in (local_dir / PARTIAL_DIR).iterdir():
        if p.name not in keep:
            p.unlink(missing_ok=True)


def _is_present(local_dir: Path, f: RemoteFile, known: Mapping[str, FileEntry]) -> FileEntry | None:
    entry = known.get(f.path)
    final = local_dir / f.path
    if entry and entry.upstream == f.upstream and entry.size == f.size and final.is_file() and final.stat().st_size == f.size:
        return entry
    return None


def _fetch_file(local_dir: Path, f: RemoteFile, source: FileSource, hub: FileSource, known: Mapping[str, FileEntry],
                req: FetchRequest, progress: ProgressSink, journal: "_Journal") -> tuple[FileOutcome, FileEntry | None]:
    if not (req.refetch and req.only_paths is not None):
        entry = _is_present(local_dir, f, known)
        if entry is not None:
            progress.advance(f.size)
            return FileOutcome(f.path, f.size, "present", entry.source), entry
    try:
        return _fetch_from(local_dir, f, source, progress, journal)
    except IntegrityError as e:
        if source is hub or not req.hub_fallback:
            return _failed(f, source, e)
        rejected = f"{source.label} served bytes that do not match the pin; taken from the Hub instead"
    except (RemoteError, BadInput) as e:
        return _failed(f, source, e)
    try:
        outcome, entry = _fetch_from(local_dir, f, hub, progress, journal)
        return replace(outcome, note=rejected), entry
    except (IntegrityError, RemoteError, BadInput) as e:
        return _failed(f, hub, e)


def _fetch_from(local_dir: Path, f: RemoteFile, source: FileSource, progress: ProgressSink,
                journal: "_Journal") -> tuple[FileOutcome, FileEntry]:
    digests, transferred, resumed = _download(local_dir, f, source, progress)
    entry = FileEntry(path=f.path, size=digests.size, blake3=digests.blake3, sha256=digests.sha256 or "",
                      upstream=f.upstream, source=source.label)
    journal.append(entry)
    return FileOutcome(f.path, f.size, "downloaded", source.label, transferred, resumed), entry


def _failed(f: RemoteFile, source: FileSource, e: MMError) -> tuple[FileOutcome, None]:
    return FileOutcome(f.path, f.size, "failed", source.label, error=e.message, exit_code=e.exit_code), None


class TransferCut(RemoteError):
    """The connection broke mid-body; what arrived is on disk and the transfer can continue."""


@dataclass
class _Transfer:
    out: object  # the open partial file
    hasher: StreamHasher
    received: int = 0


def _new_hasher(f: RemoteFile) -> StreamHasher:
    return StreamHasher(sha256=True, git_size=None if f.lfs_sha256 else f.size)


def _download(local_dir: Path, f: RemoteFile, source: FileSource, progress: ProgressSink) -> tuple[Digests, int, int]:
    """Continue (or start) the partial file, hash in the same pass, check identity, publish."""
    partial = _partial_path(local_dir, f)
    have = partial.stat().st_size if partial.exists() else 0
    if have > f.size:
        partial.unlink()
        have = 0
    with open(partial, "ab") as out:
        t = _Transfer(out, _new_hasher(f))
        if have:
            _hash_existing(partial, have, t.hasher)
            progress.advance(have)
        stalls = 0
        while t.hasher.size < f.size:
            before = t.hasher.size
            try:
                _receive(source, f, t, progress)
            except TransferCut:
                pass
            if t.hasher.size == before:
                stalls += 1
                if stalls > CUT_RETRIES:
                    raise RemoteError(f"{f.path}: transfer from {source.label} keeps breaking at byte {before} of {f.size}; run again to resume")
        out.flush()
        os.fsync(out.fileno())
    digests = t.hasher.digests()
    if digests.size != f.size or not f.upstream.matches(digests.sha256, digests.git_sha1):
        partial.unlink(missing_ok=True)
        got = digests.sha256 if f.lfs_sha256 else digests.git_sha1
        raise IntegrityError(f"{f.path}: bytes from {source.label} do not match the pinned revision "
                             f"({f.upstream.kind} expected {f.upstream.value[:16]}, got {str(got)[:16]}); not kept")
    publish(partial, local_dir / f.path)
    return digests, t.received, have


def _receive(source: FileSource, f: RemoteFile, t: _Transfer, progress: ProgressSink) -> None:
    """Append one response's body to the partial file, hashing as it goes.

    Network reads are small (tens of KiB); they are gathered into WRITE_BATCH before the write and the
    hash updates, which costs far less per byte. The batch is always flushed, even when the connection
    breaks, so every byte that arrived is kept for the next attempt.
    """
    with source.stream(f.path, t.hasher.size) as (start, chunks):
        if start != t.hasher.size:  # the server ignored Range: start over
            t.out.seek(0)
            t.out.truncate()
            progress.advance(-t.hasher.size)
            t.hasher = _new_hasher(f)
        batch = bytearray()
        try:
            for chunk in chunks:
                if t.hasher.size + len(batch) + len(chunk) > f.size:
                    raise IntegrityError(f"{f.path}: {source.label} sent more than the listed {f.size} bytes; not kept")
                batch += chunk
                if len(batch) >= WRITE_BATCH:
                    _append(t, batch, progress)
                    batch = bytearray()
        except httpx2.TransportError as e:
            raise TransferCut(f"{f.path}: transfer cut ({type(e).__name__}) after {t.hasher.size + len(batch)} bytes") from None
        finally:
            if batch and t.hasher.size + len(batch) <= f.size:
                _append(t, batch, progress)


def _append(t: _Transfer, data: bytearray, progress: ProgressSink) -> None:
    t.out.write(data)
    t.hasher.update(data)
    t.received += len(data)
    progress.advance(len(data))


def _hash_existing(partial: Path, length: int, hasher: StreamHasher) -> None:
    with open(partial, "rb") as src:
        while length:
            chunk = src.read(min(CHUNK, length))
            if not chunk:
                break
            hasher.update(chunk)
            length -= len(chunk)


class _Journal:
    """Append-only record of files proven during a run, so a killed fetch does not re-hash them."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def append(self, entry: FileEntry) -> None:
        line = json.dumps(asdict(entry)) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> dict[str, FileEntry]:
        out: dict[str, FileEntry] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = entry_from_dict(json.loads(line))
                out[entry.path] = entry
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill is simply not trusted
        return out

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


# --- a manifest for a directory another tool filled ----------------------------------------------

@dataclass(frozen=True)
class LocalManifest:
    manifest: Manifest
    manifest_path: str
    checked_upstream: bool
    note: str | None = None


def manifest_for_local_dir(local_dir: Path, repo_id: str, revision: str, *, endpoint: str | None = None,
                           token: str | None = None, offline: bool = False, jobs: int = 2,
                           progress: ProgressSink = NULL_PROGRESS, repo_type: str = "model") -> LocalManifest:
    """Hash every payload file locally; when the Hub answers, prove each against its upstream identity."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise BadInput(f"{local_dir}: not a directory")
    remote, commit, note = None, revision, None
    if not offline:
        try:
            resolved = resolve_revision(repo_id, revision, endpoint=endpoint, token=token, repo_type=repo_type)
            commit = resolved.commit
            remote = {f.path: f for f in list_remote_files(repo_id, commit, endpoint=endpoint, token=token, repo_type=repo_type)}
        except Unreachable as e:
            note = f"Hub not reachable ({e.message}); files hashed locally without upstream identities"
    if remote is None and not (HEX.match(commit) and len(commit) == 40):
        raise BadInput(f"--revision {revision}: offline, only a full 40-hex commit can be recorded")
    paths = payload_files(local_dir)
    if not paths:
        raise BadInput(f"{local_dir}: no files to record")
    progress.begin(sum((local_dir / p).stat().st_size for p in paths), f"hash {local_dir.name}")

    def one(path: str) -> tuple[FileEntry, str | None]:
        upstream = remote[path].upstream if remote and path in remote else None
        result = entry_for_file(local_dir, path, upstream=upstream, want_git_sha1=bool(upstream and upstream.kind == "git-blob-sha1"))
        progress.advance(result[0].size)
        return result

    with dir_lock(local_dir, "mm manifest"):
        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                hashed = list(pool.map(one, paths))
        finally:
            progress.end()
        if remote is not None:
            _check_against_upstream(local_dir, hashed, remote)
        manifest = Manifest(repo_id=repo_id, revision=commit, files=tuple(e for e, _ in hashed), repo_type=repo_type,
                            requested_revision=revision, endpoint=public_endpoint(hub_endpoint(endpoint)) if remote else None)
        manifest = manifest.with_files(manifest.files)
        write_manifest(manifest, manifest_path(local_dir))
    return LocalManifest(manifest, str(manifest_path(local_dir)), remote is not None, note)


def _check_against_upstream(local_dir: Path, hashed: list[tuple[FileEntry, str | None]], remote: Mapping[str, RemoteFile]) -> None:
    wrong = [e.path for e, git in hashed if e.path in remote and not remote[e.path].upstream.matches(e.sha256, git)]
    extra = [e.path for e, _ in hashed if e.path not in remote]
    missing = sorted(set(remote) - {e.path for e, _ in hashed})
    problems = [(wrong, "differ from the Hub"), (missing, "missing locally"), (extra, "not in the revision")]
    parts = [f"{len(paths)} {what} ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})" for paths, what in problems if paths]
    if parts:
        raise IntegrityError(f"{local_dir}: no manifest written: " + "; ".join(parts))
