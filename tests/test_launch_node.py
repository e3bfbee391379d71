"""mm launch for a whole node: replicas behind the SGLang router, checked with SGLang's and sglang-router's own parsers."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.serving.launch import EnvRef, LaunchOptions, load_catalog
from mm.artifacts.serving.router import plan_node
from tests.test_launch import (PIN, QUARK_REPO, REPO_ROOT, ROCM_IMAGE, SECRET, assert_no_secrets, mm, model_dir,  # noqa: F401
                               quark_dir, sglang_parse)

EIGHT = "0,1,2,3,4,5,6,7"


def commands(script: str) -> list[list[str]]:
    """Every `docker run` of a node script, as the shell would split it on a host that has the image by its pinned
    reference (the script's `$image` is then its `image_ref`; test_launch_image runs the image lookup itself)."""
    joined = script.replace("\\\n", " ")
    image_ref = shlex.split(re.search(r"^image_ref=(.*)$", script, re.M).group(1))[0]
    return [[image_ref if t == "${image}" else t for t in shlex.split(line.strip())]
            for line in joined.splitlines() if line.strip().startswith("docker run ")]


def option(tokens: list[str], flag: str) -> str:
    return tokens[tokens.index(flag) + 1]


def router_parse(argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tests.support.sglang_stubs.parse_router_args"], cwd=REPO_ROOT,
                          input=json.dumps(argvs), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def router_part(tokens: list[str]) -> list[str]:
    return tokens[tokens.index("sglang_router.launch_router") + 1:]


# --- the node's shape ----------------------------------------------------------------------------

def test_b300_balanced_on_8_gpus_is_two_tp4_replicas_behind_the_router(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT)
    assert r.returncode == 0, r.stderr
    runs = commands(r.stdout)
    assert len(runs) == 3
    replicas, router = runs[:2], runs[2]
    assert [option(t, "--gpus") for t in replicas] == ['"device=0,1,2,3"', '"device=4,5,6,7"']
    assert [option(t, "--name") for t in replicas] == ["minimax-m3-1-flash-0", "minimax-m3-1-flash-1"]
    assert [option(t, "-p") for t in replicas] == ["127.0.0.1:30001:30001", "127.0.0.1:30002:30002"]
    assert [option(t, "--port") for t in replicas] == ["30001", "30002"]
    assert [option(t, "--tp") for t in replicas] == ["4", "4"]
    cache = model_dir.parent / "mm-kernel-cache" / "sglang-b300-balanced"
    for t in replicas:  # the same read-only model and the same kernel caches
        assert f"{model_dir}:/models/MiniMax-M3.1-Flash:ro" in t and f"{cache / 'minfer'}:/root/.cache/minfer" in t
        assert "-d" in t and "--rm" not in t and "--api-key" not in t
    assert option(router, "--name") == "minimax-m3-1-flash-router" and option(router, "--pull") == "never"
    assert option(router, "--network") == "host" and "HF_HUB_OFFLINE=1" in router and PIN.image in router
    assert router[router.index(PIN.image) + 1:router.index("sglang_router.launch_router") + 1] == ["python3", "-m", "sglang_router.launch_router"]
    part = router_part(router)
    assert part[part.index("--worker-urls") + 1:part.index("--worker-urls") + 3] == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert option(part, "--policy") == "cache_aware" and option(part, "--host") == "127.0.0.1" and option(part, "--port") == "30000"
    assert option(part, "--prometheus-host") == "127.0.0.1"
    # replicas first, each /health waited for, then the router
    assert r.stdout.index("wait_healthy minimax-m3-1-flash-1 30002") < r.stdout.index("--name minimax-m3-1-flash-router")


def test_mi355x_on_8_gpus_is_two_tp4_replicas_behind_the_router_not_a_refusal(model_dir):
    r = mm("launch", model_dir, "--hardware", "mi355x", "--image", ROCM_IMAGE, "--gpus", EIGHT)
    assert r.returncode == 0, r.stderr
    replicas, router = commands(r.stdout)[:2], commands(r.stdout)[2]
    assert ["HIP_VISIBLE_DEVICES=0,1,2,3" in t for t in replicas] == [True, False]
    assert ["HIP_VISIBLE_DEVICES=4,5,6,7" in t for t in replicas] == [False, True]
    assert [option(t, "--tp") for t in replicas] == ["4", "4"]
    assert ROCM_IMAGE in router and option(router_part(router), "--policy") == "cache_aware"


def test_four_gpus_listed_give_one_server_and_no_router_exactly_as_before(model_dir):
    listed = mm("launch", model_dir, "--hardware", "b300", "--gpus", "0,1,2,3")
    default = mm("launch", model_dir, "--hardware", "b300")
    one = mm("launch", model_dir, "--hardware", "b300", "--replicas", "1")
    assert listed.returncode == default.returncode == one.returncode == 0
    assert listed.stdout == default.stdout == one.stdout
    assert "sglang_router" not in listed.stdout and listed.stdout.count("docker run") == 1
    assert "exec docker run --rm" in listed.stdout.replace(" \\\n  ", " ")


def test_three_tp4_replicas_on_8_gpus_are_refused_for_lack_of_gpus(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--replicas", "3")
    assert r.returncode == 7 and r.stdout == ""
    assert "not enough GPUs" in r.stderr and "3 x 4 = 12 GPUs" in r.stderr and "--replicas 2" in r.stderr


@pytest.mark.parametrize("extra, clash", [
    (["--replica-ports", "30000,30001"], "replica 0 port 30000: collides with --port (router)"),
    (["--replica-ports", "31000,31000"], "replica 1 port 31000: collides with replica 0 port"),
    (["--metrics-port", "30002"], "--metrics-port (router metrics) 30002: collides with replica 1 port"),
    (["--port", "28999", "--metrics-port", "29001"], "--metrics-port (router metrics) 29001: collides with replica 1 port"),
])
def test_port_collisions_are_refused_as_bad_values(model_dir, extra, clash):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, *extra)
    assert r.returncode == 2 and clash in r.stderr and r.stdout == ""


def test_replica_ports_follow_the_router_port_unless_given(model_dir):
    moved = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--port", "8000")
    assert [option(t, "-p") for t in commands(moved.stdout)[:2]] == ["127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    given = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--replica-ports", "9001,9005")
    assert [option(t, "-p") for t in commands(given.stdout)[:2]] == ["127.0.0.1:9001:9001", "127.0.0.1:9005:9005"]


def test_replica_ports_must_match_the_replica_count(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--replica-ports", "31001")
    assert r.returncode == 2 and "2 replicas need 2 ports" in r.stderr


def test_a_gpu_list_that_does_not_split_into_replicas_is_a_bad_value(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", "0,1,2,3,4,5")
    assert r.returncode == 2 and "4 distinct GPUs per replica; list a multiple of 4" in r.stderr
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", "0,1,2,3,3,4,5,6")
    assert r.returncode == 2 and "listed twice" in r.stderr


def test_refusals_stay_with_replicas(model_dir):
    h200 = mm("launch", model_dir, "--hardware", "h200", "--dspark", "--replicas", "2")
    assert h200.returncode == 7 and "requires Blackwell" in h200.stderr
    vllm = mm("launch", model_dir, "--hardware", "b300", "--engine", "vllm", "--image", "vllm/vllm-openai@sha256:" + "cd" * 32,
              "--gpus", EIGHT)
    assert vllm.returncode == 7 and "SGLang router" in vllm.stderr


def test_expose_applies_to_the_router_only_and_the_key_stays_out_of_the_script(model_dir, tmp_path):
    out = tmp_path / "node.sh"
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--expose", "--out", out)
    assert r.returncode == 0, r.stderr
    script = out.read_text()
    replicas, router = commands(script)[:2], commands(script)[2]
    assert [option(t, "-p") for t in replicas] == ["127.0.0.1:30001:30001", "127.0.0.1:30002:30002"]
    assert all("--api-key" not in t for t in replicas)
    part = router_part(router)
    assert option(part, "--host") == "0.0.0.0" and option(part, "--api-key") == "${MM_API_KEY}"
    assert option(part, "--prometheus-host") == "127.0.0.1"
    assert ': "${MM_API_KEY:?' in script
    assert_no_secrets(script, r.stdout, r.stderr)


def test_format_json_describes_every_container(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["replica_count"] == 2
    assert [(c["name"], c["role"], c["port"]) for c in doc["containers"]] == [
        ("minimax-m3-1-flash-0", "replica", 30001), ("minimax-m3-1-flash-1", "replica", 30002),
        ("minimax-m3-1-flash-router", "router", 30000)]
    assert [c.get("gpus") for c in doc["containers"]] == [[0, 1, 2, 3], [4, 5, 6, 7], None]
    assert doc["router"]["worker_urls"] == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert doc["router"]["docker_argv"][:3] == ["docker", "run", "--name"]
    assert [p["port"] for p in doc["replicas"]] == [30001, 30002]
    script_runs = commands(mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT).stdout)
    assert [p["docker_argv"] for p in doc["replicas"]] + [doc["router"]["docker_argv"]] == script_runs
    assert doc["router"]["source"] == "recipes engines.sglang.router"


# --- HiCache: --hicache-size is per rank -----------------------------------------------------------

def test_hicache_scripts_state_the_hosts_total(model_dir):
    two = mm("launch", model_dir, "--hardware", "mi355x", "--recipe", "high-throughput", "--image", ROCM_IMAGE, "--gpus", EIGHT)
    assert "HiCache host memory: 2 replica(s) x 4 ranks x 180 GB (--hicache-size is per rank) = 1,440 GB in total" in two.stdout
    assert "echo 'HiCache host memory: 2 replica(s)" in two.stdout
    one = mm("launch", model_dir, "--hardware", "mi355x", "--recipe", "high-throughput", "--image", ROCM_IMAGE)
    assert "1 replica(s) x 4 ranks x 180 GB (--hicache-size is per rank) = 720 GB in total" in one.stdout
    mi350 = mm("launch", model_dir, "--hardware", "mi350x", "--recipe", "high-throughput", "--image", ROCM_IMAGE, "--gpus", EIGHT)
    assert "2 replica(s) x about 1,400 GB per TP 4 server" in mi350.stdout and "= 2,800 GB in total" in mi350.stdout
    plain = mm("launch", model_dir, "--hardware", "mi355x", "--image", ROCM_IMAGE, "--gpus", EIGHT)
    assert "HiCache" not in plain.stdout


# --- the engines' own parsers --------------------------------------------------------------------

def every_node_plan(model_dir: Path, quark_dir: Path):
    catalog = load_catalog()
    for r in catalog.recipes:
        if r.engine != "sglang" or r.gpus != 4:
            continue
        amd = catalog.hardware[r.hardware].vendor == "amd"
        directory = quark_dir if r.weights_repo == QUARK_REPO else model_dir
        for extra in ({}, {"expose": True}, {"port": 8000, "metrics_port": 9100, "replica_ports": (8101, 8102)}):
            opts = LaunchOptions(hardware=r.hardware, recipe=r.name, image=ROCM_IMAGE if amd else None,
                                 gpus=tuple(range(8)), **extra)
            yield plan_node(directory, opts, catalog)


def test_every_router_line_parses_with_sglang_routers_parser_and_every_server_line_with_sglangs(model_dir, quark_dir):
    nodes = list(every_node_plan(model_dir, quark_dir))
    assert len(nodes) > 40 and all(n.router and len(n.replicas) == 2 for n in nodes)
    router_argvs = [[SECRET if isinstance(t, EnvRef) else str(t) for t in n.router.argv][3:] for n in nodes]
    controls = [["--worker-urls", "http://127.0.0.1:1", "--policy", "cache-aware"], ["--worker-urls", "http://127.0.0.1:1"]]
    *results, bad, good = router_parse(router_argvs + controls)
    assert not bad["ok"] and "invalid choice: 'cache-aware'" in bad["error"]
    assert good["ok"] and good["version"] == "0.3.2"
    for node, result in zip(nodes, results):
        assert result["ok"], (node.first.recipe.id, result.get("error"))
        args = result["args"]
        assert args["worker_urls"] == [f"http://127.0.0.1:{p.port}" for p in node.replicas]
        assert args["policy"] == "cache_aware" and args["port"] == node.router.port
        assert args["host"] == ("0.0.0.0" if node.router.expose else "127.0.0.1")
        assert args["prometheus_host"] == "127.0.0.1" and args["prometheus_port"] == node.router.metrics_port
        assert args["api_key"] == (SECRET if node.router.expose else None)
    servers = [p for n in nodes for p in n.replicas]
    parsed = sglang_parse([[SECRET if isinstance(t, EnvRef) else t for t in p.engine_argv][2:] for p in servers])
    for plan, result in zip(servers, parsed):
        assert result["ok"], (plan.recipe.id, result.get("error"))
        assert result["args"]["port"] == plan.port and result["args"]["api_key"] is None
        assert result["args"]["host"] == "0.0.0.0"  # inside the container; published on 127.0.0.1 only


def test_node_scripts_pass_bash_n_and_shellcheck(model_dir, tmp_path):
    archive = tmp_path / "image.tar"
    archive.write_bytes(b"x")
    variants = {
        "b300": ["--hardware", "b300", "--gpus", EIGHT],
        "b300-expose-archive": ["--hardware", "b300", "--gpus", EIGHT, "--expose", "--image-archive", archive],
        "mi355x-ht": ["--hardware", "mi355x", "--recipe", "high-throughput", "--image", ROCM_IMAGE, "--gpus", EIGHT],
        "gb200-3": ["--hardware", "gb200", "--replicas", "3"],
    }
    scripts = []
    for name, args in variants.items():
        out = tmp_path / f"{name}.sh"
        r = mm("launch", model_dir, *args, "--out", out)
        assert r.returncode == 0, (name, r.stderr)
        assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
        assert_no_secrets(out.read_text())
        scripts.append(str(out))
    check = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


# --- the script itself, run against the stand-in docker ---------------------------------------------

def free_ports(n: int) -> list[int]:
    import socket
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, OSError):
        return 0, {}  # nothing listening yet


def test_node_script_starts_replicas_then_the_router_and_stopping_the_router_stops_them(model_dir, tmp_path):
    import os
    import time
    from tests.support import fake_docker
    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state)
    router_port, a, b, metrics = free_ports(4)
    out = tmp_path / "node.sh"
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--port", router_port, "--replica-ports", f"{a},{b}",
           "--metrics-port", metrics, "--cache-root", tmp_path / "cache", "--out", out)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", NO_PROXY="127.0.0.1")
    script = subprocess.Popen(["bash", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):  # the router comes up only after both replicas answered /health
            if http(router_port, "/health")[0] == 200:
                break
            assert script.poll() is None, script.communicate()
            time.sleep(0.1)
        assert http(a, "/health")[0] == http(b, "/health")[0] == 200
        for _ in range(2):
            code, answer = http(router_port, "/v1/chat/completions", {
                "model": "/models/MiniMax-M3.1-Flash", "messages": [{"role": "user", "content": "hi"}]})
            assert code == 200 and answer["choices"][0]["message"]["content"]
        router_log = (state / "minimax-m3-1-flash-router.log").read_text()
        assert f"routed /v1/chat/completions to http://127.0.0.1:{a}" in router_log
        assert f"routed /v1/chat/completions to http://127.0.0.1:{b}" in router_log
        # replica 0 compiled into the shared (cold) cache alone; replica 1 started after it and loaded the kernels
        assert "compiled kernels into /root/.cache/minfer" in (state / "minimax-m3-1-flash-0.log").read_text()
        assert "kernel cache hit: /root/.cache/minfer" in (state / "minimax-m3-1-flash-1.log").read_text()
        subprocess.run([str(tmp_path / "bin" / "docker"), "stop", "minimax-m3-1-flash-router"], check=True,
                       capture_output=True)
        script.wait(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
    running = [subprocess.run([str(tmp_path / "bin" / "docker"), "inspect", "-f", "{{.State.Running}}", n],
                              capture_output=True, text=True).stdout.strip()
               for n in ("minimax-m3-1-flash-0", "minimax-m3-1-flash-1")]
    assert running == ["false", "false"]  # stopped with the router, kept (stopped) for `mm diagnose --container`
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    runs = [c[c.index("--name") + 1] for c in calls if c[0] == "run"]
    assert runs == ["minimax-m3-1-flash-0", "minimax-m3-1-flash-1", "minimax-m3-1-flash-router"]


def test_node_script_stops_when_a_replica_dies_and_leaves_it_for_mm_diagnose(model_dir, tmp_path):
    import os
    from tests.support import fake_docker
    from tests.support.run import run_mm
    fake_docker.install(tmp_path / "bin", tmp_path / "docker-state")
    router_port, a, b, metrics = free_ports(4)
    out = tmp_path / "node.sh"
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", EIGHT, "--port", router_port, "--replica-ports", f"{a},{b}",
           "--metrics-port", metrics, "--cache-root", tmp_path / "cache", "--out", out)
    assert r.returncode == 0, r.stderr
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, NO_PROXY="127.0.0.1", FAKE_SGLANG_EXIT_AFTER_LOG="1",
               FAKE_SGLANG_LOG_LINES="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
    done = subprocess.run(["bash", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("mm: minimax-m3-1-flash-0 exited before /health answered; read its log: "
            "mm diagnose --container minimax-m3-1-flash-0") in done.stderr
    calls = [json.loads(line) for line in (tmp_path / "docker-state" / "calls.jsonl").read_text().splitlines()]
    assert [c[c.index("--name") + 1] for c in calls if c[0] == "run"] == ["minimax-m3-1-flash-0"]  # cold cache: alone
    diagnosis = run_mm("diagnose", "--container", "minimax-m3-1-flash-0", "--json", "--model-dir", model_dir,
                       "--hardware", "b300", "--cache-root", tmp_path / "cache", extra_env={"PATH": path})
    assert diagnosis.returncode == 1
    assert [f["row"] for f in json.loads(diagnosis.stdout)["findings"]] == ["cuda-oom"]
