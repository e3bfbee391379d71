"""`mm ls`, `mm use`, `mm gc`: revisions side by side under a model root (ROOT/<repo id>/<revision dir>/), the
current one behind ROOT/<repo id>/current, and the cleanup of those no longer needed (artifacts/store.py)."""
from __future__ import annotations


import click

from ..artifacts.units import human_bytes
from .shared import PATH
from .shared import check_repo_id, emit_json, err, handles_errors, json_option, out, to_jsonable

root_option = click.option("--root", type=PATH, envvar="MM_ROOT", default=".", show_default=True,
                           help="The model root (ROOT/<repo id>/<revision dir>/). Environment: MM_ROOT.")


@click.command("ls")
@click.argument("root", required=False, type=PATH, envvar="MM_ROOT", default=".")
@json_option
@handles_errors
def ls(root, json_out):
    """The revisions under ROOT (ROOT/<repo id>/<dir>/): sizes, bytes shared on disk, which is current, when each was
    verified, signatures, containers mounting them."""
    from ..artifacts.store import ls as list_revisions
    report = list_revisions(root)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.line(f"note: {note}")
    repos = sorted({r.repo_id for r in report.revisions})
    out.line(f"{report.root}: {len(report.revisions)} revision(s) of {len(repos)} repo(s), "
             f"{human_bytes(report.size)} of files, {human_bytes(report.on_disk)} on disk"
             + (f" (sharing saves {human_bytes(report.size - report.on_disk)})" if report.size > report.on_disk else ""))
    for repo in repos:
        out.line(f"{repo}  (current: {report.pointers.get(repo) or 'none; mm use sets it'})")
        for r in (r for r in report.revisions if r.repo_id == repo):
            out.line("  " + _revision_line(r))


def _revision_line(r) -> str:
    v = r.verified
    verified = ("never verified in full here" if v is None else
                f"verified {'OK' if v['ok'] else 'with PROBLEMS'} {v['time']} ({v['by']})"
                + ("" if v["current"] else ", before its manifest changed"))
    signature = {"none": "unsigned", "good": f"signed ({r.signer})", "stale": "signature STALE (manifest changed)",
                 "unchecked": "signed (not checked: no ssh-keygen)"}[r.signature]
    mounted = f"; mounted by {', '.join(r.mounted_by)}" if r.mounted_by else ""
    payload = f", {r.dir}.payload/ {human_bytes(r.payload)}" if r.payload else ""
    return (f"{'*' if r.current else ' '} {r.revision[:12]}  {r.dir}/  {r.files} files, {human_bytes(r.size)}, "
            f"{human_bytes(r.on_disk)} on disk ({human_bytes(r.shared)} shared){payload}; {verified}; "
            f"{signature}{mounted}")


@click.command("use")
@click.argument("repo", callback=check_repo_id)
@click.argument("revision")
@root_option
@json_option
@handles_errors
def use(repo, revision, root, json_out):
    """Make REVISION (a commit prefix or its directory name) the current one of REPO under the model root: the
    ROOT/REPO/current symlink is replaced atomically, once `verify --quick` passes on it. A rollback is the same
    command with the earlier revision; a start script that names ROOT/REPO/current serves it at its next start."""
    from ..artifacts.errors import NotInRoot
    from ..artifacts.store import use as use_revision
    try:
        result = use_revision(root, repo, revision)
    except NotInRoot as e:
        if click.get_current_context().get_parameter_source("root") is click.core.ParameterSource.DEFAULT:
            e.message += ("; the model root is the current directory when none is given: "
                          "add --root DIR or set MM_ROOT")
        raise
    if json_out:
        emit_json({"ok": True, **to_jsonable(result)})
        return
    if not result.changed:
        out.line(f"{result.pointer} -> {result.dir} already ({result.revision[:12]})"
                 + ("; the choice is recorded again, of the manifest it holds now"
                    if result.recorded else ""))
        return
    out.line(f"{result.pointer} -> {result.dir} ({result.revision[:12]}); was {result.previous or 'unset'}. "
             f"Containers started through the pointer serve it from their next start"
             + (f"; roll back with: mm use {repo} {result.previous} --root {root}" if result.previous else ""))


@click.command("gc")
@click.argument("root", required=False, type=PATH, envvar="MM_ROOT", default=".")
@click.option("--keep", type=click.IntRange(0, 10_000), default=1, show_default=True,
              help="Revisions to keep besides the current one, the most recently current (or imported) first.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing.")
@click.option("--without-docker", is_flag=True,
              help="Do not ask docker which revisions running containers mount (daemon stopped; podman, "
                   "Kubernetes): a container serving a removed revision loses its files. Current and kept stay.")
@json_option
@handles_errors
def gc(root, keep, dry_run, without_docker, json_out):
    """Remove the revisions under ROOT that are not current, not kept (--keep) and not mounted by a running
    container (docker is asked), and say what it frees. Interrupted, it leaves every revision whole or gone;
    the next run finishes."""
    from ..artifacts.store import gc as collect
    report = collect(root, keep=keep, dry_run=dry_run, without_docker=without_docker)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.line(f"note: {note}")
    verb = "would remove" if dry_run else "removed"
    for path in report.leftovers:
        out.line(f"{verb} {path} (left by an interrupted gc)")
    for r in report.removed:
        payload = f", and {r['dir']}.payload/ ({human_bytes(r['payload'])})" if r["payload"] else ""
        out.line(f"{verb} {r['repo_id']}@{r['revision'][:12]} ({r['dir']}/, {human_bytes(r['size'])} of files"
                 f"{payload})")
    for r in report.kept:
        out.line(f"kept   {r['repo_id']}@{r['revision'][:12]} ({r['dir']}/): {r['why']}")
    out.line(f"{'would free' if dry_run else 'freed'} {human_bytes(report.freed)} on disk")
