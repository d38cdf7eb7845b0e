"""The GPU host's side of ``make gpu-check``: GPU memory per process (nvidia-smi), the
``gpu_tensors``-off baseline of ``pipeline`` in a rendered profile, one gRPC inference. Loads
with the standard library alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

GPU_TENSORS_OFF = "pipeline_gpu_tensors_off"


def gpu_memory_mib(run=subprocess.run) -> dict[int, float]:
    """pid -> GPU memory (MiB) of every process with a CUDA context (nvidia-smi)."""
    out = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
              capture_output=True, text=True, timeout=30).stdout
    used = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            used[int(pid)] = float(mib.strip() or 0)
    return used


def infer(client, model: str, name: str, data, dtype: str, outputs):
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(data.shape), dtype)
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                        client_timeout=120)


def add_gpu_tensors_off(repository: Path) -> None:
    """``pipeline`` with ``gpu_tensors: "off"`` beside it (its baseline), in a rendered profile."""
    from google.protobuf import text_format

    from modelgen import configs

    config = configs.parse_pbtxt((repository / "pipeline" / "config.pbtxt").read_text())
    config.name = GPU_TENSORS_OFF
    config.parameters["gpu_tensors"].string_value = "off"
    (repository / GPU_TENSORS_OFF / "1").mkdir(parents=True)
    (repository / GPU_TENSORS_OFF / "config.pbtxt").write_text(text_format.MessageToString(config))
    (repository / GPU_TENSORS_OFF / "1" / "model.py").symlink_to(
        (repository / "pipeline" / "1" / "model.py").resolve())
