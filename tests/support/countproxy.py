"""A TCP proxy on 127.0.0.1 that counts the bytes each way and can slow them down (tests and benchmarks).

    with CountingProxy("127.0.0.1", registry.port) as proxy:   # talk to proxy.host instead of the registry
        ...
        proxy.sent       # bytes clients sent upstream (request lines, headers, bodies)
        proxy.received   # bytes upstream sent back to clients
        proxy.rate = 2_000_000   # bytes/second per connection and direction (None: full speed)
        proxy.reset()            # counters to zero
        proxy.drop_connections() # after killing a client: nothing it left in flight is forwarded or counted

It forwards bytes untouched (the Host header too, so the registry's upload URLs point back at the proxy).
"""
from __future__ import annotations

import socket
import threading
import time

PIECE = 64 * 1024


class CountingProxy:
    def __init__(self, upstream_host: str, upstream_port: int, rate: float | None = None):
        self.upstream = (upstream_host, upstream_port)
        self.rate = rate
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []

    def reset(self) -> None:
        with self._lock:
            self.sent = self.received = 0

    def drop_connections(self) -> None:
        """Close every open connection (after a client was killed: what its socket still held is not
        forwarded, and not counted, later)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _count(self, upstream: bool, n: int) -> None:
        with self._lock:
            if upstream:
                self.sent += n
            else:
                self.received += n

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(PIECE)
                if not data:
                    break
                rate = self.rate
                if rate:
                    time.sleep(len(data) / rate)
                dst.sendall(data)
                self._count(upstream, len(data))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def __enter__(self) -> "CountingProxy":
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # shutdown() wakes the accept() the serving thread is blocked in; close() alone does not: the kernel keeps
        # that socket listening on its port, and a connection that reaches it later would still be forwarded
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._server.close()
        for s in self._conns:
            try:
                s.close()
            except OSError:
                pass
