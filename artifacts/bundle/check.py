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

from ..hashing import StreamHasher
from ..progress import NULL_PROGRESS, ProgressSink
from .copyio import HASH_THREADS, ChunkPipe
from .volume import Volume, find_volumes, open_volume


@dataclass(frozen=True)
class VolumeVerdict:
    path: str
    status: str  # OK | CORRUPT | FOREIGN
    bundle_id: str | None
    volume: int | None
    volumes: int | None
    problems: list[str]


@dataclass
class BundleVerifyReport:
    ok: bool
    bundle_id: str | None
    name: str | None
    volumes: int | None
    verdicts: list[VolumeVerdict]
    missing: list[int]


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
        info = vol.data.get(e.member)
        if info is not None and _span_b3(vol.path, info, pipe, progress) != e.blake3:
            vol.damaged[e.member] = "blake3 mismatch"
    for name, want in vol.index.meta.items():
        info = vol.meta.get(name)
        if info is not None and _span_b3(vol.path, info, pipe, progress) != want:
            vol.damaged[name] = "blake3 mismatch"


def _span_b3(path: Path, info: tarfile.TarInfo, pipe: ChunkPipe, progress: ProgressSink) -> str:
    h = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
    for view in pipe.stream(path, info.offset_data, info.size, (h,)):
        progress.advance(len(view))
    return h.digests().blake3


def verify_volumes(sources: list[Path], progress: ProgressSink = NULL_PROGRESS) -> BundleVerifyReport:
    vols = [open_volume(p) for p in find_volumes(sources)]
    ref = reference_bundle(vols)
    conflicts = conflicting_numbers(vols, ref)
    total = sum(i.size for v in vols for i in v.data.values())
    progress.begin(total, "bundle verify")
    verdicts = []
    pipe = ChunkPipe()
    try:
        for v in vols:
            if v.index is not None and not v.refused and v.bundle_id == ref:
                check_data(v, pipe, progress)
            verdicts.append(_verdict(v, ref, conflicts))
    finally:
        pipe.close()
    progress.end()
    ref_vol = next((v for v in vols if v.bundle_id == ref and v.index), None)
    count = ref_vol.index.volumes if ref_vol else None
    present = {v.number for v in vols if v.bundle_id == ref and v.index}
    missing = sorted(set(range(1, (count or 0) + 1)) - present)
    return BundleVerifyReport(all(x.status == "OK" for x in verdicts), ref,
                              ref_vol.index.name if ref_vol else None, count, verdicts, missing)


def _verdict(v: Volume, ref: str | None, conflicts: dict[int, list[Volume]]) -> VolumeVerdict:
    problems = list(v.refused)
    problems += [f"{v.path.name}: member {m!r}: {why}" for m, why in sorted(v.damaged.items())]
    if v.index is not None and v.number in conflicts and v.bundle_id == ref:
        others = [o.path.name for o in conflicts[v.number] if o is not v]
        problems.append(f"{v.path.name}: claims volume {v.number}, as does {', '.join(others)} with a different index")
    if v.index is not None and v.bundle_id != ref:
        status = "FOREIGN"
        problems.insert(0, f"{v.path.name}: belongs to bundle {v.bundle_id} ({v.index.name}), not {ref}")
    else:
        status = "CORRUPT" if problems else "OK"
    return VolumeVerdict(str(v.path), status, v.bundle_id, v.index.volume if v.index else None,
                         v.index.volumes if v.index else None, problems)
