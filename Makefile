# torchmem's entry points. The two README commands are `make demo` and `make test`;
# each installs what is missing first (torch only if it is not importable, so a
# GPU machine keeps its own CUDA torch; the frameworks the integration tests need
# only for `make test`), then builds the extension in place. Packages go to the
# Python that runs make ($(PYTHON)): use a virtual environment (README).
PYTHON ?= python3
TORCH_SPEC ?= torch==2.14.1
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" for a CPU-only torch
TORCH_PIP_ARGS ?=
PIP := $(PYTHON) -m pip

.PHONY: setup setup-test build demo test test-gpu test-budget bench-micro bench-host-micro clean \
	bench-vmm-chunks bench-vmm-chunks-build bench-cache-probe

# Each long step says what it does and about how long it takes, then shows pip's or
# the build's progress: minutes of silence look like a hang.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
	  echo "installing $(TORCH_SPEC) (about 1-3 min: ~4 GB with its CUDA libraries, ~0.5 GB from the CPU-only index)"; \
	  $(PIP) install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; }
	@$(PYTHON) tools/ensure_deps.py demo
	@$(PYTHON) tools/build_if_stale.py

# What the tests need on top: pytest, matplotlib, Lightning, Transformers, Accelerate.
setup-test: setup
	@$(PYTHON) tools/ensure_deps.py test

# Force a rebuild of torchmem._C in place (pip install -e, showing the build's steps).
build:
	$(PYTHON) tools/build_if_stale.py --force

# Main job: without a GPU, replay a bundled real trace under torchmem and a model
# of PyTorch's native allocator, side by side; with a GPU, train with torchmem.
demo: setup
	$(PYTHON) -m torchmem demo

test: setup-test
	$(PYTHON) -m pytest -q

test-gpu: setup-test
	$(PYTHON) -m pytest -q -m gpu

# C++ microbenchmark of the pool's cached fast path (plain g++, no torch).
bench-micro:
	@mkdir -p build/bench
	$(CXX) -std=c++17 -O3 -DNDEBUG -DTORCHMEM_DEBUG=0 -pthread -Icsrc csrc/core/pool.cpp \
	  $(wildcard csrc/core/detail/*.cpp) \
	  csrc/backend/sim_backend.cpp bench/pool_microbench.cpp -o build/bench/pool_microbench
	./build/bench/pool_microbench

# Note [Budget rule] (csrc/shim/budget.h) on a simulated device (plain g++, no torch;
# also run by tests/test_budget_rule.py).
test-budget:
	@mkdir -p build/bench
	$(CXX) -std=c++17 -O1 -pthread -Icsrc csrc/core/pool.cpp $(wildcard csrc/core/detail/*.cpp) \
	  csrc/backend/sim_backend.cpp csrc/shim/budget.cpp tests/cpp/budget_test.cpp -o build/bench/budget_test
	./build/bench/budget_test

# One replay under the pool, for callgrind's cache simulator (bench/replay_cache_probe.cpp).
bench-cache-probe:
	@mkdir -p build/bench
	$(CXX) -std=c++17 -O2 -g -DNDEBUG -DTORCHMEM_DEBUG=0 -pthread -Icsrc csrc/core/pool.cpp \
	  $(wildcard csrc/core/detail/*.cpp) csrc/backend/sim_backend.cpp $(wildcard csrc/replay/*.cpp) \
	  bench/replay_cache_probe.cpp -o build/bench/replay_cache_probe

bench-host-micro:
	@mkdir -p build/bench
	$(CXX) -std=c++17 -O3 -DNDEBUG -pthread -Icsrc csrc/host/host_pool.cpp csrc/host/host_system.cpp \
	  csrc/host/sim_host_backend.cpp bench/host_microbench.cpp -o build/bench/host_microbench
	./build/bench/host_microbench

# Standalone CUDA driver-API probe of pool-growth cost per granule by chunking design
# (bench/vmm_chunk_probe.cpp; no torch). -build always compiles; it links only where a
# libcuda.so (or the toolkit's stub next to nvcc) exists, so it is checkable without a GPU.
# Run on a GPU: make bench-vmm-chunks VMM_CHUNK_ARGS="--granules 1 4 16 64 256 --repeats 10"
NVCC ?= nvcc
VMM_CHUNK_ARGS ?=
CUDA_STUBS := $(firstword $(wildcard $(dir $(shell command -v $(NVCC) 2>/dev/null))../lib64/stubs \
	/usr/local/cuda/lib64/stubs))

bench-vmm-chunks-build:
	@mkdir -p build
	$(NVCC) -O2 -std=c++17 -c bench/vmm_chunk_probe.cpp -o build/vmm_chunk_probe.o
	@if [ -e "$(CUDA_STUBS)/libcuda.so" ] || ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then \
	  echo "$(NVCC) build/vmm_chunk_probe.o $(if $(CUDA_STUBS),-L$(CUDA_STUBS)) -lcuda -o build/vmm_chunk_probe"; \
	  $(NVCC) build/vmm_chunk_probe.o $(if $(CUDA_STUBS),-L$(CUDA_STUBS)) -lcuda -o build/vmm_chunk_probe; \
	else \
	  echo "bench-vmm-chunks-build: compiled build/vmm_chunk_probe.o; no libcuda.so here, not linked"; \
	fi

bench-vmm-chunks: bench-vmm-chunks-build
	./build/vmm_chunk_probe $(VMM_CHUNK_ARGS)

clean:
	rm -rf build torchmem/_C*.so *.egg-info
