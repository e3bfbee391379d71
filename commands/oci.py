"""`mm push`, `mm pull`, `mm inspect`, `mm preheat`: a model directory as a ModelPack artifact in an OCI registry,
and back, through a site's pull-through caches (artifacts/oci/)."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import click

from ..artifacts.errors import ProblemsFound
from ..artifacts.units import human_bytes, human_duration, human_rate
from .shared import (PATH, emit_json, err, examples, handles_errors, json_option, out, progress_for,
                     render_carried_signature, signature_options, signature_policy, to_jsonable)


def registry_options(fn: Callable) -> Callable:
    """Auth and transport options shared by push, pull and inspect. The password only ever comes from stdin."""
    for option in reversed([
        click.option("--username", help="Registry user (with --password-stdin). Default: ~/.docker/config.json, or "
                                        "REGISTRY_AUTH_FILE; else anonymous."),
        click.option("--password-stdin", is_flag=True, help="Read the password (or token) from standard input."),
        click.option("--plain-http", is_flag=True, help="Plain HTTP to a registry that is not on loopback (loopback always is)."),
        click.option("--ca-file", type=click.Path(path_type=Path, dir_okay=False, readable=False),
                     help="PEM CA bundle for the registry's HTTPS certificate. Default: the system's CAs."),
    ]):
        fn = option(fn)
    return fn


def _registry_access(ref_text: str, username: str | None, password_stdin: bool, plain_http: bool, ca_file: Path | None):
    from ..artifacts.oci.client import Credentials, Transport, load_credentials
    from ..artifacts.oci.reference import parse_reference
    ref = parse_reference(ref_text)
    creds = load_credentials(ref.registry, Credentials.from_cli(username, password_stdin, sys.stdin))
    return creds, Transport(plain_http=plain_http, ca_file=ca_file)


def _transfer_summary(items, nbytes: int, seconds: float) -> tuple[Counter, str]:
    """Counts by status, and "(bytes, rate[, N resumed])" for a push or pull report's blobs or files."""
    resumed = sum(1 for item in items if item.resumed_from)
    rate = nbytes / seconds if seconds else 0
    return Counter(item.status for item in items), (f"({human_bytes(nbytes)} in {human_duration(seconds)}, "
                                                    f"{human_rate(rate)}{f', {resumed} resumed' if resumed else ''})")


@examples(
    "mm push /data/models/MiniMax-M3.1-Flash registry.example.com/models/minimax-m3.1-flash",
    "mm push DIR 127.0.0.1:5000/models/flash:v1                # loopback: plain HTTP",
    "echo \"$TOKEN\" | mm push DIR registry.example.com/models/flash --username ci --password-stdin")
@click.command()
@click.argument("directory", type=PATH)
@click.argument("reference")
@registry_options
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Blobs uploaded in parallel.")
@click.option("--chunk-size", default="64MiB", show_default=True, help="Upload big blobs in chunks of this size (PATCH).")
@click.option("--mount-from", metavar="REPOSITORY", help="Another repository of the same registry holding some of the "
                                                         "blobs: mount them instead of uploading.")
@click.option("--max-blob-size", help="Refuse (exit 7, nothing pushed) a file above this size: the registry's single-blob "
                                      "limit (e.g. 100G for distribution on S3 with default parts, 20G for Kraken).")
@json_option
@handles_errors
def push(directory, reference, username, password_stdin, plain_http, ca_file, workers, chunk_size, mount_from,
         max_blob_size, json_out):
    """Push a verified model directory to an OCI registry as a CNCF ModelPack artifact.

    REFERENCE is host[:port]/repository[:tag]; the tag defaults to the manifest's short revision. Refuses
    (exit 1) a directory whose `mm verify --quick` fails. A rerun skips what the registry has and resumes uploads.
    """
    from ..artifacts.units import parse_size
    from ..artifacts.oci import push as oci_push
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    options = oci_push.PushOptions(credentials=creds, transport=transport, workers=workers,
                                   chunk_size=parse_size(chunk_size), mount_from=mount_from,
                                   max_blob_size=parse_size(max_blob_size) if max_blob_size else None)
    report = oci_push.push(directory, reference, options, progress_for(json_out))
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.line(f"note: {note}")
    counts, moved = _transfer_summary(report.blobs, report.bytes_sent, report.seconds)
    out.line(f"pushed {report.reference} ({report.repo_id}@{report.revision[:12]}): {counts['uploaded']} uploaded "
             f"{moved}, {counts['present']} already there, {counts['mounted']} mounted")
    out.line(f"digest: {report.digest}")
    out.line(f"pull with: mm pull {report.reference.rsplit(':', 1)[0]}@{report.digest} --local-dir DIR")


def _render_inspect(report) -> None:
    out.line(f"{report.reference} -> {report.digest}")
    out.line(f"model: {report.repo_id or '?'} revision {report.revision or '?'}")
    fields = ", ".join(f"{k} {v}" for k, v in report.config.items() if isinstance(v, str))
    if fields:
        out.line(f"config: {fields}")
    for f in report.files:
        kind = f["media_type"].rsplit(".model.", 1)[-1]
        out.line(f"{human_bytes(f['size']):>10}  {kind:<22} {f['path']}")
    signed = {None: "unknown (not pushed by mm)", True: "yes (check with mm pull --allowed-signers FILE)",
              False: "no"}[report.signed]
    out.line(f"{len(report.files)} files, {human_bytes(report.total_bytes)}; mm manifest: "
             f"{'yes' if report.mm_manifest else 'no'}; signed: {signed}")


@examples(
    "mm pull registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e --local-dir DIR",
    "mm pull registry.example.com/models/flash@sha256:DIGEST --local-dir DIR --allowed-signers allowed_signers",
    "mm pull registry.example.com/models/flash:ce7f4df87d2e --list",
    "mm pull registry.example.com/models/flash:ce7f4df87d2e --local-dir DIR --mirror t2.site:5000",
    "mm pull registry.example.com/models/flash:ce7f4df87d2e --local-dir DIR --mirror t2.site:5000 "
    "--mirror t1.site:5000 --no-fallback")
@click.command()
@click.argument("reference")
@click.option("--local-dir", type=PATH, help="Target directory (required unless --list).")
@click.option("--list", "list_only", is_flag=True, help="Show the artifact's files, sizes and revision; download nothing.")
@registry_options
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Blobs downloaded in parallel.")
@click.option("--mirror", "mirrors", multiple=True, metavar="HOST[:PORT]",
              help="Ask this registry mirror (a pull-through cache, with the reference's repository path) first; "
                   "repeat for more, tried in order, then the reference's own registry. Also http(s)://HOST[:PORT].")
@click.option("--no-fallback", is_flag=True, help="Never reach the reference's own registry: only the mirrors "
                                                  "(an air-gapped site).")
@signature_options
@json_option
@handles_errors
def pull(reference, local_dir, list_only, username, password_stdin, plain_http, ca_file, workers, mirrors, no_fallback,
         require_signature, allowed_signers, identity, json_out):
    """Pull a ModelPack artifact that mm pushed, proving every byte (sha256 and blake3) before naming a file.

    The tag is resolved to a digest once; resumes across runs; ends with the quick verify (exit 1 if it fails).
    With --allowed-signers the manifest's signature is checked before anything is written (exit 5 if not good).
    With --mirror, a mirror that is down or serves a blob whose digest fails is named and skipped for that
    blob; the next source serves it. --username credentials go to the reference's registry only.
    """
    from ..artifacts.oci import pull as oci_pull
    required = signature_policy(require_signature, allowed_signers, identity)
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    options = oci_pull.PullOptions.from_cli(mirrors=mirrors, no_fallback=no_fallback, transport=transport,
                                            workers=workers, allowed_signers=allowed_signers, identity=identity,
                                            require_signature=required)
    if list_only:
        report = oci_pull.inspect(reference, creds, transport)
        emit_json({"ok": True, **to_jsonable(report)}) if json_out else _render_inspect(report)
        return
    if local_dir is None:
        raise click.UsageError("--local-dir is required (or --list)")
    report = oci_pull.pull(reference, local_dir, creds, transport, options, progress_for(json_out))
    code = max((f.error_kind.exit_code for f in report.failed), default=0) or (ProblemsFound.exit_code if report.verify_problems else 0)
    if json_out:
        emit_json({"ok": code == 0, **to_jsonable(report)})
        sys.exit(code)
    render_carried_signature(report.signature, allowed_signers)
    _render_skipped(report.skipped)
    if mirrors:
        served = Counter(f.served_by for f in report.files if f.status == "downloaded")
        if served:
            out.line("served by: " + ", ".join(f"{who} {n} file(s)" for who, n in served.items()))
    for f in report.failed:
        err.line(f"FAILED {f.path}: {f.error}")
    counts, moved = _transfer_summary(report.files, report.bytes_transferred, report.seconds)
    out.line(f"{report.source}: {report.repo_id}@{report.revision[:12]}: {counts['downloaded']} downloaded {moved}, "
             f"{counts['present']} already present, {counts['failed']} failed")
    if report.removed:
        out.line(f"removed {len(report.removed)} file(s) of the earlier revision: {', '.join(report.removed[:5])}")
    if not report.failed:
        verdict = "OK" if not report.verify_problems else f"{len(report.verify_problems)} problem(s)"
        out.line(f"verify --quick {report.local_dir}: {verdict}")
        for problem in report.verify_problems:
            out.line(f"  {problem}")
        out.line(f"Manifest: {report.manifest_path}")
        if report.draft_subfolder:  # the pin names a draft model (as fetch says it)
            out.line(f"DSpark draft ({report.draft_subfolder}): {'present' if report.draft_present else 'MISSING'}")
    if code:
        if not report.failed:
            err.line(f"mm: {report.local_dir}: quick verify after pull found problems")
        sys.exit(code)


SKIPPED_SHOWN = 10  # lines naming skipped sources; the rest are counted (all are in --json)


def _render_skipped(skipped) -> None:
    """One line per source passed over for one reason (a mirror that is down: one line, not one per file)."""
    lines: dict[tuple[str, str], list[str]] = {}
    for s in skipped:
        lines.setdefault((s.source, s.reason), []).append(s.what)
    for (source, reason), whats in list(lines.items())[:SKIPPED_SHOWN]:
        what = whats[0] if len(whats) == 1 else f"{len(whats)} items"
        err.line(f"skipped {source} for {what}: {reason}")
    if len(lines) > SKIPPED_SHOWN:
        err.line(f"skipped sources {len(lines) - SKIPPED_SHOWN} more time(s) (--json lists them all)")


@examples(
    "mm inspect registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e",
    "mm inspect 127.0.0.1:5000/models/flash:v1 --json | jq .files")
@click.command()
@click.argument("reference")
@registry_options
@json_option
@handles_errors
def inspect(reference, username, password_stdin, plain_http, ca_file, json_out):
    """Show a registry artifact's files, sizes, revision and signature status (same as `mm pull --list`)."""
    from ..artifacts.oci import pull as oci_pull
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    report = oci_pull.inspect(reference, creds, transport)
    emit_json({"ok": True, **to_jsonable(report)}) if json_out else _render_inspect(report)


@examples(
    "mm preheat registry.example.com/models/flash:ce7f4df87d2e --tier t1.site:5000 --tier t2.site:5000",
    "mm preheat 127.0.0.1:5000/models/flash:v1 --tier http://127.0.0.1:5001 --tier http://127.0.0.1:5002 --json")
@click.command()
@click.argument("reference")
@click.option("--tier", "tiers", multiple=True, required=True, metavar="HOST[:PORT]",
              help="A pull-through cache to warm (also http(s)://HOST[:PORT]); repeat, nearest the origin first.")
@registry_options
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Blobs warmed in parallel at each tier.")
@json_option
@handles_errors
def preheat(reference, tiers, username, password_stdin, plain_http, ca_file, workers, json_out):
    """Warm a chain of pull-through caches with an artifact, nearest the origin first.

    REFERENCE names the origin (the site registry mm push wrote to); its manifest is resolved there once. Each
    tier then gets one request per blob: a tier that has the blob sends one byte; one that does not sends the
    whole blob (fetching it from its upstream as it does), read here through sha256 and checked, never stored.
    Before the next tier is asked, and before the preheat ends, each tier is asked (headers only) whether it has
    stored what it fetched, until it has or its deadline passes (2 s plus three times the slowest blob's read):
    a blob not stored by then is a warning, not a failure (exit 0). Run again on a warm chain, no blob moves.
    Exit 4 when a tier is down or refuses, 5 when a tier's bytes do not match their digest. --username
    credentials go to the origin only.
    """
    from ..artifacts.oci import preheat as oci_preheat
    from ..artifacts.oci.client import mirror_transport
    from ..artifacts.oci.reference import parse_reference
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    hosts = tuple(mirror_transport(t, "--tier", transport) for t in tiers)
    report = oci_preheat.preheat(reference, hosts, creds, transport, workers=workers, progress=progress_for(json_out))
    code = max((b.error_kind.exit_code for b in report.failed), default=0)
    if json_out:
        emit_json({"ok": code == 0, "reference": report.reference, "digest": report.digest, "blobs": report.blobs,
                   "total_bytes": report.total_bytes, "seconds": report.seconds,
                   "tiers": [{"tier": t.tier, "warm": t.warm, "fetched": t.fetched, "failed": len(t.failed),
                              "stored": t.stored, "not_stored": len(t.unstored), "waited": t.waited,
                              "bytes_read": t.bytes_read, "seconds": t.seconds,
                              "blobs": to_jsonable(t.blobs)} for t in report.tiers]})
        sys.exit(code)
    out.line(f"preheat {report.reference} -> {report.digest}: {report.blobs} blobs, "
             f"{human_bytes(report.total_bytes)}")
    for t in report.tiers:
        rate = human_rate(t.bytes_read / t.seconds) if t.seconds and t.bytes_read else "-"
        out.line(f"  {t.tier}: {t.fetched} fetched, {t.warm} already there, {len(t.failed)} failed; "
                 f"{human_bytes(t.bytes_read)} read from it in {human_duration(t.seconds)} ({rate})"
                 + (f"; {t.stored} of {t.fetched} stored; waited {t.waited:.1f} s" if t.fetched else ""))
        for b in t.failed:
            err.line(f"FAILED {t.tier} {b.digest}: {b.error}")
        for b in t.unstored:
            err.line(f"warning: {t.tier} fetched {b.digest} but had not stored it after {t.waited:.1f} s "
                     f"(asked {b.looks} times; {b.not_stored}): the next tier or a node may fetch it from upstream "
                     f"again")
    if not code:  # by digest: a tag would be asked upstream, through every tier, at every node's pull
        pinned = parse_reference(report.reference).at(report.digest)
        out.line(f"pull on the nodes with: mm pull {pinned} --local-dir DIR --mirror {report.tiers[-1].tier}")
    sys.exit(code)
