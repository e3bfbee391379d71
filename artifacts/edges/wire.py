"""The network edge: every answer mm reads is bounded in bytes and in time, every URL a server names is checked.

Two ways bytes come in, both bounded here:

- Documents (Hub API answers read by huggingface_hub, the registry's ping, token, manifests, error bodies,
  redirects): httpx2 clients made by ``http_client`` (and installed as huggingface_hub's session factory by
  ``use_for_hub``). A response hook checks what the headers promise (no Content-Encoding: mm asks for identity,
  so no decompression bomb; a Content-Length within the cap; a redirect to an http(s) URL) and wraps the body
  in a stream that refuses the byte past the document kind's cap (``cap_for``). Every socket read of such a
  client waits at most until the answer's deadline (``MM_NET_DEADLINE`` after the request went out, headers
  included: a server trickling its headers is cut too).
- Bulk bodies (a file's bytes, the ranged engine's): ``open_raw`` on the standard library's http.client, so
  the engine reads straight into its own buffers (``RawAnswer.readinto``: one socket read, what arrived).
  The status line and headers must arrive within the deadline; each read waits at most ``MM_NET_TIMEOUT``;
  the engine's minimum-rate rule (artifacts/fetching/ranges.py) bounds a trickle.
- Clients on ``requests`` (the ModelScope SDK's): ``bound_session`` mounts on the client's sessions a copy of
  each of their adapters that applies the same rules to every answer (documents capped and under the deadline;
  bulk bodies, which the caller names, under the header deadline only), whatever the SDK does with it.
An interrupt (artifacts/edges/interrupt.py) shuts down the socket of every answer being read (``open_raw``'s and the
bounded sessions'), so a worker blocked on a silent server sees the stop at once, not after MM_NET_TIMEOUT.

Bounds (docs/hostile-input.md, "Network bounds"), all mm's own margins, none an upstream default:
  MM_NET_TIMEOUT      30 s   a connection attempt, or one read, waits at most this long
  MM_NET_DEADLINE     120 s  a whole document, or the status line and headers of any answer
  MM_NET_MIN_RATE     1024   bytes/s a download connection must average over...
  MM_NET_RATE_WINDOW  60 s   ...each window of this length, else it is cut and retried on a fresh one
  MM_NET_BACKOFF      0.25 s the wait before a failed range is asked again, doubling per failure up to 30 s
Values are read when a request starts, so tests can use short ones.
"""
from __future__ import annotations

import heapq
import http.client
import io
import itertools
import os
import socket
import ssl
import stat
import struct
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator
from urllib.parse import urlsplit

import httpcore2
import httpx2

from . import interrupt
from ..errors import BadInput, RemoteError
from ..units import human_bytes
from .fsutil import file_kind
from .untrusted import env_number, shown

KiB, MiB = 1 << 10, 1 << 20
MAX_REDIRECTS = 5  # a Hub resolve goes through one (CDN or Xet bridge); 5 is mm's margin
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
LOWAT_MAX = 1 * MiB  # a body read on a plain socket waits for up to this many bytes (SO_RCVLOWAT)...
LOWAT_SECONDS = 0.05  # ...or for what the connection brings in this long at its rate so far, whichever is less
LOWAT_MIN = 64 * KiB  # below this, reads take what arrived

# Byte caps per document kind (mm's margins over what honest servers send)
CAP_ERROR = 64 * KiB  # an error answer: one JSON error or an HTML page
CAP_REDIRECT = 64 * KiB  # a redirect's body (never needed)
CAP_HUB_API = 4 * MiB  # one Hub API answer: a 1000-entry tree page with LFS and Xet fields is about 350 KB
CAP_PING = 64 * KiB  # a registry's /v2/ answer is `{}`
CAP_MIRROR_API = 4 * MiB  # one ModelScope API answer: a repo/files listing holds at most 3000 entries (the server
# truncates there; the SDK then lists directory by directory) of about 400 bytes: about 1.2 MB
MAX_CONTAINERS = 250_000  # '[' and '{' in one document: parsed, each costs 56-200 bytes; an honest 4 MiB Hub answer
# (model info listing 40,000 files) holds about 80,000. Within 4 MiB, a million empty lists would cost 100 MB.


@dataclass(frozen=True)
class Limits:
    timeout: float = 30.0
    deadline: float = 120.0
    min_rate: float = 1024.0
    rate_window: float = 60.0
    backoff: float = 0.25


_ENV = {"MM_NET_TIMEOUT": "timeout", "MM_NET_DEADLINE": "deadline", "MM_NET_MIN_RATE": "min_rate",
        "MM_NET_RATE_WINDOW": "rate_window", "MM_NET_BACKOFF": "backoff"}


def limits() -> Limits:
    """The bounds in force: Limits' defaults, each replaced by its MM_NET_* variable when set."""

    given = {name: env_number(var, "bytes/s" if var == "MM_NET_MIN_RATE" else "seconds") for var, name in _ENV.items()}
    return Limits(**{name: value for name, value in given.items() if value is not None})


def origin(url: str) -> str:
    """scheme://host:port of URL, to name in a message: never a path, query (signatures) or credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        return f"{parts.scheme}://{parts.hostname or ''}:{port}"
    except ValueError:
        return shown(url)


def check_url(url: str, where: str, what: str) -> str:
    """URL if it is an absolute http(s) URL mm can ask; else RemoteError naming WHERE and what it sent."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c in url for c in "\r\n\0 ")
    except ValueError:
        ok = False
    if not ok:
        raise RemoteError(f"{where} {what} {shown(url)!r}, which is not an http(s) URL mm can follow; refused")
    return url


def join_url(base: str, location: str, where: str, what: str = "redirected to") -> str:
    from urllib.parse import urljoin

    try:
        target = urljoin(base, location)
    except ValueError:
        target = location
    return check_url(target, where, what)


# --- documents: httpx2 clients with a byte cap per answer and a deadline --------------------------------

class _Deadline(threading.local):
    at: float | None = None


_deadline = _Deadline()


class _Requests(threading.local):
    left: int | None = None
    what: str = ""


_requests = _Requests()


@contextmanager
def request_budget(n: int, what: str) -> Iterator[None]:
    """At most N requests (redirects and pages included) from this thread inside: a server paging or redirecting
    forever ends as a RemoteError naming WHAT (e.g. "the file listing")."""
    saved = (_requests.left, _requests.what)
    _requests.left, _requests.what = n, what
    try:
        yield
    finally:
        _requests.left, _requests.what = saved


class TooSlow(RemoteError):
    """An answer that did not arrive within its deadline."""


def _remaining(timeout: float | None, where: str) -> float | None:
    at = _deadline.at
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise TooSlow(f"{where} did not finish its answer within MM_NET_DEADLINE ({limits().deadline:g} s); cut")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream:
    """A network stream whose every read waits at most until the thread's answer deadline."""

    def __init__(self, stream, where: str):
        self._stream, self._where = stream, where

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        left = _remaining(timeout, self._where)
        try:
            return self._stream.read(max_bytes, left)
        except httpcore2.ReadTimeout:
            if timeout is None or left is not None and left < timeout:  # the deadline, not one slow read
                _remaining(0.0, self._where)
                raise TooSlow(f"{self._where} did not finish its answer within MM_NET_DEADLINE "
                              f"({limits().deadline:g} s); cut") from None
            raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout), self._where)

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend:
    def __init__(self, backend):
        self._backend = backend

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _DeadlineStream(stream, f"{host}:{port}")

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_unix_socket(path, timeout, socket_options), path)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _Tally:
    """What a document's body brought so far: past CAP bytes or MAX_CONTAINERS JSON arrays and objects, refused."""

    def __init__(self, cap: int, where: str, what: str):
        self.cap, self.where, self.what = cap, where, what
        self.got = self.containers = 0

    def add(self, chunk: bytes) -> None:
        self.got += len(chunk)
        if self.got > self.cap:
            raise RemoteError(f"{self.where} sent more than {_size(self.cap)} as {self.what}; cut")
        self.containers += chunk.count(b"[") + chunk.count(b"{")  # (strings holding brackets count too: stricter)
        if self.containers > MAX_CONTAINERS:
            raise RemoteError(f"{self.where} sent more than {MAX_CONTAINERS} JSON arrays and objects as "
                              f"{self.what}; refused (no honest answer holds so many)")


class _CappedStream(httpx2.SyncByteStream):
    """A response body that refuses the byte past CAP and any read past the deadline."""

    def __init__(self, inner, cap: int, where: str, what: str):
        self._inner, self._where, self._tally = inner, where, _Tally(cap, where, what)

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._tally.add(chunk)
            _remaining(None, self._where)
            yield chunk

    def close(self) -> None:
        self._inner.close()


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} bytes"


CapFor = Callable[[httpx2.Request, httpx2.Response], "tuple[int, str]"]


def _answer_cap(method: str, url: str, status: int, headers, where: str,
                document: Callable[[], "tuple[int, str] | None"]) -> "tuple[int | None, str]":
    """(byte cap, document kind) of an answer's body, after the checks its headers allow: no Content-Encoding, a
    redirect to an http(s) URL, a Content-Length within the cap. Errors and redirects have their own caps; a
    success's is DOCUMENT()'s (None: a bulk body, no cap)."""
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RemoteError(f"{where} answered with Content-Encoding {shown(encoding, 40)!r} although mm asked for "
                          f"identity; refused (mm does not decompress what servers send)")
    if status in REDIRECT_STATUSES and "Location" in headers:
        join_url(url, headers["Location"], where)
        cap, what = CAP_REDIRECT, "a redirect"
    elif status >= 400:
        cap, what = CAP_ERROR, f"an error answer (HTTP {status})"
    else:
        kind = document()
        if kind is None:
            return None, "a file's bytes"
        cap, what = kind
    length = headers.get("Content-Length") if method != "HEAD" else None
    if length is not None and length.strip().isdigit() and int(length) > cap:
        raise RemoteError(f"{where} announced {int(length)} bytes as {what}, more than its cap of {_size(cap)}; "
                          f"refused")
    return cap, what


def _hooks(cap_for: CapFor, name: str):
    def on_request(request: httpx2.Request) -> None:
        _deadline.at = time.monotonic() + limits().deadline
        if _requests.left is not None:
            _requests.left -= 1
            if _requests.left < 0:
                raise RemoteError(f"{name} at {origin(str(request.url))} needed more requests than mm allows for "
                                  f"{_requests.what} (it keeps paging or redirecting); refused")

    def on_response(response: httpx2.Response) -> None:
        request = response.request
        peer = origin(str(request.url))
        where = name if peer.split("://", 1)[-1] in name else f"{name} at {peer}"
        cap, what = _answer_cap(request.method, str(request.url), response.status_code, response.headers, where,
                                lambda: cap_for(request, response))
        response.stream = _CappedStream(response.stream, cap, where, what)

    return {"request": [on_request], "response": [on_response]}


def http_client(cap_for: CapFor, name: str, *, request_hooks: tuple = (), **kwargs) -> httpx2.Client:
    """An httpx2 client whose answers are bounded: CAP_FOR(request, response) gives the byte cap and the name of
    the document kind for a successful answer (errors and redirects have their own caps); NAME names the peer in
    messages ("the Hub", "registry HOST"). Timeouts default to MM_NET_TIMEOUT; KWARGS go to httpx2.Client."""
    lim = limits()
    hooks = _hooks(cap_for, name)
    hooks["request"] = [*request_hooks, *hooks["request"]]
    kwargs.setdefault("timeout", httpx2.Timeout(lim.timeout))
    headers = {"Accept-Encoding": "identity", **kwargs.pop("headers", {})}
    client = httpx2.Client(event_hooks=hooks, headers=headers, max_redirects=MAX_REDIRECTS, **kwargs)
    for transport in [client._transport, *client._mounts.values()]:  # every pool, proxies' included
        pool = getattr(transport, "_pool", None)
        if pool is not None and hasattr(pool, "_network_backend"):
            pool._network_backend = _DeadlineBackend(pool._network_backend)
    return client


def read_capped(response: httpx2.Response) -> bytes:
    """The whole body of a streamed answer of an http_client (its cap and deadline apply)."""
    try:
        return response.read()
    finally:
        response.close()


def use_for_hub() -> None:
    """huggingface_hub's shared session becomes a bounded client (its request hook kept): every Hub API answer
    is capped at CAP_HUB_API, every read bounded by MM_NET_DEADLINE, at most MAX_REDIRECTS redirects."""
    from huggingface_hub.utils import _http, set_client_factory

    if getattr(_http, "_mm_bounded", False):
        return

    def factory() -> httpx2.Client:
        return http_client(lambda req, resp: (CAP_HUB_API, "a Hub API answer"), "the Hub",
                           request_hooks=(_http.hf_request_event_hook,), follow_redirects=True,
                           verify=default_ssl_context())

    set_client_factory(factory)
    _http._mm_bounded = True


# --- bulk bodies: http.client, read into the caller's buffer -----------------------------------------

class RawAnswer:
    """An answer on a plain http.client connection: status, headers, and a body read into the caller's buffer."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, where: str,
                 key: tuple | None = None, unwatch: Callable[[], None] = lambda: None):
        self._conn, self._resp, self.where, self._key, self._unwatch = conn, resp, where, key, unwatch
        self.status = resp.status
        self.headers = resp.headers
        length = resp.getheader("Content-Length")
        self.length = int(length) if length is not None and length.strip().isdigit() else None
        self._plain = self.length is not None and not resp.chunked
        self._left = self.length
        self._sock, self._timeout = conn.sock, None
        if self._plain and type(self._sock) is socket.socket and self._sock.gettimeout():  # (TLS: see below)
            self._timeout = _timeout_in_kernel(self._sock)
        self._lowat = 1  # the socket's SO_RCVLOWAT (1: the kernel's default)
        self._began: float | None = None  # when the first body read was asked (for the rate)
        self._got = 0  # body bytes read from the socket so far

    def header(self, name: str) -> str | None:
        return self._resp.getheader(name)

    def readinto(self, view: memoryview) -> int:
        """One read from the socket into VIEW: the bytes that arrived (0: the body ended)."""
        if self._plain:
            if not self._left:
                return 0
            if len(view) > self._left:
                view = view[:self._left]
            if self._timeout is not None:
                self._wait_for(self._batch(len(view)))
            n = self._resp.fp.readinto1(view)
            if n is None:  # SO_RCVTIMEO passed (_timeout_in_kernel)
                raise TimeoutError(f"no byte within {self._timeout:g} s")
            if n == 0:
                raise http.client.IncompleteRead(b"", self._left)
            self._left -= n
            self._got += n
            return n
        data = self._resp.read1(len(view))  # chunked: the client decodes the framing
        view[:len(data)] = data
        return len(data)

    def _batch(self, asked: int) -> int:
        """How many bytes the next read of ASKED waits for (batch_size, at this connection's rate so far)."""
        now = time.monotonic()
        if self._began is None:
            self._began = now
            return 1
        return batch_size(self._got / max(now - self._began, 1e-3), asked, self._left - io.DEFAULT_BUFFER_SIZE)

    def _wait_for(self, lowat: int) -> None:
        if lowat != self._lowat:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def read_capped(self, cap: int, what: str) -> bytes:
        """The whole body, at most CAP bytes and MAX_CONTAINERS JSON arrays and objects, within the deadline (a
        small document on this connection). Memory grows with what arrives, not with CAP."""
        lim = limits()
        until = time.monotonic() + lim.deadline
        piece = memoryview(bytearray(64 * KiB))
        out = bytearray()
        tally = _Tally(cap, self.where, what)
        while n := self.readinto(piece):
            chunk = piece[:n].tobytes()
            tally.add(chunk)
            out += chunk
            if time.monotonic() > until:
                raise TooSlow(f"{self.where} did not finish {what} within MM_NET_DEADLINE ({lim.deadline:g} s); cut")
        return bytes(out)

    def discard(self, limit: int) -> None:
        """Read and drop a small body (a redirect's) to its end, so that its connection can be kept."""
        if self._plain and self._left is not None and self._left <= limit:
            scratch = memoryview(bytearray(min(self._left, limit) or 1))
            try:
                while self._left and self.readinto(scratch):
                    pass
            except (OSError, http.client.HTTPException):
                pass

    def close(self) -> None:
        """Done with the answer: its connection is kept for this thread's next request to the same origin when the
        body was read to its end and the server did not say it closes; else it is closed."""
        self._unwatch()
        reusable = True
        if self._timeout is not None:
            try:
                self._wait_for(1)  # the next answer's headers: readable from their first byte
                self._sock.settimeout(self._timeout)  # ...under Python's deadline again
            except OSError:
                reusable = False
        if reusable and self._key is not None and self._plain and self._left == 0 and not self._resp.will_close:
            self._resp.close()  # the response is done; the connection's socket stays open
            old = _idle.conns.pop(self._key, None)
            if old is not None:
                old.close()
            _idle.conns[self._key] = self._conn
        else:
            self._conn.close()


def batch_size(rate: float, asked: int, rest: int) -> int:
    """What a body read of ASKED bytes waits for (its SO_RCVLOWAT) on a connection bringing RATE bytes/s whose body
    has REST bytes still to come: what it brings in LOWAT_SECONDS (a power of 2, at most LOWAT_MAX), or 1 (take
    what arrived) below LOWAT_MIN. Each socket read is a wake-up, a system call and a GIL hand-off among 16-32
    receiving threads; on a fast connection they bring a few hundred KB each unless told to wait for more. The
    wait never outlives the body: a reader that took some bytes and then waits is woken only once a whole mark's
    worth more is queued, so REST must hold twice the mark."""
    want = min(LOWAT_MAX, int(rate * LOWAT_SECONDS))
    if want < LOWAT_MIN or asked < want or rest < 2 * want:
        return 1
    return 1 << (want.bit_length() - 1)


def _timeout_in_kernel(sock: socket.socket) -> float:
    """SOCK's read timeout enforced by the kernel (SO_RCVTIMEO on a blocking socket) rather than by Python's
    poll() before every recv: half the system calls and GIL hand-offs of a body read; a read that waits longer
    returns None (RawAnswer.readinto). Returns the timeout, for RawAnswer.close to give back to Python. Plain
    sockets only: a blocking TLS socket retries a read that timed out inside the ssl module, unbounded."""
    timeout = sock.gettimeout()
    seconds = int(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((timeout - seconds) * 1e6)))
    sock.settimeout(None)
    return timeout


class Proxies:
    """The proxy the environment names for each origin (HTTPS_PROXY, HTTP_PROXY, NO_PROXY), as httpx honours them,
    read when first asked and kept, as an httpx client reads them once when it is made: scanning the environment
    cost about 0.2 ms of CPU per request, paid hundreds of times a fetch."""

    def __init__(self):
        self._env: dict[str, str] | None = None
        self._by_origin: dict[tuple[str, str], str | None] = {}

    def for_url(self, url: str) -> str | None:
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "")
        if key not in self._by_origin:
            if self._env is None:
                self._env = urllib.request.getproxies_environment()
            proxy = self._env.get(parts.scheme)
            if proxy and urllib.request.proxy_bypass_environment(key[1], self._env):
                proxy = None
            self._by_origin[key] = proxy or None
        return self._by_origin[key]


_ssl_context: ssl.SSLContext | None = None
_ssl_lock = threading.Lock()


def default_ssl_context() -> ssl.SSLContext:
    """The CAs httpx2 (and so huggingface_hub) trusts: SSL_CERT_FILE / SSL_CERT_DIR, else the system's bundle. One
    context for the process: the Hub API client (use_for_hub) and the file connections (open_raw) share it."""
    global _ssl_context
    with _ssl_lock:
        if _ssl_context is None:
            _ssl_context = _trusted_cas()
        return _ssl_context


# mm's margin: the bundles systems ship (Mozilla's, as ca-certificates and certifi carry it) are about 220 KB
CAP_CA_BUNDLE = 64 * 1024 * 1024


def _trusted_cas() -> ssl.SSLContext:
    """httpx2's context, with the files the environment names checked first as the hostile input they may be:
    SSL_CERT_FILE a regular file within CAP_CA_BUNDLE (a FIFO would block OpenSSL's read for ever, a device or a
    huge file would be read whole), SSL_CERT_DIR a directory; what OpenSSL then refuses is one line naming it."""
    for name, want_dir in (("SSL_CERT_FILE", False), ("SSL_CERT_DIR", True)):
        value = os.environ.get(name)
        if not value:
            continue
        where = f"{name}={shown(value)}"
        try:
            st = os.stat(value)
        except OSError as e:
            raise BadInput(f"{where}: {e.strerror or e}; point it at the CA certificates to trust, or unset it") from None
        if want_dir and not stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{where}: is {file_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, "
                           f"not a directory of CA certificates")
        if not want_dir and not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{where}: is {file_kind(st.st_mode)}, not a regular file of CA certificates")
        if not want_dir and st.st_size > CAP_CA_BUNDLE:
            raise BadInput(f"{where}: {human_bytes(st.st_size)}, larger than the {human_bytes(CAP_CA_BUNDLE)} mm "
                           f"reads as a CA bundle")
        break  # httpx2 reads SSL_CERT_DIR only when SSL_CERT_FILE is unset
    try:
        return httpx2.create_ssl_context(trust_env=True)
    except (ssl.SSLError, OSError, UnicodeError) as e:
        source = next((f"{n}={shown(os.environ[n])}" for n in ("SSL_CERT_FILE", "SSL_CERT_DIR") if os.environ.get(n)),
                      "the system's CA bundle")
        raise BadInput(f"{source}: OpenSSL cannot load CA certificates from it ({getattr(e, 'reason', None) or e})"
                       f"; point SSL_CERT_FILE at a PEM bundle of CA certificates, or unset it") from None


def warm_tls() -> None:
    """Make default_ssl_context on a thread now: OpenSSL parses the CA bundle (20-40 ms) without holding the GIL, so
    it runs on another core while the caller imports the Hub client, not in front of the first request. A failure
    there is left for the first real use to raise."""
    def make() -> None:
        try:
            default_ssl_context()
        except Exception:  # (an unreadable SSL_CERT_FILE: the request that needs the context says so)
            pass

    if _ssl_context is None:  # not a daemon: a process that ends early waits the few ms for it, since OpenSSL
        # still parsing while the interpreter finalizes crashed mm (SIGSEGV after its error line)
        threading.Thread(target=make, name="mm-tls").start()


class _Idle(threading.local):
    """This thread's kept-alive connections, one per (scheme, host, port, proxy)."""

    def __init__(self):
        self.conns: dict[tuple, http.client.HTTPConnection] = {}


_idle = _Idle()


def open_raw(url: str, headers: dict[str, str], where: str, *, ssl_context: ssl.SSLContext | None = None,
             proxies: Proxies | None = None, answer_timeout: float | None = None,
             receive_buffer: int | None = None) -> RawAnswer:
    """GET URL on an http.client connection: this thread's kept-alive one to that origin when there is one (a
    range after a range costs no new TCP and TLS handshake), else a new one. The status line and headers must
    arrive within MM_NET_DEADLINE (a watchdog shuts the socket down); each later read waits at most MM_NET_TIMEOUT.
    PROXIES: honour the proxy variables (as huggingface_hub's client does), as PROXIES read them. OSError / http.client.HTTPException
    propagate (the caller decides what a failed connection means); TooSlow when the deadline cut the headers.
    RawAnswer.close() keeps the connection for the next request when its body was read to the end.
    ANSWER_TIMEOUT (seconds, shorter than the deadline) bounds the connection attempt and the headers instead.
    RECEIVE_BUFFER: the socket's SO_RCVBUF in bytes, set before it connects (so the window the server may fill is
    that small from the first byte): for a request whose answer is judged by its headers and closed unread, so
    that only that much of a body reaches mm meanwhile. Such connections are kept apart from the others (a bulk
    body never comes through so small a window)."""
    lim = limits()
    parts = urlsplit(check_url(url, where, "was to be asked at"))
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    proxy = proxies.for_url(url) if proxies is not None else None
    if proxy and parts.scheme == "http":
        target = url  # absolute form, to the proxy
    headers = {**headers, **_proxy_auth(proxy)} if proxy and parts.scheme == "http" else headers
    key = (parts.scheme, parts.hostname, parts.port, proxy, id(ssl_context), receive_buffer)
    conn = _idle.conns.pop(key, None)
    kept = conn is not None
    while True:
        if conn is None:
            conn = _connection(parts, proxy, ssl_context, min(lim.timeout, answer_timeout or lim.timeout))
            if receive_buffer:
                conn._create_connection = _connector(receive_buffer)
        # A stop wakes a read blocked on a silent server. The socket itself is kept: http.client drops conn.sock
        # (the response keeps reading from it) when the server says it closes the connection.
        sock: list = [getattr(conn, "sock", None)]
        unwatch = interrupt.on_stop(lambda: _shutdown(sock[0]))
        try:
            if not kept:
                conn.connect()
                sock[0] = conn.sock
                if interrupt.requested():
                    _shutdown(sock[0])  # (the stop came while the socket was being made)
            with watchdog(conn, answer_timeout or lim.deadline, where, "send its answer's headers"):
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
            return RawAnswer(conn, resp, where, key, unwatch)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            unwatch()
            conn.close()
            if not kept:
                raise
            conn, kept = None, False  # the server closed the kept connection meanwhile: once more, on a new one
        except BaseException:
            unwatch()
            conn.close()
            raise


def _connection(parts, proxy: str | None, ssl_context: ssl.SSLContext | None,
                timeout: float) -> http.client.HTTPConnection:
    https = parts.scheme == "https"
    context = (ssl_context or default_ssl_context()) if https else None
    if proxy:
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if p.scheme != "http" or not p.hostname:
            raise RemoteError(f"proxy {shown(proxy)!r}: mm downloads through http:// proxies only")
        if not https:
            return http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout)
        conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout, context=context)
        conn.set_tunnel(parts.hostname, parts.port, headers=_proxy_auth(proxy))
        return conn
    if https:
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=context)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _connector(receive_buffer: int) -> Callable:
    """socket.create_connection as http.client calls it (its `_create_connection`), with SO_RCVBUF set on each
    socket before it connects: the TCP window is fixed at the handshake, so setting it later lets a server fill
    the default one (128 KiB, growing to megabytes) first."""
    def create(address, timeout=socket.getdefaulttimeout(), source_address=None):
        host, port = address
        error: OSError | None = None
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
                sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(addr)
                return sock
            except OSError as e:
                sock.close()
                error = e
        raise error or OSError(f"getaddrinfo returned nothing for {host}")
    return create


def _proxy_auth(proxy: str | None) -> dict[str, str]:
    p = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy or ''}")
    if not p.username:
        return {}
    import base64
    from urllib.parse import unquote
    token = base64.b64encode(f"{unquote(p.username)}:{unquote(p.password or '')}".encode()).decode()
    return {"Proxy-Authorization": f"Basic {token}"}


@contextmanager
def watchdog(conn: http.client.HTTPConnection, seconds: float, where: str, what: str) -> Iterator[None]:
    """Whatever CONN does inside must end within SECONDS: then its socket is shut down and TooSlow raised (a
    server trickling its status line and headers, which per-read timeouts never end). Headers that http.client
    refuses (too long, too many) are a RemoteError too."""
    fired = threading.Event()
    cancel = _ALARMS.after(seconds, lambda: _cut(conn, fired))
    try:
        yield
    except (OSError, http.client.HTTPException) as e:
        if fired.is_set():
            raise TooSlow(f"{where} did not {what} within {seconds:g} s (MM_NET_DEADLINE); cut") from None
        if isinstance(e, http.client.LineTooLong) or isinstance(e, http.client.HTTPException) and "header" in str(e):
            raise RemoteError(f"{where} sent headers mm refuses ({type(e).__name__}: {shown(str(e), 80)})") from None
        raise
    finally:
        cancel()
    if fired.is_set():
        raise TooSlow(f"{where} did not {what} within {seconds:g} s (MM_NET_DEADLINE); cut")


class Alarms:
    """One thread that calls each callback given to ``after`` once its time comes, unless cancelled first: a
    watchdog per request costs a heap entry, not a thread started and stopped (a 1 GiB fetch makes hundreds)."""

    def __init__(self):
        self._heap: list[tuple[float, int, list]] = []
        self._cv = threading.Condition(threading.Lock())
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def after(self, seconds: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Call CALLBACK in SECONDS; returns the function that cancels it."""
        entry = [callback]
        with self._cv:
            when = time.monotonic() + seconds
            if not self._heap or when < self._heap[0][0]:
                self._cv.notify()  # the thread sleeps until a later time, or for nothing
            heapq.heappush(self._heap, (when, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mm-alarms", daemon=True)
                self._thread.start()

        def cancel() -> None:
            entry[0] = None
        return cancel

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._heap and self._heap[0][2][0] is None:
                    heapq.heappop(self._heap)  # cancelled: dropped as soon as it is on top
                if not self._heap:
                    self._cv.wait()
                    continue
                when, _, entry = self._heap[0]
                wait = when - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
                callback, entry[0] = entry[0], None
            if callback is not None:
                callback()


_ALARMS = Alarms()


def _cut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    fired.set()
    _shut(conn)


def _shut(conn) -> None:
    _shutdown(getattr(conn, "sock", None))


def _shutdown(sock: socket.socket | None) -> None:
    """Shut SOCK down (a read blocked on it returns at once); its reader closes it."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@contextmanager
def raw_answer(url: str, headers: dict[str, str], where: str, **kwargs) -> Iterator[RawAnswer]:
    answer = open_raw(url, headers, where, **kwargs)
    try:
        yield answer
    finally:
        answer.close()


# --- clients on `requests` (the ModelScope SDK): the same bounds, mounted on their sessions -----------------

BulkOrCap = Callable[[str], "tuple[int, str] | None"]


def bound_session(session, cap_for: BulkOrCap, name: str) -> None:
    """Bound every answer SESSION (a requests.Session a client library owns) receives, whatever the library then
    does with it: each of its adapters is replaced by a copy (same class, pools, retries) that
      - waits at most MM_NET_TIMEOUT to connect and per read (the library's own timeouts, when shorter, kept);
      - cuts an answer whose status line and headers, or whole document, take longer than MM_NET_DEADLINE (a
        watchdog shuts the socket down: a trickle of header bytes is cut too), and shuts it down on an interrupt;
      - refuses a compressed answer (mm asks for identity), a redirect to what is not an http(s) URL, more than
        MAX_REDIRECTS redirects, and a body past its cap: CAP_FOR(url) gives (cap, document kind) for a
        successful answer, or None for a bulk body (a file's bytes: the caller's engine bounds those; only the
        header deadline applies); error answers and redirects have their own caps.
    NAME names the peer in messages ("ModelScope"). Failures are RemoteError (TooSlow for time)."""
    session.headers["Accept-Encoding"] = "identity"
    session.max_redirects = MAX_REDIRECTS
    for prefix, adapter in list(session.adapters.items()):
        if isinstance(adapter, _BoundedAdapter):
            continue
        cls = type(f"Bounded{type(adapter).__name__}", (_BoundedAdapter, type(adapter)), {})
        bounded = cls(pool_connections=adapter._pool_connections, pool_maxsize=adapter._pool_maxsize,
                      max_retries=adapter.max_retries, pool_block=adapter._pool_block)
        bounded._mm_bounds = (cap_for, name)
        session.mount(prefix, bounded)
        adapter.close()


class _Watching(threading.local):
    watch: "_Watch | None" = None


_watching = _Watching()  # the request this thread is sending through a bounded adapter


class _Watch:
    """One request on a bounded session: the sockets it reads, shut down when its deadline passes or mm is
    stopped (`fired` says which)."""

    def __init__(self, seconds: float):
        self.fired: str | None = None
        self._socks: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire, ("deadline",))
        self._timer.daemon = True
        self._timer.start()
        self._unwatch = interrupt.on_stop(lambda: self._fire("stop"))

    def attach(self, sock) -> None:
        with self._lock:
            self._socks.append(sock)
            fired = self.fired
        if fired:
            _shutdown(sock)

    def _fire(self, why: str) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired = why
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)

    def no_deadline(self) -> None:
        """A bulk body follows: only an interrupt ends it from here (the caller's engine bounds its rate)."""
        self._timer.cancel()

    def done(self) -> None:
        self._timer.cancel()
        self._unwatch()


class _WatchedConnection:
    """A urllib3 connection whose socket the request being sent on this thread (its _Watch) can shut down: the
    socket itself is kept (http.client drops the connection's when the server says it closes it)."""

    def getresponse(self, *args, **kwargs):
        if _watching.watch is not None and self.sock is not None:  # the request went out on it
            _watching.watch.attach(self.sock)
        return super().getresponse(*args, **kwargs)


def _watch_pools(manager) -> None:
    """MANAGER's pools make _WatchedConnection connections (urllib3's pool_classes_by_scheme; the classes it
    had, proxies' and TLS included, kept underneath)."""
    classes = dict(manager.pool_classes_by_scheme)
    for scheme, pool in classes.items():
        if getattr(pool, "_mm_watched", False):
            continue
        conn = type(f"Watched{pool.ConnectionCls.__name__}", (_WatchedConnection, pool.ConnectionCls), {})
        classes[scheme] = type(f"Watched{pool.__name__}", (pool,), {"ConnectionCls": conn, "_mm_watched": True})
    manager.pool_classes_by_scheme = classes


def _clamp(timeout, most: float):
    """A requests timeout (None, seconds, or (connect, read)) with each part at most MOST."""
    if timeout is None:
        return most, most
    if isinstance(timeout, (int, float)):
        return min(timeout, most)
    if isinstance(timeout, tuple) and len(timeout) == 2:
        return tuple(most if t is None else min(t, most) for t in timeout)
    return timeout


class _BoundedAdapter:
    """Mixed into a copy of a requests adapter by bound_session."""

    _mm_bounds: tuple

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        _watch_pools(self.poolmanager)

    def proxy_manager_for(self, *args, **kwargs):
        manager = super().proxy_manager_for(*args, **kwargs)
        _watch_pools(manager)
        return manager

    def send(self, request, stream=False, timeout=None, **kwargs):
        cap_for, name = self._mm_bounds
        lim = limits()
        where = f"{name} at {origin(request.url)}"
        late = f"{where} did not finish its answer within MM_NET_DEADLINE ({lim.deadline:g} s); cut"
        watch = _Watch(lim.deadline)
        saved, _watching.watch = _watching.watch, watch
        try:
            response = super().send(request, stream=stream, timeout=_clamp(timeout, lim.timeout), **kwargs)
        except Exception:
            watch.done()
            if watch.fired == "deadline":
                raise TooSlow(late) from None
            raise
        except BaseException:
            watch.done()
            raise
        finally:
            _watching.watch = saved
        try:
            cap, what = _answer_cap(request.method, request.url, response.status_code, response.headers, where,
                                    lambda: cap_for(request.url))
        except BaseException:
            watch.done()
            response.close()
            raise
        if cap is None:
            watch.no_deadline()
        response.raw = _BoundedBody(response.raw, watch, None if cap is None else _Tally(cap, where, what), late)
        return response




class _BoundedBody:
    """A requests answer's body (urllib3's response underneath): every read counted against the document's
    tally (none for a bulk body), a read the deadline cut is TooSlow. What requests and client libraries call
    (read, read1, stream, close, release_conn) goes through here; anything else reaches the response itself."""

    def __init__(self, raw, watch: _Watch, tally: _Tally | None, late: str):
        self._raw, self._watch, self._tally, self._late = raw, watch, tally, late

    def _took(self, data: bytes) -> bytes:
        if self._watch.fired == "deadline":
            raise TooSlow(self._late)
        if self._tally is not None:
            self._tally.add(data)
        if not data:
            self._watch.done()  # the body ended
        return data

    def _read(self, method, amt, decode_content, **kwargs) -> bytes:
        try:
            data = method(amt, decode_content=decode_content, **kwargs)
        except Exception:
            if self._watch.fired == "deadline":
                raise TooSlow(self._late) from None
            raise
        return self._took(data)

    def read(self, amt=None, decode_content=None, **kwargs) -> bytes:
        if amt is None and self._tally is not None:  # the whole document: in pieces, so that the cap applies
            out = bytearray()
            while piece := self._read(self._raw.read, 64 * KiB, decode_content, **kwargs):
                out += piece
            return bytes(out)
        return self._read(self._raw.read, amt, decode_content, **kwargs)

    def read1(self, amt=None, decode_content=None) -> bytes:
        return self._read(self._raw.read1, amt, decode_content)

    def stream(self, amt=64 * KiB, decode_content=None) -> Iterator[bytes]:
        while data := self.read(amt, decode_content):
            yield data

    def close(self) -> None:
        self._watch.done()
        self._raw.close()

    def release_conn(self) -> None:
        self._watch.done()
        self._raw.release_conn()

    def __getattr__(self, attr):
        return getattr(self._raw, attr)
