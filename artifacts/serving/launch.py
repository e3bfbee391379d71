"""Recipes (manifests/*.recipes.json) -> the offline engine command line and start script.

The recipes are data, each value with its source in the deployment guide; this module only checks a
request against them (the combinations the guide says fail are refused with the recipe to use
instead), checks the model directory, and renders one `docker run` for it: image by digest,
HF_HUB_OFFLINE=1, the model read-only at a fixed container path (FlashInfer's autotune key includes
the model path, so warm-up and production must agree), kernel caches on the host, loopback only
unless exposed with an API key read from the environment at run time.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..errors import BadInput, BadValue, Refused
from ..edges.fsutil import atomic_write_text, check_inside, read_json_file, user_path
from ..paths import manifest_path, snapshot_of, state_dir
from ..integrity.manifest import read_manifest
from ..pins import Pin, default_pin, manifests_dir, sourced_value

RECIPES_SCHEMA = "mm-recipes/1"
# A snapshot at CONTAINER_MODELS/<name> sits two levels down, as snapshots/<commit> does in hf's repo folder, so
# its relative links (../../blobs/<id>, one more ../ per subdirectory) land in this mount.
HF_BLOBS_MOUNT = "/blobs"
CONTAINER_MODELS = "/models"
DEFAULT_PORT = 30000
DEFAULT_API_KEY_ENV = "MM_API_KEY"
ROCM_MAX_TP_KEY = "rocm_max_tp"
IMAGE_RECORD_SUFFIX = ".mm-image.json"  # artifacts/serving/image.py RECORD_SUFFIX (kept here: launch stays light)
IMAGE_BY_DIGEST = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SHM_GIB = 32  # the guide's `--shm-size 32g` (docker's g: GiB); the cluster plan sizes its in-memory /dev/shm the same


# --- the recipes, as read from manifests/ -----------------------------------------------------

@dataclass(frozen=True)
class Arg:
    flag: str
    value: str | None
    source: str


@dataclass(frozen=True)
class Recipe:
    engine: str
    hardware: str
    name: str
    status: str
    exact_command_published: bool
    gpus: int
    weights_repo: str
    speculative: str | None
    context_limit: int | None
    expects_qmul4: bool
    args: tuple[Arg, ...]
    facts: tuple[str, ...]
    sources: dict[str, str]
    hicache_host_gb_per_server: float | None = None  # where the guide gives a total instead of --hicache-size

    @property
    def id(self) -> str:
        return f"{self.engine}/{self.hardware}/{self.name}"

    def arg(self, *flags: str) -> Arg | None:
        return next((a for a in self.args if a.flag in flags), None)


@dataclass(frozen=True)
class Hardware:
    name: str
    vendor: str  # nvidia | amd
    family: str  # blackwell | hopper | cdna
    default_recipe: str
    gpus_per_node: int | None = None  # one node's GPUs: a replica needing more spans nodes (the cluster plan)


@dataclass(frozen=True)
class CacheDir:
    name: str
    container: str
    env: str | None
    families: tuple[str, ...]


@dataclass(frozen=True)
class Engine:
    name: str
    image: str | None
    entrypoint: str | None
    command: tuple[str, ...]
    common_args: tuple[Arg, ...]
    tail_args: tuple[Arg, ...]
    api_key_flag: str
    caches: tuple[CacheDir, ...]
    msa_jit_env: dict[str, str]
    router: dict | None = None  # the SGLang router in front of several replicas (module, policy, ...)


@dataclass(frozen=True)
class Catalog:
    path: Path
    pin: Pin
    model_max_context: int
    sampling: dict[str, float]
    engines: dict[str, Engine]
    hardware: dict[str, Hardware]
    recipes: tuple[Recipe, ...]
    refusals: dict[str, object]

    def recipes_for(self, engine: str, hardware: str) -> list[Recipe]:
        return [r for r in self.recipes if r.engine == engine and r.hardware == hardware]


def recipes_path(pin: Pin | None = None) -> Path:
    """The recipes file the pin names (the default pin's when PIN is None)."""
    pin = pin or default_pin()
    if not pin.recipes:
        raise BadInput(f"{manifests_dir()}: pin {pin.name} names no recipes file; `mm launch` needs one")
    return manifests_dir() / pin.recipes


def _args(items: list, where: str) -> tuple[Arg, ...]:
    out = []
    for item in items:
        if not isinstance(item, dict) or "flag" not in item or not item.get("source"):
            raise BadInput(f"{where}: every argument needs a flag and a source")
        value = item.get("value")
        out.append(Arg(str(item["flag"]), None if value is None else str(value), str(item["source"])))
    return tuple(out)


def _from_pin(value, pin: Pin):
    if isinstance(value, dict) and "from_pin" in value:
        return getattr(pin, value["from_pin"])
    return value


def load_catalog(path: Path | None = None, pin: Pin | None = None) -> Catalog:
    pin = pin or default_pin()
    path = Path(path or recipes_path(pin))
    doc = read_json_file(path, what="recipes file")
    if not isinstance(doc, dict) or doc.get("schema") != RECIPES_SCHEMA:
        raise BadInput(f"{path}: not a recipes file (expected schema {RECIPES_SCHEMA!r})")
    try:
        engines = {}
        for name, e in doc["engines"].items():
            engines[name] = Engine(
                name=name,
                image=_from_pin(sourced_value(e["image"], f"{path}: engines.{name}.image"), pin),
                entrypoint=sourced_value(e["entrypoint"], str(path)),
                command=tuple(sourced_value(e["command"], str(path))),
                common_args=_args(e["common_args"], f"{path}: engines.{name}"),
                tail_args=_args(e["tail_args"], f"{path}: engines.{name}"),
                api_key_flag=sourced_value(e["api_key_flag"], str(path)),
                caches=tuple(CacheDir(c["name"], c["container"], c.get("env"), tuple(c["families"]))
                             for c in sourced_value(e["caches"], str(path))),
                msa_jit_env=dict(sourced_value(e["msa_jit_env"], str(path))),
                router=dict(sourced_value(e["router"], str(path))) if "router" in e else None,
            )
        hardware = {}
        for name, h in doc["hardware"].items():
            h = sourced_value(h, f"{path}: hardware.{name}")
            hardware[name] = Hardware(name, h["vendor"], h["family"], h["default_recipe"],
                                      int(h["gpus_per_node"]) if "gpus_per_node" in h else None)
        recipes = tuple(_recipe(r, pin, path) for r in doc["recipes"])
        return Catalog(
            path=path, pin=pin,
            model_max_context=int(sourced_value(doc["model_max_context"], str(path))),
            sampling=dict(sourced_value(doc["sampling"], str(path))),
            engines=engines, hardware=hardware, recipes=recipes,
            refusals={k: sourced_value(v, str(path)) for k, v in doc["refusals"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise BadInput(f"{path}: malformed recipes file ({e!r})") from None


def _recipe(r: dict, pin: Pin, path: Path) -> Recipe:
    where = f"{path}: recipe {r.get('engine')}/{r.get('hardware')}/{r.get('name')}"
    fields = ("status", "exact_command_published", "gpus", "weights", "speculative", "context_limit",
              "expects_qmul4_log_line")
    values = {k: sourced_value(r[k], where) for k in fields}
    return Recipe(
        engine=r["engine"], hardware=r["hardware"], name=r["name"],
        status=values["status"],
        exact_command_published=bool(values["exact_command_published"]),
        gpus=int(values["gpus"]),
        weights_repo=_from_pin(values["weights"], pin),
        speculative=values["speculative"],
        context_limit=values["context_limit"],
        expects_qmul4=bool(values["expects_qmul4_log_line"]),
        args=_args(r["args"], where),
        facts=tuple(sourced_value(f, where) for f in r.get("facts", [])),
        sources={k: r[k]["source"] for k in fields},
        hicache_host_gb_per_server=(float(sourced_value(r["hicache_host_gb_per_server"], where))
                                    if "hicache_host_gb_per_server" in r else None),
    )


# --- a launch request, checked ---------------------------------------------------------------

@dataclass(frozen=True)
class LaunchOptions:
    hardware: str
    recipe: str | None = None
    engine: str = "sglang"
    gpus: tuple[int, ...] | None = None
    port: int = DEFAULT_PORT
    tp: int | None = None
    context_length: int | None = None
    dspark: bool = False  # ask for DSpark explicitly (it is on wherever the recipe has it)
    expose: bool = False
    api_key_env: str = DEFAULT_API_KEY_ENV
    image: str | None = None
    image_archive: Path | None = None
    cache_root: Path | None = None
    name: str | None = None  # container name; None: the pin's container_name
    replicas: int | None = None  # None: as many as --gpus holds (see router.plan_node)
    replica_ports: tuple[int, ...] | None = None
    metrics_port: int | None = None
    overrides: tuple[tuple[str, str], ...] = ()  # (server flag, value) the user set: OVERRIDE_FLAGS
    revision: str | None = None  # --revision: the model revision the user means to serve (the manifest must name it)
    chosen: tuple[RevisionChoice, ...] = ()  # who else chose a revision: `mm use`'s record, a trusted signature
    choice_doubt: str | None = None  # why a record of a choice no longer holds (the manifest changed since)


@dataclass(frozen=True)
class RevisionChoice:
    """A revision someone chose on purpose: the user (`mm use`, `mm launch --revision`) or a signer the user
    trusts (--allowed-signers). Such a revision, though not the guide's pin, is no warning at every start."""
    revision: str
    how: str  # e.g. "`mm use` at 2026-12-03T10:00:00Z", "signed by alice@example.com (...)"


# Server flags `mm launch` lets the user override, each named after the flag the guide's troubleshooting table names
# in a fix (its "CUDA out of memory" row: lower --mem-fraction-static below 0.8, then --chunked-prefill-size);
# flag -> (what the value must be, its check). SGLang's flags: the vLLM recipes take none of them.
OVERRIDE_FLAGS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "--mem-fraction-static": ("a fraction between 0 and 1", lambda v: 0 < float(v) < 1),
    "--chunked-prefill-size": ("a whole number of tokens, 1 or more", lambda v: int(v) >= 1),
}


def check_overrides(overrides: tuple[tuple[str, str], ...], engine: str) -> None:
    for flag, value in overrides:
        if flag not in OVERRIDE_FLAGS:
            raise BadValue(f"{flag}: not a server flag mm launch overrides (those it does: {', '.join(OVERRIDE_FLAGS)})")
        if engine != "sglang":
            raise BadValue(f"{flag}: an SGLang flag; the {engine} recipes do not take it")
        what, ok = OVERRIDE_FLAGS[flag]
        try:
            good = ok(value)
        except ValueError:
            good = False
        if not good:
            raise BadValue(f"{flag} {value!r}: must be {what}")


@dataclass(frozen=True)
class EnvRef:
    """A shell variable expanded when the script runs: the secret's value is never in the script."""

    name: str

    def __str__(self) -> str:
        return "${%s}" % self.name


Token = str | EnvRef


@dataclass(frozen=True)
class Mount:
    host: Path
    container: str
    read_only: bool = False

    def spec(self) -> str:
        return f"{self.host}:{self.container}" + (":ro" if self.read_only else "")


@dataclass(frozen=True)
class LaunchPlan:
    recipe: Recipe
    hardware: Hardware
    model_dir: Path
    repo_id: str
    revision: str
    container_model_path: str
    image: str
    image_archive: Path | None
    gpus: tuple[int, ...]
    port: int
    expose: bool
    api_key_env: str | None
    name: str
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]
    entrypoint: str | None
    engine_argv: tuple[Token, ...]
    cache_root: Path | None
    uses_dspark: bool
    revalidate: bool
    sampling: dict[str, float]
    warnings: tuple[str, ...] = field(default=())
    overrides: tuple[tuple[str, str, str | None], ...] = ()  # (flag, the user's value, the recipe's value or None)
    image_id: str | None = None  # config digest recorded by `mm image save`: what survives `docker load`
    image_record: Path | None = None  # that record (beside the archive)
    revision_choice: str | None = None  # a revision other than the guide's pin, and who chose it (no warning)
    revision_warning: str | None = None  # a revision other than the pin that nobody chose: the script warns at start

    @property
    def archive_hint(self) -> str:
        """The archive to `docker load`, as the script names it when the image is missing."""
        if self.image_archive:
            return str(self.image_archive)
        if self.image_record:
            return str(self.image_record.with_name(self.image_record.name.removesuffix(IMAGE_RECORD_SUFFIX)))
        return "<the image archive from the bundle>"

    @property
    def cache_mounts(self) -> tuple[Mount, ...]:
        return tuple(m for m in self.mounts if not m.read_only)


def choose_recipe(catalog: Catalog, opts: LaunchOptions) -> Recipe:
    hw = catalog.hardware.get(opts.hardware)
    if hw is None:
        raise BadValue(f"--hardware {opts.hardware!r}: unknown (known: {', '.join(catalog.hardware)})")
    if opts.engine not in catalog.engines:
        raise BadValue(f"--engine {opts.engine!r}: unknown (known: {', '.join(catalog.engines)})")
    candidates = catalog.recipes_for(opts.engine, opts.hardware)
    if not candidates:
        others = sorted({r.engine for r in catalog.recipes if r.hardware == opts.hardware})
        raise Refused(f"the guide has no {opts.engine} recipe for {opts.hardware}; use --engine {' or '.join(others)}")
    wanted = opts.recipe or (hw.default_recipe if opts.engine == "sglang" else candidates[0].name)
    recipe = next((r for r in candidates if r.name == wanted), None)
    if recipe is None:
        names = ", ".join(r.name for r in candidates)
        raise Refused(f"the guide has no {opts.engine} {wanted!r} recipe for {opts.hardware}; "
                      f"its {opts.hardware} recipes are: {names} (use --recipe {candidates[0].name})")
    return recipe


def check_combination(catalog: Catalog, recipe: Recipe, opts: LaunchOptions) -> None:
    """Refuse what the guide says fails, naming the recipe to use instead."""
    hw = catalog.hardware[recipe.hardware]
    if opts.dspark and not recipe.speculative:
        if hw.family == "hopper" or recipe.engine == "vllm":
            message = catalog.refusals["dspark_non_blackwell"] if hw.family == "hopper" else "the guide gives no DSpark flags for vLLM"
            raise Refused(f"DSpark on {recipe.hardware} ({recipe.id}): {message}; use the {recipe.id} recipe without "
                          f"--dspark (no speculative decoding), or a Blackwell recipe such as --hardware b300 --recipe balanced")
        raise Refused(f"recipe {recipe.id} does not use DSpark; pick one that does (e.g. --recipe low-latency)")
    rocm_max = int(catalog.refusals[ROCM_MAX_TP_KEY])
    tp = opts.tp or _recipe_tp(recipe)
    n_gpus = len(opts.gpus) if opts.gpus else (opts.tp or recipe.gpus)  # one replica's GPUs
    if hw.vendor == "amd" and max(tp, n_gpus) > rocm_max:
        raise Refused(
            f"{recipe.hardware}: ROCm runs the NVFP4 checkpoint at TP {rocm_max} or lower (asked for {max(tp, n_gpus)} "
            f"in one server); on an 8-GPU node run two TP {rocm_max} servers behind the SGLang router: "
            f"mm launch DIR --hardware {recipe.hardware} --recipe {recipe.name} --gpus 0,1,2,3,4,5,6,7 "
            f"(replicas on --gpus 0,1,2,3 and --gpus 4,5,6,7, the router on --port {opts.port})")
    limit = recipe.context_limit or catalog.model_max_context
    if opts.context_length is not None:
        if opts.context_length > limit:
            hint = ("use a Blackwell recipe (e.g. --hardware b300 --recipe balanced) for longer contexts"
                    if recipe.context_limit else "that is the model's maximum")
            raise Refused(f"--context-length {opts.context_length:,} is above the {recipe.id} recipe's limit of "
                          f"{limit:,} tokens; use --context-length {limit} or less ({hint})")
        if recipe.engine != "sglang":
            raise BadValue(f"--context-length: the guide gives no context flag for {recipe.engine}; leave it out")


def _recipe_tp(recipe: Recipe) -> int:
    arg = recipe.arg("--tp", "--tensor-parallel-size")
    return int(arg.value) if arg and arg.value else recipe.gpus


def check_model_dir(model_dir: Path, recipe: Recipe, pin: Pin) -> tuple[str, str]:
    """Manifest present, quick verify passes, the pin's draft subfolder present when the recipe uses the draft.

    Returns (repo_id, revision) from the manifest.
    """
    from ..integrity.verify import require_quick_verify  # imported here to keep launch light

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a directory")
    mpath = manifest_path(model_dir)
    if not mpath.is_file():
        raise BadInput(f"{mpath}: no manifest; run `mm fetch` (or `mm unbundle`) for this directory first")
    manifest = read_manifest(mpath)
    if manifest.partial is not None:  # verify passes it (it judges what was asked for); a server needs it all
        raise Refused(f"{model_dir}: a partial fetch ({manifest.partial.asked()}) left {len(manifest.partial.left_out)} "
                      f"file(s) of the revision out (e.g. {manifest.partial.left_out[0]}); fetch the whole revision "
                      f"before launching")
    if manifest.repo_id != recipe.weights_repo:
        raise Refused(f"{model_dir}: holds {manifest.repo_id}, but recipe {recipe.id} is for {recipe.weights_repo}; "
                      f"fetch {recipe.weights_repo} or pick a recipe for these weights")
    if recipe.speculative:
        draft = pin.draft_dir
        if draft is None:
            raise Refused(f"recipe {recipe.id} uses speculative decoding, but pin {pin.name} names no draft model "
                          f"(draft.subfolder); pick a recipe without it")
        if not (model_dir / draft).is_dir():
            raise Refused(f"{model_dir / draft}: missing, but recipe {recipe.id} uses DSpark (the draft lives in {draft}/ "
                          f"at the same revision); fetch the pinned revision again: {draft}/ is part of it")
    require_quick_verify(model_dir, manifest, before="launching")
    return manifest.repo_id, manifest.revision


def read_identity(model_dir: Path, recipe: Recipe) -> tuple[str, str]:
    """(repo_id, revision) from the manifest when there is one, else the recipe's weights (no checks)."""
    try:
        manifest = read_manifest(manifest_path(model_dir))
        return manifest.repo_id, manifest.revision
    except (BadInput, OSError):
        return recipe.weights_repo, "unknown"


def plan_launch(model_dir: Path, opts: LaunchOptions, catalog: Catalog | None = None,
                identity: tuple[str, str] | None = None) -> LaunchPlan:
    """One server. IDENTITY (repo_id, revision) skips the model-directory checks: the caller made them."""
    catalog = catalog or load_catalog()
    recipe = choose_recipe(catalog, opts)
    from .docker import as_mounted  # a store's `current` pointer is mounted as named: `mm use` decides the next start

    mount_dir = as_mounted(model_dir)
    model_dir = Path(model_dir).resolve()
    # the model directory first, then the request
    repo_id, revision = identity or check_model_dir(model_dir, recipe, catalog.pin)
    opts = replace(opts, name=opts.name or catalog.pin.container_name)
    check_combination(catalog, recipe, opts)
    engine = catalog.engines[recipe.engine]
    hw = catalog.hardware[recipe.hardware]
    warnings: list[str] = []
    revalidate = not recipe.exact_command_published

    image = opts.image or engine.image
    if not image:
        raise BadValue(f"--image: the guide pins no {recipe.engine} image for {recipe.hardware}; pass --image NAME@sha256:<digest>")
    if not IMAGE_BY_DIGEST.match(image):
        raise BadValue(f"--image {image!r}: give the image by digest (NAME@sha256:<64 hex>) so every host runs the same bytes")
    if hw.vendor == "amd" and image == catalog.pin.image:
        raise BadValue(f"--image: the pinned image is CUDA-only; {recipe.hardware} needs a ROCm SGLang image by digest")
    if opts.image_archive is not None and not Path(opts.image_archive).is_file():
        raise BadInput(f"--image-archive {opts.image_archive}: no such file")
    if not ENV_NAME.match(opts.api_key_env):
        raise BadValue(f"--api-key-env {opts.api_key_env!r}: not a shell variable name")
    if not 1 <= opts.port <= 65535:
        raise BadValue(f"--port {opts.port}: out of range")

    tp = opts.tp or _recipe_tp(recipe)
    gpus = tuple(opts.gpus) if opts.gpus else tuple(range(tp if opts.tp else recipe.gpus))
    needed = tp if opts.tp else recipe.gpus
    if len(gpus) != needed or len(set(gpus)) != len(gpus):
        raise BadValue(f"--gpus {','.join(map(str, gpus))}: recipe {recipe.id} runs on {needed} distinct GPUs")
    if opts.tp and opts.tp != _recipe_tp(recipe):
        revalidate = True
        warnings.append(f"TP {opts.tp} differs from the recipe's TP {_recipe_tp(recipe)}: revalidate before serving traffic")
    revision_choice, revision_warning = judge_revision(model_dir, revision, catalog.pin, recipe, opts)
    if revision_warning:
        warnings.append(revision_warning)
    if recipe.status != "validated by the SGLang Cookbook":
        warnings.append(f"recipe {recipe.id} status: {recipe.status}")

    container_model = f"{CONTAINER_MODELS}/{repo_id.rsplit('/', 1)[-1]}"
    cache_root = None
    mounts = [Mount(mount_dir, container_model, read_only=True)]
    snapshot = snapshot_of(model_dir)
    if snapshot is not None:  # a Hugging Face cache snapshot: its links (../../blobs/<id>) must resolve in the container
        mounts.append(Mount(Path(snapshot.blobs), HF_BLOBS_MOUNT, read_only=True))
    env: list[tuple[str, str]] = [("HF_HUB_OFFLINE", "1")]
    if hw.family == "blackwell":
        env += list(engine.msa_jit_env.items())
    caches = [c for c in engine.caches if hw.family in c.families]
    if caches:
        beside = state_dir(model_dir) if snapshot is not None else None  # never inside hf's cache
        cache_root = kernel_cache_root(model_dir, recipe.id, opts.cache_root, beside)
        for c in caches:
            # docker -v would mount whatever a link planted here points to, read-write, into the container
            mounts.append(Mount(check_inside(cache_root, cache_root / c.name), c.container))
            if c.env:
                env.append((c.env, c.container))

    for m in mounts:
        if ":" in str(m.host) or "," in str(m.host):
            raise BadInput(f"{m.host}: docker -v cannot mount a path containing ':' or ','; move or link it")
    check_overrides(opts.overrides, recipe.engine)
    engine_argv = _engine_argv(engine, recipe, tp, opts, container_model)
    recipe_values = {a.flag: a.value for a in engine.common_args + recipe.args}
    overrides = tuple((flag, value, recipe_values.get(flag)) for flag, value in opts.overrides)
    image_record, image_id, image_warnings = find_image_record(image, model_dir, opts.image_archive)
    warnings += image_warnings
    return LaunchPlan(
        recipe=recipe, hardware=hw, model_dir=model_dir, repo_id=repo_id, revision=revision,
        container_model_path=container_model, image=image,
        image_archive=Path(opts.image_archive).resolve() if opts.image_archive else None,
        gpus=gpus, port=opts.port, expose=opts.expose,
        api_key_env=opts.api_key_env if opts.expose else None, name=opts.name,
        env=tuple(env), mounts=tuple(mounts), entrypoint=engine.entrypoint, engine_argv=tuple(engine_argv),
        cache_root=cache_root, uses_dspark=bool(recipe.speculative), revalidate=revalidate,
        sampling=catalog.sampling, warnings=tuple(warnings), image_id=image_id, image_record=image_record,
        overrides=overrides, revision_choice=revision_choice, revision_warning=revision_warning,
    )


def judge_revision(model_dir: Path, revision: str, pin: Pin, recipe: Recipe,
                   opts: LaunchOptions) -> tuple[str | None, str | None]:
    """(who chose the revision, None) or (None, the warning) for a revision of the pinned repo other than the
    guide's pin; (None, None) for the pin itself or another repo. Chosen: --revision names it (a --revision the
    directory does not hold is refused), `mm use` recorded it with this very manifest, or a trusted signer signed it."""
    if opts.revision is not None and not revision.startswith(opts.revision.lower()):
        raise Refused(f"{model_dir}: holds revision {revision}, not --revision {opts.revision}; launch the directory "
                      f"that holds it, or leave --revision out")
    if revision == pin.revision or recipe.weights_repo != pin.repo_id:
        return None, None
    how = ([f"--revision {opts.revision} on the command line"] if opts.revision is not None else []) + \
        [c.how for c in opts.chosen if c.revision == revision]
    if how:
        return f"model revision {revision} (not the guide's pin {pin.revision}) was chosen: {'; '.join(how)}", None
    why = opts.choice_doubt or (f"nobody chose it: `mm use` it (in a model root), or launch with --revision "
                                f"{revision[:12]} (or --allowed-signers, when it is signed)")
    return None, f"model revision {revision} is not the guide's pin {pin.revision}, and {why}"


def find_image_record(image: str, model_dir: Path, archive: Path | None) -> tuple[Path | None, str | None, list[str]]:
    """The `mm image save` record for IMAGE: beside --image-archive, else in the unbundled payload
    (DIR.payload/image/, `mm unbundle`'s default). Returns (record, image ID, warnings) or (None, None, warnings);
    the warnings name a payload archive that is not IMAGE (carried with --allow-other-image) or has no record."""
    from .image import read_record  # here: only a plan with an archive or a payload needs it

    warnings: list[str] = []
    if archive is not None:
        candidates = [Path(archive).with_name(Path(archive).name + IMAGE_RECORD_SUFFIX)]
    else:
        payload = model_dir.with_name(model_dir.name + ".payload") / "image"
        candidates = sorted(payload.glob("*" + IMAGE_RECORD_SUFFIX)) if payload.is_dir() else []
        for tar in sorted(payload.glob("*.tar")) if payload.is_dir() else []:
            if not tar.with_name(tar.name + IMAGE_RECORD_SUFFIX).is_file():
                warnings.append(f"{tar}: no {IMAGE_RECORD_SUFFIX} record beside it; not proven to be {image}")
    for path in candidates:
        if path.is_file():
            record = read_record(path)
            if record.chain.reference == image:
                return path.resolve(), record.chain.config, warnings
            if archive is not None:
                raise Refused(f"{path}: records {record.chain.reference}, not the image this plan runs ({image}); "
                              f"pass the archive of {image} (mm image save)")
            warnings.append(f"{path.with_name(record.archive)} is {record.chain.reference}, not the image this plan "
                            f"runs ({image})")
    return None, None, warnings


def _engine_argv(engine: Engine, recipe: Recipe, tp: int, opts: LaunchOptions, model_path: str) -> list[Token]:
    subst = {"{model_path}": model_path, "{port}": str(opts.port)}
    argv: list[Token] = [subst.get(t, t) for t in engine.command]
    tp_flags = ("--tp", "--tensor-parallel-size")
    for a in engine.common_args + recipe.args:
        argv.append(a.flag)
        if a.value is not None:
            argv.append(str(tp) if a.flag in tp_flags else subst.get(a.value, a.value))
    if opts.context_length is not None:
        if "--context-length" in argv:
            argv[argv.index("--context-length") + 1] = str(opts.context_length)
        else:
            argv += ["--context-length", str(opts.context_length)]
    for flag, value in opts.overrides:  # the user's value in place of the recipe's, else added
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    for a in engine.tail_args:
        argv += [a.flag] + ([subst.get(a.value, a.value)] if a.value is not None else [])
    if opts.expose:
        argv += [engine.api_key_flag, EnvRef(opts.api_key_env)]
    return argv


# --- rendering -------------------------------------------------------------------------------

def docker_run_argv(plan: LaunchPlan, *, detach: bool = False, name: str | None = None,
                    extra_env: tuple[tuple[str, str], ...] = (), image: Token | None = None) -> list[Token]:
    """The one `docker run` for PLAN; warm-up runs the same line detached under its own name.

    Never pulls (`--pull never`): the host is offline; IMAGE is how the image was found on this host (the script's
    `$image`, the pinned reference or the recorded image ID)."""
    argv: list[Token] = ["docker", "run", "-d" if detach else "--rm", "--pull", "never", "--name", name or plan.name]
    if plan.hardware.vendor == "nvidia":
        argv += ["--gpus", '"device=%s"' % ",".join(map(str, plan.gpus))]
    else:  # ROCm containers reach the GPUs through the kernel driver devices
        argv += ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video",
                 "-e", "HIP_VISIBLE_DEVICES=" + ",".join(map(str, plan.gpus))]
    published = f"{plan.port}:{plan.port}" if plan.expose else f"127.0.0.1:{plan.port}:{plan.port}"
    argv += ["--shm-size", f"{SHM_GIB}g", "--ipc=host", "-p", published]
    for key, value in plan.env + tuple(extra_env):
        argv += ["-e", f"{key}={value}"]
    for m in plan.mounts:
        argv += ["-v", m.spec()]
    if plan.entrypoint:
        argv += ["--entrypoint", plan.entrypoint]
    argv.append(image if image is not None else plan.image)
    argv += list(plan.engine_argv)
    return argv


def _shell(token: Token) -> str:
    return f'"{token}"' if isinstance(token, EnvRef) else shlex.quote(token)


def override_lines(plan: LaunchPlan) -> list[str]:
    """The script's statement of each override: the user's value, not the guide's."""
    return [f"# Override: {flag} {value} is the user's (mm launch {flag} {value}), not the guide's: the recipe has "
            + (f"{flag} {was}" if was is not None else "no value for it (SGLang's default)")
            for flag, value, was in plan.overrides]


def revision_lines(plan: LaunchPlan) -> list[str]:
    """The script's statement of a revision other than the guide's pin that someone chose (no warning then)."""
    return [f"# Revision: {plan.revision_choice}."] if plan.revision_choice else []


def start_warning_lines(plan: LaunchPlan) -> list[str]:
    """What the script says on stderr at every start: a revision nobody chose (`mm launch` said the same)."""
    if not plan.revision_warning:
        return []
    return [f"echo {shlex.quote('WARNING: ' + plan.revision_warning)} >&2", ""]


def render_script(plan: LaunchPlan) -> str:
    r = plan.recipe
    lines = [
        "#!/usr/bin/env bash",
        f"# Offline start of {plan.repo_id} @ {plan.revision}, generated by `mm launch`.",
        f"# Recipe {r.id}: {r.status} ({r.sources['status']}).",
        f"# Image pinned by digest; model mounted read-only at {plan.container_model_path}; no network needed.",
    ]
    lines += [f"# Note: {f}" for f in r.facts]
    if plan.hardware.vendor == "amd":
        lines.append("# Note: GPU access (--device /dev/kfd /dev/dri, HIP_VISIBLE_DEVICES) follows the ROCm container convention, not the guide.")
    lines += revision_lines(plan)
    lines += [f"# Warning: {w}" for w in plan.warnings]
    lines += override_lines(plan)
    hicache = hicache_statement(plan, 1)
    if hicache:
        lines.append(f"# {hicache}")
    lines += ["set -euo pipefail", ""]
    lines += start_warning_lines(plan)
    if plan.revalidate:
        why = ("the guide does not publish the exact command for this recipe (it points to the SGLang configuration "
               "generator); only the flags it states are here" if not r.exact_command_published else "; ".join(plan.warnings))
        lines += [f"# REVALIDATE: {why}. Check this command against the upstream recipe before serving traffic.",
                  f"echo {shlex.quote(f'WARNING: {r.id}: command must be revalidated against the upstream recipe before serving traffic')} >&2",
                  ""]
    lines += script_setup(plan, plan.api_key_env if plan.expose else None, "Published on all interfaces",
                          "Kernel caches persist across starts (MSA, FlashInfer, Triton, DeepGEMM); `mm warmup` fills them.")
    lines.append(_wrap(docker_run_argv(plan, image=IMAGE_VAR), IMAGE_VAR))
    return "\n".join(lines) + "\n"


# What doctor, warm-up and the start script say when docker cannot start a container (one wording for all three).
IMAGE_VAR = EnvRef("image")  # how the script found the image on this host (image_lines); every docker run uses it


def image_candidates(plan: LaunchPlan) -> tuple[str, ...]:
    """What the image may be called on this host, in the order the start script tries (image_lines): the pinned
    reference, else the image ID `mm image save` recorded. `mm warmup` and `mm doctor` search the same way."""
    return (plan.image,) + ((plan.image_id,) if plan.image_id else ())


def image_identity(plan: LaunchPlan) -> str:
    """The image as messages name it: the pinned reference and, when recorded, its image ID."""
    return plan.image + (f" (image ID {plan.image_id})" if plan.image_id else "")


def script_setup(plan: LaunchPlan, api_key_env: str | None, exposed: str, caches: str) -> list[str]:
    """The lines before the first `docker run`: demand the API key, find (or load) the image by identity, make the
    caches. Every `docker run` after them names the image as IMAGE_VAR."""
    lines = []
    if api_key_env:
        lines += [f"# {exposed}: clients must send Authorization: Bearer ${api_key_env}.",
                  f': "${{{api_key_env}:?set {api_key_env} to the API key clients must send (it is not stored in this script)}}"',
                  ""]
    lines += image_lines(plan)
    if plan.cache_mounts:
        lines += [f"# {caches}", "mkdir -p " + " ".join(shlex.quote(str(m.host)) for m in plan.cache_mounts), ""]
    return lines


def image_lines(plan: LaunchPlan) -> list[str]:
    """Find the image by what survives `docker load`: the pinned reference (kept by the containerd store, or
    pulled), else the image ID `mm image save` recorded (Docker's classic store drops repo digests on load).
    Neither: load --image-archive and check the loaded ID, or stop naming the archive to load."""
    from .docker import DOCKER_DOWN, DOCKER_MISSING  # here: launch stays light (docker's module loads the tools)

    q = shlex.quote
    lines = ["# Docker first: a host without it, or with its daemon down, is told so (not that the image is missing).",
             f"command -v docker >/dev/null 2>&1 || {{ echo {q('mm: ' + DOCKER_MISSING)} >&2; exit 1; }}",
             "docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || "
             f"{{ echo {q('mm: ' + DOCKER_DOWN)} >&2; exit 1; }}",
             "",
             "# The image by identity, never pulled: the pinned reference if this host has it, else the image ID",
             "# (config digest) `mm image save` recorded; Docker's classic store drops repo digests on `docker load`.",
             f"image_ref={q(plan.image)}",
             f"image_id={q(plan.image_id or '')}",
             "find_image() {",
             '  if docker image inspect "$image_ref" >/dev/null 2>&1; then image=$image_ref',
             '  elif [ -n "$image_id" ] && docker image inspect "$image_id" >/dev/null 2>&1; then image=$image_id',
             "  else return 1",
             "  fi",
             "}"]
    ident = image_identity(plan)
    if plan.image_archive:
        archive = q(str(plan.image_archive))
        lines += ["if ! find_image; then",
                  f"  echo {q(f'loading the image from {plan.image_archive}')} >&2",
                  f"  docker load -i {archive} >&2",
                  f"  find_image || {{ echo {q(f'mm: {plan.image_archive}: loaded, but this host still lacks {ident}; the archive holds another image')} >&2; exit 1; }}",
                  "fi", ""]
    else:
        lines += [f"find_image || {{ echo {q(f'mm: image {ident} is not on this host: docker load -i {plan.archive_hint}')} >&2; exit 1; }}",
                  ""]
    return lines


def _wrap(argv: list[Token], image: Token, exec_: bool = True) -> str:
    """One flag (with its value) per line, the image and the engine command on their own, like the guide."""
    lines: list[list[str]] = [["exec"] if exec_ else []]
    after_image = False
    for token in argv:
        is_flag = isinstance(token, str) and token.startswith("-") and token != "-m"  # `python3 -m module` stays whole
        if (is_flag or token == image or after_image) and lines[-1]:
            lines.append([])
        after_image = token == image
        lines[-1].append(_shell(token))
    return " \\\n  ".join(" ".join(line) for line in lines if line)


def hicache_statement(plan: LaunchPlan, replicas: int) -> str | None:
    """HiCache keeps evicted prefixes in host memory; --hicache-size is per rank (guide), so say the node's total."""
    gb = hicache_host_gb(plan, replicas)
    if gb is None:
        return None
    tp = int(dict(_pairs(plan.engine_argv)).get("--tp") or plan.recipe.gpus)
    size = dict(_pairs(plan.engine_argv)).get("--hicache-size")
    if size:
        how = f"{replicas} replica(s) x {tp} ranks x {size} GB (--hicache-size is per rank)"
    else:
        how = f"{replicas} replica(s) x about {plan.recipe.hicache_host_gb_per_server:,.0f} GB per TP {tp} server (the guide's figure at the default HiCache ratio)"
    return f"HiCache host memory: {how} = {gb:,.0f} GB in total on this host; size host memory before starting."


def hicache_host_gb(plan: LaunchPlan, replicas: int) -> float | None:
    """Host memory the HiCache pools of REPLICAS servers of PLAN take, in GB (None: the recipe has no HiCache)."""
    args = dict(_pairs(plan.engine_argv))
    if "--enable-hierarchical-cache" not in args:
        return None
    tp = int(args.get("--tp") or plan.recipe.gpus)
    if args.get("--hicache-size"):
        return replicas * tp * float(args["--hicache-size"])
    if plan.recipe.hicache_host_gb_per_server:
        return replicas * plan.recipe.hicache_host_gb_per_server
    return None


def _pairs(argv) -> list[tuple[str, str | None]]:
    """(flag, value or None) for an engine argv."""
    tokens = [str(t) for t in argv]
    out = []
    for i, t in enumerate(tokens):
        if t.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            out.append((t, None if nxt is None or nxt.startswith("--") else nxt))
    return out


def plan_document(plan: LaunchPlan) -> dict:
    """The plan as data (`--format json`): argv lists with secrets as ${VAR} references."""
    r = plan.recipe
    return {
        "recipe": r.id, "status": r.status, "exact_command_published": r.exact_command_published,
        "revalidate": plan.revalidate, "repo_id": plan.repo_id, "revision": plan.revision,
        "model_dir": str(plan.model_dir), "container_model_path": plan.container_model_path,
        "image": plan.image, "image_archive": str(plan.image_archive) if plan.image_archive else None,
        "image_id": plan.image_id, "image_record": str(plan.image_record) if plan.image_record else None,
        "gpus": list(plan.gpus), "port": plan.port, "expose": plan.expose, "api_key_env": plan.api_key_env,
        "env": dict(plan.env), "mounts": [m.spec() for m in plan.mounts],
        "cache_root": str(plan.cache_root) if plan.cache_root else None,
        "uses_dspark": plan.uses_dspark, "expects_qmul4": r.expects_qmul4, "sampling": plan.sampling,
        "engine_argv": [str(t) for t in plan.engine_argv],
        "docker_argv": [str(t) for t in docker_run_argv(plan)],
        "facts": list(r.facts), "warnings": list(plan.warnings),
        "revision_choice": plan.revision_choice, "revision_warning": plan.revision_warning,
        "overrides": [{"flag": f, "value": v, "recipe_value": was, "source": "the user's override (mm launch)"}
                      for f, v, was in plan.overrides],
        "sources": {"recipe": r.sources, "args": {a.flag: a.source for a in r.args}},
    }


def kernel_cache_root(model_dir: Path, recipe_id: str, given: Path | None, beside: Path | None = None) -> Path:
    """The kernel caches' root: --cache-root as the user named it (links followed: their choice), or mm's default
    BESIDE/mm-kernel-cache/<recipe> (BESIDE: MODEL_DIR/.., or mm's state directory for a Hugging Face cache
    snapshot), whose two directories mm names and so must not be links."""
    if given:
        return user_path(given)
    parent = user_path(beside or Path(model_dir).parent)
    return user_path(check_inside(parent, parent / "mm-kernel-cache" / recipe_id.replace("/", "-")))


def write_output(text: str, out: Path, executable: bool) -> None:
    """Atomically (temporary name, fsync, rename); a start script is executable, a JSON plan is not. OUT is the
    user's: its links are followed (their choice), and the file is written at the real path."""
    out = user_path(out)
    atomic_write_text(out, text, mode=0o755 if executable else 0o644, root=out.parent)
