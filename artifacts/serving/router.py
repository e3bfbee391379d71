"""A whole node: several replicas of one recipe behind the SGLang router, as one offline start script.

The guide: "When several replicas serve one endpoint, put the SGLang router in front with --policy
cache_aware", and on ROCm "on an 8-GPU AMD node, start two TP 4 servers on different ports behind a
router". Each replica is the very `docker run` line of launch.py (its own GPUs, port on 127.0.0.1 and
container name; the same read-only model and kernel caches). The router is one more container from the
same pinned image, offline (`--pull never`, HF_HUB_OFFLINE=1), on the host network so that it reaches
the replicas where they are published (127.0.0.1) and binds 127.0.0.1 itself unless exposed.

Kernel caches are shared by the replicas, but never written by two at once: SGLang 0.5.23 keys its
FlashInfer autotune file by model path, parallel sizes and rank (`rank_tp0_pp0_dp0.json`), not by
replica, and a rank that finds the per-rank files disagreeing deletes them
(srt/model_executor/runner/flashinfer_autotune.py), so two replicas tuning at once can throw away each
other's results. With a cold cache (no mm-cache-key.json from `mm warmup`) the script starts replica 0
alone and waits for its /health before starting the others, which then load what it compiled.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadValue, Refused
from .cachekey import FILE_NAME as CACHE_KEY_FILE
from .launch import (IMAGE_VAR, Catalog, EnvRef, LaunchOptions, LaunchPlan, Token, _wrap, check_combination,
                     check_model_dir, choose_recipe, docker_run_argv, hicache_statement, load_catalog, plan_document,
                     override_lines, plan_launch, read_identity, render_script, revision_lines, script_setup,
                     start_warning_lines)

DEFAULT_HEALTH_TIMEOUT = 3600  # seconds the script waits for each replica's /health (a cold start compiles kernels)


@dataclass(frozen=True)
class RouterPlan:
    name: str
    image: str
    host: str  # what the router binds: 127.0.0.1, or 0.0.0.0 with --expose
    port: int
    metrics_port: int
    worker_urls: tuple[str, ...]
    policy: str
    expose: bool
    api_key_env: str | None
    argv: tuple[Token, ...]  # the container's command: python3 -m sglang_router.launch_router ...
    source: str


@dataclass(frozen=True)
class NodePlan:
    replicas: tuple[LaunchPlan, ...]
    router: RouterPlan | None

    @property
    def first(self) -> LaunchPlan:
        return self.replicas[0]

    @property
    def containers(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.replicas) + ((self.router.name,) if self.router else ())


def split_gpus(catalog: Catalog, opts: LaunchOptions) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(replicas, each replica's GPUs): no GPU in two replicas; refused when the GPUs cannot hold them."""
    recipe = choose_recipe(catalog, opts)
    per = opts.tp if opts.tp else recipe.gpus
    if opts.replicas is not None and opts.replicas < 1:
        raise BadValue(f"--replicas {opts.replicas}: must be 1 or more")
    if not opts.gpus:
        replicas = opts.replicas or 1
        gpus = tuple(range(replicas * per))
    else:
        gpus = tuple(opts.gpus)
        if len(set(gpus)) != len(gpus):
            raise BadValue(f"--gpus {','.join(map(str, gpus))}: a GPU is listed twice (no GPU may serve two replicas)")
        if opts.replicas is None and (len(gpus) < per or len(gpus) % per):
            raise BadValue(f"--gpus {','.join(map(str, gpus))}: recipe {recipe.id} runs on {per} distinct GPUs"
                           + (f" per replica; list a multiple of {per}" if len(gpus) > per else ""))
        replicas = opts.replicas or len(gpus) // per
        if replicas * per > len(gpus):
            raise Refused(f"--replicas {replicas}: not enough GPUs: {replicas} replicas of recipe {recipe.id} need "
                          f"{replicas} x {per} = {replicas * per} GPUs, --gpus lists {len(gpus)}; "
                          f"use --replicas {max(1, len(gpus) // per)} or list more GPUs")
        if replicas * per != len(gpus):
            if opts.replicas:  # e.g. --replicas 1 with 8 ROCm GPUs: say what the guide says about one server
                check_combination(catalog, recipe, dataclasses.replace(opts, gpus=gpus[:len(gpus) // replicas]))
            raise BadValue(f"--gpus {','.join(map(str, gpus))}: recipe {recipe.id} runs on {per} distinct GPUs per "
                           f"replica; list {replicas * per} GPUs for {replicas} replica(s)")
    return replicas, tuple(gpus[i * per:(i + 1) * per] for i in range(replicas))


def _ports(opts: LaunchOptions, replicas: int, metrics_default: int) -> tuple[tuple[int, ...], int]:
    ports = tuple(opts.replica_ports) if opts.replica_ports else tuple(opts.port + 1 + i for i in range(replicas))
    if len(ports) != replicas:
        raise BadValue(f"--replica-ports {','.join(map(str, ports))}: {replicas} replicas need {replicas} ports")
    metrics = opts.metrics_port or metrics_default
    named = [("--port (router)", opts.port)] + [(f"replica {i} port", p) for i, p in enumerate(ports)] + \
            [("--metrics-port (router metrics)", metrics)]
    seen: dict[int, str] = {}
    for what, port in named:
        if not 1 <= port <= 65535:
            raise BadValue(f"{what} {port}: out of range")
        if port in seen:
            raise BadValue(f"{what} {port}: collides with {seen[port]}; every replica, the router and its metrics "
                           f"need their own port (--port, --replica-ports, --metrics-port)")
        seen[port] = what
    return ports, metrics


def plan_node(model_dir: Path, opts: LaunchOptions, catalog: Catalog | None = None, check_dir: bool = True) -> NodePlan:
    from .docker import as_mounted

    catalog = catalog or load_catalog()
    recipe = choose_recipe(catalog, opts)
    model_dir = as_mounted(model_dir)  # a store's `current` pointer stays the pointer in the script
    opts = dataclasses.replace(opts, name=opts.name or catalog.pin.container_name)
    identity = check_model_dir(model_dir, recipe, catalog.pin) if check_dir else read_identity(model_dir, recipe)
    replicas, gpu_sets = split_gpus(catalog, opts)
    if replicas == 1:
        return NodePlan((plan_launch(model_dir, dataclasses.replace(opts, gpus=gpu_sets[0]), catalog, identity),), None)
    engine = catalog.engines[recipe.engine]
    if not engine.router:
        raise Refused(f"--replicas {replicas}: the guide puts the SGLang router in front of SGLang replicas only; "
                      f"for {recipe.engine} run one server (--replicas 1)")
    ports, metrics = _ports(opts, replicas, int(engine.router["metrics_port"]))
    plans = tuple(plan_launch(model_dir, dataclasses.replace(opts, gpus=gpus, port=port, name=f"{opts.name}-{i}",
                                                             expose=False), catalog, identity)
                  for i, (gpus, port) in enumerate(zip(gpu_sets, ports)))
    return NodePlan(plans, _router(plans[0], engine.router, catalog, opts, ports, metrics))


def _router(first: LaunchPlan, spec: dict, catalog: Catalog, opts: LaunchOptions, ports: tuple[int, ...],
            metrics: int) -> RouterPlan:
    host = "0.0.0.0" if opts.expose else "127.0.0.1"
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
    argv: list[Token] = [spec["interpreter"], "-m", spec["module"], "--worker-urls", *urls, "--policy", spec["policy"],
                         "--host", host, "--port", str(opts.port),
                         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    if opts.expose:
        argv += ["--api-key", EnvRef(opts.api_key_env)]
    engine = catalog.engines[first.recipe.engine]
    return RouterPlan(name=f"{opts.name}-router", image=first.image, host=host, port=opts.port, metrics_port=metrics,
                      worker_urls=urls, policy=spec["policy"], expose=opts.expose,
                      api_key_env=opts.api_key_env if opts.expose else None, argv=tuple(argv),
                      source=f"recipes engines.{engine.name}.router")


def router_docker_argv(router: RouterPlan, *, detach: bool = False, name: str | None = None,
                       worker_urls: tuple[str, ...] | None = None, port: int | None = None,
                       image: Token | None = None) -> list[Token]:
    """The router's `docker run`: same image, offline, on the host network (it reaches the replicas on 127.0.0.1).
    IMAGE is how the image was found on this host (the script's `$image`: pinned reference or recorded image ID)."""
    argv: list[Token] = ["docker", "run"] + (["-d"] if detach else []) + [
        "--name", name or router.name, "--pull", "never", "--network", "host", "-e", "HF_HUB_OFFLINE=1",
        image if image is not None else router.image]
    command = list(router.argv)
    if worker_urls is not None:  # warm-up: its own replicas and port
        i = command.index("--worker-urls")
        command[i + 1:i + 1 + len(router.worker_urls)] = list(worker_urls)
    if port is not None:
        command[command.index("--port") + 1] = str(port)
    return argv + command


# --- the start script ------------------------------------------------------------------------

def render_node_script(node: NodePlan) -> str:
    if node.router is None:
        return render_script(node.first)
    first, router = node.first, node.router
    r = first.recipe
    n = len(node.replicas)
    lines = [
        "#!/usr/bin/env bash",
        f"# Offline start of {first.repo_id} @ {first.revision} on {n} replicas behind the SGLang router, "
        "generated by `mm launch`.",
        f"# Recipe {r.id}: {r.status} ({r.sources['status']}).",
        f"# Image pinned by digest; model mounted read-only at {first.container_model_path}; no network needed.",
    ]
    for i, p in enumerate(node.replicas):
        lines.append(f"# Replica {i}: container {p.name}, GPUs {','.join(map(str, p.gpus))}, 127.0.0.1:{p.port} (loopback only).")
    where = f"all interfaces, port {router.port} (API key required)" if router.expose else f"127.0.0.1:{router.port}"
    lines.append(f"# Router: container {router.name}, {where}, --policy {router.policy}; "
                 f"metrics on 127.0.0.1:{router.metrics_port}; started once every replica answers /health.")
    lines.append("# Stopping the router (Ctrl-C, or `docker stop " + router.name + "`) stops the replicas; stopped "
                 "containers stay until the next start so that `mm diagnose --container NAME` can read their logs.")
    lines += [f"# Note: {f}" for f in r.facts]
    if first.hardware.vendor == "amd":
        lines.append("# Note: GPU access (--device /dev/kfd /dev/dri, HIP_VISIBLE_DEVICES) follows the ROCm container convention, not the guide.")
    lines += revision_lines(first)
    lines += [f"# Warning: {w}" for w in first.warnings]
    lines += override_lines(first)
    hicache = hicache_statement(first, n)
    if hicache:
        lines.append(f"# {hicache}")
    lines += ["set -euo pipefail", ""]
    lines += start_warning_lines(first)
    if first.revalidate:
        lines += [f"# REVALIDATE: the guide does not publish the exact command for recipe {r.id}; only the flags it states are here.",
                  f"echo {shlex.quote(f'WARNING: {r.id}: command must be revalidated against the upstream recipe before serving traffic')} >&2",
                  ""]
    if hicache:
        lines += [f"echo {shlex.quote(hicache)} >&2", ""]
    lines += script_setup(first, router.api_key_env, "The router is published on all interfaces",
                          "Kernel caches persist across starts and are shared by the replicas; `mm warmup` fills them.")
    names = " ".join(shlex.quote(p.name) for p in node.replicas)
    lines += [
        f"REPLICAS=({names})",
        f"ROUTER={shlex.quote(router.name)}",
        f'HEALTH_TIMEOUT="${{MM_HEALTH_TIMEOUT:-{DEFAULT_HEALTH_TIMEOUT}}}"',
        "",
        "stop_all() {",
        "  trap - EXIT INT TERM",
        '  docker stop "$ROUTER" "${REPLICAS[@]}" >/dev/null 2>&1 || true',
        "}",
        "trap stop_all EXIT",
        "trap 'exit 130' INT",
        "trap 'exit 143' TERM",
        "",
        "wait_healthy() {  # CONTAINER PORT",
        "  local waited=0",
        '  until curl --fail --silent --output /dev/null "http://127.0.0.1:$2/health"; do',
        "    if [ \"$(docker inspect -f '{{.State.Running}}' \"$1\" 2>/dev/null)\" != true ]; then",
        '      echo "mm: $1 exited before /health answered; read its log: mm diagnose --container $1" >&2',
        "      return 1",
        "    fi",
        '    if [ "$waited" -ge "$HEALTH_TIMEOUT" ]; then',
        '      echo "mm: $1: /health on 127.0.0.1:$2 did not answer within ${HEALTH_TIMEOUT}s (MM_HEALTH_TIMEOUT)" >&2',
        "      return 1",
        "    fi",
        "    sleep 2",
        "    waited=$((waited + 2))",
        "  done",
        '  echo "$1 ready on 127.0.0.1:$2" >&2',
        "}",
        "",
        "# Containers an earlier run left stopped (kept for diagnosis) go first.",
        'docker rm -f "$ROUTER" "${REPLICAS[@]}" >/dev/null 2>&1 || true',
        "",
    ]
    cold = (f"[ ! -f {shlex.quote(str(first.cache_root / CACHE_KEY_FILE))} ]" if first.cache_root else None)
    for i, p in enumerate(node.replicas):
        argv = docker_run_argv(p, detach=True, image=IMAGE_VAR)  # the image script_setup found by identity
        lines.append(f"# Replica {i}")
        lines.append(_wrap(argv, IMAGE_VAR, exec_=False))
        if i == 0 and cold and n > 1:
            lines += ["# A cold cache (no `mm warmup` yet): replica 0 compiles alone, the others then load its kernels.",
                      f"if {cold}; then",
                      f"  wait_healthy {shlex.quote(p.name)} {p.port}",
                      "fi"]
        lines.append("")
    for p in node.replicas:
        lines.append(f"wait_healthy {shlex.quote(p.name)} {p.port}")
    lines += ["", "# The router, in the foreground: when it stops, the EXIT trap stops the replicas."]
    lines.append(_wrap(router_docker_argv(router, image=IMAGE_VAR), IMAGE_VAR, exec_=False))
    return "\n".join(lines) + "\n"


def node_document(node: NodePlan) -> dict:
    """`--format json`: one server's plan as today; with a router, every container described."""
    if node.router is None:
        return plan_document(node.first)
    router = node.router
    first = node.first
    return {
        "recipe": first.recipe.id, "status": first.recipe.status, "repo_id": first.repo_id, "revision": first.revision,
        "image": first.image, "replica_count": len(node.replicas), "hicache": hicache_statement(first, len(node.replicas)),
        "replicas": [{**plan_document(p), "docker_argv": [str(t) for t in docker_run_argv(p, detach=True)]}
                     for p in node.replicas],
        "router": {"name": router.name, "image": router.image, "host": router.host, "port": router.port,
                   "metrics_port": router.metrics_port, "worker_urls": list(router.worker_urls), "policy": router.policy,
                   "expose": router.expose, "api_key_env": router.api_key_env,
                   "argv": [str(t) for t in router.argv],
                   "docker_argv": [str(t) for t in router_docker_argv(router)], "source": router.source},
        "containers": [{"name": p.name, "role": "replica", "gpus": list(p.gpus), "port": p.port,
                        "published": f"127.0.0.1:{p.port}:{p.port}"} for p in node.replicas]
                      + [{"name": router.name, "role": "router", "port": router.port, "network": "host",
                          "bind": f"{router.host}:{router.port}"}],
    }
