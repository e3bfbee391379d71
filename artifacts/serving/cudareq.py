"""Will the NVIDIA Container Toolkit start this image on this driver? Its own requirement check, reproduced.

A CUDA image states what it needs in its environment. The toolkit's hook (nvidia-container-toolkit
internal/config/image/cuda_image.go, GetRequirements) passes every NVIDIA_REQUIRE_* variable but
NVIDIA_REQUIRE_JETPACK to `nvidia-container-cli configure --require`, adds `cuda>=MAJOR.MINOR` of CUDA_VERSION
for a "legacy" image (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA not), and passes none when NVIDIA_DISABLE_REQUIRE
parses as true (Go's strconv.ParseBool). libnvidia-container then evaluates each requirement for every visible
GPU (src/cli/configure.c) with its small language (src/cli/dsl.c):

  - a requirement is space-separated alternatives (OR), each a comma-separated list of conditions (AND): the
    first alternative whose conditions all hold satisfies it;
  - a condition is NAME OP VALUE, OP one of = != < <= > >=, NAME one of cuda (the driver's CUDA version,
    what `nvidia-smi` shows as "CUDA Version"), driver (the driver version), arch (the GPU's compute capability)
    and brand (the GPU's brand, compared case-insensitively, = and != only);
  - versions compare numerically part by part ("13.0" < "13.4", "580.159.03" >= "580");
  - anything it cannot parse is "invalid expression", and the container does not start either;
  - an unsatisfied requirement stops the container: "unsatisfied condition: <first alternative>", with
    ", please update your driver to a newer version, or use an earlier cuda container" when it starts with cuda>=.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
JETPACK = "NVIDIA_REQUIRE_JETPACK"
DISABLE = "NVIDIA_DISABLE_REQUIRE"
CUDA_VERSION = "CUDA_VERSION"
TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go strconv.ParseBool; anything else (or an error) is false
OPERATORS = ("=", "!=", "<", "<=", ">", ">=")  # dsl.c operators[], matched on the whole operator text
_SEMVER = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[-+].*)?$")
# libnvidia-container src/driver.c driver_get_device_brand_1_svc: the brands it names; any other is "Unknown".
# (Newer toolkits name more brands; `brand_candidates` tries the GPU's own brand too.)
KNOWN_BRANDS = {"quadro": "Quadro", "tesla": "Tesla", "nvs": "NVS", "grid": "GRID", "geforce": "GeForce", "titan": "TITAN"}


class Invalid(ValueError):
    """libnvidia-container's "invalid expression"."""


@dataclass(frozen=True)
class Host:
    cuda: str | None  # the driver's CUDA version ("13.0"); None: not known (the rule then holds, as in configure.c)
    driver: str | None  # "580.159.03"
    arch: str | None  # one GPU's compute capability, "9.0"
    brand: str | None  # one GPU's brand as libnvidia-container names it


def requirements(env: dict[str, str]) -> list[str]:
    """What the toolkit asks libnvidia-container to check for an image with environment ENV ([] when disabled)."""
    if env.get(DISABLE, "") in TRUE:
        return []
    reqs = [value for name, value in sorted(env.items()) if name.startswith(REQUIRE_PREFIX) and not name.startswith(JETPACK)]
    if env.get(CUDA_VERSION) and not env.get("NVIDIA_REQUIRE_CUDA"):  # a legacy image
        m = _SEMVER.match(env[CUDA_VERSION])
        if not m:
            raise Invalid(f"CUDA_VERSION {env[CUDA_VERSION]!r}: invalid CUDA version")
        reqs.append(f"cuda>={m.group(1)}.{m.group(2) or 0}")
    return reqs


def compare_version(v1: str, op: str, v2: str) -> bool:
    """dsl.c dsl_compare_version: dotted numbers, part by part; trailing .0 parts are equal to none."""
    if not re.fullmatch(r"[0-9.]*", v1) or not re.fullmatch(r"[0-9.]*", v2):
        raise Invalid(f"{v1!r} {op} {v2!r}: not a version")
    a = [p for p in v1.split(".") if p != ""]
    b = [p for p in v2.split(".") if p != ""]
    while a and b:
        x, y = int(a.pop(0)), int(b.pop(0))
        if x != y:
            return {"=": False, "!=": True, "<": x < y, "<=": x < y, ">": x > y, ">=": x > y}[op]
    rest_a = any(int(p) for p in a)
    rest_b = any(int(p) for p in b)
    if op == "!=":
        return rest_a or rest_b
    if op in ("=", "<=", ">=") and not rest_a and not rest_b:
        return True
    if op == "=":
        return False
    if op in ("<", "<="):
        return not rest_a and rest_b
    return rest_a and not rest_b


def _condition(expr: str, host: Host) -> bool:
    m = re.match(r"^([^<>=!]+)([<>=!]+)(.*)$", expr)
    if not m or m.group(2) not in OPERATORS or m.group(3) == "":
        raise Invalid(expr)
    name, op, value = m.group(1).lower(), m.group(2), m.group(3)
    if name == "cuda":
        return True if host.cuda is None else compare_version(host.cuda, op, value)
    if name == "driver":
        return True if host.driver is None else compare_version(host.driver, op, value)
    if name == "arch":
        return True if host.arch is None else compare_version(host.arch, op, value)
    if name == "brand":
        if host.brand is None:
            return True
        if op not in ("=", "!="):
            raise Invalid(expr)
        return (host.brand.lower() == value.lower()) == (op == "=")
    raise Invalid(expr)


def satisfied(requirement: str, host: Host) -> bool:
    """dsl.c dsl_evaluate: True when one space-separated alternative has all its comma-separated conditions."""
    ok = True
    for alternative in requirement.split(" "):
        if alternative == "":
            continue
        conditions = [c for c in alternative.split(",") if c != ""]
        all_held = True
        for condition in conditions:
            ok = _condition(condition, host)
            if not ok:
                all_held = False
                break
        if all_held:
            return True if conditions else ok
    return ok


def refusal(requirement: str) -> str:
    """The message nvidia-container-cli prints when REQUIREMENT is not satisfied."""
    first = requirement.split(" ")[0]
    if first.startswith("cuda>="):
        return (f"nvidia-container-cli: requirement error: unsatisfied condition: {first}, please update your driver "
                f"to a newer version, or use an earlier cuda container")
    return f"nvidia-container-cli: requirement error: unsatisfied condition: {first}"


def brand_candidates(product_brand: str | None) -> list[str | None]:
    """The brand strings a toolkit may report for a GPU whose `nvidia-smi -q` says PRODUCT_BRAND: the stored
    libnvidia-container's mapping (Quadro, Tesla, NVS, GRID, GeForce, TITAN, else Unknown) and the GPU's own word
    (newer toolkits name NVIDIA and RTX brands)."""
    if not product_brand:
        return [None]
    stored = KNOWN_BRANDS.get(product_brand.strip().lower(), "Unknown")
    own = product_brand.strip().replace(" ", "")
    return [stored] if own.lower() == stored.lower() else [stored, own]


def major_minor(version: str | None) -> tuple[int, int] | None:
    m = _SEMVER.match(version or "")
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


# NVIDIA CUDA Compatibility, "Minor Version Compatibility", table 1 (docs.nvidia.com/deploy/cuda-compatibility/
# minor-version-compatibility.html): the minimum driver on which any runtime of that CUDA major version runs.
MINOR_COMPAT_MIN_DRIVER = {13: 580, 12: 525, 11: 450}
