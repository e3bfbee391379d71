"""The Hugging Face Hub, and nothing else: resolve a revision to its commit, list its files with their
upstream identities (LFS sha256 or git blob sha1), and serve a file's bytes as a download.Source (URL,
auth headers, Range).

huggingface_hub does the talking for the API (HfApi, headers, token and error mapping) over a session mm
bounds (artifacts/edges/wire.py: a byte cap per answer, a deadline, checked redirects). A file's bytes come over
plain http.client connections (wire.open_raw), read straight into the download engine's buffers; what happens
to them (partials, resume, hashing, checks, naming) is the engine's (artifacts/fetching/ranges.py, download.py); the
fetch flow is artifacts/fetching/fetch.py.
"""
from __future__ import annotations

import http.client
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence
from urllib.parse import urlsplit

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
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, hf_raise_for_status

from ..edges import wire
from .download import RemoteFile
from ..errors import BadValue, RemoteError, first_line
from .ranges import Answer, RetryLater, http_answer
from ..edges.fsutil import check_relpath, open_local_file
from ..integrity.manifest import public_endpoint
from ..units import is_commit
from ..edges.progress import NULL_PROGRESS, ProgressSink

if TYPE_CHECKING:
    from ..integrity.verify import VerifyReport

HEX = re.compile(r"^[0-9a-f]+$")
XET_HASH = re.compile(r"^[0-9a-f]{64}$")
MAX_REDIRECTS = wire.MAX_REDIRECTS
MAX_LISTED = 200_000  # files in one listing: mm's margin (the largest model repos hold a few thousand)
LISTING_REQUESTS = 2 * (MAX_LISTED // 1000) + 10  # the Hub pages a tree 1000 entries at a time: mm's margin of 2x
RESOLVE_REQUESTS = 1000  # refs, then commit lists 50 at a time for a short sha (50,000 commits): mm's margin


# --- what the Hub says -----------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    repo_id: str
    requested: str
    commit: str
    kind: str  # "commit" | "short-commit" | "branch" | "tag"


def hub_endpoint(endpoint: str | None = None) -> str:
    """The Hub's base URL (ENDPOINT, else HF_ENDPOINT, else huggingface.co), checked to be an http(s) URL."""
    url = (endpoint or constants.ENDPOINT).rstrip("/")
    return wire.check_url(url, "the Hub endpoint (HF_ENDPOINT)", "is")


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
        raise RemoteError(f"{at}: file not found on the Hub ({first_line(e)})") from None
    except OfflineModeIsEnabled:
        raise Unreachable(f"{at}: HF_HUB_OFFLINE is set; the Hub cannot be reached in offline mode") from None
    except HfHubHTTPError as e:
        raise RemoteError(f"{at}: Hub request failed: {first_line(e)}") from None
    except httpx2.TooManyRedirects:
        raise RemoteError(f"{at}: the Hub at {public_endpoint(hub_endpoint())} redirected more than {MAX_REDIRECTS} "
                          f"times; refused") from None
    except httpx2.TimeoutException as e:
        raise Unreachable(f"{at}: the Hub at {public_endpoint(hub_endpoint())} did not answer within "
                          f"MM_NET_TIMEOUT ({wire.limits().timeout:g} s): {type(e).__name__}") from None
    except httpx2.HTTPError as e:
        raise Unreachable(f"{at}: cannot reach the Hub at {public_endpoint(hub_endpoint())}: {type(e).__name__}: {first_line(e)}") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        # huggingface_hub parses the Hub's answers: one it cannot read is the server's fault, not mm's
        raise RemoteError(f"{at}: the Hub at {public_endpoint(hub_endpoint())} answered something that is not a "
                          f"Hub API answer ({type(e).__name__}: {first_line(e)[:120]})") from None


# mm's margin: a stored login is one token of about 40 characters
MAX_STORED_LOGIN = 64 * 1024


def _check_stored_login(token: str | None) -> None:
    """huggingface_hub reads the stored login (HF_TOKEN_PATH) whole, by path, when no token is given: a FIFO there
    would block it for ever, /dev/zero would fill the memory. It must be a regular file of a token's size, or
    absent. Opened, not read: mm never reads or keeps the token."""
    if token or os.environ.get("HF_TOKEN") or not os.path.lexists(constants.HF_TOKEN_PATH):
        return
    open_local_file(constants.HF_TOKEN_PATH, what="stored Hub login (HF_TOKEN_PATH)", max_bytes=MAX_STORED_LOGIN).close()


def _api(endpoint: str | None, token: str | None) -> HfApi:
    # token=None lets huggingface_hub take HF_TOKEN or the stored login; mm never reads or keeps it.
    _check_stored_login(token)
    wire.use_for_hub()  # every answer capped and under a deadline, redirects checked
    return HfApi(endpoint=hub_endpoint(endpoint), token=token, library_name="mm")


def resolve_revision(repo_id: str, revision: str, *, endpoint: str | None = None, token: str | None = None,
                     repo_type: str = "model") -> Resolved:
    """Resolve a full sha, short sha, branch or tag to the full 40-hex commit, once.

    A full sha is a commit, as huggingface_hub takes it (file_download.REGEX_COMMIT_HASH): asked about directly
    (one request, no list of refs first). It is still asked, not assumed: the listing that follows goes through
    huggingface_hub's retrying pager, which waits ~20 s on an unreachable Hub and logs each retry with the URL
    as given (credentials in HF_ENDPOINT included); this request fails at once, through mm's messages."""
    rev = revision.strip()
    if not rev:
        raise BadValue("--revision: empty revision")
    api = _api(endpoint, token)
    with hub_errors(repo_id, rev), wire.request_budget(RESOLVE_REQUESTS, "resolving a revision"):
        if is_commit(rev):
            return Resolved(repo_id, rev, api.repo_info(repo_id, revision=rev, repo_type=repo_type).sha, "commit")
        refs = api.list_repo_refs(repo_id, repo_type=repo_type)
        for kind, group in (("branch", refs.branches), ("tag", refs.tags)):
            for ref in group:
                if rev in (ref.name, ref.ref):
                    return Resolved(repo_id, rev, ref.target_commit, kind)
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
    entries = []
    with hub_errors(repo_id, commit), wire.request_budget(LISTING_REQUESTS, "the file listing"):
        for e in api.list_repo_tree(repo_id, revision=commit, recursive=True, repo_type=repo_type):
            if len(entries) >= MAX_LISTED:  # a server paging forever
                raise RemoteError(f"{repo_id}@{commit[:12]}: the Hub at {public_endpoint(hub_endpoint())} listed more "
                                  f"than {MAX_LISTED} files; refused")
            if isinstance(e, RepoFile):
                entries.append(e)
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
        self._proxies = wire.Proxies()  # the environment's proxies, read once for the fetch
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
    def stream(self, path: str, start: int, end: int | None = None) -> Iterator[Answer]:
        url, resolving = self._start_url(path)
        rng = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        try:
            for _ in range(MAX_REDIRECTS + 1):
                headers = {**(self._hub_headers if self._on_hub(url) else self._cdn_headers), **rng}
                where = f"{path}: {_where(url)}"
                try:
                    raw = wire.open_raw(url, headers, _where(url), proxies=self._proxies)
                except wire.TooSlow as e:
                    raise RetryLater(f"{path}: {e.message}", "slow-headers") from None
                except (OSError, http.client.HTTPException) as e:
                    raise RetryLater(f"{path}: cannot reach {_where(url)}: {type(e).__name__}", "connect") from None
                try:
                    location = raw.header("Location")
                    if raw.status in wire.REDIRECT_STATUSES and location:
                        url = wire.join_url(url, location, where)
                        raw.discard(wire.CAP_REDIRECT)  # so the Hub's connection is kept for the next file
                        continue
                    if resolving:
                        resolving = False
                        self._settle(path, None if self._on_hub(url) else url)
                    self._check(raw, path, url)
                    yield http_answer(raw, where)
                    return
                finally:
                    raw.close()
            raise RemoteError(f"{self.repo_id}@{self.commit[:12]}: {path}: more than {MAX_REDIRECTS} redirects")
        finally:
            if resolving:
                self._settle(path, None)

    def _check(self, raw: "wire.RawAnswer", path: str, url: str) -> None:
        status = raw.status
        if status in (200, 206):
            return
        where = f"{path}: {_where(url)} answered {status}"
        if status == 429:
            raise RetryLater(f"{where} (rate limited)", "429", _retry_after(raw.header("Retry-After")))
        if status == 408 or status >= 500:
            raise RetryLater(where, f"{status}", _retry_after(raw.header("Retry-After")))
        if not self._on_hub(url):  # an expired or revoked signed URL: resolve the file again
            self._forget(path, url)
            raise RetryLater(f"{where} (signed URL expired or refused; resolving again)", "expired", after=0)
        try:
            body = raw.read_capped(wire.CAP_ERROR, f"an error answer (HTTP {status})")
        except (OSError, http.client.HTTPException):
            body = b""
        # huggingface_hub's own mapping of the Hub's errors (gated, not found, ...), from the bounded body
        response = httpx2.Response(status, headers=list(raw.headers.items()), content=body,
                                   request=httpx2.Request("GET", url))
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


def verify_upstream(model_dir: Path, repo_id: str, revision: str, *, quick: bool = False, jobs: int | None = None,
                    endpoint: str | None = None, token: str | None = None,
                    progress: ProgressSink = NULL_PROGRESS, strict: bool = False) -> VerifyReport:
    """`mm verify --upstream`: check MODEL_DIR against the Hub's own identities (LFS sha256, git blob sha1) for
    REVISION; no manifest needed."""
    from ..integrity.verify import Expected, check_readable_dir, verify_listing

    check_readable_dir(Path(model_dir))  # before the Hub is asked
    resolved = resolve_revision(repo_id, revision, endpoint=endpoint, token=token)
    remote = list_remote_files(repo_id, resolved.commit, endpoint=endpoint, token=token)
    expected = [Expected(f.path, f.size, f.upstream.kind, f.upstream.value) for f in remote]
    return verify_listing(model_dir, expected, f"hub:{repo_id}@{resolved.commit}", "the Hub's file list",
                          quick=quick, jobs=jobs, progress=progress, strict=strict)
