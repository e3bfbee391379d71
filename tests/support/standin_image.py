"""A stand-in server image for the real-docker tests: SGLang's HTTP API and log lines, from busybox-static.

    tar_bytes = rootfs_tar()                       # the root file system, built here
    image_id = build(engine, "127.0.0.1:P/lmsysorg/sglang:standin", env={"NVIDIA_REQUIRE_CUDA": "cuda>=13.0"})

`docker import` turns the tar into an image (with ENV lines for PATH and the given variables). What it holds:
  /bin/busybox and its applets (Debian busybox-static)
  /usr/bin/sglang, /usr/bin/vllm    -> /standin/server: `sglang serve ...` / `vllm serve MODEL ...` as mm starts them
  /usr/bin/python3                   `python3 -m sglang_router.launch_router ...`: the router, a TCP proxy bound to
                                     127.0.0.1:--port in front of the first --worker-urls (Debian docker.io's own
                                     docker-proxy, with the libc it links)
  /usr/bin/nvidia-smi                one line per device in NVIDIA_VISIBLE_DEVICES (the docker wrapper sets it)
The server prints SGLang 0.5.23's log lines (server_args, the DSpark line, MSA's nvfp4_to_fp8 backend line, uvicorn
access lines), answers /health with 503 until it is ready (as SGLang does while it starts), then 200, and answers
/v1/chat/completions like SGLang (content, reasoning_content null when thinking is disabled). The file
`standin-mode` in the mounted SGLang cache (/root/.cache/sglang) picks a failure, each printing the message its
source prints (see MODES). It compiles "kernels" (writes a file) into empty mounted caches, as a first start does.
"""
from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

# mode -> the row of the guide's troubleshooting table a warm-up must name
MODES = {
    "jit": "msa-jit-disabled", "slow": "nvfp4-slow-path", "cache": "kernel-cache-not-persisted", "oom": "cuda-oom",
    "dspark": "dspark-needs-blackwell", "weights": "weights-incomplete", "nccl": "nccl-hang",
    "rawthink": "raw-think-tokens", "thinking400": "thinking-type-400", "neverready": "health-failing",
}
NEVER_READY = ("nccl", "neverready")

SERVER = r"""#!/bin/sh
# Stand-in for SGLang (or vLLM) in mm's real-docker tests. Messages quote their sources (see tests/diagnose_corpus).
engine=$1; shift
port=30000; model=""; rparser=None; tparser=None; spec=None
if [ "$engine" = vllm ]; then [ "$1" = serve ] && shift; model=$1; shift; fi
[ "$1" = serve ] && shift
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift ;;
    --model-path) model=$2; shift ;;
    --reasoning-parser) rparser="'$2'"; shift ;;
    --tool-call-parser) tparser="'$2'"; shift ;;
    --speculative-algorithm) spec="'$2'"; shift ;;
  esac
  shift
done
mode=$(cat /root/.cache/sglang/standin-mode 2>/dev/null || echo healthy)
export STANDIN_MODE="$mode" STANDIN_MODEL="$model" STANDIN_ENGINE="$engine"
log() { echo "[$(date -u '+%Y-%m-%d %H:%M:%S')$tp] $*"; }
trap 'exit 0' TERM INT
tp=
if [ "$engine" = vllm ]; then
  echo "INFO [utils.py:253] non-default args: {'model': '$model', 'reasoning_parser': $rparser, 'tool_call_parser': $tparser}"
else
  log "server_args={'model_path': '$model', 'port': $port, 'reasoning_parser': $rparser, 'tool_call_parser': $tparser, 'speculative_algorithm': $spec}"
fi
[ -d "$model" ] || { log "RuntimeError: Cannot find any model weights with \`$model\`"; exit 1; }
if [ "$spec" = "'DSPARK'" ] && [ -d "$model/dspark" ]; then
  log "DSpark draft found in the target checkpoint's dspark/ subfolder; defaulting --speculative-draft-model-path to $model/dspark."
fi
for cache in /root/.cache/sglang /root/.cache/sglang-jit /root/.cache/minfer; do
  if [ -d "$cache" ] && [ -z "$(ls "$cache" | grep -v '^standin-mode$')" ]; then echo kernel > "$cache/kernel-$$.bin"; fi
done
tp=" TP0"
backend=qmul4
case "$mode" in
  jit) log "Scheduler hit an exception: Traceback (most recent call last):"
       log "RuntimeError: JIT compilation is disabled and AOT kernel ('msa_v1_prefill_q8kv8', 64, 4) was not found; set FMHA_SM100_ALLOW_JIT=1 to allow JIT compilation"
       tp=; log "Received sigquit from a child process. It usually means the child failed."; exit 1 ;;
  oom) log "Scheduler hit an exception: Traceback (most recent call last):"
       log "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 268.00 GiB of which 1.06 GiB is free."
       exit 1 ;;
  dspark) tp=; log "ValueError: M3.1 NVFP4 DSPARK requires Blackwell"; exit 1 ;;
  weights) log "AssertionError: Attempted to load weight (torch.Size([3072, 6144])) into parameter (torch.Size([3072, 4096]))"; exit 1 ;;
  slow) backend=fp16_fallback
        log "MSA-v1 Q8KV4 decode is unavailable (QMUL4 requires CUDA compiler >=13.4, got 13.0); using the slower FP8 fallback." ;;
  cache) log "Failed to save AOT kernel msa_v1_decode_q8kv4: [Errno 30] Read-only file system: '/root/.cache/minfer/msa_v1/standin.o'" ;;
  nccl) echo "standin:1:1 [0] misc/shmutils.cc:113 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-st0001 (size 9637888), error: No space left on device (28)" ;;
esac
[ "$engine" = sglang ] && log "Compiled inference.dequant.nvfp4_to_fp8 backend=$backend in 0.1s"
tp=
echo "INFO:     Application startup complete."
nc -ll -p "$port" -e /standin/handler &
case "$mode" in
  nccl|neverready) ;;
  *) sleep 1; : > /tmp/ready; [ "$engine" = sglang ] && log "The server is fired up and ready to roll!" ;;
esac
while :; do wait; sleep 1; done
"""

HANDLER = r"""#!/bin/sh
cr=$(printf '\r')
read -r method path proto
len=0
while read -r line; do
  line=${line%"$cr"}
  [ -z "$line" ] && break
  case "$line" in [Cc]ontent-[Ll]ength:*) len=${line#*:}; len=${len# } ;; esac
done
body=
[ "$len" -gt 0 ] && body=$(head -c "$len")
reply() {
  printf 'HTTP/1.1 %s %s\r\nContent-Type: application/json\r\nContent-Length: %s\r\nConnection: close\r\n\r\n%s' "$1" "$2" "${#3}" "$3"
  echo "INFO:     127.0.0.1:0 - \"$method $path HTTP/1.1\" $1 $2" >> /proc/1/fd/1
}
case "$method $path" in
  "GET /health")
    if [ -f /tmp/ready ]; then reply 200 OK ''; else reply 503 'Service Unavailable' ''; fi ;;
  "POST /v1/chat/completions")
    off=; case "$body" in *'"thinking": {"type": "disabled"}'*) off=1 ;; esac
    reasoning='"The stand-in thinks about it."'; [ -n "$off" ] && reasoning=null
    content="The stand-in answers: sparse attention attends to a subset."
    if [ "$STANDIN_MODE" = rawthink ]; then content="<mm:think>The stand-in thinks.</mm:think>$content"; reasoning=null; fi
    if [ "$STANDIN_MODE" = thinking400 ] && [ -n "$off" ]; then
      reply 400 'Bad Request' "{\"object\": \"error\", \"message\": \"thinking.type must be 'adaptive', 'enabled' or 'disabled', got None.\", \"type\": \"BadRequestError\", \"param\": null, \"code\": 400}"
      exit 0
    fi
    reply 200 OK "{\"id\": \"standin\", \"object\": \"chat.completion\", \"model\": \"$STANDIN_MODEL\", \"choices\": [{\"index\": 0, \"message\": {\"role\": \"assistant\", \"content\": \"$content\", \"reasoning_content\": $reasoning}, \"finish_reason\": \"stop\"}]}" ;;
  *) reply 404 'Not Found' '{"detail": "Not Found"}' ;;
esac
"""

NVIDIA_SMI = r"""#!/bin/sh
# The stand-in's GPUs: one line per device the docker wrapper passed (NVIDIA_VISIBLE_DEVICES), B300s.
devs=${NVIDIA_VISIBLE_DEVICES:-0,1,2,3}
[ "$devs" = all ] && devs=0,1,2,3
case "$*" in
  "--query-gpu=name,compute_cap,driver_version --format=csv,noheader") line="NVIDIA B300 SXM6 AC, 10.3, 590.48.01" ;;
  "--query-gpu=name --format=csv,noheader") line="NVIDIA B300 SXM6 AC" ;;
  *) echo "stand-in nvidia-smi: unsupported arguments: $*" >&2; exit 2 ;;
esac
for d in $(echo "$devs" | tr ',' ' '); do echo "$line"; done
"""

PYTHON3 = r"""#!/bin/sh
# `python3 -m sglang_router.launch_router ...` only: the router, a TCP proxy on 127.0.0.1:--port to the first worker.
[ "$1 $2" = "-m sglang_router.launch_router" ] || { echo "stand-in python3: only -m sglang_router.launch_router" >&2; exit 2; }
shift 2
port=; worker=
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift ;; --worker-urls) worker=$2; shift ;; esac
  shift
done
rest=${worker#http://}
echo "stand-in router on 127.0.0.1:$port in front of $worker"
# docker-proxy reports readiness on fd 3 and closes it: give it one (else it closes its own listener)
exec /standin/docker-proxy -proto tcp -host-ip 127.0.0.1 -host-port "$port" -container-ip "${rest%:*}" -container-port "${rest##*:}" 3>/dev/null
"""

SCRIPTS = {"standin/server": SERVER, "standin/handler": HANDLER, "usr/bin/nvidia-smi": NVIDIA_SMI,
           "usr/bin/python3": PYTHON3, "usr/bin/sglang": '#!/bin/sh\nexec /standin/server sglang "$@"\n',
           "usr/bin/vllm": '#!/bin/sh\nexec /standin/server vllm "$@"\n'}
BINARIES = {"standin/docker-proxy": "/usr/sbin/docker-proxy", "lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
            "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}


def _add(tf: tarfile.TarFile, name: str, data: bytes, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tf.addfile(info, io.BytesIO(data))


def rootfs_tar() -> bytes:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox: not installed (make tools installs busybox-static)")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for d in ("bin", "usr", "usr/bin", "standin", "lib", "lib/x86_64-linux-gnu", "lib64", "root", "root/.cache"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tf.addfile(info)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode, tmp.mtime = tarfile.DIRTYPE, 0o1777, 0
        tf.addfile(tmp)
        _add(tf, "bin/busybox", Path(busybox).read_bytes())
        for applet in applets:
            if applet != "busybox":
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname, link.mode, link.mtime = tarfile.SYMTYPE, "busybox", 0o777, 0
                tf.addfile(link)
        for name, text in SCRIPTS.items():
            _add(tf, name, text.encode())
        for name, source in BINARIES.items():
            _add(tf, name, Path(source).resolve().read_bytes())
    return out.getvalue()


def build(engine, ref: str, env: dict[str, str]) -> str:
    """`docker import` the stand-in as REF with ENV; returns its image ID."""
    changes = ["--change", "ENV PATH=/usr/bin:/bin"]
    for key, value in env.items():
        changes += ["--change", f"ENV {key}={value}"]
    done = subprocess.run(["docker", "import", *changes, "-", ref], input=rootfs_tar(), capture_output=True,
                          env=engine.env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"docker import: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode().strip()
