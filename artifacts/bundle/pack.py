"""mm bundle: pack a verified model (plus optional payloads) into tar volumes sized to the media, each volume
checkable on its own (check.py) and importable in any order (unpack.py).

The volume format is described in format.py and index.py; what rides beside the model in payloads.py.
Writing reads each source byte once: the bytes are hashed (blake3 of each piece, and of the whole file
against the manifest) on their way into the volume.
A volume is written under a temporary name, fsynced and renamed, so a killed run leaves only whole
volumes; the rerun keeps those that still verify and continues with the rest. With sync=False (a staging
disk copied from with other tools) volumes are renamed without fsync: the rerun still re-checks every
volume it finds before keeping it, but the caller must flush (unmount, `sync`) before unplugging.

Decisions where the issue is silent:
- Sizes are decimal (4G = 4e9 bytes, as disks are sold); `4GiB` means binary.
- A file that does not fit the room left in a volume is split there (volumes are filled), unless less
  than MIN_PIECE is left, in which case it starts in the next volume.
- Payload files (image archive, kernel caches) have no manifest: their whole-file sha256 and blake3 are
  computed while they are written and recorded in the index of the volume holding their last byte.
- A kernel cache's key comes from `mm-cache-key.json` inside it (cachekey.py), else from `--cache-key
  KEY=VALUE`; with neither it is bundled as unkeyed and the result says so.
"""
from __future__ import annotations

import calendar
import json
import os
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..cachekey import parse_cache_key
from ..errors import BadInput, IntegrityError
from ..fsutil import dir_lock, human_bytes, publish_fd
from ..hashing import StreamHasher
from ..manifest import Manifest, export_sums, manifest_path, read_manifest
from ..progress import NULL_PROGRESS, ProgressSink
from ..verify import require_quick_verify
from .copyio import HASH_THREADS, ChunkPipe, EarlyFlush
from .format import (
    END_OF_ARCHIVE, MANIFEST_MEMBER, PLACEHOLDER, RESTORE_MEMBER, SUMS_MEMBER, b3, data_member, file_member,
    index_member, member_bytes, padded, parse_size, payload_sums_member, render_json, tar_header, volume_filename,
)
from .index import Entry, Index
from .payloads import MODEL_KIND, MODEL_PREFIX, PAYLOAD_ROOT, Payloads, collect_payloads, payloads_document, restore_hints
from .volume import open_volume

MIN_PIECE = 64 * 1024
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Source:
    """One file to carry: a model file (hashes known from the manifest) or a payload file."""

    kind: str
    path: str
    src: Path
    size: int
    blake3: str | None = None
    sha256: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.path)


@dataclass
class Piece:
    source: Source
    offset: int
    length: int
    segment: int = 1
    segments: int = 1

    @property
    def member(self) -> str:
        return data_member(self.source.kind, self.source.path, self.segment, self.segments)

    @property
    def is_last(self) -> bool:
        return self.segment == self.segments


@dataclass
class Plan:
    bundle_id: str
    name: str
    volume_size: int
    manifest: Manifest
    manifest_bytes: bytes
    payloads: Payloads
    volumes: list[list[Piece]]
    mtime: int

    @property
    def count(self) -> int:
        return len(self.volumes)


@dataclass(frozen=True)
class VolumeResult:
    number: int
    path: str
    size: int
    kept: bool


@dataclass
class BundleResult:
    ok: bool
    bundle_id: str
    name: str
    out: str
    volume_size: int
    volumes: list[VolumeResult]
    total_bytes: int
    payloads: dict  # per payload kind (its index key): what was carried, in short
    notes: list[str] = field(default_factory=list)
    synced: bool = True  # every volume fsynced before it got its name


# --- planning ---------------------------------------------------------------------------------

def plan_bundle(manifest: Manifest, manifest_bytes: bytes, model_dir: Path, volume_size: int, name: str,
                payloads: Payloads, payload_sources: list[Source]) -> Plan:
    sources = [Source(MODEL_KIND, f.path, model_dir / f.path, f.size, f.blake3, f.sha256) for f in manifest.files]
    sources += payload_sources
    id_doc = {"name": name, "volume_size": volume_size, "manifest": b3(manifest_bytes),
              "payloads": payloads_document(payloads),
              "stamps": [[s.kind, s.path, s.size, _mtime_ns(s)] for s in payload_sources]}
    bundle_id = b3(json.dumps(id_doc, sort_keys=True).encode())[:32]
    mtime = _manifest_mtime(manifest)
    sums = export_sums(manifest, "sha256").encode()
    reserve = 8192 + member_bytes(MANIFEST_MEMBER, len(manifest_bytes)) + member_bytes(SUMS_MEMBER, len(sums))
    for _ in range(32):
        plan = Plan(bundle_id, name, volume_size, manifest, manifest_bytes, payloads,
                    _place(sources, volume_size, volume_size - reserve - END_OF_ARCHIVE), mtime)
        excess = max(volume_bytes(plan, n) for n in range(1, plan.count + 1)) - volume_size
        if excess <= 0:
            return plan
        reserve += padded(excess) + 4096
    raise BadInput(f"volume size {volume_size} is too small for this bundle's index")  # pragma: no cover


def _mtime_ns(s: Source) -> int:
    return s.src.stat().st_mtime_ns


def _manifest_mtime(manifest: Manifest) -> int:
    try:
        return calendar.timegm(time.strptime(manifest.created, "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, OverflowError):
        return 0


def _place(sources: list[Source], volume_size: int, room: int) -> list[list[Piece]]:
    """Fill volumes in order: whole files where they fit, else split at the room left."""
    if room < MIN_PIECE + 4096:
        raise BadInput(f"volume size {volume_size} bytes is too small: the index, manifest and restore notes "
                       f"need {volume_size - room} of it, leaving less than {MIN_PIECE + 4096} for data")
    volumes: list[list[Piece]] = [[]]
    used = 0
    for s in sources:
        offset, pieces = 0, []
        while True:
            left = s.size - offset
            name = data_member(s.kind, s.path, 2 if offset else 1, 2 if offset else 1)
            cost = member_bytes(name + "99", left)  # "99": room for a wider segment number
            if used + cost <= room:
                pieces.append(Piece(s, offset, left))
                volumes[-1].append(pieces[-1])
                used += cost
                break
            head = len(tar_header(data_member(s.kind, s.path, 1, 2) + "99", room, 0))
            take = (room - used - head) // 512 * 512
            if take >= MIN_PIECE and take < left:
                pieces.append(Piece(s, offset, take))
                volumes[-1].append(pieces[-1])
                offset += take
            elif used == 0:
                raise BadInput(f"volume size too small for {s.path}")  # pragma: no cover
            volumes.append([])
            used = 0
        for i, p in enumerate(pieces, 1):
            p.segment, p.segments = i, len(pieces)
    return [v for v in volumes if v] or [[]]


# --- rendering the metadata members -----------------------------------------------------------

def _entry(p: Piece, digests: dict) -> Entry:
    s = p.source
    whole = digests.get(s.key, (PLACEHOLDER, PLACEHOLDER)) if p.is_last else (None, None)
    if s.kind == MODEL_KIND:
        whole = (s.blake3, s.sha256)
    return Entry(p.member, s.kind, s.path, p.offset, p.length, s.size, p.segment, p.segments,
                 digests.get(p.member, PLACEHOLDER), whole[0], whole[1])


def restore_text(plan: Plan) -> bytes:
    m = plan.manifest
    q = shlex.quote
    lines = [
        f"Bundle {plan.name} (id {plan.bundle_id}): {m.repo_id} at revision {m.revision},",
        f"{len(m.files)} model files, {human_bytes(m.total_bytes)}, in {plan.count} volume(s) "
        f"named {volume_filename(plan.name, 1, plan.count).replace('.vol001', '.volNNN')}.",
        "",
        "With mm:   mm bundle verify VOLUMES...   then   mm unbundle VOLUMES... --dest DIR",
        "",
        "Without mm (POSIX sh, tar, cat, sha256sum only): copy all volume files into one directory, cd",
        "there, and run the lines between the markers (e.g. save them as restore.sh and run `sh restore.sh`).",
        f"The model ends up in ./restore/{MODEL_PREFIX}, payloads in ./restore/{PAYLOAD_ROOT}; sha256sum -c checks "
        "every byte.",
        "",
        "--- begin restore script ---",
        "set -e",
        "mkdir -p restore",
    ]
    lines += [f"tar -xf {q(volume_filename(plan.name, n, plan.count))} -C restore" for n in range(1, plan.count + 1)]
    lines.append("cd restore")
    split: dict[tuple[str, str], list[Piece]] = {}
    for vol in plan.volumes:
        for p in vol:
            if p.segments > 1:
                split.setdefault(p.source.key, []).append(p)
    for (kind, path), pieces in split.items():
        target = file_member(kind, path)
        lines.append(f"mkdir -p {q(target.rsplit('/', 1)[0])}")
        lines.append(f"cat {' '.join(q(p.member) for p in pieces)} > {q(target)}")
    if split:
        lines.append("rm -r segments")
    lines.append(f"(cd {MODEL_PREFIX} && sha256sum -c ../{SUMS_MEMBER})")
    payload_sums = [payload_sums_member(n) for n in range(1, plan.count + 1) if _payload_ends(plan, n)]
    if payload_sums:
        lines.append(f"cat {' '.join(payload_sums)} | sha256sum -c -")
    lines.append("--- end restore script ---")
    for hint in restore_hints(plan.payloads):
        lines += ["", hint]
    return ("\n".join(lines) + "\n").encode()


def _payload_ends(plan: Plan, n: int) -> list[Piece]:
    return [p for p in plan.volumes[n - 1] if p.source.kind != MODEL_KIND and p.is_last]


def meta_members(plan: Plan, n: int, digests: dict, restore: bytes) -> list[tuple[str, bytes]]:
    """This volume's metadata members in tar order, index first. DIGESTS fills in what is known."""
    sums = export_sums(plan.manifest, "sha256").encode()
    extra = []
    ends = _payload_ends(plan, n)
    if ends:
        lines = [f"{digests.get(p.source.key, (PLACEHOLDER, PLACEHOLDER))[1]}  {file_member(*p.source.key)}"
                 for p in ends]
        extra.append((payload_sums_member(n), ("\n".join(lines) + "\n").encode()))
    meta = {SUMS_MEMBER: b3(sums), RESTORE_MEMBER: b3(restore)}
    meta.update({name: (b3(data) if digests else PLACEHOLDER) for name, data in extra})
    m = plan.manifest
    index = Index(plan.bundle_id, plan.name, n, plan.count, plan.volume_size, m.repo_id, m.revision,
                  b3(plan.manifest_bytes), meta, plan.payloads, tuple(_entry(p, digests) for p in plan.volumes[n - 1]))
    return [(index_member(n), render_json(index.to_doc())), (MANIFEST_MEMBER, plan.manifest_bytes), (SUMS_MEMBER, sums),
            (RESTORE_MEMBER, restore), *extra]


def volume_bytes(plan: Plan, n: int) -> int:
    restore = restore_text(plan)
    total = sum(member_bytes(name, len(data)) for name, data in meta_members(plan, n, {}, restore))
    total += sum(member_bytes(p.member, p.length) for p in plan.volumes[n - 1])
    return total + END_OF_ARCHIVE


# --- writing ------------------------------------------------------------------------------------

class _Writer:
    """Appends to a volume file descriptor, remembering the position."""

    def __init__(self, fd: int, sync: bool):
        self.fd, self.pos = fd, 0
        self.flush = EarlyFlush(fd, enabled=sync)

    def write(self, data) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.pos += n
            self.flush.wrote(n)

    def pad(self) -> None:
        if self.pos % 512:
            self.write(bytes(512 - self.pos % 512))


class _Hashers:
    """Whole-file hashers that span volumes; a volume's work is committed only when the volume is good."""

    def __init__(self):
        self.files: dict[tuple[str, str], StreamHasher] = {}
        self.done: dict[tuple[str, str], tuple[str, str]] = {}

    def start(self, pieces: list[Piece]) -> dict:
        return {p.source.key: (self.files[p.source.key].copy() if p.segment > 1 else
                               StreamHasher(sha256=p.source.kind != MODEL_KIND, blake3_threads=HASH_THREADS)) for p in pieces}


class _SourceMismatch(IntegrityError):
    """A model file's bytes do not match the manifest; KEY names it, so volumes holding its pieces can go."""

    def __init__(self, message: str, key: tuple[str, str]):
        super().__init__(message)
        self.key = key


def _write_volume(plan: Plan, n: int, tmp: Path, hashers: _Hashers, pipe: ChunkPipe, progress: ProgressSink,
                  restore: bytes, sync: bool) -> tuple[dict, int]:
    """Write volume N to TMP (left open for the caller to fsync and publish); returns (hashers, fd)."""
    pieces = plan.volumes[n - 1]
    working = hashers.start(pieces)
    digests: dict = {}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        w = _Writer(fd, sync)
        patch_at = {}
        for name, data in meta_members(plan, n, {}, restore):
            w.write(tar_header(name, len(data), plan.mtime))
            patch_at[name] = w.pos
            w.write(data)
            w.pad()
        for p in pieces:
            w.write(tar_header(p.member, p.length, plan.mtime))
            whole, piece_hash = _piece_hashers(p, working)
            try:
                for view in pipe.stream(p.source.src, p.offset, p.length, {whole, piece_hash}):
                    w.write(view)
                    progress.advance(len(view))
            except (EOFError, OSError) as e:
                raise IntegrityError(f"{p.source.src}: cannot read {p.source.kind} file ({e}); run `mm verify`") from None
            digests[p.member] = piece_hash.digests().blake3
            w.pad()
            if p.is_last:
                got = whole.digests()
                if p.source.kind == MODEL_KIND and got.blake3 != p.source.blake3:
                    raise _SourceMismatch(f"{p.source.src}: content does not match the manifest (blake3); "
                                          f"run `mm verify` and repair before bundling", p.source.key)
                digests[p.source.key] = (got.blake3, got.sha256)
        w.write(bytes(END_OF_ARCHIVE))
        for name, data in meta_members(plan, n, digests, restore):
            os.pwrite(fd, data, patch_at[name])
        w.flush.wait()
    except BaseException:
        w.flush.wait()
        os.close(fd)
        os.unlink(tmp)
        raise
    return working, fd


def _piece_hashers(p: Piece, working: dict) -> tuple[StreamHasher, StreamHasher]:
    """(whole-file hasher, this piece's hasher): one and the same when the file is not split."""
    whole = working[p.source.key]
    return whole, (whole if p.segments == 1 else StreamHasher(sha256=False, blake3_threads=HASH_THREADS))


def _keep_volume(plan: Plan, n: int, final: Path, hashers: _Hashers, pipe: ChunkPipe, progress: ProgressSink) -> dict | None:
    """An existing volume from an earlier run is kept if it is this plan's volume N and every piece checks."""
    try:
        vol = open_volume(final)
    except OSError:
        return None
    if vol.refused or vol.damaged or vol.bundle_id != plan.bundle_id or vol.number != n:
        return None
    planned = [(p.member, p.offset, p.length) for p in plan.volumes[n - 1]]
    if [(e.member, e.offset, e.length) for e in vol.entries()] != planned:
        return None
    working = hashers.start(plan.volumes[n - 1])
    for p, e in zip(plan.volumes[n - 1], vol.entries()):
        info = vol.data[p.member]
        whole, piece_hash = _piece_hashers(p, working)
        for view in pipe.stream(final, info.offset_data, info.size, {whole, piece_hash}):
            progress.advance(len(view))
        if piece_hash.digests().blake3 != e.blake3:
            return None
    return working


def create_bundle(model_dir: Path, out_dir: Path, volume_size: int | str, name: str | None = None,
                  payloads: dict[str, Sequence[Path]] | None = None, cache_key: Sequence[str] = (),
                  progress: ProgressSink = NULL_PROGRESS, sync: bool = True) -> BundleResult:
    """Bundle MODEL_DIR into OUT_DIR. PAYLOADS: payload kind -> paths to carry (payloads.PAYLOAD_KINDS);
    CACHE_KEY: `KEY=VALUE` pairs for kernel caches without a key of their own."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    volume_size = parse_size(volume_size)
    mpath = manifest_path(model_dir)
    manifest = read_manifest(mpath)
    manifest_bytes = mpath.read_bytes()
    require_quick_verify(model_dir, manifest, before="bundling")
    name = name or f"{manifest.repo_id.rsplit('/', 1)[-1]}-{manifest.revision[:12]}"
    if not NAME_RE.match(name):
        raise BadInput(f"bundle name {name!r}: use letters, digits, '.', '_' and '-' only")
    records, files, notes = collect_payloads(dict(payloads or {}), parse_cache_key(tuple(cache_key)))
    payload_sources = [Source(kind, f.path, f.src, f.size) for kind, f in files]
    plan = plan_bundle(manifest, manifest_bytes, model_dir, volume_size, name, records, payload_sources)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(p.length for v in plan.volumes for p in v)
    with dir_lock(out_dir, "mm bundle"):
        progress.begin(total, f"bundle {name}")
        results = _write_all(plan, out_dir, progress, sync)
        progress.end()
    ours = {Path(v.path).name for v in results}
    for stale in sorted(out_dir.glob(f"{name}.vol*-of-*.tar")):
        if stale.name not in ours:
            notes.append(f"{stale}: a volume of an earlier, different bundle run; remove it before copying the disks")
    return BundleResult(True, plan.bundle_id, name, str(out_dir), volume_size, results, total,
                        payloads_document(records, "summary"), notes, synced=sync)


def _write_all(plan: Plan, out_dir: Path, progress: ProgressSink, sync: bool) -> list[VolumeResult]:
    restore = restore_text(plan)
    hashers = _Hashers()
    pipe = ChunkPipe()
    finals = [out_dir / volume_filename(plan.name, n, plan.count) for n in range(1, plan.count + 1)]
    results, pending = [], []
    try:
        with ThreadPoolExecutor(max_workers=1) as publisher:
            try:
                for n, final in enumerate(finals, 1):
                    working = _keep_volume(plan, n, final, hashers, pipe, progress) if final.exists() else None
                    kept = working is not None
                    if not kept:
                        tmp = final.with_name(f".{final.name}.partial")
                        working, fd = _write_volume(plan, n, tmp, hashers, pipe, progress, restore, sync)
                        pending.append(publisher.submit(publish_fd, fd, tmp, final, sync))  # beside the next volume
                    hashers.files.update(working)
                    results.append(VolumeResult(n, str(final), volume_bytes(plan, n), kept))
            finally:
                for job in pending:
                    job.result()
    except _SourceMismatch as e:
        for n, final in enumerate(finals, 1):  # its earlier pieces must not be kept by a rerun
            if any(p.source.key == e.key for p in plan.volumes[n - 1]):
                final.unlink(missing_ok=True)
        raise
    finally:
        pipe.close()
    return results
