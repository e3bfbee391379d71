"""Everything the air-gapped host needs crosses with the bundle, end to end.

Connected side: `mm fetch` of the demo model from the local Hub, `mm image save` from the real docker-registry on
127.0.0.1, `mm bundle` (mm's wheelhouse for this host built from the package index pip is configured for, the image
proven against the pinned reference). Air-gapped side: inside `unshare -n` (a network namespace with nothing but
loopback), a bare python3 and stand-in nvidia-smi/docker: install-mm.sh from the first disk alone, `mm bundle
verify`, `mm unbundle`, the payload's `docker load` step, `mm doctor`, `mm launch` and the script's image check.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from mm.artifacts.serving import image as mm_image
from mm.artifacts.bundle import wheelhouse
from mm.artifacts.bundle.wheelhouse import Platform
from tests.support import fake_docker, fake_gpu
from tests.support.oci_image import containerd_save_archive
from tests.support.registry import free_port
from tests.support.run import run_mm
from tests.test_launch import make_model_dir

WITH_MM = {"MM_BUNDLE_NO_MM": "0"}  # the suite bundles without mm unless a test asks (conftest)
HOST = wheelhouse.host_target()


def volumes(out: Path) -> list[Path]:
    return sorted(out.glob("*.vol*-of-*.tar"))


def members(vol: Path) -> list[str]:
    with tarfile.open(vol) as tf:
        return tf.getnames()


@dataclass
class Connected:
    """What the connected host produced: the fetched model, the saved image, the bundle volumes."""

    model: Path
    archive: Path
    out: Path
    too_small: subprocess.CompletedProcess
    minimum: str
    bundled: subprocess.CompletedProcess
    image_ref: str
    image_id: str


@pytest.fixture(scope="module")
def connected(tmp_path_factory, _hub_server_session, model_repo, pinned_image) -> Connected:
    from tests.conftest import _isolated_env

    base = tmp_path_factory.mktemp("connected")
    hub = dict(_isolated_env(base), HF_ENDPOINT=_hub_server_session.url)
    model = base / "models" / "MiniMax-M3.1-Flash"
    fetched = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", model, env=hub,
                     timeout=300)
    assert fetched.returncode == 0, fetched.stderr
    archive = base / "sglang.tar"
    saved = run_mm("image", "save", pinned_image.ref, "--platform", "linux/amd64", "--out", archive,
                   "--insecure-registry", timeout=300)
    assert saved.returncode == 0, saved.stderr
    out = base / "volumes"
    bundle = ("bundle", model, "--out", out, "--image", archive, "--image-ref", pinned_image.ref, "--insecure-registry")
    too_small = run_mm(*bundle, "--volume-size", "5M", extra_env=WITH_MM, timeout=900)
    minimum = re.search(r"use --volume-size (\d+M) or more", too_small.stderr)
    assert minimum, too_small.stderr
    bundled = run_mm(*bundle, "--volume-size", minimum.group(1), "--json", extra_env=WITH_MM, timeout=900)
    assert bundled.returncode == 0, bundled.stderr
    return Connected(model, archive, out, too_small, minimum.group(1), bundled, pinned_image.ref,
                     pinned_image.image.platforms["linux/amd64"].config)


# --- the bundle carries mm ----------------------------------------------------------------------------

def test_a_volume_too_small_for_mm_is_refused_naming_the_minimum(connected):
    assert connected.too_small.returncode == 3
    assert "too small to carry mm whole in volume 1" in connected.too_small.stderr


def test_the_bundle_says_which_hosts_mm_will_install_on_before_writing(connected):
    assert "mm will install on: linux/amd64 CPython 3.10, 3.11, 3.12, 3.13 (--target-platform" in \
        connected.too_small.stderr
    assert "mm will install on" not in connected.bundled.stdout  # --json: the sets are in the document


def test_mm_travels_whole_in_volume_1_with_the_installer_beside_the_volumes(connected, tmp_path):
    doc = json.loads(connected.bundled.stdout)
    assert doc["mm"]["sets"] == [t.name for t in wheelhouse.targets_for()]
    assert doc["mm"]["install"] == "sh install-mm.sh [DIR]"
    vols = volumes(connected.out)
    assert len(vols) >= 2  # the minimum holds mm; the model spills over to the next disk
    first = members(vols[0])
    with tarfile.open(vols[0]) as tf:
        (tmp_path / "wheelhouse.json").write_bytes(tf.extractfile("payload/mm/wheelhouse/wheelhouse.json").read())
    house = wheelhouse.read_index(tmp_path)
    wheels = [f"payload/mm/wheelhouse/wheels/{w['file']}" for s in house["sets"] for w in s["wheels"]]
    assert "payload/mm/install-mm.sh" in first and set(wheels) <= set(first)
    assert not any(m.startswith("segments/payload/mm/") for v in vols for m in members(v))  # never split
    assert (connected.out / "install-mm.sh").read_bytes() == wheelhouse.install_script_text().encode()


def test_bundle_leaves_nothing_of_its_own_on_the_disks_and_keeps_the_wheelhouse_in_the_xdg_cache(connected):
    assert sorted(p.name for p in connected.out.iterdir()) == sorted([v.name for v in volumes(connected.out)]
                                                                      + ["install-mm.sh"])
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "mm" / "wheelhouse"
    assert (cache / "sets" / HOST.name / "requirements.lock").is_file()  # a rerun downloads nothing
    assert not list(cache.glob("build-*"))  # this run's build is removed after it


def test_restore_txt_and_bundle_verify_name_install_mm_sh(connected):
    with tarfile.open(volumes(connected.out)[0]) as tf:
        restore = tf.extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    assert "sh install-mm.sh beside the volumes" in restore
    checked = run_mm("bundle", "verify", connected.out)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "install: mm " in checked.stdout and "sh install-mm.sh [DIR] where the volumes lie" in checked.stdout


@pytest.mark.parametrize("python,covered", [("3.12", True), ("3.9", False)])
def test_bundle_verify_says_whether_this_hosts_python3_is_covered_before_anything_is_installed(connected, python,
                                                                                                covered):
    interpreter = other_cpython(python)
    if interpreter is None:
        pytest.skip(f"no CPython {python} here")
    checked = run_mm("bundle", "verify", connected.out, extra_env={"PYTHON": interpreter})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if covered:
        assert f"this host is covered: {interpreter} is CPython {python} on {HOST.machine}, set " \
               f"linux-{HOST.machine}-cp{python.replace('.', '')}" in checked.stdout
    else:
        assert f"this host is NOT covered: {interpreter} is CPython {python}, older than mm supports (3.10 or " \
               f"newer); install a newer CPython the bundle holds a set for (linux-x86_64-cp310" in checked.stdout
    doc = json.loads(run_mm("bundle", "verify", connected.out, "--json", extra_env={"PYTHON": interpreter}).stdout)
    assert ("is covered" if covered else "NOT covered") in doc["mm_host"]


def test_the_image_is_proven_against_the_pinned_reference_and_its_record_travels(connected):
    doc = json.loads(connected.bundled.stdout)
    assert doc["image"]["proven"] is True and doc["image"]["pinned"] == connected.image_ref
    assert doc["image"]["image_id"] == connected.image_id and doc["image"]["record"] == "sglang.tar.mm-image.json"
    assert "payload/image/sglang.tar.mm-image.json" in [m for v in volumes(connected.out) for m in members(v)]


def test_bundle_verify_names_a_damaged_wheel_in_volume_1(connected, tmp_path):
    first = volumes(connected.out)[0]
    copy = tmp_path / first.name
    shutil.copy(first, copy)
    with tarfile.open(copy) as tf:
        wheel = next(m for m in tf.getmembers() if m.name.startswith("payload/mm/wheelhouse/") and m.name.endswith(".whl"))
    with open(copy, "r+b") as f:  # one byte inside the wheel's data
        f.seek(wheel.offset_data + wheel.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run_mm("bundle", "verify", copy)
    assert r.returncode == 1
    assert f"CORRUPT  {copy}" in r.stdout and f"member {wheel.name!r}: blake3 mismatch" in r.stdout


def test_bundle_resolves_the_chain_itself_for_an_archive_without_a_record_and_carries_one(pinned_image, tmp_path):
    model = make_model_dir(tmp_path / "models")
    archive = containerd_save_archive(pinned_image.image, pinned_image.repo, tmp_path / "sglang.tar")  # no record
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "2M", "--image", archive,
               "--image-ref", pinned_image.ref, "--insecure-registry", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["image"]["proven"] is True
    record = mm_image.read_record(mm_image.record_path(archive))  # written from the registry's chain
    assert record.chain.reference == pinned_image.ref and record.format == "oci-archive"
    assert record.chain.config in {p.config for p in pinned_image.image.platforms.values()}
    assert "payload/image/sglang.tar.mm-image.json" in [m for v in volumes(tmp_path / "v") for m in members(v)]


def test_bundle_proves_the_image_offline_from_its_mm_image_save_record(pinned_image, tmp_path, unused_port):
    model = make_model_dir(tmp_path / "models")
    archive = tmp_path / "sglang.tar"
    mm_image.save_image(pinned_image.ref, archive, "linux/amd64", tls_verify=False)
    offline_ref = pinned_image.ref.replace(pinned_image.registry.host, f"127.0.0.1:{unused_port}")
    record = json.loads(mm_image.record_path(archive).read_text())
    record["reference"] = offline_ref  # the same pin, its registry now out of reach
    mm_image.record_path(archive).write_text(json.dumps(record))
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "2M", "--image", archive,
               "--image-ref", offline_ref, "--insecure-registry", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["image"]
    assert doc["proven"] is True and doc["image_id"] == pinned_image.image.platforms["linux/amd64"].config
    mm_image.record_path(archive).unlink()
    r = run_mm("bundle", model, "--out", tmp_path / "w", "--volume-size", "2M", "--image", archive,
               "--image-ref", offline_ref, "--insecure-registry")
    assert r.returncode == 3 and "no record sglang.tar.mm-image.json beside it" in r.stderr


def test_no_mm_leaves_mm_out(tmp_path):
    model = make_model_dir(tmp_path / "models")
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "2M", "--no-mm", "--json",
               extra_env=WITH_MM)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mm"] is None
    assert not (tmp_path / "v" / "install-mm.sh").exists() and not (tmp_path / "v" / ".mm-wheelhouse").exists()
    assert not any(m.startswith("payload/mm/") for v in volumes(tmp_path / "v") for m in members(v))


def test_only_mm_refuses_a_model_directory(tmp_path):
    r = run_mm("bundle", tmp_path, "--only-mm", "--out", tmp_path / "tools")
    assert r.returncode == 3 and "--only-mm writes only install-mm.sh and wheelhouse/" in r.stderr


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """`mm bundle --only-mm` for amd64 and arm64 x CPython 3.10 and 3.12 (neither is the Python running pip)."""
    out = tmp_path_factory.mktemp("tools")
    r = run_mm("bundle", "--only-mm", "--out", out, "--target-platform", "linux/amd64", "--target-platform",
               "linux/arm64", "--target-python", "3.10", "--target-python", "3.12", timeout=900)
    assert r.returncode == 0, r.stderr
    return out


def test_only_mm_writes_one_locked_set_per_platform_and_python(tools):
    doc = wheelhouse.read_index(tools / "wheelhouse")
    assert [s["name"] for s in doc["sets"]] == ["linux-x86_64-cp310", "linux-x86_64-cp312", "linux-aarch64-cp310",
                                                "linux-aarch64-cp312"]
    assert wheelhouse.check_wheelhouse(tools / "wheelhouse") == [] and (tools / "install-mm.sh").is_file()
    blake3 = {s["name"]: next(w["file"] for w in s["wheels"] if w["name"] == "blake3") for s in doc["sets"]}
    assert "cp310-cp310" in blake3["linux-aarch64-cp310"] and "cp312-cp312" in blake3["linux-aarch64-cp312"]
    assert "aarch64" in blake3["linux-aarch64-cp310"] and "x86_64" in blake3["linux-x86_64-cp310"]


@pytest.mark.parametrize("python", ["3.10", "3.12"])
def test_every_aarch64_wheel_fits_an_aarch64_cpython_of_that_version(tools, python):
    target = Platform("aarch64", python)
    assert wheelhouse.misfits(wheelhouse.set_wheels(tools / "wheelhouse", target.name), target) == []


def test_each_set_meets_its_own_pythons_markers_not_the_one_pip_ran_on(tools):
    """pip download evaluates markers for the Python running it; anyio needs exceptiongroup below 3.11 only."""
    for name, python in (("linux-aarch64-cp310", "3.10"), ("linux-aarch64-cp312", "3.12")):
        target = Platform("aarch64", python)
        assert wheelhouse.unmet_requirements(target, wheelhouse.set_wheels(tools / "wheelhouse", name))[0] == []
    names = {s["name"]: {w["name"] for w in s["wheels"]} for s in wheelhouse.read_index(tools / "wheelhouse")["sets"]}
    assert "exceptiongroup" in names["linux-aarch64-cp310"] and "exceptiongroup" not in names["linux-aarch64-cp312"]


def other_cpython(version: str) -> str | None:
    """A CPython VERSION that runs (pyenv's own, or one on PATH that is not a pyenv shim)."""
    pyenv = sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob(f"{version}.*/bin/python{version}"))
    for candidate in [str(p) for p in pyenv] + [shutil.which(f"python{version}") or ""]:
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.mark.parametrize("python", ["3.10", "3.12"])
def test_install_into_another_cpython_from_its_own_set(tools, python, tmp_path):
    interpreter = other_cpython(python)
    if interpreter is None or HOST.machine != "x86_64":
        pytest.skip(f"no CPython {python} on this x86_64 host to install into")
    done = subprocess.run(["sh", str(tools / "install-mm.sh"), str(tmp_path / "venv")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": interpreter,
                               "MM_INSTALL_WITH": "uv"})
    assert done.returncode == 0, done.stderr
    assert f"(linux-x86_64-cp{python.replace('.', '')}, with uv, offline)" in done.stdout
    assert subprocess.run([str(tmp_path / "venv" / "bin" / "mm"), "--version"], capture_output=True).returncode == 0


@pytest.mark.parametrize("python", ["3.10", "3.12", "3.13"])
def test_a_bundle_made_with_the_defaults_installs_mm_offline_into_another_cpython(connected, python, tmp_path):
    """The air-gapped host's python3 is rarely the connected host's: a default bundle made here installs mm, with
    no network (`unshare -n`), into each CPython a GPU server is likely to run, from volume 1 beside the script."""
    interpreter, prefix = other_cpython(python), unshare_prefix()
    if interpreter is None or prefix is None or HOST.machine != "x86_64":
        pytest.skip(f"no CPython {python} on this x86_64 host to install into, or no unshare -n")
    done = subprocess.run([*prefix, "sh", str(connected.out / "install-mm.sh"), str(tmp_path / "venv")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": interpreter})
    assert done.returncode == 0, done.stderr
    assert f"(linux-x86_64-cp{python.replace('.', '')}, with pip, offline)" in done.stdout
    venv_python = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                                  "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    assert venv_python.stdout.strip() == python
    assert subprocess.run([str(tmp_path / "venv" / "bin" / "mm"), "--version"], capture_output=True).returncode == 0


# --- the image by identity in the bundle ----------------------------------------------------------------

def test_bundle_refuses_an_image_that_is_not_the_pinned_one(pinned_image, other_image, tmp_path):
    model = make_model_dir(tmp_path / "models")
    wrong = containerd_save_archive(other_image, pinned_image.repo, tmp_path / "sglang.tar")
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "2M", "--image", wrong,
               "--image-ref", pinned_image.ref, "--insecure-registry")
    assert r.returncode == 7
    assert f"but {pinned_image.ref} for linux/amd64 is {pinned_image.image.platforms['linux/amd64'].config}" in r.stderr
    assert not volumes(tmp_path / "v")


def test_allow_other_image_carries_it_and_the_bundle_and_start_script_say_so(pinned_image, other_image, tmp_path):
    model = make_model_dir(tmp_path / "models")
    wrong = containerd_save_archive(other_image, pinned_image.repo, tmp_path / "sglang.tar")
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "2M", "--image", wrong,
               "--image-ref", pinned_image.ref, "--allow-other-image", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["image"]["proven"] is False and any("--allow-other-image" in n for n in doc["notes"])
    dest = tmp_path / "dest" / model.name
    u = run_mm("unbundle", tmp_path / "v", "--dest", dest, "--json")
    assert u.returncode == 0, u.stderr
    assert any(f"NOT proven to be the pinned image {pinned_image.ref} (--allow-other-image)" in c
               for c in json.loads(u.stdout)["next_commands"])
    script = run_mm("launch", dest, "--hardware", "b300", "--image", pinned_image.ref).stdout
    assert f"# Warning: {dest.with_name(dest.name + '.payload') / 'image' / 'sglang.tar'}: no .mm-image.json record " \
           f"beside it; not proven to be {pinned_image.ref}" in script


# --- a node: every replica and the router start by the recorded image ID -----------------------------------

def test_node_script_starts_every_replica_and_the_router_by_the_recorded_image_id(pinned_image, tmp_path):
    model = make_model_dir(tmp_path / "models")
    archive = tmp_path / "sglang.tar"
    mm_image.save_image(pinned_image.ref, archive, "linux/amd64", tls_verify=False)
    bin_dir, state = tmp_path / "bin", tmp_path / "docker-state"
    fake_docker.install(bin_dir, state, store="classic")  # drops repo digests on load
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DOCKER_PLATFORM": "linux/amd64",
           "MM_HEALTH_TIMEOUT": "60"}
    port, r1, r2, metrics = (free_port() for _ in range(4))
    script = tmp_path / "start.sh"
    made = run_mm("launch", model, "--hardware", "b300", "--gpus", "0,1,2,3,4,5,6,7", "--image", pinned_image.ref,
                  "--image-archive", archive, "--port", port, "--replica-ports", f"{r1},{r2}", "--metrics-port",
                  metrics, "--out", script)
    assert made.returncode == 0, made.stderr
    started = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    assert ["load", "-i", str(archive)] in calls  # absent: loaded from --image-archive, then found by its ID
    runs = [c for c in calls if c[0] == "run"]
    image_id = pinned_image.image.platforms["linux/amd64"].config
    names = [c[c.index("--name") + 1] for c in runs]
    assert names == ["minimax-m3-1-flash-0", "minimax-m3-1-flash-1", "minimax-m3-1-flash-router"]
    for c in runs:
        assert image_id in c and pinned_image.ref not in c and c[c.index("--pull") + 1] == "never"


# --- doctor for a node: the shared HiCache sizing, every port ------------------------------------------------

def doctor(model: Path, bin_dir: Path, *args: object) -> tuple[int, dict]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = run_mm("doctor", model, "--json", *args, env=env)
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


def test_doctor_sizes_hicache_for_every_replica_of_the_node(tmp_path):
    model = make_model_dir(tmp_path / "models")
    fake_docker.install(tmp_path / "bin", tmp_path / "state", store="classic")
    rocm = "lmsysorg/sglang-rocm@sha256:" + "1" * 64
    base = ("--hardware", "mi355x", "--recipe", "high-throughput", "--image", rocm, "--port", free_port(),
            "--replica-ports", f"{free_port()},{free_port()}", "--metrics-port", free_port())
    code, checks = doctor(model, tmp_path / "bin", *base, "--gpus", "0,1,2,3,4,5,6,7")
    mem = checks["host memory"]
    assert code == 1 and mem["status"] == "fail"
    assert mem["detail"].startswith("HiCache needs 1,440 GB of host memory (2 replica(s) of sglang/mi355x/high-throughput")


def test_doctor_checks_every_port_a_node_binds(tmp_path):
    model = make_model_dir(tmp_path / "models")
    fake_gpu.install(tmp_path / "bin", 8 * [fake_gpu.B300])
    fake_docker.install(tmp_path / "bin", tmp_path / "state", store="classic")
    port, r1, r2, metrics = (free_port() for _ in range(4))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", r2))
        busy.listen()
        code, checks = doctor(model, tmp_path / "bin", "--hardware", "b300", "--gpus", "0,1,2,3,4,5,6,7",
                              "--port", port, "--replica-ports", f"{r1},{r2}", "--metrics-port", metrics)
    assert code == 1
    assert {k: v["status"] for k, v in checks.items() if "port" in k} == {
        "router port": "ok", "replica 0 port": "ok", "replica 1 port": "fail", "router metrics port": "ok"}
    assert checks["replica 1 port"]["detail"] == f"127.0.0.1:{r2} is in use (Address already in use)"


# --- the air-gapped side, in a network namespace with no network ---------------------------------------------

def unshare_prefix() -> list[str]:
    """`unshare -n` (root), else `unshare -rn` (an unprivileged user namespace); None when neither is permitted."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return []


AIRGAP_SCRIPT = r"""
set -eu
say() { printf '\n== %s\n' "$*"; }
ip link set lo up 2>/dev/null || true   # the host's own loopback; nothing else exists in this namespace
say "no network: routes"; cat /proc/net/route
python3 -c 'import socket,sys
try:
    socket.create_connection(("1.1.1.1", 443), timeout=3)
except OSError as e:
    print("outside unreachable:", e.strerror or e)
else:
    sys.exit("reached the outside: this is not an air gap")'
say "install mm from the first disk alone"
cd "$DISK1"
sh install-mm.sh "$WORK/mm-venv"
MM="$WORK/mm-venv/bin/mm"
say "the second disk arrives"
say "bundle verify"; "$MM" bundle verify "$DISK1" "$DISK2"
say "unbundle"; "$MM" unbundle "$DISK1" "$DISK2" --dest "$DEST" --json > "$WORK/unbundle.json"
say "the payload's docker load step"
python3 -c 'import json,sys; print(next(c for c in json.load(open(sys.argv[1]))["next_commands"] if c.startswith("docker load")).split("   #")[0])' "$WORK/unbundle.json" > "$WORK/load.sh"
cat "$WORK/load.sh"; sh "$WORK/load.sh"
say "doctor"; "$MM" doctor "$DEST" --hardware b300 --image "$IMAGE_REF" --port "$PORT" --cache-root "$WORK/cache"
say "launch"; "$MM" launch "$DEST" --hardware b300 --image "$IMAGE_REF" --port "$PORT" --cache-root "$WORK/cache" --out "$WORK/start.sh"
say "start"; bash "$WORK/start.sh"
"""


def test_air_gapped_host_installs_mm_verifies_unbundles_checks_and_starts_with_no_network(connected, bare_python,
                                                                                          tmp_path):
    prefix = unshare_prefix()
    if not prefix:
        pytest.skip("unshare -n is not permitted here (needs root or unprivileged user namespaces); "
                    "the air-gapped side was not run")
    work = tmp_path / "airgap"
    disk1, disk2 = work / "disk1", work / "disk2"
    vols = volumes(connected.out)
    for disk, vs in ((disk1, vols[:1]), (disk2, vols[1:])):
        disk.mkdir(parents=True)
        for v in vs:
            shutil.copy(v, disk / v.name)
    shutil.copy(connected.out / "install-mm.sh", disk1)  # "copy the volumes, run install-mm.sh"
    stand_ins = work / "stand-ins"
    fake_gpu.install(stand_ins, 4 * [fake_gpu.B300])
    fake_docker.install(stand_ins, work / "docker-state", store="classic")
    dest = work / "models" / "MiniMax-M3.1-Flash"
    env = {"PATH": f"{bare_python}:{stand_ins}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(work),
           "WORK": str(work), "DISK1": str(disk1), "DISK2": str(disk2), "DEST": str(dest),
           "IMAGE_REF": connected.image_ref, "PORT": str(free_port()), "FAKE_DOCKER_PLATFORM": "linux/amd64",
           "FAKE_GPU_INFO": ", ".join(fake_gpu.B300), "LANG": "C.UTF-8"}
    done = subprocess.run([*prefix, "sh", "-c", AIRGAP_SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                          cwd=work)
    log = done.stdout + done.stderr
    (tmp_path / "airgap.log").write_text(log)
    assert done.returncode == 0, log[-4000:]
    assert "outside unreachable:" in log
    assert re.search(r"installed mm, version \S+ into \S+/mm-venv \(" + HOST.name + r", with (pip|uv), offline\)", log)
    assert f"docker image inspect --format '{{{{.Id}}}}' {connected.image_id}" in log
    assert "ready to start" in log  # doctor: no failed check (warnings allowed)
    assert f"fake docker: running image {connected.image_id} as {connected.image_id} (pull never)" in log
    loaded = [json.loads(line) for line in (work / "docker-state" / "calls.jsonl").read_text().splitlines()]
    assert ["image", "inspect", "--format", "{{.Id}}", connected.image_id] in loaded
