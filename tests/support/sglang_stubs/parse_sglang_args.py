"""Parse SGLang command lines with SGLang 0.5.23's own parser (`ServerArgs.add_cli_args`).

Run as a subprocess, never imported by the test process (the stubs would leak into it):
    python -m tests.support.sglang_stubs.parse_sglang_args < argvs.json
stdin: a JSON list of argument lists (what follows `sglang serve`); stdout: a JSON list with, for
each, {"ok": true, "args": {dest: value}} or {"ok": false, "error": "<argparse message>"}.
"""
import argparse
import contextlib
import io
import json
import sys

from tests.support.sglang_stubs import install

install()

from sglang.srt.server_args import ServerArgs  # noqa: E402


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            ns = parser.parse_args(argv)
    except SystemExit:
        return {"ok": False, "error": stderr.getvalue().strip().splitlines()[-1]}
    return {"ok": True, "args": {k: v for k, v in vars(ns).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    json.dump([parse(parser, argv) for argv in json.load(sys.stdin)], sys.stdout, default=str)


if __name__ == "__main__":
    main()
