"""mm unbundle: import volumes (any order, any number of sittings) into a model directory, safely.

Nothing from a volume is trusted until checked: the tar headers are judged first (volume.open_volume);
every target path is derived from the typed index (never from the tar member name), validated, and kept
inside its destination; data is read from the volume at the validated member offset and written by this
code (tarfile never extracts). A hostile or damaged volume is named with the member at fault.

State between sittings lives in DEST/.mm/unbundle/state.json (which pieces of split files are in place).
Files are written under partial names (DEST/.mm/unbundle/partial/..., or <payload root>/.mm-partial/...)
and given their final name only when their whole-file blake3 matches the manifest (payloads: the index of
the volume holding their last byte). A file already at its final name with the right size is not rewritten.

The report says how the import went (Outcome: imported, refused, verify-failed); the CLI maps that to the
exit status. Not enough free space raises Refused before anything is written.
"""
from __future__ import annotations

import enum
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from ..errors import BadInput, Refused
from ..fsutil import (MM_DIR, atomic_write_bytes, atomic_write_json, check_relpath, dir_lock, fsync_dir, publish,
                      require_free_space)
from ..hashing import StreamHasher, blake3_file
from ..manifest import from_dict, manifest_path
from ..progress import NULL_PROGRESS, ProgressSink
from .check import conflicting_numbers, reference_bundle
from .copyio import HASH_THREADS, ChunkPipe, EarlyFlush
from .format import MANIFEST_MEMBER, b3, file_member
from .index import Entry
from .payloads import MODEL_KIND, PAYLOAD_PARTIAL, files_expected, next_commands, payload_roots, payloads_placed
from .volume import Volume, find_volumes, open_volume

STATE_DIR = f"{MM_DIR}/unbundle"


class Outcome(str, enum.Enum):
    """How an unbundle run ended (the CLI maps it to the exit status)."""

    IMPORTED = "imported"  # everything given was imported (volumes may still be missing)
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


class Places:
    """Where each kind of file goes, and its partial name; every path is checked to stay inside its root."""

    def __init__(self, dest: Path, payload_dests: dict[str, Path | None] | None = None):
        self.dest = dest
        self.payload_roots = payload_roots(dest, payload_dests)
        self.roots = {MODEL_KIND: dest, **self.payload_roots}

    def final(self, kind: str, path: str) -> Path:
        check_relpath(path, f"{kind} path")
        root = self.roots[kind]
        target = root / path
        for parent in [*reversed(target.relative_to(root).parents)][1:] + [target.relative_to(root)]:
            if (root / parent).is_symlink():
                raise BadInput(f"{root / parent}: is a symlink inside the destination; refusing to write through it")
        return target

    def partial_dir(self, kind: str) -> Path:
        if kind == MODEL_KIND:
            return self.dest / STATE_DIR / "partial"
        return self.roots[kind] / PAYLOAD_PARTIAL

    def partial(self, kind: str, path: str) -> Path:
        return self.partial_dir(kind) / (b3(f"{kind}:{path}".encode())[:32] + ".part")

    def clean_partials(self) -> None:
        shutil.rmtree(self.dest / STATE_DIR, ignore_errors=True)
        for kind in self.payload_roots:
            shutil.rmtree(self.partial_dir(kind), ignore_errors=True)


class _State:
    """Pieces of split files already in place, by file; written atomically after every piece."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.doc = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as e:
            raise BadInput(f"{path}: unreadable unbundle state ({e}); remove it to start the import over") from None
        if not isinstance(self.doc, dict):
            raise BadInput(f"{path}: not an unbundle state; remove it to start the import over")
        self.doc.setdefault("pieces", {})
        self.doc.setdefault("whole", {})

    def pieces(self, key: str) -> dict:
        return self.doc["pieces"].setdefault(key, {})

    def bytes_in_place(self, key: str) -> int:
        return sum(int(p[1]) for p in self.doc["pieces"].get(key, {}).values())

    def save(self) -> None:
        atomic_write_json(self.path, self.doc)


def _is_done(target: Path, size: int) -> bool:
    return target.is_file() and not target.is_symlink() and target.stat().st_size == size


def check_free_space(places: Places, remaining: dict[str, int]) -> None:
    """REMAINING: bytes still to write by kind of destination."""
    require_free_space([(places.roots[kind], need) for kind, need in remaining.items()], "the bundle")


def _judge_volumes(vols: list[Volume], ref: str | None, manifest_b3: str | None) -> tuple[list[Volume], list[str]]:
    conflicts = conflicting_numbers(vols, ref)
    accepted, refused = [], []
    for v in vols:
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
        else:
            accepted.append(v)
    return accepted, refused


def _still_needed(expected: dict, targets: dict, state: _State) -> dict[str, int]:
    """Bytes still to write, by kind of destination (files not yet final, less pieces already in place)."""
    needed: dict[str, int] = {}
    for key, size in expected.items():
        left = 0 if _is_done(targets[key], size) else size - state.bytes_in_place(f"{key[0]}:{key[1]}")
        needed[key[0]] = needed.get(key[0], 0) + left
    return needed


def _check_entries(v: Volume, manifest_files: dict) -> str | None:
    """An index entry for a model file must agree with the manifest (path, size, whole-file hashes)."""
    for e in v.entries():
        if e.kind != MODEL_KIND:
            continue
        f = manifest_files.get(e.path)
        if f is None:
            return f"{v.path.name}: member {e.member!r} is not a file of the manifest; refused"
        if (f.size, f.blake3, f.sha256) != (e.size, e.file_blake3, e.file_sha256):
            return f"{v.path.name}: member {e.member!r} disagrees with the manifest (size or hash); refused"
    return None


def unbundle(sources: list[Path], dest: Path, payload_dests: dict[str, Path | None] | None = None,
             progress: ProgressSink = NULL_PROGRESS, sync: bool = True) -> UnbundleReport:
    """Import the volumes in SOURCES into DEST; PAYLOAD_DESTS: payload kind -> its destination (default
    DEST.payload/<kind dir>). sync=False skips the fsyncs of imported data (the final names still come only
    after the hashes match)."""
    dest = Path(dest)
    vols = [open_volume(p) for p in find_volumes(sources)]
    dest.mkdir(parents=True, exist_ok=True)
    with dir_lock(dest, "mm unbundle"):
        state = _State(dest / STATE_DIR / "state.json")
        ref = reference_bundle(vols, state.doc.get("bundle_id"))
        first = next((v for v in vols if v.bundle_id == ref and not v.refused and v.manifest_bytes
                      and MANIFEST_MEMBER not in v.damaged), None)
        manifest_b3 = state.doc.get("manifest_blake3") or (first.index.manifest_blake3 if first else None)
        accepted, refused = _judge_volumes(vols, ref, manifest_b3)
        if first is None or not accepted:
            raise BadInput(f"no usable volume of bundle {ref or '(unknown)'} among {len(vols)} given: "
                           + "; ".join(refused[:3]))
        manifest = from_dict(json.loads(first.manifest_bytes), f"{first.path.name}: {MANIFEST_MEMBER}")
        files_by_path = manifest.by_path()
        for v in list(accepted):
            why = _check_entries(v, files_by_path)
            if why:
                accepted.remove(v)
                refused.append(why)
        idx = first.index
        _check_dest_manifest(dest, first.manifest_bytes)
        places = Places(dest, payload_dests)
        expected = {**{(MODEL_KIND, f.path): f.size for f in manifest.files}, **files_expected(idx.payloads)}
        targets = {key: places.final(*key) for key in expected}
        check_free_space(places, _still_needed(expected, targets, state))
        state.doc.update({"bundle_id": ref, "name": idx.name, "volumes": idx.volumes,
                          "manifest_blake3": idx.manifest_blake3})
        if not manifest_path(dest).is_file():
            atomic_write_bytes(manifest_path(dest), first.manifest_bytes)
        state.save()
        run = _Import(places, state, targets, progress, sync)
        total = sum(e.length for v in accepted for e in v.entries())
        progress.begin(total, f"unbundle {idx.name}")
        try:
            for v in sorted(accepted, key=lambda v: v.number):
                run.volume(v)
                done_vols = set(state.doc.setdefault("done_volumes", []))
                if not any(v.path.name in c for c in run.corrupt):
                    done_vols.add(v.number)
                state.doc["done_volumes"] = sorted(done_vols)
                state.save()
        finally:
            run.pipe.close()
        progress.end()
        waiting = sorted(file_member(*key) for key, size in expected.items() if not _is_done(targets[key], size))
        missing = sorted(set(range(1, idx.volumes + 1)) - set(state.doc["done_volumes"]))
        complete = not waiting
        verify_doc = None
        outcome = Outcome.REFUSED if (refused or run.corrupt) else Outcome.IMPORTED
        if complete:
            verify_doc = _final_verify(dest, progress)
            if outcome is Outcome.IMPORTED and not verify_doc["ok"]:
                outcome = Outcome.VERIFY_FAILED
            places.clean_partials()
        roots = places.payload_roots
        return UnbundleReport(outcome is Outcome.IMPORTED, outcome, complete, ref, idx.name, str(dest), idx.volumes,
                              [v.path.name for v in accepted], refused, missing, run.imported, run.skipped,
                              run.corrupt, waiting, payloads_placed(idx.payloads, roots),
                              next_commands(idx.payloads, roots) if complete else [], verify_doc, synced=sync)


def _check_dest_manifest(dest: Path, manifest_bytes: bytes) -> None:
    existing = manifest_path(dest)
    if existing.is_file():
        have = from_dict(json.loads(existing.read_text()), str(existing))
        want = from_dict(json.loads(manifest_bytes), "bundle manifest")
        if (have.repo_id, have.revision, have.files) != (want.repo_id, want.revision, want.files):
            raise Refused(f"{existing}: DEST already holds a different model ({have.repo_id}@{have.revision[:12]}); "
                          f"choose an empty --dest")


def _final_verify(dest: Path, progress: ProgressSink) -> dict:
    from ..verify import verify_dir  # the verify capability (issue 3)

    report = verify_dir(dest, progress=progress)
    return {"ok": report.ok, "files_checked": report.files_checked, "bytes_checked": report.bytes_checked,
            "problems": [f"{p.path}: {p.kind}: {p.detail}" for p in report.problems]}


class _Import:
    def __init__(self, places: Places, state: _State, targets: dict, progress: ProgressSink, sync: bool):
        self.places, self.state, self.targets, self.progress, self.sync = places, state, targets, progress, sync
        self.imported: list[str] = []
        self.corrupt: list[str] = []
        self.skipped = 0
        self.pipe = ChunkPipe()

    def volume(self, v: Volume) -> None:
        for member, why in sorted(v.damaged.items()):
            self.corrupt.append(f"{v.path.name}: member {member!r}: {why}")
        for e in v.entries():
            info = v.data.get(e.member)
            if info is not None:
                self.member(v, e, info)
            self.progress.advance(e.length)

    def member(self, v: Volume, e: Entry, info) -> None:
        final = self.targets.get(e.key)
        if final is None:
            self.corrupt.append(f"{v.path.name}: member {e.member!r} is not listed in the bundle's payloads; refused")
            return
        skey = f"{e.kind}:{e.path}"
        pieces = self.state.pieces(skey)
        if _is_done(final, e.size) or str(e.segment) in pieces:
            self.skipped += 1
            return
        partial = self.places.partial(*e.key)
        partial.parent.mkdir(parents=True, exist_ok=True)
        got = self._copy(v, info, partial, e.offset, e.size, fresh=e.whole)
        if got != e.blake3:
            self.corrupt.append(f"{v.path.name}: member {e.member!r}: blake3 mismatch; not imported")
            if e.whole:
                partial.unlink(missing_ok=True)
            return
        if not e.whole:
            if e.file_blake3:
                self.state.doc["whole"][skey] = [e.file_blake3, e.file_sha256]
            pieces[str(e.segment)] = [e.offset, e.length, got]
            self.state.save()
            if len(pieces) < e.segments:
                return
        want = e.file_blake3 if e.whole else self.state.doc["whole"].get(skey, [None])[0]
        have = got if e.whole else blake3_file(partial, threads=blake3.blake3.AUTO)
        if have != want:
            self.corrupt.append(f"{v.path.name}: {file_member(*e.key)}: assembled file does not match its "
                                f"blake3; not imported")
            partial.unlink(missing_ok=True)
            self.state.doc["pieces"].pop(skey, None)
            self.state.doc["whole"].pop(skey, None)
            self.state.save()
            return
        publish(partial, final, sync=self.sync)
        self.imported.append(file_member(*e.key))
        if not e.whole:
            self.state.doc["pieces"].pop(skey, None)
            self.state.doc["whole"].pop(skey, None)
            self.state.save()

    def _copy(self, v: Volume, info, partial: Path, offset: int, size: int, fresh: bool) -> str:
        """Write the member's bytes at OFFSET of the partial file, hashing them; fsynced unless told not to.
        Returns the blake3."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0)
        fd = os.open(partial, flags, 0o644)
        h = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
        flush = EarlyFlush(fd, enabled=self.sync)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            pos = offset
            try:
                for view in self.pipe.stream(v.path, info.offset_data, info.size, (h,)):
                    while view:
                        n = os.pwrite(fd, view, pos)
                        view, pos = view[n:], pos + n
                        flush.wrote(n)
            except EOFError:  # the volume shrank since it was scanned
                return "truncated"
            except OSError as e:
                raise BadInput(f"{v.path.name}: member {info.name!r}: copy to {partial} failed ({e})") from None
            finally:
                flush.wait()
        finally:
            os.close(fd)
        if self.sync:  # a piece recorded in the state must survive a crash
            fsync_dir(partial)
            fsync_dir(partial.parent)
        return h.digests().blake3
