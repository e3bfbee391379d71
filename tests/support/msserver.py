"""A local ModelScope API server on 127.0.0.1 that the real `modelscope` SDK (1.40 / modelscope-hub 0.5) talks to.

It speaks the endpoints and response shapes the SDK calls (read from modelscope_hub/_legacy_api.py,
_download.py, _openapi.py):

  GET  /api/v1/models/{owner}/{name}/revisions            {"Data": {"RevisionMap": {"Branches": [...], "Tags": [...]}}}
  GET  /api/v1/models/{owner}/{name}/repo/files?Revision=&Recursive=&Root=
                                                          {"Data": {"Files": [{Path, Name, Type, Size, Sha256, IsLFS, ...}]}}
  GET|HEAD /api/v1/models/{owner}/{name}/repo?Revision=&FilePath=   the bytes; Range -> 206 + Content-Range
  GET  /openapi/v1/models/{owner}/{name}                  {"success": true, "data": {...}}

Legacy responses are wrapped as {"Code": 200, "Data": ..., "Success": true, "Message": "success"}.
Tests shape the mirror per case: revisions made from a directory (e.g. tests.support.modelgen.write_model)
or from {path: bytes}, bytes served that differ from what the listing promises, a listing that fails
(HTTP status) or answers 200 with Success:false (which the SDK reads as an empty list), downloads that
break at a byte offset, and a hostile mirror (`misbehave`: an endless listing, headers trickled, a listing of a
million entries, an answer that is not JSON or not the shape the SDK expects). Every request is recorded
(`requests`, `downloads(path)`).

CLI (e.g. for a demo): `python -m tests.support.msserver --model-id OWNER/NAME --dir DIR` prints
MS_URL=http://127.0.0.1:PORT and serves DIR as branch master until SIGTERM.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_THRESHOLD = 10 * 1024 * 1024  # ModelScope stores larger files in LFS; only reported, never relied on
LISTING_CAP = 3000  # repo/files silently truncates here; the SDK then walks the tree with Root=<dir>


@dataclass
class Revision:
    files: dict[str, bytes]
    kind: str = "branch"  # "branch" | "tag"
    created_at: int = 0
    commit: str = ""


@dataclass
class Repo:
    model_id: str
    revisions: dict[str, Revision] = field(default_factory=dict)
    # (revision, path) -> bytes served instead of the listed ones (a lying mirror)
    served_instead: dict[tuple[str, str], bytes] = field(default_factory=dict)
    # None, "success-false" (200 with Success:false), or an HTTP status int for the listing endpoint;
    # for every revision, or per revision in failing_revisions
    listing_failure: object = None
    failing_revisions: dict[str, object] = field(default_factory=dict)
    # path -> byte offset at which every download of it drops the connection (a transfer that keeps breaking)
    cut_at: dict[str, int] = field(default_factory=dict)
    # path -> byte offset at which the next download of it falls silent until the client hangs up (once)
    stall_at: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    range: str | None
    host: str


class MSServer:
    """Owns the repos and the HTTP server thread. Use as a context manager or call start()/stop()."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.hostile: dict[str, str] = {}  # endpoint -> a key of HOSTILE (misbehave)
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- shaping the mirror --------------------------------------------------------------------
    def add_revision(self, model_id: str, revision: str, content: Path | dict[str, bytes], *,
                     kind: str = "branch", created_at: int | None = None) -> Revision:
        """Serve CONTENT (a directory, or {path: bytes}) as branch or tag REVISION of MODEL_ID."""
        files = _read_tree(content) if isinstance(content, (str, Path)) else dict(content)
        repo = self.repos.setdefault(model_id, Repo(model_id))
        stamp = created_at if created_at is not None else int(time.time()) + len(repo.revisions)
        rev = Revision(files=files, kind=kind, created_at=stamp, commit=hashlib.sha1(
            json.dumps(sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items())).encode()).hexdigest())
        repo.revisions[revision] = rev
        return rev

    def serve_instead(self, model_id: str, revision: str, path: str, data: bytes) -> None:
        """Serve DATA for PATH while the listing keeps promising the original size and sha256."""
        self.repos[model_id].served_instead[(revision, path)] = data

    def cut_downloads(self, model_id: str, path: str, offset: int | None) -> None:
        """Drop the connection whenever a download of PATH reaches byte OFFSET (None: stop cutting)."""
        cuts = self.repos[model_id].cut_at
        cuts.pop(path, None) if offset is None else cuts.__setitem__(path, offset)

    def misbehave(self, endpoint: str, how: str) -> None:
        """Answer every request to ENDPOINT ("files": repo/files, "revisions") the hostile way HOW (a key of
        HOSTILE), for every repo, until the server stops."""
        assert endpoint in ("files", "revisions") and how in HOSTILE, (endpoint, how)
        self.hostile[endpoint] = how

    def stall_download(self, model_id: str, path: str, offset: int) -> None:
        """The next download of PATH sends its headers and the bytes before OFFSET, then nothing at all."""
        self.repos[model_id].stall_at[path] = offset

    def fail_listing(self, model_id: str, how: object, revision: str | None = None) -> None:
        """how: "success-false" (HTTP 200, Success:false, no files) or an HTTP status such as 404/500;
        for every revision, or only REVISION."""
        repo = self.repos.setdefault(model_id, Repo(model_id))
        if revision is None:
            repo.listing_failure = how
        else:
            repo.failing_revisions[revision] = how

    # -- observing -------------------------------------------------------------------------------
    def downloads(self, path: str | None = None) -> list[Request]:
        """File downloads (GET .../repo?FilePath=), optionally for one path."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/repo")
                and "FilePath" in r.query and (path is None or r.query["FilePath"] == path)]

    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "MSServer":
        server = self

        class Handler(_Handler):
            ms = server

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 64  # parallel fetch workers plus listing calls on a loaded machine

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="msserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "MSServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_tree(root: Path | str) -> dict[str, bytes]:
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).as_posix().startswith((".mm/", ".git/", ".cache/"))}


_MODEL_PATH = re.compile(r"^/api/v1/models/([^/]+)/([^/]+)(/.*)?$")
_OPENAPI_MODEL = re.compile(r"^/openapi/v1/models/([^/]+)/([^/]+)/?$")


class _Handler(BaseHTTPRequestHandler):
    ms: MSServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # keep pytest output clean
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def _parsed(self) -> tuple[str, dict[str, str]]:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        return unquote(parts.path), query

    def _send_json(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _ok(self, data: object) -> None:
        self._send_json(200, {"Code": 200, "Data": data, "Message": "success", "RequestId": uuid.uuid4().hex,
                              "Success": True})

    def _error(self, status: int, message: str, code: int | None = None) -> None:
        self._send_json(status, {"Code": code or status, "Data": None, "Message": message,
                                 "RequestId": uuid.uuid4().hex, "Success": False})

    # -- routing ---------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path, query = self._parsed()
        self.ms.record(Request(self.command, path, query, self.headers.get("Range"), self.headers.get("Host", "")))
        m = _OPENAPI_MODEL.match(path)
        if m:
            return self._repo_info(f"{m[1]}/{m[2]}")
        m = _MODEL_PATH.match(path)
        if not m:
            return self._error(404, f"no such endpoint {path}")
        repo = self.ms.repos.get(f"{m[1]}/{m[2]}")
        if repo is None:
            return self._error(404, f"model {m[1]}/{m[2]} not found", code=10010205001)
        tail = m[3] or ""
        how = self.ms.hostile.get({"/revisions": "revisions", "/repo/files": "files"}.get(tail, ""))
        if how is not None:
            return HOSTILE[how](self)
        if tail == "/revisions":
            return self._revisions(repo)
        if tail == "/repo/files":
            return self._files(repo, query)
        if tail == "/repo" and "FilePath" in query:
            return self._download(repo, query)
        return self._error(404, f"no such endpoint {path}")

    def _repo_info(self, model_id: str) -> None:
        if model_id not in self.ms.repos:
            return self._send_json(404, {"success": False, "code": "NotFound", "message": f"{model_id} not found"})
        owner, name = model_id.split("/", 1)
        self._send_json(200, {"success": True, "request_id": uuid.uuid4().hex, "data": {
            "id": model_id, "owner": owner, "name": name, "visibility": "public", "downloads": 0}})

    def _revisions(self, repo: Repo) -> None:
        def item(name: str, rev: Revision) -> dict:
            return {"Revision": name, "CreatedAt": rev.created_at, "CommitId": rev.commit, "Description": ""}

        branches = [item(n, r) for n, r in repo.revisions.items() if r.kind == "branch"]
        tags = [item(n, r) for n, r in repo.revisions.items() if r.kind == "tag"]
        self._ok({"RevisionMap": {"Branches": branches, "Tags": tags}})

    def _files(self, repo: Repo, query: dict[str, str]) -> None:
        name = query.get("Revision") or "master"
        failure = repo.failing_revisions.get(name, repo.listing_failure)
        if failure == "success-false":
            return self._send_json(200, {"Code": 10010205001, "Data": {}, "Message": "listing unavailable",
                                         "RequestId": uuid.uuid4().hex, "Success": False})
        if isinstance(failure, int):
            return self._error(failure, "listing failed")
        rev = repo.revisions.get(name)
        if rev is None:
            return self._error(404, f"revision {name} not found", code=10010205001)
        recursive = query.get("Recursive", "False").lower() == "true"
        root = (query.get("Root") or "").strip("/")
        self._ok({"Files": _listing(rev, name, root, recursive)[:LISTING_CAP]})

    def _download(self, repo: Repo, query: dict[str, str]) -> None:
        name = query.get("Revision") or "master"
        file_path = query["FilePath"]
        rev = repo.revisions.get(name)
        if rev is None or file_path not in rev.files:
            return self._error(404, f"file {file_path} not found at {name}", code=10010205001)
        data = repo.served_instead.get((name, file_path), rev.files[file_path])
        start = _range_start(self.headers.get("Range"))
        if start is not None and start >= len(data) and len(data) > 0:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if start is not None and len(data) > 0:
            body = data[start:]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if self.command == "HEAD":
            return
        stall = repo.stall_at.pop(file_path, None)
        if stall is not None:
            self.wfile.write(body[: max(0, stall - (start or 0))])
            self.wfile.flush()
            self.close_connection = True
            try:
                while self.connection.recv(65536):  # silent until the client hangs up
                    pass
            except OSError:
                pass
            return
        cut = repo.cut_at.get(file_path)
        if cut is not None:
            self.wfile.write(body[: max(0, cut - (start or 0))])
            self.wfile.flush()
            self.close_connection = True  # the rest of the promised Content-Length never comes
            return
        self.wfile.write(body)


# --- a hostile mirror: each answers a request its own way, until the client hangs up ---------------------

_ENTRY = b'{"Name": "f%d", "Path": "f%d", "Type": "blob", "Size": 1, "Sha256": "", "IsLFS": false, "Mode": "100644"}'


def _chunked(handler: _Handler, pieces) -> None:
    """A 200 whose chunked body is PIECES (an iterator of bytes), sent until it ends or the client leaves."""
    handler.close_connection = True
    try:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for piece in pieces:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        handler.wfile.write(b"0\r\n\r\n")
    except OSError:
        pass


def _endless(handler: _Handler) -> None:
    """A listing that starts right and never ends."""
    def pieces():
        yield b'{"Code": 200, "Success": true, "Data": {"Files": ['
        block = b",".join(_ENTRY % (i, i) for i in range(500)) + b","
        while True:
            yield block
    _chunked(handler, pieces())


def _million(handler: _Handler) -> None:
    """A well-formed listing of 1,000,000 files (about 100 MB)."""
    def pieces():
        yield b'{"Code": 200, "Success": true, "Data": {"Files": ['
        for start in range(0, 1_000_000, 1000):
            yield (b"," if start else b"") + b",".join(_ENTRY % (i, i) for i in range(start, start + 1000))
        yield b"]}}"
    _chunked(handler, pieces())


def _million_tiny(handler: _Handler) -> None:
    """A listing of 1,000,000 empty objects: about 3 MB, within any byte cap."""
    _chunked(handler, iter([b'{"Code": 200, "Success": true, "Data": {"Files": [', b",".join([b"{}"] * 1_000_000),
                            b"]}}"]))


def _slowloris(handler: _Handler) -> None:
    """The status line, then one byte of a header every 0.2 s."""
    handler.close_connection = True
    try:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while True:
            handler.wfile.write(b"a")
            time.sleep(0.2)
    except OSError:
        pass


def _fixed(body: bytes, content_type: str = "application/json"):
    def answer(handler: _Handler) -> None:
        handler.close_connection = True
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        except OSError:
            pass
    return answer


HOSTILE = {
    "endless": _endless,
    "slowloris": _slowloris,
    "million": _million,
    "million-tiny": _million_tiny,
    "not-json": _fixed(b"<html><body>" + b"x" * 1000 + b"</body></html>", "text/html"),
    "nested": _fixed(b"[" * 100_000 + b"]" * 100_000),  # within every cap; deeper than the JSON parser goes
    "bad-entry": _fixed(b'{"Code": 200, "Success": true, "Data": {"Files": [{"Path": "a\\u001b[2Jb", "Type": "blob", '
                        b'"Size": -5, "Sha256": ""}]}}'),  # a terminal escape in a path, a negative size
    "wrong-shape": _fixed(b'{"Code": 200, "Success": true, "Data": {"Files": [{"Path": ["x"], "Size": 1e999}], '
                          b'"RevisionMap": {"Branches": [{"Revision": {"$": 1}}], "Tags": 7}}}'),
}


def _range_start(header: str | None) -> int | None:
    m = re.match(r"^bytes=(\d+)-$", header or "")
    return int(m[1]) if m else None


def _listing(rev: Revision, revision: str, root: str, recursive: bool) -> list[dict]:
    """Entries as ModelScope returns them: blobs with Sha256, plus a tree entry for each directory."""
    prefix = f"{root}/" if root else ""
    entries: dict[str, dict] = {}
    for path, data in sorted(rev.files.items()):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix):]
        parts = rest.split("/")
        if len(parts) > 1:  # directories on the way
            upto = len(parts) - 1 if recursive else 1
            for i in range(1, upto + 1):
                d = prefix + "/".join(parts[:i])
                entries.setdefault(d, {"Name": parts[i - 1], "Path": d, "Type": "tree", "Size": 0, "Sha256": "",
                                       "IsLFS": False, "Revision": rev.commit, "Mode": "40000"})
            if not recursive:
                continue
        entries[path] = {
            "Name": parts[-1], "Path": path, "Type": "blob", "Size": len(data),
            "Sha256": hashlib.sha256(data).hexdigest(), "IsLFS": len(data) >= LFS_THRESHOLD,
            "Revision": rev.commit, "CommittedDate": rev.created_at, "Mode": "100644",
        }
    return list(entries.values())


# --- a guard for CLI subprocesses: no connection and no name lookup beyond loopback -----------------

NET_GUARD = '''\
"""sitecustomize installed by tests: refuse (and log) any socket connect or DNS lookup beyond loopback."""
import ipaddress, os, sys

_LOG = os.environ["MM_TEST_NET_LOG"]


def _loopback(host):
    if isinstance(host, bytes):
        host = host.decode()
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _guard(event, args):
    if event == "socket.connect" and isinstance(args[1], tuple):
        host = args[1][0]
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if not _loopback(host):
        with open(_LOG, "a") as log:
            log.write(f"{event} {host}\\n")
        raise OSError(f"test network guard: {event} to non-loopback {host!r} refused")


sys.addaudithook(_guard)
'''


def net_guard_env(directory: Path) -> dict[str, str]:
    """Env for a Python subprocess that refuses and logs every non-loopback connection (DNS included).

    Log lines land in DIRECTORY/net.log; an empty or absent log means nothing left 127.0.0.1.
    """
    directory = Path(directory)
    (directory / "guard").mkdir(parents=True, exist_ok=True)
    (directory / "guard" / "sitecustomize.py").write_text(NET_GUARD)
    return {"PYTHONPATH": str(directory / "guard"), "MM_TEST_NET_LOG": str(directory / "net.log")}


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.support.msserver --model-id OWNER/NAME --dir DIR [--revision master] [--port N]`:
    serve DIR as that mirror revision, print MS_URL=http://127.0.0.1:PORT, serve until SIGTERM/SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m tests.support.msserver")
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--revision", default="master")
    args = parser.parse_args(argv)
    server = MSServer().start()
    server.add_revision(args.model_id, args.revision, args.dir)
    print(f"MS_URL={server.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
