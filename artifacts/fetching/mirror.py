"""ModelScope mirrors: list a mirror's files, reconcile them by content with the pinned revision, and
serve the matching ones as a byte source (download.Source) for fetch.

ModelScope publishes a sha256 for every file but does not name the Hugging Face commit it mirrors, so
a mirror file stands in for a pinned file only when path, size and content hash agree: the Hub's LFS
sha256 (or a local manifest's sha256) against the listing's Sha256; for small non-LFS files, for which
the Hub gives only a git blob sha1, the git blob sha1 of the mirror's bytes. LFS status and file order
are never compared. hub.fetch verifies every byte a mirror serves against the pin's identity anyway.

The SDK (modelscope 1.40, delegating to modelscope_hub) reads its endpoint from MODELSCOPE_ENDPOINT
once, at the first HubApi(); pass `endpoint` to point one call elsewhere. Every answer it reads for mm is
bounded like the Hub's (wire.bound_session on the SDK's requests sessions: API answers capped at
wire.CAP_MIRROR_API and MM_NET_DEADLINE, file bodies under the header deadline and the ranged engine's rules),
and what it hands back is checked before use: a hostile mirror ends as one RemoteError naming the host.
"""
from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .download import RemoteFile
from ..edges import wire
from ..errors import BadInput, BadValue, RemoteError, first_line
from ..edges.untrusted import shown
from .fetch import FetchRequest, SourcePlan
from ..integrity.hashing import git_blob_sha1
from .hub import Resolved, Unreachable, list_remote_files, resolve_revision, select
from ..integrity.manifest import Manifest, read_manifest
from ..pins import pinned_target
from .ranges import Answer, RetryLater, TransferCut, chunk_reader

DEFAULT_MS_REVISION = "master"  # ModelScope's default branch; always passed explicitly (an omitted revision may pick a tag)
CHUNK = 1024 * 1024
SMALL_FILE_LIMIT = 64 * 1024 * 1024  # non-LFS files on the Hub are far smaller; refuse to buffer anything larger

IDENTICAL = "identical"
DIFFERENT = "different"
MISSING = "missing-on-mirror"
EXTRA = "extra-on-mirror"


# --- data ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MirrorFile:
    """One blob in a ModelScope listing."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PinFile:
    """What the pinned revision holds at PATH: a sha256 (LFS oid, or from a manifest) and/or a git blob sha1."""

    path: str
    size: int
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class PinnedFiles:
    repo_id: str
    revision: str  # full commit
    origin: str  # "hub" or "manifest:<path>"
    files: tuple[PinFile, ...]


@dataclass(frozen=True)
class FileReport:
    path: str
    status: str  # identical | different | missing-on-mirror | extra-on-mirror
    pin_size: int | None
    mirror_size: int | None
    compared_by: str | None = None  # "sha256" | "git-blob-sha1" | "size"
    note: str | None = None


@dataclass(frozen=True)
class Reconciliation:
    repo_id: str
    revision: str
    pin_origin: str
    modelscope_id: str
    ms_revision: str
    files: tuple[FileReport, ...]
    pin_files: int = 0
    pin_bytes: int = 0
    supplied_files: int = 0
    supplied_bytes: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.supplied_files == self.pin_files

    @property
    def label(self) -> str:
        return f"modelscope:{self.modelscope_id}@{self.ms_revision}"

    def paths(self, status: str) -> list[str]:
        return [f.path for f in self.files if f.status == status]

    def unsupplied(self) -> list[str]:
        return [f.path for f in self.files if f.status in (DIFFERENT, MISSING)]


@dataclass(frozen=True)
class RevisionCoverage:
    ms_revision: str
    kind: str  # "branch" | "tag"
    supplied_files: int
    supplied_bytes: int
    pin_files: int
    pin_bytes: int
    error: str | None = None


@dataclass(frozen=True)
class RevisionRanking:
    """--all-revisions: every branch and tag, best first, with the best one's full report."""

    modelscope_id: str
    ranking: tuple[RevisionCoverage, ...]
    best: Reconciliation | None


# --- the SDK at the edge ---------------------------------------------------------------------------

def ms_api(endpoint: str | None = None):
    """The SDK's HubApi (modelscope.hub.api, delegating to modelscope_hub), every answer it reads bounded (module
    docstring). Imported late: it is slow to load."""
    import requests
    from modelscope.hub.api import HubApi

    api = HubApi(endpoint=endpoint)
    # The SDK's two clients (modelscope_hub.api.HubApi's legacy and openapi) each hold a requests session for
    # API calls and one for reads; all of them are bounded.
    sessions = [value for client in (api._api.legacy, api._api.openapi) for value in vars(client).values()
                if isinstance(value, requests.Session)]
    if not sessions:
        raise RuntimeError("the modelscope SDK holds no requests session mm can bound (an SDK mm does not know)")
    for session in sessions:
        wire.bound_session(session, _cap_for, "ModelScope")
    return api


def _cap_for(url: str) -> tuple[int, str] | None:
    """A file download (GET .../repo?...FilePath=...) is a bulk body; every other answer is an API document."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.path.endswith("/repo") and "FilePath=" in parts.query:
        return None
    return wire.CAP_MIRROR_API, "a ModelScope API answer"


def _sdk_errors() -> tuple[type[BaseException], ...]:
    import requests
    from modelscope_hub.errors import HubError

    return (HubError, requests.RequestException, OSError)


# What the SDK raises when an answer parsed as JSON is not the shape it expects (a list for an object, a string
# for a number, nesting deeper than the parser goes, a date out of range).
_SHAPE_ERRORS = (ValueError, TypeError, AttributeError, LookupError, RecursionError, ArithmeticError)


@contextmanager
def _sdk_call(what: str, api) -> Iterator[str]:
    """The SDK's failures (and RemoteErrors inside) as one RemoteError: WHAT, then why, naming the host (yielded)."""
    host = wire.origin(getattr(api, "endpoint", "") or "")
    try:
        yield host
    except RemoteError as e:  # wire's bounds: the message names the host and what it sent
        raise RemoteError(f"{what}: {e.message}") from None
    except json.JSONDecodeError as e:  # (requests' too)
        raise RemoteError(f"{what}: {host} sent an answer that is not JSON ({shown(first_line(e), 80)})") from None
    except _sdk_errors() as e:
        raise RemoteError(f"{what} from {host}: {shown(first_line(e), 200)}") from None
    except _SHAPE_ERRORS as e:
        raise RemoteError(f"{what}: {host} sent an answer that is not what the ModelScope API sends "
                          f"({type(e).__name__}: {shown(first_line(e), 80)})") from None


def list_mirror_files(model_id: str, revision: str = DEFAULT_MS_REVISION, *, api=None) -> list[MirrorFile]:
    """The blobs of MODEL_ID@REVISION with their Sha256 (`list_repo_files` keeps it; `get_model_files` drops it).

    The SDK reads a failed listing answered as HTTP 200 with Success:false as an empty list, so an
    empty listing is an error here.
    """
    api = api or ms_api()
    what = f"ModelScope {model_id}@{revision}: cannot list files"
    with _sdk_call(what, api) as host:
        entries = api.list_repo_files(model_id, "model", revision=revision, recursive=True)
        files = [_mirror_file(e, host) for e in entries if not e.is_dir]
    if not files:
        raise RemoteError(f"ModelScope {model_id}@{revision}: the file listing is empty "
                          "(the mirror failed to list it, or the revision holds no files)")
    return files


def _mirror_file(entry, host: str) -> MirrorFile:
    """ENTRY of the SDK's listing as a MirrorFile, once its fields are what a listing holds."""
    from ..edges.untrusted import printable

    path, size, sha256 = entry.path, entry.size, entry.sha256 or ""
    if not (isinstance(path, str) and 0 < len(path) <= 4096 and printable(path) == path) \
            or type(size) is not int or size < 0 or not isinstance(sha256, str):
        raise RemoteError(f"{host} sent a listing entry that is not a file's path, size and sha256 "
                          f"({shown(repr((path, size, sha256)), 80)}); refused")
    return MirrorFile(path, size, sha256.lower())


def list_mirror_revisions(model_id: str, *, api=None) -> list[tuple[str, str]]:
    """(name, "branch" | "tag") for every branch and tag of the mirror, branches first."""
    from ..edges.untrusted import printable

    api = api or ms_api()
    what = f"ModelScope {model_id}: cannot list branches and tags"
    with _sdk_call(what, api) as host:
        branches, tags = api.get_model_branches_and_tags_details(model_id)
        found = [(b["Revision"], "branch") for b in branches] + [(t["Revision"], "tag") for t in tags]
        if any(not isinstance(name, str) or not 0 < len(name) <= 256 or printable(name) != name for name, _ in found):
            raise RemoteError(f"{host} named a revision that is not a branch or tag name; refused")
    if not found:
        raise RemoteError(f"ModelScope {model_id}: the mirror lists no branches or tags")
    return found


class MirrorSource:
    """A byte source for fetch (download.Source): files of one mirror revision, with Range resume."""

    def __init__(self, model_id: str, revision: str, *, api=None):
        self.model_id = model_id
        self.revision = revision
        self.label = f"modelscope:{model_id}@{revision}"
        self._api = api or ms_api()

    max_connections = 1  # one stream per file from the mirror

    @contextmanager
    def stream(self, path: str, offset: int, end: int | None = None) -> Iterator[Answer]:
        # END is not asked for: the engine stops reading at the end of its range
        headers = {"Accept-Encoding": "identity"}  # byte offsets must be offsets into the file itself
        if offset:
            headers["Range"] = f"bytes={offset}-"
        where = f"ModelScope {self.model_id}@{self.revision}: {path}"
        try:
            resp = self._api.legacy.download_stream(self.model_id, "model", path, self.revision, headers=headers)
        except wire.TooSlow as e:  # headers trickled: asked again on a fresh connection, within the file's budget
            raise RetryLater(f"{where}: {e.message}", "slow-headers") from None
        except _sdk_errors() as e:
            raise RemoteError(f"{where}: download failed: {first_line(e)}") from None
        try:
            length = resp.headers.get("Content-Length", "")
            encoded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
            yield Answer(resp.status_code, resp.headers.get("Content-Range"), chunk_reader(_chunks(resp, where)),
                         int(length) if length.isdigit() and not encoded else None)
        finally:
            resp.close()

    def read(self, path: str, limit: int = SMALL_FILE_LIMIT) -> bytes:
        """The whole file, for hashing small files during reconciliation."""
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        out = bytearray()
        with self.stream(path, 0) as answer:
            while n := answer.read(view):
                out += view[:n]
                if len(out) > limit:
                    raise RemoteError(f"ModelScope {self.model_id}@{self.revision}: {path} is larger than {limit} bytes")
        return bytes(out)


def _chunks(resp, where: str) -> Iterator[bytes]:
    """The body as it arrives. read1, not iter_content: urllib3's read(n) drops what it buffered when the
    connection breaks before n bytes, and those bytes are what a resume continues from."""
    from urllib3.exceptions import HTTPError as Urllib3Error

    try:
        while chunk := resp.raw.read1(CHUNK, decode_content=True):
            yield chunk
    except (*_sdk_errors(), Urllib3Error) as e:
        # What arrived is on disk: the download engine continues from there with a Range request.
        raise TransferCut(f"{where}: transfer cut ({first_line(e)})") from None


# --- what to compare --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MirrorTarget:
    repo_id: str
    revision: str
    modelscope_id: str


def target(repo: str | None, revision: str | None, modelscope_id: str | None) -> MirrorTarget:
    """Fill what the user left out from the curated pin in manifests/ (the default pin when REPO is omitted)."""
    t = pinned_target(repo, revision)
    if not t.revision:
        raise BadInput(f"{t.repo_id}: no pin in manifests/ for this repo; give --revision")
    modelscope_id = modelscope_id or (t.pin.modelscope_id if t.pin else None)
    if not modelscope_id:
        raise BadInput(f"{t.repo_id}: the pin names no ModelScope mirror; give --modelscope-id OWNER/NAME")
    return MirrorTarget(t.repo_id, t.revision, modelscope_id)


def parse_source(spec: str, default_modelscope_id: str) -> tuple[str, str]:
    """`modelscope`, `modelscope:OWNER/NAME` or `modelscope:OWNER/NAME@REV` -> (model id, revision)."""
    m = re.match(r"^modelscope(?::([^@/\s]+/[^@/\s]+))?(?:@([^@\s]+))?$", spec)
    if not m:
        raise BadValue(f"--source {spec!r}: expected hub, modelscope, modelscope:OWNER/NAME or modelscope:OWNER/NAME@REV")
    return m[1] or default_modelscope_id, m[2] or DEFAULT_MS_REVISION


# --- the pin's identities --------------------------------------------------------------------------

def pinned_from_hub(repo_id: str, revision: str, *, endpoint: str | None = None, token: str | None = None):
    """The pin's identities from the Hub: (PinnedFiles, hub.Resolved, [hub.RemoteFile]) so fetch need not list again."""
    try:
        resolved = resolve_revision(repo_id, revision, endpoint=endpoint, token=token)
        remote = list_remote_files(repo_id, resolved.commit, endpoint=endpoint, token=token)
    except Unreachable as e:
        raise Unreachable(f"{e.message}; to use the mirror without the Hub, give --pin-manifest "
                          "(a manifest of the pinned revision)") from None
    files = tuple(PinFile(f.path, f.size, sha256=f.lfs_sha256, git_sha1=None if f.lfs_sha256 else f.blob_id)
                  for f in remote)
    return PinnedFiles(repo_id, resolved.commit, "hub", files), resolved, remote


def pinned_from_manifest(manifest: Manifest, path: Path | str) -> PinnedFiles:
    """Offline: a local mm manifest has a sha256 for every file, so nothing needs downloading."""
    files = tuple(PinFile(f.path, f.size, sha256=f.sha256,
                          git_sha1=f.upstream.value if f.upstream and f.upstream.kind == "git-blob-sha1" else None)
                  for f in manifest.files)
    return PinnedFiles(manifest.repo_id, manifest.revision, f"manifest:{path}", files)


def read_pin_manifest(path: Path, repo_id: str, revision: str) -> Manifest:
    """A local mm manifest standing in for the Hub's listing of REPO_ID@REVISION (offline from the Hub)."""
    manifest = read_manifest(path)
    same_revision = revision == manifest.requested_revision or manifest.revision.startswith(revision)
    if manifest.repo_id != repo_id or not same_revision:
        raise BadInput(f"{path}: holds {manifest.repo_id}@{manifest.revision[:12]}, not {repo_id}@{revision}")
    return manifest


def pinned_for(t: MirrorTarget, manifest_file: Path | None, *, endpoint: str | None = None) -> PinnedFiles:
    """The pin's identities: from a local mm manifest when given (offline), else from the Hub."""
    if manifest_file is None:
        return pinned_from_hub(t.repo_id, t.revision, endpoint=endpoint)[0]
    return pinned_from_manifest(read_pin_manifest(manifest_file, t.repo_id, t.revision), manifest_file)


def remote_from_manifest(manifest: Manifest, path: Path) -> tuple[Resolved, list[RemoteFile]]:
    """The Hub's identities as a manifest recorded them, for fetch to verify mirror bytes against."""
    remote = []
    for f in manifest.files:
        if f.upstream is None:
            raise BadInput(f"{path}: {f.path} has no upstream identity (manifest made without the Hub); "
                           "it cannot prove mirror bytes are the pin's")
        lfs = f.upstream.kind == "lfs-sha256"
        remote.append(RemoteFile(f.path, f.size, blob_id="" if lfs else f.upstream.value,
                                 lfs_sha256=f.upstream.value if lfs else None))
    resolved = Resolved(manifest.repo_id, manifest.requested_revision or manifest.revision, manifest.revision, "commit")
    return resolved, remote


# --- reconciliation --------------------------------------------------------------------------------

def compare(pin: list[PinFile] | tuple[PinFile, ...], mirror: list[MirrorFile],
            read_mirror: Callable[[str], bytes]) -> list[FileReport]:
    """Match on path, size and content hash. READ_MIRROR(path) is called only for same-size files that
    the pin knows by git blob sha1 alone (small non-LFS files)."""
    by_path = {m.path: m for m in mirror}
    reports = []
    for p in sorted(pin, key=lambda f: f.path):
        m = by_path.get(p.path)
        if m is None:
            reports.append(FileReport(p.path, MISSING, p.size, None))
        elif m.size != p.size:
            reports.append(FileReport(p.path, DIFFERENT, p.size, m.size, "size"))
        elif p.sha256:
            same = m.sha256.lower() == p.sha256.lower()
            note = None if m.sha256 else "the mirror lists no sha256 for it"
            reports.append(FileReport(p.path, IDENTICAL if same else DIFFERENT, p.size, m.size, "sha256", note))
        elif p.git_sha1:
            reports.append(_compare_bytes(p, m, read_mirror(p.path)))
        else:
            raise BadInput(f"pin entry {p.path!r} has neither a sha256 nor a git blob sha1 to compare")
    pinned = {p.path for p in pin}
    reports += [FileReport(m.path, EXTRA, None, m.size) for m in sorted(mirror, key=lambda f: f.path)
                if m.path not in pinned]
    return reports


def _compare_bytes(p: PinFile, m: MirrorFile, data: bytes) -> FileReport:
    if git_blob_sha1(data) == p.git_sha1:
        if m.sha256 and hashlib.sha256(data).hexdigest() != m.sha256:
            # Bytes are the pin's, but the listing promises others: fetch would reject them, so do not count it.
            return FileReport(p.path, DIFFERENT, p.size, m.size, "git-blob-sha1",
                              "served bytes do not match the listing's sha256")
        return FileReport(p.path, IDENTICAL, p.size, m.size, "git-blob-sha1")
    return FileReport(p.path, DIFFERENT, p.size, m.size, "git-blob-sha1")


def summarize(pinned: PinnedFiles, modelscope_id: str, ms_revision: str, reports: list[FileReport]) -> Reconciliation:
    identical = [r for r in reports if r.status == IDENTICAL]
    counts = {s: sum(1 for r in reports if r.status == s) for s in (IDENTICAL, DIFFERENT, MISSING, EXTRA)}
    return Reconciliation(
        repo_id=pinned.repo_id, revision=pinned.revision, pin_origin=pinned.origin,
        modelscope_id=modelscope_id, ms_revision=ms_revision, files=tuple(reports),
        pin_files=len(pinned.files), pin_bytes=sum(f.size for f in pinned.files),
        supplied_files=len(identical), supplied_bytes=sum(r.pin_size or 0 for r in identical), counts=counts,
    )


def reconcile(pinned: PinnedFiles, modelscope_id: str, ms_revision: str = DEFAULT_MS_REVISION, *,
              endpoint: str | None = None, api=None) -> Reconciliation:
    api = api or ms_api(endpoint)
    mirror = list_mirror_files(modelscope_id, ms_revision, api=api)
    source = MirrorSource(modelscope_id, ms_revision, api=api)
    return summarize(pinned, modelscope_id, ms_revision, compare(pinned.files, mirror, source.read))


def rank_revisions(pinned: PinnedFiles, modelscope_id: str, *, endpoint: str | None = None,
                   api=None) -> RevisionRanking:
    """Reconcile every branch and tag; best coverage (bytes, then files) first. A revision whose listing
    fails is ranked last with its error; if every one fails, that is a RemoteError."""
    api = api or ms_api(endpoint)
    results: list[tuple[RevisionCoverage, Reconciliation | None]] = []
    for name, kind in list_mirror_revisions(modelscope_id, api=api):
        try:
            rec = reconcile(pinned, modelscope_id, name, api=api)
        except RemoteError as e:
            results.append((RevisionCoverage(name, kind, 0, 0, len(pinned.files),
                                             sum(f.size for f in pinned.files), e.message), None))
            continue
        results.append((RevisionCoverage(name, kind, rec.supplied_files, rec.supplied_bytes,
                                         rec.pin_files, rec.pin_bytes), rec))
    if all(rec is None for _, rec in results):
        raise RemoteError(f"ModelScope {modelscope_id}: no branch or tag could be listed "
                          f"({results[0][0].ms_revision}: {results[0][0].error})")
    results.sort(key=lambda r: (r[1] is None, -r[0].supplied_bytes, -r[0].supplied_files, r[0].kind != "tag"))
    return RevisionRanking(modelscope_id, tuple(c for c, _ in results), results[0][1])


# --- fetch from the mirror -------------------------------------------------------------------------

def mirror_sources(rec: Reconciliation, *, mirror_only: bool = False, endpoint: str | None = None,
                   api=None) -> Mapping[str, MirrorSource]:
    """Per-path byte sources for fetch: the mirror for every file whose content matches the pin.

    The rest come from the Hub; with MIRROR_ONLY they are an error that names them.
    """
    missing = rec.unsupplied()
    if mirror_only and missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing) - 8} more)" if len(missing) > 8 else "")
        raise RemoteError(f"{rec.label} cannot supply {len(missing)} file(s) of {rec.repo_id}@{rec.revision[:12]} "
                          f"(different or missing on the mirror): {shown}; drop --mirror-only to take them from the Hub")
    source = MirrorSource(rec.modelscope_id, rec.ms_revision, api=api or ms_api(endpoint))
    return {path: source for path in rec.paths(IDENTICAL)}


@dataclass(frozen=True)
class MirrorOptions:
    """`mm fetch --source modelscope[:OWNER/NAME[@REV]]` with the options that go only with it, their rule checked
    once, by from_cli (plan_fetch takes it as it is). MIRROR_ONLY: nothing from the Hub; PIN_MANIFEST: the pin's
    identities from this mm manifest, for when the Hub is unreachable."""

    source: str
    mirror_only: bool = False
    pin_manifest: Path | None = None

    @classmethod
    def from_cli(cls, source: str, mirror_only: bool, pin_manifest: Path | None) -> MirrorOptions | None:
        """None for `--source hub`, the default: neither --mirror-only nor --pin-manifest goes with it."""
        if source == "hub":
            if mirror_only or pin_manifest:
                raise BadValue("--mirror-only and --pin-manifest need --source modelscope")
            return None
        return cls(source, mirror_only, pin_manifest)


def plan_fetch(req: FetchRequest, options: MirrorOptions,
               default_modelscope_id: str | None) -> tuple[SourcePlan, Reconciliation]:
    """`mm fetch --source modelscope[...]`: reconcile the mirror with the pin's identities (the Hub's listing,
    or the pin manifest when the Hub is unreachable) and return the source plan fetch takes: the pin's listing,
    and the mirror as byte source for every matching file of REQ's patterns.
    fetch still verifies every byte against those identities."""
    source_spec, mirror_only, pin_manifest = options.source, options.mirror_only, options.pin_manifest
    if default_modelscope_id is None and ":" not in source_spec:
        raise BadInput(f"{req.repo_id}: the pin names no ModelScope mirror; use --source modelscope:OWNER/NAME")
    model_id, ms_revision = parse_source(source_spec, default_modelscope_id or "")
    if pin_manifest is None:
        pinned, resolved, remote = pinned_from_hub(req.repo_id, req.revision, endpoint=req.endpoint, token=req.token)
    else:
        manifest = read_pin_manifest(pin_manifest, req.repo_id, req.revision)
        resolved, remote = remote_from_manifest(manifest, pin_manifest)
        pinned = pinned_from_manifest(manifest, pin_manifest)
    wanted = {f.path for f in select(remote, req.include, req.exclude)}
    pinned = replace(pinned, files=tuple(f for f in pinned.files if f.path in wanted))
    api = ms_api()
    rec = reconcile(pinned, model_id, ms_revision, api=api)
    sources = mirror_sources(rec, mirror_only=mirror_only, api=api)
    return SourcePlan(resolved=resolved, files=tuple(remote), by_path=sources, hub_fallback=not mirror_only), rec
