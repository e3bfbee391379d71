"""mm pull REF --local-dir DIR, and mm inspect REF: a ModelPack artifact from an OCI registry, proven on arrival.

The tag is resolved to a digest once; everything after uses that digest (a tag moved meanwhile cannot mix two
revisions). mm's manifest comes first (its own layer, cross-checked with the layers); then each file's blob is
streamed into DIR/.mm/partial/<sha256>.part (continued with Range after a kill), hashed in the pass that writes
it (sha256 against the layer digest, blake3 against the manifest), and named only when both match. The same
lock, free-space check, journal and atomic names as `mm fetch`, and the same ranged engine (artifacts/fetching/ranges.py:
a blob's missing ranges over several connections, every answer's offsets proven, a budget per file, a range map
beside the partial); it ends with the quick verify.
With --allowed-signers, the signature layer (a signed model's, modelpack.MM_SIGNATURE) is checked over the mm
manifest layer's exact bytes with ssh-keygen before anything is written (signing.py); --require-signature refuses
an unsigned artifact too. The pulled manifest records the registry as each file's source, so it is no longer the
signed bytes: the signature is checked at pull and reported, not stored beside it (sign again with `mm sign`).

With mirrors (`--mirror`, containerd's hosts semantics), every request (the manifest, each small blob, each
file's blob) goes to the mirrors in order with the reference's repository path, then to the reference's own
registry unless `no_fallback`. A mirror that is down, refuses, or serves bytes whose digest fails is named in the
report (Skipped) and the next source asked; a file's partial kept from a source that went down is continued
from the next one (every byte is still hashed, and the file named only when both digests match). Credentials
given for the reference (--username) go to its registry only; a mirror gets its own entry in the auth file, or
nothing.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

from ..fetching.download import (JOURNAL, PARTIAL_DIR, Journal, Partial, RemoteFile, fetch_into, known_entries,
                                 partial_path, prepare_dir)
from ..errors import BadInput, BadValue, IntegrityError, MMError, RemoteError
from ..edges.fsutil import check_targets, dir_lock, publish, require_free_space, still_to_write, unlink_file
from ..paths import manifest_path, state_root
from ..edges import interrupt
from ..integrity.manifest import FileEntry, Manifest, write_manifest
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from ..fetching.ranges import (DEFAULT_CONNECTIONS, Answer, Connections, RetryLater, TransferStats, clear_state,
                               http_answer, state_path)
from ..edges.untrusted import load_json
from . import modelpack
from .client import Client, Credentials, Transport, mirror_transport
from .reference import Reference, parse_reference


@dataclass(frozen=True)
class PulledFile:
    path: str
    size: int
    digest: str
    status: str  # "downloaded" | "present" | "failed"
    bytes_transferred: int = 0
    resumed_from: int = 0
    error: str | None = None
    error_kind: type[MMError] | None = None  # the failure's class; the CLI maps it to an exit code
    served_by: str | None = None  # the host whose bytes completed the file (a mirror or the registry)


@dataclass(frozen=True)
class PullReport:
    reference: str
    digest: str  # the manifest digest the tag resolved to
    source: str  # oci:REF@DIGEST, as recorded in the manifest
    repo_id: str
    revision: str
    local_dir: str
    manifest_path: str
    files: tuple[PulledFile, ...]
    removed: tuple[str, ...]  # files of an earlier pull that this artifact does not have
    bytes_transferred: int
    seconds: float
    verify_problems: tuple[str, ...]
    draft_present: bool
    draft_subfolder: str | None = None  # the pin's draft subfolder; None: the model's pin names no draft (or no pin)
    signature: dict | None = None  # the checked signature (identity, key type, fingerprint), with --allowed-signers
    skipped: tuple["Skipped", ...] = ()  # sources passed over (down, refusing, or serving bytes whose digest failed)
    transfer: dict | None = None  # requests, retries, bytes hashed from memory and read back (ranges.TransferStats)

    @property
    def failed(self) -> list[PulledFile]:
        return [f for f in self.files if f.status == "failed"]


@dataclass(frozen=True)
class InspectReport:
    reference: str
    digest: str
    artifact_type: str
    repo_id: str | None
    revision: str | None
    annotations: dict
    config: dict
    files: tuple[dict, ...]  # path, size, media_type, digest
    total_bytes: int
    mm_manifest: bool
    signed: bool | None  # None: not pushed by mm (no mm manifest layer), so no signature scheme is known


@dataclass(frozen=True)
class Skipped:
    source: str  # "mirror HOST" or "registry HOST"
    what: str  # a file's path, "the manifest", or a blob's digest
    reason: str


@dataclass(frozen=True)
class PullOptions:
    """How `mm pull` pulls, its rules checked once, by from_cli (pull takes it as it is): MIRRORS (host, transport)
    asked first, in order; NO_FALLBACK: never the reference's own registry; WORKERS: blobs at once;
    ALLOWED_SIGNERS: the manifest's signature is checked before anything is written (IntegrityError when it is not
    good; with REQUIRE_SIGNATURE when there is none either), by IDENTITY when given."""

    mirrors: tuple[tuple[str, Transport], ...] = ()
    no_fallback: bool = False
    workers: int = 4
    allowed_signers: Path | None = None
    identity: str | None = None
    require_signature: bool = False

    @classmethod
    def from_cli(cls, *, mirrors: Sequence[str], no_fallback: bool, transport: Transport, **options) -> PullOptions:
        """The options as `mm pull` was given them: each --mirror read (reference.parse_endpoint) with the
        transport it gets; BadValue when --no-fallback leaves no place to ask."""
        if no_fallback and not mirrors:
            raise BadValue("--no-fallback needs at least one --mirror")
        return cls(tuple(mirror_transport(m, "--mirror", transport) for m in mirrors), no_fallback, **options)


class Places:
    """Where an artifact is asked for, in order: each of MIRRORS with the reference's repository path, then the
    reference's own registry unless NO_FALLBACK. Offers the two calls `resolve` makes (get_manifest, read_blob),
    each trying the places in order; every place passed over is recorded in SKIPPED."""

    def __init__(self, ref: Reference, credentials: Credentials | None, transport: Transport,
                 mirrors: tuple[tuple[str, Transport], ...] = (), no_fallback: bool = False):
        from .client import load_credentials

        self.ref = ref
        self.places: list[tuple[str, Client]] = []
        try:
            for host, via in mirrors:
                # a mirror never gets the reference registry's credentials: only its own auth-file entry
                self.places.append((f"mirror {host}", Client(Reference(host, ref.repository), load_credentials(host),
                                                             via)))
            if not no_fallback:
                self.places.append((f"registry {ref.registry}", Client(ref, credentials, transport)))
        except BaseException:
            self.close()
            raise
        self.skipped: list[Skipped] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        for _, client in self.places:
            client.close()

    def __enter__(self) -> "Places":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def skip(self, label: str, what: str, reason: str) -> None:
        with self._lock:
            self.skipped.append(Skipped(label, what, reason))

    def _each(self, what: str, call):
        reasons, kind = [], RemoteError
        for label, client in self.places:
            try:
                return call(client)
            except (RemoteError, IntegrityError) as e:
                if len(self.places) == 1 and not label.startswith("mirror"):
                    raise  # no mirror: as without any
                reasons.append(f"{label}: {e.message}")
                kind = type(e)
                self.skip(label, what, e.message)
        raise kind(f"{self.ref}: no source served {what} ({'; '.join(reasons)})")

    def get_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        return self._each("the manifest", lambda c: c.get_manifest(Reference(c.ref.registry, ref.repository,
                                                                             ref.tag, ref.digest)))

    def read_blob(self, digest: str, limit: int) -> bytes:
        return self._each(digest, lambda c: c.read_blob(digest, limit))


@dataclass(frozen=True)
class Resolved:
    ref: Reference
    digest: str
    parsed: modelpack.Parsed
    config: dict
    manifest: Manifest | None  # mm's, from its layer (None for an artifact another tool pushed)
    mm_bytes: bytes | None = None  # the mm manifest layer's exact bytes
    signature: bytes | None = None  # the signature layer's bytes, when there is one


def resolve(client: "Client | Places", ref: Reference) -> Resolved:
    """The manifest (tag -> digest, once), the config and mm's manifest; all checked."""
    data, _, digest = client.get_manifest(ref)
    where = str(ref.at(digest))
    parsed = modelpack.parse(data, where)
    config = load_json(client.read_blob(parsed.config.digest, 4 * 1024 * 1024), f"{where} config blob",
                       what="config blob")
    manifest, mm_bytes, signature = None, None, None
    if parsed.mm_layer is not None:
        mm_bytes = client.read_blob(parsed.mm_layer.digest, modelpack.MAX_MM_MANIFEST)
        manifest = modelpack.restored_manifest(parsed, mm_bytes, where)
    if parsed.sig_layer is not None:
        from ..integrity.signing import MAX_SIG_BYTES
        signature = client.read_blob(parsed.sig_layer.digest, MAX_SIG_BYTES)
    return Resolved(ref, digest, parsed, config if isinstance(config, dict) else {}, manifest, mm_bytes, signature)


def _require_tag_or_digest(ref: Reference, text: str) -> None:
    if not ref.tag and not ref.digest:
        raise BadInput(f"{text}: give a tag or a digest (mm push tags with the short revision, e.g. {text}:ce7f4df87d2e)")


def inspect(reference: str, credentials: Credentials | None = None, transport: Transport = Transport()) -> InspectReport:
    ref = parse_reference(reference)
    _require_tag_or_digest(ref, reference)
    with Client(ref, credentials, transport) as client:
        r = resolve(client, ref)
    types = {layer.path: layer.media_type for layer in r.parsed.files}
    files = tuple({"path": layer.path, "size": layer.size, "media_type": types[layer.path], "digest": layer.digest}
                  for layer in sorted(r.parsed.files, key=lambda x: x.path))
    descriptor = r.config.get("descriptor") if isinstance(r.config.get("descriptor"), dict) else {}
    return InspectReport(
        reference=str(ref), digest=r.digest, artifact_type=modelpack.ARTIFACT_TYPE,
        repo_id=r.manifest.repo_id if r.manifest else descriptor.get("name"),
        revision=r.manifest.revision if r.manifest else r.parsed.annotations.get(modelpack.REVISION),
        annotations=r.parsed.annotations, config=r.config.get("config") or {}, files=files,
        total_bytes=r.parsed.total_bytes, mm_manifest=r.manifest is not None,
        signed=(r.parsed.sig_layer is not None) if r.manifest is not None else None)


def pull(reference: str, local_dir: Path, credentials: Credentials | None = None, transport: Transport = Transport(),
         options: PullOptions = PullOptions(), progress: ProgressSink = NULL_PROGRESS,
         draft_subfolder: str | None = None) -> PullReport:
    """Pull REFERENCE into LOCAL_DIR as OPTIONS say (PullOptions). DRAFT_SUBFOLDER: where the draft model lives;
    default the pin's (none for a model that never had one)."""
    from ..integrity.verify import verify_dir

    started = time.monotonic()
    local_dir = Path(local_dir)
    ref = parse_reference(reference)
    _require_tag_or_digest(ref, reference)
    with Places(ref, credentials, transport, options.mirrors, options.no_fallback) as places:
        r = resolve(places, ref)
        if r.manifest is None:
            raise BadInput(f"{ref.at(r.digest)}: no mm manifest layer ({modelpack.MM_MANIFEST}); mm pulls what mm "
                           f"pushed, so that every file has its blake3 and the Hub's identity")
        source = f"oci:{ref.at(r.digest)}"
        checked = _check_signature(r, options.allowed_signers, options.identity, options.require_signature)
        prepare_dir(local_dir, "mm pull")
        with dir_lock(local_dir, "mm pull"):
            interrupt.keeps(local_dir)  # an interrupt names the partial files kept here
            journal = Journal(local_dir / JOURNAL, local_dir)
            known = known_entries(local_dir)
            layers = {layer.path: layer for layer in r.parsed.files}
            wanted = r.manifest.files
            check_targets(local_dir, [f.path for f in wanted] + sorted(set(known) - set(r.manifest.by_path())))
            _clean_partials(local_dir, wanted)
            _check_free_space(local_dir, wanted, known)
            progress.begin(sum(f.size for f in wanted), f"pull {ref.repository}@{r.digest[7:19]}", files=len(wanted))

            # files with the same bytes share one blob and one partial: one worker takes them all, in turn
            groups: dict[str, list[FileEntry]] = {}
            for entry in wanted:
                groups.setdefault(layers[entry.path].digest, []).append(entry)

            digests = {path: layer.digest for path, layer in layers.items()}
            blobs = [BlobSource(client, digests, label, failover=i < len(places.places) - 1,
                                mirror=label.startswith("mirror"))
                     for i, (label, client) in enumerate(places.places)]
            budget = Connections(DEFAULT_CONNECTIONS)
            stats = TransferStats(retry_budget=max(64, 16 * options.workers))

            def one(group: list[FileEntry]) -> list[tuple[PulledFile, FileEntry | None]]:
                with working_on(progress, group[0].path):
                    return [_pull_file(blobs, places, local_dir, entry, known, source, progress, journal, budget,
                                       stats) for entry in group]

            try:
                with interrupt.worker_pool(options.workers) as pool:  # an interrupt starts no queued blob
                    results = [r for rs in pool.map(one, sorted(groups.values(), key=lambda g: -g[0].size)) for r in rs]
            finally:
                progress.end()
            got = {e.path: e for _, e in results if e is not None}
            removed: tuple[str, ...] = ()
            if len(got) == len(wanted):  # complete: the directory now holds this revision and nothing of another
                removed = _remove_other_revision(local_dir, known, r.manifest)
                write_manifest(r.manifest.with_files(list(got.values())), manifest_path(local_dir), root=state_root(local_dir))
                journal.clear()
    outcomes = tuple(sorted((o for o, _ in results), key=lambda o: o.path))
    problems: tuple[str, ...] = ()
    if not any(o.status == "failed" for o in outcomes):
        report = verify_dir(local_dir, quick=True)
        problems = tuple(f"{p.kind} {p.path}: {p.detail}" for p in report.failures)
    if draft_subfolder is None:
        from ..pins import pin_for_repo
        pin = pin_for_repo(r.manifest.repo_id)
        draft_subfolder = pin.draft_subfolder if pin is not None else None
    draft = (draft_subfolder or "").rstrip("/") + "/"
    return PullReport(
        reference=str(ref), digest=r.digest, source=source, repo_id=r.manifest.repo_id, revision=r.manifest.revision,
        local_dir=str(local_dir), manifest_path=str(manifest_path(local_dir)), files=outcomes, removed=removed,
        bytes_transferred=sum(o.bytes_transferred for o in outcomes), seconds=time.monotonic() - started,
        verify_problems=problems,
        draft_present=bool(draft_subfolder) and any(f.path.startswith(draft) and f.path.endswith(".safetensors")
                                                     for f in r.manifest.files),
        draft_subfolder=draft if draft_subfolder else None, signature=checked, skipped=tuple(places.skipped),
        transfer=stats.report())



def _check_signature(r: Resolved, allowed_signers: Path | None, identity: str | None, require: bool) -> dict | None:
    if allowed_signers is None or (r.signature is None and not require):
        return None
    from ..integrity.signing import verify_manifest_signature

    where = f"{r.ref.at(r.digest)}: {modelpack.MM_MANIFEST_PATH}"
    report = verify_manifest_signature(r.mm_bytes, r.signature, allowed_signers, identity, where=where,
                                       signature_where=f"{r.ref.at(r.digest)}: {modelpack.MM_SIGNATURE_PATH}")
    return {"identity": report.identity, "key_type": report.key_type, "fingerprint": report.fingerprint,
            "namespace": report.namespace, "allowed_signers": report.allowed_signers}


def _blob_file(entry: FileEntry) -> RemoteFile:
    """The engine's view of a layer: its identity is the sha256 (the layer digest), so its partial file is
    DIR/.mm/partial/<sha256>.part, where `mm fetch` keeps the same bytes' partial too."""
    return RemoteFile(entry.path, entry.size, blob_id=entry.sha256, lfs_sha256=entry.sha256)


def _present(local_dir: Path, entry: FileEntry, known: dict[str, FileEntry]) -> FileEntry | None:
    have = known.get(entry.path)
    final = local_dir / entry.path
    if (have and have.sha256 == entry.sha256 and have.blake3 == entry.blake3 and have.size == entry.size
            and final.is_file() and final.stat().st_size == entry.size):
        return have
    return None


def _clean_partials(local_dir: Path, wanted: tuple[FileEntry, ...]) -> None:
    keep = {p.name for f in wanted for p in (partial_path(local_dir, _blob_file(f)),
                                             state_path(partial_path(local_dir, _blob_file(f))))}
    for p in (local_dir / PARTIAL_DIR).iterdir():
        if p.name not in keep and p.suffix in (".part", ".ranges"):
            unlink_file(local_dir, p)


def _check_free_space(local_dir: Path, wanted, known) -> None:
    needed = 0
    for f in wanted:
        if _present(local_dir, f, known):
            continue
        partial = Partial.of(local_dir, _blob_file(f))
        needed += still_to_write(partial.path, f.size, partial.have)
    require_free_space([(local_dir, needed)], "the pull")


def _remove_other_revision(local_dir: Path, known: dict[str, FileEntry], manifest: Manifest) -> tuple[str, ...]:
    """Files an earlier manifest recorded that this artifact does not have: a pull leaves one revision, not two.
    Files mm never recorded are left alone (verify reports them as extra)."""
    keep = manifest.by_path()
    removed = []
    for path in sorted(set(known) - set(keep)):
        try:
            unlink_file(local_dir, local_dir / path, missing_ok=False)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
    return tuple(removed)


class BlobSource:
    """The artifact's blobs as a source for the ranged engine (ranges.RangeSource): a file's path names its layer,
    whose digest names the blob; each request is a ranged GET on its own connection (Client.open_blob).
    FAILOVER: another source follows, so a host that cannot be reached fails the file here at once (RemoteError),
    without the engine's backoff: the next source continues it (containerd's hosts do the same).
    MIRROR: a mirror (a site's pull-through cache, near the node) serves each blob as one stream, as containerd
    pulls a layer: its bytes arrive in order and are hashed from the receive buffer, none kept in memory or read
    back from the disk, and a node holds 4 connections (its workers) instead of 16-32. 32 nodes pulling 4 x 256 MiB
    from one registry on the 16-core host went from 0.42x to 0.84x curl's aggregate rate, 144 to 49 MB a node, and
    read back nothing (docs/fleet.md): nodes share the cores, where every extra receiving thread is GIL hand-offs
    and window copies."""

    def __init__(self, client: Client, digests: dict[str, str], label: str | None = None, failover: bool = False,
                 mirror: bool = False):
        self.client, self.digests, self.failover = client, digests, failover
        self.label = label or f"registry {client.ref.registry}"
        self.max_connections = 1 if mirror else None  # (read by ranges.download)

    @contextmanager
    def stream(self, path: str, start: int, end: int | None = None) -> Iterator[Answer]:
        digest = self.digests[path]
        try:
            with self.client.open_blob(digest, start, end) as raw:
                yield http_answer(raw, f"{self.client.ref.name}@{digest}")
        except RetryLater as e:  # ("connect": no connection at all; a body cut mid-way is a TransferCut, "cut")
            if self.failover and e.reason == "connect":
                raise RemoteError(e.message) from None
            raise


def _pull_file(sources: list[BlobSource], places: Places, local_dir: Path, entry: FileEntry,
               known: dict[str, FileEntry], source: str, progress: ProgressSink, journal: "Journal",
               budget: Connections, stats: TransferStats) -> tuple[PulledFile, FileEntry | None]:
    """ENTRY from the first of SOURCES that serves it whole and right; the ones before it are named in PLACES."""
    digest = sources[0].digests[entry.path]
    if _present(local_dir, entry, known):
        progress.advance(entry.size)
        return PulledFile(entry.path, entry.size, digest, "present"), known[entry.path]
    transferred = resumed = 0
    for i, blobs in enumerate(sources):
        try:
            moved, was = _download(blobs, local_dir, entry, digest, progress, budget, stats)
        except (RemoteError, IntegrityError) as e:
            if interrupt.requested() or i == len(sources) - 1 or isinstance(e, ManifestDisagrees):
                return PulledFile(entry.path, entry.size, digest, "failed", transferred, resumed, error=e.message,
                                  error_kind=type(e), served_by=blobs.label), None
            places.skip(blobs.label, entry.path, e.message)
            continue
        except MMError as e:
            return PulledFile(entry.path, entry.size, digest, "failed", transferred, resumed, error=e.message,
                              error_kind=type(e), served_by=blobs.label), None
        transferred, resumed = transferred + moved, resumed or was
        got = replace(entry, source=source)
        journal.append(got)
        return PulledFile(entry.path, entry.size, digest, "downloaded", transferred, resumed,
                          served_by=blobs.label), got
    raise AssertionError("not reached")


class ManifestDisagrees(IntegrityError):
    """The blob is the layer (its sha256 matched) but not the file the mm manifest describes: the artifact itself
    is wrong, whichever source serves it."""


def _download(blobs: BlobSource, local_dir: Path, entry: FileEntry, digest: str, progress: ProgressSink,
              budget: Connections, stats: TransferStats) -> tuple[int, int]:
    """Continue (or start) the blob's partial file with the ranged engine (every byte hashed once, sha256 checked
    against the layer digest), check blake3 against the pulled manifest, publish. Nothing below LOCAL_DIR is
    written through a link (fsutil's rule)."""
    blob = _blob_file(entry)
    partial = Partial.of(local_dir, blob)
    try:
        done = fetch_into(partial, blob, blobs, progress, connections=budget, stats=stats, root=local_dir)
    except IntegrityError:  # fetch_into dropped the partial
        raise IntegrityError(f"{entry.path}: blob {digest} from {blobs.label} does not match its digest; not "
                             f"kept") from None
    if done.digests.blake3 != entry.blake3:
        clear_state(partial.path, local_dir)
        raise ManifestDisagrees(f"{entry.path}: blake3 {done.digests.blake3[:16]} disagrees with the pulled mm manifest "
                             f"({entry.blake3[:16]}); not kept")
    publish(partial.path, local_dir / entry.path, root=local_dir)  # fsync, rename, fsync the directory
    unlink_file(local_dir, state_path(partial.path))
    return done.transferred, done.resumed_from
