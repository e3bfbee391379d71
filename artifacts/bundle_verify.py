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

from .bundle_format import HASH_THREADS, ChunkPipe, Volume, find_volumes, open_volume
from .bundle_parity import ParityVolume, check_parity_volume, is_parity_volume, open_parity_volume
from .parity import recoverability
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
    if ref_par is not None:
        m = ref_par.index.parities
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
