"""A stand-in `docker` executable for warm-up tests, and the fake SGLang server it starts.

`install(bin_dir, state_dir)` writes `bin_dir/docker`; put bin_dir first on PATH. Implemented:
`run` (detached: starts a real HTTP server on 127.0.0.1 at the published port; with nvidia-smi as
entrypoint: prints GPU info), `logs`, `inspect -f {{.State.Running}}` and `-f {{json .Mounts}}`, `inspect NAME...` (the
whole JSON array: Id, Name, State with Running and StartedAt, Mounts), `ps -q [--no-trunc]` (running containers),
`stop`/`rm [-f]` of one or more containers, `image inspect`, `load -i`, `info`, `version`. `STATE/.store/down`
existing: the daemon is down (docker version exits 1, docker info exits 0 with ServerErrors as Debian's 20.10
client does, every other command exits 1).
`add_container(state_dir, name, volumes, started)` records a running container without starting a server (a
stand-in that only mounts things, e.g. for `mm gc`); its process is a `sleep` the caller stops with stop_container.
A run without -d stays in the foreground until the container stops (`docker stop` from elsewhere, or a
signal to this process, which it passes on). Every call is appended to STATE/calls.jsonl for assertions.

A container whose command is `python3 -m sglang_router.launch_router` is a fake SGLang router: it needs
`--network host` (it reaches the replicas on 127.0.0.1), binds 127.0.0.1 whatever --host says (tests never
bind elsewhere), answers /health, and forwards /v1/chat/completions to --worker-urls in turn, requiring
`Authorization: Bearer <--api-key>` when a key is given.

Image store: `install(..., store="classic"|"containerd")` gives the stand-in a real image store in
STATE/.store/images.json; without it every image is present (the warm-up tests' default). `docker load -i` reads the
archive: the classic store keeps the config digest as the image ID and the tags, and drops repo digests (moby#22011);
the containerd store keeps the repo digests an OCI archive's index.json names (`io.containerd.image.name`) and
reports the index digest as the ID. `image inspect REF` and `run --pull never` find images by ID, tag or repo digest
and fail as docker does when absent. With a store, a foreground run says which image would serve and exits 0 (the
launch-script tests check the image, not the server). `info` reports the runtimes in STATE/.store/runtimes.json
(default: runc, nvidia).

The server answers like SGLang: `/health`, `/v1/chat/completions` with `reasoning_content`. It checks
what the real one would need (model mounted read-only at --model-path, HF_HUB_OFFLINE=1), writes a
file into each mounted cache (as a kernel compile would) and logs the lines the guide checks.
Behaviour for scenarios, from the environment (docker passes the caller's environment through):
  FAKE_SGLANG_NEVER_READY=1        /health answers 503 forever
  FAKE_SGLANG_NVFP4_BACKEND=NAME   log `nvfp4_to_fp8 backend=NAME` (default qmul4)
  FAKE_SGLANG_REASONING_ALWAYS=1   return reasoning_content even with thinking disabled
  FAKE_GPU_INFO="NAME, CC, DRIVER" what nvidia-smi prints for each GPU (default a B300)
  FAKE_SGLANG_ANSWER_FILE=PATH     answer every chat request with PATH's bytes, HTTP 200 (a hostile server)
  FAKE_SGLANG_ALWAYS_COMPILE=1     write the kernel caches at every start (default: only when empty, like a cache)
  FAKE_SGLANG_LOG_LINES="a|b"      extra lines the server logs at start (to feed `mm diagnose`)
  FAKE_SGLANG_EXIT_AFTER_LOG=1     exit (code 1) right after logging them, before serving
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VALUE_OPTIONS = {"--name", "--gpus", "--shm-size", "-p", "-e", "-v", "--entrypoint", "--device", "--group-add", "-f", "--format",
                 "--pull", "--network"}
ROUTER_MODULE = "sglang_router.launch_router"
DSPARK_LINE = "DSpark draft found in the target checkpoint's dspark/ subfolder"


def install(bin_dir: Path, state_dir: Path, store: str | None = None, runtimes: tuple[str, ...] = ("runc", "nvidia"),
            images: list[dict] | None = None) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    meta = state_dir / ".store"  # not *.json at the top: those are containers
    meta.mkdir(exist_ok=True)
    if store is not None:
        assert store in ("classic", "containerd")
        (meta / "kind").write_text(store)
        (meta / "images.json").write_text(json.dumps(images or []))
    (meta / "runtimes.json").write_text(json.dumps(list(runtimes)))
    exe = bin_dir / "docker"
    exe.write_text(f"#!/bin/sh\nFAKE_DOCKER_STATE={state_dir} exec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def add_container(state_dir: Path, name: str, volumes: list[str], started: float | None = None) -> subprocess.Popen:
    """A running container NAME mounting VOLUMES (`HOST:CONTAINER[:ro]`), started at STARTED (epoch seconds, default
    now), whose process is a `sleep`; returns it (stop it with stop_container)."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    record = {"pid": proc.pid, "started": time.time() if started is None else started,
              "opts": {"env": {}, "volumes": list(volumes), "publish": [], "flags": ["-d"], "image": "stand-in",
                       "command": [], "name": name}}
    (Path(state_dir) / f"{name}.json").write_text(json.dumps(record))
    return proc


def stop_container(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


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
    if _store() and find_image(opts["image"]) is None:
        if opts.get("pull") == "never":
            print(f"docker: Error response from daemon: No such image: {opts['image']}", file=sys.stderr)
        else:
            print(f"Unable to find image '{opts['image']}' locally\ndocker: Error response from daemon: "
                  f"Get \"https://registry-1.docker.io/v2/\": dial tcp: lookup registry-1.docker.io: no such host",
                  file=sys.stderr)
        return 125
    if opts.get("gpus") and (refusal := os.environ.get("FAKE_TOOLKIT_REFUSES")):
        # what the NVIDIA Container Toolkit's prestart hook makes docker print when the image's requirement fails
        print("docker: Error response from daemon: failed to create task for container: failed to create shim task: "
              "OCI runtime create failed: runc create failed: unable to start container process: error during container "
              "init: error running hook #0: error running hook: exit status 1, stdout: , stderr: Auto-detected mode as "
              f"'legacy'\n{refusal}: unknown.", file=sys.stderr)
        return 125
    if opts.get("entrypoint") == "nvidia-smi":
        gpus = opts.get("gpus", '"device=0"').strip('"').split("=", 1)[1].split(",")
        line = os.environ.get("FAKE_GPU_INFO", "NVIDIA B300 SXM6 AC, 10.3, 590.48.01")
        print("\n".join(line for _ in gpus))
        return 0
    name = opts["name"]
    if _container(name).exists():
        print(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use.', file=sys.stderr)
        return 125
    if "-d" not in opts["flags"] and _store():  # a foreground run with an image store: say which image would serve
        img = find_image(opts["image"])
        print(f"fake docker: running image {img['Id']} as {opts['image']} (pull {opts.get('pull', 'missing')})")
        return 0
    log = _state() / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "_serve", name], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ})
    _container(name).write_text(json.dumps({"pid": proc.pid, "started": time.time(), "opts": opts}))
    if "-d" in opts["flags"]:
        print(f"{abs(hash(name)):064x}"[:64])
        return 0
    # Foreground: like docker's sig-proxy, pass INT/TERM on to the container; return when it stops.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _kill(proc.pid))
    code = proc.wait()
    sys.stdout.write(log.read_text())
    return code


def cmd_logs(args: list[str]) -> int:
    log = _state() / f"{args[-1]}.log"
    if not log.exists():
        print(f"Error response from daemon: No such container: {args[-1]}", file=sys.stderr)
        return 1
    with log.open("rb") as f:  # streamed: a test's log may be bigger than memory
        shutil.copyfileobj(f, sys.stdout.buffer)
    return 0


def _mounts(state: dict) -> list[dict]:
    mounts = []
    for spec in state["opts"]["volumes"]:
        host, container, *mode = spec.split(":")
        # dockerd records a bind's source cleaned as text (Go's path.Clean: `..`, `.`, `//`, a trailing slash),
        # never resolved: a symlink in it stays a symlink, followed by the kernel when the container starts
        source = "/" + os.path.normpath(host).lstrip("/") if host.startswith("/") else host
        mounts.append({"Type": "bind", "Source": source, "Destination": container, "RW": mode != ["ro"]})
    return mounts


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e9):09d}Z"


def cmd_ps(args: list[str]) -> int:
    """`ps -q [--no-trunc]`: one running container per line (their names stand in for IDs)."""
    for path in sorted(_state().glob("*.json")):
        if _alive(json.loads(path.read_text())["pid"]):
            print(path.stem)
    return 0


def cmd_inspect(args: list[str]) -> int:
    if not any(a in ("-f", "--format") for a in args):  # the whole document of every container named
        names = [a for a in args if a != "--"]
        docs = []
        for name in names:
            if not _container(name).exists():
                print(f"Error: No such object: {name}", file=sys.stderr)
                return 1
            state = json.loads(_container(name).read_text())
            docs.append({"Id": f"{abs(hash(name)):064x}"[:64], "Name": "/" + name, "Mounts": _mounts(state),
                         "State": {"Running": _alive(state["pid"]), "Pid": state["pid"],
                                   "StartedAt": _rfc3339(state.get("started", time.time()))}})
        print(json.dumps(docs))
        return 0
    path = _container(args[-1])
    if not path.exists():
        print(f"Error: No such object: {args[-1]}", file=sys.stderr)
        return 1
    state = json.loads(path.read_text())
    if "{{json .Mounts}}" in args:
        print(json.dumps(_mounts(state)))
        return 0
    print("true" if _alive(state["pid"]) else "false")
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


def _each_container(args: list[str], act) -> int:
    """Run ACT(name, path) for every container named in ARGS, like docker: one error line per unknown name."""
    code = 0
    for name in [a for a in args if not a.startswith("-")]:
        path = _container(name)
        if not path.exists():
            print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
            code = 1
        elif act(name, path):
            print(name)
        else:
            code = 1
    return code


def cmd_stop(args: list[str]) -> int:
    return _each_container(args, lambda name, path: _kill(json.loads(path.read_text())["pid"]) or True)


def cmd_rm(args: list[str]) -> int:
    def remove(name: str, path: Path) -> bool:
        pid = json.loads(path.read_text())["pid"]
        if _alive(pid):
            if "-f" not in args:
                print("Error response from daemon: cannot remove a running container", file=sys.stderr)
                return False
            _kill(pid)
        path.unlink()
        (_state() / f"{name}.log").unlink(missing_ok=True)
        return True
    return _each_container(args, remove)


# --- the image store ---------------------------------------------------------------

def _store() -> str | None:
    path = _state() / ".store" / "kind"
    return path.read_text().strip() if path.exists() else None


def _images() -> list[dict]:
    return json.loads((_state() / ".store" / "images.json").read_text())


def find_image(ref: str) -> dict | None:
    for img in _images():
        if ref in (img["Id"], img["Id"].split(":", 1)[1]) or ref in img["RepoTags"] or ref in img["RepoDigests"]:
            return img
        if "@" not in ref and ":" not in ref.rsplit("/", 1)[-1] and f"{ref}:latest" in img["RepoTags"]:
            return img
    return None


def _sha256(data: bytes) -> str:
    import hashlib
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _read_archive(path: str) -> list[dict]:
    """Images a `docker load` of PATH adds, as this store would record them."""
    import tarfile
    store = _store()
    platform = os.environ.get("FAKE_DOCKER_PLATFORM", "linux/amd64")
    loaded = []
    with tarfile.open(path) as tf:
        names = set(tf.getnames())
        blob = lambda digest: tf.extractfile("blobs/sha256/" + digest.split(":")[1]).read()  # noqa: E731
        if "index.json" in names:
            for entry in json.loads(tf.extractfile("index.json").read())["manifests"]:
                name = (entry.get("annotations") or {}).get("io.containerd.image.name", "")
                doc = json.loads(blob(entry["digest"]))
                manifests = [m["digest"] for m in doc.get("manifests", [])
                             if f"{m['platform']['os']}/{m['platform']['architecture']}" == platform] or [entry["digest"]]
                config = json.loads(blob(manifests[0]))["config"]["digest"]
                repo = name.split("@")[0]
                if store == "containerd":
                    loaded.append({"Id": entry["digest"], "RepoTags": [name] if "@" not in name and name else [],
                                   "RepoDigests": [f"{repo}@{entry['digest']}"] if name else []})
                else:
                    loaded.append({"Id": config, "RepoTags": [name] if "@" not in name and name else [], "RepoDigests": []})
        else:
            for e in json.loads(tf.extractfile("manifest.json").read()):
                loaded.append({"Id": _sha256(tf.extractfile(e["Config"]).read()), "RepoTags": e.get("RepoTags") or [],
                               "RepoDigests": []})
    return loaded


def cmd_load(args: list[str]) -> int:
    path = args[args.index("-i") + 1] if "-i" in args else args[args.index("--input") + 1]
    try:
        loaded = _read_archive(path)
    except (OSError, KeyError, ValueError) as e:
        print(f"Error response from daemon: {e}", file=sys.stderr)
        return 1
    if _store():
        images = [img for img in _images() if img["Id"] not in {i["Id"] for i in loaded}]
        (_state() / ".store" / "images.json").write_text(json.dumps(images + loaded))
    for img in loaded:
        print("\n".join(f"Loaded image: {t}" for t in img["RepoTags"]) or f"Loaded image ID: {img['Id']}")
    return 0


def cmd_image_inspect(args: list[str]) -> int:
    refs = [a for a in args if not a.startswith("-") and a != args[args.index("--format") + 1]] if "--format" in args else [a for a in args if not a.startswith("-")]
    if not _store():
        return 0
    found = []
    for ref in refs:
        img = find_image(ref)
        if img is None:
            print(f"Error: No such image: {ref}", file=sys.stderr)
            return 1
        found.append(img)
    if "--format" in args:
        fmt = args[args.index("--format") + 1]
        key = fmt.strip("{} ").lstrip(".")
        print("\n".join(json.dumps(img[key]) if key != "Id" else img["Id"] for img in found))
    else:
        print(json.dumps(found, indent=2))
    return 0


DAEMON_DOWN = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"


def _down() -> bool:
    return (_state() / ".store" / "down").exists()


def cmd_version(args: list[str]) -> int:
    """Like Debian's docker 20.10 client: with the daemon down it prints the client part and exits 1."""
    if _down():
        print(DAEMON_DOWN, file=sys.stderr)
        return 1
    print("27.3.1" if "--format" in args else "Server: Docker Engine\n Version: 27.3.1")
    return 0


def cmd_info(args: list[str]) -> int:
    if _down():  # Debian's 20.10 `docker info --format '{{json .}}'` exits 0 and reports ServerErrors
        print(json.dumps({"ServerErrors": [DAEMON_DOWN], "ClientInfo": {"Debug": False}}))
        return 0
    path = _state() / ".store" / "runtimes.json"
    runtimes = json.loads(path.read_text()) if path.exists() else ["runc"]
    doc = {"Runtimes": {r: {"path": r} for r in runtimes}, "DefaultRuntime": "runc", "ServerVersion": "27.3.1",
           "Driver": "overlay2", "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]] if _store() == "containerd" else []}
    if "--format" in args:
        print(json.dumps(doc["Runtimes"]) if "Runtimes" in args[args.index("--format") + 1] else json.dumps(doc))
    else:
        print(json.dumps(doc))
    return 0


# --- the fake SGLang server -------------------------------------------------------------------

def _arg(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


class _JSONHandler(BaseHTTPRequestHandler):
    def _send_bytes(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(name: str) -> None:
    opts = json.loads(_container(name).read_text())["opts"] if _container(name).exists() else None
    for _ in range(50):  # `run` writes the state file right after starting us
        if opts:
            break
        time.sleep(0.02)
        opts = json.loads(_container(name).read_text())["opts"] if _container(name).exists() else None
    command = opts["command"]
    log = lambda line: print(line, flush=True)  # noqa: E731
    if ROUTER_MODULE in command:
        return serve_router(opts, log)
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
    always_compile = os.environ.get("FAKE_SGLANG_ALWAYS_COMPILE") == "1"
    for container, (host, read_only) in mounts.items():
        if not read_only:  # a kernel cache: compile into it on a miss, load from it on a hit
            host.mkdir(parents=True, exist_ok=True)
            kernel = host / "fake-kernel.bin"
            if kernel.exists() and not always_compile:
                log(f"kernel cache hit: {container}")
            else:
                kernel.write_bytes(b"compiled")
                log(f"compiled kernels into {container}")
    log(f"server_args: {' '.join(command)}")
    for line in filter(None, os.environ.get("FAKE_SGLANG_LOG_LINES", "").split("|")):
        log(line)
    if os.environ.get("FAKE_SGLANG_EXIT_AFTER_LOG") == "1":
        sys.exit(1)
    log(f"nvfp4_to_fp8 backend={os.environ.get('FAKE_SGLANG_NVFP4_BACKEND', 'qmul4')}")
    if _arg(command, "--speculative-algorithm") == "DSPARK" and (mounts[model_path][0] / "dspark").is_dir():
        log(DSPARK_LINE)
    never_ready = os.environ.get("FAKE_SGLANG_NEVER_READY") == "1"
    reasoning_always = os.environ.get("FAKE_SGLANG_REASONING_ALWAYS") == "1"

    class Handler(_JSONHandler):
        def log_message(self, fmt, *args):
            log("http: " + fmt % args)

        def _send(self, code: int, doc: dict) -> None:
            self._send_bytes(code, json.dumps(doc).encode())

        def do_GET(self):
            if self.path == "/health":
                self._send(503 if never_ready else 200, {})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            if os.environ.get("FAKE_SGLANG_ANSWER_FILE"):
                return self._send_bytes(200, Path(os.environ["FAKE_SGLANG_ANSWER_FILE"]).read_bytes())
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


# --- the fake SGLang router ---------------------------------------------------------------------

def serve_router(opts: dict, log) -> None:
    command = opts["command"]
    if opts.get("network") != "host":
        log("ERROR: the router cannot reach replicas published on the host's 127.0.0.1 without --network host")
        sys.exit(1)
    if opts["env"].get("HF_HUB_OFFLINE") != "1" or opts.get("pull") != "never":
        log("ERROR: the router must start offline (--pull never, HF_HUB_OFFLINE=1)")
        sys.exit(1)
    start = command.index("--worker-urls") + 1
    workers = list(itertools.takewhile(lambda t: not t.startswith("--"), command[start:]))
    api_key = _arg(command, "--api-key")
    turn = itertools.cycle(workers)
    log(f"router: policy={_arg(command, '--policy')} workers={','.join(workers)} host={_arg(command, '--host')}")

    class Handler(_JSONHandler):
        def log_message(self, fmt, *args):
            log("http: " + fmt % args)

        _send = _JSONHandler._send_bytes

        def do_GET(self):
            self._send(200, b"{}") if self.path == "/health" else self._send(404, b'{"error": "not found"}')

        def do_POST(self):
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                return self._send(401, b'{"error": "unauthorized"}')
            body = self.rfile.read(int(self.headers["Content-Length"]))
            worker = next(turn)
            log(f"routed {self.path} to {worker}")
            request = urllib.request.Request(worker + self.path, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                with opener.open(request, timeout=60) as answer:
                    self._send(answer.status, answer.read())
            except urllib.error.HTTPError as e:
                self._send(e.code, e.read())

    server = ThreadingHTTPServer(("127.0.0.1", int(_arg(command, "--port"))), Handler)
    signal.signal(signal.SIGTERM, lambda *_: (log("router shutting down"), os._exit(0)))
    log(f"router listening on 127.0.0.1:{_arg(command, '--port')}")
    server.serve_forever()


def main(argv: list[str]) -> int:
    if argv[:1] == ["_serve"]:
        serve(argv[1])
        return 0
    _record(argv)
    commands = {"run": cmd_run, "logs": cmd_logs, "inspect": cmd_inspect, "stop": cmd_stop, "rm": cmd_rm,
                "load": cmd_load, "info": cmd_info, "version": cmd_version, "ps": cmd_ps}
    if _down() and argv[:1] not in (["version"], ["info"]):
        print(DAEMON_DOWN, file=sys.stderr)
        return 1
    if argv[:2] == ["image", "inspect"]:
        return cmd_image_inspect(argv[2:])
    if not argv or argv[0] not in commands:
        print(f"fake docker: unsupported command {argv[:1]}", file=sys.stderr)
        return 125
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
