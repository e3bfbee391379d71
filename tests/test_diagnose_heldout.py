"""mm diagnose on the held-out corpus (tests/diagnose_heldout/): logs in the formats users paste (Kubernetes CRI,
docker json-file, `docker logs --timestamps`, ANSI colour, TP-rank interleaving, kubelet events, docker health)
written from the messages' sources before any detector was tuned on them. Its figures are reported apart from
the tuned corpus (tests/test_diagnose_corpus.py), since that one says what the detectors were fitted to.
"""
from __future__ import annotations

import json
from pathlib import Path

from mm.artifacts.serving.diagnose import DiagnoseRequest, run_diagnosis

HELDOUT = Path(__file__).parent / "diagnose_heldout"
CASES: dict[str, dict] = json.loads((HELDOUT / "index.json").read_text())["cases"]


def rows(name: str) -> list[str]:
    case = CASES[name]
    return [f.row for f in run_diagnosis(DiagnoseRequest(logfile=HELDOUT / case["file"], engine=case.get("engine"))).findings]


def test_heldout_recall_and_false_alarms(capsys):
    failures = [n for n, c in CASES.items() if c["expect"]]
    quiet = [n for n, c in CASES.items() if not c["expect"]]
    missed = [n for n in failures if CASES[n]["expect"] not in rows(n)]
    alarms = [n for n in quiet if rows(n)]
    with capsys.disabled():
        print(f"\nheld-out corpus: recall {len(failures) - len(missed)}/{len(failures)}, false alarms {len(alarms)}/"
              f"{len(quiet)} (traps and healthy); missed: {', '.join(missed) or 'none'}; alarms: {', '.join(alarms) or 'none'}")
    assert not alarms
    assert len(failures) - len(missed) >= 0.9 * len(failures)
