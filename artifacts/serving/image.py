"""The pinned container image, by identity: save it without a Docker daemon, prove an archive is it.

The pin names the image by its registry manifest digest (`REPO@sha256:...`, most likely an image index over amd64
and arm64). A `docker save` archive holds the config digest (the image ID) and tags, not that digest, and Docker's
classic store drops RepoDigests on save/load. So mm records the chain

    pinned digest -> platform manifest digest -> config digest (image ID) -> layer digests

in `<archive>.mm-image.json` beside the archive (`mm image save`), proves an archive against it (`mm bundle
--image`: the sha256 of the config blob inside the archive must be the chain's config digest), and the launch
script finds the image by the pinned reference, else by that image ID.

Registry access is skopeo's (Debian package `skopeo`): `skopeo inspect --raw` for the manifests (each one's sha256
checked here against the digest that named it) and `skopeo copy` by digest to a docker-archive/oci-archive.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import BadInput, IntegrityError, Refused, RemoteError
from ..edges.fsutil import atomic_write_json, open_local_file, publish, read_json_file, unlink_file, user_path
from ..integrity.hashing import upstream_digest
from ..edges.tools import ToolMissing, last_line, run_tool
from ..edges.untrusted import load_json

RECORD_SCHEMA = "mm-image/1"
RECORD_SUFFIX = ".mm-image.json"
PLATFORMS = ("linux/amd64", "linux/arm64")
FORMATS = ("docker-archive", "oci-archive")
INDEX_TYPES = {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
MANIFEST_TYPES = {"application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"}
REF = re.compile(r"^(?P<repo>[a-z0-9][a-z0-9._:/-]*[a-z0-9])@(?P<digest>sha256:[0-9a-f]{64})$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_JSON = 16 << 20  # a manifest, index or config larger than this is not one


def parse_ref(ref: str) -> tuple[str, str]:
    """REPO@sha256:<64 hex> -> (REPO, digest); anything else (a tag, no digest) is refused."""
    m = REF.match(ref or "")
    if not m:
        raise BadInput(f"{ref!r}: give the image by digest (REPO@sha256:<64 hex>)")
    return m.group("repo"), m.group("digest")


def parse_platform(value: str) -> str:
    v = value.strip().lower()
    v = {"amd64": "linux/amd64", "x86_64": "linux/amd64", "arm64": "linux/arm64", "aarch64": "linux/arm64",
         "linux/x86_64": "linux/amd64", "linux/aarch64": "linux/arm64", "linux/arm64/v8": "linux/arm64"}.get(v, v)
    if v not in PLATFORMS:
        raise BadInput(f"--platform {value!r}: expected linux/amd64 or linux/arm64")
    return v


def host_platform() -> str:
    return parse_platform(os.uname().machine)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- the chain ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    media_type: str


@dataclass(frozen=True)
class Chain:
    repo: str
    pinned: str  # the digest the pin names
    pinned_media_type: str
    platform: str
    platform_manifest: str
    config: str  # the image ID
    layers: tuple[Layer, ...]

    @property
    def reference(self) -> str:
        return f"{self.repo}@{self.pinned}"


def _skopeo(args: list[str], what: str, timeout: float = 120, show_progress: bool = False) -> bytes:
    """Run skopeo within TIMEOUT, its answer at most MAX_JSON bytes (tools.run_tool); SHOW_PROGRESS (a terminal):
    its own per-layer progress bars go to the terminal."""
    if shutil.which("skopeo") is None:
        raise BadInput("skopeo: not installed; mm reads registries with skopeo (Debian package `skopeo`; `make tools`)")
    if show_progress:
        args = [a for a in args if a != "--quiet"]
    try:
        proc = run_tool(["skopeo", *args], timeout=timeout, max_output=MAX_JSON, passthrough=show_progress)
    except ToolMissing as e:
        raise BadInput(e.message) from None
    if proc.stopped and proc.stopped.startswith("no answer"):
        raise RemoteError(f"{what}: {proc.stopped} from the registry (skopeo stopped)")
    if proc.stopped:
        raise RemoteError(f"{what}: skopeo wrote {proc.stopped}; stopped")
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        message = _skopeo_message(lines[-1]) if lines else "skopeo failed"  # whole: the hint reads its end
        raise RemoteError(f"{what}: {_offline_hint(message) or last_line(message)}")
    return proc.stdout_bytes


# What Go's resolver and dialer say when the network is not there (no DNS, no route, nothing listening).
_OFFLINE = re.compile(r"no such host|network is unreachable|i/o timeout|connection refused|no route to host|"
                      r"server misbehaving|Temporary failure in name resolution")
_REGISTRY_HOST = re.compile(r"(?:pinging container registry|lookup|dial tcp) \[?([\w.:-]+?)\]?(?::\d+)?[: ]")


def _offline_hint(message: str) -> str | None:
    """A network failure said as what it means for a user: this host cannot reach the registry, and the
    image is saved on the connected side. None when MESSAGE is not about reaching the registry."""
    if not _OFFLINE.search(message):
        return None
    host = _REGISTRY_HOST.search(message)
    reason = _OFFLINE.search(message).group(0)
    return (f"cannot reach the registry {host.group(1) if host else ''} ({reason}): this host looks offline. "
            f"`mm image save` runs on the connected side: save the image there and carry the archive "
            f"(`mm bundle DIR --image FILE ...`); on the air-gapped host `mm launch --image-archive FILE` loads it")


SKOPEO_LOG = re.compile(r'level=\w+ msg="((?:[^"\\]|\\.)*)"')


def _skopeo_message(line: str) -> str:
    """The message of skopeo's last log line (`time=... level=fatal msg="..."`), without the logger's frame."""
    found = SKOPEO_LOG.search(line)
    return found.group(1).replace('\\"', '"') if found else line


def _tls(tls_verify: bool) -> str:
    return f"--tls-verify={'true' if tls_verify else 'false'}"


def _verify_tls(repo: str, tls_verify: bool) -> bool:
    """The one rule of mm's registry clients (push, pull, inspect: oci/client.py): a registry on loopback
    speaks plain HTTP by itself; elsewhere TLS is verified unless --insecure-registry."""
    from ..oci.reference import is_loopback

    return tls_verify and not is_loopback(repo.split("/", 1)[0])


def _fetch_manifest(repo: str, digest: str, tls_verify: bool, timeout: float, auth: tuple[str, ...] = ()) -> dict:
    raw = _skopeo(["inspect", "--raw", _tls(tls_verify), *auth, f"docker://{repo}@{digest}"], f"{repo}@{digest}",
                  timeout)
    if sha256_digest(raw) != digest:
        raise IntegrityError(f"{repo}@{digest}: the registry served a manifest whose sha256 is {sha256_digest(raw)}")
    return _parse_json(raw, f"{repo}@{digest}")


def _parse_json(raw: bytes, where: str) -> dict:
    doc = load_json(raw, where, max_bytes=MAX_JSON)
    if not isinstance(doc, dict):
        raise BadInput(f"{where}: not a JSON object")
    return doc


def _media_type(doc: dict) -> str:
    if doc.get("mediaType"):
        return str(doc["mediaType"])
    return "application/vnd.oci.image.index.v1+json" if "manifests" in doc else "application/vnd.oci.image.manifest.v1+json"


def _platform_of(entry: dict) -> str:
    p = _object(entry.get("platform"))  # hostile: a platform that is a list or a string names no platform
    return f"{p.get('os')}/{p.get('architecture')}"


def _object(value: object) -> dict:
    """An optional sub-object of a document read from a registry or an archive: {} when it is not an object."""
    return value if isinstance(value, dict) else {}


def _manifests(index: dict, where: str) -> list:
    manifests = index.get("manifests", [])
    if not isinstance(manifests, list):
        raise BadInput(f"{where}: the image index's manifests is not a list")
    return manifests


def _size(value: object) -> int:
    """A byte count from a hostile document: an integer, never a float, a string or true."""
    if type(value) is not int or value < 0:
        raise ValueError(f"size {str(value)[:40]!r} is not a whole number of bytes")
    return value


def select_platform(index: dict, platform: str, where: str) -> str:
    """The manifest digest for PLATFORM in an image index."""
    manifests = _manifests(index, where)
    matches = [m for m in manifests if isinstance(m, dict) and _platform_of(m) == platform]
    if not matches:
        have = ", ".join(sorted({_platform_of(m) for m in manifests if isinstance(m, dict)}))
        raise Refused(f"{where}: no {platform} image (the index has: {have or 'nothing'})")
    digest = str(matches[0].get("digest"))
    if not DIGEST.match(digest):
        raise BadInput(f"{where}: bad manifest digest {digest!r} for {platform}")
    return digest


def _chain_from_manifest(repo: str, pinned: str, pinned_type: str, platform: str, manifest_digest: str,
                         manifest: dict) -> Chain:
    try:
        config = str(manifest["config"]["digest"])
        layers = tuple(Layer(str(layer["digest"]), _size(layer["size"]), str(layer.get("mediaType", "")))
                       for layer in manifest["layers"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise BadInput(f"{repo}@{manifest_digest}: not an image manifest (no config/layers)") from None
    if not DIGEST.match(config) or not all(DIGEST.match(layer.digest) for layer in layers):
        raise BadInput(f"{repo}@{manifest_digest}: malformed digests in the manifest")
    return Chain(repo, pinned, pinned_type, platform, manifest_digest, config, layers)


def resolve_chain(ref: str, platform: str, tls_verify: bool = True, timeout: float = 120,
                  auth: tuple[str, ...] = ()) -> Chain:
    """Ask the registry: pinned digest -> platform manifest -> config and layers, each manifest's sha256 checked.
    AUTH: skopeo's --authfile option when the registry wants credentials."""
    repo, pinned = parse_ref(ref)
    tls_verify = _verify_tls(repo, tls_verify)
    top = _fetch_manifest(repo, pinned, tls_verify, timeout, auth)
    top_type = _media_type(top)
    if top_type in INDEX_TYPES:
        manifest_digest = select_platform(top, platform, ref)
        manifest = _fetch_manifest(repo, manifest_digest, tls_verify, timeout, auth)
    elif top_type in MANIFEST_TYPES:  # a single-platform image: its config says which platform
        manifest_digest, manifest = pinned, top
        config = _parse_json(_skopeo(["inspect", "--raw", "--config", _tls(tls_verify), *auth, f"docker://{ref}"], ref,
                                     timeout), ref)
        if f"{config.get('os')}/{config.get('architecture')}" != platform:
            raise Refused(f"{ref}: a single-platform image for {config.get('os')}/{config.get('architecture')}, not {platform}")
    else:
        raise BadInput(f"{ref}: unsupported manifest type {top_type!r}")
    return _chain_from_manifest(repo, pinned, top_type, platform, manifest_digest, manifest)


# --- the record beside the archive ----------------------------------------------------------------

def record_path(archive: Path) -> Path:
    return Path(archive).with_name(Path(archive).name + RECORD_SUFFIX)


@dataclass
class ImageRecord:
    chain: Chain
    archive: str  # file name, beside the record
    format: str
    size: int
    sha256: str
    tag: str | None
    saved_at: str
    env: dict[str, str] | None = None  # the image's NVIDIA_*/CUDA_* environment (config_env); None: not recorded

    def to_json(self) -> dict:
        c = self.chain
        return {"schema": RECORD_SCHEMA, "reference": c.reference, "repo": c.repo, "pinned": c.pinned,
                "pinned_media_type": c.pinned_media_type, "platform": c.platform,
                "platform_manifest": c.platform_manifest, "config": c.config, "image_id": c.config,
                "layers": [asdict(layer) for layer in c.layers],
                "archive": {"file": self.archive, "format": self.format, "size": self.size, "sha256": self.sha256,
                            "tag": self.tag},
                "config_env": self.env, "saved_at": self.saved_at}


def archive_platform(archive: Path) -> str | None:
    """The platform (linux/amd64, linux/arm64) of an archive `mm image save` wrote, from the record beside it;
    None without a record."""
    rec = record_path(Path(archive))
    return read_record(rec).chain.platform if rec.is_file() else None


def read_record(path: Path) -> ImageRecord:
    """A record written by `mm image save`, parsed and checked (it came across the air gap: hostile until parsed)."""
    doc = read_json_file(path, what="image record", max_bytes=MAX_JSON)
    try:
        if not isinstance(doc, dict) or doc.get("schema") != RECORD_SCHEMA:
            raise ValueError(f"expected schema {RECORD_SCHEMA!r}")
        repo, pinned = parse_ref(doc["reference"])
        if doc["platform"] not in PLATFORMS:
            raise ValueError(f"platform {doc['platform']!r}")
        for key in ("platform_manifest", "config"):
            if not DIGEST.match(str(doc[key])):
                raise ValueError(f"{key} {doc[key]!r} is not a sha256 digest")
        layers = tuple(Layer(str(x["digest"]), _size(x["size"]), str(x["media_type"])) for x in doc["layers"])
        archive = doc["archive"]
        if "/" in str(archive["file"]) or archive["format"] not in FORMATS:
            raise ValueError("archive entry")
        tag = archive.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise ValueError(f"archive tag {str(tag)[:40]!r} is not a string")
        chain = Chain(repo, pinned, str(doc["pinned_media_type"]), doc["platform"], doc["platform_manifest"],
                      doc["config"], layers)
        env = doc.get("config_env")
        if env is not None and not isinstance(env, dict) or isinstance(env, dict) and not all(isinstance(k, str) and RUNTIME_ENV.match(k) and isinstance(v, str)
                                                and len(v) <= MAX_ENV_VALUE for k, v in env.items()):
            raise ValueError("config_env must map NVIDIA_*/CUDA_* names to strings")
        return ImageRecord(chain, str(archive["file"]), archive["format"], _size(archive["size"]),
                           str(archive["sha256"]), tag, str(doc.get("saved_at", "")),
                           None if env is None else dict(env))
    except BadInput as e:
        raise BadInput(f"{path}: not an mm image record ({e.message})") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not an mm image record ({e})") from None


# --- reading an archive ------------------------------------------------------------------------------

@dataclass
class ArchiveImage:
    config: str  # sha256 of the config blob's bytes, computed here
    platform: str
    tags: list[str] = field(default_factory=list)
    repo_digests: list[str] = field(default_factory=list)  # names with @digest the archive carries (OCI/containerd)
    env: dict[str, str] = field(default_factory=dict)  # the image's NVIDIA_* and CUDA_* environment (config_env)


RUNTIME_ENV = re.compile(r"^(?:NVIDIA|CUDA)_[A-Z0-9_]{1,64}$")  # what the NVIDIA Container Toolkit reads of an image
MAX_ENV_VALUE = 8192


def config_env(config: dict) -> dict[str, str]:
    """The NVIDIA_* and CUDA_* variables of an image config's Env ("K=V" strings), bounded: what the container
    runtime's GPU hook decides from (NVIDIA_REQUIRE_*, NVIDIA_DISABLE_REQUIRE, CUDA_VERSION); nothing else is kept."""
    inner = config.get("config") or config.get("Config") or {}
    env = inner.get("Env") if isinstance(inner, dict) else None
    out: dict[str, str] = {}
    for item in env if isinstance(env, list) else []:
        if isinstance(item, str) and "=" in item:
            key, value = item.split("=", 1)
            if RUNTIME_ENV.match(key) and len(value) <= MAX_ENV_VALUE:
                out[key] = value
    return out


def _read_member(tf: tarfile.TarFile, name: str, where: str) -> bytes:
    try:
        member = tf.getmember(name)
    except KeyError:
        raise BadInput(f"{where}: {name} is missing from the archive") from None
    if not member.isfile() or member.size > MAX_JSON:
        raise BadInput(f"{where}: {name} is not a plain file of a sane size")
    f = tf.extractfile(member)
    assert f is not None
    return f.read()


def _oci_blob(tf: tarfile.TarFile, digest: str, where: str) -> bytes:
    if not DIGEST.match(digest):
        raise BadInput(f"{where}: bad digest {digest!r}")
    data = _read_member(tf, "blobs/sha256/" + digest.split(":")[1], where)
    if sha256_digest(data) != digest:
        raise IntegrityError(f"{where}: blob {digest} does not hash to its name")
    return data


def _oci_configs(tf: tarfile.TarFile, descriptor: dict, where: str, depth: int = 0) -> list[tuple[str, dict]]:
    """(config digest, config) of every image under DESCRIPTOR that the archive holds the blobs for."""
    if depth > 4:
        raise BadInput(f"{where}: image index nested too deep")
    digest = str(descriptor.get("digest"))
    try:
        doc = _parse_json(_oci_blob(tf, digest, where), where)
    except BadInput:
        return [] if depth else _raise_missing(where, digest)
    if _media_type(doc) in INDEX_TYPES or "manifests" in doc:
        found = []
        for entry in _manifests(doc, where):
            if isinstance(entry, dict):
                found += _oci_configs(tf, entry, where, depth + 1)
        return found
    config = doc.get("config")
    if not isinstance(config, dict):
        raise BadInput(f"{where}: manifest {digest}: config is not an object")
    config_digest = str(config.get("digest"))
    return [(config_digest, _parse_json(_oci_blob(tf, config_digest, where), where))]


def _raise_missing(where: str, digest: str):
    raise BadInput(f"{where}: the archive's index names {digest}, which it does not hold")


def read_archive(archive: Path) -> list[ArchiveImage]:
    """The images a docker-archive (`docker save`, skopeo) or OCI archive holds, each config hashed here."""
    where = str(archive)
    try:
        with open_local_file(archive, what="image archive") as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
            names = set(tf.getnames())
            if "index.json" in names:
                index = _parse_json(_read_member(tf, "index.json", where), where)
                images = []
                for entry in _manifests(index, f"{where}: index.json"):
                    if not isinstance(entry, dict) or not DIGEST.match(str(entry.get("digest"))):
                        continue  # `docker save` (classic) names its images here without digests
                    name = _object(entry.get("annotations")).get("io.containerd.image.name")
                    name = name if isinstance(name, str) else ""
                    digests = [f"{name.split('@')[0]}@{entry.get('digest')}"] if name else []
                    tags = [name] if name and "@" not in name else []
                    for digest, config in _oci_configs(tf, entry, where):
                        images.append(ArchiveImage(digest, f"{config.get('os')}/{config.get('architecture')}",
                                                   tags, digests, config_env(config)))
                if images:
                    return images
            if "manifest.json" in names:
                entries = load_json(_read_member(tf, "manifest.json", where), f"{where}: manifest.json")
                if not isinstance(entries, list):
                    raise BadInput(f"{where}: manifest.json is not a list")
                images = []
                for e in entries:
                    if not isinstance(e, dict) or not isinstance(e.get("Config"), str):
                        raise BadInput(f"{where}: manifest.json: an entry without a Config file name")
                    data = _read_member(tf, e["Config"], where)
                    config = _parse_json(data, where)
                    tags = e.get("RepoTags") or []
                    images.append(ArchiveImage(sha256_digest(data), f"{config.get('os')}/{config.get('architecture')}",
                                               [str(t) for t in tags] if isinstance(tags, list) else [],
                                               env=config_env(config)))
                return images
    except (OSError, tarfile.TarError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{archive}: cannot read the image archive ({e})") from None
    raise BadInput(f"{archive}: not an image archive (no manifest.json or index.json with an image inside)")


# --- mm image save ---------------------------------------------------------------------------------------

@dataclass
class SaveReport:
    archive: Path
    record: Path
    format: str
    size: int
    sha256: str
    tag: str | None
    chain: Chain
    seconds: float


def _file_sha256(path: Path) -> str:
    return upstream_digest(path, "lfs-sha256")  # the file's sha256, memory bounded


def _tag_name(chain: Chain) -> str:
    """The tag mm gives the pinned image for one platform: mm-<12 hex of the pinned digest>-<arch>."""
    return f"mm-{chain.pinned.split(':')[1][:12]}-{chain.platform.split('/')[1]}"


def save_image(ref: str, out: Path, platform: str, fmt: str = "docker-archive", tls_verify: bool = True,
               timeout: float = 3600, show_progress: bool = False) -> SaveReport:
    """Copy REF's PLATFORM image by digest to OUT (temporary name, checked, fsynced, renamed) plus its record."""
    if fmt not in FORMATS:
        raise BadInput(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    started = time.monotonic()
    out = user_path(out)  # the user's path: links followed (their choice); nothing is written through one below
    if out.is_dir():
        raise BadInput(f"{out}: is a directory; give the archive's file name")
    chain = resolve_chain(ref, platform, tls_verify)
    tag = f"{chain.repo}:{_tag_name(chain)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    unlink_file(out.parent, tmp)
    try:
        dest = f"{fmt}:{tmp}:{tag}" if fmt == "docker-archive" else f"{fmt}:{tmp}:{tag.rsplit(':', 1)[1]}"
        _skopeo(["copy", "--quiet", f"--src-tls-verify={'true' if _verify_tls(chain.repo, tls_verify) else 'false'}",
                 f"docker://{chain.repo}@{chain.platform_manifest}", dest], f"skopeo copy {chain.reference}", timeout,
                show_progress)
        images = read_archive(tmp)
        held = {img.config for img in images}
        if held != {chain.config}:
            raise IntegrityError(f"{out}: skopeo wrote config {', '.join(sorted(held))}, not {chain.config}")
        publish(tmp, out, root=out.parent)
    except BaseException:
        unlink_file(out.parent, tmp)
        raise
    size, digest = out.stat().st_size, _file_sha256(out)
    record = ImageRecord(chain, out.name, fmt, size, digest, tag, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         images[0].env)
    atomic_write_json(record_path(out), record.to_json(), root=out.parent)
    return SaveReport(out, record_path(out), fmt, size, digest, tag, chain, time.monotonic() - started)


def write_record_for(archive: Path, proof: "Proof") -> Path:
    """The record `mm image save` would have written, for an archive proven against the registry (`mm bundle
    --image` on a connected host): the start script needs the image ID on the offline side."""
    archive = user_path(archive)
    fmt = "oci-archive" if _is_oci(archive) else "docker-archive"
    env = next((img.env for img in read_archive(archive) if img.config == proof.config), {})
    record = ImageRecord(proof.record, archive.name, fmt, archive.stat().st_size, _file_sha256(archive), None,
                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), env)
    try:
        atomic_write_json(record_path(archive), record.to_json(), root=archive.parent)
    except OSError as e:
        raise BadInput(f"{record_path(archive)}: cannot write the image record beside the archive ({e.strerror}); "
                       f"write the archive with `mm image save` where it can be") from None
    return record_path(archive)


def _is_oci(archive: Path) -> bool:
    with open_local_file(archive, what="image archive") as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
        names = set(tf.getnames())
    return "index.json" in names and "manifest.json" not in names


# --- proving an archive is the pinned image ------------------------------------------------------------

@dataclass
class Proof:
    archive: str
    reference: str  # the pinned reference asked for
    platform: str
    config: str  # the image ID the chain gives
    platform_manifest: str
    how: str  # "registry" (resolved here) | "record" (mm image save's record)
    archive_configs: list[str]
    proven: bool
    detail: str
    record: Chain | None = None


def prove_archive(archive: Path, ref: str, tls_verify: bool = True, record: Path | None = None,
                  resolve_timeout: float = 20, registry: bool = True) -> Proof:
    """Is ARCHIVE the image REF pins? Its config blob's sha256 must be the config digest the chain gives.

    The chain comes from the registry when it answers, else from the record `mm image save` wrote beside the
    archive (or RECORD). Refused (exit 7) when the archive holds another image; BadInput when neither the registry
    nor a record can say what the pinned image is.
    """
    repo, pinned = parse_ref(ref)
    images = read_archive(archive)
    configs = sorted({img.config for img in images})
    platforms = sorted({img.platform for img in images if img.platform in PLATFORMS}) or [host_platform()]
    rec_path = Path(record) if record else record_path(archive)
    rec = read_record(rec_path) if rec_path.is_file() else None
    chains: list[Chain] = []
    how = "registry"
    try:
        if not registry:
            raise RemoteError("not asked (record only)")
        chains = [resolve_chain(ref, p, tls_verify, resolve_timeout) for p in platforms]
    except (RemoteError, Refused) as e:
        if rec is None:
            raise BadInput(f"{archive}: cannot prove it is {ref}: the registry is out of reach ({e.message}) and there "
                           f"is no record {rec_path.name} beside it (write the archive with `mm image save`)") from None
        how = "record"
        if rec.chain.reference != f"{repo}@{pinned}":
            raise Refused(f"{rec_path}: records {rec.chain.reference}, not the pinned {ref}")
        chains = [rec.chain]
    chain = next((c for c in chains if c.config in configs), chains[0])
    proven = chain.config in configs
    if proven:
        detail = (f"{archive} is {ref} for {chain.platform}: config {chain.config} (image ID) via manifest "
                  f"{chain.platform_manifest}, checked against the {'registry' if how == 'registry' else 'record ' + rec_path.name}")
    else:
        detail = (f"{archive} holds image {', '.join(configs)}, but {ref} for {chain.platform} is {chain.config} "
                  f"(checked against the {'registry' if how == 'registry' else 'record ' + rec_path.name})")
    return Proof(str(archive), ref, chain.platform, chain.config, chain.platform_manifest, how, configs, proven,
                 detail, chain)


# --- mm image push: the carried archive into the site registry, by digest ---------------------------------
# What the archive can give the registry, best first (the archive's own index.json says which):
#   "pinned"    an OCI archive holding the pinned index itself (what a containerd-store `docker save REPO@DIGEST`
#               writes): skopeo copy --all --preserve-digests, and the site serves REPO@<the pinned digest>;
#   "platform"  an OCI archive holding the chain's platform manifest (`mm image save --format oci-archive`):
#               skopeo copy --preserve-digests, and the site serves REPO@<that manifest digest>;
#   "rebuilt"   a docker-archive (`mm image save`'s default, `docker save`): it holds no registry manifest and its
#               layers uncompressed, so skopeo writes a new manifest; the site serves REPO@<that new digest>, whose
#               config is the pinned image ID. Nothing upstream names that digest: mm reports it.
PUSH_KINDS = ("pinned", "platform", "rebuilt")
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


def repository_path(repo: str) -> str:
    """REPO's path without its registry host, as a mirror serves it (containerd and docker ask a mirror for
    /v2/<path>/...): lmsysorg/sglang, docker.io/lmsysorg/sglang -> lmsysorg/sglang; ubuntu -> library/ubuntu
    (Docker Hub's own rule for one-component names)."""
    parts = repo.split("/")
    hub = True
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        hub = parts[0] in DOCKER_HUB
        parts = parts[1:]
    if hub and len(parts) == 1:
        parts = ["library", *parts]
    return "/".join(parts)


def registry_of(repo: str) -> str:
    """The registry host a repository reference names: docker.io when it names none (Docker Hub)."""
    first = repo.split("/", 1)[0]
    if "/" in repo and ("." in first or ":" in first or first == "localhost"):
        return "docker.io" if first in DOCKER_HUB else first
    return "docker.io"


@dataclass
class PushReport:
    archive: Path
    record: Path
    pushed: str  # SITE/REPO@digest: what the nodes pull
    digest: str
    kind: str  # PUSH_KINDS
    chain: Chain  # the pinned chain (from the record)
    served: Chain  # what the site registry serves under `digest`, each manifest's sha256 checked
    before: str  # how the archive was proven before the push
    after: str  # what the registry was proven to serve after it
    tls: str  # "verified" | "off (--plain-http)" | "off (loopback)"
    credentials: str | None  # where they came from (never the values)
    seconds: float
    note: str | None = None  # when the site does not hold the pinned digest itself: what nodes must name


def _archive_manifests(archive: Path) -> set[str]:
    """The digests an OCI archive's index.json names (empty for a docker-archive); blob hashes are checked by
    read_archive and, on upload, by the registry."""
    with open_local_file(archive, what="image archive") as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
        if "index.json" not in set(tf.getnames()):
            return set()
        index = _parse_json(_read_member(tf, "index.json", str(archive)), f"{archive}: index.json")
    return {str(e.get("digest")) for e in _manifests(index, f"{archive}: index.json") if isinstance(e, dict)}


def parse_site(site: str, chain: Chain) -> str:
    """SITE (host[:port], or host[:port]/repository) -> host[:port]/repository; the repository defaults to the
    pinned one's path, which is what a mirror is asked for. A reference never carries credentials."""
    from ..oci.reference import HOST, REPOSITORY

    host, _, repo = site.strip().partition("/")
    if "@" in host or "://" in host:
        raise BadInput("the site registry is host[:port][/repository], without a scheme or credentials; give "
                       "--username with --password-stdin, or an entry in ~/.docker/config.json / REGISTRY_AUTH_FILE")
    repo = repo.strip("/") or repository_path(chain.repo)
    if not HOST.match(host) or not REPOSITORY.match(repo):
        raise BadInput(f"{site!r}: not a registry host[:port][/repository] (lowercase repository path)")
    return f"{host}/{repo}"


@contextmanager
def _authfile(credentials, registry: str) -> Iterator[tuple[str, ...]]:
    """skopeo's options for CREDENTIALS: a containers auth file (mode 0600, in a private temporary directory,
    removed after), never --creds (a command line is world-readable in /proc)."""
    if credentials is None:
        yield ()
        return
    import base64
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mm-auth-") as tmp:
        path = Path(tmp) / "auth.json"
        token = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {registry: {"auth": token}}}, f)
        yield ("--authfile", str(path))


def _scrubbed(e: Exception, credentials) -> Exception:
    """E with the password taken out of its message (a tool may echo what it was given)."""
    if credentials is not None and credentials.password and isinstance(e, (BadInput, RemoteError, IntegrityError)):
        e.message = e.message.replace(credentials.password, "***")
        e.args = (e.message,)
    return e


def push_image(archive: Path, site: str, ref: str, credentials=None, plain_http: bool = False,
               timeout: float = 3600, show_progress: bool = False) -> PushReport:
    """Put ARCHIVE (the engine image carried in the bundle, with its record beside it) into the SITE registry by
    digest with skopeo, proving before the push that the archive is REF's pinned image (its sha256 is the one its
    record holds, its config the chain's image ID) and after it that the registry serves the pinned chain."""
    from ..oci.reference import is_loopback

    started = time.monotonic()
    archive = user_path(archive)
    if not archive.is_file():
        raise BadInput(f"{archive}: no such image archive")
    if ":" in archive.name or ":" in str(archive.parent):
        raise BadInput(f"{archive}: skopeo cannot read an archive whose path holds ':'; move or rename it")
    rec_path = record_path(archive)
    if not rec_path.is_file():
        raise BadInput(f"{archive}: no record {rec_path.name} beside it: mm pushes only an archive it can prove "
                       f"(written by `mm image save`, carried by `mm bundle --image`, restored by `mm unbundle`)")
    record = read_record(rec_path)
    chain = record.chain
    repo, pinned = parse_ref(ref)
    if (chain.pinned, repository_path(chain.repo)) != (pinned, repository_path(repo)):  # saved from a mirror: same
        raise Refused(f"{rec_path}: records {chain.reference}, not the pinned {ref}")
    if record.archive != archive.name:
        raise BadInput(f"{rec_path}: records the archive {record.archive!r}, not {archive.name!r}")
    digest_now = _file_sha256(archive)
    if digest_now != record.sha256:
        raise IntegrityError(f"{archive}: sha256 {digest_now}, but its record {rec_path.name} holds {record.sha256}: "
                             f"the archive changed since it was saved; restore it from the bundle")
    proof = prove_archive(archive, chain.reference, record=rec_path, registry=False)
    if not proof.proven:
        raise Refused(proof.detail)
    before = (f"{archive.name}: sha256 as its record {rec_path.name}; config {chain.config} is the image ID of "
              f"{ref} for {chain.platform}")
    held = _archive_manifests(archive)
    kind = "pinned" if chain.pinned in held else "platform" if chain.platform_manifest in held else "rebuilt"
    dest_repo = parse_site(site, chain)
    host = dest_repo.split("/", 1)[0]
    verify = not plain_http and not is_loopback(host)
    tls = "verified" if verify else "off (--plain-http)" if plain_http else "off (loopback)"
    fmt = "oci-archive" if _is_oci(archive) else "docker-archive"
    try:
        with _authfile(credentials, host) as auth:
            dest_flags = [f"--dest-tls-verify={'true' if verify else 'false'}",
                          *(["--dest-authfile", auth[1]] if auth else [])]
            if kind == "rebuilt":
                digest = _push_rebuilt(archive, fmt, dest_repo, record, dest_flags, timeout, show_progress)
            else:
                digest = chain.pinned if kind == "pinned" else chain.platform_manifest
                _skopeo(["copy", "--quiet", *(["--all"] if kind == "pinned" else []), "--preserve-digests",
                         *dest_flags, f"{fmt}:{archive}", f"docker://{dest_repo}@{digest}"],
                        f"skopeo copy {archive.name} -> {dest_repo}@{digest}", timeout, show_progress)
            served = resolve_chain(f"{dest_repo}@{digest}", chain.platform, verify, auth=auth)
    except (BadInput, RemoteError, IntegrityError) as e:
        raise _scrubbed(e, credentials) from None
    after = _prove_served(served, chain, kind, f"{dest_repo}@{digest}")
    return PushReport(archive, rec_path, f"{dest_repo}@{digest}", digest, kind, chain, served, before, after, tls,
                      credentials.origin if credentials is not None else None, time.monotonic() - started,
                      _push_note(kind, chain))


def _push_rebuilt(archive: Path, fmt: str, dest_repo: str, record: ImageRecord, dest_flags: list[str],
                  timeout: float, show_progress: bool) -> str:
    """A docker-archive: skopeo writes a new manifest under the record's tag and says its digest (--digestfile)."""
    import tempfile

    tag = _tag_name(record.chain)
    with tempfile.TemporaryDirectory(prefix="mm-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        _skopeo(["copy", "--quiet", "--digestfile", str(digest_file), *dest_flags, f"{fmt}:{archive}",
                 f"docker://{dest_repo}:{tag}"], f"skopeo copy {archive.name} -> {dest_repo}:{tag}", timeout,
                show_progress)
        digest = digest_file.read_text(errors="replace").strip()[:100] if digest_file.is_file() else ""
    if not DIGEST.match(digest):
        raise RemoteError(f"skopeo copy {archive.name} -> {dest_repo}:{tag}: no manifest digest reported ({digest!r})")
    return digest


def _prove_served(served: Chain, chain: Chain, kind: str, where: str) -> str:
    """The registry's answer under the pushed digest is the pinned chain (every manifest's sha256 was checked as it
    was read): the same platform manifest, config and layers; for a rebuilt manifest, the same image ID."""
    if served.config != chain.config:
        raise IntegrityError(f"{where}: the registry serves config {served.config}, not the pinned image ID "
                             f"{chain.config}")
    if kind != "rebuilt" and (served.platform_manifest, served.layers) != (chain.platform_manifest, chain.layers):
        raise IntegrityError(f"{where}: the registry serves manifest {served.platform_manifest}, not the pinned "
                             f"chain's {chain.platform_manifest}")
    if kind == "pinned":
        return (f"{where} serves the pinned index: {chain.platform} -> manifest {served.platform_manifest} -> "
                f"config {served.config}")
    if kind == "platform":
        return (f"{where} is the pinned chain's {chain.platform} manifest (under {chain.pinned}) -> config "
                f"{served.config}")
    return (f"{where} is a manifest skopeo wrote from the docker-archive (it holds no registry manifest); its config "
            f"{served.config} is the pinned image ID, {len(served.layers)} "
            f"layer{'' if len(served.layers) == 1 else 's'}")


def _push_note(kind: str, chain: Chain) -> str | None:
    """What a node naming the pinned digest finds at the site, when it is not the pinned digest itself."""
    if kind == "pinned":
        return None
    carry = ("carry a containerd-store `docker save` of the pinned digest (the whole index) to push the pinned "
             "digest itself")
    if kind == "platform":
        return (f"the site holds {chain.platform}'s manifest of {chain.pinned}, not the index itself: nodes name the "
                f"manifest digest; {carry}")
    return (f"a node naming {chain.pinned} or its {chain.platform} manifest will not find it at the site: nodes name "
            f"the digest above; `mm image save --format oci-archive` keeps the pinned chain's digests, or {carry}")
