"""Verify a model directory: every byte against the manifest (or the Hub's own identities), every
file present, every safetensors shard and index structurally sound; files nobody expects are reported (and
fail only with strict, as `hf cache verify --fail-on-extra-files` does). A partial fetch is judged on what
was asked for: what its manifest records as left out is named, not missed.

Speed: each byte is read once. Sizes are compared first (a size mismatch is already a verdict, and
mapping a file shorter than expected risks SIGBUS). Files are then hashed one per core with
single-threaded blake3 (measured: ~7% less CPU than spreading each file over all cores as b3sum
does): shards of one model are about the same size, so rounds of them keep every core busy. Large
files left over, too few or too unequal to fill a round, are hashed one at a time on all cores, and
files smaller than SMALL_FILE one at a time in one thread. Never more threads than cores. Memory stays
bounded whatever the model size and the core count: the windows in use at once (hashing.blake3_file)
share WINDOW_BUDGET bytes, so each of JOBS threads hashing a file of its own gets its part (measured on
16 cores, 32 shards of 256 MiB: peak RSS 421 MB with 32 MiB a thread, 387 MB of it mapped file pages;
87 MB with this, at the same speed).
The structure checks read headers through safetensors.deserialize, so no verify imports numpy (~70 ms of CPU).
"""
from __future__ import annotations

import os
import posixpath
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

from ..errors import BadInput, BadValue, Busy, QuickVerifyFailed
from ..paths import MM_DIR, Snapshot, manifest_path, snapshot_of, state_dir
from ..edges.fsutil import check_relpath, is_model_file, lock_holder, read_local_file, read_lock
from ..edges.interrupt import usable_cores
from .manifest import Manifest, read_manifest
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from ..edges.untrusted import MAX_DOCUMENT, Malformed, load_json
from .reading import (BIG_FILE, MAX_WINDOW, MIN_WINDOW, ROUND_SPREAD, SMALL_FILE, WINDOW_BUDGET,  # noqa: F401
                      hash_schedule, window_size)
from .safetensors_check import StructureError, index_faults, read_header, read_weight_map

if TYPE_CHECKING:
    from .early import HeadStart

# Problems a re-download fixes; the others (extra files, symlinks, structure of good bytes) it cannot.
REPAIRABLE = frozenset({"missing", "size", "hash", "empty", "unreadable"})
# Reported, but a failure only when asked for (--strict): a user's own file beside the model is no damage.
LENIENT = frozenset({"extra"})
SHORT = 12  # hex digits shown of a digest
T = TypeVar("T")
R = TypeVar("R")
_END = object()


@dataclass(frozen=True)
class Problem:
    path: str  # relative POSIX path in the model dir (or the manifest/index file)
    kind: str  # "missing" | "size" | "hash" | "extra" | "empty" | "unreadable" | "changed" | "symlink" | "structure" | "index" | "draft"
    #         | "manifest" (the manifest itself: it lists no file)
    detail: str  # expected vs found, one line


@dataclass(frozen=True)
class VerifyReport:
    model_dir: str
    manifest_path: str
    quick: bool
    files_checked: int
    bytes_checked: int
    seconds: float
    problems: tuple[Problem, ...]
    strict: bool = False  # extra files fail too
    left_out: tuple[str, ...] = ()  # a partial fetch: the revision's files not asked for (not judged)
    asked: str | None = None  # a partial fetch: what was asked for, e.g. "--include '*.json'"

    @property
    def failures(self) -> tuple[Problem, ...]:
        """The problems that make the verdict DAMAGED (extra files only with strict)."""
        return self.problems if self.strict else tuple(p for p in self.problems if p.kind not in LENIENT)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_checked / self.seconds if self.seconds > 0 else 0.0

    def repairable(self) -> frozenset[str]:
        """Paths a fresh download would fix."""
        return frozenset(p.path for p in self.problems if p.kind in REPAIRABLE)


@dataclass(frozen=True, slots=True)
class Expected:
    """What one file must be: its size and one digest, from the manifest or from the Hub."""

    path: str
    size: int
    algorithm: str  # "blake3" (manifest) | "lfs-sha256" | "git-blob-sha1" (the Hub's identities)
    digest: str


@dataclass(frozen=True)
class VerifyOptions:
    """What `mm verify` is asked, its rules checked once, by from_cli: against MANIFEST_FILE (default: the model's
    own) with verify_dir, or with UPSTREAM against the Hub's listing of REPO at REVISION (default: the manifest's;
    fetching.hub.verify_upstream). QUICK: no hashing; STRICT: extra files fail; JOBS: threads; LABEL_NODE: the
    node a passing full verify of the model's own manifest labels."""

    quick: bool = False
    strict: bool = False
    jobs: int | None = None
    manifest_file: Path | None = None
    upstream: bool = False
    repo: str | None = None
    revision: str | None = None
    label_node: str | None = None

    @classmethod
    def from_cli(cls, *, allowed_signers: Path | None = None, **options) -> VerifyOptions:
        """The options as `mm verify` was given them, or BadValue naming the rule they break. ALLOWED_SIGNERS
        (checked against the manifest) takes part in one rule."""
        given = cls(**options)
        if given.label_node and (given.quick or given.upstream or given.manifest_file):
            raise BadValue("--label-node needs a full verify of DIR against its own manifest "
                           "(no --quick, --upstream or --manifest)")
        if given.upstream and allowed_signers:
            raise BadValue("--allowed-signers checks the manifest; --upstream does not use it")
        if not given.upstream and (given.repo or given.revision):
            raise BadValue("--repo and --revision only apply with --upstream")
        return given


# --- entry points ------------------------------------------------------------------------------

def verify_dir(model_dir: Path, manifest: Manifest | None = None, *, quick: bool = False, jobs: int | None = None,
               progress: ProgressSink = NULL_PROGRESS, manifest_file: Path | None = None,
               strict: bool = False, rehash: frozenset[str] | None = None,
               head_start: bool = False) -> VerifyReport:
    """Check MODEL_DIR against MANIFEST (default: the one beside the model, or MANIFEST_FILE). STRICT: extra
    files fail the verdict too. A partial manifest's left-out files are not judged (nor what names them).
    REHASH: hash only these paths (repair's re-verify: the rest was hashed just before and not rewritten);
    every file is still checked for presence, size and structure.

    PROVEN: paths whose content the caller proved against this manifest itself (unbundle hashed them on their way
    to disk): checked like every file for presence, size, readability and structure, but not read again.

    HEAD_START: take the digests the console script began for exactly this verify, if any (early.py); files
    whose identity changed since are hashed again.

    Raises BadInput when it cannot run (no manifest, unreadable directory); damage is returned as problems.
    """
    model_dir = Path(model_dir)
    check_readable_dir(model_dir)
    manifest_file = Path(manifest_file) if manifest_file else manifest_path(model_dir)
    with read_lock(model_dir, "verify", "verify when it has finished"):
        head = None
        if head_start:
            from .early import HeadStartKey, claim
            head = claim(HeadStartKey.of(model_dir, manifest_file, max(1, jobs or usable_cores())))
        try:
            if head is not None and quick:  # nothing hashed: not a byte more
                head.stop()
                head = None
            if manifest is None:
                manifest = read_manifest(manifest_file)
            expected = [Expected(f.path, f.size, "blake3", f.blake3) if f.blake3 is not None
                        else Expected(f.path, f.size, f.upstream.kind, f.upstream.value) for f in manifest.files]
            report = _verify(model_dir, expected, str(manifest_file), quick=quick, jobs=jobs, progress=progress,
                             ignore=_inside(model_dir, manifest_file), rehash=rehash,
                             left_out=frozenset(manifest.partial.left_out if manifest.partial else ()), head=head)
        finally:
            if head is not None:
                head.stop()
    if not manifest.files:  # a model is at least one file: an emptied manifest would vouch for anything beside it
        report = replace(report, problems=(Problem(_inside(model_dir, manifest_file) or str(manifest_file), "manifest",
                                                   "lists no file, and a model is at least one: an emptied "
                                                   "manifest (write it again with `mm manifest`)"), *report.problems))
    partial = manifest.partial
    return replace(report, strict=strict, left_out=partial.left_out if partial else (),
                   asked=partial.asked() if partial else None)


def require_quick_verify(model_dir: Path, manifest: Manifest | None = None, *, before: str) -> None:
    """The one quick-verify gate (presence, sizes, readability, shard headers) in front of `mm bundle`,
    `mm launch` (and next `mm push`): raises QuickVerifyFailed naming the first problems. BEFORE names
    what is refused, e.g. "bundling"."""
    report = verify_dir(model_dir, manifest, quick=True)
    if not report.ok:
        from .provenance import import_remedy
        failures = report.failures
        named = ", ".join(f"{p.path} ({p.kind}: {p.detail})" for p in failures[:3])
        more = f" and {len(failures) - 3} more" if len(failures) > 3 else ""
        remedy = import_remedy(model_dir, damaged=len(failures)) or f"run `mm verify {model_dir}` (or `mm repair`)"
        raise QuickVerifyFailed(f"{model_dir}: quick verify found {len(failures)} problem(s): {named}{more}; "
                                f"{remedy} before {before}")
    manifest = manifest or read_manifest(manifest_path(model_dir))
    if unproven := manifest.unproven:  # listed by the revision, never fetched and proven here
        raise QuickVerifyFailed(f"{model_dir}: {len(unproven)} file(s) of the revision were never fetched and proven "
                                f"here (e.g. {unproven[0].path}); run `mm repair {model_dir}` before {before}")


def verify_listing(model_dir: Path, expected: list[Expected], source: str, listing: str, *, quick: bool = False,
                   jobs: int | None = None, progress: ProgressSink = NULL_PROGRESS, strict: bool = False) -> VerifyReport:
    """Check MODEL_DIR against EXPECTED, a listing that is no manifest (the Hub's: fetching.hub.verify_upstream);
    SOURCE names where it came from, LISTING what it is, in the report."""
    model_dir = Path(model_dir)
    check_readable_dir(model_dir)
    with read_lock(model_dir, "verify", "verify when it has finished"):
        report = _verify(model_dir, expected, source, quick=quick, jobs=jobs, progress=progress, listing=listing)
    return replace(report, strict=strict)


# --- the run -----------------------------------------------------------------------------------

@dataclass
class _Scan:
    sizes: dict[str, int] = field(default_factory=dict)  # model files (and symlinks to files inside)
    problems: list[Problem] = field(default_factory=list)
    flagged: set[str] = field(default_factory=set)  # paths already judged (escaping symlinks, unreadable)
    def judged(self, rel: str) -> bool:
        """Already reported, itself or a directory above it (an unlistable dir, a symlink leaving)."""
        return rel in self.flagged or (bool(self.flagged) and any(rel.startswith(d + "/") for d in self.flagged))


def _verify(model_dir: Path, expected: list[Expected], source: str, *, quick: bool, jobs: int | None,
            progress: ProgressSink, ignore: str | None = None, listing: str = "the manifest",
            left_out: frozenset[str] = frozenset(), rehash: frozenset[str] | None = None,
            head: HeadStart | None = None) -> VerifyReport:
    started = head.started if head is not None else time.perf_counter()  # from the first byte hashed
    jobs = max(1, jobs or usable_cores())
    scan = _scan(model_dir, ignore)
    problems = list(scan.problems)
    to_hash: list[Expected] = []
    missing: list[Expected] = []
    examined = 0
    for exp in expected:
        if scan.judged(exp.path):
            continue
        examined += 1
        found = scan.sizes.get(exp.path)
        if found is None:
            missing.append(exp)
            problems.append(Problem(exp.path, "missing", f"expected {exp.size} bytes, no such file"))
        elif found != exp.size:
            problems.append(_size_problem(exp, found))
        elif rehash is None or exp.path in rehash:
            to_hash.append(exp)
    listed = {e.path for e in expected}
    extras = sorted(p for p in scan.sizes if p not in listed)
    del listed
    problems += _extra_problems(model_dir, extras, missing, scan.sizes, quick, listing)

    broken: set[str] = {p.path for p in problems}
    if quick:
        problems += _unreadable(model_dir, [e.path for e in to_hash])
        bytes_checked = 0
    else:
        hash_problems, bytes_checked = _hash_all(model_dir, to_hash, jobs, progress, head)
        problems += hash_problems
    broken |= {p.path for p in problems if p.kind in ("unreadable", "empty", "size")}
    problems += _structure(model_dir, scan.sizes, broken, jobs, left_out)
    return VerifyReport(
        model_dir=str(model_dir), manifest_path=source, quick=quick,
        files_checked=examined - len(missing), bytes_checked=bytes_checked,
        seconds=time.perf_counter() - started,
        problems=tuple(sorted(problems, key=lambda p: (p.path, p.kind, p.detail))),
    )


def check_readable_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a directory (nothing to verify)")
    try:
        with os.scandir(model_dir):
            pass
    except OSError as e:
        raise BadInput(f"{model_dir}: cannot read the model directory: {e.strerror}") from None


def _inside(model_dir: Path, path: Path) -> str | None:
    try:
        return Path(os.path.abspath(path)).relative_to(os.path.abspath(model_dir)).as_posix()
    except ValueError:
        return None


def _scan(model_dir: Path, ignore: str | None) -> _Scan:
    """Every model file under MODEL_DIR with its size; symlinks leaving the directory are problems (in a
    Hugging Face cache snapshot, links to files of that repo's blobs/ read as those files)."""
    root = os.path.realpath(model_dir)
    snapshot = snapshot_of(model_dir)
    scan = _Scan()
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            entries = list(os.scandir(os.path.join(model_dir, rel_dir)))
        except OSError as e:
            scan.problems.append(Problem(rel_dir, "unreadable", f"directory cannot be listed: {e.strerror}"))
            scan.flagged.add(rel_dir)
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if not is_model_file(rel + "/") or rel == ignore:  # "/": a directory named like a prefix counts too
                continue
            try:
                if entry.is_symlink():
                    _judge_symlink(entry.path, rel, root, scan, snapshot)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    scan.sizes[rel] = entry.stat(follow_symlinks=False).st_size
                else:
                    scan.flagged.add(rel)
                    scan.problems.append(Problem(rel, "unreadable", "not a regular file"))
            except OSError as e:
                scan.flagged.add(rel)
                scan.problems.append(Problem(rel, "unreadable", f"cannot stat: {e.strerror}"))
    return scan


def _judge_symlink(full: str, rel: str, root: str, scan: _Scan, snapshot: Snapshot | None = None) -> None:
    target = os.path.realpath(full)
    if snapshot is not None and snapshot.allows(target):
        scan.sizes[rel] = os.stat(target).st_size  # the one allowance: hf's link to its own blob
        return
    if os.path.commonpath([root, target]) != root:
        scan.flagged.add(rel)
        scan.problems.append(Problem(rel, "symlink", f"points outside the model directory, to {target}"))
        return
    try:
        st = os.stat(full)
    except OSError:
        scan.flagged.add(rel)
        scan.problems.append(Problem(rel, "symlink", f"dangling symlink to {os.readlink(full)}"))
        return
    if stat.S_ISREG(st.st_mode):
        scan.sizes[rel] = st.st_size  # a link to a file inside the directory reads as that file
    # a link to a directory inside is walked under its real name


def _size_problem(exp: Expected, found: int) -> Problem:
    if found == 0:
        return Problem(exp.path, "empty", f"expected {exp.size} bytes, found an empty file")
    delta = found - exp.size
    how = f"{-delta} bytes short (truncated?)" if delta < 0 else f"{delta} bytes too long (appended to?)"
    return Problem(exp.path, "size", f"expected {exp.size} bytes, found {found}: {how}")


def _extra_problems(model_dir: Path, extras: list[str], missing: list[Expected], sizes: dict[str, int],
                    quick: bool, listing: str) -> list[Problem]:
    """Files nobody expects; when one matches a missing file's size (and digest), say it looks renamed."""
    by_size: dict[int, list[Expected]] = {}
    for exp in missing:
        by_size.setdefault(exp.size, []).append(exp)
    problems = []
    for rel in extras:
        detail = f"not in {listing}" + (" (empty file)" if sizes[rel] == 0 else "")
        for exp in by_size.get(sizes[rel], []):
            if quick:
                detail += f"; same size as missing {exp.path} (renamed?)"
                break
            if _digest_matches(model_dir / rel, exp):
                detail += f"; same bytes as missing {exp.path} (renamed?)"
                break
        problems.append(Problem(rel, "extra", detail))
    return problems


def _digest_matches(path: Path, exp: Expected) -> bool:
    from blake3 import blake3

    from .hashing import ChangedDuringRead

    try:
        return _digest(path, exp, blake3.AUTO, None) == exp.digest
    except (OSError, ChangedDuringRead):
        return False


def _digest(path: str | Path, exp: Expected, threads: int, on_bytes: Callable[[int], None] | None,
            window: int = MAX_WINDOW) -> str:
    # hashing (and blake3's native module) loads with the first file hashed: a quick verify hashes none
    from .hashing import SLICE, blake3_file, upstream_digest

    if exp.algorithm == "blake3":
        return blake3_file(path, threads, on_bytes, window=window)
    # sha256/sha1 have no inner threads: one file a thread, each in its part of the budget
    return upstream_digest(path, exp.algorithm, on_bytes, window=min(window, SLICE))


def _hash_all(model_dir: Path, files: list[Expected], jobs: int, progress: ProgressSink,
              head: HeadStart | None = None) -> tuple[list[Problem], int]:
    """Hash every file whose size already matched (see the module docstring for the schedule); with HEAD, the
    files it hashed and that are still the files it read are judged on its digests."""
    from blake3 import blake3

    progress.begin(sum(e.size for e in files), "verify", files=len(files))
    try:
        results = []
        if head is not None:
            early = head.join(progress)
            rest = []
            for exp in files:
                got = early.get(exp.path) if exp.algorithm == "blake3" else None
                if got is not None and _identity(model_dir, exp.path) == got.identity:
                    results.append(_judge(exp, got.blake3))
                else:
                    rest.append(exp)
            files = rest
        per_core, one_at_a_time = hash_schedule(files, jobs)
        threads = blake3.AUTO if jobs == usable_cores() else jobs
        window = window_size(jobs)
        results += _in_parallel(per_core, lambda e: _check_one(model_dir, e, 1, progress, window), jobs)
        results += [_check_one(model_dir, e, threads if e.size >= BIG_FILE else 1, progress)
                    for e in one_at_a_time]
    finally:
        progress.end()
    problems = [p for p, _ in results if p is not None]
    return problems, sum(n for _, n in results)


def _identity(model_dir: Path, rel: str) -> tuple[int, ...] | None:
    from .early import file_id
    try:
        return file_id(os.stat(os.path.join(model_dir, rel)))
    except OSError:
        return None


def _check_one(model_dir: Path, exp: Expected, threads: int, progress: ProgressSink,
               window: int = MAX_WINDOW) -> tuple[Problem | None, int]:
    with working_on(progress, exp.path):  # several files are checked at once: the bar names those in flight
        return _check_file(model_dir, exp, threads, progress, window)


def _check_file(model_dir: Path, exp: Expected, threads: int, progress: ProgressSink,
                window: int) -> tuple[Problem | None, int]:
    from .hashing import ChangedDuringRead

    try:
        got = _digest(os.path.join(model_dir, exp.path), exp, threads, progress.advance, window)
    except OSError as e:
        return Problem(exp.path, "unreadable", f"cannot be read: {e.strerror or e}"), 0
    except ChangedDuringRead:
        return Problem(exp.path, "changed", "changed during verify (another process cut it or opened it for "
                                            "writing while it was hashed); verify again when nothing writes it"), 0
    return _judge(exp, got)


def _judge(exp: Expected, got: str) -> tuple[Problem | None, int]:
    """EXP against GOT, its file's digest: (the problem or None, bytes hashed)."""
    if got == exp.digest:
        return None, exp.size
    name = {"blake3": "blake3", "lfs-sha256": "sha256 (Hub LFS)", "git-blob-sha1": "git blob sha1 (Hub)"}[exp.algorithm]
    return Problem(exp.path, "hash", f"{name} expected {exp.digest[:SHORT]}…, found {got[:SHORT]}…: content differs"), exp.size


def _unreadable(model_dir: Path, paths: list[str]) -> list[Problem]:
    """--quick reads no content but still proves each file can be opened (microseconds a file: no threads)."""
    problems = []
    for rel in paths:
        try:
            os.close(os.open(os.path.join(model_dir, rel), os.O_RDONLY | os.O_NONBLOCK))
        except OSError as e:
            problems.append(Problem(rel, "unreadable", f"cannot be read: {e.strerror}"))
    return problems


def _in_parallel(items: list[T], fn: Callable[[T], R], jobs: int) -> list[R]:
    """fn over ITEMS on JOBS threads pulling from one shared queue: no per-item task overhead, and
    a long file on one thread does not hold back the others. Results come in no particular order."""
    if jobs == 1 or len(items) < 2:
        return [fn(item) for item in items]
    queue = iter(items)
    lock = threading.Lock()
    batches: list[list[R]] = [[] for _ in range(jobs)]
    failures: list[BaseException] = []

    def worker(done: list[R]) -> None:
        try:
            while not failures:
                with lock:
                    item = next(queue, _END)
                if item is _END:
                    return
                done.append(fn(item))
        except BaseException as e:  # re-raised in the caller's thread below
            failures.append(e)

    # Plain threads, not concurrent.futures: its import (with logging) costs ~10 ms of every verify's start-up.
    threads = [threading.Thread(target=worker, args=(batch,)) for batch in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return [r for batch in batches for r in batch]


# --- structure ---------------------------------------------------------------------------------

def _structure(model_dir: Path, sizes: dict[str, int], broken: set[str], jobs: int,
               left_out: frozenset[str] = frozenset()) -> list[Problem]:
    """Shard headers, index files against those headers, and the draft the config names; shards and a draft
    that a partial fetch LEFT_OUT are not asked for."""
    shards = [rel for rel in sizes if rel.endswith(".safetensors") and rel not in broken]
    headers: dict[str, frozenset[str] | None] = {}  # None: unreadable or malformed (already reported)
    problems = []

    def parse(rel: str) -> tuple[str, frozenset[str] | None, Problem | None]:
        try:
            return rel, read_header(model_dir / rel).tensors, None
        except StructureError as e:
            return rel, None, Problem(rel, "structure", str(e))
        except OSError as e:
            return rel, None, Problem(rel, "unreadable", f"cannot be read: {e.strerror}")

    for rel, tensors, problem in _in_parallel(shards, parse, jobs):
        headers[rel] = tensors
        if problem is not None:
            problems.append(problem)
    for rel in sorted(sizes):
        if rel.endswith(".safetensors.index.json") and rel not in broken:
            problems += _index_problems(model_dir, rel, sizes, headers, broken, left_out)
    problems += _draft_problems(model_dir, sizes, broken, left_out)
    return problems


def _index_problems(model_dir: Path, index_rel: str, sizes: dict[str, int],
                    headers: dict[str, frozenset[str] | None], broken: set[str],
                    left_out: frozenset[str] = frozenset()) -> list[Problem]:
    try:
        weight_map = read_weight_map(model_dir / index_rel)
    except StructureError as e:
        return [Problem(index_rel, "index", str(e))]
    except OSError as e:
        return [Problem(index_rel, "unreadable", f"cannot be read: {e.strerror}")]
    base = posixpath.dirname(index_rel)
    shard_tensors: dict[str, frozenset[str] | None] = {}
    problems = []
    for shard in sorted(set(weight_map.values())):
        rel = posixpath.join(base, shard) if base else shard
        try:
            check_relpath(rel, index_rel)
        except BadInput as e:
            problems.append(Problem(index_rel, "index", f"names shard {shard!r}: {e.message}"))
            continue
        if rel in left_out and rel not in sizes:
            continue  # not asked for (a partial fetch): not compared
        if rel not in sizes:
            shard_tensors[shard] = None
        elif rel not in broken and headers.get(rel) is not None:
            shard_tensors[shard] = headers[rel]
    problems += [Problem(index_rel, "index", fault.detail) for fault in index_faults(weight_map, shard_tensors)]
    return problems


DRAFT_KEYS = ("draft_subfolder", "draft_model_subfolder", "subfolder")


def draft_subfolder(config: dict) -> str | None:
    """The draft directory a config.json names (speculative_config), e.g. "dspark", or None."""
    spec = config.get("speculative_config")
    if not isinstance(spec, dict):
        return None
    for key in DRAFT_KEYS:
        if isinstance(spec.get(key), str) and spec[key].strip("/"):
            return spec[key].strip("/")
    if str(spec.get("algorithm", "")).upper() == "DSPARK":
        return "dspark"
    return None


def _draft_problems(model_dir: Path, sizes: dict[str, int], broken: set[str],
                    left_out: frozenset[str] = frozenset()) -> list[Problem]:
    if "config.json" not in sizes or "config.json" in broken:
        return []
    try:
        config = load_json(read_local_file(model_dir / "config.json", what="config.json", max_bytes=MAX_DOCUMENT),
                           "config.json")
    except OSError as e:
        return [Problem("config.json", "unreadable", f"cannot be read: {e.strerror or e}")]
    except Malformed as e:
        return [Problem("config.json", "structure", e.detail)]
    except BadInput as e:  # not a regular file, or larger than a config can be
        return [Problem("config.json", "unreadable", e.message.split(": ", 1)[-1])]
    if not isinstance(config, dict):
        return [Problem("config.json", "structure", "not a JSON object")]
    sub = draft_subfolder(config)
    if sub is None or sub in broken:  # e.g. a symlink leaving the directory: reported as such
        return []
    if any(rel.startswith(sub + "/") for rel in left_out):  # a partial fetch left (part of) the draft out
        return []
    inside = [rel for rel in sizes if rel.startswith(sub + "/")]
    lacking = [what for what, ok in (("config.json", f"{sub}/config.json" in inside),
                                     ("safetensors weights", any(r.endswith(".safetensors") for r in inside))) if not ok]
    if not lacking:
        return []
    where = f"{sub}/ is missing" if not inside else f"{sub}/ has no {' and no '.join(lacking)}"
    return [Problem("config.json", "draft", f"names draft {sub}/ (speculative_config) but {where}")]


def summary_counts(problems: Iterable[Problem]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


def upstream_target(directory: Path, manifest_file: Path | None, repo: str | None, revision: str | None) -> tuple[str, str]:
    """The repo and revision `verify --upstream` checks: the options, else the manifest's."""
    if repo and revision:
        return repo, revision
    mpath = manifest_file or manifest_path(directory)
    if not mpath.exists():
        raise BadInput(f"{directory}: --upstream needs a repo and revision: pass --repo and --revision, "
                       f"or keep the manifest at {mpath}")
    m = read_manifest(mpath)
    return repo or m.repo_id, revision or m.revision
