"""The user's path: work already on disk is used, verify says what a user means, the conventions a
newcomer brings. Every test runs the real `mm` (and the real `hf` CLI where a user would) against the local Hub."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.support.run import run_mm

ROOT = Path(__file__).resolve().parents[1]
HF = Path(sys.executable).parent / "hf"
SHARD = "model-00002-of-00004.safetensors"


def hf_download(env: dict, repo_id: str, revision: str, *args: str) -> subprocess.CompletedProcess:
    """The real `hf download` (huggingface_hub's CLI) against the local Hub."""
    r = subprocess.run([str(HF), "download", repo_id, "--revision", revision, *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def hf_local_dir(_hub_server_session, model_repo, tmp_path_factory) -> tuple[Path, dict]:
    """`hf download --local-dir` of the repo's head, once per module; tests copy it."""
    root = tmp_path_factory.mktemp("hf-local")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(root / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               NO_PROXY="127.0.0.1")
    hf_download(env, model_repo.repo_id, model_repo.head, "--local-dir", str(root / "model"))
    return root / "model", env


@pytest.fixture
def filled(hf_local_dir, tmp_path) -> Path:
    dest = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(hf_local_dir[0], dest)
    return dest


@pytest.fixture(scope="module")
def fetched(_hub_server_session, model_repo, hf_local_dir, tmp_path_factory) -> Path:
    """A directory `mm fetch` completed (adopting the hf download: no second download), once per module."""
    dest = tmp_path_factory.mktemp("fetched") / "MiniMax-M3.1-Flash"
    shutil.copytree(hf_local_dir[0], dest)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hf_local_dir[1])
    assert r.returncode == 0, r.stderr
    return dest


@pytest.fixture
def model(fetched, tmp_path) -> Path:
    dest = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(fetched, dest)
    return dest


# --- work already on disk is used, never redone ----------------------------------------------------------

def test_fetch_adopts_what_an_hf_download_already_wrote_without_downloading_it(run_mm, hub_env, hub_server,
                                                                               model_repo, filled):
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    n = len(model_repo.files)
    assert doc["counts"] == {"downloaded": 0, "adopted": n, "present": 0, "failed": 0}
    assert doc["bytes_transferred"] == 0
    m = read_manifest(manifest_path(filled))
    assert all(e.proven and e.source == "local" for e in m.files) and len(m.files) == n


def test_fetch_downloads_over_a_file_on_disk_whose_bytes_differ_and_says_so(run_mm, hub_env, model_repo, filled):
    flip_byte(filled / SHARD)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"]["downloaded"] == 1 and doc["counts"]["adopted"] == len(model_repo.files) - 1
    shard = next(f for f in doc["files"] if f["path"] == SHARD)
    assert shard["status"] == "downloaded" and "not the pinned one" in shard["note"]
    assert (filled / SHARD).read_bytes() == model_repo.read(SHARD)


def test_fetch_never_adopts_through_a_planted_symlink(run_mm, hub_env, model_repo, filled, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(filled / SHARD, outside)
    (filled / SHARD).symlink_to(outside)
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled, "--json", env=hub_env)
    doc = json.loads(r.stdout)
    assert next(f for f in doc["files"] if f["path"] == SHARD)["status"] != "adopted", r.stdout


def test_repair_hashes_only_the_files_it_restored(run_mm, hub_env, model):
    flip_byte(model / SHARD)
    r = run_mm("repair", model, "--json", env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["restored"] == [SHARD]
    assert doc["after"]["bytes_checked"] == (model / SHARD).stat().st_size  # not the whole model a second time
    assert doc["after"]["ok"] is True


def test_repair_of_a_healthy_directory_verifies_once(run_mm, hub_env, model):
    r = run_mm("repair", model, env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "re-verify" not in r.stdout and r.stdout.count("hashed at") == 1, r.stdout
    assert "nothing to re-fetch" in r.stdout


# --- verify says what a user means ----------------------------------------------------------------------

def test_a_users_own_file_is_reported_and_passes_unless_strict(run_mm, model):
    (model / "notes.txt").write_text("my notes\n")
    r = run_mm("verify", model)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EXTRA      notes.txt: not in the manifest" in r.stdout
    assert "OK; 1 extra file(s) reported, not failed (--strict fails on them)" in r.stdout
    r = run_mm("verify", model, "--strict", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["ok"] is False


def test_a_partial_fetch_is_recorded_and_verify_judges_what_was_asked(run_mm, hub_env, model_repo, tmp_path):
    dest = tmp_path / "configs"
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest,
               "--include", "*.json", env=hub_env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(manifest_path(dest).read_text())
    assert doc["schema"] == "mm-manifest/1" and doc["partial"]["include"] == ["*.json"]
    left_out = {p for p in model_repo.files if not p.endswith(".json")}
    assert set(doc["partial"]["left_out"]) == left_out
    v = run_mm("verify", dest)
    assert v.returncode == 0, v.stdout + v.stderr
    assert f"partial fetch (--include '*.json'): {len(left_out)} file(s) of the revision left out" in v.stdout
    assert "INDEX" not in v.stdout and "DRAFT" not in v.stdout
    launch = run_mm("launch", dest, "--hardware", "b300")  # a server needs the whole revision
    assert launch.returncode == 7 and "a partial fetch (--include '*.json')" in launch.stderr, launch.stderr
    (dest / "config.json").unlink()  # damage to what was asked for still fails
    v = run_mm("verify", dest)
    assert v.returncode == 1 and "MISSING    config.json" in v.stdout, v.stdout


def test_a_whole_fetch_writes_no_partial_key(model):
    assert "partial" not in json.loads(manifest_path(model).read_text())


def test_verify_that_finds_damage_names_mm_repair(run_mm, model):
    flip_byte(model / SHARD)
    r = run_mm("verify", model)
    assert r.returncode == 1
    assert f"next: mm repair {model}" in r.stdout, r.stdout
    assert json.loads(run_mm("verify", model, "--json").stdout)["next"].startswith(f"next: mm repair {model}")


def test_quick_verify_summary_and_readme_say_the_same(run_mm, model):
    r = run_mm("verify", model, "--quick")
    assert r.returncode == 0
    said = "presence, sizes, readability and shard headers"
    assert said in r.stdout and f"--quick` checks {said}" in (ROOT / "docs" / "verify.md").read_text()


# --- the Hugging Face cache layout (`hf download` without --local-dir) ----------------------------------

def tree(root: Path) -> dict[str, str]:
    """Every path under ROOT (links as their target, files by size): to prove nothing was written there."""
    return {p.relative_to(root).as_posix(): (os.readlink(p) if p.is_symlink() else str(p.stat().st_size))
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def hf_cache(_hub_server_session, model_repo, tmp_path_factory) -> Path:
    """HF_HOME after a real `hf download` of the head commit into the cache, once per module."""
    home = tmp_path_factory.mktemp("hf-cache") / "hf-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=_hub_server_session.url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")
    hf_download(env, model_repo.repo_id, model_repo.head)
    return home


@pytest.fixture
def snapshot(hf_cache, model_repo, tmp_path, hub_env) -> tuple[Path, dict]:
    """(this test's copy of the cache's snapshot, an environment whose XDG_STATE_HOME is this test's)."""
    home = tmp_path / "hf-home"
    shutil.copytree(hf_cache, home, symlinks=True)
    snap = home / "hub" / f"models--{model_repo.repo_id.replace('/', '--')}" / "snapshots" / model_repo.head
    assert (snap / SHARD).is_symlink()
    return snap, dict(hub_env, XDG_STATE_HOME=str(tmp_path / "state"))


def test_manifest_of_a_cache_snapshot_is_kept_outside_the_cache(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    cache = snap.parents[2]
    before = tree(cache)
    r = run_mm("manifest", snap, "--json", env=env)  # repo and revision come from the layout
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["checked_upstream"] is True and doc["revision"] == model_repo.head
    assert Path(doc["manifest_path"]).is_relative_to(tmp_path / "state" / "mm" / "hf-cache")
    assert tree(cache) == before  # nothing of mm's inside hf's cache
    v = run_mm("verify", snap, env=env)
    assert v.returncode == 0 and v.stdout.count("\n") == 1, v.stdout + v.stderr
    flip_byte(Path(os.path.realpath(snap / SHARD)))  # the blob the link leads to
    v = run_mm("verify", snap, env=env)
    assert v.returncode == 1 and f"HASH       {SHARD}" in v.stdout, v.stdout


def test_fetch_from_a_cache_snapshot_without_a_manifest_reuses_its_files(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", tmp_path / "d",
               "--from", snap, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"]["downloaded"] == 0 and doc["counts"]["adopted"] == len(list(snap.rglob("*.*")))
    assert run_mm("verify", tmp_path / "d", env=env).returncode == 0


def test_fetch_from_a_cache_snapshot_with_its_manifest_reuses_the_blobs_its_links_lead_to(run_mm, snapshot,
                                                                                        model_repo, tmp_path):
    snap, env = snapshot
    assert run_mm("manifest", snap, "--offline", env=env).returncode == 0
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", tmp_path / "d",
               "--from", snap, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["counts"]["downloaded"] == 0, r.stdout


def test_a_link_planted_below_mms_cache_state_is_not_written_through(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state" / "mm" / "hf-cache"
    state.mkdir(parents=True)
    (state / f"models--{model_repo.repo_id.replace('/', '--')}").symlink_to(elsewhere)
    r = run_mm("manifest", snap, "--offline", env=env)
    assert r.returncode == 3 and "symlink" in r.stderr.lower(), r.stdout + r.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_link_in_a_snapshot_that_leaves_its_blobs_is_refused(run_mm, snapshot, tmp_path):
    snap, env = snapshot
    assert run_mm("manifest", snap, "--offline", env=env).returncode == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (snap / "extra.json").symlink_to(outside)
    v = run_mm("verify", snap, env=env)  # the allowance is hf's links into its own blobs/, nothing else
    assert v.returncode == 1 and "SYMLINK    extra.json: points outside the model directory" in v.stdout, v.stdout
    m = run_mm("manifest", snap, "--offline", env=env)
    assert m.returncode == 3 and "does not lead to a file of" in m.stderr, m.stderr


def test_a_cache_snapshot_bundles_unbundles_and_launches(run_mm, snapshot, model_repo, tmp_path):
    snap, env = snapshot
    assert run_mm("manifest", snap, "--offline", env=env).returncode == 0
    b = run_mm("bundle", snap, "--out", tmp_path / "disk", "--volume-size", "100M", "--no-mm", env=env)
    assert b.returncode == 0, b.stderr
    u = run_mm("unbundle", tmp_path / "disk", "--dest", tmp_path / "restored", env=env)
    assert u.returncode == 0, u.stdout + u.stderr
    assert all((tmp_path / "restored" / p).read_bytes() == model_repo.read(p) for p in model_repo.files)
    launch = run_mm("launch", snap, "--hardware", "b300", "--format", "json", env=env)
    assert launch.returncode == 0, launch.stderr
    plan = json.loads(launch.stdout)
    mounts = dict(m.rsplit(":", 2)[:2] for m in plan["mounts"] if m.endswith(":ro"))
    blobs = {container: host for host, container in mounts.items()}["/blobs"]
    model_at = plan["container_model_path"]
    for link in (p for p in snap.rglob("*") if p.is_symlink()):  # every hf link resolves inside the container
        in_container = Path(model_at) / link.relative_to(snap)
        target = os.path.normpath(in_container.parent / os.readlink(link))
        assert target.startswith("/blobs/") and (Path(blobs) / target.removeprefix("/blobs/")).is_file(), target
    assert all(not m.startswith(str(snap.parents[1])) for m in plan["mounts"] if not m.endswith(":ro"))


def test_a_cache_snapshot_pushes_with_titled_layers_and_inspects_with_ok(run_mm, snapshot, registry):
    snap, env = snapshot
    assert run_mm("manifest", snap, "--offline", env=env).returncode == 0
    before = tree(snap.parents[2])
    ref = f"{registry.host}/userpath/snapshot:v1"
    r = run_mm("push", snap, ref, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert tree(snap.parents[2]) == before
    assert json.loads(run_mm("inspect", ref, "--json", env=env).stdout)["ok"] is True
    layers = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                                       capture_output=True, text=True, check=True).stdout)["layers"]
    for layer in layers:  # what `oras pull` names a file by, beside the model-spec's own path
        assert layer["annotations"]["org.opencontainers.image.title"] == layer["annotations"]["org.cncf.model.filepath"]


def test_writers_refuse_a_cache_snapshot_before_writing(run_mm, snapshot, model_repo):
    snap, env = snapshot
    before = tree(snap.parents[2])
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", snap, env=env)
    assert r.returncode == 7 and "a Hugging Face cache snapshot" in r.stderr, r.stderr
    assert tree(snap.parents[2]) == before


# --- messages and conventions ---------------------------------------------------------------------------

def on_a_terminal(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """ARGV under util-linux `script`: its stdout and stderr are a pseudo-terminal, as a user's are."""
    import shlex
    return subprocess.run(["script", "-qec", shlex.join(argv), "/dev/null"], capture_output=True, text=True,
                          timeout=120, env=env)


def test_adopting_shows_what_it_hashes_on_a_terminal(hub_env, model_repo, filled):
    from tests.support.run import mm_argv
    tty = on_a_terminal(mm_argv("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", filled),
                        dict(hub_env, COLUMNS="200"))
    assert tty.returncode == 0, tty.stdout
    assert f"hash {len(model_repo.files)} file(s) already on disk" in tty.stdout
    assert f"0 downloaded, {len(model_repo.files)} adopted" in tty.stdout


def test_an_offline_variable_is_named_not_masked(run_mm, hub_env, model_repo, tmp_path):
    r = run_mm("fetch", model_repo.repo_id, "--revision", "main", "--local-dir", tmp_path / "m",
               env=dict(hub_env, HF_HUB_OFFLINE="1"))
    assert r.returncode == 4 and "HF_HUB_OFFLINE is set" in r.stderr, r.stderr


def test_a_token_value_is_still_masked():
    from mm.artifacts.edges.untrusted import redact
    token = "hf_" + "aB3" * 12
    assert redact(f"HF_TOKEN={token} HF_ENDPOINT=http://u:pw@host") == "HF_TOKEN=hf_*** HF_ENDPOINT=http://host"


def test_fetch_without_revision_says_the_sha_came_from_the_pin(run_mm, hub_env, tmp_path):
    from mm.artifacts.pins import default_pin
    r = run_mm("fetch", "--local-dir", tmp_path / "m", env=hub_env)  # the local Hub has no such commit
    assert r.returncode == 4
    assert f"no --revision given: {default_pin().revision[:12]} is the revision of mm's pin" in r.stderr, r.stderr


@pytest.mark.parametrize("typo, meant", [("bundle verfy", "verify"), ("manifest exprot", "export")])
def test_a_subcommand_typo_suggests_the_subcommand(run_mm, tmp_path, typo, meant):
    r = run_mm(*typo.split(), "x", cwd=tmp_path)
    assert r.returncode == 2 and f"Did you mean '{meant}'?" in r.stderr and "--out" not in r.stderr, r.stderr


@pytest.mark.parametrize("command, typed, own", [("pull", "--dest", "--local-dir"), ("unbundle", "--local-dir", "--dest"),
                                                 ("launch", "--output", "--out")])
def test_an_option_another_command_spells_otherwise_names_this_ones(tmp_path, command, typed, own):
    r = run_mm(command, "x", typed, "y", cwd=tmp_path)
    assert r.returncode == 2 and f"No such option '{typed}': mm {command} calls it {own}" in r.stderr, r.stderr


def test_version_command_and_short_flag():
    outs = {run_mm(*args).stdout for args in (("version",), ("-V",), ("--version",))}
    assert len(outs) == 1 and outs.pop().startswith("mm, version ")
    assert json.loads(run_mm("version", "--json").stdout)["ok"] is True


def test_shell_completion_as_the_readme_says(tmp_path):
    script = run_mm(extra_env={"_MM_COMPLETE": "bash_source"})
    assert script.returncode == 0 and "_mm_completion" in script.stdout
    words = run_mm(extra_env={"_MM_COMPLETE": "bash_complete", "COMP_WORDS": "mm bundle ver", "COMP_CWORD": "2"})
    assert "verify" in words.stdout
    assert "_MM_COMPLETE=bash_source mm" in (ROOT / "README.md").read_text()


def test_every_help_has_examples_that_parse():
    import shlex
    import click
    from mm.cli import main

    def walk(cmd, path):
        yield path, cmd
        if isinstance(cmd, click.Group):  # the root loads each command's module here
            ctx = click.Context(cmd, info_name=path)
            for name in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, name), f"{path} {name}")

    for path, cmd in walk(main, "mm"):
        with click.Context(cmd, info_name=path) as ctx:
            assert "Examples:\n    mm" in cmd.get_help(ctx), path
        for line in cmd.epilog.splitlines()[2:]:
            argv = next(part for part in line.replace("&&", "|").split("|") if part.strip().startswith("mm"))
            args = shlex.split(argv, comments=True)[1:]
            if "COMMAND" in args or "--help" in args or "-V" in args:
                continue
            main.make_context("mm", list(args), resilient_parsing=False)  # raises on an unknown option


def test_hardware_is_accepted_in_any_case(run_mm, model):
    r = run_mm("launch", model, "--hardware", "B300", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recipe"] == "sglang/b300/balanced"


def test_user_facing_text_cites_the_guide_by_title_not_a_repository_path(run_mm, model):
    script = run_mm("launch", model, "--hardware", "b300")
    assert script.returncode == 0 and "Self-host MiniMax-M3.1-Flash" in script.stdout, script.stdout[:500]
    for text in [script.stdout, *((ROOT / "manifests").glob("*.json"))]:
        assert "seeds/" not in (text if isinstance(text, str) else text.read_text(encoding="utf-8"))


def test_image_save_speaks_plain_http_to_loopback_without_a_flag(pinned_image, run_mm, tmp_path):
    r = run_mm("image", "save", pinned_image.ref, "--platform", "linux/amd64", "--out", tmp_path / "i.tar")
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_image_save_on_an_offline_host_says_so_and_what_to_do(run_mm, tmp_path):
    r = run_mm("image", "save", "--out", tmp_path / "i.tar", prefix=("unshare", "-n"))
    assert r.returncode == 4, r.stderr
    assert "this host looks offline" in r.stderr and "runs on the connected side" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_allowed_signers_alone_requires_a_signature_in_every_command(run_mm, model, keys, tmp_path):
    for args in (("verify", model), ("launch", model, "--hardware", "b300")):
        r = run_mm(*args, "--allowed-signers", keys["allowed"])
        assert r.returncode == 5 and "not signed" in r.stderr, (args, r.stderr)
    assert run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "100M", "--no-mm").returncode == 0
    u = run_mm("unbundle", tmp_path / "disk", "--dest", tmp_path / "d", "--allowed-signers", keys["allowed"])
    assert u.returncode == 5 and "not signed" in u.stderr and not (tmp_path / "d").exists(), u.stderr


def _allowed(keys, tmp_path, options: str, principal: str = "alice@example.com") -> Path:
    pub = " ".join(Path(f"{keys['alice']}.pub").read_text().split()[:2])
    path = tmp_path / "allowed"
    path.write_text(f"{principal} {options}{' ' if options else ''}{pub}\n")
    return path


@pytest.mark.parametrize("options, reason", [('valid-before="20200101"', "key has expired"),
                                             ('valid-before="tomorrow"', 'invalid "valid-before" time')])
def test_a_signature_refusal_passes_on_ssh_keygens_reason(run_mm, model, keys, tmp_path, options, reason):
    assert run_mm("sign", model, "--key", keys["alice"]).returncode == 0
    r = run_mm("verify", model, "--allowed-signers", _allowed(keys, tmp_path, options))
    assert r.returncode == 5 and reason in r.stderr and "does not allow" not in r.stderr, r.stderr


def test_a_wildcard_principal_is_shown_as_a_pattern(run_mm, model, keys, tmp_path):
    assert run_mm("sign", model, "--key", keys["alice"]).returncode == 0
    r = run_mm("verify", model, "--allowed-signers", _allowed(keys, tmp_path, "", "*@example.com"))
    assert r.returncode == 0, r.stderr
    assert "allowed for any principal matching '*@example.com'" in r.stdout and "signed by *@" not in r.stdout


def test_install_mm_gives_venvs_whole_reason(wheelhouse_dir, bare_python, tmp_path):
    # Debian without python3-venv: venv's message spans lines and ends with a blank one; uv is made to fail too,
    # so the run stops right after the line under test.
    real = (bare_python / "python3").read_text().split("exec ", 1)[1].split(" -I")[0]
    (bare_python / "python3").write_text(
        '#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n'
        '  printf "The virtual environment was not created successfully because ensurepip is not\\n'
        'available.\\n\\nFailing command: /x/bin/python3\\n\\n" >&2\n  exit 1\nfi\n'
        f'case "$1 $3" in "- "*/uv) exit 1 ;; esac\nexec {real} -I "$@"\n')  # no uv either
    proc = subprocess.run(["sh", str(wheelhouse_dir / "install-mm.sh"), str(tmp_path / "venv")], cwd=tmp_path,
                          env={"PATH": f"{bare_python}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert ("venv/pip not usable here (The virtual environment was not created successfully because ensurepip is "
            "not available. Failing command: /x/bin/python3); installing with the bundled uv") in proc.stderr, proc.stderr


def test_readme_lists_every_mm_environment_variable():
    import re
    code = [ROOT / "cli.py", *(ROOT / "commands").rglob("*.py"), *(ROOT / "artifacts").rglob("*.py"), *(ROOT / "artifacts").rglob("*.sh"),
            *(ROOT / "tests").rglob("*.py")]
    read = re.compile(r"""(?:environ(?:\.get)?\(\s*|environ\[|envvar=|getenv\(\s*|default=)["'](MM_[A-Z0-9_]+)["']"""
                      r"""|\$\{?(MM_[A-Z0-9_]+)""")
    used = {a or b for path in code for a, b in read.findall(path.read_text(encoding="utf-8"))}
    table = (ROOT / "docs" / "environment.md").read_text()
    assert used and not {v for v in used if f"| `{v}`" not in table}, sorted(used)


# --- the newcomer's first ten minutes --------------------------------------------------------------------

def make_dry_run(*args: str, venv: Path) -> str:
    r = subprocess.run(["make", "-n", f"VENV={venv}", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_demo_installs_mm_only_and_says_where_it_is(tmp_path):
    demo = make_dry_run("demo", venv=tmp_path / "venv")
    assert "pip install -q -e . " in demo and "export PATH=" in demo and f"{tmp_path}/venv/bin" in demo
    assert not any(engine in demo for engine in ("vllm", "sglang", "[test]"))
    test = make_dry_run("test", venv=tmp_path / "venv")
    assert all(engine in test for engine in ("vllm==", "sglang==", "sglang-router==", "'.[test]'"))


def test_make_stamps_reinstall_the_test_tools_after_mm(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()
    (venv / ".installed-test").touch()
    os.utime(venv / ".installed", (1e10, 1e10))  # mm re-installed after the test tools: they follow
    up_to_date = lambda target, *w: subprocess.run(["make", "-q", f"VENV={venv}", *w, target], cwd=ROOT).returncode
    assert up_to_date("install") == 0 and up_to_date("install-test") == 1
    os.utime(venv / ".installed-test", (2e10, 2e10))
    assert up_to_date("install-test") == 0 and up_to_date("install-test", "-W", "setup.cfg") == 1


def test_mm_wheel_from_a_plain_editable_checkout_holds_only_the_package(tmp_path):
    # `pip install -e .` without strict mode makes the checkout itself the `mm` package: .git/, tests/ beside it.
    checkout = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files", "cli.py", "_version.py", "commands", "artifacts", "manifests",
                              "setup.cfg"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, checkout / rel)
    for junk in (".git/HEAD", "tests/test_x.py", "tests/__init__.py", "notes/todo.txt"):
        (checkout / junk).parent.mkdir(parents=True, exist_ok=True)
        (checkout / junk).write_text("not mm\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "mm").symlink_to(checkout)
    code = ("import sys, zipfile; from pathlib import Path; from mm.artifacts.bundle import wheelhouse; "
            "print('\\n'.join(zipfile.ZipFile(wheelhouse.build_mm_wheel(Path(sys.argv[1]))).namelist()))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], env=dict(os.environ, PYTHONPATH=str(site)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    names = set(r.stdout.split())
    assert not [n for n in names if n.startswith(("mm/.git", "mm/tests", "mm/notes"))], sorted(names)
    expected = {f"mm/{rel}" for rel in tracked if rel.endswith((".py", ".json", ".sh")) and rel != "setup.cfg"}
    assert {n for n in names if not n.startswith("mm-")} == expected


def test_the_wheels_file_list_is_setup_cfgs():
    import configparser
    from mm.artifacts.bundle import wheelhouse
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    packages = [p.strip() for p in cfg["options"]["packages"].split(",")]
    assert [p.removeprefix("mm").lstrip(".").replace(".", "/") for p in packages] == list(wheelhouse.PACKAGES)
    data = {k.removeprefix("mm").lstrip(".").replace(".", "/"): tuple(v.split()) for k, v in cfg["options.package_data"].items()}
    assert data == wheelhouse.PACKAGE_DATA


def test_known_content_in_another_directory_is_copied_in_not_downloaded(tmp_path):
    """The engine's step `fetch --from BASE_DIR` builds on: a candidate elsewhere is hashed as it is copied and
    published under its final name only when it matches; a wrong one leaves nothing behind."""
    import hashlib
    from mm.artifacts.fetching.download import RemoteFile, Session
    from mm.artifacts.integrity.hashing import git_blob_sha1

    base, dest = tmp_path / "base", tmp_path / "dest"
    base.mkdir()
    good, bad = os.urandom(3 << 20), b"{}\n"
    (base / "w.safetensors").write_bytes(good)
    (base / "c.json").write_bytes(b"[]\n")  # same size as what is pinned, other bytes
    files = [RemoteFile("sub/w.safetensors", len(good), "x", lfs_sha256=hashlib.sha256(good).hexdigest()),
             RemoteFile("c.json", len(bad), git_blob_sha1(bad))]
    with Session(dest, "test") as session:
        adopted = session.adopt(files, {"sub/w.safetensors": base / "w.safetensors", "c.json": base / "c.json"})
    assert set(adopted) == {"sub/w.safetensors"} and session.differing == {"c.json"}
    outcome, entry = adopted["sub/w.safetensors"]
    assert outcome.status == "adopted" and entry.proven and entry.sha256 == files[0].lfs_sha256
    assert (dest / "sub" / "w.safetensors").read_bytes() == good and not (dest / "c.json").exists()
    assert not list((dest / ".mm" / "partial").iterdir())
