"""mm warmup end to end against a stand-in `docker` on PATH that starts a real HTTP server on 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import struct
import zlib
from pathlib import Path

import pytest

from mm.artifacts.pins import default_pin
from mm.artifacts.serving.warmup import tiny_png
from tests.support import fake_docker
from tests.support.run import run_mm
from tests.test_launch import HF_SECRET, SECRET, make_model_dir, script_tokens

PIN = default_pin()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture
def docker(tmp_path) -> Path:
    """The fake docker's state directory; its `docker` is first on PATH for mm_env()."""
    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state)
    return state


@pytest.fixture
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warmup(model_dir: Path, docker: Path, port: int, *args, **fake_env):
    env = {"PATH": f"{docker.parent / 'bin'}{os.pathsep}{os.environ['PATH']}", "MM_API_KEY": SECRET, "HF_TOKEN": HF_SECRET,
           "NO_PROXY": "127.0.0.1", **fake_env}
    cache = docker.parent / "cache"
    result = run_mm("warmup", model_dir, "--hardware", "b300", "--port", port, "--cache-root", cache, *args, extra_env=env)
    return result, cache


def calls(docker: Path) -> list[list[str]]:
    return [json.loads(line) for line in (docker / "calls.jsonl").read_text().splitlines()]


def report(cache: Path) -> dict:
    return json.loads((cache / "mm-warmup-report.json").read_text())


def checks(cache: Path) -> dict[str, dict]:
    return {c["name"]: c for c in report(cache)["checks"]}


def assert_container_gone(docker: Path) -> None:
    assert not list(docker.glob("*.json")), "the warm-up container was left behind"
    verbs = [c[0] for c in calls(docker)]
    assert "stop" in verbs and verbs[-1] == "rm"


def test_warmup_good_path_runs_the_guides_checks_and_records_the_cache_key(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port)
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(checks(cache)) == {"text", "thinking-disabled", "image", "nvfp4-qmul4", "dspark-draft"}
    assert all(c["ok"] for c in checks(cache).values()) and report(cache)["ok"] is True
    key = json.loads((cache / "mm-cache-key.json").read_text())
    assert key == {"schema": "mm-cache-key/1", "gpu": "NVIDIA B300 SXM6 AC", "compute_capability": "10.3",
                   "driver": "590.48.01", "image": PIN.image, "recipe": "sglang/b300/balanced", "gpu_count": 4}
    for sub in ("minfer", "sglang", "sglang-jit"):  # the server compiled into the mounted caches
        assert (cache / sub / "fake-kernel.bin").read_bytes() == b"compiled"
    assert_container_gone(docker)
    for text in [(docker.parent / "cache" / n).read_text() for n in ("mm-warmup-report.json", "mm-cache-key.json")]:
        assert SECRET not in text and HF_SECRET not in text


def test_warmup_starts_the_same_command_line_as_launch(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port)
    assert result.returncode == 0, result.stdout + result.stderr
    launched = run_mm("launch", model_dir, "--hardware", "b300", "--port", port, "--cache-root", cache)
    expected = script_tokens(launched.stdout)[2:]  # after `docker run`
    run = next(c for c in calls(docker) if c[0] == "run" and "-d" in c)[1:]
    expected[expected.index("--rm")] = "-d"
    expected[expected.index("--name") + 1] = "mm-warmup-sglang-b300-balanced"
    i = expected.index("-v")
    expected[i:i] = ["-e", "SGLANG_WARMUP_TIMEOUT=1800"]  # first start compiles every kernel
    assert run == expected


def test_warmup_times_out_when_health_never_answers_and_shows_the_log_tail(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port, "--timeout", "1", FAKE_SGLANG_NEVER_READY="1")
    assert result.returncode == 1
    assert f"/health on 127.0.0.1:{port} did not answer within 1s" in result.stderr
    assert "log lines of mm-warmup-sglang-b300-balanced" in result.stderr and '"GET /health HTTP/1.1" 503' in result.stderr
    doc = report(cache)
    assert doc["ok"] is False and "did not answer" in doc["error"] and doc["log_tail"]
    assert not (cache / "mm-cache-key.json").exists()
    assert_container_gone(docker)


def test_warmup_reports_the_slow_path_when_the_qmul4_line_is_missing(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port, FAKE_SGLANG_NVFP4_BACKEND="torch_fallback")
    assert result.returncode == 1
    check = checks(cache)["nvfp4-qmul4"]
    assert check["ok"] is False and "slow path taken" in check["detail"] and "backend=torch_fallback" in check["detail"]
    assert "slow path taken" in result.stderr
    assert all(c["ok"] for name, c in checks(cache).items() if name != "nvfp4-qmul4")
    assert_container_gone(docker)


def test_warmup_fails_when_reasoning_comes_back_with_thinking_disabled(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port, FAKE_SGLANG_REASONING_ALWAYS="1")
    assert result.returncode == 1
    check = checks(cache)["thinking-disabled"]
    assert check["ok"] is False and "although thinking was disabled" in check["detail"]
    assert checks(cache)["text"]["ok"] is True
    assert_container_gone(docker)


def test_warmup_refuses_a_blackwell_recipe_on_hopper_gpus_before_starting(model_dir, docker, port):
    result, cache = warmup(model_dir, docker, port, FAKE_GPU_INFO="NVIDIA H200, 9.0, 580.65.06")
    assert result.returncode == 7
    assert "NVIDIA H200 (compute 9.0)" in result.stderr and "requires Blackwell" in result.stderr
    assert not any(c[0] == "run" and "-d" in c for c in calls(docker))


def test_warmup_sends_a_local_png_file_as_a_data_uri(model_dir, docker, port, tmp_path):
    png = tmp_path / "probe.png"
    png.write_bytes(tiny_png(4, 3))
    result, cache = warmup(model_dir, docker, port, "--image-file", png, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and {c["name"]: c["ok"] for c in doc["checks"]}["image"] is True


def test_warmup_rejects_an_image_file_that_is_not_png(model_dir, docker, port, tmp_path):
    bogus = tmp_path / "probe.png"
    bogus.write_bytes(b"GIF89a")
    result, _ = warmup(model_dir, docker, port, "--image-file", bogus)
    assert result.returncode == 3 and "not a PNG" in result.stderr
    assert not (docker / "calls.jsonl").exists()


def test_tiny_png_is_a_well_formed_png():
    data = tiny_png(8, 8)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = body
        pos += 12 + length
    assert struct.unpack(">II", chunks[b"IHDR"][:8]) == (8, 8)
    assert len(zlib.decompress(chunks[b"IDAT"])) == 8 * (1 + 8 * 3)


def test_container_logs_bigger_than_the_memory_bound_are_read_within_it(docker, tmp_path):
    """Warm-up reads `docker logs` streaming, as `mm diagnose` does: its checks, its tail and the table's matches."""
    import sys

    from tests.support.memory import peak_rss
    from tests.test_diagnose import MEMORY_BOUND, MB, sparse_log

    docker.mkdir(parents=True, exist_ok=True)
    sparse_log(docker / "huge.log", "starting\n", 200 * MB, "\n[TP0] nvfp4_to_fp8 backend=qmul4\n", 100 * MB,
               "\nCUDA out of memory\nlast line\n")
    probe = ("import sys; from mm.artifacts.serving.warmup import container_logs; s = container_logs('huge'); "
             "sys.exit(0 if (s.lines, s.kept, list(s.tail)[-2:], sorted({k for k, _ in s.hits})) == "
             "(6, ['[TP0] nvfp4_to_fp8 backend=qmul4'], ['CUDA out of memory', 'last line'], ['cuda-oom']) else 7)")
    env = {**os.environ, "PATH": f"{docker.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    returncode, peak = peak_rss([sys.executable, "-c", probe], env)
    assert returncode == 0
    assert peak < MEMORY_BOUND, peak
