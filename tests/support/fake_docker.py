"""A stand-in `docker` executable for warm-up tests, and the fake SGLang server it starts.

`install(bin_dir, state_dir)` writes `bin_dir/docker`; put bin_dir first on PATH. Implemented:
`run` (detached: starts a real HTTP server on 127.0.0.1 at the published port; with nvidia-smi as
entrypoint: prints GPU info), `logs`, `inspect -f {{.State.Running}}`, `stop`, `rm [-f]`,
`image inspect`. Every call is appended to STATE/calls.jsonl for assertions.

The server answers like SGLang: `/health`, `/v1/chat/completions` with `reasoning_content`. It checks
what the real one would need (model mounted read-only at --model-path, HF_HUB_OFFLINE=1), writes a
file into each mounted cache (as a kernel compile would) and logs the lines the guide checks.
Behaviour for scenarios, from the environment (docker passes the caller's environment through):
  FAKE_SGLANG_NEVER_READY=1        /health answers 503 forever
  FAKE_SGLANG_NVFP4_BACKEND=NAME   log `nvfp4_to_fp8 backend=NAME` (default qmul4)
  FAKE_SGLANG_REASONING_ALWAYS=1   return reasoning_content even with thinking disabled
  FAKE_GPU_INFO="NAME, CC, DRIVER" what nvidia-smi prints for each GPU (default a B300)
  FAKE_SGLANG_ANSWER_FILE=PATH     answer every chat request with PATH's bytes, HTTP 200 (a hostile server)
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VALUE_OPTIONS = {"--name", "--gpus", "--shm-size", "-p", "-e", "-v", "--entrypoint", "--device", "--group-add", "-f", "--format"}
DSPARK_LINE = "DSpark draft found in the target checkpoint's dspark/ subfolder"


def install(bin_dir: Path, state_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "docker"
    exe.write_text(f"#!/bin/sh\nFAKE_DOCKER_STATE={state_dir} exec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def _state() -> Path:
    return Path(os.environ["FAKE_DOCKER_STATE"])


def _record(argv: list[str]) -> None:
    with open(_state() / "calls.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")


def parse_run(args: list[str]) -> dict:
    opts: dict = {"env": {}, "volumes": [], "publish": [], "flags": []}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        if flag in VALUE_OPTIONS:
            value = args[i + 1]
            i += 2
            if flag == "-e":
                key, _, val = value.partition("=")
                opts["env"][key] = val
            elif flag == "-v":
                opts["volumes"].append(value)
            elif flag == "-p":
                opts["publish"].append(value)
            else:
                opts[flag.lstrip("-")] = value
        else:
            opts["flags"].append(flag)
            i += 1
    opts["image"] = args[i]
    opts["command"] = args[i + 1:]
    return opts


def _container(name: str) -> Path:
    return _state() / f"{name}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cmd_run(args: list[str]) -> int:
    opts = parse_run(args)
    if opts.get("entrypoint") == "nvidia-smi":
        gpus = opts.get("gpus", '"device=0"').strip('"').split("=", 1)[1].split(",")
        line = os.environ.get("FAKE_GPU_INFO", "NVIDIA B300 SXM6 AC, 10.3, 590.48.01")
        print("\n".join(line for _ in gpus))
        return 0
    name = opts["name"]
    if _container(name).exists():
        print(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use.', file=sys.stderr)
        return 125
    if "-d" not in opts["flags"]:
        print("fake docker: only detached runs are supported", file=sys.stderr)
        return 125
    log = _state() / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "_serve", name], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ})
    _container(name).write_text(json.dumps({"pid": proc.pid, "opts": opts}))
    print(f"{abs(hash(name)):064x}"[:64])
    return 0


def cmd_logs(args: list[str]) -> int:
    log = _state() / f"{args[-1]}.log"
    if not log.exists():
        print(f"Error response from daemon: No such container: {args[-1]}", file=sys.stderr)
        return 1
    sys.stdout.write(log.read_text())
    return 0


def cmd_inspect(args: list[str]) -> int:
    path = _container(args[-1])
    if not path.exists():
        print(f"Error: No such object: {args[-1]}", file=sys.stderr)
        return 1
    print("true" if _alive(json.loads(path.read_text())["pid"]) else "false")
    return 0


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        if not _alive(pid):
            return
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)


def cmd_stop(args: list[str]) -> int:
    path = _container(args[-1])
    if not path.exists():
        print(f"Error response from daemon: No such container: {args[-1]}", file=sys.stderr)
        return 1
    _kill(json.loads(path.read_text())["pid"])
    print(args[-1])
    return 0


def cmd_rm(args: list[str]) -> int:
    path = _container(args[-1])
    if not path.exists():
        print(f"Error response from daemon: No such container: {args[-1]}", file=sys.stderr)
        return 1
    pid = json.loads(path.read_text())["pid"]
    if _alive(pid):
        if "-f" not in args:
            print("Error response from daemon: cannot remove a running container", file=sys.stderr)
            return 1
        _kill(pid)
    path.unlink()
    (_state() / f"{args[-1]}.log").unlink(missing_ok=True)
    print(args[-1])
    return 0


# --- the fake SGLang server -------------------------------------------------------------------

def _arg(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def serve(name: str) -> None:
    opts = json.loads(_container(name).read_text())["opts"] if _container(name).exists() else None
    for _ in range(50):  # `run` writes the state file right after starting us
        if opts:
            break
        time.sleep(0.02)
        opts = json.loads(_container(name).read_text())["opts"] if _container(name).exists() else None
    command = opts["command"]
    log = lambda line: print(line, flush=True)  # noqa: E731
    mounts = {}
    for spec in opts["volumes"]:
        host, container, *mode = spec.split(":")
        mounts[container] = (Path(host), mode == ["ro"])
    model_path = _arg(command, "--model-path")
    if opts["env"].get("HF_HUB_OFFLINE") != "1":
        log("ERROR: HF_HUB_OFFLINE is not set; would try the network")
        sys.exit(1)
    if model_path not in mounts or not mounts[model_path][1] or not (mounts[model_path][0] / "config.json").is_file():
        log(f"ERROR: --model-path {model_path} is not a read-only mount of a model directory")
        sys.exit(1)
    for container, (host, read_only) in mounts.items():
        if not read_only:  # a kernel cache: "compile" into it
            host.mkdir(parents=True, exist_ok=True)
            (host / "fake-kernel.bin").write_bytes(b"compiled")
    log(f"server_args: {' '.join(command)}")
    log(f"nvfp4_to_fp8 backend={os.environ.get('FAKE_SGLANG_NVFP4_BACKEND', 'qmul4')}")
    if _arg(command, "--speculative-algorithm") == "DSPARK" and (mounts[model_path][0] / "dspark").is_dir():
        log(DSPARK_LINE)
    never_ready = os.environ.get("FAKE_SGLANG_NEVER_READY") == "1"
    reasoning_always = os.environ.get("FAKE_SGLANG_REASONING_ALWAYS") == "1"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            log("http: " + fmt % args)

        def _send(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(503 if never_ready else 200, {})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            if os.environ.get("FAKE_SGLANG_ANSWER_FILE"):
                body = Path(os.environ["FAKE_SGLANG_ANSWER_FILE"]).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("model") != model_path:
                return self._send(404, {"error": f"model {req.get('model')!r} not served"})
            for message in req["messages"]:
                parts = message["content"] if isinstance(message["content"], list) else []
                for part in parts:
                    if part.get("type") == "image_url":
                        url = part["image_url"]["url"]
                        if not url.startswith("data:image/png;base64,"):
                            return self._send(400, {"error": "offline: remote image URLs cannot be fetched"})
                        if not base64.b64decode(url.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n"):
                            return self._send(400, {"error": "image is not a PNG"})
            thinking_off = (req.get("thinking") or {}).get("type") == "disabled"
            reasoning = None if thinking_off and not reasoning_always else "The user asks a short question."
            self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "Sparse attention attends to a chosen subset of tokens.",
                            "reasoning_content": reasoning}}]})

    port = int(opts["publish"][0].rsplit(":", 1)[1])
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: (log("shutting down"), os._exit(0)))
    log(f"Uvicorn running on http://0.0.0.0:{port}")
    server.serve_forever()


def main(argv: list[str]) -> int:
    if argv[:1] == ["_serve"]:
        serve(argv[1])
        return 0
    _record(argv)
    commands = {"run": cmd_run, "logs": cmd_logs, "inspect": cmd_inspect, "stop": cmd_stop, "rm": cmd_rm}
    if argv[:2] == ["image", "inspect"]:
        return 0
    if not argv or argv[0] not in commands:
        print(f"fake docker: unsupported command {argv[:1]}", file=sys.stderr)
        return 125
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
