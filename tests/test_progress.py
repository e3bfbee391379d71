"""Progress and units: one live bar per phase that leaves one summary line when it ends, figures
restic shows (percent, bytes, rate, elapsed, ETA, the current file), never past 100%, decimal units throughout.

What a user sees is read on a real pseudo-terminal (tests/support/tty.py: `script`, then pyte plays the bytes
back); what each phase counts is read with a recording sink, since the bar itself never draws past its total.
"""
from __future__ import annotations

import io
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.bundle.repair import repair_volumes
from mm.artifacts.bundle.unpack import UnbundleOptions, unbundle
from mm.artifacts.units import human_bytes, human_duration, human_rate
from mm.artifacts.edges.progress import (ETA_MIN_BYTES, ETA_MIN_SECONDS, PeriodicProgress, TerminalProgress, eta,
                                         phase_summary)
from tests.support.modelgen import write_model
from tests.support.run import run_mm
from tests.support.tty import run_on_tty
from tests.test_bundle_parity import flip_byte_in_member
from tests.test_repair import flip_middle_byte

VOLUME_SIZE = 500_000
REVISION = "ce7f4df87d2e05262f5775f373dac4772f134041"
NAME = f"MiniMax-M3.1-Flash-{REVISION[:12]}"
BAR_GLYPHS = re.compile("[━╸╺]")  # rich's bar: on the final screen, none may be left
UNIT = re.compile(r"\d(?:\.\d)? ?(B|kB|MB|GB|TB|KiB|MiB|GiB|TiB|KB)\b")


class Recorder:
    """A ProgressSink keeping, for each phase, [label, total, bytes advanced] (thread-safe)."""

    def __init__(self):
        self.phases: list[list] = []
        self.items: set[str] = set()
        self._open = False
        self._lock = threading.Lock()

    def begin(self, total_bytes, label, files=None):
        with self._lock:
            if self._open:
                self.phases[-1][:2] = [label, total_bytes]
            else:
                self.phases.append([label, total_bytes, 0])
                self._open = True

    def advance(self, nbytes):
        with self._lock:
            if self._open:
                self.phases[-1][2] += nbytes

    def item(self, name):
        self.items.add(name)

    def item_done(self, name):
        pass

    def note(self, message):
        pass

    def end(self):
        self._open = False


def assert_each_phase_counts_its_total(rec: Recorder) -> None:
    assert rec.phases
    for label, total, advanced in rec.phases:
        assert advanced == total, f"{label}: {advanced} of {total}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "model"
    write_model(root, shards=3, shard_bytes=600 * 1024)
    manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", REVISION, offline=True)
    return root


@pytest.fixture(scope="module")
def bundled(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("progress-vols")
    create_bundle(model, BundleOptions((out,), VOLUME_SIZE, parity=2, sync=False))
    return out


@pytest.fixture
def vols(bundled, tmp_path) -> Path:
    d = tmp_path / "vols"
    shutil.copytree(bundled, d)
    return d


class Clock:
    """A clock the test moves: the sinks read elapsed time, rate and ETA from it (no test waits)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status_sink(clock: Clock, as_json: bool = False) -> tuple[PeriodicProgress, list[str]]:
    """A periodic sink whose interval never comes (the test asks for its status line itself)."""
    lines: list[str] = []
    return PeriodicProgress(lines.append, 86400, as_json=as_json, clock=clock), lines


def eta_of(line: str) -> str:
    return re.search(r"ETA (\S+)", line)[1]


def test_the_eta_waits_until_the_rate_is_measured_over_enough_time_and_bytes():
    clock = Clock()
    sink, _ = status_sink(clock)
    sink.begin(250 * 10**9, "fetch big")
    clock.now += 1
    sink.advance(2_500_000)  # a slow first second (connection set-up): 2.5 MB/s would say 27 hours
    assert eta_of(sink.status()) == "-:--:--"
    clock.now += ETA_MIN_SECONDS - 1
    sink.advance(ETA_MIN_BYTES)
    assert eta_of(sink.status()) != "-:--:--"  # measured over 5 s and 12.5 MB: now it may guess
    sink.end()
    assert [eta(5 * 10**6, 10**9, 10**6, 100.0), eta(10**9, 10**9, 10**6, 4.9)] == [None, None]
    assert eta(10**7, 10**9, 10**6, ETA_MIN_SECONDS) == pytest.approx(990)
    assert eta(2 * 10**6, 10**7, 10**5, 6.0) == pytest.approx(80)  # a small phase: a tenth of it is enough


def test_a_phase_that_counts_blobs_says_blobs_not_files():
    clock = Clock()
    sink, _ = status_sink(clock)
    sink.begin(2_000_000, "preheat models/flash@262264aa5062 at 2 tier(s)", files=16, unit="blob")
    clock.now += 1
    sink.advance(1_000_000)
    assert "0/16 blobs" in sink.status()
    assert sink.status(final=True).startswith("preheat models/flash@262264aa5062 at 2 tier(s): 16 blobs, 1.0 MB")


def test_the_current_file_line_names_what_is_in_flight_not_the_first_file_begun():
    clock = Clock()
    sink, _ = status_sink(clock)
    sink.begin(4000, "fetch repo", files=4)
    for name in ("a.safetensors", "b.safetensors", "c.safetensors"):
        sink.item(name)
    sink.item_done("c.safetensors")  # the newest is over; a and b are still coming
    line = sink.status()
    assert line.endswith("  b.safetensors (+1 more in flight)") and "  1/4 files" in line, line
    sink.item_done("b.safetensors")
    sink.item("d.safetensors")
    assert sink.status().endswith("  d.safetensors (+1 more in flight)")
    sink.item_done("a.safetensors")
    sink.item_done("d.safetensors")
    assert sink.status().endswith("  4/4 files")  # nothing in flight: no file named
    sink.end()
    one_at_a_time, _ = status_sink(clock, as_json=True)
    one_at_a_time.begin(3000, "bundle x", files=3)
    one_at_a_time.item("v1")
    one_at_a_time.item("v2")  # a caller that never says item_done: its newest is its current file
    event = json.loads(one_at_a_time.status())
    assert (event["current_files"], event["files_done"]) == (["v2"], 1)
    one_at_a_time.end()


def test_the_terminal_line_names_what_is_in_flight():
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    sink = TerminalProgress(console, clock=Clock())
    sink.begin(3000, "verify x", files=3)
    for name in ("a.safetensors", "b.safetensors"):
        sink.item(name)
    sink.item_done("b.safetensors")
    with console.capture() as shown:
        console.print(*sink._live[0].get_renderables())
    assert "  a.safetensors" in shown.get() and "b.safetensors" not in shown.get()
    sink.end()


def test_a_phase_cut_short_by_an_interrupt_leaves_no_summary_line():
    from rich.console import Console

    from mm.artifacts.edges import interrupt

    clock = Clock()
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    terminal, periodic = TerminalProgress(console, clock=clock), status_sink(clock)
    periodic[0]._wrote = True  # as if an interval had passed: its summary would follow
    for sink in (terminal, periodic[0]):
        sink.begin(1000, "fetch repo")
        sink.advance(400)
    interrupt.STOP.set()
    try:
        terminal.end()
        periodic[0].end()
    finally:
        interrupt.STOP.clear()
    assert "fetch repo:" not in console.file.getvalue() and periodic[1] == []
    terminal.begin(1000, "fetch repo")
    terminal.end()  # not interrupted: the summary stays
    assert "fetch repo: 0 B in " in console.file.getvalue()


# --- units --------------------------------------------------------------------------------------------------

def test_one_decimal_unit_system():
    assert human_bytes(150_000_000) == "150.0 MB"  # --volume-size 150M, as given (was 143.0 MiB)
    assert [human_bytes(n) for n in (0, 999, 1000, 999_949, 999_950, 252 * 10**9, 4 * 10**12)] == [
        "0 B", "999 B", "1.0 kB", "999.9 kB", "1.0 MB", "252.0 GB", "4.0 TB"]
    assert human_rate(614_400_000) == "614.4 MB/s"
    assert [human_duration(s) for s in (0.04, 12.34, 192, 7380)] == ["0.0 s", "12.3 s", "3 min 12 s", "2 h 03 min"]
    assert phase_summary("verify", 628_900_000, 1.5, 14) == "verify: 14 files, 628.9 MB in 1.5 s (419.3 MB/s)"


def test_a_run_speaks_one_unit_system(model, vols, tmp_path):
    """The plan, the volumes, the summaries, verify and unbundle: MB and MB/s, never MiB (--json stays in bytes)."""
    runs = [run_mm("bundle", model, "--out", tmp_path / "out", "--volume-size", "1.5M"),
            run_mm("bundle", "verify", tmp_path / "out"), run_mm("verify", model),
            run_mm("unbundle", tmp_path / "out", "--dest", tmp_path / "dest")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    text = "\n".join(r.stdout + r.stderr for r in runs)
    assert "of up to 1.5 MB" in text
    assert {m.group(1) for m in UNIT.finditer(text)} <= {"B", "kB", "MB", "GB"} and "iB" not in text
    assert re.search(r"hashed at \d+\.\d (kB|MB|GB)/s", text)


def test_long_commands_end_with_files_bytes_and_time_off_a_terminal_too(model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(model, copy, ignore=shutil.ignore_patterns(".mm"))
    ends = {"manifest": (("manifest", copy, "--repo", "MiniMaxAI/MiniMax-M3.1-Flash", "--revision", REVISION,
                          "--offline"), r"13 files \(2\.2 MB\) hashed in \d+\.\d s "),
            "bundle": (("bundle", model, "--out", tmp_path / "out", "--volume-size", VOLUME_SIZE),
                       r"5 volume\(s\), 2\.\d MB on disk, in \d+\.\d s; model: 13 file\(s\), 2\.2 MB carried\."),
            "bundle verify": (("bundle", "verify", tmp_path / "out"),
                              r"checked 5 volume file\(s\), 2\.\d MB on disk: 2\.\d MB of members hashed .* in \d+\.\d s"),
            "unbundle": (("unbundle", tmp_path / "out", "--dest", tmp_path / "dest"),
                         r"13 file\(s\) imported, .* in \d+\.\d s\.\n.*OK \(13 files, 2\.2 MB: ")}
    for what, (args, pattern) in ends.items():
        r = run_mm(*args)
        assert r.returncode == 0 and re.search(pattern, r.stdout), (what, r.stdout, r.stderr)


# --- what each phase counts ----------------------------------------------------------------------------------

def test_bundle_with_parity_counts_each_phase_to_its_total(model, tmp_path):
    rec = Recorder()
    create_bundle(model, BundleOptions((tmp_path / "out",), VOLUME_SIZE, parity=2, sync=False), progress=rec)
    assert [p[0] for p in rec.phases] == [f"bundle {NAME}", f"parity {NAME}"]
    assert_each_phase_counts_its_total(rec)  # the parity phase went to 750/629 MB: padding counted as read
    assert "model-00001-of-00003.safetensors" in rec.items


def test_a_rerun_over_a_damaged_volume_counts_its_bytes_once(model, vols):
    flip_byte_in_member(sorted(vols.glob("*.vol003-*.tar"))[0], "segments/")
    rec = Recorder()
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, sync=False), progress=rec)
    assert_each_phase_counts_its_total(rec)


def test_unbundle_rebuilding_past_a_damaged_parity_stream_counts_each_phase_once(vols, tmp_path):
    flip_byte_in_member(sorted(vols.glob("*.par001-*.tar"))[0], "parity/")
    sorted(vols.glob("*.vol003-*.tar"))[0].unlink()
    rec = Recorder()
    report = unbundle([vols], tmp_path / "dest", UnbundleOptions(sync=False), progress=rec)
    assert report.ok and report.rebuilt == [3]
    # no "verify" phase: every file was hashed on its way to disk, the final check reads none again
    assert [p[0] for p in rec.phases] == [f"unbundle {NAME}", "rebuild volume(s) 3", "unbundle rebuilt volume(s) 3"]
    assert_each_phase_counts_its_total(rec)  # the rebuild ran twice (parity 1 left out): counted once


def test_repair_volume_counts_each_phase_to_its_total(vols):
    sorted(vols.glob("*.vol002-*.tar"))[0].unlink()
    sorted(vols.glob("*.par002-*.tar"))[0].unlink()
    rec = Recorder()
    repair_volumes([vols], sync=False, progress=rec)
    assert [p[0] for p in rec.phases] == ["check volumes", "rebuild volume 2", "parity 2"]
    assert_each_phase_counts_its_total(rec)


# --- on a terminal ---------------------------------------------------------------------------------------------

def summaries(screen: list[str], label: str) -> list[str]:
    return [line for line in screen if line.startswith(f"{label}: ")]


def assert_no_bar_left_and_never_past_100(run) -> None:
    assert not [line for line in run.screen if BAR_GLYPHS.search(line) or " ETA " in line], run.text
    for frame in run.frames:
        for percent in re.findall(r"(\d+)%", frame):
            assert int(percent) <= 100, frame


def test_bundle_with_parity_on_a_terminal(model, tmp_path):
    run = run_on_tty("bundle", model, "--out", tmp_path / "out", "--volume-size", VOLUME_SIZE, "--parity", "2")
    assert run.returncode == 0, run.text
    assert_no_bar_left_and_never_past_100(run)
    assert run.screen[0] == "plan: model: 13 file(s), 2.2 MB carried"
    assert run.screen[1].startswith("  in 5 volume(s) of up to 500.0 kB")
    (bundle,), (parity,) = summaries(run.screen, f"bundle {NAME}"), summaries(run.screen, f"parity {NAME}")
    assert re.fullmatch(rf"bundle {NAME}: 13 files, 2\.2 MB in \d+\.\d s( \(.+/s\))?", bundle)
    assert re.fullmatch(rf"parity {NAME}: 5 files, 2\.3 MB in \d+\.\d s( \(.+/s\))?", parity)
    bars = [f for f in run.frames if f.startswith(f"bundle {NAME} ") and "%" in f]
    assert bars and re.search(r"  0%\s+0 B / 2\.2 MB", bars[0])  # shown from the first byte
    assert all(re.search(r"\d+%\s+\S+ \S+ / \S+ \S+\s+\S+ \S+/s\s+\d:\d\d:\d\d ETA", f) for f in bars)
    assert any(re.fullmatch(r"  [\w./-]+\.(safetensors|json)", f) for f in run.frames)  # the current file
    assert run.frames[-1].startswith(f"bundle {NAME} (id ") and "; model: 13 file(s), 2.2 MB carried." in run.frames[-1]


def test_unbundle_with_a_parity_rebuild_on_a_terminal(vols, tmp_path):
    sorted(vols.glob("*.vol002-*.tar"))[0].unlink()
    run = run_on_tty("unbundle", vols, "--dest", tmp_path / "dest")
    assert run.returncode == 0, run.text
    assert_no_bar_left_and_never_past_100(run)
    for label in (f"unbundle {NAME}", "rebuild volume(s) 2", "unbundle rebuilt volume(s) 2"):
        assert len(summaries(run.screen, label)) == 1, (label, run.text)
    assert not summaries(run.screen, "verify"), run.text  # nothing to read again: no bar


def test_repair_volume_on_a_terminal(vols):
    sorted(vols.glob("*.vol004-*.tar"))[0].unlink()
    sorted(vols.glob("*.par001-*.tar"))[0].unlink()
    run = run_on_tty("bundle", "repair-volume", vols)
    assert run.returncode == 0, run.text
    assert_no_bar_left_and_never_past_100(run)
    for label in ("check volumes", "rebuild volume 4", "parity 1"):
        assert len(summaries(run.screen, label)) == 1, (label, run.text)
    assert re.fullmatch(rf"bundle {NAME}: 2 volume file\(s\) written, \d+\.\d kB, in \d+\.\d s", run.screen[-1])


def test_bundle_verify_on_a_terminal_ends_with_files_bytes_and_time(bundled):
    run = run_on_tty("bundle", "verify", bundled)
    assert run.returncode == 0, run.text
    assert_no_bar_left_and_never_past_100(run)
    assert len(summaries(run.screen, "bundle verify")) == 1
    assert any(re.fullmatch(r"checked 7 volume file\(s\), 3\.\d MB on disk: 3\.\d MB of members hashed \(.*\) in \d+\.\d s", line) for line in run.screen)


def test_repair_on_a_terminal_leaves_one_line_per_phase(hub_env, hub_server, model_repo, tmp_path):
    dest = tmp_path / "MiniMax-M3.1-Flash"
    fetched = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env)
    assert fetched.returncode == 0, fetched.stderr
    flip_middle_byte(dest / "model-00002-of-00004.safetensors")
    run = run_on_tty("repair", dest, env=hub_env)
    assert run.returncode == 0, run.text
    assert_no_bar_left_and_never_past_100(run)
    fetched = [line for line in run.screen if re.fullmatch(r"fetch \S+: 1 file, .* in .*", line)]
    assert len(summaries(run.screen, "verify")) == 2 and len(fetched) == 1, run.text


# --- off a terminal: a plain line every interval, or a status event a line with --json ------------------------

PERIODIC = re.compile(r"^(?P<label>[^:]+): +\d+%  +\S+ \S+ / \S+ \S+  +(\S+ \S+/s|\? B/s)  \d:\d\d:\d\d ETA \S+")


def run_logged(tmp_path: Path, *args, env=None, interval: str = "0.05"):
    """mm ARGS with stderr going to a file, as under nohup or systemd: (result, the log's lines)."""
    import os
    import subprocess

    from tests.support.run import mm_argv

    log = tmp_path / "mm-stderr.log"
    with open(log, "w") as sink:
        result = subprocess.run(mm_argv(*args), env={**(env or os.environ), "MM_PROGRESS_INTERVAL": interval},
                                stdout=subprocess.PIPE, stderr=sink, text=True, timeout=120)
    return result, log.read_text().splitlines()


def test_fetch_to_a_log_writes_a_progress_line_every_interval(hub_env, hub_server, model_repo, tmp_path):
    hub_server.rate_limit = 2 * 1024 * 1024  # bytes/s: the fetch takes about a second, many intervals
    result, lines = run_logged(tmp_path, "fetch", model_repo.repo_id, "--revision", model_repo.head,
                               "--local-dir", tmp_path / "dest", env=hub_env)
    assert result.returncode == 0, lines
    periodic = [line for line in lines if PERIODIC.match(line)]
    assert len(periodic) >= 3, lines
    assert all("\r" not in line and "\x1b" not in line for line in lines)  # whole lines, never a redrawn one
    assert any(re.search(r" \d+/\d+ files", line) for line in periodic), periodic


def test_bundle_and_unbundle_to_a_log_write_progress_lines(model, tmp_path):
    for args in (("bundle", model, "--out", tmp_path / "out", "--volume-size", VOLUME_SIZE),
                 ("unbundle", tmp_path / "out", "--dest", tmp_path / "dest")):
        # 1 ms: a 2.3 MB bundle on a fast disk finished its phase inside 10 ms once, so that no interval came
        result, lines = run_logged(tmp_path, *args, interval="0.001")
        assert result.returncode == 0, lines
        assert any(PERIODIC.match(line) for line in lines), (args, lines)


def test_json_fetch_streams_status_events_on_stderr_and_one_document_on_stdout(hub_env, hub_server, model_repo,
                                                                                  tmp_path):
    import json

    hub_server.rate_limit = 2 * 1024 * 1024
    result, lines = run_logged(tmp_path, "fetch", model_repo.repo_id, "--revision", model_repo.head,
                               "--local-dir", tmp_path / "dest", "--json", env=hub_env)
    assert result.returncode == 0, lines
    json.loads(result.stdout)  # the one document, as without the events
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(events) >= 3, lines
    assert {e["message_type"] for e in events} == {"status"}
    assert {"seconds_elapsed", "seconds_remaining", "percent_done", "total_bytes", "bytes_done",
            "total_files", "files_done", "current_files"} <= events[0].keys()
    done = [e for e in events if e.get("done")]
    assert done and done[-1]["bytes_done"] == done[-1]["total_bytes"] and done[-1]["percent_done"] == 1.0, done


def test_a_short_phase_writes_no_progress_line(model, tmp_path):
    result, lines = run_logged(tmp_path, "verify", model, interval="3600")
    assert result.returncode == 0 and not any(PERIODIC.match(line) for line in lines), lines


def test_a_bad_progress_interval_is_a_usage_error(model, tmp_path):
    result, lines = run_logged(tmp_path, "verify", model, interval="soon")
    assert result.returncode == 2 and lines == [
        "mm: MM_PROGRESS_INTERVAL='soon' is not a number of seconds between 0 and 86400 (unset it for the default, 10)"
    ], lines



def test_fetch_and_bundle_verify_end_with_the_next_command(hub_env, model_repo, bundled, tmp_path):
    dest = tmp_path / "dest"
    fetched = run_mm("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env)
    assert fetched.returncode == 0, fetched.stderr
    nexts = [line for line in fetched.stdout.splitlines() if line.startswith("next: ")]
    assert nexts[0] == f"next: mm bundle {dest} --out /media/disk1 --volume-size 100G   # to carry it to an offline host"
    assert nexts[1].startswith(f"next: mm launch {dest} --hardware GPU --out start.sh   # a start script; GPU one of b300")
    checked = run_mm("bundle", "verify", bundled)
    assert checked.returncode == 0 and checked.stdout.splitlines()[-1] == \
        f"next: mm unbundle {bundled} --dest DIR   # on the offline host", checked.stdout
