"""mm doctor judges the driver as the NVIDIA Container Toolkit does, and says when docker cannot run.

The requirement language is libnvidia-container's (src/cli/dsl.c, src/cli/configure.c); which variables are
requirements is the toolkit hook's (internal/config/image/cuda_image.go). The vectors below follow that source.
Doctor scenarios reuse tests/test_doctor.py's Host: stand-in nvidia-smi and docker, the image record of the
pinned test image saved from the real docker-registry, its config_env set per test.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mm.artifacts.serving import cudareq
from mm.artifacts.serving.docker import DOCKER_DOWN, DOCKER_MISSING
from tests.support import fake_gpu
from tests.support.run import MM_BIN
from tests.test_doctor import Host, saved  # noqa: F401 (the fixture)
from tests.test_launch import VLLM_IMAGE, make_model_dir

H200 = cudareq.Host(cuda="13.0", driver="580.159.03", arch="9.0", brand="Unknown")
CUDA_134_IMAGE = ("cuda>=13.4 brand=unknown,driver>=535,driver<536 brand=tesla,driver>=535,driver<536 "
                  "brand=nvidia,driver>=570,driver<571")


@pytest.mark.parametrize("requirement, held", [
    ("cuda>=13.0", True),
    ("cuda>=13.4", False),
    ("cuda>=13.4 brand=unknown,driver>=580,driver<581", True),  # alternatives are OR'ed: the second holds
    ("cuda>=13.4 brand=tesla,driver>=580,driver<581", False),  # conditions are AND'ed: the brand fails it
    (CUDA_134_IMAGE, False),  # no alternative for a 580 driver
    ("cuda>=13.4 brand=UNKNOWN,driver>=580", True),  # brands compare case-insensitively
    ("driver>=580.159", True), ("driver>580.159.03", False), ("driver=580.159.03.0", True),
    ("arch>=9.0", True), ("arch>=10.0", False), ("cuda!=13.0", False), ("cuda<13.1", True), ("cuda<=13", True),
    ("", True), ("  ", True),
])
def test_requirements_hold_as_libnvidia_container_evaluates_them(requirement, held):
    assert cudareq.satisfied(requirement, H200) is held


@pytest.mark.parametrize("requirement", ["cuda=>13.0", "gpu>=1", "cuda>=", "brand>tesla", "driver>=580a"])
def test_an_expression_libnvidia_container_cannot_parse_is_invalid(requirement):
    with pytest.raises(cudareq.Invalid):
        cudareq.satisfied(requirement, H200)


def test_which_variables_the_toolkit_passes_as_requirements():
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=13.4", "NVIDIA_REQUIRE_ARCH": "arch>=9.0", "NVIDIA_REQUIRE_JETPACK": "x",
           "CUDA_VERSION": "13.4.1"}
    assert cudareq.requirements(env) == ["arch>=9.0", "cuda>=13.4"]
    assert cudareq.requirements({**env, "NVIDIA_DISABLE_REQUIRE": "true"}) == []
    assert cudareq.requirements({**env, "NVIDIA_DISABLE_REQUIRE": "yes"}) != []  # Go's ParseBool: "yes" is no bool
    assert cudareq.requirements({"CUDA_VERSION": "12.9.1"}) == ["cuda>=12.9"]  # a legacy image
    assert cudareq.refusal(CUDA_134_IMAGE) == ("nvidia-container-cli: requirement error: unsatisfied condition: "
                                               "cuda>=13.4, please update your driver to a newer version, or use an "
                                               "earlier cuda container")


# --- doctor ---------------------------------------------------------------------------------------

H200_580 = ("NVIDIA H200", "9.0", "580.159.03")


@pytest.fixture
def host(tmp_path, pinned_image, saved, unused_port) -> Host:  # noqa: F811
    h = Host(tmp_path, pinned_image, saved, unused_port)
    h.load()
    return h


def test_a_cuda_13_0_driver_runs_a_13_4_image_that_asks_for_13_0_with_a_warning(host):
    host.image_env({"NVIDIA_REQUIRE_CUDA": "cuda>=13.0", "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("580.159.03",)], cuda="13.0")
    code, checks = host.checks()
    driver = checks["driver"]
    assert code == 0 and driver["status"] == "warn"
    assert "the container starts (the NVIDIA Container Toolkit's requirement holds)" in driver["detail"]
    assert "CUDA minor-version compatibility runs a 13.x runtime on any driver >= 580" in driver["detail"]
    assert "PTX newer than the driver cannot be JIT-compiled" in driver["detail"] and "cuda-compat" in driver["detail"]


def test_nvidia_disable_require_is_honoured(host):
    host.image_env({"NVIDIA_REQUIRE_CUDA": CUDA_134_IMAGE, "NVIDIA_DISABLE_REQUIRE": "1", "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("580.159.03",)], cuda="13.0")
    code, checks = host.checks()
    assert code == 0 and checks["driver"]["status"] == "warn"
    assert "NVIDIA_DISABLE_REQUIRE is set, so the toolkit checks nothing" in checks["driver"]["detail"]


def test_the_requirement_of_a_13_4_image_refuses_a_13_0_driver(host):
    host.image_env({"NVIDIA_REQUIRE_CUDA": CUDA_134_IMAGE, "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("580.159.03",)], cuda="13.0")
    code, checks = host.checks()
    assert code == 1 and checks["driver"]["status"] == "fail"
    assert "unsatisfied condition: cuda>=13.4" in checks["driver"]["detail"]


def test_without_a_record_the_env_is_read_from_the_archive(host):
    """An older record (no config_env): the archive beside it holds the config; the test image has no NVIDIA_*."""
    record = host.archive.with_name(host.archive.name + ".mm-image.json")
    doc = json.loads(record.read_text())
    doc.pop("config_env", None)
    record.write_text(json.dumps(doc))
    code, checks = host.checks()
    assert checks["driver"]["status"] == "ok" and f"(read from the image archive {host.archive.resolve()})" in checks["driver"]["detail"]


def test_a_vllm_plan_gets_no_sglang_image_rule(tmp_path, pinned_image, saved, unused_port):  # noqa: F811
    host = Host(tmp_path, pinned_image, saved, unused_port)
    host.gpus(8 * [H200_580], cuda="13.0")
    done = subprocess.run([str(MM_BIN), "doctor", str(host.model), "--hardware", "h200", "--engine", "vllm",
                           "--image", VLLM_IMAGE, "--port", str(host.port), "--json"],
                          env=host.env(), capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["driver"]["status"] == "warn" and "13.4" not in checks["driver"]["detail"]
    assert "cannot read the image's NVIDIA_REQUIRE_CUDA" in checks["driver"]["detail"]


def test_doctor_says_docker_is_not_answering_when_debians_docker_info_exits_0(host):
    (host.state / ".store" / "down").write_text("")
    code, checks = host.checks()
    assert code == 1 and checks["docker"]["status"] == "fail"
    assert checks["docker"]["detail"].startswith(DOCKER_DOWN) and "Cannot connect to the Docker daemon" in checks["docker"]["detail"]
    assert "Docker ? answering" not in json.dumps(checks)


def test_doctor_says_docker_is_not_installed(host):
    (host.bin / "docker").unlink()
    env = {**host.env(), "PATH": f"{host.bin}:{Path(os.sys.executable).parent}:/usr/sbin:/sbin:/bin"}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "docker").exists())
    done = subprocess.run([str(MM_BIN), "doctor", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--port", str(host.port), "--json"], env=env, capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["docker"] == {"name": "docker", "status": "fail", "detail": DOCKER_MISSING, "fix": "install Docker Engine"}
    assert done.returncode == 1  # as warm-up and the start script: one code for "no docker here"


def test_doctor_refuses_the_model_directory_launch_refuses(tmp_path, pinned_image, saved, unused_port):  # noqa: F811
    host = Host(tmp_path, pinned_image, saved, unused_port)
    other = make_model_dir(tmp_path / "other", repo_id="someone/Other-Model")
    launched = subprocess.run([str(MM_BIN), "launch", str(other), "--hardware", "b300", "--image", host.ref],
                              env=host.env(), capture_output=True, text=True, timeout=120)
    done = subprocess.run([str(MM_BIN), "doctor", str(other), "--hardware", "b300", "--image", host.ref,
                           "--port", str(host.port), "--json"], env=host.env(), capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert launched.returncode == 7 and checks["model"]["status"] == "fail"
    assert launched.stderr.strip() == f"mm: {checks['model']['detail']}"


def test_the_shm_fix_names_the_guides_size(host):
    code, checks = host.checks()
    if checks["/dev/shm"]["status"] == "warn":  # this machine's /dev/shm is below the guide's 32 GB
        assert checks["/dev/shm"]["fix"].startswith("mount -o remount,size=32G /dev/shm (the guide's --shm-size 32g")
    assert "64G" not in json.dumps(checks)


# --- warm-up and the start script say the same ----------------------------------------------------

def test_warmup_and_the_start_script_say_the_daemon_is_down_not_that_the_image_is_missing(host, tmp_path):
    (host.state / ".store" / "down").write_text("")
    warm = subprocess.run([str(MM_BIN), "warmup", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--port", str(host.port), "--cache-root", str(host.cache)],
                          env=host.env(), capture_output=True, text=True, timeout=120)
    assert warm.returncode == 1 and warm.stderr.startswith(f"mm: {DOCKER_DOWN}") and "not on this host" not in warm.stderr
    script = tmp_path / "start.sh"
    made = subprocess.run([str(MM_BIN), "launch", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--out", str(script)], env=host.env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    started = subprocess.run(["bash", str(script)], env=host.env(), capture_output=True, text=True, timeout=60)
    assert started.returncode == 1 and started.stderr.strip() == f"mm: {DOCKER_DOWN}"


def test_warmup_and_the_start_script_say_docker_is_not_installed(host, tmp_path):
    (host.bin / "docker").unlink()
    path = ":".join(p for p in host.env()["PATH"].split(":") if not (Path(p) / "docker").exists())
    env = {**host.env(), "PATH": path}
    warm = subprocess.run([str(MM_BIN), "warmup", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--port", str(host.port), "--cache-root", str(host.cache)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert warm.returncode == 1 and warm.stderr.strip() == f"mm: {DOCKER_MISSING}"
    script = tmp_path / "start.sh"
    assert subprocess.run([str(MM_BIN), "launch", str(host.model), "--hardware", "b300", "--image", host.ref,
                           "--out", str(script)], env=env, capture_output=True, timeout=120).returncode == 0
    started = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 1 and started.stderr.strip() == f"mm: {DOCKER_MISSING}"


def test_a_12_x_driver_with_a_13_4_runtime_the_toolkit_does_not_check_fails(host):
    """NVIDIA_DISABLE_REQUIRE: the toolkit starts the container, but a 13.x runtime on a 12.x driver crosses a major
    version, which minor-version compatibility does not (NVIDIA CUDA Compatibility): the first CUDA call fails."""
    host.image_env({"NVIDIA_DISABLE_REQUIRE": "1", "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("570.172.08",)], cuda="12.8")
    code, checks = host.checks()
    assert code == 1 and checks["driver"]["status"] == "fail"
    assert "minor-version compatibility does not cross major versions" in checks["driver"]["detail"]


def test_a_runtime_a_major_version_above_the_driver_with_no_requirement_is_a_failure():
    """The pinned image's runtime known (CUDA 13.4), nothing in the image for the toolkit to check: fail, not warn."""
    from mm.artifacts.serving.doctor import FAIL, WARN, _runtime_note
    assert _runtime_note("13.4", "12.8", "570.172.08")[0] == FAIL
    assert _runtime_note("13.4", "13.0", "580.159.03")[0] == WARN  # within 13.x: minor-version compatibility


def test_a_requirement_error_is_the_drivers_failure_not_the_container_runtimes(host, monkeypatch):
    """The toolkit's prestart hook refusing the image proves the toolkit works: only the driver check fails."""
    host.image_env({"NVIDIA_REQUIRE_CUDA": CUDA_134_IMAGE, "CUDA_VERSION": "13.4.1"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("580.159.03",)], cuda="13.0")
    monkeypatch.setenv("FAKE_TOOLKIT_REFUSES", "nvidia-container-cli: requirement error: unsatisfied condition: "
                                               "cuda>=13.4, please update your driver to a newer version, or use an "
                                               "earlier cuda container")
    code, checks = host.checks()
    runtime = checks["nvidia container runtime"]
    assert code == 1 and checks["driver"]["status"] == "fail"
    assert runtime["status"] == "ok" and "requirement error" in runtime["detail"]
    assert "Container Toolkit" not in (runtime["fix"] or "")


def test_a_requirement_error_the_image_env_did_not_show_still_fails_the_driver(host, monkeypatch):
    host.image_env({"CUDA_VERSION": "13.4.1", "NVIDIA_REQUIRE_CUDA": "cuda>=13.0"})
    host.gpus(4 * [fake_gpu.B300[:2] + ("580.159.03",)], cuda="13.0")
    monkeypatch.setenv("FAKE_TOOLKIT_REFUSES", "nvidia-container-cli: requirement error: unsatisfied condition: brand=tesla")
    code, checks = host.checks()
    assert code == 1 and checks["driver"]["status"] == "fail" and "brand=tesla" in checks["driver"]["detail"]
    assert checks["nvidia container runtime"]["status"] == "ok"


def test_mig_mode_on_a_selected_gpu_fails(host):
    host.gpus(4 * [fake_gpu.B300])
    fake_gpu.install(host.bin, 4 * [fake_gpu.B300], mig=["Disabled", "Enabled", "Disabled", "Disabled"])
    code, checks = host.checks()
    assert code == 1 and checks["mig"]["status"] == "fail"
    assert checks["mig"]["detail"].startswith("GPU 1: MIG mode enabled") and "nvidia-smi -i 1 -mig 0" in checks["mig"]["fix"]


def test_mig_mode_off_is_ok(host):
    code, checks = host.checks()
    assert checks["mig"]["status"] == "ok"
