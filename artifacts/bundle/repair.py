"""mm bundle repair-volume: write lost or damaged volume files back, byte-identical, for sites that keep volumes.

Every volume given is checked first (check.py). Data volumes missing or damaged are rebuilt from the rest and
the parity volumes (unpack.rebuild_data_volumes: named only when the volume's proof is the one the parity
index records); parity volumes missing or damaged are written again from the (now whole) data volumes
(pack.write_parity_volumes) and must hash as every parity index records them. With every parity volume lost,
they are written again from the data volumes alone when all of those are intact (the data index notes the
parity's shape).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, IntegrityError
from ..edges.fsutil import unlink_file
from ..edges.interrupt import keeps
from ..edges.progress import NULL_PROGRESS, ProgressSink
from .check import check_proofs, check_volumes, conflicting_numbers, data_bytes, parity_set, ranges, reference_bundle
from .copyio import ChunkPipe
from .format import RESTORE_MEMBER, SIG_MEMBER
from .parity import CODEC, FileSource
from .pack import write_parity_volumes
from .unpack import rebuild_data_volumes
from .volume import Volume, find_volumes, meta_bytes, open_volume, split_volumes


@dataclass
class VolumeRepairReport:
    ok: bool
    bundle_id: str
    name: str
    out: str
    rebuilt: list[str]  # data volume files written back (byte-identical: as the parity index proves them)
    parity_rewritten: list[str]  # parity volume files written again from the data volumes
    intact: list[str]
    notes: list[str]


def repair_volumes(sources: list[Path], out_dir: Path | None = None, sync: bool = True,
                   progress: ProgressSink = NULL_PROGRESS) -> VolumeRepairReport:
    """Check every volume in SOURCES; rebuild what is lost or damaged into OUT_DIR (default: beside the first
    volume given). NotRecoverable (exit 1) when more are lost than the parity can rebuild."""
    vols = [open_volume(p) for p in find_volumes(sources)]
    data, parity = split_volumes(vols)
    ref = reference_bundle(data) or reference_bundle(parity)
    progress.begin(data_bytes(vols, ref), "check volumes", files=len(vols))
    pipe = ChunkPipe()
    try:
        check_volumes(vols, ref, pipe, progress)
    finally:
        pipe.close()
    progress.end()
    pset = parity_set(parity, ref)
    notes = pset.refused + pset.unused
    if not pset.usable:
        return _parity_from_data_alone(data, ref, out_dir, notes, sync, progress)
    index = pset.usable[0].parity
    check_proofs(data, index)  # a volume whose bytes between members differ is written back too
    conflicts = conflicting_numbers(data, ref)
    good = {v.number: v for v in data if v.bundle_id == ref and v.usable and v.number not in conflicts
            and v.number <= index.volumes and v.path.name == index.data[v.number - 1].file}
    lost = [n for n in range(1, index.volumes + 1) if n not in good]
    out = Path(out_dir) if out_dir else vols[0].path.parent
    out.mkdir(parents=True, exist_ok=True)
    keeps(out)  # an interrupt names the volumes complete here
    rebuilt: dict[int, Path] = {}
    if lost:
        inputs = {n: FileSource(v.path) for n, v in good.items()}
        try:
            progress.begin(sum(index.data[n - 1].size for n in lost),
                           f"rebuild volume{'s' if len(lost) > 1 else ''} {ranges(lost)}", files=len(lost))
            result = rebuild_data_volumes(pset.usable, inputs, lost, out, sync=sync, progress=progress)
            rebuilt = result.files
            notes += [f"{what}: damaged (its bytes do not match the parity index); left out of the rebuild"
                      for what in result.left_out]
        finally:
            progress.end()
            for src in inputs.values():
                src.close()
    data_paths = [rebuilt.get(n) or good[n].path for n in range(1, index.volumes + 1)]
    bad_parity = sorted(set(range(1, index.parities + 1)) - {pv.number for pv in pset.usable})
    rewritten = _rewrite_parity(pset.usable[0], data_paths, bad_parity, out, sync, progress) if bad_parity else []
    return VolumeRepairReport(True, ref, index.name, str(out), [str(rebuilt[n]) for n in sorted(rebuilt)], rewritten,
                        [good[n].path.name for n in sorted(good)], notes)


def _carried_meta(v: Volume) -> list[tuple[str, bytes]]:
    """The metadata a parity volume carries after its index and the manifest, taken from volume V (checked)."""
    meta = []
    for name in (SIG_MEMBER, RESTORE_MEMBER):
        if name in v.described.meta:
            data = meta_bytes(v, name)
            if data is None:
                raise IntegrityError(f"{v.path.name}: member {name!r} is damaged; cannot write parity from it")
            meta.append((name, data))
    return meta


def _rewrite_parity(model: Volume, data_paths: list[Path], numbers: list[int], out: Path, sync: bool,
                    progress: ProgressSink) -> list[str]:
    """Parity volumes NUMBERS again, from the (whole) data volumes, with MODEL's metadata; each new parity volume
    must check, and hash as every parity index records it."""
    index = model.parity
    progress.begin(sum(p.stat().st_size for p in data_paths), f"parity {ranges(numbers)}", files=len(data_paths))
    written = write_parity_volumes(out, name=index.name, bundle_id=index.bundle_id, manifest_bytes=model.manifest_bytes,
                                   meta=_carried_meta(model), mtime=int(model.data[index.member].mtime),
                                   data_paths=data_paths, parities=index.parities, stripe=index.stripe, sync=sync,
                                   progress=progress, only=set(numbers), schema=index.schema)
    progress.end()
    _check_written([path for _, path in written], lambda pv: pv.parity.same_set(index))
    return [str(path) for _, path in written]


def _check_written(paths: list[Path], agrees) -> None:
    pipe = ChunkPipe()
    try:
        for path in paths:
            pv = open_volume(path)
            if pv.parity is not None and not pv.refused:
                check_volumes([pv], pv.bundle_id, pipe)
            if not pv.usable or pv.parity is None or not agrees(pv):
                unlink_file(path.parent, path)
                raise IntegrityError(f"{path}: rewritten parity volume does not match the bundle's parity; removed")
    finally:
        pipe.close()


def _parity_from_data_alone(data: list[Volume], ref: str | None, out_dir: Path | None, notes: list[str], sync: bool,
                            progress: ProgressSink) -> VolumeRepairReport:
    """Every parity volume is lost: with every data volume intact, write them all again (their shape is in the
    data volumes' index); otherwise nothing can be rebuilt."""
    mine = [v for v in data if v.bundle_id == ref and not v.refused and v.index is not None]
    note = next((v.index.parity for v in mine if v.index.parity is not None), None)
    count = mine[0].index.volumes if mine else 0
    good = {v.number: v for v in mine if v.usable}
    if note is None or note.code != CODEC or len(good) != count:
        lost = sorted(set(range(1, count + 1)) - set(good))
        whose = f"bundle {ref}" if ref else "an mm bundle"  # no given file was readable as a volume
        raise BadInput(f"no usable parity volume of {whose} among {', '.join(str(v.path) for v in data) or 'those given'}"
                       + (f", and data volume(s) {', '.join(map(str, lost))} are lost or damaged" if lost else "")
                       + (f" ({'; '.join(notes[:3])})" if notes else ""))
    first = good[1]
    out = Path(out_dir) if out_dir else first.path.parent
    out.mkdir(parents=True, exist_ok=True)
    paths = [good[n].path for n in range(1, count + 1)]
    progress.begin(sum(p.stat().st_size for p in paths), f"parity {ranges(list(range(1, note.parities + 1)))}",
                   files=len(paths))
    written = write_parity_volumes(out, name=first.index.name, bundle_id=ref, manifest_bytes=first.manifest_bytes,
                                   meta=_carried_meta(first), mtime=int(first.meta[RESTORE_MEMBER].mtime),
                                   data_paths=paths, parities=note.parities, stripe=note.stripe, sync=sync,
                                   progress=progress)
    progress.end()
    _check_written([path for _, path in written], lambda pv: pv.bundle_id == ref)
    return VolumeRepairReport(True, ref, first.index.name, str(out), [], [str(path) for _, path in written],
                        [good[n].path.name for n in sorted(good)], notes)
