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
- A payload kind marked first_volume (mm's installer and wheelhouse) is placed before the model and never
  split, so that mm can be installed from the first disk alone; a volume size too small for that is refused,
  naming the smallest that fits.
- A kernel cache's key comes from `mm-cache-key.json` inside it (cachekey.py), else from `--cache-key
  KEY=VALUE`; with neither it is bundled as unkeyed and the result says so.
- A signed model (.mm/manifest.json.sig, signing.py) has its signature carried in every volume, data and parity;
  a signature that no longer matches the manifest is refused, never carried.
- `--parity M` adds M parity volumes (format.py, index.py ParityIndex, parity.py the code): once the data volumes
  are written, their files are read back once, stripe by stripe, and the parity streams written beside them.
  A parity volume is planned like a data volume: no larger than --volume-size.
- `--base BASE` makes a delta (delta.py): the model files whose content the base has are left out of the volumes
  and named in every index (DeltaNote), with the base manifest's identity; the rest is packed as usual.
- The plan comes first (plan_summary: how many volumes, how large, which disk holds which), before a byte is
  written: more than MAX_VOLUMES volumes is refused unless `--yes` (a `--volume-size 100K` typo for 100G), and
  so is a plan the output disks have no room for (fsutil.require_free_space, per file system).
- Several output directories (`--out` repeated: one per disk) are filled in order (place_volumes): each volume
  goes to the first disk, from the one the previous volume went to, with room for it (free space read before
  writing); parity volumes follow the data volumes in the same fill. A volume already on one of them under its
  name (a rerun) stays where it is. install-mm.sh goes beside volume 1. Nothing else of mm's lands on the disks.
"""
from __future__ import annotations

import calendar
import contextlib
import functools
import json
import os
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import blake3

from ..errors import BadInput, BadValue, IntegrityError, Refused
from ..paths import MM_DIR
from ..edges.fsutil import (atomic_write_bytes, check_inside, dir_lock, open_file, publish_fd, read_lock,
                            read_local_file, require_free_space, unlink_file)
from ..integrity.hashing import StreamHasher
from ..edges.interrupt import keeps
from ..integrity.manifest import MAX_MANIFEST_BYTES, Manifest, export_sums_chunks, read_manifest
from ..paths import manifest_path
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..units import human_bytes
from ..integrity.verify import require_quick_verify
from .check import ranges
from .copyio import HASH_THREADS, ChunkPipe, WriteBehind, reports_free_pages, write_all
from .format import (BLOCK, END_OF_ARCHIVE, MANIFEST_MEMBER, PLACEHOLDER, RESTORE_MEMBER, SIG_MEMBER, SUMS_MEMBER, Rendered,
                     b3,
                     data_member, file_member, index_member, member_bytes, padded, parity_data_member, parity_filename,
                     parity_index_member, payload_sums_member, render_json, render_json_chunks, tar_header,
                     volume_filename)
from . import payloads as payload_table
from . import delta as deltas
from .index import PARITY_SCHEMA, PARITY_SCHEMA_V1, DeltaNote, Entry, Index, ParityIndex, ParityNote, Stream
from .parity import (CODEC, MAX_TOTAL, STRIPE, FileSource, Layout, Span, SplicedSource, encode, file_identity,
                     whole_blake3)
from .proof import TarProof, VolumeProof
from .payloads import (MODEL_KIND, MODEL_PREFIX, PAYLOAD_ROOT, CollectOptions, Payloads, collect_payloads,
                       payloads_document, restore_hints)
from .volume import MAX_INDEX_BYTES, open_volume

MIN_PIECE = 64 * 1024
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_VOLUMES = 10_000  # more is almost surely a --volume-size typo; `--yes` writes them anyway


@dataclass(frozen=True)
class BundleOptions:
    """What `mm bundle` is asked to do, every rule between its options checked once, by from_cli (as twine's
    Settings): create_bundle takes it as it is and checks none of them again. OUTS: one directory per disk, filled
    in order. PAYLOADS: payload kind -> paths to carry (payloads.PAYLOAD_KINDS). COLLECT: what payload kinds read
    (a kernel cache's key, the pinned image, registry TLS). PARITY: Reed-Solomon parity volumes; STRIPE the code's
    stripe size (tests use small ones). YES: write more than MAX_VOLUMES volumes. BASE: make a delta against this
    base (a manifest, a model directory or a volume of its bundle; delta.load_base). BUILD_MM: the command builds
    mm's wheelhouse for TARGET_PLATFORMS x TARGET_PYTHONS and carries it; ONLY_MM: that wheelhouse alone, into
    OUTS[0], and no model."""

    outs: tuple[Path, ...]
    volume_size: int  # bytes; 0 with only_mm (no volumes)
    name: str | None = None  # default: <repo name>-<revision[:12]>
    payloads: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    collect: CollectOptions = CollectOptions()
    parity: int = 0
    stripe: int = STRIPE
    sync: bool = True
    yes: bool = False
    base: Path | None = None
    build_mm: bool = False
    only_mm: bool = False
    target_platforms: tuple[str, ...] = ()
    target_pythons: tuple[str, ...] = ()

    @classmethod
    def from_cli(cls, directory: Path | None, *, outs: Sequence[Path], volume_size: int | None,
                 payloads: Mapping[str, Sequence[Path]], no_mm: bool = False, only_mm: bool = False,
                 target_platforms: Sequence[str] = (), target_pythons: Sequence[str] = (), **options) -> BundleOptions:
        """The options as `mm bundle` was given them (sizes and keys already parsed), or BadInput naming the rule
        they break. OPTIONS: the fields that take part in no rule (name, collect, parity, sync, yes, base)."""
        carried = {kind: tuple(paths) for kind, paths in payloads.items() if paths}
        targets = {"target_platforms": tuple(target_platforms), "target_pythons": tuple(target_pythons)}
        if only_mm:
            if directory or volume_size or carried or options.get("parity") or options.get("base"):
                raise BadInput("--only-mm writes only install-mm.sh and wheelhouse/ into --out: give no model "
                               "directory, --volume-size or payload")
            if len(outs) > 1:
                raise BadInput("--only-mm writes into one --out directory")
            return cls(tuple(outs), 0, only_mm=True, **targets)
        if directory is None or volume_size is None:
            raise BadInput("give the model DIRECTORY and --volume-size (or --only-mm for mm alone)")
        if no_mm and carried.get("mm"):
            raise BadInput("--no-mm and --wheelhouse: choose one")
        if (no_mm or carried.get("mm")) and (target_platforms or target_pythons):
            raise BadInput("--target-platform/--target-python choose the wheelhouse mm bundle builds; "
                           "not with --no-mm or --wheelhouse")
        if options.get("name") is not None:
            _check_name(options["name"])
        return cls(tuple(outs), volume_size, payloads=carried,
                   build_mm=not no_mm and not carried.get("mm"), **targets, **options)

    def carrying(self, kind: str, path: Path) -> BundleOptions:
        """These options, carrying PATH as the payload KIND too (the wheelhouse the command built)."""
        return replace(self, payloads={**self.payloads, kind: (*self.payloads.get(kind, ()), path)}, build_mm=False)


def _check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise BadInput(f"bundle name {name!r}: use letters, digits, '.', '_' and '-' only")


@dataclass(frozen=True, slots=True)
class CarriedFile:
    """One file to carry: a model file (hashes known from the manifest) or a payload file."""

    kind: str
    path: str
    root: Path  # the directory PATH lies under, or the file itself (WHOLE)
    size: int
    blake3: str | None = None
    sha256: str | None = None
    whole: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.path)

    @property
    def src(self) -> Path:
        """The file to read: made when asked (a Path is ~0.5 KB, and a bundle may carry a million files)."""
        return self.root if self.whole else self.root / self.path


@dataclass(slots=True)
class Piece:
    source: CarriedFile
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
    signature: bytes | None = None  # .mm/manifest.json.sig, carried in every volume
    parity: int = 0  # parity volumes
    stripe: int = STRIPE
    delta: DeltaNote | None = None  # a delta bundle: the base, and the model files taken from it

    @property
    def count(self) -> int:
        return len(self.volumes)

    @property
    def parity_note(self) -> ParityNote | None:
        return ParityNote(self.parity, self.stripe, CODEC) if self.parity else None

    @functools.cached_property
    def restore(self) -> bytes:
        """RESTORE.txt, the same in every volume (computed once: it lists every volume)."""
        return restore_text(self)

    @functools.cached_property
    def sums(self) -> Rendered:
        return sums_document(self.manifest)

    def parity_meta(self, restore: bytes) -> list[tuple[str, bytes]]:
        """Metadata members of a parity volume after its index and the manifest."""
        return [*([(SIG_MEMBER, self.signature)] if self.signature else []), (RESTORE_MEMBER, restore)]

    def parity_volume_bytes(self) -> int:
        files = [volume_filename(self.name, n, self.count) for n in range(1, self.count + 1)]
        return parity_volume_bytes(self.name, self.bundle_id, self.manifest_bytes, self.parity_meta(self.restore),
                                   self.mtime, files, [volume_bytes(self, n) for n in range(1, self.count + 1)],
                                   self.parity, self.stripe, [self.head_members(n) for n in range(1, self.count + 1)])

    def head_members(self, n: int) -> int:
        """How many metadata members volume N starts with (meta_members, counted without rendering the index)."""
        return 4 + bool(self.signature) + bool(_payload_ends(self, n))


@dataclass(frozen=True)
class VolumeResult:
    number: int
    path: str
    size: int
    kept: bool


@dataclass(frozen=True)
class DiskShare:
    """What one output directory (a disk) gets: volume and parity numbers, bytes still to write, free bytes."""

    out: str
    volumes: list[int]
    parity: list[int]
    to_write: int  # bytes of the volumes written there this run (volumes already there under their name: not counted)
    free: int

    @property
    def holds(self) -> str:
        """'volumes 1-2, parity 1'."""
        return ", ".join(([f"volume{'s' if len(self.volumes) > 1 else ''} {ranges(self.volumes)}"] if self.volumes
                          else []) + ([f"parity {ranges(self.parity)}"] if self.parity else [])) or "nothing"


@dataclass(frozen=True)
class PlanSummary:
    """The plan, told before anything is written."""

    name: str
    volumes: int
    parity: int
    volume_size: int
    largest: int  # the largest volume file (data or parity)
    last: int  # the last data volume's size
    total_bytes: int  # every volume file, parity included: what the disks get
    data_bytes: int  # the files carried: the model's (model_bytes) and the payloads'
    files: int  # model_files plus the payloads' files
    disks: list[DiskShare]
    notes: list[str] = field(default_factory=list)
    model_files: int = 0  # the model's files the volumes carry (a delta: those the base lacks)
    model_bytes: int = 0
    taken_files: int = 0  # a delta: the model's files the destination takes from its copy of the base
    taken_bytes: int = 0
    payloads: list[PayloadShare] = field(default_factory=list)  # what rides along besides the model, by kind


@dataclass(frozen=True)
class PayloadShare:
    """One payload kind the volumes carry besides the model (mm itself, an engine image, kernel caches)."""

    kind: str
    label: str
    files: int
    bytes: int


@dataclass
class BundleResult:
    ok: bool
    bundle_id: str
    name: str
    out: str  # the first output directory (all of them: outs)
    volume_size: int
    volumes: list[VolumeResult]
    total_bytes: int
    payloads: dict  # per payload kind (its index key): what was carried, in short
    notes: list[str] = field(default_factory=list)
    synced: bool = True  # every volume fsynced before it got its name
    parity_volumes: list[VolumeResult] = field(default_factory=list)
    signed: bool = False  # the manifest's signature travels in every volume
    delta: dict | None = None  # a delta bundle: its base and what comes from it (DeltaNote.summary)
    outs: list[str] = field(default_factory=list)
    files: int = 0  # files carried (model files and payload files)
    seconds: float = 0.0
    plan: PlanSummary | None = None


# --- planning ---------------------------------------------------------------------------------

def plan_bundle(manifest: Manifest, manifest_bytes: bytes, model_dir: Path, volume_size: int, name: str,
                payloads: Payloads, payload_sources: list[CarriedFile], signature: bytes | None = None, parity: int = 0,
                stripe: int = STRIPE, delta: DeltaNote | None = None) -> Plan:
    first = [s for s in payload_sources if payload_table.BY_KIND[s.kind].first_volume]
    taken = {t.path for t in delta.take} if delta else set()
    sources = first + [CarriedFile(MODEL_KIND, f.path, model_dir, f.size, f.blake3, f.sha256) for f in manifest.files
                       if f.path not in taken]
    sources += [s for s in payload_sources if s not in first]
    id_doc = {"name": name, "volume_size": volume_size, "manifest": b3(manifest_bytes),
              "payloads": payloads_document(payloads),
              "stamps": [[s.kind, s.path, s.size, _mtime_ns(s)] for s in payload_sources]}
    if signature:
        id_doc["signature"] = b3(signature)
    if parity:
        id_doc["parity"] = [parity, stripe]
    if delta:
        id_doc["delta"] = b3(json.dumps(delta.to_doc(), sort_keys=True).encode())
    bundle_id = b3(json.dumps(id_doc, sort_keys=True).encode())[:32]
    mtime = _manifest_mtime(manifest)
    sums = sums_document(manifest)
    reserve = 8192 + member_bytes(MANIFEST_MEMBER, len(manifest_bytes)) + member_bytes(SUMS_MEMBER, len(sums))
    for _ in range(32):
        plan = Plan(bundle_id, name, volume_size, manifest, manifest_bytes, payloads,
                    _place(sources, volume_size, volume_size - reserve - END_OF_ARCHIVE), mtime, signature, parity,
                    stripe, delta)
        largest = max(volume_bytes(plan, n) for n in range(1, plan.count + 1))
        excess = max(largest, plan.parity_volume_bytes() if parity else 0) - volume_size
        if excess <= 0:
            _require_first_volume(plan, first, reserve)
            return plan
        reserve += padded(excess) + 4096
    raise BadInput(f"volume size {volume_size} is too small for this bundle's index")  # pragma: no cover


def sums_document(manifest: Manifest) -> Rendered:
    """SHA256SUMS, written a chunk at a time and never held: a line a file, and a bundle may carry a million."""
    export_sums_chunks(manifest, "sha256")  # a manifest the lines cannot be made from is refused now
    return Rendered(lambda: (chunk.encode() for chunk in export_sums_chunks(manifest, "sha256")))


def _require_first_volume(plan: Plan, first: list[CarriedFile], reserve: int) -> None:
    """Every first-volume source whole in volume 1, else refuse naming the smallest volume size that holds them."""
    keys = {s.key for s in first}
    whole = {p.source.key for p in plan.volumes[0] if p.segments == 1 and p.source.kind != MODEL_KIND}
    if keys <= whole:
        return
    need = reserve + END_OF_ARCHIVE + sum(member_bytes(data_member(s.kind, s.path, 1, 1) + "99", s.size) for s in first)
    need += MIN_PIECE + 4096 + 512 * len(first)  # room the planner keeps, and the index entries of those files
    minimum = -(-need // 10**6) * 10**6
    kinds = sorted({s.kind for s in first})
    raise BadInput(f"--volume-size {human_bytes(plan.volume_size)}: too small to carry {' and '.join(kinds)} whole "
                   f"in volume 1 ({human_bytes(sum(s.size for s in first))} that must install from the first disk "
                   f"alone); "
                   f"use --volume-size {_whole_mb(minimum)}M or more, or --no-mm")


def _mtime_ns(s: CarriedFile) -> int:
    return s.src.stat().st_mtime_ns


def _manifest_mtime(manifest: Manifest) -> int:
    try:
        return calendar.timegm(time.strptime(manifest.created, "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, OverflowError):
        return 0


def _place(sources: list[CarriedFile], volume_size: int, room: int) -> list[list[Piece]]:
    """Fill volumes in order: whole files where they fit, else split at the room left."""
    if room < MIN_PIECE + 4096:
        raise BadValue(f"--volume-size {human_bytes(volume_size)} is too small: the index, manifest and restore "
                       f"notes need {human_bytes(volume_size - room)} of each volume, leaving less than "
                       f"{human_bytes(MIN_PIECE + 4096)} for data; use --volume-size "
                       f"{_whole_mb(volume_size - room + MIN_PIECE + 4096)}M or more")
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

WRITTEN = "(every piece written)"  # a key of _write_volume's digests once the volume's data is written


def _known(p: Piece) -> bool:
    """A whole model file: its piece's blake3 is the manifest's (the file is checked against it as it is
    written), so the writer keeps no digest for it (a volume may hold a million files)."""
    return p.source.kind == MODEL_KIND and p.segments == 1


def _entry(p: Piece, digests: dict) -> Entry:
    s = p.source
    whole = digests.get(s.key, (PLACEHOLDER, PLACEHOLDER)) if p.is_last else (None, None)
    if s.kind == MODEL_KIND:
        whole = (s.blake3, s.sha256)
    piece = (s.blake3 if WRITTEN in digests else PLACEHOLDER) if _known(p) else digests.get(p.member, PLACEHOLDER)
    return Entry(p.member, s.kind, s.path, p.offset, p.length, s.size, p.segment, p.segments, piece, whole[0],
                 whole[1])


def restore_text(plan: Plan) -> bytes:
    m = plan.manifest
    q = shlex.quote
    lines = [
        f"Bundle {plan.name} (id {plan.bundle_id}): {m.repo_id} at revision {m.revision},",
        f"{len(m.files)} model files, {human_bytes(m.total_bytes)}, in {plan.count} volume(s) "
        f"named {volume_filename(plan.name, 1, plan.count).replace('.vol001', '.volNNN')}.",
        "",
        "With mm:   mm bundle verify VOLUMES...   then   mm unbundle VOLUMES... --dest DIR"
        + (" --from BASE_DIR" if plan.delta else ""),
        "",
        *(deltas.restore_intro(plan.delta, len(m.files)) if plan.delta else []),
        *_parity_notes(plan),
        "Without mm (POSIX sh, tar, cat, sha256sum" + (", cp" if plan.delta else "") + " only): copy all volume "
        "files into one directory, cd",
        "there, and run the lines between the markers (e.g. save them as restore.sh and run `sh restore.sh"
        + (" BASE_DIR`)." if plan.delta else "`)."),
        f"The model ends up in ./restore/{MODEL_PREFIX} with its manifest in {MODEL_PREFIX}/{MM_DIR}/ (so that "
        f"`mm verify`, `mm launch` work on it),",
        f"payloads in ./restore/{PAYLOAD_ROOT}; sha256sum -c checks every byte.",
        "",
        "--- begin restore script ---",
        "set -e",
        *(deltas.restore_script_head() if plan.delta else []),
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
    if plan.delta:
        lines += deltas.restore_takes(plan.delta, MODEL_PREFIX, q)
    lines.append(f"(cd {MODEL_PREFIX} && sha256sum -c ../{SUMS_MEMBER})")
    payload_sums = [payload_sums_member(n) for n in range(1, plan.count + 1) if _payload_ends(plan, n)]
    if payload_sums:
        lines.append(f"cat {' '.join(payload_sums)} | sha256sum -c -")
    # where mm looks for the manifest (and its signature): the restored model is a model directory like any other
    from ..integrity.signing import signature_path

    lines.append(f"mkdir -p {q(str(manifest_path(Path(MODEL_PREFIX)).parent))}")
    lines.append(f"cat {MANIFEST_MEMBER} > {q(str(manifest_path(Path(MODEL_PREFIX))))}")
    if plan.signature:
        lines.append(f"cat {SIG_MEMBER} > {q(str(signature_path(Path(MODEL_PREFIX))))}")
    lines.append("--- end restore script ---")
    if plan.signature:
        from ..integrity.signing import verify_command
        lines += ["", "The manifest is signed (SSH signature, namespace mm-manifest). Check it with OpenSSH alone, with",
                  "your site's allowed_signers file and the signer's identity, after the restore script ran:",
                  f"  cd restore/MMBUNDLE && {verify_command()}",
                  "(mm does the same: mm unbundle ... --require-signature --allowed-signers FILE)"]
    for hint in restore_hints(plan.payloads):
        lines += ["", hint]
    return ("\n".join(lines) + "\n").encode()


def _parity_notes(plan: Plan) -> list[str]:
    if not plan.parity:
        return []
    first = parity_filename(plan.name, 1, plan.parity)
    return [f"Parity: {plan.parity} parity volume(s) named {first.replace('.par001', '.parNNN')} (Reed-Solomon,",
            f"pyeclib {CODEC}) rebuild any {plan.parity} lost or damaged volume(s). A complete set of data",
            "volumes needs no mm and no parity (the script below). Rebuilding needs mm: `mm unbundle` does it",
            "by itself when given the parity volumes; `mm bundle repair-volume VOLUMES... --out DIR` writes lost",
            "volume files back, byte-identical; `mm bundle verify` says what is recoverable.",
            ""]


def _require_readable_index(plan: Plan, n: int, length: int) -> None:
    """Volume N's index within what mm unbundle reads (volume.MAX_INDEX_BYTES): a bundle it could not import is
    refused while it is planned, before a byte is written, with a volume size whose index fits."""
    if length > MAX_INDEX_BYTES:
        fits = plan.volume_size * MAX_INDEX_BYTES // length // 2  # half: room for files of longer paths
        raise BadValue(f"--volume-size {human_bytes(plan.volume_size)}: volume {n} would list "
                       f"{len(plan.volumes[n - 1])} pieces in an index of {human_bytes(length)}, more than the "
                       f"{human_bytes(MAX_INDEX_BYTES)} mm unbundle reads; choose a smaller --volume-size, e.g. "
                       f"{human_bytes(fits)}")


def _payload_ends(plan: Plan, n: int) -> list[Piece]:
    return [p for p in plan.volumes[n - 1] if p.source.kind != MODEL_KIND and p.is_last]


def meta_members(plan: Plan, n: int, digests: dict, restore: bytes) -> list[tuple[str, bytes]]:
    """This volume's metadata members in tar order, index first. DIGESTS fills in what is known."""
    sums = plan.sums
    extra = []
    ends = _payload_ends(plan, n)
    if ends:
        lines = [f"{digests.get(p.source.key, (PLACEHOLDER, PLACEHOLDER))[1]}  {file_member(*p.source.key)}"
                 for p in ends]
        extra.append((payload_sums_member(n), ("\n".join(lines) + "\n").encode()))
    meta = {SUMS_MEMBER: _b3_once(sums), RESTORE_MEMBER: _b3_once(restore)}
    sig = [(SIG_MEMBER, plan.signature)] if plan.signature else []
    meta.update({name: b3(data) for name, data in sig})
    meta.update({name: (b3(data) if digests else PLACEHOLDER) for name, data in extra})
    m = plan.manifest
    head = Index(plan.bundle_id, plan.name, n, plan.count, plan.volume_size, m.repo_id, m.revision,
                 b3(plan.manifest_bytes), meta, plan.payloads, (), plan.parity_note, plan.delta).to_doc(members=False)
    pieces = plan.volumes[n - 1]
    index = Rendered(lambda: render_json_chunks(head, members=(_entry(p, digests).to_doc() for p in pieces)))
    return [(index_member(n), index), (MANIFEST_MEMBER, plan.manifest_bytes), *sig,
            (SUMS_MEMBER, sums), (RESTORE_MEMBER, restore), *extra]


@functools.lru_cache(maxsize=8)
def _b3_once(data: bytes | Rendered) -> str:
    """b3 of the members every volume carries (RESTORE.txt lists every volume: hashed once, not once a volume)."""
    return _blake3_of(data).hex()


def volume_bytes(plan: Plan, n: int) -> int:
    meta = meta_members(plan, n, {}, plan.restore)
    _require_readable_index(plan, n, len(meta[0][1]))  # the index is meta's first member
    total = sum(member_bytes(name, len(data)) for name, data in meta)
    total += sum(member_bytes(p.member, p.length) for p in plan.volumes[n - 1])
    return total + END_OF_ARCHIVE


# --- writing ------------------------------------------------------------------------------------

class _Writer:
    """Appends to a volume file descriptor, remembering the position. KEEP: leave its pages in the page cache (the
    volume is hashed whole once written, for the parity index: _hash_then_publish)."""

    def __init__(self, fd: int, keep: bool = False):
        self.fd, self.pos = fd, 0
        self.flush = WriteBehind(fd, drop=not keep)

    def write(self, data) -> None:
        n = write_all(self.fd, data)
        self.pos += n
        self.flush.wrote(n)

    def pad(self) -> int:
        """Zeros up to the next tar block; returns how many."""
        n = -self.pos % BLOCK
        if n:
            self.write(bytes(n))
        return n


class _Hashers:
    """Whole-file hashers that span volumes; a volume's work is committed only when the volume is good."""

    def __init__(self):
        self.files: dict[tuple[str, str], StreamHasher] = {}
        self.done: dict[tuple[str, str], tuple[str, str]] = {}

    def start(self, pieces: list[Piece]) -> "_Working":
        return _Working(self.files)


class _Working(dict):
    """One volume's whole-file hashers, each made as its file's piece is reached and dropped once its last piece is
    hashed: only a file that goes on into the next volume keeps one (a hasher holds ~2 KB of blake3 state, and a
    volume may hold a million files)."""

    def __init__(self, carried: dict):
        super().__init__()
        self.carried = carried

    def hasher(self, p: Piece) -> StreamHasher:
        if (h := self.get(p.source.key)) is None:
            h = self[p.source.key] = (self.carried[p.source.key].copy() if p.segment > 1 else
                                      StreamHasher(sha256=p.source.kind != MODEL_KIND, blake3_threads=HASH_THREADS))
        return h


class _SourceMismatch(IntegrityError):
    """A model file's bytes do not match the manifest; KEY names it, so volumes holding its pieces can go."""

    def __init__(self, message: str, key: tuple[str, str]):
        super().__init__(message)
        self.key = key


def _write_volume(plan: Plan, n: int, tmp: Path, hashers: _Hashers, pipe: ChunkPipe, progress: ProgressSink,
                  restore: bytes, sync: bool, keep: bool = False) -> tuple[dict, int, list[Span], str | None]:
    """Write volume N to TMP (left open for the caller to fsync and publish); returns (hashers, fd, where each
    piece's bytes lie in the volume and which file they were copied from: the parity pass reads them there, and
    with parity the volume's proof for the parity index, proof.py: from the digests taken as it was written).
    KEEP: the volume's pages stay cached (see _Writer)."""
    pieces = plan.volumes[n - 1]
    working = hashers.start(pieces)
    digests: dict = {}
    spans: list[Span] = []
    proof = VolumeProof() if plan.parity else None
    fd = open_file(tmp.parent, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # never through a link
    try:
        w = _Writer(fd, keep=keep)
        patch_at, headers = {}, []
        for name, data in meta_members(plan, n, {}, restore):
            headers.append(tar_header(name, len(data), plan.mtime))
            w.write(headers[-1])
            patch_at[name] = w.pos
            for chunk in _chunks(data):
                w.write(chunk)
            w.pad()
        for p in pieces:
            progress.item(p.source.path)
            header = tar_header(p.member, p.length, plan.mtime)
            w.write(header)
            if plan.parity:  # its identity before a byte is read: a change from now on is seen
                spans.append(_span(w.pos, p))
            whole, piece_hash = _piece_hashers(p, working)
            stream = iter(pipe.stream(p.source.src, p.offset, p.length, {whole, piece_hash}))
            while True:
                try:
                    view = next(stream, None)
                except (EOFError, OSError) as e:
                    raise IntegrityError(f"{p.source.src}: cannot read {p.source.kind} file ({e}); run `mm verify`") from None
                if view is None:
                    break
                w.write(view)  # a failed write is the output's (a full or read-only disk), named below
                progress.advance(len(view))
            piece_digest = piece_hash.digests().blake3
            if not _known(p):
                digests[p.member] = piece_digest
            pad = w.pad()
            if proof is not None:
                proof.body.raw(header)
                proof.body.member(p.length, piece_digest)
                proof.body.raw(bytes(pad))
            if p.is_last:
                got = whole.digests()
                if p.source.kind == MODEL_KIND and got.blake3 != p.source.blake3:
                    raise _SourceMismatch(f"{p.source.src}: content does not match the manifest (blake3); "
                                          f"run `mm verify` and repair before bundling", p.source.key)
                if p.source.kind != MODEL_KIND:  # a model file's are the manifest's (checked just above)
                    digests[p.source.key] = (got.blake3, got.sha256)
                del working[p.source.key]
        w.write(bytes(END_OF_ARCHIVE))
        digests[WRITTEN] = True
        final = list(meta_members(plan, n, digests, restore))
        for name, data in final:
            at = patch_at[name]
            for chunk in _chunks(data):
                at += os.pwrite(fd, chunk, at)
        if proof is not None:
            proof.body.raw(bytes(END_OF_ARCHIVE))
            for header, (_, data) in zip(headers, final, strict=True):
                proof.head.raw(header)
                proof.head.member(len(data), _blake3_of(data))
                proof.head.raw(bytes(-len(data) % BLOCK))
    except BaseException as e:
        os.close(fd)
        unlink_file(tmp.parent, tmp)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(tmp)  # a write to the volume failed: name the output, never the source
        raise
    return working, fd, spans, proof.hexdigest() if proof is not None else None


def _chunks(data: bytes | Rendered) -> Iterable[bytes]:
    return data.chunks() if isinstance(data, Rendered) else (data,)


def _blake3_of(data: bytes | Rendered) -> bytes:
    h = blake3.blake3()
    for chunk in _chunks(data):
        h.update(chunk)
    return h.digest()


def _span(at: int, p: Piece) -> Span:
    """Where piece P's bytes lie in its volume (from AT) and which file they are copied from, as it is now."""
    try:
        return Span(at, p.source.src, p.offset, p.length, file_identity(p.source.src))
    except OSError as e:
        raise IntegrityError(f"{p.source.src}: cannot read {p.source.kind} file ({e.strerror}); "
                             f"run `mm verify`") from None


def _piece_hashers(p: Piece, working: dict) -> tuple[StreamHasher, StreamHasher]:
    """(whole-file hasher, this piece's hasher): one and the same when the file is not split."""
    whole = working.hasher(p)
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
    checked = 0
    for p, e in zip(plan.volumes[n - 1], vol.entries()):
        progress.item(p.source.path)
        info = vol.data[p.member]
        whole, piece_hash = _piece_hashers(p, working)
        for view in pipe.stream(final, info.offset_data, info.size, {whole, piece_hash}):
            progress.advance(len(view))
            checked += len(view)
        if piece_hash.digests().blake3 != e.blake3:
            progress.advance(-checked)  # the volume is written again: the bar counts its bytes once
            return None
        if p.is_last:
            del working[p.source.key]
    return working


def create_bundle(model_dir: Path, options: BundleOptions, progress: ProgressSink = NULL_PROGRESS,
                  on_plan: Callable[[PlanSummary], None] | None = None) -> BundleResult:
    """Bundle MODEL_DIR as OPTIONS say (BundleOptions), with MODEL_DIR's reader's lock held throughout
    (fsutil.read_lock: `mm gc` keeps a revision being bundled, and no writer starts in it meanwhile). ON_PLAN gets
    the plan before anything is written."""
    with read_lock(Path(model_dir), "mm bundle"):
        return _create_bundle(Path(model_dir), options, progress, on_plan)


def _create_bundle(model_dir: Path, options: BundleOptions, progress: ProgressSink,
                   on_plan: Callable[[PlanSummary], None] | None) -> BundleResult:
    started = time.monotonic()
    outs = _distinct(list(options.outs))
    volume_size, parity, stripe, sync = options.volume_size, options.parity, options.stripe, options.sync
    mpath = manifest_path(model_dir)
    manifest = read_manifest(mpath)
    manifest_bytes = read_local_file(mpath, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    signature = _signature_to_carry(model_dir, manifest_bytes)
    require_quick_verify(model_dir, manifest, before="bundling")
    delta = deltas.plan_delta(manifest, deltas.load_base(options.base)) if options.base is not None else None
    name = options.name
    if name is None:  # from the manifest, which may hold anything
        name = f"{manifest.repo_id.rsplit('/', 1)[-1]}-{manifest.revision[:12]}" + (
            f"-delta-{delta.base_revision[:8]}" if delta else "")
        _check_name(name)
    records, files, notes, beside = collect_payloads(dict(options.payloads), options.collect)
    payload_sources = [CarriedFile(kind, f.path, f.src, f.size, whole=True) for kind, f in files]
    carried = manifest.total_bytes - (delta.taken_bytes if delta else 0) + sum(s.size for s in payload_sources)
    refuse_too_many_volumes(-(-carried // volume_size), volume_size, carried, options.yes)  # before planning them all
    plan = plan_bundle(manifest, manifest_bytes, model_dir, volume_size, name, records, payload_sources,
                       signature=signature, parity=parity, stripe=stripe, delta=delta)
    if parity and plan.count + parity > MAX_TOTAL:
        raise BadInput(f"--parity {parity}: {plan.count} data volumes plus {parity} parity volumes is more than "
                       f"{MAX_TOTAL}; choose a larger --volume-size")
    refuse_too_many_volumes(plan.count + parity, volume_size, carried, options.yes)
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
    sizes = [volume_bytes(plan, n) for n in range(1, plan.count + 1)]
    names = [volume_filename(name, n, plan.count) for n in range(1, plan.count + 1)]
    if parity:
        sizes += [plan.parity_volume_bytes()] * parity
        names += [parity_filename(name, p, parity) for p in range(1, parity + 1)]
    where = place_volumes(outs, list(zip(names, sizes)))
    summary = plan_summary(plan, outs, where, names, sizes, manifest, payload_sources)
    if on_plan:
        on_plan(summary)
    _require_room(outs, summary, names, sizes, where,
                  mm_bytes=sum(s.size for s in payload_sources if s.kind == "mm"))
    total = sum(p.length for v in plan.volumes for p in v)
    finals = [outs[where[i]] / names[i] for i in range(len(names))]
    parity_results: list[VolumeResult] = []
    with contextlib.ExitStack() as locks:
        for out in outs:
            locks.enter_context(dir_lock(out, "mm bundle", leave_nothing=True))
            keeps(out)  # an interrupt names the volumes complete here (a volume half written is written again)
        progress.begin(total, f"bundle {name}", files=summary.files)
        results, proven, spans = _write_all(plan, finals[:plan.count], progress, sync)
        progress.end()
        for f in beside:  # e.g. install-mm.sh: run where the volumes lie, it reads mm out of volume 1
            _copy_beside(f.src, finals[0].parent, finals[0].parent / f.path, sync)
        if parity:
            data_paths = [Path(v.path) for v in results]
            progress.begin(sum(p.stat().st_size for p in data_paths), f"parity {name}", files=len(data_paths))
            parity_dirs = {p: finals[plan.count + p - 1].parent for p in range(1, parity + 1)}
            written = write_parity_volumes(outs[0], name=name, bundle_id=plan.bundle_id, manifest_bytes=manifest_bytes,
                                           meta=plan.parity_meta(plan.restore), mtime=plan.mtime,
                                           data_paths=data_paths, parities=parity, stripe=stripe, sync=sync,
                                           progress=progress, out_dirs=parity_dirs,
                                           proven=[_still(proven.get(v.number), Path(v.path)) for v in results],
                                           spans=[spans.get(v.number) for v in results])
            progress.end()
            parity_results = [VolumeResult(n, str(path), path.stat().st_size, False) for n, path in written]
    stale = leftovers(outs, name, set(names))
    if stale:
        notes.append(f"{len(stale)} volume file(s) of an earlier, different run of bundle {name} in "
                     f"{', '.join(sorted({str(p.parent) for p in stale}))} (e.g. {stale[0].name}); remove them "
                     f"before copying the disks")
    return BundleResult(True, plan.bundle_id, name, str(outs[0]), volume_size, results, total,
                        payloads_document(records, "summary"), notes, synced=sync, parity_volumes=parity_results,
                        signed=signature is not None, outs=[str(o) for o in outs], files=summary.files,
                        seconds=time.monotonic() - started, plan=summary,
                        delta=delta.summary(manifest) if delta else None)


def refuse_too_many_volumes(count: int, volume_size: int, carried: int, yes: bool) -> None:
    """More than MAX_VOLUMES volumes is refused unless YES (`--volume-size 100K` typed for 100G)."""
    if count > MAX_VOLUMES and not yes:
        raise BadValue(f"--volume-size {human_bytes(volume_size)}: {human_bytes(carried)} would take {count:,} "
                       f"volumes, more than {MAX_VOLUMES:,} (a typo, e.g. 100K for 100G?); use --volume-size "
                       f"{_whole_mb(-(-carried // MAX_VOLUMES))}M or more, or give --yes to write them all")


def _whole_mb(nbytes: int) -> int:
    """NBYTES rounded up to whole megabytes, at least 1: the size a refusal suggests."""
    return max(1, -(-nbytes // 10**6))


def precheck_volume_count(model_dir: Path, options: BundleOptions) -> None:
    """refuse_too_many_volumes from the manifest alone: the CLI calls it before building mm's wheelhouse."""
    manifest = read_manifest(manifest_path(Path(model_dir)))
    size = options.volume_size
    refuse_too_many_volumes(-(-manifest.total_bytes // size), size, manifest.total_bytes, options.yes)


def _distinct(outs: list[Path]) -> list[Path]:
    """The output directories in order, each once (the same directory given twice is one disk)."""
    seen, kept = set(), []
    for out in outs:
        key = os.path.realpath(out)
        if key not in seen:
            seen.add(key)
            kept.append(out)
    return kept


def place_volumes(outs: list[Path], files: list[tuple[str, int]]) -> list[int]:
    """For each volume file (NAME, SIZE), in order, the index in OUTS of the directory it goes to. A file already
    there under its name stays where it is (a rerun keeps it when it checks, else rewrites it in place); the
    others fill the disks in order: the first, from the one the previous volume went to, whose file system has
    room for it (free space read now, shared by directories on one file system). What fits nowhere goes to the
    last disk, where _require_room refuses it before anything is written."""
    devices = [os.stat(o).st_dev for o in outs]
    free = {}
    for dev, out in zip(devices, outs):
        free.setdefault(dev, _free_bytes(out))
    where, current = [], 0
    for file_name, size in files:
        there = next((i for i, o in enumerate(outs) if (o / file_name).is_file()), None)
        if there is not None:
            free[devices[there]] -= _need(outs[there], file_name, size)
            where.append(there)
            continue
        fits = next((i for i in range(current, len(outs)) if free[devices[i]] >= _need(outs[i], file_name, size)),
                    len(outs) - 1)
        free[devices[fits]] -= _need(outs[fits], file_name, size)
        where.append(fits)
        current = fits
    return where


def _free_bytes(out: Path) -> int:
    st = os.statvfs(out)
    return st.f_bavail * st.f_frsize  # what an unprivileged writer may use (shutil.disk_usage's "free")


def plan_summary(plan: Plan, outs: list[Path], where: list[int], names: list[str], sizes: list[int],
                 manifest: Manifest, payload_sources: list[CarriedFile]) -> PlanSummary:
    """What the plan puts where (WHERE: place_volumes's answer for the volume files NAMES of SIZES), and what the
    volumes carry: the model's files (a delta: those its base lacks) apart from the payloads riding along."""
    disks = []
    for i, out in enumerate(outs):
        mine = [j for j, w in enumerate(where) if w == i]
        to_write = sum(_to_write(out / names[j], sizes[j]) for j in mine)
        disks.append(DiskShare(str(out), [j + 1 for j in mine if j < plan.count],
                               [j - plan.count + 1 for j in mine if j >= plan.count], to_write, _free_bytes(out)))
    taken_files, taken_bytes = (len(plan.delta.take), plan.delta.taken_bytes) if plan.delta else (0, 0)
    shares = payload_shares(payload_sources)
    model_files, model_bytes = len(manifest.files) - taken_files, manifest.total_bytes - taken_bytes
    return PlanSummary(plan.name, plan.count, plan.parity, plan.volume_size, max(sizes), sizes[plan.count - 1],
                       sum(sizes), model_bytes + sum(p.bytes for p in shares), model_files + sum(p.files for p in shares),
                       disks, _disk_loss_notes(plan.parity, disks), model_files, model_bytes, taken_files, taken_bytes,
                       shares)


def payload_shares(sources: list[CarriedFile]) -> list[PayloadShare]:
    """Files and bytes of each payload kind carried, in the table's order."""
    return [PayloadShare(k.kind, k.label, len(mine), sum(s.size for s in mine))
            for k in payload_table.PAYLOAD_KINDS if (mine := [s for s in sources if s.kind == k.kind])]


def _disk_loss_notes(parity: int, disks: list[DiskShare]) -> list[str]:
    """With parity over several disks: the disks whose loss parity cannot rebuild (they hold more volumes)."""
    used = [d for d in disks if d.volumes or d.parity]
    if not parity or len(used) < 2:
        return []
    return [f"{d.out} holds {len(d.volumes) + len(d.parity)} volumes of the bundle and parity rebuilds any "
            f"{parity}: losing that whole disk is not recoverable (a disk per {parity} volume(s) is)"
            for d in used if len(d.volumes) + len(d.parity) > parity]


def _to_write(path: Path, size: int) -> int:
    """Bytes a volume of SIZE still needs at PATH: none when a file of that size is there (a rerun keeps it)."""
    try:
        return 0 if path.stat().st_size == size else size
    except OSError:
        return size


VOLUME_SLACK = 256 * 1024  # mm's own margin: a volume's file-system blocks beyond its size (a suggestion's room)


def _require_room(outs: list[Path], summary: PlanSummary, names: list[str], sizes: list[int],
                  where: list[int], mm_bytes: int = 0) -> None:
    """Refuse (exit 7) before writing when a disk's file system has not room for what the plan puts on it, with
    the fix that works there: a smaller --volume-size when one volume is larger than the disk's free space,
    --no-mm when mm's own wheels are what does not fit, else another disk or free space."""
    by_device: dict[int, list[tuple[Path, int]]] = {}
    largest: dict[int, int] = {}
    for i, out in enumerate(outs):
        need = sum(_need(out, names[j], sizes[j]) for j, w in enumerate(where) if w == i)
        dev = os.stat(out).st_dev
        by_device.setdefault(dev, []).append((out, need))
        largest[dev] = max([largest.get(dev, 0)] + [sizes[j] for j, w in enumerate(where) if w == i])
    for dev, needs in by_device.items():
        shares = [d for d in summary.disks if Path(d.out) in {o for o, _ in needs}]
        what = "mm bundle (" + "; ".join(d.holds for d in shares if d.volumes or d.parity) + ")"
        try:
            require_free_space(needs, what)
        except Refused as e:
            free = _free_bytes(needs[0][0])
            if mm_bytes and sum(n for _, n in needs) - mm_bytes <= free:
                fix = (f"{human_bytes(mm_bytes)} of it is mm's own installer and wheels: --no-mm leaves them out "
                       f"(the destination then needs mm installed already)")
            elif largest[dev] > free:
                fix = (f"one volume ({human_bytes(largest[dev])}) is larger than this disk's free space: use "
                       f"--volume-size {max((free - VOLUME_SLACK) // 10**6, 1)}M or less"
                       + (" and another --out for the rest" if len(outs) == 1 else ""))
            else:
                fix = "add a disk (another --out) or free space"
            raise Refused(f"{e.message}; {fix}; nothing written") from None


def _need(out: Path, file_name: str, size: int) -> int:
    """Free bytes a volume file of SIZE takes in OUT: whole blocks of its file system, plus room for the blocks
    that map them (an ext4 extent maps at most 128 MiB: one block per 128 MiB is more than its extent tree takes),
    less what a file already there under its name holds (it is kept, or replaced)."""
    block = os.statvfs(out).f_frsize or 4096
    need = -(-size // block) * block + block * (1 + size // 2**27)
    try:
        return max(0, need - (out / file_name).stat().st_blocks * 512)
    except OSError:
        return need


def leftovers(outs: list[Path], name: str, ours: set[str]) -> list[Path]:
    """Volume files of bundle NAME in OUTS that this plan does not name (an earlier run with other sizes)."""
    found = [p for out in outs for pattern in (f"{name}.vol*-of-*.tar", f"{name}.par*-of-*.tar")
             for p in out.glob(pattern)]
    return sorted(p for p in found if p.name not in ours)


def _signature_to_carry(model_dir: Path, manifest_bytes: bytes) -> bytes | None:
    """The model's manifest signature, if it has one; a signature that does not match the manifest never travels."""
    from ..integrity.signing import check_signature_matches, read_signature_file, signature_path

    sig_path = signature_path(model_dir)
    if (signature := read_signature_file(sig_path)) is None:
        return None
    check_signature_matches(manifest_bytes, signature, str(sig_path))
    return signature


def _copy_beside(src: Path, out_dir: Path, final: Path, sync: bool) -> None:
    data = src.read_bytes()  # mm's own file (install-mm.sh)
    check_inside(out_dir, final)
    if final.is_file() and final.stat().st_size == len(data) and final.read_bytes() == data:
        return
    atomic_write_bytes(final, data, mode=src.stat().st_mode & 0o777, root=out_dir, sync=sync)


class Proven(NamedTuple):
    """A data volume's proof for the parity index (proof.py), taken as it was written, and the file's identity once
    published (file_identity): the proof is used only while the file is still that one."""

    proof: str
    head: int
    identity: tuple[int, int, int]


def _still(proven: Proven | None, path: Path) -> Proven | None:
    """PROVEN, if the file is still the one published (else None: the parity pass proves it from its bytes)."""
    return proven if proven is not None and file_identity(path) == proven.identity else None


def _fits_in_cache(size: int) -> bool:
    """A volume of at most an eighth of the RAM is taken to be still in the page cache once written."""
    try:
        return size <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (ValueError, OSError):
        return False


def _write_all(plan: Plan, finals: list[Path], progress: ProgressSink, sync: bool
               ) -> tuple[list[VolumeResult], dict[int, Proven], dict[int, list[Span]]]:
    """Write (or keep) data volume N at FINALS[N-1]. Returns the volumes and, with parity, the proof of each volume
    written (Proven; a volume kept from an earlier run has none: the parity pass proves it) and the spans of each
    volume whose pages are not kept (the parity pass reads their bytes from the files they were copied from)."""
    restore = plan.restore
    hashers = _Hashers()
    pipe = ChunkPipe()
    for final in finals:  # a link planted on an --out disk is refused, never kept nor followed
        check_inside(final.parent, final)
    results, pending, proofs = [], [], {}  # proofs: volume number -> its proof and head
    proven: dict[int, Proven] = {}
    spans: dict[int, list[Span]] = {}
    # A volume that fits in the page cache stays cached for the parity pass, except where growing the page cache is
    # dear: on a VM that reports free memory to its host, keeping 2.3 GB of volumes cost 3-4 s of sys time
    # (docs/bundle.md, "How the parity pass reads"); there its pages go as written, as a plain bundle's do, and the
    # pass reads the files it was copied from (on the 16-core H200 host, without that device, doing so everywhere
    # made `--no-sync` 1.66-1.76x a plain bundle against 1.36-1.50x, 2 runs of 3 rounds each).
    keep_cached = plan.parity > 0 and not reports_free_pages()
    try:
        with ThreadPoolExecutor(max_workers=1) as publisher:
            try:
                for n, final in enumerate(finals, 1):
                    working = _keep_volume(plan, n, final, hashers, pipe, progress) if final.exists() else None
                    kept = working is not None
                    if not kept:
                        unlink_file(final.parent, final)  # not this plan's volume N: its room goes to the new one
                        tmp = final.with_name(f".{final.name}.partial")
                        keep = keep_cached and _fits_in_cache(volume_bytes(plan, n))
                        working, fd, copied, proof = _write_volume(plan, n, tmp, hashers, pipe, progress, restore,
                                                                   sync, keep=keep)
                        if plan.parity and not keep:  # its pages go: the pass reads where they came from
                            spans[n] = copied
                        if proof is not None:
                            proofs[n] = (proof, plan.head_members(n))
                        pending.append((n, final, publisher.submit(publish_fd, fd, tmp, final, sync,
                                                                   root=final.parent)))
                    hashers.files.update(working)
                    results.append(VolumeResult(n, str(final), volume_bytes(plan, n), kept))
            finally:
                for n, final, job in pending:
                    job.result()
                    if n in proofs and final.exists():
                        proven[n] = Proven(*proofs[n], file_identity(final))
    except _SourceMismatch as e:
        for n, final in enumerate(finals, 1):  # its earlier pieces must not be kept by a rerun
            if any(p.source.key == e.key for p in plan.volumes[n - 1]):
                unlink_file(final.parent, final)
        raise
    finally:
        pipe.close()
    return results, proven, spans


# --- parity volumes ---------------------------------------------------------------------------------

def _parity_index(name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]], parity: int,
                  parities: int, layout: Layout, files: list[str], heads: list[int | None], proofs: list[str],
                  par_b3: list[str], schema: str = PARITY_SCHEMA) -> bytes:
    """HEADS and PROOFS: each data volume's (proof.py); in SCHEMA 1, HEADS are None and PROOFS whole-file blake3."""
    return render_json(ParityIndex(
        bundle_id, name, parity, parities, layout.k, CODEC, layout.stripe, b3(manifest_bytes),
        {member: b3(data) for member, data in meta}, parity_data_member(parity),
        tuple(Stream(i, layout.lengths[i - 1], proofs[i - 1], files[i - 1], heads[i - 1])
              for i in range(1, layout.k + 1)),
        tuple(Stream(q, layout.parity_length, par_b3[q - 1]) for q in range(1, parities + 1)), schema).to_doc())


def _parity_head(index: bytes, parity: int, manifest_bytes: bytes, meta: list[tuple[str, bytes]], layout: Layout,
                 mtime: int) -> tuple[bytes, int]:
    """A parity volume's bytes before its parity stream, and where the index's data starts in them."""
    out, patch_at = bytearray(), 0
    for member, data in [(parity_index_member(parity), index), (MANIFEST_MEMBER, manifest_bytes), *meta]:
        out += tar_header(member, len(data), mtime)
        if member == parity_index_member(parity):
            patch_at = len(out)
        out += data + bytes(padded(len(data)) - len(data))
    out += tar_header(parity_data_member(parity), layout.parity_length, mtime)
    return bytes(out), patch_at


def parity_volume_bytes(name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]], mtime: int,
                        files: list[str], sizes: list[int], parities: int, stripe: int, heads: list[int]) -> int:
    """The size a parity volume will have, before anything is written (planning keeps it within the media)."""
    layout = Layout(len(sizes), parities, stripe, tuple(sizes))
    zeros = [PLACEHOLDER] * max(len(sizes), parities)
    index = _parity_index(name, bundle_id, manifest_bytes, meta, parities, parities, layout, files, heads, zeros, zeros)
    head, _ = _parity_head(index, parities, manifest_bytes, meta, layout, mtime)
    return len(head) + padded(layout.parity_length) + END_OF_ARCHIVE


def write_parity_volumes(out_dir: Path, *, name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]],
                         mtime: int, data_paths: list[Path], parities: int, stripe: int = STRIPE, sync: bool = True,
                         progress: ProgressSink = NULL_PROGRESS, only: set[int] | None = None,
                         out_dirs: dict[int, Path] | None = None,
                         proven: list[Proven | None] | None = None,
                         spans: list[list[Span] | None] | None = None,
                         schema: str = PARITY_SCHEMA) -> list[tuple[int, Path]]:
    """Read the data volume files DATA_PATHS (in volume order) once, stripe by stripe, and write PARITIES parity
    volumes to OUT_DIR (temporary names, published once complete; OUT_DIRS: another directory for some parity
    numbers, e.g. another disk). META: metadata members after the index and the manifest (the signature,
    RESTORE.txt), the same in every parity volume. ONLY: write just these parity numbers (repair-volume); the
    others are computed and dropped. PROVEN: each data volume's proof (proof.py) where already known (taken as it
    was written), else None: the parity pass proves it from the bytes it reads. SPANS: where a data volume's member bytes came from (a
    volume written by this run), read there rather than from the volume while those files are unchanged (else from
    the volume). SCHEMA: the parity index's; PARITY_SCHEMA_V1 (repair-volume writing a lost parity volume of an
    older bundle again) records each data volume's whole-file blake3. Returns (number, path) of each written."""
    out_dir = Path(out_dir)
    identities = [file_identity(Path(p)) for p in data_paths]
    sizes = tuple(size for _, size, _ in identities)
    files = [Path(p).name for p in data_paths]
    layout = Layout(len(data_paths), parities, stripe, sizes)
    wanted = sorted(only) if only else list(range(1, parities + 1))
    zeros = [PLACEHOLDER] * max(len(sizes), parities)
    v1 = schema == PARITY_SCHEMA_V1
    proven = [None] * layout.k if v1 or not proven else proven
    heads = [None if v1 else p.head if p is not None else _head_of(Path(path))
             for p, path in zip(proven, data_paths, strict=True)]
    opened: dict[int, tuple[_Writer, Path, Path, int]] = {}
    try:
        for p in wanted:
            final = Path((out_dirs or {}).get(p, out_dir)) / parity_filename(name, p, parities)
            tmp = final.with_name(f".{final.name}.partial")
            w = _Writer(open_file(final.parent, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            opened[p] = (w, tmp, final, 0)
            head, patch_at = _parity_head(_parity_index(name, bundle_id, manifest_bytes, meta, p, parities, layout,
                                                        files, heads, zeros, zeros, schema), p, manifest_bytes,
                                          meta, layout, mtime)
            w.write(head)
            opened[p] = (w, tmp, final, patch_at)
        sinks = [opened[p][0].write if p in opened else _discard for p in range(1, parities + 1)]
        copied_from = spans or [None] * layout.k
        sources = [_data_source(Path(path), copied) for path, copied in zip(data_paths, copied_from, strict=True)]
        try:
            result = encode(layout, sources, sinks, on_bytes=progress.advance,
                            known=[p.proof if p is not None else None for p in proven],
                            hasher=whole_blake3 if v1 else lambda i: TarProof(heads[i]))
            changed = [src for src in sources if isinstance(src, SplicedSource) and not src.unchanged()]
        finally:
            for src in sources:
                src.close()
        if identities != [file_identity(Path(p)) for p in data_paths] or changed:
            raise IntegrityError(f"{out_dir}: a data volume, or a file its bytes were copied from, was changed while "
                                 f"parity was computed; run again")
        written = []
        for p in wanted:
            w, tmp, final, patch_at = opened[p]
            w.pad()
            w.write(bytes(END_OF_ARCHIVE))
            os.pwrite(w.fd, _parity_index(name, bundle_id, manifest_bytes, meta, p, parities, layout, files, heads,
                                          result.data_digest, result.parity_blake3, schema), patch_at)
            del opened[p]
            publish_fd(w.fd, tmp, final, sync, root=final.parent)
            written.append((p, final))
        return written
    finally:
        for w, tmp, _, _ in opened.values():
            os.close(w.fd)
            unlink_file(tmp.parent, tmp)


def _head_of(volume: Path) -> int:
    """How many metadata members data volume VOLUME starts with, from its own index (the volume is checked)."""
    vol = open_volume(volume)
    if vol.index is None:
        raise IntegrityError(f"{volume}: not a readable data volume ({'; '.join(vol.refused) or 'no index'}); "
                             f"cannot compute parity over it")
    return len(vol.index.expected_meta())


def _data_source(volume: Path, spans: list[Span] | None) -> FileSource | SplicedSource:
    """Where the parity pass reads data volume VOLUME: from the files SPANS name, while they are the ones copied."""
    if spans:
        spliced = SplicedSource(volume, spans)
        if spliced.unchanged():
            return spliced
        spliced.close()
    return FileSource(volume)


def _discard(_view) -> None:
    pass
