"""The real container engine for tests: Debian's docker.io daemon on a private socket.

    with Dockerd(tmp) as engine:
        engine.env          # the environment for mm and the tests: PATH starts with engine.bin (the docker wrapper)
        engine.docker("ps") # the real client through the wrapper

The daemon runs as root (the tests run as root, as CI does): `dockerd --storage-driver vfs --iptables=false
--ip-masq=false --bridge mmbrXXXX` with its socket, data root, exec root and pid file under temporary directories,
so it never touches the host's docker (none need run). Only one daemon may own docker0, so each gets a bridge of its
own, made here with `ip link` on a free 10.x.y.0/24 and deleted on stop; `-p 127.0.0.1:P:P` publishing goes through
docker-proxy (the userland proxy), which needs no iptables.

The one stand-in: `engine.bin/docker`, a wrapper that drops docker's GPU request (there is no GPU here) and passes
the device list on as NVIDIA_VISIBLE_DEVICES, which is what the NVIDIA runtime would set; everything else goes to the
real client unchanged. Requires dockerd, docker, ip (Makefile: docker.io, iproute2).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DOCKERD = "dockerd"
# Debian's docker.io client (20.10, like the daemon); another docker on PATH (a newer client) also works
REAL_DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else (shutil.which("docker") or "docker")

WRAPPER = """#!/bin/sh
# Test stand-in for the GPU request only: docker's --gpus needs the NVIDIA runtime and a GPU, which this machine
# lacks. It is dropped and its device list handed to the container as NVIDIA_VISIBLE_DEVICES (what the NVIDIA
# runtime sets); every other argument reaches the real docker client unchanged.
export DOCKER_HOST={host}
skip=
for a in "$@"; do
  shift
  if [ -n "$skip" ]; then
    skip=
    set -- "$@" -e "NVIDIA_VISIBLE_DEVICES=$(printf '%s' "$a" | tr -cd '0-9,')"
    continue
  fi
  case "$a" in
    --gpus) skip=1 ;;
    --gpus=*) set -- "$@" -e "NVIDIA_VISIBLE_DEVICES=$(printf '%s' "${{a#--gpus=}}" | tr -cd '0-9,')" ;;
    *) set -- "$@" "$a" ;;
  esac
done
exec {docker} "$@"
"""


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 60), **kw)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even killed (no teardown), so that no daemon
    outlives the session (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def stop_daemon(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after TIMEOUT seconds: a daemon's own shutdown first."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def unmount_under(*roots: Path) -> None:
    """What a daemon left mounted under ROOTS, deepest first."""
    prefixes = tuple(str(root) + "/" for root in roots)
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefixes)]
    for point in sorted(points, key=len, reverse=True):
        _run(["umount", "-l", point])


def _free_subnet() -> str:
    used = _run(["ip", "-4", "route"]).stdout
    for _ in range(200):
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the test bridge")


class Dockerd:
    def __init__(self, root: Path, config_file: Path | None = None):
        self.root = Path(root)
        self.config_file = config_file  # a daemon.json (dockerd --config-file); None: dockerd's default
        self.root.mkdir(parents=True, exist_ok=True)
        self.exec_root = Path(tempfile.mkdtemp(prefix="mmd", dir="/tmp"))  # short: containerd's socket lives there
        self.sock = self.exec_root / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.bridge = f"mmbr{random.randrange(16**6):06x}"
        self.bin = self.root / "bin"
        self.log_path = self.root / "dockerd.log"
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "DOCKER_HOST": self.host,
                    "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def start(self) -> "Dockerd":
        if os.geteuid() != 0:
            raise RuntimeError("the real-docker tests start dockerd, which needs root (CI runs make test as root)")
        for tool in (DOCKERD, "ip", REAL_DOCKER):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool}: not installed (make tools installs docker.io and iproute2)")
        net = _free_subnet()
        for argv in (["ip", "link", "add", "name", self.bridge, "type", "bridge"],
                     ["ip", "addr", "add", f"{net}.1/24", "dev", self.bridge], ["ip", "link", "set", self.bridge, "up"]):
            done = _run(argv)
            if done.returncode != 0:
                self.stop()
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "docker"
        wrapper.write_text(WRAPPER.format(host=self.host, docker=REAL_DOCKER))
        wrapper.chmod(0o755)
        argv = [DOCKERD, "--storage-driver", "vfs", "--iptables=false", "--ip-masq=false", "--bridge", self.bridge,
                "-H", self.host, "--data-root", str(self.root / "data"), "--exec-root", str(self.exec_root),
                "--pidfile", str(self.exec_root / "docker.pid"), "--shutdown-timeout", "3",
                *(["--config-file", str(self.config_file)] if self.config_file else [])]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 90
        while self.docker("version", "--format", "{{.Server.Version}}").returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"dockerd did not answer on {self.host}:\n{tail}")
            time.sleep(0.2)
        return self

    def docker(self, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return _run([REAL_DOCKER, *args], env={**os.environ, "DOCKER_HOST": self.host}, timeout=timeout, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            ids = self.docker("ps", "-aq").stdout.split()
            if ids:
                self.docker("rm", "-f", *ids)
            stop_daemon(self.proc)
        self.proc = None
        _run(["ip", "link", "delete", self.bridge])
        unmount_under(self.exec_root, self.root / "data")  # its default network namespace (nsfs)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        shutil.rmtree(self.root / "data", ignore_errors=True)

    def __enter__(self) -> "Dockerd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
