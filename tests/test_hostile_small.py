"""The smaller hostile cases, and every typed reader fed values of the wrong JSON type.

  values    `--identity ""` is refused (exit 2), for every command that takes it
  records   an image record with a float layer size; an image index whose platform is a list; an OCI archive whose
            config is a list: one line, exit 3 (or 7 for "no image for this platform"), never exit 70
  reserved  a manifest (or bundle index, or Hub listing) naming a file under .mm/: refused, exit 3
  gpus      `mm warmup --hardware b300` on Hopper GPUs refuses the combination (exit 7) before it looks for the image
  tls env   SSL_CERT_FILE / SSL_CERT_DIR naming a FIFO, a device, a directory, a missing file or no certificate:
            one line naming the variable, exit 3, at once (a FIFO would block OpenSSL's read for ever); the same for
            the stored Hub login HF_TOKEN_PATH names (huggingface_hub reads it whole, by path)
  types     every typed reader of a document mm reads (manifest, bundle index, image record, cache key, wheelhouse
            index, unbundle state, journal, range map, image archives, image index and manifest, auth file, ModelPack
            manifest) given each wrong JSON type at each path: only mm's own errors, never another exception
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Callable

import pytest

from mm.artifacts.errors import MMError
from tests.support import fake_docker, fake_gpu
from tests.support.modelgen import write_fetched_model
from tests.support.run import run_mm

REV = "ce7f4df87d2e05262f5775f373dac4772f134041"
DIGEST = "sha256:" + "a" * 64


def one_line(r, code: int, *needles: object) -> None:
    text = r.stderr + r.stdout
    assert "Traceback" not in text and r.returncode == code, f"exit {r.returncode}: {text}"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mm: ") or ln.startswith("Error:")]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert str(needle) in lines[0], lines[0]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return write_fetched_model(tmp_path_factory.mktemp("small") / "MiniMax-M3.1-Flash", REV, shards=1,
                               shard_bytes=16 * 1024)


@pytest.fixture
def model(small_model, tmp_path) -> Path:
    root = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(small_model, root)
    return root


# --- values ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["verify", "unbundle", "pull", "launch"])
def test_an_empty_identity_is_refused_not_taken_as_none(command, model, tmp_path):
    args = {"verify": ["verify", model], "unbundle": ["unbundle", tmp_path, "--dest", tmp_path / "d"],
            "pull": ["pull", "127.0.0.1:9/a/b:c", "--local-dir", tmp_path / "d"],
            "launch": ["launch", model, "--hardware", "b300"]}[command]
    r = run_mm(*args, "--allowed-signers", tmp_path / "allowed", "--identity", "")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--identity" in r.stderr and "expected a signer identity" in r.stderr


# --- records and archives ----------------------------------------------------------------------------

def _record(**changes) -> dict:
    from mm.artifacts.serving.image import RECORD_SCHEMA
    from mm.artifacts.pins import default_pin

    pinned = default_pin().image
    repo, digest = pinned.split("@")
    doc = {"schema": RECORD_SCHEMA, "reference": pinned, "repo": repo, "pinned": digest,
           "pinned_media_type": "application/vnd.oci.image.index.v1+json", "platform": "linux/amd64",
           "platform_manifest": "sha256:" + "b" * 64, "config": "sha256:" + "c" * 64, "image_id": "sha256:" + "c" * 64,
           "layers": [{"digest": "sha256:" + "d" * 64, "size": 10, "media_type": "x"}],
           "archive": {"file": "sglang.tar", "format": "docker-archive", "size": 5, "sha256": "e" * 64, "tag": None},
           "saved_at": "2026-01-01T00:00:00Z"}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("size", [10.5, 1e3, "10", True])
def test_an_image_record_with_a_layer_size_that_is_not_an_integer_is_refused(size, model, tmp_path):
    archive = tmp_path / "sglang.tar"
    archive.write_bytes(b"")
    record = tmp_path / "sglang.tar.mm-image.json"
    record.write_text(json.dumps(_record(layers=[{"digest": "sha256:" + "d" * 64, "size": size, "media_type": "x"}])))
    r = run_mm("launch", model, "--hardware", "b300", "--image-archive", archive)
    one_line(r, 3, record, "not an mm image record", "whole number of bytes")


def _oci_archive(path: Path, manifest: dict) -> Path:
    """An OCI archive (index.json -> manifest blob) holding MANIFEST as given."""
    blob = json.dumps(manifest).encode()
    digest = hashlib.sha256(blob).hexdigest()
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                "digest": f"sha256:{digest}", "size": len(blob)}]}
    with tarfile.open(path, "w") as tf:
        for name, data in (("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", json.dumps(index).encode()),
                           (f"blobs/sha256/{digest}", blob)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("config", [[{"digest": DIGEST}], "sha256:x"])
def test_bundle_image_with_an_oci_archive_whose_config_is_not_an_object_is_one_line(config, small_model, tmp_path):
    archive = _oci_archive(tmp_path / "image.tar", {"schemaVersion": 2, "config": config, "layers": []})
    r = run_mm("bundle", small_model, "--out", tmp_path / "out", "--volume-size", "1G", "--image", archive)
    one_line(r, 3, archive, "config is not an object")


class _RawRegistry:
    """A registry on 127.0.0.1 that serves one manifest's bytes as they are (a real registry refuses to store an
    index whose platform is a list; a hostile or broken mirror serves one anyway)."""

    def __init__(self, body: bytes, media_type: str):
        import http.server
        import threading

        digest = "sha256:" + hashlib.sha256(body).hexdigest()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/v2/":
                    data, headers = b"{}", {"Content-Type": "application/json"}
                elif self.path.endswith(f"/manifests/{digest}"):
                    data, headers = body, {"Content-Type": media_type, "Docker-Content-Digest": digest}
                else:
                    data, headers = b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}', {"Content-Type": "application/json"}
                self.send_response(200 if self.path == "/v2/" or digest in self.path else 404)
                for k, v in {**headers, "Content-Length": str(len(data)),
                             "Docker-Distribution-Api-Version": "registry/2.0"}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.ref = f"127.0.0.1:{self.server.server_address[1]}/lmsysorg/sglang@{digest}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_image_save_with_an_index_entry_whose_platform_is_a_list_says_no_image_for_it(tmp_path):
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": DIGEST, "size": 1,
                            "platform": [{"os": "linux", "architecture": "amd64"}]}]}
    registry = _RawRegistry(json.dumps(index).encode(), index["mediaType"])
    try:
        r = run_mm("image", "save", registry.ref, "--platform", "linux/amd64", "--out", tmp_path / "x.tar",
                   "--insecure-registry", extra_env={"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}, timeout=120)
    finally:
        registry.close()
    one_line(r, 7, "no linux/amd64 image")
    assert not (tmp_path / "x.tar").exists()


# --- reserved: .mm/ belongs to mm --------------------------------------------------------------------

@pytest.mark.parametrize("command", ["verify", "repair", "bundle", "manifest export"])
def test_a_manifest_naming_a_file_under_dot_mm_is_refused(command, model, tmp_path):
    doc = json.loads((model / ".mm" / "manifest.json").read_text())
    doc["files"].append({**doc["files"][0], "path": ".mm/lock"})
    (model / ".mm" / "manifest.json").write_text(json.dumps(doc))
    args = {"verify": ["verify", model], "repair": ["repair", model],
            "bundle": ["bundle", model, "--out", tmp_path / "o", "--volume-size", "1G"],
            "manifest export": ["manifest", "export", model]}[command]
    one_line(run_mm(*args), 3, ".mm/lock", "mm keeps for its own state")


def test_a_bundle_index_naming_a_file_under_dot_mm_is_refused():
    from mm.artifacts.bundle.index import _entry
    from mm.artifacts.errors import BadInput

    raw = {"kind": "model", "path": ".mm/lock", "member": "model/.mm/lock", "size": 1, "offset": 0, "length": 1,
           "segment": 1, "segments": 1, "blake3": "a" * 64}
    with pytest.raises(BadInput, match="mm keeps for its own state"):
        _entry(raw, "index", 1, 10 ** 9)


def test_a_hub_repo_holding_a_file_under_dot_mm_is_refused_before_any_download(run_mm, hub_env, hub_root,
                                                                               tmp_path_factory, tmp_path):
    from tests.support.gitrepo import commit_dir

    src = tmp_path_factory.mktemp("dot-mm-src")
    (src / ".mm").mkdir()
    (src / ".mm" / "lock").write_text("not mm's lock\n")
    (src / "config.json").write_text("{}\n")
    repo_id = f"test-org/dot-mm-{os.getpid()}-{tmp_path.name[-12:]}"
    commit = commit_dir(hub_root / repo_id, src, "first upload")
    r = run_mm("fetch", repo_id, "--revision", commit, "--local-dir", tmp_path / "m", env=hub_env)
    one_line(r, 3, ".mm/lock", "--exclude")
    assert not (tmp_path / "m" / "config.json").exists()


# --- gpus: the combination first ---------------------------------------------------------------------

def test_warmup_of_a_blackwell_recipe_on_hopper_gpus_refuses_before_looking_for_the_image(model, tmp_path):
    bin_dir = tmp_path / "bin"
    fake_gpu.install(bin_dir, 4 * [fake_gpu.H100])
    fake_docker.install(bin_dir, tmp_path / "docker-state", store="classic", images=[])  # the image is not here
    r = run_mm("warmup", model, "--hardware", "b300", "--cache-root", tmp_path / "cache",
               extra_env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    one_line(r, 7, "NVIDIA H100", "needs Blackwell")


# --- types: every typed reader, every path, every wrong type -------------------------------------------

WRONG = [None, True, 1.5, -1, 10 ** 19, "x", "", [], {}, [1, "a"], {"a": 1}]


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield from _paths(v, prefix + (i,))


def _replaced(doc, path, value):
    if not path:
        return value
    doc = copy.deepcopy(doc)
    here = doc
    for p in path[:-1]:
        here = here[p]
    here[path[-1]] = value
    return doc


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _readers(model: Path, tmp: Path) -> dict[str, tuple[object, Callable]]:
    """(a valid sample document, a call that reads one) for each typed reader."""
    from mm.artifacts.serving import cachekey, image
    from mm.artifacts.integrity import manifest
    from mm.artifacts.bundle import wheelhouse
    from mm.artifacts.bundle.index import parse_index
    from mm.artifacts.bundle.pack import BundleOptions, create_bundle
    from mm.artifacts.bundle.unpack import _State
    from mm.artifacts.bundle.volume import open_volume
    from mm.artifacts.fetching.download import Journal
    from mm.artifacts.oci import client, modelpack
    from mm.artifacts.fetching.ranges import RangeMap

    mdoc = json.loads((model / ".mm" / "manifest.json").read_text())
    create_bundle(model, BundleOptions((tmp / "vols",), 10 ** 9, name="s"))
    idoc = json.loads(open_volume(next((tmp / "vols").glob("*.vol001-*.tar"))).index_bytes)
    cfg = json.dumps({"os": "linux", "architecture": "amd64"}).encode()
    cfg_hex = hashlib.sha256(cfg).hexdigest()
    oci_manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"digest": f"sha256:{cfg_hex}", "size": len(cfg)}, "layers": []}
    man_blob = json.dumps(oci_manifest).encode()
    man_hex = hashlib.sha256(man_blob).hexdigest()
    oci_index = {"schemaVersion": 2, "manifests": [{"digest": f"sha256:{man_hex}", "platform": {"os": "linux"},
                                                    "annotations": {"io.containerd.image.name": "x/y:z"}}]}

    def write(name: str, doc) -> Path:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
        return path

    def oci_with_manifest(doc):
        blob = json.dumps(doc).encode()
        entry = {"digest": "sha256:" + hashlib.sha256(blob).hexdigest()}
        image.read_archive(_tar(tmp / "o.tar", {"index.json": json.dumps({"manifests": [entry]}).encode(),
                                                f"blobs/sha256/{entry['digest'][7:]}": blob,
                                                f"blobs/sha256/{cfg_hex}": cfg}))

    def auth_file(doc):
        os.environ["REGISTRY_AUTH_FILE"] = str(write("auth.json", doc))
        try:
            client.load_credentials("127.0.0.1:5000")
        finally:
            del os.environ["REGISTRY_AUTH_FILE"]

    def layer(media_type, path=None):
        return {"mediaType": media_type, "digest": DIGEST, "size": 3,
                **({"annotations": {modelpack.FILEPATH: path}} if path else {})}

    return {
        "manifest": (mdoc, lambda d: manifest.from_json(json.dumps(d).encode(), "m")),
        "bundle index": (idoc, lambda d: parse_index(d, "index")),
        "image record": (_record(), lambda d: image.read_record(write("r.json", d))),
        "cache key": ({"schema": cachekey.SCHEMA, "gpu": "g", "gpu_count": 4},
                      lambda d: cachekey.read_cache_key(write(f"ck/{cachekey.FILE_NAME}", d).parent)),
        "wheelhouse index": ({"schema": wheelhouse.SCHEMA, "glibc_min": "2.28", "sets": [
            {"name": "linux-x86_64-cp311", "lock": "linux-x86_64-cp311/requirements.lock",
             "wheels": [{"file": "a-1-py3-none-any.whl", "name": "a", "version": "1", "size": 3, "sha256": "f" * 64}]}]},
            lambda d: wheelhouse.check_wheelhouse(write(f"wh/{wheelhouse.INDEX_NAME}", d).parent)),
        "unbundle state": ({"bundle_id": "b", "pieces": {"model:a": {"1": [0, 10, "ab" * 32]}},
                            "whole": {"model:a": ["c" * 64, "d" * 64]}, "done_volumes": [1]},
                           lambda d: _State(write("state.json", d), tmp).bytes_in_place("model:a")),
        "journal": (mdoc["files"][0], lambda d: Journal(write("journal.jsonl", d), tmp).entries()),
        "range map": ({"schema": "mm-ranges/1", "identity": "i", "size": 100, "done": [[0, 10]]},
                      lambda d: RangeMap.from_json(d, 100, "i")),
        "docker-archive manifest.json": ([{"Config": f"blobs/sha256/{cfg_hex}", "RepoTags": ["a:b"]}],
                                         lambda d: image.read_archive(_tar(tmp / "d.tar", {
                                             "manifest.json": json.dumps(d).encode(), f"blobs/sha256/{cfg_hex}": cfg}))),
        "OCI archive index": (oci_index, lambda d: image.read_archive(_tar(tmp / "i.tar", {
            "index.json": json.dumps(d).encode(), f"blobs/sha256/{man_hex}": man_blob, f"blobs/sha256/{cfg_hex}": cfg}))),
        "OCI archive manifest": (oci_manifest, oci_with_manifest),
        "registry image index": ({"manifests": [{"digest": DIGEST, "platform": {"os": "linux", "architecture": "amd64"}}]},
                                 lambda d: image.select_platform(image._parse_json(json.dumps(d).encode(), "ref"),
                                                                 "linux/amd64", "ref")),
        "registry image manifest": ({"config": {"digest": DIGEST}, "layers": [{"digest": DIGEST, "size": 3}]},
                                    lambda d: image._chain_from_manifest("r", "p", "t", "linux/amd64", DIGEST, d)),
        "registry auth file": ({"auths": {"127.0.0.1:5000": {"auth": "dXNlcjpwdw=="}}}, auth_file),
        "ModelPack manifest": ({"schemaVersion": 2, "mediaType": modelpack.OCI_MANIFEST,
                                "artifactType": modelpack.ARTIFACT_TYPE, "config": layer(modelpack.CONFIG),
                                "layers": [layer(modelpack.MM_MANIFEST),
                                           layer(sorted(modelpack.RAW_TYPES)[0], "a.safetensors")]},
                               lambda d: modelpack.parse(json.dumps(d).encode(), "ref")),
    }


READERS = ["manifest", "bundle index", "image record", "cache key", "wheelhouse index", "unbundle state", "journal",
           "range map", "docker-archive manifest.json", "OCI archive index", "OCI archive manifest",
           "registry image index", "registry image manifest", "registry auth file", "ModelPack manifest"]


@pytest.fixture(scope="module")
def readers(small_model, tmp_path_factory):
    return _readers(small_model, tmp_path_factory.mktemp("readers"))


@pytest.mark.parametrize("reader", READERS)
def test_a_typed_reader_given_the_wrong_json_type_anywhere_raises_only_mms_errors(reader, readers):
    sample, read = readers[reader]
    read(sample)  # the sample itself is read without error: the cases below differ from it in one value
    escaped = []
    for path in list(_paths(sample)):
        for value in WRONG:
            try:
                read(_replaced(sample, path, value))
            except MMError:
                pass
            except Exception as e:  # noqa: BLE001 -- the point: anything but mm's own error is exit 70
                escaped.append(f"{'.'.join(map(str, path)) or '$'} = {value!r}: {type(e).__name__}: {e}")
    assert not escaped, "\n".join(escaped[:10])


def ca_file_cases(tmp: Path) -> dict[str, tuple[dict[str, str], str]]:
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    garbage = tmp / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return {"fifo": ({"SSL_CERT_FILE": str(fifo)}, "is a FIFO"),
            "device": ({"SSL_CERT_FILE": "/dev/zero"}, "is a character device"),
            "directory": ({"SSL_CERT_FILE": str(tmp)}, "is a directory"),
            "missing": ({"SSL_CERT_FILE": str(tmp / "gone.pem")}, "No such file"),
            "no certificate": ({"SSL_CERT_FILE": str(garbage)}, "cannot load CA certificates"),
            "dir is a file": ({"SSL_CERT_DIR": str(garbage)}, "not a directory")}


@pytest.mark.parametrize("case", ["fifo", "device", "directory", "missing", "no certificate", "dir is a file"])
def test_a_ca_bundle_the_environment_names_that_is_not_one_is_one_line_naming_the_variable(case, tmp_path):
    extra, why = ca_file_cases(tmp_path)[case]
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    r = run_mm("fetch", "org/model", "--revision", REV, "--local-dir", tmp_path / "model", env=env,
               extra_env={**extra, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}, timeout=60)
    variable = next(iter(extra))
    one_line(r, 3, f"{variable}={extra[variable]}", why)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_stored_hub_login_that_is_not_a_file_is_one_line_not_a_hang(kind, tmp_path):
    login = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(login)
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    where = str(login) if kind == "fifo" else "/dev/zero"
    r = run_mm("fetch", "org/model", "--revision", REV, "--local-dir", tmp_path / "model", env=env,
               extra_env={"HF_TOKEN_PATH": where, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}, timeout=60)
    one_line(r, 3, where, "HF_TOKEN_PATH")
