"""The cluster's rendering of the launch plan: Kubernetes manifests (`mm launch --format k8s`) and OME's
ClusterBaseModel (`--format ome`), from the very LaunchPlan the docker start script comes from.

One plan, two renderings: a server pod's container args ARE the plan's engine argv (docker's trailing
arguments are Kubernetes' `args`; the API key `${VAR}` becomes `$(VAR)`, which the kubelet expands from
an env var read from a Secret), its env the plan's env (HF_HUB_OFFLINE=1, the caches), its image the
plan's image by digest, /dev/shm the guide's size, the model the plan's read-only mount, taken from the
node's disk at the store's `REPO/current` pointer (so `mm use` on the nodes plus a rollout restart is the
update and the rollback), the kernel caches hostPath directories on the node (a restart does not compile
again). A replica that needs more GPUs than a node has becomes a LeaderWorkerSet (SGLang's multi-node
flags, as in LWS's own SGLang example). The SGLang router finds the server pods by label (sglang-router
0.3.2's --service-discovery), with the guide's cache_aware policy, a ServiceAccount allowed to get/list/
watch pods, and a Service in front.

The proof gate is an init container: before the server starts, mm (installed from the wheelhouse the
bundle carried, offline) runs its quick verify against the copy the pod is about to mount. It checks the
bytes of THIS start: after `mm use` the next start checks the new revision, a rollback the old one; a node
label would say what was true when someone labelled the node, and `current` can move after that.
OME starts its own pods, so its ClusterBaseModel can only select nodes: `mm verify --label-node` prints
the label after a full verify, its value bound to the manifest's hash (proof_label).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import BadInput, BadValue, Refused
from .launch import (EnvRef, LaunchOptions, LaunchPlan, SHM_GIB, Token, check_model_dir, choose_recipe, load_catalog,
                     plan_document, plan_launch, revision_lines)
from .router import DEFAULT_HEALTH_TIMEOUT

# The Kubernetes minor the documents are written for (and checked against by the tests, strict).
KUBERNETES_VERSION = "1.37"
# Device plugin resource names: NVIDIA's k8s-device-plugin and AMD's k8s-device-plugin.
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
LWS_API = "leaderworkerset.x-k8s.io/v1"
OME_API = "ome.io/v1beta1"
# LWS's own SGLang example (docs/examples/sglang/lws.yaml): the leader's address and rank come from the env vars
# LWS sets in every pod; port 20000 for torch.distributed's rendezvous is that example's.
DIST_INIT_PORT = 20000
# Labels mm puts on nodes (the admin for the hardware, `mm verify --label-node` for the proof) and on pods.
LABEL_PREFIX = "mm"
HARDWARE_LABEL = f"{LABEL_PREFIX}/hardware"
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
API_KEY_SECRET_KEY = "api-key"
INSTALLER_SCRIPT = "install-mm.sh"  # wheelhouse.INSTALL_SCRIPT (not imported: launch stays light)
# Probes: SGLang answers /health without the API key (sglang/srt/utils/auth.py: health, readiness and metrics
# paths are always allowed). The start-up allowance is mm's own margin, the same as the node script's
# MM_HEALTH_TIMEOUT and `mm warmup --timeout`: the guide says only that a first start compiles for "a long time".
PROBE_PERIOD = 10  # seconds (mm's own margin)
READY_FAILURES = 3  # Kubernetes' default failureThreshold
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 label: Service names need a leading letter
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MOUNT_INSTALLER = "/mm-installer"
MOUNT_VENV = "/mm-venv"


@dataclass(frozen=True)
class ClusterOptions:
    namespace: str = "default"
    replicas: int = 1
    gpus_per_node: int | None = None  # None: the hardware's node size (recipes file)
    nodes: int | None = None  # the cluster's nodes of this hardware, when given: the replicas must fit
    api_key_secret: str | None = None  # None: <name>-api-key
    mm_installer: Path | None = None  # None: the bundle's payload beside the revision `current` names
    gate: bool = True  # the init container (k8s); OME starts its own pods and selects proven nodes instead


@dataclass(frozen=True)
class ClusterPlan:
    server: LaunchPlan
    name: str
    namespace: str
    replicas: int
    pods_per_replica: int  # 1: a Deployment; more: a LeaderWorkerSet of that size
    gpus_per_pod: int
    gpu_resource: str
    model_host_path: Path  # ROOT/REPO/current on every node
    installer_host_path: Path | None  # None: no init container (OME)
    api_key_secret: str
    router_args: tuple[Token, ...]
    router_port: int
    metrics_port: int
    multi_node_args: tuple[Token, ...]
    warnings: tuple[str, ...]

    @property
    def kind(self) -> str:
        return "LeaderWorkerSet" if self.pods_per_replica > 1 else "Deployment"

    @property
    def server_name(self) -> str:
        return f"{self.name}-server"

    @property
    def router_name(self) -> str:
        return f"{self.name}-router"

    @property
    def server_labels(self) -> dict[str, str]:
        return server_labels(self.name)

    @property
    def gpus(self) -> int:
        return self.replicas * self.pods_per_replica * self.gpus_per_pod


def server_labels(name: str) -> dict[str, str]:
    """The server pods' labels: the Deployment's selector and the router's --selector are both these."""
    return {NAME_LABEL: name, COMPONENT_LABEL: "server"}


def _check_name(value: str, what: str, limit: int, rule: re.Pattern) -> None:
    if len(value) > limit or not rule.match(value):
        raise BadValue(f"{what} {value!r}: not a Kubernetes name (lower-case letters, digits and '-', "
                       f"starting with a letter and ending with a letter or digit, at most {limit} characters)")


def plan_cluster(model_dir: Path, opts: LaunchOptions, copts: ClusterOptions) -> ClusterPlan:
    """The cluster plan: one server's LaunchPlan (what `mm launch` renders as a script), replicated."""
    from .docker import as_mounted
    from ..paths import is_pointer

    _check_name(copts.namespace, "--namespace", 63, DNS_1123)
    if opts.gpus or opts.replica_ports:
        raise BadValue("--gpus/--replica-ports: in a cluster the device plugin assigns GPUs and every pod has its own "
                       "address; leave them out (--replicas sets the number of servers)")
    if copts.replicas < 1:
        raise BadValue(f"--replicas {copts.replicas}: must be 1 or more")
    if not is_pointer(Path(model_dir)):
        raise BadInput(f"{model_dir}: not a store's current pointer (ROOT/REPO/current); the cluster plan mounts "
                       f"the pointer from each node's disk so that `mm use` and a rollout restart update and roll back "
                       f"(see `mm ls ROOT`)")
    catalog = load_catalog()
    recipe = choose_recipe(catalog, opts)
    hw = catalog.hardware[recipe.hardware]
    name = opts.name or catalog.pin.container_name
    _check_name(name, "--name", 63 - len("-server"), DNS_LABEL)  # the longest name mm derives: NAME-server
    secret = copts.api_key_secret or f"{name}-api-key"
    _check_name(secret, "--api-key-secret", 253, DNS_1123)

    mounted = as_mounted(Path(model_dir))
    identity = check_model_dir(mounted, recipe, catalog.pin)  # the local copy: manifest, draft, quick verify
    # One server, as `mm launch --expose` plans it: the pod listens on its own address, so the API key is required.
    server = plan_launch(mounted, replace(opts, name=name, expose=True, replicas=1), catalog, identity)

    per_node = copts.gpus_per_node or hw.gpus_per_node
    if per_node is None:
        raise BadValue(f"--gpus-per-node: the recipes file gives no node size for {hw.name}; say how many GPUs a node has")
    need = len(server.gpus)
    warnings = list(server.warnings)
    if need <= per_node:
        pods, per_pod, multi = 1, need, ()
    else:
        if need % per_node:
            raise Refused(f"recipe {recipe.id} runs on {need} GPUs, which {per_node}-GPU nodes cannot split evenly; "
                          f"use nodes of {need} GPUs (--gpus-per-node) or another recipe")
        pods, per_pod = need // per_node, per_node
        multi = ("--dist-init-addr", f"$(LWS_LEADER_ADDRESS):{DIST_INIT_PORT}", "--nnodes", str(pods),
                 "--node-rank", "$(LWS_WORKER_INDEX)")
        warnings.append(f"recipe {recipe.id} spans {pods} nodes of {per_node} GPUs here; the guide validates it on one "
                        f"node: revalidate before serving traffic")
    if copts.nodes is not None:
        fits = copts.nodes * (per_node // per_pod) if pods == 1 else copts.nodes // pods
        if copts.replicas > fits:
            raise Refused(f"--replicas {copts.replicas}: does not fit: each replica of {recipe.id} needs {pods} x "
                          f"{per_pod} GPUs, {copts.nodes} node(s) of {per_node} GPUs hold {fits}; "
                          f"use --replicas {max(fits, 1)} or more nodes")
    installer = _installer(mounted, copts.mm_installer) if copts.gate else None
    engine = catalog.engines[recipe.engine]
    if not engine.router:
        raise Refused(f"the guide puts the SGLang router in front of SGLang servers only; {recipe.engine} has no "
                      f"cluster plan here")
    spec = engine.router
    selector = [f"{k}={v}" for k, v in server_labels(name).items()]
    router_args: list[Token] = [spec["interpreter"], "-m", spec["module"], "--service-discovery",
                                "--selector", *selector, "--service-discovery-port", str(server.port),
                                "--service-discovery-namespace", copts.namespace, "--policy", spec["policy"],
                                "--host", "0.0.0.0", "--port", str(server.port),
                                "--prometheus-host", "0.0.0.0", "--prometheus-port", str(spec["metrics_port"]),
                                "--api-key", EnvRef(server.api_key_env)]
    return ClusterPlan(
        server=server, name=name, namespace=copts.namespace, replicas=copts.replicas, pods_per_replica=pods,
        gpus_per_pod=per_pod, gpu_resource=GPU_RESOURCE[hw.vendor], model_host_path=mounted,
        installer_host_path=installer, api_key_secret=secret, router_args=tuple(router_args),
        router_port=server.port, metrics_port=int(spec["metrics_port"]), multi_node_args=multi,
        warnings=tuple(warnings))


def _installer(mounted: Path, given: Path | None) -> Path:
    """Where install-mm.sh and its wheelhouse lie on the nodes (checked here, on this host's copy of the layout)."""
    path = Path(given) if given else mounted.resolve().with_name(mounted.resolve().name + ".payload") / "mm"
    if not (path / INSTALLER_SCRIPT).is_file() or not (path / "wheelhouse").is_dir():
        how = "" if given else " (default: the bundle's payload beside the current revision, DEST.payload/mm)"
        raise BadInput(f"{path}: no {INSTALLER_SCRIPT} with its wheelhouse/ here{how}; the proof gate installs mm "
                       f"from it on each node: pass --mm-installer DIR (`mm bundle` carries it in payload/mm)")
    return path.absolute()


# --- the proof label (OME's node selector) ---------------------------------------------------------------

def proof_label(repo_id: str, manifest_bytes: bytes) -> tuple[str, str]:
    """(key, value) of the node label that says: this node's copy of REPO_ID matched THIS manifest in a full verify.
    The value is the manifest's sha256 (its first 32 hex digits: a label value holds 63 characters), so a label left
    from another revision does not select the node."""
    slug = re.sub(r"[^a-z0-9.-]+", "-", repo_id.lower().replace("/", "."))
    return f"{LABEL_PREFIX}/" + f"proven-{slug}"[:63].rstrip("-."), hashlib.sha256(manifest_bytes).hexdigest()[:32]


def proof_label_for(model_dir: Path) -> tuple[str, str]:
    """The proof label for MODEL_DIR's manifest as it is on disk now."""
    from ..edges.fsutil import read_local_file
    from ..integrity.manifest import MAX_MANIFEST_BYTES, from_json
    from ..paths import manifest_path

    path = manifest_path(Path(model_dir))
    data = read_local_file(path, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    return proof_label(from_json(data, str(path)).repo_id, data)


# --- rendering ------------------------------------------------------------------------------------------

def _arg(token: Token) -> str:
    """A container arg: an EnvRef becomes $(NAME), which the kubelet expands from the container's env."""
    return f"$({token.name})" if isinstance(token, EnvRef) else str(token)


def server_args(plan: ClusterPlan) -> list[str]:
    return [_arg(t) for t in plan.server.engine_argv] + [_arg(t) for t in plan.multi_node_args]


def _api_key_env(plan: ClusterPlan) -> dict:
    return {"name": plan.server.api_key_env,
            "valueFrom": {"secretKeyRef": {"name": plan.api_key_secret, "key": API_KEY_SECRET_KEY}}}


def _gate(plan: ClusterPlan) -> dict:
    """The init container: mm from the carried wheelhouse, offline, runs its quick verify on the copy the server
    mounts (read-only, the same volume); a failure keeps the server from starting and names the files."""
    s = plan.server
    script = (f"sh {MOUNT_INSTALLER}/{INSTALLER_SCRIPT} {MOUNT_VENV}/mm >&2 && "
              f"exec {MOUNT_VENV}/mm/bin/mm verify --quick {s.container_model_path}")
    return {
        "name": "mm-verify",
        "image": s.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", script],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "volumeMounts": [{"name": "model", "mountPath": s.container_model_path, "readOnly": True},
                         {"name": "mm-installer", "mountPath": MOUNT_INSTALLER, "readOnly": True},
                         {"name": "mm-venv", "mountPath": MOUNT_VENV}],
    }


def _volumes(plan: ClusterPlan) -> tuple[list[dict], list[dict]]:
    s = plan.server
    volumes = [{"name": "model", "hostPath": {"path": str(plan.model_host_path), "type": "Directory"}}]
    mounts = [{"name": "model", "mountPath": s.container_model_path, "readOnly": True}]
    for m in s.cache_mounts:
        vname = "cache-" + re.sub(r"[^a-z0-9-]", "-", Path(m.container).name.lower())
        volumes.append({"name": vname, "hostPath": {"path": str(m.host), "type": "DirectoryOrCreate"}})
        mounts.append({"name": vname, "mountPath": m.container})
    volumes += [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}},
                {"name": "mm-installer", "hostPath": {"path": str(plan.installer_host_path), "type": "Directory"}},
                {"name": "mm-venv", "emptyDir": {}}]
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _pod_spec(plan: ClusterPlan, leader: bool) -> dict:
    s = plan.server
    volumes, mounts = _volumes(plan)
    container = {
        "name": "sglang",
        "image": s.image,
        "imagePullPolicy": "IfNotPresent",
        **({"command": [s.entrypoint]} if s.entrypoint else {}),
        "args": server_args(plan),
        "env": [{"name": k, "value": v} for k, v in s.env] + [_api_key_env(plan)],
        "resources": {"limits": {plan.gpu_resource: str(plan.gpus_per_pod)}},
        "volumeMounts": mounts,
    }
    if leader:
        http = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD}
        container["ports"] = [{"name": "http", "containerPort": s.port}]
        container["startupProbe"] = {**http, "failureThreshold": DEFAULT_HEALTH_TIMEOUT // PROBE_PERIOD}
        container["readinessProbe"] = {**http, "failureThreshold": READY_FAILURES}
    return {
        "nodeSelector": {HARDWARE_LABEL: s.hardware.name},
        "initContainers": [_gate(plan)],
        "containers": [container],
        "volumes": volumes,
    }


def _meta(plan: ClusterPlan, name: str, component: str, namespaced: bool = True) -> dict:
    meta: dict = {"name": name}
    if namespaced:
        meta["namespace"] = plan.namespace
    meta["labels"] = {NAME_LABEL: plan.name, COMPONENT_LABEL: component, "app.kubernetes.io/managed-by": "mm"}
    return meta


def _annotations(plan: ClusterPlan) -> dict:
    s = plan.server
    return {"mm/recipe": s.recipe.id, "mm/model": f"{s.repo_id}@{s.revision}",
            "mm/proof-gate": "init container mm-verify: mm verify --quick on the mounted copy before every start"}


def server_documents(plan: ClusterPlan) -> list[dict]:
    labels = plan.server_labels
    if plan.pods_per_replica == 1:
        doc = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, plan.server_name, "server"),
               "spec": {
                   "replicas": plan.replicas,
                   "selector": {"matchLabels": dict(labels)},
                   # No surge: a surge pod would wait for GPUs a full cluster does not have (mm's own choice).
                   "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                   "template": {"metadata": {"labels": dict(labels), "annotations": _annotations(plan)},
                                "spec": _pod_spec(plan, leader=True)}}}
        return [doc]
    worker_labels = {NAME_LABEL: plan.name, COMPONENT_LABEL: "worker"}
    doc = {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(plan, plan.server_name, "server"),
           "spec": {
               "replicas": plan.replicas,
               "leaderWorkerTemplate": {
                   "size": plan.pods_per_replica,
                   "restartPolicy": "RecreateGroupOnPodRestart",  # one rank lost: the whole group restarts
                   "leaderTemplate": {"metadata": {"labels": dict(labels), "annotations": _annotations(plan)},
                                      "spec": _pod_spec(plan, leader=True)},
                   "workerTemplate": {"metadata": {"labels": worker_labels, "annotations": _annotations(plan)},
                                      "spec": _pod_spec(plan, leader=False)}}}}
    return [doc]


def router_documents(plan: ClusterPlan) -> list[dict]:
    s = plan.server
    rname = plan.router_name
    labels = {NAME_LABEL: plan.name, COMPONENT_LABEL: "router"}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, rname, "router")}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(plan, rname, "router"),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(plan, rname, "router"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
               "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": plan.namespace}]}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, rname, "router"),
        "spec": {
            # One router: cache_aware routing keeps its prefix tree in the router's memory; two would split it.
            "replicas": 1,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels), "annotations": {"mm/recipe": s.recipe.id}},
                "spec": {
                    "serviceAccountName": rname,
                    "containers": [{
                        "name": "router",
                        "image": s.image,
                        "imagePullPolicy": "IfNotPresent",
                        "args": [_arg(t) for t in plan.router_args],
                        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, _api_key_env(plan)],
                        "ports": [{"name": "http", "containerPort": plan.router_port},
                                  {"name": "metrics", "containerPort": plan.metrics_port}],
                        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": PROBE_PERIOD},
                    }]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, plan.name, "router"),
               "spec": {"selector": dict(labels),
                        "ports": [{"name": "http", "port": plan.router_port, "targetPort": "http"}]}}
    return [account, role, binding, deployment, service]


def documents(plan: ClusterPlan) -> list[dict]:
    return server_documents(plan) + router_documents(plan)


def ome_documents(plan: ClusterPlan) -> list[dict]:
    """OME's ClusterBaseModel over the nodes' copies: local:// storage at the pointer, the nodes selected by the
    hardware label and the proof label `mm verify --label-node` prints for this manifest after a full verify."""
    s = plan.server
    key, value = proof_label_for(plan.model_host_path)
    owner = s.repo_id.split("/", 1)[0] if "/" in s.repo_id else None
    spec: dict = {"displayName": s.repo_id, "version": s.revision,
                  "storage": {"storageUri": f"local://{plan.model_host_path}", "path": str(plan.model_host_path),
                              "nodeSelector": {HARDWARE_LABEL: s.hardware.name, key: value}}}
    if owner:
        spec["vendor"] = owner
    return [{"apiVersion": OME_API, "kind": "ClusterBaseModel",
             "metadata": {**_meta(plan, plan.name, "model", namespaced=False),
                          "annotations": {"mm/recipe": s.recipe.id, "mm/proof-label": f"{key}={value}"}},
             "spec": spec}]


def _plain_dumper():
    import yaml

    class PlainDumper(yaml.SafeDumper):
        """No anchors and aliases (&id001): every document reads on its own, as people edit them."""

        def ignore_aliases(self, data):
            return True

    return PlainDumper


def render_yaml(plan: ClusterPlan, docs: list[dict], fmt: str) -> str:
    import yaml

    s = plan.server
    r = s.recipe
    head = [f"# Cluster plan for {s.repo_id} @ {s.revision}, generated by `mm launch --format {fmt}`.",
            f"# Recipe {r.id}: {r.status} ({r.sources['status']}).",
            f"# Kubernetes {KUBERNETES_VERSION}; image by digest; model read-only from each node's {plan.model_host_path}."]
    if fmt == "ome":
        key, value = proof_label_for(plan.model_host_path)
        head += [f"# Nodes selected: {HARDWARE_LABEL}={s.hardware.name} (set by the admin) and {key}={value}, which",
                 f"#   mm verify {plan.model_host_path} --label-node NODE   prints after a full verify of that node's copy.",
                 "# After `mm use`: verify and relabel each node, then write and apply this again."]
    if fmt == "k8s":
        head += [f"# {plan.replicas} replica(s) x {plan.pods_per_replica} pod(s) x {plan.gpus_per_pod} {plan.gpu_resource}"
                 f" ({plan.kind}), behind the SGLang router (--policy cache_aware) at Service {plan.name}:{plan.router_port}.",
                 f"# Before applying: label the nodes {HARDWARE_LABEL}={s.hardware.name}, and create the API key Secret:",
                 f"#   kubectl -n {plan.namespace} create secret generic {plan.api_key_secret} "
                 f"--from-file={API_KEY_SECRET_KEY}=KEYFILE",
                 "# Proof gate: init container mm-verify runs `mm verify --quick` on the node's copy before each start.",
                 f"# Start-up allowance {DEFAULT_HEALTH_TIMEOUT} s (startupProbe on /health) for the first compile: mm's own "
                 "margin (the guide gives no figure).",
                 f"# Update or roll back: `mm use` on every node, then "
                 f"kubectl -n {plan.namespace} rollout restart {plan.kind.lower()}/{plan.server_name}"]
    head += [f"# Note: {f}" for f in r.facts]
    head += revision_lines(s)
    head += [f"# Warning: {w}" for w in plan.warnings]
    if s.revalidate:
        head.append(f"# REVALIDATE: recipe {r.id}: check the command against the upstream recipe before serving traffic.")
    body = yaml.dump_all(docs, Dumper=_plain_dumper(), sort_keys=False, explicit_start=True, width=120)
    return "\n".join(head) + "\n" + body


def plan_summary(plan: ClusterPlan, fmt: str, docs: list[dict]) -> dict:
    """`--json`: what was planned, the documents by kind and name, and the server plan as `--format json` has it."""
    return {
        "format": fmt, "kubernetes_version": KUBERNETES_VERSION, "namespace": plan.namespace, "name": plan.name,
        "workload": plan.kind, "replicas": plan.replicas, "pods_per_replica": plan.pods_per_replica,
        "gpus_per_pod": plan.gpus_per_pod, "gpu_resource": plan.gpu_resource, "gpus": plan.gpus,
        "model_host_path": str(plan.model_host_path),
        "installer_host_path": str(plan.installer_host_path) if plan.installer_host_path else None,
        "api_key_secret": plan.api_key_secret, "service": f"{plan.name}:{plan.router_port}",
        "documents": [{"kind": d["kind"], "name": d["metadata"]["name"]} for d in docs],
        "server_args": server_args(plan), "router_args": [_arg(t) for t in plan.router_args],
        "warnings": list(plan.warnings), "server": plan_document(plan.server),
        **({"proof_label": "=".join(proof_label_for(plan.model_host_path))} if fmt == "ome" else {}),
    }
