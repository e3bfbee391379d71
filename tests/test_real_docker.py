"""mm on a real container engine: Debian's dockerd, a stand-in SGLang image, the whole offline path.

The image (tests/support/standin_image.py: busybox-static, SGLang's HTTP API and log lines, a failure mode per
troubleshooting row) is built with `docker import`, pushed to the test's docker-registry, then removed from the
daemon, so that what runs is what travelled: `mm image save` from the registry -> `mm bundle --image` -> `mm
unbundle` -> a real `docker load` (the classic store drops the repo digest) -> `mm doctor` -> the start script ->
`mm warmup` (healthy, and each failure mode naming its row with the plan's fix) -> the node script (two replicas
behind the router) -> `mm diagnose --container` on a replica that stopped. The only stand-ins: the docker wrapper
that drops --gpus (tests/support/dockerd.py) and nvidia-smi on the host (tests/support/fake_gpu.py).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from mm.artifacts.serving import image as mm_image
from mm.artifacts.serving.diagnose import fix_for, load_table
from mm.artifacts.serving.launch import LaunchOptions
from mm.artifacts.serving.router import plan_node
from tests.support import fake_gpu, standin_image
from tests.support.run import MM_BIN
from tests.test_launch import make_model_dir

IMAGE_ENV = {"NVIDIA_REQUIRE_CUDA": "cuda>=13.0", "CUDA_VERSION": "13.4.1"}  # what the stand-in image declares
DRIVER_580 = ("NVIDIA B300 SXM6 AC", "10.3", "580.159.03")
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployed:
    env: dict
    ref: str  # REPO@sha256:... as pushed: what the launch line names
    image_id: str
    model: Path  # the unbundled model directory
    archive: Path  # the unbundled image archive
    root: Path

    def mm(self, *args, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(MM_BIN), *map(str, args)], env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)

    def docker(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def deployed(real_docker, registry, tmp_path_factory) -> Deployed:
    root = tmp_path_factory.mktemp("real-docker")
    env = dict(real_docker.env)
    fake_gpu.install(root / "gpu-bin", 4 * [DRIVER_580], cuda="13.0")  # the host's driver: CUDA 13.0, 580.159
    env["PATH"] = f"{env['PATH']}:{root / 'gpu-bin'}"
    repo = f"{registry.host}/lmsysorg/sglang"
    image_id = standin_image.build(real_docker, f"{repo}:standin", IMAGE_ENV)
    pushed = subprocess.run(["docker", "push", f"{repo}:standin"], env=env, capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    digest = next(w for w in pushed.stdout.split() if w.startswith("sha256:"))
    ref = f"{repo}@{digest}"
    assert subprocess.run(["docker", "rmi", "-f", f"{repo}:standin", image_id], env=env, capture_output=True).returncode == 0
    run = Deployed(env, ref, image_id, Path(), Path(), root)
    archive = root / "connected" / "sglang.tar"
    saved = run.mm("image", "save", ref, "--platform", "linux/amd64", "--out", archive, "--insecure-registry")
    assert saved.returncode == 0, saved.stderr
    model = make_model_dir(root / "connected" / "models")
    vols = root / "volumes"
    bundled = run.mm("bundle", model, "--out", vols, "--volume-size", "64M", "--image", archive, "--image-ref", ref,
                     "--insecure-registry")
    assert bundled.returncode == 0, bundled.stderr
    run.model = root / "host" / "MiniMax-M3.1-Flash"
    unbundled = run.mm("unbundle", vols, "--dest", run.model)
    assert unbundled.returncode == 0, unbundled.stderr
    run.archive = run.model.with_name(run.model.name + ".payload") / "image" / "sglang.tar"
    loaded = run.docker("load", "-i", str(run.archive))
    assert loaded.returncode == 0, loaded.stderr
    return run


def wait_health(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"/health on 127.0.0.1:{port} never answered 200"
        time.sleep(0.3)


def chat(port: int) -> dict:
    body = json.dumps({"model": "/models/MiniMax-M3.1-Flash", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with _opener.open(request, timeout=10) as r:
        return json.loads(r.read())


def test_the_image_travels_by_identity_and_the_classic_store_drops_its_digest(deployed):
    record = mm_image.read_record(mm_image.record_path(deployed.archive))
    assert record.chain.config == deployed.image_id and record.env == IMAGE_ENV  # read from the image's own config
    assert deployed.docker("image", "inspect", deployed.ref).returncode != 0  # moby#22011, on the real daemon
    assert deployed.docker("image", "inspect", deployed.image_id).returncode == 0


def test_doctor_on_the_real_daemon_judges_the_driver_by_the_images_own_requirement(deployed):
    done = deployed.mm("doctor", deployed.model, "--hardware", "b300", "--image", deployed.ref, "--port", free_port(),
                       "--cache-root", deployed.root / "doctor-cache", "--json")
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["docker"]["status"] == "ok" and checks["docker"]["detail"].startswith("Docker 20.10")
    assert checks["image"]["detail"].endswith(f"by the image ID mm image save recorded (the repo digest did not "
                                              f"survive the load): {deployed.image_id}")
    assert checks["nvidia container runtime"]["detail"] == "the image's nvidia-smi sees 4 GPU(s)"
    driver = checks["driver"]
    assert driver["status"] == "warn" and "NVIDIA_REQUIRE_CUDA=cuda>=13.0" in driver["detail"]
    assert "the container starts (the NVIDIA Container Toolkit's requirement holds)" in driver["detail"]
    assert "runs a 13.x runtime on any driver >= 580" in driver["detail"]
    assert checks["model"]["status"] == "ok" and done.returncode == 0, done.stdout


def test_doctor_says_the_real_daemon_is_not_answering(deployed, real_docker):
    """The real client against a socket nobody serves (the wrapper, which names the test daemon, left out)."""
    path = [p for p in deployed.env["PATH"].split(":") if p != str(real_docker.bin)]
    env = {**deployed.env, "DOCKER_HOST": f"unix://{deployed.root}/nobody.sock", "PATH": ":".join(path)}
    done = deployed.mm("doctor", deployed.model, "--hardware", "b300", "--image", deployed.ref, "--json", env=env)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert done.returncode == 1 and checks["docker"]["detail"].startswith("the docker daemon is not answering")
    assert "Cannot connect to the Docker daemon" in checks["docker"]["detail"]


def test_the_start_script_finds_the_image_by_id_and_serves(deployed, tmp_path):
    port, name = free_port(), f"mm-single-{free_port()}"
    script = tmp_path / "start.sh"
    made = deployed.mm("launch", deployed.model, "--hardware", "b300", "--image", deployed.ref, "--port", port,
                       "--cache-root", tmp_path / "cache", "--name", name, "--out", script)
    assert made.returncode == 0, made.stderr
    proc = subprocess.Popen(["bash", str(script)], env=deployed.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_health(port)
        assert chat(port)["choices"][0]["message"]["content"].startswith("The stand-in answers")
        assert deployed.docker("stop", name).returncode == 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert (tmp_path / "cache" / "minfer").is_dir()  # the MSA cache mount, compiled into


def warmup(deployed: Deployed, cache: Path, *extra, port: int | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    done = deployed.mm("warmup", deployed.model, "--hardware", "b300", "--image", deployed.ref, "--port",
                       port or free_port(), "--cache-root", cache, *extra)
    return done, json.loads((cache / "mm-warmup-report.json").read_text())


def test_a_healthy_warmup_passes_every_check_and_writes_the_cache_key(deployed, tmp_path):
    done, report = warmup(deployed, tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["ok"] and report["diagnosis"] == []
    assert [c["name"] for c in report["checks"]] == ["text", "thinking-disabled", "image", "nvfp4-qmul4", "dspark-draft"]
    key = json.loads((tmp_path / "cache" / "mm-cache-key.json").read_text())
    assert (key["gpu"], key["gpu_count"], key["image"]) == ("NVIDIA B300 SXM6 AC", 4, deployed.ref)


@pytest.mark.parametrize("mode", sorted(standin_image.MODES))
def test_each_failure_mode_fails_the_warmup_naming_its_row_with_the_plans_fix(deployed, tmp_path, mode):
    cache = tmp_path / "cache"
    (cache / "sglang").mkdir(parents=True)
    (cache / "sglang" / "standin-mode").write_text(mode)
    timeout = ("--timeout", "4") if mode in standin_image.NEVER_READY else ()
    port = free_port()
    done, report = warmup(deployed, cache, *timeout, port=port)
    assert done.returncode == 1 and not report["ok"]
    expect = standin_image.MODES[mode]
    assert [f["row"] for f in report["diagnosis"]] == [expect], report
    plan = plan_node(deployed.model, LaunchOptions(hardware="b300", image=deployed.ref, cache_root=cache, port=port),
                     check_dir=False).first
    assert report["diagnosis"][0]["fix"] == fix_for(load_table().row(expect), plan, "sglang")
    assert f"row {load_table().row(expect).guide_row} {expect}" in done.stdout


def node_script(deployed: Deployed, tmp_path: Path) -> tuple[Path, str, int]:
    name, router_port = f"mm-node-{free_port()}", free_port()
    script = tmp_path / "node.sh"
    made = deployed.mm("launch", deployed.model, "--hardware", "b300", "--image", deployed.ref, "--gpus",
                       "0,1,2,3,4,5,6,7", "--port", router_port, "--replica-ports", f"{free_port()},{free_port()}",
                       "--metrics-port", free_port(), "--cache-root", tmp_path / "cache", "--name", name, "--out", script)
    assert made.returncode == 0, made.stderr
    return script, name, router_port


def test_the_node_script_runs_two_replicas_behind_the_router(deployed, tmp_path):
    script, name, port = node_script(deployed, tmp_path)
    proc = subprocess.Popen(["bash", str(script)], env=deployed.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_health(port, timeout=60)
        assert chat(port)["choices"][0]["message"]["content"].startswith("The stand-in answers")
        running = deployed.docker("ps", "--format", "{{.Names}}").stdout.split()
        assert {f"{name}-0", f"{name}-1", f"{name}-router"} <= set(running)
        assert deployed.docker("stop", f"{name}-router").returncode == 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"{name}-0 ready on 127.0.0.1" in err and f"{name}-1 ready on 127.0.0.1" in err
    states = deployed.docker("ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}} {{.State}}").stdout
    assert sorted(states.split("\n")[:-1]) == [f"{name}-0 exited", f"{name}-1 exited", f"{name}-router exited"]


def test_a_replica_that_dies_is_diagnosed_from_its_stopped_container(deployed, tmp_path):
    script, name, _ = node_script(deployed, tmp_path)
    (tmp_path / "cache" / "sglang").mkdir(parents=True)
    (tmp_path / "cache" / "sglang" / "standin-mode").write_text("oom")
    started = subprocess.run(["bash", str(script)], env=deployed.env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 1
    assert f"mm: {name}-0 exited before /health answered; read its log: mm diagnose --container {name}-0" in started.stderr
    done = deployed.mm("diagnose", "--container", f"{name}-0", "--model-dir", deployed.model, "--hardware", "b300",
                       "--image", deployed.ref, "--cache-root", tmp_path / "cache", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 1 and [f["row"] for f in doc["findings"]] == ["cuda-oom"]
    assert doc["findings"][0]["where"] == f"docker logs {name}-0"
    assert "recipe sglang/b300/balanced runs --mem-fraction-static 0.8" in doc["findings"][0]["fix"]
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
