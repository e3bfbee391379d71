"""`mm verify`, `mm sign`, `mm repair`: a model directory against its manifest (or the Hub), its signature, and
re-fetching what is damaged (artifacts/integrity/verify.py, signing.py, repair.py)."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from ..artifacts.errors import MMError, ProblemsFound
from ..artifacts.units import human_bytes, human_duration, human_rate
from .shared import (check_repo_id, check_revision, emit_json, handles_errors, json_option, out, progress_for,
                     render_signed, signature_options, signature_policy, to_jsonable)
from .shared import PATH, examples

if TYPE_CHECKING:
    from pathlib import Path

    from ..artifacts.integrity.verify import VerifyReport


def _verify_doc(report: VerifyReport) -> dict:
    from ..artifacts.integrity.verify import summary_counts
    return {"ok": report.ok, **to_jsonable(report), "bytes_per_second": report.bytes_per_second,
            "counts": summary_counts(report.problems)}


def _counts_text(problems) -> str:
    from ..artifacts.integrity.verify import summary_counts
    return ", ".join(f"{n} {kind}" for kind, n in sorted(summary_counts(problems).items()))


def _render_verify(report: VerifyReport, title: str = "verify") -> None:
    for p in report.problems:
        out.line(f"{p.kind.upper():<10} {p.path}: {p.detail}")
    if report.left_out:
        shown = ", ".join(report.left_out[:3]) + (f" and {len(report.left_out) - 3} more" if len(report.left_out) > 3 else "")
        out.line(f"partial fetch ({report.asked}): {len(report.left_out)} file(s) of the revision left out, not "
                 f"judged: {shown}")
    read = ("presence, sizes, readability and shard headers (--quick: nothing hashed)" if report.quick else
            f"{human_bytes(report.bytes_checked)} hashed at {human_rate(report.bytes_per_second)}")
    failures = report.failures
    extras = len(report.problems) - len(failures)
    verdict = "OK" if report.ok else f"DAMAGED: {len(failures)} problem(s) ({_counts_text(failures)})"
    if extras:
        verdict += f"; {extras} extra file(s) reported, not failed (--strict fails on them)"
    out.line(f"{title} {report.model_dir} against {report.manifest_path}: {report.files_checked} file{'' if report.files_checked == 1 else 's'}, {read}, "
             f"{human_duration(report.seconds)}. {verdict}")


def _problems_found(report: VerifyReport, what: str) -> None:
    raise ProblemsFound(f"{report.model_dir}: {len(report.failures)} problem(s) {what} "
                        f"({_counts_text(report.failures)}); see the lines above")


def _next_step(report: VerifyReport) -> str | None:
    """What a user runs after a verify that found damage: repair when a download fixes some of it."""
    if report.ok or report.manifest_path.startswith("hub:"):
        return None
    import shlex
    from pathlib import Path

    from ..artifacts.integrity.provenance import import_remedy
    from ..artifacts.integrity.verify import REPAIRABLE
    fixable = [p for p in report.failures if p.kind in REPAIRABLE]
    if remedy := import_remedy(Path(report.model_dir), damaged=len(fixable)):  # from volumes: no Hub needed
        return f"next: {remedy}"
    if fixable:
        return (f"next: mm repair {shlex.quote(report.model_dir)}   (re-fetches the {len(fixable)} missing or "
                f"damaged file(s) from the Hub, then verifies again)")
    return "next: nothing a download fixes; fix or remove the files named above by hand"


def _node_name(ctx, param, value):
    """A Kubernetes node name (a DNS subdomain): it goes into a printed command line."""
    import re
    if value is not None and (len(value) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", value)):
        raise click.BadParameter(f"{value[:60]!r}: not a Kubernetes node name (lower-case letters, digits, '-', '.')")
    return value


@examples(
    "mm verify /data/models/MiniMax-M3.1-Flash",
    "mm verify --quick /data/models/MiniMax-M3.1-Flash          # no hashing: the pre-flight check",
    "mm verify --strict /data/models/MiniMax-M3.1-Flash         # files not in the manifest fail too",
    "mm verify --upstream /data/models/MiniMax-M3.1-Flash       # against the Hub's own hashes",
    "mm verify DIR --allowed-signers allowed_signers --identity release@example.com",
    "mm verify /models/MiniMaxAI/MiniMax-M3.1-Flash/current --label-node gpu-node-7   # OME's proof label")
@click.command()
@click.argument("directory", type=PATH)  # verify says why it cannot read
@click.option("--manifest", "manifest_file", type=PATH,
              help="Manifest to check against. Default: DIR/.mm/manifest.json.")
@click.option("--quick", is_flag=True, help="Presence, sizes, readability and shard headers only; no hashing.")
@click.option("--strict", is_flag=True, help="Files not in the manifest fail too (exit 1); by default they are "
                                             "reported and pass.")
@click.option("--jobs", type=click.IntRange(1, 256), help="Threads. Default: one per core.")
@click.option("--upstream", is_flag=True, help="Check against the Hub's own identities (LFS sha256, git blob sha1), "
                                               "not the manifest; needs the Hub.")
@click.option("--repo", callback=check_repo_id, help="With --upstream: the Hub repo. Default: the manifest's.")
@click.option("--revision", callback=check_revision, help="With --upstream: the revision. Default: the manifest's commit.")
@signature_options
@click.option("--label-node", metavar="NODE", callback=_node_name, default=None,
              help="After a full verify that passes, print the `kubectl label node NODE ...` line that marks this "
                   "node's copy proven for this manifest (OME's node selector, `mm launch --format ome`).")
@json_option
@handles_errors
def verify(directory, manifest_file, quick, strict, jobs, upstream, repo, revision, require_signature, allowed_signers,
           identity, label_node, json_out):
    """Check every byte of DIR against its manifest, every file present, every safetensors shard and index
    sound; files not in the manifest are reported (and fail with --strict). A partial fetch is judged on what
    was asked for. Exit 0 all good, 1 problems found, 3 could not run, 5 bad signature."""
    from ..artifacts.integrity.verify import VerifyOptions, upstream_target, verify_dir
    progress = progress_for(json_out)
    signature = None
    signature_policy(require_signature, allowed_signers, identity)  # checked before every byte
    options = VerifyOptions.from_cli(quick=quick, strict=strict, jobs=jobs, manifest_file=manifest_file,
                                     upstream=upstream, repo=repo, revision=revision, label_node=label_node,
                                     allowed_signers=allowed_signers)
    label = _proof_label(directory) if options.label_node else None  # the manifest as it is before the bytes are read
    if options.upstream:
        from ..artifacts.fetching.hub import verify_upstream  # the Hub client loads only when asked for
        repo_id, rev = upstream_target(directory, options.manifest_file, options.repo, options.revision)
        report = verify_upstream(directory, repo_id, rev, quick=options.quick, jobs=options.jobs,
                                 progress=progress, strict=options.strict)
    else:
        manifest_obj = None
        if allowed_signers:
            signature, manifest_obj = _checked_signature(directory, allowed_signers, identity,
                                                         options.manifest_file)
            if not json_out:
                _render_signature(signature)
        report = verify_dir(directory, manifest_obj, quick=options.quick, jobs=options.jobs, progress=progress,
                            manifest_file=options.manifest_file, strict=options.strict, head_start=True)
        if not options.quick and options.manifest_file is None:  # for `mm ls`: when this directory was last verified in full
            from ..artifacts.integrity.stamps import record_verified
            record_verified(directory, report.ok, report.files_checked, report.bytes_checked, len(report.problems),
                            "mm verify")
    command = None
    if label and report.ok:
        if _proof_label(directory) != label:
            raise MMError(f"{directory}: its manifest changed while it was verified; verify again before labelling")
        command = f"kubectl label node {options.label_node} {label[0]}={label[1]} --overwrite"
    if json_out:
        emit_json({**_verify_doc(report), "next": _next_step(report),
                   **({"signature": to_jsonable(signature)} if signature else {}),
                   **({"label": {"node": options.label_node, "key": label[0], "value": label[1], "command": command}}
                      if command else {})})
        sys.exit(0 if report.ok else ProblemsFound.exit_code)
    _render_verify(report)
    if (step := _next_step(report)) is not None:
        out.line(step)
    if not report.ok:
        _problems_found(report, "found")
    if command:
        out.line(command)


def _proof_label(directory: Path) -> tuple[str, str]:
    from ..artifacts.serving.kube import proof_label_for
    return proof_label_for(directory)


def _checked_signature(directory: Path, allowed_signers: Path, identity: str | None, manifest_file: Path | None = None):
    """(SignatureReport, the Manifest parsed from exactly the bytes whose signature was checked)."""
    import json

    from ..artifacts.integrity import signing
    from ..artifacts.integrity.manifest import from_dict
    report, data = signing.verify_dir_signature(directory, allowed_signers, identity, manifest_file)
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise MMError(f"{report.signature_path}: signed manifest is not valid JSON ({e})") from None
    return report, from_dict(doc, str(report.signature_path).removesuffix(".sig"))


def _render_signature(report) -> None:
    out.line(f"signature: good, {report.describe()}, allowed by {report.allowed_signers}")



@examples(
    "mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519",
    "mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519.pub   # the key in ssh-agent")
@click.command()
@click.argument("directory", type=PATH)
@click.option("--key", required=True, type=PATH,
              help="SSH key for `ssh-keygen -Y sign`: a private key file, or KEY.pub whose key ssh-agent holds "
                   "(keys with a passphrase, hardware keys).")
@json_option
@handles_errors
def sign(directory, key, json_out):
    """Sign DIR/.mm/manifest.json with ssh-keygen (namespace mm-manifest), writing .mm/manifest.json.sig.

    mm never reads the private key: ssh-keygen does, or ssh-agent signs (SSH_AUTH_SOCK)."""
    from ..artifacts.integrity import signing
    result = signing.sign_manifest(directory, key)
    if json_out:
        emit_json({"ok": True, **to_jsonable(result)})
        return
    render_signed(result)



@examples(
    "mm repair /data/models/MiniMax-M3.1-Flash",
    "mm repair /data/models/MiniMax-M3.1-Flash --json | jq .restored")
@click.command()
@click.argument("directory", type=PATH)
@click.option("--jobs", type=click.IntRange(1, 256), help="Verify threads. Default: one per core.")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Files downloaded in parallel.")
@json_option
@handles_errors
def repair(directory, jobs, workers, json_out):
    """Re-fetch only the files verify finds missing or corrupt (from the Hub, at the manifest's commit),
    then verify again. Good files are never touched. Exit 0 repaired, 1 problems remain."""
    from ..artifacts.fetching import refetch as mm_repair
    report = mm_repair.repair_dir(directory, source=mm_repair.HubRepairSource(workers=workers), jobs=jobs, progress=progress_for(json_out))
    if json_out:
        emit_json({"ok": report.ok, "model_dir": report.model_dir, "source": report.source,
                   "restored": report.restored, "before": _verify_doc(report.before), "after": _verify_doc(report.after)})
        sys.exit(0 if report.ok else ProblemsFound.exit_code)
    if not report.restored:  # one pass: the verify that found nothing to re-fetch is the verdict
        _render_verify(report.after, "verify")
        out.print(f"{directory}: nothing to re-fetch (no missing or corrupt files)", highlight=False)
    for path in report.restored:
        out.line(f"RESTORED   {path} (from {report.source})")
    if report.restored:
        out.line("re-verify: the restored file(s) hashed; the others were hashed once, before, and not rewritten")
        _render_verify(report.after, "re-verify")
    if not report.ok:
        _problems_found(report.after, "remain that re-fetching cannot fix (fix or remove them by hand)")
