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

import io
import shutil
import socket
import subprocess
import sys
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


# --- lock: the checker sees the lines pip and uv see ----------------------------------------------------
#
# pip splits a requirements file with str.splitlines: besides \n and \r, \f, \v, \x1c-\x1e, \x85, \u2028 and
# \u2029 end a line, so `# x<FF>-r FILE` is a comment to a checker that splits on \n and two lines to pip. Each lock
# of the family below is either refused by install-mm.sh's own checker (exit 3, before pip or uv runs) or read by
# pip's and uv's own parsers as exactly the pins the checker saw.

SEPARATORS = {"form feed": "\f", "vertical tab": "\v", "file separator": "\x1c", "group separator": "\x1d",
              "record separator": "\x1e", "next line (NEL)": "\x85", "line separator": "\u2028",
              "paragraph separator": "\u2029", "carriage return": "\r", "NUL": "\x00", "tab": "\t",
              "ANSI escape": "\x1b", "zero-width space": "\u200b", "byte order mark": "\ufeff"}
HIDDEN = {"nested requirements": "-r /nonexistent/more.txt", "constraints": "-c /nonexistent/c.txt",
          "find-links": "--find-links /tmp", "extra pin": "six==1.16.0 --hash=sha256:" + HEX}
PLACES = {"inside a comment": "# mm's lock{sep}{hidden}", "after a comment's hash": "#{sep}{hidden}",
          "on an indented comment": "   # note{sep}{hidden}", "on a blank line": "{sep}{hidden}"}
SEPARATED_LOCKS = {f"{p}, {s}, {h}": (PLACES[p], SEPARATORS[s], HIDDEN[h])
                   for p in PLACES for s in SEPARATORS for h in HIDDEN}
# Printable ASCII only: the checker lets these through, and pip and uv must read the same pins from them.
PLAIN_LOCKS = {
    "comments and blank lines": "# mm's lock\n\n   \n{pins}# end\n",
    "a comment ending in a backslash": "# continued? \\\n{pins}",
    "a comment naming an option": "# -r /nonexistent/more.txt --find-links /tmp\n{pins}",
    "no newline at the end": "{pins_no_eol}",
}


def _installer_checker(tmp_path: Path) -> Path:
    """install-mm.sh's own checker (the Python helper it writes and runs), as a file."""
    text = wheelhouse.install_script_text()
    body = text.split("cat > \"$check\" <<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    check = tmp_path / "check.py"
    check.write_text(body + "\n")
    return check


def _with_lock(wheelhouse_dir: Path, tmp_path: Path, lock: str) -> Path:
    """A wheelhouse whose index and wheels are the session's and whose lock for this host is LOCK."""
    house = tmp_path / "wh"
    (house / HOST.name).mkdir(parents=True)
    for name in ("wheelhouse.json", "wheels"):
        (house / name).symlink_to(wheelhouse_dir / "wheelhouse" / name)
    (house / HOST.name / "requirements.lock").write_bytes(lock.encode())
    return house


def _checker_reads(wheelhouse_dir: Path, tmp_path: Path, lock: str) -> subprocess.CompletedProcess:
    house = _with_lock(wheelhouse_dir, tmp_path, lock)
    return subprocess.run([sys.executable, "-I", str(_installer_checker(tmp_path)), "lock", str(house), HOST.name,
                           str(tmp_path / "set"), str(tmp_path / "checked.lock")], capture_output=True, text=True)


def pip_reads(lock: Path) -> list[str]:
    """What pip's own requirements-file parser makes of LOCK: `name==version` of each requirement; an option line
    or a nested file it would act on as such (a nested file that does not exist: pip's error)."""
    from pip._internal.exceptions import InstallationError
    from pip._internal.network.session import PipSession
    from pip._internal.req.req_file import RequirementsFileParser, get_line_parser

    seen = []
    try:
        for line in RequirementsFileParser(PipSession(), get_line_parser(None)).parse(str(lock), constraint=False):
            if line.requirement:
                seen.append(line.requirement)
            else:
                seen.append("option " + " ".join(f"{k}={v}" for k, v in sorted(vars(line.opts).items()) if v))
    except InstallationError as e:
        seen.append(f"pip error: {e}")
    return seen


def uv_reads(uv: Path, lock: Path, wheels: Path) -> list[str]:
    """What uv's own parser makes of LOCK: the pins `uv pip compile --no-deps` resolves from it, offline."""
    proc = subprocess.run([str(uv), "--no-config", "pip", "compile", str(lock), "--no-deps", "--offline", "--no-index",
                           "--find-links", str(wheels), "--python", sys.executable, "--no-header", "--no-annotate",
                           "--quiet"], capture_output=True, text=True, timeout=120,
                          env={"PATH": SHELL_PATH, "HOME": str(lock.parent), "UV_CACHE_DIR": str(lock.parent / "uv-cache")})
    if proc.returncode != 0:
        return [f"uv error: {proc.stderr.strip()[:300]}"]
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.fixture(scope="module")
def uv_binary(wheelhouse_dir, tmp_path_factory) -> Path:
    """The uv the wheelhouse carries, out of its wheel."""
    import zipfile

    wheel = next((wheelhouse_dir / "wheelhouse" / "wheels").glob(f"uv-*{HOST.machine}*.whl"))
    out = tmp_path_factory.mktemp("uv") / "uv"
    with zipfile.ZipFile(wheel) as zf:
        out.write_bytes(zf.read(next(n for n in zf.namelist() if n.endswith(".data/scripts/uv"))))
    out.chmod(0o755)
    return out


def _pins(wheelhouse_dir: Path) -> str:
    return (wheelhouse_dir / "wheelhouse" / HOST.name / "requirements.lock").read_text()


@pytest.mark.parametrize("case", sorted(SEPARATED_LOCKS))
def test_a_lock_with_a_byte_outside_printable_ascii_is_refused_before_pip_runs(case, wheelhouse_dir, tmp_path):
    place, sep, hidden = SEPARATED_LOCKS[case]
    lock = place.format(sep=sep, hidden=hidden) + "\n" + _pins(wheelhouse_dir)
    proc = _checker_reads(wheelhouse_dir, tmp_path, lock)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 1 holds the character" in lines[0] and "not printable ASCII" in lines[0], lines
    assert "refused, nothing installed" in lines[0] and not (tmp_path / "set").exists()


@pytest.mark.parametrize("sep", ["\f", "\v", "\x1c", "\x85", "\u2028"])
def test_pip_itself_reads_a_line_hidden_behind_a_line_separator_in_a_comment(sep, wheelhouse_dir, tmp_path):
    """Why the checker refuses those bytes: to pip the comment ends there and the rest is a line of its own."""
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"# mm's lock{sep}six==1.16.0 --hash=sha256:{HEX}\n", encoding="utf-8")
    assert [r for r in pip_reads(lock)] == ["six==1.16.0"]


@pytest.mark.parametrize("case", sorted(PLAIN_LOCKS))
def test_a_lock_the_checker_accepts_is_read_by_pip_and_uv_as_exactly_the_pins_it_saw(case, wheelhouse_dir, uv_binary,
                                                                                      tmp_path):
    pins = _pins(wheelhouse_dir)
    lock = PLAIN_LOCKS[case].format(pins=pins, pins_no_eol=pins.rstrip("\n"))
    proc = _checker_reads(wheelhouse_dir, tmp_path, lock)
    assert proc.returncode == 0, proc.stderr
    checker_saw = proc.stdout.splitlines()
    assert len(checker_saw) == len(pins.splitlines())
    checked = tmp_path / "checked.lock"
    assert checked.read_bytes() == lock.encode()  # pip and uv read the bytes the checker read
    assert sorted(pip_reads(checked)) == checker_saw
    assert sorted(uv_reads(uv_binary, checked, tmp_path / "set")) == checker_saw


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
    return next((disk / "wheelhouse" / "wheels").glob("mm-*.whl")).relative_to(disk).as_posix()


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


HOSTILE_MEMBERS = {
    "dot-dot": "payload/mm/../../evil.txt",
    "dot-dot at the top": "../evil.txt",
    "absolute": "/tmp/evil.txt",
    "double slash": "payload//mm/wheelhouse/evil.txt",
    "dot part": "payload/./mm/wheelhouse/evil.txt",
    "ANSI escape in the wheelhouse prefix": "payload/\x1b[2J\x1b[31mmm/wheelhouse/evil.txt",
    "newline": "payload/mm/wheelhouse/evil\n.txt",
    "backslash": "payload\\..\\evil.txt",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MEMBERS))
def test_a_first_volume_carrying_a_member_mm_never_writes_is_refused(case, disk, bare_python, tmp_path):
    """Whether or not the index names it: mm bundle writes no such member, so the volume is not its own."""
    vol = _volume(disk)
    with tarfile.open(vol, "a", format=tarfile.GNU_FORMAT) as tf:
        member = tarfile.TarInfo(HOSTILE_MEMBERS[case])  # as named: tf.add would strip a leading /
        member.size = 5
        tf.addfile(member, io.BytesIO(b"evil\n"))
    proc = run_install(vol.parent, tmp_path, bare_python, str(tmp_path / "venv"))
    one_line(proc, 3, vol, "cannot read the wheelhouse from this volume")
    assert "\x1b" not in proc.stderr  # the name is shown escaped, never sent to the terminal
    assert not (tmp_path / "venv").exists()


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
