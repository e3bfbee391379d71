"""mm verify: real safetensors made here, a manifest hashed from them, then damage; the real CLI in a subprocess."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mm.artifacts.integrity import verify as verify_mod
from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.integrity.manifest import Manifest
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.safetensors_check import StructureError, read_header
from mm.artifacts.errors import BadValue
from mm.artifacts.integrity.verify import VerifyOptions, verify_dir
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm

REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
SHARD = "model-00002-of-00004.safetensors"
INDEX = "model.safetensors.index.json"
# Drop the capabilities that let root read any file, so permission bits mean what they say (tests run as root).
AS_UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def write_manifest_for(root: Path) -> Manifest:
    """A manifest hashed from ROOT's files as they are now (what `mm fetch` would have written)."""
    return manifest_for_local_dir(root, REPO, COMMIT, offline=True).manifest


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "MiniMax-M3.1-Flash"
    write_model(root, shards=4, shard_bytes=256 * 1024)
    write_manifest_for(root)
    return root


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    """A fresh copy of the generated model and its manifest, for this test to damage."""
    root = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(pristine, root, symlinks=True)
    return root


def assert_problem(r: subprocess.CompletedProcess, kind: str, path: str, *words: str) -> str:
    """Exit 1, the stderr summary, and a stdout line `KIND path: ...` holding WORDS; returns that line."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "problem(s) found" in r.stderr and "DAMAGED" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"{kind.upper():<10} {path}:")]
    assert lines, f"no {kind} line for {path} in:\n{r.stdout}"
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def problem_kinds(r: subprocess.CompletedProcess) -> set[str]:
    return {ln.split()[0] for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].isupper() and ln[10:11] == " "}


# --- content -----------------------------------------------------------------------------------

def test_intact_model_verifies_ok_with_exit_0(model):
    r = run_mm("verify", model)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "problem" not in r.stdout and r.stderr == ""


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_flipped_byte_is_a_hash_mismatch(model, where):
    shard = model / SHARD
    size = shard.stat().st_size
    flip_byte(shard, {"start": 0, "middle": size // 2, "end": size - 1}[where])
    r = run_mm("verify", model)
    assert_problem(r, "hash", SHARD, "blake3 expected", "found", "content differs")


def test_flipped_first_byte_also_breaks_the_header_structure(model):
    flip_byte(model / SHARD, 0)
    r = run_mm("verify", model)
    assert_problem(r, "structure", SHARD, "header")


def test_shard_truncated_by_one_byte_is_a_size_mismatch(model):
    shard = model / SHARD
    size = shard.stat().st_size
    os.truncate(shard, size - 1)
    r = run_mm("verify", model)
    assert_problem(r, "size", SHARD, f"expected {size} bytes, found {size - 1}", "1 bytes short")


def test_one_byte_appended_is_a_size_mismatch(model):
    shard = model / SHARD
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    r = run_mm("verify", model)
    assert_problem(r, "size", SHARD, f"expected {size} bytes, found {size + 1}", "1 bytes too long")


def test_missing_shard_is_reported_and_the_index_names_it(model):
    (model / SHARD).unlink()
    r = run_mm("verify", model)
    assert_problem(r, "missing", SHARD, "no such file")
    assert_problem(r, "index", INDEX, f"names shard {SHARD}", "which is missing")


def test_extra_file_is_reported(model):
    (model / "notes.txt").write_text("scratch\n")
    r = run_mm("verify", model, "--strict")  # without --strict it is reported and passes (tests/test_userpath.py)
    assert_problem(r, "extra", "notes.txt", "not in the manifest")


def test_tool_metadata_is_not_an_extra_file(model):
    (model / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "download" / "x.metadata").write_text("meta\n")
    (model / ".mm" / "B3SUMS").write_text("whatever\n")
    r = run_mm("verify", model)
    assert r.returncode == 0, r.stdout + r.stderr


def test_renamed_shard_is_missing_plus_an_extra_with_the_same_bytes(model):
    (model / SHARD).rename(model / "model-2.safetensors")
    r = run_mm("verify", model)
    assert_problem(r, "missing", SHARD)
    assert_problem(r, "extra", "model-2.safetensors", f"same bytes as missing {SHARD}", "renamed?")


def test_empty_file_is_reported_as_empty(model):
    size = (model / SHARD).stat().st_size
    os.truncate(model / SHARD, 0)
    r = run_mm("verify", model)
    assert_problem(r, "empty", SHARD, f"expected {size} bytes, found an empty file")


@pytest.mark.skipif(shutil.which("setpriv") is None and os.geteuid() == 0, reason="needs setpriv to drop root's read-any-file capability")
@pytest.mark.parametrize("quick", [False, True])
def test_permission_denied_file_is_unreadable(model, quick):
    (model / SHARD).chmod(0)
    r = run_mm("verify", model, *(["--quick"] if quick else []), prefix=AS_UNPRIVILEGED)
    assert_problem(r, "unreadable", SHARD, "Permission denied")


def test_symlink_escaping_the_directory_is_reported(model, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}\n")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(outside)
    r = run_mm("verify", model)
    assert_problem(r, "symlink", "tokenizer.json", "points outside the model directory", str(outside))
    assert "MISSING" not in r.stdout


def test_corrupt_header_with_a_manifest_made_from_it_is_caught_by_structure(model):
    shard = model / SHARD
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(t for t, info in header.items() if t != "__metadata__" and info["dtype"] == "BF16")
    header[name]["dtype"] = "U8"  # half the bytes the offsets span; the header only gets shorter
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # safetensors pads headers with spaces
    shard.write_bytes(data[:8] + raw + data[8 + n :])
    write_manifest_for(model)  # the damage is "blessed": sizes and hashes all match
    r = run_mm("verify", model)
    assert_problem(r, "structure", SHARD, f"tensor {name!r}", "U8", "needs")
    assert problem_kinds(r) == {"STRUCTURE"}


def _edit_index(model: Path, edit) -> None:
    index = json.loads((model / INDEX).read_text())
    edit(index["weight_map"])
    (model / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    write_manifest_for(model)


def test_index_naming_a_shard_that_does_not_exist_is_reported(model):
    _edit_index(model, lambda wm: wm.update({"model.extra.weight": "model-00009-of-00004.safetensors"}))
    r = run_mm("verify", model)
    assert_problem(r, "index", INDEX, "model-00009-of-00004.safetensors", "which is missing")


def test_shard_tensor_absent_from_the_index_is_reported(model):
    name = next(t for t, s in json.loads((model / INDEX).read_text())["weight_map"].items() if s == SHARD)
    _edit_index(model, lambda wm: wm.pop(name))
    r = run_mm("verify", model)
    assert_problem(r, "index", INDEX, "does not list", name, SHARD)


def test_index_tensor_absent_from_its_shard_is_reported(model):
    _edit_index(model, lambda wm: wm.update({"model.layers.99.ghost.weight": SHARD}))
    r = run_mm("verify", model)
    assert_problem(r, "index", INDEX, "model.layers.99.ghost.weight", f"to {SHARD}", "does not hold")


def test_draft_index_is_checked_like_the_main_one(model):
    (model / "dspark" / "model-00001-of-00001.safetensors").unlink()
    r = run_mm("verify", model)
    assert_problem(r, "index", "dspark/model.safetensors.index.json", "model-00001-of-00001.safetensors", "missing")


def test_config_naming_a_draft_that_is_absent_is_reported(model):
    shutil.rmtree(model / "dspark")
    write_manifest_for(model)
    r = run_mm("verify", model)
    assert_problem(r, "draft", "config.json", "names draft dspark/", "dspark/ is missing")


# --- options and output ------------------------------------------------------------------------

def test_quick_checks_sizes_but_reads_no_content(model):
    flip_byte(model / SHARD, (model / SHARD).stat().st_size // 2)
    r = run_mm("verify", model, "--quick")
    assert r.returncode == 0 and "nothing hashed" in r.stdout, r.stdout + r.stderr
    os.truncate(model / SHARD, 100)
    r = run_mm("verify", model, "--quick")
    assert_problem(r, "size", SHARD, "found 100")


def test_json_output_is_one_document_with_the_problems_and_exit_1(model):
    (model / SHARD).unlink()
    r = run_mm("verify", model, "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["counts"]["missing"] == 1
    assert {"path": SHARD, "kind": "missing", "detail": doc["problems"][0]["detail"]} in doc["problems"]


def test_json_output_of_a_good_model_is_ok_with_exit_0(model):
    r = run_mm("verify", model, "--json", "--jobs", "1")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["bytes_checked"] > 0


def test_manifest_option_reads_a_manifest_kept_elsewhere(model, tmp_path):
    elsewhere = tmp_path / "kept" / "manifest.json"
    elsewhere.parent.mkdir()
    manifest_path(model).rename(elsewhere)
    assert run_mm("verify", model, "--manifest", elsewhere).returncode == 0
    (model / SHARD).unlink()
    assert_problem(run_mm("verify", model, "--manifest", elsewhere), "missing", SHARD)


def test_no_manifest_cannot_run_exit_3(model):
    manifest_path(model).unlink()
    r = run_mm("verify", model)
    assert r.returncode == 3
    assert "no manifest here" in r.stderr and str(manifest_path(model)) in r.stderr


def test_not_a_directory_cannot_run_exit_3(tmp_path):
    r = run_mm("verify", tmp_path / "absent")
    assert r.returncode == 3 and "not a directory" in r.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None and os.geteuid() == 0, reason="needs setpriv to drop root's read-any-file capability")
def test_unreadable_directory_cannot_run_exit_3(model):
    model.chmod(0o300)  # may enter, may not list
    try:
        r = run_mm("verify", model, "--manifest", model.parent / "m.json", prefix=AS_UNPRIVILEGED)
    finally:
        model.chmod(0o755)
    assert r.returncode == 3
    assert "cannot read the model directory" in r.stderr and "Permission denied" in r.stderr


def test_upstream_without_repo_or_manifest_cannot_run_exit_3(model):
    manifest_path(model).unlink()
    r = run_mm("verify", "--upstream", model)
    assert r.returncode == 3 and "--upstream needs a repo and revision" in r.stderr


# --- library paths the small test model does not reach through the CLI --------------------------

def test_big_file_path_hashes_on_all_cores_and_finds_the_flip(model, monkeypatch):
    monkeypatch.setattr(verify_mod, "BIG_FILE", 1)  # every file takes the one-at-a-time, all-threads path
    assert verify_dir(model).ok
    flip_byte(model / SHARD, (model / SHARD).stat().st_size // 2)
    report = verify_dir(model, jobs=2)
    assert [(p.path, p.kind) for p in report.problems] == [(SHARD, "hash")]


def _shard_with_header(tmp_path: Path, header: dict, data_bytes: int) -> Path:
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


@pytest.mark.parametrize("tensors, data_bytes, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, 20, "gap of 4 bytes"),
    ({"a": {"dtype": "Q3", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype 'Q3'"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16, "data area is 16 bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4, "header length"),
    ({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 6 bytes"),
    ({"a": {"dtype": "F4", "shape": [4, 2], "data_offsets": [0, 4]}}, 4, None),
    ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, 8, r"unknown dtype \['F32'\]"),
    ({"a": {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype {'F32': 1}"),
])
def test_safetensors_layout_rules(tmp_path, tensors, data_bytes, message):
    path = _shard_with_header(tmp_path, tensors, data_bytes)
    if message == "header length":
        path.write_bytes(path.read_bytes()[:12])
    if message is None:
        assert read_header(path).tensors == frozenset(tensors)
        return
    with pytest.raises(StructureError, match=message):
        read_header(path)


def test_default_threads_are_the_cores_the_process_may_run_on():
    """A process pinned to one core (taskset, a container's cpuset) hashes on one thread, whatever the machine has."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from mm.artifacts.edges.interrupt import usable_cores; print(usable_cores(), os.cpu_count())")
    used, machine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert used == "1" and int(machine) >= 1


def test_a_dtype_that_is_a_list_is_one_structure_line_not_a_crash(model):
    shard = model / SHARD
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(t for t in header if t != "__metadata__")
    header[name]["dtype"] = [header[name]["dtype"]]  # JSON's list: no key of the dtype table
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    write_manifest_for(model)  # sizes and hashes match: only the header's structure is wrong
    r = run_mm("verify", "--quick", model)
    assert "Traceback" not in r.stderr
    assert_problem(r, "structure", SHARD, f"tensor {name!r}", "unknown dtype [")


def test_verify_refuses_while_another_process_writes_the_directory_exit_6(model):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mm.artifacts.edges.fsutil import dir_lock\n"
                               "with dir_lock(sys.argv[1], 'mm fetch'):\n    print('held', flush=True); time.sleep(60)", str(model)],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        r = run_mm("verify", model)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 6
    assert f"process {holder.pid} is writing it" in r.stderr
    assert run_mm("verify", model).returncode == 0  # the lock dies with its holder


def test_verify_inside_the_lock_holder_itself_runs(model):
    from mm.artifacts.edges.fsutil import dir_lock
    with dir_lock(model, "mm unbundle"):
        assert verify_dir(model).ok


def test_draft_directory_symlinked_outside_is_one_symlink_problem(model, tmp_path):
    shutil.move(model / "dspark", tmp_path / "dspark-elsewhere")
    (model / "dspark").symlink_to(tmp_path / "dspark-elsewhere")
    r = run_mm("verify", model)
    assert_problem(r, "symlink", "dspark", "points outside the model directory")
    assert "MISSING" not in r.stdout


def on_a_terminal(argv: list[str]) -> subprocess.CompletedProcess:
    """ARGV under util-linux `script`, so its stdout and stderr are a pseudo-terminal."""
    return subprocess.run(["script", "-qec", shlex.join(argv), "/dev/null"], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pseudo-terminal")
def test_progress_bar_shows_on_a_terminal_and_not_in_json(model):
    tty = on_a_terminal(mm_argv("verify", model))
    assert tty.returncode == 0 and "━" in tty.stdout and "OK" in tty.stdout
    js = on_a_terminal(mm_argv("verify", "--json", model))
    assert js.returncode == 0 and "━" not in js.stdout and '"ok": true' in js.stdout


def _expected(name: str, mib: int, algorithm: str = "blake3") -> verify_mod.Expected:
    return verify_mod.Expected(path=name, size=mib << 20, algorithm=algorithm, digest="0" * 64)


def test_shards_of_similar_size_are_hashed_one_per_core_and_the_odd_ones_on_all_cores():
    shards = [_expected(f"model-{i}.safetensors", 5000 + i) for i in range(5)]  # 5 shards, 2 cores
    draft, index = _expected("dspark/model.safetensors", 900), _expected("model.safetensors.index.json", 1)
    per_core, one_at_a_time = verify_mod.hash_schedule([index, draft, *shards], jobs=2)
    assert [e.path for e in per_core] == [f"model-{i}.safetensors" for i in (4, 3, 2, 1)] + [index.path]
    assert [e.path for e in one_at_a_time] == ["model-0.safetensors", "dspark/model.safetensors"]


def test_files_too_small_to_share_the_cores_are_hashed_one_after_another_in_one_thread():
    files = [verify_mod.Expected(f"tokenizer/{i}.json", 1024, "blake3", "0" * 64) for i in range(3)]
    per_core, one_at_a_time = verify_mod.hash_schedule([*files, _expected("vocab.json", 1)], jobs=2)
    assert [e.path for e in per_core] == ["vocab.json"] and one_at_a_time == files


def test_a_round_of_very_unequal_files_is_not_hashed_one_per_core():
    per_core, all_cores = verify_mod.hash_schedule([_expected("big", 8000), _expected("small", 2000)], jobs=2)
    assert per_core == [] and [e.path for e in all_cores] == ["big", "small"]


def test_hub_identities_are_always_hashed_one_per_core():
    files = [_expected("a", 5000, "lfs-sha256"), _expected("b", 100, "lfs-sha256")]
    per_core, all_cores = verify_mod.hash_schedule(files, jobs=2)
    assert [e.path for e in per_core] == ["a", "b"] and all_cores == []


@pytest.mark.parametrize("given, message", [
    (dict(label_node="node-1", quick=True), "--label-node needs a full verify of DIR against its own manifest"),
    (dict(label_node="node-1", upstream=True), "--label-node needs a full verify of DIR against its own manifest"),
    (dict(upstream=True, allowed_signers=Path("signers")), "--allowed-signers checks the manifest; --upstream does"),
    (dict(repo="a/b"), "--repo and --revision only apply with --upstream"),
])
def test_verify_options_that_do_not_go_together_are_a_usage_error(given, message):
    with pytest.raises(BadValue, match=message) as e:
        VerifyOptions.from_cli(**given)
    assert e.value.exit_code == 2
    assert VerifyOptions.from_cli(upstream=True, repo="a/b", revision="main").upstream


def test_a_kernel_without_madv_populate_read_hashes_the_same_windows_by_faults(tmp_path, monkeypatch):
    import blake3

    from mm.artifacts.integrity import reading
    from mm.artifacts.integrity.hashing import blake3_file
    data = os.urandom(3 * 1024 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(reading, "MADV_POPULATE_READ", 1000)  # no such advice: EINVAL, as from a kernel before 5.14
    monkeypatch.setattr(reading, "_populate_refused", False)
    assert blake3_file(tmp_path / "f", window=1024 * 1024) == blake3.blake3(data).hexdigest()
    assert reading._populate_refused


def test_the_summary_counts_one_file_in_the_singular(tmp_path):
    root = tmp_path / "one"
    root.mkdir()
    (root / "config.json").write_text("{}")
    manifest_for_local_dir(root, "acme/one", "0123456789abcdef0123456789abcdef01234567", offline=True)
    r = run_mm("verify", root)
    assert r.returncode == 0 and ": 1 file, 2 B hashed" in r.stdout, r.stdout
