"""What mm writes, chosen once: `--json` is every command's, so it may also come before the command."""
from __future__ import annotations

import json

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from tests.support.modelgen import write_model


def verified_model(tmp_path):
    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    manifest_for_local_dir(model, "o/r", "a" * 40, offline=True)
    return model


def test_json_before_the_command_is_the_commands_own_json(run_mm, tmp_path):
    model = verified_model(tmp_path)
    first, last = run_mm("--json", "verify", model, "--quick"), run_mm("verify", model, "--quick", "--json")
    assert first.returncode == last.returncode == 0, first.stderr
    doc, same = json.loads(first.stdout), json.loads(last.stdout)
    assert doc["ok"] is True and doc.keys() == same.keys()


def test_json_before_a_group_reaches_its_subcommand(run_mm, tmp_path):
    model = verified_model(tmp_path)
    r = run_mm("--json", "manifest", "export", model)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True


def test_a_user_error_with_json_first_is_one_json_document(run_mm, tmp_path):
    r = run_mm("--json", "verify", tmp_path)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 3 and str(tmp_path) in doc["error"]
