"""`mm launch`, `mm warmup`, `mm doctor`, `mm diagnose`: the offline start of a model on given hardware, its first
run, the pre-flight check of a host, and a server log against the guide's troubleshooting table
(artifacts/serving/launch.py, router.py, warmup.py, doctor.py, diagnose.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

from ..artifacts.errors import MMError, ProblemsFound
from .shared import PATH, examples
from .shared import (emit_json, err, escape, handles_errors, json_option, out, progress_for, signature_options,
                     signature_policy, to_jsonable)

if TYPE_CHECKING:
    from ..artifacts.serving import launch as mm_launch


def _hardware(ctx, param, value):
    """GPU names as users write them (B300, GB300, MI355X) are the guide's rows in any case."""
    return value.strip().lower() if value is not None else None


def _hardware_ids(ctx, param, incomplete):
    """Shell completion of --hardware: the ids of the default pin's recipes file (nothing when it cannot be read)."""
    from click.shell_completion import CompletionItem

    from ..artifacts.serving.launch import load_catalog

    try:
        ids = load_catalog().hardware
    except Exception:  # completion never prints an error into the user's command line
        return []
    return [CompletionItem(hw) for hw in ids if hw.startswith(incomplete.lower())]


def _container_name(ctx, param, value):
    """A container name handed to docker: never something docker could take as an option (`--follow`)."""
    from ..artifacts.edges.tools import check_name
    if value is not None:
        try:
            check_name(value, param.opts[0])
        except MMError as e:
            raise click.BadParameter(e.message.removeprefix(f"{param.opts[0]} ")) from None
    return value


def _seconds(ctx, param, value):
    """A duration in seconds: finite, positive, at most a week (click's FloatRange lets NaN through)."""
    import math
    if value is not None and not (math.isfinite(value) and 0 < value <= 7 * 24 * 3600):
        raise click.BadParameter(f"{value}: expected seconds, more than 0 and at most {7 * 24 * 3600}")
    return value


def _commit(ctx, param, value):
    """A commit as the user names it: 4 to 40 hex digits (a prefix is matched against the manifest's revision)."""
    import re
    if value is not None and not re.fullmatch(r"[0-9a-fA-F]{4,40}", value):
        raise click.BadParameter(f"{value!r}: expected a commit (4 to 40 hex digits)")
    return value


def _int_list(lo: int, hi: int, what: str, example: str, distinct: str = "") -> Callable:
    """A click callback for a comma-separated list of integers in [LO, HI] (GPU indices, ports); with
    DISTINCT, a value named twice is refused saying why (ports: the plan names what they collide with)."""

    def parse(ctx, param, value):
        if value is None:
            return None
        parts = value.split(",")
        numbers = tuple(int(p) for p in parts if p.strip().isdigit() and len(p.strip()) <= 6)
        if len(numbers) != len(parts) or any(not lo <= n <= hi for n in numbers):
            from ..artifacts.edges.untrusted import printable
            raise click.BadParameter(f"{printable(value)[:60]!r}: expected {what} like {example} (integers {lo} to {hi})")
        if distinct and len(set(numbers)) != len(numbers):
            raise click.BadParameter(f"{value}: {distinct}")
        return numbers

    return parse


_gpu_list = _int_list(0, 1023, "GPU indices", "0,1,2,3", distinct="a GPU is listed twice (no GPU may serve two replicas)")
_port_list = _int_list(1, 65535, "ports", "30001,30002")


def recipe_options(fn: Callable) -> Callable:
    """The options `mm launch` and `mm warmup` share: they must produce the same command line."""
    options = [
        click.argument("model_dir", type=PATH),
        click.option("--hardware", required=True, callback=_hardware, shell_complete=_hardware_ids,
                     help="b300, gb300, b200, gb200, h200, h100 (vLLM), mi355x, mi350x (any case: B300 is b300)."),
        click.option("--recipe", default=None, help="balanced, low-latency, high-throughput, ... (default: the hardware's reference)."),
        click.option("--engine", type=click.Choice(["sglang", "vllm"]), default="sglang", show_default=True),
        click.option("--gpus", callback=_gpu_list, default=None,
                     help="GPU indices, e.g. 0,1,2,3 (default: 0..N-1); more than one replica needs: one replica per group."),
        click.option("--replicas", type=click.IntRange(1, 1024), default=None,
                     help="Servers behind the SGLang router (default: as many as --gpus holds; 1 keeps one server, no router; "
                          "--format k8s: server replicas, default 1)."),
        click.option("--port", type=click.IntRange(1, 65535), default=30000, show_default=True,
                     help="The server's port; with replicas, the router's."),
        click.option("--replica-ports", callback=_port_list, default=None,
                     help="With replicas: their ports on 127.0.0.1 (default: --port+1, --port+2, ...)."),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="With replicas: the router's metrics port on 127.0.0.1 (default 29000)."),
        click.option("--tp", type=click.IntRange(1, 1024), default=None,
                     help="Override the recipe's tensor parallel size (revalidate)."),
        click.option("--context-length", type=click.IntRange(1, 2**31 - 1), default=None,
                     help="Cap the context (refused above the recipe's limit)."),
        click.option("--dspark", is_flag=True, help="Require DSpark speculative decoding (refused where the guide says it fails)."),
        click.option("--image", default=None, help="Engine image by digest (default: the pinned SGLang image)."),
        click.option("--image-archive", type=PATH, default=None,
                     help="Image archive carried in the bundle; the script runs `docker load -i` when the image is absent."),
        click.option("--cache-root", type=PATH, default=None,
                     help="Host directory for kernel caches (default: DIR/../mm-kernel-cache/<recipe>)."),
        click.option("--mem-fraction-static", default=None, metavar="FRACTION",
                     help="SGLang's --mem-fraction-static, the user's override of the recipe's (the guide's fix "
                          "for CUDA out of memory: below 0.8)."),
        click.option("--chunked-prefill-size", default=None, metavar="TOKENS",
                     help="SGLang's --chunked-prefill-size, the user's override of the recipe's (the guide's "
                          "second step for CUDA out of memory: smaller)."),
        click.option("--name", default=None, callback=_container_name,
                     help="Container name. Default: the pin's container_name (minimax-m3-1-flash)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _launch_options(kw: dict, **extra) -> mm_launch.LaunchOptions:
    from ..artifacts.serving import launch as mm_launch
    keys = ("hardware", "recipe", "engine", "gpus", "port", "tp", "context_length", "dspark", "image",
            "image_archive", "cache_root", "name", "replicas", "replica_ports", "metrics_port", "revision", "chosen",
            "choice_doubt")
    overrides = tuple((flag, kw[_param(flag)]) for flag in mm_launch.OVERRIDE_FLAGS
                      if kw.get(_param(flag)) is not None)
    return mm_launch.LaunchOptions(**{k: kw[k] for k in keys if k in kw}, overrides=overrides, **extra)


def _param(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


@examples(
    "mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
    "mm launch DIR --hardware B300 --recipe low-latency --format json",
    "mm launch DIR --hardware h200 --engine vllm --gpus 0,1,2,3,4,5,6,7",
    "mm launch DIR --hardware b300 --gpus 0,1,2,3,4,5,6,7 --replicas 2   # two servers behind the router",
    "mm launch /models/MiniMaxAI/MiniMax-M3.1-Flash/current --hardware b300 --replicas 4 --format k8s "
    "--namespace llm --out flash.yaml")
@click.command()
@recipe_options
@click.option("--expose", is_flag=True, help="Publish on all interfaces; then the API key is read from --api-key-env at run time.")
@click.option("--api-key-env", default="MM_API_KEY", show_default=True, help="Environment variable holding the API key (with --expose; in a cluster, in every pod).")
@click.option("--format", "fmt", type=click.Choice(["sh", "json", "k8s", "ome"]), default="sh", show_default=True,
              help="sh: the node's start script; json: the plan; k8s: Kubernetes manifests (servers, router, RBAC, "
                   "Service); ome: OME's ClusterBaseModel over the nodes' copies.")
@click.option("--namespace", default="default", show_default=True, help="k8s/ome: the namespace of the servers and router.")
@click.option("--gpus-per-node", type=click.IntRange(1, 1024), default=None,
              help="k8s: GPUs of one node (default: the hardware's, from the recipes); a replica needing more becomes a LeaderWorkerSet.")
@click.option("--nodes", type=click.IntRange(1, 100000), default=None,
              help="k8s: the cluster's nodes of this hardware; --replicas must fit on them.")
@click.option("--api-key-secret", default=None, help="k8s: the Secret holding the API key under key 'api-key' (default: NAME-api-key).")
@click.option("--mm-installer", type=PATH, default=None,
              help="k8s: the node directory with install-mm.sh and wheelhouse/ for the proof gate (default: DEST.payload/mm beside the current revision).")
@click.option("--out", type=PATH, default=None, help="Write it here atomically (a script gets mode 0755, a plan 0644).")
@click.option("--revision", default=None, callback=_commit,
              help="The model revision you mean to serve (a commit or a prefix of 4+ hex digits): the directory must "
                   "hold it; one other than the guide's pin is then your choice, not a warning at every start.")
@signature_options
@json_option
@handles_errors
def launch(model_dir, expose, api_key_env, fmt, namespace, gpus_per_node, nodes, api_key_secret, mm_installer, out,
           revision, require_signature, allowed_signers, identity, json_out, **kw):
    """Print (or write) the offline start for MODEL_DIR on the given hardware (replicas behind the router on a node),
    or, with --format k8s/ome, the cluster's manifests from the same plan. A revision other than the guide's pin
    warns at every start unless it was chosen: `mm use` recorded it, --revision names it, or --allowed-signers
    trusts its signature."""
    from ..artifacts.serving import launch as mm_launch, router as mm_router
    signature, signed = _launch_signature(model_dir, require_signature, allowed_signers, identity, json_out)
    kw.update(_revision_choices(model_dir, revision, signed))
    if fmt in ("k8s", "ome"):
        from ..artifacts.serving import kube
        cluster = kube.ClusterOptions(namespace=namespace, replicas=kw["replicas"] or 1, gpus_per_node=gpus_per_node,
                                      nodes=nodes, api_key_secret=api_key_secret, mm_installer=mm_installer,
                                      gate=fmt == "k8s")
        plan = kube.plan_cluster(model_dir, _launch_options(kw, api_key_env=api_key_env), cluster)
        docs = kube.documents(plan) if fmt == "k8s" else kube.ome_documents(plan)
        text = kube.render_yaml(plan, docs, fmt)
        if out is not None:
            mm_launch.write_output(text, out, executable=False)
        summary = kube.plan_summary(plan, fmt, docs)
        if json_out:
            emit_json({"ok": True, "out": str(out) if out else None, "format": fmt, "plan": summary,
                       "signature": to_jsonable(signature), **({"yaml": text} if out is None else {})})
            return
        if out is None:
            from . import shared
            shared.out.write(text)
        else:
            err.line(f"wrote {out} ({plan.server.recipe.id}, {plan.replicas} replica(s) as a {plan.kind}, "
                     f"namespace {plan.namespace})")
        _render_revision(plan.server, plan.warnings)
        return
    node = mm_router.plan_node(model_dir, _launch_options(kw, expose=expose, api_key_env=api_key_env))
    doc = mm_router.node_document(node)
    text = mm_router.render_node_script(node) if fmt == "sh" else json.dumps(doc, indent=2) + "\n"
    if out is not None:
        mm_launch.write_output(text, out, executable=fmt == "sh")
    if json_out:
        emit_json({"ok": True, "out": str(out) if out else None, "format": fmt, "plan": doc,
                   "signature": to_jsonable(signature), **({"script": text} if out is None and fmt == "sh" else {})})
        return
    plan = node.first
    if out is None:
        from . import shared  # (`out` here is --out; the script goes to the stdout console, which names a full disk)
        shared.out.write(text)
    else:
        # the script's own verdict: a command to revalidate is never summed up as the recipe's status alone
        verdict = (f"{plan.recipe.status}; REVALIDATE before serving traffic, as the script says"
                   if plan.revalidate else plan.recipe.status)
        err.line(f"wrote {out} ({plan.recipe.id}, {verdict}, {len(node.replicas)} replica(s))")
    _render_revision(plan)
    for flag, value, was in plan.overrides:
        err.line(f"override: {flag} {value} (yours, not the guide's; the recipe has "
                 f"{was if was is not None else 'none: SGLang default'})")


def _render_revision(plan: mm_launch.LaunchPlan, warnings: tuple[str, ...] | None = None) -> None:
    """The summary says of the revision what the script says: who chose it, or the warning it gives at every start."""
    if plan.revision_choice:
        err.line(f"revision: {plan.revision_choice}")
    for warning in plan.warnings if warnings is None else warnings:
        start = "; the start script warns so at every start" if warning == plan.revision_warning else ""
        err.line(f"warning: {warning}{start}")


def _launch_signature(model_dir: Path, require_signature: bool, allowed_signers: Path | None, identity: str | None,
                      json_out: bool):
    """Check the model's manifest signature before anything is planned or written (exit 5 when refused).
    Returns (the report, the choice it makes: the signed revision) or (None, None)."""
    from ..artifacts.integrity import signing
    from ..artifacts.integrity.manifest import from_json
    from ..artifacts.paths import manifest_path
    from ..artifacts.serving.launch import RevisionChoice
    if not signature_policy(require_signature, allowed_signers, identity):
        return None, None
    report, data = signing.verify_dir_signature(model_dir, allowed_signers, identity)
    if not json_out:
        err.line(f"signature: good, {report.describe()}")
    revision = from_json(data, str(manifest_path(model_dir))).revision  # the bytes the signature covers
    return report, RevisionChoice(revision, f"its manifest is {report.describe()}, allowed by {allowed_signers}")


def _revision_choices(model_dir: Path, revision: str | None, signed) -> dict:
    """LaunchOptions' say on who chose the model's revision: --revision, the signature, `mm use`'s record."""
    from ..artifacts.store import recorded_choice
    used, doubt = recorded_choice(model_dir)
    return {"revision": revision, "chosen": tuple(c for c in (signed, used) if c is not None), "choice_doubt": doubt}


@examples(
    "mm warmup /data/models/MiniMax-M3.1-Flash --hardware b300",
    "mm warmup DIR --hardware b300 --timeout 7200 --report warmup.json")
@click.command()
@recipe_options
@click.option("--timeout", type=float, default=3600, show_default=True, callback=_seconds,
              help="Seconds to wait for /health (a first start compiles kernels).")
@click.option("--report", type=PATH, default=None, help="JSON report path (default: <cache root>/mm-warmup-report.json).")
@click.option("--image-file", type=PATH, default=None, help="Local PNG for the image check (default: a tiny PNG made in code).")
@click.option("--gpu-info", default=None, help="'NAME, COMPUTE_CAP, DRIVER' for the cache key instead of asking nvidia-smi (required on AMD).")
@json_option
@handles_errors
def warmup(model_dir, timeout, report, image_file, gpu_info, json_out, **kw):
    """Start the server once so kernel caches compile, run the guide's checks, stop it, write a report."""
    from ..artifacts.serving import router as mm_router, warmup as mm_warmup
    node = mm_router.plan_node(model_dir, _launch_options(kw))
    image_png = mm_warmup.read_image_file(image_file) if image_file else None
    result = mm_warmup.run_warmup(node, timeout=timeout, image_png=image_png, gpu_info=gpu_info,
                                  progress=progress_for(json_out))
    report_path = report or mm_warmup.default_report_path(node.first)
    mm_warmup.write_report(result, report_path, root=None if report else report_path.parent)
    if json_out:
        emit_json({"report": str(report_path), **to_jsonable(result)})
        if not result.ok:
            sys.exit(ProblemsFound.exit_code)
        return
    for check in result.checks:
        mark = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
        where = f"{escape(check.target)}: " if check.target else ""
        out.print(f"{mark} {where}{check.name}: {escape(check.detail)}")
    if result.log_tail:
        err.print(f"last {len(result.log_tail)} log lines of {', '.join(result.containers)}:", markup=False)
        for line in result.log_tail:
            err.line("  " + line)
    if result.diagnosis:
        out.print("the guide's troubleshooting table:")
        _render_findings(result.diagnosis)
    out.print(f"report: {escape(str(report_path))}")
    if not result.ok:
        failed = ", ".join(f"{c.name} ({c.detail})" for c in result.failed)
        raise ProblemsFound(result.error or f"warm-up checks failed: {failed}")


@examples(
    "mm doctor /data/models/MiniMax-M3.1-Flash --hardware b300",
    "mm doctor DIR --hardware gb300 --json")
@click.command()
@recipe_options
@json_option
@handles_errors
def doctor(model_dir, json_out, **kw):
    """Will this host start MODEL_DIR with this recipe? GPUs, driver, docker, the image by identity, port, /dev/shm,
    host memory, cache disk and key, the model. One line per check with its fix; exit 1 when a check fails."""
    from ..artifacts.serving import doctor as mm_doctor
    from ..artifacts.pins import default_pin
    report = mm_doctor.run_doctor(model_dir, _launch_options(kw), default_pin())
    if json_out:
        emit_json({"ok": report.ok, **to_jsonable(report), "counts": report.counts})
    else:
        marks = {"ok": "[green]ok  [/]", "warn": "[yellow]WARN[/]", "fail": "[red]FAIL[/]"}
        for c in report.checks:
            fix = f" -> fix: {escape(c.fix)}" if c.fix and c.status != "ok" else ""
            out.print(f"{marks[c.status]} {c.name}: {escape(c.detail)}{fix}", highlight=False, soft_wrap=True)
        n = report.counts
        verdict = "ready to start" if report.ok else "NOT ready"
        out.print(f"doctor {escape(report.model_dir)} ({report.recipe}): {n['ok']} ok, {n['warn']} warning(s), "
                  f"{n['fail']} failed: {verdict}", highlight=False, soft_wrap=True)
    if not report.ok:
        sys.exit(ProblemsFound.exit_code)


@examples(
    "mm diagnose server.log",
    "mm diagnose --container minimax-m3-1-flash",
    "mm diagnose server.log --model-dir DIR --hardware b300 --host-checks")
@click.command()
@click.argument("logfile", required=False, type=PATH)
@click.option("--container", default=None, callback=_container_name,
              help="Read `docker logs NAME` and its mounts instead of a file.")
@click.option("--answer", "answers", multiple=True, type=PATH,
              help="A saved HTTP answer or request body (repeatable).")
@click.option("--model-dir", type=PATH, default=None,
              help="The model directory: adapt each fix to its recipe (with --hardware and the launch options).")
@click.option("--hardware", default=None, callback=_hardware, shell_complete=_hardware_ids, help="With --model-dir: the hardware of the launch.")
@click.option("--recipe", default=None)
@click.option("--engine", type=click.Choice(["sglang", "vllm"]), default=None,
              help="The engine that served (its detectors and fixes). Default: the one the logs show, else sglang.")
@click.option("--gpus", callback=_gpu_list, default=None)
@click.option("--port", type=click.IntRange(1, 65535), default=30000, show_default=True)
@click.option("--cache-root", type=PATH, default=None)
@click.option("--image", default=None)
@click.option("--host-checks", is_flag=True, help="Also run the table's host checks for that recipe on this host.")
@click.option("--gpu-info", default=None, help="'NAME, COMPUTE_CAP, DRIVER' lines for the GPU host check.")
@json_option
@handles_errors
def diagnose(logfile, container, answers, model_dir, hardware, recipe, engine, gpus, port, cache_root, image,
             host_checks, gpu_info, json_out):
    """Match a server log (LOGFILE, `-` for the standard input, or a container's) against the guide's
    troubleshooting table; exit 1 when a row matches. A client's paste counts too (curl, openai-python, a script's
    output, kubectl describe): docs/launch.md, 'What to paste', says what it reads and what it cannot judge."""
    from ..artifacts.serving import diagnose as mm_diagnose, launch as mm_launch
    launch = (mm_launch.LaunchOptions(hardware=hardware, recipe=recipe, engine=engine or "sglang", gpus=gpus, port=port,
                                      cache_root=cache_root, image=image) if hardware else None)
    result = mm_diagnose.run_diagnosis(mm_diagnose.DiagnoseRequest(
        logfile=None if str(logfile) == "-" else logfile,
        stdin=click.get_binary_stream("stdin") if str(logfile) == "-" else None, container=container, answers=tuple(answers), model_dir=model_dir, launch=launch,
        host_checks=host_checks, gpu_info=gpu_info, engine=engine))
    if json_out:
        emit_json({"ok": result.ok, **to_jsonable(result)})
    else:
        _render_findings(result.findings)
        verdict = (f"{len(result.findings)} row(s) of the guide's troubleshooting table match" if result.findings
                   else "no row of the guide's troubleshooting table matches")
        out.line(f"{verdict} ({result.lines_read} lines read, engine {result.engine} ({result.engine_from})"
                 f"{', recipe ' + result.recipe if result.recipe else ''})")
    if not result.ok:
        sys.exit(ProblemsFound.exit_code)


def _render_findings(findings) -> None:
    for f in findings:
        at = f" line {f.line_number}" if f.line_number else ""
        out.print(f"[red]row {f.guide_row}[/] {escape(f.row)}: {escape(f.symptom)}")
        out.print(f"  seen in {escape(f.where)}{at}: {escape(f.line)}", highlight=False)
        out.print(f"  cause: {escape(f.cause)}", highlight=False)
        out.print(f"  fix: {escape(f.fix)}", highlight=False)
