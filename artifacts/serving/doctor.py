"""mm doctor: will this host start this model with this recipe? One check per line, each with its fix.

Runs on the destination before `mm launch`, offline. It plans the same start `mm launch` would (same recipe
options) and checks what that start needs from the host:
  GPUs      nvidia-smi (rocm-smi on AMD): model and count against the recipe and --gpus, compute capability, MIG
            mode off on the selected GPUs (with MIG on, CUDA sees only MIG instances, not the whole GPU)
  driver    as the NVIDIA Container Toolkit judges it (cudareq): the image's own NVIDIA_REQUIRE_* (from the `mm image
            save` record, the archive, else `docker image inspect`) evaluated for each GPU the way libnvidia-container
            does, NVIDIA_DISABLE_REQUIRE honoured; FAIL where the container will not start, or will start and fail at
            its first CUDA call (a runtime a major version above the driver's CUDA: minor-version compatibility stays
            within a major version). A runtime newer than the driver's CUDA within its major version is a WARN
            explaining minor-version compatibility and cuda-compat. The toolkit refusing the image ("requirement
            error") is the driver's failure, not the container runtime's. The guide's CUDA 13.4 belongs to the pinned SGLang image only (it publishes no minimum
            driver, so none is invented here)
  docker    present and answering; the image present by identity (pinned reference, else the image ID
            `mm image save` recorded); the NVIDIA container runtime usable (the image's own nvidia-smi sees the GPUs)
  host      every port the start binds free on 127.0.0.1 (with replicas: theirs, the router's and its metrics),
            /dev/shm (the start uses --ipc=host), host memory for HiCache recipes (launch.hicache_host_gb and
            diagnose.hicache_fits: --hicache-size is per rank, times the replicas), free disk for the kernel caches
  caches    the kernel caches' key (mm-cache-key.json) against this GPU, driver, image and recipe
  model     the rule `mm launch` applies (launch.check_model_dir): manifest, the recipe's repository, dspark/ where
            the recipe uses DSpark, quick verify
The checks `mm diagnose --host-checks` also runs (kernel cache warm, GPU family, model complete) come from the
troubleshooting table through diagnose.host_findings, with the table's fix for this plan.
Status: ok, warn (the start works but something costs time), fail (the start will not work). Exit 1 on any fail.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .cachekey import FILE_NAME as CACHE_KEY_FILE
from ..errors import BadInput
from .docker import DOCKER_MISSING, docker_server
from .launch import LaunchOptions, LaunchPlan, hicache_host_gb, image_candidates, image_identity
from . import cudareq
from ..pins import Pin
from ..units import human_bytes
from ..edges.tools import IMAGE_REF, ToolMissing, ToolResult, check_name, last_line, run_tool
from ..edges.untrusted import load_json, small_int, version_numbers
from ..edges.fsutil import read_json_file

OK, WARN, FAIL = "ok", "warn", "fail"
SHM_GUIDE = 32 * 2**30  # the guide's --shm-size 32g (docker reads g as GiB); with --ipc=host the host's /dev/shm is what the server gets
CACHE_DISK_MARGIN = 20 * 10**9  # mm's margin for compiled kernels (the guide publishes no figure)
# The GPU product token each hardware name stands for (nvidia-smi's name holds it as one word).
GPU_TOKENS = {"b300": "B300", "gb300": "GB300", "b200": "B200", "gb200": "GB200", "h200": "H200", "h100": "H100",
              "mi355x": "MI355X", "mi350x": "MI350X"}
FAMILY_CC_MAJOR = {"blackwell": "10", "hopper": "9"}
MAX_FIELD = 256  # characters of a field of nvidia-smi's or rocm-smi's answer kept (a GPU name is ~25)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None


@dataclass
class DoctorReport:
    model_dir: str
    recipe: str
    image: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARN, FAIL)}


def _run(argv: list[str], timeout: float = 60) -> ToolResult | None:
    """The tool's answer, bounded in bytes and time (tools.run_tool); None when it is not installed."""
    try:
        return run_tool(argv, timeout=timeout)
    except ToolMissing:
        return None


def _version(text: str) -> tuple[int, ...]:
    return version_numbers(text, 2)


# --- GPUs ------------------------------------------------------------------------------------------------

@dataclass
class Gpu:
    index: int
    name: str
    compute_capability: str
    driver: str
    mig: str | None = None  # nvidia-smi's mig.mode.current: Enabled, Disabled, [N/A]; None when not asked


def nvidia_gpus() -> tuple[list[Gpu], str | None, str | None]:
    """(GPUs, highest CUDA version the driver supports, error) from nvidia-smi."""
    done = _run(["nvidia-smi", "--query-gpu=index,name,compute_cap,driver_version", "--format=csv,noheader"])
    if done is None:
        return [], None, "nvidia-smi: not found"
    if done.returncode != 0:
        return [], None, f"nvidia-smi failed: {done.last_line()}"
    gpus = []
    for line in done.stdout.splitlines():
        parts = [p.strip()[:MAX_FIELD] for p in line.split(",")]
        if len(parts) == 4 and (index := small_int(parts[0], hi=4095)) is not None:
            gpus.append(Gpu(index, parts[1], parts[2], parts[3]))
    mig = _run(["nvidia-smi", "--query-gpu=index,mig.mode.current", "--format=csv,noheader"])
    if mig is not None and mig.returncode == 0:  # an older driver without the field: not judged
        modes = {}
        for line in mig.stdout.splitlines():
            parts = [p.strip()[:MAX_FIELD] for p in line.split(",")]
            if len(parts) == 2 and (index := small_int(parts[0], hi=4095)) is not None:
                modes[index] = parts[1]
        for g in gpus:
            g.mig = modes.get(g.index)
    header = _run(["nvidia-smi"])
    m = re.search(r"CUDA Version:\s*([0-9]{1,4}(?:\.[0-9]{1,4}){0,2})(?![0-9.])", header.stdout if header else "")
    return gpus, (m.group(1) if m else None), None


def amd_gpus() -> tuple[list[Gpu], str | None, str | None]:
    done = _run(["rocm-smi", "--showproductname", "--json"])
    if done is None:
        return [], None, "rocm-smi: not found"
    if done.returncode != 0:
        return [], None, f"rocm-smi failed: {done.last_line()}"
    try:
        doc = load_json(done.stdout, "rocm-smi")
    except BadInput:
        doc = None
    if not isinstance(doc, dict):
        return [], None, "rocm-smi printed no JSON object"
    gpus = []
    for card, info in sorted(doc.items()):
        m = re.fullmatch(r"card([0-9]{1,4})", card)
        if m and isinstance(info, dict):
            name = str(info.get("Card Series") or info.get("Card series") or info.get("Card Model") or "")[:MAX_FIELD]
            gpus.append(Gpu(int(m.group(1)), name, str(info.get("GFX Version", ""))[:MAX_FIELD], ""))
    return gpus, None, None


def _has_token(name: str, token: str) -> bool:
    return token.upper() in re.split(r"[\s_/-]+", name.upper())


def _hardware_for(name: str) -> str | None:
    return next((hw for hw, token in GPU_TOKENS.items() if _has_token(name, token)), None)


def gpu_checks(plan: LaunchPlan) -> tuple[list[Check], list[Gpu], str | None]:
    """GPU count, model and compute capability; also the GPUs selected and the driver's CUDA version."""
    hw = plan.hardware
    gpus, cuda, error = amd_gpus() if hw.vendor == "amd" else nvidia_gpus()
    tool = "rocm-smi" if hw.vendor == "amd" else "nvidia-smi"
    if error:
        fix = ("install the NVIDIA driver (nvidia-smi comes with it) and check the GPUs are visible"
               if hw.vendor == "nvidia" else "install ROCm (rocm-smi comes with it)")
        return [Check("gpus", FAIL, error, fix)], [], None
    checks = []
    want = ",".join(map(str, plan.gpus))
    by_index = {g.index: g for g in gpus}
    missing = [i for i in plan.gpus if i not in by_index]
    if missing:
        checks.append(Check("gpu count", FAIL,
                            f"recipe {plan.recipe.id} runs on {len(plan.gpus)} GPUs (--gpus {want}); {tool} shows "
                            f"{len(gpus)} ({', '.join(str(g.index) for g in gpus) or 'none'})",
                            f"run on a host with {len(plan.gpus)} {GPU_TOKENS.get(hw.name, hw.name)} GPUs, or pick "
                            f"--gpus from the indices above"))
    else:
        checks.append(Check("gpu count", OK, f"{len(plan.gpus)} GPUs for {plan.recipe.id} (--gpus {want}), "
                                             f"{len(gpus)} on this host"))
    selected = [by_index[i] for i in plan.gpus if i in by_index]
    token = GPU_TOKENS.get(hw.name, hw.name.upper())
    wrong = [g for g in selected if not _has_token(g.name, token)]
    if wrong:
        other = _hardware_for(wrong[0].name)
        checks.append(Check("gpu model", FAIL,
                            f"GPU {wrong[0].index} is {wrong[0].name}; recipe {plan.recipe.id} is for {token}",
                            f"use the recipe for this GPU: mm doctor/launch ... --hardware {other}" if other
                            else f"run on {token} GPUs"))
    elif selected:
        checks.append(Check("gpu model", OK, f"{selected[0].name} x {len(selected)}"))
    mig = [g for g in selected if g.mig == "Enabled"]
    if mig:
        # NVIDIA's MIG User Guide: with MIG mode on, CUDA sees only the GPU instances created on it, not the whole GPU,
        # and GPU instances have no peer-to-peer between them, so a TP start over whole GPUs cannot run
        checks.append(Check("mig", FAIL, f"GPU {', '.join(str(g.index) for g in mig)}: MIG mode enabled; recipe "
                                         f"{plan.recipe.id} needs whole GPUs (CUDA sees only MIG instances there)",
                            f"turn MIG off with no process on the GPU: sudo nvidia-smi -i {mig[0].index} -mig 0 "
                            f"(some GPUs apply it after a GPU reset or a reboot)"))
    elif selected and any(g.mig is not None for g in selected):
        checks.append(Check("mig", OK, "MIG mode off on the selected GPUs"))
    major = FAMILY_CC_MAJOR.get(hw.family)
    if major and selected and not wrong:
        bad_cc = [g for g in selected if g.compute_capability.split(".")[0] != major]
        if bad_cc:
            checks.append(Check("compute capability", FAIL,
                                f"GPU {bad_cc[0].index} reports compute capability {bad_cc[0].compute_capability}; "
                                f"{hw.family} recipes need {major}.x", "check the driver sees the GPUs correctly"))
        else:
            checks.append(Check("compute capability", OK, f"{selected[0].compute_capability} ({hw.family})"))
    return checks, selected, cuda


# --- docker and the image -----------------------------------------------------------------------------------

def _image_tag(plan: LaunchPlan) -> str | None:
    if plan.image_record is None:
        return None
    from .image import read_record
    return read_record(plan.image_record).tag


def docker_checks(plan: LaunchPlan) -> tuple[list[Check], str | None]:
    """Checks, and how the image was found (reference or ID) or None."""
    version, problem = docker_server()
    if problem:
        fix = "install Docker Engine" if problem == DOCKER_MISSING else "start the docker daemon (systemctl start docker)"
        return [Check("docker", FAIL, problem, fix)], None
    checks = [Check("docker", OK, f"Docker {version} answering")]
    found = None
    for ref in image_candidates(plan):  # the start script's search
        if (done := _run(["docker", "image", "inspect", "--", ref])) is not None and done.returncode == 0:
            found = ref
            how = ("by its pinned reference" if ref == plan.image else "by the image ID mm image save recorded (the "
                   f"repo digest did not survive the load): {ref}")
            checks.append(Check("image", OK, f"{plan.image} present {how}"))
            break
    if found is None:
        ident = image_identity(plan)
        tag = _image_tag(plan)
        other = _run(["docker", "image", "inspect", "--format", "{{.Id}}", "--", tag]) if tag else None
        if other is not None and other.returncode == 0:
            checks.append(Check("image", FAIL, f"wrong image: {tag} is {last_line(other.stdout)}, but the pinned image is "
                                               f"{ident}", f"docker load -i {plan.archive_hint} (the bundle proved it)"))
        else:
            checks.append(Check("image", FAIL, f"{ident} is not on this host", f"docker load -i {plan.archive_hint}"))
    if plan.hardware.vendor == "nvidia":
        checks.append(_nvidia_runtime_check(plan, found))
    return checks, found


def _docker_runtimes() -> dict:
    """The runtimes docker has registered (`docker info`), {} when its answer is no JSON object."""
    done = _run(["docker", "info", "--format", "{{json .Runtimes}}"])
    try:
        runtimes = load_json(done.stdout, "docker info") if done is not None and done.returncode == 0 else {}
    except BadInput:
        runtimes = {}
    return runtimes if isinstance(runtimes, dict) else {}


REQUIREMENT_ERROR = "nvidia-container-cli: requirement error"  # libnvidia-container's refusal of an image's NVIDIA_REQUIRE_*
REFUSED = "the NVIDIA Container Toolkit is installed and answers; it refused this image on this driver"


def _nvidia_runtime_check(plan: LaunchPlan, image: str | None) -> Check:
    fix = "install the NVIDIA Container Toolkit, then `nvidia-ctk runtime configure --runtime=docker` and restart docker"
    if image is None:
        if "nvidia" in _docker_runtimes():
            return Check("nvidia container runtime", WARN, "registered with docker, not tried (the image is missing)")
        return Check("nvidia container runtime", FAIL, "docker has no nvidia runtime registered", fix)
    done = _run(["docker", "run", "--rm", "--pull", "never", "--gpus", '"device=%s"' % ",".join(map(str, plan.gpus)),
                 "--entrypoint", "nvidia-smi", check_name(image, "image", IMAGE_REF), "--query-gpu=name",
                 "--format=csv,noheader"], timeout=120)
    if done is not None and done.returncode != 0 and REQUIREMENT_ERROR in done.stderr + done.stdout:
        # the toolkit ran and refused this image on this driver: the runtime works; the driver check owns the verdict
        return Check("nvidia container runtime", OK, f"{REFUSED}: {done.last_line()}")
    if done is None or done.returncode != 0:
        return Check("nvidia container runtime", FAIL,
                     f"a container cannot reach the GPUs: {done.last_line() if done else 'docker: not found'}", fix)
    seen = [ln for ln in done.stdout.splitlines() if ln.strip()]
    return Check("nvidia container runtime", OK, f"the image's nvidia-smi sees {len(seen)} GPU(s)")


# --- the driver, judged as the container runtime judges it -------------------------------------------------

def image_env(plan: LaunchPlan, found: str | None) -> tuple[dict[str, str] | None, str]:
    """The image's NVIDIA_*/CUDA_* environment and where it was read: the `mm image save` record, else the
    archive beside it, else `docker image inspect` of the image found on this host. (None, why) when none says."""
    from .image import config_env, read_archive, read_record

    if plan.image_record is not None:
        record = read_record(plan.image_record)
        if record.env is not None:
            return record.env, f"the image record {plan.image_record}"
        archive = Path(plan.image_record).parent / record.archive
        if archive.is_file():
            env = next((img.env for img in read_archive(archive) if img.config == record.chain.config), None)
            if env is not None:
                return env, f"the image archive {archive}"
    if found is not None:
        done = _run(["docker", "image", "inspect", "--format", "{{json .Config.Env}}", "--", found])
        if done is not None and done.returncode == 0:
            try:
                env = load_json(done.stdout, f"docker image inspect {found}")
            except BadInput:
                env = None
            if isinstance(env, list):
                return config_env({"config": {"Env": env}}), f"docker image inspect {found}"
    return None, "no mm image save record or archive says, and the image is not on this host"


def gpu_brands() -> list[str | None]:
    """Each GPU's 'Product Brand' as `nvidia-smi -q` prints it (the toolkit's brand= conditions read it)."""
    done = _run(["nvidia-smi", "-q"])
    if done is None or done.returncode != 0:
        return []
    return [m.group(1).strip() for m in re.finditer(r"^\s*Product Brand\s*:\s*(.+)$", done.stdout, re.M)]


def _requirement_verdict(reqs: list[str], gpus: list[Gpu], cuda: str | None) -> tuple[str, str | None]:
    """("ok" | "fail" | "depends", the refused requirement) for every selected GPU, as libnvidia-container
    evaluates them; "depends" when the verdict turns on which brand string the toolkit reports."""
    brands: list[str | None] = []
    if any("brand" in r.lower() for r in reqs):
        brands = gpu_brands()
    outcomes = set()
    refused = None
    for i, gpu in enumerate(gpus or [None]):
        brand = brands[i] if i < len(brands) else None
        for candidate in cudareq.brand_candidates(brand):
            host = cudareq.Host(cuda=cuda, driver=gpu.driver if gpu else None,
                                arch=gpu.compute_capability if gpu else None, brand=candidate)
            bad = None
            for req in reqs:
                try:
                    ok = cudareq.satisfied(req, host)
                except cudareq.Invalid:
                    ok = False
                if not ok:
                    bad = req
                    break
            outcomes.add(bad is None)
            refused = refused or bad
    if outcomes == {True}:
        return "ok", None
    return ("fail", refused) if outcomes == {False} else ("depends", refused)


def _runtime_note(runtime: str | None, cuda: str | None, driver: str) -> tuple[str, str | None]:
    """(status, detail) of a CUDA runtime RUNTIME on a driver that supports CUDA up to CUDA, once the container
    starts: NVIDIA's CUDA compatibility rules (docs.nvidia.com/deploy/cuda-compatibility)."""
    have, need = cudareq.major_minor(cuda), cudareq.major_minor(runtime)
    if have is None or need is None or have >= need:
        return OK, None
    minimum = cudareq.MINOR_COMPAT_MIN_DRIVER.get(need[0])
    driver_major = cudareq.major_minor(driver)
    if have[0] == need[0] and minimum is not None and driver_major is not None and driver_major[0] >= minimum:
        return WARN, (f"the image's CUDA {runtime} runtime is newer than the driver's CUDA {cuda}: CUDA minor-version "
                      f"compatibility runs a {need[0]}.x runtime on any driver >= {minimum} (NVIDIA CUDA Compatibility, "
                      f"minor version compatibility), with a limited feature set: PTX newer than the driver cannot be "
                      f"JIT-compiled by it (CUDA_ERROR_UNSUPPORTED_PTX_VERSION for kernels shipped as PTX); an image's "
                      f"cuda-compat package (forward compatibility, datacenter GPUs on LTS drivers) is the other way")
    # NVIDIA CUDA Compatibility: minor-version compatibility holds within one major version only; a newer major
    # runtime needs forward compatibility (the cuda-compat package, datacenter GPUs, given driver branches), which
    # nothing the image declares shows, so CUDA's first call fails: 'CUDA driver version is insufficient'
    return FAIL, (f"the image's CUDA {runtime} runtime is a newer major version than the driver's CUDA {cuda}: "
                  f"minor-version compatibility does not cross major versions (NVIDIA CUDA Compatibility), so the "
                  f"server fails at its first CUDA call with 'CUDA driver version is insufficient for CUDA runtime "
                  f"version' unless the image carries cuda-compat for this driver branch (forward compatibility, "
                  f"datacenter GPUs only)")


def driver_check(plan: LaunchPlan, gpus: list[Gpu], cuda: str | None, found: str | None, pin: Pin) -> Check | None:
    """Will the NVIDIA Container Toolkit start this image on this driver? Its own rule (cudareq), on the image's own
    NVIDIA_REQUIRE_CUDA; FAIL only where it refuses. The guide's CUDA 13.4 is the pinned SGLang image's runtime and
    applies to that image only; it publishes no minimum driver."""
    if plan.hardware.vendor != "nvidia" or not gpus:
        return None
    driver = gpus[0].driver
    env, source = image_env(plan, found)
    pinned = plan.image == pin.image
    upgrade = "a driver whose `nvidia-smi` shows a CUDA Version the image's runtime needs"
    if env is None:
        runtime = pin.cuda_runtime if pinned else None
        status, note = _runtime_note(runtime, cuda, driver)
        why = f"cannot read the image's NVIDIA_REQUIRE_CUDA ({source})"
        if runtime is None:
            return Check("driver", WARN, f"driver {driver} supports CUDA {cuda or '?'}; {why}, so whether the container "
                                         f"runtime starts {plan.image} is not judged", f"docker load -i {plan.archive_hint}")
        detail = f"driver {driver} supports CUDA {cuda or '?'}; the guide's pinned image carries the CUDA {runtime} runtime; {why}"
        return Check("driver", FAIL if status == FAIL else WARN, detail + (f"; {note}" if note else ""),
                     upgrade if note else f"docker load -i {plan.archive_hint}")
    try:
        reqs = cudareq.requirements(env)
    except cudareq.Invalid as e:
        return Check("driver", FAIL, f"the image's {e} (read from {source}): the NVIDIA Container Toolkit refuses it",
                     "run an image with a valid CUDA_VERSION")
    runtime = env.get(cudareq.CUDA_VERSION) or (pin.cuda_runtime if pinned else None)
    said = "; ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(cudareq.REQUIRE_PREFIX) or k == cudareq.DISABLE)
    said = said or "no NVIDIA_REQUIRE_* variable"
    verdict, refused = _requirement_verdict(reqs, gpus, cuda)
    head = f"driver {driver} (CUDA {cuda or '?'}) with {plan.image}: {said} (read from {source})"
    if verdict == "fail":
        return Check("driver", FAIL, f"{head}: the container will not start: {cudareq.refusal(refused)}",
                     f"install a driver that satisfies {refused.split(' ')[0]} (nvidia-smi's 'CUDA Version'), or run "
                     f"an image built for CUDA {cuda or 'this driver'}")
    if verdict == "depends":
        return Check("driver", WARN, f"{head}: the toolkit starts it or not depending on the brand name it reports "
                                     f"for these GPUs ({refused})", "try `docker run --rm --gpus all IMAGE true` once")
    started = ("NVIDIA_DISABLE_REQUIRE is set, so the toolkit checks nothing" if env.get(cudareq.DISABLE, "") in cudareq.TRUE
               else "the NVIDIA Container Toolkit's requirement holds")
    status, note = _runtime_note(runtime, cuda, driver)
    if status == FAIL:
        return Check("driver", FAIL, f"{head}: the container starts ({started}); {note}", upgrade)
    if status == WARN:
        return Check("driver", WARN, f"{head}: the container starts ({started}); {note}", upgrade)
    return Check("driver", OK, f"{head}: the container starts ({started})")


# --- host ------------------------------------------------------------------------------------------------

def port_checks(ports: list[tuple[str, int]], expose: bool) -> list[Check]:
    """Each (what, port) the start binds: the router or single server on 0.0.0.0 with --expose, else 127.0.0.1."""
    checks = []
    for what, port in ports:
        host = "0.0.0.0" if expose and what in ("port", "router port") else "127.0.0.1"
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as e:
                checks.append(Check(what, FAIL, f"{host}:{port} is in use ({e.strerror})",
                                    "stop what listens there, or pass another port to mm launch (and mm doctor): "
                                    "--port, --replica-ports, --metrics-port"))
                continue
        checks.append(Check(what, OK, f"{host}:{port} is free"))
    return checks


def shm_check(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("/dev/shm", FAIL, f"{path}: {e.strerror}", "mount a tmpfs on /dev/shm")
    size = st.f_blocks * st.f_frsize
    if size < SHM_GUIDE:
        return Check("/dev/shm", WARN, f"{human_bytes(size)}; the guide runs with --shm-size 32g and --ipc=host, so the "
                                       f"server gets the host's /dev/shm",
                     "mount -o remount,size=32G /dev/shm (the guide's --shm-size 32g; with --ipc=host the server "
                     "uses the host's /dev/shm)")
    return Check("/dev/shm", OK, f"{human_bytes(size)} (the guide's --shm-size 32g)")


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and (kib := small_int(parts[0])) is not None:
                out[key] = kib * 1024
    except OSError:
        pass
    return out


def memory_check(plan: LaunchPlan, replicas: int) -> Check:
    """Host memory for HiCache: the node's total as launch states it (hicache_host_gb: per rank x ranks x
    replicas), judged by diagnose.hicache_fits against MemTotal."""
    from .diagnose import hicache_fits

    mem = meminfo()
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    if "--enable-hierarchical-cache" not in [str(t) for t in plan.engine_argv]:
        return Check("host memory", OK, f"{human_bytes(total)} ({human_bytes(avail)} available); no HiCache in this recipe")
    need = hicache_host_gb(plan, replicas)
    if need is None:
        fact = next((f for f in plan.recipe.facts if "memory" in f.lower()), "size host memory before enabling HiCache")
        return Check("host memory", WARN, f"HiCache at its default ratio ({fact}); {human_bytes(avail)} available of "
                                          f"{human_bytes(total)}", "compare with the recipe's figure before starting")
    short = hicache_fits(plan, replicas, total / 1e9 if total else None)
    if short:
        return Check("host memory", FAIL, short, "add host memory, fewer replicas, or a recipe without HiCache "
                                                 "(e.g. --recipe low-latency)")
    return Check("host memory", OK, f"HiCache {need:,.0f} GB for {replicas} replica(s) (--hicache-size is per rank) "
                                    f"fits in {human_bytes(total)} ({human_bytes(avail)} available now)")


def disk_check(plan: LaunchPlan) -> Check:
    root = plan.cache_root
    if root is None:
        return Check("cache disk", OK, "this recipe mounts no kernel caches")
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < CACHE_DISK_MARGIN:
        return Check("cache disk", WARN, f"{human_bytes(free)} free for the kernel caches under {root} (mm keeps a "
                                         f"{human_bytes(CACHE_DISK_MARGIN)} margin; the guide publishes no figure)",
                     "free space there, or pass --cache-root on a larger disk")
    return Check("cache disk", OK, f"{human_bytes(free)} free for the kernel caches under {root}")


def cache_key_check(plan: LaunchPlan, gpus: list[Gpu], findings: dict) -> Check:
    if plan.cache_root is None:
        return Check("kernel cache key", OK, "this recipe mounts no kernel caches")
    path = Path(plan.cache_root) / CACHE_KEY_FILE
    slow = "the first start compiles every kernel (long; `mm warmup` does it ahead of traffic)"
    cold = findings.get("kernel_cache_warm")
    if cold is not None:  # the troubleshooting table's row, with its fix for this plan
        return Check("kernel cache key", WARN, f"{cold.line} (row {cold.guide_row}: {cold.cause})", cold.fix)
    if not path.is_file():
        return Check("kernel cache key", WARN, f"no {path}: {slow}", f"mm warmup ... --cache-root {plan.cache_root}")
    try:
        key = read_json_file(path, what="cache key")
        if not isinstance(key, dict):
            raise BadInput(f"{path}: not an object")
    except BadInput:
        return Check("kernel cache key", WARN, f"{path}: unreadable: {slow}", f"mm warmup ... --cache-root {plan.cache_root}")
    here = {"image": plan.image, "recipe": plan.recipe.id}
    if gpus:
        here.update(gpu=gpus[0].name, compute_capability=gpus[0].compute_capability, driver=gpus[0].driver)
    stale = [f"{k} {key.get(k)!r} (this host: {v!r})" for k, v in here.items() if str(key.get(k)) != str(v)]
    if stale:
        return Check("kernel cache key", WARN, f"caches built for another {', '.join(stale)}: {slow}",
                     f"mm warmup ... --cache-root {plan.cache_root}")
    return Check("kernel cache key", OK, f"caches match this GPU, driver {here.get('driver', '?')}, image and recipe")


# --- the model ----------------------------------------------------------------------------------------------

def model_checks(plan: LaunchPlan, findings: dict) -> list[Check]:
    """The model: the troubleshooting table's model_dir_complete check, which is `mm launch`'s own
    (launch.check_model_dir: manifest, the recipe's repository, the draft subfolder where the recipe uses it,
    quick verify)."""
    incomplete = findings.get("model_dir_complete")
    if incomplete is not None:
        return [Check("model", FAIL, incomplete.line, incomplete.fix)]
    return [Check("model", OK, f"{plan.model_dir}: the model mm launch would start (manifest, "
                               f"{plan.repo_id}{', draft' if plan.uses_dspark else ''}, quick verify)")]


def run_doctor(model_dir: Path, opts: LaunchOptions, pin: Pin) -> DoctorReport:
    from .diagnose import host_findings
    from .router import plan_node

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a directory")
    node = plan_node(model_dir, opts, check_dir=False)  # the model's state is a check of its own here
    plan = node.first
    every_gpu = dataclasses.replace(plan, gpus=tuple(g for p in node.replicas for g in p.gpus))
    report = DoctorReport(str(plan.model_dir), plan.recipe.id, plan.image)
    gchecks, gpus, cuda = gpu_checks(every_gpu)
    report.checks += gchecks
    gpu_info = "\n".join(f"{g.name}, {g.compute_capability}, {g.driver}" for g in gpus) or None
    findings = {f.where: f for f in host_findings(plan, gpu_info)}
    family = findings.get("gpu_family")
    if family is not None:
        report.checks.append(Check("gpu family", FAIL, f"{family.line}: {family.cause}", family.fix))
    dchecks, found = docker_checks(every_gpu)
    report.checks += dchecks
    driver = driver_check(plan, gpus, cuda, found, pin)
    refused = next((c for c in dchecks if c.detail.startswith(REFUSED)), None)
    if refused is not None and (driver is None or driver.status != FAIL):
        driver = Check("driver", FAIL, f"the container will not start: {refused.detail[len(REFUSED) + 2:]}",
                       "install a driver whose `nvidia-smi` CUDA Version satisfies the image's NVIDIA_REQUIRE_CUDA")
    if driver is not None:
        report.checks.append(driver)
    if node.router is None:
        ports = [("port", plan.port)]
    else:
        ports = ([("router port", node.router.port)] + [(f"replica {i} port", p.port) for i, p in enumerate(node.replicas)]
                 + [("router metrics port", node.router.metrics_port)])
    report.checks += port_checks(ports, plan.expose or bool(node.router and node.router.expose))
    report.checks += [shm_check(), memory_check(plan, len(node.replicas)), disk_check(plan),
                      cache_key_check(plan, gpus, findings)]
    report.checks += model_checks(plan, findings)
    return report
