"""Build real git repositories laid out the way the Hugging Face Hub stores a model repo.

Large files (``*.safetensors`` and anything >= 1 MiB) are committed as Git LFS pointer files and
their content is stored under ``.git/lfs/objects/<oid[0:2]>/<oid[2:4]>/<oid>``, written here
directly (no git-lfs filters). Small files are ordinary git blobs, so their blob sha1 is the Hub's
``blobId``/``oid``. Commits are written with ``git fast-import`` (one process per commit, nothing
checked out) with deterministic dates, so the same content always gives the same commit shas.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.modelgen import write_model

LFS_MIN_BYTES = 1024 * 1024
LFS_SUFFIXES = (".safetensors",)
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1\n"
BASE_EPOCH = 1_767_225_600  # 2026-01-01T00:00:00Z; commit N is dated BASE_EPOCH + N days
AUTHOR = ("MiniMax Test", "test@minimax.invalid")
DEFAULT_REPO_ID = "MiniMaxAI/MiniMax-M3.1-Flash"


@dataclass
class ModelRepo:
    path: Path
    repo_id: str
    commits: list[str]  # oldest first
    tags: dict[str, str]  # name -> commit sha
    branches: dict[str, str]  # name -> commit sha
    files: dict[str, int] = field(default_factory=dict)  # path -> real size at the newest commit
    source_dirs: list[Path] = field(default_factory=list)  # plain files of each commit, oldest first

    @property
    def head(self) -> str:
        return self.commits[-1]

    def read(self, path: str, rev: str | None = None) -> bytes:
        """Real content of PATH at REV (default: newest commit), following LFS pointers."""
        return read_file(self.path, rev or self.head, path)


def git(repo_dir: Path, *args: str, input: bytes | None = None, env: dict | None = None) -> bytes:
    """Run git in REPO_DIR isolated from the user's and system's config; return stdout."""
    full_env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                "GIT_TERMINAL_PROMPT": "0", **(env or {})}
    done = subprocess.run(["git", "-C", str(repo_dir), *args], input=input, env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo_dir}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def init_repo(repo_dir: Path) -> Path:
    repo_dir = Path(repo_dir)
    if not (repo_dir / ".git").is_dir():
        repo_dir.mkdir(parents=True, exist_ok=True)
        git(repo_dir, "init", "-q", "-b", "main")
    return repo_dir


def lfs_object_path(repo_dir: Path, oid: str) -> Path:
    return Path(repo_dir) / ".git" / "lfs" / "objects" / oid[0:2] / oid[2:4] / oid


def lfs_pointer(oid: str, size: int) -> bytes:
    return LFS_POINTER_PREFIX + f"oid sha256:{oid}\nsize {size}\n".encode()


def parse_lfs_pointer(data: bytes) -> tuple[str, int] | None:
    """(sha256, size) if DATA is an LFS pointer file, else None."""
    if not data.startswith(LFS_POINTER_PREFIX) or len(data) > 1024:
        return None
    fields = dict(line.split(" ", 1) for line in data.decode().splitlines()[1:] if " " in line)
    oid = fields.get("oid", "")
    if not oid.startswith("sha256:") or not fields.get("size", "").isdigit():
        return None
    return oid[len("sha256:"):], int(fields["size"])


def is_lfs_candidate(path: Path, size: int) -> bool:
    return path.name.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES


def store_lfs_object(repo_dir: Path, src: Path, move: bool = False) -> tuple[str, int]:
    """Put SRC into the repo's LFS store; return (sha256, size)."""
    h = hashlib.sha256()
    with open(src, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    oid, size = h.hexdigest(), src.stat().st_size
    dest = lfs_object_path(repo_dir, oid)
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        if move:
            shutil.move(str(src), tmp)
        else:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    elif move:
        src.unlink()
    return oid, size


def commit_count(repo_dir: Path) -> int:
    if not git(repo_dir, "for-each-ref", "--count=1").strip():
        return 0
    return int(git(repo_dir, "rev-list", "--all", "--count").strip())


def ref_sha(repo_dir: Path, ref: str) -> str | None:
    out = subprocess.run(["git", "-C", str(repo_dir), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False).stdout
    return out.decode().strip() or None


def _signature(epoch: int) -> bytes:
    return f"{AUTHOR[0]} <{AUTHOR[1]}> {epoch} +0000".encode()


def _data(payload: bytes) -> bytes:
    return b"data %d\n" % len(payload) + payload + b"\n"


def commit_dir(repo_dir: Path, src_dir: Path, message: str, *, branch: str = "main",
               date: int | None = None, move_lfs: bool = False) -> str:
    """Commit SRC_DIR's files as the whole tree of BRANCH (replacing what was there); return the sha.

    With MOVE_LFS the large source files are moved into the LFS store instead of copied (for
    throw-away source directories holding big shards).
    """
    repo_dir, src_dir = init_repo(Path(repo_dir)), Path(src_dir)
    epoch = date if date is not None else BASE_EPOCH + 86400 * commit_count(repo_dir)
    parent = ref_sha(repo_dir, f"refs/heads/{branch}")
    stream = [b"commit refs/heads/" + branch.encode() + b"\n",
              b"author " + _signature(epoch) + b"\n", b"committer " + _signature(epoch) + b"\n",
              _data(message.encode())]
    if parent:
        stream.append(f"from {parent}\n".encode())
    stream.append(b"deleteall\n")
    for path in sorted(p for p in src_dir.rglob("*") if p.is_file() and ".git" not in p.relative_to(src_dir).parts):
        rel = path.relative_to(src_dir).as_posix()
        mode = b"100755" if os.access(path, os.X_OK) else b"100644"
        size = path.stat().st_size
        if is_lfs_candidate(path, size):
            content = lfs_pointer(*store_lfs_object(repo_dir, path, move=move_lfs))
        else:
            content = path.read_bytes()
        stream.append(b"M " + mode + b" inline " + rel.encode() + b"\n" + _data(content))
    stream.append(b"done\n")
    git(repo_dir, "fast-import", "--quiet", "--done", "--date-format=raw", input=b"".join(stream))
    return ref_sha(repo_dir, f"refs/heads/{branch}")


def tag(repo_dir: Path, name: str, sha: str) -> None:
    """Lightweight tag NAME -> SHA (moved if it exists)."""
    git(repo_dir, "update-ref", f"refs/tags/{name}", sha)


def branch(repo_dir: Path, name: str, sha: str) -> None:
    git(repo_dir, "update-ref", f"refs/heads/{name}", sha)


def read_file(repo_dir: Path, rev: str, path: str) -> bytes:
    """Content of PATH at REV, with LFS pointers replaced by the stored object."""
    data = git(repo_dir, "cat-file", "blob", f"{rev}:{path}")
    pointer = parse_lfs_pointer(data)
    return lfs_object_path(repo_dir, pointer[0]).read_bytes() if pointer else data


def tree_sizes(repo_dir: Path, rev: str) -> dict[str, int]:
    """path -> real size (LFS size for pointers) of every file at REV."""
    sizes = {}
    for line in git(repo_dir, "ls-tree", "-r", "-l", "-z", rev).split(b"\0"):
        if not line:
            continue
        meta, path = line.split(b"\t", 1)
        _mode, _type, oid, size = meta.split()
        sizes[path.decode()] = int(size)
        if int(size) <= 1024:
            pointer = parse_lfs_pointer(git(repo_dir, "cat-file", "blob", oid.decode()))
            if pointer:
                sizes[path.decode()] = pointer[1]
    return sizes


def make_model_repo(root: Path, repo_id: str = DEFAULT_REPO_ID, *, keep_sources: bool = True,
                    **write_model_kwargs) -> ModelRepo:
    """A repo at ROOT/<owner>/<name> shaped like MiniMax-M3.1-Flash's history.

    Commit 1 "first upload" holds the whole model (tag v1.0); commit 2 changes only README.md, so the
    weights are unchanged since the first upload, as in the real repo; branch main is at commit 2.
    With KEEP_SOURCES each commit's plain files stay in ROOT/.sources/<owner>/<name>/<n> (n = 1, 2;
    ModelRepo.source_dirs) for tests to compare against; without, large files are moved, not copied.
    """
    repo_dir = init_repo(Path(root) / repo_id)
    sources = [Path(root) / ".sources" / repo_id / str(n) for n in (1, 2)]
    for stale in sources:
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=repo_dir / ".git", prefix="src-") as tmp:
        src = sources[0] if keep_sources else Path(tmp)
        write_model(src, **write_model_kwargs)
        first = commit_dir(repo_dir, src, "first upload", move_lfs=not keep_sources)
    tag(repo_dir, "v1.0", first)
    readme = read_file(repo_dir, first, "README.md") + b"\n## Usage\n\nServe with SGLang; see the deployment guide.\n"
    second = _commit_changes(repo_dir, {"README.md": readme}, "Update README.md")
    if keep_sources:
        shutil.copytree(sources[0], sources[1], copy_function=os.link)  # hard links: same bytes, no copy
        (sources[1] / "README.md").unlink()
        (sources[1] / "README.md").write_bytes(readme)
    return ModelRepo(path=repo_dir, repo_id=repo_id, commits=[first, second], tags={"v1.0": first},
                     branches={"main": second}, files=tree_sizes(repo_dir, second),
                     source_dirs=sources if keep_sources else [])


def _commit_changes(repo_dir: Path, changes: dict[str, bytes], message: str, branch: str = "main") -> str:
    """Commit small-file CHANGES on top of BRANCH (other files unchanged)."""
    epoch = BASE_EPOCH + 86400 * commit_count(repo_dir)
    parent = ref_sha(repo_dir, f"refs/heads/{branch}")
    stream = [f"commit refs/heads/{branch}\n".encode(), b"author " + _signature(epoch) + b"\n",
              b"committer " + _signature(epoch) + b"\n", _data(message.encode()), f"from {parent}\n".encode()]
    for rel, content in changes.items():
        stream.append(b"M 100644 inline " + rel.encode() + b"\n" + _data(content))
    stream.append(b"done\n")
    git(repo_dir, "fast-import", "--quiet", "--done", "--date-format=raw", input=b"".join(stream))
    return ref_sha(repo_dir, f"refs/heads/{branch}")


def make_commits_with_shared_prefix(repo_dir: Path, prefix_len: int = 4,
                                    ref: str = "refs/hidden/shared-prefix") -> tuple[str, str]:
    """Add empty commits (on REF, a ref the Hub API does not list) until two commit shas share their
    first PREFIX_LEN hex digits; return those two shas. Deterministic for a given repo."""
    repo_dir = Path(repo_dir)
    start = ref_sha(repo_dir, ref) or ref_sha(repo_dir, "HEAD")
    batch = int(16 ** (prefix_len / 2))  # a collision is expected after ~1.2 batches (birthday bound)
    for round_ in range(100):
        stream = []
        for i in range(batch):
            epoch = BASE_EPOCH + round_ * batch + i
            stream += [f"commit {ref}\n".encode(), b"committer " + _signature(epoch) + b"\n",
                       _data(f"prefix probe {round_}.{i}".encode())]
            if i == 0 and start:
                stream.append(f"from {start}\n".encode())
        stream.append(b"done\n")
        git(repo_dir, "fast-import", "--quiet", "--done", "--date-format=raw", input=b"".join(stream))
        by_prefix = defaultdict(list)
        for sha in git(repo_dir, "rev-list", "--all").decode().split():
            by_prefix[sha[:prefix_len]].append(sha)
        shared = sorted(shas for shas in by_prefix.values() if len(shas) > 1)
        if shared:
            return shared[0][0], shared[0][1]
        start = ref_sha(repo_dir, ref)
    raise RuntimeError(f"no two commits share a {prefix_len}-hex prefix in {repo_dir}")
