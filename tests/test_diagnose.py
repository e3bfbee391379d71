"""mm diagnose: the guide's troubleshooting table as data, one synthetic log (or answer) per row."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
from mm.artifacts.serving.diagnose import DiagnoseRequest, hicache_fits, host_findings, iter_lines, load_table, run_diagnosis
from mm.artifacts.serving.launch import LaunchOptions
from mm.artifacts.serving.router import plan_node
from tests.support import fake_docker
from tests.support.memory import peak_rss
from tests.support.run import mm_argv, run_mm
from tests.test_launch import PIN, ROCM_IMAGE, make_model_dir

# Each row's synthetic input: a server log line or a saved HTTP answer / request body, as it would be seen.
ROW_INPUTS = {
    "msa-jit-disabled": "RuntimeError: JIT compilation is disabled and AOT kernel fmha_sm100_fwd_e4m3 was not found",
    "nvfp4-slow-path": "[2026-11-09 10:00:01 TP0] nvfp4_to_fp8 backend=torch",
    "cuda-oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 268.00 GiB",
    "dspark-needs-blackwell": "ValueError: M3.1 NVFP4 DSPARK requires Blackwell",
    "weights-incomplete": "RuntimeError: Cannot find any model weights with `/models/MiniMax-M3.1-Flash`",
    "nccl-hang": "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
                 "WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
    "raw-think-tokens": '{"choices": [{"message": {"role": "assistant", "content": "<mm:think>The user asks about primes."}}]}',
    "thinking-type-400": '{"object": "error", "message": "thinking.type must be \'adaptive\', \'enabled\' or \'disabled\', '
                         'got \'on\'.", "type": "BadRequestError", "code": 400}',
    "reasoning-effort-ignored": '{"model": "/models/MiniMax-M3.1-Flash", "messages": [{"role": "user", "content": "hi"}], '
                                '"chat_template_kwargs": {"reasoning_effort": "high"}}',
    "health-failing": "curl: (7) Failed to connect to 127.0.0.1 port 30000 after 0 ms: Couldn't connect to server",
    "remote-image-failed": '{"object": "error", "message": "Timed out while downloading media URL: '
                           'https://raw.githubusercontent.com/sgl-project/sglang/example_image.png", "code": 400}',
}
# What a finding quotes for an input judged as JSON: the field, not the raw text.
JUDGED = {
    "raw-think-tokens": "content: <mm:think>The user asks about primes.",
    "thinking-type-400": "error: thinking.type must be 'adaptive', 'enabled' or 'disabled', got 'on'.",
    "reasoning-effort-ignored": '"chat_template_kwargs": {"reasoning_effort": "high"}',
    "remote-image-failed": "error: Timed out while downloading media URL: "
                           "https://raw.githubusercontent.com/sgl-project/sglang/example_image.png",
}
# Rows seen outside any text: on the container (its mounts) or on the host.
NON_TEXT_ROWS = {"kernel-cache-not-persisted"}

CLEAN_LOG = """\
[2026-11-09 10:00:00] server_args={'model_path': '/models/MiniMax-M3.1-Flash', 'reasoning_parser': 'minimax-m3', 'tool_call_parser': 'minimax-m3', 'tp_size': 4}
[2026-11-09 10:00:05 TP0] DSpark draft found in the target checkpoint's dspark/ subfolder
[2026-11-09 10:00:09 TP0] Load weight end. type=MiniMaxM3ForCausalLM, avail mem=80.12 GB
[2026-11-09 10:01:40 TP0] nvfp4_to_fp8 backend=qmul4
[2026-11-09 10:02:10] The server is fired up and ready to roll!
INFO:     127.0.0.1:50312 - "GET /health HTTP/1.1" 200 OK
{"choices": [{"message": {"role": "assistant", "content": "There are 15 primes below 50.", "reasoning_content": null}}]}
{"model": "/models/MiniMax-M3.1-Flash", "thinking": {"type": "adaptive"}, "reasoning_effort": "high"}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"))


def diagnose(*args, env: dict | None = None):
    return run_mm("diagnose", *args, extra_env=env)


def test_the_table_holds_every_row_of_the_guides_troubleshooting_table_with_sources():
    table = load_table()
    assert [r.guide_row for r in table.rows] == list(range(1, 13))
    assert table.path.name == PIN.troubleshooting == "minimax-m3.1-flash.troubleshooting.json"
    seed = Path(__file__).resolve().parents[2] / "shared" / "seeds"
    chinese = next(iter(sorted(seed.glob("004_*.txt"))), None) if seed.is_dir() else None
    for row in table.rows:
        assert row.symptom and row.cause and row.fix and row.change and row.detect
        assert all(d.pattern_source for d in row.detect) and "故障排查" in row.guide
        if chinese:  # the guide's own symptom text, verbatim
            assert row.guide.split(": ", 1)[1] in chinese.read_text(encoding="utf-8")
    assert set(ROW_INPUTS) | NON_TEXT_ROWS == {r.id for r in table.rows}


@pytest.mark.parametrize("row", sorted(ROW_INPUTS))
def test_each_rows_synthetic_input_gives_exactly_that_row(row, tmp_path):
    log = tmp_path / f"{row}.log"
    log.write_text("[2026-11-09 10:00:00] starting\n" + ROW_INPUTS[row] + "\n[2026-11-09 10:00:02] exiting\n")
    result = diagnose(log, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert [f["row"] for f in doc["findings"]] == [row]
    finding = doc["findings"][0]
    assert finding["line"] == JUDGED.get(row, ROW_INPUTS[row]) and finding["line_number"] == 2
    assert finding["where"] == str(log) and finding["pattern_source"]
    assert finding["cause"] and finding["fix"] and finding["guide"]


def test_a_clean_log_matches_nothing_with_or_without_the_recipe(model_dir, tmp_path):
    log = tmp_path / "clean.log"
    log.write_text(CLEAN_LOG)
    plain = diagnose(log)
    assert plain.returncode == 0 and "no row of the guide's troubleshooting table matches (8 lines read, engine sglang (log))" in plain.stdout
    with_recipe = diagnose(log, "--model-dir", model_dir, "--hardware", "b300", "--json")
    assert with_recipe.returncode == 0 and json.loads(with_recipe.stdout)["findings"] == []


def test_the_ready_line_without_any_nvfp4_line_is_the_slow_path_only_where_the_recipe_expects_qmul4(model_dir, tmp_path):
    log = tmp_path / "no-nvfp4.log"
    log.write_text("\n".join(line for line in CLEAN_LOG.splitlines() if "nvfp4" not in line) + "\n")
    assert diagnose(log).returncode == 0  # recipe unknown: absence proves nothing
    b300 = diagnose(log, "--model-dir", model_dir, "--hardware", "b300", "--json")
    assert b300.returncode == 1
    assert [(f["row"], f["line"]) for f in json.loads(b300.stdout)["findings"]] == [
        ("nvfp4-slow-path", "[2026-11-09 10:02:10] The server is fired up and ready to roll!")]
    rocm = diagnose(log, "--model-dir", model_dir, "--hardware", "mi355x", "--image", ROCM_IMAGE)
    assert rocm.returncode == 0  # no qmul4 line is expected on ROCm


def test_parsers_missing_from_server_args_is_the_raw_token_row(tmp_path):
    log = tmp_path / "args.log"
    log.write_text(CLEAN_LOG.replace("'reasoning_parser': 'minimax-m3'", "'reasoning_parser': None"))
    doc = json.loads(diagnose(log, "--json").stdout)
    assert [f["row"] for f in doc["findings"]] == ["raw-think-tokens"] and doc["findings"][0]["line_number"] == 1


def test_fixes_are_adapted_to_the_recipe_when_the_model_dir_is_known(model_dir, tmp_path):
    log = tmp_path / "oom.log"
    log.write_text(ROW_INPUTS["cuda-oom"] + "\n" + ROW_INPUTS["msa-jit-disabled"] + "\n")
    plain = {f["row"]: f["fix"] for f in json.loads(diagnose(log, "--json").stdout)["findings"]}
    assert plain["cuda-oom"].startswith("lower --mem-fraction-static below 0.8")
    cache = tmp_path / "kc"
    here = {f["row"]: f["fix"] for f in json.loads(diagnose(log, "--json", "--model-dir", model_dir, "--hardware", "b300",
                                                           "--cache-root", cache).stdout)["findings"]}
    assert "--mem-fraction-static 0.8 and --chunked-prefill-size 32768" in here["cuda-oom"]
    assert f"{cache / 'minfer'} (mounted at /root/.cache/minfer)" in here["msa-jit-disabled"]


def test_text_output_names_the_row_the_line_the_cause_and_the_fix(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(ROW_INPUTS["dspark-needs-blackwell"] + "\n")
    result = diagnose(log)
    assert result.returncode == 1
    assert "row 5 dspark-needs-blackwell" in result.stdout and "line 1: ValueError: M3.1 NVFP4 DSPARK" in result.stdout
    assert "cause: DSpark is enabled on a non-Blackwell" in result.stdout and "fix: use the H200 recipe" in result.stdout


def test_bad_input_is_one_line_and_exit_3(tmp_path):
    missing = diagnose(tmp_path / "nope.log")
    assert missing.returncode == 3 and f"{tmp_path / 'nope.log'}: no such log" in missing.stderr
    nothing = diagnose("--json")
    assert nothing.returncode == 3 and json.loads(nothing.stdout)["ok"] is False
    assert diagnose("--model-dir", tmp_path, "--answer", tmp_path / "x").returncode == 3


# --- a log bigger than memory -------------------------------------------------------------------

MB = 1_000_000
MEMORY_BOUND = 100 * MB  # mm diagnose holds a chunk and a line, whatever the log


def sparse_log(path: Path, *parts: str | int) -> Path:
    """A log of PARTS: text, or a count of NUL bytes left as a hole (no newline in it), so GBs cost no disk."""
    with path.open("wb") as f:
        for part in parts:
            if isinstance(part, int):
                f.seek(part, os.SEEK_CUR)
            else:
                f.write(part.encode())
        f.truncate()
    return path


def big_log(path: Path) -> Path:
    """300 MB: a 200 MB line with no newline, the OOM line, then 100 MB more of one line."""
    return sparse_log(path, "[2026-11-09 10:00:00] starting\n", 200 * MB, "\n" + ROW_INPUTS["cuda-oom"] + "\n",
                      100 * MB - 1, "\n")


def test_a_log_bigger_than_the_memory_bound_with_a_line_longer_than_it_is_diagnosed_within_it(tmp_path):
    log = big_log(tmp_path / "big.log")
    assert log.stat().st_size > 3 * MEMORY_BOUND
    returncode, peak = peak_rss(mm_argv("diagnose", log), os.environ)
    assert returncode == 1
    assert peak < MEMORY_BOUND, peak
    doc = json.loads(diagnose(log, "--json").stdout)
    assert [(f["row"], f["line_number"]) for f in doc["findings"]] == [("cuda-oom", 3)]
    assert doc["lines_read"] == 4


def test_docker_logs_bigger_than_the_memory_bound_are_diagnosed_within_it(tmp_path):
    state = tmp_path / "docker-state"
    docker = fake_docker.install(tmp_path / "bin", state)
    state.mkdir(parents=True, exist_ok=True)
    big_log(state / "huge.log")  # the stand-in's `docker logs huge` streams this file
    env = {**os.environ, "PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}"}
    returncode, peak = peak_rss(mm_argv("diagnose", "--container", "huge"), env)
    assert returncode == 1
    assert peak < MEMORY_BOUND, peak
    doc = json.loads(diagnose("--container", "huge", "--json", env=env).stdout)
    assert ("cuda-oom", "docker logs huge", 3) in [(f["row"], f["where"], f["line_number"]) for f in doc["findings"]]


def test_a_line_longer_than_the_cap_is_cut_and_the_next_line_is_whole():
    long = b"x" * 5000 + b" CUDA out of memory"
    stream = io.BytesIO(b"a\n" + long + b"\n\xff tail without newline")
    assert list(iter_lines(stream, max_line=100)) == ["a", "x" * 100, "\ufffd tail without newline"]


def test_lines_split_across_read_chunks_are_joined(monkeypatch):
    from mm.artifacts.serving import diagnose as mod
    monkeypatch.setattr(mod, "READ_CHUNK", 3)
    assert list(iter_lines(io.BytesIO(b"abcdefg\nhi\n\nj"), max_line=5)) == ["abcde", "hi", "", "j"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 1024])
def test_crlf_and_a_lone_cr_end_lines_as_splitlines_does(monkeypatch, chunk):
    from mm.artifacts.serving import diagnose as mod
    monkeypatch.setattr(mod, "READ_CHUNK", chunk)
    text = b"a\r\nbc\r\r\n10%\r50%\rCUDA out of memory\n\rz"
    assert list(iter_lines(io.BytesIO(text))) == text.decode().splitlines()


# --- a container, through the stand-in docker ------------------------------------------------------

def test_diagnose_container_reads_docker_logs_and_finds_a_missing_kernel_cache_mount(model_dir, tmp_path):
    state = tmp_path / "docker-state"
    docker = fake_docker.install(tmp_path / "bin", state)
    env = {"PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([str(docker), "run", "-d", "--name", "guide-quickstart", "-p", f"127.0.0.1:{port}:{port}",
                          "-e", "HF_HUB_OFFLINE=1", "-v", f"{model_dir}:/models/MiniMax-M3.1-Flash:ro", PIN.image,
                          "sglang", "serve", "--model-path", "/models/MiniMax-M3.1-Flash", "--port", str(port)],
                         capture_output=True, text=True, env={**os.environ, **env,
                                                              "FAKE_SGLANG_LOG_LINES": ROW_INPUTS["cuda-oom"]})
    assert run.returncode == 0, run.stderr
    try:
        for _ in range(100):
            if "Uvicorn running" in (state / "guide-quickstart.log").read_text():
                break
            import time
            time.sleep(0.05)
        result = diagnose("--container", "guide-quickstart", "--json", env=env)
        doc = json.loads(result.stdout)
        assert result.returncode == 1
        assert [(f["row"], f["source"]) for f in doc["findings"]] == [("kernel-cache-not-persisted", "container"),
                                                                         ("cuda-oom", "log")]
        assert "no mount at /root/.cache/minfer" in doc["findings"][0]["line"]
        assert doc["findings"][1]["where"] == "docker logs guide-quickstart"
        h200 = diagnose("--container", "guide-quickstart", "--json", "--model-dir", model_dir, "--hardware", "h200", env=env)
        assert [f["row"] for f in json.loads(h200.stdout)["findings"]] == ["cuda-oom"]  # no MSA cache off Blackwell
    finally:
        subprocess.run([str(docker), "rm", "-f", "guide-quickstart"], capture_output=True, env={**os.environ, **env})
    gone = diagnose("--container", "guide-quickstart", env=env)
    assert gone.returncode == 3 and "docker logs failed" in gone.stderr


# --- host checks, for mm doctor ------------------------------------------------------------------

def test_host_checks_give_their_rows(model_dir, tmp_path):
    cache = tmp_path / "cache"
    plan = plan_node(model_dir, LaunchOptions(hardware="b300", cache_root=cache)).first
    assert [(f.row, f.where) for f in host_findings(plan)] == [("kernel-cache-not-persisted", "kernel_cache_warm")]
    cache.mkdir()
    (cache / "mm-cache-key.json").write_text("{}")
    assert host_findings(plan) == ()
    hopper = host_findings(plan, gpu_info="NVIDIA H200, 9.0, 580.65.06\n" * 4)
    assert [(f.row, f.line) for f in hopper] == [
        ("dspark-needs-blackwell", "GPU NVIDIA H200 (compute 9.0) with DSpark recipe sglang/b300/balanced")]
    assert host_findings(plan, gpu_info="NVIDIA B300 SXM6 AC, 10.3, 590.48.01") == ()
    cli = diagnose("--host-checks", "--model-dir", model_dir, "--hardware", "b300", "--cache-root", cache,
                   "--gpu-info", "NVIDIA H200, 9.0, 580.65.06", "--json")
    assert cli.returncode == 1 and [f["row"] for f in json.loads(cli.stdout)["findings"]] == ["dspark-needs-blackwell"]


def test_host_check_finds_damaged_weights(model_dir, tmp_path):
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    shard = next(damaged.glob("model-00001-*.safetensors"))
    shard.unlink()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mm-cache-key.json").write_text("{}")
    plan = plan_node(damaged, LaunchOptions(hardware="b300", cache_root=cache), check_dir=False).first
    findings = host_findings(plan)
    assert [f.row for f in findings] == ["weights-incomplete"] and shard.name in findings[0].line
    assert str(damaged) in findings[0].fix and "mm repair" in findings[0].fix


def test_hicache_total_is_checked_against_host_memory(model_dir):
    plan = plan_node(model_dir, LaunchOptions(hardware="mi355x", recipe="high-throughput", image=ROCM_IMAGE,
                                              gpus=tuple(range(8)))).first
    assert hicache_fits(plan, 2, mem_total_gb=2048) is None
    short = hicache_fits(plan, 2, mem_total_gb=1024)
    assert "HiCache needs 1,440 GB" in short and "1,024 GB" in short
    assert hicache_fits(plan_node(model_dir, LaunchOptions(hardware="b300")).first, 2, mem_total_gb=1) is None


# --- warm-up runs the same diagnosis on failure -----------------------------------------------------

def test_a_single_server_warmup_that_dies_reports_the_rows_its_log_matches(model_dir, tmp_path):
    state = tmp_path / "docker-state"
    docker = fake_docker.install(tmp_path / "bin", state)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}", "NO_PROXY": "127.0.0.1",
           "FAKE_SGLANG_LOG_LINES": ROW_INPUTS["cuda-oom"], "FAKE_SGLANG_EXIT_AFTER_LOG": "1"}
    result = run_mm("warmup", model_dir, "--hardware", "b300", "--port", port, "--cache-root", tmp_path / "cache",
                    extra_env=env)
    assert result.returncode == 1
    report = json.loads((tmp_path / "cache" / "mm-warmup-report.json").read_text())
    # the cause only: "exited before /health answered" is the symptom the OOM explains
    assert [f["row"] for f in report["diagnosis"]] == ["cuda-oom"]
    assert "exited before /health answered" in report["error"]
    fix = report["diagnosis"][0]["fix"]  # what the server's log shows, and a lower value to start with
    assert "the log shows --mem-fraction-static 0.8 (--chunked-prefill-size 32768)" in fix
    assert "--mem-fraction-static 0.75" in fix
    assert "the guide's troubleshooting table:" in result.stdout and "row 4 cuda-oom" in result.stdout


def test_a_warmup_that_never_becomes_ready_with_nothing_else_in_its_log_is_row_11(model_dir, tmp_path):
    docker = fake_docker.install(tmp_path / "bin", tmp_path / "docker-state")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}", "NO_PROXY": "127.0.0.1",
           "FAKE_SGLANG_NEVER_READY": "1"}
    result = run_mm("warmup", model_dir, "--hardware", "b300", "--port", port, "--cache-root", tmp_path / "cache",
                    "--timeout", "3", extra_env=env)
    assert result.returncode == 1
    report = json.loads((tmp_path / "cache" / "mm-warmup-report.json").read_text())
    assert [(f["row"], f["where"]) for f in report["diagnosis"]] == [("health-failing", "warm-up failures")]
    assert "did not answer within 3s" in report["diagnosis"][0]["line"]


def test_a_saved_answer_is_read_beside_the_log(tmp_path):
    log, answer = tmp_path / "clean.log", tmp_path / "answer.json"
    log.write_text(CLEAN_LOG)
    answer.write_text(ROW_INPUTS["thinking-type-400"] + "\n")
    result = diagnose(log, "--answer", answer, "--json")
    doc = json.loads(result.stdout)
    assert result.returncode == 1 and doc["inputs"] == [str(log), str(answer)]
    assert [(f["row"], f["where"], f["line_number"]) for f in doc["findings"]] == [("thinking-type-400", str(answer), 1)]


# --- what a line says, whatever wrapped it; messages from the same sources; fixes from what the log shows -------

from mm.artifacts.errors import BadInput  # noqa: E402
from mm.artifacts.serving.diagnose import diagnose as diagnose_texts, scan_stream  # noqa: E402

READY = "[2026-12-03 09:12:00] The server is fired up and ready to roll!"
HEALTH_503 = 'INFO:     127.0.0.1:50421 - "GET /health HTTP/1.1" 503 Service Unavailable'
TS = "2026-12-03T09:12:01.123456789Z"


def rows_of(text: str, **kw) -> list[str]:
    return [f.row for f in diagnose_texts([("log", text)], **kw).findings]


def test_a_log_piped_to_dash_is_read_from_the_standard_input():
    result = run_mm("diagnose", "-", "--json", input="[2026-12-03 09:12:00 TP0] " + ROW_INPUTS["cuda-oom"] + "\n")
    doc = json.loads(result.stdout)
    assert result.returncode == 1 and [(f["row"], f["where"]) for f in doc["findings"]] == [("cuda-oom", "<stdin>")]


def test_a_pipe_that_does_not_end_within_the_cap_stops_with_one_line():
    with pytest.raises(BadInput, match="<stdin>: more than"):
        scan_stream("<stdin>", io.BytesIO(b"INFO: tokens\n" * 1000), load_table(), cap=1000)


@pytest.mark.parametrize("wrap", [
    lambda line: f"\x1b[32m{line.replace('503', chr(27) + '[91m503')}\x1b[0m",  # uvicorn with colours
    lambda line: f"{TS} stderr F {line}",  # Kubernetes CRI (kubelet's /var/log/pods)
    lambda line: f"{TS} {line}",  # docker logs --timestamps
    lambda line: json.dumps({"log": line + "\n", "stream": "stderr", "time": TS}),  # docker's json-file driver
    lambda line: json.dumps({"level": "info", "message": line}),  # a log shipper's JSON record
    lambda line: json.dumps({"textPayload": line, "severity": "INFO", "timestamp": TS}),  # Google Cloud Logging
    lambda line: f"Dec 03 09:12:01 gpu-node-3 3f2a9c1d7e44[812]: {line}",  # journalctl of docker's journald driver
    lambda line: f"2026-12-03T09:12:01.123456+0000 gpu-node-3 sglang[812]: {line}",  # journalctl -o short-iso-precise
    lambda line: f"[pod/minimax-0/sglang] {line}",  # kubectl logs --prefix
    lambda line: f"sglang-1  | {line}",  # docker compose logs
    lambda line: 'time=2026-12-03T09:12:01Z level=info msg="{}"'.format(line.replace('"', '\\"')),  # logfmt
    lambda line: f"2026-12-03T09:12:01.123456789+00:00 {line}",  # podman logs --timestamps
    lambda line: f"2026-12-03T09:12:01.123456789Z [pod/minimax-0/sglang] {line}",  # a prefix inside a prefix
    lambda line: f"<30>Dec  3 09:12:01 gpu-node-3 sglang[812]: {line}",  # syslog (RFC 3164)
], ids=["ansi", "cri", "docker-timestamps", "json-file", "json-record", "cloud-logging", "journald", "journald-iso", "kubectl-prefix",
        "compose", "logfmt", "podman-timestamps", "nested", "syslog"])
def test_a_wrapped_line_is_read_as_what_it_says(wrap):
    assert rows_of("\n".join(wrap(line) for line in (READY, HEALTH_503))) == ["health-failing"]


def test_kubernetes_partial_lines_are_joined_before_matching():
    oom = ROW_INPUTS["cuda-oom"]
    text = f"{TS} stdout F starting\n{TS} stderr P {oom[:20]}\n{TS} stderr P {oom[20:40]}\n{TS} stderr F {oom[40:]}\n"
    [finding] = diagnose_texts([("log", text)]).findings
    assert finding.row == "cuda-oom" and finding.line == oom and finding.line_number == 2


def test_a_later_shutdown_line_does_not_hide_an_earlier_failure():
    shutdown = "[2026-12-03 09:30:00] Health check request received during shutdown. Returning 503."
    assert rows_of("\n".join([READY, HEALTH_503, shutdown, HEALTH_503])) == ["health-failing"]
    assert rows_of("\n".join([READY, shutdown, HEALTH_503])) == []  # 503s after the shutdown line are the shutdown
    sigterm = "[2026-12-03 09:30:00] SIGTERM received. signum=15 frame=None. Draining requests and shutting down..."
    reset = ("[W1203 09:30:01 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=77, addr=[::ffff:127.0.0.1]:39732,"
             " remote=[::ffff:127.0.0.1]:29500): Connection reset by peer")
    assert rows_of("\n".join([READY, sigterm, HEALTH_503, reset])) == []


@pytest.mark.parametrize("line, row", [
    ("huggingface_hub.errors.RevisionNotFoundError: 404 Client Error. (Request ID: Root=1)", "weights-incomplete"),
    ("Revision Not Found for url: https://huggingface.co/api/models/MiniMaxAI/MiniMax-M3.1-Flash/revision/0f3c2a1.",
     "weights-incomplete"),
    ("Repository Not Found for url: https://huggingface.co/api/models/MiniMaxAI/MiniMax-M3-Flash.", "weights-incomplete"),
    ("torch.distributed.DistStoreError: wait timeout after 600000ms, keys: /default_pg//cuda//0", "nccl-hang"),
    ("torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while trying to connect to "
     "(10.0.0.5, 29500).", "nccl-hang"),
    ("[rank2]: torch.distributed.DistStoreError: Socket Timeout", "nccl-hang"),
    ("  Warning  Unhealthy  2m (x40 over 12m)  kubelet  Readiness probe failed: HTTP probe failed with statuscode: 503",
     "health-failing"),
    ('Liveness probe failed: Get "http://10.1.4.7:30000/health": context deadline exceeded', "health-failing"),
    ("3f2a9c1d7e44   lmsysorg/sglang   20 minutes ago   Up 20 minutes (unhealthy)   mm-minimax", "health-failing"),
    ("2026-12-03T09:31:00Z container health_status: unhealthy 3f2a9c1d7e44 (name=mm-minimax)", "health-failing"),
    ("RuntimeError: /models/M/model.safetensors.index.json references 2 shard file(s) missing from /models/M "
     "(incomplete download?): ['model-00012-of-00059.safetensors']", "weights-incomplete"),
    ("safetensors_rust.SafetensorError: Error while deserializing header: header too large", "weights-incomplete"),
    ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached "
     "files.", "weights-incomplete"),
    ("OSError: 0f3c2a1 is not a valid git identifier (branch name, tag name or commit id) that exists for this model "
     "name.", "weights-incomplete"),
    ("RuntimeError: Data processing error: I/O error: No space left on device (os error 28)", "weights-incomplete"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "cuda-oom"),
    ("Exception: Capture cuda graph failed: CUDA error: out of memory", "cuda-oom"),
    ("[2026-12-03 09:30:01 TP0] Decode out of memory. Try to lower your batch size.", "cuda-oom"),
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", "cuda-oom"),
    ("[rank0]:[E1203 ProcessGroupNCCL.cpp:1581] [PG ID 0 PG GUID 0(default_pg) Rank 0] Heartbeat monitor timed out! "
     "Process will be terminated after dumping debug info.", "nccl-hang"),
    ("RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)", "nccl-hang"),
    ("[rank2]: torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId "
     "from [0] via c10d key-value store by key '0', but store->get('0') got error: failed to recv, got 0 bytes",
     "nccl-hang"),
    ("torch.AcceleratorError: CUDA error: invalid device ordinal", "nccl-hang"),
    ('I1203 09:40:01.1 1201 prober.go:107] "Probe failed" probeType="Liveness" pod="ml/minimax-0" '
     'probeResult="failure"', "health-failing"),
    ("  Normal   Killing    30s   kubelet   Container sglang failed startup probe, will be restarted", "health-failing"),
    ("dependency failed to start: container mm-minimax-sglang-1 is unhealthy", "health-failing"),
    ("RuntimeError: Rank 2 scheduler died during initialization (exit code: -9).", "health-failing"),
    ("[2026-12-03 09:10:09] Rank 0 scheduler is dead. Please check if there are relevant logs.", "health-failing"),
    ("[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[10.0.0.6]:24417", "nccl-hang"),
    ("RuntimeError: Socket Timeout", "nccl-hang"),
    ("gpu-node-3:312:312 [0] NCCL WARN Cuda failure 'peer access is not supported between these two devices'",
     "nccl-hang"),
    ("OSError: Error no file named pytorch_model.bin, model.safetensors, tf_model.h5 or flax_model.msgpack found in "
     "directory /models/MiniMax-M3.1-Flash.", "weights-incomplete"),
    ("$ docker inspect --format '{{json .State.Health.Status}}' mm-minimax\n\"unhealthy\"", "health-failing"),
    ("3f2a9c1d7e44   lmsysorg/sglang   30 minutes ago   Exited (137) 2 minutes ago   mm-minimax", "health-failing"),
    ("minimax-0   0/1     CrashLoopBackOff   5 (40s ago)   12m", "health-failing"),
    ("$ curl -i http://127.0.0.1:30000/health\nHTTP/1.1 503 Service Unavailable\ncontent-length: 0", "health-failing"),
    ("wget: server returned error: HTTP/1.1 503 Service Unavailable (http://127.0.0.1:30000/health)", "health-failing"),
    # look alike, are not failures: the IPv6 fallback warning of c10d; a startup probe waiting for the model to load
    ("[W1203 socket.cpp:755] [c10d] The client socket cannot be initialized to connect to [localhost]:29500 "
     "(errno: 97 - Address family not supported by protocol).", None),
    ("  Warning  Unhealthy  9m (x20 over 12m)  kubelet  Startup probe failed: HTTP probe failed with statuscode: 503",
     None),
    ("3f2a9c1d7e44   lmsysorg/sglang   20 minutes ago   Up 20 minutes (healthy)   mm-minimax", None),
    # NCCL's configuration notices at WARN; an OOM SGLang recovers from; a handled hub listing; the KV-size warning
    ("gpu-node-3:312:312 [0] NCCL WARN Cannot initialize CollNet, using point-to-point network instead", None),
    ("[2026-12-03 09:40:01 TP0] retract_decode: aborted last request 5f1c2a due to OOM", None),
    ("[2026-12-03 09:40:01] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.0980 -> "
     "0.3487", None),
    ("9c1d7e443f2a   busybox   2 hours ago   Exited (0) 2 hours ago   mm-prefetch", None),
    ("$ curl -i http://127.0.0.1:30000/v1/models\nHTTP/1.1 503 Service Unavailable", None),
    ("I0527 15:16:51.665462 58626 ProcessGroupNCCL.cpp:878] [PG 0 Rank 2] ProcessGroupNCCL environments: NCCL version: "
     "2.18.3, TORCH_NCCL_DUMP_ON_TIMEOUT: 0, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: 600, TORCH_NCCL_BLOCKING_WAIT: 0", None),
    ("Listing MiniMaxAI/MiniMax-M3.1-Flash on the Hub failed, using the local snapshot: Cannot reach "
     "https://huggingface.co/api/models/x: offline mode is enabled.", None),
    ("KV pool holds 524288 tokens, fewer than --context-length 1048576. Lower --context-length, raise "
     "--mem-fraction-static, or free memory taken before the pool is sized.", None),
    ("Exception: Capture cuda graph failed: CUDA error: an illegal memory access was encountered", None),
    ("[W1203 09:10:05 socket.cpp:462] [c10d] The client socket has failed to connect to [gpu-node-2]:29500 "
     "(errno: 111 - Connection refused).", None),
])
def test_sibling_messages_of_the_cited_sources_name_their_row(line, row):
    assert rows_of(line) == ([row] if row else [])


def test_a_vllm_log_is_known_by_its_process_prefix():
    log = ('(APIServer pid=1) INFO:     Application startup complete.\n'
           '(APIServer pid=1) INFO:     127.0.0.1:50421 - "GET /health HTTP/1.1" 503 Service Unavailable\n')
    result = diagnose_texts([("log", log)])
    assert result.engine == "vllm" and [f.row for f in result.findings] == ["health-failing"]


def test_vllms_uninitialized_weights_are_missing_weights():
    line = "ValueError: Following weights were not initialized from checkpoint: {'model.layers.47.mlp.experts.w13_weight'}"
    assert rows_of(line, engine="vllm") == ["weights-incomplete"]
    assert rows_of(line) == ["weights-incomplete"]  # a bare line: the engine is not known, the message is the same
    assert rows_of("ValueError: Some weights are not initialized from checkpoints: {'lm_head.weight'}") == [
        "weights-incomplete"]


def test_an_answer_that_quotes_the_reasoning_tags_is_no_leak():
    def answer(content):
        return json.dumps({"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": content}}]})
    assert rows_of(answer("MiniMax M3 reasons between <mm:think> and </mm:think>; the parser removes them.")) == []
    assert rows_of(answer("The user asks about primes.\n</mm:think>\nThere are 15.")) == ["raw-think-tokens"]
    assert rows_of(answer("  <mm:think>The user asks about primes.")) == ["raw-think-tokens"]


def test_a_tmpfs_kernel_cache_mount_is_not_persisted():
    tmpfs = [{"Type": "tmpfs", "Source": "", "Destination": "/root/.cache/minfer"}]
    [finding] = diagnose_texts(mounts=("c", tmpfs)).findings
    assert finding.row == "kernel-cache-not-persisted" and "tmpfs" in finding.line
    bind = [{"Type": "bind", "Source": "/srv/minfer", "Destination": "/root/.cache/minfer"}]
    assert diagnose_texts(mounts=("c", bind)).findings == ()


@pytest.mark.parametrize("args, shown, proposed", [
    ("server_args=ServerArgs(model_path='/models/M', mem_fraction_static=0.92, chunked_prefill_size=16384)", "0.92", "0.75"),
    ("server_args={'model_path': '/models/M', 'mem_fraction_static': 0.7, 'chunked_prefill_size': 8192}", "0.7", "0.65"),
])
def test_the_oom_fix_lowers_the_value_the_log_shows(args, shown, proposed):
    [finding] = diagnose_texts([("log", f"[2026-12-03 09:10:00] {args}\n{ROW_INPUTS['cuda-oom']}\n")]).findings
    assert f"the log shows --mem-fraction-static {shown} " in finding.fix
    assert f"mm launch MODEL_DIR --hardware HW --mem-fraction-static {proposed}" in finding.fix
    assert "below 0.8" not in finding.fix
    assert "0.05 (mm's own step) under the lower of the guide's 0.8 and what ran" in finding.fix  # how it was found


def test_the_oom_fix_with_a_plan_names_the_launch_that_applies_it(model_dir):
    log = "server_args=ServerArgs(mem_fraction_static=0.92)\n" + ROW_INPUTS["cuda-oom"] + "\n"
    plan = plan_node(model_dir, LaunchOptions(hardware="b300"), check_dir=False).first
    [finding] = diagnose_texts([("log", log)], plan=plan).findings
    command = f"mm launch {model_dir} --hardware b300 --mem-fraction-static 0.75"
    assert command in finding.fix
    script = run_mm(*command.split()[1:])  # the fix is a command that works: its script carries the override
    assert script.returncode == 0, script.stderr
    assert "--mem-fraction-static 0.75 \\" in script.stdout and "# Override: --mem-fraction-static 0.75" in script.stdout


def test_row_2_with_the_pinned_image_already_running_points_to_cuda_home(model_dir):
    plan = plan_node(model_dir, LaunchOptions(hardware="b300"), check_dir=False).first
    assert plan.image == PIN.image
    [finding] = diagnose_texts([("log", ROW_INPUTS["nvfp4-slow-path"])], plan=plan).findings
    assert "already runs the pinned image" in finding.fix and "CUDA_HOME" in finding.fix


def test_an_sm120_gpu_is_named_as_the_reason_not_the_toolkit():
    [sm120] = diagnose_texts([("log", "Selected NVCC does not accept QMUL4 for SM120; using FP16 dequant fallback")]).findings
    assert sm120.row == "nvfp4-slow-path" and sm120.fix.startswith("the GPU is the reason, not the toolkit")
    [sm100] = diagnose_texts([("log", "Selected NVCC does not accept QMUL4 for SM100a; using FP16 dequant fallback")]).findings
    assert "CUDA_HOME" in sm100.fix


def test_a_full_disk_is_named_in_the_fix(model_dir):
    line = "OSError: [Errno 28] No space left on device: '/models/MiniMax-M3.1-Flash/model-00031-of-00059.safetensors'"
    [bare] = diagnose_texts([("log", line)]).findings
    assert bare.row == "weights-incomplete" and bare.fix.startswith("the disk is full")
    plan = plan_node(model_dir, LaunchOptions(hardware="b300"), check_dir=False).first
    [here] = diagnose_texts([("log", line)], plan=plan).findings
    assert here.fix.startswith("the disk is full") and f"mm verify {model_dir}" in here.fix


def test_a_logfmt_message_with_an_unclosed_quote_is_read_as_printed():
    line = 'time=2026-12-03T09:30:01Z level=error msg="[TP0] Prefill out of memory. Try to lower your batch size.'
    assert rows_of(line) == ["cuda-oom"]


def test_a_docker_events_line_is_not_taken_for_journald():
    line = "2026-12-03T09:31:00.000000000Z container health_status: unhealthy 3f2a9c1d7e44 (name=mm-minimax)"
    assert rows_of(line) == ["health-failing"]


@pytest.mark.parametrize("failure, row", [
    (ROW_INPUTS["cuda-oom"], "cuda-oom"),
    ("huggingface_hub.errors.LocalEntryNotFoundError: Cannot find the requested files in the disk cache and outgoing "
     "traffic has been disabled.", "weights-incomplete"),
    ("gpu-node-3:312:901 [2] NCCL WARN socketProgressOpt: Call to recv from 10.0.0.6<53210> failed : Connection reset "
     "by peer", "nccl-hang"),
])
def test_a_failure_the_server_recovers_from_is_voided_by_its_later_ready_line(failure, row):
    assert rows_of(failure) == [row]
    assert rows_of(f"{failure}\n{READY}") == []  # handled: the server came up after it
    assert rows_of(f"{READY}\n{failure}") == [row]  # after the start, it is the failure


def test_a_weight_that_failed_to_load_is_a_finding_even_when_the_server_starts():
    line = ("[2026-12-03 09:11:02 TP0] Error loading weight model.layers.3.self_attn.o_proj.weight: Attempted to load "
            "weight (torch.Size([6144, 4096])) into parameter (torch.Size([6144, 6144]))")
    assert rows_of(f"{line}\n{READY}") == ["weights-incomplete"]
    assert rows_of(f"Parameter model.mtp.0.eh_proj.weight not found in params_dict\n{READY}") == []


def test_a_start_that_stops_in_torch_distributed_init_is_the_nccl_hang_unless_another_row_names_the_cause():
    begin = "\n".join(f"[2026-12-03 09:10:02 TP{r}] Init torch distributed begin." for r in range(4))
    assert rows_of(begin + "\ngpu-node-3:312:312 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.5<0>") == ["nccl-hang"]
    assert rows_of(begin + "\n[2026-12-03 09:10:09 TP0] Init torch distributed ends. mem usage=1.12 GB") == []
    assert rows_of(f"{begin}\n{ROW_INPUTS['cuda-oom']}") == ["cuda-oom"]
    assert rows_of(begin + "\nRuntimeError: CUDA error: an illegal memory access was encountered") == []


def test_a_message_with_its_own_fix_is_not_given_the_fraction_the_log_shows():
    log = ("server_args=ServerArgs(mem_fraction_static=0.8)\n"
           "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
           "mem_fraction_static=0.8\n")
    [finding] = diagnose_texts([("log", log)]).findings
    assert finding.row == "cuda-oom" and "asks for a larger --mem-fraction-static" in finding.fix
    assert "--mem-fraction-static 0.75" not in finding.fix


def test_the_literal_shortcut_gives_every_pattern_the_regexs_own_answer():
    """Each pattern is searched only on lines holding a literal every match holds: on every line of the corpora (and
    the table's own rows' inputs), the answer is the regex's."""
    from mm.artifacts.serving.diagnose import _searcher, normalised

    here = Path(__file__).parent
    lines = {text for d in sorted(here.glob("diagnose_*")) for f in d.iterdir()
             for _, text in normalised(f.read_text(errors="replace").splitlines())}
    lines |= set(ROW_INPUTS.values())
    patterns = {getattr(d, k) for row in load_table().rows for d in row.detect
                for k in ("pattern", "unless", "also", "after", "cleared_by", "again_after", "near") if getattr(d, k) is not None}
    swapped = {line.swapcase() for line in lines}  # a case-insensitive pattern's literals are tested lower-cased
    wrong = [(p.pattern, line) for p in patterns for line in (lines | swapped if p.flags & re.IGNORECASE else lines)
             if bool(_searcher(p)(line)) != bool(p.search(line))]
    assert not wrong, wrong[:3]


SGLANG_NO_PARSER = "[2026-12-03 09:07:02] server_args=ServerArgs(model_path='/models/M', reasoning_parser=None, tool_call_parser=None)"
SGLANG_PARSERS = ("[2026-12-03 09:07:02] server_args=ServerArgs(model_path='/models/M', reasoning_parser='minimax-m3', "
                  "tool_call_parser='minimax-m3')")


@pytest.mark.parametrize("line", [
    "[2026-12-03 09:15:42] Receive: obj=ChatCompletionRequest(messages=[{'role': 'user', 'content': 'It died with "
    "torch.OutOfMemoryError: CUDA out of memory. and a Watchdog caught collective operation timeout'}], rid='9a7c')",
    "[2026-12-03 09:15:42] Receive: obj=GenerateReqInput(text='Why does safetensors say incomplete metadata, file not "
    "fully covered?', rid='9a7c')",
    "[2026-12-03 09:15:45] Finish: obj=ChatCompletionRequest(rid='9a7c'), out={'text': 'The CUDA out of memory message "
    "means the batch did not fit.', 'meta_info': {'completion_tokens': 412}}",
    "[2026-12-03 09:15:42] Receive OpenAI: obj={'messages': [{'role': 'user', 'content': 'NCCL error: unhandled system "
    "error'}], 'model': 'M'}",
    '[2026-12-03 09:15:42] {"timestamp": "2026-12-03T09:15:42", "event": "request.received.openai", "obj": {"messages": '
    '[{"role": "user", "content": "CUDA out of memory. Tried to allocate 2.00 GiB"}]}}',
    "(APIServer pid=1) INFO 12-03 09:15:42 [logger.py:52] Request chatcmpl-1 details: prompt: 'torch.OutOfMemoryError: "
    "CUDA out of memory.', prompt_token_ids: None, prompt_embeds shape: None.",
    "(APIServer pid=1) INFO 12-03 09:15:45 [logger.py:80] Generated response chatcmpl-1: output: 'Watchdog caught "
    "collective operation timeout means a rank stalled', finish_reason: stop",
    "(APIServer pid=1) INFO 12-03 09:15:42 [logger.py:66] Received request chatcmpl-1: params: SamplingParams(n=1, "
    "stop=['CUDA out of memory'], max_tokens=64), lora_request: None.",
])
def test_a_request_log_line_is_user_data_not_a_server_failure(line):
    assert rows_of(f"{READY}\n{line}") == []


def test_thinking_type_errors_in_a_server_log_name_row_9():
    pydantic = ("[2026-12-01 09:06:58] Error in request: 1 validation error for ChatCompletionRequest\nthinking.type\n"
                "  Input should be 'enabled', 'disabled' or 'adaptive' [type=literal_error, input_value='on', "
                "input_type=str]\n    For further information visit https://errors.pydantic.dev/2.12/v/literal_error\n")
    assert rows_of(pydantic) == ["thinking-type-400"]
    assert rows_of(pydantic.replace("thinking.type", "messages.0.content")) == []
    handler = ("[2026-12-01 09:06:58] 1 validation error: [{'type': 'literal_error', 'loc': ('body', 'thinking', 'type'), "
               "'msg': \"Input should be 'enabled', 'disabled' or 'adaptive'\", 'input': 'on'}]")
    assert rows_of(handler) == ["thinking-type-400"]
    body = ('gateway: status=400 body={"object": "error", "message": "thinking.type must be one of \'enabled\', '
            '\'disabled\', \'adaptive\'; got \'budget\'", "type": "BadRequestError", "code": 400}')
    assert rows_of(body) == ["thinking-type-400"]
    answer = json.dumps({"error": {"message": "thinking.type must be one of enabled, disabled, adaptive", "code": 400}})
    assert rows_of(answer) == ["thinking-type-400"]
    request = "[2026-12-01 09:06:58] Receive: obj=ChatCompletionRequest(messages=[], thinking={'type': 'on'}, rid='1')"
    assert rows_of(request) == ["thinking-type-400"]
    assert rows_of(request.replace("'on'", "'adaptive'")) == []


def test_an_effort_in_chat_template_kwargs_shows_in_a_request_log_line_even_split_by_cri():
    request = ("[2026-12-03 09:40:42] Receive: obj=ChatCompletionRequest(messages=[{'role': 'user', 'content': 'Summarise "
               "this.'}], reasoning_effort=None, chat_template_kwargs={'reasoning_effort': 'high'}, rid='b1e0')")
    assert rows_of(request) == ["reasoning-effort-ignored"]
    cut = len(request) // 2
    cri = f"{TS} stderr P {request[:cut]}\n{TS} stderr F {request[cut:]}\n"
    assert rows_of(cri) == ["reasoning-effort-ignored"]
    assert rows_of("[2026-12-03 09:40:42] Receive OpenAI: obj={'messages': [], 'chat_template_kwargs': "
                   "{'reasoning_effort': 'max'}}") == ["reasoning-effort-ignored"]
    quoted = ("[2026-12-03 09:40:42] Receive: obj=ChatCompletionRequest(messages=[{'role': 'user', 'content': \"Should I "
              "send chat_template_kwargs={'reasoning_effort': 'high'}?\"}], reasoning_effort='high', rid='b1e1')")
    assert rows_of(quoted) == []  # what the user wrote is not the request's field
    off = "[2026-12-03 09:40:42] Receive: obj=ChatCompletionRequest(messages=[], reasoning_effort='high', thinking={'type': 'disabled'})"
    assert rows_of(off) == ["reasoning-effort-ignored"]
    assert rows_of(off.replace("'disabled'", "'adaptive'")) == []


def test_raw_tags_in_a_logged_output_are_a_leak_only_when_the_server_runs_no_parser():
    finish = ("[2026-12-02 09:10:45] Finish: obj=ChatCompletionRequest(rid='4c1e'), out={'text': '<mm:think>Call "
              "get_weather.</mm:think>\\n<minimax:tool_call>\\n<invoke name=\"get_weather\">', 'meta_info': {}}")
    assert rows_of(f"{SGLANG_NO_PARSER}\n{READY}\n{finish}") == ["raw-think-tokens"]
    assert rows_of(f"{SGLANG_PARSERS}\n{READY}\n{finish}") == []  # the raw output always holds them; the parser strips
    as_json = ('{"timestamp": "2026-12-02T09:10:45", "event": "request.finished", "rid": "4c1e", "obj": {}, '
               '"out": {"text": "The user asks.</mm:think>It is 18 C."}}')
    assert rows_of(f"{SGLANG_NO_PARSER}\n{as_json}") == ["raw-think-tokens"]


def test_a_media_loaders_network_error_after_the_start_is_a_remote_image_failure():
    trace = (
        "[2026-12-01 09:47:51] Error in request: Traceback (most recent call last):\n"
        '  File "/sgl-workspace/sglang/python/sglang/srt/utils/common.py", line 812, in load_image\n'
        "    response = requests.get(image_file, stream=True, timeout=timeout)\n"
        "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='raw.githubusercontent.com', port=443): Read timed "
        "out. (read timeout=3)\n")
    assert rows_of(f"{READY}\n{trace}") == ["remote-image-failed"]
    assert rows_of(f"{READY}\n{trace.replace('in load_image', 'in hf_hub_download')}") == []
    dns = ("[2026-12-02 09:30:45] Error in request: Failed to load image from https://raw.githubusercontent.com/x.png: "
           "HTTPSConnectionPool(host='raw.githubusercontent.com', port=443): Max retries exceeded with url: /x.png (Caused "
           "by NameResolutionError(\"Failed to resolve 'raw.githubusercontent.com' ([Errno -3] Temporary failure in name "
           "resolution)\"))")
    assert rows_of(f"{READY}\n{dns}") == ["remote-image-failed"]
    assert rows_of(dns) == []  # before the server started it is no request's failure
    vllm = ("(APIServer pid=1) ERROR 12-03 09:31:02 [serving.py:310] Failed to fetch media from URL: HTTP 404 error")
    assert rows_of(f"(APIServer pid=1) INFO:     Application startup complete.\n{vllm}") == ["remote-image-failed"]


def test_msa_aot_cache_disabled_in_the_environment_is_a_cache_not_persisted():
    [finding] = diagnose_texts([("log", "[pod/m-0/sglang] + export MSA_V1_AOT_DISABLE=1")]).findings
    assert finding.row == "kernel-cache-not-persisted" and finding.fix.startswith("unset MSA_V1_AOT_DISABLE")
    assert rows_of("MSA_V1_AOT_DISABLE=true") == ["kernel-cache-not-persisted"]
    assert rows_of("[pod/m-0/sglang] + export MSA_V1_AOT_DISABLE=0") == []


def test_a_kernel_compiled_again_after_a_restart_is_a_cache_not_persisted_but_a_first_start_is_not():
    start = ("[2026-12-03 09:36:02] server_args=ServerArgs(model_path='/models/M', tp_size=4)\n"
             "[2026-12-03 09:38:01 TP0] [msa_v1] AOT cache miss: msa_v1_decode_q8kv4; starting cute.compile\n"
             "[2026-12-03 09:39:22 TP0] [msa_v1] cute.compile done: msa_v1_decode_q8kv4 in 80.3s\n"
             "[2026-12-03 09:39:22 TP0] Saved AOT kernel msa_v1_decode_q8kv4 to /root/.cache/minfer/msa_v1/a41c/k.o in 0.4s\n"
             f"{READY}\n")
    assert rows_of(start) == []  # one start that compiles and saves: a first start
    assert rows_of(start + start) == ["kernel-cache-not-persisted"]  # the next start compiled it again


def test_a_download_that_broke_mid_file_is_missing_weights_with_a_fetch_outside_the_server():
    cut = ("OSError: Consistency check failed: file should be of size 5003742880 but has size 2147483648 "
           "(model-00012-of-00059.safetensors).\nThis is usually due to network issues while downloading the file. "
           "Please retry with `force_download=True`.")
    [finding] = diagnose_texts([("log", cut)]).findings
    assert finding.row == "weights-incomplete" and "`mm fetch --local-dir DIR`" in finding.fix
    assert rows_of(f"{cut}\n{READY}") == []  # a retry fetched it: the server came up


def test_the_hub_giving_up_after_its_retries_is_missing_weights_but_a_resumed_download_is_not():
    warning = ("[2026-12-03 09:12:49] Error while downloading from https://cas-bridge.xethub.hf.co/x: "
               "HTTPSConnectionPool(host='cas-bridge.xethub.hf.co', port=443): Read timed out.")
    assert rows_of(f"{warning}\nMax retries exceeded.") == ["weights-incomplete"]
    assert rows_of(f"{warning}\nTrying to resume download...") == []


NCCL_START = "\n".join(f"gpu-7:48:31{r} [{r}] NCCL INFO comm 0x5581c2d0 rank {r} nranks 4 cudaDev {r} nvmlDev {r} "
                       f"busId {r + 1}2000 commId 0x7e1f5a2b9c3d4e61 - Init START" for r in range(4))
CTRL_C = ("^C\nTraceback (most recent call last):\n"
          '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/distributed_c10d.py", line 4797, in barrier\n'
          "    work = group.barrier(opts=opts)\nKeyboardInterrupt")


def test_an_nccl_init_that_never_completes_is_the_hang_also_when_the_user_stopped_it_with_ctrl_c():
    assert rows_of(f"{NCCL_START}\n{CTRL_C}") == ["nccl-hang"]
    complete = NCCL_START.replace("Init START", "Init COMPLETE")
    assert rows_of(f"{NCCL_START}\n{complete}\n{CTRL_C}") == []  # it came up: the user stopped a running server


def test_a_ctrl_c_traceback_does_not_void_a_stop_in_torch_distributed_init_but_an_error_does():
    begin = "\n".join(f"[2026-12-03 09:10:02 TP{r}] Init torch distributed begin." for r in range(4))
    assert rows_of(f"{begin}\n{CTRL_C}") == ["nccl-hang"]
    assert rows_of(f"{begin}\nTraceback (most recent call last):\nAssertionError") == []


def test_health_503s_from_a_start_that_never_finished_are_row_11_unless_it_became_ready_or_another_row_names_why():
    polls = "\n".join([HEALTH_503] * 3)
    [finding] = diagnose_texts([("log", polls)]).findings
    assert finding.row == "health-failing" and "until its start-up finishes" in finding.fix
    assert rows_of(f"{polls}\n{READY}") == []
    assert rows_of(f'{polls}\nINFO:     127.0.0.1:50422 - "GET /health HTTP/1.1" 200 OK') == []
    assert rows_of(f"{polls}\n{ROW_INPUTS['cuda-oom']}") == ["cuda-oom"]


def test_a_whole_nvfp4_kv_start_that_becomes_ready_without_the_backend_line_is_the_slow_path():
    args = "[2026-12-03 09:12:03] server_args=ServerArgs(model_path='/models/M', kv_cache_dtype='fp4_e2m1', tp_size=4)"
    qmul4 = "[2026-12-03 09:12:40 TP0] Compiled inference.dequant.nvfp4_to_fp8 backend=qmul4 in 38.4s"
    assert rows_of(f"{args}\n{READY}") == ["nvfp4-slow-path"]
    assert rows_of(f"{args}\n{qmul4}\n{READY}") == []
    assert rows_of(f"{args}\n{READY}\n{qmul4}") == []  # the line came after the ready line
    assert rows_of(f"{args.replace('fp4_e2m1', 'auto')}\n{READY}") == []  # no NVFP4 KV cache: nothing to expect


def test_vllms_aiohttp_error_fetching_an_image_after_the_start_is_a_remote_image_failure():
    trace = ("ERROR 11-20 09:12:33 [serving_chat.py:221] Error in preprocessing prompt inputs\n"
             "ERROR Traceback (most recent call last):\n"
             '  File "/usr/local/lib/python3.12/dist-packages/vllm/connections.py", line 91, in async_get_bytes\n'
             "    async with await self.get_async_response(url, timeout=timeout) as r:\n"
             "aiohttp.client_exceptions.ClientResponseError: 403, message='Forbidden', "
             "url='https://images.example-cdn.com/cat.png'")
    started = "INFO:     Application startup complete."
    assert rows_of(f"{started}\n{trace}") == ["remote-image-failed"]
    assert rows_of(f"{started}\n{trace.replace('images.example-cdn.com', '127.0.0.1:8000')}") == []


def test_a_kernel_msa_saved_again_after_a_restart_is_a_cache_not_persisted():
    start = ("[2026-12-03 09:36:02] server_args=ServerArgs(model_path='/models/M', tp_size=4)\n"
             "[2026-12-03 09:39:22 TP0] Saved AOT kernel msa_v1_topk_select to /root/.cache/minfer/msa_v1/a41c/k.o in 0.4s\n"
             f"{READY}\n")
    assert rows_of(start) == []
    assert rows_of(start + start) == ["kernel-cache-not-persisted"]


def test_a_health_check_that_failed_while_the_server_still_started_is_voided_by_its_ready_line():
    refused = "curl: (7) Failed to connect to 127.0.0.1 port 30000 after 0 ms: Couldn't connect to server"
    assert rows_of(f"{refused}\n{READY}") == []
    assert rows_of(f"{refused}\n{READY}\n{refused}") == ["health-failing"]  # after the start, it is the symptom


def test_a_vllm_error_answer_quoting_the_image_hosts_403_is_a_remote_image_failure(tmp_path):
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"error": {"message": "403, message='Forbidden', url='https://images.example-cdn.com/cat.png'",
                                            "type": "BadRequestError", "code": 400}}))
    assert [f.row for f in run_diagnosis(DiagnoseRequest(answers=(answer,))).findings] == ["remote-image-failed"]
    answer.write_text(json.dumps({"error": {"message": "401 Client Error: Unauthorized for url: "
                                            "https://huggingface.co/api/models/x", "code": 400}}))
    assert run_diagnosis(DiagnoseRequest(answers=(answer,))).findings == ()


def test_a_traceback_through_the_hubs_downloader_ending_in_a_network_error_is_missing_weights():
    frame = ('Traceback (most recent call last):\n  File "/usr/local/lib/python3.12/dist-packages/huggingface_hub/'
             'file_download.py", line 517, in http_get\n')
    broken = "httpx.RemoteProtocolError: peer closed connection without sending complete message body (incomplete chunked read)"
    assert rows_of(frame + broken) == ["weights-incomplete"]
    assert rows_of(frame.replace("huggingface_hub/file_download.py", "sglang/srt/utils/common.py") + broken) == []


def test_a_vllm_log_is_known_by_its_api_server_start_line():
    log = "2026-11-20T09:12:03.037Z stderr F INFO 11-20 09:12:03 [api_server.py:1880] Starting vLLM API server 0 on http://0.0.0.0:8000"
    assert diagnose_texts([("log", log)]).engine == "vllm"


def test_a_start_without_the_nvfp4_line_is_told_why_the_line_matters():
    log = "server_args=ServerArgs(model_path='/models/M', kv_cache_dtype='fp4_e2m1')\n" + READY
    [finding] = diagnose_texts([("log", log)]).findings
    assert "without the `nvfp4_to_fp8 backend=` line" in finding.fix and "CUDA_HOME" in finding.fix


REFUSED = "curl: (7) Failed to connect to localhost port 30000 after 0 ms: Couldn't connect to server"


def test_a_docker_health_state_that_is_healthy_again_is_no_failure_whatever_its_log_of_earlier_checks_says():
    checks = [{"Start": "2026-12-03T09:22:12Z", "End": "2026-12-03T09:22:12Z", "ExitCode": 7, "Output": REFUSED + "\n"},
              {"Start": "2026-12-03T09:22:42Z", "End": "2026-12-03T09:22:42Z", "ExitCode": 0, "Output": ""}]
    health = {"Status": "healthy", "FailingStreak": 0, "Log": checks}
    assert rows_of(json.dumps(health)) == []
    assert rows_of(json.dumps([{"Id": "9c2e", "State": {"Status": "running", "Health": health}}], indent=4)) == []
    checks[1].update(ExitCode=7, Output=REFUSED)
    assert rows_of(json.dumps(dict(health, Status="starting", FailingStreak=2))) == ["health-failing"]


def test_dockers_healthy_verdict_after_failed_checks_voids_them():
    assert rows_of(f"{REFUSED}\n9c2e4f1a7b3d   sglang   Up 14 minutes (healthy)   127.0.0.1:30000->30000/tcp   m") == []
    assert rows_of(f"{REFUSED}\n2026-12-03T09:23:12Z container health_status: healthy 9c2e (name=m)") == []


def test_a_health_poll_traced_by_set_x_is_judged_by_its_last_attempt():
    attempt = "+ curl --fail --silent --show-error http://127.0.0.1:30000/health"
    failing = f"{attempt}\n{REFUSED}\n+ sleep 30\n" * 3
    assert rows_of(f"{failing}{attempt}\n+ echo 'server healthy'\nserver healthy") == []
    assert rows_of(f"{failing}{attempt}\n{REFUSED}\n+ exit 1") == ["health-failing"]


def test_a_media_fetch_failure_in_a_fragment_of_a_serving_log_counts_without_the_ready_line():
    trace = ("[2026-12-03 09:14:37] Error in request: Traceback (most recent call last):\n"
             '  File "/sgl-workspace/sglang/python/sglang/srt/managers/tokenizer_manager.py", line 712, in _tokenize_one_request\n'
             "    mm_inputs = await self.mm_processor.process_mm_data_async(\n"
             '  File "/sgl-workspace/sglang/python/sglang/srt/utils/common.py", line 861, in load_image\n'
             "    response = requests.get(image_file, stream=True, timeout=timeout)\n"
             "requests.exceptions.HTTPError: 403 Client Error: Forbidden for url: https://images.example-cdn.com/cat.png")
    assert rows_of(trace) == ["remote-image-failed"]
    served = '[2026-12-03 09:14:11] INFO:     172.17.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
    no_request_frame = "\n".join(line for line in trace.splitlines() if "tokenizer_manager" not in line and "mm_inputs" not in line)
    assert rows_of(f"{served}\n{no_request_frame}") == ["remote-image-failed"]


def test_vllms_logger_header_repeated_on_every_line_of_a_traceback_is_read_past():
    header = "(APIServer pid=1) ERROR 12-03 12:01:04 [serving_chat.py:257] "
    trace = "\n".join(header + line for line in (
        "Error in preprocessing prompt inputs", "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/multimodal/utils.py", line 216, in fetch_image_async',
        "    return await self.load_from_url_async(",
        "aiohttp.client_exceptions.ClientConnectorError: Cannot connect to host raw.githubusercontent.com:443 "
        "ssl:default [Temporary failure in name resolution]"))
    started = "(APIServer pid=1) INFO:     Application startup complete."
    [finding] = diagnose_texts([("log", f"{started}\n{trace}")]).findings
    assert finding.row == "remote-image-failed" and finding.line.startswith("aiohttp.client_exceptions.")


def test_an_answer_a_gateway_logs_inside_its_json_record_is_judged_as_the_answer():
    markup = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Shanghai</parameter>\n</invoke>\n</minimax:tool_call>'

    def record(**fields) -> str:
        return json.dumps({"level": "warn", "ts": "2026-12-03T10:15:03Z", "msg": "upstream response", **fields})
    assert rows_of(record(response_preview={"finish_reason": "stop", "tool_calls": None, "content": markup})) == [
        "raw-think-tokens"]
    assert rows_of(record(upstream_body=json.dumps({"choices": [{"message": {"role": "assistant", "content": markup}}]}))) == [
        "raw-think-tokens"]
    assert rows_of(record(messages=[{"role": "assistant", "content": markup}])) == []  # a request: what a client sent
    prose = "The M2 format opens with <minimax:tool_call>; M3 has its own."
    assert rows_of(record(response_preview={"finish_reason": "stop", "content": prose})) == []


def test_openai_pythons_print_of_a_400_about_thinking_type_is_row_9():
    errors = ("[{'type': 'literal_error', 'loc': ('body', 'thinking', 'type'), 'msg': \"Input should be 'enabled', "
              "'disabled' or 'adaptive'\", 'input': 'auto'}]")
    body = {"object": "error", "message": f"1 validation error:\n  {errors[1:-1]}\n {errors}", "type": "Bad Request",
            "param": None, "code": 400}
    assert rows_of(f"openai.BadRequestError: Error code: 400 - {body!r}") == ["thinking-type-400"]
    assert rows_of(f"openai.BadRequestError: Error code: 400 - {body!r}".replace("thinking", "messages")) == []


SCRIPT = '''for effort in ["low", "high"]:
    r = client.chat.completions.create(
        model="MiniMaxAI/MiniMax-M3.1-Flash",
        messages=[{"role": "user", "content": "Explain why reasoning_effort and thinking disabled clash."}],
        reasoning_effort=effort,
        extra_body={"thinking": {"type": "disabled"}},
        max_tokens=4096,
    )
    print(effort, r.usage.completion_tokens)'''


def test_a_python_scripts_request_with_an_effort_and_thinking_disabled_is_row_10():
    [finding] = diagnose_texts([("log", SCRIPT)], engine="sglang").findings
    assert finding.row == "reasoning-effort-ignored" and "`effort`" in finding.line
    assert rows_of(SCRIPT.replace('"disabled"', '"enabled"'), engine="sglang") == []
    assert rows_of(SCRIPT.replace("reasoning_effort=effort", 'reasoning_effort="none"'), engine="sglang") == []
    posted = ('requests.post(URL, json={"model": "M", "messages": [], "reasoning_effort": "high",\n'
              '                          "thinking": {"type": "disabled"}}, timeout=60)')
    assert rows_of(posted, engine="sglang") == ["reasoning-effort-ignored"]


def test_a_pod_that_is_ready_now_is_no_probe_failure_whatever_its_events_kept():
    events = ("Events:\n  Type     Reason     Age                 From     Message\n"
              "  Warning  Unhealthy  12m (x30 over 21m)  kubelet  Readiness probe failed: Get \"http://10.244.3.21:30000/"
              "health\": dial tcp 10.244.3.21:30000: connect: connection refused")
    conditions = "Conditions:\n  Type              Status\n  Initialized       True\n  Ready             {}\n"
    assert rows_of(conditions.format("True") + events) == []
    assert rows_of(conditions.format("False") + events) == ["health-failing"]


def test_a_200_the_client_printed_after_failed_checks_voids_them():
    assert rows_of(f"{REFUSED}\nHTTP/1.1 200 OK\ncontent-length: 0") == []
    assert rows_of(f"{REFUSED}\n<Response [200]>") == []


def test_an_answer_printed_by_openai_python_is_judged_as_the_answer():
    def printed(content: str) -> str:
        return (f"ChatCompletion(id='c1', choices=[Choice(finish_reason='stop', index=0, logprobs=None, message="
                f"ChatCompletionMessage(content={content!r}, refusal=None, role='assistant', tool_calls=None))])")
    assert rows_of(printed('<minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n</minimax:tool_call>')) == [
        "raw-think-tokens"]
    assert rows_of(printed("<mm:think>The user asks for the weather.")) == ["raw-think-tokens"]
    assert rows_of(printed("It is 18 C in Shanghai.")) == []


def test_a_media_urls_network_error_logged_without_its_traceback_is_a_remote_image_failure():
    served = '[2026-12-03 09:14:11] INFO:     172.17.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
    error = ("[2026-12-03 09:14:37] Error in request: HTTPSConnectionPool(host='cdn.example.com', port=443): Max retries "
             "exceeded with url: /a/cat.jpg (Caused by NameResolutionError(\"Failed to resolve 'cdn.example.com'\"))")
    assert rows_of(f"{served}\n{error}") == ["remote-image-failed"]
    assert rows_of(f"{served}\n{error.replace('cat.jpg', 'model-00001-of-00059.safetensors')}") == []
    hub = "404 Client Error: Not Found for url: https://huggingface.co/M/resolve/main/figures/bench.png"
    assert rows_of(f"{served}\n{hub}") == []  # the Hub's pictures are the model repo's, not a request's image


def test_a_container_unhealthy_while_it_started_and_healthy_since_is_no_failure():
    unhealthy = "2026-12-03T09:20:12Z container health_status: unhealthy 9c2e (image=sglang, name=m)"
    healthy = "2026-12-03T09:25:12Z container health_status: healthy 9c2e (image=sglang, name=m)"
    assert rows_of(f"{unhealthy}\n{healthy}") == []
    assert rows_of(f"{healthy}\n{unhealthy}") == ["health-failing"]


def test_readiness_failures_followed_by_a_pod_whose_ready_column_is_full_are_no_failure():
    failed = "  Warning  Unhealthy  12m (x30 over 21m)  kubelet  Readiness probe failed: HTTP probe failed with statuscode: 503"
    assert rows_of(f"{failed}\nNAME         READY   STATUS    RESTARTS   AGE\nminimax-0    1/1     Running   0          21m") == []
    assert rows_of(f"{failed}\nNAME         READY   STATUS    RESTARTS   AGE\nminimax-0    0/1     Running   0          21m") == [
        "health-failing"]


def test_a_health_poll_loop_that_returned_to_the_prompt_passed_its_check():
    loop = "$ until curl --fail --silent --show-error http://127.0.0.1:30000/health; do sleep 30; done\n" + f"{REFUSED}\n" * 3
    assert rows_of(f"{loop}$ curl -s http://127.0.0.1:30000/v1/models") == []
    assert rows_of(loop) == ["health-failing"]  # still waiting when pasted
    assert rows_of(f"{loop}^C\n$ docker ps") == ["health-failing"]  # stopped by hand


def test_a_grep_for_a_message_on_the_command_line_is_not_the_message():
    search = "$ docker logs minimax 2>&1 | grep 'nvfp4_to_fp8 backend='\n"
    assert rows_of(f"{search}[2026-11-26 09:14:02 TP0] nvfp4_to_fp8 backend=qmul4") == []
    assert rows_of(f"{search}[2026-11-26 09:14:02 TP0] nvfp4_to_fp8 backend=fp16_fallback") == ["nvfp4-slow-path"]


def openai_status_error(status: int, message: str) -> str:
    """openai-python's status error as a traceback's last line: f"Error code: {status} - {body}", body a dict."""
    kind = {400: "BadRequestError", 500: "InternalServerError"}[status]
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return f"openai.{kind}: Error code: {status} - {body}"


def test_a_pydantic_error_inside_openai_pythons_print_is_read_line_by_line():
    message = ("1 validation error for ChatCompletionRequest\nthinking.type\n  Input should be 'enabled', 'disabled' or "
               "'adaptive' [type=literal_error, input_value='none', input_type=str]")
    assert rows_of(openai_status_error(400, message)) == ["thinking-type-400"]
    assert rows_of(openai_status_error(400, message.replace("thinking.type", "messages.0.role"))) == []


def test_sglangs_image_data_repr_in_an_error_answer_is_a_remote_image_failure():
    message = ("Internal server error: An exception occurred while loading IMAGE data at index 0: Error while loading "
               "data ImageData(url='https://cdn.example.com/a/front.jpg', detail='auto', max_dynamic_patch=None): "
               "HTTPSConnectionPool(host='cdn.example.com', port=443): Read timed out. (read timeout=3)")
    assert rows_of(openai_status_error(500, message)) == ["remote-image-failed"]
    assert rows_of(json.dumps({"object": "error", "message": message, "code": 500})) == ["remote-image-failed"]


def test_a_500_answer_carrying_the_http_clients_error_for_a_media_url_is_a_remote_image_failure():
    message = ("Internal server error: HTTPConnectionPool(host='10.20.0.15', port=9000): Max retries exceeded with url: "
               "/images/sku-1.png (Caused by NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f0d>: "
               "Failed to establish a new connection: [Errno 113] No route to host'))")
    opened = "resp = client.chat.completions.create(model=MODEL, messages=[{\"role\": \"user\", \"content\": ["
    assert rows_of(f"{opened}\n{openai_status_error(500, message)}") == ["remote-image-failed"]
    assert rows_of(openai_status_error(500, message.replace("/images/sku-1.png", "/v1/embeddings"))) == []


def test_pillow_unable_to_identify_what_an_image_url_answered_is_a_remote_image_failure():
    served = '[2026-12-03 09:14:11] INFO:     172.17.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
    trace = ('  File "/sgl-workspace/sglang/python/sglang/srt/utils/common.py", line 866, in load_image\n'
             "    image = Image.open(BytesIO(response.content))\n"
             "PIL.UnidentifiedImageError: cannot identify image file <_io.BytesIO object at 0x7fa0e8b3c4f0>")
    assert rows_of(f"{served}\n{trace}") == ["remote-image-failed"]
    decoded = trace.replace("BytesIO(response.content)", "BytesIO(pybase64.b64decode(image_file))")
    assert rows_of(f"{served}\n{decoded}") == []  # a base64 image the client sent: no URL was fetched


def flashinfer_jit(op: str, began: str, finished: str) -> str:
    """FlashInfer's JIT loader as its logger prints it (flashinfer/jit/core.py, asctime first)."""
    return (f"2026-11-24 {began},056 - INFO - flashinfer.jit: Loading JIT ops: {op}\n"
            f"2026-11-24 {finished},057 - INFO - flashinfer.jit: Finished loading JIT ops: {op}\n")


START = "[2026-11-24 08:00:00] server_args=ServerArgs(model_path='/models/M', tp_size=4)\n"


def test_flashinfer_building_the_same_op_on_two_starts_is_a_kernel_cache_not_kept():
    built, cached = flashinfer_jit("sampling", "08:12:06", "08:16:54"), flashinfer_jit("sampling", "08:12:06", "08:12:06")
    assert rows_of(f"{START}{built}{READY}\n{START}{built}{READY}") == ["kernel-cache-not-persisted"]
    assert rows_of(f"{START}{built}{READY}\n{START}{cached}{READY}") == []  # the second start found the build


def test_a_kernel_compiled_again_at_length_on_a_later_start_is_a_kernel_cache_not_kept():
    compiled = "[2026-11-24 08:06:41 TP0] Compiled msa_decode_q8kv4_sm100a in {} s\n"
    assert rows_of(f"{START}{compiled.format(235.4)}{READY}\n{START}{compiled.format(187.8)}") == [
        "kernel-cache-not-persisted"]
    assert rows_of(f"{START}{compiled.format(235.4)}{READY}\n{START}{compiled.format(0.4)}") == []


def test_a_build_after_docker_compose_recreated_the_container_is_a_kernel_cache_not_kept():
    recreated = " ✔ Container m31-sglang-1  Recreated                0.4s\n"
    built = "sglang-1  | " + flashinfer_jit("norm", "07:37:16", "07:41:28").replace("\n2026", "\nsglang-1  | 2026")
    assert rows_of(f"{recreated}{built}") == ["kernel-cache-not-persisted"]
    assert rows_of(f"{recreated}{built.replace('07:41:28', '07:37:16')}") == []
    assert rows_of(built) == []  # one start that builds is a first start


def test_an_oom_while_serving_is_not_voided_by_the_ready_line_of_the_restart_after_it():
    oom = "[2026-11-23 06:13:05 TP0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.50 GiB."
    assert rows_of(f"{START}{READY}\n{oom}\n{START}{READY}") == ["cuda-oom"]
    assert rows_of(f"{START}{oom}\n{START}{READY}") == []  # while starting: the next start got past it


def test_server_args_as_sglang_prints_them_without_a_reasoning_parser_is_the_raw_token_row():
    args = "[2026-11-23 06:00:00] server_args=ServerArgs(model_path='m', reasoning_parser={}, tool_call_parser={}, dp_size=1)"
    assert rows_of(args.format("None", "None")) == ["raw-think-tokens"]
    assert rows_of(args.format("'minimax-m3'", "'minimax-m3'")) == []


def test_a_docker_run_publishing_a_port_the_server_does_not_listen_on_is_the_health_row():
    run = ("$ docker run -d --gpus all -p 127.0.0.1:{}:{} -v ~/.cache/minfer:/root/.cache/minfer "
           "lmsysorg/sglang@sha256:614b sglang serve --model-path M --host 0.0.0.0 {}")
    assert rows_of(run.format(8000, 8000, "--port 30000")) == ["health-failing"]
    assert rows_of(run.format(8000, 8000, "")) == ["health-failing"]  # SGLang's default port is 30000
    assert rows_of(run.format(8000, 30000, "--port 30000")) == []
    assert rows_of(run.format(8000, 8000, "--port 8000")) == []
    assert rows_of(run.format(8000, 8000, "--port 30000").replace("-d ", "-d --network host ")) == []
