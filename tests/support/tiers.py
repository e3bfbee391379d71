"""Registry tiers for tests, started from the distribution configs `mm fleet config` wrote (Debian docker-registry).

    with Tier(fleet_dir / "registry/origin/config.yml") as origin, \\
         Tier(fleet_dir / "registry/t1/config.yml") as t1, \\
         Tier(fleet_dir / "registry/t2/config.yml", addr="127.0.0.1:P") as t2:   # behind a CountingProxy
        t1.url, t1.log_text()

The config is used as written; ADDR overrides its http.addr through distribution's environment override
(REGISTRY_HTTP_ADDR, its configuration reference), as when a load balancer or a counting proxy fronts a tier.
`start()` returns once GET /v2/ answers; `start(expect_exit=True)` returns the registry's log once it has exited
(a proxy whose upstream is down). Stopped with SIGTERM, then SIGKILL, on exit.
"""
from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tests.support.registry import REGISTRY_BIN


class Tier:
    def __init__(self, config: Path, addr: str | None = None, start_timeout: float = 20.0):
        self.config_path = Path(config)
        self.config = yaml.safe_load(self.config_path.read_text())
        self.addr = addr or self.config["http"]["addr"]
        self.url = f"http://{self.addr}"
        self.log_path = self.config_path.with_name("registry.log")
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, expect_exit: bool = False) -> "Tier | str":
        env = {**os.environ, **({"REGISTRY_HTTP_ADDR": self.addr} if self.addr != self.config["http"]["addr"] else {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.config_path)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if expect_exit:
                    return self.log_text()
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}:\n{self.log_text()[-2000:]}")
            if not expect_exit:
                try:
                    with urllib.request.urlopen(self.url + "/v2/", timeout=2) as resp:
                        if resp.status == 200:
                            return self
                except (OSError, urllib.error.HTTPError):
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry {'kept running' if expect_exit else 'did not answer'} on {self.url}:\n"
                           f"{self.log_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "Tier":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
