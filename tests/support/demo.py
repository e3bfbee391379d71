"""`make demo`: the whole journey against a small MiniMax-shaped model served on 127.0.0.1.

A local Hub server (real git repo, LFS objects, the HTTP API huggingface_hub speaks) stands in for
huggingface.co; every step runs the real `mm` command as a user would and shows its output.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "demo-work"
REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
MM = str(Path(sys.executable).parent / "mm")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(args: list[str], env: dict, ok_codes: tuple[int, ...] = (0,), cwd: Path | None = None) -> subprocess.CompletedProcess:
    shown = " ".join(shlex.quote(str(a)) for a in args).replace(MM, "mm").replace(str(ROOT) + "/", "")
    print(f"$ {shown}", flush=True)
    proc = subprocess.run([str(a) for a in args], env=env, cwd=cwd, text=True, capture_output=True)
    sys.stdout.write(proc.stdout)
    sys.stdout.write(proc.stderr)
    if proc.returncode not in ok_codes:
        raise SystemExit(f"demo step failed with exit code {proc.returncode}: {shown}")
    return proc


def start_hub(stack: ExitStack) -> str:
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hubserver", "--root", str(WORK / "hub"),
                             "--make-model", REPO, "--shards", "4", "--shard-bytes", str(2 * 1024 * 1024)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    stack.callback(lambda: (proc.terminate(), proc.wait()))
    match = re.match(r"HUB_URL=(\S+)", proc.stdout.readline())
    if not match:
        raise SystemExit("the local Hub server did not start")
    return match.group(1)


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    model = WORK / "models" / "MiniMax-M3.1-Flash"
    with ExitStack() as stack:
        say("A local Hub on 127.0.0.1 serves a small model shaped like MiniMax-M3.1-Flash (MXFP8 + NVFP4 + dspark/)")
        url = start_hub(stack)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_"))}
        env.update(HF_ENDPOINT=url, HF_HOME=str(WORK / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   NO_PROXY="127.0.0.1,localhost", MODELSCOPE_CACHE=str(WORK / "ms-cache"),
                   MODELSCOPE_HOME=str(WORK / "ms-home"))
        commit = subprocess.run(["git", "-C", str(WORK / "hub" / REPO), "rev-parse", "main"], capture_output=True,
                                text=True, check=True).stdout.strip()
        print(f"Hub: {url}   repo {REPO}   main = {commit}")

        say("mm fetch: resolve a short sha once, download in parallel, check every file against the Hub")
        run([MM, "fetch", REPO, "--revision", commit[:7], "--local-dir", model], env)
        say("mm fetch again: nothing to download, everything already proven")
        run([MM, "fetch", REPO, "--revision", commit[:7], "--local-dir", model], env)
        say("mm manifest export: checksums that standard tools accept")
        run([MM, "manifest", "export", model], env)
        run(["sha256sum", "--quiet", "-c", ".mm/SHA256SUMS"], env, cwd=model)
        print("sha256sum -c: all files OK")

    say("Done. Everything after `mm fetch` works with no network at all.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
