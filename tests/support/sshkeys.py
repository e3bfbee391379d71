"""SSH keys for the signature tests: the real ssh-keygen (Debian openssh-client), never reading a terminal."""
from __future__ import annotations

import subprocess
from pathlib import Path

BOB_PASSPHRASE = "correct horse battery staple"


def keygen(*args: str, cwd: Path | None = None, input: bytes | None = None, env: dict | None = None):
    return subprocess.run(["ssh-keygen", *args], capture_output=True, cwd=cwd, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL, env=env, timeout=60)


def make_keys(d: Path) -> dict[str, Path]:
    """alice (no passphrase) and bob (a passphrase: usable through ssh-agent) in D/allowed_signers as
    alice@example.com and bob@example.com; mallory not in it."""
    for name, passphrase in (("alice", ""), ("bob", BOB_PASSPHRASE), ("mallory", "")):
        r = keygen("-q", "-t", "ed25519", "-N", passphrase, "-C", name, "-f", str(d / name))
        assert r.returncode == 0, r.stderr
    lines = [f"{who}@example.com {' '.join((d / f'{who}.pub').read_text().split()[:2])}" for who in ("alice", "bob")]
    (d / "allowed_signers").write_text("\n".join(lines) + "\n")
    return {"dir": d, "allowed": d / "allowed_signers", **{n: d / n for n in ("alice", "bob", "mallory")}}
