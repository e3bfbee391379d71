"""install-mm.sh stays offline and bounded.

  lock      requirements.lock is data, not pip input: a line that is not `name==version --hash=sha256:<hex>` (or a
            comment) is refused, exit 3, in one line, before pip or uv runs (and a loopback server named in it sees
            no request)
  network   a normal install with every network setting of the host (proxies, pip.conf, PIP_*/UV_* variables, a
            uv.toml) pointing at a loopback server: that server sees no connection, with pip and with uv; and an
            install inside `unshare -n`, where no network exists
  volume    from volume 1 only the members the wheelhouse index names, each a plain member of the size the index
            gives, checked before a byte is written: a GNU sparse member of 2 GiB never reaches $TMPDIR
  layout    a stray linux-* entry without a lock, a requirements.lock that is a directory or a FIFO, an index that
            is a FIFO: one line and a documented exit code, never a silent exit 1
The wheelhouse is the session's (conftest.wheelhouse_dir); installs run under `ulimit -f` (50 MiB a file), so a
member unpacked whatever its size would fail loudly rather than fill the disk.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from mm.artifacts.bundle import wheelhouse

HOST = wheelhouse.host_target()
SHELL_PATH = "/usr/bin:/bin"
FILE_LIMIT_BLOCKS = 102400  # ulimit -f: 50 MiB a file (the largest wheel, uv's, is ~20 MB)


class Listener:
    """A TCP server on 127.0.0.1 that counts every connection (a request, a proxy CONNECT) and closes it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self):
        # shutdown() wakes the accept() the thread is blocked in (close() alone would leave it listening; see
        # tests/support/countproxy.py), then the socket is closed once the thread is gone
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


def run_install(disk: Path, cwd: Path, bin_dir: Path, *args: str, prefix: tuple[str, ...] = (),
                **env: str) -> subprocess.CompletedProcess:
    """install-mm.sh from DISK under a bare environment (sh, coreutils, a bare python3), each file at most 50 MiB."""
    command = f'ulimit -f {FILE_LIMIT_BLOCKS}; exec sh "$0" "$@"'
    return subprocess.run([*prefix, "sh", "-c", command, str(disk / "install-mm.sh"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{bin_dir}:{SHELL_PATH}", "HOME": str(cwd), **env})


def one_line(proc: subprocess.CompletedProcess, code: int, *needles: object) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("install-mm.sh: reading the wheelhouse")]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert str(needle) in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def disk(wheelhouse_dir, tmp_path) -> Path:
    """A copy of the session's wheelhouse (install-mm.sh + wheelhouse/), as it arrives on a removable disk."""
    out = tmp_path / "disk"
    shutil.copytree(wheelhouse_dir, out)
    return out


def lock_of(disk: Path) -> Path:
    return disk / "wheelhouse" / HOST.name / "requirements.lock"


# --- lock: data, not pip input ---------------------------------------------------------------------

HEX = "ab" * 32
HOSTILE_LINES = {
    "find-links to a server": "--find-links {url}/",
    "direct URL": "evil @ {url}/evil-1.0-py3-none-any.whl",
    "index URL": "--index-url {url}/simple",
    "extra index URL": "--extra-index-url {url}/simple",
    "nested requirements": "-r {url}/more.txt",
    "editable VCS": "-e git+{url}/x.git#egg=x",
    "a range, not a pin": "click>=8 --hash=sha256:" + HEX,
    "no hash": "click==8.1.7",
    "an environment marker": "click==8.1.7 --hash=sha256:" + HEX + " ; python_version > '3'",
    "an option after the hash": "click==8.1.7 --hash=sha256:" + HEX + " --index-url {url}/simple",
    "a second hash": "click==8.1.7 --hash=sha256:" + HEX + " --hash=sha256:" + HEX,
    "a short hash": "click==8.1.7 --hash=sha256:abc",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LINES))
def test_a_lock_line_that_is_not_a_pinned_hash_is_refused_before_pip_runs(case, disk, bare_python, listener, tmp_path):
    lock = lock_of(disk)
    lines = lock.read_text().splitlines()
    lines.insert(1, HOSTILE_LINES[case].format(url=listener.url))
    lock.write_text("\n".join(lines) + "\n")
    proc = run_install(disk, tmp_path, bare_python, str(tmp_path / "venv"))
    one_line(proc, 3, lock, "line 2 is not `name==version --hash=sha256:", "refused")
    assert not (tmp_path / "venv").exists()  # neither pip nor uv ran
    assert listener.connections == 0


def test_comments_and_blank_lines_in_the_lock_are_data_too(disk, bare_python, tmp_path):
    """They pass the line check; a lock then naming no wheel at all is refused, not handed to pip."""
    lock_of(disk).write_text("# mm's lock\n\n   \n")
    one_line(run_install(disk, tmp_path, bare_python, str(tmp_path / "venv")), 3, lock_of(disk), "no wheel")


# --- network: nothing leaves the host --------------------------------------------------------------

def _hostile_network_env(home: Path, url: str) -> dict[str, str]:
    """Every way this host could send pip or uv to a server: all pointing at URL."""
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "uv").mkdir(parents=True)
    pip_conf = f"[global]\nindex-url = {url}/simple\nextra-index-url = {url}/extra\nfind-links = {url}/links\n"
    (home / ".config" / "pip" / "pip.conf").write_text(pip_conf)
    (home / "pip.conf").write_text(pip_conf)
    (home / ".config" / "uv" / "uv.toml").write_text(f'index-url = "{url}/simple"\nfind-links = ["{url}/links"]\n')
    proxies = {name: url for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                                      "ALL_PROXY")}
    return {**proxies, "PIP_CONFIG_FILE": str(home / "pip.conf"), "PIP_INDEX_URL": f"{url}/simple",
            "PIP_EXTRA_INDEX_URL": f"{url}/extra", "PIP_FIND_LINKS": f"{url}/links", "PIP_NO_INDEX": "0",
            "UV_INDEX_URL": f"{url}/simple", "UV_EXTRA_INDEX_URL": f"{url}/extra", "UV_DEFAULT_INDEX": f"{url}/d",
            "UV_INDEX": f"{url}/i", "UV_FIND_LINKS": f"{url}/links", "UV_OFFLINE": "0", "UV_NO_CONFIG": "0",
            "UV_PYTHON_DOWNLOADS": "automatic", "NO_PROXY": "", "no_proxy": ""}


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_an_install_with_every_network_setting_pointing_at_a_loopback_server_sends_it_nothing(
        installer, disk, bare_python, listener, tmp_path):
    # a stray linux-* entry without a lock (a directory, a file) is no reason to stop
    (disk / "wheelhouse" / "linux-stray").mkdir()
    (disk / "wheelhouse" / "linux-x86_64-cp39").write_text("not a set\n")
    home = tmp_path / "home"
    home.mkdir()
    proc = run_install(disk, home, bare_python, "venv", MM_INSTALL_WITH=installer,
                       **_hostile_network_env(home, listener.url))
    assert proc.returncode == 0, proc.stderr
    assert f"with {installer}, offline" in proc.stdout
    assert listener.connections == 0
    version = subprocess.run([str(home / "venv" / "bin" / "mm"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "mm, version" in version.stdout


def test_an_install_inside_unshare_n_needs_no_network(disk, bare_python, tmp_path):
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here (needs root)")
    proc = run_install(disk, tmp_path, bare_python, "venv", prefix=("unshare", "-n"), MM_INSTALL_WITH="uv")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "venv" / "bin" / "mm").is_file()


# --- volume 1: only what the index names, sizes checked first --------------------------------------

def _volume(disk: Path, leave_out: str | None = None) -> Path:
    """A first volume holding DISK's wheelhouse under payload/mm/ (as mm bundle lays it out), beside install-mm.sh."""
    vol_dir = disk.parent / "vol-disk"
    vol_dir.mkdir()
    vol = vol_dir / "demo.vol001-of-002.tar"
    with tarfile.open(vol, "w", format=tarfile.GNU_FORMAT) as tf:
        for path in sorted((disk / "wheelhouse").rglob("*")):
            rel = path.relative_to(disk).as_posix()
            if path.is_file() and rel != leave_out:
                tf.add(path, arcname=f"payload/mm/{rel}")
    shutil.copy(disk / "install-mm.sh", vol_dir / "install-mm.sh")
    return vol


def _append_sparse(vol: Path, name: str, size: int) -> None:
    """Append NAME as a GNU sparse member of SIZE bytes (all holes: GNU tar stores no data for them)."""
    src = vol.parent / "sparse-src"
    (src / Path(name).parent).mkdir(parents=True, exist_ok=True)
    with open(src / name, "wb") as f:
        f.truncate(size)
    subprocess.run(["tar", "--format=gnu", "--sparse", "-rf", str(vol), "-C", str(src), name], check=True)
    shutil.rmtree(src)


def _mm_wheel(disk: Path) -> str:
    return next((disk / "wheelhouse" / HOST.name).glob("mm-*.whl")).relative_to(disk).as_posix()


def test_a_2_gib_sparse_member_in_place_of_a_wheel_is_refused_before_a_byte_is_written(disk, bare_python, tmp_path):
    mm_wheel = _mm_wheel(disk)
    vol = _volume(disk, leave_out=mm_wheel)
    _append_sparse(vol, f"payload/mm/{mm_wheel}", 2 << 30)
    started = time.monotonic()
    proc = run_install(vol.parent, tmp_path, bare_python, str(tmp_path / "venv"), TMPDIR=str(tmp_path))
    one_line(proc, 3, vol, "cannot read the wheelhouse from this volume", f"payload/mm/{mm_wheel}", "not a plain file")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "venv").exists() and not list(tmp_path.glob("tmp.*"))


def test_a_member_whose_size_differs_from_the_index_is_refused(disk, bare_python, tmp_path):
    mm_wheel = _mm_wheel(disk)
    vol = _volume(disk, leave_out=mm_wheel)
    with tarfile.open(vol, "a", format=tarfile.GNU_FORMAT) as tf:
        (tmp_path / "short.whl").write_bytes(b"PK short")
        tf.add(tmp_path / "short.whl", arcname=f"payload/mm/{mm_wheel}")
    proc = run_install(vol.parent, tmp_path, bare_python, str(tmp_path / "venv"))
    one_line(proc, 3, vol, f"payload/mm/{mm_wheel}", "8 bytes where the index says")


def test_a_link_member_where_the_index_names_a_wheel_is_refused(disk, bare_python, tmp_path):
    mm_wheel = _mm_wheel(disk)
    vol = _volume(disk, leave_out=mm_wheel)
    with tarfile.open(vol, "a", format=tarfile.GNU_FORMAT) as tf:
        link = tarfile.TarInfo(f"payload/mm/{mm_wheel}")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    proc = run_install(vol.parent, tmp_path, bare_python, str(tmp_path / "venv"))
    one_line(proc, 3, vol, f"payload/mm/{mm_wheel}", "not a plain file")


def test_a_huge_sparse_member_the_index_does_not_name_is_never_unpacked(disk, bare_python, tmp_path):
    """Under `ulimit -f` (50 MiB): unpacking it would fail; the install goes on from what the index names."""
    vol = _volume(disk)
    _append_sparse(vol, "payload/mm/wheelhouse/linux-stray/huge.whl", 2 << 30)
    proc = run_install(vol.parent, tmp_path, bare_python, "venv", MM_INSTALL_WITH="uv", TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "venv" / "bin" / "mm").is_file()


# --- layout: one line, a documented code ------------------------------------------------------------

def test_a_lock_that_is_a_directory_is_one_line_exit_3(disk, bare_python, tmp_path):
    lock = lock_of(disk)
    lock.unlink()
    lock.mkdir()
    one_line(run_install(disk, tmp_path, bare_python, str(tmp_path / "venv")), 3, lock, "not a regular file")


@pytest.mark.parametrize("what", ["lock", "index"])
def test_a_lock_or_index_that_is_a_fifo_is_one_line_and_never_waits(what, disk, bare_python, tmp_path):
    import os

    path = lock_of(disk) if what == "lock" else disk / "wheelhouse" / "wheelhouse.json"
    path.unlink()
    os.mkfifo(path)
    proc = run_install(disk, tmp_path, bare_python, str(tmp_path / "venv"))
    one_line(proc, 3, path, "not a regular file")


def test_no_set_for_this_host_beside_stray_entries_says_what_the_bundle_holds(disk, bare_python, tmp_path):
    shutil.rmtree(disk / "wheelhouse" / HOST.name)
    (disk / "wheelhouse" / "linux-stray").mkdir()
    proc = run_install(disk, tmp_path, bare_python, str(tmp_path / "venv"))
    line = one_line(proc, 7, f"no wheel set for this host ({HOST.name}")
    assert "linux-stray" not in line
