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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BadInput, IntegrityError, Refused, RemoteError
from ..edges.fsutil import atomic_write_json, open_local_file, publish, unlink_file, user_path
from ..integrity.hashing import upstream_digest
from ..edges.tools import ToolMissing, last_line, run_tool
from ..edges.untrusted import load_json, read_json_file

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
    from ..oci.client import is_loopback

    return tls_verify and not is_loopback(repo.split("/", 1)[0])


def _fetch_manifest(repo: str, digest: str, tls_verify: bool, timeout: float) -> dict:
    raw = _skopeo(["inspect", "--raw", _tls(tls_verify), f"docker://{repo}@{digest}"], f"{repo}@{digest}", timeout)
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


def resolve_chain(ref: str, platform: str, tls_verify: bool = True, timeout: float = 120) -> Chain:
    """Ask the registry: pinned digest -> platform manifest -> config and layers, each manifest's sha256 checked."""
    repo, pinned = parse_ref(ref)
    tls_verify = _verify_tls(repo, tls_verify)
    top = _fetch_manifest(repo, pinned, tls_verify, timeout)
    top_type = _media_type(top)
    if top_type in INDEX_TYPES:
        manifest_digest = select_platform(top, platform, ref)
        manifest = _fetch_manifest(repo, manifest_digest, tls_verify, timeout)
    elif top_type in MANIFEST_TYPES:  # a single-platform image: its config says which platform
        manifest_digest, manifest = pinned, top
        config = _parse_json(_skopeo(["inspect", "--raw", "--config", _tls(tls_verify), f"docker://{ref}"], ref, timeout), ref)
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
    tag = f"{chain.repo}:mm-{chain.pinned.split(':')[1][:12]}-{platform.split('/')[1]}"
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
