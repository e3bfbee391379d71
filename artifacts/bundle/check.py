"""mm bundle verify: check each volume on its own, in any order, with or without the others.

Per volume: the index is readable, every member and piece matches its blake3, the volume belongs to the
bundle (the one most of the given volumes name), no other volume claims its number with a different index.
Missing volume numbers are reported but are not a failure (checking disks one at a time is the normal case).
Parity volumes are checked the same way (their parity stream against the blake3 their index records); with
parity known, the report says whether the data volumes missing or damaged can be rebuilt, and if not, which
volumes would be enough (recoverability). parity_set picks the parity volumes a rebuild may use.
"""
from __future__ import annotations

import os
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..integrity.hashing import StreamHasher
from ..integrity.manifest import from_json
from ..edges.progress import NULL_PROGRESS, ProgressSink
from .copyio import HASH_THREADS, ChunkPipe
from .format import MANIFEST_MEMBER, b3, index_member
from .index import PARITY_SCHEMA, ParityIndex, disagreements, unaccounted
from .proof import prove_file
from .volume import Member, Volume, find_volumes, open_volume, split_volumes


@dataclass(frozen=True)
class VolumeVerdict:
    path: str
    status: str  # OK | CORRUPT | FOREIGN
    bundle_id: str | None
    volume: int | None  # its number: data volume N, or parity N
    volumes: int | None  # of how many (data volumes, or parity volumes)
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
    parities: int | None = None  # parity volumes the bundle has (known from any of its volumes)
    parity_missing: list[int] | None = None
    recoverable: bool | None = None  # with parity: can the data volumes missing or damaged be rebuilt
    recovery: str | None = None  # e.g. "volumes 3 and 7 missing: recoverable with parity 1-2"
    install_mm: str | None = None  # how to install mm from these volumes, when the bundle carries it
    mm_host: str | None = None  # whether the bundle's wheel sets cover this host's python3 (wheelhouse.coverage)
    delta: dict | None = None  # a delta bundle: its base and how much comes from it (DeltaNote.summary)
    files_checked: int = 0  # volume files read
    bytes_checked: int = 0  # the members hashed: data (the model's carried files, payloads) and mm's metadata
    bytes_on_disk: int = 0  # the volume files' sizes (tar headers and padding included)
    seconds: float = 0.0


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
        if v.bundle_id == bundle_id and v.index is not None:  # data volumes (parity volumes: parity_set)
            by_number.setdefault(v.number, []).append(v)
    return {n: vs for n, vs in by_number.items() if len({v.index_b3 for v in vs}) > 1}


def check_data(vol: Volume, pipe: ChunkPipe, progress: ProgressSink = NULL_PROGRESS) -> None:
    """Hash every member the index lists (data or parity volume); record mismatches in vol.damaged."""
    progress.item(vol.path.name)
    for member, want in [*((m, b) for m, (_, b) in vol.described.data_members().items()), *vol.described.meta.items()]:
        info = vol.data.get(member) or vol.meta.get(member)
        if info is not None:
            vol.hashed[member] = _span_b3(vol.path, info, pipe, progress)
            if vol.hashed[member] != want:
                vol.damaged[member] = "blake3 mismatch"


def check_proofs(data: list[Volume], index: ParityIndex) -> None:
    """Every data volume that check_data found whole, proven (proof.py) against parity INDEX (schema 2): its
    members' blake3 as just read, and the bytes between them (tar headers, padding) read now. A volume whose bytes
    are not those the parity was computed over is damaged (a rebuild from it would fail, repair-volume writes it
    again). A schema 1 index records whole-file blake3 only: that would be a second pass, not taken."""
    if index.schema != PARITY_SCHEMA:
        return
    for v in data:
        if not (v.usable and v.index is not None and v.bundle_id == index.bundle_id and v.number <= index.volumes):
            continue
        want = index.data[v.number - 1]
        if v.path.name != want.file:
            continue
        known = {**v.hashed, index_member(v.number): b3(v.index_bytes), MANIFEST_MEMBER: b3(v.manifest_bytes)}
        try:
            got = prove_file(v.path, want.head, known) if os.path.getsize(v.path) == want.size else None
        except (OSError, tarfile.TarError, EOFError):
            got = None
        if got != want.digest:
            v.damaged["(volume)"] = (f"its bytes are not those parity {index.parity} was computed over (the tar "
                                     f"headers or padding between members differ)")


def check_meaning(vol: Volume, reference: Volume | None = None) -> None:
    """What the volume says must make sense, not only hash right: its manifest parses (safe paths, typed
    values), every index entry agrees with the manifest and the payload records, and what is bundle-wide
    agrees with REFERENCE (another volume of the bundle). Faults go to vol.refused (unbundle refuses the same)."""
    if reference is not None and reference is not vol and (field := vol.index.differs_from(reference.index)):
        vol.refused.append(f"{vol.path.name}: its index's {field} differs from {reference.path.name}'s")
    if not vol.has_manifest:
        return
    try:
        manifest = from_json(vol.manifest_bytes, f"{vol.path.name}: {MANIFEST_MEMBER}")
    except BadInput as e:
        vol.refused.append(e.message)
        return
    vol.refused += [f"{vol.path.name}: {p}" for p in disagreements(vol.index, manifest)]


def check_complete(data: list[Volume], ref: str | None, reference: Volume | None) -> None:
    """With every data volume of bundle REF at hand, every file of the manifest must be carried or taken from a
    delta's base: one the index forgets could never be imported. A fault goes to REFERENCE's refused list."""
    mine = [v for v in data if v.index is not None and v.bundle_id == ref and not v.refused]
    manifest = _manifest_of(reference)
    if manifest is None or {v.number for v in mine} != set(range(1, reference.index.volumes + 1)):
        return
    if lost := unaccounted(manifest, [v.index for v in mine]):
        reference.refused.append(incomplete(ref, lost))


def incomplete(ref: str | None, lost: list[str]) -> str:
    return (f"bundle {ref}: {len(lost)} file(s) of its manifest neither carried by a volume nor taken from the base "
            f"(e.g. {lost[0]!r}): its index does not account for every file; refused")


def _span_b3(path: Path, info: Member, pipe: ChunkPipe, progress: ProgressSink) -> str:
    h = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
    for view in pipe.stream(path, info.offset_data, info.size, (h,)):
        progress.advance(len(view))
    return h.digests().blake3


def check_volumes(vols: list[Volume], ref: str | None, pipe: ChunkPipe, progress: ProgressSink = NULL_PROGRESS) -> None:
    """check_data on every readable volume of bundle REF (data and parity)."""
    for v in vols:
        if v.described is not None and not v.refused and v.bundle_id == ref:
            check_data(v, pipe, progress)


def data_bytes(vols: list[Volume], ref: str | None) -> int:
    """The bytes check_volumes reads: every member check_data hashes, of every volume it checks."""
    total = 0
    for v in vols:
        if v.described is not None and not v.refused and v.bundle_id == ref:
            total += sum(v.data[m].size for m in v.described.data_members() if m in v.data)
            total += sum(v.meta[n].size for n in v.described.meta if n in v.meta)
    return total


def verify_volumes(sources: list[Path], progress: ProgressSink = NULL_PROGRESS) -> BundleVerifyReport:
    """Check the volumes in SOURCES (files, or directories: several mount points) each on its own."""
    started = time.monotonic()
    vols = [open_volume(p) for p in find_volumes(sources)]
    data, parity = split_volumes(vols)
    ref = reference_bundle(data) or reference_bundle(parity)
    conflicts = conflicting_numbers(data, ref)
    pipe = ChunkPipe()
    reference = next((v for v in data if v.index is not None and v.bundle_id == ref and not v.refused
                      and v.has_manifest), None)
    try:
        for v in data:
            if v.index is not None and not v.refused and v.bundle_id == ref:
                check_meaning(v, reference)
        check_complete(data, ref, reference)
        progress.begin(data_bytes(data + parity, ref), "bundle verify", files=len(vols))
        check_volumes(data + parity, ref, pipe, progress)
        if usable := parity_set(parity, ref).usable:
            check_proofs(data, usable[0].parity)
    finally:
        progress.end()
        pipe.close()
    verdicts = [_verdict(v, ref, conflicts) for v in data + parity]
    ref_vol = next((v for v in data if v.bundle_id == ref and v.index), None)
    ref_par = next((v for v in parity if v.bundle_id == ref and v.parity), None)
    count = ref_vol.index.volumes if ref_vol else (ref_par.parity.volumes if ref_par else None)
    name = (ref_vol or ref_par).described.name if (ref_vol or ref_par) else None
    present = {v.number for v in data if v.bundle_id == ref and v.index}
    missing = sorted(set(range(1, (count or 0) + 1)) - present)
    report = BundleVerifyReport(all(x.status == "OK" for x in verdicts), ref, name, count, verdicts, missing)
    note = next((v.index.parity for v in data if v.bundle_id == ref and v.index and v.index.parity), None)
    m = ref_par.parity.parities if ref_par else (note.parities if note else None)
    if m:
        good = {x.volume for x in verdicts if x.kind == "parity" and x.status == "OK"}
        given = {x.volume for x in verdicts if x.kind == "parity" and x.bundle_id == ref}
        damaged = sorted({x.volume for x in verdicts if x.kind == "data" and x.status == "CORRUPT" and x.volume})
        report.parities = m
        report.parity_missing = sorted(set(range(1, m + 1)) - given)
        report.recoverable, report.recovery = recoverability(count, m, missing, damaged,
                                                             sorted(set(range(1, m + 1)) - good))
    report.install_mm = _install_mm(ref_vol.index.payloads) if ref_vol else None
    if report.install_mm:
        from .wheelhouse import coverage
        report.mm_host = coverage(ref_vol.index.payloads["mm"][0].sets)
    if ref_vol is not None and ref_vol.index.delta is not None:
        report.delta = ref_vol.index.delta.summary(_manifest_of(reference))
    report.files_checked, report.bytes_checked = len(vols), data_bytes(data + parity, ref)
    report.bytes_on_disk = sum(_size(v.path) for v in vols)
    report.seconds = time.monotonic() - started
    return report


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # gone since it was opened: its verdict says so
        return 0


def _manifest_of(vol: Volume | None):
    try:
        return from_json(vol.manifest_bytes, vol.path.name) if vol is not None else None
    except BadInput:
        return None


def _install_mm(payloads: dict) -> str | None:
    carried = payloads.get("mm") or ()
    if not carried:
        return None
    rec = carried[0]
    return (f"mm {rec.mm_version} travels in volume 1 (sets {', '.join(rec.sets)}): sh install-mm.sh [DIR] where the "
            f"volumes lie (it reads volume 1), or sh payload/mm/install-mm.sh after `tar -xf` of volume 1")


def _verdict(v: Volume, ref: str | None, conflicts: dict[int, list[Volume]]) -> VolumeVerdict:
    problems = list(v.refused)
    problems += [f"{v.path.name}: member {m!r}: {why}" for m, why in sorted(v.damaged.items())]
    if v.index is not None and v.number in conflicts and v.bundle_id == ref:
        others = [o.path.name for o in conflicts[v.number] if o is not v]
        problems.append(f"{v.path.name}: claims volume {v.number}, as does {', '.join(others)} with a different index")
    d = v.described
    if d is not None and v.bundle_id != ref:
        status = "FOREIGN"
        what = "parity of" if v.is_parity else "belongs to"
        problems.insert(0, f"{v.path.name}: {what} bundle {v.bundle_id} ({d.name}), not {ref}")
    else:
        status = "CORRUPT" if problems else "OK"
    total = (d.parities if v.is_parity else d.volumes) if d else None
    return VolumeVerdict(str(v.path), status, v.bundle_id, d.number if d else None, total, problems,
                         "parity" if v.is_parity else "data")


# --- parity: which volumes a rebuild may use, and what it can do ------------------------------------

@dataclass
class ParitySet:
    """The parity volumes a rebuild may use (one per number, all of one encoding), and why others may not."""

    usable: list[Volume]
    refused: list[str]  # hostile, of another bundle or of another encoding
    unused: list[str]  # damaged: left out, nothing wrong with the bundle


def parity_set(pvols: list[Volume], bundle_id: str | None) -> ParitySet:
    """Damage is what open_volume (and check_data, when it ran) found."""
    out = ParitySet([], [], [])
    for pv in sorted(pvols, key=lambda v: v.number):
        if pv.refused:
            out.refused += pv.refused
        elif bundle_id and pv.bundle_id != bundle_id:
            out.refused.append(f"{pv.path.name}: parity of bundle {pv.bundle_id} ({pv.parity.name}), not {bundle_id}; "
                               f"refused")
        elif pv.damaged:
            out.unused.append(f"{pv.path.name}: damaged ({', '.join(f'{m}: {w}' for m, w in sorted(pv.damaged.items()))}); "
                              f"not used")
        elif out.usable and not out.usable[0].parity.same_set(pv.parity):
            out.refused.append(f"{pv.path.name}: parity of another encoding of this bundle; refused")
        elif not any(u.number == pv.number for u in out.usable):
            out.usable.append(pv)
    return out


def ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, run = [], []
    for n in sorted(numbers):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def recoverability(k: int, m: int, missing: list[int], damaged: list[int], bad_parity: list[int]) -> tuple[bool, str]:
    """(recoverable, sentence): MISSING and DAMAGED are data volume numbers, BAD_PARITY parity numbers missing or
    damaged. E.g. "volumes 3 and 7 missing: recoverable with parity 1-2"."""
    lost = sorted(set(missing) | set(damaged))
    if not lost:
        return True, "no data volume missing or damaged"
    good_parity = [p for p in range(1, m + 1) if p not in bad_parity]
    parts = []
    for nums, what in ((sorted(missing), "missing"), (sorted(set(damaged) - set(missing)), "damaged")):
        if nums:
            parts.append(f"{'volume' if len(nums) == 1 else 'volumes'} {_and([str(n) for n in nums])} {what}")
    head = ", ".join(parts)
    if len(lost) <= len(good_parity):
        return True, f"{head}: recoverable with parity {ranges(good_parity[:len(lost)])}"
    need = len(lost) - len(good_parity)
    have = f"only parity {ranges(good_parity)} usable" if good_parity else "no usable parity volume"
    others = [f"volume {n}" for n in lost] + [f"parity {p}" for p in sorted(bad_parity)]
    return False, f"{head}: NOT recoverable ({have}); bring back any {need} of: {', '.join(others)}"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
