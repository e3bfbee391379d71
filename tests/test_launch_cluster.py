"""mm launch --format k8s/ome: the cluster's manifests from the same plan as the start script, checked offline against
Kubernetes' own schemas (kubernetes-validate, strict), the vendored LeaderWorkerSet and OME CRDs, and SGLang's and
sglang-router's own parsers."""
from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mm.artifacts.serving.kube import KUBERNETES_VERSION
from mm.artifacts.serving.router import DEFAULT_HEALTH_TIMEOUT
from tests.test_launch import (PIN, REPO_ROOT, ROCM_IMAGE, SECRET, VLLM_IMAGE, assert_no_secrets, docker_options, engine_part,  # noqa: F401
                               make_model_dir, mm, script_tokens, sglang_parse)
from tests.test_launch_node import router_parse

CRDS = Path(__file__).resolve().parent / "crds"
REVISION_DIR = PIN.revision[:12]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A model root as `mm unbundle` + `mm use` leave it: ROOT/<repo>/<revision>/, the `current` pointer, and the
    bundle's payload/mm (install-mm.sh and its wheelhouse) beside the revision."""
    root = tmp_path_factory.mktemp("cluster") / "models"
    repo = root / PIN.repo_id
    made = make_model_dir(repo)
    made.rename(repo / REVISION_DIR)
    os.symlink(REVISION_DIR, repo / "current")
    installer = repo / f"{REVISION_DIR}.payload" / "mm"
    (installer / "wheelhouse").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "artifacts" / "bundle" / "install-mm.sh", installer / "install-mm.sh")
    return root


def current(store: Path) -> Path:
    return store / PIN.repo_id / "current"


def k8s(store: Path, *args: str, fmt: str = "k8s") -> list[dict]:
    r = mm("launch", current(store), "--format", fmt, *args)
    assert r.returncode == 0, r.stderr
    assert_no_secrets(r.stdout, r.stderr)
    return [d for d in yaml.safe_load_all(r.stdout) if d is not None]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def server_pod(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]


def container(pod: dict, name: str = "sglang") -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does with $(VAR) in args: each one replaced by the container's env value."""
    out = []
    for a in args:
        for k, v in env.items():
            a = a.replace(f"$({k})", v)
        out.append(a)
    return out


def assert_valid_kubernetes(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@lru_cache(maxsize=None)
def crd_schema(filename: str, version: str) -> dict:
    crd = yaml.load((CRDS / filename).read_text(), Loader=yaml.CSafeLoader)
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    return _strict(copy.deepcopy(schema))


def _strict(schema):
    """kubectl --validate=strict: an object schema with properties refuses fields it does not name."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def assert_valid_crd(doc: dict, filename: str) -> None:
    version = doc["apiVersion"].split("/")[1]
    jsonschema.validate(doc, crd_schema(filename, version), cls=jsonschema.Draft7Validator)


# --- the documents ---------------------------------------------------------------------------------

def test_b300_plan_is_servers_router_rbac_and_service_each_valid_for_kubernetes_strict(store):
    docs = k8s(store, "--hardware", "b300", "--replicas", "2", "--namespace", "llm")
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Deployment", "minimax-m3-1-flash-server"), ("ServiceAccount", "minimax-m3-1-flash-router"),
        ("Role", "minimax-m3-1-flash-router"), ("RoleBinding", "minimax-m3-1-flash-router"),
        ("Deployment", "minimax-m3-1-flash-router"), ("Service", "minimax-m3-1-flash")]
    for doc in docs:
        assert_valid_kubernetes(doc)
        assert doc["metadata"]["namespace"] == "llm"
    assert by_kind(docs, "Deployment")[0]["spec"]["replicas"] == 2


def test_strict_validation_does_refuse_an_unknown_field(store):
    """Control: the validator is strict (a misspelt field would not pass unnoticed)."""
    doc = by_kind(k8s(store, "--hardware", "b300"), "Deployment")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        assert_valid_kubernetes(doc)


def test_server_pod_has_the_recipes_gpus_shm_offline_image_by_digest_and_read_only_model(store):
    pod = server_pod(k8s(store, "--hardware", "b300"))
    c = container(pod)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert c["image"] == PIN.image and c["image"] == pod["initContainers"][0]["image"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["FMHA_SM100_ALLOW_JIT"] == "1"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}  # the guide's --shm-size 32g
    assert volumes["model"]["hostPath"] == {"path": str(current(store)), "type": "Directory"}  # the pointer
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models/MiniMax-M3.1-Flash"]["readOnly"] is True and mounts["/dev/shm"]["name"] == "dshm"
    caches = store / PIN.repo_id / "mm-kernel-cache" / "sglang-b300-balanced"
    for name, path in (("sglang", "/root/.cache/sglang"), ("minfer", "/root/.cache/minfer")):
        volume = volumes[mounts[path]["name"]]["hostPath"]
        assert volume == {"path": str(caches / name), "type": "DirectoryOrCreate"}  # on the node: no recompile
    assert pod["nodeSelector"] == {"mm/hardware": "b300"}


def test_start_up_allowance_is_the_node_scripts_health_timeout_and_readiness_is_health(store):
    c = container(server_pod(k8s(store, "--hardware", "b300")))
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] == DEFAULT_HEALTH_TIMEOUT == 3600
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_api_key_comes_from_a_secret_in_servers_and_router_never_inlined(store):
    docs = k8s(store, "--hardware", "b300", "--api-key-secret", "llm-key")
    for pod in (server_pod(docs), by_kind(docs, "Deployment")[1]["spec"]["template"]["spec"]):
        c = pod["containers"][0]
        key = next(e for e in c["env"] if e["name"] == "MM_API_KEY")
        assert key == {"name": "MM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}}
        assert c["args"][c["args"].index("--api-key") + 1] == "$(MM_API_KEY)"
    assert not by_kind(docs, "Secret")


# --- one plan, two renderings --------------------------------------------------------------------

@pytest.mark.parametrize("hardware,extra", [("b300", ()), ("h200", ()), ("mi355x", ("--image", ROCM_IMAGE))])
def test_server_flags_env_and_image_equal_the_docker_scripts(store, hardware, extra):
    r = mm("launch", current(store), "--hardware", hardware, "--expose", *extra)
    assert r.returncode == 0, r.stderr
    tokens = script_tokens(r.stdout)
    image = ROCM_IMAGE if extra else PIN.image
    docker_args = tokens[tokens.index(image) + 1:]
    c = container(server_pod(k8s(store, "--hardware", hardware, *extra)))
    assert c["image"] == image
    assert expand(c["args"], {"MM_API_KEY": "${MM_API_KEY}"}) == docker_args
    docker_env = [v for f, v in docker_options(tokens, image) if f == "-e" and not v.startswith("HIP_VISIBLE_DEVICES=")]
    assert [f"{e['name']}={e['value']}" for e in c["env"] if "value" in e] == docker_env


def test_h200_and_mi355x_plans_take_their_recipes_gpus_and_resource_names(store):
    h200_docs = k8s(store, "--hardware", "h200")
    for doc in h200_docs:
        assert_valid_kubernetes(doc)
    h200 = container(server_pod(h200_docs))
    assert h200["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert h200["args"][h200["args"].index("--context-length") + 1] == "140000"
    assert "FMHA_SM100_ALLOW_JIT" not in {e["name"] for e in h200["env"]}  # MSA JIT is Blackwell only
    mi = k8s(store, "--hardware", "mi355x", "--image", ROCM_IMAGE, "--replicas", "2")
    c = container(server_pod(mi))
    assert c["resources"]["limits"] == {"amd.com/gpu": "4"} and c["image"] == ROCM_IMAGE
    for doc in mi:
        assert_valid_kubernetes(doc)


def test_server_args_parse_with_sglang_0_5_23(store):
    plans = [k8s(store, "--hardware", "b300"), k8s(store, "--hardware", "h200"),
             k8s(store, "--hardware", "mi355x", "--image", ROCM_IMAGE),
             k8s(store, "--hardware", "b300", "--recipe", "high-throughput", "--gpus-per-node", "4")]
    env = {"MM_API_KEY": SECRET, "LWS_LEADER_ADDRESS": "minimax-m3-1-flash-server-0.minimax-m3-1-flash-server",
           "LWS_WORKER_INDEX": "1"}
    argvs = []
    for docs in plans:
        server = docs[0]
        spec = (server["spec"]["template"]["spec"] if server["kind"] == "Deployment"
                else server["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"])
        argvs.append(expand(container(spec)["args"], env)[2:])  # after `sglang serve`
    results = sglang_parse(argvs)
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    assert [r["args"]["tp_size"] for r in results] == [4, 8, 4, 8]
    assert results[0]["args"]["api_key"] == SECRET and results[0]["args"]["model_path"] == "/models/MiniMax-M3.1-Flash"
    lws = results[3]["args"]
    assert (lws["nnodes"], lws["node_rank"]) == (2, 1) and lws["dist_init_addr"].endswith(":20000")


def test_router_args_parse_with_sglang_routers_parser_and_select_the_server_pods(store):
    docs = k8s(store, "--hardware", "b300", "--replicas", "3", "--namespace", "llm")
    router = by_kind(docs, "Deployment")[1]["spec"]["template"]["spec"]
    args = expand(container(router, "router")["args"], {"MM_API_KEY": SECRET})
    assert args[:3] == ["python3", "-m", "sglang_router.launch_router"]
    [parsed] = router_parse([args[3:]])
    assert parsed["ok"], parsed.get("error")
    a = parsed["args"]
    assert a["service_discovery"] is True and a["service_discovery_namespace"] == "llm"
    assert a["policy"] == "cache_aware" and a["service_discovery_port"] == 30000
    server = by_kind(docs, "Deployment")[0]
    assert a["selector"] == server["spec"]["template"]["metadata"]["labels"]  # the router finds exactly the servers
    assert a["selector"] == server["spec"]["selector"]["matchLabels"]
    role = by_kind(docs, "Role")[0]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert router["serviceAccountName"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    binding = by_kind(docs, "RoleBinding")[0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    service = by_kind(docs, "Service")[0]
    assert service["spec"]["selector"] == by_kind(docs, "Deployment")[1]["spec"]["selector"]["matchLabels"]


# --- a replica larger than a node -------------------------------------------------------------------

def test_a_replica_needing_more_gpus_than_a_node_is_a_leaderworkerset_valid_against_the_lws_crd(store):
    docs = k8s(store, "--hardware", "b300", "--recipe", "high-throughput", "--gpus-per-node", "4", "--replicas", "2")
    lws = docs[0]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    assert_valid_crd(lws, "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], template["size"]) == (2, 2)
    for role in ("leaderTemplate", "workerTemplate"):
        pod = template[role]
        assert_valid_kubernetes({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **pod["metadata"]},
                                 "spec": pod["spec"]})
        assert container(pod["spec"])["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        assert pod["spec"]["initContainers"][0]["name"] == "mm-verify"  # every pod is gated
    router = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    selector = container(router, "router")["args"]
    assert "app.kubernetes.io/component=server" in selector
    assert template["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    assert template["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    for doc in docs[1:]:
        assert_valid_kubernetes(doc)


def test_lws_crd_check_does_refuse_an_unknown_field(store):
    lws = k8s(store, "--hardware", "b300", "--recipe", "high-throughput", "--gpus-per-node", "4")[0]
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError):
        assert_valid_crd(lws, "leaderworkerset.x-k8s.io_leaderworkersets.yaml")


# --- the proof gate ---------------------------------------------------------------------------------

def gate_script(docs: list[dict], tmp: Path, model: Path, installer: Path) -> str:
    """The init container's command with its mounts at this host's paths (the kubelet's job)."""
    pod = server_pod(docs)
    gate = pod["initContainers"][0]
    assert gate["command"][:2] == ["sh", "-c"]
    mounts = {m["name"]: m["mountPath"] for m in gate["volumeMounts"]}
    assert {m["name"]: m.get("readOnly", False) for m in gate["volumeMounts"]} == {
        "model": True, "mm-installer": True, "mm-venv": False}
    script = gate["command"][2]
    for name, path in (("model", model), ("mm-installer", installer), ("mm-venv", tmp / "venv")):
        script = script.replace(mounts[name], str(path))
    return script


def fake_installer(tmp: Path) -> Path:
    """A stand-in for install-mm.sh (tests/test_installer_offline.py runs the real one on a real wheelhouse): it
    puts this test's installed mm at DEST/bin/mm, as the real one does."""
    installer = tmp / "installer"
    (installer / "wheelhouse").mkdir(parents=True)
    mm_bin = shutil.which("mm", path=str(REPO_ROOT / ".venv" / "bin")) or shutil.which("mm")
    (installer / "install-mm.sh").write_text(f'mkdir -p "$1/bin" && ln -s {shlex.quote(mm_bin)} "$1/bin/mm"\n')
    return installer


def test_gate_passes_a_good_copy_and_stops_the_pod_on_a_damaged_one(store, tmp_path):
    docs = k8s(store, "--hardware", "b300")
    copy_ = tmp_path / "copy"
    shutil.copytree(current(store), copy_, symlinks=True)
    installer = fake_installer(tmp_path)
    ok = subprocess.run(["sh", "-c", gate_script(docs, tmp_path / "a", copy_, installer)], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    shard = sorted(copy_.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    bad = subprocess.run(["sh", "-c", gate_script(docs, tmp_path / "b", copy_, installer)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and shard.name in bad.stdout + bad.stderr


def test_gate_installs_mm_from_the_carried_wheelhouse_offline(store):
    pod = server_pod(k8s(store, "--hardware", "b300"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["mm-installer"]["hostPath"]["path"] == str(store / PIN.repo_id / f"{REVISION_DIR}.payload" / "mm")
    script = pod["initContainers"][0]["command"][2]
    assert script.startswith("sh /mm-installer/install-mm.sh /mm-venv/mm")
    assert script.endswith("mm verify --quick /models/MiniMax-M3.1-Flash")
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in pod["initContainers"][0]["env"]


# --- OME ----------------------------------------------------------------------------------------------

def test_ome_cluster_base_model_is_local_storage_on_proven_nodes_valid_against_omes_crd(store):
    [doc] = k8s(store, "--hardware", "b300", fmt="ome")
    assert (doc["apiVersion"], doc["kind"]) == ("ome.io/v1beta1", "ClusterBaseModel")
    assert_valid_crd(doc, "ome.io_clusterbasemodels.yaml")
    storage = doc["spec"]["storage"]
    assert storage["storageUri"] == f"local://{current(store)}" and storage["path"] == str(current(store))
    label = mm("verify", current(store), "--label-node", "gpu-node-7")
    assert label.returncode == 0, label.stderr
    command = [line for line in label.stdout.splitlines() if line.startswith("kubectl label")][0]
    key, value = shlex.split(command)[4].split("=")
    assert storage["nodeSelector"] == {"mm/hardware": "b300", key: value}
    assert command == f"kubectl label node gpu-node-7 {key}={value} --overwrite"


def test_ome_needs_no_installer_its_pods_are_omes(store):
    [doc] = k8s(store, "--hardware", "b300", "--mm-installer", "/nonexistent", fmt="ome")
    assert doc["kind"] == "ClusterBaseModel"


def test_label_is_never_printed_for_a_copy_that_failed_its_full_verify(store, tmp_path):
    copy_ = tmp_path / "copy"
    shutil.copytree(current(store), copy_, symlinks=True)
    shard = sorted(copy_.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = mm("verify", copy_, "--label-node", "gpu-node-7")
    assert r.returncode == 1 and "kubectl label" not in r.stdout + r.stderr


def test_label_value_changes_with_the_manifest(store, tmp_path):
    from mm.artifacts.serving.kube import proof_label
    a = proof_label(PIN.repo_id, b'{"a": 1}')
    b = proof_label(PIN.repo_id, b'{"a": 2}')
    assert a[0] == b[0] == "mm/proven-minimaxai.minimax-m3.1-flash" and a[1] != b[1]


# --- output ---------------------------------------------------------------------------------------------

def test_json_names_the_documents_and_the_file_written(store, tmp_path):
    out = tmp_path / "plan.yaml"
    r = mm("launch", current(store), "--hardware", "b300", "--format", "k8s", "--replicas", "2", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["out"] == str(out) and doc["format"] == "k8s"
    plan = doc["plan"]
    assert (plan["workload"], plan["replicas"], plan["gpus"], plan["gpu_resource"]) == ("Deployment", 2, 8, "nvidia.com/gpu")
    assert [d["kind"] for d in plan["documents"]] == [d["kind"] for d in yaml.safe_load_all(out.read_text())]
    assert out.stat().st_mode & 0o777 == 0o644
    assert_no_secrets(r.stdout, out.read_text())


# --- bad input: one line, the documented exit code, nothing written ------------------------------------------

@pytest.mark.parametrize("args,code,words", [
    (("--hardware", "b300", "--replicas", "5", "--nodes", "2"), 7, "does not fit"),
    (("--hardware", "b300", "--image", "lmsysorg/sglang:dev-minimax-m31-flash"), 2, "by digest"),
    (("--hardware", "b300", "--namespace", "LLM_prod"), 2, "--namespace"),
    (("--hardware", "b300", "--name", "Mini.Max"), 2, "--name"),
    (("--hardware", "b300", "--gpus", "0,1,2,3"), 2, "device plugin"),
    (("--hardware", "mi355x", "--image", ROCM_IMAGE, "--tp", "8"), 7, "TP 4 or lower"),
    (("--hardware", "b300", "--recipe", "high-throughput", "--gpus-per-node", "3"), 7, "cannot split evenly"),
    (("--hardware", "b300", "--mm-installer", "/nonexistent"), 3, "install-mm.sh"),
    (("--hardware", "h200", "--engine", "vllm", "--image", VLLM_IMAGE), 7, "SGLang router"),
])
def test_bad_input_is_refused_in_one_line_with_its_exit_code_and_nothing_written(store, tmp_path, args, code, words):
    out = tmp_path / "plan.yaml"
    r = mm("launch", current(store), "--format", "k8s", "--out", out, *args)
    assert r.returncode == code, r.stderr
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_model_directory_that_is_not_the_stores_pointer_is_refused(store, tmp_path):
    r = mm("launch", store / PIN.repo_id / REVISION_DIR, "--hardware", "b300", "--format", "k8s")
    assert r.returncode == 3 and "current pointer" in r.stderr and len(r.stderr.strip().splitlines()) == 1
