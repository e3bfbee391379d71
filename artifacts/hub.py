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
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ContextManager, Iterator, Mapping, Protocol, Sequence
from urllib.parse import urljoin, urlsplit

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
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, get_session, hf_raise_for_status

from .errors import BadInput, IntegrityError, MMError, Refused, RemoteError
from .fsutil import MM_DIR, check_relpath, dir_lock, human_bytes, payload_files, publish
from .hashing import Digests, StreamHasher
from .manifest import (FileEntry, Manifest, Upstream, entry_for_file, entry_from_dict, manifest_path, public_endpoint,
                       read_manifest, write_manifest)
from .progress import NULL_PROGRESS, ProgressSink
from .ranges import DEFAULT_CONNECTIONS, Connections, RangedJob, RetryLater, TransferStats, clear_state, state_path
from . import ranges

HEX = re.compile(r"^[0-9a-f]+$")
PARTIAL_DIR = f"{MM_DIR}/partial"
JOURNAL = f"{MM_DIR}/journal.jsonl"
MAX_REDIRECTS = 5
XET_HASH = re.compile(r"^[0-9a-f]{64}$")


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
    xet_hash: str | None = None  # the Hub's Xet hash of a Xet-backed file (recorded; lfs_sha256 is what is checked)

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
        xet = getattr(e, "xet_hash", None)
        files.append(RemoteFile(path=e.path, size=int(e.size), blob_id=e.blob_id,
                                lfs_sha256=e.lfs.sha256 if e.lfs else None,
                                xet_hash=xet if isinstance(xet, str) and XET_HASH.match(xet) else None))
    return sorted(files, key=lambda f: f.path)


def select(files: Sequence[RemoteFile], include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[RemoteFile]:
    return list(filter_repo_objects(files, allow_patterns=list(include) or None,
                                    ignore_patterns=list(exclude) or None, key=lambda f: f.path))


# --- where bytes come from ---------------------------------------------------------------------

class FileSource(Protocol):
    label: str  # recorded as the manifest entry's "source"

    def stream(self, path: str, start: int, end: int | None = None) -> ContextManager[tuple[int, Iterator[bytes]]]:
        """Bytes [START, END) of PATH (END None: to the end); yield (offset the body really starts at, chunks).
        See ranges.RangeSource: RetryLater for what may pass, RemoteError for what will not."""


class HubSource:
    """Files of one commit from the Hub, by ranges.

    The first request for a file follows the Hub's redirect (CDN or Xet bridge, a signed URL) and the
    location is kept for the file's other ranges; the token goes only to the Hub's own origin. A signed URL
    that has expired (403/410, or any 4xx, from the other origin) is dropped and the file resolved again.
    429 (with Retry-After), 408 and 5xx are RetryLater: the engine retries that range with backoff."""

    def __init__(self, repo_id: str, commit: str, *, endpoint: str | None = None, token: str | None = None,
                 repo_type: str = "model"):
        self.repo_id, self.commit, self.repo_type = repo_id, commit, repo_type
        self.endpoint = hub_endpoint(endpoint)
        self._hub_headers = build_hf_headers(token=token, library_name="mm")
        self._hub_headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file itself
        self._cdn_headers = {k: v for k, v in self._hub_headers.items() if k.lower() not in ("authorization", "cookie")}
        self._lock = threading.Lock()
        self._located: dict[str, str] = {}  # path -> signed URL on another origin
        self._locating: dict[str, threading.Event] = {}
        self.label = "hub"

    def _start_url(self, path: str) -> tuple[str, bool]:
        """Where to ask for PATH: the kept signed URL, else the Hub (first asker resolves, the others wait)."""
        with self._lock:
            if path in self._located:
                return self._located[path], False
            event = self._locating.get(path)
            if event is None:
                self._locating[path] = threading.Event()
                return hf_hub_url(self.repo_id, path, revision=self.commit, repo_type=self.repo_type,
                                  endpoint=self.endpoint), True
        event.wait(timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        with self._lock:
            if path in self._located:
                return self._located[path], False
        return hf_hub_url(self.repo_id, path, revision=self.commit, repo_type=self.repo_type, endpoint=self.endpoint), False

    def _settle(self, path: str, location: str | None) -> None:
        with self._lock:
            if location is not None:
                self._located[path] = location
            event = self._locating.pop(path, None)
        if event is not None:
            event.set()

    def _forget(self, path: str, url: str) -> None:
        with self._lock:
            if self._located.get(path) == url:
                del self._located[path]

    def _on_hub(self, url: str) -> bool:
        return _origin(url) == _origin(self.endpoint)

    @contextmanager
    def stream(self, path: str, start: int, end: int | None = None) -> Iterator[tuple[int, Iterator[bytes]]]:
        url, resolving = self._start_url(path)
        rng = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        session = get_session()
        try:
            for _ in range(MAX_REDIRECTS + 1):
                headers = {**(self._hub_headers if self._on_hub(url) else self._cdn_headers), **rng}
                try:
                    request = session.build_request("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
                    response = session.send(request, stream=True, follow_redirects=False)
                except httpx2.TransportError as e:
                    raise RetryLater(f"{path}: cannot reach {_where(url)}: {type(e).__name__}", "connect") from None
                try:
                    if response.has_redirect_location:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if resolving:
                        resolving = False
                        self._settle(path, None if self._on_hub(url) else url)
                    self._check(response, path, url)
                    yield content_start(response.status_code, response.headers.get("Content-Range")), _body(response, path)
                    return
                finally:
                    response.close()
            raise RemoteError(f"{self.repo_id}@{self.commit[:12]}: {path}: more than {MAX_REDIRECTS} redirects")
        finally:
            if resolving:
                self._settle(path, None)

    def _check(self, response: httpx2.Response, path: str, url: str) -> None:
        status = response.status_code
        if status in (200, 206):
            return
        where = f"{path}: {_where(url)} answered {status}"
        if status == 429:
            raise RetryLater(f"{where} (rate limited)", "429", _retry_after(response.headers.get("Retry-After")))
        if status == 408 or status >= 500:
            raise RetryLater(where, f"{status}", _retry_after(response.headers.get("Retry-After")))
        if not self._on_hub(url):  # an expired or revoked signed URL: resolve the file again
            self._forget(path, url)
            raise RetryLater(f"{where} (signed URL expired or refused; resolving again)", "expired", after=0)
        response.read()
        with hub_errors(self.repo_id, self.commit[:12]):
            hf_raise_for_status(response)
        raise RemoteError(where)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def _where(url: str) -> str:
    """An origin to name in a message: never a path, query string (signatures) or credentials."""
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}"


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def _body(response: httpx2.Response, path: str) -> Iterator[bytes]:
    # Bytes as they arrive, nothing buffered is lost on a cut; raw when the body is not encoded (identity was
    # asked for), which skips the client's decoder layer.
    received = 0
    encoded = response.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
    try:
        for chunk in (response.iter_bytes() if encoded else response.iter_raw()):
            received += len(chunk)
            yield chunk
    except httpx2.TransportError as e:
        raise TransferCut(f"{path}: transfer cut ({type(e).__name__}) after {received} bytes of this response") from None


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
    workers: int | None = None  # files at once; default: up to `connections`
    connections: int = DEFAULT_CONNECTIONS  # connections at once, over all files (ranges of one file, or many files)
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
    ranges: int = 0  # range requests that delivered bytes
    connections: int = 0  # most connections the file used at once


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
    transfer: dict = field(default_factory=dict)  # connections (budget, most used), requests, retries by reason

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
        label = f"fetch {req.repo_id}@{resolved.commit[:12]}"
        total = sum(f.size for f in planned)
        progress.begin(total, f"{label} 0/{len(planned)} files")
        journal = _Journal(local_dir / JOURNAL)
        connections = Connections(req.connections)
        stats = TransferStats(retry_budget=max(64, 16 * req.connections))
        finished = [0]
        count_lock = threading.Lock()

        def one(f: RemoteFile) -> tuple[FileOutcome, FileEntry | None]:
            source = req.sources.get(f.path, hub)
            try:
                return _fetch_file(local_dir, f, source, hub, known, req, progress, journal, connections, stats)
            finally:
                with count_lock:
                    finished[0] += 1
                    progress.begin(total, f"{label} {finished[0]}/{len(planned)} files")

        try:
            with ThreadPoolExecutor(max_workers=max(1, req.workers or req.connections)) as pool:
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
        transfer={"connections": req.connections, "connections_used": connections.peak, **stats.report()},
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
        needed += f.size - (ranges.load_state(partial, f.size, f.upstream.value).done if partial.exists() else 0)
    free = shutil.disk_usage(local_dir).free
    if needed > free:
        raise Refused(f"{local_dir}: not enough free disk: {human_bytes(needed)} to download, {human_bytes(free)} free")


def _partial_path(local_dir: Path, f: RemoteFile) -> Path:
    # Keyed by the upstream identity, so a partial file can never be continued with another revision's bytes.
    return local_dir / PARTIAL_DIR / f"{f.upstream.value}.part"


def _clean_stale_partials(local_dir: Path, planned: Sequence[RemoteFile]) -> None:
    keep = {p.name for f in planned for p in (_partial_path(local_dir, f), state_path(_partial_path(local_dir, f)))}
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
                req: FetchRequest, progress: ProgressSink, journal: "_Journal", connections: Connections,
                stats: TransferStats) -> tuple[FileOutcome, FileEntry | None]:
    if not (req.refetch and req.only_paths is not None):
        entry = _is_present(local_dir, f, known)
        if entry is not None:
            progress.advance(f.size)
            return FileOutcome(f.path, f.size, "present", entry.source), entry
    try:
        return _fetch_from(local_dir, f, source, progress, journal, connections, stats)
    except IntegrityError as e:
        if source is hub or not req.hub_fallback:
            return _failed(f, source, e)
        rejected = f"{source.label} served bytes that do not match the pin; taken from the Hub instead"
    except (RemoteError, BadInput) as e:
        return _failed(f, source, e)
    try:
        outcome, entry = _fetch_from(local_dir, f, hub, progress, journal, connections, stats)
        return replace(outcome, note=rejected), entry
    except (IntegrityError, RemoteError, BadInput) as e:
        return _failed(f, hub, e)


def _fetch_from(local_dir: Path, f: RemoteFile, source: FileSource, progress: ProgressSink,
                journal: "_Journal", connections: Connections, stats: TransferStats) -> tuple[FileOutcome, FileEntry]:
    done = _download(local_dir, f, source, progress, connections, stats)
    d = done.digests
    entry = FileEntry(path=f.path, size=d.size, blake3=d.blake3, sha256=d.sha256 or "", upstream=f.upstream,
                      source=source.label, xet_hash=f.xet_hash)
    journal.append(entry)
    return FileOutcome(f.path, f.size, "downloaded", source.label, done.transferred, done.resumed_from,
                       ranges=done.ranges, connections=done.connections), entry


def _failed(f: RemoteFile, source: FileSource, e: MMError) -> tuple[FileOutcome, None]:
    return FileOutcome(f.path, f.size, "failed", source.label, error=e.message, exit_code=e.exit_code), None


class TransferCut(RetryLater):
    """The connection broke mid-body; what arrived is on disk and the transfer can continue."""

    def __init__(self, message: str):
        super().__init__(message, "cut")


def _new_hasher(f: RemoteFile) -> StreamHasher:
    return StreamHasher(sha256=True, git_size=None if f.lfs_sha256 else f.size)


def _download(local_dir: Path, f: RemoteFile, source: FileSource, progress: ProgressSink, connections: Connections,
              stats: TransferStats) -> ranges.RangedResult:
    """Fill the partial file's gaps by ranges (artifacts/ranges.py), hash in file order, check identity, publish."""
    partial = _partial_path(local_dir, f)
    done = ranges.download(RangedJob(f.path, f.size, partial, f.upstream.value, _new_hasher(f)), source, connections,
                           stats, progress)
    digests = done.digests
    if digests.size != f.size or not f.upstream.matches(digests.sha256, digests.git_sha1):
        clear_state(partial)
        got = digests.sha256 if f.lfs_sha256 else digests.git_sha1
        raise IntegrityError(f"{f.path}: bytes from {source.label} do not match the pinned revision "
                             f"({f.upstream.kind} expected {f.upstream.value[:16]}, got {str(got)[:16]}); not kept")
    publish(partial, local_dir / f.path)
    state_path(partial).unlink(missing_ok=True)
    return done


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
