"""mm diagnose against a corpus of real message text: tests/diagnose_corpus/.

Each case is a file (a server log, a saved answer or request, a terminal session) and an entry in index.json:
the row of the guide's troubleshooting table it must give (or null for a healthy or unrelated input), the source
its message text comes from (SGLang 0.5.23, MiniMax MSA, PyTorch, NCCL, vLLM 0.33.0, or the real output of
safetensors, requests, huggingface_hub and curl), the engine the user would name with --engine, and the launch
plan (`--model-dir DIR --hardware HW`) it is read with. Every case is diagnosed twice, without a plan and with
one: a failure must name its row (with a plan always; without one unless `needs_plan` says why not), a healthy
input must give nothing. The figures are printed by the last test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm.artifacts.serving.diagnose import DiagnoseRequest, load_table, run_diagnosis
from mm.artifacts.serving.launch import LaunchOptions
from tests.test_launch import VLLM_IMAGE, make_model_dir

CORPUS = Path(__file__).parent / "diagnose_corpus"
CASES: dict[str, dict] = json.loads((CORPUS / "index.json").read_text())["cases"]
FAILURES = sorted(n for n, c in CASES.items() if c["expect"])
HEALTHY = sorted(n for n, c in CASES.items() if not c["expect"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("corpus-models"))


def findings(name: str, model_dir: Path | None):
    case = CASES[name]
    plan = {}
    if model_dir is not None:
        spec = case.get("plan") or {"hardware": "b300", "engine": case.get("engine", "sglang")}
        engine = spec.get("engine", "sglang")
        plan = {"model_dir": model_dir, "launch": LaunchOptions(hardware=spec["hardware"], engine=engine,
                                                                image=VLLM_IMAGE if engine == "vllm" else None)}
    result = run_diagnosis(DiagnoseRequest(logfile=CORPUS / case["file"], engine=case.get("engine"), **plan))
    return result.findings


def test_the_corpus_covers_every_row_with_several_cited_variants_and_healthy_inputs():
    rows = {r.id for r in load_table().rows}
    per_row = {r: sum(1 for n in FAILURES if CASES[n]["expect"] == r) for r in rows}
    assert len(FAILURES) >= 60 and len(HEALTHY) >= 15
    assert min(per_row.values()) >= 4, per_row
    assert all(CASES[n]["source"] and (CORPUS / CASES[n]["file"]).is_file() for n in CASES)
    assert {p.name for p in CORPUS.iterdir()} == {c["file"] for c in CASES.values()} | {"index.json"}


@pytest.mark.parametrize("name", FAILURES)
def test_each_failure_names_its_row(name, model_dir):
    expect = CASES[name]["expect"]
    with_plan = [f.row for f in findings(name, model_dir)]
    assert expect in with_plan, with_plan
    assert set(with_plan) == {expect}, f"other rows named too: {with_plan}"
    without = [f.row for f in findings(name, None)]
    if CASES[name].get("needs_plan"):
        assert without == []  # absence of a line is evidence only for a recipe that prints it
    else:
        assert without == [expect]


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_or_unrelated_input_gives_no_finding(name, model_dir):
    assert findings(name, None) == ()
    assert findings(name, model_dir) == ()


def test_fixes_follow_the_engine_and_the_hardware(model_dir):
    [sglang] = findings("r10-sglang-effort-in-kwargs-curl", None)
    assert sglang.fix.startswith("send reasoning_effort as a top-level field")
    [vllm] = findings("r10-vllm-top-level-effort", None)
    assert "in chat_template_kwargs (the guide's vLLM row)" in vllm.fix
    [b200] = findings("r04-b200-oom", model_dir)
    assert b200.fix.startswith("use the B200 recipe from the SGLang configuration generator, not the B300 flags")
    [b300] = findings("r04-torch-oom-new-format", model_dir)
    assert "recipe sglang/b300/balanced runs --mem-fraction-static 0.8" in b300.fix


def test_a_request_is_judged_by_its_fields_not_its_text(model_dir, tmp_path):
    """A user message that quotes an error is no error; pretty-printed JSON is read whole."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Why do I get `CUDA out of memory` and "
                                        "thinking.type must be 'adaptive', 'enabled' or 'disabled'? <mm:think>"}]}
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body, indent=2) + "\n")
    assert run_diagnosis(DiagnoseRequest(logfile=path)).findings == ()


def test_recall_and_false_alarms(model_dir, capsys):
    def rate(with_plan: bool) -> tuple[int, int]:
        return (sum(CASES[n]["expect"] in [f.row for f in findings(n, model_dir if with_plan else None)] for n in FAILURES),
                sum(bool(findings(n, model_dir if with_plan else None)) for n in HEALTHY))
    (hit_plan, fa_plan), (hit_bare, fa_bare) = rate(True), rate(False)
    with capsys.disabled():
        print(f"\ndiagnose corpus: recall {hit_plan}/{len(FAILURES)} with a plan, {hit_bare}/{len(FAILURES)} without; "
              f"false alarms {fa_plan}/{len(HEALTHY)} with a plan, {fa_bare}/{len(HEALTHY)} without")
    assert hit_plan >= 0.9 * len(FAILURES) and fa_plan == 0 and fa_bare == 0


def test_a_structured_log_line_and_a_server_error_answer_are_read_as_evidence(tmp_path):
    log = tmp_path / "structured.log"
    log.write_text('{"level": "error", "msg": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."}\n'
                   + json.dumps({"object": "error", "message": "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda "
                                 "error", "code": 500}, indent=2) + "\n")
    assert [f.row for f in run_diagnosis(DiagnoseRequest(logfile=log)).findings] == ["cuda-oom", "nccl-hang"]
