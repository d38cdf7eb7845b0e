"""The tritonserver flags this repository is served with, locally (the launcher) and in the NGC
container (``scripts/container-serve.sh``): one list, so both places serve it the same way.

    python3 -m tritonlocal.flags                       # the container's flags, one per line
    python3 -m tritonlocal.flags --model-repository /models

Standard library only: it runs inside the container before anything else is known to work.
"""

from __future__ import annotations

import argparse
import sys

MIB = 2**20
# The python backend's shared-memory region per stub: start and growth step. Regions never
# shrink; from Triton's 1 MiB default the orchestrators' regions crept to ~190 MiB in 1 MiB steps
# (docs/orchestrator.md). Sizing /dev/shm: docs/operations.md.
SHM_DEFAULT_BYTES = 32 * MIB
SHM_GROWTH_BYTES = 16 * MIB
# The python backend's per-instance pool of server-side threads (undocumented, default 32). Each
# BLS call in flight holds one until the sub-model answers, and each response a stub sends needs
# one: it must exceed every orchestrator's ``subrequest_threads`` (64), or responses wait behind
# calls to a slow model (docs/reliability.md). tests/unit/test_configs.py checks.
PYTHON_THREAD_POOL = 96
CONTAINER_REPOSITORY = "/opt/bls/model_repository"
# Triton's CUDA memory pool per GPU (--cuda-memory-pool-byte-size; its default is 64 MiB). The GPU
# tensors of BLS requests and responses (gpu_tensors on: PIXELS, 9.6 MB at batch 16) and the
# onnxruntime backend's batch buffers come from it; past it, every tensor falls back to
# cudaMalloc/cudaFree and a CUDA IPC handle of its own. The arithmetic is in docs/production.md
# ("The CUDA memory pool"); modelgen.profiles.cuda_pool_bytes computes it and a test keeps the two
# equal. One flag per GPU id: Triton creates pools only for the GPUs it finds (core r24.10
# cuda_memory_manager.cc), so ids past the host's last GPU are ignored.
CUDA_MEMORY_POOL_BYTES = 256 * MIB
CUDA_POOL_GPUS = 8


def serving_flags(shm_default_bytes: int = SHM_DEFAULT_BYTES,
                  shm_growth_bytes: int = SHM_GROWTH_BYTES,
                  python_thread_pool: int = PYTHON_THREAD_POOL) -> list[str]:
    """What every server of this repository runs with, wherever it runs."""
    return [
        # No load/unload at run time: what is deployed is what was reviewed.
        "--model-control-mode=none",
        # The configs are complete and committed: load them exactly as written.
        "--disable-auto-complete-config",
        # A model that fails to load stops the server instead of serving without it.
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--backend-config=python,shm-default-byte-size={shm_default_bytes}",
        f"--backend-config=python,shm-growth-byte-size={shm_growth_bytes}",
        f"--backend-config=python,thread-pool-size={python_thread_pool}",
    ]


def container_flags(model_repository: str = CONTAINER_REPOSITORY) -> list[str]:
    """The NGC container's server: all interfaces inside the container (publish the ports to
    127.0.0.1 on the host unless told otherwise), GPU metrics on, a CUDA memory pool per GPU
    sized for the GPU profiles."""
    return [f"--model-repository={model_repository}", *serving_flags(),
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
            "--allow-metrics=true", "--allow-gpu-metrics=true", "--allow-cpu-metrics=true",
            *cuda_pool_flags()]


def cuda_pool_flags() -> list[str]:
    """A CUDA memory pool per GPU sized for the GPU profiles (the container's server, and the local
    server on a GPU host)."""
    return [f"--cuda-memory-pool-byte-size={gpu}:{CUDA_MEMORY_POOL_BYTES}"
            for gpu in range(CUDA_POOL_GPUS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tritonlocal.flags",
                                     description="Print the container's tritonserver flags.")
    parser.add_argument("--model-repository", default=CONTAINER_REPOSITORY)
    args = parser.parse_args(argv)
    print("\n".join(container_flags(args.model_repository)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
