"""mm command line: the root of the command tree.

The commands live in commands/, one module per area, each imported only when one of its commands runs (or shows its
--help): `mm verify --help` loads click, this module, commands/shared.py (what every command uses) and
commands/verify.py, and no library module; `mm --version` is answered before any of them (__main__.py). This module
holds what the root needs without them: the registry (each command's module and the line `mm --help` shows), the
examples every --help ends with, `mm version`, and the guard that ends any failure in mm's one-line error and
documented exit code. Commands parse their options, call artifacts/, and render (rich on a terminal, or one JSON
document); nothing else.
"""
from __future__ import annotations

import functools
import sys
import threading

import click

from ._version import __version__
from .artifacts.errors import BadInput, BadValue
from .commands.shared import emit_json, fail, json_option, report_interrupt, thread_failed

# Every command: name -> (its module in commands/, which defines it under that name; the line `mm --help` shows,
# the first paragraph of the command's own help: tests/test_startup.py holds the two equal).
COMMANDS: dict[str, tuple[str, str]] = {
    "bundle": ("bundle", "Pack a model into volumes (`mm bundle DIR --out OUT --volume-size 500G`) or check them "
                         "(`mm bundle verify VOL...`)."),
    "diagnose": ("launch", "Match a server log (LOGFILE, `-` for the standard input, or a container's) against the "
                           "guide's troubleshooting table; exit 1 when a row matches."),
    "doctor": ("launch", "Will this host start MODEL_DIR with this recipe? GPUs, driver, docker, the image by "
                         "identity, port, /dev/shm, host memory, cache disk and key, the model. One line per check "
                         "with its fix; exit 1 when a check fails."),
    "fetch": ("fetch", "Download a pinned revision, verify every file against the Hub, write the manifest."),
    "fleet": ("tiers", "The registry tiers between the site registry and the nodes (`mm fleet config --origin URL "
                       "--tier URL --out DIR`)."),
    "gc": ("store", "Remove the revisions under ROOT that are not current, not kept (--keep) and not mounted by a running "
                    "container (docker is asked), and say what it frees. Interrupted, it leaves every revision whole "
                    "or gone; the next run finishes."),
    "image": ("image", "The pinned engine image by identity (`mm image save --out FILE`, `mm image push FILE SITE`)."),
    "inspect": ("oci", "Show a registry artifact's files, sizes, revision and signature status (same as "
                       "`mm pull --list`)."),
    "launch": ("launch", "Print (or write) the offline start for MODEL_DIR on the given hardware (replicas behind the "
                         "router on a node), or, with --format k8s/ome, the cluster's manifests from the same plan."),
    "ls": ("store", "The revisions under ROOT (ROOT/<repo id>/<dir>/): sizes, bytes shared on disk, which is current, "
                    "when each was verified, signatures, containers mounting them."),
    "manifest": ("fetch", "Write (`mm manifest DIR --repo R --revision REV`) or export (`mm manifest export DIR`) a "
                          "manifest."),
    "mirror": ("fetch", "ModelScope mirrors: compare a mirror with the pinned revision by content."),
    "preheat": ("oci", "Warm a chain of pull-through caches with an artifact, nearest the origin first."),
    "pull": ("oci", "Pull a ModelPack artifact that mm pushed, proving every byte (sha256 and blake3) before naming a "
                    "file."),
    "push": ("oci", "Push a verified model directory to an OCI registry as a CNCF ModelPack artifact."),
    "repair": ("verify", "Re-fetch only the files verify finds missing or corrupt (from the Hub, at the manifest's "
                         "commit), then verify again. Good files are never touched. Exit 0 repaired, 1 problems "
                         "remain."),
    "sign": ("verify", "Sign DIR/.mm/manifest.json with ssh-keygen (namespace mm-manifest), writing "
                       ".mm/manifest.json.sig."),
    "unbundle": ("bundle", "Import volumes (files or directories, any order, some now and the rest later) into DEST, "
                           "then verify."),
    "use": ("store", "Make REVISION (a commit prefix or its directory name) the current one of REPO under the model "
                     "root: the ROOT/REPO/current symlink is replaced atomically, once `verify --quick` passes on it. "
                     "A rollback is the same command with the earlier revision; a start script that names "
                     "ROOT/REPO/current serves it at its next start."),
    "verify": ("verify", "Check every byte of DIR against its manifest, every file present, every safetensors shard "
                         "and index sound; files not in the manifest are reported (and fail with --strict). A partial "
                         "fetch is judged on what was asked for. Exit 0 all good, 1 problems found, 3 could not run, "
                         "5 bad signature."),
    "warmup": ("launch", "Start the server once so kernel caches compile, run the guide's checks, stop it, write a "
                         "report."),
}

# click 8.4 and later name the closest command in "No such command" (`mm verfy`: "Did you mean 'verify'?")
_NO_SUCH_COMMAND = getattr(click.exceptions, "NoSuchCommand", ())


class MMGroup(click.Group):
    """The top-level group: each command loaded from its module when it runs, click's usage errors in mm's
    one-line format (exit 2), and a last guard so that nothing, even outside a command, ends in a traceback or in
    exit 1."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            # the import statement's own path (importlib.import_module would hide it from python -X importtime)
            module = __import__(f"commands.{COMMANDS[cmd_name][0]}", globals(), fromlist=["_"], level=1)
            command = getattr(module, cmd_name)
            _add_examples(command, f"mm {cmd_name}")
            self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except _NO_SUCH_COMMAND as e:  # click suggests a close name among the commands loaded: offer them all
            raise type(e)(e.command_name, possibilities=self.list_commands(ctx), ctx=ctx) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """`mm --help` lists every command with its line from the registry, importing none of them (as click's
        Group.format_commands does with the commands themselves)."""
        commands = [(name, self.commands.get(name) or click.Command(name, help=COMMANDS[name][1]))
                    for name in self.list_commands(ctx)]
        commands = [(name, command) for name, command in commands if not command.hidden]
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            with formatter.section("Commands"):
                formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in commands])

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = _json_after_command(list(sys.argv[1:] if args is None else args))
        json_out = "--json" in args
        threading.excepthook = thread_failed
        if threading.current_thread() is threading.main_thread():  # (click's test runner may call from elsewhere)
            from .artifacts.edges import interrupt
            interrupt.install(functools.partial(report_interrupt, json_out, args))
        try:
            rv = super().main(args, prog_name=prog_name or "mm", complete_var=complete_var, standalone_mode=False,
                              **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else "", err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""
            fail(BadValue(f"{e.format_message()}{hint}"), "mm", json_out)
        except click.ClickException as e:
            fail(BadInput(e.format_message()), "mm", json_out)
        except click.exceptions.Abort:
            fail(KeyboardInterrupt(), "mm", json_out)
        except SystemExit:
            raise
        except BaseException as e:
            fail(e, "mm " + " ".join(a for a in args[:2] if not a.startswith("-")), json_out)
        sys.exit(rv if isinstance(rv, int) else 0)


def _json_after_command(args: list[str]) -> list[str]:
    """`mm --json COMMAND ...` is `mm COMMAND ... --json`: every command has --json, so it may come first too."""
    if "--json" not in args:
        return args
    at = args.index("--json")
    rest = args[:at] + args[at + 1:]
    if any(not a.startswith("-") for a in args[:at]) or all(a.startswith("-") for a in rest):
        return args  # after the command (its own option), or no command at all (click says so)
    end = rest.index("--") if "--" in rest else len(rest)
    return rest[:end] + ["--json"] + rest[end:]


@click.group(cls=MMGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="mm")
def main() -> None:
    """mm: fetch a pinned model revision, prove every byte, carry it across an air gap, start it offline."""


@main.command()
@json_option
def version(json_out):
    """Print mm's version (as `mm --version` and `mm -V` do)."""
    if json_out:
        emit_json({"ok": True, "version": __version__})
    else:
        click.echo(f"mm, version {__version__}")


# --- examples at the end of every --help (as `hf` does), in one place -----------------------------------------

EXAMPLES: dict[str, tuple[str, ...]] = {
    "mm": ("mm fetch --local-dir /data/models/MiniMax-M3.1-Flash      # the pinned revision",
           "mm verify /data/models/MiniMax-M3.1-Flash",
           "mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
           "mm unbundle /media/disk1 --dest /data/models/MiniMax-M3.1-Flash   # on the air-gapped host",
           "mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
           "mm COMMAND --help    # each command's options and examples"),
    "mm version": ("mm version", "mm -V", "mm version --json"),
    "mm fetch": ("mm fetch --local-dir /data/models/MiniMax-M3.1-Flash             # the pin's repo and revision",
                 "mm fetch Qwen/Qwen3-8B --revision main --local-dir /data/models/Qwen3-8B",
                 "mm fetch --local-dir ./m --include '*.json'                        # a partial fetch, recorded",
                 "mm fetch --local-dir ./m --source modelscope                       # the mirror, then the Hub",
                 "mm fetch --local-dir ./m --json | jq .counts",
                 "mm fetch REPO -r NEW --local-dir ROOT/REPO/NEW --from ROOT/REPO/current   # download what changed"),
    "mm manifest": ("mm manifest ./model --repo Qwen/Qwen3-8B --revision main",
                    "mm manifest ~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/COMMIT",
                    "mm manifest export ./model"),
    "mm manifest create": ("mm manifest ./model --repo Qwen/Qwen3-8B --revision main      # filled by hf download",
                           "mm manifest ./model --repo Qwen/Qwen3-8B --revision FULL_SHA --offline",
                           "mm manifest ~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/COMMIT"),
    "mm manifest export": ("mm manifest export ./model && cd ./model && sha256sum -c .mm/SHA256SUMS",
                           "mm manifest export ./model --format blake3"),
    "mm verify": ("mm verify /data/models/MiniMax-M3.1-Flash",
                  "mm verify --quick /data/models/MiniMax-M3.1-Flash          # no hashing: the pre-flight check",
                  "mm verify --strict /data/models/MiniMax-M3.1-Flash         # files not in the manifest fail too",
                  "mm verify --upstream /data/models/MiniMax-M3.1-Flash       # against the Hub's own hashes",
                  "mm verify DIR --allowed-signers allowed_signers --identity release@example.com",
                  "mm verify /models/MiniMaxAI/MiniMax-M3.1-Flash/current --label-node gpu-node-7   # OME's proof label"),
    "mm sign": ("mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519",
                "mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519.pub   # the key in ssh-agent"),
    "mm repair": ("mm repair /data/models/MiniMax-M3.1-Flash",
                  "mm repair /data/models/MiniMax-M3.1-Flash --json | jq .restored"),
    "mm mirror": ("mm mirror reconcile", "mm mirror reconcile --all-revisions"),
    "mm mirror reconcile": ("mm mirror reconcile                                  # the pin's repo, revision and mirror",
                            "mm mirror reconcile --ms-revision v1.0",
                            "mm mirror reconcile --all-revisions",
                            "mm mirror reconcile --pin-manifest DIR/.mm/manifest.json     # no Hub needed"),
    "mm bundle": ("mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
                  "mm bundle verify /media/disk1 /media/disk2",
                  "mm bundle repair-volume /media/disk1 /media/disk2"),
    "mm bundle create": ("mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
                         "mm bundle DIR --out /media/disk1 --volume-size 1.8T --parity 2 --image sglang.tar",
                         "mm bundle --only-mm --out ./mm-upgrade       # mm itself, for a host that has the model",
                         "mm bundle ROOT/REPO/NEW --base ROOT/REPO/OLD --out /media/disk1 --volume-size 500G   # a delta"),
    "mm bundle verify": ("mm bundle verify /media/disk1 /media/disk2",
                         "mm bundle verify /media/disk1/MiniMax-M3.1-Flash-ce7f4df87d2e.vol001-of-003.tar --json"),
    "mm bundle repair-volume": ("mm bundle repair-volume /media/disk1 /media/disk2 /media/parity",
                                "mm bundle repair-volume /media/disk1 --out /media/spare"),
    "mm unbundle": ("mm unbundle /media/disk1 /media/disk2 --dest /data/models/MiniMax-M3.1-Flash",
                    "mm unbundle /media/disk1 --dest DIR        # some volumes now, the rest later",
                    "mm unbundle /media/disk1 --dest DIR --allowed-signers allowed_signers",
                    "mm unbundle /media/disk1 --dest ROOT/REPO/NEW --from ROOT/REPO/OLD   # a delta: the rest from OLD"),
    "mm ls": ("mm ls /data/models",
              "mm ls /data/models --json | jq '.revisions[] | {dir, current, shared}'"),
    "mm use": ("mm use MiniMaxAI/MiniMax-M3.1-Flash 2f3a91c0 --root /data/models",
               "mm use MiniMaxAI/MiniMax-M3.1-Flash ce7f4df8 --root /data/models    # the rollback"),
    "mm gc": ("mm gc /data/models --dry-run",
              "mm gc /data/models --keep 2"),
    "mm image": ("mm image save --out sglang.tar",
                 "mm image push DEST.payload/image/sglang.tar registry.site:5000"),
    "mm image save": ("mm image save --out sglang.tar                      # the pinned engine image, this platform",
                      "mm image save --platform linux/arm64 --out sglang-arm64.tar      # for GB200/GB300 nodes",
                      "mm image save 127.0.0.1:5000/lmsysorg/sglang@sha256:DIGEST --out sglang.tar"),
    "mm image push": ("mm image push DEST.payload/image/sglang.tar registry.site:5000      # -> registry.site:5000/lmsysorg/sglang",
                      "mm image push sglang.tar 10.0.0.5:5000 --plain-http               # a site registry without TLS",
                      "echo \"$TOKEN\" | mm image push sglang.tar registry.site --username ci --password-stdin"),
    "mm fleet": ("mm fleet config --origin http://10.0.0.1:5000 --tier http://10.0.1.1:5000 --tier http://10.0.2.1:5000 --out fleet",),
    "mm fleet config": ("mm fleet config --origin http://10.0.0.1:5000 --tier http://10.0.1.1:5000 --tier http://10.0.2.1:5000 --out fleet",
                        "mm fleet config --origin https://registry.site --tier https://cache.rack7.site --out fleet --ttl 720h"),
    "mm push": ("mm push /data/models/MiniMax-M3.1-Flash registry.example.com/models/minimax-m3.1-flash",
                "mm push DIR 127.0.0.1:5000/models/flash:v1                # loopback: plain HTTP",
                "echo \"$TOKEN\" | mm push DIR registry.example.com/models/flash --username ci --password-stdin"),
    "mm pull": ("mm pull registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e --local-dir DIR",
                "mm pull registry.example.com/models/flash@sha256:DIGEST --local-dir DIR --allowed-signers allowed_signers",
                "mm pull registry.example.com/models/flash:ce7f4df87d2e --list",
                "mm pull registry.example.com/models/flash:ce7f4df87d2e --local-dir DIR --mirror t2.site:5000",
                "mm pull registry.example.com/models/flash:ce7f4df87d2e --local-dir DIR --mirror t2.site:5000 "
                "--mirror t1.site:5000 --no-fallback"),
    "mm preheat": ("mm preheat registry.example.com/models/flash:ce7f4df87d2e --tier t1.site:5000 --tier t2.site:5000",
                   "mm preheat 127.0.0.1:5000/models/flash:v1 --tier http://127.0.0.1:5001 --tier http://127.0.0.1:5002 --json"),
    "mm inspect": ("mm inspect registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e",
                   "mm inspect 127.0.0.1:5000/models/flash:v1 --json | jq .files"),
    "mm launch": ("mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
                  "mm launch DIR --hardware B300 --recipe low-latency --format json",
                  "mm launch DIR --hardware h200 --engine vllm --gpus 0,1,2,3,4,5,6,7",
                  "mm launch DIR --hardware b300 --gpus 0,1,2,3,4,5,6,7 --replicas 2   # two servers behind the router",
                  "mm launch /models/MiniMaxAI/MiniMax-M3.1-Flash/current --hardware b300 --replicas 4 --format k8s "
                  "--namespace llm --out flash.yaml"),
    "mm warmup": ("mm warmup /data/models/MiniMax-M3.1-Flash --hardware b300",
                  "mm warmup DIR --hardware b300 --timeout 7200 --report warmup.json"),
    "mm doctor": ("mm doctor /data/models/MiniMax-M3.1-Flash --hardware b300",
                  "mm doctor DIR --hardware gb300 --json"),
    "mm diagnose": ("mm diagnose server.log",
                    "mm diagnose --container minimax-m3-1-flash",
                    "mm diagnose server.log --model-dir DIR --hardware b300 --host-checks"),
}


def _add_examples(cmd: click.Command, path: str) -> None:
    """Every command's --help ends with its EXAMPLES ("\b": click keeps the lines as written)."""
    cmd.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[path])
    for name, sub in getattr(cmd, "commands", {}).items():
        _add_examples(sub, f"{path} {name}")


_add_examples(main, "mm")


if __name__ == "__main__":
    main()
