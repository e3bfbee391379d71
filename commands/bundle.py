"""`mm bundle` (create, verify, repair-volume) and `mm unbundle`: a model as self-describing tar volumes across the
air gap, and back into a directory (artifacts/bundle/)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import click

from ..artifacts.bundle.payloads import PAYLOAD_KINDS
from ..artifacts.errors import IntegrityError, MMError, ProblemsFound, Waiting
from ..artifacts.units import human_bytes, human_duration
from .shared import PATH
from .shared import (DefaultGroup, emit_json, err, handles_errors, json_option, out, progress_for,
                     render_carried_signature, signature_options, signature_policy, to_jsonable)


def _cache_key(ctx, param, value) -> dict | None:
    """--cache-key KEY=VALUE pairs -> the key document (cachekey.parse_cache_key)."""
    from ..artifacts.serving.cachekey import parse_cache_key
    try:
        return parse_cache_key(value)
    except MMError as e:
        raise click.BadParameter(e.message) from None


class VolumeSize(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from ..artifacts.units import parse_size
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except MMError as e:
            self.fail(e.message, param, ctx)



def payload_options(side: str) -> Callable:
    """One option per payload kind (artifacts/bundle/payloads.py): what `mm bundle` carries (side "source")
    or where `mm unbundle` puts it (side "dest")."""
    def apply(fn: Callable) -> Callable:
        for k in reversed(PAYLOAD_KINDS):
            if side == "source":
                option = click.option(k.source_option, k.source_param, multiple=k.many, type=PATH,
                                      help=k.source_help)
            else:
                option = click.option(k.dest_option, k.dest_param, type=PATH, help=k.dest_help)
            fn = option(fn)
        return fn
    return apply


def _payload_sources(kw: dict) -> dict[str, list[Path]]:
    values = {k.kind: kw.pop(k.source_param) for k in PAYLOAD_KINDS}
    return {kind: list(v) if isinstance(v, tuple) else ([v] if v else []) for kind, v in values.items()}


@click.group(cls=DefaultGroup, default="create")
def bundle():
    """Pack a model into volumes (`mm bundle DIR --out OUT --volume-size 500G`) or check them (`mm bundle verify VOL...`)."""


@bundle.command("create")
@click.argument("directory", required=False, type=PATH)
@click.option("--out", "out_dirs", required=True, multiple=True, type=PATH,
              help="Directory for the volume files: one per disk, repeatable (--out /media/disk1 --out /media/disk2): "
                   "filled in order, each volume where it fits (free space is checked before writing).")
@click.option("--volume-size", type=VolumeSize(),
              help="Size of each volume, decimal as disks are sold: 750M, 4G (=4,000,000,000 bytes), 500G, 1.8T; "
                   "binary with 'i': 4GiB. Volume 1 must hold mm's wheelhouse whole.")
@click.option("--name", help="Bundle name used in volume file names. Default: <repo name>-<revision[:12]>.")
@payload_options("source")
@click.option("--cache-key", "cache_key", multiple=True, metavar="KEY=VALUE", callback=_cache_key,
              help="Key for kernel caches without mm-cache-key.json (gpu=, compute_capability=, driver=, image=, "
                   "recipe=); repeatable. Without either the cache is bundled as unkeyed.")
@click.option("--no-mm", "no_mm", is_flag=True, envvar="MM_BUNDLE_NO_MM",
              help="Leave mm itself out (by default the bundle carries install-mm.sh and a locked wheelhouse of mm and "
                   "its dependencies in volume 1). Environment: MM_BUNDLE_NO_MM=1.")
@click.option("--only-mm", "only_mm", is_flag=True,
              help="No model: write install-mm.sh and wheelhouse/ into --out (to upgrade mm on a host that has the model).")
@click.option("--target-platform", "target_platforms", multiple=True, metavar="linux/amd64|linux/arm64",
              help="The air-gapped host's platform for the wheelhouse (repeatable; default: linux/amd64, plus this "
                   "host's and an --image's platform). GB200/GB300 nodes are linux/arm64.")
@click.option("--target-python", "target_pythons", multiple=True, metavar="3.X",
              help="The air-gapped host's CPython minor version (repeatable; default: 3.10 to 3.13 and this host's).")
@click.option("--image-ref", default=None,
              help="The pinned reference --image must be (default: the pin's engine image).")
@click.option("--allow-other-image", is_flag=True,
              help="Carry an --image that is not (or cannot be proven to be) the pinned image; the bundle and the "
                   "start script say so.")
@click.option("--insecure-registry", is_flag=True, help="Plain HTTP or unverified TLS when proving --image against a "
                                                        "registry that is not on loopback (loopback always is).")
@click.option("--no-sync", "no_sync", is_flag=True,
              help="Do not fsync the volumes (a staging disk you copy from with other tools). A rerun still re-checks "
                   "every volume before keeping it; flush (`sync`, unmount) before unplugging the disk.")
@click.option("--parity", type=click.IntRange(0, 31), default=0, show_default=True,
              help="Reed-Solomon parity volumes to add: any that many lost or damaged volumes can be rebuilt "
                   "(e.g. 2 for ten data volumes).")
@click.option("--yes", is_flag=True, help="Write a plan of more than 10,000 volumes (refused otherwise: most likely a "
                                          "--volume-size typo, 100K for 100G).")
@click.option("--base", type=PATH,
              help="Make a delta: carry only the files whose content this base revision lacks (its manifest file, "
                   "its model directory, or a volume of its bundle); the destination takes the rest from its copy "
                   "of the base (mm unbundle --from).")
@json_option
@handles_errors
def bundle_create(directory, out_dirs, volume_size, name, cache_key, no_mm, only_mm, target_platforms, target_pythons,
                  image_ref, allow_other_image, insecure_registry, no_sync, parity, yes, base, json_out, **kw):
    """Write the model (and payloads, and mm itself) as self-describing tar volumes, plus --parity volumes; a
    rerun resumes."""
    import contextlib

    from ..artifacts.bundle import wheelhouse
    from ..artifacts.bundle.pack import BundleOptions, create_bundle, precheck_volume_count
    from ..artifacts.bundle.payloads import CollectOptions
    options = BundleOptions.from_cli(
        directory, outs=out_dirs, volume_size=volume_size, payloads=_payload_sources(kw), no_mm=no_mm,
        only_mm=only_mm, target_platforms=target_platforms, target_pythons=target_pythons, name=name,
        collect=CollectOptions(cache_key=cache_key, image_ref=image_ref, allow_other_image=allow_other_image,
                               tls_verify=not insecure_registry),
        parity=parity, sync=not no_sync, yes=yes, base=base)
    if options.only_mm:
        targets = wheelhouse.targets_for(options.target_platforms, options.target_pythons)
        if not json_out:
            err.line(f"mm will install on: {wheelhouse.describe_targets(targets)} (--target-platform and "
                     f"--target-python choose others)")
        report = wheelhouse.build_wheelhouse(options.outs[0], targets, progress_for(json_out),
                                             cache=wheelhouse.sets_cache())
        if json_out:
            emit_json({"ok": True, **to_jsonable(report), "size": report.size})
            return
        for s in report.sets:
            out.line(f"{s.name}: {len(s.wheels)} wheels, {human_bytes(s.size)}")
        out.line(f"wrote {report.out}/install-mm.sh and {report.out}/wheelhouse/ (mm {report.mm_version}, "
                 f"{human_bytes(report.size)}); on the air-gapped host: sh install-mm.sh [DIR]")
        return
    precheck_volume_count(directory, options)  # a typo in --volume-size ends here, before any work
    progress = progress_for(json_out)
    with contextlib.ExitStack() as stack:
        if options.build_mm:  # built in mm's cache directory, removed after the run
            from ..artifacts.serving.image import archive_platform
            also = tuple(p for p in map(archive_platform, options.payloads.get("image", ())) if p)
            targets = wheelhouse.targets_for(options.target_platforms, options.target_pythons, also)
            if not json_out:
                err.line(f"mm will install on: {wheelhouse.describe_targets(targets)} (--target-platform and "
                         f"--target-python choose others)")
            options = options.carrying("mm", stack.enter_context(wheelhouse.bundle_wheelhouse(targets, progress)))
        result = create_bundle(directory, options, progress, on_plan=None if json_out else _render_bundle_plan)
    if json_out:  # each payload kind under its own key, beside the rest
        emit_json({key: value for field_name, v in to_jsonable(result).items()
                   for key, value in (v.items() if field_name == "payloads" else [(field_name, v)])})
        return
    for note in result.notes:
        err.print(f"note: {note}", markup=False)
    for v in result.volumes:
        out.line(f"{'kept ' if v.kept else 'wrote'} {v.path} ({human_bytes(v.size)} on disk)")
    for v in result.parity_volumes:
        out.line(f"wrote {v.path} ({human_bytes(v.size)} on disk, parity {v.number} of {len(result.parity_volumes)})")
    if result.signed:
        out.line("the manifest's signature travels in every volume (MMBUNDLE/manifest.json.sig)")
    parity_part = f" + {len(result.parity_volumes)} parity" if result.parity_volumes else ""
    on_disk = sum(v.size for v in result.volumes + result.parity_volumes)
    out.line(f"bundle {result.name} (id {result.bundle_id}): {len(result.volumes)} volume(s){parity_part}, "
             f"{human_bytes(on_disk)} on disk, in {human_duration(result.seconds)}; {_carried(result.plan)}. "
             f"Check the disks with: mm bundle verify {' '.join(result.outs)}")
    if result.delta:
        from ..artifacts.bundle.delta import describe
        out.line(f"{describe(result.delta)}; at the destination: mm unbundle VOLUMES --dest NEW_DIR --from BASE_DIR")
    carried = result.payloads.get("mm")
    if carried:
        out.line(f"mm {carried['mm_version']} ({', '.join(carried['sets'])}) travels whole in volume 1; on the "
                 f"air-gapped host, where the volumes lie: sh install-mm.sh [DIR]")
    if not result.synced:
        out.line(f"not synced (--no-sync): run `sync` or unmount before removing the disk holding "
                 f"{' and '.join(result.outs)}")


def _carried(plan) -> str:
    """What the volumes carry, the model apart from what rides along: 'model: 1 file(s), 576 B carried (11 file(s),
    752.2 kB taken from the base); mm itself (installer and wheels): 36 file(s), 41.3 MB'. "Carried" is the one
    name of the model's bytes in the volumes; the volume files' size on disk is said as such where it is."""
    base = (f" ({plan.taken_files} file(s), {human_bytes(plan.taken_bytes)} taken from the base at the destination)"
            if plan.taken_files else "")
    return "; ".join([f"model: {plan.model_files} file(s), {human_bytes(plan.model_bytes)} carried{base}"]
                     + [f"{p.label}: {p.files} file(s), {human_bytes(p.bytes)}" for p in plan.payloads])


def _render_bundle_plan(plan) -> None:
    """The plan, before a byte is written: what the volumes carry, how many, how large, which disk holds which (on
    stderr, with the progress: stdout keeps the results)."""
    parity = f" + {plan.parity} parity volume(s)" if plan.parity else ""
    last = f" (the last {human_bytes(plan.last)})" if plan.volumes > 1 else ""
    err.line(f"plan: {_carried(plan)}")
    err.line(f"  in {plan.volumes} volume(s) of up to {human_bytes(plan.volume_size)}{last}{parity}: "
             f"{human_bytes(plan.total_bytes)} on disk (tar headers and mm's index included)")
    for d in plan.disks:
        err.line(f"  {d.out}: {d.holds} ({human_bytes(d.to_write)} to write, {human_bytes(d.free)} free)")
    for note in plan.notes:
        err.line(f"note: {note}")


@bundle.command("verify")
@click.argument("volumes", nargs=-1, required=True, type=PATH)
@json_option
@handles_errors
def bundle_verify(volumes, json_out):
    """Check each volume on its own (any order, any subset): OK / CORRUPT / FOREIGN, then the missing ones.

    Exit 0 when every volume given is OK (missing volumes are reported, not failed); 1 otherwise.
    """
    from ..artifacts.bundle.check import verify_volumes
    report = verify_volumes(list(volumes), progress=progress_for(json_out))
    if json_out:
        emit_json(report)
    else:
        for v in report.verdicts:
            what = "parity" if v.kind == "parity" else "volume"
            out.line(f"{v.status:<8} {v.path}" + (f"  ({what} {v.volume} of {v.volumes})" if v.volume else ""))
            for problem in v.problems:
                out.line(f"         {problem}")
        missing = ", ".join(str(n) for n in report.missing) or "none"
        out.line(f"checked {report.files_checked} volume file(s), {human_bytes(report.bytes_on_disk)} on disk: "
                 f"{human_bytes(report.bytes_checked)} of members hashed (the files carried and mm's index, manifest "
                 f"and notes) in {human_duration(report.seconds)}")
        if report.bundle_id is None:
            out.line("no readable bundle volume among those given")
        else:
            out.line(f"bundle {report.name} ({report.bundle_id}): {report.volumes} volume(s); missing: {missing}")
            if report.install_mm:
                out.line(f"install: {report.install_mm}")
                out.line(f"         {report.mm_host}")
            if report.delta:
                from ..artifacts.bundle.delta import describe
                out.line(f"{describe(report.delta)}: mm unbundle VOLUMES --dest NEW_DIR --from BASE_DIR")
            if report.parities:
                gone = ", ".join(str(n) for n in report.parity_missing) or "none"
                out.line(f"parity: {report.parities} volume(s); missing: {gone}")
            if report.recovery:
                out.line(report.recovery)
            if report.ok and not report.delta:
                from shlex import quote
                given = " ".join(quote(str(v)) for v in volumes)
                later = "; the missing volumes may come later" if report.missing else ""
                out.line(f"next: mm unbundle {given} --dest DIR   # on the offline host{later}")
    if not report.ok:
        bad = [f"{Path(v.path).name} {v.status}" for v in report.verdicts if v.status != "OK"]
        err.line(f"mm: bundle verify: {', '.join(bad)}")
        sys.exit(ProblemsFound.exit_code)


@bundle.command("repair-volume")
@click.argument("volumes", nargs=-1, required=True, type=PATH)
@click.option("--out", "out_dir", type=PATH,
              help="Where rebuilt volume files go. Default: beside the first volume given.")
@click.option("--no-sync", "no_sync", is_flag=True, help="Do not fsync the rebuilt volumes.")
@json_option
@handles_errors
def bundle_repair_volume(volumes, out_dir, no_sync, json_out):
    """Write lost or damaged volume files back from the others and the parity volumes, byte-identical.

    Every volume given is checked first; a rebuilt data volume gets its name only when its whole-file blake3 is
    the one the parity index records. Exit 0 repaired (or nothing to repair), 1 too many volumes lost (the
    message says which would be enough), 3 no usable parity volume."""
    import time

    from ..artifacts.bundle.repair import repair_volumes
    started = time.monotonic()
    report = repair_volumes(list(volumes), out_dir, sync=not no_sync, progress=progress_for(json_out))
    if json_out:
        emit_json(report)
        return
    for note in report.notes:
        err.line(f"note: {note}")
    for path in report.rebuilt:
        out.line(f"rebuilt  {path} (byte-identical, blake3 checked)")
    for path in report.parity_rewritten:
        out.line(f"rewrote  {path} (parity)")
    written = [Path(p) for p in report.rebuilt + report.parity_rewritten]
    if not written:
        out.line(f"bundle {report.name}: nothing to repair ({len(report.intact)} data volume(s) intact)")
    else:
        out.line(f"bundle {report.name}: {len(written)} volume file(s) written, "
                 f"{human_bytes(sum(p.stat().st_size for p in written))}, "
                 f"in {human_duration(time.monotonic() - started)}")


@click.command()
@click.argument("volumes", nargs=-1, required=True, type=PATH)
@click.option("--dest", required=True, type=PATH, help="The model directory to fill.")
@payload_options("dest")
@click.option("--no-sync", "no_sync", is_flag=True,
              help="Do not fsync imported files (a scratch copy): files are still named only once their hashes match, "
                   "and the final verify still runs; a crash can lose what the page cache held.")
@click.option("--readback", is_flag=True,
              help="Also read each file back from the disk once fsynced (its pages dropped from the page cache) and "
                   "name it only if it still matches: proves the disk holds the bytes, at the cost of a second read.")
@click.option("--from", "base_dir", type=PATH,
              help="A delta bundle's base: the directory holding the base revision. Files the delta does not carry are "
                   "taken from there (reflink where the file system clones, else a copy), each hashed.")
@click.option("--link", is_flag=True,
              help="With --from, where no reflink is possible: hard-link the base files instead of copying them. The "
                   "two directories then share one inode per file: damage to one shows in both.")
@signature_options
@json_option
@handles_errors
def unbundle(volumes, dest, no_sync, readback, base_dir, link, require_signature, allowed_signers, identity, json_out,
             **kw):
    """Import volumes (files or directories, any order, some now and the rest later) into DEST, then verify.

    Exit 0 imported and verified, 8 what was given is imported and other volumes are still to come, 5 a volume
    or member was refused (or a file read back with --readback differed), 1 the final verify failed, 7 not
    enough space.
    """
    import time

    from ..artifacts.bundle.unpack import Outcome, UnbundleOptions, unbundle as import_volumes
    options = UnbundleOptions.from_cli(
        payload_dests={k.kind: kw[k.dest_param] for k in PAYLOAD_KINDS}, sync=not no_sync, readback=readback,
        base_dir=base_dir, link=link, allowed_signers=allowed_signers, identity=identity,
        require_signature=signature_policy(require_signature, allowed_signers, identity))
    started = time.monotonic()
    report = import_volumes(list(volumes), dest, options, progress_for(json_out))
    exit_code, why = {Outcome.IMPORTED: (0, ""),
                      Outcome.WAITING: (Waiting.exit_code, "waiting for more volumes"),
                      Outcome.REFUSED: (IntegrityError.exit_code, "volumes or members refused"),
                      Outcome.VERIFY_FAILED: (ProblemsFound.exit_code, "final verify found problems")}[report.outcome]
    if json_out:
        doc = to_jsonable(report)
        emit_json({"ok": doc.pop("ok"), "exit_code": exit_code, **doc})
    else:
        render_carried_signature(report.signature, allowed_signers)
        for line in report.refused + report.corrupt:
            err.line(f"refused: {line}")
        for note in report.notes:
            err.line(f"note: {note}")
        if report.rebuilt:
            out.line(f"rebuilt from parity {', '.join(map(str, report.parity_used))}: volume(s) "
                     f"{', '.join(map(str, report.rebuilt))} (each checked whole, then imported)")
        if report.recovery:
            out.line(report.recovery)
        out.line(f"{len(report.imported)} file(s) imported, {report.skipped} already present, from "
                 f"{len(report.used)} volume(s) of {report.name} ({report.bundle_id}) in "
                 f"{human_duration(time.monotonic() - started)}.")
        if report.delta and report.delta.get("mode"):
            d = report.delta
            how = {"reflink": "by reflink (no bytes copied)", "link": "by hard link (--link)",
                   "copy": "by copy (no reflink on this file system)"}[d["mode"]]
            out.line(f"{d['taken']} file(s), {human_bytes(d['taken_bytes'])} taken from the base {d['from']} {how}, "
                     f"each hashed; {d['files_from_base'] - d['taken']} already in place")
        if report.complete:
            v = report.verify
            checked = sum(v[k]["bytes"] for k in ("hashed_as_written", "named_earlier_unchanged", "hashed_now"))
            out.line(f"verify {dest}: {'OK' if v['ok'] else 'PROBLEMS'} ({v['files_checked']} files, "
                     f"{human_bytes(checked)}: {v['hashed_as_written']['files']} hashed as they were written, "
                     + (f"{v['named_earlier_unchanged']['files']} named by an earlier run and unchanged, "
                        if v['named_earlier_unchanged']['files'] else "")
                     + f"{v['hashed_now']['files']} hashed now ({human_bytes(v['hashed_now']['bytes'])}); "
                     f"sizes and shard headers checked)")
            out.line(f"proven: {v['proven']}")
            for problem in v["problems"]:
                out.line(f"  {problem}")
            for cmd in report.next_commands:
                out.line(f"next: {cmd}")
        elif report.missing_volumes:
            from ..artifacts.integrity.provenance import import_remedy
            missing = ", ".join(str(n) for n in report.missing_volumes)
            out.line(f"still missing: volume(s) {missing} of {report.volumes}; {len(report.waiting)} file(s) "
                     f"waiting. Run again with the rest.")
            if remedy := import_remedy(dest):
                out.line(f"next: {remedy}")
        else:  # every volume imported: what still waits is refused above (a base file, or an index that forgets it)
            out.line(f"{len(report.waiting)} file(s) not imported: {', '.join(report.waiting[:3])}"
                     + (" ..." if len(report.waiting) > 3 else ""))
        if not report.synced:
            out.line(f"not synced (--no-sync): run `sync` before relying on {dest} surviving a crash")
    if exit_code:
        if not json_out:
            err.line(f"mm: unbundle {dest}: {why}")
        sys.exit(exit_code)
