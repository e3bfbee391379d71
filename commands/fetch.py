"""`mm fetch`, `mm manifest`, `mm mirror`: a pinned revision from the Hub (or a ModelScope mirror) into a directory
with its manifest, a manifest for a directory another tool filled, and a mirror compared with the pin
(artifacts/fetching/fetch.py, adopt.py, manifest.py, mirror.py)."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..artifacts.errors import MMError
from ..artifacts.units import human_bytes, human_duration, human_rate
from .shared import PATH
from .shared import (DefaultGroup, check_repo_id, check_revision, emit_json, err, escape, handles_errors, json_option,
                     out, progress_for, render_signed, to_jsonable)

if TYPE_CHECKING:
    from ..artifacts.fetching import fetch as mm_fetch, mirror as ms_mirror


def _fetch_request(repo: str | None, revision: str | None, local_dir: Path | None, **options) -> mm_fetch.FetchRequest:
    from ..artifacts.fetching import fetch as mm_fetch
    from ..artifacts.pins import pinned_target
    t = pinned_target(repo, revision)
    return mm_fetch.FetchRequest(repo_id=t.repo_id, revision=t.revision or "main",
                                 local_dir=local_dir or Path(t.repo_id.split("/")[-1]), **options)


def _with_pin_origin(e: MMError, repo: str | None, revision: str | None, req: mm_fetch.FetchRequest) -> MMError:
    """E, saying where a revision the user never typed came from (the pin), when it is about that revision."""
    from ..artifacts.pins import pinned_target
    pin = pinned_target(repo, revision).pin
    if revision is not None or pin is None or req.revision not in e.message:
        return e
    e.message += (f" (no --revision given: {req.revision[:12]} is the revision of mm's pin {pin.name} for "
                  f"{req.repo_id}; pass --revision to fetch another)")
    return e


def _render_fetch(result: mm_fetch.FetchResult) -> None:
    if result.revision_kind != "commit":
        moving = " (a moving branch)" if result.revision_kind == "branch" else ""
        out.print(f"Resolved {result.requested_revision}{moving} -> {result.commit}; the manifest pins this commit.")
    counts = {s: [f for f in result.files if f.status == s] for s in FETCH_STATUSES}
    for f in counts["failed"]:
        err.print(f"FAILED {f.path}: {f.error}", markup=False)
    for f in result.files:
        if f.note:
            err.print(f"note: {f.path}: {f.note}", markup=False)
    resumed = [f for f in counts["downloaded"] if f.resumed_from]
    rate = result.bytes_transferred / result.seconds if result.seconds else 0
    moved = (f" ({human_bytes(result.bytes_transferred)} in {human_duration(result.seconds)}, {human_rate(rate)}"
             f"{f', {len(resumed)} resumed' if resumed else ''})") if counts["downloaded"] else ""
    adopted = f" ({human_bytes(sum(f.size for f in counts['adopted']))} already on disk, hashed here)" \
        if counts["adopted"] else ""
    out.print(f"{result.repo_id}@{result.commit[:12]}: {len(counts['downloaded'])} downloaded{moved}, "
              f"{len(counts['adopted'])} adopted{adopted}, {len(counts['present'])} already present, "
              f"{len(counts['failed'])} failed", highlight=False)
    t = result.transfer
    if t.get("requests"):
        retried = ", ".join(f"{n} {why}" for why, n in sorted(t["retries_by_reason"].items()))
        per_conn = rate / t["connections_used"] if t["connections_used"] else 0
        out.print(f"Connections: {t['connections_used']} of {t['connections']} used, {t['requests']} requests,"
                  f" {human_rate(per_conn)} per connection; retries: {t['retries']} of {t['retry_budget']}"
                  f"{f' ({retried})' if retried else ''}", highlight=False)
    sources = Counter(f.source for f in counts["downloaded"])
    if len(sources) > 1 or "hub" not in sources and sources:
        out.print("Sources: " + ", ".join(f"{n} from {label}" for label, n in sources.most_common()), highlight=False)
    out.print(f"Manifest: {result.manifest_path}", highlight=False)
    if result.draft is not None:  # the pin names a draft model
        out.print(f"DSpark draft ({result.draft.subfolder}): {'present' if result.draft.present else 'MISSING'}",
                  highlight=False)


FETCH_STATUSES = ("downloaded", "adopted", "present", "failed")


def _fetch_counts(files) -> dict[str, int]:
    """Files by outcome, every status named (0 included): what --json's "counts" holds."""
    return {status: sum(1 for f in files if f.status == status) for status in FETCH_STATUSES}


def _fetch_exit_code(result: mm_fetch.FetchResult) -> int:
    """The worst failure's code (the library reports each failure's class; only the CLI knows codes)."""
    return max((f.error_kind.exit_code for f in result.failed), default=0)


@click.command()
@click.argument("repo", required=False, callback=check_repo_id)
@click.option("--revision", "-r", callback=check_revision,
              help="Full or short commit, branch or tag. Default: the pin's revision (manifests/).")
@click.option("--local-dir", type=PATH, help="Target directory. Default: ./<repo name>.")
@click.option("--include", multiple=True, help="Only paths matching this glob (repeatable).")
@click.option("--exclude", multiple=True, help="Skip paths matching this glob (repeatable).")
@click.option("--connections", type=click.IntRange(1, 256), default=32, show_default=True,
              help="Most HTTP connections at once over all files (ranges of one big file, or many small files); "
                   "16 to start with, more while they raise the aggregate rate.")
@click.option("--workers", type=click.IntRange(1, 256), help="Files downloaded at once. Default: up to --connections.")
@click.option("--source", default="hub", show_default=True,
              help="hub, or modelscope[:OWNER/NAME[@REV]]: every file whose content matches the pin from that mirror, the rest from the Hub.")
@click.option("--mirror-only", is_flag=True, help="With --source modelscope: nothing from the Hub; fail naming the files the mirror cannot supply.")
@click.option("--pin-manifest", type=PATH,
              help="With --source modelscope: the pin's identities from this mm manifest, for when the Hub is unreachable.")
@click.option("--sign-with", type=PATH,
              help="Sign the manifest at the end (as `mm sign DIR --key KEY`) when every file was fetched.")
@click.option("--from", "base_dir", type=PATH,
              help="Another revision's directory on this host: files whose content it has are read from there, not "
                   "downloaded (each checked against the pin like a download).")
@json_option
@handles_errors
def fetch(repo, revision, local_dir, include, exclude, connections, workers, source, mirror_only, pin_manifest, sign_with,
          base_dir, json_out):
    """Download a pinned revision, verify every file against the Hub, write the manifest.

    Resumes across runs; the token comes from HF_TOKEN or the stored login, the endpoint from HF_ENDPOINT.
    """
    from ..artifacts.fetching import fetch as mm_fetch
    req = _fetch_request(repo, revision, local_dir, include=tuple(include), exclude=tuple(exclude), workers=workers,
                         connections=connections, base_dir=base_dir)
    plan = _mirror_plan(req, source, mirror_only, pin_manifest)  # mirror
    if sign_with is not None and not Path(sign_with).exists():  # before the download, not after it
        raise MMError(f"{sign_with}: no such key file (give a private key, or KEY.pub with its key in ssh-agent)")
    try:
        result = mm_fetch.fetch(req, progress_for(json_out), plan=plan)
    except MMError as e:
        raise _with_pin_origin(e, repo, revision, req) from None
    signed = None
    if sign_with is not None and not result.failed:
        from ..artifacts.integrity import signing
        signed = signing.sign_manifest(req.local_dir, sign_with)
    if json_out:
        emit_json({"ok": not result.failed, **to_jsonable(result), "counts": _fetch_counts(result.files),
                   "signed": to_jsonable(signed)})
    else:
        _render_fetch(result)
        if signed:
            render_signed(signed)
        elif sign_with is not None:
            err.print("not signed: some files failed", markup=False)
        if not result.failed:
            for hint in _next_after_fetch(result):
                out.line(f"next: {hint}")
    sys.exit(_fetch_exit_code(result))


def _next_after_fetch(result: mm_fetch.FetchResult) -> list[str]:
    """Where a fetched model usually goes next: onto disks for an offline host, or (a pinned model) a start."""
    from shlex import quote

    from ..artifacts.pins import pin_for_repo

    where = quote(result.local_dir)
    hints = [f"mm bundle {where} --out /media/disk1 --volume-size 100G   # to carry it to an offline host"]
    pin = pin_for_repo(result.repo_id)
    if pin is not None and pin.recipes:
        from ..artifacts.serving.launch import load_catalog, recipes_path

        try:
            gpus = ", ".join(load_catalog(recipes_path(pin), pin).hardware)
        except MMError:
            return hints
        hints.append(f"mm launch {where} --hardware GPU --out start.sh   # a start script; GPU one of {gpus}")
    return hints


@click.group(cls=DefaultGroup, default="create")
def manifest():
    """Write (`mm manifest DIR --repo R --revision REV`) or export (`mm manifest export DIR`) a manifest."""


@manifest.command("create")
@click.argument("directory", type=PATH)
@click.option("--repo", callback=check_repo_id,
              help="The Hub repo the directory holds, e.g. MiniMaxAI/MiniMax-M3.1-Flash. Default for a Hugging Face "
                   "cache snapshot: the repo its folder names.")
@click.option("--revision", callback=check_revision, help="Its revision (full sha when offline). Default for a Hugging "
                                                     "Face cache snapshot: its commit.")
@click.option("--offline", is_flag=True, help="Do not ask the Hub; record local hashes only.")
@click.option("--jobs", type=click.IntRange(1, 64), default=2, show_default=True)
@json_option
@handles_errors
def manifest_create(directory, repo, revision, offline, jobs, json_out):
    """Hash a directory another tool filled (e.g. `hf download`) and write DIR/.mm/manifest.json."""
    import time

    from ..artifacts.fetching import adopt
    from ..artifacts.paths import snapshot_of
    started = time.monotonic()
    snapshot = snapshot_of(directory)
    if snapshot is not None:  # hf's cache layout names both
        repo, revision = repo or snapshot.repo_id, revision or snapshot.revision
    if not repo or not revision:
        raise click.UsageError("--repo and --revision are required (only a Hugging Face cache snapshot names them)")
    result = adopt.manifest_for_local_dir(directory, repo, revision, offline=offline, jobs=jobs, progress=progress_for(json_out))
    if json_out:
        emit_json({"ok": True, "manifest_path": result.manifest_path, "checked_upstream": result.checked_upstream,
                   "note": result.note, "files": len(result.manifest.files), "bytes": result.manifest.total_bytes,
                   "revision": result.manifest.revision})
        return
    if result.note:
        err.print(f"note: {result.note}", markup=False)
    checked = "checked against the Hub" if result.checked_upstream else "NOT checked against the Hub"
    out.print(f"{len(result.manifest.files)} files ({human_bytes(result.manifest.total_bytes)}) hashed in "
              f"{human_duration(time.monotonic() - started)} at {result.manifest.revision}, {checked}. "
              f"Manifest: {result.manifest_path}", highlight=False)
    if snapshot is not None:
        out.print(f"{directory} is a Hugging Face cache snapshot: its manifest is kept outside hf's cache (above), "
                  f"and mm verify, bundle, launch and push find it there", highlight=False, soft_wrap=True)


@manifest.command("export")
@click.argument("directory", type=PATH)
@click.option("--format", "fmt", type=click.Choice(["sha256", "blake3", "both"]), default="both", show_default=True)
@json_option
@handles_errors
def manifest_export(directory, fmt, json_out):
    """Write SHA256SUMS / B3SUMS into DIR/.mm/ for `sha256sum -c` and `b3sum --check` (run from DIR)."""
    from ..artifacts.integrity.manifest import export_sums_files
    written = export_sums_files(directory, ("sha256", "blake3") if fmt == "both" else (fmt,))
    if json_out:
        emit_json({"ok": True, "written": written})
        return
    for path in written:
        out.print(f"wrote {path}", highlight=False)
    out.print(f"check without mm: cd {directory} && sha256sum -c .mm/SHA256SUMS && b3sum --check .mm/B3SUMS",
              highlight=False)



# --- mirror --------------------------------------------------------------------------

def _render_reconciliation(rec: ms_mirror.Reconciliation) -> None:
    from ..artifacts.fetching import mirror as ms_mirror
    from rich.table import Table

    table = Table(title=escape(f"{rec.label} vs {rec.repo_id}@{rec.revision[:12]} (pin from {rec.pin_origin})"))
    table.add_column("path", overflow="fold")
    for column in ("status", "pin size", "mirror size", "compared by"):
        table.add_column(column, justify="right" if "size" in column else "left", no_wrap=True)
    style = {ms_mirror.IDENTICAL: "green", ms_mirror.DIFFERENT: "red", ms_mirror.MISSING: "red", ms_mirror.EXTRA: "yellow"}
    for f in rec.files:
        status = f"[{style[f.status]}]{f.status}[/]" + (f" ({escape(f.note)})" if f.note else "")
        table.add_row(escape(f.path), status, "-" if f.pin_size is None else str(f.pin_size),
                      "-" if f.mirror_size is None else str(f.mirror_size), f.compared_by or "-")
    out.print(table)
    out.line(f"Verdict: {rec.label} can supply {rec.supplied_files} of {rec.pin_files} files "
             f"({human_bytes(rec.supplied_bytes)} of {human_bytes(rec.pin_bytes)}) of {rec.repo_id}@{rec.revision[:12]}"
             + ("." if rec.complete else f"; from the Hub: {', '.join(rec.unsupplied())}"))


def _render_ranking(ranking: ms_mirror.RevisionRanking) -> None:
    from rich.table import Table

    table = Table(title=f"ModelScope {ranking.modelscope_id}: branches and tags by coverage of the pin")
    for column in ("rank", "revision", "kind", "files", "bytes", "note"):
        table.add_column(column)
    for i, c in enumerate(ranking.ranking, 1):
        table.add_row(str(i), c.ms_revision, c.kind, f"{c.supplied_files}/{c.pin_files}",
                      f"{human_bytes(c.supplied_bytes)}/{human_bytes(c.pin_bytes)}", c.error or "")
    out.print(table)
    if ranking.best is not None:
        _render_reconciliation(ranking.best)


def _mirror_plan(req: mm_fetch.FetchRequest, source: str, mirror_only: bool,
                 pin_manifest: Path | None) -> mm_fetch.SourcePlan | None:
    """`mm fetch --source modelscope[...]`: byte sources from the mirror for the files that match the pin."""
    from ..artifacts.fetching import mirror as ms_mirror
    from ..artifacts.pins import pinned_target
    options = ms_mirror.MirrorOptions.from_cli(source, mirror_only, pin_manifest)
    if options is None:
        return None
    pin = pinned_target(req.repo_id, req.revision).pin
    return ms_mirror.plan_fetch(req, options, pin.modelscope_id if pin else None)[0]


def _reconciliation_json(rec: ms_mirror.Reconciliation | None) -> dict | None:
    return None if rec is None else {**to_jsonable(rec), "complete": rec.complete, "label": rec.label}


@click.group()
def mirror():
    """ModelScope mirrors: compare a mirror with the pinned revision by content."""


@mirror.command("reconcile")
@click.argument("repo", required=False, callback=check_repo_id)
@click.option("--revision", "-r", callback=check_revision, help="The pinned Hub revision. Default: the pin's (manifests/).")
@click.option("--modelscope-id", callback=check_repo_id, help="The mirror, OWNER/NAME on ModelScope. Default: the pin's.")
@click.option("--ms-revision", callback=check_revision, help="Mirror branch or tag. Default: master (ModelScope's default branch).")
@click.option("--all-revisions", is_flag=True, help="Rank every branch and tag of the mirror by how much of the pin it supplies.")
@click.option("--pin-manifest", "manifest_file", type=PATH,
              help="Take the pin's hashes from this mm manifest instead of the Hub (offline from the Hub).")
@click.option("--ms-endpoint", help="ModelScope endpoint. Default: MODELSCOPE_ENDPOINT, else https://modelscope.cn.")
@json_option
@handles_errors
def mirror_reconcile(repo, revision, modelscope_id, ms_revision, all_revisions, manifest_file, ms_endpoint, json_out):
    """Report each file as identical, different, missing on the mirror or extra on it, and what the mirror can supply.

    Matches on path, size and content hash (sha256; git blob sha1 of the mirror's bytes for small non-LFS
    files). Exit 0 whatever the verdict; 4 when the mirror or the Hub cannot be listed.
    """
    from ..artifacts.fetching import mirror as ms_mirror
    if all_revisions and ms_revision:
        raise click.UsageError("--ms-revision and --all-revisions exclude each other")
    target = ms_mirror.target(repo, revision, modelscope_id)
    pinned = ms_mirror.pinned_for(target, manifest_file)
    if all_revisions:
        ranking = ms_mirror.rank_revisions(pinned, target.modelscope_id, endpoint=ms_endpoint)
        if json_out:
            emit_json({"ok": True, "modelscope_id": ranking.modelscope_id, "ranking": to_jsonable(ranking.ranking),
                       "best": _reconciliation_json(ranking.best)})
        else:
            _render_ranking(ranking)
        return
    rec = ms_mirror.reconcile(pinned, target.modelscope_id, ms_revision or ms_mirror.DEFAULT_MS_REVISION,
                              endpoint=ms_endpoint)
    if json_out:
        emit_json({"ok": True, **_reconciliation_json(rec)})
    else:
        _render_reconciliation(rec)
