"""Parse `vllm serve` command lines with vLLM 0.33.0's own CLI parser and its own checks.

Run as a subprocess, never imported by the test process (the stubs would leak into it):
    python -m tests.support.vllm_stubs.parse_vllm_args < argvs.json
stdin: a JSON list of argument lists (what follows `--entrypoint vllm IMAGE`, i.e. starting with `serve`); stdout:
{"version": ..., "tool_call_parsers": [...], "reasoning_parsers": [...], "results": [...]} with, for each argv,
{"ok": true, "args": {dest: value}} or {"ok": false, "error": "..."}.

The parser is built as `vllm` (vllm/entrypoints/cli/main.py) builds it: a FlexibleArgumentParser with the `serve`
subcommand's own subparser_init; then, as vLLM does before it loads a model, ServeSubcommand.validate
(validate_parsed_serve_args: e.g. --enable-auto-tool-choice needs --tool-call-parser) and the API server's
validate_api_server_args (the tool-call parser must be one vLLM registers).
"""
import contextlib
import io
import json
import sys

from tests.support.vllm_stubs import install

install()

import vllm  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.entrypoints.common.cli_args import validate_api_server_args  # noqa: E402
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def build() -> tuple[FlexibleArgumentParser, ServeSubcommand]:
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
    return parser, serve


def parse(parser: FlexibleArgumentParser, serve: ServeSubcommand, argv: list[str]) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            ns = parser.parse_args(argv)
    except SystemExit:
        return {"ok": False, "error": stderr.getvalue().strip().splitlines()[-1]}
    try:
        serve.validate(ns)
        validate_api_server_args(ns)
    except (TypeError, ValueError, KeyError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "args": {k: v for k, v in vars(ns).items() if k != "dispatch_function"}}


def main() -> None:
    parser, serve = build()
    json.dump({"version": vllm.__version__,
               "tool_call_parsers": sorted(ToolParserManager.list_registered()),
               "reasoning_parsers": sorted(ReasoningParserManager.list_registered()),
               "results": [parse(parser, serve, argv) for argv in json.load(sys.stdin)]}, sys.stdout, default=str)


if __name__ == "__main__":
    main()
