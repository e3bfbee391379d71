"""The real containerd for tests: Debian's `containerd` on a private socket, with `ctr` as its client.

    with Containerd(tmp, hosts_dir=fleet / "containerd/certs.d") as cd:
        cd.ctr("images", "pull", "--hosts-dir", str(cd.hosts_dir), "--plain-http", ref)
        cd.ctr("images", "ls")

Each instance has its own root, state directory, socket (under a short /tmp directory: a unix socket path is at most
107 bytes) and config.toml, so it never touches the host's containerd (none need run). The config sets the CRI
plugin's registry config_path to HOSTS_DIR (containerd docs/hosts.md), the same directory `ctr --hosts-dir` reads,
and the `native` snapshotter (plain copies: no overlay mount is needed inside a test container). It runs as root, as
CI runs the tests. Requires containerd and ctr (Makefile: containerd).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.dockerd import _die_with_parent, stop_daemon, unmount_under

NAMESPACE = "mm-test"

CONFIG = """version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{sock}"

[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "{hosts_dir}"

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "native"
"""


class Containerd:
    def __init__(self, root: Path, hosts_dir: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hosts_dir = Path(hosts_dir)
        self.state = Path(tempfile.mkdtemp(prefix="mmc", dir="/tmp"))
        self.sock = self.state / "containerd.sock"
        self.config_path = self.root / "config.toml"
        self.log_path = self.root / "containerd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Containerd":
        if os.geteuid() != 0:
            raise RuntimeError("the containerd tests start containerd, which needs root (CI runs make test as root)")
        for tool in ("containerd", "ctr"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool}: not installed (make tools installs containerd)")
        self.config_path.write_text(CONFIG.format(root=self.root / "data", state=self.state / "state", sock=self.sock,
                                                  hosts_dir=self.hosts_dir))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(["containerd", "--config", str(self.config_path)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 60
        while self.ctr("version").returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"containerd did not answer on {self.sock}:\n{tail}")
            time.sleep(0.2)
        return self

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", str(self.sock), "--namespace", NAMESPACE, *args],
                              capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_daemon(self.proc)
        self.proc = None
        unmount_under(self.state, self.root)
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.root / "data", ignore_errors=True)

    def __enter__(self) -> "Containerd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
