"""The Hugging Face Hub, and nothing else: resolve a revision to its commit, list its files with their
upstream identities (LFS sha256 or git blob sha1), and serve a file's bytes as a download.Source (URL,
auth headers, Range).

huggingface_hub does the talking (HfApi for the API, its shared HTTP session, headers, token and error
mapping). What happens to the bytes (partials, resume, hashing, checks, naming) is the download engine's
(artifacts/download.py); the fetch flow is artifacts/fetch.py.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

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

from .download import RemoteFile, TransferCut, content_start
from .errors import BadInput, RemoteError, first_line
from .fsutil import check_relpath
from .manifest import public_endpoint

HEX = re.compile(r"^[0-9a-f]+$")


# --- what the Hub says -----------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    repo_id: str
    requested: str
    commit: str
    kind: str  # "commit" | "short-commit" | "branch" | "tag"


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
        raise RemoteError(f"{at}: file not found on the Hub ({first_line(e)})") from None
    except OfflineModeIsEnabled:
        raise Unreachable(f"{at}: HF_HUB_OFFLINE is set; the Hub cannot be reached in offline mode") from None
    except HfHubHTTPError as e:
        raise RemoteError(f"{at}: Hub request failed: {first_line(e)}") from None
    except httpx2.HTTPError as e:
        raise Unreachable(f"{at}: cannot reach the Hub at {public_endpoint(hub_endpoint())}: {type(e).__name__}: {first_line(e)}") from None


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

class HubSource:
    """The Hub as a download.Source: files of one commit, resumed with HTTP Range."""

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
                yield content_start(response.status_code, response.headers.get("Content-Range")), _body(response, path)


def _body(response, path: str) -> Iterator[bytes]:
    # iter_bytes() without a size hands over bytes as they arrive: nothing buffered is lost on a cut.
    received = 0
    try:
        for chunk in response.iter_bytes():
            received += len(chunk)
            yield chunk
    except httpx2.TransportError as e:
        raise TransferCut(f"{path}: transfer cut ({type(e).__name__}) after {received} bytes of this response") from None
