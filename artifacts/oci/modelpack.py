"""The CNCF ModelPack model format (modelpack/model-spec docs/spec.md, docs/config.md, docs/annotations.md).

An mm model directory becomes one OCI image manifest:
  artifactType application/vnd.cncf.model.manifest.v1+json, config application/vnd.cncf.model.config.v1+json,
  one raw layer per file (no tar, no compression), media type by role (weight / weight.config / doc / code),
  annotations org.cncf.model.filepath and org.cncf.model.file.metadata+json, and beside them the relative path as
  org.opencontainers.image.title (the OCI annotation `oras pull` names a layer's file by, instead of its digest),
  plus one layer holding mm's own manifest (media type MM_MANIFEST), so a pull restores `.mm/manifest.json`
  with blake3 and the Hub's identities; the Hub repo and revision also go in the manifest's annotations;
  and, for a signed model, one layer holding the manifest's SSH signature (MM_SIGNATURE, signing.py) over the
  mm manifest layer's exact bytes, so `mm pull --require-signature` can check it before writing anything.
Digests are each file's sha256, already in mm's manifest: nothing is hashed again. The output is
deterministic (constant file metadata), so pushing the same directory twice gives the same digest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import BadInput, IntegrityError
from ..paths import MANIFEST_NAME, MM_DIR
from ..edges.fsutil import check_model_path, read_json_file
from ..integrity.manifest import Manifest, from_json
from ..edges.untrusted import load_json
from .client import OCI_MANIFEST
from .reference import DIGEST

ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
CODE = "application/vnd.cncf.model.code.v1.raw"
RAW_TYPES = frozenset({WEIGHT, WEIGHT_CONFIG, DOC, CODE, "application/vnd.cncf.model.dataset.v1.raw"})
MM_MANIFEST = "application/vnd.mm.manifest.v1+json"
MM_SIGNATURE = "application/vnd.mm.manifest.sig.v1"  # an armored SSHSIG (ssh-keygen -Y sign, namespace mm-manifest)
FILEPATH = "org.cncf.model.filepath"
FILE_METADATA = "org.cncf.model.file.metadata+json"
UNTESTED = "org.cncf.model.file.mediatype.untested"
SOURCE = "org.opencontainers.image.source"
REVISION = "org.opencontainers.image.revision"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
MM_MANIFEST_PATH = f"{MM_DIR}/{MANIFEST_NAME}"
MM_SIGNATURE_PATH = f"{MM_MANIFEST_PATH}.sig"
MAX_MM_MANIFEST = 16 * 1024 * 1024  # mm's margin: about 50,000 files at ~300 bytes an entry (the largest model
# repos hold a few thousand); read whole and parsed, so it is also what bounds pull's memory

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".ckpt", ".h5", ".msgpack", ".nemo")
CODE_SUFFIXES = (".py", ".sh", ".ipynb")
DOC_NAMES = ("README", "LICENSE", "LICENCE", "NOTICE", "COPYING", "USE_POLICY", "CHANGELOG")
DOC_SUFFIXES = (".md", ".pdf", ".rst")
CONFIG_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt", ".yaml", ".yml", ".vocab")
# safetensors dtype -> the spec's precision names (docs/config.md)
PRECISION = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3",
             "F8_E5M2": "float8_e5m2", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
             "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool", "C64": "complex64"}
EPOCH = "1970-01-01T00:00:00Z"


def media_type(path: str) -> tuple[str, bool]:
    """(layer media type, tested) for a file of the model: weights, their config/tokenizer, docs, code.
    tested is False when the role is a guess (the layer then says so with org.cncf.model.file.mediatype.untested)."""
    name = PurePosixPath(path).name
    lower = name.lower()
    if lower.endswith(WEIGHT_SUFFIXES) and not lower.endswith(".index.json"):
        return WEIGHT, True
    if name.upper().startswith(DOC_NAMES) or lower.endswith(DOC_SUFFIXES):
        return DOC, True
    if lower.endswith(CODE_SUFFIXES):
        return CODE, True
    if lower.endswith(CONFIG_SUFFIXES) or lower.startswith(("tokenizer", "vocab", "merges", "config")):
        return WEIGHT_CONFIG, True
    return WEIGHT_CONFIG, False


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # sha256:<hex>
    size: int
    path: str  # org.cncf.model.filepath ("" for none)

    def descriptor(self, annotations: dict[str, str]) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, "annotations": annotations}


@dataclass(frozen=True)
class Artifact:
    """What push sends: the blobs' descriptors (layers, then config) and the manifest bytes, sent last."""

    layers: tuple[Layer, ...]  # file layers, then the mm manifest layer
    config: bytes
    config_digest: str
    manifest: bytes
    manifest_digest: str
    mm_manifest: bytes  # the mm manifest layer's bytes (small, in memory)
    signature: bytes | None = None  # the signature layer's bytes, when the model is signed


def _file_metadata(path: str, size: int) -> str:
    return json.dumps({"name": PurePosixPath(path).name, "mode": 0o644, "uid": 0, "gid": 0, "size": size,
                       "mtime": EPOCH, "typeflag": 48}, separators=(",", ":"))


def _sha256(data: bytes) -> str:
    import hashlib
    return "sha256:" + hashlib.sha256(data).hexdigest()


def model_config_fields(model_dir: Path, manifest: Manifest) -> dict[str, str]:
    """The spec's config fields mm can state: format (safetensors when every weight is), architecture (config.json's
    first `architectures` entry) and precision (the dtypes in the shards' headers, headers only)."""
    from ..integrity.safetensors_check import StructureError
    fields: dict[str, str] = {}
    weights = [f.path for f in manifest.files if media_type(f.path)[0] == WEIGHT]
    if weights and all(p.endswith(".safetensors") for p in weights):
        fields["format"] = "safetensors"
    try:
        config = read_json_file(model_dir / "config.json", what="config.json")
        arch = config.get("architectures") if isinstance(config, dict) else None
        if isinstance(arch, list) and arch and isinstance(arch[0], str) and len(arch[0]) <= 256:
            fields["architecture"] = arch[0]
    except BadInput:  # verify names a config.json that is not what it must be; here it only adds a field
        pass
    dtypes: set[str] = set()
    for path in weights:
        if path.endswith(".safetensors"):
            try:
                dtypes |= _dtypes(model_dir / path)
            except (OSError, ValueError, BadInput, StructureError):
                continue
    names = [PRECISION[d] for d in PRECISION if d in dtypes]
    if names:
        fields["precision"] = ",".join(names)
    return fields


def _dtypes(path: Path) -> set[str]:
    import struct
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError("header too long")
        doc = load_json(f.read(n), str(path))
    if not isinstance(doc, dict):
        raise ValueError("header is not an object")
    return {v["dtype"] for k, v in doc.items()
            if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("dtype"), str)}


def _path_annotations(path: str, size: int) -> dict[str, str]:
    """A layer's file: the model-spec's path and metadata, and the OCI title (what `oras pull` writes it as)."""
    return {FILEPATH: path, FILE_METADATA: _file_metadata(path, size), TITLE: path}


def build(model_dir: Path, manifest: Manifest, mm_manifest: bytes, config_fields: dict[str, str],
          signature: bytes | None = None) -> Artifact:
    """The ModelPack artifact for MODEL_DIR, from its manifest (digests are the recorded sha256s); SIGNATURE (over
    MM_MANIFEST's bytes) adds its own layer."""
    layers, descriptors = [], []
    for f in manifest.files:
        mt, tested = media_type(f.path)
        layer = Layer(mt, f"sha256:{f.sha256}", f.size, f.path)
        annotations = _path_annotations(f.path, f.size)
        if not tested:
            annotations[UNTESTED] = "true"
        layers.append(layer)
        descriptors.append(layer.descriptor(annotations))
    mm_layer = Layer(MM_MANIFEST, _sha256(mm_manifest), len(mm_manifest), MM_MANIFEST_PATH)
    layers.append(mm_layer)
    descriptors.append(mm_layer.descriptor(_path_annotations(MM_MANIFEST_PATH, len(mm_manifest))))
    if signature is not None:
        sig_layer = Layer(MM_SIGNATURE, _sha256(signature), len(signature), MM_SIGNATURE_PATH)
        layers.append(sig_layer)
        descriptors.append(sig_layer.descriptor(_path_annotations(MM_SIGNATURE_PATH, len(signature))))
    source = f"{(manifest.endpoint or 'https://huggingface.co').rstrip('/')}/{manifest.repo_id}"
    descriptor = {"name": manifest.repo_id, "revision": manifest.revision, "sourceURL": source}
    if manifest.created:
        descriptor["createdAt"] = manifest.created
    config = {"descriptor": descriptor, "config": dict(config_fields),
              "modelfs": {"type": "layers", "diffIds": [layer.digest for layer in layers]}}
    config_bytes = json.dumps(config, separators=(",", ":")).encode()
    annotations = {SOURCE: source, REVISION: manifest.revision, TITLE: manifest.repo_id}
    if manifest.created:
        annotations[CREATED] = manifest.created
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
           "config": {"mediaType": CONFIG, "digest": _sha256(config_bytes), "size": len(config_bytes)},
           "layers": descriptors, "annotations": annotations}
    manifest_bytes = json.dumps(doc, separators=(",", ":")).encode()
    return Artifact(tuple(layers), config_bytes, _sha256(config_bytes), manifest_bytes, _sha256(manifest_bytes),
                    mm_manifest, signature)


# --- reading an artifact (hostile until parsed) ----------------------------------------------------

@dataclass(frozen=True)
class Parsed:
    files: tuple[Layer, ...]  # one per model file, with its path
    mm_layer: Layer | None
    config: Layer
    annotations: dict[str, str]
    sig_layer: Layer | None = None

    @property
    def total_bytes(self) -> int:
        return sum(layer.size for layer in self.files)


def parse(data: bytes, where: str) -> Parsed:
    """Check an OCI manifest is a ModelPack artifact mm can restore; every path and digest checked."""
    doc = load_json(data, where, what="manifest")
    if not isinstance(doc, dict) or doc.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST:
        kind = doc.get("mediaType") if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(f"{where}: not an OCI image manifest ({kind})")
    config = _layer(doc.get("config"), where, "config")
    if doc.get("artifactType") != ARTIFACT_TYPE and config.media_type != CONFIG:
        raise BadInput(f"{where}: not a ModelPack model artifact (artifactType {doc.get('artifactType')!r})")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise BadInput(f"{where}: manifest has no layer list")
    files, mm_layer, sig_layer, seen = [], None, None, set()
    for i, raw in enumerate(raw_layers):
        layer = _layer(raw, where, f"layer {i}")
        if layer.media_type == MM_MANIFEST:
            if mm_layer is not None:
                raise BadInput(f"{where}: two mm manifest layers")
            mm_layer = layer
            continue
        if layer.media_type == MM_SIGNATURE:
            if sig_layer is not None:
                raise BadInput(f"{where}: two mm signature layers")
            sig_layer = layer
            continue
        if layer.media_type not in RAW_TYPES:
            raise BadInput(f"{where}: layer {i} ({layer.path or layer.digest}) has media type {layer.media_type!r}; "
                           f"mm restores raw (untarred) layers only")
        if not layer.path:
            raise BadInput(f"{where}: layer {i} has no {FILEPATH} annotation")
        check_model_path(layer.path, where)
        if layer.path in seen:
            raise BadInput(f"{where}: layer path {layer.path!r} is reserved or repeated")
        seen.add(layer.path)
        files.append(layer)
    annotations = doc.get("annotations") if isinstance(doc.get("annotations"), dict) else {}
    return Parsed(tuple(files), mm_layer, config, {str(k): str(v) for k, v in annotations.items()}, sig_layer)


def _layer(raw: object, where: str, what: str) -> Layer:
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: {what} is not a descriptor")
    digest, size, mt = raw.get("digest"), raw.get("size"), raw.get("mediaType")
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise BadInput(f"{where}: {what} has digest {digest!r}; mm takes sha256 digests only")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadInput(f"{where}: {what} has a bad size {size!r}")
    if not isinstance(mt, str):
        raise BadInput(f"{where}: {what} has no media type")
    annotations = raw.get("annotations") if isinstance(raw.get("annotations"), dict) else {}
    path = annotations.get(FILEPATH, "")
    return Layer(mt, digest, size, path if isinstance(path, str) else "")


def restored_manifest(parsed: Parsed, mm_bytes: bytes, where: str) -> Manifest:
    """mm's manifest from its layer, cross-checked with the layers: same paths, sizes and sha256s, or refused."""
    manifest = from_json(mm_bytes, f"{where} (mm manifest layer)")
    layers = {layer.path: layer for layer in parsed.files}
    entries = manifest.by_path()
    if set(layers) != set(entries):
        odd = sorted(set(layers) ^ set(entries))
        raise IntegrityError(f"{where}: the mm manifest and the layers name different files ({', '.join(odd[:3])})")
    for path, entry in entries.items():
        layer = layers[path]
        if layer.digest != f"sha256:{entry.sha256}" or layer.size != entry.size:
            raise IntegrityError(f"{where}: {path}: layer {layer.digest[:19]} ({layer.size} bytes) disagrees with the "
                                 f"mm manifest (sha256:{entry.sha256[:12]}, {entry.size} bytes)")
    return manifest
