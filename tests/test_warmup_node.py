"""mm warmup --replicas: two fake replicas and a fake router from the stand-in docker, end to end."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.test_launch import HF_SECRET, SECRET
from tests.support.run import run_mm
from tests.test_launch_node import EIGHT, free_ports
from tests.test_warmup import docker, model_dir  # noqa: F401  (fixtures)


def warmup(model_dir: Path, docker: Path, *args, **fake_env):
    router, a, b, metrics = free_ports(4)
    env = {"PATH": f"{docker.parent / 'bin'}{os.pathsep}{os.environ['PATH']}", "MM_API_KEY": SECRET, "HF_TOKEN": HF_SECRET,
           "NO_PROXY": "127.0.0.1", **fake_env}
    cache = docker.parent / "cache"
    result = run_mm("warmup", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--port", router,
                    "--replica-ports", f"{a},{b}", "--metrics-port", metrics, "--cache-root", cache, "--json", *args,
                    extra_env=env)
    return result, cache, (router, a, b)


def by_target(doc: dict) -> dict[tuple[str, str], dict]:
    return {(c["target"], c["name"]): c for c in doc["checks"]}


NAMES = ("mm-warmup-sglang-b300-balanced-0", "mm-warmup-sglang-b300-balanced-1", "mm-warmup-sglang-b300-balanced-router")


def test_warmup_of_two_replicas_and_the_router_runs_the_guides_checks_on_each_and_through_the_router(model_dir, docker):
    result, cache, (router, a, b) = warmup(model_dir, docker)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["replicas"] == 2 and doc["containers"] == list(NAMES) and doc["port"] == router
    checks = by_target(doc)
    for name in NAMES:
        for check in ("text", "thinking-disabled", "image"):
            assert checks[(name, check)]["ok"] is True, (name, check)
    for name in NAMES[:2]:
        assert checks[(name, "nvfp4-qmul4")]["ok"] and checks[(name, "dspark-draft")]["ok"]
    # replica 1 started after replica 0 had compiled, and wrote nothing into the shared caches
    assert checks[(NAMES[1], "from-cache")]["ok"] is True and "none written" in checks[(NAMES[1], "from-cache")]["detail"]
    assert (NAMES[0], "from-cache") not in checks
    assert doc["diagnosis"] == []
    key = json.loads((cache / "mm-cache-key.json").read_text())
    assert key["gpu_count"] == 4 and key["recipe"] == "sglang/b300/balanced"
    calls = [json.loads(line) for line in (docker / "calls.jsonl").read_text().splitlines()]
    runs = [c for c in calls if c[0] == "run" and "-d" in c]
    assert [c[c.index("--name") + 1] for c in runs] == list(NAMES)
    assert [c[c.index("--gpus") + 1] for c in runs[:2]] == ['"device=0,1,2,3"', '"device=4,5,6,7"']
    assert "--network" in runs[2] and runs[2][runs[2].index("--worker-urls") + 1:][:2] == [
        f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"]
    nvidia_smi = next(c for c in calls if c[0] == "run" and "nvidia-smi" in c)
    assert nvidia_smi[nvidia_smi.index("--gpus") + 1] == f'"device={EIGHT}"'
    assert not list(docker.glob("*.json")), "a warm-up container was left behind"
    assert SECRET not in result.stdout and HF_SECRET not in result.stdout


def test_a_replica_that_compiles_again_fails_the_from_cache_check(model_dir, docker):
    result, cache, _ = warmup(model_dir, docker, FAKE_SGLANG_ALWAYS_COMPILE="1")
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    check = by_target(doc)[(NAMES[1], "from-cache")]
    assert check["ok"] is False and "compiled again" in check["detail"] and "fake-kernel.bin" in check["detail"]
    assert not list(docker.glob("*.json"))


def test_a_failed_warmup_reports_the_troubleshooting_rows_its_logs_match(model_dir, docker):
    result, cache, _ = warmup(model_dir, docker, FAKE_SGLANG_NVFP4_BACKEND="triton_fallback")
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert {f["row"] for f in doc["diagnosis"]} == {"nvfp4-slow-path"}
    finding = doc["diagnosis"][0]
    assert finding["line"] == "nvfp4_to_fp8 backend=triton_fallback" and finding["where"].startswith("docker logs mm-warmup-")
    report = json.loads((cache / "mm-warmup-report.json").read_text())
    assert report["diagnosis"] == doc["diagnosis"]
