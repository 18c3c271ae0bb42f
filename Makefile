# unispec — the README's two commands are `make demo` and `make test`; both install into .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNISPEC := $(VENV)/bin/unispec
STAMP := $(VENV)/.unispec-installed
PYTEST_FAST := -m "not slow and not gpu and not trt"

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

.PHONY: install test test-all test-trt lint demo models export engines bench serve clean

install: $(STAMP)

# torch first, pinned: any other version or a loose range pulls gigabytes of CUDA packages.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -c 'from plugins import ort_cpu; ort_cpu.library_path()' || echo "native ORT kernels not built: ONNX Runtime runs model.onnx instead"
	@touch $(STAMP)

test: install
	$(PY) -m pytest -q $(PYTEST_FAST)

test-all: install
	$(PY) -m pytest -q

# The trt_build group alone: every method's tiny artifact built into a TensorRT-RTX engine, CPU-only
# (float16 and float32; a few minutes). `make test` runs its quick structured-output build.
test-trt: install
	$(PY) -m pytest -q -m trt_build tests/engines

lint: install
	$(VENV)/bin/ruff check unispec export runtime plugins engines tests

demo: install
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
