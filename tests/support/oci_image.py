"""A small two-platform test image built by hand as an OCI layout (no Docker), pushed with skopeo.

    img = build_layout(dir, tag="dev")       # linux/amd64 + linux/arm64 behind one image index
    img.index_digest                         # what a pin names (REPO@sha256:...)
    img.platforms["linux/amd64"].config      # the image ID docker reports after `docker load` (classic store)
    push(img, "127.0.0.1:PORT/lmsysorg/sglang")   # skopeo copy --all --preserve-digests, plain HTTP
    containerd_save_archive(img, "REPO", path)     # what `docker save REPO@sha256:<index>` writes on a containerd store

Each platform has one gzip layer holding /etc/mm-test-platform (its own bytes, so configs and digests differ).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass
class PlatformImage:
    platform: str
    manifest: str
    config: str
    layers: list[str]


@dataclass
class TestImage:
    layout: Path
    tag: str
    index_digest: str
    platforms: dict[str, PlatformImage] = field(default_factory=dict)


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest, len(data)


def _layer(content: bytes) -> tuple[bytes, bytes]:
    """(gzip blob, uncompressed tar) of a layer holding etc/mm-test-platform."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("etc/mm-test-platform")
        info.size, info.mtime, info.mode = len(content), 0, 0o644
        tf.addfile(info, io.BytesIO(content))
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as f:
        f.write(raw.getvalue())
    return gz.getvalue(), raw.getvalue()


def build_layout(layout: Path, tag: str = "dev", salt: str = "") -> TestImage:
    """Write an OCI image layout at LAYOUT: an index over linux/amd64 and linux/arm64, tagged TAG."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    entries, platforms = [], {}
    for arch, variant in (("amd64", None), ("arm64", "v8")):
        gz, raw = _layer(f"mm test image {salt} {arch}\n".encode())
        layer_digest, layer_size = _blob(layout, gz)
        config = {"architecture": arch, "os": "linux", **({"variant": variant} if variant else {}),
                  "config": {"Entrypoint": ["/bin/true"]},
                  "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw).hexdigest()]}}
        config_digest, config_size = _blob(layout, json.dumps(config, sort_keys=True).encode())
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
                    "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": layer_size}]}
        manifest_digest, manifest_size = _blob(layout, json.dumps(manifest).encode())
        plat = {"architecture": arch, "os": "linux", **({"variant": variant} if variant else {})}
        entries.append({"mediaType": OCI_MANIFEST, "digest": manifest_digest, "size": manifest_size, "platform": plat})
        platforms[f"linux/{arch}"] = PlatformImage(f"linux/{arch}", manifest_digest, config_digest, [layer_digest])
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
    index_digest, index_size = _blob(layout, json.dumps(index).encode())
    top = {"schemaVersion": 2, "manifests": [{"mediaType": OCI_INDEX, "digest": index_digest, "size": index_size,
                                              "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (layout / "index.json").write_text(json.dumps(top))
    return TestImage(layout, tag, index_digest, platforms)


def push(image: TestImage, repo: str) -> str:
    """Push the whole index to REPO (host:port/name) over plain HTTP, digests preserved; returns REPO@index."""
    subprocess.run(["skopeo", "copy", "--quiet", "--all", "--preserve-digests", "--dest-tls-verify=false",
                    f"oci:{image.layout}:{image.tag}", f"docker://{repo}:{image.tag}"],
                   check=True, capture_output=True, text=True, timeout=120)
    return f"{repo}@{image.index_digest}"


def containerd_save_archive(image: TestImage, repo: str, out: Path) -> Path:
    """The archive a containerd-store `docker save REPO@sha256:<index>` writes: the OCI layout, its index.json
    naming the pinned index with io.containerd.image.name (so a load keeps the repo digest)."""
    top = {"schemaVersion": 2, "manifests": [{
        "mediaType": OCI_INDEX, "digest": image.index_digest,
        "size": (image.layout / "blobs" / "sha256" / image.index_digest.split(":")[1]).stat().st_size,
        "annotations": {"io.containerd.image.name": f"{repo}@{image.index_digest}"}}]}
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for path in sorted((image.layout / "blobs").rglob("*")):
            if path.is_file():
                tf.add(path, arcname=path.relative_to(image.layout).as_posix())
        for name, data in (("oci-layout", (image.layout / "oci-layout").read_bytes()),
                           ("index.json", json.dumps(top).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out
