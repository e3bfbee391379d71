#!/bin/sh
# install-mm.sh: install mm offline from the wheelhouse that came with the bundle. Needs only sh and python3.
#
#   sh install-mm.sh [DIR]        install into DIR (default ./mm-venv), then run DIR/bin/mm
#
# Run it where it lies: beside wheelhouse/ (an unpacked bundle payload, or `mm bundle --only-mm`), or beside the
# bundle's volume files (it then reads the wheelhouse out of volume 1 with python3's tarfile).
# It picks the wheel set for this machine and Python (linux-<x86_64|aarch64>-cp<XY>), installs with
# `python3 -m venv` + pip, or with the bundled uv when python3 has no venv/pip (Debian/Ubuntu without python3-venv);
# both run with --no-index --require-hashes against the set's requirements.lock, with no configuration or index of
# this host and proxies pointing nowhere: nothing comes from a network. The lock is checked line by line first.
# Environment: PYTHON (default python3), MM_INSTALL_WITH=pip|uv (default: pip, uv when venv/pip fail).
set -eu

say() { printf '%s\n' "install-mm.sh: $*" >&2; }
die() { code=$1; shift; say "$*"; exit "$code"; }

here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-./mm-venv}
py=${PYTHON:-python3}
with=${MM_INSTALL_WITH:-auto}

command -v "$py" >/dev/null 2>&1 || die 3 "$py: not found; mm needs CPython 3.10 or newer"
pytag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])') || die 3 "$py: does not run"
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
machine=$(uname -m)
case $machine in
  amd64) machine=x86_64 ;;
  arm64) machine=aarch64 ;;
esac
set_name="linux-$machine-$pytag"

# The checks run in python3's standard library (one helper, written to $tmp): everything read from the disk is
# hostile. A file must be regular (a FIFO never blocks it), its size is checked with fstat before a bounded read.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM
check="$tmp/check.py"
cat > "$check" <<'PY'
import glob, hashlib, json, os, re, stat, sys, tarfile

PROG = "install-mm.sh"
SCHEMA = "mm-wheelhouse/2"  # wheelhouse/wheels/ holds every set's wheels, each once; SET/requirements.lock names them
MAX_INDEX = 4 << 20       # wheelhouse.json: a few KB today
MAX_LOCK = 1 << 20        # requirements.lock: one line a wheel
MAX_WHEEL = 1 << 30       # mm's margin: the largest wheel of a set (uv's) is ~20 MB
MAX_MEMBERS = 1000000     # headers read from volume 1 before giving up
SET_NAME = re.compile(r"linux-(x86_64|aarch64)-cp3[0-9]{1,2}")
WHEEL_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]*[.]whl")
# A lock line is data: `name==version --hash=sha256:<64 hex>`, as mm wrote it. Nothing else reaches pip or uv.
LOCK_LINE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?==[A-Za-z0-9][A-Za-z0-9.+!_-]* --hash=sha256:[0-9a-f]{64}")


def fail(code, message):
    sys.stderr.write("%s: %s\n" % (PROG, " ".join(str(message).split())[:400]))
    sys.exit(code)


def kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_small(path, limit, code, what):
    """The bytes of PATH: a regular file (opening never blocks), at most LIMIT bytes (checked before reading)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        fail(code, "%s: %s (cannot read: %s)" % (path, what, e.strerror or e))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            fail(code, "%s: %s (%s, not a regular file)" % (path, what, kind(st.st_mode)))
        if st.st_size > limit:
            fail(code, "%s: %s (bigger than %d MiB)" % (path, what, limit >> 20))
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        fail(code, "%s: %s (cannot read: %s)" % (path, what, e.strerror or e))
    finally:
        os.close(fd)
    if len(data) > limit:
        fail(code, "%s: %s (bigger than %d MiB)" % (path, what, limit >> 20))
    return data


def parse_index(data, where):
    """wheelhouse.json, its shape checked: what the rest of the install trusts (names become paths)."""
    def bad(what):
        fail(3, "%s: not a wheelhouse index (%s)" % (where, what))

    def number(text):  # a long digit string costs quadratic time to convert (refused by CPython 3.11+, not 3.10)
        if len(text) > 64:
            bad("a number of %d digits" % len(text))
        return int(text)

    try:
        doc = json.loads(data.decode("utf-8"), parse_int=number)
    except RecursionError:
        bad("nested too deeply")
    except ValueError as e:  # not UTF-8, not JSON
        bad("not JSON: %s" % e)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        bad("expected an object with schema %r" % SCHEMA)
    need = doc.get("glibc_min")
    if not isinstance(need, str) or not re.fullmatch(r"[0-9]{1,4}[.][0-9]{1,4}", need):
        bad("glibc_min: expected a version like 2.28")
    sets = doc.get("sets")
    if not isinstance(sets, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in sets):
        bad("sets: expected a list of objects with a name")
    for s in sets:
        if not SET_NAME.fullmatch(s["name"]):
            bad("sets: %r is not a set name like linux-x86_64-cp311" % s["name"][:80])
        wheels = s.get("wheels")
        if not isinstance(wheels, list) or not all(
                isinstance(w, dict) and isinstance(w.get("file"), str) and WHEEL_FILE.fullmatch(w["file"])
                and type(w.get("size")) is int and 0 < w["size"] <= MAX_WHEEL for w in wheels):
            bad("sets: %s: wheels: expected a list of {file: NAME.whl, size: 1 to %d}" % (s["name"], MAX_WHEEL))
    return doc


def cmd_index(path):
    """Check the index; print whether this host's glibc is new enough."""
    doc = parse_index(read_small(path, MAX_INDEX, 3, "not a wheelhouse index"), path)
    need = doc["glibc_min"]
    try:
        have = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
        ok = tuple(map(int, have.split(".")[:2])) >= tuple(map(int, need.split(".")))
    except (ValueError, OSError, AttributeError, IndexError):
        have, ok = "none", False
    print("yes" if ok else "no glibc %s (the wheels need glibc %s or newer)" % (have, need))


def cmd_extract(vol, out, set_name):
    """From volume 1, only what the wheelhouse index names: the index, each set's lock, this host's wheels; each a
    plain member (no sparse, link or device member) of the size the index gives, checked before a byte is written."""
    def refuse(why):
        fail(3, "%s: cannot read the wheelhouse from this volume (%s)" % (vol, why))

    try:
        st = os.stat(vol)
        if not stat.S_ISREG(st.st_mode):
            refuse("%s, not a regular file" % kind(st.st_mode))
        with tarfile.open(vol, "r:") as tf:
            members = {}
            for n, m in enumerate(tf):
                if n >= MAX_MEMBERS:
                    refuse("more than %d members" % MAX_MEMBERS)
                why = unsafe_name(m.name)
                if why:  # mm never writes such a member: the volume is not what mm bundle wrote
                    refuse("member %s: %s" % (ascii(m.name[:200]), why))
                members.setdefault(m.name, []).append(m)
            index_names = [name for name in members if name == "wheelhouse/wheelhouse.json"
                           or name.endswith("/wheelhouse/wheelhouse.json")]
            if len(index_names) != 1:
                refuse("no wheelhouse in it" if not index_names else "more than one wheelhouse index")
            root = index_names[0][:-len("wheelhouse.json")]
            wanted = {root + "wheelhouse.json": ("the index", None, MAX_INDEX)}
            index_member = plain(members, root + "wheelhouse.json", None, MAX_INDEX, refuse)
            doc = parse_index(read_member(tf, index_member, refuse), "%s: %swheelhouse.json" % (vol, root))
            for s in doc["sets"]:
                wanted[root + s["name"] + "/requirements.lock"] = ("a lock", None, MAX_LOCK)
                if s["name"] == set_name:
                    for w in s["wheels"]:
                        wanted[root + "wheels/" + w["file"]] = ("a wheel", w["size"], w["size"])
            take = [(name, plain(members, name, size, limit, refuse)) for name, (_, size, limit) in sorted(wanted.items())
                    if name in members or size is not None]
            need = sum(m.size for _, m in take)
            os.makedirs(out, exist_ok=True)
            free = os.statvfs(out)
            if need > free.f_bavail * free.f_frsize:
                fail(7, "%s: %d bytes to unpack the wheelhouse into %s, %d free there (set TMPDIR to a larger disk)"
                     % (vol, need, out, free.f_bavail * free.f_frsize))
            for name, m in take:
                target = os.path.join(out, *name[len(root):].split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tf.extractfile(m)
                with open(target, "xb") as dst:
                    left = m.size
                    while left:
                        chunk = src.read(min(1 << 20, left))
                        if not chunk:
                            refuse("member %r: cut short" % m.name)
                        dst.write(chunk)
                        left -= len(chunk)
    except SystemExit:
        raise
    except Exception as e:  # a damaged or hostile volume: one line, never a traceback
        refuse("%s: %s" % (type(e).__name__, e))


def unsafe_name(name):
    """Why NAME is not a member name mm bundle writes (the rule of mm's check_relpath), or None: an absolute path,
    an empty, `.` or `..` part, a backslash or a control character (an ANSI escape, a newline, a NUL)."""
    import unicodedata

    if not name:
        return "an empty name"
    if name.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "not normalised or escapes the directory (an empty, . or .. part)"
    if any(c == "\\" or unicodedata.category(c) in ("Cc", "Cs") for c in name):
        return "a control character or backslash in the name"
    return None


def plain(members, name, size, limit, refuse):
    """The one member NAME: a plain file (not sparse), of SIZE bytes when the index gives it, else at most LIMIT."""
    found = members.get(name, [])
    if len(found) != 1:
        refuse("member %r: %s" % (name, "missing, though the index names it" if not found else "given twice"))
    m = found[0]
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.sparse is not None:
        refuse("member %r: not a plain file (tar type %r%s)" % (name, m.type, ", sparse" if m.sparse else ""))
    if size is not None and m.size != size:
        refuse("member %r: %d bytes where the index says %d" % (name, m.size, size))
    if m.size > limit:
        refuse("member %r: %d bytes, more than the %d allowed" % (name, m.size, limit))
    return m


def read_member(tf, m, refuse):
    data = tf.extractfile(m).read(m.size + 1)
    if len(data) != m.size:
        refuse("member %r: cut short" % m.name)
    return data


def cmd_lock(wheelhouse, set_name, set_dir, checked_lock):
    """The lock is data: every line `name==version --hash=sha256:...` (or a comment); the bytes of every wheel the
    index gives the set (under wheels/) in it, and each linked into SET_DIR, the only directory pip and uv see
    (they check the hashes again as they install). The lock's checked bytes go to CHECKED_LOCK, the file pip and
    uv read. Prints what the lock pins, one `name==version` a line."""
    lock = os.path.join(wheelhouse, set_name, "requirements.lock")
    doc = parse_index(read_small(os.path.join(wheelhouse, "wheelhouse.json"), MAX_INDEX, 3, "not a wheelhouse index"),
                      os.path.join(wheelhouse, "wheelhouse.json"))
    data = read_small(lock, MAX_LOCK, 5, "not a readable lock file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(5, "%s: not a readable lock file (UnicodeDecodeError: %s)" % (lock, e))
    # pip splits a requirements file with str.splitlines (\r, \f, \v, \x1c-\x1e, \x85, \u2028, \u2029 end a line
    # too), uv has its own rules: a byte outside printable ASCII could hide a line from this check that they read.
    # mm writes printable ASCII and \n only; anything else refuses the lock.
    odd = next((i for i, c in enumerate(text) if c != "\n" and not " " <= c <= "~"), None)
    if odd is not None:
        n = text.count("\n", 0, odd) + 1
        fail(3, "%s: line %d holds the character %s, not printable ASCII; the lock is data, never pip input: "
                "refused, nothing installed" % (lock, n, ascii(text[odd])))
    pinned = {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not LOCK_LINE.fullmatch(line):
            fail(3, "%s: line %d is not `name==version --hash=sha256:<64 hex digits>` (%r); the lock is data, "
                    "never pip input: refused, nothing installed" % (lock, n, line[:100]))
        spec, _, digest = line.partition(" --hash=sha256:")
        pinned[digest] = spec
    if not pinned:
        fail(3, "%s: no wheel in the lock; refused" % lock)
    seen = set()
    files = [w["file"] for s in doc["sets"] if s["name"] == set_name for w in s["wheels"]]
    os.makedirs(set_dir)
    for path in (os.path.join(wheelhouse, "wheels", f) for f in sorted(set(files))):
        h = hashlib.sha256()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    fail(5, "%s: not a regular file" % path)
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            fail(5, "%s: unreadable (%s)" % (path, e))
        if h.hexdigest() not in pinned:
            fail(5, "%s: sha256 %s is not in %s (damaged in transit?)" % (path, h.hexdigest(), lock))
        seen.add(h.hexdigest())
        os.symlink(os.path.abspath(path), os.path.join(set_dir, os.path.basename(path)))
    missing = sorted(spec for digest, spec in pinned.items() if digest not in seen)
    if missing:
        fail(5, "%s: no wheel for %s" % (os.path.join(wheelhouse, "wheels"), ", ".join(missing)))
    with open(checked_lock, "xb") as f:
        f.write(data)
    sys.stdout.write("".join(spec + "\n" for spec in sorted(pinned.values())))


def cmd_uv(set_dir, out):
    """The uv binary out of the (checked) uv wheel, with zipfile: bounded, never a traceback."""
    import zipfile

    wheels = glob.glob(os.path.join(set_dir, "uv-*.whl"))
    if len(wheels) != 1:
        fail(1, "no uv wheel in " + set_dir)
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            names = [n for n in zf.namelist() if n.endswith(".data/scripts/uv")]
            if not names:
                fail(1, "%s: no uv binary in this wheel" % wheels[0])
            with zf.open(names[0]) as src, open(out, "wb") as dst:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    dst.write(chunk)
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        fail(1, "%s: cannot take uv out of it (%s)" % (wheels[0], e))
    os.chmod(out, 0o755)


COMMANDS = {"index": cmd_index, "extract": cmd_extract, "lock": cmd_lock, "uv": cmd_uv}
try:
    COMMANDS[sys.argv[1]](*sys.argv[2:])
except SystemExit:
    raise
except BaseException as e:  # a bug here: still one line
    fail(3, "%s: %s" % (type(e).__name__, e))
PY

# pip and uv run with no way to the network: no index, find-links only the set's own directory, no configuration
# or PIP_*/UV_* variable of this host, and every proxy variable pointing at a port where nothing listens.
nowhere=http://127.0.0.1:9
offline() {
  (
    for var in $(env | sed -n -e 's/^\(PIP_[A-Za-z0-9_]*\)=.*/\1/p' -e 's/^\(UV_[A-Za-z0-9_]*\)=.*/\1/p'); do
      unset "$var"
    done
    unset NO_PROXY no_proxy
    PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_OFFLINE=1 UV_NO_CONFIG=1
    UV_PYTHON_DOWNLOADS=never http_proxy=$nowhere https_proxy=$nowhere HTTP_PROXY=$nowhere HTTPS_PROXY=$nowhere
    all_proxy=$nowhere ALL_PROXY=$nowhere
    export PIP_CONFIG_FILE PIP_NO_INDEX PIP_DISABLE_PIP_VERSION_CHECK UV_OFFLINE UV_NO_CONFIG UV_PYTHON_DOWNLOADS \
      http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY
    exec "$@"
  )
}

# The wheelhouse: beside this script, or inside the first volume beside it.
wheelhouse=
for candidate in "$here/wheelhouse" "$here/payload/mm/wheelhouse"; do
  if [ -e "$candidate/wheelhouse.json" ]; then wheelhouse=$candidate; break; fi
done
if [ -z "$wheelhouse" ]; then
  for vol in "$here"/*.vol001-of-*.tar; do
    [ -f "$vol" ] || continue
    say "reading the wheelhouse from $(basename "$vol")"
    "$py" "$check" extract "$vol" "$tmp/wh" "$set_name" || exit $?
    wheelhouse="$tmp/wh"
    break
  done
fi
[ -n "$wheelhouse" ] || die 3 "no wheelhouse/ beside $here/install-mm.sh and no volume 1 (*.vol001-of-*.tar) there; run it from the bundle's first volume directory"

# Pick the set; say what the bundle holds when none fits this host.
holds=$(cd "$wheelhouse" && for d in linux-*; do if [ -f "$d/requirements.lock" ]; then printf '%s ' "$d"; fi; done)
lock="$wheelhouse/$set_name/requirements.lock"
if [ -e "$lock" ] && [ ! -f "$lock" ]; then
  die 3 "$lock: not a regular file; the wheelhouse is damaged (copy it again)"
fi
if [ ! -f "$lock" ]; then
  die 7 "no wheel set for this host ($set_name: $machine, CPython $pyver); the bundle holds: ${holds:-nothing}. Build one on the connected host with: mm bundle --only-mm --out DIR --target-platform linux/$machine --target-python $pyver"
fi
# The index came from a removable disk: read it as hostile (bounded, its shape checked), one line when it is not one.
glibc_ok=$("$py" "$check" index "$wheelhouse/wheelhouse.json") || exit $?
[ "$glibc_ok" = yes ] || die 7 "this host has $glibc_ok; the bundle holds: $holds"
set_dir="$tmp/set"

# The lock is data: each line checked (exit 3 before pip or uv runs), then every wheel's bytes against it (exit 5);
# the set's wheels are linked into $set_dir, where pip and uv find them and nothing else.
"$py" "$check" lock "$wheelhouse" "$set_name" "$set_dir" "$tmp/requirements.lock" >/dev/null || exit $?
lock="$tmp/requirements.lock"

[ ! -e "$dest" ] || [ -z "$(ls -A "$dest" 2>/dev/null)" ] || [ -x "$dest/bin/python" ] ||
  die 3 "$dest: exists and is not a virtual environment; name another directory"

# An existing mm-venv is upgraded in place: every wheel of the lock is installed again (same version, new bytes too).
reinstall=
[ -x "$dest/bin/mm" ] && reinstall=yes

install_pip() {  # returns 10 when this python3 cannot make a venv with pip (then uv takes over)
  offline "$py" -m venv "$dest" >"$tmp/venv.log" 2>&1 || return 10
  [ -x "$dest/bin/pip" ] || { echo "the venv it made has no pip" >"$tmp/venv.log"; return 10; }
  offline "$dest/bin/python" -m pip --isolated install --quiet --disable-pip-version-check --no-input --no-cache-dir \
    --no-index --find-links "$set_dir" --only-binary :all: --require-hashes -r "$lock" ${reinstall:+--force-reinstall}
}

install_uv() {
  # Every wheel was checked against the lock above; the binary comes out of the uv wheel with python3's zipfile.
  "$py" "$check" uv "$set_dir" "$tmp/uv" || return 1
  offline "$tmp/uv" --no-config venv --quiet --offline --allow-existing --python "$(command -v "$py")" "$dest" &&
    offline "$tmp/uv" --no-config pip install --quiet --offline --no-index --find-links "$set_dir" --no-build \
      --require-hashes -r "$lock" --python "$dest/bin/python" ${reinstall:+--reinstall}
}

case $with in
  pip) install_pip || die 1 "pip install into $dest failed (see above)"; used=pip ;;
  uv) install_uv || die 1 "uv install into $dest failed (see above)"; used=uv ;;
  auto)
    rc=0
    install_pip || rc=$?
    if [ "$rc" -eq 0 ]; then
      used=pip
    elif [ "$rc" -ne 10 ]; then
      die 1 "pip install into $dest failed (see above)"
    else
      # venv's whole complaint on one line (Debian's ends with blank lines; its first line stops mid-sentence)
      why=$(tr -s ' \t\n' '   ' <"$tmp/venv.log" 2>/dev/null | cut -c1-300 | sed 's/ *$//')
      say "$py -m venv/pip not usable here (${why:-python3 -m venv failed without a word}); installing with the bundled uv"
      rm -rf "$dest"
      install_uv || die 1 "uv install into $dest failed (see above)"
      used=uv
    fi ;;
  *) die 2 "MM_INSTALL_WITH=$with: expected pip or uv" ;;
esac

version=$("$dest/bin/mm" --version) || die 1 "$dest/bin/mm does not run"
echo "installed $version into $dest ($set_name, with $used, offline)"
echo "next: $dest/bin/mm bundle verify <volumes>   (then mm unbundle, mm doctor, mm launch)"
