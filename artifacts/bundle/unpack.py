"""mm unbundle: import volumes (any order, any number of sittings) into a model directory, safely.

Nothing from a volume is trusted until checked: the tar headers are judged first (volume.open_volume);
every target path is derived from the typed index (never from the tar member name), validated, and kept
inside its destination; data is read from the volume at the validated member offset and written by this
code (tarfile never extracts). A hostile or damaged volume is named with the member at fault.

State between sittings lives in DEST/.mm/unbundle/state.json (which pieces of split files are in place).
Files are written under partial names (DEST/.mm/unbundle/partial/..., or <payload root>/.mm-partial/...)
and given their final name only when their whole-file blake3 matches the manifest (payloads: the index of
the volume holding their last byte). A file already at its final name with the right size is not rewritten, unless an import named it and it changed since.

The report says how the import went (Outcome: imported, waiting, refused, verify-failed); the CLI maps that to
the exit status. A complete import leaves its record in DEST/.mm/imported.json (the bundle, where its volumes were
read, and each file's stamp as named): running unbundle again from the same volumes imports again exactly the files
changed since (a hand-edited file), and integrity.provenance tells verify, launch and repair to advise the volumes.
Not enough free space raises Refused before anything is written.

Signatures: with --allowed-signers the manifest's signature (MMBUNDLE/manifest.json.sig) is checked with
ssh-keygen before anything is written (signing.py); with --require-signature an unsigned bundle is refused too.
The signature is put back beside the manifest (DEST/.mm/manifest.json.sig).

Parity: parity volumes among the sources rebuild the data volumes not imported whole (missing, or with a damaged
member) once enough volumes are at hand (parity.py decodes; rebuild_data_volumes writes each under a temporary
name in DEST/.mm/unbundle/rebuilt/ and names it only when its digest, taken as it is written, is the one the
parity index records: its proof, proof.py, or its whole-file blake3 in a parity index of schema 1); a rebuilt volume is then judged and imported like any other and deleted. Data volumes imported in an
earlier sitting still count: their skeleton (every byte that is not member data) is kept at import, and the
member bytes are read back from the imported files (_Skeleton).

Deltas (delta.py): a bundle whose index names a base needs --from BASE_DIR, checked before anything is written;
the files it does not carry are taken from there (reflink, --link, or a copy, each hashed) after the volumes are
imported, in every sitting, and the free-space check counts them only when they are copied.
"""
from __future__ import annotations

import bisect
import enum
import io
import os
import stat
import struct
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping, NamedTuple

from ..errors import BadInput, BadValue, IntegrityError, MMError, Refused
from ..paths import IMPORT_RECORD, MM_DIR, POINTER, UNBUNDLE_DIR, store_root_of
from ..edges.fsutil import (atomic_write_bytes, atomic_write_json, check_inside, check_relpath, check_targets, dir_lock,
                            fsync_dir, make_dirs, open_file, publish, publish_fd, publish_many, read_json_file,
                            read_local_file, read_lock, remove_tree, require_free_space, still_to_write, unlink_file)
from ..integrity.hashing import StreamHasher
from ..edges.interrupt import keeps
from ..integrity.manifest import MAX_MANIFEST_BYTES, from_file, read_manifest
from ..paths import manifest_path
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..units import human_bytes
from ..edges.sharing import COPY, how_to_share
from ..edges.untrusted import MAX_DOCUMENT, At, load_json
from . import delta as deltas
from .check import ParitySet, conflicting_numbers, incomplete, parity_set, reference_bundle
from .copyio import ChunkPipe, WriteBehind, read_back, reports_free_pages, write_all
from .format import MANIFEST_MEMBER, SIG_MEMBER, b3, file_member, volume_filename
from .index import (PARITY_SCHEMA, Entry, Index, disagreements, parse_index, share_manifest_strings,
                    take_disagreements, unaccounted)
from .parity import FileSource, NotRecoverable, describe_shortfall, rebuild
from .payloads import MODEL_KIND, PAYLOAD_PARTIAL, files_expected, next_commands, payload_roots, payloads_placed
from .volume import Volume, find_volumes, meta_bytes, open_volume, split_volumes

STATE_DIR = UNBUNDLE_DIR
REBUILT = "rebuilt"  # under STATE_DIR: data volumes rebuilt from parity, deleted once imported
MAX_NAMED_VOLUMES = 10_000  # mm's own bound on the names kept for advice (a bundle of more volumes is named by number)


class Outcome(str, enum.Enum):
    """How an unbundle run ended (the CLI maps it to the exit status)."""

    IMPORTED = "imported"  # everything was imported and the final verify passed
    WAITING = "waiting"  # everything given was imported; the bundle's other volumes are still to come
    REFUSED = "refused"  # a volume or member was refused or did not match its hash; the rest was imported
    VERIFY_FAILED = "verify-failed"  # the last volume is in, and the final full verify found problems


@dataclass
class UnbundleReport:
    ok: bool
    outcome: Outcome
    complete: bool
    bundle_id: str | None
    name: str | None
    dest: str
    volumes: int | None
    used: list[str]
    refused: list[str]
    missing_volumes: list[int]
    imported: list[str]
    skipped: int
    corrupt: list[str]
    waiting: list[str]
    payloads: dict
    next_commands: list[str]
    verify: dict | None = None
    notes: list[str] = field(default_factory=list)
    synced: bool = True  # every imported file fsynced before it got its name
    rebuilt: list[int] = field(default_factory=list)  # data volumes rebuilt from parity (and imported)
    parity_used: list[int] = field(default_factory=list)
    recovery: str | None = None  # why lost volumes could not be rebuilt yet, and what would be enough
    signature: dict | None = None  # the checked manifest signature (identity, key fingerprint)
    delta: dict | None = None  # a delta: its base (DeltaNote.summary), the base dir, how files were taken (mode), taken


class Places:
    """Where each kind of file goes, and its partial name; every path is checked to stay inside its root."""

    def __init__(self, dest: Path, payload_dests: dict[str, Path | None] | None = None):
        self.dest = dest
        self.payload_roots = payload_roots(dest, payload_dests)
        self.roots = {MODEL_KIND: dest, **self.payload_roots}
        self._partial_dirs: dict[str, Path] = {}

    def final(self, kind: str, path: str) -> Path:
        """ROOT/PATH for a file of KIND, refused (naming the link) when a symlink lies on the way (fsutil's rule);
        a link at the name itself is replaced when the file is published, never followed."""
        check_relpath(path, f"{kind} path")
        root = self.roots[kind]
        check_targets(root, [path])
        return root / path

    def partial_dir(self, kind: str) -> Path:
        if kind == MODEL_KIND:
            return self.dest / STATE_DIR / "partial"
        return self.roots[kind] / PAYLOAD_PARTIAL

    def partial(self, kind: str, path: str) -> Path:
        if (folder := self._partial_dirs.get(kind)) is None:  # asked a few times a file, of a million files
            folder = self._partial_dirs[kind] = self.partial_dir(kind)
        return folder / (b3(f"{kind}:{path}".encode())[:32] + ".part")

    def clean_partials(self) -> None:
        remove_tree(self.dest, self.dest / STATE_DIR)
        for kind in self.payload_roots:
            remove_tree(self.roots[kind], self.partial_dir(kind))


class _State:
    """Pieces of split files already in place, by file; written atomically after every piece."""

    def __init__(self, path: Path, root: Path):
        self.path, self.root = path, root
        try:
            self.doc = read_json_file(path, what="unbundle state") if path.is_file() else {}
            self._check()
        except BadInput as e:
            raise BadInput(f"{e.message}; remove it to start the import over") from None

    def _check(self) -> None:
        at = At(str(self.path))
        at.obj(self.doc)
        self.doc.setdefault("pieces", {})
        self.doc.setdefault("whole", {})
        for file_key, pieces in at.get_obj(self.doc, "pieces").items():
            for segment, piece in at.key("pieces").key(file_key).obj(pieces).items():
                p_at = at.key("pieces").key(file_key).key(segment)
                if len(p_at.list(piece)) != 3:
                    raise p_at.fail("expected [offset, length, blake3]")
                p_at.index(0).int(piece[0]), p_at.index(1).int(piece[1]), p_at.index(2).str(piece[2], max_len=64)
        for file_key, whole in at.get_obj(self.doc, "whole").items():
            at.key("whole").key(file_key).list(whole)
        for n, volume in enumerate(at.get_list(self.doc, "done_volumes", [])):
            at.key("done_volumes").index(n).int(volume)
        proven = at.get_obj(self.doc, "proven", {})
        for file_key, stamp in proven.items():  # _stamp of each file named
            s_at = at.key("proven").key(file_key)
            if stamp is not None and len(s_at.list(stamp)) != 4:
                raise s_at.fail("expected [inode, size, mtime_ns, ctime_ns]")
            for i, value in enumerate(stamp or []):
                s_at.index(i).int(value)
            if stamp is not None:
                try:
                    proven[file_key] = Stamp.of(*stamp)
                except struct.error:
                    raise s_at.fail("a value is out of range for an inode, a size or a time") from None

    def pieces(self, key: str) -> dict:
        """The pieces of KEY in place (a fresh dict, not kept, when none: a whole file has none, and a bundle may
        hold a million files)."""
        return self.doc["pieces"].get(key) or {}

    def add_piece(self, key: str, segment: int, piece: list) -> dict:
        pieces = self.doc["pieces"].setdefault(key, {})
        pieces[str(segment)] = piece
        return pieces

    def bytes_in_place(self, key: str) -> int:
        return sum(int(p[1]) for p in self.doc["pieces"].get(key, {}).values())

    def save(self) -> None:
        atomic_write_json(self.path, self.doc, root=self.root, indent=None,  # a stamp a file: one line, C encoder
                          default=Stamp.as_list)


def _is_done(target: Path, size: int) -> bool:
    """A regular file (not a link) of SIZE bytes at TARGET: one lstat (a million files)."""
    try:
        st = os.lstat(target)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _in_place(targets: dict, stale: set, key: tuple[str, str], size: int) -> bool:
    """A file at its final name with its size, and not changed since an import named it (STALE)."""
    return key not in stale and _is_done(targets[key], size)


def _changed_since_named(targets: dict, state: _State) -> set[tuple[str, str]]:
    """Files an import (this bundle's, in an earlier sitting or a finished import) named whose stamp changed since:
    written to by hand or by a tool. They are imported again; their old stamps no longer prove them."""
    proven = state.doc.get("proven", {})
    stale = set()
    for key, target in targets.items():
        skey = f"{key[0]}:{key[1]}"
        stamp = proven.get(skey)
        if stamp is not None and _stamp(target) not in (None, stamp):
            stale.add(key)
            del proven[skey]
    return stale


def _read_record(dest: Path) -> _State | None:
    """The record a finished import left (the same shape as the state of one in progress), or None. Damaged or
    planted, it is ignored: it only saves work (stamps), and every file it would spare is still checked by size,
    structure and, where its stamp differs, by hash."""
    try:
        return _State(check_inside(dest, dest / IMPORT_RECORD), dest)
    except (BadInput, OSError, ValueError):
        return None


def _write_record(dest: Path, state: _State) -> None:
    keep = ("bundle_id", "name", "volumes", "manifest_blake3", "done_volumes", "read_from", "volume_files", "proven")
    doc = {"schema": "mm-import/1", **{k: state.doc[k] for k in keep if k in state.doc}}
    atomic_write_json(check_inside(dest, dest / IMPORT_RECORD), doc, root=dest, default=Stamp.as_list)


def check_free_space(places: Places, remaining: dict[str, int]) -> None:
    """REMAINING: bytes still to write by kind of destination."""
    require_free_space([(places.roots[kind], need) for kind, need in remaining.items()], "the bundle")


def _judge_volumes(vols: list[Volume], ref: str | None, manifest_b3: str | None,
                   first: Volume | None = None) -> tuple[list[Volume], list[str]]:
    conflicts = conflicting_numbers(vols, ref)
    accepted, refused = [], []
    for v in vols:
        differs = first is not None and v.index is not None and v.bundle_id == ref and v.index.differs_from(first.index)
        if v.refused:
            refused += v.refused
        elif v.bundle_id != ref:
            refused.append(f"{v.path.name}: belongs to bundle {v.bundle_id} ({v.index.name}), not {ref}; refused")
        elif v.number in conflicts:
            others = ", ".join(o.path.name for o in conflicts[v.number] if o is not v)
            refused.append(f"{v.path.name}: claims volume {v.number}, as does {others} with a different index; "
                           f"both refused")
        elif manifest_b3 and v.index.manifest_blake3 != manifest_b3:
            refused.append(f"{v.path.name}: carries a different manifest than the rest of bundle {ref}; refused")
        elif differs:
            refused.append(f"{v.path.name}: its index's {differs} differs from {first.path.name}'s (same bundle {ref}); "
                           f"refused")
        else:
            accepted.append(v)
    return accepted, refused


class _Targets(Mapping):
    """(kind, path) -> the final name of each file the bundle imports: every one checked up front (Places.final: a
    safe path, no link on the way), each Path made when asked (a Path is ~0.5 KB, and a bundle may hold a million
    files)."""

    def __init__(self, places: Places, keys: Mapping[tuple[str, str], int]):
        self._roots, self._keys = places.roots, keys
        by_kind: dict[str, list[str]] = {}
        for kind, path in keys:
            check_relpath(path, f"{kind} path")
            by_kind.setdefault(kind, []).append(path)
        for kind, paths in by_kind.items():  # Places.final's check, each directory walked once, not once a file
            check_targets(places.roots[kind], paths)

    def __getitem__(self, key: tuple[str, str]) -> Path:
        if key not in self._keys:
            raise KeyError(key)
        return self._roots[key[0]] / key[1]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _still_needed(expected: dict, targets: Mapping, state: _State, stale: set, places: Places) -> dict[str, int]:
    """Bytes still to write, by kind of destination (files not yet final, less what their partial files hold)."""
    needed: dict[str, int] = {}
    for key, size in expected.items():
        left = 0 if _in_place(targets, stale, key, size) else still_to_write(
            places.partial(*key), size, state.bytes_in_place(f"{key[0]}:{key[1]}"))
        needed[key[0]] = needed.get(key[0], 0) + left
    return needed


def check_signature(vols: list[Volume], allowed_signers: Path, identity: str | None, require: bool):
    """The bundle's manifest signature, checked with ssh-keygen before anything is written: (report or None when
    unsigned and not required, the blake3 of the manifest bytes whose signature was checked: they are not held).
    VOLS: data volumes first, then parity volumes (they carry the manifest and its signature too)."""
    from ..integrity.signing import verify_manifest_signature

    ref = reference_bundle(vols)
    first = next((v for v in vols if v.bundle_id == ref and not v.refused and v.has_manifest), None)
    if first is None:
        why = [r for v in vols for r in v.refused][:3] or [f"{v.path.name}: its manifest is damaged or missing"
                                                          for v in vols][:3] or ["no volume given"]
        raise BadInput(f"no usable volume to check the manifest signature in: {'; '.join(why)}")
    sig = meta_bytes(first, SIG_MEMBER)
    if sig is None and SIG_MEMBER in first.described.meta:
        raise IntegrityError(f"{first.path.name}: member {SIG_MEMBER!r} is damaged; refused")
    if sig is None and not require:
        return None, first.manifest_b3
    report = verify_manifest_signature(_manifest_bytes(first), sig, allowed_signers, identity,
                                       where=f"{first.path.name}: {MANIFEST_MEMBER}",
                                       signature_where=f"{first.path.name}: {SIG_MEMBER}")
    return report, first.manifest_b3


def _manifest_file(source: Volume | bytes) -> BinaryIO:
    """The bundle's manifest as a binary file: read again from its volume (Volume.reread_manifest: BadInput at its
    end when it changed since the volume was opened), or the bytes an earlier sitting left."""
    return source.reread_manifest() if isinstance(source, Volume) else io.BytesIO(source)


def _manifest_chunks(source: Volume | bytes) -> Iterator[bytes]:
    """The bundle's manifest a megabyte at a time, as _manifest_file reads it."""
    with _manifest_file(source) as f:
        while chunk := f.read(1 << 20):
            yield chunk


def _manifest_b3(source: Volume | bytes) -> str:
    """The blake3 of the bundle's manifest (a volume's as hashed at open: reading it again checks it is the same)."""
    return source.manifest_b3 if isinstance(source, Volume) else b3(source)


def _manifest_bytes(vol: Volume) -> bytes:
    """VOL's manifest, read again (Volume.manifest_bytes); BadInput when it changed since the volume was opened."""
    data = vol.manifest_bytes
    if not data:
        raise BadInput(f"{vol.path.name}: {MANIFEST_MEMBER} changed since the volume was opened; refused, nothing "
                       f"written")
    return data


@dataclass(frozen=True)
class UnbundleOptions:
    """How `mm unbundle` imports, its rules checked once, by from_cli (unbundle takes it as it is). PAYLOAD_DESTS:
    payload kind -> its destination (default DEST.payload/<kind dir>). SYNC=False skips the fsyncs of imported data
    (the final names still come only after the hashes match). READBACK: each file, once fsynced, is read back from
    the disk (its pages dropped from the page cache) before it is named. BASE_DIR: a delta's base revision
    (--from), whose files are taken by reflink, by hard link when LINK, else by a copy. ALLOWED_SIGNERS: check the
    manifest's signature first (IntegrityError, nothing written, when it is not good; with REQUIRE_SIGNATURE when
    there is none either), by IDENTITY when given."""

    payload_dests: Mapping[str, Path | None] = field(default_factory=dict)
    sync: bool = True
    readback: bool = False
    base_dir: Path | None = None
    link: bool = False
    allowed_signers: Path | None = None
    identity: str | None = None
    require_signature: bool = False

    @classmethod
    def from_cli(cls, **options) -> UnbundleOptions:
        """The options as `mm unbundle` was given them, or the rule they break: --link needs --from (BadValue),
        --readback needs the fsyncs --no-sync leaves out (BadInput)."""
        given = cls(**options)
        if given.link and given.base_dir is None:
            raise BadValue("--link hard-links files of the base: it needs --from BASE_DIR")
        if given.readback and not given.sync:
            raise BadInput("--readback reads back what was fsynced to the disk: not with --no-sync")
        return given


def unbundle(sources: list[Path], dest: Path, options: UnbundleOptions = UnbundleOptions(),
             progress: ProgressSink = NULL_PROGRESS) -> UnbundleReport:
    """_unbundle; a DEST this call made is removed again when the import is refused before keeping any work
    (only mm's lock and state in it): a refused `mm unbundle` leaves no empty --dest behind."""
    made = not os.path.lexists(dest)
    try:
        return _unbundle(sources, dest, options, progress)
    except MMError:
        if made:
            _remove_if_no_work(Path(dest))
        raise


def _next_commands(payloads, roots: dict[str, Path], dest: Path, manifest) -> list[str]:
    """The payloads' next commands, then, when DEST is a revision in a store's layout, the `mm use` that makes it
    the one a start script made from ROOT/REPO/current serves."""
    use = []
    if (root := store_root_of(dest, manifest.repo_id)) is not None:
        use = [f"mm use {manifest.repo_id} {manifest.revision[:12]} --root {root}   # serve it from {root}/"
               f"{manifest.repo_id}/{POINTER} at the next start"]
    return next_commands(payloads, roots) + use


_NO_WORK = {f"{MM_DIR}/lock", f"{STATE_DIR}/state.json"}  # what a refused import leaves: no byte of the model


def _remove_if_no_work(dest: Path) -> None:
    try:
        held = {str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir() or p.is_symlink()}
        if held <= _NO_WORK:
            remove_tree(dest.parent, dest)
    except (OSError, MMError):  # left as it is: the refusal's own line is what the user needs
        pass


def _unbundle(sources: list[Path], dest: Path, options: UnbundleOptions, progress: ProgressSink) -> UnbundleReport:
    """Import the volumes in SOURCES into DEST as OPTIONS say."""
    from ..paths import refuse_snapshot

    dest = Path(dest)
    refuse_snapshot(dest, "mm unbundle")
    payload_dests, sync, readback = dict(options.payload_dests), options.sync, options.readback
    allowed_signers, identity, base_dir, link = options.allowed_signers, options.identity, options.base_dir, options.link
    require_signature = options.require_signature
    vols, pvols = split_volumes([open_volume(p) for p in find_volumes(sources)])
    signature, signed_manifest = None, None
    if allowed_signers is not None:
        signature, signed_manifest = check_signature(vols + pvols, allowed_signers, identity, require_signature)
    dest.mkdir(parents=True, exist_ok=True)
    with dir_lock(dest, "mm unbundle"), (read_lock(Path(base_dir), "mm unbundle --from") if base_dir is not None
                                         else nullcontext()):  # gc keeps a delta's base while it is read
        keeps(dest)  # an interrupt names the imported volumes and partial files kept here
        state = _State(check_inside(dest, dest / STATE_DIR / "state.json"), dest)
        record = _read_record(dest) if not state.doc.get("bundle_id") else None
        ref = reference_bundle(vols, state.doc.get("bundle_id"))
        if record is not None and record.doc.get("bundle_id") == ref:  # the same bundle again: trust its stamps
            state.doc["proven"] = record.doc.get("proven", {})
        early = _Rebuilt()
        if pvols and not _readable(vols, ref) and _earlier_index(dest, ref or reference_bundle(pvols)) is None:
            rebuilt_vols = _rebuild_before_import(dest, vols, pvols, ref or reference_bundle(pvols), sync, progress,
                                                  early)
            vols = vols + rebuilt_vols
            ref = reference_bundle(vols, state.doc.get("bundle_id"))
        first = next((v for v in vols if v.bundle_id == ref and not v.refused and v.has_manifest), None)
        manifest_b3 = state.doc.get("manifest_blake3") or (first.index.manifest_blake3 if first else None)
        accepted, refused = _judge_volumes(vols, ref, manifest_b3, first)
        if first is not None and accepted:
            # the manifest is read again from the volume as it is parsed and written (~285 bytes a file: not held)
            idx, source, where = first.index, first, f"{first.path.name}: {MANIFEST_MEMBER}"
            idx_where = first.path.name
        else:  # parity volumes only: the bundle's index from an earlier sitting, when it left one
            earlier = _earlier_index(dest, ref) if pvols else None
            if earlier is None:
                why = refused[:3] + ([early.recovery] if early.recovery else []) or [
                    "no data volume given, and no parity volume of an mm bundle" if not pvols else "none readable"]
                raise BadInput(f"no usable volume of bundle {ref or '(unknown)'} among {len(vols)} data and "
                               f"{len(pvols)} parity volume(s) given: " + "; ".join(why))
            idx, source, where = earlier
            idx_where = str(dest / STATE_DIR / "index.json")
            first = next((pv for pv in pvols if pv.bundle_id == ref and not pv.refused), None)
        with _manifest_file(source) as f:
            manifest = from_file(f, where)
        if idx.delta is not None and (wrong := take_disagreements(idx.delta, manifest)):
            raise BadInput(f"{first.path.name if first else where}: {wrong[0]}; refused, nothing written")
        for v in list(accepted):
            if disagree := disagreements(v.index, manifest):
                accepted.remove(v)
                refused.append(f"{v.path.name}: {disagree[0]}; refused")
                if not accepted:  # every volume given says otherwise than the manifest: nothing to import
                    raise IntegrityError(f"{'; '.join(refused[:3])}; nothing written")
        if disagree := disagreements(idx, manifest):  # every path below is looked up among the manifest's files
            raise BadInput(f"{idx_where}: {disagree[0]}; refused")
        files = manifest.by_path()
        for index in {id(i): i for i in [idx, *(v.index for v in accepted)]}.values():
            share_manifest_strings(index, files)
        del files, index  # (the loop's name would keep the last index's members alive past forget_members)
        if {v.number for v in accepted} == set(range(1, idx.volumes + 1)) and (
                lost := unaccounted(manifest, [v.index for v in accepted])):
            raise BadInput(f"{incomplete(ref, lost)}; nothing written")
        pset = parity_set(pvols, ref)
        refused += pset.refused
        if signed_manifest is not None and _manifest_b3(source) != signed_manifest:
            raise IntegrityError(f"{where}: another manifest than the one whose signature was checked")
        if idx.delta is None and base_dir is not None:
            raise BadValue(f"--from {base_dir}: bundle {idx.name} is not a delta; it carries every file")
        base = deltas.open_base(base_dir, idx.delta, first.path.name if first else where, dest) if idx.delta else None
        _check_dest_manifest(dest, manifest)
        places = Places(dest, payload_dests)
        expected = {**{(MODEL_KIND, f.path): f.size for f in manifest.files}, **files_expected(idx.payloads)}
        targets = _Targets(places, expected)
        stale = _changed_since_named(targets, state)
        needed = _still_needed(expected, targets, state, stale, places)
        mode = how_to_share(base.path, places.partial_dir(MODEL_KIND), link, root=dest) if base else None
        if base and mode != COPY:  # a reflink or a hard link writes no data
            needed[MODEL_KIND] -= sum(t.size for t in idx.delta.take
                                      if not _in_place(targets, stale, (MODEL_KIND, t.path), t.size))
        check_free_space(places, needed)
        state.doc.update({"bundle_id": ref, "name": idx.name, "volumes": idx.volumes,
                          "manifest_blake3": idx.manifest_blake3})
        state.doc.setdefault("read_from", {}).update({str(v.number): str(v.path.absolute()) for v in accepted})
        if idx.volumes <= MAX_NAMED_VOLUMES:  # what advice names a volume still to come by (integrity.provenance)
            state.doc["volume_files"] = [volume_filename(idx.name, n, idx.volumes) for n in range(1, idx.volumes + 1)]
        if not manifest_path(dest).is_file():
            atomic_write_bytes(manifest_path(dest), _manifest_chunks(source), root=dest)
        _restore_signature(dest, first)
        if first is not None and not first.is_parity and (pvols or idx.parity):  # for a sitting of parity volumes only
            atomic_write_bytes(dest / STATE_DIR / "index.json", first.index_bytes, root=dest)
        state.save()
        run = _Import(places, state, targets, progress, sync, readback, stale)
        total = sum(e.length for v in accepted for e in v.entries())
        progress.begin(total, f"unbundle {idx.name}")
        try:
            for v in sorted(accepted, key=lambda v: v.number):
                run.volume(v)
                done_vols = set(state.doc.setdefault("done_volumes", []))
                if not any(v.path.name in c for c in run.corrupt):
                    done_vols.add(v.number)
                    if pvols or idx.parity:
                        _Skeleton.save(dest, v)
                state.doc["done_volumes"] = sorted(done_vols)
                state.save()
            progress.end()
            for v in vols:  # rebuilt from parity before the import: imported now, deleted as _rebuild_from_parity does
                if v.path.parent == dest / STATE_DIR / REBUILT and v.number in state.doc["done_volumes"]:
                    unlink_file(dest, v.path)
            rebuild_report = _Rebuilt(notes=list(pset.unused))
            from_base = {(MODEL_KIND, t.path) for t in idx.delta.take} if base else set()
            if pset.usable and any(not _is_done(targets[key], size) for key, size in expected.items()
                                   if key not in from_base):
                rebuild_report = _rebuild_from_parity(dest, accepted, pset, run, state, idx.volumes, sync, progress,
                                                      lambda v: _judge_rebuilt(v, ref, manifest_b3, manifest, idx),
                                                      volume_size=idx.volume_size)
                refused += rebuild_report.refused
            rebuild_report.volumes = early.volumes + rebuild_report.volumes
            rebuild_report.notes = early.notes + rebuild_report.notes
            rebuild_report.parity_used = sorted(set(early.parity_used) | set(rebuild_report.parity_used))
            taken = _take_from_base(base, idx, mode, run, progress) if base else None
            run.corrupt += taken.refused if taken else []
        finally:
            run.pipe.close()
        for v in vols + pvols:  # imported: their member records make room for the final check
            v.forget_members()
        idx = replace(idx, members=())
        # a file changed since an import named it is imported again when its volume is here; when it is not, it
        # does not wait: the final check hashes it and names it (and the volumes that restore it)
        waiting = sorted(file_member(*key) for key, size in expected.items() if not _is_done(targets[key], size))
        missing = sorted(set(range(1, idx.volumes + 1)) - set(state.doc["done_volumes"]))
        taken_paths = {t.path for t in idx.delta.take} if idx.delta else set()
        if not missing and (lost := sorted(key[1] for key, size in expected.items() if key[0] == MODEL_KIND
                                           and key[1] not in taken_paths and not _is_done(targets[key], size))):
            refused.append(incomplete(ref, lost))  # every volume imported, and still files no volume carries
        complete = not waiting
        verify_doc = None
        outcome = (Outcome.REFUSED if (refused or run.corrupt) else Outcome.IMPORTED if complete
                   else Outcome.WAITING)
        if complete:
            verify_doc = _final_check(dest, run, state, manifest, progress)
            if outcome is Outcome.IMPORTED and not verify_doc["ok"]:
                outcome = Outcome.VERIFY_FAILED
            _write_record(dest, state)
            places.clean_partials()
        roots = places.payload_roots
        return UnbundleReport(outcome is Outcome.IMPORTED, outcome, complete, ref, idx.name, str(dest), idx.volumes,
                              [v.path.name for v in accepted], refused, missing, run.imported, run.skipped,
                              run.corrupt, waiting, payloads_placed(idx.payloads, roots),
                              _next_commands(idx.payloads, roots, dest, manifest) if complete else [], verify_doc,
                              notes=rebuild_report.notes, synced=sync, rebuilt=rebuild_report.volumes,
                              parity_used=rebuild_report.parity_used, recovery=rebuild_report.recovery,
                              signature=_signature_doc(signature), delta=_delta_doc(idx, manifest, base, taken))


def _take_from_base(base: deltas.BaseDir, idx: Index, mode: str, run: _Import, progress: ProgressSink) -> deltas.Taken:
    """The delta's files not yet in place, taken from the base directory (each hashed before it gets its name, and
    with --readback a copy read back from the disk too); each taken file counts as named by this run."""
    todo = [t for t in idx.delta.take if not run.in_place((MODEL_KIND, t.path), t.size)]
    progress.begin(sum(t.size for t in todo), f"take from {base.path} ({mode})", files=len(todo))

    def readback(path: Path, size: int, pipe: ChunkPipe, hashers) -> None:
        run.read_back.add(size, read_back(path, size, pipe, hashers))

    try:
        taken = deltas.take_from_base(base, todo, mode, lambda path: run.targets[(MODEL_KIND, path)],
                                      lambda path: run.places.partial(MODEL_KIND, path), run.places.dest, run.sync,
                                      progress, readback if run.readback else None)
    finally:
        progress.end()
    for path in taken.files:
        run.taken.append(path)
        run.stale.discard((MODEL_KIND, path))
        if run.sync:  # a later sitting trusts it by its stamp, as a file imported from a volume
            run.state.doc.setdefault("proven", {})[f"{MODEL_KIND}:{path}"] = _stamp(run.targets[(MODEL_KIND, path)])
    run.state.save()
    return taken


def _delta_doc(idx: Index, manifest, base: deltas.BaseDir | None, taken: deltas.Taken | None) -> dict | None:
    if idx.delta is None:
        return None
    doc = {**idx.delta.summary(manifest), "from": str(base.path) if base else None}
    if taken is not None:
        doc.update(mode=taken.mode, taken=len(taken.files), taken_bytes=taken.bytes, copied_bytes=taken.copied_bytes,
                   refused=taken.refused)
    return doc


def _signature_doc(report) -> dict | None:
    if report is None:
        return None
    return {"identity": report.identity, "key_type": report.key_type, "fingerprint": report.fingerprint,
            "namespace": report.namespace, "allowed_signers": report.allowed_signers}


def _earlier_index(dest: Path, ref: str | None) -> tuple[Index, bytes, str] | None:
    """(the bundle's data index, the manifest bytes, where) as an earlier sitting of bundle REF left them in DEST,
    or None. Read back as hostile as a volume's: parsed, and the manifest checked against its blake3."""
    path = dest / STATE_DIR / "index.json"
    try:
        idx = parse_index(load_json(read_local_file(path, what="bundle index", max_bytes=MAX_DOCUMENT), str(path)),
                          str(path))
        manifest_bytes = read_local_file(manifest_path(dest), what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError, BadInput):
        return None
    if idx.bundle_id != ref or b3(manifest_bytes) != idx.manifest_blake3:
        return None
    return idx, manifest_bytes, str(manifest_path(dest))


def _restore_signature(dest: Path, first: Volume | None) -> None:
    """Put the manifest's signature back beside the manifest (DEST/.mm/manifest.json.sig)."""
    from ..integrity.signing import signature_path

    if first is None:
        return
    sig = meta_bytes(first, SIG_MEMBER)
    if sig is not None and not signature_path(dest).is_file():
        atomic_write_bytes(signature_path(dest), sig, root=dest)


# --- parity: rebuilding lost data volumes -------------------------------------------------------------

@dataclass
class _Rebuilt:
    volumes: list[int] = field(default_factory=list)  # data volume numbers rebuilt and imported
    parity_used: list[int] = field(default_factory=list)
    recovery: str | None = None  # why not (yet), and what would be enough
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _judge_rebuilt(v: Volume, ref: str, manifest_b3: str | None, manifest, idx: Index) -> str | None:
    """A rebuilt volume is judged as any other before a byte of it is imported: the same bundle, the same
    bundle-wide fields as the bundle's index IDX, entries that agree with the manifest and payload records."""
    if v.refused or v.damaged or v.index is None:
        return f"{v.path.name}: rebuilt from parity but does not open as a whole volume; refused"
    _, refused = _judge_volumes([v], ref, manifest_b3)
    if refused:
        return refused[0]
    if field := v.index.differs_from(idx):
        return f"{v.path.name}: rebuilt from parity, but its index's {field} differs from the bundle's; refused"
    disagree = disagreements(v.index, manifest)
    return f"{v.path.name}: {disagree[0]}; refused" if disagree else None


def _rebuild_from_parity(dest: Path, accepted: list[Volume], pset: ParitySet, run: _Import, state: _State, count: int,
                         sync: bool, progress: ProgressSink, judge, volume_size: int | None = None) -> _Rebuilt:
    """Rebuild the data volumes not yet imported whole (missing, or with a damaged member) from the intact data
    volumes given (or what earlier sittings left in DEST) and the usable parity volumes; import them (each judged
    by JUDGE first), delete them."""
    out = _Rebuilt(notes=list(pset.unused))
    lost = sorted(set(range(1, count + 1)) - set(state.doc.get("done_volumes", [])))
    if not pset.usable or not lost:
        return out
    pindex = pset.usable[0].parity
    if pindex.volumes != count:
        out.refused.append(f"{pset.usable[0].path.name}: parity over {pindex.volumes} data volumes, the bundle has "
                           f"{count}; refused")
        return out
    too_big = [n for n in lost if volume_size and pindex.data[n - 1].size > volume_size]
    if too_big:  # a rebuilt volume is written whole before it is judged: never larger than a volume can be
        out.refused.append(f"{pset.usable[0].path.name}: says data volume {too_big[0]} is "
                           f"{pindex.data[too_big[0] - 1].size} bytes, more than the bundle's volume size "
                           f"{volume_size}; refused")
        return out
    intact = {v.number: v for v in accepted if v.number not in lost}
    sources: dict[int, object] = {n: FileSource(v.path, read_once=True) for n, v in intact.items()}
    for n in sorted(set(state.doc.get("done_volumes", [])) - set(intact)):  # imported in an earlier sitting
        skeleton = _Skeleton.load(dest, n, run)
        if skeleton is not None:
            sources[n] = skeleton
    try:
        progress.begin(sum(pindex.data[n - 1].size for n in lost), f"rebuild volume(s) {', '.join(map(str, lost))}",
                       files=len(lost))
        rebuilt = rebuild_data_volumes(pset.usable, sources, lost, dest / STATE_DIR / REBUILT, sync, progress, root=dest)
        out.notes += [f"{what}: damaged (its bytes do not match the parity index); left out of the rebuild"
                      for what in rebuilt.left_out]
    except NotRecoverable as e:
        out.recovery = f"cannot rebuild yet: {e.message}"
        return out
    finally:
        progress.end()
        for src in sources.values():
            src.close()
    names = {v.number: v.path.name for v in accepted}
    opened = {n: open_volume(path) for n, path in sorted(rebuilt.files.items())}
    judged = {n: judge(v) for n, v in opened.items()}
    progress.begin(sum(e.length for n, v in opened.items() if not judged[n] for e in v.entries()),
                   f"unbundle rebuilt volume(s) {', '.join(str(n) for n in opened if not judged[n])}")
    try:
        for n, v in opened.items():
            if judged[n]:
                out.refused.append(judged[n])
                unlink_file(dest, v.path)
                continue
            run.volume(v)
            _Skeleton.save(dest, v)
            if n in names:  # its damaged members are now imported from the rebuilt copy
                run.corrupt = [c for c in run.corrupt if not c.startswith(f"{names[n]}: ")]
                out.notes.append(f"{names[n]}: damaged; rebuilt from parity and imported")
            state.doc["done_volumes"] = sorted(set(state.doc.get("done_volumes", [])) | {n})
            state.save()
            unlink_file(dest, v.path)
            out.volumes.append(n)
    finally:
        progress.end()
    out.parity_used = rebuilt.parity_used
    return out


def _readable(vols: list[Volume], ref: str | None) -> bool:
    """Some data volume of bundle REF gives its index and manifest."""
    return any(v.bundle_id == ref and not v.refused and v.index is not None and v.has_manifest for v in vols)


def _rebuild_before_import(dest: Path, vols: list[Volume], pvols: list[Volume], ref: str | None, sync: bool,
                           progress: ProgressSink, out: _Rebuilt) -> list[Volume]:
    """No data volume tells the bundle's index, and no earlier sitting left it: the data volumes not given whole
    are rebuilt from the parity volumes first (as `mm bundle repair-volume` does, and as `mm bundle verify`
    promises), into DEST's state directory, then imported as if given. What could not be done goes to OUT."""
    pset = parity_set(pvols, ref)
    if not pset.usable:
        out.recovery = "; ".join(pset.refused + pset.unused) or None
        return []
    pindex = pset.usable[0].parity
    intact = {v.number: v for v in vols if v.bundle_id == ref and v.usable and v.number <= pindex.volumes
              and v.path.name == pindex.data[v.number - 1].file}
    lost = [n for n in range(1, pindex.volumes + 1) if n not in intact]
    require_free_space([(dest / STATE_DIR, sum(pindex.data[n - 1].size for n in lost))],
                       f"rebuilding data volume(s) {', '.join(map(str, lost))} from parity")
    sources: dict[int, object] = {n: FileSource(v.path, read_once=True) for n, v in intact.items()}
    try:
        progress.begin(sum(pindex.data[n - 1].size for n in lost), f"rebuild volume(s) {', '.join(map(str, lost))}",
                       files=len(lost))
        rebuilt = rebuild_data_volumes(pset.usable, sources, lost, dest / STATE_DIR / REBUILT, sync, progress,
                                       root=dest)
    except NotRecoverable as e:
        out.recovery = f"cannot rebuild from parity: {e.message}"
        return []
    finally:
        progress.end()
        for src in sources.values():
            src.close()
    out.volumes, out.parity_used = sorted(rebuilt.files), rebuilt.parity_used
    out.notes += [f"{what}: damaged (its bytes do not match the parity index); left out of the rebuild"
                  for what in rebuilt.left_out]
    return [open_volume(path) for _, path in sorted(rebuilt.files.items())]


class RebuiltVolumes(NamedTuple):
    files: dict[int, Path]  # data volume number -> the rebuilt file
    parity_used: list[int]  # parity volumes the rebuild read
    left_out: list[str]  # inputs found damaged and left out ("parity 1", "volume 3")


def rebuild_data_volumes(pvols: list[Volume], data: dict[int, object], want: list[int], out_dir: Path,
                         sync: bool = True, progress: ProgressSink = NULL_PROGRESS, *,
                         root: Path | None = None) -> RebuiltVolumes:
    """Rebuild data volumes WANT (numbers) from the good DATA sources (number -> parity.ByteSource) and the parity
    volumes PVOLS (parity_set's usable), each into OUT_DIR under its own file name: written under a temporary
    name, named only when its digest (proof.py's proof, or a schema 1 index's whole-file blake3), taken as it is
    written, is the one the parity index records. Raises NotRecoverable naming
    what would be enough. An input whose bytes are not those the parity index records (a damaged parity stream,
    a bad byte between members of a data volume) shows as a result that does not match: it is found by hashing
    the inputs, left out, and the rebuild runs again from the others. ROOT: the directory OUT_DIR lies in (no
    symlink followed below it; default OUT_DIR itself, as the user named it)."""
    if not pvols:
        raise NotRecoverable("no usable parity volume")
    index = pvols[0].parity
    layout, k = index.layout, index.layout.k
    inputs = {n - 1: src for n, src in data.items()}
    opened = []
    for pv in pvols:
        info = pv.data[pv.parity.member]
        opened.append(FileSource(pv.path, info.offset_data, info.size, read_once=True))
        inputs[k + pv.number - 1] = opened[-1]
    want_idx = [n - 1 for n in want]
    out_dir = Path(out_dir)
    root = Path(root or out_dir)
    make_dirs(root, out_dir)
    outs: dict[int, tuple[int, Path, Path]] = {}
    try:
        for i in want_idx:
            final = out_dir / index.data[i].file
            tmp = out_dir / f".{index.data[i].file}.partial"
            outs[i] = (open_file(root, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), tmp, final)

        def sink(fd: int):
            def write(view) -> None:
                write_all(fd, view)
            return write

        def hasher(i: int):
            return index.stream(i).hasher()

        def named(i: int) -> str:
            return f"volume {i + 1}" if i < k else f"parity {i - k + 1}"

        damaged: set[int] = set()
        written = [0]

        def advance(n: int) -> None:
            written[0] += n
            progress.advance(n)

        while True:  # an input found damaged is left out and the rebuild run again while enough are left
            usable = {i: src for i, src in inputs.items() if i not in damaged}
            result = rebuild(layout, usable, want_idx, {i: sink(outs[i][0]) for i in want_idx}, on_bytes=advance,
                             hasher=hasher)
            bad = [i for i in want_idx if result.output_digest[i] != index.data[i].digest]
            if not bad:
                break
            progress.advance(-written[0])  # the bar starts this rebuild again: never past 100%
            written[0] = 0
            checked = rebuild(layout, usable, want_idx, {i: _discard for i in want_idx}, hash_inputs=True,
                              hasher=hasher)
            found = {i for i, d in checked.input_digest.items() if d != index.stream(i).digest}
            if not found:
                raise IntegrityError(f"rebuilt volume(s) {', '.join(str(i + 1) for i in bad)} do not match the "
                                     f"parity index ({'proof' if index.schema == PARITY_SCHEMA else 'blake3'}), and no "
                                     f"input shows damage; nothing written")
            damaged |= found
            if len(inputs) - len(damaged) < k:
                raise NotRecoverable(f"damaged input(s) {', '.join(map(named, sorted(damaged)))} left out: "
                                     f"{describe_shortfall(layout, set(inputs) - damaged, set(want_idx))}")
            for fd, _, _ in outs.values():
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
        done = {}
        for i in want_idx:
            fd, tmp, final = outs.pop(i)
            publish_fd(fd, tmp, final, sync, root=root)
            done[i + 1] = final
        return RebuiltVolumes(done, [i - k + 1 for i in result.inputs if i >= k], [named(i) for i in sorted(damaged)])
    finally:
        for src in opened:
            src.close()
        for fd, tmp, _ in outs.values():
            os.close(fd)
            unlink_file(root, tmp)


def _discard(_view) -> None:
    pass


class _Skeleton:
    """A data volume imported earlier, read back from what it left in DEST: the bytes that are not member data
    (tar headers, metadata, padding: a few KB) are kept at import in DEST/.mm/unbundle/skeleton/, member data is
    read from the imported file (or the partial file of a split one). A parity rebuild in a later sitting uses it
    in place of a disk no longer at hand; what it gives is checked by the rebuilt volume's digest (its proof)."""

    def __init__(self, size: int, regions: list, literal: bytes, run: _Import):
        self.size, self.regions, self.literal, self.run = size, regions, literal, run
        self.starts = [r[0] for r in regions]
        self.files: dict[tuple[str, str], int | None] = {}

    @staticmethod
    def save(dest: Path, v: Volume) -> None:
        spans = sorted((info.offset_data, info.size, e.kind, e.path, e.offset)
                       for e in v.entries() if (info := v.data.get(e.member)) is not None)
        size = os.stat(v.path).st_size
        regions, literal, pos = [], bytearray(), 0
        with open(v.path, "rb") as f:
            for start, length, kind, path, file_offset in [*spans, (size, 0, None, None, 0)]:
                if start > pos:
                    f.seek(pos)
                    gap = f.read(start - pos)
                    regions.append([pos, len(gap), "lit", len(literal)])
                    literal += gap
                if length:
                    regions.append([start, length, "file", kind, path, file_offset])
                pos = start + length
        where = dest / STATE_DIR / "skeleton"
        atomic_write_bytes(where / f"vol{v.number:03d}.bin", bytes(literal), root=dest)
        atomic_write_json(where / f"vol{v.number:03d}.json", {"size": size, "regions": regions}, root=dest)

    @classmethod
    def load(cls, dest: Path, n: int, run: _Import) -> _Skeleton | None:
        """None when it is missing or unreadable (the volume then counts as lost)."""
        where = dest / STATE_DIR / "skeleton"
        try:
            doc = read_json_file(check_inside(dest, where / f"vol{n:03d}.json"), what="volume skeleton")
            literal = read_local_file(check_inside(dest, where / f"vol{n:03d}.bin"), what="volume skeleton",
                                      max_bytes=MAX_DOCUMENT)
            regions = doc["regions"]
            if not isinstance(regions, list) or not all(isinstance(r, list) and len(r) >= 4 for r in regions):
                return None
            return cls(int(doc["size"]), regions, literal, run)
        except (OSError, ValueError, KeyError, TypeError, BadInput):
            return None

    def _file(self, kind: str, path: str) -> int | None:
        if (kind, path) not in self.files:
            final = self.run.targets.get((kind, path))
            found = final if final is not None and final.is_file() else self.run.places.partial(kind, path)
            try:
                self.files[(kind, path)] = os.open(found, os.O_RDONLY)
            except (OSError, BadInput):
                self.files[(kind, path)] = None
        return self.files[(kind, path)]

    def pread(self, offset: int, n: int) -> bytes:
        out = bytearray()
        end = min(offset + n, self.size)
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while offset < end and i < len(self.regions):
            r = self.regions[i]
            start, length = r[0], r[1]
            take = min(end, start + length) - offset
            if take > 0:
                rel = offset - start
                if r[2] == "lit":
                    out += self.literal[r[3] + rel:r[3] + rel + take]
                else:
                    fd = self._file(r[3], r[4])
                    data = os.pread(fd, take, r[5] + rel) if fd is not None else b""
                    out += data + bytes(take - len(data))  # a missing file reads as zeros: the blake3 check fails
                offset += take
            i += 1
        return bytes(out)

    def close(self) -> None:
        for fd in self.files.values():
            if fd is not None:
                os.close(fd)


def _check_dest_manifest(dest: Path, want) -> None:
    """DEST holds no manifest, or one of the same model as WANT (the bundle's, parsed once)."""
    existing = manifest_path(dest)
    if existing.is_file():
        have = read_manifest(existing)
        if (have.repo_id, have.revision, have.files) != (want.repo_id, want.revision, want.files):
            raise Refused(f"{existing}: DEST already holds a different model ({have.repo_id}@{have.revision[:12]}); "
                          f"choose an empty --dest")


def _final_check(dest: Path, run: _Import, state: _State, manifest, progress: ProgressSink) -> dict:
    """Once every file is in place: the whole directory as `mm verify` judges it (every file present, nothing extra,
    sizes, readability, shard headers and indexes), reading again only the content no import has proven: a file
    this run named was hashed on its way to disk, a file an earlier sitting named is proven when it is still the
    very inode, size, mtime and ctime that sitting recorded; anything else (found in place, changed since) is hashed
    now. With --readback every file this run named was also read back from the disk (_Import.read_back). Files a
    delta took from its base count as named: each was hashed against the manifest before it got its name."""
    from ..integrity.stamps import record_verified
    from ..integrity.verify import verify_dir  # the verify capability

    now = {path for kind, path in run.named if kind == MODEL_KIND} | set(run.taken)
    earlier = set()
    for skey, stamp in state.doc.get("proven", {}).items():
        kind, _, path = skey.partition(":")
        target = run.targets.get((kind, path))
        if kind == MODEL_KIND and path not in now and target is not None and _stamp(target) == stamp:
            earlier.add(path)
    rehash = frozenset(f.path for f in manifest.files if f.path not in now and f.path not in earlier)
    # the manifest just imported is the one at DEST (_check_dest_manifest): not read and held a second time
    report = verify_dir(dest, manifest, progress=progress if rehash else NULL_PROGRESS, rehash=rehash)  # no empty bar
    record_verified(dest, report.ok, report.files_checked, report.bytes_checked, len(report.problems), "mm unbundle")
    count = lambda paths: {"files": len(paths), "bytes": sum(f.size for f in manifest.files if f.path in paths)}  # noqa: E731
    return {"ok": report.ok, "files_checked": report.files_checked, "bytes_checked": report.bytes_checked,
            "problems": [f"{p.path}: {p.kind}: {p.detail}" for p in report.problems],
            "hashed_as_written": count(now), "named_earlier_unchanged": count(earlier),
            "hashed_now": {"files": report.files_checked - len(now | earlier), "bytes": report.bytes_checked},
            "read_back": run.read_back.doc() if run.readback else None,
            "proven": run.proven_sentence()}


class Stamp(bytes):
    """A file's [inode, size, mtime_ns, ctime_ns] packed in 32 bytes: a list of four ints is ~200 bytes, and an
    import names a million files. Written to the state and the import record as that list (as_list)."""

    _FORMAT = struct.Struct("<Qqqq")

    @classmethod
    def of(cls, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> "Stamp":
        return cls(cls._FORMAT.pack(ino, size, mtime_ns, ctime_ns))

    @staticmethod
    def as_list(value: object) -> list[int]:
        """json's `default` for a Stamp; anything else is not JSON."""
        if isinstance(value, Stamp):
            return list(Stamp._FORMAT.unpack(value))
        raise TypeError(f"{type(value).__name__} is not JSON")


def _stamp(path: Path) -> Stamp | None:
    """What says a file is still the one an import named: its inode, size, mtime and ctime (ctime cannot be set
    back by a writer: any write or utime after the import changes it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        return Stamp.of(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except (OSError, struct.error):
        return None


@dataclass
class _ReadBack:
    """--readback's tally: files read back from the disk, their bytes, and how many of those bytes the kernel
    fetched from the storage device (None where it does not count them)."""

    files: int = 0
    bytes: int = 0
    from_device: int | None = 0

    def add(self, size: int, from_device: int | None) -> None:
        self.files += 1
        self.bytes += size
        self.from_device = None if from_device is None or self.from_device is None else self.from_device + from_device

    def doc(self) -> dict:
        return {"files": self.files, "bytes": self.bytes, "from_device": self.from_device}


# Whole files this small are named in batches (publish_many: one syncfs, then the renames, then one fsync a
# directory) instead of two flushes each; a batch holds at most this many files and bytes: mm's own margins, a
# killed import redoing at most one batch, and a flush that writes back no more than 64 MiB at a time.
SMALL_FILE = 1024 * 1024
BATCH_FILES = 1024
BATCH_BYTES = 64 * 1024 * 1024
# blake3 threads per hasher of an import: one, in ChunkPipe's helper thread, beside the writer. One core hashes
# faster than a volume is read (blake3: 5.6 GiB/s on one core of this VM; tar -xf + sync: 0.7 GB/s cold on the
# H200 host); blake3's own threads (AUTO: rayon, one a core) woke on every 8 MiB chunk, faulted the volume's
# mapping in from many cores and spun (sched_yield, futex) while a chunk's pages were still being read: on the H200
# host mm unbundle spent 8.02 s of system and 6.19 s of user time against tar's 4.16 s and 0.11 s (docs/bundle.md).
IMPORT_HASH_THREADS = 1


class _Import:
    """Imports members. Each byte is read once, from the volume: hashed (blake3) in the pipe on its way to the
    partial file, each member against the index, each whole file against the manifest before it is named (a file
    split over volumes imported in order in one run is hashed whole in the same pass; one whose earlier pieces came
    in another sitting is read back once from DEST). READBACK: each file, once fsynced, is also read back from the
    disk with its pages dropped from the page cache, and named only if it still matches."""

    def __init__(self, places: Places, state: _State, targets: dict, progress: ProgressSink, sync: bool,
                 readback: bool = False, stale: set | None = None):
        self.places, self.state, self.targets, self.progress, self.sync = places, state, targets, progress, sync
        self.readback = readback
        self.stale = stale if stale is not None else set()  # files changed since an import named them: import again
        self.named: list[tuple[str, str]] = []  # file keys this run imported and named
        self.taken: list[str] = []  # model files this run took from a delta's base and named
        self.corrupt: list[str] = []
        self.present: set[tuple[str, str]] = set()  # files found complete (counted once, however many pieces)
        self.counted = 0
        self.pipe = ChunkPipe()
        self.running: dict[str, tuple[int, StreamHasher]] = {}  # split file -> (bytes hashed in order, its hasher)
        self.reread = 0  # bytes of split files read back from DEST to check them whole (pieces of other sittings)
        self.read_back = _ReadBack()
        self.pending: dict[str, list[tuple[Path, Path, tuple[str, str]]]] = {}  # kind -> small files to name
        self.pending_bytes = 0
        self.drop = reports_free_pages()  # the volumes' pages leave the page cache once copied (_copy)

    def in_place(self, key: tuple[str, str], size: int) -> bool:
        return _in_place(self.targets, self.stale, key, size)

    @property
    def skipped(self) -> int:
        """Files already in place, not members: a file split over three volumes counts once."""
        return len(self.present)

    def proven_sentence(self) -> str:
        """What the import proved of the files it named, in one sentence for the report."""
        how = "fsynced before it was named" if self.sync else "not fsynced (--no-sync)"
        said = (f"each file's blake3 over its bytes as they were written matches the manifest ({how}); "
                + (f"{human_bytes(self.reread)} of split files whose other pieces came in an earlier sitting were "
                   f"read back once from DEST to check them whole; " if self.reread else ""))
        if not self.readback:
            return said + "nothing was read back from the disk (--readback does)"
        rb = self.read_back
        source = ("all of it from the storage device" if rb.from_device is not None and rb.from_device >= rb.bytes
                  else "the kernel does not count reads from the device here" if rb.from_device is None
                  else f"only {human_bytes(rb.from_device)} of it from the storage device: the rest came from "
                       f"memory (a file system without a device, e.g. tmpfs, or pages that could not be dropped)")
        return said + (f"then each file was read back after fsync with its pages dropped from the page cache "
                       f"({rb.files} file(s), {human_bytes(rb.bytes)}, {source}) and matched again")

    def volume(self, v: Volume) -> None:
        for member, why in sorted(v.damaged.items()):
            self.corrupt.append(f"{v.path.name}: member {member!r}: {why}")
        for e in v.entries():
            info = v.data.get(e.member)
            self.counted = 0  # bytes of this entry the copy already showed on the bar
            if info is not None:
                self.progress.item(e.path)
                self.member(v, e, info)
            self.progress.advance(e.length - self.counted)
        self.flush()

    def member(self, v: Volume, e: Entry, info) -> None:
        final = self.targets.get(e.key)
        if final is None:
            self.corrupt.append(f"{v.path.name}: member {e.member!r} is not listed in the bundle's payloads; refused")
            return
        skey = f"{e.kind}:{e.path}"
        pieces = self.state.pieces(skey)
        if self.in_place(e.key, e.size):
            self.present.add(e.key)
            return
        if str(e.segment) in pieces:  # this piece is in place from an earlier sitting
            return
        partial = self.places.partial(*e.key)
        root = self.places.roots[e.kind]  # open_file makes the partial file's directory
        piece = StreamHasher(sha256=False, blake3_threads=IMPORT_HASH_THREADS)
        whole = None if e.whole else self._continuation(skey, e.offset)
        copied = self._copy(v, info, root, partial, e.offset, e.size, fresh=e.whole,
                            hashers=(piece,) if whole is None else (piece, whole))
        got = piece.digests().blake3 if copied else "truncated"
        if got != e.blake3:
            self.corrupt.append(f"{v.path.name}: member {e.member!r}: blake3 mismatch; not imported")
            if e.whole:
                unlink_file(root, partial)
            return
        if not e.whole:
            if e.file_blake3:
                self.state.doc["whole"][skey] = [e.file_blake3, e.file_sha256]
            pieces = self.state.add_piece(skey, e.segment, [e.offset, e.length, got])
            if whole is not None:
                self.running[skey] = (e.offset + e.length, whole)
            self.state.save()
            if len(pieces) < e.segments:
                return
        # the manifest's blake3 for a model file (the index's agrees with it: checked before import), the
        # payload record's for a payload file
        want = e.file_blake3 if e.whole else self.state.doc["whole"].get(skey, [None])[0]
        why = self._check_whole(e, skey, partial, want, got if e.whole else self._hashed_whole(skey, e.size))
        if why:
            self.corrupt.append(f"{v.path.name}: {file_member(*e.key)}: {why}; not imported")
            unlink_file(root, partial)
            self.state.doc["pieces"].pop(skey, None)
            self.state.doc["whole"].pop(skey, None)
            self.state.save()
            return
        if self.sync and e.whole and e.size <= SMALL_FILE:  # named with others, durable at a batch's cost
            self.pending.setdefault(e.kind, []).append((partial, final, e.key))
            self.pending_bytes += e.size
            if sum(map(len, self.pending.values())) >= BATCH_FILES or self.pending_bytes >= BATCH_BYTES:
                self.flush()
            return
        publish(partial, final, sync=self.sync, root=root)
        self._named(e.key, final)
        if not e.whole:
            self.state.doc["pieces"].pop(skey, None)
            self.state.doc["whole"].pop(skey, None)
            self.state.save()

    @property
    def imported(self) -> list[str]:
        """The report's names of the files imported, made when the report is (not held through the import and its
        final check: ~100 bytes a file)."""
        return [file_member(*key) for key in self.named]

    def _named(self, key: tuple[str, str], final: Path) -> None:
        self.named.append(key)
        self.stale.discard(key)
        if self.sync:  # a later sitting trusts it by its stamp (not a file a crash may have cut: --no-sync)
            self.state.doc.setdefault("proven", {})[f"{key[0]}:{key[1]}"] = _stamp(final)  # saved with the state

    def flush(self) -> None:
        """Name the small files checked and waiting (fsutil.publish_many: their bytes on the disk before any of them
        gets its name); done before the state records a volume, so what it calls done survives a crash."""
        pending, self.pending, self.pending_bytes = self.pending, {}, 0
        for kind, files in pending.items():
            publish_many([(partial, final) for partial, final, _ in files], root=self.places.roots[kind])
            for _, final, key in files:
                self._named(key, final)

    def _continuation(self, skey: str, offset: int) -> StreamHasher | None:
        """The whole-file hasher a piece at OFFSET continues (a copy: kept only when the piece checks), or None
        when the bytes before it did not pass this run in order."""
        if offset == 0:
            return StreamHasher(sha256=False, blake3_threads=IMPORT_HASH_THREADS)
        upto, h = self.running.get(skey, (0, None))
        return h.copy() if h is not None and upto == offset else None

    def _hashed_whole(self, skey: str, size: int) -> str | None:
        """The blake3 of a split file hashed whole on its way to disk in this run, or None."""
        upto, h = self.running.pop(skey, (0, None))
        return h.digests().blake3 if h is not None and upto == size else None

    def _check_whole(self, e: Entry, skey: str, partial: Path, want: str | None, hashed: str | None) -> str | None:
        """Why the complete partial file may not be named, or None. HASHED: its blake3 as written in this run (None
        when its pieces did not all pass in order: it is read back from DEST once)."""
        if hashed is not None and hashed != want:
            return "assembled file does not match its blake3"
        if hashed is not None and not self.readback:
            return None
        h = StreamHasher(sha256=False, blake3_threads=IMPORT_HASH_THREADS)
        if self.readback:
            self.read_back.add(e.size, read_back(partial, e.size, self.pipe, (h,)))
        else:
            for _ in self.pipe.stream(partial, 0, e.size, (h,)):
                pass
            self.reread += e.size
        if h.digests().blake3 == want:
            return None
        if hashed is None:
            return "assembled file does not match its blake3"
        return ("read back from the disk after fsync, its blake3 differs from the bytes written (the destination "
                "disk or its controller returned other bytes)")

    def _copy(self, v: Volume, info, root: Path, partial: Path, offset: int, size: int, fresh: bool, hashers) -> bool:
        """Write the member's bytes at OFFSET of the partial file, feeding them to HASHERS on the way; False when
        the volume ended early. A piece of a split file is fsynced (file and directory) unless told not to: the
        state records it next. A whole file is fsynced by publish."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0)
        fd = open_file(root, partial, flags, 0o644)  # never through a link (fsutil's rule)
        flush = WriteBehind(fd, start=offset)  # the pages stay cached: the engine reads the model next
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            pos = offset
            try:
                # where the VM hands free memory back to its host, the volume's pages leave the page cache once
                # copied: it is read once, and the memory they held takes the model's pages next, not memory the
                # host took back (docs/bundle.md, "Page cache"); elsewhere they stay, as tar leaves them: the
                # drop is kernel work in this thread (fadvise: 45 ms for 1.07 GiB in perf here) that gains nothing there
                for view in self.pipe.stream(v.path, info.offset_data, info.size, hashers, drop=self.drop):
                    try:
                        n = write_all(fd, view, pos)
                    except OSError as e:  # DEST is full or read-only: name it (the CLI maps the errno)
                        e.filename = str(partial)
                        raise
                    pos += n
                    flush.wrote(n)
                    self.progress.advance(n)
                    self.counted += n
            except EOFError:  # the volume shrank since it was scanned
                return False
            except OSError as e:
                if e.filename is not None:
                    raise
                raise BadInput(f"{v.path.name}: member {info.name!r}: cannot be read ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if self.sync and not fresh:  # a piece recorded in the state must survive a crash
            fsync_dir(partial)
            fsync_dir(partial.parent)
        return True
