"""Signed manifests: OpenSSH signatures (SSHSIG) over `.mm/manifest.json`, namespace `mm-manifest`.

mm never reads a private key: every signature is made by `ssh-keygen -Y sign -f KEY` and every check is
`ssh-keygen -Y verify`, so a site can check a manifest with OpenSSH alone:

    ssh-keygen -Y verify -f allowed_signers -I ID -n mm-manifest -s manifest.json.sig < manifest.json

KEY may be a private key file, or a public key (`KEY.pub`) whose private half an ssh-agent holds
(SSH_AUTH_SOCK): ssh-keygen then asks the agent, which is also how keys with a passphrase and hardware keys
(sk-ssh-ed25519) work. ssh-keygen runs with no standard input, so a passphrase is never read from a pipe.

The signature file is hostile input like any other: it is parsed here only to name the key (type and
SHA256 fingerprint) and the namespace in messages; whether it is good is always ssh-keygen's verdict.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, IntegrityError
from ..paths import MM_DIR, state_root
from ..edges.fsutil import atomic_write_bytes, open_local_file, read_local_file
from ..edges.tools import ToolMissing, ToolResult, run_tool

NAMESPACE = "mm-manifest"
SIG_SUFFIX = ".sig"
MAX_SIG_BYTES = 64 * 1024
MAX_KEY_FILE_BYTES = 1024 * 1024  # mm's margin: an allowed signers file of thousands of keys; a private key is < 20 KiB
SSH_KEYGEN = "ssh-keygen"
_ARMOR_BEGIN = b"-----BEGIN SSH SIGNATURE-----"
_ARMOR_END = b"-----END SSH SIGNATURE-----"


@dataclass(frozen=True)
class SignatureInfo:
    """What a signature file says about itself (before anyone trusts it)."""

    key_type: str       # e.g. ssh-ed25519, sk-ssh-ed25519@openssh.com
    fingerprint: str    # SHA256:<base64>, as ssh-keygen -l prints it
    namespace: str


@dataclass(frozen=True)
class SignatureReport:
    """A signature ssh-keygen found good for IDENTITY against the allowed signers file."""

    identity: str
    key_type: str
    fingerprint: str
    namespace: str
    allowed_signers: str
    signature_path: str | None = None

    def describe(self) -> str:
        if is_pattern(self.identity):  # what matched is a line of allowed_signers, not a person: say so
            return (f"signed by {self.key_type} key {self.fingerprint}, a key allowed for any principal matching "
                    f"{self.identity!r} (give --identity to require one principal)")
        return f"signed by {self.identity} ({self.key_type} key {self.fingerprint})"


def is_pattern(principal: str) -> bool:
    """An allowed_signers principal that is a pattern (OpenSSH: *, ?, and comma-separated lists, ! negation)."""
    return any(c in principal for c in "*?,!")


@dataclass(frozen=True)
class SignResult:
    manifest_path: str
    signature_path: str
    key_type: str
    fingerprint: str
    namespace: str = NAMESPACE


def signature_path(model_dir: Path) -> Path:
    """Beside the manifest (for a Hugging Face cache snapshot, outside the cache: artifacts/paths.py)."""
    from ..paths import state_dir

    return state_dir(model_dir, MM_DIR) / ("manifest.json" + SIG_SUFFIX)


def verify_command(allowed_signers: str = "allowed_signers", identity: str = "ID", sig: str = "manifest.json.sig",
                   manifest: str = "manifest.json") -> str:
    """The line that checks a manifest with OpenSSH alone (docs/verify.md, RESTORE.txt, mm's own output)."""
    return f"ssh-keygen -Y verify -f {allowed_signers} -I {identity} -n {NAMESPACE} -s {sig} < {manifest}"


# --- the signature blob ---------------------------------------------------------------------------

def _ssh_string(blob: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(blob):
        raise ValueError("truncated")
    (n,) = struct.unpack(">I", blob[pos:pos + 4])
    if pos + 4 + n > len(blob):
        raise ValueError("truncated")
    return blob[pos + 4:pos + 4 + n], pos + 4 + n


def read_signature_info(sig: bytes, where: str) -> SignatureInfo:
    """Key type, fingerprint and namespace from an armored SSHSIG; BadInput if it is not one."""
    text = sig.strip()
    if len(sig) > MAX_SIG_BYTES or not text.startswith(_ARMOR_BEGIN) or not text.endswith(_ARMOR_END):
        raise BadInput(f"{where}: not an SSH signature (expected -----BEGIN SSH SIGNATURE-----)")
    try:
        blob = base64.b64decode(b"".join(text[len(_ARMOR_BEGIN):-len(_ARMOR_END)].split()), validate=True)
        if blob[:6] != b"SSHSIG":
            raise ValueError("no SSHSIG magic")
        pos = 10  # magic, then uint32 version
        pubkey, pos = _ssh_string(blob, pos)
        namespace, pos = _ssh_string(blob, pos)
        key_type, _ = _ssh_string(pubkey, 0)
        fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(pubkey).digest()).decode().rstrip("=")
        return SignatureInfo(key_type.decode("ascii"), fingerprint, namespace.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{where}: malformed SSH signature ({e})") from None


# --- running ssh-keygen -----------------------------------------------------------------------------

def _ssh_keygen(args: list[str], stdin: bytes | None = None, cwd: Path | None = None) -> ToolResult:
    """ssh-keygen, bounded (tools.run_tool): in a session of its own, so with no terminal to prompt on, and with
    askpass turned off (SSH_ASKPASS_REQUIRE=never): a passphrase it needs and the agent lacks makes it fail."""
    exe = shutil.which(SSH_KEYGEN)
    if exe is None:
        raise BadInput("ssh-keygen: not found; install OpenSSH (Debian: apt-get install openssh-client)")
    env = {k: v for k, v in os.environ.items() if k not in ("SSH_ASKPASS", "DISPLAY")}
    env["SSH_ASKPASS_REQUIRE"] = "never"
    try:
        proc = run_tool([exe, *args], timeout=300, input=stdin, cwd=cwd, env=env, max_output=MAX_SIG_BYTES)
    except ToolMissing as e:
        raise BadInput(f"ssh-keygen: could not run ({e.message})") from None
    if proc.stopped:
        raise BadInput(f"ssh-keygen: {proc.stopped}; stopped")
    return proc


def _reasons(proc: ToolResult) -> str:
    """ssh-keygen's own reasons (an expired key, a malformed valid-before: `FILE:LINE: why`), not its verdict."""
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    verdicts = ("No principal matched", "Could not verify signature")
    return "; ".join(dict.fromkeys(ln for ln in lines if not ln.startswith(verdicts)))[:500]


def sign_bytes(data: bytes, key: Path, where: str = "manifest") -> bytes:
    """An SSHSIG over DATA made by `ssh-keygen -Y sign -f KEY -n mm-manifest` (agent or key file)."""
    key = Path(key)
    if not os.path.lexists(key):
        raise BadInput(f"{key}: no such key file (give a private key, or KEY.pub with its key in ssh-agent)")
    open_local_file(key, what="key file", max_bytes=MAX_KEY_FILE_BYTES).close()  # ssh-keygen reads it: no FIFO
    with tempfile.TemporaryDirectory(prefix="mm-sign-") as tmp:
        target = Path(tmp) / "manifest.json"
        target.write_bytes(data)
        proc = _ssh_keygen(["-Y", "sign", "-f", str(key.absolute()), "-n", NAMESPACE, str(target)])
        sig = Path(str(target) + SIG_SUFFIX)
        if proc.returncode != 0 or not sig.is_file():
            why = proc.last_line().removeprefix("Enter passphrase: ")  # the prompt it printed, with no one to answer
            hint = ("; a key with a passphrase must be in ssh-agent (ssh-add KEY) and KEY may be its .pub"
                    if "passphrase" in why else "")
            raise BadInput(f"{key}: ssh-keygen could not sign {where}: {why}{hint}")
        return sig.read_bytes()


def sign_manifest(model_dir: Path, key: Path) -> SignResult:
    """Sign DIR/.mm/manifest.json; the signature lands at DIR/.mm/manifest.json.sig (temporary name, rename)."""
    from .manifest import from_dict
    from ..paths import manifest_path  # a manifest that does not parse is not signed

    mpath = manifest_path(model_dir)
    data = _manifest_bytes(mpath)
    _parse_manifest(data, str(mpath), from_dict)
    sig = sign_bytes(data, key, str(mpath))
    info = read_signature_info(sig, str(key))
    out = signature_path(model_dir)
    atomic_write_bytes(out, sig, root=state_root(model_dir))
    return SignResult(str(mpath), str(out), info.key_type, info.fingerprint)


def _manifest_bytes(mpath: Path) -> bytes:
    from .manifest import MAX_MANIFEST_BYTES

    if not os.path.lexists(mpath):
        raise BadInput(f"{mpath}: no manifest here (run `mm fetch` or `mm manifest` first)")
    return read_local_file(mpath, what="manifest", max_bytes=MAX_MANIFEST_BYTES)


def _parse_manifest(data: bytes, where: str, from_dict) -> None:
    from ..edges.untrusted import load_json

    from_dict(load_json(data, where, what="manifest"), where)


# --- verifying --------------------------------------------------------------------------------------

def _read_allowed_signers(allowed_signers: Path) -> Path:
    allowed_signers = Path(allowed_signers)
    # ssh-keygen reads it: a regular file of a sane size (a FIFO would keep it waiting), readable by us
    open_local_file(allowed_signers, what="allowed signers file", max_bytes=MAX_KEY_FILE_BYTES).close()
    return allowed_signers


def verify_manifest_signature(manifest_bytes: bytes, signature: bytes | None, allowed_signers: Path,
                              identity: str | None = None, where: str = "manifest",
                              signature_where: str | None = None) -> SignatureReport:
    """Check SIGNATURE over MANIFEST_BYTES with `ssh-keygen -Y verify` against ALLOWED_SIGNERS.

    IDENTITY (e.g. alice@example.com) must be a principal the key is allowed for; without it, the principals
    ssh-keygen finds for the signing key in the file are tried. Raises IntegrityError (exit 5) for an unsigned
    manifest or a signature that is not good (wrong key, namespace, identity, or bytes); BadInput (exit 3) for
    an unreadable allowed signers file or a signature that is not an SSH signature at all.
    Used by `mm verify`, `mm unbundle`, `mm launch` and `mm pull`.
    """
    allowed_signers = _read_allowed_signers(allowed_signers)
    sig_where = signature_where or f"{where}{SIG_SUFFIX}"
    if signature is None:
        raise IntegrityError(f"{where}: not signed (no {Path(sig_where).name}); a signature is required "
                             f"(sign with `mm sign DIR --key KEY`)")
    info = read_signature_info(signature, sig_where)
    if info.namespace != NAMESPACE:
        raise IntegrityError(f"{sig_where}: signature is for namespace {info.namespace!r}, not {NAMESPACE!r} "
                             f"(not a manifest signature); refused")
    with tempfile.TemporaryDirectory(prefix="mm-verify-") as tmp:
        sig_file = Path(tmp) / "manifest.json.sig"
        sig_file.write_bytes(signature)
        found = _ssh_keygen(["-Y", "find-principals", "-f", str(allowed_signers.absolute()), "-s", str(sig_file),
                             "-n", NAMESPACE])
        principals = [p for p in found.stdout.split("\n") if p.strip()] \
            if found.returncode == 0 else []
        if not principals:
            if why := _reasons(found):  # e.g. the key's line has expired, or its valid-before is malformed
                raise IntegrityError(f"{sig_where}: signed by {info.key_type} key {info.fingerprint}; ssh-keygen "
                                     f"refuses it: {why}; refused")
            raise IntegrityError(f"{sig_where}: signed by {info.key_type} key {info.fingerprint}, which "
                                 f"{allowed_signers} does not allow for {NAMESPACE}; refused")
        last = ""
        for principal in [identity] if identity else principals:
            proc = _ssh_keygen(["-Y", "verify", "-f", str(allowed_signers.absolute()), "-I", principal,
                                "-n", NAMESPACE, "-s", str(sig_file)], stdin=manifest_bytes)
            if proc.returncode == 0:
                return SignatureReport(principal, info.key_type, info.fingerprint, info.namespace,
                                       str(allowed_signers), signature_where)
            last = proc.last_line()
        if identity and any(_ssh_keygen(["-Y", "verify", "-f", str(allowed_signers.absolute()), "-I", p, "-n",
                                         NAMESPACE, "-s", str(sig_file)], stdin=manifest_bytes).returncode == 0
                            for p in principals):
            raise IntegrityError(f"{sig_where}: signed by {info.key_type} key {info.fingerprint}, allowed for "
                                 f"{', '.join(principals)}, not for identity {identity!r}; refused")
    raise IntegrityError(f"{where}: signature by {info.key_type} key {info.fingerprint} does not verify "
                         f"({last}): the manifest was changed after signing, or the signature belongs to "
                         f"another manifest; refused")


def read_signature_file(path: Path) -> bytes | None:
    """A signature file's bytes, or None where there is none: no such name, or a symlink that leads nowhere (one
    meaning, "not signed": exit 5 where a signature is required). Whatever else is there is read as hostile."""
    try:
        return read_local_file(path, what="signature", max_bytes=MAX_SIG_BYTES)
    except BadInput:
        if os.path.exists(path):
            raise
        return None


def verify_dir_signature(model_dir: Path, allowed_signers: Path, identity: str | None = None,
                         manifest_file: Path | None = None) -> tuple[SignatureReport, bytes]:
    """Check DIR/.mm/manifest.json.sig; returns the report and the exact manifest bytes that were checked
    (verify then parses THESE bytes, so a manifest swapped after the check is never used)."""
    from ..paths import manifest_path

    mpath = Path(manifest_file) if manifest_file else manifest_path(model_dir)
    data = _manifest_bytes(mpath)
    spath = Path(str(mpath) + SIG_SUFFIX)
    sig = read_signature_file(spath)
    return verify_manifest_signature(data, sig, allowed_signers, identity, str(mpath), str(spath)), data


def check_signature_matches(manifest_bytes: bytes, signature: bytes, where: str) -> SignatureInfo:
    """The signature is a good mm-manifest signature over these bytes by the key it names (no trust decided):
    `ssh-keygen -Y check-novalidate`. For bundle, so that a stale signature never travels."""
    info = read_signature_info(signature, where)
    with tempfile.TemporaryDirectory(prefix="mm-verify-") as tmp:
        sig_file = Path(tmp) / "manifest.json.sig"
        sig_file.write_bytes(signature)
        proc = _ssh_keygen(["-Y", "check-novalidate", "-n", NAMESPACE, "-s", str(sig_file)], stdin=manifest_bytes)
    if proc.returncode != 0:
        raise IntegrityError(f"{where}: signature does not match the manifest ({proc.last_line()}): the manifest "
                             f"changed after it was signed; sign it again with `mm sign`")
    return info
