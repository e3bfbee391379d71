"""Shared pytest fixtures; each capability keeps its fixtures in its own section."""
from __future__ import annotations

# --- hub server fixtures ---
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.gitrepo import ModelRepo, commit_dir, make_commits_with_shared_prefix, make_model_repo
from tests.support.hubserver import HubServer
from tests.support.run import run_mm as _run_mm

# `mm bundle` carries mm's wheelhouse by default (pip download from the package index); tests that are not about
# it bundle without (tests/test_airgap.py and test_wheelhouse.py ask for it with MM_BUNDLE_NO_MM=0).
os.environ["MM_BUNDLE_NO_MM"] = "1"

BIG_FILE = "model.safetensors"
BIG_BYTES = 8 * 1024 * 1024  # big enough that a rate-limited download can be killed mid-file


@pytest.fixture(scope="session", autouse=True)
def _xdg_cache_home(tmp_path_factory) -> None:
    """mm's cache directory (the wheelhouse `mm bundle` builds) under the session's tmp, never the user's ~/.cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """The directory the session's Hub server serves (<owner>/<name> git repos)."""
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="session")
def model_repo(hub_root) -> ModelRepo:
    """MiniMaxAI/MiniMax-M3.1-Flash double: 4 shards of ~256 KiB + dspark/, commits [first upload, README
    change], tag v1.0 on the first, main on the second; source_dirs hold each commit's plain files."""
    return make_model_repo(hub_root, shards=4, shard_bytes=256 * 1024, draft=True)


@pytest.fixture(scope="session")
def _hub_server_session(hub_root):
    with HubServer(hub_root) as server:
        yield server


@pytest.fixture
def hub_server(_hub_server_session) -> HubServer:
    """The session's server with counters and fault hooks cleared for this test (and no connection of an earlier
    test still being served: its bytes would count here)."""
    _hub_server_session.quiesce()
    _hub_server_session.reset()
    yield _hub_server_session
    _hub_server_session.quiesce()
    _hub_server_session.reset()


def _write_small_repo_files(src: Path, tensor_bytes: int, seed: int) -> None:
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text('{"model_type": "test"}\n')
    data = np.random.default_rng(seed).integers(0, 256, size=tensor_bytes, dtype=np.uint8)
    save_file({"weight": data}, str(src / BIG_FILE), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def ambiguous_repo(hub_root, tmp_path_factory) -> tuple[str, str]:
    """(repo_id, 4-hex prefix shared by two commits on its main branch; ~1500 commits in all)."""
    repo_id = "test-org/ambiguous"
    src = tmp_path_factory.mktemp("ambiguous-src")
    _write_small_repo_files(src, 1024, seed=1)
    commit_dir(hub_root / repo_id, src, "first upload")
    sha_a, _sha_b = make_commits_with_shared_prefix(hub_root / repo_id, prefix_len=4, ref="refs/heads/main")
    return repo_id, sha_a[:4]


@pytest.fixture(scope="session")
def big_repo(hub_root, tmp_path_factory) -> tuple[str, str, str, int]:
    """(repo_id, commit, big file's path, its size): one 8 MiB safetensors file, for kill/resume tests."""
    repo_id = "test-org/big-model"
    src = tmp_path_factory.mktemp("big-src")
    _write_small_repo_files(src, BIG_BYTES, seed=2)
    commit = commit_dir(hub_root / repo_id, src, "first upload")
    return repo_id, commit, BIG_FILE, (src / BIG_FILE).stat().st_size


@pytest.fixture(scope="session")
def private_repo(hub_root, _hub_server_session, tmp_path_factory) -> tuple[str, str, str]:
    """(repo_id, commit, token): a repo the session's server serves only with `Authorization: Bearer token`."""
    repo_id = "test-org/private-model"
    src = tmp_path_factory.mktemp("private-src")
    _write_small_repo_files(src, 64 * 1024, seed=3)
    commit = commit_dir(hub_root / repo_id, src, "first upload")
    token = "hf_" + secrets.token_hex(16)
    _hub_server_session.private_repos[repo_id] = token
    return repo_id, commit, token


@pytest.fixture
def unused_port() -> int:
    """A 127.0.0.1 port nothing listens on (for 'server down' tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(tmp_path: Path) -> dict[str, str]:
    """os.environ without Hub/ModelScope settings or tokens, with caches under TMP_PATH."""
    dropped = ("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "MODELSCOPE_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(dropped) and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               MODELSCOPE_CACHE=str(tmp_path / "modelscope-cache"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


@pytest.fixture
def hub_env(hub_server, tmp_path) -> dict[str, str]:
    """Environment for subprocesses that talk to the local Hub: HF_ENDPOINT set, fresh HF_HOME, no token."""
    return dict(_isolated_env(tmp_path), HF_ENDPOINT=hub_server.url)


@pytest.fixture
def run_mm(tmp_path):
    """tests.support.run.run_mm with an isolated environment by default (no Hub settings or tokens)."""
    def run(*args, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        return _run_mm(*args, env=env if env is not None else _isolated_env(tmp_path), **kwargs)
    return run
# --- end hub server fixtures ---


# --- mirror ---
from tests.support.msserver import MSServer, net_guard_env  # noqa: E402


@pytest.fixture
def ms_server():
    """A local ModelScope API server (127.0.0.1) that the real modelscope SDK talks to; empty until a test adds revisions."""
    with MSServer() as server:
        yield server


@pytest.fixture
def pinned_files(model_repo) -> dict[str, bytes]:
    """{path: bytes} of the model repo's newest commit: what a faithful mirror serves."""
    return {path: model_repo.read(path) for path in model_repo.files}


@pytest.fixture
def ms_env(hub_env, ms_server, tmp_path) -> dict[str, str]:
    """hub_env plus the SDK's endpoint, home and cache under tmp_path (so it never probes public hosts), and a
    guard that refuses and logs any non-loopback connection or DNS lookup; checked after every test."""
    guard = net_guard_env(tmp_path / "net")
    env = dict(hub_env, MODELSCOPE_ENDPOINT=ms_server.url, MODELSCOPE_HOME=str(tmp_path / "ms-home"),
               MODELSCOPE_CACHE=str(tmp_path / "ms-cache"), MODELSCOPE_DOWNLOAD_INTRA_CLOUD="false",
               MM_TEST_NET_LOG=guard["MM_TEST_NET_LOG"],
               PYTHONPATH=os.pathsep.join(p for p in (guard["PYTHONPATH"], hub_env.get("PYTHONPATH")) if p))
    yield env
    log = Path(guard["MM_TEST_NET_LOG"])
    assert not log.exists(), f"a subprocess tried to leave loopback: {log.read_text()}"
# --- end mirror ---


# --- air gap ---
@pytest.fixture(scope="session")
def wheelhouse_dir(tmp_path_factory) -> Path:
    """OUT of `build_wheelhouse` for the default targets (linux/amd64, CPython 3.10 to 3.13 and this one) and this
    Python on the other machine (x86_64, aarch64): install-mm.sh + wheelhouse/. Built once a session; downloaded
    sets are kept in the session's mm cache directory, which later builds (and `mm bundle` run by the tests) copy
    from (the same mm wheel bytes), so the suite downloads each set once."""
    from mm.artifacts.bundle import wheelhouse

    out = tmp_path_factory.mktemp("wheelhouse")
    host = wheelhouse.host_target()
    other = "aarch64" if host.machine == "x86_64" else "x86_64"
    targets = wheelhouse.targets_for() + wheelhouse.targets_for((other,), (host.python,))
    wheelhouse.build_wheelhouse(out, targets, cache=wheelhouse_cache(tmp_path_factory))
    return out


def wheelhouse_cache(tmp_path_factory) -> Path:
    """Where `mm bundle` keeps downloaded sets (wheelhouse.sets_cache), under the session's XDG_CACHE_HOME."""
    from mm.artifacts.bundle import wheelhouse

    return wheelhouse.sets_cache()


@pytest.fixture
def bare_python(tmp_path) -> Path:
    """A directory holding `python3`: this interpreter's base CPython (no venv) run as `python3 -I`."""
    bin_dir = tmp_path / "bare-bin"
    bin_dir.mkdir()
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {base} -I "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return bin_dir
@dataclass
class PinnedImage:
    registry: "Registry"
    image: "TestImage"
    repo: str  # host:port/lmsysorg/sglang
    ref: str  # repo@sha256:<index digest>: what the pin names


@pytest.fixture(scope="session")
def pinned_image(tmp_path_factory):
    """The session's docker-registry on 127.0.0.1 holding a two-platform test image (built by hand as an OCI
    layout, pushed with skopeo), named by its index digest like the pin names lmsysorg/sglang."""
    from tests.support.oci_image import build_layout, push
    from tests.support.registry import Registry

    layout = build_layout(tmp_path_factory.mktemp("oci") / "layout")
    with Registry(tmp_path_factory.mktemp("image-registry")) as reg:
        repo = f"{reg.host}/lmsysorg/sglang"
        yield PinnedImage(reg, layout, repo, push(layout, repo))


@pytest.fixture(scope="session")
def other_image(tmp_path_factory):
    """Another two-platform image (different bytes), as an OCI layout: for 'wrong image' tests."""
    from tests.support.oci_image import build_layout

    return build_layout(tmp_path_factory.mktemp("oci-other") / "layout", salt="other")
# --- end air gap ---

# --- OCI registry ---
from tests.support.registry import Registry  # noqa: E402

REGISTRY_USER, REGISTRY_PASSWORD = "mm-tester", "pw-" + secrets.token_hex(12)


@pytest.fixture(scope="session")
def registry():
    """The session's anonymous docker-registry (distribution 2.8) on 127.0.0.1; use a repository name of your own."""
    with Registry() as reg:
        yield reg


@pytest.fixture(scope="session")
def auth_registry():
    """The session's htpasswd docker-registry: user REGISTRY_USER, password REGISTRY_PASSWORD (reg.users)."""
    with Registry(users={REGISTRY_USER: REGISTRY_PASSWORD}) as reg:
        yield reg
# --- end OCI registry ---


# --- signatures ---
from tests.support.sshkeys import make_keys  # noqa: E402


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, Path]:
    """SSH keys made by the real ssh-keygen: alice and bob (passphrase) allowed, mallory not (support/sshkeys.py)."""
    return make_keys(tmp_path_factory.mktemp("keys"))
# --- end signatures ---


# --- the real container engine ---
@pytest.fixture(scope="session")
def real_docker(tmp_path_factory):
    """Debian's dockerd on a private socket, data root, exec root and bridge, started once per session (root only;
    tests/support/dockerd.py). Its `env` puts the docker wrapper (drops --gpus) first on PATH."""
    from tests.support.dockerd import Dockerd

    with Dockerd(tmp_path_factory.mktemp("dockerd")) as engine:
        yield engine
# --- end real container engine ---
