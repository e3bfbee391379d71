"""A local stand-in for the Hugging Face Hub, serving real git repositories on 127.0.0.1 only.

It speaks the part of the Hub HTTP API that huggingface_hub 2.x uses to read a model repo:

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]      repo_info / model_info
    GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=   list_repo_tree
    POST /api/models/{repo}/paths-info/{rev}                    get_paths_info (form or JSON body)
    GET  /api/models/{repo}/refs                                list_repo_refs
    GET  /api/models/{repo}/commits/{rev}                       list_repo_commits
    HEAD/GET /{repo}/resolve/{rev}/{path}                       hf_hub_download (Range -> 206)

Repositories are ``ROOT/<owner>/<name>`` git repos as built by ``tests.support.gitrepo`` (LFS
pointers in git, objects in ``.git/lfs/objects``), read with the git CLI. Revisions resolve like
the Hub: full sha, branch, tag, full ref name, or a unique commit-sha prefix (>= 4 hex).

Test hooks (thread-safe; ``reset()`` clears them), keyed by the file's path inside the repo:
``bytes_served[path]`` / ``total_bytes_served`` (counted as a chunk is handed to the socket, so it
is up to date when the client has the bytes; a dropped connection may over-count by one chunk),
``requests`` [(method, path, range)],
``corrupt[path] = bytes`` (same length, served instead of the content), ``cut_after[path] = n``
(send n body bytes then drop the connection, ``cut_times[path]`` times, default once),
``rate_limit`` (body bytes/second per response), ``down`` (answer 503 to everything),
``fail_file[path] = status`` (answer that status, e.g. 404 or 500, to every download of the file),
``api_body`` (bytes answered with 200 to every /api/ request instead of the real answer: a hostile Hub),
``auth_headers_seen`` (count of requests carrying an Authorization header; never their value),
``connections`` (TCP connections accepted, both listeners: keep-alive reuse shows as fewer than requests),
``tree_page_size`` / ``tree_page_size_expand`` / ``commits_page_size`` (the Hub's 1000/50/50;
longer listings are paged with a ``Link: <...>; rel="next"`` header, as the Hub does).

WAN hooks, on both listeners:
``conn_rate`` (bytes/second per TCP connection, a token bucket kept across the requests of one
keep-alive connection; None = off), ``served`` [(listener, path, range header, status, body bytes)]
one row per answered file request, ``too_many[path] = n`` (the next n GETs of PATH get 429 with
``Retry-After: retry_after``), ``fail_times[path] = n`` (the next n GETs get 503), ``fail_after[path] = k``
(GETs after the k-th get 503), ``ignore_range``
(paths, or "*": a Range request gets 200 and the whole body), ``shift_range[path] = k`` (a Range
request gets a 206 whose honest Content-Range starts k bytes before the offset asked, after it when k
is negative), ``corrupt_at[path] = offset`` (the byte at OFFSET is served flipped).

The "bridge": a second listener on 127.0.0.1 (``bridge_url``) standing in for the CDN / Xet bridge.
``xet_repos`` (repo ids) are served as Xet-backed: the tree and paths-info add ``xetHash`` beside
``lfs.oid``, HEAD/GET on ``resolve`` answer ``X-Xet-Hash`` and ``Link: <...>; rel="xet-auth"`` (as
huggingface_hub 2.4's ``parse_xet_file_data_from_response`` reads them) and redirect (302) every
LFS file to the bridge; ``redirect_lfs`` does the same for every repo's LFS files (the Hub's CDN
redirect). Bridge URLs are signed (HMAC) and expire after ``signed_url_ttl`` seconds: then the bridge
answers ``expired_status`` (403 like S3, or 410); a bad signature is 403. The bridge honours Range and
counts ``bridge_auth_headers_seen`` (a token sent to it is a leak). ``redirect_to`` (a base URL) redirects every LFS
file to ``<base>/<oid[:2]>/<oid[2:4]>/<oid>`` instead: a real CDN (the fetch benchmark's nginx) serving
``.git/lfs/objects``.

Tokens: ``HubServer(root, token=T)`` makes every repo private, ``private_repos[repo_id] = T`` one
repo. A request for a private repo without ``Authorization`` gets 401 + RepoNotFound (what the Hub
answers anonymous callers); with a wrong token, 401 "Invalid credentials in Authorization header".

CLI: ``python -m tests.support.hubserver --root DIR [--port N] [--make-model [REPO_ID]
--shards K --shard-bytes B]`` prints ``HUB_URL=http://127.0.0.1:PORT`` and serves until SIGTERM.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from tests.support.gitrepo import lfs_object_path, parse_lfs_pointer

HOST = "127.0.0.1"
SEND_CHUNK = 1024 * 1024
HEX = re.compile(r"[0-9a-f]+")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class HubError(Exception):
    """An error answered the Hub's way: status + X-Error-Code/X-Error-Message + JSON body."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


@dataclass(frozen=True)
class Entry:
    path: str
    type: str  # "file" or "directory"
    oid: str  # git blob sha1 / tree sha1
    size: int  # real size (the LFS object's for LFS files)
    lfs_sha256: str | None = None
    pointer_size: int | None = None


def _git(repo_dir: Path, *args: str, input: bytes | None = None) -> bytes:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    done = subprocess.run(["git", "-C", str(repo_dir), "-c", "core.quotepath=off", *args], input=input,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class RepoStore:
    """Reads repos under ROOT with git; caches what a commit sha makes immutable."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._trees: dict[tuple[Path, str], dict[str, Entry]] = {}
        self._blobs: dict[tuple[Path, str], bytes] = {}
        self._last_commits: dict[tuple[Path, str], dict[str, dict]] = {}
        self._all_commits: dict[tuple[Path, tuple], list[str]] = {}
        self._commit_lists: dict[tuple[Path, str], list[dict]] = {}

    def repo_dir(self, repo_id: str) -> Path:
        parts = repo_id.split("/")
        if len(parts) == 2 and all(NAME.fullmatch(p) for p in parts):
            path = self.root / parts[0] / parts[1]
            if (path / ".git").is_dir():
                return path
        raise HubError(401, "RepoNotFound", f"Repository not found: {repo_id}")

    def refs(self, repo_dir: Path) -> dict[str, str]:
        """Full ref name -> commit sha (annotated tags peeled)."""
        out = _git(repo_dir, "for-each-ref", "--format=%(objectname) %(*objectname) %(refname)").decode()
        refs = {}
        for line in out.splitlines():
            obj, peeled, name = line.split(" ", 2)
            refs[name] = peeled or obj
        return refs

    def resolve(self, repo_dir: Path, rev: str) -> str:
        refs = self.refs(repo_dir)
        for name in (rev, f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if name.startswith("refs/") and name in refs:
                return refs[name]
        if HEX.fullmatch(rev) and 4 <= len(rev) <= 40:
            matches = [c for c in self._commits_reachable(repo_dir, refs) if c.startswith(rev)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise HubError(404, "RevisionNotFound",
                               f"Revision '{rev}' is ambiguous: it is a prefix of {len(matches)} commits")
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    def _commits_reachable(self, repo_dir: Path, refs: dict[str, str]) -> list[str]:
        key = (repo_dir, tuple(sorted(refs.items())))
        with self._lock:
            cached = self._all_commits.get(key)
        if cached is None:
            cached = _git(repo_dir, "rev-list", "--all").decode().split() if refs else []
            with self._lock:
                self._all_commits[key] = cached
        return cached

    def tree(self, repo_dir: Path, commit: str) -> dict[str, Entry]:
        """Every file and directory of COMMIT by path, with LFS pointers decoded."""
        key = (repo_dir, commit)
        with self._lock:
            if key in self._trees:
                return self._trees[key]
        rows = []
        for line in _git(repo_dir, "ls-tree", "-r", "-t", "-l", "-z", "--full-tree", commit).split(b"\0"):
            if line:
                meta, path = line.split(b"\t", 1)
                _mode, kind, oid, size = meta.decode().split()
                rows.append((path.decode(), kind, oid, 0 if size == "-" else int(size)))
        small = [oid for _, kind, oid, size in rows if kind == "blob" and size <= 1024]
        contents = self._read_blobs(repo_dir, small)
        entries = {}
        for path, kind, oid, size in rows:
            if kind == "tree":
                entries[path] = Entry(path, "directory", oid, 0)
            elif kind == "blob":
                pointer = parse_lfs_pointer(contents[oid]) if oid in contents else None
                entries[path] = (Entry(path, "file", oid, pointer[1], pointer[0], size) if pointer
                                 else Entry(path, "file", oid, size))
        with self._lock:
            self._trees[key] = entries
        return entries

    def _read_blobs(self, repo_dir: Path, oids: list[str]) -> dict[str, bytes]:
        if not oids:
            return {}
        out = _git(repo_dir, "cat-file", "--batch", input="".join(f"{o}\n" for o in oids).encode())
        blobs, pos = {}, 0
        while pos < len(out):
            header_end = out.index(b"\n", pos)
            oid, _kind, size = out[pos:header_end].decode().split()
            start = header_end + 1
            blobs[oid] = out[start:start + int(size)]
            pos = start + int(size) + 1
        return blobs

    def blob(self, repo_dir: Path, oid: str) -> bytes:
        key = (repo_dir, oid)
        with self._lock:
            data = self._blobs.get(key)
        if data is None:
            data = _git(repo_dir, "cat-file", "blob", oid)
            with self._lock:
                self._blobs[key] = data
        return data

    def commits(self, repo_dir: Path, commit: str) -> list[dict]:
        """Hub-shaped commit list, newest first."""
        key = (repo_dir, commit)
        with self._lock:
            if key in self._commit_lists:
                return self._commit_lists[key]
        out = _git(repo_dir, "log", "--format=%H%x00%an%x00%ct%x00%B%x01", commit).decode()
        items = []
        for record in out.split("\x01"):
            record = record.strip("\n")
            if not record:
                continue
            sha, author, epoch, body = record.split("\x00", 3)
            title, _, message = body.strip().partition("\n")
            items.append({"id": sha, "title": title, "message": message.strip(), "date": _iso(int(epoch)),
                          "authors": [{"user": author, "avatar": None}]})
        with self._lock:
            self._commit_lists[key] = items
        return items

    def last_commits(self, repo_dir: Path, commit: str) -> dict[str, dict]:
        """path (file or directory) -> {id, title, date} of the newest commit that touched it."""
        key = (repo_dir, commit)
        with self._lock:
            if key in self._last_commits:
                return self._last_commits[key]
        out = _git(repo_dir, "log", "--format=%x01%H%x00%ct%x00%s", "--name-only", commit).decode()
        found: dict[str, dict] = {}
        for block in out.split("\x01")[1:]:
            head, *names = block.split("\n")
            sha, epoch, title = head.split("\x00", 2)
            info = {"id": sha, "title": title, "date": _iso(int(epoch))}
            for name in filter(None, names):
                parts = name.split("/")
                for i in range(1, len(parts) + 1):
                    found.setdefault("/".join(parts[:i]), info)
        with self._lock:
            self._last_commits[key] = found
        return found


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


def xet_hash_for(lfs_sha256: str) -> str:
    """The stand-in Xet hash of an LFS object (64 hex; the real one is a merkle hash over Xet chunks)."""
    return hashlib.sha256(b"xet-merkle:" + bytes.fromhex(lfs_sha256)).hexdigest()


def _tree_json(entry: Entry, last_commit: dict | None, xet: bool = False) -> dict:
    item = {"type": entry.type, "oid": entry.oid, "size": entry.size, "path": entry.path}
    if entry.lfs_sha256:
        item["lfs"] = {"oid": entry.lfs_sha256, "size": entry.size, "pointerSize": entry.pointer_size}
        if xet:
            item["xetHash"] = xet_hash_for(entry.lfs_sha256)
    if last_commit is not None:
        item["lastCommit"] = last_commit
        if entry.type == "file":
            item["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False},
                                          "pickleImportScan": None}
    return item


def _sibling_json(entry: Entry, blobs: bool) -> dict:
    item = {"rfilename": entry.path}
    if blobs:
        item.update(size=entry.size, blobId=entry.oid)
        if entry.lfs_sha256:
            item["lfs"] = {"sha256": entry.lfs_sha256, "size": entry.size, "pointerSize": entry.pointer_size}
    return item


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) for a single 'bytes=' range; None to serve the whole file."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header or "")
    if not m or (not m[1] and not m[2]):
        return None
    if not m[1]:  # suffix range: the last N bytes
        n = int(m[2])
        if n == 0:
            raise HubError(416, None, f"Range not satisfiable: {header}", {"Content-Range": f"bytes */{size}"})
        return max(0, size - n), size - 1
    start = int(m[1])
    end = min(int(m[2]), size - 1) if m[2] else size - 1
    if start >= size or end < start:
        raise HubError(416, None, f"Range not satisfiable: {header}", {"Content-Range": f"bytes */{size}"})
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mm-test-hub/1.0"
    # TCP_NODELAY, as real HTTP servers set on kept-alive connections: the headers and the body go out in two
    # writes, and with Nagle the body waits for the client's delayed ACK of the headers (40 ms per answer after
    # the first on a connection: three Hub API calls cost 0.12 s of a fetch that no real Hub adds)
    disable_nagle_algorithm = True
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        if self.server.hub.verbose:
            super().log_message(format, *args)

    def setup(self):
        super().setup()
        self.server.track(self.connection, True)
        with self.server.hub._lock:
            self.server.hub.connections += 1

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_GET(self):
        self._dispatch()

    def do_HEAD(self):
        self._dispatch()

    def do_POST(self):
        self._dispatch()

    def _dispatch(self):
        hub = self.server.hub
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else b""
        url = urlsplit(self.path)
        hub._record(self.command, unquote(url.path), self.headers.get("Range"), "Authorization" in self.headers)
        try:
            if hub.down:
                raise HubError(503, None, "Service unavailable (test hub is down)")
            segments = url.path.split("/")[1:]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if segments[:2] == ["api", "models"] and len(segments) >= 4:
                repo_id = unquote(segments[2]) + "/" + unquote(segments[3])
                self._check_token(hub.token or hub.private_repos.get(repo_id))
                if hub.api_body is not None:
                    self._send(200, hub.api_body, "application/json")
                    return
                self._api(hub.store, repo_id, segments[4:], query, body)
            elif len(segments) >= 5 and segments[2] == "resolve" and self.command in ("GET", "HEAD"):
                repo_id = unquote(segments[0]) + "/" + unquote(segments[1])
                self._check_token(hub.token or hub.private_repos.get(repo_id))
                self._resolve(hub.store, repo_id, unquote(segments[3]), unquote("/".join(segments[4:])))
            else:
                self._check_token(hub.token)
                raise HubError(404, None, f"Not found: {url.path}")
        except HubError as e:
            headers = {**e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            headers["X-Error-Message"] = e.message
            self._send(e.status, json.dumps({"error": e.message}).encode(), "application/json", headers)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as e:  # a server bug: answer 500 (not a silent disconnect) and show it
            traceback.print_exc()
            self.close_connection = True
            self._send(500, json.dumps({"error": f"test hub bug: {e}"}).encode(), "application/json",
                       {"X-Error-Message": f"test hub bug: {e}"})

    def _check_token(self, token: str | None):
        if token is None:
            return
        auth = self.headers.get("Authorization")
        if auth is None:
            raise HubError(401, "RepoNotFound", "Repository not found (authentication required)")
        if auth != f"Bearer {token}":
            raise HubError(401, None, "Invalid credentials in Authorization header")

    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, headers: dict | None = None):
        self._send(200, json.dumps(obj).encode(), "application/json; charset=utf-8", headers)

    def _api(self, store: RepoStore, repo_id: str, rest: list[str], query: dict, body: bytes):
        repo_dir = store.repo_dir(repo_id)
        op = rest[0] if rest else "revision"
        if op == "refs" and len(rest) == 1:
            return self._json(self._refs(store.refs(repo_dir), _truthy(query.get("include_prs"))))
        rev = unquote(rest[1]) if len(rest) >= 2 else "main"
        commit = store.resolve(repo_dir, rev)
        hub = self.server.hub
        if op == "revision" and len(rest) <= 2:
            tree = store.tree(repo_dir, commit)
            files = sorted((e for e in tree.values() if e.type == "file"), key=lambda e: e.path)
            date = store.commits(repo_dir, commit)[0]["date"]
            owner = repo_id.split("/")[0]
            return self._json({
                "_id": commit[:24], "id": repo_id, "modelId": repo_id, "author": owner, "sha": commit,
                "lastModified": date, "createdAt": date, "private": hub.token is not None or repo_id in hub.private_repos,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "usedStorage": sum(e.size for e in files),
                "siblings": [_sibling_json(e, _truthy(query.get("blobs"))) for e in files]})
        if op == "tree":
            expand = _truthy(query.get("expand"))
            entries = self._tree(store, repo_dir, commit, unquote("/".join(rest[2:])).strip("/"),
                                 _truthy(query.get("recursive")), expand, repo_id in hub.xet_repos)
            return self._paged(entries, query, hub.tree_page_size_expand if expand else hub.tree_page_size)
        if op == "paths-info" and self.command == "POST":
            return self._json(self._paths_info(store, repo_dir, commit, body, repo_id in hub.xet_repos))
        if op == "commits":
            return self._paged(store.commits(repo_dir, commit), query, hub.commits_page_size)
        raise HubError(404, None, f"Not found: /api/models/{repo_id}/{'/'.join(rest)}")

    def _paged(self, items: list, query: dict, page_size: int):
        """One page of ITEMS from ?cursor=, with a GitHub-style Link rel="next" header when more remain
        (the Hub paginates trees and commit lists this way and huggingface_hub follows the link)."""
        cursor = int(query.get("cursor") or 0)
        headers = {}
        if cursor + page_size < len(items):
            next_query = urlencode({**query, "cursor": cursor + page_size})
            headers["Link"] = f'<{self.server.hub.url}{urlsplit(self.path).path}?{next_query}>; rel="next"'
        return self._json(items[cursor:cursor + page_size], headers)

    @staticmethod
    def _refs(refs: dict[str, str], include_prs: bool) -> dict:
        def group(prefix):
            return [{"name": name[len(prefix):], "ref": name, "targetCommit": sha}
                    for name, sha in sorted(refs.items()) if name.startswith(prefix)]
        out = {"branches": group("refs/heads/"), "tags": group("refs/tags/"), "converts": group("refs/convert/")}
        if include_prs:
            out["pullRequests"] = group("refs/pr/")
        return out

    @staticmethod
    def _tree(store: RepoStore, repo_dir: Path, commit: str, base: str, recursive: bool, expand: bool,
              xet: bool = False) -> list:
        tree = store.tree(repo_dir, commit)
        if base and (base not in tree or tree[base].type != "directory"):
            raise HubError(404, "EntryNotFound", f"Directory not found: {base}", {"X-Repo-Commit": commit})
        prefix = base + "/" if base else ""
        last = store.last_commits(repo_dir, commit) if expand else {}
        entries = [e for p, e in sorted(tree.items())
                   if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])]
        return [_tree_json(e, last.get(e.path) if expand else None, xet) for e in entries]

    def _paths_info(self, store: RepoStore, repo_dir: Path, commit: str, body: bytes, xet: bool = False) -> list:
        if (self.headers.get("Content-Type") or "").startswith("application/json"):
            form = json.loads(body or b"{}")
            paths, expand = form.get("paths", []), bool(form.get("expand"))
        else:
            form = parse_qs(body.decode())
            paths, expand = form.get("paths", []), _truthy((form.get("expand") or ["false"])[-1])
        tree = store.tree(repo_dir, commit)
        last = store.last_commits(repo_dir, commit) if expand else {}
        found = [tree[p.strip("/")] for p in ([paths] if isinstance(paths, str) else paths) if p.strip("/") in tree]
        return [_tree_json(e, last.get(e.path) if expand else None, xet) for e in found]

    def _resolve(self, store: RepoStore, repo_id: str, rev: str, path: str):
        hub = self.server.hub
        repo_dir = store.repo_dir(repo_id)
        commit = store.resolve(repo_dir, rev)
        entry = store.tree(repo_dir, commit).get(path)
        if entry is None or entry.type != "file" or self.server.hub.fail_file.get(path) == 404:
            raise HubError(404, "EntryNotFound", f"Entry not found: {path} at {commit}", {"X-Repo-Commit": commit})
        if path in self.server.hub.fail_file:
            raise HubError(self.server.hub.fail_file[path], None, f"test hub: failing {path} on purpose")
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if entry.lfs_sha256:
            headers.update({"ETag": f'"{entry.lfs_sha256}"', "X-Linked-Etag": f'"{entry.lfs_sha256}"',
                            "X-Linked-Size": str(entry.size)})
            xet = repo_id in hub.xet_repos
            if xet:
                xet_hash = xet_hash_for(entry.lfs_sha256)
                headers["X-Xet-Hash"] = xet_hash
                headers["Link"] = (f'<{hub.url}/api/models/{repo_id}/xet-read-token/{commit}>; rel="xet-auth", '
                                   f'<{hub.bridge_url}/reconstruction/{xet_hash}>; rel="xet-reconstruction-info"')
            if hub.redirect_to:
                oid = entry.lfs_sha256
                headers["Location"] = f"{hub.redirect_to.rstrip('/')}/{oid[:2]}/{oid[2:4]}/{oid}"
                self._send(302, b"", "text/plain", headers)
                return
            if xet or hub.redirect_lfs:
                self._fault(path)  # the Hub itself rate-limits resolve calls
                headers["Location"] = hub.signed_url(repo_id, entry.lfs_sha256, path)
                self._send(302, b"", "text/plain", headers)
                return
            source: Path | bytes = lfs_object_path(repo_dir, entry.lfs_sha256)
        else:
            headers["ETag"] = f'"{entry.oid}"'
            source = store.blob(repo_dir, entry.oid)
        self._serve_file(path, source, entry.size, headers)

    def _fault(self, path: str):
        """The 429 / 503 hooks, for GETs only (HEAD is metadata)."""
        if self.command != "GET":
            return
        hub = self.server.hub
        if hub._take(hub.too_many, path):
            hub._served(self.server.listener, path, self.headers.get("Range"), 429, 0)
            raise HubError(429, None, "Too Many Requests (test hub rate limit)", {"Retry-After": str(hub.retry_after)})
        with hub._lock:
            seen = hub._gets[path] = hub._gets.get(path, 0) + 1
        if hub._take(hub.fail_times, path) or (path in hub.fail_after and seen > hub.fail_after[path]):
            hub._served(self.server.listener, path, self.headers.get("Range"), 503, 0)
            raise HubError(503, None, "Service unavailable (test hub fault)")

    def _serve_file(self, path: str, source: Path | bytes, size: int, headers: dict):
        hub = self.server.hub
        self._fault(path)
        asked = self.headers.get("Range")
        span = None if hub.ignores_range(path) else _parse_range(asked, size)
        if span and path in hub.shift_range:
            span = (min(size - 1, max(0, span[0] - hub.shift_range[path])), span[1])
        start, end = span or (0, size - 1)
        length = end - start + 1
        status = 206 if span else 200
        row = hub._served(self.server.listener, path, asked, status, 0)  # before the client can see anything
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        if span:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "GET" and length > 0:
            self._send_body(path, source, start, length, row)

    def _throttle(self, n: int):
        """Per-connection token bucket (bytes/s), kept across the requests of this keep-alive connection."""
        rate = self.server.hub.conn_rate
        if not rate:
            return
        now = time.monotonic()
        # at most 50 ms of credit: an idle connection does not bank a burst
        self._bucket_t = max(getattr(self, "_bucket_t", now), now - 0.05) + n / rate
        delay = self._bucket_t - now
        if delay > 0:
            time.sleep(delay)

    def _send_body(self, key: str, source: Path | bytes, start: int, length: int, row: list | None = None) -> int:
        hub = self.server.hub
        corrupt = hub.corrupt.get(key)
        flip = hub.corrupt_at.get(key)
        cut = hub._take_cut(key)
        rate = hub.rate_limit
        limit = length if cut is None else min(length, cut)
        sent = 0
        try:
            if isinstance(source, Path) and corrupt is None and flip is None and not rate:
                chunk = SEND_CHUNK if not hub.conn_rate else max(16 * 1024, min(256 * 1024, hub.conn_rate // 50))
                with open(source, "rb") as f:
                    while sent < limit:
                        want = min(chunk, limit - sent)
                        self._throttle(want)
                        hub._count(key, want, row)  # counted before sending, so the client never sees a stale count
                        n = self.connection.sendfile(f, start + sent, want)
                        hub._count(key, n - want, row)
                        if n == 0:
                            break
                        sent += n
            else:
                f = open(source, "rb") if isinstance(source, Path) else None
                chunk = max(1, min(64 * 1024, rate // 20)) if rate else SEND_CHUNK
                if hub.conn_rate:
                    chunk = min(chunk, max(16 * 1024, min(256 * 1024, hub.conn_rate // 50)))
                t0 = time.monotonic()
                try:
                    while sent < limit:
                        n, pos = min(chunk, limit - sent), start + sent
                        if corrupt is not None:
                            data = corrupt[pos:pos + n]
                        elif f is not None:
                            f.seek(pos)
                            data = f.read(n)
                        else:
                            data = source[pos:pos + n]
                        if not data:  # a corrupt[] shorter than the file: stop short, like a cut
                            break
                        if flip is not None and pos <= flip < pos + len(data):
                            data = bytearray(data)
                            data[flip - pos] ^= 0xFF
                        self._throttle(len(data))
                        hub._count(key, len(data), row)
                        self.wfile.write(data)
                        sent += len(data)
                        if rate:
                            delay = t0 + sent / rate - time.monotonic()
                            if delay > 0:
                                time.sleep(delay)
                finally:
                    if f is not None:
                        f.close()
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True
            return sent
        if sent < length:  # cut: drop the connection mid-body
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return sent


class _BridgeHandler(_Handler):
    """The CDN / Xet bridge: GET/HEAD /blobs/<owner>/<name>/<sha256>?path=&expires=&sig= (signed, expiring)."""

    server_version = "mm-test-bridge/1.0"

    def _dispatch(self):
        hub = self.server.hub
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        path = query.get("path", "")
        hub._record(self.command, unquote(url.path), self.headers.get("Range"), False)
        if "Authorization" in self.headers:
            with hub._lock:
                hub.bridge_auth_headers_seen += 1
        try:
            segments = url.path.split("/")[1:]
            if self.command not in ("GET", "HEAD") or len(segments) != 4 or segments[0] != "blobs":
                raise HubError(404, None, f"Not found: {url.path}")
            repo_id, oid = f"{segments[1]}/{segments[2]}", segments[3]
            if not hub.signature_ok(repo_id, oid, path, query.get("expires", ""), query.get("sig", "")):
                raise HubError(403, None, "Signature does not match")
            if time.time() > float(query["expires"]):
                hub._served("bridge", path, self.headers.get("Range"), hub.expired_status, 0)
                raise HubError(hub.expired_status, None, "Request has expired")
            repo_dir = hub.store.repo_dir(repo_id)
            blob = lfs_object_path(repo_dir, oid)
            if not HEX.fullmatch(oid) or not blob.is_file():
                raise HubError(404, None, "NoSuchKey")
            self._serve_file(path, blob, blob.stat().st_size, {"ETag": f'"{oid}"', "Accept-Ranges": "bytes"})
        except HubError as e:
            self._send(e.status, json.dumps({"error": e.message}).encode(), "application/json", e.headers)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as e:
            traceback.print_exc()
            self.close_connection = True
            self._send(500, json.dumps({"error": f"test bridge bug: {e}"}).encode(), "application/json")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, hub: "HubServer", port: int, listener: str = "hub"):
        self.hub = hub
        self.listener = listener
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((HOST, port), _BridgeHandler if listener == "bridge" else _Handler)

    def handle_error(self, request, client_address):
        """A client that drops a keep-alive connection (a ranged download closing early) is not a server error."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    def track(self, conn: socket.socket, alive: bool):
        with self._conns_lock:
            (self._conns.add if alive else self._conns.discard)(conn)

    def drop_connections(self):
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer:
    """The local Hub. ``with HubServer(root) as hub: ... hub.url ...``; only ever binds 127.0.0.1."""

    def __init__(self, root: Path, port: int = 0, token: str | None = None, verbose: bool = False):
        self.root = Path(root)
        self.port = port
        self.token = token
        self.private_repos: dict[str, str] = {}  # repo_id -> the token it needs (kept across reset())
        self.verbose = verbose
        self.store = RepoStore(self.root)
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._bridge: _Server | None = None
        self._bridge_thread: threading.Thread | None = None
        self._secret = secrets.token_bytes(16)
        self.reset()

    def reset(self) -> None:
        """Clear counters, request log and every fault hook."""
        with self._lock:
            self.bytes_served: dict[str, int] = {}
            self.requests: list[tuple[str, str, str | None]] = []
            self.corrupt: dict[str, bytes] = {}
            self.cut_after: dict[str, int] = {}
            self.cut_times: dict[str, int] = {}
            self.rate_limit: int | None = None
            self.down = False
            self.fail_file: dict[str, int] = {}
            self.api_body: bytes | None = None
            self.auth_headers_seen = 0
            self.connections = 0
            # WAN hooks
            self.conn_rate: int | None = None
            self.served: list[list] = []  # [listener, path, range, status, bytes]; see served_for()
            self.too_many: dict[str, int] = {}
            self.retry_after = 1
            self.fail_times: dict[str, int] = {}
            self.fail_after: dict[str, int] = {}
            self._gets: dict[str, int] = {}
            self.ignore_range: set[str] = set()
            self.shift_range: dict[str, int] = {}
            self.corrupt_at: dict[str, int] = {}
            self.xet_repos: set[str] = set()
            self.redirect_lfs = False
            self.redirect_to: str | None = None
            self.signed_url_ttl = 3600.0
            self.expired_status = 403
            self.bridge_auth_headers_seen = 0
            # page sizes of the real Hub (huggingface_hub follows the Link header)
            self.tree_page_size, self.tree_page_size_expand, self.commits_page_size = 1000, 50, 50

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("HubServer is not started")
        return f"http://{HOST}:{self._server.server_address[1]}"

    @property
    def bridge_url(self) -> str:
        if self._bridge is None:
            raise RuntimeError("HubServer is not started")
        return f"http://{HOST}:{self._bridge.server_address[1]}"

    def signed_url(self, repo_id: str, oid: str, path: str) -> str:
        """A bridge URL for the LFS object OID of REPO_ID, valid for signed_url_ttl seconds."""
        expires = f"{time.time() + self.signed_url_ttl:.3f}"
        query = urlencode({"path": path, "expires": expires, "sig": self._sign(repo_id, oid, path, expires)})
        return f"{self.bridge_url}/blobs/{repo_id}/{oid}?{query}"

    def _sign(self, repo_id: str, oid: str, path: str, expires: str) -> str:
        return hmac.new(self._secret, f"{repo_id}\0{oid}\0{path}\0{expires}".encode(), hashlib.sha256).hexdigest()

    def signature_ok(self, repo_id: str, oid: str, path: str, expires: str, sig: str) -> bool:
        try:
            float(expires)
        except ValueError:
            return False
        return hmac.compare_digest(self._sign(repo_id, oid, path, expires), sig)

    def ignores_range(self, path: str) -> bool:
        return "*" in self.ignore_range or path in self.ignore_range

    def served_for(self, path: str, listener: str | None = None) -> list[tuple[str, str, str | None, int, int]]:
        """Answered requests for repo file PATH: (listener, path, range header, status, body bytes sent)."""
        with self._lock:
            rows = [tuple(r) for r in self.served]
        return [r for r in rows if r[1] == path and (listener is None or r[0] == listener)]

    @property
    def total_bytes_served(self) -> int:
        with self._lock:
            return sum(self.bytes_served.values())

    def resolve_requests(self, path: str | None = None) -> list[tuple[str, str, str | None]]:
        """Logged /resolve/ requests, optionally only those for repo file PATH."""
        with self._lock:
            reqs = list(self.requests)
        return [r for r in reqs if "/resolve/" in r[1] and (path is None or r[1].split("/", 5)[-1] == path)]

    def start(self) -> "HubServer":
        self._server = _Server(self, self.port)
        self._bridge = _Server(self, 0, listener="bridge")
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="hubserver", daemon=True)
        self._bridge_thread = threading.Thread(target=self._bridge.serve_forever, kwargs={"poll_interval": 0.1},
                                               name="hubserver-bridge", daemon=True)
        self._thread.start()
        self._bridge_thread.start()
        return self

    def quiesce(self, timeout: float = 5.0) -> None:
        """Drop every open connection and wait for their handlers to end: a client killed by the last test (or a
        throttled answer still being sent) then counts nothing, and serves nothing, in the next one."""
        servers = [srv for srv in (self._server, self._bridge) if srv is not None]
        for srv in servers:
            srv.drop_connections()
        deadline = time.monotonic() + timeout
        while any(srv._conns for srv in servers) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop listening and drop open keep-alive connections, so the port refuses connections."""
        if self._server is None:
            return
        for server, thread in ((self._server, self._thread), (self._bridge, self._bridge_thread)):
            server.shutdown()
            server.server_close()
            server.drop_connections()
            thread.join(timeout=5)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _record(self, method: str, path: str, range_header: str | None, has_auth: bool) -> None:
        with self._lock:
            self.requests.append((method, path, range_header))
            self.auth_headers_seen += has_auth

    def _count(self, key: str, n: int, row: list | None = None) -> None:
        with self._lock:
            self.bytes_served[key] = self.bytes_served.get(key, 0) + n
            if row is not None:
                row[4] += n

    def _served(self, listener: str, path: str, range_header: str | None, status: int, nbytes: int) -> list:
        row = [listener, path, range_header, status, nbytes]
        with self._lock:
            self.served.append(row)
        return row

    def _take(self, counts: dict[str, int], key: str) -> bool:
        """Consume one of COUNTS[KEY] if any is left."""
        with self._lock:
            left = counts.get(key, 0)
            if left <= 0:
                return False
            counts[key] = left - 1
            return True

    def _take_cut(self, key: str) -> int | None:
        """The cut for KEY if one is armed, consuming one of its cut_times."""
        with self._lock:
            if key not in self.cut_after:
                return None
            n = self.cut_after[key]
            left = self.cut_times.get(key, 1) - 1
            if left <= 0:
                del self.cut_after[key]
                self.cut_times.pop(key, None)
            else:
                self.cut_times[key] = left
            return n


def _ensure_model_repo(root: Path, repo_id: str, shards: int, shard_bytes: int, seed: int, draft: bool) -> None:
    """Build the model repo unless one built with the same parameters is already there."""
    from tests.support.gitrepo import make_model_repo

    params = {"repo_id": repo_id, "shards": shards, "shard_bytes": shard_bytes, "seed": seed, "draft": draft}
    repo_dir = root / repo_id
    marker = repo_dir / ".git" / "hubserver-model.json"
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return
    if repo_dir.exists():
        shutil.rmtree(repo_dir)
    make_model_repo(root, repo_id, keep_sources=False, shards=shards, shard_bytes=shard_bytes, seed=seed, draft=draft)
    marker.write_text(json.dumps(params))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.hubserver", description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, type=Path, help="directory holding <owner>/<name> git repos")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--make-model", nargs="?", const="MiniMaxAI/MiniMax-M3.1-Flash", metavar="REPO_ID",
                        help="first build a generated model repo under --root (default MiniMaxAI/MiniMax-M3.1-Flash); "
                             "kept if one with the same parameters is there")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-bytes", type=int, default=256 * 1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--token-env", metavar="VAR", help="require the token held in environment variable VAR")
    parser.add_argument("--conn-rate", type=int, metavar="BYTES_PER_S", help="per-connection throttle (default off)")
    parser.add_argument("--redirect-lfs", action="store_true", help="redirect LFS files to the bridge (the Hub's CDN)")
    parser.add_argument("--redirect-to", metavar="URL",
                        help="redirect LFS files to URL/<oid[:2]>/<oid[2:4]>/<oid> (a CDN serving .git/lfs/objects)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    if args.make_model:
        _ensure_model_repo(args.root, args.make_model, args.shards, args.shard_bytes, args.seed, not args.no_draft)
    token = os.environ[args.token_env] if args.token_env else None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)  # raising (not Event.set) cannot deadlock inside a lock's wait
    try:
        with HubServer(args.root, port=args.port, token=token, verbose=args.verbose) as hub:
            hub.conn_rate, hub.redirect_lfs, hub.redirect_to = args.conn_rate, args.redirect_lfs, args.redirect_to
            print(f"HUB_URL={hub.url}", flush=True)
            while True:
                time.sleep(3600)
    except _Stop:
        return 0


class _Stop(Exception):
    pass


def _raise_stop(*_):
    raise _Stop


if __name__ == "__main__":
    sys.exit(main())
