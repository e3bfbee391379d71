"""Hostile servers on 127.0.0.1 against `mm fetch`, `mm pull`, `mm push` and `mm inspect`.

Every case runs the real mm in a subprocess against tests/support/hostile.py, a server whose answers the case
scripts byte by byte, and asserts what a user sees and what the host keeps: the exit code (never 70), the
message (one line, no traceback), nothing created, changed or deleted outside the target (a snapshot of the
test's directory, a sentinel directory and HOME included), the child's peak RSS under 150 MB, and that the
case ends within its deadline. The bounds are the short ones tests set (MM_NET_*, artifacts/edges/wire.py); mm's
defaults are for real WAN links (docs/hostile-input.md, "Network bounds").

Families: Hub API answers (fetch), file bytes from the Hub or its CDN (fetch), registry documents (ping, token,
manifests, error bodies: pull, inspect, push), registry blobs (pull, through the same ranged engine), upload
locations (push), passwords in references. `CASES` counts them.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import blake3
import numpy as np
import pytest
from safetensors.numpy import save_file

from mm.artifacts.integrity.manifest import FileEntry, Manifest, Upstream, to_json, write_manifest
from mm.artifacts.paths import manifest_path
from mm.artifacts.oci import modelpack
from tests.support.hostile import HostileServer, Out, Request
from tests.support.memory import run_with_peak_rss
from tests.support.run import mm_argv

MiB = 1 << 20
RSS_LIMIT = 150e6
NET_ENV = {"MM_NET_TIMEOUT": "1", "MM_NET_DEADLINE": "1.5", "MM_NET_MIN_RATE": "1024", "MM_NET_RATE_WINDOW": "0.5",
           "MM_NET_BACKOFF": "0.01"}
REPO = "hostile/model"
COMMIT = "c0ffee" * 6 + "c0ff"
BIG = "model.safetensors"
PASSWORD = "s3cr3t-pa55w0rd"


# --- what every case asserts ----------------------------------------------------------------------

def _snapshot(root: Path, skip: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p == skip or skip in p.parents:
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float
    rss: int

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class Harness:
    """Runs mm in a sandbox under TMP: HOME, a working directory and a sentinel directory it must not touch."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.dest = tmp / "dest"
        for d in ("home", "work", "sentinel"):
            (tmp / d).mkdir()
        (tmp / "sentinel" / "keep.txt").write_text("mm must not touch this\n")
        self.env = {k: v for k, v in os.environ.items()
                    if not k.lower().endswith("_proxy") and not k.startswith(("HF_", "MM_NET_"))
                    and k not in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG")}
        self.env.update(HOME=str(tmp / "home"), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
                        DOCKER_CONFIG=str(tmp / "home" / ".docker"), **NET_ENV)

    def run(self, *args, deadline: float, env: dict | None = None, input: str | None = None) -> Outcome:
        before = _snapshot(self.tmp, self.dest)
        started = time.monotonic()
        proc, rss = run_with_peak_rss(mm_argv(*args), {**self.env, **(env or {})}, timeout=deadline + 30,
                                      cwd=self.tmp / "work", input=input)
        seconds = time.monotonic() - started
        got = Outcome(proc.returncode, proc.stdout, proc.stderr, seconds, rss)
        RESULTS.append((os.environ.get("PYTEST_CURRENT_TEST", args[0]).rsplit(" ", 1)[0], seconds, rss))
        assert got.code != 70, got.text
        assert "Traceback" not in got.text, got.text
        assert rss < RSS_LIMIT, f"peak RSS {rss / 1e6:.0f} MB"
        assert seconds < deadline, f"took {seconds:.1f} s, deadline {deadline} s"
        assert _snapshot(self.tmp, self.dest) == before, "something outside the target changed"
        if got.code:
            assert len(got.stderr.strip().splitlines()) == 1, got.stderr
        return got


RESULTS: list[tuple[str, float, float]] = []


@pytest.fixture(scope="module", autouse=True)
def closing_figures():
    """After the module: the count of mm runs, the slowest, the highest peak RSS (shown with pytest -s)."""
    yield
    if RESULTS:
        slowest = max(RESULTS, key=lambda r: r[1])
        highest = max(RESULTS, key=lambda r: r[2])
        print(f"\nhostile network cases: {len(RESULTS)} mm runs; slowest {slowest[1]:.1f} s ({slowest[0]}); "
              f"highest peak RSS {highest[2] / 1e6:.0f} MB ({highest[0]})")


@pytest.fixture
def harness(tmp_path) -> Harness:
    return Harness(tmp_path)


def expect(got: Outcome, code: int, pattern: str) -> None:
    assert got.code == code, got.text
    assert re.search(pattern, got.stderr), got.stderr


# --- the Hub, for fetch ---------------------------------------------------------------------------

def _tensor_bytes(tmp: Path, nbytes: int, seed: int) -> bytes:
    path = tmp / f"t{seed}.safetensors"
    save_file({"weight": np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)}, str(path))
    return path.read_bytes()


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> bytes:
    """A real safetensors file of 3 MiB: three connections' worth of ranges."""
    return _tensor_bytes(tmp_path_factory.mktemp("hostile-weights"), 3 * MiB, seed=19)


def asked(req: Request, size: int) -> tuple[int, int] | None:
    """The (first, last) bytes a Range header asks for; None without one."""
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", req.headers.get("range", ""))
    if not m:
        return None
    return int(m[1]), min(size - 1, int(m[2])) if m[2] else size - 1


def honest(req: Request, out: Out, data: bytes) -> None:
    span = asked(req, len(data))
    if span is None:
        out.send(200, {"Content-Type": "application/octet-stream"}, data)
    else:
        first, last = span
        out.send(206, {"Content-Range": f"bytes {first}-{last}/{len(data)}"}, data[first:last + 1])


def hub(data: bytes, resolve: Callable = honest, api: Callable | None = None) -> Callable[[Request, Out], None]:
    """A Hub for REPO at COMMIT holding BIG (LFS): API answers honest unless API handles them (returns True),
    /resolve/ answered by RESOLVE(req, out, data)."""
    sha = hashlib.sha256(data).hexdigest()

    def script(req: Request, out: Out) -> None:
        if req.path.startswith("/api/"):
            if api is not None and api(req, out):
                return
            if req.path == f"/api/models/{REPO}/refs":
                out.send(200, {"Content-Type": "application/json"}, json.dumps(
                    {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": COMMIT}],
                     "tags": [], "converts": []}).encode())
            elif req.path.startswith(f"/api/models/{REPO}/tree/"):
                out.send(200, {"Content-Type": "application/json"}, json.dumps(
                    [{"type": "file", "oid": "1" * 40, "size": len(data), "path": BIG,
                      "lfs": {"oid": sha, "size": len(data), "pointerSize": 130}}]).encode())
            else:
                out.send(404, {"Content-Type": "application/json"}, b'{"error": "not here"}')
        elif req.path == f"/{REPO}/resolve/{COMMIT}/{BIG}" or req.path.startswith("/cdn/"):
            resolve(req, out, data)
        else:
            out.send(404, {}, b"")

    return script


def fetch(h: Harness, server: HostileServer, deadline: float = 12, *extra: str) -> Outcome:
    return h.run("fetch", REPO, "--revision", "main", "--local-dir", h.dest, *extra, deadline=deadline,
                 env={"HF_ENDPOINT": server.url})


def recorded(h: Harness) -> list:
    """What the range maps of DEST record as received."""
    done = []
    for state in (h.dest / ".mm" / "partial").glob("*.ranges"):
        done += json.loads(state.read_text())["done"]
    return done


# Hub API answers: one request per case (refs), the answer hostile

def _endless(req, out):
    out.endless()


def _announced_10_gb(req, out):
    out.head(200, {"Content-Type": "application/json", "Content-Length": str(10 << 30)})
    out.body(b"[" * 1000)
    out.stall(5)


def _trickled_body(req, out):
    out.head(200, {"Content-Type": "application/json", "Content-Length": "100000"})
    out.trickle(b"[" * 100000, 0.2)


def _slowloris_headers(req, out):
    out.raw(b"HTTP/1.1 200 OK\r\n")
    out.trickle(b"X-Slow: " + b"a" * 10000, 0.2)


def _huge_header(req, out):
    out.raw(b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 200_000 + b"\r\nContent-Length: 2\r\n\r\n{}")


def _gzip_bomb(req, out):
    bomb = gzip.compress(b" " * MiB) * 256  # 256 gzip members: 256 MiB of spaces in about 260 KiB
    out.send(200, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, bomb)


def _redirect_forever(req, out):
    n = int(req.query.split("=")[-1] or 0) if req.query else 0
    out.send(302, {"Location": f"{req.path}?hop={n + 1}"})


def _redirect_to(location: str):
    def script(req, out):
        out.send(302, {"Location": location})
    return script


def _not_json(req, out):
    out.send(200, {"Content-Type": "application/json"}, b"<html>" + b"x" * 1000)


def _many_containers(req, out):
    body = b"[" + b"[]," * (4 * MiB // 3 - 2) + b"[]]"  # within the cap, as many lists as fit
    out.send(200, {"Content-Type": "application/json"}, body)


def _refs_only(script):
    """SCRIPT answers the refs request; the rest of the API is honest."""
    def api(req, out):
        if req.path.endswith("/refs"):
            script(req, out)
            return True
        return False
    return api


def _pages_forever(req, out):
    if req.path.startswith(f"/api/models/{REPO}/tree/"):
        n = int(req.query.rsplit("=", 1)[-1]) if "cursor=" in req.query else 0
        out.send(200, {"Content-Type": "application/json",
                       "Link": f'<http://{req.headers["host"]}{req.path}?cursor={n + 1}>; rel="next"'}, b"[]")
        return True
    return False


HUB_API = {
    "endless chunked body": (_refs_only(_endless), r"more than 4 MiB as a Hub API answer"),
    "Content-Length of 10 GB": (_refs_only(_announced_10_gb), r"announced 10737418240 bytes"),
    "body trickled past the deadline": (_refs_only(_trickled_body), r"did not finish its answer within MM_NET_DEADLINE"),
    "headers trickled (slowloris)": (_refs_only(_slowloris_headers), r"did not finish its answer within MM_NET_DEADLINE"),
    "a 200 KB header line": (_refs_only(_huge_header), r"cannot reach the Hub|refus"),
    "gzip bomb": (_refs_only(_gzip_bomb), r"Content-Encoding 'gzip'.*refused"),
    "endless redirect chain": (_refs_only(_redirect_forever), r"redirected more than 5 times"),
    "redirect to file://": (_refs_only(_redirect_to("file:///etc/passwd")), r"file:///etc/passwd.*not an http\(s\) URL"),
    "redirect to http://[::1": (_refs_only(_redirect_to("http://[::1")), r"not an http\(s\) URL"),
    "not JSON": (_refs_only(_not_json), r"not a Hub API answer"),
    "tree pages forever": (_pages_forever, r"more requests than mm allows for the file listing"),
}


@pytest.mark.parametrize("case", list(HUB_API))
def test_fetch_refuses_a_hostile_hub_api_answer(harness, weights, case):
    api, message = HUB_API[case]
    with HostileServer(hub(weights, api=api)) as server:
        got = fetch(harness, server)
    expect(got, 4, message)
    assert not harness.dest.exists() or not any((harness.dest / ".mm" / "partial").glob("*.part"))


def test_fetch_refuses_an_api_answer_of_a_million_tiny_lists_within_its_byte_cap(harness, weights):
    with HostileServer(hub(weights, api=_refs_only(_many_containers))) as server:
        got = fetch(harness, server)
    expect(got, 4, r"more than 250000 JSON arrays and objects")


# File bytes (resolve, or the CDN it redirects to)

def _short_ignoring_range(req, out, data):
    out.send(200, {}, data[:-1000], length=len(data) - 1000)


def _short_then_cut(req, out, data):
    out.head(200, {"Content-Length": str(len(data))})
    out.body(data[:-1000])


def _content_range(value: str | None):
    def script(req, out, data):
        headers = {} if value is None else {"Content-Range": value.replace("N", str(len(data)))}
        out.send(206, headers, data[:1024])
    return script


def _length_lie(req, out, data):
    out.send(200, {}, data, length=len(data) + 12345)


def _earlier_206(req, out, data):
    """Every Range answered from 1000 bytes before it (honest about it): overlapping ranges."""
    span = asked(req, len(data))
    first, last = (0, len(data) - 1) if span is None else (max(0, span[0] - 1000), span[1])
    out.send(206, {"Content-Range": f"bytes {first}-{last}/{len(data)}"}, data[first:last + 1])


def _longer_than_said(req, out, data):
    """206 bodies that go on past their Content-Range (and a 200 past the file): mm reads no further."""
    span = asked(req, len(data)) or (0, len(data) - 1)
    out.head(206, {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}", "Transfer-Encoding": "chunked"})
    piece = data[span[0]:span[1] + 1] + b"\0" * MiB
    out.body(b"%x\r\n" % len(piece) + piece + b"\r\n")
    out.stall(5)


def _endless_right_bytes(req, out, data):
    """The file's bytes, chunked, then garbage forever: mm stops at the end of the file."""
    span = asked(req, len(data)) or (0, len(data) - 1)
    out.head(206, {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}", "Transfer-Encoding": "chunked"})
    piece = data[span[0]:span[1] + 1]
    out.body(b"%x\r\n" % len(piece) + piece + b"\r\n")
    frame = b"10000\r\n" + b"\xee" * 65536 + b"\r\n"
    while True:
        out.body(frame)


def _first_answer(bad: Callable):
    """BAD for the first request of the file, honest after."""
    seen = []

    def script(req, out, data):
        seen.append(req)
        (bad if len(seen) == 1 else honest)(req, out, data)
    return script


def _trickle(req, out, data):
    """The right bytes, one every 5 s."""
    span = asked(req, len(data)) or (0, len(data) - 1)
    out.head(206, {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}"})
    out.trickle(data[span[0]:span[1] + 1], 5)


def _trickle_fast(req, out, data):
    span = asked(req, len(data)) or (0, len(data) - 1)
    out.head(206, {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}",
                   "Content-Length": str(span[1] - span[0] + 1)})
    out.trickle(data[span[0]:span[1] + 1], 0.3)


def _stall(req, out, data):
    out.head(200, {"Content-Length": str(len(data))})
    out.stall(5)


def _bytes_slowloris(req, out, data):
    out.raw(b"HTTP/1.1 200 OK\r\n")
    out.trickle(b"X-Slow: " + b"a" * 1000, 0.2)


def _bytes_huge_header(req, out, data):
    out.raw(b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 200_000 + b"\r\n\r\n")


def _bytes_gzip(req, out, data):
    out.send(200, {"Content-Encoding": "gzip"}, gzip.compress(data))


def _cdn_redirect(location: str):
    def script(req, out, data):
        out.send(302, {"Location": location})
    return script


def _cdn_forever(req, out, data):
    out.send(302, {"Location": f"/cdn/{time.monotonic_ns()}"})


FILE_BYTES_FAIL = {
    "ignores Range, every body 1,000 bytes short": (_short_ignoring_range, r"answers wrongly|failed attempts in a row"),
    "body cut 1,000 bytes short of its Content-Length": (_short_then_cut, r"answers wrongly|failed attempts in a row"),
    "206 with Content-Range: bytes banana": (_content_range("bytes banana"), r"bytes banana.*none of its bytes kept"),
    "206 with Content-Range: bytes */N": (_content_range("bytes */N"), r"bytes \*/\d+.*none of its bytes kept"),
    "206 without Content-Range": (_content_range(None), r"no Content-Range.*none of its bytes kept"),
    "206 whose Content-Range names another size": (_content_range("bytes 0-1023/999999999"), r"none of its bytes kept"),
    "200 whose Content-Length lies": (_length_lie, r"Content-Length \d+ for a file of"),
    "trickle that never speeds up": (_trickle_fast, r"less than MM_NET_MIN_RATE"),
    "redirect to file://": (_cdn_redirect("file:///etc/passwd"), r"not an http\(s\) URL"),
    "redirect to http://[::1": (_cdn_redirect("http://[::1"), r"not an http\(s\) URL"),
    "endless redirect chain": (_cdn_forever, r"more than 5 redirects"),
    "gzip Content-Encoding on the bytes": (_bytes_gzip, r"Content-Encoding 'gzip'"),
    "a 200 KB header line": (_bytes_huge_header, r"headers mm refuses"),
}


@pytest.mark.parametrize("case", list(FILE_BYTES_FAIL))
def test_fetch_fails_a_file_whose_server_answers_wrongly_and_records_nothing_unproven(harness, weights, case):
    resolve, message = FILE_BYTES_FAIL[case]
    with HostileServer(hub(weights, resolve=resolve)) as server:
        got = fetch(harness, server)
        asked_for = [r for r in server.requests if not r.path.startswith("/api/")]
    expect(got, 4, message)
    assert len(asked_for) <= 2 * 3 + 64  # the file's request budget: twice its 3 planned ranges, plus 64
    for start, end in recorded(harness):  # only proven bytes are recorded, and they are the file's
        assert (harness.dest / ".mm" / "partial").glob("*.part")
        part = next((harness.dest / ".mm" / "partial").glob("*.part")).read_bytes()
        assert part[start:end] == weights[start:end]


FILE_BYTES_RECOVER = {
    "overlapping 206s (each from 1,000 bytes earlier)": (_earlier_206, 12),
    "206 bodies longer than their Content-Range": (_longer_than_said, 12),
    "endless chunked body after the right bytes": (_endless_right_bytes, 12),
    "a trickle of 1 byte every 5 s, then honest": (_first_answer(_trickle), 15),
    "headers then silence, then honest": (_first_answer(_stall), 12),
    "headers trickled (slowloris), then honest": (_first_answer(_bytes_slowloris), 12),
    "a bad Content-Range once, then honest": (_first_answer(_content_range("bytes banana")), 12),
}


@pytest.mark.parametrize("case", list(FILE_BYTES_RECOVER))
def test_fetch_gets_the_right_bytes_past_a_server_that_misbehaves_then_behaves(harness, weights, case):
    resolve, deadline = FILE_BYTES_RECOVER[case]
    with HostileServer(hub(weights, resolve=resolve)) as server:
        got = fetch(harness, server, deadline, "--connections", "1")
        connections = server.connections
    assert got.code == 0, got.text
    assert (harness.dest / BIG).read_bytes() == weights
    if case.startswith(("a trickle", "headers")):
        assert connections >= 4  # refs, tree, the bad answer, a fresh connection for the retry


def test_a_206_that_proves_nothing_is_never_written_at_offset_0_nor_recorded(harness, weights):
    with HostileServer(hub(weights, resolve=_content_range("bytes banana"))) as server:
        got = fetch(harness, server, 25)
    assert got.code == 4
    assert recorded(harness) == []
    part = next((harness.dest / ".mm" / "partial").glob("*.part"))
    assert part.read_bytes().strip(b"\0") == b""  # nothing of the answer landed anywhere


# --- a registry, for pull / inspect / push ------------------------------------------------------------

@dataclass
class Artifact:
    tag: str
    manifest: bytes
    blobs: dict[str, bytes]  # digest -> bytes
    files: dict[str, bytes]  # path -> bytes
    model_dir: Path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Artifact:
    """A small model as mm pushes it (modelpack.build): one 3 MiB safetensors file and config.json."""
    model = tmp_path_factory.mktemp("hostile-artifact") / "model"
    model.mkdir()
    files = {BIG: _tensor_bytes(model.parent, 3 * MiB, seed=23), "config.json": b'{"model_type": "test"}\n'}
    entries = []
    for path, data in files.items():
        (model / path).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        entries.append(FileEntry(path, len(data), blake3.blake3(data).hexdigest(), sha, Upstream("lfs-sha256", sha),
                                 "local"))
    manifest = Manifest("hostile/model", COMMIT, tuple(entries))
    write_manifest(manifest, manifest_path(model))
    art = modelpack.build(model, manifest, to_json(manifest).encode(), {})
    blobs = {art.config_digest: art.config, **{layer.digest: files[layer.path] for layer in art.layers
                                                 if layer.path in files}}
    mm_layer = next(layer for layer in art.layers if layer.media_type == modelpack.MM_MANIFEST)
    blobs[mm_layer.digest] = art.mm_manifest
    return Artifact("v1", art.manifest, blobs, files, model)


def registry(art: Artifact, **overrides: Callable) -> Callable[[Request, Out], None]:
    """A registry serving ART as hostile/model:v1. OVERRIDES by kind: ping, manifest, config, blob (the big file's),
    upload, token; each called as (req, out) and answering instead of the honest registry."""
    big = next(d for d, b in art.blobs.items() if b == art.files[BIG])
    config = json.loads(art.manifest)["config"]["digest"]

    def script(req: Request, out: Out) -> None:
        path = req.path
        kind = ("ping" if path == "/v2/" else "token" if path == "/token" else
                "manifest" if "/manifests/" in path else "upload" if "/blobs/uploads/" in path else
                "config" if path.endswith(config) else "blob" if path.endswith(big) else "other")
        if kind in overrides:
            return overrides[kind](req, out)
        if kind == "ping":
            out.send(200, {"Content-Type": "application/json"}, b"{}")
        elif kind == "manifest":
            if req.method == "PUT":
                out.send(201, {"Docker-Content-Digest": "sha256:" + hashlib.sha256(req.body).hexdigest()})
            else:
                out.send(200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, art.manifest)
        elif kind == "upload":
            out.send(202, {"Location": "/v2/hostile/model/blobs/uploads/u1?state=x", "Range": "0-0"})
        elif path.startswith("/v2/hostile/model/blobs/sha256:"):
            digest = path.rsplit("/", 1)[-1]
            data = art.blobs.get(digest)
            if data is None:
                out.send(404, {}, b"")
            elif req.method == "HEAD":
                out.send(200, {}, b"", length=len(data))
            else:
                honest(req, out, data)
        else:
            out.send(404, {}, b"")

    return script


def pull(h: Harness, server: HostileServer, deadline: float = 12, ref: str | None = None) -> Outcome:
    return h.run("pull", ref or f"{server.host}/hostile/model:v1", "--local-dir", h.dest, deadline=deadline)


def inspect(h: Harness, server: HostileServer, deadline: float = 12) -> Outcome:
    return h.run("inspect", f"{server.host}/hostile/model:v1", deadline=deadline)


def push(h: Harness, server: HostileServer, art: Artifact, deadline: float = 12) -> Outcome:
    return h.run("push", art.model_dir, f"{server.host}/hostile/model:v1", deadline=deadline)


def _challenge(realm: str):
    def script(req, out):
        out.send(401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="x"', "Content-Type": "application/json"},
                 b'{"errors": []}')
    return script


def _token_then(script):
    """A registry that wants a token from its own /token, which SCRIPT answers."""
    return {"ping": lambda req, out: _challenge(f"http://{req.headers['host']}/token")(req, out), "token": script}


def _error_endless(req, out):
    out.endless(status=500, headers={"Content-Type": "application/json"})


REGISTRY_DOCS = {
    "ping: endless chunked body": ({"ping": _endless}, r"more than 64 KiB as its /v2/ answer"),
    "ping: headers trickled (slowloris)": ({"ping": _slowloris_headers}, r"did not finish its answer within"),
    "ping: a 200 KB header line": ({"ping": _huge_header}, r"cannot reach the registry"),
    "ping: realm that is not a URL": ({"ping": _challenge("banana")}, r"'banana'.*not an http\(s\) URL"),
    "ping: realm file://": ({"ping": _challenge("file:///etc/passwd")}, r"not an http\(s\) URL"),
    "ping: realm http://[::1": ({"ping": _challenge("http://[::1")}, r"not an http\(s\) URL"),
    "token: endless chunked body": (_token_then(_endless), r"more than 1 MiB as a token answer"),
    "token: body trickled past the deadline": (_token_then(_trickled_body), r"did not finish its answer within"),
    "token: gzip bomb": (_token_then(_gzip_bomb), r"Content-Encoding 'gzip'"),
    "manifest: endless chunked body": ({"manifest": _endless}, r"more than 4 MiB as a manifest"),
    "manifest: Content-Length of 10 GB": ({"manifest": _announced_10_gb}, r"announced 10737418240 bytes"),
    "manifest: error answer without end": ({"manifest": _error_endless}, r"more than 64 KiB as an error answer"),
    "manifest: body trickled past the deadline": ({"manifest": _trickled_body}, r"did not finish its answer within"),
    "manifest: gzip bomb": ({"manifest": _gzip_bomb}, r"Content-Encoding 'gzip'"),
    "manifest: a million tiny lists within the cap": ({"manifest": _many_containers}, r"more than 250000 JSON"),
    "config blob: endless": ({"config": lambda req, out: out.endless(chunked=False)}, r"more than 4 MiB as a small blob"),
    "config blob: redirect to file://": ({"config": _redirect_to("file:///etc/passwd")}, r"not an http\(s\) URL"),
}


INSPECT_TOO = ("ping: endless chunked body", "ping: realm that is not a URL", "manifest: endless chunked body",
               "config blob: endless")  # inspect reads the same documents through the same client as pull


@pytest.mark.parametrize("command,case", [("pull", c) for c in REGISTRY_DOCS] + [("inspect", c) for c in INSPECT_TOO])
def test_pull_and_inspect_refuse_a_hostile_registry_document(harness, artifact, case, command):
    overrides, message = REGISTRY_DOCS[case]
    with HostileServer(registry(artifact, **overrides)) as server:
        got = (pull if command == "pull" else inspect)(harness, server)
    assert got.code in (3, 4), got.text  # 3: a document that parses but is not a manifest
    assert re.search(message, got.stderr), got.stderr
    assert not (harness.dest / BIG).exists()


PUSH_CASES = {
    "ping: endless chunked body": ({"ping": _endless}, r"more than 64 KiB as its /v2/ answer"),
    "ping: realm that is not a URL": ({"ping": _challenge("banana")}, r"not an http\(s\) URL"),
    "token: endless chunked body": (_token_then(_endless), r"more than 1 MiB as a token answer"),
    "upload: Location file://": ({"upload": lambda req, out: out.send(202, {"Location": "file:///tmp/mm-hostile-upload"})},
                                 r"file:///tmp/mm-hostile-upload.*not an http\(s\) URL"),
    "upload: Location http://[::1": ({"upload": lambda req, out: out.send(202, {"Location": "http://[::1"})},
                                     r"not an http\(s\) URL"),
    "upload: answer without end": ({"upload": _error_endless}, r"more than 64 KiB as an error answer"),
}


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_push_refuses_a_hostile_registry(harness, artifact, case):
    overrides, message = PUSH_CASES[case]
    with HostileServer(registry(artifact, **overrides)) as server:
        got = push(harness, server, artifact)
    expect(got, 4, message)
    assert not Path("/tmp/mm-hostile-upload").exists()


# Blobs through the ranged engine

def _short_blob_then_empty_206(req, out, data):
    span = asked(req, len(data))
    if span is None:
        out.send(200, {}, data[:len(data) // 2], length=len(data))  # cut half-way
    else:
        out.send(206, {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}"}, b"", length=0)


def _blob_requests(server: HostileServer, art: Artifact) -> int:
    big = "sha256:" + hashlib.sha256(art.files[BIG]).hexdigest()
    return sum(r.path.endswith(big) and r.method == "GET" for r in server.requests)


def _blob_script(art: Artifact, resolve: Callable):
    data = art.files[BIG]
    return lambda req, out: resolve(req, out, data)


PULL_BLOB_FAIL = {
    "short blob, then empty 206s": (_short_blob_then_empty_206, r"answers wrongly|failed attempts in a row|none of its bytes kept"),
    "ignores Range, every body 1,000 bytes short": (_short_ignoring_range, r"answers wrongly|failed attempts in a row"),
    "206 with Content-Range: bytes banana": (_content_range("bytes banana"), r"bytes banana.*none of its bytes kept"),
    "206 without Content-Range": (_content_range(None), r"no Content-Range.*none of its bytes kept"),
    "redirect to file://": (_cdn_redirect("file:///etc/passwd"), r"not an http\(s\) URL"),
    "trickle that never speeds up": (_trickle_fast, r"less than MM_NET_MIN_RATE"),
}


@pytest.mark.parametrize("case", list(PULL_BLOB_FAIL))
def test_pull_fails_a_blob_whose_registry_answers_wrongly(harness, artifact, case):
    resolve, message = PULL_BLOB_FAIL[case]
    with HostileServer(registry(artifact, blob=_blob_script(artifact, resolve))) as server:
        got = pull(harness, server)
        blob_requests = _blob_requests(server, artifact)
    expect(got, 4, message)
    assert blob_requests <= 2 * 3 + 64  # the file's request budget: twice its 3 planned ranges, plus 64
    assert not (harness.dest / BIG).exists()


@pytest.mark.parametrize("case", [c for c in PULL_BLOB_FAIL if "trickle" not in c])  # (the rate cut is _land's,
# for every source alike: its 5 s are spent once, above)
def test_pull_fails_a_blob_whose_mirror_answers_wrongly_within_the_same_bounds(harness, artifact, case):
    resolve, message = PULL_BLOB_FAIL[case]
    with HostileServer(registry(artifact, blob=_blob_script(artifact, resolve))) as server:
        got = harness.run("pull", "127.0.0.1:9/hostile/model:v1", "--local-dir", harness.dest, "--mirror",
                          server.host, "--no-fallback", deadline=12)  # (the mirror, one stream per blob, is all)
        blob_requests = _blob_requests(server, artifact)
    expect(got, 4, message)
    assert blob_requests <= 2 * 1 + 64  # the file's request budget: twice its 1 planned stream, plus 64
    assert not (harness.dest / BIG).exists()


def _resume_answer(shift: int | None):
    """A Range request answered 206 from SHIFT bytes off the offset asked (None: no Content-Range at all)."""
    def script(req, out, data):
        span = asked(req, len(data))
        if span is None:
            return honest(req, out, data)
        if shift is None:
            return out.send(206, {}, data[span[0]:span[1] + 1])
        first = max(0, min(len(data) - 1, span[0] + shift))
        out.send(206, {"Content-Range": f"bytes {first}-{span[1]}/{len(data)}"}, data[first:span[1] + 1])
    return script


@pytest.mark.parametrize("shift,code", [(-4096, 0), (4096, 0), (None, 4)], ids=["earlier", "later", "missing"])
def test_pull_resumed_with_a_206_from_another_offset_ends_right_or_bounded(harness, artifact, shift, code):
    data = artifact.files[BIG]
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    partial = harness.dest / ".mm" / "partial"
    partial.mkdir(parents=True)
    (partial / f"{digest[7:]}.part").write_bytes(data[:MiB])  # a killed pull's prefix
    with HostileServer(registry(artifact, blob=_blob_script(artifact, _resume_answer(shift)))) as server:
        got = pull(harness, server)
        blob_requests = _blob_requests(server, artifact)
    assert got.code == code, got.text
    assert blob_requests <= 2 * 2 + 64
    if code == 0:
        assert (harness.dest / BIG).read_bytes() == data
    else:
        assert re.search(r"no Content-Range", got.stderr), got.stderr
        assert recorded(harness) == [[0, MiB]]


def test_pull_gets_the_right_bytes_past_a_trickle_then_an_honest_registry(harness, artifact):
    with HostileServer(registry(artifact, blob=_blob_script(artifact, _first_answer(_trickle)))) as server:
        got = pull(harness, server, 15)
    assert got.code == 0, got.text
    assert (harness.dest / BIG).read_bytes() == artifact.files[BIG]


# --- passwords in references ---------------------------------------------------------------------------

@pytest.mark.parametrize("command,json_out", [("pull", False), ("inspect", False), ("push", False), ("pull", True)])
def test_a_password_in_a_reference_is_never_printed(harness, artifact, command, json_out):
    ref = f"robot:{PASSWORD}@127.0.0.1:9/hostile/model:v1"
    args = {"pull": ("pull", ref, "--local-dir", harness.dest), "inspect": ("inspect", ref),
            "push": ("push", artifact.model_dir, ref)}[command]
    got = harness.run(*args, *(["--json"] if json_out else []), deadline=10)
    assert got.code == 3, got.text
    assert PASSWORD not in got.text and "robot" not in got.text
    assert "holds no credentials" in got.stderr
    if json_out:
        assert json.loads(got.stdout)["exit_code"] == 3


def test_a_password_in_a_url_reference_is_never_printed(harness):
    got = harness.run("pull", f"https://robot:{PASSWORD}@127.0.0.1:9/hostile/model:v1", "--local-dir", harness.dest,
                      deadline=10)
    assert got.code == 3 and PASSWORD not in got.text, got.text


def test_redact_hides_the_credentials_of_a_reference_in_any_line_mm_prints():
    from mm.artifacts.edges.untrusted import redact
    assert redact(f"mm: robot:{PASSWORD}@reg.site:5000/models/x:tag: refused") == "mm: ***@reg.site:5000/models/x:tag: refused"
    assert redact(f"pulling http://robot:{PASSWORD}@reg.site/x") == "pulling http://reg.site/x"
    assert redact("sha256:abc@def and mail a@b.c") == "sha256:abc@def and mail a@b.c"  # nothing else touched


def test_fetch_through_the_proxy_http_proxy_names_takes_the_api_and_the_bytes_through_it(harness, weights):
    from tests.support.hostile import ForwardProxy
    with HostileServer(hub(weights)) as server, ForwardProxy() as proxy:
        got = harness.run("fetch", REPO, "--revision", "main", "--local-dir", harness.dest, deadline=15,
                          env={"HF_ENDPOINT": server.url, "HTTP_PROXY": proxy.url, "NO_PROXY": ""})
    assert got.code == 0, got.text
    assert (harness.dest / BIG).read_bytes() == weights
    assert any("/api/" in u for u in proxy.requests) and any("/resolve/" in u for u in proxy.requests)


# --- a ModelScope mirror, for mirror reconcile and fetch --source modelscope ---------------------------------
# The real modelscope SDK lists the mirror over `requests`; mm mounts its bounds on the SDK's sessions
# (wire.bound_session). The mirror is tests/support/msserver.py made hostile (MSServer.misbehave); the pin comes
# from a manifest (--pin-manifest), so the Hub is never asked.

MS_ID = "hostile/mirror"
MIRROR_CASES = {  # (endpoint, how): what the one line says
    ("files", "endless"): r"ModelScope at http://127\.0\.0\.1:\d+ sent more than 4 MiB as a ModelScope API answer",
    ("files", "slowloris"): r"ModelScope at http://127\.0\.0\.1:\d+ did not finish its answer within MM_NET_DEADLINE",
    ("files", "million"): r"ModelScope at http://127\.0\.0\.1:\d+ sent more than 4 MiB",
    ("files", "million-tiny"): r"ModelScope at http://127\.0\.0\.1:\d+ sent more than 250000 JSON arrays and objects",
    ("files", "not-json"): r"cannot list files: http://127\.0\.0\.1:\d+ sent an answer that is not JSON",
    ("files", "nested"): r"http://127\.0\.0\.1:\d+ sent an answer that is not what the ModelScope API sends",
    ("files", "wrong-shape"): r"cannot list files: http://127\.0\.0\.1:\d+ sent an answer that is not what the "
                              r"ModelScope API sends",
    ("files", "bad-entry"): r"cannot list files: http://127\.0\.0\.1:\d+ sent a listing entry that is not a file's "
                            r"path, size and sha256 \(\('a\\x1b\[2Jb', -5, ''\)\); refused",
    ("revisions", "endless"): r"branches and tags: ModelScope at http://127\.0\.0\.1:\d+ sent more than 4 MiB",
    ("revisions", "wrong-shape"): r"branches and tags: http://127\.0\.0\.1:\d+ sent an answer that is not what the "
                                  r"ModelScope API sends",
}


@pytest.fixture(scope="module")
def pin_manifest(tmp_path_factory, weights) -> Path:
    """A manifest of REPO at COMMIT holding BIG: the pin's identities without the Hub."""
    sha = hashlib.sha256(weights).hexdigest()
    path = tmp_path_factory.mktemp("hostile-pin") / "manifest.json"
    write_manifest(Manifest(REPO, COMMIT, (FileEntry(BIG, len(weights), blake3.blake3(weights).hexdigest(), sha,
                                                     Upstream("lfs-sha256", sha), "hub"),)), path)
    return path


def mirror_env(h: Harness, server) -> dict[str, str]:
    """The SDK pointed at SERVER, its home and cache under the target (mm's business, not the sentinel's)."""
    return {"MODELSCOPE_ENDPOINT": server.url, "MODELSCOPE_HOME": str(h.dest / "ms-home"),
            "MODELSCOPE_CACHE": str(h.dest / "ms-cache"), "MODELSCOPE_DOWNLOAD_INTRA_CLOUD": "false"}


@pytest.mark.parametrize("endpoint,how", list(MIRROR_CASES), ids=[f"{e} {h}" for e, h in MIRROR_CASES])
def test_mirror_reconcile_refuses_a_hostile_modelscope_answer(harness, pin_manifest, endpoint, how):
    from tests.support.msserver import MSServer
    with MSServer() as server:
        server.add_revision(MS_ID, "master", {BIG: b"x"})
        server.misbehave(endpoint, how)
        got = harness.run("mirror", "reconcile", REPO, "--revision", COMMIT, "--modelscope-id", MS_ID,
                          "--pin-manifest", pin_manifest, *(["--all-revisions"] if endpoint == "revisions" else []),
                          deadline=15, env=mirror_env(harness, server))
    expect(got, 4, MIRROR_CASES[endpoint, how])


@pytest.mark.parametrize("how", ["endless", "slowloris"])
def test_fetch_from_a_hostile_modelscope_mirror_ends_in_one_line_and_fetches_nothing(harness, pin_manifest, how):
    from tests.support.msserver import MSServer
    with MSServer() as server:
        server.add_revision(MS_ID, "master", {BIG: b"x"})
        server.misbehave("files", how)
        got = harness.run("fetch", REPO, "--revision", COMMIT, "--local-dir", harness.dest, "--source",
                          f"modelscope:{MS_ID}", "--mirror-only", "--pin-manifest", pin_manifest, deadline=15,
                          env=mirror_env(harness, server))
    expect(got, 4, MIRROR_CASES["files", how])
    assert not (harness.dest / BIG).exists()


# --- a hostile tier, for preheat ------------------------------------------------------------------------------

def _whole_flipped(req, out, data):
    """A cold tier's answer (the whole blob to a Range request) with one byte changed."""
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    out.send(200, {}, bytes(bad))


def _whole_then_garbage(req, out, data):
    """The whole blob to a Range request, chunked, then garbage forever: preheat stops at the blob's size."""
    out.head(200, {"Transfer-Encoding": "chunked"})
    out.body(b"%x\r\n" % len(data) + data + b"\r\n")
    frame = b"10000\r\n" + b"\xee" * 65536 + b"\r\n"
    while True:
        out.body(frame)


PREHEAT_TIER = {
    "the whole blob with one byte changed": (_whole_flipped, 5, r"do not match the blob's digest"),
    "206 with Content-Range: bytes banana": (_content_range("bytes banana"), 4, r"Content-Range 'bytes banana'"),
    "a 200 whose Content-Length lies": (_length_lie, 4, r"answered with \d+ bytes for a blob of"),
    "ignores Range, every body 1,000 bytes short": (_short_ignoring_range, 4, r"answered with \d+ bytes for a blob"),
    "the whole blob, then garbage forever": (_whole_then_garbage, 0, r""),
}


@pytest.mark.parametrize("case", list(PREHEAT_TIER))
def test_preheat_checks_what_a_hostile_tier_sends_and_stays_bounded(harness, artifact, case):
    resolve, code, message = PREHEAT_TIER[case]
    with HostileServer(registry(artifact)) as origin, \
            HostileServer(registry(artifact, blob=_blob_script(artifact, resolve))) as tier:
        got = harness.run("preheat", f"{origin.host}/hostile/model:v1", "--tier", tier.host, deadline=20)
    expect(got, code, message)


def _never_stored(req, out, data):
    """A cache that never keeps what it fetches: every GET, the conditional one-byte look included, answered as a
    pull-through cache answers a miss (distribution's copyContent: 200, the whole blob, an unquoted Etag)."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    out.send(200, {"Etag": digest, "Docker-Content-Digest": digest}, data)


def _silent_to_looks(req, out, data):
    """The whole blob to the preheat's read; nothing at all to a look (a conditional GET)."""
    if "if-none-match" in req.headers:
        return out.stall(60)
    _never_stored(req, out, data)


NEVER_STORES = {"answers every look from its upstream": (_never_stored, "from its upstream (200"),
                "says nothing to a look": (_silent_to_looks, "did not send its answer's headers within")}


@pytest.mark.parametrize("case", list(NEVER_STORES))
def test_preheat_waits_for_a_tier_that_never_stores_only_until_its_deadline_and_says_so(harness, artifact, case):
    resolve, why = NEVER_STORES[case]
    with HostileServer(registry(artifact)) as origin, \
            HostileServer(registry(artifact, blob=_blob_script(artifact, resolve))) as tier:
        got = harness.run("preheat", f"{origin.host}/hostile/model:v1", "--tier", tier.host, "--json", deadline=20)
        looks = sum("if-none-match" in r.headers for r in tier.requests)
    assert got.code == 0, got.text  # a warning: every byte that passed was proven
    [t] = json.loads(got.stdout)["tiers"]
    [big] = [b for b in t["blobs"] if b["status"] == "fetched"]
    assert (t["fetched"], t["stored"], t["not_stored"]) == (1, 0, 1)
    assert big["stored"] is False and why in big["not_stored"] and big["looks"] == looks >= 2
    # the deadline: STORE_FLOOR (2 s) plus three times the read, then at most STORE_FIRST (0.2 s) for a last look
    assert 2.0 <= t["waited"] < 2.0 + 3 * big["read_seconds"] + 1.0


def test_ctrl_c_while_preheat_waits_for_a_tier_to_store_stops_it_at_once(harness, artifact):
    with HostileServer(registry(artifact)) as origin, \
            HostileServer(registry(artifact, blob=_blob_script(artifact, _never_stored))) as tier:
        proc = subprocess.Popen(mm_argv("preheat", f"{origin.host}/hostile/model:v1", "--tier", tier.host),
                                env=harness.env, cwd=harness.tmp / "work", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 15
        while not any("if-none-match" in r.headers for r in tier.requests):  # the wait has begun
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    assert (proc.returncode, err.strip()) == (130, "mm: interrupted by SIGINT")
    assert time.monotonic() - sent < 2.0  # tests/test_interrupt.py's limit on a loaded machine (the goal: 1 s)
