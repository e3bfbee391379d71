"""mm doctor: one line per check with its fix, --json, exit 1 on a failed check (0 with warnings).

Stand-ins on PATH: nvidia-smi (tests/support/fake_gpu.py) and docker with a classic image store
(tests/support/fake_docker.py); the image is the pinned test image saved from the real docker-registry.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from mm.artifacts.serving import image as mm_image
from tests.support.run import MM_BIN
from tests.support import fake_docker, fake_gpu
from tests.test_launch import make_model_dir

RECIPE = "sglang/b300/balanced"


@pytest.fixture(scope="module")
def saved(pinned_image, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("img") / "sglang.tar"
    mm_image.save_image(pinned_image.ref, out, "linux/amd64", tls_verify=False)
    return out


class Host:
    """A destination host: the unbundled model and image payload, stand-in GPUs and docker, a cache root."""

    def __init__(self, root: Path, pinned_image, saved: Path, port: int):
        self.root, self.ref, self.port = root, pinned_image.ref, port
        self.image_id = pinned_image.image.platforms["linux/amd64"].config
        self.model = make_model_dir(root / "models")
        self.payload = self.model.with_name(self.model.name + ".payload") / "image"
        self.payload.mkdir(parents=True)
        self.archive = self.payload / saved.name
        shutil.copy(saved, self.archive)
        shutil.copy(mm_image.record_path(saved), mm_image.record_path(self.archive))
        self.bin, self.state = root / "bin", root / "docker-state"
        self.cache = root / "cache"
        self.gpus(4 * [fake_gpu.B300])
        fake_docker.install(self.bin, self.state, store="classic")
        self.cache_key()

    def image_env(self, env: dict) -> None:
        """The image's NVIDIA_*/CUDA_* environment as `mm image save` recorded it."""
        record = mm_image.record_path(self.archive)
        doc = json.loads(record.read_text())
        record.write_text(json.dumps({**doc, "config_env": env}))

    def gpus(self, gpus, cuda: str = "13.4") -> None:
        fake_gpu.install(self.bin, gpus, cuda)

    def cache_key(self, **changes) -> None:
        self.cache.mkdir(exist_ok=True)
        name, cc, driver = fake_gpu.B300
        key = {"schema": "mm-cache-key/1", "gpu": name, "compute_capability": cc, "driver": driver, "image": self.ref,
               "recipe": RECIPE, "gpu_count": 4, **changes}
        (self.cache / "mm-cache-key.json").write_text(json.dumps(key))

    def env(self) -> dict:
        return {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "FAKE_GPU_INFO": ", ".join(fake_gpu.B300)}

    def docker(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env(), capture_output=True, text=True, timeout=60)

    def load(self, archive: Path | None = None) -> None:
        assert self.docker("load", "-i", str(archive or self.archive)).returncode == 0

    def doctor(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(MM_BIN), "doctor", str(self.model), "--hardware", "b300", "--image", self.ref,
                               "--port", str(self.port), "--cache-root", str(self.cache), *extra],
                              env=self.env(), capture_output=True, text=True, timeout=120)

    def checks(self, *extra: str) -> tuple[int, dict[str, dict]]:
        done = self.doctor("--json", *extra)
        doc = json.loads(done.stdout)
        return done.returncode, {c["name"]: c for c in doc["checks"]}


@pytest.fixture
def host(tmp_path, pinned_image, saved, unused_port) -> Host:
    h = Host(tmp_path, pinned_image, saved, unused_port)
    h.load()
    return h


def test_healthy_host(host):
    done = host.doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].endswith("ready to start") and f"({RECIPE})" in lines[-1]
    code, checks = host.checks()
    assert code == 0
    expected_ok = ["gpu count", "gpu model", "compute capability", "driver", "docker", "image",
                   "nvidia container runtime", "port", "host memory", "kernel cache key", "model"]
    assert [n for n in expected_ok if checks[n]["status"] != "ok"] == []
    assert checks["driver"]["detail"] == (
        f"driver 590.48.01 (CUDA 13.4) with {host.ref}: no NVIDIA_REQUIRE_* variable (read from the image record "
        f"{mm_image.record_path(host.archive).resolve()}): the container starts (the NVIDIA Container Toolkit's "
        f"requirement holds)")
    assert checks["image"]["detail"].startswith(f"{host.ref} present by the image ID mm image save recorded")
    assert checks["nvidia container runtime"]["detail"] == "the image's nvidia-smi sees 4 GPU(s)"
    assert all(c["status"] in ("ok", "warn") for c in checks.values())  # /dev/shm, cache disk: this machine's sizes
    assert len(lines) == len(checks) + 1


def test_wrong_gpu(host):
    host.gpus(4 * [fake_gpu.H100])
    code, checks = host.checks()
    assert code == 1
    assert checks["gpu model"]["status"] == "fail"
    assert checks["gpu model"]["detail"] == f"GPU 0 is NVIDIA H100 80GB HBM3; recipe {RECIPE} is for B300"
    assert checks["gpu model"]["fix"] == "use the recipe for this GPU: mm doctor/launch ... --hardware h100"
    text = host.doctor().stdout
    assert "FAIL gpu model: GPU 0 is NVIDIA H100 80GB HBM3" in text and "-> fix: use the recipe" in text
    assert text.strip().splitlines()[-1].endswith("NOT ready")


def test_too_few_gpus(host):
    host.gpus(2 * [fake_gpu.B300])
    code, checks = host.checks()
    assert code == 1
    assert checks["gpu count"]["detail"] == f"recipe {RECIPE} runs on 4 GPUs (--gpus 0,1,2,3); nvidia-smi shows 2 (0, 1)"


def test_a_driver_the_images_requirement_refuses_fails_with_the_toolkits_own_message(host):
    host.image_env({"NVIDIA_REQUIRE_CUDA": "cuda>=13.4 brand=tesla,driver>=535,driver<536", "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300], cuda="12.8")
    code, checks = host.checks()
    assert code == 1 and checks["driver"]["status"] == "fail"
    assert checks["driver"]["detail"].endswith(
        "the container will not start: nvidia-container-cli: requirement error: unsatisfied condition: cuda>=13.4, "
        "please update your driver to a newer version, or use an earlier cuda container")
    assert checks["driver"]["fix"].startswith("install a driver that satisfies cuda>=13.4")


def test_no_image(tmp_path, pinned_image, saved, unused_port):
    host = Host(tmp_path, pinned_image, saved, unused_port)  # nothing loaded
    code, checks = host.checks()
    assert code == 1
    assert checks["image"]["detail"] == f"{host.ref} (image ID {host.image_id}) is not on this host"
    assert checks["image"]["fix"] == f"docker load -i {host.archive.resolve()}"
    assert checks["nvidia container runtime"]["status"] == "warn"  # registered, not tried without the image


def test_wrong_image(tmp_path, pinned_image, other_image, saved, unused_port):
    host = Host(tmp_path, pinned_image, saved, unused_port)
    tag = json.loads(mm_image.record_path(host.archive).read_text())["archive"]["tag"]
    wrong = tmp_path / "wrong.tar"  # another image carrying the tag mm image save gave the pinned one
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{other_image.layout}:dev", f"docker-archive:{wrong}:{tag}"],
                   check=True, capture_output=True)
    host.load(wrong)
    code, checks = host.checks()
    assert code == 1
    other_id = other_image.platforms["linux/amd64"].config
    assert checks["image"]["detail"] == (f"wrong image: {tag} is {other_id}, but the pinned image is {host.ref} "
                                         f"(image ID {host.image_id})")


def test_busy_port(host):
    with socket.socket() as s:
        s.bind(("127.0.0.1", host.port))
        s.listen()
        code, checks = host.checks()
    assert code == 1
    assert checks["port"]["detail"].startswith(f"127.0.0.1:{host.port} is in use")
    assert "--port" in checks["port"]["fix"]


def test_stale_cache_key_warns_that_the_first_start_compiles(host):
    host.cache_key(driver="580.65.06")
    code, checks = host.checks()
    assert code == 0  # a warning, not a failure
    assert checks["kernel cache key"]["status"] == "warn"
    assert checks["kernel cache key"]["detail"].startswith(
        "caches built for another driver '580.65.06' (this host: '590.48.01'): the first start compiles every kernel")


def test_missing_draft_and_damaged_model_fail(host):
    shutil.rmtree(host.model / "dspark")
    code, checks = host.checks()
    assert code == 1
    assert checks["model"]["status"] == "fail" and "uses DSpark" in checks["model"]["detail"]


def test_no_nvidia_smi(host):
    (host.bin / "nvidia-smi").unlink()
    env = host.env()
    env["PATH"] = f"{host.bin}:/usr/bin:/bin"
    done = subprocess.run([str(MM_BIN), "doctor", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--port", str(host.port), "--json"], env=env, capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert done.returncode == 1 and checks["gpus"]["detail"] == "nvidia-smi: not found"


@pytest.mark.parametrize("bad", [b"[" * 100_000 + b"]" * 100_000, b'{"gpu": NaN}', b"\xff", b"[1]"])
def test_a_hostile_cache_key_is_named_unreadable_not_a_crash(host, bad):
    """The key is read like every file mm reads: deep nesting, NaN, bytes that are not UTF-8 or a
    list warn that the first start compiles; doctor still answers every other check."""
    (host.cache / "mm-cache-key.json").write_bytes(bad)
    done = host.doctor("--json")
    assert "Traceback" not in done.stderr and done.returncode == 0, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["kernel cache key"]["status"] == "warn" and "unreadable" in checks["kernel cache key"]["detail"]
