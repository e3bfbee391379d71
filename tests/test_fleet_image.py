"""The engine image to the nodes through the registry tiers: `mm image push` puts the bundle's archive into the site
registry by digest, `mm fleet config` writes the tiers' distribution configs and the nodes' containerd/docker
configuration, and a real containerd pulls the image through the nearest tier (Debian docker-registry 2.8 as origin
-> T1 -> T2, started from mm's configs; containerd on a private socket)."""
from __future__ import annotations

import json
import subprocess
import tomllib

import pytest
import yaml

from mm.artifacts.serving import image as mm_image
from tests.support.containerd import Containerd
from tests.support.countproxy import CountingProxy
from tests.support.oci_image import containerd_save_archive
from tests.support.registry import Registry, free_port
from tests.support.tiers import Tier, serve_until_exit

AMD64 = "linux/amd64"


def _saved(pinned_image, tmp_path, fmt: str):
    out = tmp_path / ("sglang.oci.tar" if fmt == "oci-archive" else "sglang.tar")
    mm_image.save_image(pinned_image.ref, out, AMD64, fmt, tls_verify=False)
    return out


def _pinned_index_archive(pinned_image, tmp_path):
    """What a containerd-store `docker save REPO@<pinned index>` writes, with the record `mm bundle --image` adds."""
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "sglang-index.tar")
    proof = mm_image.prove_archive(archive, pinned_image.ref, tls_verify=False)
    mm_image.write_record_for(archive, proof)
    return archive


def _served(reg, repo_digest: str) -> dict:
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{reg.host}/{repo_digest}"],
                         capture_output=True, check=True, timeout=60).stdout
    assert mm_image.sha256_digest(raw) == repo_digest.split("@")[1]
    return json.loads(raw)


# --- mm image push -----------------------------------------------------------------------------------------

def test_push_the_pinned_index_itself(pinned_image, run_mm, tmp_path):
    archive = _pinned_index_archive(pinned_image, tmp_path)
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, site.host, "--reference", pinned_image.ref, "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        index = pinned_image.image.index_digest
        assert doc["kind"] == "pinned" and doc["pushed"] == f"{site.host}/lmsysorg/sglang@{index}"
        assert doc["served"]["config"] == pinned_image.image.platforms[AMD64].config
        assert {m["digest"] for m in _served(site, f"lmsysorg/sglang@{index}")["manifests"]} == \
            {p.manifest for p in pinned_image.image.platforms.values()}


def test_push_an_oci_archive_by_the_pinned_chains_platform_manifest(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    want = pinned_image.image.platforms[AMD64]
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, site.host, "--reference", pinned_image.ref)
        assert proc.returncode == 0, proc.stderr
        assert f"pushed    {site.host}/lmsysorg/sglang@{want.manifest}  (TLS off (loopback); credentials: none)" \
            in proc.stdout
        assert f"the pinned chain's {AMD64} manifest" in proc.stdout
        assert _served(site, f"lmsysorg/sglang@{want.manifest}")["config"]["digest"] == want.config


def test_push_a_docker_archive_names_the_new_digest_whose_config_is_the_pinned_image_id(pinned_image, run_mm,
                                                                                         tmp_path):
    archive = _saved(pinned_image, tmp_path, "docker-archive")
    want = pinned_image.image.platforms[AMD64]
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, f"{site.host}/site/sglang", "--reference", pinned_image.ref, "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["kind"] == "rebuilt" and doc["pushed"] == f"{site.host}/site/sglang@{doc['digest']}"
        assert doc["digest"] != want.manifest  # a docker-archive holds no registry manifest: skopeo wrote a new one
        assert _served(site, f"site/sglang@{doc['digest']}")["config"]["digest"] == want.config


def test_push_refuses_an_archive_changed_since_its_record(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    with open(archive, "ab") as f:
        f.write(b"\0" * 1024)  # still a readable tar, another file
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, site.host, "--reference", pinned_image.ref)
        assert proc.returncode == 5
        assert "the archive changed since it was saved" in proc.stderr and len(proc.stderr.splitlines()) == 1
        assert not (site.storage / "docker").exists()  # nothing reached the registry


def test_push_refuses_an_archive_recorded_for_another_pin(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    other = pinned_image.ref.split("@")[0] + "@sha256:" + "ab" * 32
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, site.host, "--reference", other)
    assert proc.returncode == 7
    assert f"records {pinned_image.ref}, not the pinned {other}" in proc.stderr


def test_push_needs_the_record_beside_the_archive(pinned_image, run_mm, tmp_path):
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "bare.tar")
    proc = run_mm("image", "push", archive, "127.0.0.1:1", "--reference", pinned_image.ref)
    assert proc.returncode == 3
    assert "no record bare.tar.mm-image.json beside it" in proc.stderr


def test_push_with_credentials_from_stdin_never_shows_them(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    password = "pw-not-for-logs-7f3a"
    with Registry(tmp_path / "site", users={"site-ci": password}) as site:
        denied = run_mm("image", "push", archive, site.host, "--reference", pinned_image.ref,
                        "--username", "site-ci", "--password-stdin", input="wrong-" + password + "\n")
        proc = run_mm("image", "push", archive, site.host, "--reference", pinned_image.ref,
                      "--username", "site-ci", "--password-stdin", input=password + "\n")
    assert denied.returncode == 4, denied.stderr
    assert password not in denied.stderr + denied.stdout
    assert proc.returncode == 0, proc.stderr
    assert "credentials: --username/--password-stdin" in proc.stdout and password not in proc.stdout + proc.stderr


def test_a_site_reference_with_credentials_is_refused_without_echoing_them(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    proc = run_mm("image", "push", archive, "ci:hunter2@127.0.0.1:5000", "--reference", pinned_image.ref)
    assert proc.returncode == 3
    assert "without a scheme or credentials" in proc.stderr and "hunter2" not in proc.stderr


# --- mm fleet config ---------------------------------------------------------------------------------------

def _fleet_config(run_mm, tmp_path, origin: str, *tiers: str):
    out = tmp_path / "fleet"
    args = ["fleet", "config", "--origin", origin, "--out", out, "--storage-root", tmp_path / "storage"]
    for tier in tiers:
        args += ["--tier", tier]
    proc = run_mm(*args)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_fleet_config_writes_the_chain_nearest_tier_as_the_nodes_mirror(run_mm, tmp_path):
    out, proc = _fleet_config(run_mm, tmp_path, "http://10.0.0.1:5000", "http://10.0.1.1:5000", "http://10.0.2.1:5000")
    t1 = yaml.safe_load((out / "registry/t1/config.yml").read_text())
    t2 = yaml.safe_load((out / "registry/t2/config.yml").read_text())
    origin = yaml.safe_load((out / "registry/origin/config.yml").read_text())
    assert "proxy" not in origin and origin["http"]["addr"] == "10.0.0.1:5000"
    assert t1["proxy"] == {"remoteurl": "http://10.0.0.1:5000", "ttl": "168h"}
    assert t2["proxy"]["remoteurl"] == "http://10.0.1.1:5000" and t2["http"]["addr"] == "10.0.2.1:5000"
    assert t2["storage"]["filesystem"]["rootdirectory"] == f"{tmp_path}/storage/t2"
    hosts = tomllib.loads((out / "containerd/certs.d/10.0.0.1:5000/hosts.toml").read_text())
    assert hosts == {"server": "http://10.0.0.1:5000",
                     "host": {"http://10.0.2.1:5000": {"capabilities": ["pull", "resolve"]}}}
    hub = tomllib.loads((out / "containerd/certs.d/docker.io/hosts.toml").read_text())  # the pin names Docker Hub
    assert hub["server"] == "https://registry-1.docker.io" and list(hub["host"]) == ["http://10.0.2.1:5000"]
    assert json.loads((out / "docker/daemon.json").read_text())["registry-mirrors"] == ["http://10.0.2.1:5000"]
    snippet = tomllib.loads((out / "containerd/config-snippet.toml").read_text())
    assert snippet["plugins"]["io.containerd.grpc.v1.cri"]["registry"]["config_path"] == "/etc/containerd/certs.d"
    order = (out / "START-ORDER.txt").read_text()
    assert order.index("1. origin") < order.index("2. t1") < order.index("3. t2")
    assert "docker uses registry-mirrors only for Docker Hub references" in proc.stdout
    for path in out.rglob("*.yml"):  # every value names its source
        for line in path.read_text().splitlines():
            if ": " in line and not line.rstrip().endswith(":") and not line.startswith("#"):
                assert "#" in line, f"{path.name}: {line!r} names no source"


@pytest.mark.parametrize("bad", ["http://10.0.1.1:5000/v2", "ftp://10.0.1.1", "http://u:p@10.0.1.1:5000"])
def test_fleet_config_refuses_a_tier_that_is_not_a_registry_root(run_mm, tmp_path, bad):
    proc = run_mm("fleet", "config", "--origin", "http://10.0.0.1:5000", "--tier", bad, "--out", tmp_path / "f")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert ":p@" not in proc.stderr
    assert not (tmp_path / "f").exists()


def test_the_tiers_start_from_the_emitted_configs_origin_first(run_mm, tmp_path):
    origin_url, t1_url, t2_url = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    out, _ = _fleet_config(run_mm, tmp_path, origin_url, t1_url, t2_url)
    early = serve_until_exit(out / "registry/t1/config.yml")  # its upstream is not up yet: 2.8 exits
    assert "connection refused" in early
    with Tier(out / "registry/origin/config.yml"), Tier(out / "registry/t1/config.yml"), \
            Tier(out / "registry/t2/config.yml") as t2:
        assert t2.url == t2_url


# --- the image through the tiers to containerd ------------------------------------------------------------

@pytest.mark.parametrize("named", ["site", "hub"])
def test_containerd_pulls_the_pushed_image_through_t2_by_the_pinned_digest(pinned_image, run_mm, tmp_path, named):
    """NAMED: the reference names the site registry, or Docker Hub as the pin does (its own hosts.toml)."""
    archive = _pinned_index_archive(pinned_image, tmp_path)
    index = pinned_image.image.index_digest
    amd64 = pinned_image.image.platforms[AMD64]
    origin_port, t1_port, t2_port = free_port(), free_port(), free_port()
    with CountingProxy("127.0.0.1", t2_port) as t2_front:  # the nodes' side of T2, counting what it serves
        out, _ = _fleet_config(run_mm, tmp_path, f"http://127.0.0.1:{origin_port}", f"http://127.0.0.1:{t1_port}",
                               f"http://{t2_front.host}")
        hosts_dir = out / "containerd/certs.d"
        with Tier(out / "registry/origin/config.yml") as origin, Tier(out / "registry/t1/config.yml") as t1, \
                Tier(out / "registry/t2/config.yml", addr=f"127.0.0.1:{t2_port}") as t2, \
                Containerd(tmp_path / "containerd", hosts_dir) as node:
            pushed = run_mm("image", "push", archive, origin.addr, "--reference", pinned_image.ref)
            assert pushed.returncode == 0, pushed.stderr
            ref = f"{origin.addr if named == 'site' else 'docker.io'}/lmsysorg/sglang@{index}"
            pulled = node.ctr("images", "pull", "--hosts-dir", str(hosts_dir), "--plain-http", ref)
            assert pulled.returncode == 0, pulled.stderr + node.log_path.read_text()[-2000:]
            [line] = [x for x in node.ctr("images", "ls").stdout.splitlines() if x.startswith(ref)]
            assert line.split()[2] == index  # arrived as the pinned digest
            content = node.ctr("content", "ls").stdout
            assert amd64.config in content and amd64.layers[0] in content  # the pinned image ID and its layer
            layer_size = (pinned_image.image.layout / "blobs/sha256" / amd64.layers[0][7:]).stat().st_size
            assert t2_front.received >= layer_size
            assert f"GET /v2/lmsysorg/sglang/blobs/{amd64.layers[0]}" in t2.log_text()  # T2 served it ...
            assert f"GET /v2/lmsysorg/sglang/blobs/{amd64.layers[0]}" in t1.log_text()  # ... through T1


def test_docker_pulls_the_pins_docker_hub_reference_through_the_emitted_registry_mirrors(pinned_image, run_mm,
                                                                                         tmp_path):
    from tests.support.dockerd import Dockerd

    archive = _pinned_index_archive(pinned_image, tmp_path)
    index = pinned_image.image.index_digest
    origin_url, t1_url, t2_url = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    out, _ = _fleet_config(run_mm, tmp_path, origin_url, t1_url, t2_url)
    with Tier(out / "registry/origin/config.yml") as origin, Tier(out / "registry/t1/config.yml"), \
            Tier(out / "registry/t2/config.yml") as t2, \
            Dockerd(tmp_path / "dockerd", config_file=out / "docker/daemon.json") as node:
        assert run_mm("image", "push", archive, origin.addr, "--reference", pinned_image.ref).returncode == 0
        hub_ref = f"lmsysorg/sglang@{index}"  # as the pin names it: Docker Hub, which docker mirrors
        pulled = node.docker("pull", hub_ref)
        assert pulled.returncode == 0, pulled.stderr
        image_id = node.docker("image", "inspect", "--format", "{{.Id}}", hub_ref).stdout.strip()
        assert image_id == pinned_image.image.platforms[AMD64].config
        assert f"GET /v2/lmsysorg/sglang/manifests/{index}" in t2.log_text()


def test_push_takes_the_pins_docker_hub_name_for_an_archive_saved_from_a_mirror(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")  # saved from 127.0.0.1:P/lmsysorg/sglang
    hub_pin = f"lmsysorg/sglang@{pinned_image.image.index_digest}"  # the pin's own spelling
    with Registry(tmp_path / "site") as site:
        proc = run_mm("image", "push", archive, site.host, "--reference", hub_pin)
    assert proc.returncode == 0, proc.stderr


def test_fleet_config_never_writes_through_a_link_planted_in_its_directory(run_mm, tmp_path):
    (tmp_path / "fleet").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "fleet" / "registry").symlink_to(tmp_path / "elsewhere")
    proc = run_mm("fleet", "config", "--origin", "http://10.0.0.1:5000", "--tier", "http://10.0.1.1:5000",
                  "--out", tmp_path / "fleet")
    assert proc.returncode == 3 and "is a symlink" in proc.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_push_the_archive_mm_unbundle_restored(pinned_image, run_mm, tmp_path):
    from tests.test_launch import make_model_dir

    model = make_model_dir(tmp_path / "models")
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "sglang.tar")
    bundled = run_mm("bundle", model, "--out", tmp_path / "disk", "--volume-size", "2M", "--image", archive,
                     "--image-ref", pinned_image.ref, "--insecure-registry", "--no-mm")
    assert bundled.returncode == 0, bundled.stderr
    dest = tmp_path / "site" / "model"
    restored = run_mm("unbundle", tmp_path / "disk", "--dest", dest)
    assert restored.returncode == 0, restored.stderr
    carried = dest.with_name("model.payload") / "image" / "sglang.tar"
    with Registry(tmp_path / "site-registry") as site:
        proc = run_mm("image", "push", carried, site.host, "--reference", pinned_image.ref, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pushed"] == f"{site.host}/lmsysorg/sglang@{pinned_image.image.index_digest}"


def test_push_refuses_a_malformed_record_in_one_line(pinned_image, run_mm, tmp_path):
    archive = _saved(pinned_image, tmp_path, "oci-archive")
    record = mm_image.record_path(archive)
    doc = json.loads(record.read_text())
    doc["layers"] = [{"digest": "sha256:" + "0" * 64, "size": "12", "media_type": "x"}]  # a size that is a string
    record.write_text(json.dumps(doc))
    proc = run_mm("image", "push", archive, "127.0.0.1:1", "--reference", pinned_image.ref)
    assert proc.returncode == 3 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"mm: {record}: not an mm image record")


def test_fleet_config_refuses_a_ttl_distribution_cannot_read(run_mm, tmp_path):
    proc = run_mm("fleet", "config", "--origin", "http://10.0.0.1:5000", "--tier", "http://10.0.1.1:5000",
                  "--ttl", "7d", "--out", tmp_path / "f")
    assert proc.returncode == 2 and "a Go duration" in proc.stderr
    assert not (tmp_path / "f").exists()
