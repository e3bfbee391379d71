"""mm launch: recipes as data -> offline start scripts; the real CLI in a subprocess, SGLang's and vLLM's own parsers."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.serving.launch import EnvRef, LaunchOptions, load_catalog, plan_launch, recipes_path
from mm.artifacts.integrity.manifest import Manifest, entry_for_file, write_manifest
from mm.artifacts.paths import manifest_path
from mm.artifacts.pins import default_pin
from tests.support.modelgen import write_model
from tests.support.run import run_mm

REPO_ROOT = Path(__file__).resolve().parents[1]
PIN = default_pin()
QUARK_REPO = "amd/MiniMax-M3.1-Flash-Quark-MXFP4"
ROCM_IMAGE = "example.org/rocm/sglang@sha256:" + "ab" * 32
VLLM_IMAGE = "vllm/vllm-openai@sha256:" + "cd" * 32
SECRET = "sk-test-" + "7f3a9c" * 4
HF_SECRET = "hf_" + "Zq8" * 10

# The guide's offline 4 x B300 start, verbatim (shared/seeds/004_9bc383c314a5bc40.txt, section
# "权重、缓存与离线部署" / English: "Weights, cache, and offline deployment", second docker run block).
GUIDE_B300_OFFLINE = r"""docker run --rm --name minimax-m3-1-flash \
  --gpus '"device=0,1,2,3"' \
  --shm-size 32g \
  --ipc=host \
  -p 127.0.0.1:30000:30000 \
  -e HF_HUB_OFFLINE=1 \
  -e FMHA_SM100_ALLOW_JIT=1 \
  -v /data/models/MiniMax-M3.1-Flash:/models/MiniMax-M3.1-Flash:ro \
  -v ~/.cache/minfer:/root/.cache/minfer \
  lmsysorg/sglang@sha256:614b1509bcb729c653528d448bff9850f8977fcad9d12ba56bd6dbe3d7985e87 \
  sglang serve \
  --trust-remote-code \
  --model-path /models/MiniMax-M3.1-Flash \
  --reasoning-parser minimax-m3 \
  --tool-call-parser minimax-m3 \
  --tp 4 \
  --moe-runner-backend flashinfer_trtllm_routed \
  --speculative-algorithm DSPARK \
  --speculative-use-block-verification \
  --cuda-graph-backend-prefill breakable \
  --chunked-prefill-size 32768 \
  --max-running-requests 128 \
  --cuda-graph-max-bs-decode 128 \
  --mem-fraction-static 0.8 \
  --tokenizer-worker-num 8 \
  --host 0.0.0.0 \
  --port 30000"""


def make_model_dir(root: Path, repo_id: str = PIN.repo_id, draft: bool = True) -> Path:
    """A small MiniMax-shaped checkpoint with its manifest, as `mm fetch` would leave it."""
    model = root / repo_id.rsplit("/", 1)[-1]
    files = write_model(model, shards=2, shard_bytes=64 * 1024, draft=draft)
    entries = tuple(entry_for_file(model, f)[0] for f in files)
    write_manifest(Manifest(repo_id=repo_id, revision=PIN.revision, files=entries), manifest_path(model))
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def quark_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("quark"), repo_id=QUARK_REPO, draft=False)


SECRETS = {"MM_API_KEY": SECRET, "HF_TOKEN": HF_SECRET}  # set for every run: none may reach a script


def mm(*args) -> subprocess.CompletedProcess:
    """The installed `mm` (tests.support.run.run_mm) with secrets set in its environment."""
    return run_mm(*args, extra_env=SECRETS)


def assert_no_secrets(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text and HF_SECRET not in text


def engine_part(tokens: list[str]) -> list[str]:
    return tokens[tokens.index("serve") + 1:]


def docker_options(tokens: list[str], image: str) -> list[tuple[str, str | None]]:
    """docker run's options as (flag, value) pairs, with each -v reduced to its container side."""
    opts, i = [], 2
    while tokens[i] != image:
        flag = tokens[i]
        if flag.startswith("--") and "=" in flag or flag in ("--rm",):
            opts.append((flag, None))
            i += 1
            continue
        value = tokens[i + 1]
        if flag == "-v":
            value = value.split(":", 1)[1]
        opts.append((flag, value))
        i += 2
    return opts


def script_tokens(script: str) -> list[str]:
    """The docker run line of an emitted script, as the shell would split it on a host that has the image by its
    pinned reference (`$image` is then the script's `image_ref`)."""
    line = script[script.index("exec docker run"):].replace("\\\n", " ")
    image_ref = shlex.split(re.search(r"^image_ref=(.*)$", script, re.M).group(1))[0]
    return [image_ref if t == "${image}" else t for t in shlex.split(line)[1:]]


# --- the recipes as data -------------------------------------------------------------------------

MATRIX = {  # the guide's hardware matrix (SGLang) and the vLLM row
    ("sglang", "b300"): {"balanced", "low-latency", "high-throughput"},
    ("sglang", "gb300"): {"balanced", "low-latency", "high-throughput"},
    ("sglang", "b200"): {"balanced", "low-latency", "high-throughput"},
    ("sglang", "gb200"): {"balanced", "low-latency", "high-throughput"},
    ("sglang", "h200"): {"balanced", "high-throughput"},
    ("sglang", "mi355x"): {"low-latency", "high-throughput", "quark-low-latency"},
    ("sglang", "mi350x"): {"low-latency", "high-throughput", "quark-low-latency"},
}
STATUSES = {"validated by the SGLang Cookbook", "final validation in progress", "not validated"}


def test_recipes_cover_the_guides_hardware_matrix_with_status_and_sources():
    catalog = load_catalog()
    found: dict[tuple[str, str], set[str]] = {}
    for r in catalog.recipes:
        found.setdefault((r.engine, r.hardware), set()).add(r.name)
        assert r.status in STATUSES
        assert all(source for source in r.sources.values()) and all(a.source for a in r.args)
    for key, names in MATRIX.items():
        assert found[key] == names, key
    assert {hw for (engine, hw) in found if engine == "vllm"} == {"b300", "gb300", "b200", "gb200", "h200", "h100", "mi355x"}
    status = {(r.hardware, r.name): r.status for r in catalog.recipes if r.engine == "sglang"}
    assert status[("b200", "balanced")] == status[("gb200", "high-throughput")] == "final validation in progress"
    assert status[("mi350x", "quark-low-latency")] == "not validated"
    assert status[("b300", "balanced")] == status[("h200", "balanced")] == "validated by the SGLang Cookbook"
    assert catalog.sampling == {"temperature": 1.0, "top_p": 0.95}


def test_recipes_take_the_image_digest_from_the_pin_without_copying_it():
    text = recipes_path().read_text()
    assert json.loads(text)["schema"] == "mm-recipes/1"
    assert PIN.image.split("@")[1] not in text
    assert load_catalog().engines["sglang"].image == PIN.image


def test_only_the_b300_balanced_recipe_claims_a_published_exact_command():
    exact = [r.id for r in load_catalog().recipes if r.exact_command_published]
    assert exact == ["sglang/b300/balanced"]


# --- the guide's reference command ---------------------------------------------------------------

def test_guide_block_in_this_test_is_verbatim_from_the_seed():
    seeds = sorted((REPO_ROOT.parent / "shared" / "seeds").glob("004_*.txt"))
    if not seeds:
        pytest.skip("shared/seeds is not beside the checkout; the verbatim copy above stands in")
    blocks = re.findall(r"```bash[^\n]*\n(.*?)```", seeds[0].read_text(encoding="utf-8"), re.S)
    offline = [b.strip() for b in blocks if "HF_HUB_OFFLINE=1" in b]
    assert offline == [GUIDE_B300_OFFLINE]


def test_b300_balanced_reproduces_the_guides_offline_command_flag_for_flag(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300")
    assert r.returncode == 0, r.stderr
    ours, guide = script_tokens(r.stdout), shlex.split(GUIDE_B300_OFFLINE.replace("\\\n", " "))
    image = PIN.image
    assert ours[ours.index(image) + 1:] == guide[guide.index(image) + 1:]  # sglang serve ... identical
    our_opts, guide_opts = docker_options(ours, image), docker_options(guide, image)
    assert [o for o in our_opts if o not in guide_opts] == [
        ("--pull", "never"),  # offline: never let docker try a registry
        ("-e", "SGLANG_CACHE_DIR=/root/.cache/sglang"), ("-e", "SGLANG_JIT_CACHE_DIR=/root/.cache/sglang-jit"),
        ("-v", "/root/.cache/sglang"), ("-v", "/root/.cache/sglang-jit")]
    assert [o for o in guide_opts if o not in our_opts] == []
    assert f"-v {model_dir}:/models/MiniMax-M3.1-Flash:ro" in r.stdout


# --- SGLang's own parser -------------------------------------------------------------------------

def sglang_parse(argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tests.support.sglang_stubs.parse_sglang_args"], cwd=REPO_ROOT,
                          input=json.dumps(argvs), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def every_sglang_plan(model_dir: Path, quark_dir: Path):
    catalog = load_catalog()
    for r in catalog.recipes:
        if r.engine != "sglang":
            continue
        amd = catalog.hardware[r.hardware].vendor == "amd"
        directory = quark_dir if r.weights_repo == QUARK_REPO else model_dir
        for extra in ({}, {"expose": True}, {"context_length": 131072}):
            opts = LaunchOptions(hardware=r.hardware, recipe=r.name, image=ROCM_IMAGE if amd else None, **extra)
            yield plan_launch(directory, opts, catalog)


def test_every_emitted_sglang_command_parses_with_sglang_0_5_23_and_fp8_is_rejected(model_dir, quark_dir):
    plans = list(every_sglang_plan(model_dir, quark_dir))
    argvs = [[SECRET if isinstance(t, EnvRef) else t for t in p.engine_argv][2:] for p in plans]
    # Controls: the parser does reject what SGLang rejects (vLLM's spelling of the FP8 KV cache).
    controls = [["--model-path", "/m", "--kv-cache-dtype", "fp8"], ["--model-path", "/m", "--kv-cache-dtype", "fp8_e4m3"]]
    *results, bad, good = sglang_parse(argvs + controls)
    assert not bad["ok"] and "invalid choice: 'fp8'" in bad["error"]
    assert good["ok"] and good["args"]["kv_cache_dtype"] == "fp8_e4m3"
    assert len(results) == len(plans) > 40
    for plan, result in zip(plans, results):
        assert result["ok"], (plan.recipe.id, result.get("error"))
        args = result["args"]
        assert args["model_path"] == "/models/MiniMax-M3.1-Flash" or plan.recipe.weights_repo == QUARK_REPO
        assert args["revision"] is None and args["trust_remote_code"] is True
        assert args["reasoning_parser"] == args["tool_call_parser"] == "minimax-m3"
        assert args["speculative_algorithm"] == ("DSPARK" if plan.uses_dspark else None)
        assert args["port"] == plan.port
        if plan.recipe.hardware == "h200":
            assert args["tp_size"] == 8 and args["context_length"] in (140000, 131072)


# --- vLLM's own parser ---------------------------------------------------------------------------

def vllm_parse(argvs: list[list[str]]) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.support.vllm_stubs.parse_vllm_args"], cwd=REPO_ROOT,
                          input=json.dumps(argvs), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def every_vllm_plan(model_dir: Path):
    """Every vLLM recipe x hardware, each as mm emits it by default, exposed (API key), on another port, at another TP."""
    catalog = load_catalog()
    for r in catalog.recipes:
        if r.engine != "vllm":
            continue
        for extra in ({}, {"expose": True}, {"port": 30100}, {"tp": 2}):
            opts = LaunchOptions(hardware=r.hardware, recipe=r.name, engine="vllm", image=VLLM_IMAGE, **extra)
            yield plan_launch(model_dir, opts, catalog)


def vllm_argv(plan) -> list[str]:
    """What follows the image in `docker run --entrypoint vllm IMAGE ...`: `serve MODEL ...`."""
    assert plan.entrypoint == "vllm"
    return [SECRET if isinstance(t, EnvRef) else t for t in plan.engine_argv]


def test_every_emitted_vllm_command_parses_with_vllm_0_33_0_and_passes_its_serve_checks(model_dir):
    plans = list(every_vllm_plan(model_dir))
    out = vllm_parse([vllm_argv(p) for p in plans])
    assert out["version"] == "0.33.0"
    assert len(out["results"]) == len(plans) == 4 * 7
    for plan, result in zip(plans, out["results"]):
        assert result["ok"], (plan.recipe.id, plan.port, result.get("error"))
        args = result["args"]
        hopper = plan.hardware.family == "hopper"
        assert args["subparser"] == "serve" and args["model_tag"] == plan.container_model_path
        # no --served-model-name: vLLM serves the model under its path, the name mm's warm-up requests send
        assert args["served_model_name"] is None
        tp = int(plan.engine_argv[plan.engine_argv.index("--tensor-parallel-size") + 1])
        assert args["tensor_parallel_size"] == tp == (2 if len(plan.gpus) == 2 else plan.recipe.gpus)
        assert args["tool_call_parser"] == args["reasoning_parser"] == "minimax_m3"
        assert args["enable_auto_tool_choice"] is True
        assert args["tool_call_parser"] in out["tool_call_parsers"] and args["reasoning_parser"] in out["reasoning_parsers"]
        assert args["block_size"] == 128 and args["kv_cache_dtype"] == ("fp8" if hopper else "auto")
        assert args["host"] == "0.0.0.0" and args["port"] == plan.port
        assert args["api_key"] == ([SECRET] if plan.expose else None)


def test_vllm_parser_refuses_sglang_spellings_and_auto_tool_choice_without_a_parser(model_dir):
    argv = vllm_argv(plan_launch(model_dir, LaunchOptions(hardware="h200", engine="vllm", image=VLLM_IMAGE)))
    at = argv.index("--tool-call-parser")
    controls = [
        argv + ["--context-length", "131072"],                  # SGLang's flag (mm refuses it for vLLM)
        argv[:at + 1] + ["minimax-m3"] + argv[at + 2:],         # SGLang's parser name
        argv[:at] + argv[at + 2:],                              # --enable-auto-tool-choice alone
        argv,
    ]
    unknown_flag, sglang_parser_name, no_parser, as_emitted = vllm_parse(controls)["results"]
    assert not unknown_flag["ok"] and "unrecognized arguments: --context-length 131072" in unknown_flag["error"]
    assert not sglang_parser_name["ok"] and "invalid tool call parser: minimax-m3" in sglang_parser_name["error"]
    assert not no_parser["ok"] and "--enable-auto-tool-choice requires --tool-call-parser" in no_parser["error"]
    assert as_emitted["ok"]


# --- the script ----------------------------------------------------------------------------------

SCRIPT_VARIANTS = {
    "b300": ["--hardware", "b300"],
    "b300-expose-archive": ["--hardware", "b300", "--expose", "--image-archive", "{archive}", "--gpus", "4,5,6,7", "--port", "30100"],
    "gb200-ht": ["--hardware", "gb200", "--recipe", "high-throughput"],
    "h200": ["--hardware", "h200", "--context-length", "100000"],
    "mi355x": ["--hardware", "mi355x", "--recipe", "high-throughput", "--image", ROCM_IMAGE],
    "vllm-h200": ["--hardware", "h200", "--engine", "vllm", "--image", VLLM_IMAGE, "--expose"],
}


def test_emitted_scripts_pass_bash_n_and_shellcheck_and_hold_no_secrets(model_dir, tmp_path):
    archive = tmp_path / "image.tar"
    archive.write_bytes(b"not really an image")
    scripts = []
    for name, args in SCRIPT_VARIANTS.items():
        out = tmp_path / f"{name}.sh"
        r = mm("launch", model_dir, *[a.format(archive=archive) for a in args], "--out", out)
        assert r.returncode == 0, (name, r.stderr)
        assert out.stat().st_mode & 0o777 == 0o755
        assert subprocess.run(["bash", "-n", str(out)], capture_output=True).returncode == 0, name
        assert_no_secrets(out.read_text(), r.stdout, r.stderr)
        scripts.append(str(out))
    check = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    assert not list(tmp_path.glob(".*.tmp"))


def test_script_starts_offline_from_the_read_only_model_by_digest_on_loopback(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--port", "31000")
    tokens = script_tokens(r.stdout)
    assert r.stdout.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in r.stdout
    assert "HF_HUB_OFFLINE=1" in tokens and "FMHA_SM100_ALLOW_JIT=1" in tokens
    assert tokens[tokens.index("-p") + 1] == "127.0.0.1:31000:31000"
    assert f"{model_dir}:/models/MiniMax-M3.1-Flash:ro" in tokens
    assert PIN.image in tokens and "--revision" not in tokens
    assert tokens[tokens.index("--shm-size") + 1] == "32g" and "--ipc=host" in tokens
    cache = model_dir.parent / "mm-kernel-cache" / "sglang-b300-balanced"
    for host, container in (("minfer", "/root/.cache/minfer"), ("sglang", "/root/.cache/sglang"),
                            ("sglang-jit", "/root/.cache/sglang-jit")):
        assert f"{cache / host}:{container}" in tokens
    assert "REVALIDATE" not in r.stdout


def test_expose_publishes_everywhere_and_takes_the_api_key_from_the_environment(model_dir, tmp_path):
    out = tmp_path / "start.sh"
    r = mm("launch", model_dir, "--hardware", "b300", "--expose", "--api-key-env", "SERVE_KEY", "--out", out)
    assert r.returncode == 0, r.stderr
    script = out.read_text()
    tokens = script_tokens(script)
    assert tokens[tokens.index("-p") + 1] == "30000:30000"
    assert tokens[tokens.index("--api-key") + 1] == "${SERVE_KEY}"
    assert ': "${SERVE_KEY:?' in script
    assert_no_secrets(script, r.stdout, r.stderr)
    env = {k: v for k, v in {**os.environ, **SECRETS}.items() if k != "SERVE_KEY"}
    started = subprocess.run(["bash", str(out)], capture_output=True, text=True, env=env, timeout=30)
    assert started.returncode != 0 and "SERVE_KEY" in started.stderr  # refuses before docker runs


def test_recipe_without_a_published_command_says_revalidate(model_dir):
    r = mm("launch", model_dir, "--hardware", "gb200", "--recipe", "high-throughput")
    assert r.returncode == 0, r.stderr
    assert "# REVALIDATE:" in r.stdout and "echo 'WARNING: sglang/gb200/high-throughput: command must be revalidated" in r.stdout
    tokens = script_tokens(r.stdout)
    assert tokens[tokens.index("--tp") + 1] == "4" and tokens[tokens.index("--ep") + 1] == "4"
    assert "final validation in progress" in r.stderr


def test_h200_runs_tp8_without_speculative_decoding_within_140k_context(model_dir):
    r = mm("launch", model_dir, "--hardware", "h200")
    tokens = script_tokens(r.stdout)
    assert tokens[tokens.index("--tp") + 1] == "8"
    assert tokens[tokens.index("--context-length") + 1] == "140000"
    assert "--speculative-algorithm" not in tokens and "FMHA_SM100_ALLOW_JIT=1" not in tokens
    assert not any(t.endswith(":/root/.cache/minfer") for t in tokens)
    assert tokens[tokens.index("--gpus") + 1] == '"device=0,1,2,3,4,5,6,7"'


def test_vllm_h200_uses_block_size_128_minimax_m3_parsers_and_fp8_kv_cache(model_dir):
    r = mm("launch", model_dir, "--hardware", "h200", "--engine", "vllm", "--image", VLLM_IMAGE)
    assert r.returncode == 0, r.stderr
    tokens = script_tokens(r.stdout)
    engine = tokens[tokens.index(VLLM_IMAGE) + 1:]
    assert engine == ["serve", "/models/MiniMax-M3.1-Flash", "--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8",
                      "--block-size", "128", "--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3",
                      "--enable-auto-tool-choice", "--host", "0.0.0.0", "--port", "30000"]
    assert tokens[tokens.index("--entrypoint") + 1] == "vllm" and "REVALIDATE" in r.stdout


@pytest.mark.parametrize("hardware", ["b300", "gb300", "b200", "gb200", "h200", "h100", "mi355x"])
def test_every_vllm_line_with_a_tool_call_parser_enables_auto_tool_choice(model_dir, hardware):
    r = mm("launch", model_dir, "--hardware", hardware, "--engine", "vllm", "--image", VLLM_IMAGE)
    assert r.returncode == 0, r.stderr
    tokens = script_tokens(r.stdout)
    assert "--tool-call-parser" in tokens and "--enable-auto-tool-choice" in tokens


def test_vllm_without_an_image_digest_is_a_bad_value(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--engine", "vllm")
    assert r.returncode == 2 and "--image" in r.stderr and "digest" in r.stderr


def test_image_archive_adds_a_docker_load_before_the_run(model_dir, tmp_path):
    archive = tmp_path / "sglang image.tar"
    archive.write_bytes(b"x")
    r = mm("launch", model_dir, "--hardware", "b300", "--image-archive", archive)
    assert f"docker load -i '{archive}'" in r.stdout
    assert r.stdout.index("docker load") < r.stdout.index("exec docker run")


def test_format_json_gives_the_argv_with_sources(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--format", "json", "--expose")
    doc = json.loads(r.stdout)
    assert doc["recipe"] == "sglang/b300/balanced" and doc["image"] == PIN.image
    assert doc["engine_argv"][-2:] == ["--api-key", "${MM_API_KEY}"]
    assert "B300" in doc["sources"]["args"]["--moe-runner-backend"]
    assert_no_secrets(r.stdout, r.stderr)


# --- refusals ------------------------------------------------------------------------------------

def test_dspark_on_h200_is_refused_with_the_h200_recipe_instead(model_dir):
    r = mm("launch", model_dir, "--hardware", "h200", "--dspark")
    assert r.returncode == 7
    assert "requires Blackwell" in r.stderr and "sglang/h200/balanced" in r.stderr and "without" in r.stderr


def test_tp_above_4_on_rocm_is_refused_with_two_tp4_servers_advice(model_dir):
    # One server on 8 ROCm GPUs is refused (8 GPUs without --replicas 1 become two replicas: tests/test_launch_node.py).
    for extra in (["--tp", "8"], ["--gpus", "0,1,2,3,4,5,6,7", "--replicas", "1"]):
        r = mm("launch", model_dir, "--hardware", "mi355x", "--image", ROCM_IMAGE, *extra)
        assert r.returncode == 7, r.stderr
        assert "TP 4 or lower" in r.stderr and "two TP 4 servers behind the SGLang router" in r.stderr
        assert "--gpus 0,1,2,3,4,5,6,7" in r.stderr and "--gpus 4,5,6,7" in r.stderr


def test_context_above_the_recipes_limit_is_refused(model_dir):
    r = mm("launch", model_dir, "--hardware", "h200", "--context-length", "200000")
    assert r.returncode == 7
    assert "200,000" in r.stderr and "140,000" in r.stderr and "--context-length 140000" in r.stderr


def test_recipe_the_guide_lacks_is_refused_with_the_ones_it_has(model_dir):
    r = mm("launch", model_dir, "--hardware", "h200", "--recipe", "low-latency")
    assert r.returncode == 7 and "balanced, high-throughput" in r.stderr


def test_missing_dspark_dir_is_refused_for_a_dspark_recipe(tmp_path):
    model = make_model_dir(tmp_path, draft=False)
    r = mm("launch", model, "--hardware", "b300")
    assert r.returncode == 7 and f"{model / 'dspark'}: missing" in r.stderr and "DSpark" in r.stderr
    assert mm("launch", model, "--hardware", "h200").returncode == 0  # no DSpark there


def test_missing_manifest_is_bad_input(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    manifest_path(bare).unlink()
    r = mm("launch", bare, "--hardware", "b300")
    assert r.returncode == 3 and f"{manifest_path(bare)}: no manifest" in r.stderr


def test_failing_quick_verify_stops_the_launch(model_dir, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    shard = next(damaged.glob("model-00001-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    r = mm("launch", damaged, "--hardware", "b300")
    assert r.returncode == 1 and "quick verify" in r.stderr and shard.name in r.stderr and r.stdout == ""


def test_weights_other_than_the_recipes_are_refused(model_dir):
    r = mm("launch", model_dir, "--hardware", "mi355x", "--recipe", "quark-low-latency", "--image", ROCM_IMAGE)
    assert r.returncode == 7 and QUARK_REPO in r.stderr and PIN.repo_id in r.stderr


def test_hardware_with_only_a_vllm_path_is_refused_for_sglang(model_dir):
    r = mm("launch", model_dir, "--hardware", "h100")
    assert r.returncode == 7 and "no sglang recipe for h100" in r.stderr and "--engine vllm" in r.stderr


def test_gpu_list_that_does_not_match_the_recipe_is_a_bad_value(model_dir):
    r = mm("launch", model_dir, "--hardware", "b300", "--gpus", "0,1")
    assert r.returncode == 2 and "--gpus 0,1" in r.stderr and "4 distinct GPUs" in r.stderr


def test_json_plan_written_with_out_is_not_executable(model_dir, tmp_path):
    out = tmp_path / "plan.json"
    r = mm("launch", model_dir, "--hardware", "b300", "--format", "json", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o644
    assert json.loads(out.read_text())["recipe"] == json.loads(r.stdout)["plan"]["recipe"] == "sglang/b300/balanced"


def test_a_start_script_printed_to_a_full_disk_names_that_file(model_dir):
    r = run_mm("launch", model_dir, "--hardware", "b300", prefix=("sh", "-c", 'exec "$0" "$@" > /dev/full'))
    assert r.returncode == 7, r.stderr
    assert r.stderr.startswith("mm: /dev/full: no space left on device") and str(model_dir) not in r.stderr


def test_the_shell_completes_hardware_ids_from_the_recipes():
    def complete(words: str) -> list[str]:
        done = run_mm(extra_env={"_MM_COMPLETE": "bash_complete", "COMP_WORDS": words,
                                 "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))})
        return [line.split(",", 1)[1] for line in done.stdout.splitlines()]

    assert complete("mm launch DIR --hardware ") == list(load_catalog().hardware)
    assert complete("mm doctor DIR --hardware B") == [hw for hw in load_catalog().hardware if hw.startswith("b")]


# --- the user's overrides of the flags the guide's fixes name ----------------------------------------------

def test_launch_overrides_the_flags_the_guides_oom_fix_names_and_says_they_are_the_users(model_dir):
    r = run_mm("launch", model_dir, "--hardware", "b300", "--mem-fraction-static", "0.75",
               "--chunked-prefill-size", "4096")
    assert r.returncode == 0, r.stderr
    script = r.stdout
    assert "# Override: --mem-fraction-static 0.75 is the user's (mm launch --mem-fraction-static 0.75), not the " \
           "guide's: the recipe has --mem-fraction-static " in script, script
    assert "# Override: --chunked-prefill-size 4096 is the user's" in script
    doc = json.loads(run_mm("launch", model_dir, "--hardware", "b300", "--mem-fraction-static", "0.75",
                            "--format", "json").stdout)
    assert doc["overrides"] == [{"flag": "--mem-fraction-static", "value": "0.75",
                                 "recipe_value": doc["overrides"][0]["recipe_value"],
                                 "source": "the user's override (mm launch)"}]
    argv = doc["engine_argv"]
    assert argv.count("--mem-fraction-static") == 1 and argv[argv.index("--mem-fraction-static") + 1] == "0.75"
    (result,) = sglang_parse([[t for t in argv][2:]])  # SGLang's own parser takes the overridden command
    assert result["ok"] and result["args"]["mem_fraction_static"] == 0.75, result


def test_a_launch_override_out_of_range_is_a_usage_error(model_dir):
    r = run_mm("launch", model_dir, "--hardware", "b300", "--mem-fraction-static", "1.5")
    assert r.returncode == 2 and "--mem-fraction-static '1.5': must be a fraction between 0 and 1" in r.stderr, r.stderr
