"""The registry tiers between the site registry and the nodes, and each node's runtime configuration for them.

A site puts the engine image (`mm image push`) and the model (`mm push`) into its origin registry; pull-through
caches (CNCF distribution in proxy mode: Debian's `docker-registry`) stand between it and the nodes, origin -> T1
-> T2, each proxying the one before it. `write_fleet_config` writes, under OUT:

    registry/<tier>/config.yml         each tier's distribution configuration (the origin's: a plain registry)
    containerd/certs.d/<host>/hosts.toml   the nearest tier as a mirror of each registry the nodes name
    containerd/config-snippet.toml     the CRI plugin's config_path, pointing at certs.d
    docker/daemon.json                 registry-mirrors: only Docker Hub references go through a mirror in docker
    START-ORDER.txt                    the order to start the tiers, with the check each must pass first

Every value names its source in a comment (distribution's configuration reference, containerd's docs/hosts.md,
Debian's packaged config) or says it is mm's own choice.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, BadValue
from .reference import Endpoint, parse_endpoint
from ..edges.fsutil import atomic_write_text, user_path

# Debian docker-registry's /etc/docker/registry/config.yml: storage.filesystem.rootdirectory
DEFAULT_STORAGE_ROOT = "/var/lib/docker-registry"
# distribution's configuration reference, `proxy.ttl`: "Cache 168h (7 days) by default"
DEFAULT_TTL = "168h"
# containerd docs/hosts.md: the directory the CRI plugin's config_path names, and `ctr images pull --hosts-dir`
CERTS_D = "/etc/containerd/certs.d"
DOCKER_HUB_SERVER = "https://registry-1.docker.io"  # containerd docs/hosts.md, the docker.io example's server
GO_DURATION = re.compile(r"^(?:0|(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+)$")  # time.ParseDuration's form


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass
class Tier:
    name: str  # origin, t1, t2, ...
    url: str
    upstream: str | None  # the tier before it (None: the origin)
    addr: str  # distribution's http.addr
    storage: str  # storage.filesystem.rootdirectory
    config: str  # the config file, relative to OUT
    ready: str  # the check that must pass before the next tier starts


@dataclass
class FleetConfig:
    out: Path
    tiers: list[Tier]  # in start order: origin first
    mirror: str  # the nearest tier: what the nodes pull through
    registries: list[str]  # the registries whose references go through the mirror (one hosts.toml each)
    files: list[str] = field(default_factory=list)  # written, relative to OUT
    notes: list[str] = field(default_factory=list)


def _listen_addr(ep: Endpoint) -> str:
    """http.addr for a tier reached at EP: its address and port when the URL names an address (loopback stays
    loopback), else :PORT, every address (the name resolves on the nodes, not necessarily here)."""
    if _is_ip(ep.hostname) or ep.hostname == "localhost":
        return f"{'[' + ep.hostname + ']' if ':' in ep.hostname else ep.hostname}:{ep.port}"
    return f":{ep.port}"


def _registry_yaml(tier: Tier, ep: Endpoint, ttl: str, total: int) -> str:
    role = ("the origin: the site registry that `mm image push` and `mm push` write to" if tier.upstream is None
            else f"a pull-through cache of {tier.upstream}")
    lines = [
        f"# mm fleet config: {tier.name} of {total} registries ({role}).",
        f"# Start: docker-registry serve {tier.config}   (START-ORDER.txt: after the tier before it answers)",
        "version: 0.1  # the one configuration version (distribution configuration reference, `version`)",
        "log:",
        "  accesslog:",
        "    disabled: false  # what this tier served, one line per request (reference, `log.accesslog`)",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {tier.storage}  # Debian docker-registry's rootdirectory, one directory per tier (mm)",
        "http:",
        f"  addr: {tier.addr}  # the URL's address and port (mm; `:PORT` listens on every address)",
        "  headers:",
        "    X-Content-Type-Options: [nosniff]  # Debian docker-registry's packaged config",
    ]
    if ep.scheme == "https":
        lines += ["  tls:  # an https:// URL: place this tier's certificate and key here (reference, `http.tls`)",
                  f"    certificate: /etc/docker/registry/{tier.name}.crt",
                  f"    key: /etc/docker/registry/{tier.name}.key"]
    if tier.upstream is not None:
        lines += ["proxy:",
                  f"  remoteurl: {tier.upstream}  # the tier before it: one upstream per proxy (reference, "
                  "`proxy.remoteurl`)",
                  f"  ttl: {ttl}  # expire cached content after this (reference, `proxy.ttl`, default 168h; 0: never). "
                  "distribution 2.8 ignores the key: it expires after a fixed 168h"]
    return "\n".join(lines) + "\n"


def _hosts_toml(server: str, mirror: Endpoint, registry: str) -> str:
    return "\n".join([
        f"# mm fleet config: {registry} references are pulled through the nearest tier, {mirror.url}.",
        "# containerd docs/hosts.md: hosts are tried in order, then `server`; a mirror gets pull and resolve only.",
        f'server = "{server}"  # the registry itself, tried last',
        "",
        f'[host."{mirror.url}"]',
        '  capabilities = ["pull", "resolve"]  # containerd docs/hosts.md: a mirror is not pushed to',
        *(['  # a private CA: ca = "/etc/containerd/certs.d/' + registry + '/ca.crt"  (containerd docs/hosts.md)']
          if mirror.scheme == "https" else []),
        "",
    ])


def write_fleet_config(origin: str, tiers: list[str], out: Path, storage_root: str = DEFAULT_STORAGE_ROOT,
                       ttl: str = DEFAULT_TTL, registries: list[str] | None = None) -> FleetConfig:
    """Write the tiers' distribution configs, the nodes' containerd hosts.toml and docker daemon.json, and the
    start order under OUT. ORIGIN: the site registry's URL; TIERS: the caches' URLs, nearest the origin first (the
    last is the nodes' mirror); REGISTRIES: the registry hosts whose references the nodes pull through the mirror
    (default: the origin's host)."""
    if not tiers:
        raise BadValue("--tier: give at least one pull-through cache (nearest the origin first)")
    endpoints = [parse_endpoint(u, what, scheme_required=True)
                 for u, what in [(origin, "--origin"), *((t, "--tier") for t in tiers)]]
    seen = [ep.url for ep in endpoints]
    if len(set(seen)) != len(seen):
        raise BadValue(f"--origin/--tier: a registry is named twice ({', '.join(seen)})")
    if not GO_DURATION.match(ttl):
        raise BadValue(f"--ttl {ttl!r}: a Go duration such as 168h, 30m or 0 (distribution reads it so)")
    if not storage_root.startswith("/"):
        raise BadValue(f"--storage-root {storage_root!r}: an absolute directory on the tiers' hosts")
    out = user_path(out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: not a directory")
    names = ["origin"] + [f"t{i}" for i in range(1, len(tiers) + 1)]
    built: list[Tier] = []
    for i, (name, ep) in enumerate(zip(names, endpoints)):
        built.append(Tier(name, ep.url, endpoints[i - 1].url if i else None, _listen_addr(ep),
                          f"{storage_root.rstrip('/')}/{name}", f"registry/{name}/config.yml",
                          f"curl -fsS {'--cacert CA ' if ep.scheme == 'https' else ''}{ep.url}/v2/ answers 200"))
    mirror = endpoints[-1]
    hosts = list(dict.fromkeys(registries or [endpoints[0].host]))
    for host in hosts:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9.-]*(?::\d{1,5})?$", host):
            raise BadValue(f"--mirror-for {host!r}: a registry host[:port] (docker.io for Docker Hub)")
    report = FleetConfig(out, built, mirror.url, hosts)

    def write(rel: str, text: str) -> None:
        atomic_write_text(out / rel, text, root=out)
        report.files.append(rel)

    out.mkdir(parents=True, exist_ok=True)
    for tier, ep in zip(built, endpoints):
        write(tier.config, _registry_yaml(tier, ep, ttl, len(built)))
    for host in hosts:
        server = (DOCKER_HUB_SERVER if host == "docker.io" else
                  endpoints[0].url if host == endpoints[0].host else f"https://{host}")
        write(f"containerd/certs.d/{host}/hosts.toml", _hosts_toml(server, mirror, host))
    write("containerd/config-snippet.toml", "\n".join([
        "# mm fleet config: merge into /etc/containerd/config.toml (version 2), then restart containerd once;",
        "# later changes under certs.d need no restart (containerd docs/hosts.md).",
        '[plugins."io.containerd.grpc.v1.cri".registry]',
        f'  config_path = "{CERTS_D}"  # where containerd/certs.d/ above goes (containerd docs/hosts.md)', ""]))
    insecure = [ep.host for ep in (mirror, endpoints[0]) if ep.scheme == "http"]
    daemon = {"registry-mirrors": [mirror.url], **({"insecure-registries": list(dict.fromkeys(insecure))}
                                                   if insecure else {})}
    write("docker/daemon.json", json.dumps(daemon, indent=2) + "\n")
    report.notes = [
        "docker uses registry-mirrors only for Docker Hub references (docker.io/..., e.g. the pin's lmsysorg/sglang); "
        f"a reference naming {endpoints[0].host} goes to that registry directly. Merge docker/daemon.json into "
        "/etc/docker/daemon.json and restart docker. containerd mirrors any registry that has a hosts.toml.",
        "distribution 2.8 exits at start when its upstream does not answer: start the tiers in START-ORDER.txt's "
        "order.",
        "one upstream per proxy; concurrent misses of one blob are not merged (each fetches from upstream): warm the "
        "tiers before the nodes pull (mm preheat).",
    ]
    order = ["# mm fleet config: start the registries in this order, each once the one before it answers.",
             "# distribution 2.8 in proxy mode exits at start when its upstream does not answer.", ""]
    for n, tier in enumerate(built, 1):
        role = (f"pull-through cache of {tier.upstream}" if tier.upstream else
                "the origin: mm image push / mm push write here")
        order += [f"{n}. {tier.name:<6} {tier.url}   ({role})",
                  f"   docker-registry serve {tier.config}",
                  f"   ready when: {tier.ready}", ""]
    order += [f"Nodes pull through {mirror.url}:",
              f"   containerd: copy containerd/certs.d/* to {CERTS_D}/ and set config_path (config-snippet.toml)",
              "   docker:     merge docker/daemon.json (Docker Hub references only)", "",
              *[f"Note: {note}" for note in report.notes], ""]
    write("START-ORDER.txt", "\n".join(order))
    return report
