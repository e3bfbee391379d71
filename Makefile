# mm: two commands on a fresh machine
#   make demo   install mm into .venv and run the whole pipeline against a local model server
#   make test   run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install tools demo test bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# SGLang's own argument parser, for the launch tests (no torch needed; tests stub what it imports)
	$(BIN)/pip install -q --no-deps sglang==0.5.23 msgspec
	touch $(STAMP)

# Standard tools that tests and benchmarks use (b3sum, shellcheck, strace to see fsyncs); Debian packages.
tools:
	@command -v b3sum >/dev/null && command -v shellcheck >/dev/null && command -v strace >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq b3sum shellcheck strace >/dev/null; }

demo: install
	$(BIN)/python -m tests.support.demo

test: install tools
	$(BIN)/python -m pytest -q

bench: install tools
	$(BIN)/python -m tests.bench.run

clean:
	rm -rf $(VENV) demo-work bench-work
