"""mm unbundle: import volumes (any order, any number of sittings) into a model directory, safely.

Nothing from a volume is trusted until checked: the tar headers are judged first (bundle_format.open_volume);
every target path is derived from the index (never from the tar member name), validated, and kept inside
its destination; data is read from the volume at the validated member offset and written by this code
(tarfile never extracts). A hostile or damaged volume is named with the member at fault.

State between sittings lives in DEST/.mm/unbundle/state.json (which pieces of split files are in place).
Files are written under partial names (DEST/.mm/unbundle/partial/..., or <payload root>/.mm-partial/...)
and given their final name only when their whole-file blake3 matches the manifest (payloads: the index of
the volume holding their last byte). A file already at its final name with the right size is not rewritten.

Exit status (see cli): 0 imported cleanly (even if volumes are still missing); 5 a volume or member was
refused or did not match its hash (the rest is imported); 1 the final full verify found problems;
7 not enough free space (checked before writing anything).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from .bundle_verify import conflicting_numbers, reference_bundle, split_volumes
from .bundle_format import (
    HASH_THREADS, KINDS, MANIFEST_MEMBER, SIG_MEMBER, ChunkPipe, EarlyFlush, Volume, b3, find_volumes, io_settings,
    open_volume,
)
from .bundle_parity import ParityVolume, parity_set, rebuild_data_volumes
from .errors import BadInput, IntegrityError, Refused
from .fsutil import MM_DIR, atomic_write_bytes, atomic_write_json, check_relpath, dir_lock, fsync_dir, human_bytes, publish
from .hashing import StreamHasher, blake3_file
from .manifest import from_dict, manifest_path
from .progress import NULL_PROGRESS, ProgressSink

STATE_DIR = f"{MM_DIR}/unbundle"
PAYLOAD_PARTIAL = ".mm-partial"


@dataclass
class UnbundleReport:
    ok: bool
    exit_code: int
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


class _Dest:
    """Where each kind of file goes, and its partial name; every path is checked to stay inside its root."""

    def __init__(self, dest: Path, image_dest: Path | None, cache_dest: Path | None):
        beside = dest.parent / f"{dest.name}.payload"
        self.roots = {"model": dest, "image": Path(image_dest or beside / "image"),
                      "kernel-cache": Path(cache_dest or beside / "kernel-cache")}

    def final(self, kind: str, path: str) -> Path:
        check_relpath(path, f"{kind} path")
        root = self.roots[kind]
        target = root / path
        for parent in [*reversed(target.relative_to(root).parents)][1:] + [target.relative_to(root)]:
            if (root / parent).is_symlink():
                raise BadInput(f"{root / parent}: is a symlink inside the destination; refusing to write through it")
        return target

    def partial(self, kind: str, path: str) -> Path:
        name = b3(f"{kind}:{path}".encode())[:32] + ".part"
        if kind == "model":
            return self.roots["model"] / STATE_DIR / "partial" / name
        return self.roots[kind] / PAYLOAD_PARTIAL / name


class _State:
    """Pieces of split files already in place, by file; written atomically after every piece."""

    def __init__(self, path: Path):
        self.path = path
        self.doc = json.loads(path.read_text()) if path.is_file() else {}
        self.doc.setdefault("pieces", {})
        self.doc.setdefault("whole", {})

    def pieces(self, key: str) -> dict:
        return self.doc["pieces"].setdefault(key, {})

    def bytes_in_place(self, key: str) -> int:
        return sum(int(p[1]) for p in self.doc["pieces"].get(key, {}).values())

    def save(self) -> None:
        atomic_write_json(self.path, self.doc)


def _files_expected(manifest, payloads: dict) -> dict[tuple[str, str], int]:
    files = {("model", f.path): f.size for f in manifest.files}
    if payloads.get("image"):
        files[("image", payloads["image"]["file"])] = int(payloads["image"]["size"])
    for c in payloads.get("kernel_caches", []):
        for rel, size in c["files"]:
            files[("kernel-cache", f"{c['label']}/{rel}")] = int(size)
    return files


def _is_done(target: Path, size: int) -> bool:
    return target.is_file() and not target.is_symlink() and target.stat().st_size == size


def check_free_space(dest: _Dest, remaining: dict[str, int]) -> None:
    by_device: dict[int, tuple[Path, int]] = {}
    for kind, need in remaining.items():
        probe = dest.roots[kind]
        while not probe.exists():
            probe = probe.parent
        dev = probe.stat().st_dev
        seen = by_device.get(dev, (probe, 0))
        by_device[dev] = (seen[0], seen[1] + need)
    for probe, need in by_device.values():
        free = shutil.disk_usage(probe).free
        if need > free:
            raise Refused(f"{probe}: not enough free space: the bundle needs {human_bytes(need)} more, "
                          f"{human_bytes(free)} free")


def _judge_volumes(vols: list[Volume], ref: str | None, manifest_b3: str | None) -> tuple[list[Volume], list[str]]:
    conflicts = conflicting_numbers(vols, ref)
    accepted, refused = [], []
    for v in vols:
        if v.refused:
            refused += v.refused
        elif v.bundle_id != ref:
            refused.append(f"{v.path.name}: belongs to bundle {v.bundle_id} ({v.index.get('name')}), "
                           f"not {ref}; refused")
        elif v.number in conflicts:
            others = ", ".join(o.path.name for o in conflicts[v.number] if o is not v)
            refused.append(f"{v.path.name}: claims volume {v.number}, as does {others} with a different index; "
                           f"both refused")
        elif manifest_b3 and v.index.get("manifest_blake3") != manifest_b3:
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
        if e["kind"] != "model":
            continue
        f = manifest_files.get(e["path"])
        if f is None:
            return f"{v.path.name}: member {e['member']!r} is not a file of the manifest; refused"
        if (f.size, f.blake3, f.sha256) != (int(e["size"]), e["file_blake3"], e["file_sha256"]):
            return f"{v.path.name}: member {e['member']!r} disagrees with the manifest (size or hash); refused"
    return None


def _meta_bytes(v: Volume, member: str, limit: int = 64 * 1024) -> bytes | None:
    """A small metadata member's bytes, if present, within LIMIT, and matching the blake3 in the volume's index."""
    info = v.meta.get(member)
    want = (v.index or {}).get("meta", {}).get(member)
    if info is None or want is None or info.size > limit:
        return None
    with open(v.path, "rb") as f:
        f.seek(info.offset_data)
        data = f.read(info.size)
    return data if len(data) == info.size and b3(data) == want else None


def check_signature(vols: list[Volume], allowed_signers: Path, identity: str | None, require: bool):
    """The bundle's manifest signature, checked with ssh-keygen before anything is written; (report, bytes)."""
    from .signing import verify_manifest_signature

    ref = reference_bundle(vols)
    first = next((v for v in vols if v.bundle_id == ref and not v.refused and v.manifest_bytes
                  and MANIFEST_MEMBER not in v.damaged), None)
    if first is None:
        raise BadInput("no usable volume to check the manifest signature in")
    sig = _meta_bytes(first, SIG_MEMBER)
    if sig is None and SIG_MEMBER in (first.index or {}).get("meta", {}):
        raise IntegrityError(f"{first.path.name}: member {SIG_MEMBER!r} is damaged; refused")
    if sig is None and not require:
        return None, first.manifest_bytes
    report = verify_manifest_signature(first.manifest_bytes, sig, allowed_signers, identity,
                                       where=f"{first.path.name}: {MANIFEST_MEMBER}",
                                       signature_where=f"{first.path.name}: {SIG_MEMBER}")
    return report, first.manifest_bytes


def unbundle(sources: list[Path], dest: Path, image_dest: Path | None = None, cache_dest: Path | None = None,
             progress: ProgressSink = NULL_PROGRESS, sync: bool = True, allowed_signers: Path | None = None,
             identity: str | None = None, require_signature: bool = False) -> UnbundleReport:
    """sync=False skips the fsyncs of imported data (the final names still come only after the hashes match).

    ALLOWED_SIGNERS: the manifest's signature is checked (ssh-keygen) before anything is written; with
    REQUIRE_SIGNATURE an unsigned bundle is refused too (IntegrityError, exit 5). Parity volumes among SOURCES
    rebuild data volumes that are missing or damaged (bundle_parity.py); each rebuilt volume is checked whole
    against the parity index, then imported like any other (every member against its blake3, every file against
    the manifest)."""
    dest = Path(dest)
    vols, pvols = split_volumes(find_volumes(sources))
    signature, signed_manifest = None, None
    if allowed_signers is not None:
        signature, signed_manifest = check_signature(vols, allowed_signers, identity, require_signature)
    dest.mkdir(parents=True, exist_ok=True)
    with dir_lock(dest, "mm unbundle"):
        state = _State(dest / STATE_DIR / "state.json")
        ref = reference_bundle(vols, state.doc.get("bundle_id"))
        first = next((v for v in vols if v.bundle_id == ref and not v.refused and v.manifest_bytes
                      and MANIFEST_MEMBER not in v.damaged), None)
        manifest_b3 = state.doc.get("manifest_blake3") or (first.index["manifest_blake3"] if first else None)
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
        if signed_manifest is not None and first.manifest_bytes != signed_manifest:
            raise IntegrityError(f"{first.path.name}: carries another manifest than the one whose signature was checked")
        _check_dest_manifest(dest, first.manifest_bytes)
        places = _Dest(dest, image_dest, cache_dest)
        expected = _files_expected(manifest, idx["payloads"])
        targets = {key: places.final(*key) for key in expected}
        check_free_space(places, _still_needed(expected, targets, state))
        state.doc.update({"bundle_id": ref, "name": idx["name"], "volumes": idx["volumes"],
                          "manifest_blake3": idx["manifest_blake3"]})
        if not manifest_path(dest).is_file():
            atomic_write_bytes(manifest_path(dest), first.manifest_bytes)
        _restore_signature(dest, first)
        state.save()
        run = _Import(places, state, targets, progress, sync)
        total = sum(int(e["length"]) for v in accepted for e in v.entries())
        progress.begin(total, f"unbundle {idx['name']}")
        try:
            for v in sorted(accepted, key=lambda v: v.number):
                run.volume(v)
                done_vols = set(state.doc.setdefault("done_volumes", []))
                if not any(v.path.name in c for c in run.corrupt):
                    done_vols.add(v.number)
                    if pvols or idx.get("parity"):
                        _Skeleton.save(dest, v)
                state.doc["done_volumes"] = sorted(done_vols)
                state.save()
            progress.end()
            rebuilt, parity_used, recovery, parity_notes = [], [], None, []
            if pvols and any(not _is_done(targets[key], size) for key, size in expected.items()):
                rebuilt, parity_used, recovery, parity_notes = _rebuild_from_parity(
                    dest, ref, accepted, pvols, run, state, int(idx["volumes"]), sync, progress)
        finally:
            run.pipe.close()
        waiting = sorted(f"{KINDS[k]}/{p}" for (k, p), size in expected.items() if not _is_done(targets[(k, p)], size))
        missing = sorted(set(range(1, int(idx["volumes"]) + 1)) - set(state.doc["done_volumes"]))
        complete = not waiting
        verify_doc = None
        refused += [n for n in parity_notes if n.endswith("refused")]
        exit_code = 5 if (refused or run.corrupt) else 0
        if complete:
            verify_doc = _final_verify(dest, progress)
            exit_code = exit_code or (0 if verify_doc["ok"] else 1)
            _clean_partials(places, dest)
        payloads = _payload_places(idx["payloads"], places)
        return UnbundleReport(exit_code == 0, exit_code, complete, ref, idx["name"], str(dest), int(idx["volumes"]),
                              [v.path.name for v in accepted], refused, missing, run.imported, run.skipped,
                              run.corrupt, waiting, payloads, _next_commands(payloads, complete), verify_doc,
                              notes=[n for n in parity_notes if not n.endswith("refused")], synced=sync,
                              rebuilt=rebuilt, parity_used=parity_used, recovery=recovery,
                              signature=_signature_doc(signature))


def _signature_doc(report) -> dict | None:
    if report is None:
        return None
    return {"identity": report.identity, "key_type": report.key_type, "fingerprint": report.fingerprint,
            "namespace": report.namespace, "allowed_signers": report.allowed_signers}


def _restore_signature(dest: Path, first: Volume) -> None:
    """Put the manifest's signature back beside the manifest (DEST/.mm/manifest.json.sig)."""
    from .signing import signature_path

    sig = _meta_bytes(first, SIG_MEMBER)
    if sig is not None and not signature_path(dest).is_file():
        atomic_write_bytes(signature_path(dest), sig)


def _rebuild_from_parity(dest: Path, ref: str, accepted: list[Volume], pvols: list[ParityVolume], run: "_Import",
                         state: "_State", count: int, sync: bool, progress: ProgressSink):
    """Rebuild the data volumes not yet imported whole (missing, or with a damaged member) from the intact data
    volumes given and the parity volumes, import them, delete them. Returns (rebuilt numbers, parity numbers
    used, why not when it cannot yet, notes)."""
    from .parity import FileSource, NotRecoverable

    usable, notes = parity_set(pvols, ref)
    lost = sorted(set(range(1, count + 1)) - set(state.doc.get("done_volumes", [])))
    if not usable or not lost:
        return [], [], None, notes
    if usable[0].index.volumes != count:
        return [], [], None, notes + [f"{usable[0].path.name}: parity over {usable[0].index.volumes} data volumes, "
                                      f"the bundle has {count}; refused"]
    intact = {v.number: v for v in accepted if v.number not in lost}
    sources = {n: FileSource(v.path) for n, v in intact.items()}
    for n in sorted(set(state.doc.get("done_volumes", [])) - set(intact)):  # imported in an earlier sitting
        skeleton = _Skeleton.load(dest, n, run)
        if skeleton is not None:
            sources[n] = skeleton
    out_dir = dest / STATE_DIR / "rebuilt"
    try:
        progress.begin(sum(usable[0].index.data[n - 1].size for n in lost), f"rebuild volume(s) {lost}")
        rebuilt = rebuild_data_volumes(usable, sources, lost, out_dir, sync=sync, progress=progress,
                                       delay=io_settings()[1])
        progress.end()
    except NotRecoverable as e:
        progress.end()
        return [], [], f"cannot rebuild yet: {e.message}", notes
    finally:
        for src in sources.values():
            src.close()
    names = {v.number: v.path.name for v in accepted}
    for n, path in sorted(rebuilt.items()):
        v = open_volume(path)
        if v.refused or v.damaged or v.bundle_id != ref or v.number != n:
            raise IntegrityError(f"{path.name}: rebuilt from parity but does not open as volume {n} of {ref}")
        run.volume(v)
        _Skeleton.save(dest, v)
        if n in names:  # its damaged members are now imported from the rebuilt copy
            run.corrupt = [c for c in run.corrupt if not c.startswith(f"{names[n]}: ")]
            notes.append(f"{names[n]}: damaged; rebuilt from parity and imported")
        state.doc["done_volumes"] = sorted(set(state.doc.get("done_volumes", [])) | {n})
        state.save()
        path.unlink()
    return sorted(rebuilt), [pv.number for pv in usable], None, notes


def _check_dest_manifest(dest: Path, manifest_bytes: bytes) -> None:
    existing = manifest_path(dest)
    if existing.is_file():
        have = from_dict(json.loads(existing.read_text()), str(existing))
        want = from_dict(json.loads(manifest_bytes), "bundle manifest")
        if (have.repo_id, have.revision, have.files) != (want.repo_id, want.revision, want.files):
            raise Refused(f"{existing}: DEST already holds a different model ({have.repo_id}@{have.revision[:12]}); "
                          f"choose an empty --dest")


def _final_verify(dest: Path, progress: ProgressSink) -> dict:
    from .verify import verify_dir  # the verify capability (issue 3)

    report = verify_dir(dest, progress=progress)
    return {"ok": report.ok, "files_checked": report.files_checked, "bytes_checked": report.bytes_checked,
            "problems": [f"{p.path}: {p.kind}: {p.detail}" for p in report.problems]}


def _clean_partials(places: _Dest, dest: Path) -> None:
    shutil.rmtree(dest / STATE_DIR, ignore_errors=True)
    for kind in ("image", "kernel-cache"):
        shutil.rmtree(places.roots[kind] / PAYLOAD_PARTIAL, ignore_errors=True)


def _payload_places(payloads: dict, places: _Dest) -> dict:
    out: dict = {"image": None, "kernel_caches": []}
    if payloads.get("image"):
        img = payloads["image"]
        out["image"] = {**img, "path": str(places.roots["image"] / img["file"])}
    for c in payloads.get("kernel_caches", []):
        out["kernel_caches"].append({"label": c["label"], "key": c["key"], "files": len(c["files"]),
                                     "path": str(places.roots["kernel-cache"] / c["label"])})
    return out


def _next_commands(payloads: dict, complete: bool) -> list[str]:
    if not complete:
        return []
    cmds = []
    if payloads["image"]:
        cmds.append(f"docker load -i {payloads['image']['path']}")
    for c in payloads["kernel_caches"]:
        cmds.append(f"docker run ... -v {c['path']}:/root/.cache/{c['label']} ...   "
                    f"# kernel cache {c['label']}, key {json.dumps(c['key']) if c['key'] else 'unkeyed'}")
    return cmds


class _Skeleton:
    """A data volume imported earlier, read back from what it left in DEST: the bytes that are not member data
    (tar headers, metadata, padding) are kept at import in DEST/.mm/unbundle/skeleton/, member data is read from
    the imported file (or the partial file of a split one). A parity rebuild in a later sitting uses it in place
    of a disk no longer at hand; what it gives is checked by the rebuilt volume's whole-file blake3."""

    def __init__(self, size: int, regions: list, literal: bytes, files: dict, run: "_Import"):
        self.size, self.regions, self.literal, self.files, self.run = size, regions, literal, files, run
        self.starts = [r[0] for r in regions]

    @staticmethod
    def save(dest: Path, v: Volume) -> None:
        spans = sorted((info.offset_data, info.size, e["kind"], e["path"], int(e["offset"]))
                       for e in v.entries() if (info := v.data.get(e["member"])) is not None)
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
        where.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(where / f"vol{v.number:03d}.bin", bytes(literal))
        atomic_write_json(where / f"vol{v.number:03d}.json", {"size": size, "regions": regions})

    @classmethod
    def load(cls, dest: Path, n: int, run: "_Import") -> "_Skeleton | None":
        where = dest / STATE_DIR / "skeleton"
        try:
            doc = json.loads((where / f"vol{n:03d}.json").read_text())
            literal = (where / f"vol{n:03d}.bin").read_bytes()
            return cls(int(doc["size"]), doc["regions"], literal, {}, run)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _file(self, kind: str, path: str) -> int | None:
        if (kind, path) not in self.files:
            final = self.run.targets.get((kind, path))
            partial = self.run.places.partial(kind, path)
            found = final if final is not None and final.is_file() else partial
            try:
                self.files[(kind, path)] = os.open(found, os.O_RDONLY)
            except OSError:
                self.files[(kind, path)] = None
        return self.files[(kind, path)]

    def pread(self, offset: int, n: int) -> bytes:
        import bisect

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


class _Import:
    def __init__(self, places: _Dest, state: _State, targets: dict, progress: ProgressSink, sync: bool):
        self.places, self.state, self.targets, self.progress, self.sync = places, state, targets, progress, sync
        self.imported: list[str] = []
        self.corrupt: list[str] = []
        self.skipped = 0
        self.pipe = ChunkPipe()

    def volume(self, v: Volume) -> None:
        for member, why in sorted(v.damaged.items()):
            self.corrupt.append(f"{v.path.name}: member {member!r}: {why}")
        for e in v.entries():
            info = v.data.get(e["member"])
            if info is not None:
                self.member(v, e, info)
            self.progress.advance(int(e["length"]))

    def member(self, v: Volume, e: dict, info) -> None:
        key = (e["kind"], e["path"])
        final = self.targets.get(key)
        if final is None:
            self.corrupt.append(f"{v.path.name}: member {e['member']!r} is not listed in the bundle's payloads; refused")
            return
        size, segments = int(e["size"]), int(e["segments"])
        skey = f"{key[0]}:{key[1]}"
        pieces = self.state.pieces(skey)
        if _is_done(final, size) or str(e["segment"]) in pieces:
            self.skipped += 1
            return
        partial = self.places.partial(*key)
        partial.parent.mkdir(parents=True, exist_ok=True)
        got = self._copy(v, info, partial, int(e["offset"]), size, fresh=segments == 1)
        if got != e["blake3"]:
            self.corrupt.append(f"{v.path.name}: member {e['member']!r}: blake3 mismatch; not imported")
            if segments == 1:
                partial.unlink(missing_ok=True)
            return
        if segments > 1:
            if e["file_blake3"]:
                self.state.doc["whole"][skey] = [e["file_blake3"], e["file_sha256"]]
            pieces[str(e["segment"])] = [int(e["offset"]), int(e["length"]), got]
            self.state.save()
            if len(pieces) < segments:
                return
        want = e["file_blake3"] if segments == 1 else self.state.doc["whole"].get(skey, [None])[0]
        have = got if segments == 1 else blake3_file(partial, threads=blake3.blake3.AUTO)
        if have != want:
            self.corrupt.append(f"{v.path.name}: {KINDS[key[0]]}/{key[1]}: assembled file does not match its "
                                f"blake3; not imported")
            partial.unlink(missing_ok=True)
            self.state.doc["pieces"].pop(skey, None)
            self.state.doc["whole"].pop(skey, None)
            self.state.save()
            return
        publish(partial, final, sync=self.sync)
        self.imported.append(f"{KINDS[key[0]]}/{key[1]}")
        if segments > 1:
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
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.sync:
            fsync_dir(partial.parent)
        return h.digests().blake3
