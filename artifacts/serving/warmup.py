"""Warm-up: start the recipe's server once with the kernel caches mounted, run the guide's checks, stop it.

The first start compiles the MSA, FlashInfer, Triton and DeepGEMM kernels into the mounted caches, so
that production starts reuse them. The server runs under the very `docker run` line `mm launch`
emits (detached, under its own name): FlashInfer's autotune key includes the model path and the
parallel sizes, so anything else would warm the wrong cache. The cache key (GPU, compute capability,
driver, image digest, recipe) is written beside the caches so that a bundle carries them only to
matching hosts. HTTP goes to 127.0.0.1 only: the server is ours.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import re
import struct
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from .cachekey import FILE_NAME as CACHE_KEY_FILE, CacheKey, write_cache_key
from .diagnose import Finding, ScannedText, diagnose, load_table, scan_docker_logs
from ..errors import BadInput, ProblemsFound, Refused
from ..edges.fsutil import atomic_write_json, read_local_file, user_path
from .launch import LaunchPlan, docker_run_argv, image_candidates, image_identity
from ..edges.progress import NULL_PROGRESS, ProgressSink
from .router import NodePlan, router_docker_argv
from ..edges import interrupt
from ..edges.tools import ToolMissing, ToolResult, last_line, run_tool, start_detached
from ..edges.untrusted import load_json, small_int

REPORT_SCHEMA = "mm-warmup-report/1"
MAX_ANSWER = 16 * 1024 * 1024  # bytes of one chat answer the checks read
REPORT_NAME = "mm-warmup-report.json"
MAX_IMAGE_FILE = 32 * 1024 * 1024  # mm's margin for the --image-file PNG sent to the server's vision check
DSPARK_LINE = "DSpark draft found in the target checkpoint's dspark/ subfolder"
RAW_TOKENS = re.compile(r"</?mm:think>|\]<\]minimax\[>\[")  # what the minimax-m3 parsers take out of content
NVFP4_BACKEND = re.compile(r"nvfp4_to_fp8 backend=(\S+)")
FAST_NVFP4_BACKEND = "qmul4"
FIRST_START_WARMUP_TIMEOUT = "1800"  # SGLANG_WARMUP_TIMEOUT: a first start compiles every kernel
LOG_TAIL_LINES = 40
DOCKER = "docker"

# Loopback only, and never through a proxy from the environment.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class WarmupCheck:
    name: str
    ok: bool
    detail: str
    target: str | None = None  # with replicas: the container (a replica or the router) the check ran against


@dataclass(frozen=True)
class WarmupReport:
    ok: bool
    recipe: str
    status: str
    image: str
    container: str
    port: int
    cache_root: str | None
    cache_key: CacheKey | None
    ready_after_s: float | None
    checks: tuple[WarmupCheck, ...]
    error: str | None = None
    log_tail: tuple[str, ...] = ()
    started: str = ""
    finished: str = ""
    replicas: int = 1
    containers: tuple[str, ...] = ()
    diagnosis: tuple[Finding, ...] = ()  # the troubleshooting rows the logs and failed checks match
    schema: str = REPORT_SCHEMA

    @property
    def failed(self) -> tuple[WarmupCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """A small valid RGB PNG (a two-colour gradient) built in code, so the image check needs no file."""
    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in (x * 32 % 256, y * 32 % 256, 128)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# --- docker ----------------------------------------------------------------------------------

def _docker(args: list[str], timeout: float = 120) -> ToolResult:
    """docker's answer, bounded in bytes and time (tools.run_tool; its text decoded with replacement)."""
    try:
        done = run_tool([DOCKER, *args], timeout=timeout)
    except ToolMissing:
        from .docker import DOCKER_MISSING

        raise ProblemsFound(DOCKER_MISSING) from None
    if done.stopped:
        raise ProblemsFound(f"docker {args[0]}: {done.stopped}")
    return done


def parse_gpu_info(text: str) -> tuple[str, str, str, int]:
    """`nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader` -> one GPU kind."""
    rows = [tuple(part.strip() for part in line.split(",")) for line in text.splitlines() if line.strip()]
    if not rows or any(len(r) != 3 for r in rows):
        raise BadInput(f"GPU info {text.strip()!r}: expected 'NAME, COMPUTE_CAP, DRIVER' lines")
    if len(set(rows)) != 1:
        raise Refused(f"GPUs differ ({'; '.join(sorted({', '.join(r) for r in rows}))}); a recipe and its caches need one GPU kind")
    return rows[0][0], rows[0][1], rows[0][2], len(rows)


def local_image(plan: LaunchPlan) -> str:
    """How this host has the plan's image (the same search as the start script): the pinned reference, else the
    image ID `mm image save` recorded (the classic store drops repo digests on `docker load`). Docker itself first:
    without it, or with its daemon down, that is what warm-up says (as doctor and the start script do)."""
    from .docker import docker_problem

    if problem := docker_problem(DOCKER):  # missing or down: exit 1, as doctor's failed check and the start script
        raise ProblemsFound(problem)
    for ref in image_candidates(plan):
        if _docker(["image", "inspect", "--", ref]).returncode == 0:
            return ref
    raise BadInput(f"image {image_identity(plan)} is not on this host: docker load -i {plan.archive_hint}")


def query_gpus(plan: LaunchPlan, image: str | None = None) -> str:
    """Ask the pinned image's nvidia-smi for the selected GPUs (what the cache key records)."""
    if plan.hardware.vendor != "nvidia":
        raise BadInput(f"{plan.hardware.name}: pass --gpu-info 'NAME, GFX/COMPUTE, DRIVER' (nvidia-smi is NVIDIA only)")
    argv = ["run", "--rm", "--pull", "never", "--gpus", '"device=%s"' % ",".join(map(str, plan.gpus)),
            "--entrypoint", "nvidia-smi", image or plan.image, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
    done = _docker(argv)
    if done.returncode != 0:
        raise ProblemsFound(f"docker run nvidia-smi failed ({done.returncode}): {_last_line(done.stderr)}")
    return done.stdout


def check_gpu_family(plan: LaunchPlan, gpu: str, compute_capability: str) -> None:
    """Blackwell recipes (MSA, DSpark on NVFP4) fail on older GPUs: say so before a long start."""
    try:
        major = small_int(compute_capability.split(".")[0], hi=999)
        if major is None:
            raise ValueError(compute_capability)
    except ValueError:
        return  # AMD gfx names and the like: nothing to compare
    family = plan.hardware.family
    if family == "blackwell" and major < 10:
        raise Refused(f"GPUs are {gpu} (compute {compute_capability}), but recipe {plan.recipe.id} needs Blackwell "
                      f"(M3.1 NVFP4 DSPARK requires Blackwell); use --hardware h200 on Hopper")
    if family == "hopper" and major != 9:
        raise Refused(f"GPUs are {gpu} (compute {compute_capability}), but recipe {plan.recipe.id} is for Hopper; "
                      f"pick the recipe for this hardware")


def refuse_wrong_gpus(plan: LaunchPlan, gpu_info: str | None) -> None:
    """Refuse (exit 7) a recipe the GPUs cannot run before anything else is looked at: --gpu-info, else the host's
    own nvidia-smi when it answers (the image's nvidia-smi, which the cache key records, needs the image)."""
    if gpu_info is None and plan.hardware.vendor == "nvidia":
        from .doctor import nvidia_gpus

        gpus, _, _ = nvidia_gpus()
        chosen = [g for g in gpus if g.index in plan.gpus] or gpus
        gpu_info = "\n".join(f"{g.name}, {g.compute_capability}, {g.driver}" for g in chosen) or None
    if gpu_info:
        gpu, cc, _, _ = parse_gpu_info(gpu_info)
        check_gpu_family(plan, gpu, cc)


def _last_line(text: str) -> str:
    return last_line(text or "") or "(no output)"


# the log lines log_checks reads; every other line is matched against the troubleshooting table as it streams by
CHECKED_LINES = re.compile(NVFP4_BACKEND.pattern + "|" + re.escape(DSPARK_LINE))


def container_logs(name: str) -> ScannedText:
    """`docker logs NAME` read streaming (a server log may be GBs): the table's matches, the tail, the checked lines."""
    try:
        return scan_docker_logs(name, load_table(), docker=DOCKER, tail=LOG_TAIL_LINES, keep=CHECKED_LINES,
                                check=False)
    except BadInput as e:
        if "no answer within" in e.message:
            raise ProblemsFound(e.message) from None
        raise


def container_running(name: str) -> bool:
    done = _docker(["inspect", "-f", "{{.State.Running}}", "--", name])
    return done.returncode == 0 and done.stdout.strip() == "true"


def _start_container(args: list[str], name: str) -> ToolResult:
    """`docker run -d ...` of container NAME; interrupted meanwhile, the container (created or not) is removed."""
    try:
        return _docker(args)
    except KeyboardInterrupt:
        stop_container(name)
        raise


def stop_container(name: str) -> None:
    if interrupt.requested():  # Ctrl-C: removed by a docker that outlives mm (which ends within a second)
        start_detached([DOCKER, "rm", "-f", "--", name])
        return
    _docker(["stop", "--", name], timeout=180)
    _docker(["rm", "-f", "--", name])


# --- HTTP against the local server -----------------------------------------------------------

def health_ok(port: int) -> bool:
    try:
        with _http.open(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(name: str, port: int, timeout: float, poll: float, progress: ProgressSink) -> float:
    """Seconds until /health answered 200; raises ProblemsFound on timeout or when the container exits."""
    start = last_note = time.monotonic()
    delay = min(poll, 0.25)  # short at first (a warm cache starts fast), then every `poll` seconds
    while True:
        if health_ok(port):
            return time.monotonic() - start
        if not container_running(name):
            raise ProblemsFound(f"container {name} exited before /health answered")
        if time.monotonic() - start > timeout:
            raise ProblemsFound(f"server not ready: /health on 127.0.0.1:{port} did not answer within {timeout:g}s")
        if time.monotonic() - last_note >= 30:
            last_note = time.monotonic()
            progress.note(f"waiting for /health ({last_note - start:.0f}s)")
        time.sleep(delay)
        delay = min(poll, delay * 2)


def chat(port: int, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with _http.open(request, timeout=timeout) as response:
            answer = load_json(response.read(MAX_ANSWER + 1), request.full_url, max_bytes=MAX_ANSWER)
    except urllib.error.HTTPError as e:
        raise ProblemsFound(f"HTTP {e.code}: {e.read(300).decode('utf-8', 'replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ProblemsFound(f"no usable answer: {e}") from None
    except BadInput as e:
        raise ProblemsFound(f"no usable answer: {e.message}") from None
    return answer if isinstance(answer, dict) else {}


def _message(answer: dict) -> dict:
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return {}
    return message if isinstance(message, dict) else {}


# --- the guide's checks ----------------------------------------------------------------------

MAX_KEPT_ANSWER = 64 * 1024  # bytes of a failed check's answer kept for the diagnosis (judged as JSON there)


def request_checks(plan: LaunchPlan, image_png: bytes, timeout: float, port: int | None = None,
                   target: str | None = None, answers: list[str] | None = None) -> list[WarmupCheck]:
    """Quickstart steps 5-7: text, thinking disabled, image input (as a data URI: the host is offline). The answer
    of a check that fails goes to ANSWERS, so that the diagnosis judges its fields."""
    base = {"model": plan.container_model_path, "max_tokens": 4096, **plan.sampling}
    checks = []

    def run(name: str, body: dict, judge) -> None:
        try:
            answer = chat(port or plan.port, {**base, **body}, timeout)
        except ProblemsFound as e:
            checks.append(WarmupCheck(name, False, e.message, target))
            return
        checks.append(dataclasses.replace(judge(_message(answer)), target=target))
        if not checks[-1].ok and answers is not None:
            answers.append(json.dumps(answer)[:MAX_KEPT_ANSWER])

    def has_content(name: str):
        def judge(m: dict) -> WarmupCheck:
            content = m.get("content")
            raw = RAW_TOKENS.search(str(content or ""))
            if raw:  # the guide's troubleshooting row: parsers off, or not the pinned runtime
                return WarmupCheck(name, False, f"content holds the raw token {raw.group(0)}: {str(content)[:200]}")
            return WarmupCheck(name, bool(content and str(content).strip()),
                         f"content: {len(str(content or ''))} chars" if content else "choices[0].message.content is empty")
        return judge

    run("text", {"messages": [{"role": "user", "content": "Explain sparse attention in one sentence."}]},
        has_content("text"))

    def thinking_off(m: dict) -> WarmupCheck:
        reasoning, content = m.get("reasoning_content"), m.get("content")
        if reasoning:
            return WarmupCheck("thinking-disabled", False, f"reasoning_content returned ({len(str(reasoning))} chars) although thinking was disabled")
        if not (content and str(content).strip()):
            return WarmupCheck("thinking-disabled", False, "choices[0].message.content is empty")
        return WarmupCheck("thinking-disabled", True, "content present, reasoning_content empty")

    run("thinking-disabled", {"messages": [{"role": "user", "content": "How many prime numbers are there below 50?"}],
                              "thinking": {"type": "disabled"}}, thinking_off)
    run("image", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe this image in one sentence."},
        {"type": "image_url", "image_url": {"url": data_uri(image_png)}}]}]}, has_content("image"))
    return checks


def log_checks(plan: LaunchPlan, log: str | ScannedText, target: str | None = None) -> list[WarmupCheck]:
    if isinstance(log, ScannedText):
        log = "\n".join(log.kept)
    checks = []
    if plan.recipe.expects_qmul4:
        backends = NVFP4_BACKEND.findall(log)
        if FAST_NVFP4_BACKEND in backends:
            checks.append(WarmupCheck("nvfp4-qmul4", True, f"nvfp4_to_fp8 backend={FAST_NVFP4_BACKEND}"))
        else:
            seen = f"backend={backends[-1]}" if backends else "no nvfp4_to_fp8 line"
            checks.append(WarmupCheck("nvfp4-qmul4", False, f"slow path taken: log shows {seen}, not backend=qmul4 "
                                                      "(CUDA toolkit older than 13.4: use the pinned image or set CUDA_HOME to CUDA 13.4)"))
    if plan.uses_dspark:
        found = DSPARK_LINE in log
        checks.append(WarmupCheck("dspark-draft", found, "DSpark draft loaded from dspark/" if found
                            else f"log lacks {DSPARK_LINE!r}: the draft was not loaded"))
    return [dataclasses.replace(c, target=target) for c in checks]


# --- the whole warm-up -----------------------------------------------------------------------

def warmup_name(plan: LaunchPlan) -> str:
    return "mm-warmup-" + plan.recipe.id.replace("/", "-")


def _diagnosis(plan: LaunchPlan, logs: dict[str, ScannedText], error: str | None, checks: list[WarmupCheck],
               answers: list[str] = ()) -> tuple[Finding, ...]:
    """The guide's troubleshooting rows that the logs, the failures and the failed answers match (the same as
    `mm diagnose`)."""
    failures = [error] if error else []
    failures += [f"{c.target + ': ' if c.target else ''}{c.name}: {c.detail}" for c in checks if not c.ok]
    table = load_table()
    texts = list(logs.values()) + [("warm-up failures", "\n".join(failures))]
    texts += [(f"warm-up answer {i + 1}", answer) for i, answer in enumerate(answers)]
    return diagnose(texts, plan=plan, table=table).findings


def _table_check(diagnosis: tuple[Finding, ...], checks: list[WarmupCheck]) -> list[WarmupCheck]:
    """A log that matches a row of the troubleshooting table fails the warm-up even when every check passed
    (e.g. the MSA kernels could not be saved: the caches warm-up exists to fill stay empty)."""
    if not diagnosis or any(not c.ok for c in checks):
        return []
    f = diagnosis[0]
    return [WarmupCheck("troubleshooting table", False, f"{f.where} matches row {f.guide_row} ({f.row}): {f.line}")]


def run_warmup(target: LaunchPlan | NodePlan, *, timeout: float = 3600, image_png: bytes | None = None,
               gpu_info: str | None = None, request_timeout: float = 600, poll: float = 2.0,
               progress: ProgressSink = NULL_PROGRESS) -> WarmupReport:
    """One server, or (a NodePlan with a router) every replica and the router."""
    if isinstance(target, NodePlan):
        if target.router is not None:
            return run_node_warmup(target, timeout=timeout, image_png=image_png, gpu_info=gpu_info,
                                   request_timeout=request_timeout, poll=poll, progress=progress)
        target = target.first
    plan = target
    if plan.expose:
        raise BadInput("warm-up publishes on 127.0.0.1 only; leave out --expose")
    started = _now()
    refuse_wrong_gpus(plan, gpu_info)  # the combination first: a missing image is not the answer on the wrong GPU
    image = local_image(plan)
    gpu, cc, driver, count = parse_gpu_info(gpu_info if gpu_info is not None else query_gpus(plan, image))
    check_gpu_family(plan, gpu, cc)
    cache_key = CacheKey(gpu=gpu, compute_capability=cc, driver=driver, image=plan.image, recipe=plan.recipe.id, gpu_count=count)
    name = warmup_name(plan)
    _docker(["rm", "-f", "--", name])  # a warm-up killed earlier may have left its container behind
    extra_env = (("SGLANG_WARMUP_TIMEOUT", FIRST_START_WARMUP_TIMEOUT),) if plan.recipe.engine == "sglang" else ()
    argv = [str(t) for t in docker_run_argv(plan, detach=True, name=name, extra_env=extra_env, image=image)]
    progress.note(f"starting {plan.recipe.id} as container {name}")
    done = _start_container(argv[1:], name)
    if done.returncode != 0:
        raise ProblemsFound(f"docker run failed ({done.returncode}): {_last_line(done.stderr)}")

    checks: list[WarmupCheck] = []
    error, tail, ready_after, diagnosis = None, (), None, ()
    try:
        try:
            ready_after = wait_healthy(name, plan.port, timeout, poll, progress)
        except ProblemsFound as e:
            error = e.message
        answers: list[str] = []
        if error is None:
            progress.note(f"/health ready after {ready_after:.0f}s; running the guide's checks")
            checks += request_checks(plan, image_png or tiny_png(), request_timeout, answers=answers)
        log = container_logs(name)
        if error is None:
            checks += log_checks(plan, log)
        diagnosis = _diagnosis(plan, {name: log}, error, checks, answers)
        checks += _table_check(diagnosis, checks)
        if error or not all(c.ok for c in checks):
            tail = tuple(log.tail)
    finally:
        stop_container(name)

    return _finish(plan, cache_key, ready_after, checks, error, tail, diagnosis, started, container=name, port=plan.port,
                   containers=(name,))


def _finish(plan: LaunchPlan, cache_key: CacheKey, ready_after: float | None, checks: list[WarmupCheck], error: str | None,
            tail: tuple[str, ...], diagnosis: tuple[Finding, ...], started: str, **where) -> WarmupReport:
    """Record the cache key once the caches were filled (the first server answered /health); build the report."""
    if ready_after is not None and plan.cache_root is not None:
        write_cache_key(plan.cache_root, cache_key)
    return WarmupReport(ok=error is None and all(c.ok for c in checks), recipe=plan.recipe.id, status=plan.recipe.status,
                        image=plan.image, cache_root=str(plan.cache_root) if plan.cache_root else None,
                        cache_key=cache_key, ready_after_s=None if ready_after is None else round(ready_after, 1),
                        checks=tuple(checks), error=error, log_tail=tail, started=started, finished=_now(),
                        diagnosis=diagnosis, **where)


def cache_snapshot(root: Path | None) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of the kernel caches (mm's own files left out)."""
    if root is None or not root.is_dir():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (CACHE_KEY_FILE, REPORT_NAME)}


def _from_cache_check(before: dict, after: dict, name: str) -> WarmupCheck:
    written = sorted(k for k in after if before.get(k) != after[k])
    if written:
        return WarmupCheck("from-cache", False, f"wrote {len(written)} file(s) into the shared kernel cache (compiled again): "
                     f"{', '.join(written[:5])}", name)
    return WarmupCheck("from-cache", True, f"started from the shared kernel cache ({len(after)} files, none written)", name)


def run_node_warmup(node: NodePlan, *, timeout: float = 3600, image_png: bytes | None = None, gpu_info: str | None = None,
                    request_timeout: float = 600, poll: float = 2.0, progress: ProgressSink = NULL_PROGRESS) -> WarmupReport:
    """Warm replica 0 alone (it compiles into the shared caches), then start each other replica and prove it
    wrote nothing there, then the router; the guide's checks run on every replica and through the router."""
    first, router = node.first, node.router
    started = _now()
    all_gpus = [g for p in node.replicas for g in p.gpus]
    node_view = dataclasses.replace(first, gpus=tuple(all_gpus))
    refuse_wrong_gpus(node_view, gpu_info)
    image = local_image(first)  # every replica and the router run the image found by identity, as the node script does
    gpu, cc, driver, count = parse_gpu_info(gpu_info if gpu_info is not None else query_gpus(node_view, image))
    check_gpu_family(first, gpu, cc)
    cache_key = CacheKey(gpu=gpu, compute_capability=cc, driver=driver, image=first.image, recipe=first.recipe.id,
                         gpu_count=len(first.gpus))
    base = warmup_name(first)
    names = [f"{base}-{i}" for i in range(len(node.replicas))]
    router_name = f"{base}-router"
    for name in (router_name, *names):
        _docker(["rm", "-f", "--", name])
    extra_env = (("SGLANG_WARMUP_TIMEOUT", FIRST_START_WARMUP_TIMEOUT),)
    checks: list[WarmupCheck] = []
    error, ready_after, started_names = None, None, []
    logs: dict[str, ScannedText] = {}
    tail: tuple[str, ...] = ()
    diagnosis: tuple[Finding, ...] = ()
    try:
        for i, (plan, name) in enumerate(zip(node.replicas, names)):
            before = cache_snapshot(first.cache_root)
            progress.note(f"starting replica {i} of {first.recipe.id} as {name} (GPUs {','.join(map(str, plan.gpus))})")
            done = _start_container([str(t) for t in docker_run_argv(plan, detach=True, name=name, extra_env=extra_env,
                                                                               image=image)][1:], name)
            if done.returncode != 0:
                error = f"docker run {name} failed ({done.returncode}): {_last_line(done.stderr)}"
                break
            started_names.append(name)
            try:
                took = wait_healthy(name, plan.port, timeout, poll, progress)
            except ProblemsFound as e:
                error = f"replica {i} ({name}): {e.message}"
                break
            if i == 0:
                ready_after = took
            else:
                checks.append(_from_cache_check(before, cache_snapshot(first.cache_root), name))
        if error is None:
            progress.note(f"starting the router as {router_name} on 127.0.0.1:{router.port}")
            done = _start_container([str(t) for t in router_docker_argv(router, detach=True, name=router_name,
                                                                        image=image)][1:], router_name)
            if done.returncode != 0:
                error = f"docker run {router_name} failed ({done.returncode}): {_last_line(done.stderr)}"
            else:
                started_names.append(router_name)
                try:
                    wait_healthy(router_name, router.port, timeout, poll, progress)
                except ProblemsFound as e:
                    error = f"router ({router_name}): {e.message}"
        answers: list[str] = []
        if error is None:
            png = image_png or tiny_png()
            for plan, name in zip(node.replicas, names):
                checks += request_checks(plan, png, request_timeout, target=name, answers=answers)
            checks += request_checks(first, png, request_timeout, port=router.port, target=router_name, answers=answers)
        logs = {name: container_logs(name) for name in started_names}
        if error is None:
            for plan, name in zip(node.replicas, names):
                checks += log_checks(plan, logs[name], target=name)
        diagnosis = _diagnosis(first, logs, error, checks, answers)
        checks += _table_check(diagnosis, checks)
        if error or not all(c.ok for c in checks):
            failing = {c.target for c in checks if not c.ok} or {started_names[-1] if started_names else names[0]}
            tail = tuple(f"{name}: {line}" for name in started_names if name in failing
                         for line in (logs[name].tail if name in logs else ()))
    finally:
        for name in reversed(started_names):  # the router first
            stop_container(name)

    return _finish(first, cache_key, ready_after, checks, error, tail, diagnosis, started, container=router_name,
                   port=router.port, replicas=len(node.replicas), containers=tuple(names) + (router_name,))


def default_report_path(plan: LaunchPlan) -> Path:
    return (plan.cache_root or plan.model_dir.parent) / REPORT_NAME


def _schema_first(doc: dict) -> dict:
    return {"schema": doc.pop("schema"), **doc}


def write_report(report: WarmupReport, path: Path, root: Path | None = None) -> None:
    """PATH under ROOT (the kernel cache root for the default report), or, without ROOT, a path the user named."""
    path = Path(path) if root else user_path(path)
    atomic_write_json(path, _schema_first(asdict(report)), root=root or path.parent)


def read_image_file(path: Path) -> bytes:
    data = read_local_file(path, what="--image-file PNG", max_bytes=MAX_IMAGE_FILE)
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise BadInput(f"--image-file {path}: not a PNG file")
    return data

