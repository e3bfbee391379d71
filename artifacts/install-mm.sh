#!/bin/sh
# install-mm.sh: install mm offline from the wheelhouse that came with the bundle. Needs only sh and python3.
#
#   sh install-mm.sh [DIR]        install into DIR (default ./mm-venv), then run DIR/bin/mm
#
# Run it where it lies: beside wheelhouse/ (an unpacked bundle payload, or `mm bundle --only-mm`), or beside the
# bundle's volume files (it then reads the wheelhouse out of volume 1 with python3's tarfile).
# It picks the wheel set for this machine and Python (linux-<x86_64|aarch64>-cp<XY>), installs with
# `python3 -m venv` + pip, or with the bundled uv when python3 has no venv/pip (Debian/Ubuntu without python3-venv);
# both run with --no-index --require-hashes against the set's requirements.lock: nothing comes from a network.
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

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

# The wheelhouse: beside this script, or inside the first volume beside it.
wheelhouse=
for candidate in "$here/wheelhouse" "$here/payload/mm/wheelhouse"; do
  if [ -f "$candidate/wheelhouse.json" ]; then wheelhouse=$candidate; break; fi
done
if [ -z "$wheelhouse" ]; then
  for vol in "$here"/*.vol001-of-*.tar; do
    [ -f "$vol" ] || continue
    say "reading the wheelhouse from $(basename "$vol")"
    "$py" - "$vol" "$tmp/wh" <<'PY' || exit 3
import os, sys, tarfile
vol, out = sys.argv[1], sys.argv[2]
def fail(why):
    sys.exit("install-mm.sh: %s: cannot read the wheelhouse from this volume (%s)" % (vol, why))
found = False
try:
    with tarfile.open(vol, "r:") as tf:
        for m in tf:
            parts = m.name.split("/")
            if "wheelhouse" not in parts or not m.isfile():
                continue
            rel = parts[parts.index("wheelhouse") + 1:]
            if not rel or any(p in ("", ".", "..") for p in rel) or m.name.startswith("/"):
                fail("unsafe member %r" % m.name)
            target = os.path.join(out, *rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tf.extractfile(m) as src, open(target, "wb") as dst:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    dst.write(chunk)
            found = True
except Exception as e:  # a damaged or hostile volume: one line, never a traceback
    fail("%s: %s" % (type(e).__name__, e))
if not found:
    fail("no wheelhouse in it")
PY
    wheelhouse="$tmp/wh"
    break
  done
fi
[ -n "$wheelhouse" ] || die 3 "no wheelhouse/ beside $here/install-mm.sh and no volume 1 (*.vol001-of-*.tar) there; run it from the bundle's first volume directory"

# Pick the set; say what the bundle holds when none fits this host.
holds=$(cd "$wheelhouse" && for d in linux-*; do [ -f "$d/requirements.lock" ] && printf '%s ' "$d"; done)
if [ ! -f "$wheelhouse/$set_name/requirements.lock" ]; then
  die 7 "no wheel set for this host ($set_name: $machine, CPython $pyver); the bundle holds: ${holds:-nothing}. Build one on the connected host with: mm bundle --only-mm --out DIR --target-platform linux/$machine --target-python $pyver"
fi
# The index came from a removable disk: read it as hostile (bounded, its shape checked), one line when it is not one.
glibc_ok=$("$py" - "$wheelhouse/wheelhouse.json" <<'PY'
import json, os, re, sys
path = sys.argv[1]
MAX_BYTES = 4 << 20


def bad(what):
    sys.stderr.write("install-mm.sh: %s: not a wheelhouse index (%s)\n" % (path, " ".join(str(what).split())[:200]))
    sys.exit(3)


try:
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
except OSError as e:
    bad("cannot read: %s" % (e.strerror or e))
if len(data) > MAX_BYTES:
    bad("bigger than %d MiB" % (MAX_BYTES >> 20))


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
if not isinstance(doc, dict) or doc.get("schema") != "mm-wheelhouse/1":
    bad("expected an object with schema 'mm-wheelhouse/1'")
need = doc.get("glibc_min")
if not isinstance(need, str) or not re.fullmatch(r"[0-9]{1,4}[.][0-9]{1,4}", need):
    bad("glibc_min: expected a version like 2.28")
sets = doc.get("sets")
if not isinstance(sets, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in sets):
    bad("sets: expected a list of objects with a name")
try:
    have = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    ok = tuple(map(int, have.split(".")[:2])) >= tuple(map(int, need.split(".")))
except (ValueError, OSError, AttributeError, IndexError):
    have, ok = "none", False
print("yes" if ok else "no glibc %s (the wheels need glibc %s or newer)" % (have, need))
PY
) || exit 3
[ "$glibc_ok" = yes ] || die 7 "this host has $glibc_ok; the bundle holds: $holds"
set_dir="$wheelhouse/$set_name"
lock="$set_dir/requirements.lock"

# Every wheel's bytes against the lock first, so that damage names its file before any installer runs.
"$py" - "$set_dir" "$lock" <<'PY' || exit 5
import glob, hashlib, os, sys
set_dir, lock = sys.argv[1:]
pinned = {}
try:
    with open(lock, encoding="utf-8") as f:
        for line in f:
            spec, _, digest = line.strip().partition(" --hash=sha256:")
            pinned[digest] = spec
except (OSError, UnicodeError) as e:  # the lock came from a removable disk: one line, never a traceback
    sys.exit("install-mm.sh: %s: not a readable lock file (%s: %s)" % (lock, type(e).__name__, e))
seen = set()
for path in sorted(glob.glob(os.path.join(set_dir, "*.whl"))):
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        sys.exit("install-mm.sh: %s: unreadable (%s)" % (path, e))
    if h.hexdigest() not in pinned:
        sys.exit("install-mm.sh: %s: sha256 %s is not in %s (damaged in transit?)" % (path, h.hexdigest(), lock))
    seen.add(h.hexdigest())
missing = sorted(spec for digest, spec in pinned.items() if digest not in seen)
if missing:
    sys.exit("install-mm.sh: %s: no wheel for %s" % (set_dir, ", ".join(missing)))
PY

[ ! -e "$dest" ] || [ -z "$(ls -A "$dest" 2>/dev/null)" ] || [ -x "$dest/bin/python" ] ||
  die 3 "$dest: exists and is not a virtual environment; name another directory"

# An existing mm-venv is upgraded in place: every wheel of the lock is installed again (same version, new bytes too).
reinstall=
[ -x "$dest/bin/mm" ] && reinstall=yes

install_pip() {  # returns 10 when this python3 cannot make a venv with pip (then uv takes over)
  "$py" -m venv "$dest" >"$tmp/venv.log" 2>&1 || return 10
  [ -x "$dest/bin/pip" ] || { echo "the venv it made has no pip" >"$tmp/venv.log"; return 10; }
  PIP_CONFIG_FILE=/dev/null "$dest/bin/python" -m pip --isolated install --quiet --disable-pip-version-check \
    --no-input --no-cache-dir --no-index --find-links "$set_dir" --require-hashes -r "$lock" ${reinstall:+--force-reinstall}
}

install_uv() {
  # Every wheel was checked against the lock above; the binary comes out of the uv wheel with python3's zipfile.
  "$py" - "$set_dir" "$tmp/uv" <<'PY' || return 1
import glob, os, sys, zipfile
set_dir, out = sys.argv[1:]
wheels = glob.glob(os.path.join(set_dir, "uv-*.whl"))
if len(wheels) != 1:
    sys.exit("install-mm.sh: no uv wheel in " + set_dir)
try:
    with zipfile.ZipFile(wheels[0]) as zf:
        names = [n for n in zf.namelist() if n.endswith(".data/scripts/uv")]
        if not names:
            sys.exit("install-mm.sh: %s: no uv binary in this wheel" % wheels[0])
        with zf.open(names[0]) as src, open(out, "wb") as dst:
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                dst.write(chunk)
except (OSError, zipfile.BadZipFile, EOFError) as e:
    sys.exit("install-mm.sh: %s: cannot take uv out of it (%s)" % (wheels[0], e))
os.chmod(out, 0o755)
PY
  "$tmp/uv" --no-config venv --quiet --offline --allow-existing --python "$(command -v "$py")" "$dest" &&
    "$tmp/uv" --no-config pip install --quiet --offline --no-index --find-links "$set_dir" --require-hashes \
      -r "$lock" --python "$dest/bin/python" ${reinstall:+--reinstall}
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
