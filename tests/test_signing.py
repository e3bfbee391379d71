"""Signed manifests: the real ssh-keygen (Debian openssh-client), a real ssh-agent started here, the real CLI.

Keys: alice (ed25519, no passphrase, in allowed_signers as alice@example.com), bob (ed25519 with a passphrase,
in allowed_signers as bob@example.com, usable only through the agent), mallory (not in allowed_signers).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mm.artifacts.integrity import signing
from mm.artifacts.errors import IntegrityError
from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.paths import manifest_path
from tests.support.modelgen import write_model
from tests.support.run import run_mm
from tests.support.sshkeys import BOB_PASSPHRASE, keygen

REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
README = Path(__file__).resolve().parent.parent / "docs" / "verify.md"


def mm(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real mm (tests.support.run), without the caller's ssh-agent: a test that wants one passes ENV."""
    base = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    return run_mm(*args, env=base, extra_env=env)


def fingerprint(pub: Path) -> str:
    return keygen("-l", "-f", str(pub)).stdout.decode().split()[1]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "MiniMax-M3.1-Flash"
    write_model(root, shards=2, shard_bytes=128 * 1024)
    manifest_for_local_dir(root, REPO, COMMIT, offline=True)
    return root


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    root = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(pristine, root)
    return root


@pytest.fixture
def agent(keys, tmp_path):
    """A real ssh-agent (foreground, this test's own process) holding bob's passphrase-protected key."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.02)
        askpass = tmp_path / "askpass.sh"
        askpass.write_text(f"#!/bin/sh\necho '{BOB_PASSPHRASE}'\n")
        askpass.chmod(0o700)
        env = dict(os.environ, SSH_AUTH_SOCK=str(sock), SSH_ASKPASS=str(askpass), SSH_ASKPASS_REQUIRE="force",
                   DISPLAY=":0")
        r = subprocess.run(["ssh-add", str(keys["bob"])], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        yield {"SSH_AUTH_SOCK": str(sock)}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def sign(model: Path, key: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = mm("sign", model, "--key", key, env=env)
    assert r.returncode == 0, r.stderr
    return r


def private_key_text(key: Path) -> str:
    return "".join(key.read_text().splitlines()[1:-1])


# --- signing and verifying ------------------------------------------------------------------------

def test_sign_writes_the_signature_and_verify_names_identity_and_fingerprint(model, keys):
    r = sign(model, keys["alice"])
    sig = model / ".mm" / "manifest.json.sig"
    assert sig.read_bytes().startswith(b"-----BEGIN SSH SIGNATURE-----")
    fp = fingerprint(keys["dir"] / "alice.pub")
    assert fp in r.stdout and private_key_text(keys["alice"]) not in r.stdout + r.stderr
    v = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert v.returncode == 0, v.stderr
    assert f"signature: good, signed by alice@example.com (ssh-ed25519 key {fp})" in v.stdout
    assert "OK" in v.stdout.splitlines()[-1]
    doc = json.loads(mm("verify", model, "--allowed-signers", keys["allowed"], "--identity", "alice@example.com",
                        "--json").stdout)
    assert doc["ok"] and doc["signature"]["identity"] == "alice@example.com" and doc["signature"]["fingerprint"] == fp


def test_ssh_keygen_alone_verifies_with_the_line_the_readme_gives(model, keys):
    sign(model, keys["alice"])
    line = signing.verify_command(str(keys["allowed"]), "alice@example.com")
    assert signing.verify_command() in README.read_text()
    assert "mm" not in line.replace("mm-manifest", "")
    r = subprocess.run(["sh", "-c", line], cwd=model / ".mm", capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert 'Good "mm-manifest" signature for alice@example.com' in r.stdout + r.stderr


def test_tampered_manifest_is_refused_before_any_byte_is_read(model, keys):
    sign(model, keys["alice"])
    mpath = manifest_path(model)
    doc = json.loads(mpath.read_text())
    doc["revision"] = "0" * 40
    mpath.write_text(json.dumps(doc, indent=2) + "\n")
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "does not verify" in r.stderr and "changed after signing" in r.stderr
    assert "hashed" not in r.stdout  # the byte check never ran


def test_tampered_file_with_untouched_manifest_passes_the_signature_and_fails_the_bytes(model, keys):
    sign(model, keys["alice"])
    shard = next(model.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "signature: good, signed by alice@example.com" in r.stdout
    assert "HASH" in r.stdout and shard.name in r.stdout


def test_signature_by_a_key_not_in_allowed_signers_is_refused(model, keys):
    sign(model, keys["mallory"])
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 5
    fp = fingerprint(keys["dir"] / "mallory.pub")
    assert fp in r.stderr and "does not allow" in r.stderr


def test_signature_for_another_namespace_is_refused(model, keys):
    r = keygen("-Y", "sign", "-f", str(keys["alice"]), "-n", "git", str(manifest_path(model)))
    assert r.returncode == 0, r.stderr
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 5
    assert "namespace 'git', not 'mm-manifest'" in r.stderr


def test_wrong_identity_is_refused_naming_who_the_key_is_allowed_for(model, keys):
    sign(model, keys["alice"])
    r = mm("verify", model, "--allowed-signers", keys["allowed"], "--identity", "bob@example.com")
    assert r.returncode == 5
    assert "allowed for alice@example.com, not for identity 'bob@example.com'" in r.stderr


def test_unsigned_manifest_is_refused_when_a_signature_is_asked_for(model, keys):
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 5 and "not signed" in r.stderr


def test_agent_held_key_with_a_passphrase_signs_through_the_agent(model, keys, agent):
    r = sign(model, keys["dir"] / "bob.pub", env=agent)
    assert fingerprint(keys["dir"] / "bob.pub") in r.stdout
    v = mm("verify", model, "--allowed-signers", keys["allowed"], "--identity", "bob@example.com")
    assert v.returncode == 0, v.stderr
    assert "signed by bob@example.com" in v.stdout
    assert BOB_PASSPHRASE not in r.stdout + r.stderr + v.stdout


def test_passphrase_key_without_an_agent_fails_cleanly_and_writes_nothing(model, keys):
    r = mm("sign", model, "--key", keys["bob"])
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "passphrase" in r.stderr and "ssh-agent" in r.stderr and "Traceback" not in r.stderr
    assert not (model / ".mm" / "manifest.json.sig").exists()
    assert not list((model / ".mm").glob(".*tmp"))


def test_resigning_replaces_the_signature_atomically(model, keys):
    sign(model, keys["mallory"])
    sign(model, keys["alice"])
    assert mm("verify", model, "--allowed-signers", keys["allowed"]).returncode == 0
    assert sorted(p.name for p in (model / ".mm").iterdir() if "sig" in p.name) == ["manifest.json.sig"]


def test_sign_without_a_manifest_is_bad_input(tmp_path, keys):
    r = mm("sign", tmp_path, "--key", keys["alice"])
    assert r.returncode == 3 and "no manifest here" in r.stderr


def test_garbage_signature_file_is_bad_input(model, keys):
    (model / ".mm" / "manifest.json.sig").write_text("not a signature\n")
    r = mm("verify", model, "--allowed-signers", keys["allowed"])
    assert r.returncode == 3 and "not an SSH signature" in r.stderr


def test_library_check_for_mm_pull_takes_bytes_and_names_the_signer(model, keys):
    sign(model, keys["alice"])
    data = manifest_path(model).read_bytes()
    sig = (model / ".mm" / "manifest.json.sig").read_bytes()
    report = signing.verify_manifest_signature(data, sig, keys["allowed"])
    assert report.identity == "alice@example.com" and report.fingerprint == fingerprint(keys["dir"] / "alice.pub")
    with pytest.raises(IntegrityError, match="does not verify"):
        signing.verify_manifest_signature(data + b" ", sig, keys["allowed"])
    with pytest.raises(IntegrityError, match="not signed"):
        signing.verify_manifest_signature(data, None, keys["allowed"])


# --- launch -----------------------------------------------------------------------------------------

def test_launch_require_signature_refuses_unsigned_before_writing(model, keys, tmp_path):
    out = tmp_path / "start.sh"
    r = mm("launch", model, "--hardware", "b300", "--require-signature", "--allowed-signers", keys["allowed"],
           "--out", out)
    assert r.returncode == 5 and "not signed" in r.stderr
    assert not out.exists()


def test_launch_require_signature_refuses_a_wrong_signer_and_accepts_a_good_one(model, keys, tmp_path):
    out = tmp_path / "start.sh"
    sign(model, keys["mallory"])
    r = mm("launch", model, "--hardware", "b300", "--require-signature", "--allowed-signers", keys["allowed"],
           "--out", out)
    assert r.returncode == 5 and not out.exists()
    sign(model, keys["alice"])
    r = mm("launch", model, "--hardware", "b300", "--require-signature", "--allowed-signers", keys["allowed"],
           "--out", out)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "signed by alice@example.com" in r.stderr


def test_require_signature_without_allowed_signers_is_a_usage_error(model):
    r = mm("launch", model, "--hardware", "b300", "--require-signature")
    assert r.returncode == 2 and "--allowed-signers" in r.stderr


# --- fetch --sign-with --------------------------------------------------------------------------------

def test_fetch_sign_with_signs_the_manifest_at_the_end(run_mm, hub_env, model_repo, keys, tmp_path):
    dest = tmp_path / "m"
    r = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.commits[-1], "--local-dir", str(dest),
               "--sign-with", str(keys["alice"]), env=hub_env)
    assert r.returncode == 0, r.stderr
    assert fingerprint(keys["dir"] / "alice.pub") in r.stdout
    v = mm("verify", dest, "--allowed-signers", keys["allowed"], "--identity", "alice@example.com")
    assert v.returncode == 0, v.stderr


def test_verify_takes_the_signature_options_every_consumer_takes(model):
    """verify, unbundle, pull and launch share one set of signature options and one rule for them."""
    r = mm("verify", model, "--require-signature")
    assert r.returncode == 2 and "--require-signature needs --allowed-signers FILE" in r.stderr
    r = mm("verify", model, "--identity", "release@example.com")
    assert r.returncode == 2 and "--identity needs --allowed-signers" in r.stderr
