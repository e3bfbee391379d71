"""mm diagnose on the held-out corpora: logs in the formats users paste (Kubernetes CRI, docker json-file,
`docker logs --timestamps`, ANSI colour, TP-rank interleaving, kubelet events, docker health, journald, logfmt,
`kubectl logs --prefix`, compose) written from the messages' sources. tests/diagnose_heldout/ was committed before
any detector was changed for it; tests/diagnose_heldout2/ after those changes, and is run as it came;
tests/diagnose_heldout3/, written by an outside tester, gave 41/49 with one false alarm blind and is now seen (the
detectors were changed for the families behind its misses); tests/diagnose_heldout4/, written by another engineer
before any detector was tuned for it, gave 36/43 with no false alarm blind and is now seen likewise;
tests/diagnose_heldout5/, written by another engineer and run as it came, gave 47/54 with two false alarms blind and
is now seen likewise; tests/diagnose_heldout6/ and tests/diagnose_heldout7/, written by engineers who never saw the
detectors and run as they came, gave 35/42 and 32/38 with one false alarm each blind and are now seen likewise;
tests/diagnose_heldout8/ and tests/diagnose_heldout9/, written by engineers who never saw the detectors and run as they
came, gave 42/48 with no false alarm and 37/41 with two false alarms blind and are now seen likewise;
tests/diagnose_heldout10/, written by an engineer who never saw the detectors and run as it came, gave 30/36 with one
false alarm blind and is now seen likewise. tests/diagnose_heldout11/, written by another such engineer and run as it
came on the detectors that round ten left, gave 34/36 with no false alarm blind and is kept as it came: nothing was
tuned for it, so its figure stays a blind one, and it must not fall. tests/diagnose_heldout12/, written by another
such engineer and run as it came on the same detectors as round eleven, gave 31/36 with two false alarms blind and is
now seen likewise. tests/diagnose_heldout13/ and tests/diagnose_heldout14/, written by engineers who never saw the
detectors and run as they came on the detectors round twelve left, gave 35/36 and 27/35 with one false alarm each blind
and are now seen likewise. Their figures are reported apart from the tuned corpus (tests/test_diagnose_corpus.py), which says what the detectors were fitted to.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm.artifacts.serving.diagnose import DiagnoseRequest, run_diagnosis

ROUNDS = {name: Path(__file__).parent / name for name in (
    "diagnose_heldout", "diagnose_heldout2", "diagnose_heldout3", "diagnose_heldout4", "diagnose_heldout5",
    "diagnose_heldout6", "diagnose_heldout7", "diagnose_heldout8", "diagnose_heldout9", "diagnose_heldout10",
    "diagnose_heldout11", "diagnose_heldout12", "diagnose_heldout13", "diagnose_heldout14")}


def figures(corpus: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    cases: dict[str, dict] = json.loads((corpus / "index.json").read_text())["cases"]

    def rows(case: dict) -> list[str]:
        request = DiagnoseRequest(logfile=corpus / case["file"], engine=case.get("engine"))
        return [f.row for f in run_diagnosis(request).findings]
    failures = [n for n, c in cases.items() if c["expect"]]
    quiet = [n for n, c in cases.items() if not c["expect"]]
    missed = [n for n in failures if cases[n]["expect"] not in rows(cases[n])]
    alarms = [n for n in quiet if rows(cases[n])]
    return failures, quiet, missed, alarms


@pytest.mark.parametrize("name", ROUNDS)
def test_heldout_recall_and_false_alarms(name, capsys):
    failures, quiet, missed, alarms = figures(ROUNDS[name])
    with capsys.disabled():
        print(f"\n{name}: recall {len(failures) - len(missed)}/{len(failures)}, false alarms {len(alarms)}/{len(quiet)} "
              f"(traps and healthy); missed: {', '.join(missed) or 'none'}; alarms: {', '.join(alarms) or 'none'}")
    assert not alarms
    if name == "diagnose_heldout":  # the round the changes were made for; the second is reported as it came
        assert len(failures) - len(missed) >= 0.9 * len(failures)
    if name == "diagnose_heldout11":  # blind, never tuned for: its 34/36 as it came is the floor
        assert len(failures) - len(missed) >= 34
