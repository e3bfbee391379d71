"""Ctrl-C while a server sends nothing: the blocked download wakes at once and mm ends cooperatively.

A read on a socket whose server has gone silent waits up to MM_NET_TIMEOUT (30 s by default) before the worker
could see the stop flag; the interrupt watcher would end the process after 0.7 s instead, like kill -9, losing
what that worker held in its buffer. mm shuts down the socket of every answer being read when it is stopped
(artifacts/edges/wire.py), so the worker lands what it received and the range map is saved on the way out.

Each case serves a 3 MiB file whose first answer sends PART bytes and then nothing (the Hub and a registry from
tests/support/hostile.py, a ModelScope mirror from tests/support/msserver.py), sends a real SIGINT while the
server is silent, and asserts: exit 130 within the interrupt tests' limit, the range map on disk holds the bytes
received before the stall, and the rerun (the server honest again) is served at most 1.25x what was missing.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.hostile import HostileServer, Out, Request
from tests.support.msserver import MSServer
from tests.test_hostile_net import artifact, pin_manifest  # noqa: F401 - module fixtures this file uses too
from tests.test_hostile_net import (BIG, COMMIT, MS_ID, REPO, Harness, _blob_script, _tensor_bytes, asked, honest, hub,
                                    mirror_env, recorded, registry)
from tests.test_interrupt import interrupt, one_line, start, wait_until

MiB = 1 << 20
PART = 512 * 1024  # what the first answer sends before it falls silent
SILENT_NET = {"MM_NET_TIMEOUT": "60", "MM_NET_DEADLINE": "120", "MM_NET_RATE_WINDOW": "60"}  # no bound ends the stall


def silent_after_part():
    """A RESOLVE(req, out, data) whose first answer sends its headers and PART bytes, then nothing until the client
    hangs up; every later answer is honest."""
    first = []

    def resolve(req: Request, out: Out, data: bytes) -> None:
        if first:
            return honest(req, out, data)
        first.append(req)
        span = asked(req, len(data))
        begin, last = span or (0, len(data) - 1)
        headers = {"Content-Length": str(last + 1 - begin)}
        if span:
            headers["Content-Range"] = f"bytes {begin}-{last}/{len(data)}"
        out.head(206 if span else 200, headers)
        out.body(data[begin:begin + PART])
        out.stall()
    return resolve


def received(h: Harness) -> int:
    return sum(end - begin for begin, end in recorded(h))


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> bytes:
    return _tensor_bytes(tmp_path_factory.mktemp("silent-weights"), 3 * MiB, seed=31)


def _fetch(h: Harness, server: HostileServer) -> tuple:
    args = ("fetch", REPO, "--revision", "main", "--local-dir", h.dest, "--connections", "1")
    return args, {"HF_ENDPOINT": server.url}


def _pull(h: Harness, server: HostileServer) -> tuple:
    return ("pull", f"{server.host}/hostile/model:v1", "--local-dir", h.dest, "--workers", "1"), {}


def _mirror(h: Harness, server: MSServer, pin: Path) -> tuple:
    return ("fetch", REPO, "--revision", COMMIT, "--local-dir", h.dest, "--source", f"modelscope:{MS_ID}",
            "--mirror-only", "--pin-manifest", pin), mirror_env(h, server)


def _served_by_mirror(server: MSServer, size: int) -> int:
    """Bytes the mirror's downloads of BIG were asked for (each to the end of the file)."""
    return sum(size - int((r.range or "bytes=0-")[6:-1]) for r in server.downloads(BIG))


@pytest.mark.parametrize("command", ["fetch", "pull", "fetch --source modelscope"])
def test_ctrl_c_while_the_server_sends_nothing_keeps_what_arrived_and_the_rerun_fetches_the_rest(
        tmp_path, weights, artifact, pin_manifest, command):
    h = Harness(tmp_path)
    data = artifact.files[BIG] if command == "pull" else weights
    if command == "fetch --source modelscope":
        server = MSServer()
        server.add_revision(MS_ID, "master", {BIG: data})
        server.stall_download(MS_ID, BIG, PART)
        started = lambda: server.downloads(BIG)  # noqa: E731 - msserver counts requests, not bytes
        served = lambda: _served_by_mirror(server, len(data))  # noqa: E731
    else:
        server = HostileServer(hub(weights, resolve=silent_after_part()) if command == "fetch" else
                               registry(artifact, blob=_blob_script(artifact, silent_after_part())))
        started = lambda: server.body_bytes >= PART  # noqa: E731
        served = lambda: server.body_bytes  # noqa: E731
    with server:
        args, env = (_mirror(h, server, pin_manifest) if command.startswith("fetch --source") else
                     _fetch(h, server) if command == "fetch" else _pull(h, server))
        proc = start(*args, env={**h.env, **SILENT_NET, **env}, cwd=tmp_path / "work")
        wait_until(proc, started, "the first bytes sent")
        time.sleep(0.5)  # mm reads them into its buffer; the server says nothing more
        _, err, _ = interrupt(proc, signal.SIGINT, f"{command}, server silent, SIGINT")
        line = one_line(err, "SIGINT")
        assert "partial download(s)" in line, line
        kept = received(h)
        assert kept >= PART, f"the range map holds {kept} bytes; {PART} arrived before the stall"
        missing = len(data) - kept
        served_before = served()
        r = h.run(*args, deadline=30, env={**SILENT_NET, **env})
        rerun = served() - served_before
    assert r.code == 0, r.text
    assert (h.dest / BIG).read_bytes() == data
    assert rerun <= 1.25 * missing, (rerun, missing)
