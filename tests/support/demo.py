"""`make demo`: the whole journey against a small MiniMax-shaped model served on 127.0.0.1.

A local Hub server (real git repo, LFS objects, the HTTP API huggingface_hub speaks) stands in for
huggingface.co; every step runs the real `mm` command as a user would and shows its output.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from tests.support.fake_docker import install as install_fake_docker
from tests.support.registry import REGISTRY_BIN, MissingTool, Registry

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "demo-work"
REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
MM = str(Path(sys.executable).parent / "mm")
# What the demo runs besides Python, mm and the coreutils, with the Debian package of each: `make demo` installs
# them (the Makefile's DEMO_TOOLS and DEMO_TOOL_PACKAGES); tests/test_demo.py keeps these equal to what this code
# and the servers it starts run.
NEEDS = {"git": "git", "docker-registry": "docker-registry", "ip": "iproute2"}


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(args: list[str], env: dict, ok_codes: tuple[int, ...] = (0,), cwd: Path | None = None,
        capture: bool = False) -> subprocess.CompletedProcess:
    """Run one step as a user would: its output goes straight to this terminal (progress bars, and stdout and
    stderr in the order mm printed them); capture=True keeps it to read (then printed after the step)."""
    shown = " ".join(shlex.quote(str(a)) for a in args).replace(MM, "mm").replace(str(ROOT) + "/", "")
    print(f"$ {shown}", flush=True)
    proc = subprocess.run([str(a) for a in args], env=env, cwd=cwd, text=True, capture_output=capture)
    if capture:
        sys.stdout.write(proc.stdout)
        sys.stdout.write(proc.stderr)
    if proc.returncode not in ok_codes:
        raise SystemExit(f"demo step failed with exit code {proc.returncode}: {shown}")
    return proc


def start_server(stack: ExitStack, module: str, *args: str) -> str:
    """Start one of tests/support's local servers as its own process; return the URL it prints."""
    proc = subprocess.Popen([sys.executable, "-m", f"tests.support.{module}", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    stack.callback(lambda: (proc.terminate(), proc.wait()))
    match = re.match(r"\w+_URL=(\S+)", proc.stdout.readline())
    if not match:
        raise SystemExit(f"the local {module} did not start")
    return match.group(1)


MS_ID = "MiniMax/MiniMax-M3.1-Flash"


def make_mirror_copy(model: Path) -> Path:
    """What a real mirror looks like: the same weights, its own README, an extra configuration.json."""
    mirror = WORK / "modelscope-mirror"
    shutil.copytree(model, mirror, ignore=shutil.ignore_patterns(".mm"))
    (mirror / "README.md").write_text("# MiniMax-M3.1-Flash (ModelScope)\n")
    (mirror / "configuration.json").write_text('{"framework": "pytorch", "task": "text-generation"}\n')
    return mirror


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_tools() -> list[str]:
    """NEEDS that are not installed here, each with its package (sbin directories included: `ip` lives there)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = {"docker-registry": lambda: os.access(REGISTRY_BIN, os.X_OK)}
    return [f"{tool} (Debian package {package})" for tool, package in NEEDS.items()
            if not found.get(tool, lambda: shutil.which(tool, path=path))()]


def main() -> int:
    missing = missing_tools()
    if missing:
        raise SystemExit(f"demo: not installed: {', '.join(missing)}; `make demo` installs them (apt-get, as root)")
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    model = WORK / "models" / "MiniMax-M3.1-Flash"
    with ExitStack() as stack:
        say("A local Hub on 127.0.0.1 serves a small model shaped like MiniMax-M3.1-Flash (MXFP8 + NVFP4 + dspark/)")
        url = start_server(stack, "hubserver", "--root", str(WORK / "hub"), "--make-model", REPO,
                           "--shards", "4", "--shard-bytes", str(2 * 1024 * 1024))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_"))}
        env.update(HF_ENDPOINT=url, HF_HOME=str(WORK / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   NO_PROXY="127.0.0.1,localhost", MODELSCOPE_CACHE=str(WORK / "ms-cache"),
                   MODELSCOPE_HOME=str(WORK / "ms-home"))
        commit = subprocess.run(["git", "-C", str(WORK / "hub" / REPO), "rev-parse", "main"], capture_output=True,
                                text=True, check=True).stdout.strip()
        print(f"Hub: {url}   repo {REPO}   main = {commit}")

        say("mm fetch: resolve a short sha once, download in parallel, check every file against the Hub")
        run([MM, "fetch", REPO, "--revision", commit[:7], "--local-dir", model], env)
        say("mm fetch again: nothing to download, everything already proven")
        run([MM, "fetch", REPO, "--revision", commit[:7], "--local-dir", model], env)
        say("mm manifest export: checksums that standard tools accept")
        run([MM, "manifest", "export", model], env)
        run(["sha256sum", "--quiet", "-c", ".mm/SHA256SUMS"], env, cwd=model)
        print("sha256sum -c: all files OK")

        say("mm verify: every byte against the manifest, every shard's structure and index")
        run([MM, "verify", model], env)
        say("A shard is damaged on disk (one flipped byte): verify names it, repair re-fetches only it")
        shard = model / "model-00003-of-00004.safetensors"
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        run([MM, "verify", model], env, ok_codes=(1,))
        run([MM, "repair", model], env)

        say("ModelScope mirror (local, 127.0.0.1): reconcile by content, then fetch what matches from it")
        mirror_files = make_mirror_copy(model)
        ms_url = start_server(stack, "msserver", "--model-id", MS_ID, "--dir", str(mirror_files))
        ms_env = dict(env, MODELSCOPE_ENDPOINT=ms_url, MODELSCOPE_DOWNLOAD_INTRA_CLOUD="false")
        run([MM, "mirror", "reconcile", REPO, "--revision", commit, "--modelscope-id", MS_ID], ms_env)
        from_mirror = WORK / "models" / "from-mirror"
        run([MM, "fetch", REPO, "--revision", commit, "--source", "modelscope", "--local-dir", from_mirror], ms_env)
        run([MM, "verify", "--quick", from_mirror], ms_env)

    offline = {k: v for k, v in env.items() if k != "HF_ENDPOINT"}
    offline.update(HF_HUB_OFFLINE="1")
    say("The Hub is gone from here on. mm bundle: volumes sized to the media, each checkable on its own")
    volumes = WORK / "volumes"
    run([MM, "bundle", model, "--out", volumes, "--volume-size", "3M", "--name", "minimax", "--no-mm"], offline)
    run(["ls", "-l", volumes], offline)
    say("mm bundle verify at the destination, before import (one disk not yet arrived)")
    vols = sorted(volumes.glob("*.tar"))
    run([MM, "bundle", "verify", *vols[:-1]], offline)
    say("mm unbundle: disks arrive one at a time, in any order")
    restored = WORK / "airgap" / "MiniMax-M3.1-Flash"
    run([MM, "unbundle", *reversed(vols[:-1]), "--dest", restored], offline)
    run([MM, "unbundle", vols[-1], "--dest", restored], offline)
    run([MM, "verify", restored], offline)

    say("The site's OCI registry (docker-registry on 127.0.0.1): mm push once, then mm pull on every node")
    with Registry(WORK / "registry") as registry:
        ref = f"{registry.host}/models/minimax-m3.1-flash"
        run([MM, "push", restored, ref], offline)
        run([MM, "pull", "--list", f"{ref}:{commit[:12]}"], offline)
        node2 = WORK / "node2" / "MiniMax-M3.1-Flash"
        run([MM, "pull", f"{ref}:{commit[:12]}", "--local-dir", node2], offline)

    say("mm launch: the matching offline start (4 x B300, Balanced recipe, DSpark)")
    script = WORK / "airgap" / "start-minimax.sh"
    run([MM, "launch", restored, "--hardware", "b300", "--out", script], offline)
    print(script.read_text())
    say("mm warmup: start once, compile kernel caches, run the guide's checks (a stand-in `docker` serves here)")
    docker_bin = WORK / "fake-docker-bin"
    install_fake_docker(docker_bin, WORK / "fake-docker-state")
    warm_env = dict(offline, PATH=f"{docker_bin}:{offline.get('PATH', '')}")
    run([MM, "warmup", restored, "--hardware", "b300", "--port", str(free_port()), "--timeout", "60"], warm_env)

    airgap_host(model, offline)

    say("Done. Everything after `mm fetch` works with no network at all.")
    return 0


AIRGAP_HOST = r"""
set -eu
ip link set lo up 2>/dev/null || true   # the host's own loopback; no other interface exists in this namespace
cd "$DISK1"
sh install-mm.sh "$VENV"
"$VENV/bin/mm" bundle verify "$DISK1" "$DISK2"
"$VENV/bin/mm" unbundle "$DISK1" "$DISK2" --dest "$DEST"
"$VENV/bin/mm" doctor "$DEST" --hardware b300 --port "$PORT"
"""


def airgap_host(model: Path, env: dict) -> None:
    """mm itself crosses too: a bundle with mm's wheelhouse, then a host with no network (`unshare -n`) installs
    mm from the first disk alone and checks itself with `mm doctor` (stand-in nvidia-smi and docker)."""
    say("mm bundle carries mm itself: install-mm.sh and a locked wheelhouse, whole in volume 1")
    vols = WORK / "volumes-with-mm"
    build_env = dict(env, MM_BUNDLE_NO_MM="0")
    probe = run([MM, "bundle", model, "--out", vols, "--volume-size", "1M", "--name", "minimax"], build_env,
                ok_codes=(3,), capture=True)
    minimum = re.search(r"use --volume-size (\d+M)", probe.stderr)
    run([MM, "bundle", model, "--out", vols, "--volume-size", minimum.group(1), "--name", "minimax"], build_env)
    prefix = next((p for p in (["unshare", "-n"], ["unshare", "-rn"])
                   if shutil.which("unshare") and subprocess.run([*p, "true"], capture_output=True).returncode == 0), None)
    if prefix is None:
        say("skipped the host with no network: `unshare -n` is not permitted here (needs root)")
        return
    say("A host with no network at all (unshare -n): copy the volumes, run install-mm.sh, then mm bundle verify, "
        "mm unbundle, mm doctor")
    host = WORK / "airgap-host"
    shutil.rmtree(host, ignore_errors=True)
    volumes = sorted(vols.glob("*.vol*-of-*.tar"))
    for disk, these in (("disk1", volumes[:1]), ("disk2", volumes[1:])):
        (host / disk).mkdir(parents=True)
        for v in these:
            shutil.copy(v, host / disk / v.name)
    shutil.copy(vols / "install-mm.sh", host / "disk1")
    from tests.support import fake_gpu
    stand_ins = host / "stand-ins"
    fake_gpu.install(stand_ins, 4 * [fake_gpu.B300])
    install_fake_docker(stand_ins, host / "docker-state")
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    host_env = {"PATH": f"{stand_ins}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(host), "PYTHON": str(python),
                "DISK1": str(host / "disk1"), "DISK2": str(host / "disk2"), "VENV": str(host / "mm-venv"),
                "DEST": str(host / "models" / "MiniMax-M3.1-Flash"), "PORT": str(free_port()), "LANG": "C.UTF-8"}
    run([*prefix, "sh", "-c", AIRGAP_HOST], host_env, cwd=host)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MissingTool as e:  # a tool gone since the check: one line, never a traceback
        raise SystemExit(f"demo: {e}") from None
    except FileNotFoundError as e:
        raise SystemExit(f"demo: {e.filename}: {e.strerror}") from None
