# unispec — the README's two commands are `make demo` and `make test`; both install into .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNISPEC := $(VENV)/bin/unispec
# installed: core + dev (`make test` and the targets below); demo-installed: core + export (`make demo`)
STAMP := $(VENV)/.unispec-installed
DEMO_STAMP := $(VENV)/.unispec-demo-installed
# torch's build: cpu here and in CI; on a GPU machine e.g. TORCH_BUILD=cu130 (torch 2.13.0's CUDA 13 build, untested)
TORCH_BUILD ?= cpu
TORCH := torch==2.13.0+$(TORCH_BUILD)
TORCH_INDEX := https://download.pytorch.org/whl/$(TORCH_BUILD)
PYTEST_FAST := -m "not slow and not gpu and not trt"
# one worker per core (pytest-xdist); a file's tests share a worker, so its module fixtures are built once
PYTEST_PARALLEL := -n auto --dist loadfile

# make export TARGET=dir [DRAFT=dir] METHOD=mtp K=3 OUT=artifacts/x [DTYPE=float16] [EXPORT_ARGS="--block-size 8"]
TARGET ?=
DRAFT ?=
METHOD ?= none
K ?= 3
DTYPE ?= float32
EXPORT_ARGS ?=
OUT ?= artifacts/$(METHOD)
ART ?= $(OUT)
RECIPE ?=
TIMING_CACHE ?=
FLAVOUR ?=
CC ?=
# make bench ART=artifacts/x [BENCH_ARGS="--baseline artifacts/none --batch-sizes 1 --json out.json --plot out.png"]
BENCH_ARGS ?=
# make serve ART=artifacts/x [SERVE_ARGS="--port 8000 --replicas 2"]: OpenAI-compatible server (README "Serving")
SERVE_ARGS ?=

.PHONY: install install-gpu test test-all test-trt lint demo models export engines bench serve clean

install: $(STAMP)

# torch first, as the explicit local version 2.13.0+cpu: a bare `torch==2.13.0` (which the `export` extra
# pins) is the 527 MB CUDA 13 wheel plus its cuDNN / CUDA wheels on a plain index. The first try takes
# +cpu from the configured indexes and find-links (here /opt/wheels holds it: no network); a plain index
# lacks it (pip fails in about 2 s) and the second try adds PyTorch's own index for that build. A short
# --timeout / --retries keeps an unreachable index from holding pip for minutes (here the name does not
# resolve: it fails in about 8 s). Once torch==2.13.0+cpu is installed, the extras' pin is satisfied.
define install_base
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q '$(TORCH)' 2>/dev/null || { \
		echo "$(TORCH) is not on the configured package index; trying $(TORCH_INDEX)"; \
		$(PY) -m pip install -q --timeout 20 --retries 1 --extra-index-url $(TORCH_INDEX) '$(TORCH)'; }
endef

define build_ort_kernels
	$(PY) -c 'from plugins import ort_cpu; ort_cpu.library_path()' || echo "native ORT kernels not built: ONNX Runtime runs model.onnx instead"
endef

$(STAMP): pyproject.toml
	$(install_base)
	$(PY) -m pip install -q -e '.[dev]'
	$(build_ort_kernels)
	@touch $(STAMP)

# `unispec demo` exports the bundled models and runs them on ONNX Runtime: core + `export`, no test tools.
$(DEMO_STAMP): pyproject.toml
	$(install_base)
	$(PY) -m pip install -q -e '.[export]'
	$(build_ort_kernels)
	@touch $(DEMO_STAMP)

# A GPU machine: ONNX Runtime's CUDA execution provider (`gpu` extra: onnxruntime-gpu, CUDA 13 + cuDNN 9
# wheels; the driver must support CUDA 13). onnxruntime and onnxruntime-gpu install the same `onnxruntime`
# module, so the CPU package is removed and the GPU one reinstalled last, its files intact. With
# TORCH_BUILD=cu130 the `gpu` tests and the `trt` backend get a CUDA torch too. Untested (no GPU in CI).
install-gpu: install
	$(PY) -m pip install -q -e '.[gpu]'
	$(PY) -m pip uninstall -q -y onnxruntime
	$(PY) -m pip install -q --force-reinstall --no-deps \
		"onnxruntime-gpu==$$($(PY) -c 'import importlib.metadata as m; print(m.version("onnxruntime-gpu"))')"

test: install
	$(PY) -m pytest -q --durations=15 $(PYTEST_PARALLEL) $(PYTEST_FAST)

test-all: install
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# The trt_build group alone: every method's tiny artifact built into a TensorRT-RTX engine, CPU-only
# (float16 and float32; a few minutes), structured output included. Engine builds are `slow`: not in `make test`.
test-trt: install
	$(PY) -m pytest -q -m trt_build tests/engines

lint: install
	$(VENV)/bin/ruff check unispec export runtime plugins engines tests benchmarks

# After `make test` the dev install already holds what the demo needs.
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(UNISPEC) demo

# Retrains the bundled models under models/ from this machine's Python stdlib (CPU, about an hour);
# a model whose recipe, corpus and target are unchanged is kept. MODELS="llama3 llama3-dflash" limits it.
MODELS ?=
models: install
	$(PY) -u -m export.train --out models $(if $(MODELS),--only $(MODELS))

export: install
	@test -n "$(TARGET)" || { echo "usage: make export TARGET=dir [DRAFT=dir] METHOD=m K=n OUT=dir"; exit 2; }
	$(UNISPEC) export --target $(TARGET) $(if $(DRAFT),--draft $(DRAFT)) --method $(METHOD) \
		--num-speculative-tokens $(K) --dtype $(DTYPE) --out $(OUT) $(EXPORT_ARGS)

# make engines ART=artifacts/x [RECIPE=decode-heavy|file.toml] [TIMING_CACHE=build/timing.cache]
#              [FLAVOUR=tensorrt-rtx|tensorrt] [CC="sm_86 sm_89"]   (TensorRT-RTX builds CPU-only; see README)
engines: install
	$(UNISPEC) build $(ART) $(if $(RECIPE),--recipe $(RECIPE)) $(if $(TIMING_CACHE),--timing-cache $(TIMING_CACHE)) \
		$(if $(FLAVOUR),--flavour $(FLAVOUR)) $(foreach cc,$(CC),--compute-capability $(cc))

bench: install
	$(UNISPEC) bench $(ART) $(BENCH_ARGS)

serve: install
	@test -d "$(ART)" || { echo "usage: make serve ART=artifact_dir [SERVE_ARGS=\"--port 8000 --replicas 2\"]"; exit 2; }
	$(UNISPEC) serve $(ART) $(SERVE_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +
