"""Is this a GPU host the local GPU mode can serve on? (``make serve BLS_PROFILE=gpu``,
``make gpu-check``)

    python -m tritonlocal.gpu require gpu     # exit 2 with one clear line unless it can serve
    python -m tritonlocal.gpu probe           # exit 3 with one clear line on a host without GPU

The local GPU mode runs the wheel's tritonserver (CUDA 12.6 runtime of its own) with Triton's
onnxruntime backend built against ``onnxruntime-gpu``, whose PyPI wheel of the pinned version is
built for CUDA 13 (``tritonlocal.backend_build``, ``GPU_PACKAGES``): that needs the NVIDIA driver
R580 or newer. ``nvidia-smi`` answers both questions (it comes with the driver). Standard library
only: the Makefile runs this with the system Python before any venv exists, so a CPU host fails
in a second, not after installing a GiB of CUDA wheels.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass

# CUDA 13.0's minimum Linux driver (CUDA's release notes, "CUDA Driver" table): what the
# onnxruntime-gpu wheel's CUDA 13 runtime needs.
MIN_DRIVER = 580
# The local profiles: the committed repository on CPU, and the GPU profiles modelgen.profiles
# renders. gpu-trt serves native TensorRT plans, which need Triton's tensorrt backend: the wheel
# has none, so that profile runs in the container only.
LOCAL_PROFILES = ("portable", "gpu", "gpu-ort-trt")
CONTAINER_ONLY = {"gpu-trt": "it serves native TensorRT plans through Triton's tensorrt backend, "
                             "which the nvidia-pytriton wheel does not ship"}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int


@dataclass(frozen=True)
class Host:
    driver: str           # "580.65.06"
    gpus: tuple[Gpu, ...]

    @property
    def driver_major(self) -> int:
        return int(self.driver.split(".")[0])

    def describe(self) -> str:
        names = ", ".join(f"{g.index}: {g.name} ({g.memory_mib} MiB)" for g in self.gpus)
        return f"driver {self.driver}; GPU {names}"


class NoGpu(RuntimeError):
    """This host cannot run the GPU mode; the message says why, in one line."""


def probe(run=subprocess.run) -> Host:
    """The GPUs and driver ``nvidia-smi`` reports; raises ``NoGpu`` with the reason otherwise."""
    if shutil.which("nvidia-smi") is None:
        raise NoGpu("no NVIDIA GPU on this host (nvidia-smi, which comes with the driver, is "
                    "not installed)")
    try:
        out = run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        raise NoGpu(f"nvidia-smi did not run ({error})") from None
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not rows:
        reason = (out.stderr or out.stdout).strip().splitlines()
        raise NoGpu("nvidia-smi found no usable GPU"
                    + (f" ({reason[0]})" if reason else f" (exit {out.returncode})"))
    try:
        gpus = tuple(Gpu(int(r[0]), r[1], int(float(r[2]))) for r in rows)
        return Host(rows[0][3], gpus)
    except (IndexError, ValueError):
        raise NoGpu(f"cannot read nvidia-smi's answer: {out.stdout.strip()[:200]}") from None


def require(profile: str, run=subprocess.run, host: Host | None = None) -> Host | None:
    """None for the CPU profile; the host for a GPU profile it can serve (``host``: already
    probed). Raises ``NoGpu`` with a message that says what to do instead."""
    if profile == "portable":
        return None
    if profile in CONTAINER_ONLY:
        raise NoGpu(f"BLS_PROFILE={profile} cannot be served by the local server: "
                    f"{CONTAINER_ONLY[profile]}; use the container (`make docker-run "
                    f"BLS_PROFILE={profile}`), or BLS_PROFILE=gpu / gpu-ort-trt here")
    if profile not in LOCAL_PROFILES:
        raise NoGpu(f"BLS_PROFILE must be one of {', '.join(LOCAL_PROFILES)} for `make serve` "
                    f"(got '{profile}')")
    try:
        host = host or probe(run)
    except NoGpu as error:
        raise NoGpu(f"BLS_PROFILE={profile} needs an NVIDIA GPU: {error}. On this host serve "
                    "the CPU profile: `make serve` (BLS_PROFILE=portable)") from None
    if host.driver_major < MIN_DRIVER:
        raise NoGpu(f"BLS_PROFILE={profile} needs NVIDIA driver R{MIN_DRIVER} or newer (the "
                    f"onnxruntime-gpu wheel is built for CUDA 13); this host has {host.driver}. "
                    "Upgrade the driver, or use the container (`make docker-run`, CUDA 12.6)")
    return host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonlocal.gpu",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    need = sub.add_parser("require", help="exit 2 unless this host can serve PROFILE locally")
    need.add_argument("profile")
    check = sub.add_parser("probe", help="describe the GPUs; exit 3 (one line) when there are none")
    check.add_argument("--what", default="gpu-check",
                       help="the command asking, named in the no-GPU line")
    args = parser.parse_args(argv)
    if args.command == "require":
        try:
            host = require(args.profile)
        except NoGpu as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if host is not None:
            print(f"GPU host: {host.describe()}")
        return 0
    try:
        host = probe()
    except NoGpu as error:
        print(f"{args.what}: {error}; nothing to check on this host.")
        return 3
    print(f"{args.what}: {host.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
