"""Registry tiers for tests, started from the distribution configs `mm fleet config` wrote (Debian docker-registry).

    with Tier(fleet_dir / "registry/origin/config.yml") as origin, \\
         Tier(fleet_dir / "registry/t1/config.yml") as t1, \\
         Tier(fleet_dir / "registry/t2/config.yml", addr="127.0.0.1:P") as t2:   # behind a CountingProxy
        t1.url, t1.log_text()
    log = serve_until_exit(fleet_dir / "registry/t1/config.yml")   # a tier that does not start: what it logged

A Tier is tests/support/registry.Registry with mm's config used as written: ADDR overrides its http.addr through
distribution's environment override (REGISTRY_HTTP_ADDR, its configuration reference), as when a load balancer or
a counting proxy fronts a tier. Its log is registry.log beside the config.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from tests.support.registry import REGISTRY_BIN, Registry


class Tier(Registry):
    def __init__(self, config: Path, addr: str | None = None):
        config = Path(config)
        super().__init__(root=config.parent)
        self.config_path = config
        written = yaml.safe_load(config.read_text())["http"]["addr"]
        self.addr = addr or written
        self.host, self.port = self.addr, int(self.addr.rsplit(":", 1)[1])
        self.url = f"http://{self.addr}"
        self.env = {**os.environ, "REGISTRY_HTTP_ADDR": self.addr} if self.addr != written else None

    def _write_config(self) -> None:
        """The config is mm's, as written."""


def serve_until_exit(config: Path, timeout: float = 30) -> str:
    """Run docker-registry on CONFIG until it exits by itself; what it printed."""
    done = subprocess.run([REGISTRY_BIN, "serve", str(config)], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)
    return done.stdout + done.stderr
