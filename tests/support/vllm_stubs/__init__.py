"""Stand-ins so that vLLM 0.33.0's own `vllm serve` parser imports on a CPU test venv (no torch, no CUDA).

vLLM is installed with --no-deps (Makefile), with the few real packages its parser code runs on: pydantic (vLLM's
configs are pydantic dataclasses whose fields become the flags, with their types and choices), regex and PyYAML
(FlexibleArgumentParser). Everything else its import chain reaches is a stub from tests/support/sglang_stubs (the
same machinery as SGLang's parser test); only the parser test's subprocess installs them (`install()`).
"""
from __future__ import annotations

import inspect
import types

from tests.support import sglang_stubs
from tests.support.sglang_stubs import _StubBase, _StubMeta

# What `vllm.entrypoints.cli.serve` (the `vllm serve` subcommand) imports at module level (directly or through vllm.config / vllm.engine.arg_utils)
# that the test venv lacks, and why that is safe to stub (none of it decides which flags exist or what they accept):
STUBBED = (
    "torch",               # tensors and custom ops; the parser reads only torch.dtype/device as type names (below)
    "transformers",        # model configs (HF AutoConfig), read when the engine starts, not when flags are parsed
    "openai", "openai_harmony",  # request/response types of the API server's protocol models
    "fastapi", "uvloop", "aiohttp", "prometheus_client", "zmq",  # the HTTP server, event loop, metrics, IPC
    "psutil", "cpuinfo",   # host probing (memory, CPU flags) at engine start
    "cbor2", "cloudpickle", "pybase64", "PIL",  # hashing/serialisation of requests and images
    "cachetools",          # LRU caches for multimodal inputs
    "partial_json_parser", "xgrammar", "llguidance",  # structured output and tool-call output decoding
    "starlette", "uvicorn", "watchfiles", "orjson",  # more of the HTTP server (responses, reload, JSON encoding)
    "tokenizers",          # HF tokenizers, loaded with the model
)


def _infer_schema(fn, mutates_args=(), **kwargs) -> str:
    """torch.library.infer_schema: vLLM's IR op registry (reached from config validation) registers its ops at import
    time and splits the schema at ' -> ' to count the Tensor outputs; answer with as many outputs as annotated."""
    n = str(inspect.signature(fn).return_annotation).count("Tensor")
    return "() -> " + ("()" if n == 0 else "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")")


def _type(module: str, name: str) -> type:
    return _StubMeta(name, (_StubBase,), {"__module__": module})


ATTRS = {
    # vLLM parses torch's version; torch.dtype / torch.device appear in `X | torch.dtype` annotations (must be types)
    "torch": {"__version__": "2.14.0", "dtype": _type("torch", "dtype"), "device": _type("torch", "device"),
              # request models bound their integer fields by torch.iinfo(torch.long) (pydantic needs real ints)
              "iinfo": lambda dtype: types.SimpleNamespace(min=-2**63, max=2**63 - 1)},
    "torch.library": {"infer_schema": _infer_schema},
}


def install() -> None:
    # VLLM_TARGET_DEVICE=cpu: vLLM's explicit CPU platform, so that device detection does not probe the stubs
    # (DeviceConfig's default is built while the flags are registered).
    sglang_stubs.install(STUBBED, ATTRS, env=("VLLM_TARGET_DEVICE", "cpu"))
