"""`mm image save`: the pinned engine image by identity, as an archive for the air-gapped host (artifacts/serving/image.py)."""
from __future__ import annotations

from pathlib import Path

import click

from ..artifacts.units import human_bytes
from .shared import emit_json, err, handles_errors, json_option, out, to_jsonable


@click.group()
def image():
    """The pinned engine image by identity (`mm image save --out FILE`)."""


@image.command("save")
@click.argument("reference", required=False)
@click.option("--platform", "platform_", default=None, help="linux/amd64 or linux/arm64 (default: this host's).")
@click.option("--out", "out_file", required=True, type=click.Path(path_type=Path), help="The archive to write.")
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
