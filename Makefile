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

# The same install steps as the container image (deploy/docker/Dockerfile).
$(STAMP): pyproject.toml deploy/install.sh | $(BIN)/python
	deploy/install.sh $(PIP) --editable --extras test
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
