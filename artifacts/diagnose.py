"""The guide's troubleshooting table as a diagnosis: rows in manifests/<pin>.troubleshooting.json, matched here.

Each row is the guide's (symptom, most likely cause, shortest fix) plus how to see it: detectors on a server
log or an HTTP exchange (regular expressions), on the container (`docker inspect` mounts) or on the host
(named checks, which `mm doctor` can run through `host_findings`). A row matches at most once, on its
first detector that fires, and reports the line that matched. When the launch plan is known, the fix is
adapted to it (the cache paths, flags and ports mm uses); otherwise it is the guide's text.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from .errors import BadInput
from .cachekey import FILE_NAME as CACHE_KEY_FILE
from .launch import LaunchPlan, _pairs
from .pins import Pin, default_pin, manifests_dir
from .tools import ToolMissing, check_name, run_tool, stream_tool
from .untrusted import At, Malformed, load_json, read_json_file, small_int

SCHEMA = "mm-troubleshooting/1"
SOURCES = ("log", "http", "container", "host")
MAX_LINE = 400  # a matched line is quoted up to this many characters


@dataclass(frozen=True)
class Detector:
    source: str
    pattern: re.Pattern | None = None
    unless: re.Pattern | None = None  # the row does not match when this is anywhere in the text
    also: re.Pattern | None = None  # ... and matches only when this is somewhere too
    requires: str | None = None  # a property of the recipe: expects_qmul4, blackwell
    missing_mount: str | None = None
    check: str | None = None
    pattern_source: str = ""


@dataclass(frozen=True)
class Row:
    id: str
    guide_row: int
    guide: str
    symptom: str
    cause: str
    fix: str
    fix_here: str | None
    change: dict
    detect: tuple[Detector, ...]


@dataclass(frozen=True)
class Table:
    path: Path
    rows: tuple[Row, ...]

    def row(self, row_id: str) -> Row:
        return next(r for r in self.rows if r.id == row_id)


@dataclass(frozen=True)
class Finding:
    row: str
    guide_row: int
    symptom: str
    cause: str
    fix: str
    change: dict
    source: str  # log | http | container | host
    where: str  # the file, container or check it was seen in
    line: str  # the line (or fact) that matched
    line_number: int | None
    guide: str


@dataclass(frozen=True)
class Diagnosis:
    inputs: tuple[str, ...]
    recipe: str | None
    findings: tuple[Finding, ...] = field(default=())
    lines_read: int = 0
    table: str = ""

    @property
    def ok(self) -> bool:
        return not self.findings


# --- the table -------------------------------------------------------------------------------

def table_path(pin: Pin | None = None) -> Path:
    pin = pin or default_pin()
    return manifests_dir() / (pin.troubleshooting or f"{pin.name}.troubleshooting.json")


def _regex(value: str | None, where: str) -> re.Pattern | None:
    if value is None:
        return None
    try:
        return re.compile(value)
    except re.error as e:
        raise BadInput(f"{where}: bad pattern {value!r}: {e}") from None


MAX_TABLE_BYTES = 4 * 1024 * 1024
MAX_PATTERN = 2000
# the placeholders a row's fix_here may name (plan_context's keys): any other would fail when the fix is shown
FIX_FIELDS = frozenset({"recipe", "hardware", "model_dir", "revision", "pinned_revision", "image", "pinned_image",
                        "cache_root", "minfer_mount", "minfer_host", "mem_fraction_static", "chunked_prefill_size",
                        "gpu_count", "gpus", "port", "container"})


def _fix_template(value: str | None, at: At) -> str | None:
    import string

    if value is None:
        return None
    try:
        fields = [f for _, f, spec, conv in string.Formatter().parse(value) if f is not None]
    except ValueError as e:
        raise at.fail(f"not a fix template ({e})") from None
    for f in fields:
        if f not in FIX_FIELDS:
            raise at.fail(f"unknown placeholder {{{f[:40]}}} (known: {', '.join(sorted(FIX_FIELDS))})")
    return value


def load_table(path: Path | None = None) -> Table:
    """The troubleshooting table (hostile until parsed, like every file mm reads): typed rows, compiled patterns."""
    path = Path(path or table_path())
    doc = read_json_file(path, what="troubleshooting table", max_bytes=MAX_TABLE_BYTES)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise BadInput(f"{path}: not a troubleshooting table (expected schema {SCHEMA!r})")
    at = At(str(path))
    rows = []
    for n, r in enumerate(at.get_list(doc, "rows")):
        r_at = at.key("rows").index(n)
        r_at.obj(r)
        row_id = r_at.get_str(r, "id", max_len=128, empty=False)
        where = f"{path}: row {row_id!r}"
        detectors = []
        for j, d in enumerate(r_at.get_list(r, "detect")):
            d_at = r_at.key("detect").index(j)
            d_at.obj(d)
            source = d_at.get_str(d, "source", max_len=32)
            pattern_source = d_at.get_str(d, "pattern_source", "", max_len=MAX_PATTERN)
            if source not in SOURCES or not pattern_source:
                raise BadInput(f"{where}: every detector needs a source ({', '.join(SOURCES)}) and a pattern_source")
            check = d_at.get_str(d, "check", None, max_len=64)
            if source == "host" and check not in HOST_CHECKS:
                raise BadInput(f"{where}: unknown host check {check!r}")
            patterns = {k: _regex(d_at.get_str(d, k, None, max_len=MAX_PATTERN), where) for k in ("pattern", "unless", "also")}
            detectors.append(Detector(
                source=source, **patterns, requires=d_at.get_str(d, "requires", None, max_len=64),
                missing_mount=d_at.get_str(d, "missing_mount", None, max_len=4096), check=check,
                pattern_source=pattern_source))
        guide = r_at.get_obj(r, "guide")
        g_at = r_at.key("guide")
        rows.append(Row(id=row_id, guide_row=g_at.key("value").get_int(g_at.get_obj(guide, "value"), "row", hi=10_000),
                        guide=g_at.get_str(guide, "source", max_len=4096), symptom=r_at.get_str(r, "symptom"),
                        cause=r_at.get_str(r, "cause"), fix=r_at.get_str(r, "fix"),
                        fix_here=_fix_template(r_at.get_str(r, "fix_here", None), r_at.key("fix_here")),
                        change=dict(r_at.get_obj(r, "change")), detect=tuple(detectors)))
    return Table(path=path, rows=tuple(rows))


# --- adapting a fix to the plan --------------------------------------------------------------

def plan_context(plan: LaunchPlan) -> dict[str, str]:
    args = dict(_pairs(plan.engine_argv))
    minfer = next((m for m in plan.mounts if m.container == "/root/.cache/minfer"), None)
    pin = default_pin()
    return {
        "recipe": plan.recipe.id, "hardware": plan.hardware.name, "model_dir": str(plan.model_dir),
        "revision": plan.revision, "pinned_revision": pin.revision or "", "image": plan.image,
        "pinned_image": pin.image or "", "cache_root": str(plan.cache_root or "(no kernel caches for this recipe)"),
        "minfer_mount": minfer.spec() if minfer else "~/.cache/minfer:/root/.cache/minfer",
        "minfer_host": str(minfer.host) if minfer else "~/.cache/minfer",
        "mem_fraction_static": args.get("--mem-fraction-static") or "SGLang's default",
        "chunked_prefill_size": args.get("--chunked-prefill-size") or "SGLang's default",
        "gpu_count": str(len(plan.gpus)), "gpus": ",".join(map(str, plan.gpus)), "port": str(plan.port),
        "container": plan.name,
    }


def _fix(row: Row, plan: LaunchPlan | None) -> str:
    if plan is None or not row.fix_here:
        return row.fix
    return row.fix_here.format_map(plan_context(plan))


def _applies(d: Detector, plan: LaunchPlan | None) -> bool:
    """Recipe-specific detectors run only when the plan says they apply (or, for families, when it is unknown)."""
    if d.requires == "expects_qmul4":
        return plan is not None and plan.recipe.expects_qmul4
    if d.requires == "blackwell":
        return plan is None or plan.hardware.family == "blackwell"
    return True


def _finding(row: Row, plan: LaunchPlan | None, source: str, where: str, line: str, number: int | None) -> Finding:
    line = line.strip()
    return Finding(row=row.id, guide_row=row.guide_row, symptom=row.symptom, cause=row.cause, fix=_fix(row, plan),
                   change=row.change, source=source, where=where,
                   line=line if len(line) <= MAX_LINE else line[:MAX_LINE] + "...", line_number=number, guide=row.guide)


# --- text: server logs and HTTP exchanges ----------------------------------------------------

MAX_LOG_LINE = 64 * 1024  # bytes of one log line that are matched; the rest of a longer line is skipped
READ_CHUNK = 1024 * 1024


_LINE_END = re.compile(rb"\r\n?|\n")


def iter_lines(stream: BinaryIO, max_line: int = MAX_LOG_LINE) -> Iterator[str]:
    """The lines of a byte stream (ended by \\n, \\r\\n or a lone \\r, as a progress bar writes), read in chunks,
    each cut to MAX_LINE bytes and decoded (bad UTF-8 replaced): memory stays within a chunk and a line whatever
    the stream holds (a multi-GB log, a line with no end)."""
    line = bytearray()
    full = False  # this line already holds max_line bytes: skip to its end
    after_cr = False  # the last chunk ended a line with \r: a \n first in this one belongs to it
    while chunk := stream.read(READ_CHUNK):
        start = 1 if after_cr and chunk[:1] == b"\n" else 0
        after_cr = False
        while True:
            m = _LINE_END.search(chunk, start)
            end = len(chunk) if m is None else m.start()
            if not full:
                room = max_line - len(line)
                line += chunk[start:min(end, start + room)]
                full = end - start > room
            if m is None:
                break
            yield line.decode("utf-8", "replace")
            line, full, start = bytearray(), False, m.end()
            after_cr = m.group() == b"\r" and start == len(chunk)
    if line or full:
        yield line.decode("utf-8", "replace")


@dataclass
class ScannedText:
    """One text (a log, an HTTP answer) read once, line by line: for every text detector of the table its first
    matching line and whether its `unless` / `also` patterns were seen anywhere; the line count, the last TAIL
    lines and the lines that match KEEP (the first MAX_KEPT). Nothing else of the text is held."""
    where: str
    lines: int = 0
    hits: dict = field(default_factory=dict)  # (row id, detector index) -> (line, number)
    unless_seen: set = field(default_factory=set)
    also_seen: set = field(default_factory=set)
    tail: deque = field(default_factory=deque)
    kept: list = field(default_factory=list)


MAX_KEPT = 256


def scan_text(where: str, lines: Iterable[str], table: Table, *, tail: int = 0,
              keep: re.Pattern | None = None) -> ScannedText:
    detectors = [((row.id, j), d) for row in table.rows for j, d in enumerate(row.detect)
                 if d.source in ("log", "http") and d.pattern is not None]
    scan = ScannedText(where=where, tail=deque(maxlen=tail))
    for number, line in enumerate(lines, 1):
        scan.lines = number
        for key, d in detectors:
            if key not in scan.hits and d.pattern.search(line):
                scan.hits[key] = (line, number)
            if d.unless is not None and key not in scan.unless_seen and d.unless.search(line):
                scan.unless_seen.add(key)
            if d.also is not None and key not in scan.also_seen and d.also.search(line):
                scan.also_seen.add(key)
        if tail:
            scan.tail.append(line)
        if keep is not None and len(scan.kept) < MAX_KEPT and keep.search(line):
            scan.kept.append(line)
    return scan


def _match_text(key: tuple[str, int], d: Detector, scan: ScannedText) -> tuple[str, int] | None:
    if d.pattern is None or key in scan.unless_seen or (d.also is not None and key not in scan.also_seen):
        return None
    return scan.hits.get(key)


def diagnose(texts: Iterable[tuple[str, str] | ScannedText] = (), *, plan: LaunchPlan | None = None,
             table: Table | None = None, mounts: tuple[str, list[dict]] | None = None, host: bool = False,
             gpu_info: str | None = None) -> Diagnosis:
    """Match the table against TEXTS ((where, text): logs, HTTP answers; or texts already read by `scan_text`
    with the same table), a container's MOUNTS ((name, docker inspect .Mounts)) and, with HOST, the host checks.
    Every text detector reads every text: a log may hold a request dump, a saved exchange may hold a log line."""
    table = table or load_table()
    scans = [t if isinstance(t, ScannedText) else scan_text(t[0], t[1].splitlines(), table) for t in texts]
    findings: list[Finding] = []
    for row in table.rows:
        found = None
        for j, d in enumerate(row.detect):
            if not _applies(d, plan):
                continue
            if d.source in ("log", "http"):
                for scan in scans:
                    hit = _match_text((row.id, j), d, scan)
                    if hit:
                        found = _finding(row, plan, d.source, scan.where, hit[0], hit[1])
                        break
            elif d.source == "container" and mounts is not None:
                name, items = mounts
                if d.missing_mount and not any(m.get("Destination") == d.missing_mount for m in items):
                    found = _finding(row, plan, "container", name, f"no mount at {d.missing_mount} "
                                     f"(mounts: {', '.join(sorted(str(m.get('Destination')) for m in items)) or 'none'})", None)
            elif d.source == "host" and host and plan is not None:
                fact = HOST_CHECKS[d.check](plan, gpu_info)
                if fact:
                    found = _finding(row, plan, "host", d.check, fact, None)
            if found:
                findings.append(found)
                break
    return Diagnosis(inputs=tuple(s.where for s in scans) + ((mounts[0],) if mounts else ()) + (("host",) if host else ()),
                     recipe=plan.recipe.id if plan else None, findings=tuple(findings),
                     lines_read=sum(s.lines for s in scans), table=str(table.path))


def scan_log(path: Path, table: Table) -> ScannedText:
    """A log file (or saved answer), read streaming: see `iter_lines`."""
    try:
        with open(path, "rb") as f:
            return scan_text(str(path), iter_lines(f), table)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None


def scan_docker_logs(name: str, table: Table, *, docker: str = "docker", tail: int = 0, keep: re.Pattern | None = None,
                     timeout: float = 120, check: bool = True) -> ScannedText:
    """`docker logs NAME` (stdout and stderr, as docker interleaves them) read streaming, like a log file, within
    TIMEOUT (tools.stream_tool: the process group is killed then, or when docker exits and a child of it still
    holds the pipe). With CHECK, docker failing (no such container) is an error; without, what it wrote is the log."""
    check_name(name, "--container")
    try:
        with stream_tool([docker, "logs", "--", name], timeout=timeout) as proc:
            scan = scan_text(f"docker logs {name}", iter_lines(proc.stdout), table, tail=max(tail, 1), keep=keep)
    except ToolMissing:
        raise BadInput("docker: not found on PATH (mm reads `docker logs`)") from None
    if proc.stopped:
        raise BadInput(f"docker logs {name}: {proc.stopped}")
    if check and proc.returncode != 0:
        last = next((line for line in reversed(scan.tail) if line.strip()), "(no output)")
        raise BadInput(f"--container {name}: docker logs failed: {last.strip()}")
    if not tail:
        scan.tail.clear()
    return scan


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


# --- host checks (for `mm doctor`) -----------------------------------------------------------

def _kernel_cache_warm(plan: LaunchPlan, gpu_info: str | None) -> str | None:
    if plan.cache_root is None:
        return None
    key = plan.cache_root / CACHE_KEY_FILE
    if key.is_file():
        return None
    return f"{key}: missing, so the next start compiles every kernel (run `mm warmup` with the same recipe)"


def _gpu_family(plan: LaunchPlan, gpu_info: str | None) -> str | None:
    if not gpu_info or plan.hardware.vendor != "nvidia" or not plan.uses_dspark:
        return None
    for line in gpu_info.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and (major := small_int(parts[1].split(".")[0], hi=999)) is not None and major < 10:
            return f"GPU {parts[0]} (compute {parts[1]}) with DSpark recipe {plan.recipe.id}"
    return None


def _model_dir_complete(plan: LaunchPlan, gpu_info: str | None) -> str | None:
    from .manifest import manifest_path, read_manifest
    from .verify import verify_dir

    mpath = manifest_path(plan.model_dir)
    if not mpath.is_file():
        return f"{mpath}: no manifest, so the weights cannot be checked"
    report = verify_dir(plan.model_dir, read_manifest(mpath), quick=True)
    if report.ok:
        return None
    first = report.problems[0]
    return f"quick verify: {len(report.problems)} problem(s), first {first.path}: {first.kind} ({first.detail})"


HOST_CHECKS: dict[str, Callable[[LaunchPlan, str | None], str | None]] = {
    "kernel_cache_warm": _kernel_cache_warm,
    "gpu_family": _gpu_family,
    "model_dir_complete": _model_dir_complete,
}


def host_findings(plan: LaunchPlan, gpu_info: str | None = None, table: Table | None = None) -> tuple[Finding, ...]:
    """The host-check rows for PLAN on this host (what `mm doctor` runs). GPU_INFO: nvidia-smi
    `--query-gpu=name,compute_cap,driver_version --format=csv,noheader` output, when known."""
    return diagnose(plan=plan, table=table, host=True, gpu_info=gpu_info).findings


def hicache_fits(plan: LaunchPlan, replicas: int, mem_total_gb: float | None = None) -> str | None:
    """None when the HiCache pools of REPLICAS servers fit host memory (MemTotal), else why not."""
    from .launch import hicache_host_gb

    need = hicache_host_gb(plan, replicas)
    if need is None:
        return None
    if mem_total_gb is None:
        mem_total_gb = _mem_total_gb()
    if mem_total_gb is None or need < mem_total_gb:
        return None
    return (f"HiCache needs {need:,.0f} GB of host memory ({replicas} replica(s) of {plan.recipe.id}; --hicache-size is "
            f"per rank) but this host has {mem_total_gb:,.0f} GB")


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None

# --- one request, as the CLI gives it --------------------------------------------------------

@dataclass(frozen=True)
class DiagnoseRequest:
    logfile: Path | None = None
    container: str | None = None
    answers: tuple[Path, ...] = ()
    model_dir: Path | None = None
    launch: object | None = None  # LaunchOptions: the recipe the fixes are adapted to (with model_dir)
    host_checks: bool = False
    gpu_info: str | None = None


def run_diagnosis(req: DiagnoseRequest) -> Diagnosis:
    if not (req.logfile or req.container or req.answers or req.host_checks):
        raise BadInput("diagnose: give a LOGFILE, --container NAME, --answer FILE or --host-checks")
    if req.logfile and req.container:
        raise BadInput("diagnose: give a LOGFILE or --container NAME, not both")
    plan = None
    if req.model_dir is not None:
        if req.launch is None:
            raise BadInput("--model-dir: give --hardware too, so that mm knows the recipe")
        from .router import plan_node
        plan = plan_node(req.model_dir, req.launch, check_dir=False).first
    elif req.host_checks:
        raise BadInput("--host-checks: give --model-dir and --hardware (the checks are about that recipe on this host)")
    table = load_table()
    texts = []
    if req.logfile:
        texts.append(scan_log(req.logfile, table))
    mounts = None
    if req.container:
        texts.append(scan_docker_logs(req.container, table))
        mounts = (req.container, container_mounts(req.container))
    texts += [scan_log(a, table) for a in req.answers]
    return diagnose(texts, plan=plan, table=table, mounts=mounts, host=req.host_checks, gpu_info=req.gpu_info)
