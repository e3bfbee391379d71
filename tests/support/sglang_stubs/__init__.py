"""Stand-in modules so that SGLang 0.5.23's (and sglang-router's, and vLLM's) argument parser imports without a GPU stack.

Only the parser test's subprocess installs these (`install()`); nothing imports them globally.
The pattern follows SGLang's own `sglang/_platform_stubs.py`: every attribute of a stub module is
another stub, calling one is a pass-through decorator, CamelCase names are subclassable classes.
"""
from __future__ import annotations

import abc
import importlib.machinery
import os
import sys
import types

# Top-level packages SGLang's server_args imports at module level that a CPU test venv lacks.
# (numpy, msgspec and the standard library are real.)
STUBBED = ("torch", "triton", "orjson", "psutil", "pybase64", "PIL", "starlette", "pydantic_core", "pydantic",
           "zmq", "IPython", "aiohttp",
           "setproctitle", "fastapi", "uvicorn")  # what sglang_router.launch_router imports besides its own Rust parser

# Backends SGLang probes with hasattr(): absent, so it does not take the NPU/MUSA/HPU paths.
ABSENT = {"torch.npu", "torch.musa", "torch.hpu", "torch.mlu"}
# Values SGLang reads at import time that must be real (versions are parsed, not just looked up).
ATTRS = {"torch": {"__version__": "2.9.0"}, "triton": {"__version__": "3.5.0"}}


class _StubMeta(abc.ABCMeta):
    """Stub classes answer any class attribute too (`torch._C._distributed_c10d.Store`)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_value(f"{cls.__module__}.{cls.__name__}", name)

    def __int__(cls):  # enum-like constants: int(torch.distributed.ReduceOp.SUM)
        return 0

    __index__ = __int__

    def __getitem__(cls, item):  # generic stub classes: `cachetools.LRUCache[_K, _V]`
        return cls


class _StubBase(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # instances too: `app = FastAPI(); @app.get("/health")`
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_value(f"{type(self).__module__}.{type(self).__name__}", name)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # a real pydantic model with a stub-typed field (vLLM)
        from pydantic_core import core_schema
        return core_schema.any_schema()


class _Decorator:
    """What calling a stub returns: a pass-through decorator that is falsy (`torch.cuda.is_available()`)."""

    def __call__(self, fn=None, *args, **kwargs):
        return fn

    def __bool__(self):
        return False


class StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__: list[str] = []
        self.__package__ = name
        self.__file__ = __file__

    def __getattr__(self, name: str):
        full = f"{self.__name__}.{name}"
        if (name.startswith("__") and name.endswith("__")) or full in ABSENT:
            raise AttributeError(name)
        if full in sys.modules:
            return sys.modules[full]
        value = _stub_value(self.__name__, name)
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Decorator()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


def _stub_value(owner: str, name: str):
    """A subclassable class for CamelCase names (`_DecoratorContextManager`), a stub module otherwise."""
    if name.lstrip("_")[:1].isupper():
        return _StubMeta(name, (_StubBase,), {"__module__": owner})
    full = f"{owner}.{name}"
    return sys.modules.setdefault(full, StubModule(full))


class _StubLoader:
    """Hands the import system a StubModule (a spec without a loader would become a namespace package)."""

    def create_module(self, spec):
        module = sys.modules.get(spec.name) or StubModule(spec.name)
        for key, value in ATTRS.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module):
        pass


class _StubFinder:
    """First on sys.meta_path: the listed packages are always stubs, installed or not (same result everywhere)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def install(stubbed: tuple[str, ...] = STUBBED, attrs: dict | None = None,
            env: tuple[str, str] = ("SGLANG_USE_CPU_ENGINE", "1")) -> None:
    """SGLang's lists by default; tests/support/vllm_stubs passes vLLM's (one engine per subprocess)."""
    global STUBBED, ATTRS
    STUBBED, ATTRS = stubbed, ATTRS if attrs is None else attrs
    # No accelerator here: the engine's CPU platform defaults keep platform detection off the stubs.
    os.environ.setdefault(*env)
    sys.meta_path.insert(0, _StubFinder())
