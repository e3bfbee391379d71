# mm: two commands on a fresh machine
#   make demo   install mm into .venv and the tools the demo runs, then run the whole pipeline against a local Hub
#   make test   run the test suite, then the wheel check (build, install into a fresh venv, run outside the checkout)
# make install installs mm and what it needs (no more); make install-test adds the test tools (pytest, and the
# engines' own argument parsers the launch tests run: SGLang, sglang-router, vLLM, ~1.3 GB).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test tools demo-tools demo test wheel-check bench clean

install: $(STAMP)

install-test: $(TEST_STAMP)

# A strict editable install links each package file into build/__editable__*; a new module or pin file needs a
# re-install, so the stamp depends on the list of package files.
PACKAGE_FILES := $(wildcard *.py commands/*.py artifacts/*.py artifacts/*.sh artifacts/*/*.py artifacts/*/*.sh manifests/*.json)

$(STAMP): setup.cfg pyproject.toml $(PACKAGE_FILES)
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e . --config-settings editable_mode=strict
	touch $(STAMP)

# The test tools, on top of mm: re-made whenever mm is re-installed (the stamp above is newer), so a `make test`
# after a package change re-links the editable install with its test extras.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=strict
	# SGLang's own argument parser, for the launch tests (no torch needed; tests stub what it imports)
	$(BIN)/pip install -q --no-deps sglang==0.5.23 msgspec
	# The SGLang router's own argument parser (sglang_router.launch_router), for the router lines: the pinned image
	# builds sgl-router from its SGLang commit without naming a version, so the newest release on PyPI
	$(BIN)/pip install -q --no-deps sglang-router==0.3.2
	# vLLM's own `vllm serve` parser, for the vLLM lines (the guide: vLLM 0.33.0 or later). --no-deps: no torch/CUDA;
	# the parser runs on real pydantic (vLLM's configs are pydantic dataclasses), regex, PyYAML, msgspec (and numpy,
	# huggingface_hub, safetensors from mm itself); tests/support/vllm_stubs stubs the rest
	$(BIN)/pip install -q --no-deps vllm==0.33.0
	$(BIN)/pip install -q pydantic regex pyyaml msgspec
	touch $(TEST_STAMP)

# The tools `make demo` runs besides Python and mm, all Debian packages: git (the local Hub's repository), the real OCI
# registry (docker-registry) and ip (iproute2: the loopback of the host without a network). They are
# tests/support/demo.py's NEEDS; tests/test_demo.py keeps both equal to what the demo's code runs.
DEMO_TOOLS := git docker-registry ip
DEMO_TOOL_PACKAGES := git docker-registry iproute2

# Standard tools that tests and benchmarks use, all Debian packages: b3sum and sha256sum peers, shellcheck, strace (to
# see fsyncs), the real OCI registry (docker-registry, distribution 2.8) and skopeo, ssh-keygen for signatures, the real
# container engine (docker.io: dockerd 20.10, started by the tests on a private socket and bridge, iproute2 makes the
# bridge), busybox-static (the stand-in server image's root file system), curl (the node script's health checks),
# nginx (the fetch benchmark's CDN), aria2c and openssl (its peers), losetup, mkfs.ext4 and filefrag for the ext4
# on a loop device that `mm unbundle --readback` is tested on, and mkfs.xfs (xfsprogs) for the XFS images with
# reflinks of the delta tests and benchmark; containerd and its client ctr, started by the tests on a private socket
# to pull the engine image through the registry tiers as a node does; and the demo's tools above.
TOOLS := $(DEMO_TOOLS) b3sum shellcheck strace skopeo ssh-keygen dockerd busybox curl nginx aria2c openssl \
	losetup mkfs.ext4 filefrag mkfs.xfs containerd ctr
TOOL_PACKAGES := $(DEMO_TOOL_PACKAGES) b3sum shellcheck strace skopeo openssh-client docker.io busybox-static curl nginx \
	aria2 openssl mount e2fsprogs xfsprogs containerd

# Install the packages $(2) with apt-get when one of the commands $(1) is missing (sbin directories included, which
# a user's PATH may lack); without root, one line saying what to install instead of apt-get's refusal.
define install_missing
	@missing=; for t in $(1); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	  [ -z "$$missing" ] && exit 0; \
	  [ "$$(id -u)" = 0 ] || { echo "make: missing:$$missing; install them as root: apt-get install $(2)" >&2; exit 1; }; \
	  echo "installing$$missing with apt-get"; apt-get update -qq && apt-get install -y -qq $(2) >/dev/null
endef

tools:
	$(call install_missing,$(TOOLS),$(TOOL_PACKAGES))

demo-tools:
	$(call install_missing,$(DEMO_TOOLS),$(DEMO_TOOL_PACKAGES))

demo: install demo-tools
	# the demo's model server makes its tensors with numpy (a test tool: mm itself never imports it)
	$(BIN)/pip install -q 'numpy>=1.26'
	$(BIN)/python -m tests.support.demo
	@echo
	@echo "mm is installed at $(abspath $(BIN))/mm; to run it as \`mm\` in this shell:"
	@echo "  export PATH=\"$(abspath $(BIN)):\$$PATH\""

# Tests run in a random order (pytest-randomly): the suite must not depend on which test ran before, and a random
# order turns a hidden dependence into a failure that names its seed. Replay one with `make test SEED=N`; run in
# file order with `make test ORDER="-p no:randomly"`. The suite runs on two workers (pytest-xdist: each has its own
# servers, ports and temporary directories), which halves its time on CI's machine; `make test JOBS=0` runs it in
# one process.
SEED ?= $(shell date +%s)
ORDER ?= -p randomly --randomly-seed=$(SEED)
JOBS ?= 2

test: install-test tools
	@echo "test order: $(ORDER), workers: $(JOBS)"
	$(BIN)/python -m pytest -q -n $(JOBS) $(ORDER)
	$(MAKE) --no-print-directory wheel-check

# The wheel as users get it: built, installed (not editable) into a fresh venv under /tmp, run from outside the
# checkout (mm --version, mm launch reading the pin, mm verify); the wheel holds only mm/ and its dist-info.
wheel-check: install
	tests/wheel_check.sh $(BIN)/python

bench: install-test tools
	$(BIN)/python -m tests.bench.run

clean:
	rm -rf $(VENV) build demo-work bench-work
