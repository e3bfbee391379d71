#!/usr/bin/env bash
# The wheel, as a user gets it: build it, install it (not editable) into a fresh venv outside the checkout,
# and run mm from a directory outside the checkout: --version, a pin read by `mm launch`, `mm verify`.
# Usage: tests/wheel_check.sh PYTHON   (PYTHON builds the wheel and makes the venv)
set -euo pipefail
python=${1:-python3}
checkout=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/mm-wheel-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "wheel check: $*" >&2; exit 1; }

# A clean copy of the sources (tracked and new files, nothing ignored), so no stale build/ leaks in.
mkdir "$work/src"
if git -C "$checkout" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$checkout" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$work/src"
else
  cp -r "$checkout/." "$work/src/" && rm -rf "$work/src/build" "$work/src/.venv"
fi
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(echo "$work"/dist/mm-*.whl)
[ -f "$wheel" ] || fail "no wheel built"

# Nothing but mm/ and the dist-info at the top of site-packages.
top=$("$python" - "$wheel" <<'PY'
import sys, zipfile
print(" ".join(sorted({n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))
PY
)
[[ "$top" =~ ^mm\ mm-[^\ ]+\.dist-info$ ]] || fail "wheel top level is '$top', expected mm and its dist-info"

"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel"   # not editable; dependencies from the package index
mm="$work/venv/bin/mm"

# A small model directory (real safetensors headers) with a manifest, all outside the checkout.
run="$work/run" && mkdir -p "$run/model/dspark"
cd "$run"
"$work/venv/bin/python" - <<'PY'
import json, struct
def shard(path):
    data = bytes(range(16))
    header = json.dumps({"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)
shard("model/model.safetensors")
shard("model/dspark/model.safetensors")
with open("model/config.json", "w") as f:
    f.write('{"model_type": "wheel-check"}\n')
PY
revision=$("$work/venv/bin/python" -c "from mm.artifacts.pins import default_pin; print(default_pin().revision)")
repo=$("$work/venv/bin/python" -c "from mm.artifacts.pins import default_pin; print(default_pin().repo_id)")
image=$("$work/venv/bin/python" -c "from mm.artifacts.pins import default_pin; print(default_pin().image)")

version=$("$mm" --version) || fail "mm --version failed"
[[ "$version" == *"version 0."* ]] || fail "mm --version printed '$version'"
"$mm" manifest model --repo "$repo" --revision "$revision" --offline >/dev/null || fail "mm manifest --offline failed"
script=$("$mm" launch model --hardware b300) || fail "mm launch failed"
[[ "$script" == *"docker run"* && "$script" == *"$image"* && "$script" == *"--name minimax-m3-1-flash"* ]] \
  || fail "mm launch did not render the pinned start script"
verified=$("$mm" verify model) || fail "mm verify failed"
[[ "$verified" == *" OK"* ]] || fail "mm verify printed '$verified'"
python_path=$("$work/venv/bin/python" -c "import mm.cli; print(mm.cli.__file__)")
[[ "$python_path" == "$work/venv/"* ]] || fail "mm imported from $python_path, not the fresh venv"
echo "wheel check: OK ($(basename "$wheel"): mm --version, launch from the pin, verify, from $run)"
