"""The wheelhouse: mm and its dependencies as locked wheels per target; install-mm.sh installs offline."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from mm.artifacts.bundle import wheelhouse
from mm.artifacts.bundle.wheelhouse import Platform

HOST = wheelhouse.host_target()
DEFAULT = wheelhouse.targets_for()  # conftest.wheelhouse_dir: these and this Python on the other machine
OTHER = "aarch64" if HOST.machine == "x86_64" else "x86_64"
SHELL_PATH = "/usr/bin:/bin"


def run_install(script: Path, cwd: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """install-mm.sh under a bare environment: only sh, the coreutils and a bare python3 on PATH."""
    return subprocess.run(["sh", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{bin_dir}:{SHELL_PATH}", "HOME": str(cwd), **env})


def test_each_set_holds_mm_uv_and_every_dependency_locked_by_sha256(wheelhouse_dir):
    doc = wheelhouse.read_index(wheelhouse_dir / "wheelhouse")
    assert {s["name"] for s in doc["sets"]} == {t.name for t in DEFAULT} | {Platform(OTHER, HOST.python).name}
    for s in doc["sets"]:
        names = {w["name"] for w in s["wheels"]}
        assert {"mm", "uv", "huggingface-hub", "modelscope", "blake3", "safetensors", "click", "rich",
                "cryptography", "packaging"} <= names
        lock = (wheelhouse_dir / "wheelhouse" / s["lock"]).read_text().splitlines()
        assert len(lock) == len(s["wheels"]) and all(" --hash=sha256:" in line for line in lock)
    assert wheelhouse.check_wheelhouse(wheelhouse_dir / "wheelhouse") == []


def test_sets_of_one_machine_share_every_wheel_they_all_accept(wheelhouse_dir):
    """Another CPython costs its version-specific wheels only: cryptography's abi3 wheel serves 3.10 to 3.13."""
    doc = wheelhouse.read_index(wheelhouse_dir / "wheelhouse")
    groups: dict[tuple, dict[str, list[Platform]]] = {}
    for s in doc["sets"]:
        for w in s["wheels"]:
            groups.setdefault((s["machine"], w["name"], w["version"]), {}).setdefault(w["file"], []).append(
                Platform(s["machine"], s["python"]))
    for key, files in groups.items():
        users = [t for ts in files.values() for t in ts]
        if len(files) > 1:  # kept apart only when no one of them fits every set that needs that release
            assert not any(all(wheelhouse.wheel_fits(f, t) for t in users) for f in files), key
    assert len(groups[("x86_64", "cryptography", next(k[2] for k in groups if k[1] == "cryptography"))]) == 1
    assert len(list((wheelhouse_dir / "wheelhouse" / "wheels").glob("uv-*x86_64*.whl"))) == 1


def test_every_aarch64_wheel_has_a_tag_an_aarch64_cpython_of_that_version_accepts(wheelhouse_dir):
    arm = Platform("aarch64", HOST.python)
    x86 = Platform("x86_64", HOST.python)
    arm_dir, x86_dir = (wheelhouse.set_wheels(wheelhouse_dir / "wheelhouse", t.name) for t in (arm, x86))
    assert wheelhouse.misfits(arm_dir, arm) == [] and wheelhouse.misfits(x86_dir, x86) == []
    # the check can fail: the x86_64 set's compiled wheels are refused for aarch64
    refused = wheelhouse.misfits(x86_dir, arm)
    assert any(name.startswith(("blake3-", "cryptography-", "uv-")) for name in refused)
    # per-minor-version wheels (not abi3) are refused for another CPython minor
    other_minor = Platform("aarch64", "3.%d" % (HOST.version[1] + 1))
    assert any(name.startswith("blake3-") for name in wheelhouse.misfits(arm_dir, other_minor))


def test_the_mm_wheel_is_packed_from_the_installed_package_byte_for_byte_reproducible(tmp_path):
    first = wheelhouse.build_mm_wheel(tmp_path / "a")
    second = wheelhouse.build_mm_wheel(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "mm = mm.__main__:main" in zf.read(info).decode()
        assert zf.testzip() is None
    assert {"mm/cli.py", "mm/artifacts/bundle/wheelhouse.py", "mm/artifacts/bundle/install-mm.sh",
            "mm/manifests/minimax-m3.1-flash.json"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_install_uses_the_bundled_uv_when_python3_cannot_make_a_venv(wheelhouse_dir, bare_python, tmp_path):
    # Debian/Ubuntu without python3-venv: `python3 -m venv` fails because ensurepip is missing.
    real = (bare_python / "python3").read_text().split("exec ", 1)[1].split(" -I")[0]
    (bare_python / "python3").write_text(
        '#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n'
        '  echo "The virtual environment was not created successfully because ensurepip is not available." >&2\n'
        f'  exit 1\nfi\nexec {real} -I "$@"\n')
    work = tmp_path / "host"
    work.mkdir()
    proc = run_install(wheelhouse_dir / "install-mm.sh", work, bare_python)
    assert proc.returncode == 0, proc.stderr
    assert "ensurepip is not available" in proc.stderr and "installing with the bundled uv" in proc.stderr
    assert f"installed mm, version {wheelhouse.mm_version()} into ./mm-venv ({HOST.name}, with uv, offline)" in proc.stdout
    assert "next: ./mm-venv/bin/mm bundle verify" in proc.stdout
    version = subprocess.run([str(work / "mm-venv" / "bin" / "mm"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "mm, version" in version.stdout


def test_install_on_a_host_with_no_matching_set_says_what_the_bundle_holds(wheelhouse_dir, bare_python, tmp_path):
    only_other = tmp_path / "bundle"
    shutil.copytree(wheelhouse_dir, only_other)
    shutil.rmtree(only_other / "wheelhouse" / HOST.name)
    proc = run_install(only_other / "install-mm.sh", tmp_path, bare_python, str(tmp_path / "venv"))
    assert proc.returncode == 7
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"no wheel set for this host ({HOST.name}" in lines[0]
    assert f"the bundle holds: " in lines[0] and Platform(OTHER, HOST.python).name in lines[0]
    assert f"{HOST.name} " not in lines[0].split("the bundle holds: ", 1)[1]
    assert not (tmp_path / "venv").exists()


def test_install_refuses_a_wheel_whose_bytes_differ_from_the_lock(wheelhouse_dir, bare_python, tmp_path):
    tampered = tmp_path / "bundle"
    shutil.copytree(wheelhouse_dir, tampered)
    click_wheel = next((tampered / "wheelhouse" / "wheels").glob("click-*.whl"))
    data = bytearray(click_wheel.read_bytes())
    data[-100] ^= 0xFF
    click_wheel.write_bytes(bytes(data))
    proc = run_install(tampered / "install-mm.sh", tmp_path, bare_python, "venv", MM_INSTALL_WITH="uv")
    assert proc.returncode == 5
    assert proc.stderr.strip().splitlines() == [
        f"install-mm.sh: {click_wheel}: sha256 {wheelhouse._sha256(click_wheel)} is not in "
        f"{tampered / 'wheelhouse' / HOST.name / 'requirements.lock'} (damaged in transit?)"]
    assert not (tmp_path / "venv" / "bin" / "mm").exists()


HOSTILE_INDEXES = {
    "truncated JSON": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.2',
    "not UTF-8": b'\xff\xfe{"schema": "mm-wheelhouse/2"}',
    "empty": b"",
    "a list": b"[]",
    "another schema": b'{"schema": "mm-wheelhouse/9", "glibc_min": "2.28", "sets": []}',
    "no glibc_min": b'{"schema": "mm-wheelhouse/2", "sets": []}',
    "glibc_min a number": b'{"schema": "mm-wheelhouse/2", "glibc_min": 2.28, "sets": []}',
    "glibc_min not a version": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.x", "sets": []}',
    "glibc_min unicode digits": '{"schema": "mm-wheelhouse/2", "glibc_min": "\u0662.\u0662\u0668", "sets": []}'.encode(),
    "sets not a list": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.28", "sets": {"name": "x"}}',
    "a set not an object": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.28", "sets": ["linux-x86_64-cp311"]}',
    "deep nesting": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.28", "sets": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "huge integer": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.28", "sets": [], "n": ' + b"9" * 10_000 + b"}",
    "bigger than 4 MiB": b'{"schema": "mm-wheelhouse/2", "glibc_min": "2.28", "sets": []' + b" " * (5 << 20) + b"}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INDEXES))
def test_install_with_a_hostile_index_says_so_in_one_line_and_exits_3(case, wheelhouse_dir, bare_python, tmp_path):
    """wheelhouse.json comes from a removable disk: malformed or of the wrong shape, one line naming it, no traceback."""
    disk = tmp_path / "disk"
    (disk / "wheelhouse" / HOST.name).mkdir(parents=True)
    shutil.copy(wheelhouse_dir / "install-mm.sh", disk / "install-mm.sh")
    shutil.copy(wheelhouse_dir / "wheelhouse" / HOST.name / "requirements.lock", disk / "wheelhouse" / HOST.name)
    index = disk / "wheelhouse" / "wheelhouse.json"
    index.write_bytes(HOSTILE_INDEXES[case])
    proc = run_install(disk / "install-mm.sh", tmp_path, bare_python, str(tmp_path / "venv"))
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"install-mm.sh: {index}: not a wheelhouse index ("), lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "venv").exists()


def test_install_from_a_damaged_first_volume_says_so_in_one_line_and_exits_3(wheelhouse_dir, bare_python, tmp_path):
    """Volume 1 cut short on the disk: one line naming the volume and why, no traceback, nothing installed."""
    import tarfile

    disk = tmp_path / "disk"
    disk.mkdir()
    vol = disk / "demo.vol001-of-002.tar"
    with tarfile.open(vol, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(wheelhouse_dir / "wheelhouse", arcname="payload/mm/wheelhouse")
    with open(vol, "r+b") as f:
        f.truncate(vol.stat().st_size // 2 + 7)
    shutil.copy(wheelhouse_dir / "install-mm.sh", disk / "install-mm.sh")
    proc = run_install(disk / "install-mm.sh", tmp_path, bare_python, str(tmp_path / "venv"))
    assert proc.returncode == 3, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("install-mm.sh: reading the wheelhouse")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"install-mm.sh: {vol}: cannot read the wheelhouse from this volume ("), lines[0]
    assert not (tmp_path / "venv").exists()


def test_install_with_a_lock_file_that_is_not_text_says_so_in_one_line_and_exits_5(wheelhouse_dir, bare_python, tmp_path):
    """requirements.lock damaged into bytes that are not UTF-8: one line naming it, no traceback."""
    disk = tmp_path / "disk"
    shutil.copytree(wheelhouse_dir, disk)
    lock = disk / "wheelhouse" / HOST.name / "requirements.lock"
    lock.write_bytes(b"\xff\xfe" + lock.read_bytes())
    proc = run_install(disk / "install-mm.sh", tmp_path, bare_python, str(tmp_path / "venv"))
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"install-mm.sh: {lock}: not a readable lock file (UnicodeDecodeError"), lines[0]
    assert not (tmp_path / "venv").exists()


def test_install_reads_the_wheelhouse_out_of_the_first_volume(wheelhouse_dir, bare_python, tmp_path):
    """Run beside the volume files: the script takes the wheelhouse from volume 1 with python3's tarfile."""
    import tarfile

    disk = tmp_path / "disk"
    disk.mkdir()
    with tarfile.open(disk / "demo.vol001-of-002.tar", "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(wheelhouse_dir / "wheelhouse", arcname="payload/mm/wheelhouse")
    shutil.copy(wheelhouse_dir / "install-mm.sh", disk / "install-mm.sh")
    proc = run_install(disk / "install-mm.sh", tmp_path, bare_python, "venv", MM_INSTALL_WITH="uv")
    assert proc.returncode == 0, proc.stderr
    assert "reading the wheelhouse from demo.vol001-of-002.tar" in proc.stderr
    assert (tmp_path / "venv" / "bin" / "mm").is_file()


def test_install_script_is_posix_sh():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (make tools installs it)")
    proc = subprocess.run(["shellcheck", "-s", "sh", str(Path(wheelhouse.__file__).with_name("install-mm.sh"))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("value,expected", [("linux/amd64", "x86_64"), ("linux/arm64", "aarch64"),
                                            ("aarch64", "aarch64"), ("x86_64", "x86_64")])
def test_target_platform_names(value, expected):
    assert wheelhouse.parse_machine(value) == expected


@pytest.mark.parametrize("value", ["windows/amd64", "linux/riscv64", "sparc"])
def test_unknown_target_platform_is_refused(value):
    with pytest.raises(wheelhouse.BadInput, match="--target-platform"):
        wheelhouse.parse_machine(value)


def test_target_python_versions():
    assert [wheelhouse.parse_python(v) for v in ("3.11", "cp312", "3.10")] == ["3.11", "3.12", "3.10"]
    with pytest.raises(wheelhouse.BadInput, match="3.10 or newer"):
        wheelhouse.parse_python("3.8")
    assert json.loads(json.dumps([t.name for t in wheelhouse.targets_for(("linux/arm64",), ("3.11", "3.12"))])) == [
        "linux-aarch64-cp311", "linux-aarch64-cp312"]


def test_default_targets_are_cpython_3_10_to_3_13_on_amd64_plus_this_host_and_an_arm64_image():
    names = [t.name for t in wheelhouse.targets_for()]
    assert {"linux-x86_64-cp310", "linux-x86_64-cp311", "linux-x86_64-cp312", "linux-x86_64-cp313", HOST.name} == set(names)
    with_arm = [t.name for t in wheelhouse.targets_for((), (), ("linux/arm64",))]
    assert {"linux-aarch64-cp310", "linux-aarch64-cp313"} <= set(with_arm) and set(names) <= set(with_arm)
    assert wheelhouse.describe_targets(wheelhouse.targets_for((), (), ("linux/arm64",))).startswith(
        "linux/amd64 CPython 3.10, 3.11, 3.12, 3.13")
    # given, the options replace the default
    assert [t.name for t in wheelhouse.targets_for(("linux/arm64",), ("3.12",))] == ["linux-aarch64-cp312"]


def test_coverage_names_the_set_to_build_for_a_python3_the_bundle_lacks(tmp_path, monkeypatch):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 3.14 cpython\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PYTHON", str(fake))
    line = wheelhouse.coverage(["linux-x86_64-cp312"])
    assert line.startswith(f"this host is NOT covered: {fake} is CPython 3.14 on {HOST.machine} and the bundle holds "
                           f"linux-x86_64-cp312; build one on the connected host with: mm bundle --only-mm --out DIR "
                           f"--target-platform linux/{HOST.machine} --target-python 3.14"), line
    assert wheelhouse.coverage([f"linux-{HOST.machine}-cp314"]).startswith("this host is covered")
    monkeypatch.setenv("PYTHON", str(tmp_path / "nothing"))
    assert "not found (install-mm.sh needs CPython 3.10 or newer)" in wheelhouse.coverage([])


def test_no_pip_download_needed_when_the_set_is_cached(wheelhouse_dir, tmp_path_factory, tmp_path, monkeypatch):
    from tests.conftest import wheelhouse_cache

    def no_network(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(wheelhouse, "_pip_download", no_network)
    report = wheelhouse.build_wheelhouse(tmp_path / "out", [HOST], cache=wheelhouse_cache(tmp_path_factory))
    assert [s.name for s in report.sets] == [HOST.name]
    assert sorted(os.listdir(tmp_path / "out" / "wheelhouse" / "wheels")) == sorted(
        p.name for p in (wheelhouse_cache(tmp_path_factory) / HOST.name).glob("*.whl"))


def test_install_again_into_the_same_directory_upgrades_in_place(wheelhouse_dir, bare_python, tmp_path):
    for _ in range(2):
        proc = run_install(wheelhouse_dir / "install-mm.sh", tmp_path, bare_python, "venv", MM_INSTALL_WITH="uv")
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "venv" / "bin" / "mm").is_file()
    other = tmp_path / "not-a-venv"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = run_install(wheelhouse_dir / "install-mm.sh", tmp_path, bare_python, str(other), MM_INSTALL_WITH="uv")
    assert refused.returncode == 3 and "exists and is not a virtual environment" in refused.stderr
    assert (other / "notes.txt").read_text() == "mine"
