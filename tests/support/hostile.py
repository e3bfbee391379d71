"""A hostile HTTP server on 127.0.0.1: every answer is scripted by the test, byte by byte where it must be.

    def script(req: Request, out: Out) -> None:
        if req.path == "/v2/":
            out.endless()                      # a chunked body that never ends
        else:
            out.send(200, {"Content-Type": "application/json"}, b"{}")

    with HostileServer(script) as server:      # server.url, server.host ("127.0.0.1:PORT")
        ...
        server.requests                        # [Request], in arrival order
        server.connections                     # TCP connections accepted
        server.body_bytes                      # body bytes written to clients, all answers together

`Out` writes an honest answer (`send`), or misbehaves: `head` (status line and headers only), `raw` bytes,
`trickle` (a byte at a time), `endless` (chunked, forever, until the client hangs up), `stall` (say nothing).
One request per connection (answers say `Connection: close`), so each request's behaviour is its own.
A script that raises is a bug in the test: the connection is dropped and the error kept in `server.errors`.
"""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

HOST = "127.0.0.1"
MAX_HEAD = 64 * 1024


@dataclass
class Request:
    method: str
    target: str  # as sent: path and query
    headers: dict[str, str]  # names in lower case
    body: bytes = b""
    connection: int = 0  # the TCP connection's number (1, 2, ...)

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urlsplit(self.target).query


@dataclass
class Out:
    sock: socket.socket
    server: "HostileServer"
    closed: bool = field(default=False)

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def head(self, status: int, headers: dict[str, str] | list[tuple[str, str]] | None = None,
             reason: str = "X") -> None:
        items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in items] + ["Connection: close", "", ""]
        self.raw("\r\n".join(lines).encode("latin-1"))

    def body(self, data: bytes) -> None:
        self.raw(data)
        self.server._count(len(data))

    def send(self, status: int, headers: dict[str, str] | None = None, body: bytes = b"",
             length: int | None = None) -> None:
        """An answer with BODY; Content-Length is LENGTH when given (a lie, if the test wants one), else the truth."""
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body) if length is None else length))
        self.head(status, headers)
        if body:
            self.body(body)

    def trickle(self, data: bytes, interval: float) -> None:
        """DATA one byte at a time, INTERVAL seconds apart (until the client hangs up)."""
        for i in range(len(data)):
            self.body(data[i:i + 1])
            time.sleep(interval)

    def endless(self, piece: bytes = b"x" * 65536, chunked: bool = True, interval: float = 0.0,
                status: int = 200, headers: dict[str, str] | None = None) -> None:
        """A body that never ends: chunked (no length), or raw after no Content-Length, until the client leaves."""
        hdrs = {"Content-Type": "application/octet-stream", **(headers or {})}
        if chunked:
            hdrs["Transfer-Encoding"] = "chunked"
        self.head(status, hdrs)
        frame = (b"%x\r\n" % len(piece)) + piece + b"\r\n" if chunked else piece
        while True:
            self.body(frame)
            if interval:
                time.sleep(interval)

    def stall(self, seconds: float = 3600) -> None:
        """Say nothing (after whatever was sent) for SECONDS, or until the client hangs up."""
        self.sock.settimeout(seconds)
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass


Script = Callable[[Request, Out], None]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: HostileServer = self.server.owner  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        number = server._connected()
        try:
            req = _read_request(sock)
            if req is None:
                return
            req.connection = number
            with server._lock:
                server.requests.append(req)
            server.script(req, Out(sock, server))
        except (OSError, ValueError):
            pass  # the client hung up, as hostile answers make it do
        except Exception as e:  # noqa: BLE001 - a bug in the test's script: kept for the test to see
            with server._lock:
                server.errors.append(e)
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _read_request(sock: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > MAX_HEAD:
            raise ValueError("request head too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length") or 0)
    body = rest
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        if not chunk:
            break
        body += chunk
    return Request(method, target, headers, body[:length])


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class HostileServer:
    def __init__(self, script: Script):
        self.script = script
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []
        self.connections = 0
        self.body_bytes = 0
        self._lock = threading.Lock()
        self._server = _TCPServer((HOST, 0), _Handler)
        self._server.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hostile-server", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def host(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def _connected(self) -> int:
        with self._lock:
            self.connections += 1
            return self.connections

    def _count(self, n: int) -> None:
        with self._lock:
            self.body_bytes += n

    def __enter__(self) -> "HostileServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class ForwardProxy:
    """A plain HTTP forward proxy on 127.0.0.1 (absolute-form requests, one per connection): what HTTP_PROXY
    names on a site that reaches the Hub only through a proxy. `requests` holds the absolute URLs asked."""

    def __init__(self):
        self.requests: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._handle(self.request)

        self._server = _TCPServer((HOST, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def _handle(self, client: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        with self._lock:
            self.requests.append(target)
        parts = urlsplit(target)
        if parts.hostname != HOST:  # loopback only, ever
            client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        headers = [line for line in lines[1:] if not line.lower().startswith(("proxy-", "connection"))]
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        with socket.create_connection((parts.hostname, parts.port or 80)) as upstream:
            upstream.sendall("\r\n".join([f"{method} {path} {version}", *headers, "Connection: close", "", ""])
                             .encode("latin-1") + rest)
            while chunk := upstream.recv(1 << 20):
                client.sendall(chunk)

    def __enter__(self) -> "ForwardProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
