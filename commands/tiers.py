"""`mm fleet config`: the registry tiers' distribution configs and the nodes' containerd/docker configuration for
them, with the start order (artifacts/oci/tiers.py)."""
from __future__ import annotations


import click

from .shared import PATH, emit_json, handles_errors, json_option, out, to_jsonable


@click.group()
def fleet():
    """The registry tiers between the site registry and the nodes (`mm fleet config --origin URL --tier URL --out
    DIR`)."""


@fleet.command("config")
@click.option("--origin", required=True, help="The site registry's URL (http://HOST:PORT or https://...): where "
                                              "`mm image push` and `mm push` write.")
@click.option("--tier", "tiers", multiple=True, required=True,
              help="A pull-through cache's URL, nearest the origin first; repeat (the last is the nodes' mirror).")
@click.option("--out", "out_dir", required=True, type=PATH, help="The directory to write.")
@click.option("--storage-root", default="/var/lib/docker-registry", show_default=True,
              help="Each tier stores under ROOT/<tier> (Debian docker-registry's own rootdirectory).")
@click.option("--ttl", default="168h", show_default=True,
              help="proxy.ttl: how long a tier keeps what it cached (distribution 3.x; 2.8 keeps a fixed 168h).")
@click.option("--mirror-for", "registries", multiple=True, metavar="HOST[:PORT]",
              help="A registry whose references the nodes pull through the nearest tier (one hosts.toml each). "
                   "Default: the origin's host and the pinned image's registry (docker.io).")
@json_option
@handles_errors
def fleet_config(origin, tiers, out_dir, storage_root, ttl, registries, json_out):
    """Write the tiers' distribution configs (origin -> T1 -> T2 ..., each proxying the one before it), each node's
    containerd hosts.toml (the nearest tier as mirror) and docker daemon.json, and START-ORDER.txt under DIR."""
    from ..artifacts.oci import tiers as mm_tiers
    from ..artifacts.oci.reference import parse_endpoint
    from ..artifacts.serving.image import registry_of
    from ..artifacts.pins import default_pin
    if not registries:
        pinned = default_pin().image
        registries = [parse_endpoint(origin, "--origin", scheme_required=True).host]
        registries += [registry_of(pinned.split("@")[0])] if pinned else []
    report = mm_tiers.write_fleet_config(origin, list(tiers), out_dir, storage_root, ttl, list(registries))
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    lines = [f"wrote     {report.out}/"]
    lines += [f"  {rel}" for rel in report.files]
    lines.append("start order (distribution 2.8 will not start while its upstream is down):")
    for n, tier in enumerate(report.tiers, 1):
        lines.append(f"  {n}. {tier.name:<6} {tier.url:<28} docker-registry serve {tier.config}"
                     + (f"   (proxies {tier.upstream})" if tier.upstream else ""))
    lines.append(f"nodes     pull through {report.mirror} for {', '.join(report.registries)}")
    lines += [f"note      {note}" for note in report.notes]
    for line in lines:
        out.line(line)
