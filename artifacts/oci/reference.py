"""A registry and an artifact as the user names them: a reference (host[:port]/repository[:tag][@sha256:...]) and
a registry's own address (HOST[:PORT] or the root of an http(s):// URL). The grammar alone, below the client: the
image and fleet code read references without the HTTP stack."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import BadInput, BadValue
from ..edges.untrusted import shown

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
HOST = re.compile(r"^(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?$")


# --- references ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    """host[:port]/repository[:tag][@sha256:...]; the host is always explicit (no Docker Hub default)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def at(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, None, digest)

    @property
    def lookup(self) -> str:
        """What the manifest endpoint takes: the digest when there is one, else the tag."""
        return self.digest or self.tag or ""


def parse_reference(text: str) -> Reference:
    text = text.strip()
    where = f"{text or repr(text)}"
    if "/" not in text or "://" in text:
        raise BadInput(f"{shown(where)}: not a registry reference (expected host[:port]/repository[:tag|@sha256:...])")
    host, rest = text.split("/", 1)
    if "@" in host:  # user:password@host: the credentials are never echoed, and never taken from here
        raise BadInput(f"***@{shown(host.rsplit('@', 1)[1], 80)}/...: a registry reference holds no credentials; "
                       f"give --username with --password-stdin, or an entry in ~/.docker/config.json / REGISTRY_AUTH_FILE")
    if not HOST.match(host):
        raise BadInput(f"{where}: {host!r} is not a registry host[:port]")
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not DIGEST.match(digest):
            raise BadInput(f"{where}: digest must be sha256:<64 hex>")
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not TAG.match(tag):
            raise BadInput(f"{where}: {tag!r} is not a valid tag")
    if not REPOSITORY.match(rest):
        raise BadInput(f"{where}: {rest!r} is not a valid repository name (lowercase, digits, '.', '_', '-', '/')")
    return Reference(host, rest, tag, digest)


@dataclass(frozen=True)
class Endpoint:
    """A registry as the user names it (`--mirror`, `--tier`, `--origin`): its host, and the scheme if given."""

    scheme: str | None  # http | https; None: named as HOST[:PORT] (the transport decides)
    host: str  # host[:port], lower case, as a reference names it
    port: int | None  # the URL's own default (80, 443) when a scheme is given without one

    @property
    def url(self) -> str:  # of an endpoint named with its scheme
        return f"{self.scheme}://{self.host}"

    @property
    def hostname(self) -> str:
        return urlsplit(f"//{self.host}").hostname or ""


def parse_endpoint(text: str, what: str, *, scheme_required: bool = False) -> Endpoint:
    """HOST[:PORT], or the root of an http(s):// URL (SCHEME_REQUIRED: only that): a registry is the root of a host
    (distribution's mirror recipe: "no path components other than an optional trailing slash") and its address
    never carries credentials (they live in ~/.docker/config.json or REGISTRY_AUTH_FILE). A malformed value is
    BadValue, as any other malformed option value."""
    named = shown(text, 80)
    form = "http://HOST[:PORT] or https://HOST[:PORT]" if scheme_required else "HOST[:PORT] or an http(s):// URL"
    raw = text.strip()
    scheme, sep, rest = raw.partition("://")
    scheme, rest = (scheme.lower(), rest) if sep else (None, raw)
    if scheme not in (None, "http", "https") or scheme_required and scheme is None:
        raise BadValue(f"{what} {named!r}: expected {form}")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        raise BadValue(f"{what} ***@{shown(authority.rsplit('@', 1)[1], 80)}: holds credentials; give them in "
                       f"~/.docker/config.json or REGISTRY_AUTH_FILE, never in an address")
    if rest[len(authority):].strip("/"):
        raise BadValue(f"{what} {named!r}: a registry is the root of its host: no path, query or fragment")
    if not HOST.match(authority):
        raise BadValue(f"{what} {named!r}: expected {form}")
    try:
        port = urlsplit(f"//{authority}").port
    except ValueError:
        raise BadValue(f"{what} {named!r}: bad port") from None
    if port is None and scheme:
        port = 443 if scheme == "https" else 80
    return Endpoint(scheme, authority.lower(), port)


def is_loopback(registry: str) -> bool:
    host = urlsplit(f"//{registry}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
