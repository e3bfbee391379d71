"""External tools answer like hostile input: every tool mm runs is bounded (artifacts/edges/tools.py).

A stand-in for each tool (nvidia-smi, rocm-smi, docker info / logs / inspect, skopeo, ssh-keygen) is put first on
PATH and answers badly: NUL bytes and bytes that are not UTF-8, an endless stream, a number of 5,000 digits,
garbage with exit 0, stderr only, no answer at all, a child left holding the pipe. Each case asserts the exit code
and the message mm gives, no exit 70 and no traceback, and, where the output is huge, the peak RSS of the mm
process. Deadlines: the tests set MM_TOOL_TIMEOUT (every tool's deadline, as an operator would) to TOOL_TIMEOUT
seconds, so "never answers" costs a second, not a minute. ssh-keygen's passphrase prompt is tried
for real, on a pseudo-terminal (`script`), where a prompt would wait for an answer.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import signal
import time
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.pins import default_pin
from tests.support.modelgen import write_model
from tests.support.run import MM_BIN

TOOL_TIMEOUT = 1.0  # seconds: every tool deadline in these tests (MM_TOOL_TIMEOUT)
MEMORY_BOUND = 150 * 1024 * 1024
CAP = 1024 * 1024  # tools.MAX_OUTPUT

MEASURED = '''\
import os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
'''


class Tools:
    """A bin directory of stand-in tools (first on PATH) and the way to run mm with it."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        self.calls = root / "calls.log"  # every stand-in appends its argv here
        self.env = {k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK", "DOCKER_HOST")}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", MM_TOOL_TIMEOUT=f"{TOOL_TIMEOUT:g}")
        self.tool("docker", 'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock" >&2; exit 1')

    def tool(self, name: str, body: str) -> None:
        """A stand-in NAME: a shell script logging its argv, then BODY."""
        exe = self.bin / name
        exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {shlex.quote(str(self.calls))}\n{body}\n')
        exe.chmod(0o755)

    def python_tool(self, name: str, code: str) -> None:
        """A stand-in NAME whose BODY is Python (bytes a shell cannot print easily)."""
        script = self.root / f"{name}.py"
        script.write_text(code)
        self.tool(name, f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} \"$@\"")

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def mm(self, *args, timeout: float = 60) -> tuple[subprocess.CompletedProcess, int, float]:
        """(the result, the mm process's peak RSS, seconds it took)."""
        rss_file = self.root / "rss"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", MEASURED, str(rss_file), str(MM_BIN), *map(str, args)],
                              env=self.env, capture_output=True, timeout=timeout)
        took = time.monotonic() - started
        result = subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode("utf-8", "replace"),
                                             done.stderr.decode("utf-8", "replace"))
        assert result.returncode != 70 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "internal error" not in result.stderr, result.stderr[-3000:]
        return result, int(rss_file.read_text()), took


@pytest.fixture
def tools(tmp_path) -> Tools:
    return Tools(tmp_path / "tools")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    pin = default_pin()
    model = tmp_path_factory.mktemp("models") / pin.repo_id.rsplit("/", 1)[-1]
    write_model(model, shards=2, shard_bytes=64 * 1024, draft=True)
    manifest_for_local_dir(model, pin.repo_id, pin.revision, offline=True)
    return model


def doctor_checks(tools: Tools, model_dir: Path, *extra) -> tuple[int, dict[str, dict], int, float]:
    r, rss, took = tools.mm("doctor", model_dir, *(extra or ("--hardware", "b300")), "--json")
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}, rss, took


GOOD_ROW = "0, NVIDIA B300 SXM6 AC, 10.3, 590.48.01"


def nvidia_smi(tools: Tools, rows: str, header: str = "| Driver Version: 590.48.01      CUDA Version: 13.4 |") -> None:
    tools.tool("nvidia-smi", f'if [ $# -eq 0 ]; then printf "%s\\n" {shlex.quote(header)}; '
                             f'else printf "%s\\n" {shlex.quote(rows)}; fi')


# --- nvidia-smi (mm doctor) ----------------------------------------------------------------------------

@pytest.mark.parametrize("value,deadline", [(None, 60.0), ("7200", 7200.0), ("0.5", 0.5)])
def test_mm_tool_timeout_is_every_tools_deadline_in_place_of_mms_own(monkeypatch, value, deadline):
    from mm.artifacts.edges.tools import deadline as tool_deadline
    if value is None:
        monkeypatch.delenv("MM_TOOL_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MM_TOOL_TIMEOUT", value)
    assert tool_deadline(60) == deadline  # raised on a slow host, or lowered, from mm's own 60 s


def test_an_mm_tool_timeout_that_is_not_a_positive_number_is_a_usage_error(tools):
    tools.env["MM_TOOL_TIMEOUT"] = "-1"
    r, _, _ = tools.mm("image", "save", IMAGE, "--out", tools.root / "img.tar")
    assert r.returncode == 2 and r.stderr.strip() == "mm: MM_TOOL_TIMEOUT='-1': expected a positive number (seconds)"
    assert tools.called() == []  # refused before any tool ran


def test_nvidia_smi_with_nul_and_invalid_utf8_in_a_gpu_name_is_a_wrong_gpu_printed_escaped(tools, model_dir):
    tools.python_tool("nvidia-smi", 'import sys\n'
                      'if len(sys.argv) == 1: sys.stdout.buffer.write(b"CUDA Version: 13.4\\n")\n'
                      'else: sys.stdout.buffer.write(b"".join(b"%d, NVIDIA B\\x00300\\xff\\xfe\\x1b[31m, 10.3, 590\\n" % i '
                      'for i in range(8)))\n')
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["gpu model"]["status"] == "fail" and "\x00" in checks["gpu model"]["detail"]  # JSON escapes it
    r, _, _ = tools.mm("doctor", model_dir, "--hardware", "b300")
    assert r.returncode == 1
    line = next(ln for ln in r.stdout.splitlines() if "gpu model" in ln)
    assert "\\x00" in line and "\\x1b" in line and "\x1b" not in line and "\x00" not in line  # escaped on screen


def test_an_nvidia_smi_gpu_index_of_5000_digits_is_no_gpu(tools, model_dir):
    nvidia_smi(tools, "9" * 5000 + ", NVIDIA B300 SXM6 AC, 10.3, 590.48.01")
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["gpu count"]["status"] == "fail" and "shows 0 (none)" in checks["gpu count"]["detail"]


def test_an_nvidia_smi_cuda_version_of_5000_digits_is_no_cuda_version(tools, model_dir):
    nvidia_smi(tools, "0, NVIDIA B300 SXM6 AC, 10.3, 590.48.01",
               header="| Driver Version: 590.48.01      CUDA Version: " + "1" * 5000 + ".4 |")
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert checks["driver"]["status"] == "warn" and "supports CUDA ?" in checks["driver"]["detail"]
    assert "1111" not in checks["driver"]["detail"]


def test_nvidia_smi_that_never_stops_writing_is_stopped_at_the_cap_within_the_memory_bound(tools, model_dir):
    tools.tool("nvidia-smi", "exec cat /dev/zero")
    code, checks, rss, took = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["gpus"]["detail"] == f"nvidia-smi failed: more than {CAP} bytes of output on stdout"
    assert rss < MEMORY_BOUND, rss
    print(f"endless nvidia-smi: {took:.2f} s, peak RSS {rss / 2**20:.0f} MiB")


def test_nvidia_smi_that_never_answers_is_killed_with_its_children_at_the_deadline(tools, model_dir):
    tools.tool("nvidia-smi", f"sleep 600 & echo $! > {tools.root / 'child.pid'}; exec sleep 600")
    code, checks, _, took = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["gpus"]["detail"] == f"nvidia-smi failed: no answer within {TOOL_TIMEOUT:g} s (MM_TOOL_TIMEOUT)"
    child = int((tools.root / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower() \
        or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"  # the whole process group was killed


def test_nvidia_smi_garbage_with_exit_0_shows_no_gpu(tools, model_dir):
    tools.python_tool("nvidia-smi", 'import sys, random\nrandom.seed(7)\n'
                      'sys.stdout.buffer.write(bytes(random.randrange(256) for _ in range(20000)))\n')
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert code == 1 and checks["gpu count"]["status"] == "fail"


def test_nvidia_smi_writing_stderr_only_is_named_by_its_last_line(tools, model_dir):
    tools.tool("nvidia-smi", 'echo "some detail" >&2; printf "NVIDIA-SMI has failed because it could not communicate '
                             'with the NVIDIA driver\\033]0;x\\007\\n" >&2; exit 9')
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["gpus"]["detail"] == ("nvidia-smi failed: NVIDIA-SMI has failed because it could not communicate "
                                        "with the NVIDIA driver\\x1b]0;x\\x07")


def test_nvidia_smi_leaving_a_child_holding_its_output_does_not_keep_mm_waiting(tools, model_dir):
    nvidia_smi(tools, GOOD_ROW)
    body = (tools.bin / "nvidia-smi").read_text().split("\n", 2)[2]
    tools.tool("nvidia-smi", "sleep 600 &\n" + body)  # the child inherits stdout and stderr; mm's own deadlines
    tools.env.pop("MM_TOOL_TIMEOUT")
    code, checks, _, took = doctor_checks(tools, model_dir)
    assert checks["gpu model"]["status"] == "ok"
    assert took < 15, took  # two nvidia-smi calls, each let go LINGER (0.5 s) after it exited


# --- rocm-smi (mm doctor on AMD) ------------------------------------------------------------------------

ROCM_IMAGE = "lmsysorg/sglang-rocm@sha256:" + "cd" * 32

@pytest.mark.parametrize("answer", ['{"card0": {"Card Series": "MI355X"}, "n": ' + "7" * 5000 + "}",
                                    '{"card' + "9" * 5000 + '": {"Card Series": "MI355X"}}'])
def test_rocm_smi_with_a_5000_digit_number_is_read_as_no_gpu(tools, model_dir, answer):
    tools.tool("rocm-smi", f"printf '%s' {shlex.quote(answer)}")
    code, checks, _, _ = doctor_checks(tools, model_dir, "--hardware", "mi355x", "--image", ROCM_IMAGE)
    assert code == 1
    assert (checks.get("gpus", {}).get("detail") == "rocm-smi printed no JSON object"
            or "shows 0 (none)" in checks["gpu count"]["detail"])


# --- docker info (mm doctor) ---------------------------------------------------------------------------

@pytest.mark.parametrize("answer", ["1" * 5000, "\\xff\\x00\\x1b[2J"])
def test_docker_version_answering_a_hostile_version_is_printed_bounded_and_escaped(tools, model_dir, answer):
    nvidia_smi(tools, GOOD_ROW)
    tools.tool("docker", f'if [ "$1" = version ]; then printf "{answer}"; exit 0; fi; exit 1')
    code, checks, _, _ = doctor_checks(tools, model_dir)
    assert code == 1  # the image is not there
    assert checks["docker"]["status"] == "ok"
    detail = checks["docker"]["detail"]
    assert len(detail) < 400 and "\x1b" not in detail and "\x00" not in detail


def test_docker_version_that_never_stops_writing_is_stopped_at_the_cap(tools, model_dir):
    nvidia_smi(tools, GOOD_ROW)
    tools.tool("docker", 'if [ "$1" = version ]; then exec yes 20.10; fi; exit 1')
    code, checks, rss, _ = doctor_checks(tools, model_dir)
    assert code == 1
    assert checks["docker"]["status"] == "fail"
    assert f"more than {CAP} bytes of output on stdout" in checks["docker"]["detail"]
    assert rss < MEMORY_BOUND


# --- docker logs / inspect (mm diagnose --container) ------------------------------------------------------

@pytest.mark.parametrize("name", ["--follow", "-f", "--since=1h", "a b", "x;rm", ""])
def test_a_container_name_that_docker_could_take_as_an_option_is_refused_before_docker_runs(tools, name):
    r, _, _ = tools.mm("diagnose", "--container", name)
    assert r.returncode == 2
    assert "--container" in r.stderr and "not a valid name" in r.stderr
    assert tools.called() == []


def test_a_container_name_is_passed_after_double_dash(tools):
    tools.tool("docker", "echo 'CUDA out of memory'")
    r, _, _ = tools.mm("diagnose", "--container", "srv.1")
    assert r.returncode == 1
    assert tools.called() == ["docker logs -- srv.1", "docker inspect -f {{json .Mounts}} -- srv.1"]


def test_docker_logs_with_nul_and_invalid_utf8_are_still_diagnosed(tools):
    tools.python_tool("docker", 'import sys\nif sys.argv[1] == "logs":\n'
                      '    sys.stdout.buffer.write(b"\\x00\\xff\\xfe junk\\n\\x1b[2Jtorch.OutOfMemoryError: CUDA out of memory'
                      '\\xc3\\n" + bytes(range(256)) + b"\\n")\n'
                      'else: sys.stdout.buffer.write(b"\\xff\\x00")\n')
    r, _, _ = tools.mm("diagnose", "--container", "srv", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert "cuda-oom" in [f["row"] for f in doc["findings"]]


def test_docker_logs_of_300_mb_stream_through_within_the_memory_bound(tools):
    tools.python_tool("docker", 'import sys\nif sys.argv[1] == "logs":\n'
                      '    line = b"x" * 9_999_999 + b"\\n"\n'  # lines of 10 MB: mm keeps 64 KiB of each
                      '    for _ in range(30): sys.stdout.buffer.write(line)\n')
    tools.env.pop("MM_TOOL_TIMEOUT")  # the default deadline (120 s): the stream is long, not stuck
    r, rss, took = tools.mm("diagnose", "--container", "srv", "--json", timeout=120)
    assert r.returncode == 1, r.stderr  # only the missing cache mount (the stand-in's inspect answers nothing)
    assert json.loads(r.stdout)["lines_read"] == 30
    assert rss < MEMORY_BOUND, rss
    print(f"300 MB of docker logs: {took:.1f} s, peak RSS {rss / 2**20:.0f} MiB")


def test_docker_logs_that_never_end_stop_at_the_deadline(tools):
    tools.tool("docker", 'if [ "$1" = logs ]; then while :; do echo "waiting"; sleep 0.01; done; fi')
    r, rss, took = tools.mm("diagnose", "--container", "srv")
    assert r.returncode == 3
    assert r.stderr.strip() == f"mm: docker logs srv: no answer within {TOOL_TIMEOUT:g} s (MM_TOOL_TIMEOUT)"
    assert took < 10


def test_a_docker_wrapper_whose_child_holds_the_pipe_does_not_keep_mm_waiting(tools):
    tools.tool("docker", 'if [ "$1" = logs ]; then (sleep 600; echo late) & echo "CUDA out of memory"; fi; exit 0')
    tools.env.pop("MM_TOOL_TIMEOUT")  # mm's own deadline: mm lets go because docker itself exited
    r, _, took = tools.mm("diagnose", "--container", "srv", "--json")
    assert r.returncode == 1
    assert "cuda-oom" in [f["row"] for f in json.loads(r.stdout)["findings"]]
    assert took < 10, took
    print(f"docker wrapper holding the pipe: mm ended after {took:.2f} s")


@pytest.mark.parametrize("mounts", ['[{"Destination": ' + "9" * 5000 + "}]", "[" * 100_000, "\x00\xff"])
def test_docker_inspect_answering_hostile_json_is_read_as_no_mounts(tools, mounts):
    tools.python_tool("docker", f'import sys\nif sys.argv[1] == "inspect": sys.stdout.buffer.write({mounts.encode("latin-1")!r})\n'
                      'else: print("CUDA out of memory")\n')
    r, _, _ = tools.mm("diagnose", "--container", "srv", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert "cuda-oom" in [f["row"] for f in doc["findings"]]
    assert "kernel-cache-not-persisted" in [f["row"] for f in doc["findings"]]  # no mounts: no cache mount


# --- skopeo (mm image save) ------------------------------------------------------------------------------

IMAGE = "127.0.0.1:5000/lmsysorg/sglang@sha256:" + "ab" * 32


def image_save(tools: Tools, out: Path):
    return tools.mm("image", "save", IMAGE, "--out", out, "--insecure-registry")


def test_skopeo_that_never_stops_writing_is_stopped_at_its_document_cap(tools, tmp_path):
    tools.tool("skopeo", "exec cat /dev/zero")
    r, rss, _ = image_save(tools, tmp_path / "img.tar")
    assert r.returncode == 4
    assert r.stderr.strip().endswith(f"skopeo wrote more than {16 << 20} bytes of output on stdout; stopped")
    assert rss < MEMORY_BOUND
    assert not list(tmp_path.glob("img.tar*")) and not list(tmp_path.glob(".img.tar*"))


def test_skopeo_failing_with_binary_stderr_is_one_printable_line(tools, tmp_path):
    tools.python_tool("skopeo", 'import sys\nsys.stderr.buffer.write(b"\\xff\\xfe\\x00\\x1b[31m time=x level=fatal '
                      'msg=\\"manifest unknown\\x00\\xff\\"\\n"); sys.exit(1)\n')
    r, _, _ = image_save(tools, tmp_path / "img.tar")
    assert r.returncode == 4
    assert r.stderr.count("\n") == 1 and r.stderr.strip().endswith(": manifest unknown\\x00\ufffd")


def test_skopeo_that_never_answers_is_a_registry_that_did_not_answer(tools, tmp_path):
    tools.tool("skopeo", "exec sleep 600")
    r, _, took = image_save(tools, tmp_path / "img.tar")
    assert r.returncode == 4 and r.stderr.strip().endswith(f"no answer within {TOOL_TIMEOUT:g} s (MM_TOOL_TIMEOUT) from the registry (skopeo stopped)")
    assert took < 10


def test_skopeo_garbage_with_exit_0_is_refused_as_not_the_pinned_manifest(tools, tmp_path):
    tools.tool("skopeo", "printf '\\377\\000 not json'")
    r, _, _ = image_save(tools, tmp_path / "img.tar")
    assert r.returncode == 5 and "served a manifest whose sha256 is" in r.stderr


# --- ssh-keygen (mm sign) -------------------------------------------------------------------------------

@pytest.fixture
def manifest_dir(tmp_path) -> Path:
    model = tmp_path / "m"
    write_model(model, shards=1, shard_bytes=1024)
    manifest_for_local_dir(model, "org/model", "ce7f4df87d2e05262f5775f373dac4772f134041", offline=True)
    return model


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a pseudo-terminal")
def test_sign_with_a_passphrase_key_and_no_agent_fails_with_the_hint_instead_of_prompting(tools, manifest_dir, tmp_path):
    key = tmp_path / "bob"
    made = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-C", "bob", "-f", str(key)],
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    assert made.returncode == 0, made.stderr
    (tools.bin / "docker").unlink()
    command = f"{shlex.quote(str(MM_BIN))} sign {shlex.quote(str(manifest_dir))} --key {shlex.quote(str(key))}"
    # script gives mm a controlling terminal: a prompt would wait there for a passphrase until the timeout
    done = subprocess.run(["script", "-qec", command, "/dev/null"], env=tools.env, capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "incorrect passphrase" in done.stdout
    assert "a key with a passphrase must be in ssh-agent (ssh-add KEY) and KEY may be its .pub" in done.stdout
    assert "Enter passphrase" not in done.stdout
    assert not (manifest_dir / ".mm" / "manifest.json.sig").exists()


def test_ssh_keygen_that_never_answers_is_stopped(tools, manifest_dir, keys):
    tools.tool("ssh-keygen", "exec sleep 600")
    r, _, took = tools.mm("sign", manifest_dir, "--key", keys["alice"])
    assert r.returncode == 3 and r.stderr.strip() == f"mm: ssh-keygen: no answer within {TOOL_TIMEOUT:g} s (MM_TOOL_TIMEOUT); stopped"
    assert took < 10


def test_ssh_keygen_flooding_stderr_is_stopped_at_its_cap(tools, manifest_dir, keys):
    tools.tool("ssh-keygen", "exec yes 'error error error' >&2")
    r, rss, _ = tools.mm("sign", manifest_dir, "--key", keys["alice"])
    assert r.returncode == 3
    assert r.stderr.strip() == f"mm: ssh-keygen: more than {64 * 1024} bytes of output on stderr; stopped"
    assert not (manifest_dir / ".mm" / "manifest.json.sig").exists()


# --- Ctrl-C while a tool runs -----------------------------------------------------------------------------

def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_ctrl_c_while_a_tool_runs_kills_its_process_group_and_exits_130_at_once(tools, tmp_path):
    pids = tools.root / "pids"
    tools.tool("skopeo", f"sleep 600 & echo $! >> {pids}; echo $$ >> {pids}; exec sleep 600")
    tools.env.pop("MM_TOOL_TIMEOUT")  # mm's own deadline (an hour): only the interrupt ends the tool
    proc = subprocess.Popen([str(MM_BIN), "image", "save", IMAGE, "--out", tmp_path / "img.tar"], env=tools.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    print(f"Ctrl-C during skopeo: exit after {took:.3f} s")
    assert proc.returncode == 130 and took < 2
    assert err.strip() == "mm: interrupted by SIGINT" and "Traceback" not in err
    # skopeo and the child it started: SIGKILLed as a group; the kernel may take a moment to end them (2 s at most)
    until = time.monotonic() + 2
    while not all(_gone(int(p)) for p in pids.read_text().split()) and time.monotonic() < until:
        time.sleep(0.01)
    assert all(_gone(int(p)) for p in pids.read_text().split())


@pytest.mark.parametrize("command", [("launch", "--hardware", "b300"), ("warmup", "--hardware", "b300")])
def test_a_container_name_option_that_docker_could_take_as_an_option_is_refused(tools, model_dir, command):
    r, _, _ = tools.mm(command[0], model_dir, *command[1:], "--name", "--rm")
    assert r.returncode == 2 and "'--rm': not a valid name" in r.stderr
    assert tools.called() == []


# The Ctrl-C that lands while a tool is being started: after fork and exec, before mm holds the tool's process group
# (Popen not yet returned, or returned but not yet registered for the stop). A driver runs mm's own run_tool and
# stream_tool with mm's own signal handling (interrupt.install) and sends the SIGINT at exactly that point, once
# the tool has started its child; the tool and its child must be gone when the process has exited 130.
SPAWN_RACE = r'''
import os, signal, subprocess, sys, threading, time
from mm.artifacts.edges import interrupt, tools

how, where, pids = sys.argv[1], sys.argv[2], sys.argv[3]


def ctrl_c_once_the_tool_runs():
    until = time.monotonic() + 30
    while not (os.path.exists(pids) and len(open(pids).read().split()) == 2) and time.monotonic() < until:
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)


class Popen(subprocess.Popen):
    def _execute_child(self, *args):
        super()._execute_child(*args)
        if where == "inside-popen":  # fork and exec done, Popen has not returned
            ctrl_c_once_the_tool_runs()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if where == "after-popen":  # Popen returned, run_tool has not yet registered the tool for the stop
            ctrl_c_once_the_tool_runs()
            if how == "worker":  # the main thread ends the process meanwhile
                time.sleep(0.3)


subprocess.Popen = Popen
interrupt.install(lambda exc: os.write(2, f"mm: interrupted by {exc.signal_name}\n".encode()))
tool = ["sh", "-c", f"sleep 600 & echo $! >> {pids}; echo $$ >> {pids}; exec sleep 600"]
try:
    if how == "run_tool":
        tools.run_tool(tool, timeout=3600)
    elif how == "stream_tool":
        with tools.stream_tool(tool, timeout=3600) as stream:
            stream.stdout.read()
    else:  # run_tool in a worker thread, as a command's worker pool would (its Interrupted stays in the thread)
        def work():
            try:
                tools.run_tool(tool, timeout=3600)
            except interrupt.Interrupted:
                pass
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.05)
    print("the tool ended by itself", flush=True)
except interrupt.Interrupted as exc:
    interrupt.end(exc, flush=True)
'''


@pytest.mark.parametrize("how, where", [("run_tool", "inside-popen"), ("run_tool", "after-popen"),
                                        ("stream_tool", "inside-popen"), ("stream_tool", "after-popen"),
                                        ("worker", "after-popen")])
def test_ctrl_c_while_a_tool_is_being_started_still_kills_its_process_group(tmp_path, how, where):
    pids = tmp_path / "pids"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SPAWN_RACE, how, where, str(pids)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 130 and done.stderr.strip() == "mm: interrupted by SIGINT", done.stderr[-3000:]
    assert time.monotonic() - started < 10
    until = time.monotonic() + 2  # SIGKILLed as a group; the kernel may take a moment to end them
    while not all(_gone(int(p)) for p in pids.read_text().split()) and time.monotonic() < until:
        time.sleep(0.01)
    left = [p for p in pids.read_text().split() if not _gone(int(p))]
    for p in left:  # this test's own leftovers go, whatever it found
        os.kill(int(p), signal.SIGKILL)
    assert not left, f"the tool's processes {left} outlived the interrupted mm"
