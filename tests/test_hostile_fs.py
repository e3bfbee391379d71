"""A target directory is mm's, and only its own; a local file is what it seems, or refused.

The rule (docs/hostile-input.md): a directory or file the user names is taken as given, a symlink included (the
user's choice); below it, mm writes, renames and deletes only through real directories, never through a symlink (a
link at a final name is replaced by the rename, as a name), and never into a file that has another hard link. A link in the way is refused, exit 3, naming it. Local
files mm reads (logs, signatures, keys, auth files, manifests, image archives, volumes) must be regular files;
their size is checked with fstat before a bounded read, so a FIFO, /dev/zero or a huge file never hangs or swells mm.

Families (each parametrized):
  fetch     a link planted in an `mm fetch` target, in every position (subdir, .mm/, .mm/partial/, a partial file,
            its range map, the journal, the lock, dangling, a loop), a hard-linked partial; a final name linked
            outside (symlink or hard link) is replaced as a name, what it points to untouched
  pull      the same for `mm pull`, and the file of another revision deleted through a linked subdirectory
  writers   unbundle --dest, bundle --out, launch --out and the kernel-cache root, manifest export, sign
  user      a target the user names that is itself a link: followed, as the user chose
  race      a parent swapped for a link after mm opened it, or while mm creates it (fsutil's openat walk)
  local     local files that are not what they seem: FIFOs, /dev/zero, a 700 MB sparse signature, directories
Each case: no exit 70, no traceback, the exit code, the message naming the link (or file), and a snapshot of a
sentinel directory outside the target unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mm.artifacts.edges import fsutil
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.errors import BadInput
from tests.support.modelgen import write_fetched_model
from tests.support.run import run_mm

REV_A = "ce7f4df87d2e05262f5775f373dac4772f134041"
REV_B = "54e4e69dfc45aa11bb22cc33dd44ee55ff667788"
DEADLINE = 60  # seconds any one case may take (a hang on a FIFO would be caught here)


# --- helpers ------------------------------------------------------------------------------------

def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ROOT: links by target, files by content hash and mode, directories by name."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
    return out


@pytest.fixture
def outside(tmp_path) -> Path:
    """The sentinel: a directory outside every target, which no case may change."""
    root = tmp_path / "outside"
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "victim").write_bytes(b"precious bytes, not mm's\n")
    (root / "dir" / "config.json").write_text('{"not": "mm\'s"}\n')
    (root / "dir" / "model.safetensors").write_bytes(b"\0" * 64)
    return root


def refused(r: subprocess.CompletedProcess, code: int, *names: object) -> None:
    """Exit CODE (never 70), no traceback, and the output naming each of NAMES."""
    text = r.stderr + r.stdout
    assert "Traceback" not in text, text
    assert r.returncode == code, f"exit {r.returncode}, expected {code}: {text}"
    for name in names:
        assert str(name) in text, text


def unchanged(outside: Path, before: dict) -> None:
    assert snapshot(outside) == before, "something outside the target was created, changed or deleted"


# --- fetch: a link planted in the target ---------------------------------------------------------

def _upstream(model_repo) -> str:
    """The first shard's LFS sha256: the name of its partial file (DIR/.mm/partial/<sha256>.part)."""
    shard = next(p for p in sorted(model_repo.files) if p.endswith(".safetensors"))
    return hashlib.sha256(model_repo.read(shard)).hexdigest()


def _plant(dest: Path, where: str, outside: Path, upstream: str) -> Path:
    """Plant a link (or hard link) at WHERE in DEST; returns the path the message must name."""
    partial = dest / ".mm" / "partial"
    links = {
        "subdir": (dest / "dspark", outside / "dir"),
        "state dir": (dest / ".mm", outside / "dir"),
        "partial dir": (partial, outside / "dir"),
        "partial file": (partial / f"{upstream}.part", outside / "dir" / "victim"),
        "range map": (partial / f"{upstream}.part.ranges", outside / "dir" / "victim"),
        "journal": (dest / ".mm" / "journal.jsonl", outside / "dir" / "victim"),
        "lock": (dest / ".mm" / "lock", outside / "dir" / "victim"),
        "dangling": (dest / "dspark", outside / "missing"),
        "loop": (dest / "dspark", Path("dspark")),
    }
    if where == "hard-linked partial":
        partial.mkdir(parents=True)
        os.link(outside / "dir" / "victim", partial / f"{upstream}.part")
        return partial / f"{upstream}.part"
    link, target = links[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("where", ["subdir", "state dir", "partial dir", "partial file", "range map", "journal", "lock",
                                   "dangling", "loop", "hard-linked partial"])
def test_fetch_refuses_a_link_planted_in_its_target(where, run_mm, hub_env, model_repo, outside, tmp_path):
    dest = tmp_path / "model"
    named = _plant(dest, where, outside, _upstream(model_repo))
    before = snapshot(outside)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.commits[-1], "--local-dir", dest, env=hub_env,
               timeout=DEADLINE)
    refused(r, 3, named)
    assert "hard links" in r.stderr + r.stdout if where == "hard-linked partial" else "is a symlink" in r.stderr
    unchanged(outside, before)


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_fetch_over_a_final_name_linked_outside_replaces_the_name_only(link, run_mm, hub_env, model_repo, outside,
                                                                       tmp_path):
    """A final name is published by rename: a link there is replaced, never written through; what it pointed to
    keeps its bytes (and the file is downloaded, not adopted through the link)."""
    dest = tmp_path / "model"
    dest.mkdir()
    if link == "symlink":
        (dest / "config.json").symlink_to(outside / "dir" / "config.json")
    else:
        os.link(outside / "dir" / "config.json", dest / "config.json")
    before = snapshot(outside)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.commits[-1], "--local-dir", dest, env=hub_env,
               timeout=DEADLINE)
    refused(r, 0)
    assert not (dest / "config.json").is_symlink()
    assert (dest / "config.json").read_bytes() == model_repo.read("config.json")
    unchanged(outside, before)


# --- pull: a link planted in the target, and a deletion through one --------------------------------

def _registry_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG") and k.lower() not in ("http_proxy", "https_proxy")}
    return dict(env, DOCKER_CONFIG=str(tmp_path / "docker-config"), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory) -> dict[str, str]:
    """Two revisions pushed: A with dspark/, B without (so pulling B over A removes A's dspark files)."""
    refs = {}
    for rev, draft, tag in ((REV_A, True, "a"), (REV_B, False, "b")):
        root = tmp_path_factory.mktemp(f"pull-{tag}") / "MiniMax-M3.1-Flash"
        write_fetched_model(root, rev, shards=1, shard_bytes=32 * 1024, draft=draft, seed=ord(tag))
        ref = f"{registry.host}/hostile-fs/flash:{tag}"
        r = run_mm("push", root, ref, env=_registry_env(root.parent), timeout=DEADLINE)
        assert r.returncode == 0, r.stderr
        refs[tag] = ref
    return refs


@pytest.mark.parametrize("where", ["subdir", "state dir"])
def test_pull_refuses_a_link_planted_in_its_target(where, pushed, outside, tmp_path):
    dest = tmp_path / "model"
    named = _plant(dest, where, outside, "unused")
    before = snapshot(outside)
    r = run_mm("pull", pushed["a"], "--local-dir", dest, env=_registry_env(tmp_path), timeout=DEADLINE)
    refused(r, 3, named, "is a symlink")
    unchanged(outside, before)


def test_pull_of_another_revision_deletes_nothing_through_a_linked_subdirectory(pushed, outside, tmp_path):
    dest = tmp_path / "model"
    env = _registry_env(tmp_path)
    refused(run_mm("pull", pushed["a"], "--local-dir", dest, env=env, timeout=DEADLINE), 0)
    for f in (dest / "dspark").iterdir():  # the same names outside, behind a link where dspark/ was
        shutil.copyfile(f, outside / "dir" / f.name)
    shutil.rmtree(dest / "dspark")
    (dest / "dspark").symlink_to(outside / "dir")
    before = snapshot(outside)
    r = run_mm("pull", pushed["b"], "--local-dir", dest, env=env, timeout=DEADLINE)
    refused(r, 3, dest / "dspark", "is a symlink")
    unchanged(outside, before)


# --- the other writers: unbundle --dest, bundle --out, launch, manifest export, sign ---------------

@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return write_fetched_model(tmp_path_factory.mktemp("small") / "MiniMax-M3.1-Flash", REV_A, shards=1,
                               shard_bytes=32 * 1024)


@pytest.fixture
def model(small_model, tmp_path) -> Path:
    root = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(small_model, root)
    return root


@pytest.fixture(scope="module")
def volumes(small_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("volumes")
    create_bundle(small_model, BundleOptions((out,), 10 ** 9, name="small"))
    return out


@pytest.mark.parametrize("where", ["subdir", "state dir"])
def test_unbundle_refuses_a_link_planted_in_dest(where, volumes, outside, tmp_path):
    dest = tmp_path / "dest"
    named = _plant(dest, where, outside, "unused")
    before = snapshot(outside)
    refused(run_mm("unbundle", volumes, "--dest", dest, timeout=DEADLINE), 3, named, "is a symlink")
    unchanged(outside, before)


def test_unbundle_over_a_final_name_linked_outside_replaces_the_name_only(volumes, outside, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").symlink_to(outside / "dir" / "config.json")
    before = snapshot(outside)
    refused(run_mm("unbundle", volumes, "--dest", dest, timeout=DEADLINE), 0)
    assert not (dest / "config.json").is_symlink() and (dest / "config.json").is_file()
    unchanged(outside, before)


@pytest.mark.parametrize("name", ["small.vol001-of-001.tar", ".small.vol001-of-001.tar.partial"])
def test_bundle_refuses_a_link_planted_in_out(name, small_model, outside, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(outside / "dir" / "victim")
    before = snapshot(outside)
    r = run_mm("bundle", small_model, "--out", out, "--volume-size", "1G", "--name", "small", timeout=DEADLINE)
    refused(r, 3, out / name, "is a symlink")
    unchanged(outside, before)


@pytest.mark.parametrize("command", ["manifest export", "sign"])
def test_a_writer_of_a_model_directory_refuses_a_linked_state_dir(command, model, keys, outside):
    """The manifest is read through the link (reading is harmless); what they write is refused."""
    shutil.copytree(model / ".mm", outside / "dir" / "state")
    shutil.rmtree(model / ".mm")
    (model / ".mm").symlink_to(outside / "dir" / "state")
    before = snapshot(outside)
    args = ["manifest", "export", model] if command == "manifest export" else ["sign", model, "--key", keys["alice"]]
    refused(run_mm(*args, timeout=DEADLINE), 3, model / ".mm", "is a symlink")
    unchanged(outside, before)


def test_launch_refuses_a_linked_default_kernel_cache_root(model, outside):
    (model.parent / "mm-kernel-cache").symlink_to(outside / "dir")
    before = snapshot(outside)
    r = run_mm("launch", model, "--hardware", "b300", timeout=DEADLINE)
    refused(r, 3, model.parent / "mm-kernel-cache", "is a symlink")
    unchanged(outside, before)


def test_launch_refuses_a_link_planted_for_a_kernel_cache_mount(model, outside, tmp_path):
    """docker -v would mount what the link points to, read-write, into the container."""
    cache_root = tmp_path / "caches"
    plan = run_mm("launch", model, "--hardware", "b300", "--cache-root", cache_root, "--format", "json",
                  timeout=DEADLINE)
    assert plan.returncode == 0, plan.stderr
    mounts = [m.split(":")[0] for m in json.loads(plan.stdout)["mounts"] if m.startswith(f"{cache_root}/")]
    link = Path(mounts[0])  # HOST:CONTAINER, the first kernel cache's directory on the host
    cache_root.mkdir(exist_ok=True)
    link.symlink_to(outside / "dir")
    before = snapshot(outside)
    refused(run_mm("launch", model, "--hardware", "b300", "--cache-root", cache_root, timeout=DEADLINE), 3, link,
            "is a symlink")
    unchanged(outside, before)


# --- user: a target the user names that is itself a link is followed (their choice) ---------------

def test_a_fetch_target_that_is_a_link_the_user_named_is_followed(run_mm, hub_env, model_repo, tmp_path):
    real = tmp_path / "big-disk" / "model"
    real.mkdir(parents=True)
    (tmp_path / "model").symlink_to(real)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.commits[-1], "--local-dir", tmp_path / "model",
               env=hub_env, timeout=DEADLINE)
    refused(r, 0)
    assert (real / "config.json").read_bytes() == model_repo.read("config.json")
    assert (tmp_path / "model").is_symlink()


def test_a_bundle_out_that_is_a_link_the_user_named_is_followed(small_model, tmp_path):
    real = tmp_path / "disk1"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    r = run_mm("bundle", small_model, "--out", tmp_path / "out", "--volume-size", "1G", "--name", "s", timeout=DEADLINE)
    refused(r, 0)
    assert (real / "s.vol001-of-001.tar").is_file()


def test_a_launch_out_file_that_is_a_link_the_user_named_is_written_at_its_target(model, tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (tmp_path / "start.sh").symlink_to(scripts / "start.sh")  # dangling until mm writes it
    refused(run_mm("launch", model, "--hardware", "b300", "--out", tmp_path / "start.sh", timeout=DEADLINE), 0)
    assert (tmp_path / "start.sh").is_symlink() and "docker run" in (scripts / "start.sh").read_text()


# --- race: a parent swapped for a link while mm works (fsutil's openat walk) ------------------------

def test_a_parent_swapped_for_a_link_after_it_was_opened_is_not_followed(outside, tmp_path):
    """mm holds the directory, not its name: the file lands in the real directory, wherever it was moved."""
    root = tmp_path / "target"
    before = snapshot(outside)
    with fsutil.parent_dir(root, root / "sub" / "file", create=True) as (dfd, name):
        (root / "sub").rename(root / "moved")
        (root / "sub").symlink_to(outside / "dir")  # the attacker's swap, between mm's check and its write
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
        os.close(fd)
    assert (root / "moved" / "file").is_file()
    unchanged(outside, before)


def test_a_link_swapped_in_while_mm_creates_a_directory_is_refused(outside, tmp_path, monkeypatch):
    """Another process wins the race for the name mm is creating, with a link: the next open refuses it."""
    root = tmp_path / "target"
    root.mkdir()
    real_mkdir = os.mkdir

    def racing_mkdir(name, mode=0o777, *, dir_fd=None):
        os.symlink(outside / "dir", name, dir_fd=dir_fd)
        raise FileExistsError(name)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(BadInput, match="is a symlink"):
        fsutil.atomic_write_bytes(root / "sub" / "f", b"x", root=root)
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert not (outside / "dir" / "f").exists()


def test_a_file_with_another_hard_link_is_never_opened_for_writing(outside, tmp_path):
    root = tmp_path / "target"
    root.mkdir()
    os.link(outside / "dir" / "victim", root / "partial")
    before = snapshot(outside)
    with pytest.raises(BadInput, match="2 hard links"):
        fsutil.open_file(root, root / "partial", os.O_RDWR)
    unchanged(outside, before)


# --- local: files that are not what they seem -------------------------------------------------------

@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_a_signature_linked_to_a_700_mb_file_is_refused_by_its_size(model, keys, tmp_path):
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(700 * 1024 * 1024)  # sparse: no disk used, 700 MB to read
    (model / ".mm" / "manifest.json.sig").symlink_to(huge)
    r = run_mm("verify", model, "--allowed-signers", keys["allowed"], timeout=DEADLINE)
    refused(r, 3, model / ".mm" / "manifest.json.sig", "larger than")


@pytest.mark.parametrize("what", ["fifo", "/dev/zero"])
def test_a_signature_that_is_not_a_regular_file_is_refused(what, model, keys, fifo):
    (model / ".mm" / "manifest.json.sig").symlink_to(fifo if what == "fifo" else what)
    r = run_mm("verify", model, "--allowed-signers", keys["allowed"], timeout=DEADLINE)
    refused(r, 3, model / ".mm" / "manifest.json.sig", "not a regular file")


@pytest.mark.parametrize("where", ["missing", "a dangling link", "a link loop"])
def test_a_signature_that_is_not_there_is_one_meaning_not_signed_exit_5(where, model, keys, tmp_path):
    sig = model / ".mm" / "manifest.json.sig"
    if where == "a dangling link":
        sig.symlink_to(tmp_path / "nowhere.sig")
    elif where == "a link loop":
        sig.symlink_to(sig)
    r = run_mm("verify", model, "--allowed-signers", keys["allowed"], timeout=DEADLINE)
    refused(r, 5, "not signed")


@pytest.mark.parametrize("where", ["missing", "a dangling link"])
def test_bundle_of_a_model_whose_signature_is_not_there_carries_none(where, model, tmp_path):
    if where == "a dangling link":
        (model / ".mm" / "manifest.json.sig").symlink_to(tmp_path / "nowhere.sig")
    r = run_mm("bundle", model, "--out", tmp_path / "out", "--volume-size", "1G", "--json", timeout=DEADLINE,
               extra_env={"MM_BUNDLE_NO_MM": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout).get("signature") is None


@pytest.mark.skipif(shutil.which("setpriv") is None and os.geteuid() == 0, reason="needs setpriv to drop root's read-any-file capability")
@pytest.mark.parametrize("command", [["diagnose", "{f}"], ["verify", "{model}", "--allowed-signers", "{f}"]])
def test_a_file_mm_may_not_read_is_mm_s_one_line_and_exit_3_not_a_usage_error(command, model, tmp_path):
    f = tmp_path / "private"
    f.write_text("x\n")
    f.chmod(0)
    as_unprivileged = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    r = run_mm(*[a.format(f=f, model=model) for a in command], prefix=as_unprivileged, timeout=DEADLINE)
    refused(r, 3, f, "Permission denied")


@pytest.mark.parametrize("what", ["fifo", "/dev/zero"])
def test_a_log_that_is_not_a_regular_file_is_refused(what, fifo):
    path = fifo if what == "fifo" else Path(what)
    refused(run_mm("diagnose", path, timeout=DEADLINE), 3, path, "not a regular file")


@pytest.mark.parametrize("what", ["a directory", "under a file"])
def test_an_unreadable_log_exits_3(what, tmp_path):
    path = tmp_path if what == "a directory" else Path(__file__) / "log"
    refused(run_mm("diagnose", path, timeout=DEADLINE), 3, path)


def test_a_registry_auth_file_that_is_a_fifo_is_refused(fifo, unused_port, tmp_path):
    env = dict(_registry_env(tmp_path), REGISTRY_AUTH_FILE=str(fifo))
    r = run_mm("inspect", f"127.0.0.1:{unused_port}/a/b:c", env=env, timeout=DEADLINE)
    refused(r, 3, fifo, "FIFO")


def test_a_manifest_linked_to_dev_zero_is_refused(model):
    (model / ".mm" / "manifest.json").unlink()
    (model / ".mm" / "manifest.json").symlink_to("/dev/zero")
    refused(run_mm("verify", model, timeout=DEADLINE), 3, model / ".mm" / "manifest.json", "character device")


@pytest.mark.parametrize("option", ["--allowed-signers", "--key"])
def test_a_key_or_allowed_signers_file_that_is_a_fifo_is_refused(option, model, keys, fifo):
    args = ("verify", model, "--allowed-signers", fifo) if option == "--allowed-signers" else ("sign", model, "--key", fifo)
    refused(run_mm(*args, timeout=DEADLINE), 3, fifo, "FIFO")


@pytest.mark.parametrize("what", ["fifo", "/dev/zero"])
def test_an_image_archive_or_volume_that_is_not_a_regular_file_is_refused(what, small_model, fifo, tmp_path):
    path = fifo if what == "fifo" else Path(what)
    r = run_mm("bundle", small_model, "--out", tmp_path / "o", "--volume-size", "1G", "--image", path,
               "--allow-other-image", timeout=DEADLINE)
    refused(r, 3, path)
    refused(run_mm("unbundle", path, "--dest", tmp_path / "d", timeout=DEADLINE), 3, path)
