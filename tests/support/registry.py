"""A real OCI registry for tests: the Debian `docker-registry` (distribution 2.8) on 127.0.0.1.

    with Registry() as reg:                         # anonymous
        reg.url        # "http://127.0.0.1:PORT"
        reg.host       # "127.0.0.1:PORT"  (what goes in an image reference)
        reg.storage    # Path: the filesystem driver's root directory
        reg.blob_path("sha256:...")  # Path of that blob's data file in storage (to corrupt it in a test)
        reg.log_text()               # everything the registry logged so far (access log included)

    with Registry(users={"alice": "s3cret"}) as reg:   # htpasswd basic auth (realm "mm-test")
        ...

    with TokenServer(tmp, users) as ts, Registry(token=ts) as reg:   # Bearer tokens (tests/support/tokenserver.py)
    with Registry(tls=True) as reg:   # HTTPS with a self-signed certificate for 127.0.0.1: reg.url is https://,
        reg.ca_path                   # and reg.ca_path the PEM to trust
    with Registry(proxy="http://127.0.0.1:P") as t1:   # a pull-through cache of that registry (`proxy: remoteurl:`)

A chain of them (origin -> T1 -> T2, each behind a byte-counting proxy) is tests/support/registry_chain.py.

Each instance gets a fresh temporary directory (config.yml, htpasswd, storage, registry.log) under `root`
(default: a new `tempfile.mkdtemp`, removed on exit; a given root is left in place) and a free port. The
context manager returns once `GET /v2/` answers (200, or 401 with auth). The process is stopped (SIGTERM, then
SIGKILL) on exit. Requires /usr/bin/docker-registry (Debian `docker-registry`, `make tools`) and the `bcrypt`
package (test extras) for htpasswd entries.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# the binary: MM_BENCH_REGISTRY_BIN or MM_TEST_REGISTRY_BIN (a docker-registry carried to a host without Debian's
# package), else the Debian package's, else one on PATH
REGISTRY_BIN = (os.environ.get("MM_BENCH_REGISTRY_BIN") or os.environ.get("MM_TEST_REGISTRY_BIN")
                or ("/usr/bin/docker-registry" if os.path.exists("/usr/bin/docker-registry")
                    else shutil.which("docker-registry") or "/usr/bin/docker-registry"))
HOST = "127.0.0.1"


class MissingTool(RuntimeError):
    """docker-registry is not installed (one line: what to install)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def htpasswd_line(user: str, password: str) -> str:
    """One htpasswd entry, bcrypt (the only scheme distribution accepts), cost 4 to keep each request cheap."""
    import bcrypt
    return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4, prefix=b'2a')).decode()}"


class Registry:
    """A docker-registry process on 127.0.0.1:<free port>; see the module docstring."""

    def __init__(self, root: Path | None = None, *, users: dict[str, str] | None = None,
                 start_timeout: float = 20.0, token=None, tls: bool = False, proxy: str | None = None):
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="mm-registry-"))
        self.users = dict(users or {})
        self.port = free_port()
        self.host = f"{HOST}:{self.port}"
        self.token = token
        self.tls = tls
        self.proxy = proxy  # the upstream URL when this registry is a pull-through cache
        self.ca_path: Path | None = None
        self.url = f"{'https' if tls else 'http'}://{self.host}"
        self.storage = self.root / "storage"
        self.config_path = self.root / "config.yml"
        self.log_path = self.root / "registry.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None  # the process's environment (None: this one's)

    # -- files -----------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(parents=True, exist_ok=True)
        config: dict = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)},
                        "delete": {"enabled": True}, "redirect": {"disable": True},
                        "maintenance": {"uploadpurging": {"enabled": False}}},
            "http": {"addr": self.host, "secret": "mm-test-upload-state-secret",
                     "headers": {"X-Content-Type-Options": ["nosniff"]}},
        }
        if self.proxy:
            config["proxy"] = {"remoteurl": self.proxy}
        if self.users:
            htpasswd = self.root / "htpasswd"
            htpasswd.write_text("".join(htpasswd_line(u, p) + "\n" for u, p in self.users.items()))
            config["auth"] = {"htpasswd": {"realm": "mm-test", "path": str(htpasswd)}}
        if self.token is not None:
            config["auth"] = {"token": {"realm": self.token.realm, "service": self.token.service,
                                        "issuer": self.token.issuer, "rootcertbundle": str(self.token.cert_path)}}
        if self.tls:
            from tests.support.tokenserver import self_signed
            cert, key = self_signed(self.root / "tls", HOST, name="registry")
            self.ca_path = cert
            config["http"]["tls"] = {"certificate": str(cert), "key": str(key)}
        # YAML is a superset of JSON: no YAML library needed.
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")

    def blob_path(self, digest: str) -> Path:
        """Where the filesystem driver keeps the blob DIGEST ("sha256:<hex>")."""
        algo, _, hexpart = digest.partition(":")
        return self.storage / "docker" / "registry" / "v2" / "blobs" / algo / hexpart[:2] / hexpart / "data"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- process ---------------------------------------------------------------------------------------------
    def start(self) -> "Registry":
        """Start it on a free port; another process (a parallel test worker) may take that port between the probe
        and the registry's bind, so a start that fails with "address already in use" tries a new port."""
        for attempt in range(5):
            try:
                return self._start_once()
            except RuntimeError as e:
                if "address already in use" not in str(e) or attempt == 4:
                    raise
                self.port = free_port()
                self.host = f"{HOST}:{self.port}"
                self.url = f"{'https' if self.tls else 'http'}://{self.host}"
        raise AssertionError("not reached")

    def _start_once(self) -> "Registry":
        if not os.access(REGISTRY_BIN, os.X_OK):
            raise MissingTool(f"{REGISTRY_BIN} not found: install Debian docker-registry (make tools)")
        self._write_config()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.config_path)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}:\n{self.log_text()[-2000:]}")
            try:
                context = ssl.create_default_context(cafile=str(self.ca_path)) if self.tls else None
                with urllib.request.urlopen(self.url + "/v2/", timeout=2, context=context) as resp:
                    if resp.status == 200:
                        return self
            except urllib.error.HTTPError as err:
                if err.code == 401 and (self.users or self.token is not None):
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not answer on {self.url}/v2/:\n{self.log_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "Registry":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
