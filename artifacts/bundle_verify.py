"""mm bundle verify: check each volume on its own, in any order, with or without the others.

Per volume: the index is readable, every member and piece matches its blake3, the volume belongs to the
bundle (the one most of the given volumes name), no other volume claims its number with a different index.
Missing volume numbers are reported but are not a failure (checking disks one at a time is the normal case).
"""
from __future__ import annotations

import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .bundle_format import HASH_THREADS, RESTORE_MEMBER, SIG_MEMBER, ChunkPipe, Volume, find_volumes, open_volume
from .bundle_parity import (
    ParityVolume, check_parity_volume, is_parity_volume, open_parity_volume, parity_set, rebuild_data_volumes,
    write_parity_volumes,
)
from .errors import BadInput, IntegrityError
from .parity import CODEC, FileSource, recoverability
from .hashing import StreamHasher
from .progress import NULL_PROGRESS, ProgressSink


@dataclass(frozen=True)
class VolumeVerdict:
    path: str
    status: str  # OK | CORRUPT | FOREIGN
    bundle_id: str | None
    volume: int | None
    volumes: int | None
    problems: list[str]
    kind: str = "data"  # data | parity


@dataclass
class BundleVerifyReport:
    ok: bool
    bundle_id: str | None
    name: str | None
    volumes: int | None
    verdicts: list[VolumeVerdict]
    missing: list[int]
    parities: int | None = None  # parity volumes the bundle has (known when one of them is given)
    parity_missing: list[int] | None = None
    recoverable: bool | None = None  # with parity given: can the missing/damaged data volumes be rebuilt
    recovery: str | None = None  # e.g. "volumes 3 and 7 missing: recoverable with parity 1-2"


def reference_bundle(vols: list[Volume], preferred: str | None = None) -> str | None:
    """The bundle these volumes belong to: PREFERRED if given, else the one most of them name."""
    if preferred:
        return preferred
    ids = Counter(v.bundle_id for v in vols if v.bundle_id and not v.refused)
    ids = ids or Counter(v.bundle_id for v in vols if v.bundle_id)
    return ids.most_common(1)[0][0] if ids else None


def conflicting_numbers(vols: list[Volume], bundle_id: str | None) -> dict[int, list[Volume]]:
    """Volume numbers claimed by two volumes of the bundle whose indexes differ."""
    by_number: dict[int, list[Volume]] = {}
    for v in vols:
        if v.bundle_id == bundle_id and v.index is not None:
            by_number.setdefault(v.number, []).append(v)
    return {n: vs for n, vs in by_number.items() if len({v.index_bytes for v in vs}) > 1}


def check_data(vol: Volume, pipe: ChunkPipe, progress: ProgressSink = NULL_PROGRESS) -> None:
    """Hash every member the index lists; record mismatches in vol.damaged."""
    for e in vol.entries():
        info = vol.data.get(e["member"])
        if info is not None and _span_b3(vol.path, info, pipe, progress) != e["blake3"]:
            vol.damaged[e["member"]] = "blake3 mismatch"
    for name, want in vol.index.get("meta", {}).items():
        info = vol.meta.get(name)
        if info is not None and _span_b3(vol.path, info, pipe, progress) != want:
            vol.damaged[name] = "blake3 mismatch"


def _span_b3(path: Path, info: tarfile.TarInfo, pipe: ChunkPipe, progress: ProgressSink) -> str:
    h = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
    for view in pipe.stream(path, info.offset_data, info.size, (h,)):
        progress.advance(len(view))
    return h.digests().blake3


def split_volumes(paths: list[Path]) -> tuple[list[Volume], list[ParityVolume]]:
    """Data volumes and parity volumes among PATHS, each opened (headers and metadata only)."""
    data, parity = [], []
    for p in paths:
        if is_parity_volume(p):
            parity.append(open_parity_volume(p))
        else:
            data.append(open_volume(p))
    return data, parity


def verify_volumes(sources: list[Path], progress: ProgressSink = NULL_PROGRESS) -> BundleVerifyReport:
    vols, pvols = split_volumes(find_volumes(sources))
    ref = reference_bundle(vols) or reference_bundle(pvols)
    conflicts = conflicting_numbers(vols, ref)
    total = sum(i.size for v in vols for i in v.data.values()) + sum(pv.data.size for pv in pvols if pv.data)
    progress.begin(total, "bundle verify")
    verdicts = []
    pipe = ChunkPipe()
    try:
        for v in vols:
            if v.index is not None and not v.refused and v.bundle_id == ref:
                check_data(v, pipe, progress)
            verdicts.append(_verdict(v, ref, conflicts))
        for pv in pvols:
            if pv.bundle_id == ref:
                check_parity_volume(pv, progress)
            verdicts.append(_parity_verdict(pv, ref))
    finally:
        pipe.close()
    progress.end()
    ref_vol = next((v for v in vols if v.bundle_id == ref and v.index), None)
    ref_par = next((pv for pv in pvols if pv.bundle_id == ref and pv.index), None)
    count = int(ref_vol.index["volumes"]) if ref_vol else (ref_par.index.volumes if ref_par else None)
    present = {v.number for v in vols if v.bundle_id == ref and v.index}
    missing = sorted(set(range(1, (count or 0) + 1)) - present)
    name = ref_vol.index["name"] if ref_vol else (ref_par.index.name if ref_par else None)
    report = BundleVerifyReport(all(x.status == "OK" for x in verdicts), ref, name, count, verdicts, missing)
    m = ref_par.index.parities if ref_par is not None else (_parity_record(ref_vol) or {}).get("parities")
    if m:
        good_parity = {x.volume for x in verdicts if x.kind == "parity" and x.status == "OK"}
        given_parity = {x.volume for x in verdicts if x.kind == "parity" and x.bundle_id == ref}
        damaged = sorted({x.volume for x in verdicts if x.kind == "data" and x.status == "CORRUPT" and x.volume})
        report.parities = m
        report.parity_missing = sorted(set(range(1, m + 1)) - given_parity)
        report.recoverable, report.recovery = recoverability(
            count, m, missing, damaged, sorted(set(range(1, m + 1)) - good_parity))
    return report


def _parity_verdict(pv: ParityVolume, ref: str | None) -> VolumeVerdict:
    problems = list(pv.refused) + [f"{pv.path.name}: member {m!r}: {why}" for m, why in sorted(pv.damaged.items())]
    if pv.index is not None and pv.bundle_id != ref:
        status = "FOREIGN"
        problems.insert(0, f"{pv.path.name}: parity of bundle {pv.bundle_id} ({pv.index.name}), not {ref}")
    else:
        status = "CORRUPT" if problems else "OK"
    idx = pv.index
    return VolumeVerdict(str(pv.path), status, pv.bundle_id, idx.parity if idx else None,
                         idx.parities if idx else None, problems, "parity")


def _verdict(v: Volume, ref: str | None, conflicts: dict[int, list[Volume]]) -> VolumeVerdict:
    problems = list(v.refused)
    problems += [f"{v.path.name}: member {m!r}: {why}" for m, why in sorted(v.damaged.items())]
    if v.index is not None and v.number in conflicts and v.bundle_id == ref:
        others = [o.path.name for o in conflicts[v.number] if o is not v]
        problems.append(f"{v.path.name}: claims volume {v.number}, as does {', '.join(others)} with a different index")
    if v.index is not None and v.bundle_id != ref:
        status = "FOREIGN"
        problems.insert(0, f"{v.path.name}: belongs to bundle {v.bundle_id} ({v.index.get('name')}), not {ref}")
    else:
        status = "CORRUPT" if problems else "OK"
    idx = v.index or {}
    return VolumeVerdict(str(v.path), status, v.bundle_id, idx.get("volume"), idx.get("volumes"), problems)


@dataclass
class RepairReport:
    ok: bool
    bundle_id: str
    name: str
    out: str
    rebuilt: list[str]  # data volume files written back (byte-identical: whole-file blake3 as the parity index says)
    parity_rewritten: list[str]  # parity volume files written again from the data volumes
    intact: list[str]
    notes: list[str]


def repair_volumes(sources: list[Path], out_dir: Path | None = None, sync: bool = True,
                   progress: ProgressSink = NULL_PROGRESS) -> RepairReport:
    """`mm bundle repair-volume`: check every volume given, rebuild the data volumes that are missing or damaged
    from the rest and the parity volumes into OUT_DIR (default: beside the first volume given), then write lost
    or damaged parity volumes again. Nothing is written under a final name before it checks."""
    vols, pvols = split_volumes(find_volumes(sources))
    ref = reference_bundle(vols) or reference_bundle(pvols)
    total = sum(i.size for v in vols for i in v.data.values()) + sum(pv.data.size for pv in pvols if pv.data)
    progress.begin(total, "check volumes")
    pipe = ChunkPipe()
    try:
        for v in vols:
            if v.index is not None and not v.refused and v.bundle_id == ref:
                check_data(v, pipe, progress)
    finally:
        pipe.close()
    for pv in pvols:
        if pv.bundle_id == ref:
            check_parity_volume(pv, progress)
    progress.end()
    usable, notes = parity_set(pvols, ref)
    if not usable:
        return _parity_from_data_alone(vols, ref, out_dir, notes, sync, progress)
    index = usable[0].index
    conflicts = conflicting_numbers(vols, ref)
    good = {v.number: v for v in vols if v.bundle_id == ref and not v.refused and not v.damaged
            and v.number not in conflicts and v.path.name == index.data[v.number - 1].file}
    lost = [n for n in range(1, index.volumes + 1) if n not in good]
    out = Path(out_dir) if out_dir else Path(next(iter(vols or pvols)).path).parent
    out.mkdir(parents=True, exist_ok=True)
    rebuilt: dict[int, Path] = {}
    if lost:
        sources_by_n = {n: FileSource(v.path) for n, v in good.items()}
        try:
            progress.begin(sum(index.data[n - 1].size for n in lost), "rebuild")
            rebuilt = rebuild_data_volumes(usable, sources_by_n, lost, out, sync=sync, progress=progress)
            progress.end()
        finally:
            for src in sources_by_n.values():
                src.close()
    data_paths = [rebuilt.get(n) or good[n].path for n in range(1, index.volumes + 1)]
    bad_parity = sorted(set(range(1, index.parities + 1)) - {pv.number for pv in usable})
    rewritten = []
    if bad_parity:
        rewritten = _rewrite_parity(usable[0], data_paths, bad_parity, out, sync, progress)
    return RepairReport(True, ref, index.name, str(out), [str(rebuilt[n]) for n in sorted(rebuilt)], rewritten,
                        [good[n].path.name for n in sorted(good)], notes)


def _rewrite_parity(model: ParityVolume, data_paths: list[Path], numbers: list[int], out: Path, sync: bool,
                    progress: ProgressSink) -> list[str]:
    """Parity volumes NUMBERS again, from the (now whole) data volumes, with MODEL's metadata; each new parity
    stream must hash as every parity index records it."""
    index = model.index
    meta = []
    with open(model.path, "rb") as f:
        for name in index.meta:
            info = model.meta[name]
            f.seek(info.offset_data)
            meta.append((name, f.read(info.size)))
    mtime = int(model.data.mtime)
    progress.begin(sum(p.stat().st_size for p in data_paths), "parity")
    written = write_parity_volumes(out, name=index.name, bundle_id=index.bundle_id, manifest_bytes=model.manifest_bytes,
                                   meta=meta, mtime=mtime, data_paths=data_paths, parities=index.parities,
                                   stripe=index.stripe, sync=sync, progress=progress, only=set(numbers))
    progress.end()
    for r in written:
        pv = open_parity_volume(r.path)
        check_parity_volume(pv)
        if not pv.usable or not pv.index.same_set(index):
            Path(r.path).unlink(missing_ok=True)
            raise IntegrityError(f"{r.path}: rewritten parity volume does not match the bundle's parity index; removed")
    return [r.path for r in written]


def _parity_record(v: Volume | None) -> dict | None:
    """The data index's note of the bundle's parity ({"parities", "stripe", "code"}), checked, or None."""
    rec = (v.index or {}).get("parity") if v is not None else None
    if not isinstance(rec, dict):
        return None
    m, stripe = rec.get("parities"), rec.get("stripe")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (m, stripe)) or not 1 <= m <= 31 \
            or stripe < 64 or stripe % 64 or stripe > 64 * 1024 * 1024 or rec.get("code") != CODEC:
        return None
    return rec


def _parity_from_data_alone(vols: list[Volume], ref: str | None, out_dir: Path | None, notes: list[str], sync: bool,
                            progress: ProgressSink) -> RepairReport:
    """Every parity volume is lost: with every data volume intact, write them all again (their layout is in the
    data volumes' index); otherwise nothing can be rebuilt."""
    mine = [v for v in vols if v.bundle_id == ref and not v.refused]
    rec = next((r for r in map(_parity_record, mine) if r), None)
    count = int(mine[0].index["volumes"]) if mine else 0
    good = {v.number: v for v in mine if not v.damaged}
    if rec is None or not mine or len(good) != count:
        lost = sorted(set(range(1, count + 1)) - set(good))
        raise BadInput(f"no usable parity volume of bundle {ref} among those given"
                       + (f", and data volume(s) {', '.join(map(str, lost))} are lost or damaged" if lost else "")
                       + (f" ({'; '.join(notes[:3])})" if notes else ""))
    first = good[1]
    meta = [(name, _member_bytes(first, name)) for name in (SIG_MEMBER, RESTORE_MEMBER) if name in first.meta]
    out = Path(out_dir) if out_dir else first.path.parent
    paths = [good[n].path for n in range(1, count + 1)]
    progress.begin(sum(p.stat().st_size for p in paths), "parity")
    written = write_parity_volumes(out, name=first.index["name"], bundle_id=ref, manifest_bytes=first.manifest_bytes,
                                   meta=meta, mtime=int(first.meta[RESTORE_MEMBER].mtime), data_paths=paths,
                                   parities=rec["parities"], stripe=rec["stripe"], sync=sync, progress=progress)
    progress.end()
    return RepairReport(True, ref, first.index["name"], str(out), [], [r.path for r in written],
                        [good[n].path.name for n in sorted(good)], notes)


def _member_bytes(v: Volume, name: str) -> bytes:
    """A metadata member of a volume check_data found intact (its blake3 matched the index)."""
    info = v.meta[name]
    with open(v.path, "rb") as f:
        f.seek(info.offset_data)
        data = f.read(info.size)
    if len(data) != info.size:
        raise IntegrityError(f"{v.path.name}: member {name!r} is truncated")
    return data
