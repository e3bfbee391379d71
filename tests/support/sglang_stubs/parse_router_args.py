"""Parse router command lines with sglang-router's own parser (`sglang_router.launch_router.parse_router_args`).

Run as a subprocess, never imported by the test process (the stubs would leak into it):
    python -m tests.support.sglang_stubs.parse_router_args < argvs.json
stdin: a JSON list of argument lists (what follows `python3 -m sglang_router.launch_router`); stdout: a JSON
list with, for each, {"ok": true, "args": {field: value}, "version": "..."} or {"ok": false, "error": "..."}.
The package is installed with --no-deps (Makefile); its Rust extension is real, setproctitle/fastapi/uvicorn
(used only to run the router, not to parse) are stubs.
"""
import contextlib
import dataclasses
import io
import json
import sys

from tests.support.sglang_stubs import install

install()

from sglang_router import __version__  # noqa: E402
from sglang_router.launch_router import parse_router_args  # noqa: E402


def parse(argv: list[str]) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_router_args(argv)
    except SystemExit:
        return {"ok": False, "error": stderr.getvalue().strip().splitlines()[-1]}
    except ValueError as e:  # RouterArgs.from_cli_args validation
        return {"ok": False, "error": str(e)}
    return {"ok": True, "version": __version__, "args": dataclasses.asdict(args)}


def main() -> None:
    json.dump([parse(argv) for argv in json.load(sys.stdin)], sys.stdout, default=str)


if __name__ == "__main__":
    main()
