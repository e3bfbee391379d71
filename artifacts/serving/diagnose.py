"""The guide's troubleshooting table as a diagnosis: rows in manifests/<pin>.troubleshooting.json, matched here.

Each row is the guide's (symptom, most likely cause, shortest fix) plus how to see it: detectors on a server
log or an HTTP exchange (regular expressions), on the container (`docker inspect` mounts) or on the host
(named checks, which `mm doctor` can run through `host_findings`). A row matches at most once, on its
first detector that fires, and reports the line that matched. When the launch plan is known, the fix is
adapted to it (the cache paths, flags and ports mm uses); otherwise it is the guide's text.
"""
from __future__ import annotations

import datetime
import itertools
import json
import re
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from ..errors import BadInput
from ..edges.fsutil import open_local_file, read_json_file
from .cachekey import FILE_NAME as CACHE_KEY_FILE
from .launch import LaunchPlan, _pairs
from ..pins import Pin, default_pin, manifests_dir
from ..edges.tools import ToolMissing, check_name, stream_tool
from ..edges.untrusted import At, Malformed, load_json, printable, small_int

SCHEMA = "mm-troubleshooting/1"
SOURCES = ("log", "http", "container", "host")
MAX_LINE = 400  # a matched line is quoted up to this many characters


@dataclass(frozen=True)
class Detector:
    source: str
    pattern: re.Pattern | None = None
    unless: re.Pattern | None = None  # a line matching this voids the pattern's later lines (not earlier ones)
    also: re.Pattern | None = None  # ... and matches only when this is somewhere too
    after: re.Pattern | None = None  # the pattern counts only on lines after one that matches this (a ready line)
    again_after: re.Pattern | None = None  # the pattern counts only for a value (its group 1) it already matched
    # before a line matching this (a later start of the server: what it compiled then was not kept)
    cleared_by: re.Pattern | None = None  # a later line matching this voids an earlier hit (the server recovered)
    # cleared_by voids only a hit from before its first match (a failure while starting that the start got past); a
    # hit after it (the server was up) is a failure while serving, and a later match is the next start, no recovery
    cleared_while_starting: bool = False
    near: re.Pattern | None = None  # the pattern counts only within `within` lines after a line matching this (or on it)
    within: int | None = None
    min_seconds: float | None = None  # the pattern's group `seconds` (a duration the line states) must reach this
    requires: str | None = None  # a property of the recipe: expects_qmul4, blackwell; plan: a launch plan is given
    engine: str | None = None  # sglang | vllm: the detector applies to that engine only
    field: str | None = None  # error | content: the pattern judges that field of a JSON answer, not text
    body: str | None = None  # a named check on a JSON request or answer body (BODY_CHECKS)
    payload: bool = False  # the pattern is tried on request/response log lines only (PAYLOAD), their strings masked
    fallback: bool = False  # a symptom whose cause another row may name: reported only when no other row matches
    missing_mount: str | None = None
    fix: str | None = None  # this message's own fix, where it says more than the row's (a full disk, the GPU)
    fix_here: str | None = None  # ... adapted to the plan
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
    fix_vllm: str | None = None  # the guide's vLLM row, where it differs
    fix_here_vllm: str | None = None
    fix_here_hardware: dict = field(default_factory=dict)  # hardware name -> fix_here (the guide's B200 advice)
    fix_here_pinned_image: str | None = None  # when the start already runs the pinned image (its other fix)
    fix_log: str | None = None  # when the log shows the server's own values of the flags the fix names (LOG_FIELDS)


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
    pattern_source: str = ""  # where the matched message comes from


@dataclass(frozen=True)
class Diagnosis:
    inputs: tuple[str, ...]
    recipe: str | None
    findings: tuple[Finding, ...] = field(default=())
    lines_read: int = 0
    table: str = ""
    engine: str = "sglang"
    engine_from: str = "default"  # --engine | plan | log | default

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
MAX_WITHIN = 50  # lines a detector's `near` may be before its match (a block such as kubectl describe's volume)
# the placeholders a row's fix_here may name (plan_context's keys): any other would fail when the fix is shown
FIX_FIELDS = frozenset({"recipe", "hardware", "model_dir", "revision", "pinned_revision", "image", "pinned_image",
                        "cache_root", "minfer_mount", "minfer_host", "mem_fraction_static", "chunked_prefill_size",
                        "gpu_count", "gpus", "port", "container"})
FIELDS = ("error", "content", "output")  # output: the model's text in a request log line (PAYLOAD), with `also` seen
# the placeholders a row's fix_log may name: the values the log shows and the lower ones mm proposes
LOG_FIELDS = frozenset({"mem_fraction_static", "mem_fraction_lower", "chunked_prefill_size", "apply"})


def _fix_template(value: str | None, at: At, known: frozenset = FIX_FIELDS) -> str | None:
    import string

    if value is None:
        return None
    try:
        fields = [f for _, f, spec, conv in string.Formatter().parse(value) if f is not None]
    except ValueError as e:
        raise at.fail(f"not a fix template ({e})") from None
    for f in fields:
        if f not in known:
            raise at.fail(f"unknown placeholder {{{f[:40]}}} (known: {', '.join(sorted(known))})")
    return value


def _detector(d: dict, d_at: At, where: str) -> Detector:
    d_at.obj(d)
    source = d_at.get_str(d, "source", max_len=32)
    pattern_source = d_at.get_str(d, "pattern_source", "", max_len=MAX_PATTERN)
    if source not in SOURCES or not pattern_source:
        raise BadInput(f"{where}: every detector needs a source ({', '.join(SOURCES)}) and a pattern_source")
    check = d_at.get_str(d, "check", None, max_len=64)
    if source == "host" and check not in HOST_CHECKS:
        raise BadInput(f"{where}: unknown host check {check!r}")
    if source == "log" and check is not None and check not in LINE_CHECKS:
        raise BadInput(f"{where}: unknown line check {check!r} (known: {', '.join(sorted(LINE_CHECKS))})")
    body = d_at.get_str(d, "body", None, max_len=64)
    if body is not None and body not in BODY_CHECKS:
        raise BadInput(f"{where}: unknown body check {body!r} (known: {', '.join(sorted(BODY_CHECKS))})")
    engine = d_at.get_str(d, "engine", None, max_len=32)
    if engine is not None and engine not in ENGINES:
        raise BadInput(f"{where}: unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    judged = d_at.get_str(d, "field", None, max_len=32)
    if judged is not None and judged not in FIELDS:
        raise BadInput(f"{where}: unknown field {judged!r} (known: {', '.join(FIELDS)})")
    patterns = {k: _regex(d_at.get_str(d, k, None, max_len=MAX_PATTERN), where)
                for k in ("pattern", "unless", "also", "after", "cleared_by", "again_after", "near")}
    min_seconds = d.get("min_seconds")
    if min_seconds is not None and (isinstance(min_seconds, bool) or not isinstance(min_seconds, (int, float))
                                    or min_seconds <= 0 or patterns["pattern"] is None
                                    or "seconds" not in patterns["pattern"].groupindex):
        raise BadInput(f"{where}: min_seconds must be a positive number, with a pattern that has a group named seconds")
    while_starting = d_at.get_bool(d, "cleared_while_starting", False)
    within = d_at.get_int(d, "within", None, lo=0, hi=MAX_WITHIN) if "within" in d else None
    if (within is None) != (patterns["near"] is None):
        raise BadInput(f"{where}: near and within go together (a pattern, and how many lines before the match it may be)")
    if while_starting and patterns["cleared_by"] is None:
        raise BadInput(f"{where}: cleared_while_starting needs a cleared_by")
    return Detector(source=source, **patterns, min_seconds=min_seconds, cleared_while_starting=while_starting, within=within, requires=d_at.get_str(d, "requires", None, max_len=64), engine=engine,
                    field=judged, body=body, fallback=d_at.get_bool(d, "fallback", False),
                    payload=d_at.get_bool(d, "payload", False),
                    missing_mount=d_at.get_str(d, "missing_mount", None, max_len=4096), check=check,
                    fix=d_at.get_str(d, "fix", None), fix_here=_fix_template(d_at.get_str(d, "fix_here", None),
                                                                             d_at.key("fix_here")),
                    pattern_source=pattern_source)


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
        detectors = [_detector(d, r_at.key("detect").index(j), where) for j, d in enumerate(r_at.get_list(r, "detect"))]
        guide = r_at.get_obj(r, "guide")
        g_at = r_at.key("guide")
        by_hw = r_at.get_obj(r, "fix_here_hardware", {})
        rows.append(Row(id=row_id, guide_row=g_at.key("value").get_int(g_at.get_obj(guide, "value"), "row", hi=10_000),
                        guide=g_at.get_str(guide, "source", max_len=4096), symptom=r_at.get_str(r, "symptom"),
                        cause=r_at.get_str(r, "cause"), fix=r_at.get_str(r, "fix"),
                        fix_here=_fix_template(r_at.get_str(r, "fix_here", None), r_at.key("fix_here")),
                        change=dict(r_at.get_obj(r, "change")), detect=tuple(detectors),
                        fix_vllm=r_at.get_str(r, "fix_vllm", None),
                        fix_here_vllm=_fix_template(r_at.get_str(r, "fix_here_vllm", None), r_at.key("fix_here_vllm")),
                        fix_here_hardware={hw: _fix_template(r_at.key("fix_here_hardware").get_str(by_hw, hw), r_at.key(hw))
                                           for hw in by_hw},
                        fix_here_pinned_image=_fix_template(r_at.get_str(r, "fix_here_pinned_image", None),
                                                            r_at.key("fix_here_pinned_image")),
                        fix_log=_fix_template(r_at.get_str(r, "fix_log", None), r_at.key("fix_log"), LOG_FIELDS)))
    return Table(path=path, rows=tuple(rows))


# --- adapting a fix to the plan and the engine --------------------------------------------------

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


def _lower_fraction(shown: str) -> str | None:
    """The --mem-fraction-static mm proposes below SHOWN: under the guide's 0.8 (row 4: 'lower it below 0.8') and
    0.05 below the lower of the two (mm's own step), so the proposal always moves down from what ran."""
    try:
        value = float(shown)
    except ValueError:
        return None
    lower = round(min(value, 0.8) - 0.05, 2)
    return f"{lower:.2f}" if 0 < lower < value else None


def launch_takes(option: str) -> bool:
    """Whether `mm launch` takes this engine flag as the user's override (launch.OVERRIDE_FLAGS)."""
    from .launch import OVERRIDE_FLAGS

    return option in OVERRIDE_FLAGS


def log_context(shown: dict[str, str], plan: LaunchPlan | None) -> dict[str, str] | None:
    """The placeholders of a row's fix_log from the server's own values in the log, or None when it shows none."""
    fraction = shown.get("mem_fraction_static")
    lower = _lower_fraction(fraction) if fraction else None
    if lower is None:
        return None
    if launch_takes("--mem-fraction-static"):
        where = (f"mm launch {plan.model_dir} --hardware {plan.hardware.name}" if plan is not None
                 else "mm launch MODEL_DIR --hardware HW")
        apply = f"{where} --mem-fraction-static {lower}"
    else:
        apply = f"set the engine flag --mem-fraction-static {lower} in the start script `mm launch` wrote"
    return {"mem_fraction_static": fraction, "mem_fraction_lower": lower, "apply": apply,
            "chunked_prefill_size": shown.get("chunked_prefill_size") or "its current value"}


def fix_for(row: Row, plan: LaunchPlan | None, engine: str, d: Detector | None = None,
            shown: dict[str, str] | None = None) -> str:
    """The fix for ENGINE: on vLLM the row's vLLM fix (the guide's vLLM row) where it has one, never an
    SGLang-specific one; the matched message's own fix first (D); on SGLang, the server's own flag values the log
    SHOWS (unless the message has its own fix); with a plan, adapted to it (on SGLang, the hardware's own advice first: B200; the pinned image's
    other fix when it already runs)."""
    context = plan_context(plan) if plan is not None else None
    own_fix = d is not None and (d.fix or d.fix_here)
    from_log = log_context(shown or {}, plan) if row.fix_log and not own_fix else None
    if from_log is not None and engine != "vllm" and not (plan and plan.hardware.name in row.fix_here_hardware):
        return row.fix_log.format_map(from_log)
    pinned = plan is not None and context["pinned_image"] and plan.image == context["pinned_image"]
    own = [(d.fix_here, True), (d.fix, False)] if d is not None else []
    if engine == "vllm":
        options = own + [(row.fix_here_vllm, True), (row.fix_vllm, False), (row.fix_here, True), (row.fix, False)]
    else:
        options = own + [(row.fix_here_hardware.get(plan.hardware.name) if plan else None, True),
                         (row.fix_here_pinned_image if pinned else None, True), (row.fix_here, True), (row.fix, False)]
    for text, templated in options:
        if text and not (templated and context is None):
            return text.format_map(context) if templated else text
    return row.fix


def _applies(d: Detector, plan: LaunchPlan | None, engine: str) -> bool:
    """Engine-bound detectors run for that engine only; recipe-specific ones only when the plan says they apply
    (or, for families, when it is unknown)."""
    if d.engine is not None and d.engine != engine:
        return False
    if d.requires == "expects_qmul4":
        return plan is not None and plan.recipe.expects_qmul4
    if d.requires == "blackwell":
        return plan is None or plan.hardware.family == "blackwell"
    if d.requires == "plan":  # a start that departs from the recipe, not a symptom: only against the recipe's own flags
        return plan is not None
    return True


def _finding(row: Row, plan: LaunchPlan | None, engine: str, d: Detector, where: str, line: str,
             number: int | None, shown: dict[str, str] | None = None) -> Finding:
    line = printable(line.strip())
    return Finding(row=row.id, guide_row=row.guide_row, symptom=row.symptom, cause=row.cause, fix=fix_for(row, plan, engine, d, shown),
                   change=row.change, source=d.source, where=where,
                   line=line if len(line) <= MAX_LINE else line[:MAX_LINE] + "...", line_number=number, guide=row.guide,
                   pattern_source=d.pattern_source)


# --- which engine wrote the text -------------------------------------------------------------

ENGINES = ("sglang", "vllm")
# A line only that engine prints (from each engine's source), so a log tells which engine served it.
ENGINE_MARKERS = {
    "sglang": re.compile(r"server_args=(?:\{|ServerArgs\()|The server is fired up and ready to roll!"),  # srt/entrypoints/engine.py, http_server.py
    "vllm": re.compile(r"vLLM (?:API )?server version \S+|Initializing a V1 LLM engine \(v|Starting vLLM server on"
                       r"|Starting vLLM API server (?:\d+ |\(pure diffusion mode\) )?on |non-default args: \{"
                       r"|^\((?:APIServer|EngineCore(?:_DP\d+)?) pid=\d+\) "),
    # vLLM 0.33.0 entrypoints/common/startup.py, v1/engine/core.py, launchers; utils/system_utils.py decorate_logs
    # prefixes its processes' lines with "(APIServer pid=N)", "(EngineCore_DP0 pid=N)"; entrypoints/openai/api_server.py
    # run_server_worker ('Starting vLLM API server %d on %s', before 0.8 'Starting vLLM API server on %s') and
    # run_server ('vLLM API server version %s')
}


def engine_of(scans: Iterable[ScannedText], explicit: str | None = None,
              plan: LaunchPlan | None = None) -> tuple[str, str]:
    """(engine, how it is known): --engine, else the one engine the texts show, else the plan's recipe, else SGLang
    (the engine of the guide's troubleshooting table and of `mm launch` by default)."""
    if explicit:
        return explicit, "--engine"
    seen = set().union(*(s.engines for s in scans)) if scans else set()
    if len(seen) == 1:
        return next(iter(seen)), "log"
    if plan is not None:
        return plan.recipe.engine, "plan"
    return "sglang", "default"


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


# --- what the line says, whatever wrapped it --------------------------------------------------

# ECMA-48 CSI sequences (colours, cursor moves) and OSC sequences (titles, hyperlinks) as terminals and rich write them
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_RFC3339 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)"
# the CRI logging format kubelet writes under /var/log/pods (k8s.io/cri-api: TIMESTAMP STREAM TAG LINE, TAG P for a
# partial line that the next piece continues, F for its last piece)
_CRI = re.compile(rf"^{_RFC3339} (?:stdout|stderr) ([PF])(?:[:|][^ ]*)? ?(.*)$", re.S)
_DOCKER_TIMESTAMP = re.compile(rf"^{_RFC3339} ")  # `docker logs --timestamps`, `podman logs --timestamps`
# the prefixes collectors put before what the process printed (journald's first: it starts with a timestamp too)
_PREFIXES = (
    # journalctl's short, short-precise, short-iso(-precise) and short-full outputs, and syslog (RFC 3164, after a <PRI>):
    # WHEN HOST IDENT[PID]: (the PID
    # too, so that `docker events` 'TIME container health_status: ...' is not taken for one)
    re.compile(r"^(?:<\d{1,3}>)?(?:[A-Z][a-z]{2} \d{4}-\d\d-\d\d |[A-Z][a-z]{2} [ \d]?\d |\d{4}-\d\d-\d\dT)\d\d:\d\d:\d\d(?:\.\d+)?"
               r"(?: ?[A-Z]{3,5}|Z|[+-]\d\d:?\d\d)? \S+ [^\s\[\]:]+\[\d+\]: "),
    _DOCKER_TIMESTAMP,
    # `kubectl logs --prefix`: [pod/NAME/CONTAINER]
    re.compile(r"^\[[a-z.]+/[^\]\s/]+/[^\]\s]+\] ?"),
    # `docker compose logs`: SERVICE-1  | (compose v1: SERVICE_1  | )
    re.compile(r"^[\w.-]+\s*\| ?"),
)
# logfmt (Go's slog/logrus, Grafana Loki, Vector): key=value pairs, the message in msg= or message=, quoted with \" escapes
_LOGFMT = re.compile(r'^(?:[\w.@-]+=(?:"(?:[^"\\]|\\.)*"|\S*) )*?(?:msg|message)=(?:"((?:[^"\\]|\\.)*)"|([^"\s]\S*))')
_LOGFMT_ESCAPE = re.compile(r"\\(.)")
_LOGFMT_CHARS = {"n": "\n", "t": "\t", "r": "\r"}


# Fluent Bit's stdout output: [N] TAG: [TIMESTAMP, {record}] (1.x) or [[TIMESTAMP, {metadata}], {record}] (2.x), the
# record a Ruby-style hash ("key"=>"value") that is JSON once each "key"=> is "key":
_FLUENTBIT = re.compile(r'^\[\d+\] [^\s:]+: \[(?:\[\d+(?:\.\d+)?, \{[^{}]*\}\]|\d+(?:\.\d+)?), (\{".*\})\]\s*$')
_FLUENTBIT_KEY = re.compile(r'"(?:[^"\\]|\\.)*"(=>)?')


def _fluentbit_record(line: str) -> str | None:
    """A Fluent Bit stdout line's record as JSON (whole strings consumed, so that a '=>' inside a value stays), or
    None when LINE is no such line."""
    if not line.startswith("[") or not (m := _FLUENTBIT.match(line)):
        return None
    return _FLUENTBIT_KEY.sub(lambda k: k.group()[:-2] + ":" if k.group(1) else k.group(), m.group(1))


def _unwrapped(line: str) -> str:
    """What the process printed, with the collectors' prefixes (timestamps, pod, service, journald) removed and a
    logfmt record replaced by its message."""
    if (record := _fluentbit_record(line)) is not None:
        return record
    for _ in range(4):  # a prefix inside a prefix: journald of compose, docker timestamps of kubectl
        for prefix in _PREFIXES:
            if m := prefix.match(line):
                line = line[m.end():]
                break
        else:
            break
    if "=" in line and (m := _LOGFMT.match(line)):
        if m.group(1) is None:
            return m.group(2)
        return _LOGFMT_ESCAPE.sub(lambda e: _LOGFMT_CHARS.get(e.group(1), e.group(1)), m.group(1))
    return line
# the JSON keys that hold the message of a log record: docker's json-file driver ({"log", "stream", "time"}),
# Python/structlog/zap/Loki shippers ("message", "msg"), Google Cloud Logging ("textPayload"), Loki's export ("line");
# journald's export (`journalctl -o json`: MESSAGE beside __REALTIME_TIMESTAMP, _SYSTEMD_UNIT, PRIORITY, ...);
# a record also names a level, time, stream or unit
_RECORD_TEXT = ("log", "message", "msg", "MESSAGE", "textPayload", "line")
_RECORD_MARK = frozenset({"stream", "time", "timestamp", "ts", "level", "levelname", "severity", "logger", "@timestamp",
                          "__REALTIME_TIMESTAMP", "_SYSTEMD_UNIT", "SYSLOG_IDENTIFIER", "PRIORITY", "__CURSOR", "_PID",
                          "container_id", "container_name"})  # docker's fluentd driver: {container_*, source, log}


def _record(line: str) -> tuple[str | None, dict] | None:
    """A JSON log record on one line: its message (None when it has none) and the record, else None (a request or an
    answer is read by the body reader)."""
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        doc = load_json(text, "log record", max_bytes=MAX_LOG_LINE)
    except Malformed:
        return None
    if not isinstance(doc, dict) or not _RECORD_MARK.intersection(doc):
        return None
    return next((doc[k] for k in _RECORD_TEXT if isinstance(doc.get(k), str)), None), doc


# a record's fields that hold what a client sent (a prompt quoting anything), never an answer
_RECORD_REQUEST_KEYS = frozenset({"messages", "prompt", "input", "inputs", "request", "request_body", "obj", "params"})
MAX_RECORD_ANSWERS = 8


def _record_answers(doc: object, depth: int = 0) -> Iterator[str]:
    """The answers a log record carries besides its message (a gateway or proxy logging the upstream's answer, whole,
    as a JSON string, or as a preview of its message), each as the JSON document the body reader takes: an answer or
    an error answer as it is; an assistant message (content beside finish_reason, tool_calls or role assistant) inside
    choices."""
    if depth > 4:
        return
    if isinstance(doc, str):
        text = doc.strip()
        if depth and text.startswith("{") and text.endswith("}"):
            try:
                doc = load_json(text, "log record field", max_bytes=MAX_LOG_LINE)
            except Malformed:
                return
        else:
            return
    if isinstance(doc, list):
        for item in doc[:MAX_RECORD_ANSWERS]:
            yield from _record_answers(item, depth + 1)
        return
    if not isinstance(doc, dict):
        return
    if depth:
        if body_facts(doc, 0) is not None:
            yield json.dumps(doc)
            return
        if isinstance(doc.get("content"), str) and (
                "finish_reason" in doc or "tool_calls" in doc or doc.get("role") == "assistant"):
            yield json.dumps({"choices": [{"message": {"content": doc["content"]}}]})
            return
    for key, value in list(doc.items())[:64]:
        if key not in _RECORD_REQUEST_KEYS and isinstance(value, (dict, list, str)):
            yield from _record_answers(value, depth + 1)


def normalised(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of what each line says: ANSI escapes removed, a Kubernetes CRI prefix removed (CRI
    partial pieces joined, bounded by MAX_LOG_LINE), the prefixes of `docker logs --timestamps`, `kubectl logs
    --prefix`, `docker compose logs` and journalctl removed, a logfmt or JSON log record replaced by its message (one
    line per line of it) and followed by the answers it carries (_record_answers). The number is the first physical line's."""
    partial: list[str] = []
    partial_at = 0
    size = 0
    for number, raw in enumerate(lines, 1):
        line = _ANSI.sub("", raw) if "\x1b" in raw else raw
        if m := _CRI.match(line):
            tag, line = m.groups()
            if tag == "P":
                if not partial:
                    partial_at = number
                if size < MAX_LOG_LINE:
                    partial.append(line)
                    size += len(line)
                continue
            if partial:
                line, number = "".join(partial) + line, partial_at
                partial, size = [], 0
        line = _unwrapped(line)
        record = _record(line) if "{" in line else None
        if record is None:
            yield number, line
            continue
        message, doc = record
        if message is None:
            yield number, line
        else:
            for piece in message.splitlines() or [""]:
                yield number, _ANSI.sub("", piece) if "\x1b" in piece else piece
        for answer in itertools.islice(_record_answers(doc), MAX_RECORD_ANSWERS):
            yield number, answer
    if partial:
        yield partial_at, "".join(partial)


# --- JSON bodies inside a text ---------------------------------------------------------------

MAX_BODY = 1024 * 1024  # bytes of one JSON request or answer judged; a longer one is read as text
MAX_BODIES = 256  # bodies kept per text (their facts, not the documents)
MAX_FACT = 4096  # characters of one field kept
_BODY_START = re.compile(r'\{\s*(?:"|\}|$)')  # a JSON object begins here (not a Python dict repr: those quote with ')
_JSON_TOKEN = re.compile(r'[{}"\\]')


@dataclass
class Body:
    """What the table judges of one JSON document (a request or an answer), not the document itself."""
    line: int
    request: bool = False
    thinking: object = None  # the request's `thinking` value (absent: _ABSENT)
    effort: object = None  # top-level reasoning_effort
    kwargs_effort: object = None  # chat_template_kwargs.reasoning_effort
    thinking_mode: object = None  # chat_template_kwargs.thinking_mode
    error: str | None = None  # an error answer's message
    contents: list = field(default_factory=list)  # assistant content strings


_ABSENT = object()


def _short(value: object) -> str:
    if isinstance(value, _Expr):  # a variable of the script: its name
        return f"`{str(value)[:MAX_FACT]}` (a value the script computes)"
    return json.dumps(value, ensure_ascii=False)[:MAX_FACT]


def body_facts(doc: object, line: int) -> Body | None:
    """A request (it has messages), an answer (choices) or an error answer (SGLang's {"object": "error",
    "message"}, vLLM's {"error": {"message"}}, FastAPI's {"detail"})."""
    if not isinstance(doc, dict):
        return None
    body = Body(line=line)
    if isinstance(doc.get("messages"), list):
        kwargs = doc.get("chat_template_kwargs")
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        body.request = True
        body.thinking = doc.get("thinking", _ABSENT)
        body.effort = doc.get("reasoning_effort", _ABSENT)
        body.kwargs_effort = kwargs.get("reasoning_effort", _ABSENT)
        body.thinking_mode = kwargs.get("thinking_mode", _ABSENT)
        return body
    error = doc.get("error")
    if doc.get("object") == "error" and isinstance(doc.get("message"), str):
        body.error = doc["message"][:MAX_FACT]
    elif isinstance(error, dict) and isinstance(error.get("message"), str):
        body.error = error["message"][:MAX_FACT]
    elif isinstance(error, str):
        body.error = error[:MAX_FACT]
    elif isinstance(doc.get("detail"), str):
        body.error = doc["detail"][:MAX_FACT]
    choices = doc.get("choices")
    if not isinstance(choices, list):  # one choice, or its message, as `jq '.choices[0]'` / `.choices[0].message` prints it
        if isinstance(doc.get("message"), dict) and ("finish_reason" in doc or "index" in doc):
            choices = [doc]
        elif doc.get("role") == "assistant" and isinstance(doc.get("content"), str):
            choices = [{"message": doc}]
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        for key in ("message", "delta"):
            part = choice.get(key)
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                body.contents.append(part["content"][:MAX_FACT])
    return body if body.error is not None or body.contents else None


# moby's health state (api/types/container/health.go Health: Status, FailingStreak, Log of HealthcheckResult with
# ExitCode and Output), in `docker inspect` whole, as .State or as .State.Health
_HEALTH_OUTPUT = re.compile(r'"Output":\s*"(?:[^"\\]|\\.)*"')


MAX_EXPORT_SEEK = 64  # mm's own margin: physical lines between two records of an export (labels, metadata)


def _loki_lines(doc: object) -> list[tuple[int, str]] | None:
    """The log lines of a Grafana Loki query_range/query answer (data.result[].values: [nanosecond timestamp, line]
    pairs per stream) in time order, or None when DOC is no such answer. Loki answers newest first (direction=backward
    is its default) and splits a log into streams (stdout, stderr, one per pod): the pairs are merged by timestamp,
    so that the log's last line is the last one it printed."""
    data = doc.get("data") if isinstance(doc, dict) else None
    result = data.get("result") if isinstance(data, dict) else None
    if not (isinstance(result, list) and result and all(isinstance(r, dict) and "values" in r for r in result)):
        return None
    pairs = []
    for stream in result:
        values = stream["values"]
        if not isinstance(values, list):
            return None
        for value in values:
            if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0].isdigit()
                    and isinstance(value[1], str)):
                return None
            pairs.append((int(value[0]), len(pairs), value[1]))
    return [(i, line) for _, i, line in sorted(pairs)]


def _search_hits_lines(doc: object) -> list[tuple[int, str]] | None:
    """The messages of an Elasticsearch/OpenSearch _search answer (hits.hits[]._source with an @timestamp and a
    message) in @timestamp order, or None when DOC is no such answer or a hit lacks either: Kibana Discover and most
    queries sort by @timestamp desc, newest first."""
    hits = doc.get("hits") if isinstance(doc, dict) else None
    hits = hits.get("hits") if isinstance(hits, dict) else None
    if not (isinstance(hits, list) and hits):
        return None
    stamped = []
    for hit in hits:
        source = hit.get("_source") if isinstance(hit, dict) else None
        if not isinstance(source, dict) or not isinstance(stamp := source.get("@timestamp"), str):
            return None
        text = next((source[k] for k in _RECORD_TEXT if isinstance(source.get(k), str)), None)
        try:
            when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return None
        if text is None:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        stamped.append((when, len(stamped), text))
    return [(i, text) for _, i, text in sorted(stamped)]


def _export_lines(doc: object) -> list[tuple[int, str]] | None:
    """A log platform's JSON export, as the lines it carries in time order, each with its place in the export (Loki,
    Elasticsearch), else None."""
    lines = _loki_lines(doc)
    return _search_hits_lines(doc) if lines is None else lines


def _health_healthy(doc: object) -> bool:
    """Whether DOC is or holds a container health state whose current Status is healthy: its Log then keeps the
    outputs of earlier checks (failures while the server started), which the present state has cleared."""
    for _ in range(3):  # [container] -> container -> State -> Health
        if isinstance(doc, list) and len(doc) == 1:
            doc = doc[0]
        if not isinstance(doc, dict):
            return False
        if isinstance(doc.get("Log"), list) and "FailingStreak" in doc:
            return doc.get("Status") == "healthy"
        doc = doc.get("State") if isinstance(doc.get("State"), dict) else doc.get("Health")
    return isinstance(doc, dict) and isinstance(doc.get("Log"), list) and doc.get("Status") == "healthy"


# a request as a Python script sends it: openai-python's chat.completions.create(model=..., messages=..., **fields,
# extra_body={...}) (its extra_body is merged into the JSON body), or requests/httpx .post(url, json={...})
_PY_CALL = re.compile(r"\bcompletions\.create\(|\b(?:requests|httpx|session|client)\.post\(")
MAX_CALL_LINES = 200
MAX_CALL_BYTES = 64 * 1024  # a request call in a script is short; mm's own margin
MAX_CALL_TRIES = 32  # parses tried per call (each at a ')' that may close it): a line of ')'s costs no more


class _Expr(str):
    """The source text of a value a script computes (a variable): set, but its value is not in the text."""


class _PythonCall:
    """Collects the text of one Python call from its '(' until it parses (bounded by MAX_CALL_LINES, MAX_CALL_BYTES) and
    reads it as the JSON body it sends, its literals evaluated and any other value kept as an _Expr; never run."""

    def __init__(self, first: str, number: int):
        self.number = number
        self.text = first
        self.tried = 0  # the ends before this offset were tried already (the text only grows)
        self.tries = 0
        self.lines = 1
        self.open = first.count("(") - first.count(")")  # naive: parens in strings count too, so it only gates a parse
        self.given_up = len(first) > MAX_CALL_BYTES

    def add(self, line: str) -> None:
        self.lines += 1
        self.open += line.count("(") - line.count(")")
        self.text += "\n" + line
        if self.lines > MAX_CALL_LINES or len(self.text) > MAX_CALL_BYTES:
            self.given_up = True

    def document(self) -> dict | None:
        import ast

        start, self.tried = self.tried, len(self.text)
        if self.open > 0 or self.given_up:
            return None
        for end in (i for i in range(start, len(self.text)) if self.text[i] == ")"):
            self.tries += 1
            if self.tries > MAX_CALL_TRIES:
                self.given_up = True
                return None
            try:
                tree = ast.parse("f" + self.text[:end + 1], mode="eval")
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                continue
            if isinstance(tree.body, ast.Call):
                return _call_body(tree.body)
        return None


def _literal(node: object) -> object:
    import ast

    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        if isinstance(node, ast.Dict):  # a dict with a computed value: its literal keys, each value read alike
            return {k.value: _literal(v) for k, v in zip(node.keys, node.values)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        return _Expr(ast.unparse(node)[:MAX_FACT])


def _call_body(call: object) -> dict | None:
    """The JSON body a create(...) or post(..., json=...) call sends, else None."""
    fields = {kw.arg: kw.value for kw in call.keywords if kw.arg is not None}
    if "json" in fields:
        body = _literal(fields["json"])
        return body if isinstance(body, dict) else None
    if "messages" not in fields:
        return None
    body = {name: _literal(value) for name, value in fields.items() if name not in ("extra_body", "extra_headers")}
    extra = _literal(fields["extra_body"]) if "extra_body" in fields else {}
    if isinstance(extra, dict):
        body.update(extra)
    if not isinstance(body.get("messages"), list):
        body["messages"] = []  # messages built by the script: what is judged is the other fields
    return body


class _JsonObject:
    """Collects the lines of one JSON object that starts in a text (`curl -d '{`, `json.dumps(indent=2)`, an SSE
    `data: {...}` line) until its braces balance outside strings; bounded by MAX_BODY."""

    def __init__(self, first: str, offset: int, number: int):
        self.number = number
        self.lines: list[tuple[str, int]] = [(first, number)]  # the raw lines, to read as text if it is no JSON
        self.parts: list[str] = []
        self.size = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.payload = False  # it began on a request log line (PAYLOAD)
        self.done = self._feed(first[offset:])

    def add(self, line: str, number: int) -> bool:
        self.lines.append((line, number))
        self.done = self._feed(line)
        return self.done

    @property
    def too_big(self) -> bool:
        return self.size > MAX_BODY

    def _feed(self, segment: str) -> bool:
        end = None
        skip = -1
        if self.escaped:  # a backslash ended the last line
            skip, self.escaped = 0, False
        for m in _JSON_TOKEN.finditer(segment):
            pos, c = m.start(), m.group()
            if pos == skip:
                continue
            if self.in_string:
                if c == "\\":
                    skip = pos + 1
                    self.escaped = skip == len(segment)
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == "{":
                self.depth += 1
            elif c == "}":
                self.depth -= 1
                if self.depth == 0:
                    end = pos + 1
                    break
        piece = segment if end is None else segment[:end]
        self.parts.append(piece)
        self.size += len(piece) + 1
        return end is not None

    def document(self) -> object | None:
        try:
            return load_json("\n".join(self.parts), "body", max_bytes=MAX_BODY)
        except Malformed:
            return None


@dataclass
class ScannedText:
    """One text (a log, an HTTP answer) read once, line by line: for every text detector of the table its first
    matching line and whether its `unless` / `also` / `after` patterns were seen; the JSON requests and answers in
    it (their facts); which engine's lines it holds; the line count, the last TAIL lines and the lines that match
    KEEP (the first MAX_KEPT). Nothing else of the text is held."""
    where: str
    lines: int = 0
    hits: dict = field(default_factory=dict)  # (row id, detector index) -> (line, number)
    unless_seen: set = field(default_factory=set)
    also_seen: set = field(default_factory=set)
    after_seen: set = field(default_factory=set)
    cleared_seen: set = field(default_factory=set)  # detectors whose cleared_by matched (cleared_while_starting)
    kept_hits: set = field(default_factory=set)  # hits no later cleared_by voids (cleared_while_starting)
    near_at: dict = field(default_factory=dict)  # (row id, detector index) -> the last line its `near` matched
    bodies: list = field(default_factory=list)
    stream_content: str = ""  # the delta.content of SSE chunks, joined (a marker may span chunks)
    stream_line: int | None = None
    outputs: list = field(default_factory=list)  # (the model's output text, line) from request log lines (PAYLOAD)
    engines: set = field(default_factory=set)
    values: dict = field(default_factory=dict)  # (row id, detector index) -> (values before the last restart, since)
    shown: dict = field(default_factory=dict)  # the server's own flag values the text shows (SHOWN_FLAGS)
    tail: deque = field(default_factory=deque)
    kept: list = field(default_factory=list)


MAX_KEPT = 256
# the flag values a server prints at start: SGLang's server_args line (ServerArgs(mem_fraction_static=0.92, ...) or
# {'mem_fraction_static': 0.92, ...}: srt/entrypoints/engine.py) and a command line echoed in the log
SHOWN_FLAGS = re.compile(r"\b(mem_fraction_static|chunked_prefill_size)'?\s*[=:]\s*'?(\d+(?:\.\d+)?)\b"
                         r"|--(mem-fraction-static|chunked-prefill-size)[= ](\d+(?:\.\d+)?)\b")


MIN_NEEDLE = 3  # characters: a shorter literal is found on most lines and skips nothing


def _needles_of(items: list) -> frozenset[str] | None:
    """Literals one of which every match of the parsed sequence ITEMS holds: its longest run of plain characters, or
    the needles of a group or a positive lookahead it requires (a branch: one per alternative), whichever is the
    least common kind (the longest shortest needle); None when there is none of MIN_NEEDLE characters."""
    from re import _constants as c

    options: list[frozenset[str]] = []
    run: list[str] = []
    for op, arg in [*items, (None, None)]:
        if op is c.LITERAL:
            run.append(chr(arg))
            continue
        if len(run) >= MIN_NEEDLE:
            options.append(frozenset(["".join(run)]))
        run = []
        inner = None
        if op is c.SUBPATTERN and not arg[1] and not arg[2]:  # a group without flags of its own
            inner = _needles_of(list(arg[3]))
        elif op is c.ASSERT and arg[0] == 1:  # (?=...): the line holds it too
            inner = _needles_of(list(arg[1]))
        elif op is c.BRANCH:
            alternatives = [_needles_of(list(seq)) for seq in arg[1]]
            inner = None if None in alternatives else frozenset().union(*alternatives)
        if inner:
            options.append(inner)
    return max(options, key=lambda o: min(map(len, o)), default=None)


_LOWERED: list = [None, ""]  # the last line lower-cased: every case-insensitive detector tries the same line in turn


# A runbook or help text's step, as a CI job echoes it ("If the log shows CUDA out of memory ..., lower ...", a numbered
# or bulleted "In case NCCL init times out, verify ..."): a conditional clause, then what to do. A log line or a
# user's report says what happened; round fourteen's trap_gha_runbook_echo_mentions_oom.
_RUNBOOK_STEP = re.compile(
    r"\s*(?:[-*\u2022]\s+|\d{1,2}[.)]\s+)?(?:If|In case)\s[^,;:]{3,160}[,:]\s*(?:then\s+|please\s+|first\s+)?"
    r"(?:check|lower|set|keep|restart|raise|increase|reduce|decrease|use|try|add|make sure|verify|run|mount|pass|drop"
    r"|confirm|ensure|switch|remove|update|re-?run|consult|follow|bump|disable|enable|export|unset|delete|clear"
    r"|rebuild|pin|retry|wait|escalate|inspect|compare|do not|don't|never)\b")
_STEP_INITIALS = frozenset(" \t-*\u20220123456789I")


def _lower(line: str) -> str:
    if _LOWERED[0] is not line:
        _LOWERED[0], _LOWERED[1] = line, line.lower()
    return _LOWERED[1]


@lru_cache(maxsize=1024)
def _searcher(pattern: re.Pattern) -> Callable[[str], object]:
    """PATTERN.search, behind a test that the line holds one of the literals every match holds (str `in` is far
    cheaper than a regex search that fails at every position, which is what most lines of a log cost). A pattern
    that ignores case tests its ASCII literals against the line in lower case."""
    try:
        from re import _parser

        needles = _needles_of(list(_parser.parse(pattern.pattern, pattern.flags)))
    except Exception:  # another Python's parser: no shortcut, the same answers
        return pattern.search
    if not needles:
        return pattern.search
    search = pattern.search
    if pattern.flags & re.IGNORECASE:
        if not all(n.isascii() for n in needles):
            return search
        lowered = frozenset(n.lower() for n in needles)
        if len(lowered) == 1:
            [one] = lowered
            return lambda line: one in _lower(line) and search(line)
        return lambda line: any(n in _lower(line) for n in lowered) and search(line)
    if len(needles) == 1:  # the common cases, without a generator per line
        [one] = needles
        return lambda line: one in line and search(line)
    if len(needles) == 2:
        one, two = needles
        return lambda line: (one in line or two in line) and search(line)
    return lambda line: any(n in line for n in needles) and search(line)


# --- request and response log lines: user data -------------------------------------------------

# The lines an engine writes about one request, holding its prompt and output (user data, never a server failure):
# SGLang's --log-requests (srt/utils/request_logger.py: "Receive: obj=...", "Receive OpenAI: obj={...}",
# "Finish: obj=..., out={...}"), vLLM's --enable-log-requests (entrypoints/serve/utils/request_logger.py: "Request ID
# details: prompt: ...", "Generated response ID: output: ...", "Request ID JSON body: ...", "Received request ID: params:
# SamplingParams(...)" with the user's stop strings)
PAYLOAD = re.compile(r"\b(?:Receive(?: OpenAI)?|Finish): obj=|\bRequest \S+ (?:details: prompt: |JSON body: )"
                     r"|\bGenerated response \S+: output: |\bReceived request \S+: params: ")
_PY_STRING = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")
# the model's output in such a line: SGLang's out={..., 'text': '...'}, vLLM's output: '...' (a Python repr)
_OUTPUT = re.compile(r"\bout=\{(?:[^{}'\"]|'[\w.]*'|\{[^{}]*\})*?'text': |\bGenerated response \S+: output: ")
MAX_OUTPUTS = 64
# an answer's message as openai-python prints it (print(completion): its pydantic models' repr, content first:
# ChatCompletionMessage(content='...', refusal=None, role='assistant', ...); streamed, ChoiceDelta(content='...', ...))
# and as LangChain's langchain_openai returns it (langchain_core AIMessage / AIMessageChunk repr, content first)
_PY_ANSWER = re.compile(r"\b(?:ChatCompletionMessage|ChoiceDelta|AIMessage|AIMessageChunk)\(content=")


# pydantic's ValidationError prints each error as a location line ('thinking.type'; v1: 'thinking -> type') and an
# indented message ('  Input should be ... [type=literal_error, ...]'): the message is read as 'LOCATION: message'
_PYDANTIC_LOC = re.compile(r"^[A-Za-z_][\w.]*(?: -> \w+)*$")
_PYDANTIC_MSG = re.compile(r"^\s+\S.*[\[(]type=[\w.]+")


# vLLM's logger header (vllm/logger.py _FORMAT '%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s',
# dates '%m-%d %H:%M:%S'), after utils/system_utils.py decorate_logs' '(APIServer pid=N) '; its NewLineFormatter
# repeats the header on every line of a message, so a traceback's lines carry it too: what follows is what was logged;
# decorate_logs prefixes whatever else the process writes (a traceback printed to stderr, uvicorn's access lines)
# with '(APIServer pid=N) ' alone
_VLLM_HEADER = re.compile(r"^(?:\((APIServer|EngineCore(?:_DP\d+)?|\w+) pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                          r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]\s]+:\d+\] |^\((APIServer|EngineCore(?:_DP\d+)?|\w+) pid=\d+\) ")
_VLLM_LEVEL_INITIALS = frozenset("DIWEC")


def _is_payload(line: str) -> bool:
    return (("obj=" in line or "Request " in line or "Generated response " in line or "Received request " in line)
            and PAYLOAD.search(line) is not None)


def _masked(line: str) -> str:
    """A request log line with the text of every string that holds a space emptied: what the user wrote (a prompt
    quoting an error, or a field name) is never read as the request's own fields; names and short values stay."""
    return _PY_STRING.sub(lambda m: m.group()[0] * 2 if any(c.isspace() for c in m.group()[1:-1]) else m.group(), line)


def _logged_output(line: str) -> str | None:
    """The model's output text a request log line carries (see _OUTPUT), else None."""
    import ast

    m = _OUTPUT.search(line)
    literal = _PY_STRING.match(line, m.end()) if m else None
    if literal is None:
        return None
    try:
        text = ast.literal_eval(literal.group())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return text[:MAX_FACT] if isinstance(text, str) else None


# A command the user typed: a shell prompt (`$ `, `# `, `user@host:~$ `, PowerShell's `PS C:\> `) or a `set -x` trace;
# a prompt with nothing after it (`$`, `user@host:~$`) is the shell back, waiting, at the end of a paste.
_SHELL_PROMPT = re.compile(r"^(?:\S*@\S*:\S*[$#](?: |\s*$)|[$#] |\$\s*$|PS [^>]*> |\+ )")
# A search for a message quotes the message (`docker logs X | grep 'nvfp4_to_fp8 backend='`): its pattern is what
# the user looks for, never what the server said. grep, ripgrep, ack, ag, findstr, PowerShell's Select-String.
_SEARCH_ARG = re.compile(r"\b(?:[ezf]?grep|rg|ag|ack|findstr|Select-String)\b((?:\s+-[-\w=]+)*\s+)"
                         r"('(?:[^']*)'?|\"(?:[^\"\\]|\\.)*\"?|[^\s|;&]+)")
# A loop that polls /health until it answers (`until curl -f .../health; do sleep 5; done`, `while ! curl ...`):
# its failures are the wait; the shell comes back to a prompt only once the check passed (a Ctrl-C prints `^C`).
_POLL_LOOP = re.compile(r"\b(?:until|while\s+!)\s+(?:curl|wget)\b[^;]*/health\b")
# what a passing attempt of such a loop reads as to the detectors that a later check voids (their cleared_by)
_POLL_PASSED = "+ curl http://127.0.0.1/health"
# The guide's check of the NVFP4 decode path (Quickstart step 4: `docker logs NAME 2>&1 | grep 'nvfp4_to_fp8 backend='`),
# or a grep for qmul4, not inverted (-v): what it printed decides; nothing (the next prompt, grep -c's 0, the paste's
# end) reads to the detectors as _GREP_EMPTY followed by the command
_GREP_NVFP4 = re.compile(r"\b(?:[ezf]?grep|rg)\b(?:(?!\s-\w*v)[^|;&])*?(?:nvfp4_to_fp8|qmul4)")
_GREP_EMPTY = "grep found no 'nvfp4_to_fp8 backend=' line: "


# openai-python's APIStatusError as printed: _base_client.py _make_status_error_from_response formats
# f"Error code: {response.status_code} - {body}" with body = json.loads(the answer), so the answer is a Python dict repr
_OPENAI_STATUS = re.compile(r"\bError code: \d{3} - (\{.*\})\s*$")


# FlashInfer's JIT loader (flashinfer/jit/core.py) logs 'Loading JIT ops: NAME' and 'Finished loading JIT ops: NAME'
# around torch's cpp_extension load, which builds only what is not built yet: a load from the cache takes milliseconds, a
# build minutes. Its logger prints the time (logging's asctime), so the scanner adds to the Finished line how long
# the load took: ' (after N s)'.
_FLASHINFER_JIT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - \w+ - flashinfer\.jit: "
                             r"(Loading|Finished loading) JIT ops: (\S+)\s*$")


def _seconds_of(stamp: str, millis: str) -> float | None:
    try:
        when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
        return when.timestamp() + int(millis) / 1000
    except ValueError:
        return None


# --- checks on one line, past what a pattern can say ---------------------------------------------

_PUBLISH = re.compile(r"^(?:-p|--publish)(?:=(.+))?$")
# the port the server listens on when its command names none: SGLang's ServerArgs port, vLLM's serve --port
DEFAULT_PORTS = {"sglang": 30000, "vllm": 8000}


def _port_not_published(line: str) -> str | None:
    """A `docker run` / `podman run` line whose -p/--publish options publish no container port the server in it listens
    on (its --port, else the engine's default): the guide's row 11 'the port mapping is wrong'."""
    import shlex

    try:
        words = shlex.split(line, comments=False)
    except ValueError:
        words = line.split()
    published: list[int] = []
    port = engine = None
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word in ("--network=host", "--net=host") or (word in ("--network", "--net") and nxt == "host") \
                or word in ("-P", "--publish-all"):
            return None  # the host's own ports, or every exposed port: nothing to compare
        if m := _PUBLISH.match(word):
            spec = (m.group(1) or nxt).split("/")[0]
            container = spec.rsplit(":", 1)[-1]
            if container.isdigit():
                published.append(int(container))
            elif "-" in container:
                return None  # a range: not judged
        elif word.startswith("--port="):
            port = word.split("=", 1)[1]
        elif word == "--port":
            port = nxt
        elif engine is None:  # the image's or the command's name: lmsysorg/sglang@sha256:..., vllm/vllm-openai:TAG
            name = word.lower().rsplit("/", 1)[-1].split("@")[0].split(":")[0]
            engine = next((e for e in DEFAULT_PORTS if e in name), None)
    if not published:
        return None
    listening = int(port) if port and port.isdigit() else DEFAULT_PORTS.get(engine or "")
    if listening is None or listening in published:
        return None
    return f"the server listens on port {listening} in the container; -p publishes {', '.join(map(str, published))}"


MINFER = "/root/.cache/minfer"  # the guide's kernel cache in the container (its -v ~/.cache/minfer:/root/.cache/minfer)


def _minfer_not_mounted(line: str) -> str | None:
    """A `docker run` / `podman run` line that mounts volumes but none at /root/.cache/minfer (or a folder above it):
    what the MSA kernels compile into is lost with the container (the guide's row 3). A line with no mount at all is
    not judged (a command shortened for a paste)."""
    import shlex

    try:
        words = shlex.split(line, comments=False)
    except ValueError:
        words = line.split()
    targets: list[str] = []
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word in ("-v", "--volume") or word.startswith(("-v=", "--volume=")):
            spec = word.split("=", 1)[1] if "=" in word else nxt
            parts = spec.split(":")
            targets.append(parts[1] if len(parts) > 1 else parts[0])
        elif word == "--mount" or word.startswith("--mount="):
            spec = word.split("=", 1)[1] if word.startswith("--mount=") else nxt
            fields = dict(f.split("=", 1) for f in spec.split(",") if "=" in f)
            if fields.get("type") == "tmpfs":
                continue  # memory: no more kept than no mount
            targets.append(fields.get("dst") or fields.get("destination") or fields.get("target") or "")
    if not targets:
        return None
    kept = [t.rstrip("/") for t in targets if t and (MINFER + "/").startswith(t.rstrip("/") + "/")]
    if kept:
        return None
    return f"no volume at {MINFER} (volumes at {', '.join(t for t in targets if t)})"


# a compose file pasted with the log (compose spec: services.<name>.environment, .volumes in short 'SRC:DST[:MODE]' or
# long 'target: DST' syntax): read as the guide's docker run is by _minfer_not_mounted
_COMPOSE_SERVICES = re.compile(r"^services:\s*$")
_COMPOSE_VOLUMES = re.compile(r"^-?\s*volumes:\s*(?:\[(.*)\])?\s*$")
_COMPOSE_ITEM = re.compile(r"""^-\s*["']?([^"'\s#]+)""")
_COMPOSE_TARGET = re.compile(r"""^-?\s*target:\s*["']?(/[^"'\s#]*)""")
COMPOSE_NO_MINFER = "compose services (line {line}) set FMHA_SM100_ALLOW_JIT and mount {targets}, none at " + MINFER


@dataclass
class _Compose:
    """The services block of a pasted compose file, being read: whether it sets FMHA_SM100_ALLOW_JIT and where its
    volumes are mounted."""
    line: int
    jit: bool = False
    targets: list = field(default_factory=list)
    volumes_at: int | None = None  # the indent of the `volumes:` key whose list is being read

    def add(self, line: str) -> None:
        text = line.strip()
        if not text or text.startswith("#"):
            return
        indent = len(line) - len(line.lstrip())
        if "FMHA_SM100_ALLOW_JIT" in text:
            self.jit = True
        if self.volumes_at is not None and (indent < self.volumes_at or (indent == self.volumes_at and text[0] != "-")):
            self.volumes_at = None
        if m := _COMPOSE_VOLUMES.match(text):
            self.volumes_at = None if m.group(1) is not None else indent
            for spec in (m.group(1) or "").split(","):
                self._short(spec.strip().strip("\"'"))
        elif self.volumes_at is not None and len(self.targets) < MAX_KEPT:
            if m := _COMPOSE_TARGET.match(text):
                self.targets.append(m.group(1))
            elif m := _COMPOSE_ITEM.match(text):
                self._short(m.group(1))

    def _short(self, spec: str) -> None:
        parts = spec.split(":")
        target = parts[1] if len(parts) > 1 else parts[0]
        if target.startswith("/"):
            self.targets.append(target)

    def finding(self) -> str | None:
        """The line the detectors read when JIT is allowed and volumes are mounted, none at /root/.cache/minfer."""
        if not self.jit or not self.targets:
            return None
        if any((MINFER + "/").startswith(t.rstrip("/") + "/") for t in self.targets):
            return None
        return COMPOSE_NO_MINFER.format(line=self.line, targets=", ".join(self.targets))


LINE_CHECKS: dict[str, Callable[[str], str | None]] = {"port_not_published": _port_not_published,
                                                       "minfer_not_mounted": _minfer_not_mounted}


def _long_enough(d: Detector, m: object) -> object:
    """M, unless D wants a duration (min_seconds) that M's group `seconds` does not reach."""
    if not m or d.min_seconds is None:
        return m
    try:
        return m if float(m.group("seconds")) >= d.min_seconds else None
    except (ValueError, TypeError):
        return None


# A line that begins a record of its own (a log header, a bracketed prefix, a traceback's frame or its code, an
# exception, a command, a JSON or XML value, a blank): never the continuation of a wrapped message; nor is a line
# after one that ends a sentence or a bracket, or after a traceback's frame line
MAX_WRAPPED = 3  # physical lines one wrapped message is read across
_LINE_ENDS = frozenset('.)]}!?"\'|>')
_FRAME = re.compile(r'^\s*File "')
_RECORD_HEAD = re.compile(r"^(?:\s*$|\s{4}|\s*[\[({<]|\d{4}-\d\d-\d\d|\d\d:\d\d|[A-Z]{3,}[\s:]|[A-Z]\d{4} |\s*Traceback\b"
                          r"|\s*File \"|[$#] |\+ |>>> |\s*[\w.]+(?:Error|Exception|Warning)\b|\s*\^)")


class _Scanner:
    def __init__(self, where: str, table: Table, tail: int, keep: re.Pattern | None):
        self.detectors = [((row.id, j), d, {k: _searcher(getattr(d, k)) for k in ("pattern", "unless", "also", "after",
                                                                                   "cleared_by", "again_after", "near")
                                                 if getattr(d, k)})
                          for row in table.rows for j, d in enumerate(row.detect)
                          if d.source in ("log", "http") and d.pattern is not None and d.field in (None, "output")]
        self.scan = ScannedText(where=where, tail=deque(maxlen=tail))
        self.keep = keep
        self.tail = tail
        self.pending: _JsonObject | None = None
        self.location: str | None = None  # the last line, when it was a pydantic error's location (_PYDANTIC_LOC)
        self.call: _PythonCall | None = None  # a request a Python script sends, being read
        self.polling = False  # a shell loop polling /health is running (_POLL_LOOP)
        self.jit_loading: dict[str, float] = {}  # FlashInfer op -> when its load began (_FLASHINFER_JIT)
        self.previous: tuple[str, int, int] | None = None  # the last text line (with the lines it continues), its
        # first line's number and how many lines it holds: for a message wrapped onto the next
        self.grep: tuple[str, int] | None = None  # the guide's grep for the decode path, until its output is seen
        self.compose: _Compose | None = None  # a pasted compose file's services block, being read

    def line(self, number: int, line: str) -> None:
        scan = self.scan
        scan.lines = number
        if (line[:1] == "(" or line[:1] in _VLLM_LEVEL_INITIALS) and (m := _VLLM_HEADER.match(line)):
            if m.group(1) or m.group(2):
                scan.engines.add("vllm")
            line = line[m.end():]
        if self.tail:
            scan.tail.append(line)
        if self.compose is not None:
            if line.strip() and not line[:1].isspace() and not line.startswith(("#", "-")):  # the block ended
                self._compose_end()
            else:
                self.compose.add(line)
        if self.compose is None and _COMPOSE_SERVICES.match(line):
            self.compose = _Compose(number)
        if "flashinfer.jit: " in line and (m := _FLASHINFER_JIT.match(line)) and (at := _seconds_of(*m.group(1, 2))):
            if m.group(3) == "Loading":
                if len(self.jit_loading) < MAX_KEPT:
                    self.jit_loading[m.group(4)] = at
            elif (began := self.jit_loading.pop(m.group(4), None)) is not None:
                line = f"{line.rstrip()} (after {max(at - began, 0.0):.1f} s)"
        if self.polling and (line.startswith("^C") or _SHELL_PROMPT.match(line)):
            self.polling = False
            if not line.startswith("^C"):
                self._cleared(_POLL_PASSED)
        if self.grep is not None and line.strip():
            if _SHELL_PROMPT.match(line) or line.strip() == "0":
                self._match(_GREP_EMPTY + self.grep[0], self.grep[1])
            self.grep = None
        if _SHELL_PROMPT.match(line):
            self.polling = _POLL_LOOP.search(line) is not None and "timeout" not in line
            self.grep = (line.strip()[:MAX_LINE], number) if _GREP_NVFP4.search(line) else None
            line = _SEARCH_ARG.sub(lambda m: m.group(0)[:m.start(2) - m.start()], line)
        if self.keep is not None and len(scan.kept) < MAX_KEPT and self.keep.search(line):
            scan.kept.append(line)
        if self.call is not None:
            self._call_line(line)
        elif ("create(" in line or "post(" in line) and (m := _PY_CALL.search(line)):
            self.call = _PythonCall(line[m.end() - 1:], number)
            self._call_line(None)
        if "Error code: " in line and (m := _OPENAI_STATUS.search(line)):  # ends a traceback: whatever is open
            self._printed_error(m.group(1), number)
        if self.pending is not None:
            if self.pending.add(line, number) or self.pending.too_big:
                self._close()
            return
        location, self.location = self.location, line if len(line) < 256 and _PYDANTIC_LOC.match(line) else None
        if location is not None and "type=" in line and _PYDANTIC_MSG.match(line):
            line = f"{location}: {line.strip()}"
        if "content=" in line and len(scan.bodies) < MAX_BODIES:
            self._printed_answers(line, number)
        payload = _is_payload(line)
        if payload and len(scan.outputs) < MAX_OUTPUTS and (text := _logged_output(line)) is not None:
            scan.outputs.append((text, number))
        start = _BODY_START.search(line) if "{" in line else None
        if start is None:
            self._match(_masked(line) if payload else line, number, payload)
            return
        # what precedes the body is text ("data: ", a log prefix)
        self._match(_masked(line[:start.start()]) if payload else line[:start.start()], number, payload)
        self.pending = _JsonObject(line, start.start(), number)
        self.pending.payload = payload
        if self.pending.done:
            self._close()

    def _exported(self, lines: list[tuple[int, str]], pending: _JsonObject) -> None:
        """The log lines a log platform's export carried (_export_lines), in time order, each read as a line of the log
        at the physical line that holds it (the export's first where it is not on a line of its own)."""
        at: dict[int, int] = {}  # place in the export -> the physical line that holds it, found in the export's order
        cursor = 0
        for place, text in sorted(lines):
            quoted = json.dumps(text, ensure_ascii=False)[1:-1]
            found = next((k for k in range(cursor, min(cursor + MAX_EXPORT_SEEK, len(pending.lines)))
                          if quoted in pending.lines[k][0]), None)
            if found is not None:
                at[place], cursor = pending.lines[found][1], found + 1
        last = self.scan.lines
        for place, text in lines:
            number = at.get(place, pending.number)
            for _, piece in normalised(text.splitlines() or [""]):
                self.line(number, piece)
        if self.pending is not None:  # a body the export's lines left open ends with them
            self._close()
        self.scan.lines = last

    def _printed_answers(self, line: str, number: int) -> None:
        """The contents of the answers openai-python printed on LINE (_PY_ANSWER), read as an answer's."""
        import ast

        contents = []
        for m in itertools.islice(_PY_ANSWER.finditer(line), MAX_OUTPUTS):
            head = line[m.end():m.end() + MAX_FACT]  # the content's beginning is what is judged
            literal = _PY_STRING.match(head) or (head and _PY_STRING.match(head.rstrip("\\") + head[0]))
            if not literal:
                continue
            try:
                text = ast.literal_eval(literal.group())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(text, str):
                contents.append(text[:MAX_FACT])
        if contents:
            self.scan.bodies.append(Body(line=number, contents=contents))

    def _printed_error(self, text: str, number: int) -> None:
        """The answer openai-python printed with its status error (_OPENAI_STATUS), read as an error answer."""
        import ast

        if len(text) > MAX_BODY:
            return
        try:
            doc = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return
        facts = body_facts(doc, number)
        if facts is None or facts.error is None:
            return
        self._error_text(facts.error, number)
        if len(self.scan.bodies) < MAX_BODIES:
            self.scan.bodies.append(facts)

    def _error_text(self, error: str, number: int) -> None:
        """A server's error message matched like the log lines it holds: one line at a time, a pydantic error's
        location line read with the message under it (as in line())."""
        location = None
        for piece in itertools.islice(error.splitlines(), MAX_CALL_LINES):
            if location is not None and "type=" in piece and _PYDANTIC_MSG.match(piece):
                piece = f"{location}: {piece.strip()}"
            location = piece if len(piece) < 256 and _PYDANTIC_LOC.match(piece) else None
            self._match(piece, number)

    def _call_line(self, line: str | None) -> None:
        call = self.call
        if line is not None:
            call.add(line)
        doc = call.document()
        if doc is None and not call.given_up:
            return
        self.call = None
        if doc is not None and (facts := body_facts(doc, call.number)) is not None and facts.request \
                and len(self.scan.bodies) < MAX_BODIES:
            self.scan.bodies.append(facts)

    def _close(self) -> None:
        pending, self.pending = self.pending, None
        doc = None if pending.too_big or not pending.done else pending.document()
        if doc is None:  # not JSON after all: read as text
            for text, number in pending.lines:
                self._match(_masked(text) if pending.payload else text, number, pending.payload)
            return
        if isinstance(doc, dict) and str(doc.get("event", "")).startswith("request."):
            # SGLang's --log-requests-format json (utils/log_utils.py log_json): a request or its output, user data
            out = doc.get("out")
            if isinstance(out, dict) and isinstance(out.get("text"), str) and len(self.scan.outputs) < MAX_OUTPUTS:
                self.scan.outputs.append((out["text"][:MAX_FACT], pending.number))
            doc = doc.get("obj")
            if not (isinstance(doc, dict) and isinstance(doc.get("messages"), list)):
                return
        if (exported := _export_lines(doc)) is not None:
            self._exported(exported, pending)
            return
        facts = body_facts(doc, pending.number)
        if facts is None:  # JSON, but no request or answer (a structured log line): read as text
            healthy = _health_healthy(doc)
            for text, number in pending.lines:
                text = _HEALTH_OUTPUT.sub('"Output":""', text) if healthy else text
                self._match(_masked(text) if pending.payload else text, number, pending.payload)
            return
        if facts.error is not None:  # a server's error message is evidence like a log line (an OOM in a 500)
            self._error_text(facts.error, pending.number)
        if isinstance(doc, dict) and doc.get("object") == "chat.completion.chunk":
            scan = self.scan
            scan.stream_line = scan.stream_line or pending.number
            scan.stream_content = (scan.stream_content + "".join(facts.contents))[-MAX_FACT:]
            facts.contents = []
        if (facts.request or facts.error is not None or facts.contents) and len(self.scan.bodies) < MAX_BODIES:
            self.scan.bodies.append(facts)

    def _match(self, line: str, number: int, payload: bool = False) -> None:
        """Every detector on LINE; a request log line (PAYLOAD) is user data: only the detectors made for it see it."""
        if line and line[:1] in _STEP_INITIALS and _RUNBOOK_STEP.match(line):
            line = ""  # a runbook step a CI job echoed: the failure it names is its condition, not an event
        if not line:
            self.previous = None
            return
        scan = self.scan
        previous, self.previous = self.previous, None if payload else (line, number, 1)
        if (previous is not None and not payload and previous[0].rstrip()[-1:] not in _LINE_ENDS
                and not _RECORD_HEAD.match(line) and not _FRAME.match(previous[0])):
            self._match_wrapped(previous[:2], line)
            if previous[2] < MAX_WRAPPED:  # a message broken over three lines: the next joins the two before it
                self.previous = (f"{previous[0].rstrip()} {line.lstrip()}"[-MAX_LOG_LINE:], previous[1], previous[2] + 1)
        if not payload:
            for engine, marker in ENGINE_MARKERS.items():
                if engine not in scan.engines and marker.search(line):
                    scan.engines.add(engine)
            if ("mem" in line or "chunked" in line) and len(scan.shown) < 2:
                for m in SHOWN_FLAGS.finditer(line):
                    scan.shown.setdefault((m.group(1) or m.group(3)).replace("-", "_"), m.group(2) or m.group(4))
        for key, d, search in self.detectors:
            if payload and not d.payload:
                continue
            if d.near is not None and search["near"](line):
                scan.near_at[key] = number
            if d.cleared_by is not None and (key in scan.hits or d.cleared_while_starting) and search["cleared_by"](line):
                if key not in scan.kept_hits:
                    scan.hits.pop(key, None)
                scan.cleared_seen.add(key)
            if d.again_after is not None and not payload:
                self._again(key, d, search, line, number)
            elif (d.field is None and d.payload == payload and key not in scan.hits and key not in scan.unless_seen
                    and (d.after is None or key in scan.after_seen)
                    and (d.near is None or number - scan.near_at.get(key, -MAX_WITHIN - 1) <= d.within)
                    and _long_enough(d, search["pattern"](line)) and (d.check is None or LINE_CHECKS[d.check](line))):
                scan.hits[key] = (line, number)
                if d.cleared_while_starting and key in scan.cleared_seen:
                    scan.kept_hits.add(key)
            if d.after is not None and key not in scan.after_seen and search["after"](line):
                scan.after_seen.add(key)
            if d.unless is not None and key not in scan.unless_seen and search["unless"](line):
                scan.unless_seen.add(key)
            if d.also is not None and key not in scan.also_seen and search["also"](line):
                scan.also_seen.add(key)

    def _match_wrapped(self, previous: tuple[str, int], line: str) -> None:
        """A message a ticket, a chat or a terminal broke across two lines: each detector's pattern on the previous
        line joined to this one (by a space, or by nothing where a word was cut), counted only where the match spans
        the join, so that what either line says alone is judged as before and two unrelated lines never combine
        into more than one message's worth of words."""
        scan = self.scan
        head, number = previous
        tail = line.lstrip()
        joins = [f"{head.rstrip()} {tail}"]
        if len(head) >= 60 and head[-1:].islower() and tail[:1].islower():  # a terminal's hard wrap inside a word
            joins.append(head + tail)
        for joined in joins:
            cut = len(head.rstrip()) if joined[len(head.rstrip()):len(head.rstrip()) + 1] == " " else len(head)
            for key, d, search in self.detectors:
                if (d.field is not None or d.payload or d.check is not None or d.again_after is not None
                        or d.near is not None or key in scan.hits or key in scan.unless_seen or (d.after is not None and key not in scan.after_seen)):
                    continue
                m = _long_enough(d, search["pattern"](joined))
                # a pattern that either line matches alone (one that opens with `.*`) is that line's hit, not a join's
                if m and m.start() < cut < m.end() and not search["pattern"](tail) and not search["pattern"](head):
                    scan.hits[key] = (joined, number)
                    if d.cleared_while_starting and key in scan.cleared_seen:
                        scan.kept_hits.add(key)

    def _cleared(self, line: str) -> None:
        """LINE's effect as a later recovery only: the hits whose cleared_by it matches are voided."""
        for key, d, search in self.detectors:
            if d.cleared_by is not None and key in self.scan.hits and key not in self.scan.kept_hits \
                    and search["cleared_by"](line):
                del self.scan.hits[key]

    def _again(self, key: tuple[str, int], d: Detector, search: dict, line: str, number: int) -> None:
        """A value of the pattern's group 1 matched again after a restart (d.again_after) is a hit."""
        scan = self.scan
        earlier, current = scan.values.setdefault(key, (set(), set()))
        if search["again_after"](line):
            earlier |= current
            current.clear()
        elif key not in scan.hits and (m := _long_enough(d, search["pattern"](line))):
            if m.group(1) in earlier:
                scan.hits[key] = (line, number)
            elif len(current) < MAX_KEPT:
                current.add(m.group(1))

    def _compose_end(self) -> None:
        compose, self.compose = self.compose, None
        if compose is not None and (text := compose.finding()) is not None:
            self._match(text, compose.line)

    def finish(self) -> ScannedText:
        self._compose_end()
        if self.grep is not None:
            self._match(_GREP_EMPTY + self.grep[0], self.grep[1])
        if self.pending is not None:
            pending, self.pending = self.pending, None
            for text, number in pending.lines:
                self._match(_masked(text) if pending.payload else text, number, pending.payload)
        return self.scan


def scan_text(where: str, lines: Iterable[str], table: Table, *, tail: int = 0,
              keep: re.Pattern | None = None) -> ScannedText:
    scanner = _Scanner(where, table, tail, keep)
    for number, line in normalised(lines):
        scanner.line(number, line)
    return scanner.finish()


# --- judging a body's fields -------------------------------------------------------------------

M3_THINKING_TYPES = ("adaptive", "enabled", "disabled")  # SGLang 0.5.23 serving_chat.py _M3_THINKING_TYPES
M3_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # the guide's capability table; serving_chat.py _M3_REASONING_EFFORTS
EFFORT_OFF = ("none", "minimal")  # the guide: these turn thinking off


def _set(value: object) -> bool:
    return value is not _ABSENT and value is not None


def _thinking_type_invalid(b: Body) -> str | None:
    if not b.request or b.thinking is _ABSENT or b.thinking is None:
        return None
    kind = b.thinking.get("type") if isinstance(b.thinking, dict) else None
    if kind in M3_THINKING_TYPES or isinstance(b.thinking, _Expr) or isinstance(kind, _Expr):
        return None
    return f'"thinking": {_short(b.thinking)} (type must be adaptive, enabled or disabled)'


def _effort_in_template_kwargs(b: Body) -> str | None:
    if b.request and _set(b.kwargs_effort):
        return f'"chat_template_kwargs": {{"reasoning_effort": {_short(b.kwargs_effort)}}}'
    return None


def _effort_top_level_only(b: Body) -> str | None:
    if b.request and _set(b.effort) and not _set(b.kwargs_effort):
        return f'"reasoning_effort": {_short(b.effort)} at the top level, none in chat_template_kwargs'
    return None


def _effort(b: Body) -> object:
    return b.effort if _set(b.effort) else b.kwargs_effort


def _effort_with_thinking_off(b: Body) -> str | None:
    effort = _effort(b)
    if not b.request or not _set(effort) or effort in EFFORT_OFF:
        return None
    off = (isinstance(b.thinking, dict) and b.thinking.get("type") == "disabled") or b.thinking_mode == "disabled"
    return f'reasoning_effort {_short(effort)} with thinking disabled' if off else None


def _effort_unknown_value(b: Body) -> str | None:
    effort = _effort(b)
    if b.request and _set(effort) and not isinstance(effort, _Expr) and effort not in M3_EFFORTS + EFFORT_OFF:
        return f'"reasoning_effort": {_short(effort)} (known: {", ".join(M3_EFFORTS + EFFORT_OFF)})'
    return None


BODY_CHECKS: dict[str, Callable[[Body], str | None]] = {
    "thinking_type_invalid": _thinking_type_invalid,
    "effort_in_template_kwargs": _effort_in_template_kwargs,
    "effort_top_level_only": _effort_top_level_only,
    "effort_with_thinking_off": _effort_with_thinking_off,
    "effort_unknown_value": _effort_unknown_value,
}


def _match_text(key: tuple[str, int], d: Detector, scan: ScannedText) -> tuple[str, int] | None:
    if d.pattern is None or (d.also is not None and key not in scan.also_seen):
        return None
    return scan.hits.get(key)


def _match_bodies(d: Detector, scan: ScannedText, key: tuple[str, int]) -> tuple[str, int | None] | None:
    if d.body is not None:
        for b in scan.bodies:
            fact = BODY_CHECKS[d.body](b)
            if fact:
                return fact, b.line
        return None
    if d.field == "error":
        for b in scan.bodies:
            if b.error is not None and d.pattern.search(b.error):
                return f"error: {b.error}", b.line
    elif d.field == "output":
        if d.also is None or key in scan.also_seen:
            for text, line in scan.outputs:
                if d.pattern.search(text):
                    return f"output: {text}", line
    elif d.field == "content":
        contents = [(c, b.line) for b in scan.bodies for c in b.contents]
        if scan.stream_content:
            contents.append((scan.stream_content, scan.stream_line))
        for text, line in contents:
            if d.pattern.search(text):
                return f"content: {text}", line
    return None


def diagnose(texts: Iterable[tuple[str, str] | ScannedText] = (), *, plan: LaunchPlan | None = None,
             table: Table | None = None, mounts: tuple[str, list[dict]] | None = None, host: bool = False,
             gpu_info: str | None = None, engine: str | None = None) -> Diagnosis:
    """Match the table against TEXTS ((where, text): logs, HTTP answers; or texts already read by `scan_text`
    with the same table), a container's MOUNTS ((name, docker inspect .Mounts)) and, with HOST, the host checks.
    Every text detector reads every text: a log may hold a request dump, a saved exchange may hold a log line.
    ENGINE (--engine) wins over the plan's and over what the texts show."""
    table = table or load_table()
    scans = [t if isinstance(t, ScannedText) else scan_text(t[0], t[1].splitlines(), table) for t in texts]
    engine, engine_from = engine_of(scans, engine, plan)
    shown = {k: v for scan in reversed(scans) for k, v in scan.shown.items()}  # the first text's value wins
    found_by: list[tuple[Finding, Detector]] = []
    for row in table.rows:
        found = None
        for j, d in enumerate(row.detect):
            if not _applies(d, plan, engine):
                continue
            if d.source in ("log", "http"):
                for scan in scans:
                    if key_hit := (_match_bodies(d, scan, (row.id, j)) if d.body or d.field else _match_text((row.id, j), d, scan)):
                        found = _finding(row, plan, engine, d, scan.where, key_hit[0], key_hit[1], shown)
                        break
            elif d.source == "container" and mounts is not None:
                name, items = mounts
                at = [m for m in items if m.get("Destination") == d.missing_mount]
                if d.missing_mount and not at:
                    found = _finding(row, plan, engine, d, name, f"no mount at {d.missing_mount} (mounts: "
                                     f"{', '.join(sorted(str(m.get('Destination')) for m in items)) or 'none'})", None)
                elif d.missing_mount and all(m.get("Type") == "tmpfs" for m in at):
                    # docker inspect's Mounts Type "tmpfs" (--mount type=tmpfs): memory, gone when the container stops
                    found = _finding(row, plan, engine, d, name, f"{d.missing_mount} is a tmpfs mount: what is "
                                     f"compiled there is lost when the container stops", None)
            elif d.source == "host" and host and plan is not None:
                fact = HOST_CHECKS[d.check](plan, gpu_info)
                if fact:
                    found = _finding(row, plan, engine, d, d.check, fact, None)
            if found:
                found_by.append((found, d))
                break
    causes = [f for f, d in found_by if not d.fallback]
    findings = causes or [f for f, _ in found_by]  # a symptom row (the server exited) stands alone, else the causes
    return Diagnosis(inputs=tuple(s.where for s in scans) + ((mounts[0],) if mounts else ()) + (("host",) if host else ()),
                     recipe=plan.recipe.id if plan else None, findings=tuple(findings),
                     lines_read=sum(s.lines for s in scans), table=str(table.path), engine=engine, engine_from=engine_from)


def scan_log(path: Path, table: Table) -> ScannedText:
    """A log file (or saved answer), read streaming: see `iter_lines`."""
    try:
        with open_local_file(path, what="log") as f:  # a regular file: a FIFO or /dev/zero would never end
            return scan_text(str(path), iter_lines(f), table)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None


MAX_PIPE_BYTES = 4 * 1024 ** 3  # mm's own margin: days of a busy server's log; a pipe that never ends (docker logs -f) stops


class _Capped:
    """A stream read up to MAX bytes: then BadInput, so that `docker logs -f X | mm diagnose -` ends."""

    def __init__(self, stream: BinaryIO, where: str, cap: int):
        self.stream, self.where, self.left, self.cap = stream, where, cap, cap

    def read(self, n: int) -> bytes:
        chunk = self.stream.read(min(n, self.left + 1))
        self.left -= len(chunk)
        if self.left < 0:
            raise BadInput(f"{self.where}: more than {self.cap // 1024 ** 3} GiB; give the part around the failure "
                           f"(docker logs --tail N, or a saved file)")
        return chunk


def scan_stream(where: str, stream: BinaryIO, table: Table, cap: int = MAX_PIPE_BYTES) -> ScannedText:
    """A log piped in (`docker logs X 2>&1 | mm diagnose -`), read streaming like a file, up to CAP bytes."""
    try:
        return scan_text(where, iter_lines(_Capped(stream, where, cap)), table)
    except OSError as e:
        raise BadInput(f"{where}: cannot read: {e.strerror or e}") from None


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
    """The very check `mm launch` makes before it writes a script (launch.check_model_dir): the manifest is there,
    holds the recipe's repository, the draft subfolder is there where the recipe uses it, quick verify passes."""
    from ..errors import MMError
    from .launch import check_model_dir

    try:
        check_model_dir(plan.model_dir, plan.recipe, default_pin())
    except MMError as e:
        return e.message
    return None


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
    stdin: BinaryIO | None = None  # LOGFILE `-`: the log piped in
    container: str | None = None
    answers: tuple[Path, ...] = ()
    model_dir: Path | None = None
    launch: object | None = None  # LaunchOptions: the recipe the fixes are adapted to (with model_dir)
    host_checks: bool = False
    gpu_info: str | None = None
    engine: str | None = None  # --engine; None: the plan's, else what the logs show, else sglang


def run_diagnosis(req: DiagnoseRequest) -> Diagnosis:
    if not (req.logfile or req.stdin or req.container or req.answers or req.host_checks):
        raise BadInput("diagnose: give a LOGFILE (- for the standard input), --container NAME, --answer FILE or "
                       "--host-checks")
    if (req.logfile or req.stdin) and req.container:
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
    if req.stdin is not None:
        texts.append(scan_stream("<stdin>", req.stdin, table))
    elif req.logfile:
        texts.append(scan_log(req.logfile, table))
    mounts = None
    if req.container:
        texts.append(scan_docker_logs(req.container, table))
        from .docker import container_mounts

        mounts = (req.container, container_mounts(req.container))
    texts += [scan_log(a, table) for a in req.answers]
    return diagnose(texts, plan=plan, table=table, mounts=mounts, host=req.host_checks, gpu_info=req.gpu_info,
                    engine=req.engine)
