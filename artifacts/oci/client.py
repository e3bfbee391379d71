"""A small OCI distribution-spec client: httpx2 (the HTTP stack huggingface_hub already brings) for the API, the
standard library's http.client for blob bodies (uploads with sendfile, downloads read into mm's own buffer).

What mm needs and oras-py lacks (docs/registry.md, "Why not oras-py"): blobs stream from and to disk (never whole in
memory), chunked uploads (PATCH + Content-Range) that resume from the offset the registry reports, cross-
repository mounts, ranged blob GETs, and auth that follows the registry's `WWW-Authenticate` challenge
(anonymous, Basic, Bearer token). Credentials live only in memory: never in a message, a log line, a URL or a
file mm writes.
"""
from __future__ import annotations

import base64
import hashlib
import http.client
import os
import re
import ssl
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TextIO
from urllib.parse import urlencode, urlsplit

import httpx2

from ..edges import interrupt, wire
from ..errors import BadInput, BadValue, IntegrityError, RemoteError, RetryLater
from .reference import DIGEST, Reference, is_loopback, parse_endpoint
from ..edges.untrusted import load_json, shown
from ..edges.fsutil import read_json_file

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST))
MAX_AUTH_FILE = 4 * 1024 * 1024  # a docker/podman auth file
MAX_TOKEN_ANSWER = 1024 * 1024  # a token service's answer (JWTs run to a few KiB)
TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token
MAX_MANIFEST = 4 * 1024 * 1024  # what distribution accepts for a manifest; a larger answer is not a manifest
SENDFILE_SLICE = 8 * 1024 * 1024  # progress is reported after each slice
PROBE_WINDOW = 4096  # SO_RCVBUF of a blob_in_store question (the kernel doubles it): room for an answer's status
# line and headers (distribution's are under 1 KiB), and little of a body (mm's own margin)


# --- mirrors and tiers ---------------------------------------------------------------------------

def mirror_transport(text: str, what: str, transport: "Transport") -> tuple[str, "Transport"]:
    """A mirror or tier (parse_endpoint) and the transport for it: http: plain HTTP to that host whatever
    TRANSPORT says; https: TLS even on loopback, which needs --ca-file."""
    endpoint = parse_endpoint(text, what)
    if endpoint.scheme == "http":
        return endpoint.host, Transport(plain_http=True, timeout=transport.timeout)
    if endpoint.scheme == "https" and not transport.ca_file and is_loopback(endpoint.host):
        raise BadValue(f"{what} {shown(text, 80)!r}: HTTPS on loopback needs --ca-file")
    return endpoint.host, transport


# --- credentials -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    origin: str = "--username"  # where they came from, for messages (never the values)

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()

    @classmethod
    def from_cli(cls, username: str | None, password_stdin: bool, stdin: TextIO) -> Credentials | None:
        """--username with --password-stdin, checked once: the password (or a token) is the first line of STDIN,
        never an argument. None when neither is given (load_credentials: the auth file, else anonymous)."""
        if not password_stdin:
            if username:
                raise BadValue("--username and --password-stdin go together")
            return None
        if not username:
            raise BadValue("--password-stdin needs --username")
        password = stdin.readline().rstrip("\r\n")
        if not password:
            raise BadValue("--password-stdin: nothing on standard input")
        return cls(username, password, "--username/--password-stdin")


def auth_files() -> list[Path]:
    """REGISTRY_AUTH_FILE when set (containers' auth.json), else $DOCKER_CONFIG/config.json or ~/.docker/config.json."""
    if os.environ.get("REGISTRY_AUTH_FILE"):
        return [Path(os.environ["REGISTRY_AUTH_FILE"])]
    docker_dir = Path(os.environ["DOCKER_CONFIG"]) if os.environ.get("DOCKER_CONFIG") else Path.home() / ".docker"
    return [docker_dir / "config.json"]


def load_credentials(registry: str, given: Credentials | None = None) -> Credentials | None:
    """GIVEN (Credentials.from_cli), else the registry's entry in the auth file, else None (anonymous)."""
    if given is not None:
        return given
    for path in auth_files():
        if not path.exists():
            continue
        # the loader's message names the file and the fault, never a value from it (the file holds secrets)
        doc = read_json_file(path, what="registry auth file", max_bytes=MAX_AUTH_FILE)
        auths = doc.get("auths") if isinstance(doc, dict) else None
        if not isinstance(auths, dict):
            continue
        for key, entry in auths.items():
            if _auth_key_host(str(key)) != registry or not isinstance(entry, dict):
                continue
            if isinstance(entry.get("auth"), str) and entry["auth"]:
                try:
                    user, _, secret = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    raise BadInput(f"{path}: the entry for {registry} has an auth field that is not base64 user:password") from None
                return Credentials(user, secret, str(path))
            if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
                return Credentials(entry["username"], entry["password"], str(path))
    return None


def _auth_key_host(key: str) -> str:
    """Docker config keys are 'host:port', 'https://host:port' or 'https://host/v1/'."""
    if "://" in key:
        key = urlsplit(key).netloc
    return key.split("/", 1)[0]


# --- the client ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Transport:
    plain_http: bool = False
    ca_file: Path | None = None
    timeout: float | None = None  # a connect or one read; None: MM_NET_TIMEOUT (artifacts/edges/wire.py)


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, params = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', params)}


def _registry_error(resp: httpx2.Response) -> str:
    """The registry's own error code and message (distribution's JSON errors), one short line. The body is read
    within its cap (wire.CAP_ERROR) and deadline; a larger one ends as a RemoteError of its own."""
    try:
        body = resp.read()
    except httpx2.HTTPError:
        body = b""
    return _error_text(resp.status_code, body)


def _cap(cap: int, what: str) -> dict:
    """Request extensions naming the byte cap and document kind of the answer (see Client._cap_for)."""
    return {"mm_cap": (cap, what)}


def _error_text(status: int, body: bytes) -> str:
    try:
        first = (load_json(body, "registry error").get("errors") or [])[0]
        text = f"{first.get('code', '')}: {first.get('message', '')}".strip(": ")
    except (BadInput, ValueError, AttributeError, IndexError, TypeError):
        text = ""
    return f"HTTP {status}" + (f" {text[:200]}" if text else "")


class Client:
    """One registry, one repository. Thread-safe: workers share it (and its connection pool and token)."""

    def __init__(self, ref: Reference, credentials: Credentials | None = None, transport: Transport = Transport(),
                 push: bool = False, mount_from: str | None = None):
        # HTTPS unless told otherwise or on loopback; a CA file means HTTPS, loopback included
        scheme = "https" if transport.ca_file or not (transport.plain_http or is_loopback(ref.registry)) else "http"
        self.ref = ref
        self.base = f"{scheme}://{ref.registry}"
        self.credentials = credentials
        actions = "pull,push" if push else "pull"
        self.scopes = [f"repository:{ref.repository}:{actions}"]
        if mount_from and mount_from != ref.repository:
            self.scopes.append(f"repository:{mount_from}:pull")
        verify: ssl.SSLContext | bool = True
        self._ssl: ssl.SSLContext | None = None
        self._timeout = transport.timeout or wire.limits().timeout
        if scheme == "https":
            try:
                verify = ssl.create_default_context(cafile=str(transport.ca_file) if transport.ca_file else None)
            except (OSError, ssl.SSLError) as e:
                raise BadInput(f"{transport.ca_file}: cannot load CA certificates ({type(e).__name__})") from None
            self._ssl = verify
        self._http = wire.http_client(self._cap_for, f"registry {ref.registry}", verify=verify, follow_redirects=False,
                                      trust_env=False, timeout=httpx2.Timeout(self._timeout),
                                      limits=httpx2.Limits(max_connections=64, max_keepalive_connections=32),
                                      headers={"User-Agent": "mm (model-artifact manager)"})
        self._auth_header: str | None = None
        self._lock = threading.Lock()
        self._authed = False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def url(self, path: str) -> str:
        """PATH (an API path, or an upload Location the registry sent) as a URL on the registry, checked."""
        return wire.join_url(self.base + "/", path, f"registry {self.ref.registry}", "sent the location")

    @staticmethod
    def _cap_for(request: httpx2.Request, response: httpx2.Response) -> tuple[int, str]:
        """The byte cap of a successful answer: what the request named (_cap), else a small API answer."""
        return request.extensions.get("mm_cap") or (wire.CAP_ERROR, "an API answer")

    # -- auth ---------------------------------------------------------------------------------------
    def _where(self) -> str:
        return self.ref.registry

    def _login(self, challenge: str) -> None:
        """Answer a 401's WWW-Authenticate: Basic with the credentials, or fetch a Bearer token."""
        scheme, params = _challenge(challenge)
        if scheme == "basic":
            if self.credentials is None:
                raise RemoteError(f"{self._where()}: the registry wants a login (give --username and --password-stdin, "
                                  f"or add it to ~/.docker/config.json / REGISTRY_AUTH_FILE)")
            self._auth_header = self.credentials.basic()
            return
        if scheme != "bearer" or "realm" not in params:
            raise RemoteError(f"{self._where()}: unsupported authentication scheme {shown(scheme, 40)!r}")
        realm = wire.check_url(params["realm"], f"{self._where()}: the WWW-Authenticate challenge",
                               "names as its token service")
        query = [("service", params["service"])] if params.get("service") else []
        query += [("scope", s) for s in self.scopes]  # one scope parameter each, as distribution's token servers read them
        url = realm + ("&" if "?" in realm else "?") + urlencode(query)
        headers = {"Authorization": self.credentials.basic()} if self.credentials else {}
        try:
            resp = self._http.send(self._http.build_request("GET", url, headers=headers,
                                                            extensions=_cap(MAX_TOKEN_ANSWER, "a token answer")))
        except (httpx2.HTTPError, httpx2.InvalidURL) as e:
            raise RemoteError(f"{self._where()}: cannot reach the token service at {wire.origin(url)} "
                              f"({type(e).__name__})") from None
        if resp.status_code in (401, 403):
            raise RemoteError(f"{self._where()}: the token service refused "
                              f"{'the credentials from ' + self.credentials.origin if self.credentials else 'anonymous access'} "
                              f"(HTTP {resp.status_code})")
        if resp.status_code != 200:
            raise RemoteError(f"{self._where()}: token service answered HTTP {resp.status_code}")
        try:
            doc = load_json(resp.content, f"{self._where()} token service", max_bytes=MAX_TOKEN_ANSWER)
            token = doc.get("token") or doc.get("access_token")
        except (BadInput, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RemoteError(f"{self._where()}: token service gave no token")
        if len(token) > MAX_TOKEN_ANSWER or not TOKEN.fullmatch(token):  # it goes into a header line as it is
            raise RemoteError(f"{self._where()}: token service gave a token that is not a bearer token "
                              f"(characters outside RFC 6750's token68)")
        self._auth_header = f"Bearer {token}"

    def _refused(self, resp: httpx2.Response) -> RemoteError:
        if self.credentials is not None:
            return RemoteError(f"{self._where()}: the registry refused the credentials from {self.credentials.origin} "
                               f"({_registry_error(resp)})")
        return RemoteError(f"{self._where()}: the registry wants a login ({_registry_error(resp)}); give --username and "
                           f"--password-stdin, or add it to ~/.docker/config.json / REGISTRY_AUTH_FILE")

    def ping(self) -> None:
        """GET /v2/ once, to learn the auth scheme before any request with a body."""
        with self._lock:
            if self._authed:
                return
            resp = self._send("GET", "/v2/", auth=False, cap=(wire.CAP_PING, "its /v2/ answer"))
            if resp.status_code == 401:
                self._login(resp.headers.get("WWW-Authenticate", ""))
            elif resp.status_code not in (200, 404):
                raise RemoteError(f"{self._where()}: not an OCI registry ({_registry_error(resp)})")
            self._authed = True

    # -- requests -----------------------------------------------------------------------------------
    def _send(self, method: str, url: str, *, headers: dict | None = None, content=None, auth: bool = True,
              stream: bool = False, cap: tuple[int, str] | None = None) -> httpx2.Response:
        """One request; the answer is read within CAP (bytes, document kind; default a small API answer) and the
        deadline (wire.http_client)."""
        hdrs = dict(headers or {})
        target = self.url(url)
        # credentials go to the registry only, never to another host an upload URL (Location) may name
        if auth and self._auth_header and urlsplit(target).netloc == urlsplit(self.base).netloc:
            hdrs["Authorization"] = self._auth_header
        request = self._http.build_request(method, target, headers=hdrs, content=content,
                                           extensions=_cap(*cap) if cap else {})
        try:
            return self._http.send(request, stream=stream)
        except httpx2.TimeoutException as e:
            raise RemoteError(f"{self._where()}: the registry at {self.base} did not answer within MM_NET_TIMEOUT "
                              f"({self._timeout:g} s): {type(e).__name__}") from None
        except (httpx2.HTTPError, httpx2.InvalidURL) as e:
            raise RemoteError(f"{self._where()}: cannot reach the registry at {self.base} "
                              f"({type(e).__name__}{': ' + _short(e) if _short(e) else ''})") from None

    def request(self, method: str, url: str, *, headers: dict | None = None,
                body: Callable[[], object] | None = None, stream: bool = False,
                cap: tuple[int, str] | None = None) -> httpx2.Response:
        """Send; on a 401 (token expired, or a scope not yet granted) log in again once and resend.
        BODY is a factory, so a streamed body can be produced again for the retry."""
        self.ping()
        resp = self._send(method, url, headers=headers, content=body() if body else None, stream=stream, cap=cap)
        if resp.status_code == 401:
            resp.close()
            with self._lock:
                self._login(resp.headers.get("WWW-Authenticate", ""))
            resp = self._send(method, url, headers=headers, content=body() if body else None, stream=stream, cap=cap)
            if resp.status_code == 401:
                resp.read()
                raise self._refused(resp)
        if resp.status_code == 403:
            resp.read()
            raise RemoteError(f"{self._where()}: access to {self.ref.repository} denied ({_registry_error(resp)})")
        return resp

    # -- manifests ----------------------------------------------------------------------------------
    def get_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        """(bytes, media type, sha256 digest) of REF's manifest; the digest is computed here, and must match what
        was asked for (a digest reference) and what the registry says (Docker-Content-Digest)."""
        resp = self.request("GET", f"/v2/{ref.repository}/manifests/{ref.lookup}", headers={"Accept": MANIFEST_ACCEPT},
                            stream=True, cap=(MAX_MANIFEST, "a manifest"))
        try:
            if resp.status_code == 404:
                raise RemoteError(f"{ref}: not found in the registry")
            if resp.status_code != 200:
                raise RemoteError(f"{ref}: manifest request failed ({_registry_error(resp)})")
            data = resp.read()  # within MAX_MANIFEST and the deadline
        finally:
            resp.close()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if ref.digest and digest != ref.digest:
            raise IntegrityError(f"{ref}: the registry served a manifest whose sha256 is {digest}, not the digest asked for")
        said = resp.headers.get("Docker-Content-Digest")
        if said and DIGEST.match(said) and said != digest:
            raise IntegrityError(f"{ref}: manifest bytes hash to {digest} but the registry says {said}")
        return bytes(data), resp.headers.get("Content-Type", "").split(";")[0].strip(), digest

    def put_manifest(self, tag_or_digest: str, data: bytes, media_type: str) -> str:
        resp = self.request("PUT", f"/v2/{self.ref.repository}/manifests/{tag_or_digest}",
                            headers={"Content-Type": media_type}, body=lambda: data)
        resp.read()
        if resp.status_code not in (200, 201):
            raise RemoteError(f"{self.ref.name}:{tag_or_digest}: manifest upload refused ({_registry_error(resp)})")
        return "sha256:" + hashlib.sha256(data).hexdigest()

    # -- blobs --------------------------------------------------------------------------------------
    def blob_size(self, digest: str) -> int | None:
        """HEAD the blob: its size when the repository has it, None when it does not."""
        resp = self.request("HEAD", f"/v2/{self.ref.repository}/blobs/{digest}")
        resp.read()
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RemoteError(f"{self.ref.name}@{digest}: blob check failed ({_registry_error(resp)})")
        try:
            return int(resp.headers.get("Content-Length", "-1"))
        except ValueError:
            return -1

    @contextmanager
    def open_blob(self, digest: str, offset: int = 0, end: int | None = None) -> Iterator["wire.RawAnswer"]:
        """GET bytes [OFFSET, END) of the blob (Range; END None: to its end) on a plain http.client connection
        (wire.open_raw: headers within the deadline, a body read straight into the caller's buffer). The bulk path:
        httpx hands out 64 KiB pieces and copies each. Follows a redirect to blob storage (S3 and the like), checked
        to be an http(s) URL, without the registry's Authorization. Yields a 200 or 206 answer; the caller proves
        its offsets (ranges.prove). 429, 408 and 5xx raise RetryLater; other refusals RemoteError."""
        rng = {"Range": f"bytes={offset}-{'' if end is None else end - 1}"} if offset or end is not None else {}
        raw, url = self._get_blob(digest, rng, follow=True)
        where = f"{self.ref.name}@{digest}"
        try:
            status = raw.status
            if status == 401:
                raise RemoteError(f"{self._where()}: the registry refused the credentials"
                                  + (f" from {self.credentials.origin}" if self.credentials else " (anonymous)"))
            if status == 404:
                raise RemoteError(f"{where}: blob not found in the registry")
            if status == 416:
                raise RemoteError(f"{where}: registry refused the range from byte {offset}")
            if status in (408, 429) or status >= 500:
                raise RetryLater(f"{where}: {wire.origin(url)} answered HTTP {status}", str(status))
            if status not in (200, 206):
                raise RemoteError(f"{where}: blob download failed (HTTP {status})")
            yield raw
        finally:
            raw.close()

    def _get_blob(self, digest: str, extra: dict[str, str], follow: bool,
                  **raw_options) -> "tuple[wire.RawAnswer, str]":
        """The answer to a GET of the blob with the EXTRA headers, after one login on a 401 and, when FOLLOW, the
        redirects to blob storage (checked, without the registry's Authorization); and the URL that gave it.
        RAW_OPTIONS go to wire.open_raw. A connection that fails or headers too slow: RetryLater."""
        self.ping()
        url = self.url(f"/v2/{self.ref.repository}/blobs/{digest}")
        base = urlsplit(url).netloc
        where = f"{self.ref.name}@{digest}"
        relogged = False
        for _ in range(wire.MAX_REDIRECTS + 1):
            headers = {"User-Agent": "mm (model-artifact manager)", "Accept-Encoding": "identity", **extra}
            on_registry = urlsplit(url).netloc == base
            if self._auth_header and on_registry:
                headers["Authorization"] = self._auth_header
            peer = f"registry {self.ref.registry}" if on_registry else f"blob storage at {wire.origin(url)}"
            try:
                raw = wire.open_raw(url, headers, peer, ssl_context=self._ssl, **raw_options)
            except wire.TooSlow as e:
                raise RetryLater(f"{where}: {e.message}", "slow-headers") from None
            except (OSError, http.client.HTTPException) as e:
                raise RetryLater(f"{where}: cannot reach {wire.origin(url)} ({type(e).__name__})", "connect") from None
            if raw.status == 401 and not relogged and on_registry:
                challenge = raw.header("WWW-Authenticate") or ""
                raw.close()
                with self._lock:
                    self._login(challenge)
                relogged = True
                continue
            location = raw.header("Location")
            if follow and raw.status in wire.REDIRECT_STATUSES and location:
                raw.close()
                url = wire.join_url(url, location, f"{where}: {peer}")
                continue
            return raw, url
        raise RemoteError(f"{where}: more than {wire.MAX_REDIRECTS} redirects; refused")

    def blob_in_store(self, digest: str, within: float) -> str | None:
        """Whether the registry now serves DIGEST from its own storage, asked for (nearly) no blob bytes: None when
        it does, else what it answered instead. Within WITHIN seconds (connection and headers).

        The question is a GET carrying `If-None-Match: "DIGEST"` and `Range: bytes=0-0`. Distribution serves a
        stored blob through registry/storage/blobserver.go: a quoted ETag, Cache-Control, and Go's
        http.ServeContent, which answers that request with 304 and no body (206 and one byte where the tag is not
        honoured; a 307 to blob storage when the driver redirects). A pull-through cache that has not stored it yet
        (registry/proxy/proxyblobstore.go, copyContent) answers 200 with the whole blob as it comes from its
        upstream, an unquoted Etag and no Cache-Control, headers sent with the first piece: that answer is closed
        at its headers, on a socket whose receive window is PROBE_WINDOW bytes, so that little of the body reaches
        mm. The cache's copy stops at its next write; by then its upstream has filled the buffers between them
        (megabytes on loopback), which no client can prevent: a look is free only once the blob is stored. Not a
        HEAD: Go's server reads a HEAD's body to its end and drops it, so on a proxy a HEAD moves the whole blob
        from upstream."""
        extra = {"If-None-Match": f'"{digest}"', "Range": "bytes=0-0"}
        raw, _ = self._get_blob(digest, extra, follow=False, answer_timeout=within, receive_buffer=PROBE_WINDOW)
        try:
            status = raw.status
            if status in (206, 304) or status in wire.REDIRECT_STATUSES and raw.header("Location"):
                if status == 206:
                    raw.discard(1)
                return None
            etag = (raw.header("ETag") or "").strip()
            if status == 200 and etag == f'"{digest}"':  # from storage, though it honours neither header
                return None
            how = ("from its upstream (200, " + ("no ETag" if not etag else f"ETag {shown(etag, 80)}") + ")"
                   if status == 200 else f"HTTP {status}")
            return f"it answered {how}"
        finally:
            raw.close()

    def _connection(self, parts) -> "http.client.HTTPConnection":
        """A new http.client connection for an upload body (one per transfer; the API calls pool theirs in httpx)."""
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self._timeout,
                                               context=self._ssl or ssl.create_default_context())
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self._timeout)

    def read_blob(self, digest: str, limit: int) -> bytes:
        """A small blob (config, mm manifest) in memory, refused above LIMIT bytes or past the deadline, checked
        against DIGEST."""
        try:
            with self.open_blob(digest) as raw:
                if raw.status != 200:
                    raise RemoteError(f"{self.ref.name}@{digest}: the registry answered {raw.status} to a request for "
                                      f"the whole blob")
                try:
                    data = raw.read_capped(limit, "a small blob (config or manifest)")
                except (OSError, http.client.HTTPException) as e:
                    raise RemoteError(f"{self.ref.name}@{digest}: download cut ({type(e).__name__})") from None
        except RetryLater as e:
            raise RemoteError(e.message) from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise IntegrityError(f"{self.ref.name}@{digest}: blob bytes do not match their digest; refused")
        return data

    # -- uploads ------------------------------------------------------------------------------------
    def mount(self, digest: str, from_repo: str) -> str | None:
        """Ask for a cross-repository mount: None when mounted (201), else the upload URL the registry opened."""
        query = urlencode({"mount": digest, "from": from_repo})
        resp = self.request("POST", f"/v2/{self.ref.repository}/blobs/uploads/?{query}")
        resp.read()
        if resp.status_code == 201:
            return None
        if resp.status_code == 202 and resp.headers.get("Location"):
            return resp.headers["Location"]
        raise RemoteError(f"{self.ref.name}: mount of {digest} from {from_repo} failed ({_registry_error(resp)})")

    def start_upload(self) -> str:
        resp = self.request("POST", f"/v2/{self.ref.repository}/blobs/uploads/")
        resp.read()
        if resp.status_code != 202 or not resp.headers.get("Location"):
            raise RemoteError(f"{self.ref.name}: upload refused ({_registry_error(resp)})")
        return resp.headers["Location"]

    def upload_offset(self, location: str) -> tuple[int, str] | None:
        """GET an upload's status: (bytes the registry holds, its URL), or None when the upload is gone."""
        resp = self.request("GET", location)
        resp.read()
        if resp.status_code != 204:
            return None
        m = re.match(r"^(?:bytes=)?0-(\d+)$", resp.headers.get("Range", "").strip())
        offset = int(m.group(1)) + 1 if m else 0
        if resp.headers.get("Range", "").strip() in ("0-0", "bytes=0-0"):
            offset = 0  # distribution says 0-0 for an empty upload too
        return offset, resp.headers.get("Location") or location

    def send_file(self, method: str, url: str, headers: dict, path: Path, start: int, length: int,
                  on_bytes: Callable[[int], None] | None = None) -> tuple[int, dict[str, str], bytes]:
        """METHOD with LENGTH bytes of PATH from START as the body, sent with sendfile (the kernel copies the file
        to the socket: no pass through Python, no buffer) on a plain http.client connection. Returns (status,
        headers, body). A 401 (token expired) logs in again and sends once more."""
        self.ping()
        target = self.url(url)
        parts = urlsplit(target)
        for attempt in (1, 2):
            hdrs = {"User-Agent": "mm (model-artifact manager)", "Content-Length": str(length), **headers}
            if self._auth_header and parts.netloc == urlsplit(self.base).netloc:
                hdrs["Authorization"] = self._auth_header
            conn = self._connection(parts)
            try:
                conn.putrequest(method, parts.path + (f"?{parts.query}" if parts.query else ""), skip_accept_encoding=True)
                for k, v in hdrs.items():
                    conn.putheader(k, v)
                conn.endheaders()
                with open(path, "rb") as f:
                    pos, left = start, length
                    while left:
                        # stopped mid-chunk: the rerun starts this blob again (docs/registry.md, "Resume of a push")
                        interrupt.check()
                        n = conn.sock.sendfile(f, pos, min(left, SENDFILE_SLICE))
                        if not n:
                            raise BadInput(f"{path}: file shrank while it was being pushed")
                        pos += n
                        left -= n
                        if on_bytes is not None:
                            on_bytes(n)
                with wire.watchdog(conn, wire.limits().deadline, f"registry {self.ref.registry}",
                                   "answer the upload"):
                    resp = conn.getresponse()
                    answer = wire.RawAnswer(conn, resp, f"registry {self.ref.registry}")
                    body = answer.read_capped(wire.CAP_ERROR, "its answer to an upload")
                status, rheaders = resp.status, {k.lower(): v for k, v in resp.getheaders()}
            except (OSError, http.client.HTTPException) as e:
                raise RemoteError(f"{self._where()}: upload to {parts.scheme}://{parts.netloc} cut "
                                  f"({type(e).__name__}); run again to resume") from None
            finally:
                conn.close()
            if status == 401 and attempt == 1:
                with self._lock:
                    self._login(rheaders.get("www-authenticate", ""))
                continue
            if status == 401:
                raise RemoteError(f"{self._where()}: the registry refused the credentials"
                                  + (f" from {self.credentials.origin}" if self.credentials else " (anonymous)"))
            return status, rheaders, body
        raise AssertionError("unreachable")

    def patch(self, location: str, path: Path, start: int, length: int,
              on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
        """Send LENGTH bytes of PATH from START as one chunk; returns (registry's new offset, next URL)."""
        headers = {"Content-Type": "application/octet-stream", "Content-Range": f"{start}-{start + length - 1}"}
        status, rheaders, body = self.send_file("PATCH", location, headers, path, start, length, on_bytes)
        if status != 202:
            raise RemoteError(f"{self.ref.name}: chunk upload at byte {start} refused ({_error_text(status, body)})")
        m = re.match(r"^(?:bytes=)?0-(\d+)$", rheaders.get("range", "").strip())
        return (int(m.group(1)) + 1 if m else start + length), rheaders.get("location") or location

    def finish_upload(self, location: str, digest: str, data: bytes = b"", path: Path | None = None, length: int = 0,
                      on_bytes: Callable[[int], None] | None = None) -> None:
        """PUT the upload closed with its digest; the body is DATA, or LENGTH bytes of PATH (a whole small file)."""
        sep = "&" if "?" in location else "?"
        url = f"{location}{sep}{urlencode({'digest': digest})}"
        headers = {"Content-Type": "application/octet-stream"}
        if path is not None:
            status, _, body = self.send_file("PUT", url, headers, path, 0, length, on_bytes)
        else:
            resp = self.request("PUT", url, headers={**headers, "Content-Length": str(len(data))},
                                body=(lambda: data) if data else None)
            status, body = resp.status_code, resp.read()
        if status not in (201, 204):
            raise RemoteError(f"{self.ref.name}: upload of {digest} not accepted ({_error_text(status, body)})")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
