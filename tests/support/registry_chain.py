"""A chain of real pull-through caches for tests and benchmarks: Debian's `docker-registry` (distribution 2.8) as
the origin, then tiers in proxy mode (`proxy: remoteurl:`), each tier's upstream the one before it, all on
127.0.0.1, each registry behind a byte-counting proxy (tests/support/countproxy.py), so that what each one served
is measured where it leaves it.

    with Chain(tmp_path, tiers=2) as chain:        # origin -> T1 -> T2
        chain.origin.host                           # "127.0.0.1:P": push here (the counting proxy's address)
        chain.tiers[1].host                         # T2: what nodes pull through (`mm pull --mirror`)
        chain.tiers[1].direct_host                  # T2 itself, past its counting proxy
        chain.tiers[0].served                       # bytes T1 sent to its clients (T2 and whoever else asked)
        chain.reset()                               # every counter to zero
        chain.kill(chain.tiers[1])                  # the registry stops at once, its address refuses connections

Start order is the origin first, then each tier after its upstream answers (2.8 proxies resolve their upstream
at start). Each registry's own files are under ROOT/<name>/ (Registry's layout).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .countproxy import CountingProxy
from .registry import HOST, Registry


class Hop:
    """One registry of the chain and the counting proxy in front of it."""

    def __init__(self, name: str, registry: Registry):
        self.name, self.registry = name, registry
        self.proxy: CountingProxy | None = None
        self._closed = False

    @property
    def host(self) -> str:
        return self.proxy.host

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def direct_host(self) -> str:
        """The registry itself, not through the counting proxy (a Python thread pair per connection): for the
        last tier in a benchmark, where the bytes it serves need no counting and many connections go at once."""
        return self.registry.host

    @property
    def served(self) -> int:
        """Bytes this registry sent to its clients since the last reset (headers included)."""
        return self.proxy.received

    def start(self) -> "Hop":
        self.registry.start()
        self.proxy = CountingProxy(HOST, self.registry.port).__enter__()
        return self

    def close_address(self) -> None:
        if self.proxy is not None and not self._closed:
            self._closed = True
            self.proxy.drop_connections()
            self.proxy.__exit__(None, None, None)

    def stop(self) -> None:
        self.close_address()
        self.registry.stop()


class Chain:
    def __init__(self, root: Path | None = None, tiers: int = 2):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="mm-chain-"))
        self.origin = Hop("origin", Registry(self.root / "origin"))
        self.tiers: list[Hop] = []
        self._count = tiers

    @property
    def hops(self) -> list[Hop]:
        return [self.origin, *self.tiers]

    def __enter__(self) -> "Chain":
        try:
            self.origin.start()
            upstream = self.origin
            for i in range(self._count):
                hop = Hop(f"T{i + 1}", Registry(self.root / f"t{i + 1}", proxy=upstream.url)).start()
                self.tiers.append(hop)
                upstream = hop
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for hop in reversed(self.hops):
            hop.stop()

    def reset(self) -> None:
        for hop in self.hops:
            hop.proxy.reset()

    def kill(self, hop: Hop) -> None:
        """HOP's registry is killed (SIGKILL) and its address closed: connections in flight are cut, new ones
        refused."""
        if hop.registry.proc is not None:
            hop.registry.proc.kill()
            hop.registry.proc.wait()
            hop.registry.proc = None
        hop.close_address()
