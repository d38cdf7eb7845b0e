# The production image: this model repository and its BLS orchestrators on Triton 2.51.0
# (NGC 24.10, the release the local server runs), for GPU hosts.
#
#   make docker-build       # the server image (target `server`) and its test image (target `test`)
#   make docker-run         # GPUs, ports on 127.0.0.1, --shm-size for the BLS fan-out
#   make test-container     # the pytest suite inside the test image, against its own server
#
# Written for a host with a Docker engine and NVIDIA GPUs; the development machine has neither,
# so this file is checked by tests/tooling/test_container.py (image tag, non-root user, health
# check, every COPY source exists), not built there. docs/production.md says what ran where.

ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3

# -- 1. Export the ONNX models: CPU PyTorch, the same code and pins as `make models` --------------
FROM python:3.11-slim AS export
ARG MODEL_SIZE=full
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bls_models bls_models
COPY modelgen modelgen
COPY tritonlocal tritonlocal
COPY bench bench
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install '.[export]'
COPY model_repository model_repository
RUN python -m modelgen.export --repository model_repository --size "${MODEL_SIZE}"

# -- 2. The server ------------------------------------------------------------------------------
FROM ${TRITON_IMAGE} AS server
LABEL org.opencontainers.image.title="triton-bls-pipelines" \
      org.opencontainers.image.description="Triton 2.51 BLS orchestrators over ONNX/TensorRT models"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    BLS_HOME=/opt/bls BLS_CACHE=/var/cache/bls BLS_PROFILE=gpu \
    TRITON_HTTP_URL=localhost:8000
WORKDIR /opt/bls
# The orchestrators run in the python backend's stub, whose interpreter is the image's python3
# (3.10): the package and its pins (numpy < 2 for the r24.10 stub) go there, with the ONNX checker
# and TensorRT 10.5's Python bindings for the engine build (the libraries are the image's).
COPY pyproject.toml README.md ./
COPY bls_models bls_models
COPY modelgen modelgen
COPY tritonlocal tritonlocal
COPY bench bench
COPY ops ops
COPY reliability reliability
RUN python3 -m pip --version >/dev/null 2>&1 \
      || (apt-get update && apt-get install -y --no-install-recommends python3-pip \
          && rm -rf /var/lib/apt/lists/*) \
 && python3 -m pip install '.[container]'
COPY scripts scripts
COPY --from=export /src/model_repository model_repository
# Fail here, not in a pod: import what the container will import, under this Python (every
# bls_models module and the orchestrators' model.py, the entry script's modules, numpy < 2,
# TensorRT's bindings over the image's libraries). Needs no GPU.
RUN python3 scripts/check_image.py
# An unprivileged user; it writes only to the cache (TensorRT engines), which `make docker-run`
# mounts as a volume so engines survive restarts, and to /tmp (the repository each start renders).
RUN groupadd --system --gid 10001 bls \
 && useradd --system --uid 10001 --gid bls --home-dir /opt/bls --shell /usr/sbin/nologin bls \
 && mkdir -p /var/cache/bls && chown bls:bls /var/cache/bls
USER 10001:10001
VOLUME ["/var/cache/bls"]
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD python3 -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status == 200 else 1)"
# Through NGC's own entry point first: it runs /opt/nvidia/entrypoint.d/ (among them the CUDA
# forward-compatibility set-up that lets this CUDA 12.6 image start on older drivers such as
# R535/R550), then execs its arguments. docs/production.md: medium confidence, not verified
# against the 24.10 image's own script.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/bls/scripts/container-serve.sh"]

# -- 3. The test image: the server image plus the suite's dependencies -------------------------
# `make test-container` runs it; the production image above carries no test tooling.
FROM server AS test
USER root
COPY tests tests
# curl: the README's example request is tested as pasted.
RUN (command -v curl >/dev/null || (apt-get update && apt-get install -y --no-install-recommends curl \
      && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && python3 -m pip install '.[container-test]' \
 && python3 scripts/check_image.py --test
USER 10001:10001
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/bls/scripts/container-test.sh"]
