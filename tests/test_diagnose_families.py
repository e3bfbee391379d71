"""mm diagnose on tests/diagnose_families/: one case per member of the families of misses the blind held-out rounds
showed (client-side pastes, the guide's messages in a writer's own words, input formats, lines wrapped by a ticket
or a terminal, a note before the log) and the traps beside them (what must stay quiet). Each case was written
before the detector change it tests; a failure must name its row and no other, a trap must give nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm.artifacts.serving.diagnose import DiagnoseRequest, run_diagnosis

CORPUS = Path(__file__).parent / "diagnose_families"
CASES: dict[str, dict] = json.loads((CORPUS / "index.json").read_text())["cases"]


def rows(name: str) -> list[str]:
    case = CASES[name]
    return [f.row for f in run_diagnosis(DiagnoseRequest(logfile=CORPUS / case["file"], engine=case.get("engine"))).findings]


def test_every_file_is_a_case():
    assert {p.name for p in CORPUS.iterdir()} == {c["file"] for c in CASES.values()} | {"index.json"}
    assert all(c["source"] for c in CASES.values())


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c["expect"]))
def test_a_family_member_names_its_row(name):
    assert rows(name) == [CASES[name]["expect"]]


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c["expect"]))
def test_a_trap_gives_nothing(name):
    assert rows(name) == []
