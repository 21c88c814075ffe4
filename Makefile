# kvtier — the README's two commands live here: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=
# NOTE: `make test` runs pytest in this many worker processes (pytest-xdist),
# whole files at a time so a module's shared fixtures are built once
# (`make test TEST_WORKERS=0` runs it in one process).
TEST_WORKERS ?= 2

# NOTE: the mlx[cpu] wheel links a reference BLAS; Debian's OpenBLAS makes
# prefill ~20x faster on Linux CPUs. Preload it when present, never require it.
OPENBLAS := $(wildcard /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3)
RUN_ENV := $(if $(OPENBLAS),LD_PRELOAD=$(firstword $(OPENBLAS)),)
# NOTE: the tests keep compiled modules (__pycache__, ignored by git) even
# where the environment sets PYTHONDONTWRITEBYTECODE: without them each pytest
# worker re-rewrites ~600 test modules (~8 s) and every server or script the
# tests start compiles kvtier's packages again; about 40 s of `make test`.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE $(RUN_ENV)

.PHONY: venv serve test test-slow lint typecheck bench fetch-model native clean openblas-hint

# NOTE: pip runs quietly and takes about a minute on a fresh clone; the echo
# lines say what is happening meanwhile.
$(VENV)/.installed: pyproject.toml
	@echo "kvtier: creating the virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "kvtier: upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "kvtier: installing kvtier and its dependencies (MLX, mlx-lm, FastAPI, dev tools); about a minute on a fresh clone"
	$(PY) -m pip install -q -e '.[dev]'
	@echo "kvtier: installed into $(VENV)"
	touch $@

venv: $(VENV)/.installed

openblas-hint:
	@if [ "$$(uname -s)" = "Linux" ] && [ -z "$(OPENBLAS)" ]; then \
	  echo "kvtier: Debian's OpenBLAS not found; MLX on this CPU will be slow."; \
	  echo "kvtier: install it with: sudo apt-get install -y libopenblas0-pthread"; \
	fi

fetch-model: venv
	@echo "kvtier: checking the default model (downloaded and converted on the first run only, into $${KVTIER_HOME:-~/.cache/kvtier})"
	$(RUN_ENV) $(VENV)/bin/kvtier fetch-default-model

# NOTE: builds the few-row product once (cached under $$KVTIER_HOME/native);
# optional: where it cannot build, kvtier says why and keeps MLX's product.
native: venv
	@echo "kvtier: checking the native CPU kernels (built on the first run only, into $${KVTIER_HOME:-~/.cache/kvtier}/native)"
	$(RUN_ENV) $(PY) -m kernels.native

serve: venv openblas-hint fetch-model native
	$(RUN_ENV) $(VENV)/bin/kvtier serve --host $(HOST) --port $(PORT) $(ARGS)

# NOTE: `mypy tests` checks the tests against the API under the relaxed
# tests.* override in pyproject.toml (bodies type-checked, fixtures may stay
# unannotated); the packages themselves are held to --strict.
lint: venv
	$(VENV)/bin/ruff check actors messages kernels tests tools
	$(VENV)/bin/mypy --strict actors messages kernels
	$(VENV)/bin/mypy tests

typecheck: lint

test: venv lint fetch-model native
	$(TEST_ENV) $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# NOTE: the slow suite also drives the agent frameworks (openai-agents,
# pydantic-ai) and sglang-router, installed here once; Ray (the `ray` extra,
# several hundred MB), lm-eval (`eval`) and guidellm (its own venv) are left
# out: their tests skip without them.
$(VENV)/.installed-slow: $(VENV)/.installed
	@echo "kvtier: installing the agents and cluster extras for the slow suite"
	$(PY) -m pip install -q -e '.[dev,agents,cluster]'
	touch $@

test-slow: $(VENV)/.installed-slow fetch-model native
	$(TEST_ENV) $(VENV)/bin/pytest -q -m slow --timeout 1800

bench: venv fetch-model
	$(RUN_ENV) $(PY) tools/bench/runtime.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
