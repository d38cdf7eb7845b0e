# Triton BLS pipelines — local CPU runtime: tritonserver 2.51 from the nvidia-pytriton wheel with
# Triton's own onnxruntime backend (r24.10, C++), built here from source (`make backend`).
# `make help` lists the targets. Every target installs what it needs on first use.

PYTHON           ?= python3
VENV             ?= .venv
MODEL_REPOSITORY ?= model_repository
MODEL_SIZE       ?= small
# A MODEL_REPOSITORY other than the project's is served as it is; 1: export the project's models
# whose files it lacks (never overwriting a file).
EXPORT_INTO_GIVEN ?=
HTTP_PORT        ?= 8000
GRPC_PORT        ?= 8001
METRICS_PORT     ?= 8002
PYTEST_ARGS      ?=
SOAK_ARGS        ?=
CHAOS            ?=
# Models `make models` leaves out when they need training first (`make serve` sets digits_large).
DEFER            ?=
# Triton's onnxruntime backend: the r24.10 source tarballs (no network needed when given; else
# GitHub), the ONNX Runtime C API header (a libonnxruntime-dev .deb; else ONNX Runtime's release)
# and the build cache (keyed by every input; rebuilt only when one changes).
TRITON_SOURCES   ?= $(wildcard ../shared/vendor/triton-r24.10)
ORT_HEADERS      ?= $(wildcard ../shared/vendor/onnxruntime-headers)
BACKEND_CACHE    ?= .triton/onnxruntime-backend
export TRITONLOCAL_BACKEND_CACHE := $(abspath $(BACKEND_CACHE))
# The GPU build of the same backend (`make backend-gpu`: onnxruntime-gpu, CUDA 13 from PyPI; it
# compiles without a GPU). GPU_RUNTIME=1 also installs the libraries serving on GPUs needs.
BACKEND_GPU_CACHE ?= .triton/onnxruntime-backend-gpu
export TRITONLOCAL_BACKEND_GPU_CACHE := $(abspath $(BACKEND_GPU_CACHE))
GPU_RUNTIME      ?=
JOBS             ?=
# The NGC container (GPU hosts with Docker and the NVIDIA container toolkit): docs/production.md
IMAGE            ?= triton-bls-pipelines:24.10
TEST_IMAGE       ?= triton-bls-pipelines-test:24.10
# `make serve` serves the CPU profile (portable) unless BLS_PROFILE is given on the command line
# or in the environment (gpu, gpu-ort-trt: the local GPU mode); the container targets default to
# gpu. SERVE_PROFILE is what `make serve` serves.
SERVE_PROFILE    := $(if $(filter command line environment%,$(origin BLS_PROFILE)),$(BLS_PROFILE),portable)
BLS_PROFILE      ?= gpu
GPUS             ?= all
# /dev/shm (docker run --shm-size), by the rule of docs/operations.md ("Shared memory";
# `python -m tritonlocal.shm REPO...` computes it): the server needs 128 MiB at start (1g leaves
# room to grow; 2g with the logits tagger), the test container, which also serves the test-only
# models, 6.2 GiB. tests/tooling/test_container.py checks both against the rule.
SHM_SIZE         ?= 1g
TEST_SHM_SIZE    ?= 8g
PUBLISH_HOST     ?= 127.0.0.1
# Engine caches (Docker volumes): one for the served container, another for the test container,
# so a test run never shares its cache with a server (each container renders its own repository).
CACHE_VOLUME     ?= bls-cache
TEST_CACHE_VOLUME ?= bls-test-cache

PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: tune help venv backend backend-gpu gpu-host models configs serve lint test test-unit bench bench-pb-calls bench-recovery bench-poison-load bench-ledger soak clean docker-build docker-run test-container gpu-check
BENCH_EXPERIMENTS := ort_options orchestration overhead overload control_flow

help: ## Show this help
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'
	@echo "  make bench-<experiment>  one experiment: $(BENCH_EXPERIMENTS)"
	@echo "  Variables: HTTP_PORT GRPC_PORT METRICS_PORT MODEL_REPOSITORY MODEL_SIZE=small|full|fast PYTEST_ARGS TEST_WORKERS SOAK_ARGS CHAOS=1 MODEL BUDGET_MS"
	@echo "  Backend:   TRITON_SOURCES=$(TRITON_SOURCES) ORT_HEADERS=$(ORT_HEADERS) BACKEND_CACHE=$(BACKEND_CACHE) BACKEND_GPU_CACHE=$(BACKEND_GPU_CACHE) GPU_RUNTIME=1 JOBS"
	@echo "  GPU host:  make serve BLS_PROFILE=gpu|gpu-ort-trt (no Docker), make gpu-check GPU_CHECK_ARGS"
	@echo "  Container: IMAGE TEST_IMAGE BLS_PROFILE=portable|gpu|gpu-ort-trt|gpu-trt GPUS SHM_SIZE TEST_SHM_SIZE PUBLISH_HOST CACHE_VOLUME TEST_CACHE_VOLUME"

$(STAMP): pyproject.toml scripts/install_system_deps.sh scripts/install_perf_analyzer.py
	scripts/install_system_deps.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[local]'
	$(PY) scripts/install_perf_analyzer.py --venv $(VENV)
	touch $@

venv: $(STAMP) ## Create .venv and install everything (pip + Debian packages + perf_analyzer)

# Triton Model Analyzer (the `tune` extra) in a venv of its own, made on first use.
TUNE_VENV  := .venv-tune
TUNE_STAMP := $(TUNE_VENV)/.installed
$(TUNE_STAMP): pyproject.toml $(STAMP)
	$(PYTHON) -m venv $(TUNE_VENV)
	$(TUNE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[tune]'
	touch $@

TUNE = $(PY) -m ops.tune $(foreach m,$(MODEL),--model $(m)) $(foreach c,$(COMPOSING),--composing $(c)) \
	    $(if $(BUDGET_MS),--budget-ms $(BUDGET_MS))
ifeq ($(SERVE_PROFILE),portable)
tune: models backend $(TUNE_STAMP) ## Triton Model Analyzer tunes instances and batching (MODEL=<name>: one model; COMPOSING=<your BLS>=<a,b>; BUDGET_MS; BLS_PROFILE=gpu on a GPU host) -> bench/results/tuning/
	$(TUNE)
else
tune: gpu-host $(TUNE_STAMP)
	$(MAKE) --no-print-directory models backend-gpu GPU_RUNTIME=1
	$(TUNE) --profile $(SERVE_PROFILE)
endif

backend: $(STAMP) ## Build Triton's onnxruntime backend (C++, r24.10; ~20 s, cached by its inputs)
	$(PY) -m tritonlocal.backend_build $(if $(TRITON_SOURCES),--sources $(TRITON_SOURCES)) \
	    $(if $(ORT_HEADERS),--headers $(ORT_HEADERS))

backend-gpu: $(STAMP) ## The same backend for GPUs (TRITON_ENABLE_GPU, onnxruntime-gpu, CUDA 13 from PyPI; compiles without a GPU)
	$(PY) -m tritonlocal.backend_build --gpu $(if $(GPU_RUNTIME),--runtime) $(if $(JOBS),--jobs $(JOBS)) \
	    $(if $(TRITON_SOURCES),--sources $(TRITON_SOURCES)) $(if $(ORT_HEADERS),--headers $(ORT_HEADERS))

# Fails in a second, with one line, when this host cannot serve SERVE_PROFILE (system Python,
# standard library only: before any venv or CUDA wheel is installed).
gpu-host:
	@$(PYTHON) -m tritonlocal.gpu require $(SERVE_PROFILE)

models: $(STAMP) ## Export the ONNX models into the project's model_repository (skipped when up to date); another MODEL_REPOSITORY is only checked (EXPORT_INTO_GIVEN=1: export its missing files)
	$(PY) -m modelgen.export --repository $(MODEL_REPOSITORY) --size $(MODEL_SIZE) \
	    $(if $(EXPORT_INTO_GIVEN),--into-given) $(foreach m,$(DEFER),--defer $(m))

# `make serve` answers first and trains later: digits_large (minutes of training on first use)
# is made while the other models serve (tritonlocal.deferred).
serve: DEFER = digits_large

configs: $(STAMP) ## Regenerate every config.pbtxt, the orchestrators' model.py and the docs' parameter table from bls_models/spec.py
	$(PY) -m modelgen.configs --repository $(MODEL_REPOSITORY)

SERVE = $(PY) -m tritonlocal serve --model-repository $(MODEL_REPOSITORY) \
	    --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)
ifeq ($(SERVE_PROFILE),portable)
serve: models backend ## Serve $(MODEL_REPOSITORY) on 127.0.0.1 in the foreground (Ctrl-C stops it; BLS_PROFILE=gpu on a GPU host)
	$(SERVE)
else
# A GPU profile: the host check first (a second, one line), then, in this order even under -j,
# the models and the GPU backend with its runtime libraries.
serve: gpu-host
	$(MAKE) --no-print-directory models backend-gpu GPU_RUNTIME=1
	$(SERVE) --profile $(SERVE_PROFILE)
endif

# The suite runs on two workers (pytest-xdist), each with its own session server, in the units of
# work tests/conftest.py names, where two session servers fit and two cores are free: `-n auto`
# picks two with two CPUs, 22 GiB of memory (about 21 GiB at the peak) and 1.5 cores idle, else
# one process (docs/operations.md#the-test-suite). TEST_WORKERS=0 or 2 says so instead.
TEST_WORKERS ?= auto
SETUP_FOR_TESTS = $(MAKE) --no-print-directory -j3 lint models backend $(TUNE_STAMP)
PYTEST_WORKERS = $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup
UNIT_LOG := .triton/unit-tests.log
test: $(STAMP) ## Lint, then the whole test suite (unit + live server) — what CI runs
ifeq ($(strip $(PYTEST_ARGS)),)
	@# Once the venv is made, side by side: the setup (the digits training, the longest, the
	@# backend build, Model Analyzer's venv and the lint) and the unit tests (a fake pb_utils,
	@# no server, no ONNX file; mostly waiting) on two workers of their own. Then every other
	@# test on TEST_WORKERS workers. Exits non-zero if either part failed.
	@mkdir -p $(dir $(UNIT_LOG)); echo "unit tests: beside the setup, output in $(UNIT_LOG)"
	@$(PY) -m pytest -p no:cacheprovider -n 2 tests/unit > $(UNIT_LOG) 2>&1 & units=$$!; \
	trap 'kill $$units 2>/dev/null' INT TERM; \
	$(SETUP_FOR_TESTS) || { kill $$units 2>/dev/null; exit 1; }; \
	wait $$units; unit_status=$$?; \
	if [ $$unit_status -eq 0 ]; then tail -n 1 $(UNIT_LOG); else cat $(UNIT_LOG); fi; \
	$(PYTEST_WORKERS) --ignore=tests/unit; status=$$?; \
	[ $$unit_status -eq 0 ] || echo "the unit tests failed (above; $(UNIT_LOG))"; \
	[ $$unit_status -eq 0 ] && [ $$status -eq 0 ]
else
	$(SETUP_FOR_TESTS)
	$(PYTEST_WORKERS) $(PYTEST_ARGS)
endif

lint: $(STAMP) ## ruff over every Python file (rules in pyproject.toml); `make test` runs it first
	$(PY) -m ruff check .

test-unit: $(STAMP) ## Only the tests that need no server
	$(PY) -m pytest -m "not live" $(PYTEST_ARGS)

bench: models backend ## Run every benchmark (perf_analyzer) -> bench/results/REPORT.md (tuning: make tune)
	$(PY) -m bench

soak: models backend ## Soak both orchestrators (100 000 requests at concurrency 512; SOAK_ARGS) -> bench/results/soak.md; CHAOS=1: 20 min with bad inputs, cancels, short deadlines and stub kills -> chaos.md
	$(PY) -m reliability.$(if $(filter 1,$(CHAOS)),chaos,soak) $(SOAK_ARGS)

$(addprefix bench-,$(BENCH_EXPERIMENTS)): bench-%: models backend ## (bench-orchestration, bench-overhead, ...) one experiment
	$(PY) -m bench --experiment $*

bench-pb-calls: models backend ## What each pb_utils call costs in a stub, send vs return, calls per request -> bench/results/pb_calls.md
	$(PY) -m bench.pb_calls

bench-recovery: models backend ## A pipeline stub SIGKILLed under mixed load, 5 runs: what each model pays -> bench/results/recovery.md
	$(PY) -m reliability.recovery

bench-poison-load: models backend ## One request in ten poisoned, 32 clients, 120 s: innocents failed, stubs' memory -> bench/results/poison_load.md
	$(PY) -m reliability.poison_load

bench-ledger: $(STAMP) ## What each runtime mechanism costs a normal request, in-process -> bench/results/ledger.md
	$(PY) -m tests.ledger

docker-build: ## Build the NGC-based server image and its test image (Docker; no GPU needed)
	docker build --target server -t $(IMAGE) .
	docker build --target test -t $(TEST_IMAGE) .

# The image serves its own full-size models (the Dockerfile's export stage): nothing of this
# checkout is needed on the host, not even Python (a GPU host's Python 3.10 cannot install the
# local pins). REPOSITORY_MOUNT=<dir> mounts a repository of the host's read-only over the image's
# copy instead. Engines persist in the $(CACHE_VOLUME) volume; ports are published on $(PUBLISH_HOST).
REPOSITORY_MOUNT ?=
docker-run: ## Serve in the container on GPUs (BLS_PROFILE, SHM_SIZE, PUBLISH_HOST, REPOSITORY_MOUNT)
	docker run --rm -it --gpus $(GPUS) --shm-size=$(SHM_SIZE) --security-opt=no-new-privileges \
	    -p $(PUBLISH_HOST):8000:8000 -p $(PUBLISH_HOST):8001:8001 -p $(PUBLISH_HOST):8002:8002 \
	    -e BLS_PROFILE=$(BLS_PROFILE) -v $(CACHE_VOLUME):/var/cache/bls \
	    -e TRITONLOCAL_ADMIN_HEADER -e TRITONLOCAL_OPEN_APIS \
	    $(if $(REPOSITORY_MOUNT),-v $(abspath $(REPOSITORY_MOUNT)):/opt/bls/model_repository:ro) $(IMAGE)

test-container: ## Run the test suite inside the test image against its own server (GPU host)
	docker run --rm --gpus $(GPUS) --shm-size=$(TEST_SHM_SIZE) --security-opt=no-new-privileges \
	    -e BLS_PROFILE=$(BLS_PROFILE) -v $(TEST_CACHE_VOLUME):/var/cache/bls $(TEST_IMAGE) $(PYTEST_ARGS)

# On a GPU host (no Docker needed): every GPU profile against CPU ONNX Runtime, the GPU-tensor path,
# engine builds and perf_analyzer, in under 15 minutes -> bench/results/gpu-check/REPORT.md. On a
# host without a GPU it says so in one line and succeeds. GPU_CHECK_ARGS=--dry-run lists the steps.
GPU_CHECK_ARGS   ?=
gpu-check: ## On a GPU host: prove it works (every GPU profile, correctness, GPU tensors, engines, perf; <15 min)
	@case " $(GPU_CHECK_ARGS) " in *" --dry-run "*) exec $(PYTHON) -m ops.gpu_check $(GPU_CHECK_ARGS);; esac; \
	$(PYTHON) -m tritonlocal.gpu probe --what "make gpu-check" || { [ $$? = 3 ] && exit 0; exit 1; }; \
	$(MAKE) --no-print-directory models backend-gpu MODEL_SIZE=full GPU_RUNTIME=1 && \
	$(PY) -m ops.gpu_check $(GPU_CHECK_ARGS)

clean: ## Remove generated models, logs and caches (keeps .venv)
	rm -rf .triton .pytest_cache $(MODEL_REPOSITORY)/*/[0-9]*/model.onnx $(MODEL_REPOSITORY)/.export-stamp.json
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
