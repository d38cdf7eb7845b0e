"""The local GPU mode without Docker (`make serve BLS_PROFILE=gpu`): which profile the Makefile and
the launcher serve, the fail-fast check on a host without a GPU, and the GPU server's settings. No
GPU here: what runs on one is in docs/production.md ("The local GPU mode")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tritonlocal import __main__ as cli
from tritonlocal import backend_build, flags, gpu, launcher
from tritonlocal.runtime import LauncherError

ROOT = Path(__file__).resolve().parents[2]
SMI_ROWS = "0, NVIDIA L4, 23034, 580.65.06\n1, NVIDIA L4, 23034, 580.65.06\n"


def smi(stdout: str = SMI_ROWS, code: int = 0, stderr: str = ""):
    return lambda *args, **kwargs: SimpleNamespace(stdout=stdout, stderr=stderr, returncode=code)


@pytest.fixture
def no_nvidia_smi(monkeypatch):
    real = gpu.shutil.which
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None if name == "nvidia-smi" else real(name))


@pytest.fixture
def nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpu.shutil, "which", lambda name: f"/usr/bin/{name}")


def path_without_nvidia_smi() -> str:
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "nvidia-smi").exists())


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("BLS_PROFILE", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    environment.update(PATH=path_without_nvidia_smi(), **(env or {}))
    return subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", *args],
                          cwd=ROOT, capture_output=True, text=True, env=environment, timeout=120)


# -- the host check (tritonlocal.gpu) -----------------------------------------------------------
def test_the_probe_reads_every_gpu_and_the_driver(nvidia_smi):
    host = gpu.probe(run=smi())
    assert host.driver == "580.65.06" and host.driver_major == 580
    assert [g.name for g in host.gpus] == ["NVIDIA L4", "NVIDIA L4"]
    assert "0: NVIDIA L4 (23034 MiB)" in host.describe()


def test_without_nvidia_smi_there_is_no_gpu(no_nvidia_smi):
    with pytest.raises(gpu.NoGpu, match="no NVIDIA GPU on this host"):
        gpu.probe()


def test_nvidia_smi_without_a_working_driver_is_no_gpu(nvidia_smi):
    failed = smi("", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with pytest.raises(gpu.NoGpu, match="found no usable GPU .*couldn't communicate"):
        gpu.probe(run=failed)


def test_the_cpu_profile_needs_no_gpu(no_nvidia_smi):
    assert gpu.require("portable") is None


@pytest.mark.parametrize("profile", ["gpu", "gpu-ort-trt"])
def test_a_gpu_profile_on_a_cpu_host_says_what_to_do_instead(profile, no_nvidia_smi):
    with pytest.raises(gpu.NoGpu) as failure:
        gpu.require(profile)
    message = str(failure.value)
    assert f"BLS_PROFILE={profile} needs an NVIDIA GPU" in message and "`make serve`" in message
    assert "\n" not in message


def test_a_driver_older_than_cuda_13s_is_refused(nvidia_smi):
    with pytest.raises(gpu.NoGpu, match=r"driver R580 or newer .*550\.54\.15"):
        gpu.require("gpu", run=smi("0, NVIDIA A10, 23028, 550.54.15\n"))
    assert gpu.require("gpu", run=smi()).driver == "580.65.06"


def test_gpu_trt_is_container_only_and_says_why(nvidia_smi):
    with pytest.raises(gpu.NoGpu, match=r"tensorrt backend, which the nvidia-pytriton wheel does not ship"):
        gpu.require("gpu-trt", run=smi())


# -- the launcher -------------------------------------------------------------------------------
def test_serve_with_a_gpu_profile_on_a_cpu_host_fails_fast_with_one_line(no_nvidia_smi, capsys):
    started = time.monotonic()
    assert cli.main(["serve", "--profile", "gpu"]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: BLS_PROFILE=gpu needs an NVIDIA GPU") and "\n" not in err


def test_the_portable_profile_serves_the_repository_itself(tmp_path):
    assert launcher.profile_repository("portable", ROOT / "model_repository", tmp_path,
                                       tmp_path / "cache") == ROOT / "model_repository"
    assert not list(tmp_path.iterdir())


def test_a_gpu_profile_is_rendered_into_a_directory_of_its_own(tmp_path):
    first = launcher.profile_repository("gpu", ROOT / "model_repository", tmp_path, tmp_path / "c")
    second = launcher.profile_repository("gpu", ROOT / "model_repository", tmp_path, tmp_path / "c")
    assert first != second and first.parent == tmp_path
    assert 'kind: KIND_GPU' in (first / "classifier" / "config.pbtxt").read_text()


def test_a_gpu_server_without_the_runtime_libraries_says_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setenv(backend_build.GPU_CACHE_ENV, str(tmp_path))
    with pytest.raises(LauncherError, match=r"make backend-gpu GPU_RUNTIME=1"):
        launcher.gpu_library_path("/x")
    # The directory is keyed by the pins: a stand-in installed under that key.
    root = tmp_path / "packages" / f"runtime-{backend_build._pins_key(backend_build.GPU_RUNTIME_PACKAGES)}"
    (root / "nvidia" / "cudnn" / "lib").mkdir(parents=True)
    (root / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9").write_bytes(b"")
    (root / ".installed").write_text("")
    assert launcher.gpu_library_path("/x") == f"{root / 'nvidia' / 'cudnn' / 'lib'}{os.pathsep}/x"


def test_a_gpu_server_refuses_to_start_without_the_gpu_build(tmp_path, monkeypatch):
    monkeypatch.setenv(backend_build.GPU_CACHE_ENV, str(tmp_path / "empty"))
    models = launcher.read_configs([ROOT / "model_repository"])
    server = launcher.TritonServer(launcher.ServerOptions(ROOT / "model_repository", gpu=True))
    with pytest.raises(LauncherError, match=r"backend for GPUs is not built .*`make backend-gpu`"):
        server._onnxruntime_backend(models)


def test_the_container_and_the_local_gpu_server_share_the_cuda_pool_flags():
    assert set(flags.cuda_pool_flags()) <= set(flags.container_flags(flags.new_credential()))
    assert len(flags.cuda_pool_flags()) == flags.CUDA_POOL_GPUS


# -- the Makefile -------------------------------------------------------------------------------
def test_make_serve_without_a_profile_is_the_cpu_path_as_before():
    for env in ({}, {"BLS_PROFILE": "portable"}):
        plan = make("-n", "serve", env=env).stdout
        assert "-m tritonlocal.backend_build " in plan and "-m tritonlocal serve " in plan
        assert "--gpu" not in plan and "--profile" not in plan and "tritonlocal.gpu" not in plan


@pytest.mark.parametrize("how", ["command line", "environment"])
def test_make_serve_with_a_gpu_profile_checks_the_host_first_then_builds_for_gpus(how):
    result = (make("-n", "serve", "BLS_PROFILE=gpu-ort-trt") if how == "command line"
              else make("-n", "serve", env={"BLS_PROFILE": "gpu-ort-trt"}))
    lines = result.stdout.splitlines()
    check = next(i for i, line in enumerate(lines) if "-m tritonlocal.gpu require gpu-ort-trt" in line)
    build = next(i for i, line in enumerate(lines) if "backend_build --gpu --runtime" in line)
    serve = next(i for i, line in enumerate(lines) if "-m tritonlocal serve" in line)
    assert check < build < serve and "--profile gpu-ort-trt" in lines[serve]


@pytest.mark.parametrize("jobs", [[], ["-j4"]])
def test_make_serve_gpu_on_a_cpu_host_stops_in_a_second_with_one_line(jobs):
    started = time.monotonic()
    result = make(*jobs, "serve", "BLS_PROFILE=gpu")
    assert result.returncode != 0 and time.monotonic() - started < 10
    errors = [line for line in result.stderr.splitlines() if not line.startswith("make:")]
    assert len(errors) == 1 and "needs an NVIDIA GPU" in errors[0], result.stderr
    assert "pip" not in result.stdout


def test_the_container_targets_keep_gpu_as_their_default_profile():
    plan = make("-n", "docker-run").stdout
    assert "-e BLS_PROFILE=gpu " in plan


def test_docker_run_needs_nothing_of_the_checkout_on_the_host():
    """On a GPU host the Makefile only runs docker: no venv, pip, apt or model export (the host's
    Python 3.10 cannot install the local pins; the image has its own models)."""
    plan = make("-n", "docker-run").stdout
    assert plan.startswith("docker run ") and plan.count("docker run") == 1, plan
    assert not [word for word in ("pip install", ".venv", "modelgen", "apt-get") if word in plan], plan
    assert "/opt/bls/model_repository" not in plan, "the image's own models are served"
    mounted = make("-n", "docker-run", "REPOSITORY_MOUNT=model_repository").stdout
    assert f"-v {ROOT / 'model_repository'}:/opt/bls/model_repository:ro" in mounted


def server_command(**options) -> list[str]:
    server = launcher.TritonServer(launcher.ServerOptions(ROOT / "model_repository", **options))
    return server.command(Path("/bin/tritonserver"), ROOT / "model_repository", Path("/b"), [])


def test_the_cpu_server_command_is_as_before():
    command = server_command()
    assert "--pinned-memory-pool-byte-size=0" in command and "--allow-gpu-metrics=false" in command
    assert not [a for a in command if a.startswith("--cuda-memory-pool-byte-size")]


def test_a_gpu_server_gets_gpu_metrics_pinned_memory_and_the_cuda_pools():
    command = server_command(gpu=True)
    assert "--allow-gpu-metrics=true" in command
    assert "--pinned-memory-pool-byte-size=0" not in command
    assert [a for a in command if a.startswith("--cuda-memory-pool-")] == flags.cuda_pool_flags()


def test_extra_backends_are_copied_into_the_backend_directory(tmp_path):
    tensorrt = tmp_path / "tensorrt"
    tensorrt.mkdir()
    (tensorrt / "libtriton_tensorrt.so").write_bytes(b"backend")
    install = SimpleNamespace(python_backend=tmp_path / "python_backend")
    install.python_backend.mkdir()
    (install.python_backend / "libtriton_python.so").write_bytes(b"python")
    stub = tmp_path / "triton_python_backend_stub"
    stub.write_bytes(b"stub")
    server = launcher.TritonServer(launcher.ServerOptions(ROOT / "model_repository",
                                                          extra_backends={"tensorrt": tensorrt}))
    target = server._assemble_backends(install, stub, None, tmp_path / "backends")
    assert (target / "tensorrt" / "libtriton_tensorrt.so").read_bytes() == b"backend"
    assert sorted(p.name for p in (target / "python").iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub"]
