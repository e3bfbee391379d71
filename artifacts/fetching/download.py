"""The download engine: any source of bytes plugs in; the engine owns everything else.

A source (the Hub, a ModelScope mirror, next an OCI registry) only answers "give me PATH from byte
OFFSET" for a file whose identity (upstream hash) and size are known before the first byte. The engine
owns the rest, the same for every source: the partial file (DIR/.mm/partial/<identity>.part, so a
partial is never continued with another revision's bytes), resume across runs and across cut
connections, hashing every byte in the pass that writes it (blake3, sha256, git sha1), the check
against the identity before the file gets its final name, the journal of files proven so far (a killed
run does not re-hash them), the directory lock, parallel workers, progress and the free-space check.

Before anything is downloaded, the engine adopts known content on disk (`Session.adopt`): a file whose bytes
are already where they belong (an `hf download --local-dir` of the same commit, a copy from another host), or in
another local file a caller names (`mm fetch --from BASE_DIR`), is hashed locally in one read (blake3, sha256,
and the git sha1 a small file needs) and kept when it matches the file's upstream identity and size.

`fetch_into(partial, file, source, progress)` is the per-file loop: a function of the source, the file's
identity and its partial state on disk (`Partial`); `download_file` adds the final name, and `Session.run`
applies it to many files in parallel. The loop is artifacts/fetching/ranges.py's: the file's missing ranges over up to
`--connections` connections shared by the whole session, a range map beside the partial, hashing in file
order, retries per range within a budget for the session (`Session.transfer` reports them).
"""
from __future__ import annotations

import json
import os
import stat
import threading
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ContextManager, Mapping, Protocol, Sequence

from ..errors import BadInput, IntegrityError, MMError, RemoteError
from ..paths import MM_DIR
from ..edges.fsutil import (check_inside, check_model_path, check_targets, dir_lock, make_dirs, open_file, publish,
                            read_local_file, require_free_space, still_to_write, unlink_file)
from ..integrity.hashing import SLICE, Digests, StreamHasher, hash_file, mapped_windows
from ..edges.interrupt import keeps, requested as interrupt_requested, usable_cores, worker_pool
from ..integrity.manifest import FileEntry, Upstream, entry_from_dict, read_manifest
from ..paths import manifest_path
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from ..edges.sharing import clone_file
from ..edges.untrusted import load_json
from . import ranges
from .ranges import DEFAULT_CONNECTIONS, Answer, Connections, RangedJob, TransferStats, clear_state, state_path
from .ranges import RetryLater, TransferCut  # noqa: F401 - what a Source raises, importable from here as before

PARTIAL_DIR = f"{MM_DIR}/partial"
JOURNAL = f"{MM_DIR}/journal.jsonl"
MAX_JOURNAL = 64 * 1024 * 1024  # mm's margin: 100,000 proven files of ~600 bytes a line


# --- what is downloaded, and from where --------------------------------------------------------

@dataclass(frozen=True)
class RemoteFile:
    """A file to download, known before its first byte: path, size and upstream identity.

    The identity is the LFS sha256 when there is one, else the git blob sha1 (small files on the Hub).
    """

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


class Source(Protocol):
    """A source of bytes. Plug a new one (an OCI registry, ...) into the engine by implementing this."""

    label: str  # recorded as the manifest entry's "source" and shown in reports

    def stream(self, path: str, start: int, end: int | None = None) -> ContextManager[Answer]:
        """Bytes [START, END) of PATH (END None: to the end; START 0 and END None: the whole file, no Range).
        Yield the server's Answer (status, Content-Range, a read into the engine's buffer): the engine proves
        where its bytes belong and copes with any answer (ranges.prove). Raise RetryLater for what may pass
        (429, 5xx, an expired signed URL; the read raises TransferCut when the body breaks mid-way: what
        arrived is kept and the engine asks again from there), RemoteError when the source refuses. A source
        may set `max_connections` (e.g. 1) to cap the connections one of its files gets."""


@dataclass(frozen=True)
class Sources:
    """Where each file's bytes come from: BY_PATH, else DEFAULT. A file another source served wrong
    (bytes that do not match its identity) is taken from FALLBACK instead, when there is one."""

    default: Source
    by_path: Mapping[str, Source] = field(default_factory=dict)
    fallback: Source | None = None
    fallback_name: str = "the fallback source"  # in the note on a file taken from FALLBACK, e.g. "the Hub"

    def for_path(self, path: str) -> Source:
        return self.by_path.get(path, self.default)


@dataclass(frozen=True)
class FileOutcome:
    path: str
    size: int
    status: str  # "downloaded" | "adopted" (its bytes were already on disk, hashed here) | "present" | "failed"
    source: str
    bytes_transferred: int = 0
    resumed_from: int = 0
    error: str | None = None
    error_kind: type[MMError] | None = None  # the failure's class; the CLI maps it to an exit code
    note: str | None = None
    ranges: int = 0  # range requests that delivered bytes
    connections: int = 0  # most connections the file used at once


# --- one file ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Downloaded:
    digests: Digests
    transferred: int  # bytes received in this run
    resumed_from: int  # bytes a partial file held before it
    ranges: int = 0
    connections: int = 0


def partial_path(local_dir: Path, f: RemoteFile) -> Path:
    # Keyed by the upstream identity, so a partial file can never be continued with another revision's bytes.
    return local_dir / PARTIAL_DIR / f"{f.upstream.value}.part"


@dataclass(frozen=True)
class Partial:
    """The partial state of one file on disk: where its bytes go, and how many a previous run kept (its range
    map, ``<partial>.ranges``; a partial without one is a prefix, mm's earlier format)."""

    path: Path
    have: int

    @classmethod
    def of(cls, local_dir: Path, f: RemoteFile) -> "Partial":
        path = partial_path(local_dir, f)
        return cls(path, ranges.load_state(path, f.size, f.upstream.value, local_dir).done)  # not this file's bytes: start over


def download_file(local_dir: Path, f: RemoteFile, source: Source, progress: ProgressSink = NULL_PROGRESS, *,
                  connections: Connections | None = None, stats: TransferStats | None = None) -> Downloaded:
    """F from SOURCE into LOCAL_DIR/F.path, continuing its partial file: fetch_into, then publish."""
    partial = Partial.of(local_dir, f)
    done = fetch_into(partial, f, source, progress, connections=connections, stats=stats, root=local_dir)
    publish(partial.path, local_dir / f.path, root=local_dir)
    unlink_file(local_dir, state_path(partial.path))
    return Downloaded(done.digests, done.transferred, done.resumed_from, done.ranges, done.connections)


def fetch_into(partial: Partial, f: RemoteFile, source: Source, progress: ProgressSink = NULL_PROGRESS, *,
               connections: Connections | None = None, stats: TransferStats | None = None,
               root: Path | None = None) -> ranges.RangedResult:
    """The per-file loop, a function of (source, file identity, partial state): fill PARTIAL's missing ranges
    from SOURCE over up to CONNECTIONS, hashing every byte once in file order (the kept bytes first); then check
    F's identity. Raises IntegrityError (the partial and its map are dropped) or RemoteError (both kept).
    ROOT: the target directory the partial lies under (nothing below it is written through a symlink)."""
    connections = connections or Connections(DEFAULT_CONNECTIONS)
    done = ranges.download(RangedJob(f.path, f.size, partial.path, f.upstream.value, _new_hasher(f), root), source,
                           connections, stats, progress)
    digests = done.digests
    if not _matches(f, digests):
        clear_state(partial.path, root)
        got = digests.sha256 if f.lfs_sha256 else digests.git_sha1
        raise IntegrityError(f"{f.path}: bytes from {source.label} do not match the pinned revision "
                             f"({f.upstream.kind} expected {f.upstream.value[:16]}, got {str(got)[:16]}); not kept")
    return done


def _new_hasher(f: RemoteFile) -> StreamHasher:
    return StreamHasher(sha256=True, git_size=None if f.lfs_sha256 else f.size)


# --- many files: a session on one directory --------------------------------------------------------

class Session:
    """One run of the engine on LOCAL_DIR: holds the directory lock, knows what earlier runs proved.

        with Session(local_dir, "mm fetch") as s:
            results = s.run(files, sources, connections=16, progress=progress)
            ... write the manifest from s.known and results ...
            s.finished()
    """

    def __init__(self, local_dir: Path, what: str = "mm fetch"):
        self.local_dir = Path(local_dir)
        self.what = what
        self._stack = ExitStack()
        self.known: dict[str, FileEntry] = {}
        self.journal = Journal(self.local_dir / JOURNAL, self.local_dir)
        self.transfer: dict = {}  # after run(): connections, requests, retries (ranges.TransferStats.report)
        self.differing: set[str] = set()  # after adopt(): paths whose bytes on disk were not the pinned ones

    def __enter__(self) -> "Session":
        prepare_dir(self.local_dir, self.what)
        self._stack.enter_context(dir_lock(self.local_dir, self.what))
        keeps(self.local_dir)  # an interrupt names the partial files and the journal kept here
        self.known = known_entries(self.local_dir)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def run(self, files: Sequence[RemoteFile], sources: Sources, *, refetch: bool = False, workers: int | None = None,
            connections: int = DEFAULT_CONNECTIONS, progress: ProgressSink = NULL_PROGRESS,
            label: str = "download", candidates: Mapping[str, Path] | None = None) -> list[tuple[FileOutcome, FileEntry | None]]:
        """Every file of FILES present and proven, in parallel: up to WORKERS files at once (default: up to
        CONNECTIONS), their ranges sharing CONNECTIONS connections. A file already proven (same identity and
        size as a known entry, final file of that size) is kept unless REFETCH. Unless REFETCH, known content
        on disk is adopted first (`adopt`): each file's own path, and CANDIDATES ({path: another local file}).
        """
        check_targets(self.local_dir, [f.path for f in files])  # a link planted in the target: refused before any byte
        _clean_stale_partials(self.local_dir, files)
        adopted: dict[str, tuple[FileOutcome, FileEntry]] = {}
        if not refetch:
            wanted = [f for f in files if self.present(f) is None]
            adopted = self.adopt(wanted, {**in_place_candidates(self.local_dir, wanted), **(candidates or {})},
                                 progress=progress)
        self._check_free_space([f for f in files if f.path not in adopted], refetch)
        if adopted and len(adopted) == len(files):
            return [adopted[f.path] for f in files]  # nothing left to download: no second bar
        # the bar counts what this pass does (adopted bytes were counted by adopt's own phase)
        rest = [f for f in files if f.path not in adopted]
        total, finished, lock = sum(f.size for f in rest), [0], threading.Lock()
        progress.begin(total, f"{label} 0/{len(files)} files", files=len(rest))
        budget = Connections(connections)
        stats = TransferStats(retry_budget=max(64, 16 * connections))

        def one(f: RemoteFile) -> tuple[FileOutcome, FileEntry | None]:
            try:
                if f.path in adopted:
                    return adopted[f.path]
                progress.item(f.path)
                entry = None if refetch else self.present(f)
                if entry is not None:
                    progress.advance(f.size)
                    return FileOutcome(f.path, f.size, "present", entry.source), entry
                outcome, entry = self._fetch_one(f, sources, progress, budget, stats)
                if f.path in self.differing and outcome.note is None:
                    outcome = replace(outcome, note="the file already there is not the pinned one (its hash differs); "
                                                    "downloaded over it")
                return outcome, entry
            finally:
                progress.item_done(f.path)
                with lock:  # the bar's label counts files done; the bar itself, bytes and the aggregate rate
                    finished[0] += not interrupt_requested()  # a file stopped by Ctrl-C is not done
                    progress.begin(total, f"{label} {finished[0]}/{len(files)} files", files=len(rest))

        try:
            with worker_pool(workers or connections) as pool:  # an interrupt starts no queued file
                return list(pool.map(one, files))
        finally:
            progress.end()
            self.transfer = {"connections": connections, "connections_used": budget.peak,
                             "connections_kept": budget.limit, **stats.report()}

    def adopt(self, files: Sequence[RemoteFile], candidates: Mapping[str, Path], *, jobs: int | None = None,
              progress: ProgressSink = NULL_PROGRESS) -> dict[str, tuple[FileOutcome, FileEntry]]:
        """Known content on disk, used instead of downloaded: for each file of FILES with a candidate in
        CANDIDATES ({path in the revision: a local file}) that is a regular file of the file's size, hash the
        candidate in one read (blake3, sha256, and the git blob sha1 a small file's identity needs) and keep it
        when it matches the upstream identity. A candidate at the file's own path is adopted where it lies; one
        elsewhere is copied in (hashed in the same read, published under the final name only once it matches).
        Adopted entries are journaled like downloaded ones. Returns {path: (outcome "adopted", entry)}; a
        candidate that does not match is left alone (the download replaces it) and its path kept in `differing`."""
        todo = [(f, Path(candidates[f.path])) for f in files if f.path in candidates and same_size(candidates[f.path], f.size)]
        if not todo:
            return {}
        progress.begin(sum(f.size for f, _ in todo), f"hash {len(todo)} file(s) already on disk", files=len(todo))

        def one(item: tuple[RemoteFile, Path]) -> tuple[FileOutcome, FileEntry] | None:
            f, candidate = item
            try:
                with working_on(progress, f.path):
                    digests = self._hash_candidate(f, candidate, progress)
            except (OSError, BadInput):
                return None  # gone, unreadable or changed meanwhile: downloaded instead
            if digests is None:
                return None
            entry = FileEntry(path=f.path, size=digests.size, blake3=digests.blake3, sha256=digests.sha256 or "",
                              upstream=f.upstream, source="local", xet_hash=f.xet_hash)
            self.journal.append(entry)
            return FileOutcome(f.path, f.size, "adopted", "local"), entry

        try:
            with worker_pool(jobs or min(len(todo), usable_cores())) as pool:  # an interrupt starts no queued file
                results = list(pool.map(one, todo))
        finally:
            progress.end()
        adopted = {r[0].path: r for r in results if r is not None}
        self.differing |= {f.path for f, _ in todo} - set(adopted)
        return adopted

    def _hash_candidate(self, f: RemoteFile, candidate: Path, progress: ProgressSink) -> Digests | None:
        """CANDIDATE's digests when they match F (copied to F's final path first when it lies elsewhere)."""
        final = self.local_dir / f.path
        if candidate == final:
            digests = hash_file(candidate, sha256=True, git_sha1=not f.lfs_sha256)
            progress.advance(f.size)
            return digests if _matches(f, digests) else None
        # its own temporary name: never taken for a download's partial (a prefix to resume), removed unless published
        partial = partial_path(self.local_dir, f).with_suffix(".adopt")
        hasher = _new_hasher(f)
        try:
            if clone_file(candidate, partial, root=self.local_dir):  # a reflink (mm fetch --from on XFS, btrfs): one read
                digests = hash_file(partial, sha256=True, git_sha1=not f.lfs_sha256)
                progress.advance(f.size)
            else:
                out = os.fdopen(open_file(self.local_dir, partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")
                with out:
                    for piece in mapped_windows(candidate, SLICE, progress.advance):
                        hasher.update(piece)
                        out.write(piece)
                digests = hasher.digests()
            if not _matches(f, digests):
                return None
            publish(partial, final, root=self.local_dir)
            return digests
        finally:
            unlink_file(self.local_dir, partial)

    def finished(self) -> None:
        """The manifest now holds what the journal recorded."""
        self.journal.clear()

    def present(self, f: RemoteFile) -> FileEntry | None:
        entry = self.known.get(f.path)
        final = self.local_dir / f.path
        if (entry and entry.proven and entry.upstream == f.upstream and entry.size == f.size and final.is_file()
                and final.stat().st_size == f.size):
            return entry
        return None

    def _fetch_one(self, f: RemoteFile, sources: Sources, progress: ProgressSink, budget: Connections,
                   stats: TransferStats) -> tuple[FileOutcome, FileEntry | None]:
        source = sources.for_path(f.path)
        try:
            return self._from(f, source, progress, budget, stats)
        except IntegrityError as e:
            fallback = sources.fallback
            if fallback is None or source is fallback:
                return _failed(f, source, e)
            rejected = f"{source.label} served bytes that do not match the pin; taken from {sources.fallback_name} instead"
        except (RemoteError, BadInput) as e:
            return _failed(f, source, e)
        try:
            outcome, entry = self._from(f, fallback, progress, budget, stats)
            return replace(outcome, note=rejected), entry
        except (IntegrityError, RemoteError, BadInput) as e:
            return _failed(f, fallback, e)

    def _from(self, f: RemoteFile, source: Source, progress: ProgressSink, budget: Connections,
              stats: TransferStats) -> tuple[FileOutcome, FileEntry]:
        d = download_file(self.local_dir, f, source, progress, connections=budget, stats=stats)
        entry = FileEntry(path=f.path, size=d.digests.size, blake3=d.digests.blake3, sha256=d.digests.sha256 or "",
                          upstream=f.upstream, source=source.label, xet_hash=f.xet_hash)
        self.journal.append(entry)
        return FileOutcome(f.path, f.size, "downloaded", source.label, d.transferred, d.resumed_from,
                           ranges=d.ranges, connections=d.connections), entry

    def _check_free_space(self, files: Sequence[RemoteFile], refetch: bool) -> None:
        """Refuse up front rather than fail hours later with a full disk."""
        needed = 0
        for f in files:
            if not refetch and self.present(f):
                continue
            partial = Partial.of(self.local_dir, f)
            needed += still_to_write(partial.path, f.size, partial.have)
        require_free_space([(self.local_dir, needed)], "the download")


def in_place_candidates(local_dir: Path, files: Sequence[RemoteFile]) -> dict[str, Path]:
    """{path: LOCAL_DIR/path} for each file of FILES whose final name already holds a regular file inside
    LOCAL_DIR (no symlink, itself or a directory above it: a planted link is never followed)."""
    root = os.path.realpath(local_dir)
    found = {}
    for f in files:
        final = Path(local_dir) / f.path
        if os.path.realpath(final) == os.path.join(root, *f.path.split("/")) and same_size(final, f.size):
            found[f.path] = final
    return found


def same_size(path: Path, size: int) -> bool:
    """PATH is a regular file (not a symlink) of SIZE bytes."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _matches(f: RemoteFile, digests: Digests) -> bool:
    return digests.size == f.size and f.upstream.matches(digests.sha256, digests.git_sha1)


def _failed(f: RemoteFile, source: Source, e: MMError) -> tuple[FileOutcome, None]:
    return FileOutcome(f.path, f.size, "failed", source.label, error=e.message, error_kind=type(e)), None


def prepare_dir(local_dir: Path, what: str = "mm fetch") -> None:
    from ..paths import refuse_snapshot

    if local_dir.exists() and not local_dir.is_dir():
        raise BadInput(f"{local_dir}: exists and is not a directory")
    refuse_snapshot(local_dir, what)
    make_dirs(local_dir, local_dir / PARTIAL_DIR)  # OSError: the CLI names the path and the errno


def known_entries(local_dir: Path) -> dict[str, FileEntry]:
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
    entries.update(Journal(local_dir / JOURNAL, local_dir).entries())
    return entries


def _clean_stale_partials(local_dir: Path, planned: Sequence[RemoteFile]) -> None:
    keep = {p.name for f in planned for p in (partial_path(local_dir, f), state_path(partial_path(local_dir, f)))}
    for p in (local_dir / PARTIAL_DIR).iterdir():
        if p.name not in keep:
            unlink_file(local_dir, p)


class Journal:
    """Append-only record of files proven during a run, so a killed run does not re-hash them."""

    def __init__(self, path: Path, root: Path):
        self.path = path
        self.root = root  # the target directory (fsutil's rule: no write through a link below it)
        self._lock = threading.Lock()

    def append(self, entry: FileEntry) -> None:
        line = (json.dumps(asdict(entry)) + "\n").encode()
        with self._lock:
            fd = open_file(self.root, self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def entries(self) -> dict[str, FileEntry]:
        out: dict[str, FileEntry] = {}
        if not check_inside(self.root, self.path).exists():
            return out
        for line in read_local_file(self.path, what="journal", max_bytes=MAX_JOURNAL).splitlines():
            try:
                entry = entry_from_dict(load_json(line, str(self.path)))
                check_model_path(entry.path, str(self.path))
                if entry.proven:
                    out[entry.path] = entry
            except BadInput:
                continue  # a line torn by a kill (or not mm's) is simply not trusted
        return out

    def clear(self) -> None:
        unlink_file(self.root, self.path)
