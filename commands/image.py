"""`mm image save`: the pinned engine image by identity, as an archive for the air-gapped host (artifacts/serving/image.py)."""
from __future__ import annotations

import sys

import click

from ..artifacts.units import human_bytes
from .shared import PATH, emit_json, err, handles_errors, json_option, out, to_jsonable


@click.group()
def image():
    """The pinned engine image by identity (`mm image save --out FILE`, `mm image push FILE SITE`)."""


@image.command("save")
@click.argument("reference", required=False)
@click.option("--platform", "platform_", default=None, help="linux/amd64 or linux/arm64 (default: this host's).")
@click.option("--out", "out_file", required=True, type=PATH, help="The archive to write.")
@click.option("--format", "fmt", type=click.Choice(["docker-archive", "oci-archive"]), default="docker-archive",
              show_default=True, help="docker-archive loads on every Docker; oci-archive needs Docker 25 or newer.")
@click.option("--insecure-registry", is_flag=True, help="Plain HTTP or unverified TLS to a registry that is not on "
                                                         "loopback (loopback always is, as for push and pull).")
@json_option
@handles_errors
def image_save(reference, platform_, out_file, fmt, insecure_registry, json_out):
    """Write REFERENCE (default: the pinned engine image) for one platform to FILE by digest, with skopeo, and the
    chain pinned digest -> platform manifest -> config (image ID) -> layers in FILE.mm-image.json beside it."""
    from ..artifacts.serving import image as mm_image
    from ..artifacts.pins import default_pin
    ref = reference or default_pin().image
    platform = mm_image.parse_platform(platform_) if platform_ else mm_image.host_platform()
    report = mm_image.save_image(ref, out_file, platform, fmt, tls_verify=not insecure_registry,
                                 show_progress=not json_out and err.is_terminal)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    c = report.chain
    for line in (f"pinned    {c.reference} ({c.pinned_media_type.rsplit('.', 2)[-2]})",
                 f"platform  {c.platform}: manifest {c.platform_manifest}",
                 f"image ID  {c.config} (config digest; what `docker images --no-trunc` shows after `docker load`)",
                 f"layers    {len(c.layers)}, {human_bytes(sum(layer.size for layer in c.layers))} compressed",
                 f"wrote     {report.archive} ({report.format}, {human_bytes(report.size)}, tag {report.tag})",
                 f"record    {report.record}",
                 f"next: mm bundle MODEL_DIR --image {report.archive} ...  (the bundle proves it is the pinned image)"):
        out.line(line)


@image.command("push")
@click.argument("archive", type=PATH)
@click.argument("site")
@click.option("--reference", default=None, help="The pinned image the archive must be (default: the pin's).")
@click.option("--username", help="Registry user (with --password-stdin). Default: ~/.docker/config.json, or "
                                 "REGISTRY_AUTH_FILE; else anonymous.")
@click.option("--password-stdin", is_flag=True, help="Read the password (or token) from standard input.")
@click.option("--plain-http", is_flag=True, help="Plain HTTP to a site registry that is not on loopback (skopeo "
                                                 "--dest-tls-verify=false; loopback always is). Said in the output.")
@json_option
@handles_errors
def image_push(archive, site, reference, username, password_stdin, plain_http, json_out):
    """Put ARCHIVE (the engine image a bundle carries, its record beside it) into the SITE registry
    (host[:port][/repository]) by digest, with skopeo: proven to be the pinned image before the push, and what the
    registry then serves proven to be the pinned chain."""
    from ..artifacts.serving import image as mm_image
    from ..artifacts.oci.client import Credentials, load_credentials
    from ..artifacts.pins import default_pin
    ref = reference or default_pin().image
    credentials = load_credentials(site.split("/", 1)[0], Credentials.from_cli(username, password_stdin, sys.stdin))
    report = mm_image.push_image(archive, site, ref, credentials, plain_http,
                                 show_progress=not json_out and err.is_terminal)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    how = {"pinned": "the pinned digest itself",
           "platform": f"the pinned chain's {report.chain.platform} manifest",
           "rebuilt": "a manifest skopeo wrote; its config is the pinned image ID"}[report.kind]
    for line in (f"before    {report.before}",
                 f"pushed    {report.pushed}  (TLS {report.tls}; credentials: {report.credentials or 'none'})",
                 f"after     {report.after}",
                 f"nodes     pull {report.pushed}  ({how})",
                 *([f"note      {report.note}"] if report.note else []),
                 f"next: mm fleet config --origin http{'s' if report.tls == 'verified' else ''}://"
                 f"{report.pushed.split('/', 1)[0]} --tier URL [--tier URL ...] --out DIR"):
        out.line(line)
