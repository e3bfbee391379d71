"""mm push / mm pull / mm inspect against the real docker-registry (distribution 2.8) on 127.0.0.1."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from mm.artifacts.oci import modelpack
from mm.artifacts.errors import BadValue
from mm.artifacts.oci.client import Client, Credentials, Transport
from mm.artifacts.oci.pull import PullOptions
from mm.artifacts.oci.reference import Endpoint, parse_endpoint, parse_reference
from tests.support.countproxy import CountingProxy
from tests.support.modelgen import write_model
from tests.support.registry import Registry
from tests.support.run import mm_argv, run_mm

REPO_ID = "MiniMaxAI/MiniMax-M3.1-Flash"
REV_A = "ce7f4df87d2e05262f5775f373dac4772f134041"
REV_B = "54e4e69dfc45aa11bb22cc33dd44ee55ff667788"
SHARD = 3 * 1024 * 1024


def make_model(root: Path, seed: int, revision: str, shard_bytes: int = SHARD, shards: int = 3) -> Path:
    write_model(root, shards=shards, shard_bytes=shard_bytes, seed=seed)
    manifest_for_local_dir(root, REPO_ID, revision, offline=True)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Payload files (not .mm/) with their bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No docker login of the machine's user, no proxy; DOCKER_CONFIG in the test's own directory."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG") and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(DOCKER_CONFIG=str(tmp_path / "docker-config"), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra)
    return env


def mm(tmp_path: Path, *args, input: str | None = None, **env) -> subprocess.CompletedProcess:
    return run_mm(*args, env=env_for(tmp_path, **env), input=input, timeout=180)


def registry_manifest(reg: Registry, repo: str, ref: str, auth: str | None = None) -> dict:
    req = urllib.request.Request(f"{reg.url}/v2/{repo}/manifests/{ref}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json",
                                          **({"Authorization": auth} if auth else {})})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


def registry_blob(reg: Registry, repo: str, digest: str) -> bytes:
    with urllib.request.urlopen(f"{reg.url}/v2/{repo}/blobs/{digest}") as resp:
        return resp.read()


def missing_bytes(reg: Registry, repo: str, manifest_file: Path) -> int:
    """Bytes of the model's files whose blob the registry does not have (HEAD each)."""
    missing = 0
    for f in read_manifest(manifest_file).files:
        req = urllib.request.Request(f"{reg.url}/v2/{repo}/blobs/sha256:{f.sha256}", method="HEAD")
        try:
            urllib.request.urlopen(req).close()
        except urllib.error.HTTPError as e:
            assert e.code == 404
            missing += f.size
    return missing


def put_blob(reg: Registry, repo: str, data: bytes) -> str:
    """One monolithic upload (POST, then PUT with the digest), as another tool would; returns the digest."""
    import hashlib
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with urllib.request.urlopen(urllib.request.Request(f"{reg.url}/v2/{repo}/blobs/uploads/", method="POST")) as resp:
        location = resp.headers["Location"]
    put = urllib.request.Request(f"{location}&digest={digest}", data=data, method="PUT",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(put).close()
    return digest


def put_manifest(reg: Registry, repo: str, tag: str, doc: dict) -> None:
    req = urllib.request.Request(f"{reg.url}/v2/{repo}/manifests/{tag}", data=json.dumps(doc).encode(), method="PUT",
                                 headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    urllib.request.urlopen(req).close()


@pytest.fixture(scope="module")
def model_a(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("oci-a") / "MiniMax-M3.1-Flash", seed=11, revision=REV_A)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    """Another revision: different weights, and without model A's extra file."""
    return make_model(tmp_path_factory.mktemp("oci-b") / "MiniMax-M3.1-Flash", seed=12, revision=REV_B)


@pytest.fixture(scope="module")
def pushed_a(registry, model_a, tmp_path_factory) -> str:
    """Model A pushed to <registry>/minimax/flash with the default tag; returns the tagged reference."""
    proc = mm(tmp_path_factory.mktemp("push-a"), "push", model_a, f"{registry.host}/minimax/flash", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["reference"]


# --- format ---------------------------------------------------------------------------------------

def test_artifact_has_modelpack_media_types_and_annotations(registry, model_a, pushed_a):
    manifest = read_manifest(manifest_path(model_a))
    doc = registry_manifest(registry, "minimax/flash", REV_A[:12])
    assert pushed_a.endswith(f"minimax/flash:{REV_A[:12]}")
    assert doc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert doc["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert doc["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    assert doc["annotations"]["org.opencontainers.image.revision"] == REV_A
    assert doc["annotations"]["org.opencontainers.image.source"].endswith(REPO_ID)
    layers = {layer["annotations"]["org.cncf.model.filepath"]: layer for layer in doc["layers"]}
    expected_types = {
        "model-00001-of-00003.safetensors": "application/vnd.cncf.model.weight.v1.raw",
        "dspark/model-00001-of-00001.safetensors": "application/vnd.cncf.model.weight.v1.raw",
        "config.json": "application/vnd.cncf.model.weight.config.v1.raw",
        "dspark/config.json": "application/vnd.cncf.model.weight.config.v1.raw",
        "tokenizer.json": "application/vnd.cncf.model.weight.config.v1.raw",
        "model.safetensors.index.json": "application/vnd.cncf.model.weight.config.v1.raw",
        "README.md": "application/vnd.cncf.model.doc.v1.raw",
        ".mm/manifest.json": "application/vnd.mm.manifest.v1+json",
    }
    for path, media_type in expected_types.items():
        assert layers[path]["mediaType"] == media_type, path
    for f in manifest.files:  # one raw layer per file, digest = the manifest's sha256: nothing re-hashed
        layer = layers[f.path]
        assert (layer["digest"], layer["size"]) == (f"sha256:{f.sha256}", f.size)
        meta = json.loads(layer["annotations"]["org.cncf.model.file.metadata+json"])
        assert meta["name"] == Path(f.path).name and meta["size"] == f.size and meta["typeflag"] == 48
    assert set(layers) == {f.path for f in manifest.files} | {".mm/manifest.json"}
    config = json.loads(registry_blob(registry, "minimax/flash", doc["config"]["digest"]))
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in doc["layers"]]}
    assert config["config"]["format"] == "safetensors"
    assert config["config"]["architecture"] == "MiniMaxM3ForCausalLM"
    assert "float8_e4m3" in config["config"]["precision"].split(",")
    assert config["descriptor"]["revision"] == REV_A and config["descriptor"]["name"] == REPO_ID
    # the spec's config schema allows no other keys (schema/config-schema.json: additionalProperties false)
    assert set(config) == {"descriptor", "config", "modelfs"}
    assert set(config["descriptor"]) <= {"createdAt", "authors", "family", "name", "docURL", "sourceURL", "datasetsURL",
                                         "version", "revision", "vendor", "licenses", "title", "description"}
    assert set(config["config"]) <= {"architecture", "format", "paramSize", "precision", "quantization", "capabilities"}
    spec_precisions = {"float32", "float64", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "complex32",
                       "complex64", "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                       "uint64", "bool"}  # docs/config.md
    assert set(config["config"]["precision"].split(",")) <= spec_precisions


def test_skopeo_reads_the_manifest(registry, pushed_a):
    proc = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{pushed_a}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == registry_manifest(registry, "minimax/flash", REV_A[:12])
    assert doc["artifactType"] == modelpack.ARTIFACT_TYPE


# --- round trip -----------------------------------------------------------------------------------

def test_round_trip_is_byte_identical_with_dspark(model_a, pushed_a, tmp_path):
    dest = tmp_path / "pulled"
    proc = mm(tmp_path, "pull", pushed_a, "--local-dir", dest)
    assert proc.returncode == 0, proc.stderr
    assert tree(dest) == tree(model_a)
    assert any(p.startswith("dspark/") and p.endswith(".safetensors") for p in tree(dest))
    assert "verify --quick" in proc.stdout and "OK" in proc.stdout and "DSpark draft (dspark/): present" in proc.stdout
    pulled, original = read_manifest(manifest_path(dest)), read_manifest(manifest_path(model_a))
    assert (pulled.repo_id, pulled.revision) == (original.repo_id, original.revision)
    digest = json.loads(mm(tmp_path, "inspect", pushed_a, "--json").stdout)["digest"]
    assert {f.source for f in pulled.files} == {f"oci:{pushed_a.rsplit(':', 1)[0]}@{digest}"}
    strip = lambda m: [(f.path, f.size, f.blake3, f.sha256, f.upstream) for f in m.files]  # noqa: E731
    assert strip(pulled) == strip(original)
    assert mm(tmp_path, "verify", dest).returncode == 0


def test_second_pull_downloads_nothing(pushed_a, tmp_path):
    dest = tmp_path / "pulled"
    assert mm(tmp_path, "pull", pushed_a, "--local-dir", dest).returncode == 0
    before = {p: (dest / p).stat().st_ino for p in tree(dest)}
    proc = mm(tmp_path, "pull", pushed_a, "--local-dir", dest, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["bytes_transferred"] == 0
    assert {f["status"] for f in report["files"]} == {"present"}
    assert {p: (dest / p).stat().st_ino for p in tree(dest)} == before


def test_a_pull_reports_what_it_hashed_from_memory_and_read_back_from_the_disk(pushed_a, tmp_path):
    proc = mm(tmp_path, "pull", pushed_a, "--local-dir", tmp_path / "pulled", "--json")
    transfer = json.loads(proc.stdout)["transfer"]
    assert proc.returncode == 0 and transfer["read_back"] == 0  # small files land in order: nothing read back
    assert transfer["hashed_from_window"] >= 0 and transfer["requests"] > 0


def test_pull_by_digest_and_list(pushed_a, model_a, tmp_path):
    listing = json.loads(mm(tmp_path, "pull", "--list", pushed_a, "--json").stdout)
    manifest = read_manifest(manifest_path(model_a))
    assert listing["revision"] == REV_A and listing["repo_id"] == REPO_ID and listing["mm_manifest"] is True
    assert {(f["path"], f["size"]) for f in listing["files"]} == {(f.path, f.size) for f in manifest.files}
    text = mm(tmp_path, "inspect", pushed_a)
    assert text.returncode == 0 and "dspark/model-00001-of-00001.safetensors" in text.stdout and REV_A in text.stdout
    by_digest = f"{pushed_a.rsplit(':', 1)[0]}@{listing['digest']}"
    assert mm(tmp_path, "pull", by_digest, "--local-dir", tmp_path / "d").returncode == 0
    assert tree(tmp_path / "d") == tree(model_a)


def test_second_push_uploads_nothing(registry, model_a, pushed_a, tmp_path):
    with CountingProxy("127.0.0.1", registry.port) as proxy:
        proc = mm(tmp_path, "push", model_a, f"{proxy.host}/minimax/flash", "--json")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert {b["status"] for b in report["blobs"]} == {"present"} and report["bytes_sent"] == 0
        # HEADs and the manifest only: far less than the smallest shard
        assert proxy.sent < 64 * 1024


def test_push_mounts_blobs_from_another_repository(registry, model_a, pushed_a, tmp_path):
    with CountingProxy("127.0.0.1", registry.port) as proxy:
        proc = mm(tmp_path, "push", model_a, f"{proxy.host}/team/flash-copy:v1", "--mount-from", "minimax/flash", "--json")
        assert proc.returncode == 0, proc.stderr
        assert {b["status"] for b in json.loads(proc.stdout)["blobs"]} == {"mounted"}
        assert proxy.sent < 64 * 1024
    dest = tmp_path / "copy"
    assert mm(tmp_path, "pull", f"{registry.host}/team/flash-copy:v1", "--local-dir", dest).returncode == 0
    assert tree(dest) == tree(model_a)


def test_push_sends_the_manifest_after_every_blob(registry, model_a, tmp_path):
    """A tag never names a blob the registry does not have yet: the registry's access log shows the order."""
    since = len(registry.log_text())
    assert mm(tmp_path, "push", model_a, f"{registry.host}/order/flash:t", "--chunk-size", "1MiB").returncode == 0
    time.sleep(0.2)  # the access log line follows the response
    log = registry.log_text()[since:]
    blob_puts = [i for i, line in enumerate(log.splitlines()) if '"PUT /v2/order/flash/blobs/uploads/' in line]
    manifest_puts = [i for i, line in enumerate(log.splitlines()) if '"PUT /v2/order/flash/manifests/t ' in line]
    files = len(read_manifest(manifest_path(model_a)).files)
    assert len(blob_puts) >= files + 1 and len(manifest_puts) == 1  # every file, the mm manifest, the config
    assert max(blob_puts) < manifest_puts[0]


def test_push_refuses_a_directory_whose_quick_verify_fails(registry, tmp_path):
    model = make_model(tmp_path / "m", seed=13, revision=REV_A, shard_bytes=256 * 1024)
    shard = model / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = mm(tmp_path, "push", model, f"{registry.host}/broken/model:x")
    assert proc.returncode == 1
    assert "quick verify found" in proc.stderr and "model-00002-of-00003.safetensors" in proc.stderr
    assert "before pushing" in proc.stderr
    with pytest.raises(urllib.error.HTTPError):
        registry_manifest(registry, "broken/model", "x")


def test_bad_references_are_refused(tmp_path, model_a):
    for ref in ("no-host", "127.0.0.1:5000/UPPER/case", "127.0.0.1:5000/x@sha256:abc"):
        proc = mm(tmp_path, "pull", ref, "--local-dir", tmp_path / "d")
        assert proc.returncode == 3 and proc.stderr.startswith("mm: ") and "Traceback" not in proc.stderr
    proc = mm(tmp_path, "pull", "127.0.0.1:5000/x/y", "--local-dir", tmp_path / "d")
    assert proc.returncode == 3 and "give a tag or a digest" in proc.stderr


def test_https_unless_loopback_or_plain_http():
    assert Client(parse_reference("registry.site.internal:5000/m/x:t")).base == "https://registry.site.internal:5000"
    assert Client(parse_reference("registry.site.internal/m/x:t"), transport=Transport(plain_http=True)).base == \
        "http://registry.site.internal"
    assert Client(parse_reference("127.0.0.1:5000/m/x:t")).base == "http://127.0.0.1:5000"
    assert Client(parse_reference("localhost:5000/m/x:t")).base == "http://localhost:5000"



@pytest.mark.parametrize("text, scheme, host, port", [
    ("t2.site:5000", None, "t2.site:5000", 5000), ("T2.Site", None, "t2.site", None),
    ("http://10.0.1.1:5000/", "http", "10.0.1.1:5000", 5000), ("HTTPS://reg.site", "https", "reg.site", 443),
    ("http://[::1]:5000", "http", "[::1]:5000", 5000),
])
def test_a_registry_address_is_host_port_or_the_root_of_an_http_url(text, scheme, host, port):
    assert parse_endpoint(text, "--mirror") == Endpoint(scheme, host, port)


@pytest.mark.parametrize("text, why", [
    ("alice:s3cret@t2:5000", "--tier ***@t2:5000: holds credentials"),
    ("http://alice:s3cret@t2:5000/", "--tier ***@t2:5000: holds credentials"),
    ("http://t2:5000/v2", "the root of its host"), ("t2:5000?x=1", "the root of its host"),
    ("ftp://t2", "expected HOST[:PORT]"), ("t2:99999", "bad port"), ("t_2", "expected HOST[:PORT]"),
])
def test_a_registry_address_that_is_not_one_is_a_usage_error_that_never_echoes_credentials(text, why):
    with pytest.raises(BadValue, match=re.escape(why)) as e:
        parse_endpoint(text, "--tier")
    assert e.value.exit_code == 2 and "s3cret" not in e.value.message


def test_pull_options_read_each_mirror_with_its_transport_and_refuse_no_fallback_without_one():
    options = PullOptions.from_cli(mirrors=["http://t2.site:5000", "t1.site"], no_fallback=True, transport=Transport())
    assert options.mirrors == (("t2.site:5000", Transport(plain_http=True)), ("t1.site", Transport()))
    with pytest.raises(BadValue, match="--no-fallback needs at least one --mirror"):
        PullOptions.from_cli(mirrors=[], no_fallback=True, transport=Transport())


@pytest.mark.parametrize("username, password_stdin, stdin, message", [
    ("alice", False, "", "--username and --password-stdin go together"),
    (None, True, "s3cret\n", "--password-stdin needs --username"),
    ("alice", True, "", "--password-stdin: nothing on standard input"),
])
def test_a_registry_login_is_username_with_password_stdin_or_a_usage_error(username, password_stdin, stdin, message):
    with pytest.raises(BadValue, match=re.escape(message)) as e:
        Credentials.from_cli(username, password_stdin, io.StringIO(stdin))
    assert e.value.exit_code == 2 and "s3cret" not in e.value.message


def test_a_registry_login_takes_the_first_line_of_stdin_and_nothing_when_not_asked():
    login = Credentials.from_cli("alice", True, io.StringIO("s3cret\r\nmore\n"))
    assert (login.username, login.password, login.origin) == ("alice", "s3cret", "--username/--password-stdin")
    assert Credentials.from_cli(None, False, io.StringIO("unread")) is None


def test_fleet_config_wants_the_scheme_every_tier_is_served_with():
    with pytest.raises(BadValue, match=re.escape("--origin 't2:5000': expected http://HOST[:PORT] or https://")):
        parse_endpoint("t2:5000", "--origin", scheme_required=True)


# --- integrity --------------------------------------------------------------------------------------

def test_a_blob_corrupted_in_the_registry_is_refused_and_named(tmp_path):
    model = make_model(tmp_path / "m", seed=14, revision=REV_A, shard_bytes=512 * 1024)
    entry = next(f for f in read_manifest(manifest_path(model)).files if f.path == "model-00002-of-00003.safetensors")
    with Registry() as reg:
        assert mm(tmp_path, "push", model, f"{reg.host}/c/model:t").returncode == 0
        blob = reg.blob_path(f"sha256:{entry.sha256}")
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        dest = tmp_path / "pulled"
        proc = mm(tmp_path, "pull", f"{reg.host}/c/model:t", "--local-dir", dest)
    assert proc.returncode == 5, proc.stderr
    assert entry.path in proc.stderr and entry.sha256[:12] in proc.stderr
    assert not (dest / entry.path).exists()
    assert not list((dest / ".mm" / "partial").glob("*.part"))
    assert not manifest_path(dest).exists()


def test_a_file_whose_blake3_disagrees_with_the_pulled_mm_manifest_is_refused_and_named(registry, pushed_a, tmp_path):
    """The registry's sha256 is right, mm's manifest layer says another blake3: the file is not named."""
    doc = registry_manifest(registry, "minimax/flash", REV_A[:12])
    mm_layer = next(layer for layer in doc["layers"] if layer["mediaType"] == modelpack.MM_MANIFEST)
    mm_doc = json.loads(registry_blob(registry, "minimax/flash", mm_layer["digest"]))
    victim = next(f for f in mm_doc["files"] if f["path"] == "model-00002-of-00003.safetensors")
    victim["blake3"] = "0" * 64
    data = json.dumps(mm_doc).encode()
    mm_layer.update(digest=put_blob(registry, "minimax/flash", data), size=len(data))
    put_manifest(registry, "minimax/flash", "wrong-blake3", doc)
    dest = tmp_path / "pulled"
    proc = mm(tmp_path, "pull", f"{registry.host}/minimax/flash:wrong-blake3", "--local-dir", dest)
    assert proc.returncode == 5, proc.stderr
    assert "model-00002-of-00003.safetensors: blake3" in proc.stderr and "disagrees with the pulled mm manifest" in proc.stderr
    assert not (dest / victim["path"]).exists()
    assert (dest / "model-00001-of-00003.safetensors").is_file()  # the others arrived and were proven
    assert not list((dest / ".mm" / "partial").glob("*.part"))
    assert not manifest_path(dest).exists()


def test_a_layer_path_outside_the_directory_is_refused_before_anything_is_written(registry, tmp_path):
    weights = b"\x01" * 4096
    config = b'{"descriptor":{"name":"x"},"config":{},"modelfs":{"type":"layers","diffIds":[]}}'
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "artifactType": modelpack.ARTIFACT_TYPE,
           "config": {"mediaType": modelpack.CONFIG, "digest": put_blob(registry, "hostile/paths", config),
                      "size": len(config)},
           "layers": [{"mediaType": modelpack.WEIGHT, "digest": put_blob(registry, "hostile/paths", weights),
                       "size": len(weights), "annotations": {modelpack.FILEPATH: "../escape.safetensors"}}]}
    put_manifest(registry, "hostile/paths", "v1", doc)
    dest = tmp_path / "inner" / "pulled"
    for args in (("pull", f"{registry.host}/hostile/paths:v1", "--local-dir", dest),
                 ("inspect", f"{registry.host}/hostile/paths:v1")):
        proc = mm(tmp_path, *args)
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.startswith("mm: ") and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "'../escape.safetensors'" in proc.stderr and "escapes the directory" in proc.stderr
    assert not (tmp_path / "inner" / "escape.safetensors").exists() and not dest.exists()


def test_tag_moved_between_pulls_does_not_mix_revisions(registry, model_a, model_b, tmp_path):
    # a copy: the module's model_a is shared, and a manifest written again (a new "created") is another mm layer
    rev_a = tmp_path / "revision-a" / model_a.name
    shutil.copytree(model_a, rev_a)
    (rev_a / "extra-a.json").write_text('{"only": "in revision A"}\n')
    manifest_for_local_dir(rev_a, REPO_ID, REV_A, offline=True)
    ref = f"{registry.host}/moving/flash:latest"
    assert mm(tmp_path, "push", rev_a, ref).returncode == 0
    dest = tmp_path / "pulled"
    assert mm(tmp_path, "pull", ref, "--local-dir", dest).returncode == 0
    assert tree(dest) == tree(rev_a)
    assert mm(tmp_path, "push", model_b, ref).returncode == 0  # the tag moves to revision B
    proc = mm(tmp_path, "pull", ref, "--local-dir", dest)
    assert proc.returncode == 0, proc.stderr
    assert tree(dest) == tree(model_b)
    assert read_manifest(manifest_path(dest)).revision == REV_B
    assert "extra-a.json" in proc.stdout  # named as removed


def test_a_pull_killed_before_the_tag_moved_finishes_on_the_new_revision_only(registry, model_a, model_b, tmp_path):
    ref = f"{registry.host}/moving2/flash:stable"
    assert mm(tmp_path, "push", model_a, ref).returncode == 0
    dest = tmp_path / "pulled"
    with CountingProxy("127.0.0.1", registry.port, rate=2_000_000) as proxy:
        slow = subprocess.Popen(mm_argv("pull", f"{proxy.host}/moving2/flash:stable", "--local-dir", dest, "--workers", "1"),
                                env=env_for(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_partial(dest, slow, 256 * 1024)
        slow.send_signal(signal.SIGKILL)
        slow.wait()
        proxy.drop_connections()
    assert mm(tmp_path, "push", model_b, ref).returncode == 0
    assert mm(tmp_path, "pull", ref, "--local-dir", dest).returncode == 0
    assert tree(dest) == tree(model_b)
    assert read_manifest(manifest_path(dest)).revision == REV_B


# --- resume after kill -9 --------------------------------------------------------------------------

def _wait_for_partial(dest: Path, proc: subprocess.Popen, at_least: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if partial_bytes(dest) >= at_least:
            return
        assert proc.poll() is None, "pull finished before it could be killed"
        time.sleep(0.02)
    raise AssertionError("no partial download appeared")


def partial_bytes(dest: Path) -> int:
    """Bytes the partials hold by their range maps (a ranged partial has holes; one without a map is a prefix)."""
    done = 0
    for part in (dest / ".mm" / "partial").glob("*.part") if (dest / ".mm" / "partial").is_dir() else []:
        state = part.with_name(part.name + ".ranges")
        try:
            done += (sum(e - s for s, e in json.loads(state.read_text())["done"]) if state.exists()
                     else part.stat().st_size)
        except (OSError, ValueError):
            pass  # a map being replaced, or a partial just published
    return done


def _bytes_on_disk(dest: Path, model: Path) -> int:
    """Bytes of final files, plus the bytes each partial's range map records."""
    return sum((dest / p).stat().st_size for p in tree(model) if (dest / p).is_file()) + partial_bytes(dest)


def test_pull_killed_then_rerun_resumes_and_fetches_only_the_missing_part(registry, model_a, pushed_a, tmp_path):
    dest = tmp_path / "pulled"
    total = sum(len(b) for b in tree(model_a).values())
    with CountingProxy("127.0.0.1", registry.port, rate=3_000_000) as proxy:
        ref = pushed_a.replace(registry.host, proxy.host)
        proc = subprocess.Popen(mm_argv("pull", ref, "--local-dir", dest), env=env_for(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_partial(dest, proc, 2 * 1024 * 1024)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proxy.drop_connections()
        missing = total - _bytes_on_disk(dest, model_a)
        assert 0 < missing < total
        proxy.rate = None
        proxy.reset()
        rerun = mm(tmp_path, "pull", ref, "--local-dir", dest, "--json")
        assert rerun.returncode == 0, rerun.stderr
        assert proxy.received <= 1.25 * missing, (proxy.received, missing)
    report = json.loads(rerun.stdout)
    assert any(f["resumed_from"] > 0 for f in report["files"])
    assert tree(dest) == tree(model_a)
    assert not list((dest / ".mm" / "partial").glob("*.part"))


def test_push_killed_mid_upload_then_rerun_sends_only_what_the_registry_lacks(tmp_path):
    model = make_model(tmp_path / "m", seed=15, revision=REV_A)
    with Registry() as reg, CountingProxy("127.0.0.1", reg.port, rate=4_000_000) as proxy:
        ref = f"{proxy.host}/kill/push:t"
        proc = subprocess.Popen(mm_argv("push", model, ref, "--chunk-size", "1MiB"), env=env_for(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while proxy.sent < 4 * 1024 * 1024 and time.monotonic() < deadline:
            assert proc.poll() is None, "push finished before it could be killed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proxy.drop_connections()
        time.sleep(0.5)  # the registry finishes with what reached it
        missing = missing_bytes(reg, "kill/push", manifest_path(model))
        assert missing > 0
        proxy.rate = None
        proxy.reset()
        rerun = mm(tmp_path, "push", model, ref, "--chunk-size", "1MiB")
        assert rerun.returncode == 0, rerun.stderr
        assert proxy.sent <= 1.25 * missing, (proxy.sent, missing)
        dest = tmp_path / "pulled"
        assert mm(tmp_path, "pull", f"{reg.host}/kill/push:t", "--local-dir", dest).returncode == 0
    assert tree(dest) == tree(model)


def test_push_killed_between_chunks_resumes_from_the_registry_offset(tmp_path):
    model = make_model(tmp_path / "m", seed=16, revision=REV_A, shards=1, shard_bytes=6 * 1024 * 1024)
    state = model / ".mm" / "oci-push"
    with Registry() as reg, CountingProxy("127.0.0.1", reg.port) as proxy:
        ref = f"{proxy.host}/kill/chunks:t"
        proc = subprocess.Popen(mm_argv("push", model, ref, "--chunk-size", "1MiB", "--workers", "1"),
                                env=env_for(tmp_path, MM_TEST_OCI_CHUNK_PAUSE="3"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not list(state.rglob("*.json")) and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # during the pause after a whole chunk
        proc.wait()
        proxy.drop_connections()
        held = 1024 * 1024  # one chunk went in
        missing = missing_bytes(reg, "kill/chunks", manifest_path(model)) - held
        proxy.reset()
        rerun = mm(tmp_path, "push", model, ref, "--chunk-size", "1MiB", "--json")
        assert rerun.returncode == 0, rerun.stderr
        assert proxy.sent <= 1.25 * missing, (proxy.sent, missing)
        shard = next(b for b in json.loads(rerun.stdout)["blobs"] if b["path"] == "model-00001-of-00001.safetensors")
        assert shard["resumed_from"] == held and shard["status"] == "uploaded"
        dest = tmp_path / "pulled"
        assert mm(tmp_path, "pull", f"{reg.host}/kill/chunks:t", "--local-dir", dest).returncode == 0
    assert tree(dest) == tree(model)
    assert not state.exists()


# --- auth -------------------------------------------------------------------------------------------

def test_login_with_password_stdin_pushes_and_pulls(auth_registry, model_a, tmp_path):
    (user, password), = auth_registry.users.items()
    ref = f"{auth_registry.host}/private/flash:t"
    proc = mm(tmp_path, "push", model_a, ref, "--username", user, "--password-stdin", input=password + "\n")
    assert proc.returncode == 0, proc.stderr
    dest = tmp_path / "pulled"
    proc = mm(tmp_path, "pull", ref, "--local-dir", dest, "--username", user, "--password-stdin", input=password + "\n")
    assert proc.returncode == 0, proc.stderr
    assert tree(dest) == tree(model_a)
    assert not any(password.encode() in p.read_bytes() for p in dest.rglob("*") if p.is_file())


def test_a_successful_login_leaves_the_password_in_no_output_state_or_log(auth_registry, model_a, tmp_path):
    (user, password), = auth_registry.users.items()
    ref = f"{auth_registry.host}/private/quiet:t"
    outputs = []
    for args in (("push", model_a, ref, "--chunk-size", "1MiB"), ("pull", ref, "--local-dir", tmp_path / "d"),
                 ("inspect", ref)):
        for extra in ((), ("--json",)):
            proc = mm(tmp_path, *args, *extra, "--username", user, "--password-stdin", input=password + "\n")
            assert proc.returncode == 0, proc.stderr
            outputs.append(proc.stdout + proc.stderr)
    encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
    for text in outputs + [auth_registry.log_text()]:
        assert password not in text and encoded not in text
    for root in (model_a / ".mm", tmp_path / "d"):
        for p in root.rglob("*"):
            if p.is_file():
                assert password.encode() not in p.read_bytes() and encoded.encode() not in p.read_bytes(), p


def test_credentials_come_from_the_docker_config_or_registry_auth_file(auth_registry, model_a, tmp_path):
    (user, password), = auth_registry.users.items()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    config = tmp_path / "docker-config" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"auths": {auth_registry.host: {"auth": auth}}}))
    ref = f"{auth_registry.host}/private/flash2:t"
    assert mm(tmp_path, "push", model_a, ref).returncode == 0
    auth_file = tmp_path / "auth.json"
    auth_file.write_text(json.dumps({"auths": {f"http://{auth_registry.host}": {"username": user, "password": password}}}))
    config.unlink()
    proc = mm(tmp_path, "pull", "--list", ref, "--json", REGISTRY_AUTH_FILE=str(auth_file))
    assert proc.returncode == 0, proc.stderr
    assert password not in proc.stdout + proc.stderr


def test_wrong_or_missing_credentials_exit_4_and_no_secret_anywhere(auth_registry, model_a, tmp_path):
    (user, _), = auth_registry.users.items()
    wrong = "wrong-" + "s3cr3t-value-x9"
    ref = f"{auth_registry.host}/private/flash3:t"
    outputs = []
    for args in (("push", model_a, ref), ("pull", ref, "--local-dir", tmp_path / "d"), ("inspect", ref)):
        for extra in ((), ("--json",)):
            proc = mm(tmp_path, *args, *extra, "--username", user, "--password-stdin", input=wrong + "\n")
            assert proc.returncode == 4, proc.stderr
            assert "refused the credentials" in proc.stderr and "Traceback" not in proc.stderr
            outputs.append(proc.stdout + proc.stderr)
    anonymous = mm(tmp_path, "inspect", ref)
    assert anonymous.returncode == 4 and "wants a login" in anonymous.stderr
    auth_file = tmp_path / "auth.json"
    auth_file.write_text(json.dumps({"auths": {auth_registry.host: {"auth": base64.b64encode(f"{user}:{wrong}".encode()).decode()}}}))
    from_file = mm(tmp_path, "pull", ref, "--local-dir", tmp_path / "d2", REGISTRY_AUTH_FILE=str(auth_file))
    assert from_file.returncode == 4 and str(auth_file) in from_file.stderr
    outputs.append(from_file.stdout + from_file.stderr)
    encoded = base64.b64encode(f"{user}:{wrong}".encode()).decode()
    for text in outputs:
        assert wrong not in text and encoded not in text
    for d in (tmp_path / "d", tmp_path / "d2"):
        assert not any(wrong.encode() in p.read_bytes() for p in d.rglob("*") if p.is_file())
    assert wrong not in auth_registry.log_text()  # nor in what the registry logged of our requests


def test_bearer_token_auth_from_the_registry_challenge(model_a, tmp_path):
    from tests.support.tokenserver import TokenServer
    password = "tok-pw-" + os.urandom(6).hex()
    with TokenServer(tmp_path / "token", {"robot": password}) as ts, Registry(token=ts) as reg:
        ref = f"{reg.host}/bearer/flash:t"
        proc = mm(tmp_path, "push", model_a, ref, "--username", "robot", "--password-stdin", input=password + "\n")
        assert proc.returncode == 0, proc.stderr
        assert ts.auth_seen >= 1  # the credentials went to the token service, the registry saw only tokens
        dest = tmp_path / "pulled"
        proc = mm(tmp_path, "pull", ref, "--local-dir", dest, "--username", "robot", "--password-stdin", input=password + "\n")
        assert proc.returncode == 0, proc.stderr
        assert tree(dest) == tree(model_a)
        wrong = mm(tmp_path, "inspect", ref, "--username", "robot", "--password-stdin", input="not-" + password + "\n")
        assert wrong.returncode == 4 and "refused the credentials" in wrong.stderr
        assert password not in wrong.stdout + wrong.stderr + reg.log_text()
        anonymous = mm(tmp_path, "inspect", ref)  # a token without access: the registry still says no
        assert anonymous.returncode == 4 and "Traceback" not in anonymous.stderr


def test_https_with_ca_file_and_refused_with_the_wrong_ca(model_a, tmp_path):
    from tests.support.tokenserver import self_signed
    other_ca, _ = self_signed(tmp_path / "other", name="other")
    with Registry(tls=True) as reg:
        ref = f"{reg.host}/tls/flash:t"
        proc = mm(tmp_path, "push", model_a, ref, "--ca-file", reg.ca_path)
        assert proc.returncode == 0, proc.stderr
        dest = tmp_path / "pulled"
        assert mm(tmp_path, "pull", ref, "--local-dir", dest, "--ca-file", reg.ca_path).returncode == 0
        assert tree(dest) == tree(model_a)
        refused = mm(tmp_path, "pull", ref, "--local-dir", tmp_path / "d2", "--ca-file", other_ca)
        assert refused.returncode == 4 and f"https://{reg.host}" in refused.stderr and "Traceback" not in refused.stderr


def test_files_with_the_same_bytes_share_one_blob_and_both_arrive(registry, tmp_path):
    model = make_model(tmp_path / "m", seed=17, revision=REV_A, shard_bytes=256 * 1024)
    shutil.copyfile(model / "model-00001-of-00003.safetensors", model / "dspark" / "copy-of-shard-1.safetensors")
    (model / "dspark" / "generation_config.json").write_bytes((model / "generation_config.json").read_bytes())
    manifest_for_local_dir(model, REPO_ID, REV_A, offline=True)
    ref = f"{registry.host}/dupes/model:t"
    pushed = json.loads(mm(tmp_path, "push", model, ref, "--json").stdout)
    assert len({b["digest"] for b in pushed["blobs"]}) == len(pushed["blobs"])  # each blob sent once
    dest = tmp_path / "pulled"
    proc = mm(tmp_path, "pull", ref, "--local-dir", dest, "--workers", "8")
    assert proc.returncode == 0, proc.stderr
    assert tree(dest) == tree(model)


def test_max_blob_size_refuses_before_anything_is_sent(registry, model_a, tmp_path):
    proc = mm(tmp_path, "push", model_a, f"{registry.host}/limits/flash:t", "--max-blob-size", "1M")
    assert proc.returncode == 7
    assert "--max-blob-size" in proc.stderr and "model-00001-of-00003.safetensors" in proc.stderr
    with pytest.raises(urllib.error.HTTPError):
        registry_manifest(registry, "limits/flash", "t")
    assert mm(tmp_path, "push", model_a, f"{registry.host}/limits/flash:t", "--password-stdin", input="x\n").returncode == 2


def test_an_artifact_without_mm_manifest_is_listed_but_not_pulled(registry, tmp_path):
    """A ModelPack artifact another tool pushed: mm shows it, and refuses to pull it (no blake3 to prove files by)."""
    weights, config = b"\x00" * 1000, b'{"descriptor":{"name":"x"},"config":{},"modelfs":{"type":"layers","diffIds":[]}}'
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "artifactType": modelpack.ARTIFACT_TYPE,
                "config": {"mediaType": modelpack.CONFIG, "digest": put_blob(registry, "other/tool", config),
                           "size": len(config)},
                "layers": [{"mediaType": modelpack.WEIGHT, "digest": put_blob(registry, "other/tool", weights),
                            "size": len(weights),
                            "annotations": {modelpack.FILEPATH: "model.safetensors"}}]}
    put_manifest(registry, "other/tool", "v1", manifest)
    listing = mm(tmp_path, "inspect", f"{registry.host}/other/tool:v1", "--json")
    assert listing.returncode == 0 and json.loads(listing.stdout)["mm_manifest"] is False
    proc = mm(tmp_path, "pull", f"{registry.host}/other/tool:v1", "--local-dir", tmp_path / "d")
    assert proc.returncode == 3 and "no mm manifest layer" in proc.stderr


def test_a_second_pull_into_a_directory_being_pulled_is_refused(registry, pushed_a, tmp_path):
    from mm.artifacts.edges.fsutil import dir_lock
    dest = tmp_path / "pulled"
    with dir_lock(dest, "mm pull"):  # as a running pull holds it
        proc = mm(tmp_path, "pull", pushed_a, "--local-dir", dest)
    assert proc.returncode == 6 and str(dest) in proc.stderr


def test_not_enough_disk_is_refused_before_downloading(registry, pushed_a, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with CountingProxy("127.0.0.1", registry.port) as proxy:
            proc = mm(tmp_path, "pull", pushed_a.replace(registry.host, proxy.host), "--local-dir", small / "m")
            assert proc.returncode == 7, proc.stderr
            assert "not enough free disk" in proc.stderr and str(small / "m") in proc.stderr
            assert proxy.received < 256 * 1024  # the manifests only, no file
        assert not [p for p in (small / "m").rglob("*") if p.is_file() and ".mm" not in p.parts]
    finally:
        subprocess.run(["umount", str(small)])


# --- signed models -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pushed_signed(registry, model_a, keys, tmp_path_factory) -> str:
    """Model A signed by alice, pushed to <registry>/minimax/signed."""
    work = tmp_path_factory.mktemp("push-signed")
    src = work / "model"
    shutil.copytree(model_a, src)
    assert mm(work, "sign", src, "--key", keys["alice"]).returncode == 0
    proc = mm(work, "push", src, f"{registry.host}/minimax/signed", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["reference"]


def test_push_of_a_signed_model_carries_the_signature_layer_and_inspect_says_signed(registry, pushed_signed,
                                                                                    pushed_a, tmp_path):
    doc = registry_manifest(registry, "minimax/signed", REV_A[:12])
    sig = [layer for layer in doc["layers"] if layer["mediaType"] == modelpack.MM_SIGNATURE]
    assert len(sig) == 1 and sig[0]["annotations"]["org.cncf.model.filepath"] == ".mm/manifest.json.sig"
    assert registry_blob(registry, "minimax/signed", sig[0]["digest"]).startswith(b"-----BEGIN SSH SIGNATURE-----")
    assert json.loads(mm(tmp_path, "inspect", pushed_signed, "--json").stdout)["signed"] is True
    assert json.loads(mm(tmp_path, "inspect", pushed_a, "--json").stdout)["signed"] is False


def test_pull_require_signature_checks_the_signer_before_writing(pushed_signed, model_a, keys, tmp_path):
    dest = tmp_path / "dest"
    r = mm(tmp_path, "pull", pushed_signed, "--local-dir", dest, "--require-signature",
           "--allowed-signers", keys["allowed"])
    assert r.returncode == 0, r.stderr
    assert "signature: good, signed by alice@example.com (ssh-ed25519 key SHA256:" in r.stdout
    assert tree(dest) == tree(model_a)


def test_pull_require_signature_refuses_an_unsigned_artifact_before_writing(pushed_a, keys, tmp_path):
    dest = tmp_path / "dest"
    r = mm(tmp_path, "pull", pushed_a, "--local-dir", dest, "--require-signature", "--allowed-signers", keys["allowed"])
    assert r.returncode == 5 and "not signed" in r.stderr
    assert not dest.exists()


def test_pull_refuses_a_signer_not_in_allowed_signers_before_writing(registry, model_a, keys, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(model_a, src)
    assert mm(tmp_path, "sign", src, "--key", keys["mallory"]).returncode == 0
    ref = json.loads(mm(tmp_path, "push", src, f"{registry.host}/minimax/mallory", "--json").stdout)["reference"]
    dest = tmp_path / "dest"
    r = mm(tmp_path, "pull", ref, "--local-dir", dest, "--require-signature", "--allowed-signers", keys["allowed"])
    assert r.returncode == 5 and "does not allow" in r.stderr
    assert not dest.exists()
