"""docker, the one owner of its words and its questions: what mm says when docker is missing or its daemon is down
(doctor, warm-up, the start script and `mm gc` say it in the same words), whether the daemon answers, which
containers run and what they mount, and the host path a start script mounts for a model directory.

Every call goes through tools.run_tool (bounded in bytes and time, its own process group); every answer is read
as hostile JSON (untrusted.load_json)."""
from __future__ import annotations

import calendar
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, Refused
from ..edges.tools import ToolMissing, argv_batches, check_name, last_line, run_tool
from ..edges.untrusted import Malformed, load_json
from ..paths import POINTER, is_pointer

DOCKER_MISSING = "docker: not found on PATH (install Docker Engine and the NVIDIA Container Toolkit)"
DOCKER_DOWN = "the docker daemon is not answering; start it (systemctl start docker) and make sure this user may use it"
DOCKER_TIMEOUT = 60  # seconds for `docker ps` / `docker inspect` (mm's own margin)
MAX_DOCKER_ANSWER = 64 * 1024 * 1024  # `docker ps -q`: a million container ids of 65 bytes (mm's own margin)
INSPECT_BATCH = 256  # containers per `docker inspect` (mm's own margin: an answer of a few KiB each)
INSPECT_ANSWER = 16 * 1024 * 1024  # bytes of one such answer, 64 KiB a container: parsed, it stays within the memory bound


def as_mounted(path: Path) -> Path:
    """The host path a start script mounts for the model directory PATH: a store's `current` pointer as a pointer
    (in its repo's physical directory, not resolved), so that `mm use` decides what the next start serves; any
    other path resolved."""
    path = Path(path)
    return Path(os.path.realpath(path.parent)) / POINTER if is_pointer(path) else path.resolve()


# --- is docker there -------------------------------------------------------------------------------------------

def docker_server(docker: str = "docker") -> tuple[str | None, str | None]:
    """(the daemon's version, None), or (None, why docker cannot start a container here: not installed, daemon not
    answering). `docker version` asks the daemon and exits non-zero when none answers; Debian's 20.10 `docker info`
    exits 0 then (with ServerErrors), so it is no probe. Doctor, warm-up and the start script say it in the same
    words."""
    if shutil.which(docker) is None:
        return None, DOCKER_MISSING
    try:
        done = run_tool([docker, "version", "--format", "{{.Server.Version}}"], timeout=60)
    except ToolMissing:  # gone between which() and the call
        done = None
    version = last_line(done.stdout) if done is not None and done.returncode == 0 else ""
    if not version:
        return None, f"{DOCKER_DOWN} ({done.last_line() if done else 'no output'})"
    return version, None


def docker_problem(docker: str = "docker") -> str | None:
    return docker_server(docker)[1]


# --- who mounts what ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Container:
    name: str
    started: float | None  # epoch seconds, None when docker did not say
    sources: tuple[str, ...]  # host paths it mounts


def running_containers(docker: str = "docker") -> tuple[list[Container], str | None]:
    """The running containers and their mounts, from `docker ps` and `docker inspect`: (containers, note).
    No docker on PATH: none, with a note. Docker present but not answering: Refused (exit 7), since then no one
    can tell which revisions are in use."""
    ids = _docker([docker, "ps", "--quiet", "--no-trunc"], "docker ps")
    if ids is None:
        return [], "docker not found on PATH: no container checked"
    names = [line.strip() for line in ids.splitlines() if line.strip()]
    if not names:
        return [], None
    out: list[Container] = []
    for argv in argv_batches([docker, "inspect", "--"], names, max_operands=INSPECT_BATCH):
        out += _inspected(_docker(argv, "docker inspect", INSPECT_ANSWER))
    return out, None


def _inspected(answer: str | None) -> list[Container]:
    """The running containers of one `docker inspect` answer."""
    try:
        doc = load_json(answer or "[]", "docker inspect", max_bytes=INSPECT_ANSWER)
    except Malformed as e:
        raise Refused(f"docker inspect: an answer mm cannot read ({e.detail}); cannot tell which revisions running "
                      f"containers mount") from None
    out = []
    for item in doc if isinstance(doc, list) else []:
        if not isinstance(item, dict):
            continue
        state = item.get("State") if isinstance(item.get("State"), dict) else {}
        if state.get("Running") is False:
            continue
        mounts = item.get("Mounts") if isinstance(item.get("Mounts"), list) else []
        sources = tuple(m["Source"] for m in mounts if isinstance(m, dict) and isinstance(m.get("Source"), str))
        name = item.get("Name") if isinstance(item.get("Name"), str) else str(item.get("Id", "?"))[:12]
        out.append(Container(name.lstrip("/")[:256], _epoch(state.get("StartedAt")), sources))
    return out


def _docker(argv: list[str], what: str, max_output: int = MAX_DOCKER_ANSWER) -> str | None:
    """The tool's stdout (tools.run_tool: bounded, its own process group); None when docker is not installed."""
    try:
        done = run_tool(argv, timeout=DOCKER_TIMEOUT, max_output=max_output)
    except ToolMissing:
        return None
    if not done.ok:
        raise Refused(f"{what}: {DOCKER_DOWN} ({done.last_line()}); mm cannot tell which revisions running containers "
                      f"mount, so nothing is removed")
    return done.stdout


def _epoch(text: object) -> float | None:
    """docker's RFC 3339 time (2026-01-01T10:00:00.123456789Z) in epoch seconds."""
    if not isinstance(text, str):
        return None
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text.strip())
    if not m or text.startswith("0001-"):
        return None
    try:  # the pattern lets 9999-99-99T99:99:99 through: the calendar decides
        base = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + float(m.group(2) or 0)
    except (ValueError, OverflowError):
        return None
    if m.group(3) != "Z":
        sign = 1 if m.group(3)[0] == "+" else -1
        base -= sign * (int(m.group(3)[1:3]) * 3600 + int(m.group(3)[4:6]) * 60)
    return base


def container_mounts(name: str, docker: str = "docker") -> list[dict]:
    """The container's mounts from `docker inspect` (read like any other answer: within limits, objects only)."""
    check_name(name, "--container")
    try:
        inspect = run_tool([docker, "inspect", "-f", "{{json .Mounts}}", "--", name], timeout=60)
    except ToolMissing:
        raise BadInput("docker: not found on PATH (--container reads `docker logs`)") from None
    if inspect.stopped:
        raise BadInput(f"--container {name}: docker inspect: {inspect.stopped}")
    try:
        mounts = load_json(inspect.stdout, f"docker inspect {name}") if inspect.returncode == 0 else []
    except Malformed:
        mounts = []
    return [m for m in mounts if isinstance(m, dict)] if isinstance(mounts, list) else []
