"""mm push DIR REF: a verified model directory to an OCI registry as a ModelPack artifact.

Nothing is hashed again (the manifest has every file's sha256). Each blob: HEAD (the registry has it: skip),
else a cross-repository mount when told where from, else an upload: small files in one PUT, big ones in
PATCH chunks whose upload URL is saved after each chunk (DIR/.mm/oci-push/), so a run killed between chunks
continues from the offset the registry reports (GET on the upload URL). Several blobs go in parallel; the
manifest goes last, so the tag never names an artifact with missing blobs.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..edges import interrupt
from ..errors import BadInput, Refused, RemoteError
from ..paths import MM_DIR, manifest_path, state_root
from ..edges.fsutil import (atomic_write_text, check_inside, read_json_file, read_local_file, read_lock, remove_tree,
                            unlink_file)
from ..integrity.manifest import read_manifest, to_json
from ..edges.progress import NULL_PROGRESS, ProgressSink, working_on
from ..units import human_bytes
from . import modelpack
from .client import OCI_MANIFEST, Client, Credentials, Transport
from .reference import parse_reference

DEFAULT_CHUNK = 64 * 1024 * 1024
STATE_DIR = f"{MM_DIR}/oci-push"
# Single-blob limits of common registries (docs/registry.md, "Blobs above a registry's limits")
KRAKEN_ADVISED_MAX = 20 * 1000**3


@dataclass(frozen=True)
class BlobOutcome:
    path: str  # the file, ".mm/manifest.json" for mm's manifest layer, "(config)" for the config
    digest: str
    size: int
    status: str  # "present" | "mounted" | "uploaded"
    bytes_sent: int = 0
    resumed_from: int = 0


@dataclass(frozen=True)
class PushReport:
    reference: str  # host/repository:tag
    digest: str  # the manifest's digest: pull by REF@DIGEST to get exactly this
    tag: str
    repo_id: str
    revision: str
    blobs: tuple[BlobOutcome, ...]
    total_bytes: int
    bytes_sent: int
    seconds: float
    notes: tuple[str, ...]


@dataclass(frozen=True)
class PushOptions:
    credentials: Credentials | None = None
    transport: Transport = Transport()
    workers: int = 4
    chunk_size: int = DEFAULT_CHUNK
    mount_from: str | None = None
    max_blob_size: int | None = None


def push(model_dir: Path, reference: str, options: PushOptions = PushOptions(),
         progress: ProgressSink = NULL_PROGRESS) -> PushReport:
    """_push, with MODEL_DIR's reader's lock held throughout (fsutil.read_lock: `mm gc` keeps a revision being
    pushed)."""
    with read_lock(Path(model_dir), "mm push"):
        return _push(model_dir, reference, options, progress)


def _push(model_dir: Path, reference: str, options: PushOptions, progress: ProgressSink) -> PushReport:
    from ..integrity.verify import require_quick_verify

    started = time.monotonic()
    model_dir = Path(model_dir)
    ref = parse_reference(reference)
    if ref.digest:
        raise BadInput(f"{reference}: push takes a tag (or none: the short revision), not a digest")
    manifest = read_manifest(manifest_path(model_dir))
    require_quick_verify(model_dir, manifest, before="pushing")
    if options.chunk_size < 1024 * 1024:
        raise BadInput(f"--chunk-size {options.chunk_size}: at least 1 MiB")
    notes = []
    too_big = [f for f in manifest.files if options.max_blob_size is not None and f.size > options.max_blob_size]
    if too_big:
        named = ", ".join(f"{f.path} ({human_bytes(f.size)})" for f in too_big[:3])
        raise Refused(f"{model_dir}: {len(too_big)} file(s) above --max-blob-size {human_bytes(options.max_blob_size)}: "
                      f"{named}; nothing pushed (re-shard the checkpoint, or raise the registry's limit)")
    if any(f.size > KRAKEN_ADVISED_MAX for f in manifest.files) and options.max_blob_size is None:
        notes.append("a file is larger than 20 GB: some registries (Kraken) advise against such blobs; "
                     "see --max-blob-size")
    tag = ref.tag or manifest.revision[:12]
    mm_bytes, signature = _signed_manifest(model_dir, to_json(manifest).encode())
    artifact = modelpack.build(model_dir, manifest, mm_bytes, modelpack.model_config_fields(model_dir, manifest),
                               signature)
    state = _StateDir(model_dir, ref.registry, ref.repository)
    interrupt.keeps(model_dir)  # an interrupt names the upload state kept here
    sizes = {layer.digest: layer.size for layer in artifact.layers}
    total = sum(sizes.values()) + len(artifact.config)
    progress.begin(total, f"push {ref.repository}:{tag}", files=len(manifest.files))
    with Client(ref, options.credentials, options.transport, push=True, mount_from=options.mount_from) as client:
        client.ping()
        jobs: list[tuple[str, str, int, Path | bytes]] = []
        seen = set()
        for layer in artifact.layers:
            if layer.digest in seen:  # two files with the same bytes: one blob
                continue
            seen.add(layer.digest)
            data = {modelpack.MM_MANIFEST: artifact.mm_manifest, modelpack.MM_SIGNATURE: artifact.signature}.get(
                layer.media_type) or model_dir / layer.path
            jobs.append((layer.path, layer.digest, layer.size, data))
        jobs.append(("(config)", artifact.config_digest, len(artifact.config), artifact.config))
        # big blobs first: the run ends when the last big one does, not after a tail of small ones
        jobs.sort(key=lambda j: -j[2])

        def one(job: tuple[str, str, int, Path | bytes]) -> BlobOutcome:
            with working_on(progress, job[0]):
                return _push_blob(client, state, options, progress, *job)

        try:
            with interrupt.worker_pool(options.workers) as pool:  # an interrupt starts no queued blob
                outcomes = list(pool.map(one, jobs))
        finally:
            progress.end()
        digest = client.put_manifest(tag, artifact.manifest, OCI_MANIFEST)
    if digest != artifact.manifest_digest:
        raise RemoteError(f"{ref.name}:{tag}: manifest digest changed on upload")
    state.clear()
    return PushReport(reference=f"{ref.name}:{tag}", digest=digest, tag=tag, repo_id=manifest.repo_id,
                      revision=manifest.revision, blobs=tuple(outcomes), total_bytes=total,
                      bytes_sent=sum(o.bytes_sent for o in outcomes), seconds=time.monotonic() - started,
                      notes=tuple(notes))


def _signed_manifest(model_dir: Path, rendered: bytes) -> tuple[bytes, bytes | None]:
    """(the mm manifest layer's bytes, the signature layer's bytes or None). A signed model's layer is the manifest
    file's exact bytes (what the signature covers); a signature that no longer matches them is refused."""
    from ..integrity.manifest import MAX_MANIFEST_BYTES
    from ..integrity.signing import check_signature_matches, read_signature_file, signature_path

    sig_path = signature_path(model_dir)
    if (signature := read_signature_file(sig_path)) is None:
        return rendered, None
    data = read_local_file(manifest_path(model_dir), what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    check_signature_matches(data, signature, str(sig_path))
    return data, signature


def _push_blob(client: Client, state: "_StateDir", options: PushOptions, progress: ProgressSink,
               path: str, digest: str, size: int, data: Path | bytes) -> BlobOutcome:
    if client.blob_size(digest) is not None:
        state.forget(digest)
        progress.advance(size)
        return BlobOutcome(path, digest, size, "present")
    location, offset = None, 0
    saved = state.location(digest)
    if saved:
        status = client.upload_offset(saved)
        if status is not None and status[0] <= size:
            offset, location = status
    resumed_from = offset
    if location is None and options.mount_from:
        location = client.mount(digest, options.mount_from)
        if location is None:
            state.forget(digest)
            progress.advance(size)
            return BlobOutcome(path, digest, size, "mounted")
    if location is None:
        location = client.start_upload()
    progress.advance(offset)
    if isinstance(data, bytes):
        client.finish_upload(location, digest, data)
        progress.advance(size)
        return BlobOutcome(path, digest, size, "uploaded", len(data))
    sent = 0
    if offset == 0 and size <= options.chunk_size:
        client.finish_upload(location, digest, path=data, length=size, on_bytes=progress.advance)
        return BlobOutcome(path, digest, size, "uploaded", size)
    while offset < size:
        interrupt.check()  # between chunks: the upload URL saved after the last one resumes it (interrupt.py)
        length = min(options.chunk_size, size - offset)
        new_offset, location = client.patch(location, data, offset, length, progress.advance)
        sent += length
        if new_offset != offset + length:
            raise RemoteError(f"{client.ref.name}: {path}: registry holds {new_offset} bytes after a chunk ending at "
                              f"{offset + length}; run again to resume")
        offset = new_offset
        state.save(digest, location)
        _test_pause()
    client.finish_upload(location, digest)
    state.forget(digest)
    return BlobOutcome(path, digest, size, "uploaded", sent, resumed_from)


def _test_pause() -> None:
    """Tests only: MM_TEST_OCI_CHUNK_PAUSE=seconds holds still after each saved chunk, so a kill -9 can land
    between chunks (distribution cancels an upload killed mid-chunk; docs/registry.md, "Resume of a push")."""
    pause = os.environ.get("MM_TEST_OCI_CHUNK_PAUSE")
    if pause:
        interrupt.STOP.wait(float(pause))


class _StateDir:
    """DIR/.mm/oci-push/<registry+repository key>/<digest hex>.json: the upload URL after the last whole chunk.

    Upload URLs carry the registry's signed upload state, never credentials. A read-only model directory
    just pushes without resume state."""

    def __init__(self, model_dir: Path, registry: str, repository: str):
        from ..paths import state_dir  # a Hugging Face cache snapshot keeps its state outside the cache

        key = hashlib.sha256(f"{registry}/{repository}".encode()).hexdigest()[:16]
        self.root = state_dir(model_dir, MM_DIR) / STATE_DIR.removeprefix(f"{MM_DIR}/")
        self.dir = self.root / key
        self.base = state_root(model_dir)  # nothing below it is written through a link (fsutil's rule)

    def _path(self, digest: str) -> Path:
        return self.dir / f"{digest.split(':', 1)[1]}.json"

    def location(self, digest: str) -> str | None:
        try:
            doc = read_json_file(check_inside(self.base, self._path(digest)), what="upload state",
                                 max_bytes=64 * 1024)
            return doc["location"] if isinstance(doc.get("location"), str) else None
        except (BadInput, KeyError, AttributeError):  # a state that is not ours is no state: the upload starts over
            return None

    def save(self, digest: str, location: str) -> None:
        try:
            atomic_write_text(self._path(digest), json.dumps({"location": location}) + "\n", root=self.base)
        except OSError:
            pass

    def forget(self, digest: str) -> None:
        try:
            unlink_file(self.base, self._path(digest))
        except OSError:
            pass

    def clear(self) -> None:
        try:
            remove_tree(self.base, self.dir)
        except OSError:
            pass
        try:
            self.root.rmdir()
        except OSError:
            pass
