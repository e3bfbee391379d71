"""A model root that holds several revisions of a repo side by side, sharing their bytes: `mm ls`, `mm use`, `mm gc`.

Layout (docs/store.md):

    ROOT/<repo id>/<dir>/        one revision: a plain model directory (DIR/.mm/manifest.json), what `mm verify`,
                                 `mm launch` and a container mount take; any name (mm suggests the short revision)
    ROOT/<repo id>/current       the pointer: a relative symlink to one revision's <dir>, replaced atomically
    ROOT/<repo id>/.mm-removing-<dir>   a revision `mm gc` is removing (renamed first: a revision is whole or gone)
    ROOT/.mm/lock                held by `mm use` and `mm gc`
    ROOT/.mm/uses.jsonl          every switch of a pointer (when, from which revision to which), so that the revision
                                 a container started through the pointer mounts is known afterwards

Revisions share bytes through the file system, not through a blob directory: files taken from an earlier
revision (`mm unbundle --from`, `mm fetch --from`) are reflinks where the file system clones, hard links where
the user asked. So the link count of an inode and the extents of a file ARE the reference counts: removing a
revision directory frees exactly the bytes no other revision uses, and there is never an orphan to collect.
Disk use is measured with FIEMAP (sharing.py), each shared byte counted once.

Verification stamps: `mm verify DIR` (full) and `mm unbundle`'s final verify record when and how DIR was last
verified in DIR/.mm/verified.json (integrity/stamps.py), for `mm ls`.

Interrupted at any point, the root stays consistent: a switch is a rename of a new symlink over `current`; a
removal is a rename out of the way, then a delete that the next `mm gc` finishes.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from collections import Counter
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .errors import BadInput, BadValue, NotInRoot, Refused
from .paths import MM_DIR, POINTER, manifest_path, payload_dir
from .edges.fsutil import dir_lock, lock_holder, open_file, parent_dir, read_local_file, remove_tree, unlink_file
from .integrity.manifest import MAX_MANIFEST_BYTES, Manifest, from_json
from .integrity.stamps import read_verified
from .edges.sharing import DiskUse, Layout, layout, shared_bytes
from .edges.untrusted import At, load_json
from .serving.docker import Container, running_containers
from .units import iso_time

if TYPE_CHECKING:
    from .serving.launch import RevisionChoice

REMOVING = ".mm-removing-"
POINTER_TMP = ".current.tmp-"
USES = "uses.jsonl"
DEFAULT_KEEP = 1  # mm's own choice: besides the current revision, one more, so that a rollback is always one command
SWITCH_WINDOW = 5.0  # seconds after a switch is logged during which the pointer may still name the previous one
MAX_USES = 16 * 1024 * 1024
HEX = re.compile(r"^[0-9a-f]{4,40}$")


# --- what the root holds ------------------------------------------------------------------------------

@dataclass
class Revision:
    repo_id: str
    revision: str
    path: Path
    files: int
    size: int  # bytes of the model files (the manifest's sizes)
    arrived: float  # when its manifest was written here (mtime)
    manifest_bytes: bytes = field(repr=False, default=b"")
    manifest: Manifest | None = field(repr=False, default=None)
    current: bool = False

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Repo:
    repo_id: str
    path: Path
    revisions: list[Revision]
    current: str | None  # the pointer's target (a directory name), None without a pointer
    pointer_problem: str | None = None  # a pointer that names no revision here
    removing: list[Path] = field(default_factory=list)  # leftovers of an interrupted gc


@dataclass
class Store:
    root: Path
    repos: list[Repo]
    notes: list[str]

    def repo(self, repo_id: str) -> Repo:
        found = next((r for r in self.repos if r.repo_id == repo_id), None)
        if found is None:
            held = ", ".join(r.repo_id for r in self.repos) or "none"
            raise NotInRoot(f"{self.root}: no revision of {repo_id} here (repos: {held}); the layout is "
                           f"ROOT/<repo id>/<revision dir>/")
        return found


def scan(root: Path) -> Store:
    """Every revision under ROOT (ROOT/<repo id>/<dir>/ holding a manifest of that repo), each repo's pointer and
    the leftovers of an interrupted gc. A manifest that does not parse, or names another repo, is a note."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory")
    repos: list[Repo] = []
    notes: list[str] = []
    for repo_dir in _repo_dirs(root):
        repo_id = repo_dir.relative_to(root).as_posix()
        revisions, removing = [], []
        for child in sorted(repo_dir.iterdir()):
            if child.name.startswith(REMOVING) and child.is_dir() and not child.is_symlink():
                removing.append(child)
                continue
            if child.is_symlink() or not child.is_dir() or not manifest_path(child).is_file():
                continue
            rev = _revision(child, notes)
            if rev is None:
                continue
            if rev.repo_id != repo_id:
                notes.append(f"{child}: holds {rev.repo_id}, not {repo_id}; left alone (mm ls, use and gc manage "
                             f"ROOT/<repo id>/<dir>)")
                continue
            revisions.append(rev)
        if not revisions and not removing:
            continue
        current, problem = _pointer(repo_dir, revisions)
        for rev in revisions:
            rev.current = rev.name == current
        repos.append(Repo(repo_id, repo_dir, revisions, current, problem, removing))
    return Store(root, repos, notes)


def _existing(root: Path) -> Path:
    """ROOT, a directory that exists: its lock is never made in a directory a typo would create."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory (a model root holds ROOT/<repo id>/<revision dir>/)")
    return root


def _repo_dirs(root: Path) -> list[Path]:
    """ROOT/<name> and ROOT/<owner>/<name>: directories (not symlinks, not mm's own) that may hold revisions."""
    found = []
    for first in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name != MM_DIR):
        if manifest_path(first).is_file():
            continue  # a model directory directly under ROOT: not the layout
        found.append(first)
        found += [p for p in sorted(first.iterdir()) if p.is_dir() and not p.is_symlink()
                  and not manifest_path(p).is_file() and not p.name.startswith(REMOVING)]
    return found


def _revision(path: Path, notes: list[str]) -> Revision | None:
    mpath = manifest_path(path)
    try:
        data = read_local_file(mpath, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
        manifest = from_json(data, str(mpath))
        arrived = mpath.stat().st_mtime
    except (OSError, BadInput) as e:
        notes.append(f"{mpath}: {getattr(e, 'message', None) or e}; not listed")
        return None
    return Revision(manifest.repo_id, manifest.revision, path, len(manifest.files), manifest.total_bytes, arrived,
                    data, manifest)


def _pointer(repo_dir: Path, revisions: list[Revision]) -> tuple[str | None, str | None]:
    pointer = repo_dir / POINTER
    if not pointer.is_symlink():
        return None, (f"{pointer}: not a symlink mm made; `mm use` replaces it" if pointer.exists() else None)
    target = os.readlink(pointer)
    if "/" in target or target not in {r.name for r in revisions}:
        return None, f"{pointer} -> {target}: names no revision here"
    return target, None


# --- the switch log ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Use:
    time: float  # written just before the pointer was replaced
    repo_id: str
    dir: str
    previous: str | None
    revision: str | None = None  # the revision chosen, and the sha256 of its manifest's bytes: the choice is of
    manifest_sha256: str | None = None  # this very manifest (None: a line of an mm that did not record them)


def _uses_path(root: Path) -> Path:
    return Path(root) / MM_DIR / USES


def read_uses(root: Path) -> list[Use] | None:
    """The switch log, oldest first; a line torn by a kill (or not mm's) is skipped. None when it cannot be read."""
    path = _uses_path(root)
    if not os.path.lexists(path):
        return []
    try:
        lines = read_local_file(path, what="switch log", max_bytes=MAX_USES).splitlines()
    except BadInput:
        return None
    out = []
    for line in lines:
        try:
            doc = load_json(line, str(path))
            at = At(str(path))
            at.obj(doc)
            t = doc.get("time")
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                continue
            out.append(Use(float(t), at.get_str(doc, "repo_id", max_len=256), at.get_str(doc, "dir", max_len=255),
                           at.get_str(doc, "previous", None, max_len=255), at.get_str(doc, "revision", None, max_len=256),
                           at.get_str(doc, "manifest_sha256", None, max_len=64)))
        except BadInput:
            continue
    return sorted(out, key=lambda u: u.time)


def _append_use(root: Path, use: Use) -> None:
    path = _uses_path(root)
    line = json.dumps({"time": use.time, "at": iso_time(use.time), "repo_id": use.repo_id, "dir": use.dir,
                       "previous": use.previous, "revision": use.revision,
                       "manifest_sha256": use.manifest_sha256}) + "\n"
    fd = open_file(root, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # never through a link (fsutil's rule)
    try:
        os.write(fd, b"\n" + line.encode())  # a line torn by an earlier kill ends here
        os.fsync(fd)
    finally:
        os.close(fd)


# --- mm use -------------------------------------------------------------------------------------------------

@dataclass
class UseResult:
    root: str
    repo_id: str
    revision: str
    dir: str
    pointer: str
    previous: str | None
    changed: bool
    recorded: bool = False  # the choice (revision and manifest) was written to the switch log by this call


def find_revision(repo: Repo, wanted: str) -> Revision:
    """The revision WANTED names: its directory name, or its commit (full, or a prefix of 4+ hex digits)."""
    by_name = [r for r in repo.revisions if r.name == wanted]
    if by_name:
        return by_name[0]
    matches = [r for r in repo.revisions if HEX.match(wanted.lower()) and r.revision.startswith(wanted.lower())]
    held = ", ".join(f"{r.revision[:12]} ({r.name})" for r in repo.revisions) or "none"
    if not matches:
        raise NotInRoot(f"{repo.path}: no revision {wanted!r} of {repo.repo_id} here (held: {held})")
    if len({r.revision for r in matches}) > 1:
        raise BadValue(f"revision {wanted!r} is ambiguous in {repo.path}: {held}")
    return matches[0]


def use(root: Path, repo_id: str, wanted: str) -> UseResult:
    """Point ROOT/REPO_ID/current at revision WANTED, atomically, once `verify --quick` passes on it."""
    from .integrity.verify import require_quick_verify  # here: verify imports the safetensors checks

    root = _existing(root)
    with dir_lock(root, "mm use"):
        repo = scan(root).repo(repo_id)
        rev = find_revision(repo, wanted)
        require_quick_verify(rev.path, rev.manifest, before="making it current")
        pointer = repo.path / POINTER
        result = UseResult(str(root), repo_id, rev.revision, rev.name, str(pointer), repo.current, rev.name != repo.current)
        _clean_pointer_leftovers(root, repo.path)
        choice = Use(time.time(), repo_id, rev.name, repo.current, rev.revision, manifest_sha256(rev.manifest_bytes))
        if not result.changed:
            # already current: the choice is recorded again only when its record does not name this manifest (an
            # older mm's line, or a manifest changed since), so that `mm use` is how a user confirms the change
            if (last := _last_use(read_uses(root) or [], repo_id, rev.name)) is None or \
                    (last.revision, last.manifest_sha256) != (choice.revision, choice.manifest_sha256):
                _append_use(root, replace(choice, previous=rev.name))
                result.recorded = True
            return result
        if pointer.exists() and not pointer.is_symlink():
            raise BadInput(f"{pointer}: exists and is not a symlink; move it away (mm keeps the pointer there)")
        _append_use(root, choice)
        result.recorded = True
        with parent_dir(root, pointer) as (dfd, name):  # the repo's directory, reached through real directories
            tmp = f"{POINTER_TMP}{os.getpid()}"
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.symlink(rev.name, tmp, dir_fd=dfd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        return result


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _last_use(uses: list[Use], repo_id: str, dir_name: str) -> Use | None:
    return next((u for u in reversed(uses) if u.repo_id == repo_id and u.dir == dir_name), None)


def recorded_choice(model_dir: Path) -> tuple[RevisionChoice | None, str | None]:
    """Whether `mm use` chose MODEL_DIR's revision with the manifest it holds now: (the choice, None), or (None,
    why the record does not hold), or (None, None) where MODEL_DIR is no revision of a root or nobody chose it.
    The record is the latest line of ROOT/.mm/uses.jsonl naming the directory; a directory swapped by hand or a
    manifest changed since has another sha256."""
    from .serving.launch import RevisionChoice  # here: the store sits above serving; launch stays light

    real = Path(os.path.realpath(model_dir))
    try:
        data = read_local_file(manifest_path(real), what="manifest", max_bytes=MAX_MANIFEST_BYTES)
        manifest = from_json(data, str(manifest_path(real)))
    except BadInput:
        return None, None  # launch's own checks name what is wrong with it
    depth = len(manifest.repo_id.split("/"))
    if len(real.parents) <= depth or os.path.realpath(real.parents[depth] / manifest.repo_id) != str(real.parent):
        return None, None
    root = real.parents[depth]
    last = _last_use(read_uses(root) or [], manifest.repo_id, real.name)
    if last is None:
        return None, None
    again = f"if that is yours, record it: mm use {manifest.repo_id} {real.name} --root {root}"
    if last.manifest_sha256 is None:
        return None, (f"`mm use` chose {real.name} at {iso_time(last.time)} without recording its manifest (an older "
                      f"mm); {again}")
    if last.manifest_sha256 != manifest_sha256(data) or last.revision != manifest.revision:
        return None, (f"{manifest_path(real)} changed after `mm use` chose {real.name} at {iso_time(last.time)} "
                      f"(revision {(last.revision or '?')[:12]} then); {again}")
    return RevisionChoice(manifest.revision, f"`mm use` at {iso_time(last.time)}"), None


def _clean_pointer_leftovers(root: Path, repo_dir: Path) -> None:
    for stale in repo_dir.glob(f"{POINTER_TMP}*"):
        if stale.is_symlink():
            unlink_file(root, stale)


# --- who mounts what: docker ---------------------------------------------------------------------------------

def mounted(store: Store, containers: list[Container], uses: list[Use] | None) -> tuple[dict[Path, list[str]], list[str]]:
    """{revision path: [container names]} for every revision a running container mounts (the revision itself, a
    directory above it, or a path inside it; through the pointer: the revision it named when the container
    started, and the one before, for a container that started while it was being switched), and notes."""
    out: dict[Path, list[str]] = {}
    notes: list[str] = []
    for c in containers:
        for source in c.sources:
            for repo in store.repos:
                for rev in _mounted_revisions(repo, source, c, uses, notes):
                    out.setdefault(rev.path, []).append(c.name)
    return out, notes


def _mounted_revisions(repo: Repo, source: str, c: Container, uses: list[Use] | None, notes: list[str]) -> list[Revision]:
    """The revisions of REPO a mount of SOURCE serves. Compared by identity (device and inode), never by spelling:
    the root may be reached through a symlink, a bind mount or `..`, and the user's spelling is not docker's."""
    steps, real = _lookup(source)
    repo_id = _identity(repo.path)
    if repo_id is not None and any(name == POINTER and _identity(where) == repo_id for where, name in steps):
        if uses is None or c.started is None:
            notes.append(f"container {c.name} mounts {source}, and when it started (or what the pointer named then) "
                         f"is unknown: every revision of {repo.repo_id} is kept")
            return list(repo.revisions)
        mine = [u for u in uses if u.repo_id == repo.repo_id]
        before = [u for u in mine if u.time <= c.started]
        if before:  # the switch in effect when it started; the one before it too if it started during the switch
            names = {before[-1].dir} | ({before[-1].previous} if c.started - before[-1].time < SWITCH_WINDOW else set())
        else:
            names = {mine[0].previous} if mine else set()
        return [r for r in repo.revisions if r.name in names | {repo.current}]
    mounted_chain = _chain(real)  # the source and every directory above it
    if not mounted_chain:
        return []
    hit = []
    for rev in repo.revisions:
        rev_chain = _chain(os.path.realpath(rev.path))
        if rev_chain and (rev_chain[0] in mounted_chain or mounted_chain[0] in rev_chain):
            hit.append(rev)
    return hit


MAX_LINKS = 40  # symlinks one lookup follows, as Linux's own limit (ELOOP past 40)


def _lookup(source: str) -> tuple[list[tuple[str, str]], str]:
    """Resolve SOURCE as the kernel does when docker mounts it (after docker's own textual clean): every
    (physical directory, name) the lookup reads, symlinks followed one by one, and the physical path it ends at."""
    todo = [p for p in reversed(os.path.normpath(source).split("/")) if p and p != "."]
    where, steps, links = "/", [], 0
    while todo:
        name = todo.pop()
        if name == "..":
            where = os.path.dirname(where)
            continue
        steps.append((where, name))
        full = os.path.join(where, name)
        if links < MAX_LINKS and os.path.islink(full):
            links += 1
            try:
                target = os.readlink(full)
            except OSError:
                break
            where = "/" if target.startswith("/") else where
            todo += [p for p in reversed(target.split("/")) if p and p != "."]
        else:
            where = full
    return steps, where


def _identity(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(real: str) -> list[tuple[int, int]]:
    """The identities of physical path REAL and of every directory above it (a bind mount of a directory has the
    directory's identity under any other name)."""
    out = []
    for p in [real, *(str(q) for q in Path(real).parents)]:
        ident = _identity(p)
        if ident is None:
            return out if out else []
        out.append(ident)
    return out


# --- disk use ---------------------------------------------------------------------------------------------------

def layouts(rev: Revision) -> list[Layout]:
    """Where the revision's model files lie on disk (a file that is gone or unreadable counts as nothing)."""
    out = []
    for f in rev.manifest.files if rev.manifest else ():
        try:
            out.append(layout(rev.path / f.path))
        except OSError:
            continue
    return out


def _payload(rev: Revision) -> Path | None:
    """The revision's DIR.payload/ beside it, when it is a real directory (a link there is not mm's to remove)."""
    where = payload_dir(rev.path)
    return where if where.is_dir() and not where.is_symlink() else None


def _payload_layouts(rev: Revision) -> list[Layout]:
    where = _payload(rev)
    return _tree_layouts(where) if where else []


def _tree_layouts(path: Path) -> list[Layout]:
    """Every regular file under PATH (a leftover of an interrupted gc), symlinks not followed."""
    out = []
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                out.append(layout(Path(dirpath) / name))
            except OSError:
                continue
    return out


# --- mm ls ---------------------------------------------------------------------------------------------------------

@dataclass
class RevisionInfo:
    repo_id: str
    revision: str
    dir: str
    path: str
    files: int
    size: int
    on_disk: int  # bytes its files occupy on disk (shared ones included)
    shared: int  # of those, bytes another revision here uses too (reflink or hard link)
    current: bool
    verified: dict | None  # {"time", "ok", "current" (for this manifest), "by"}; None: never verified in full here
    signature: str  # "none" | "good" (the signature matches the manifest; who signed: mm verify --allowed-signers)
    #                 | "stale" (the manifest changed after signing) | "unchecked" (ssh-keygen missing)
    signer: str | None  # key type and fingerprint
    mounted_by: list[str]
    payload: int = 0  # bytes on disk of DIR.payload/ beside it (mm's wheels, an engine image, caches); gc frees it too


@dataclass
class LsReport:
    root: str
    revisions: list[RevisionInfo]
    pointers: dict[str, str | None]  # repo id -> current dir
    size: int  # bytes of all revisions' files
    on_disk: int  # bytes they occupy, each shared byte once
    removing: list[str]  # leftovers of an interrupted gc
    notes: list[str]


def ls(root: Path, docker: str = "docker") -> LsReport:
    store = scan(root)
    notes = list(store.notes)
    try:
        containers, note = running_containers(docker)
        notes += [note] if note else []
    except Refused as e:
        containers = []
        notes.append(f"{e.message.split('; mm cannot')[0]}: containers' mounts not shown")
    users, mount_notes = mounted(store, containers, read_uses(store.root))
    notes += mount_notes
    all_revs = [r for repo in store.repos for r in repo.revisions]
    per_rev = {r.path: layouts(r) for r in all_revs}
    infos = []
    for repo in store.repos:
        if repo.pointer_problem:
            notes.append(repo.pointer_problem)
        for r in repo.revisions:
            mine = per_rev[r.path]
            others = [item for p, items in per_rev.items() if p != r.path for item in items]
            stamp = read_verified(r.path, r.manifest_bytes)
            status, signer = _signature_status(r)
            infos.append(RevisionInfo(r.repo_id, r.revision, r.name, str(r.path), r.files, r.size, DiskUse(mine).bytes,
                                      shared_bytes(mine, others), r.current, stamp.__dict__ if stamp else None, status, signer,
                                      sorted(set(users.get(r.path, []))), DiskUse(_payload_layouts(r)).bytes))
    removing = [str(p) for repo in store.repos for p in repo.removing]
    if removing:
        notes.append(f"{len(removing)} revision(s) being removed by an interrupted `mm gc`; run `mm gc {store.root}` "
                     f"to finish")
    return LsReport(str(store.root), infos, {repo.repo_id: repo.current for repo in store.repos},
                    sum(r.size for r in all_revs), DiskUse([i for items in per_rev.values() for i in items]).bytes,
                    removing, notes)


def _signature_status(rev: Revision) -> tuple[str, str | None]:
    from .errors import IntegrityError
    from .integrity.signing import check_signature_matches, signature_path

    sig = signature_path(rev.path)
    if not sig.is_file():
        return "none", None
    try:
        info = check_signature_matches(rev.manifest_bytes, read_local_file(sig, what="signature", max_bytes=1024 * 1024),
                                       str(sig))
    except IntegrityError:
        return "stale", None
    except BadInput:
        return "unchecked", None
    return "good", f"{info.key_type} {info.fingerprint}"


# --- mm gc ---------------------------------------------------------------------------------------------------------

@dataclass
class GcReport:
    root: str
    dry_run: bool
    removed: list[dict]  # {"repo_id", "revision", "dir", "size"}
    kept: list[dict]  # {"repo_id", "revision", "dir", "why"}
    freed: int  # bytes on disk no revision uses any more
    leftovers: list[str]  # an interrupted gc's revisions, finished now
    notes: list[str]


WITHOUT_DOCKER = "--without-docker"


def gc(root: Path, keep: int = DEFAULT_KEEP, dry_run: bool = False, docker: str = "docker",
       without_docker: bool = False) -> GcReport:
    """Remove the revisions that are not current, not among the KEEP most recent others, not mounted by a running
    container, not being written by mm, and finish what an interrupted gc left; with DRY_RUN only say so.
    WITHOUT_DOCKER: docker is not asked which revisions running containers mount (its daemon stopped, or the
    containers run under podman or Kubernetes): the user vouches that none runs from what goes."""
    if keep < 0:
        raise BadValue(f"--keep {keep}: must be 0 or more")
    root = _existing(root)
    with dir_lock(root, "mm gc"):
        store = scan(root)
        notes = list(store.notes)
        try:
            containers, note = ([], None) if without_docker else running_containers(docker)
        except Refused as e:
            if not dry_run:
                raise Refused(f"{e.message}; `mm gc {WITHOUT_DOCKER}` removes them without asking docker: a "
                              f"container still serving a removed revision loses its files (reads fail, its next "
                              f"start finds no model)") from None
            containers, note = [], f"{e}; this dry run lists what would go if no container mounted a revision"
        if without_docker:
            note = (f"docker not asked ({WITHOUT_DOCKER}): a revision a running container mounts is removed like "
                    f"any other; the current and --keep ones stay")
        notes += [note] if note else []
        uses = read_uses(root)
        users, mount_notes = mounted(store, containers, uses)
        notes += mount_notes
        removed, kept = [], []
        for repo in store.repos:
            if repo.pointer_problem:
                notes.append(repo.pointer_problem)
            for rev, why in _decide(repo, keep, users, uses or []):
                doc = {"repo_id": repo.repo_id, "revision": rev.revision, "dir": rev.name, "size": rev.size,
                       "payload": DiskUse(_payload_layouts(rev)).bytes}
                (kept.append({**doc, "why": why}) if why else removed.append((rev, doc)))
        leftovers = [p for repo in store.repos for p in repo.removing]
        freed = _freed(store, [rev for rev, _ in removed], leftovers)
        report = GcReport(str(root), dry_run, [doc for _, doc in removed], kept, freed, [str(p) for p in leftovers],
                          notes)
        if dry_run:
            return report
        for path in leftovers:  # below ROOT, through real directories only (fsutil's rule)
            remove_tree(root, path)
        with _claimed(root, [rev for rev, _ in removed]) as (claimed, busy):
            if busy:  # a reader started since the decision: it keeps its revision
                report.kept += [{**doc, "why": busy[rev.path]} for rev, doc in removed if rev.path in busy]
                report.removed = [doc for rev, doc in removed if rev.path not in busy]
                report.freed = _freed(store, claimed, leftovers)
            for rev in claimed:
                # the payloads first: an interrupted gc leaves them as a leftover it finishes, never a revision
                # without its model that still has its payloads (or the reverse)
                for path in [p for p in (_payload(rev),) if p] + [rev.path]:
                    gone = path.with_name(REMOVING + path.name)
                    with parent_dir(root, path) as (dfd, name):
                        os.rename(name, gone.name, src_dir_fd=dfd, dst_dir_fd=dfd)  # from here on it is gone whole
                        os.fsync(dfd)
                    remove_tree(root, gone)
        for repo in store.repos:
            _clean_pointer_leftovers(root, repo.path)
        return report


def _decide(repo: Repo, keep: int, users: dict[Path, list[str]], uses: list[Use]) -> list[tuple[Revision, str | None]]:
    """(revision, why it is kept or None to remove it), most recent first."""
    last_current = {}
    for u in uses:
        if u.repo_id == repo.repo_id:
            last_current[u.dir] = u.time
            if u.previous:
                last_current[u.previous] = u.time  # it was current until then
    recent = sorted(repo.revisions, key=lambda r: (last_current.get(r.name, 0.0), r.arrived), reverse=True)
    out, others = [], 0
    for rev in recent:
        if rev.current:
            why = "current"
        elif repo.current is None and rev is recent[0]:
            why = "the newest, and no `current` pointer yet (`mm use` sets one)"
        elif rev.path in users:
            why = f"mounted by running container(s) {', '.join(sorted(set(users[rev.path])))}"
        elif (busy := _being_written(rev.path)) is not None:
            why = busy
        elif others < keep:
            others += 1
            why = f"one of the {keep} most recent besides the current one (--keep {keep})"
        else:
            why = None
        out.append((rev, why))
    return out


def _being_written(path: Path) -> str | None:
    """Why PATH must stay: an mm process reads or writes it (holds its lock), or an import into it is unfinished."""
    if (path / MM_DIR / "unbundle" / "state.json").exists():
        return "an unfinished `mm unbundle` (run it again to complete it)"
    lock = path / MM_DIR / "lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return f"in use: {lock_holder(fd, lock)}"
    finally:
        os.close(fd)


@contextmanager
def _claimed(root: Path, revs: list[Revision]) -> Iterator[tuple[list[Revision], dict[Path, str]]]:
    """Take each revision's lock whole (created if missing, so that a reader starting now finds it) and hold it
    while the revision is renamed away and deleted: a reader or writer that holds it keeps its revision, one
    that comes later is told gc holds it. Yields (the revisions claimed, {path: why kept} for the others)."""
    with ExitStack() as held:
        claimed, busy = [], {}
        for rev in revs:
            lock = rev.path / MM_DIR / "lock"
            try:
                fd = open_file(root, lock, os.O_RDWR | os.O_CREAT, 0o644)
            except (OSError, BadInput) as e:
                busy[rev.path] = f"its lock {lock} cannot be taken ({getattr(e, 'message', None) or e.strerror})"
                continue
            held.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy[rev.path] = f"in use: {lock_holder(fd, lock)}"
                continue
            claimed.append(rev)
        yield claimed, busy


def _freed(store: Store, removed: list[Revision], leftovers: list[Path]) -> int:
    """Bytes on disk that only the removed revisions (and the leftovers) use. An inode with more links than the
    root's revisions hold is used elsewhere too: it frees nothing."""
    gone = {r.path for r in removed}
    kept_layouts = [item for repo in store.repos for r in repo.revisions if r.path not in gone for item in layouts(r)]
    removed_layouts = [item for r in removed for item in layouts(r) + _payload_layouts(r)] + \
        [i for p in leftovers for i in _tree_layouts(p)]
    seen = Counter((i.dev, i.ino) for i in kept_layouts + removed_layouts)
    kept_layouts += [i for i in removed_layouts if i.links > seen[(i.dev, i.ino)]]
    kept_use = DiskUse(kept_layouts).bytes
    return DiskUse(kept_layouts + removed_layouts).bytes - kept_use


