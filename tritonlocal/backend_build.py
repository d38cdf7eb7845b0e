"""Build Triton's own onnxruntime backend (C++, r24.10) for the wheel's tritonserver, cached.

The ``nvidia-pytriton`` wheel bundles tritonserver 2.51.0 (the NGC 24.10 release) with its
python backend only. The ONNX models are served here by the same C++ backend the NGC container
runs, built from its r24.10 sources against the ONNX Runtime library of the venv's pinned
``onnxruntime`` wheel::

    python -m tritonlocal.backend_build        # `make backend`; `make serve` and `make test` run it

Inputs (all of them make the cache key; a change of any one rebuilds):

* **sources**: the r24.10 trees of ``onnxruntime_backend``, ``backend``, ``core`` and ``common``,
  as ``<repo>-r24.10.tar.gz`` in ``--sources`` (default ``../shared/vendor/triton-r24.10`` next
  to the project, when it exists: no network needed), else downloaded from GitHub at r24.10;
* **the C API header** ``onnxruntime_c_api.h``: from a ``libonnxruntime-dev`` Debian package in
  ``--headers`` (default ``../shared/vendor/onnxruntime-headers``), a directory holding the
  header, or ONNX Runtime's own release of the library's version on GitHub. Its API version must
  not be newer than the library's;
* **the library**: ``libonnxruntime.so.<version>`` inside the installed ``onnxruntime`` wheel. It
  is copied next to the backend (whose RUNPATH is ``$ORIGIN``): ONNX Runtime versions its symbols
  per release, so the backend loads exactly the library it was linked against;
* **the server library's name**: the wheel renames ``libtritonserver.so`` (to
  ``libtritonserver-<hash>.so``); the backend's ``NEEDED`` entry is rewritten to it (patchelf);
* the compiler, CMake and this recipe (``RECIPE``).

**The GPU build** (``--gpu``, ``make backend-gpu``; its own cache, ``.triton/onnxruntime-backend-gpu``)
compiles the same sources with ``TRITON_ENABLE_GPU=ON`` and ``TRITON_ENABLE_ONNXRUNTIME_TENSORRT=ON``
against ``onnxruntime-gpu`` of the CPU pin's version, with CUDA from PyPI only (no toolkit
install): ``GPU_BUILD_PACKAGES`` are installed with pip into ``<cache>/packages/build-<hash>``.
The onnxruntime-gpu wheel of the pinned version is built for CUDA 13, and CUDA 12's PyPI wheels
carry no ``nvcc`` (which the backend library's CUDA kernel needs), so the toolkit is CUDA 13.0.
CUDA 13 compiles for compute capability 7.5 and newer only, while backend r24.10 lists 5.3 to
7.2 too: the recipe narrows that list through a CMake project include (``CUDA_ARCHITECTURES``).
Compiling needs headers and nvcc, no GPU. Serving needs the runtime libraries ONNX Runtime's CUDA
and TensorRT providers load (``GPU_RUNTIME_PACKAGES``, ``--runtime``; a GiB or more) and the
NVIDIA driver R580+ (``tritonlocal.gpu``).

Output: ``<cache>/<key>/onnxruntime/{libtriton_onnxruntime.so, libonnxruntime.so.1}`` plus
``build-info.json`` and ``build.log``, and ``<cache>/current`` pointing at it. The launcher copies
``current`` into the backend directory it assembles for each server.

A missing tool or input stops the build with a message naming it (and its Debian package);
there is no fallback to anything else.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TAG = "r24.10"
REPOS = ("onnxruntime_backend", "backend", "core", "common")
VENDOR = PROJECT_ROOT.parent / "shared" / "vendor"
DEFAULT_SOURCES = VENDOR / "triton-r24.10"
DEFAULT_HEADERS = VENDOR / "onnxruntime-headers"
DEFAULT_CACHE = PROJECT_ROOT / ".triton" / "onnxruntime-backend"
CACHE_ENV = "TRITONLOCAL_BACKEND_CACHE"
DEFAULT_GPU_CACHE = PROJECT_ROOT / ".triton" / "onnxruntime-backend-gpu"
GPU_CACHE_ENV = "TRITONLOCAL_BACKEND_GPU_CACHE"
SOURCE_URL = "https://github.com/triton-inference-server/{repo}/archive/" + TAG + ".tar.gz"
ORT_RELEASE_URL = ("https://github.com/microsoft/onnxruntime/releases/download/v{version}/"
                   "onnxruntime-linux-x64-{version}.tgz")
BACKEND_LIB = "libtriton_onnxruntime.so"
TARGET = "triton-onnxruntime-backend"
# Bump when the steps below change in a way the other inputs do not show.
RECIPE = 1
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DTRITON_ENABLE_GPU=OFF",
    "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=OFF",
    "-DTRITON_ENABLE_ONNXRUNTIME_OPENVINO=OFF",
    f"-DTRITON_BACKEND_REPO_TAG={TAG}",
    f"-DTRITON_CORE_REPO_TAG={TAG}",
    f"-DTRITON_COMMON_REPO_TAG={TAG}",
    "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
    # common r24.10 always configures its tests, with googletest from Debian's sources.
    "-DFETCHCONTENT_SOURCE_DIR_GOOGLETEST=/usr/src/googletest",
)
# The GPU build: the same options with CUDA, and ONNX Runtime's TensorRT provider (the backend
# reaches it through ONNX Runtime's C API only: no TensorRT headers at build time; gpu-ort-trt).
_GPU_SWITCHES = {"-DTRITON_ENABLE_GPU=OFF": "-DTRITON_ENABLE_GPU=ON",
                 "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=OFF": "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=ON"}
GPU_OPTIONS = (*(_GPU_SWITCHES.get(option, option) for option in CMAKE_OPTIONS),
               "-DTRITON_ENABLE_MEMORY_TRACKER=OFF")
# What the GPU build compiles with (pip, --no-deps, into a directory of its own; every pin is in
# the cache key). All CUDA 13 wheels install into one tree, nvidia/cu13/{bin,include,lib,nvvm}.
GPU_CUDA_ROOT = "nvidia/cu13"
GPU_BUILD_PACKAGES = (
    "nvidia-cuda-nvcc==13.0.88",     # nvcc, ptxas, fatbinary (CUDA 12's wheels have no nvcc)
    "nvidia-nvvm==13.0.88",          # cicc, libdevice: nvcc's device front end
    "nvidia-cuda-crt==13.0.88",      # crt/ headers nvcc includes
    "nvidia-cuda-runtime==13.0.96",  # cuda_runtime_api.h, libcudart.so.13
    "nvidia-cuda-cccl==13.0.85",     # nv/target, cuda/std: included by CUDA 13's headers
)
# What ONNX Runtime's providers load when serving (libonnxruntime_providers_cuda.so NEEDs cuBLAS,
# cuBLASLt, cuRAND and cudart 13 and opens cuDNN 9 and cuFFT; the TensorRT provider NEEDs
# libnvinfer.so.10 and libnvonnxparser.so.10): onnxruntime-gpu's own `cuda` and `cudnn` extras,
# pinned within their ranges, plus TensorRT 10 for CUDA 13.
GPU_RUNTIME_PACKAGES = (
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cublas==13.0.2.14",
    "nvidia-cufft==12.0.0.61",
    "nvidia-curand==10.4.0.35",
    "nvidia-cudnn-cu13==9.14.0.64",
    "tensorrt-cu13-libs==10.16.1.11",
    "tensorrt-cu13-bindings==10.16.1.11",  # scripts/build_trt_engines.py (gpu-trt, make gpu-check)
)
# CUDA 13 dropped compute capability < 7.5; backend r24.10 hard-codes 5.3 to 9.0 for its one CUDA
# kernel (kernel_library_new, the input gatherer). The project include below runs after the
# backend's CMakeLists has set its list (cmake_language DEFER) and keeps what CUDA 13 compiles:
# Turing to Blackwell as machine code, plus PTX of the newest for GPUs after it.
CUDA_ARCHITECTURES = "75-real;80-real;86-real;89-real;90-real;100-real;120"
ARCHITECTURES_INCLUDE = (
    "# Written by tritonlocal.backend_build (the GPU build): CUDA 13 compiles for compute\n"
    "# capability 7.5 and newer only; backend r24.10 lists 5.3 to 9.0 for kernel_library_new.\n"
    "cmake_language(DEFER CALL set_target_properties kernel_library_new PROPERTIES\n"
    f"  CUDA_ARCHITECTURES \"{CUDA_ARCHITECTURES}\")\n")
# Copied next to the GPU backend (RUNPATH $ORIGIN; ONNX Runtime opens its providers from the
# directory of libonnxruntime.so): the providers, and cudart 13 under its SONAME.
GPU_PROVIDERS = ("libonnxruntime_providers_shared.so", "libonnxruntime_providers_cuda.so",
                 "libonnxruntime_providers_tensorrt.so")
# What the build needs from the system, and the Debian package that provides it.
TOOLS = {"cmake": "cmake", "g++": "g++", "make": "make", "patchelf": "patchelf",
         "dpkg-deb": "dpkg"}
FILES = {"/usr/include/rapidjson/document.h": "rapidjson-dev",
         "/usr/src/googletest/CMakeLists.txt": "googletest"}


class BuildError(RuntimeError):
    """The build cannot run or failed; the message says what is missing or went wrong."""


@dataclass(frozen=True)
class Library:
    path: Path       # libonnxruntime.so.<version> inside the onnxruntime wheel
    version: str     # "1.31.1"


@dataclass(frozen=True)
class Inputs:
    sources: dict[str, Path]  # repo -> tarball
    header: Path              # a .deb with the header, or a directory holding onnxruntime_c_api.h
    library: Library
    server_library: str       # the wheel's name of libtritonserver.so
    # The GPU build only: the CUDA toolkit tree (bin/nvcc, include, lib) and ONNX Runtime's
    # provider libraries beside its library.
    cuda: Path | None = None
    providers: tuple[Path, ...] = ()

    @property
    def gpu(self) -> bool:
        return self.cuda is not None


def _log(message: str) -> None:
    print(f"onnxruntime backend: {message}", flush=True)


# -- inputs -------------------------------------------------------------------------------------
def onnxruntime_library() -> Library:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the onnxruntime wheel is not installed in this environment (its "
                         "library is what the backend links); run `make venv`")
    return library_in(Path(list(spec.submodule_search_locations)[0]) / "capi")


def library_in(capi: Path) -> Library:
    """``libonnxruntime.so.<version>`` of an installed onnxruntime (or onnxruntime-gpu) wheel."""
    found = sorted(capi.glob("libonnxruntime.so.*.*.*"))
    if len(found) != 1:
        raise BuildError(f"expected one libonnxruntime.so.<version> in {capi}, found "
                         f"{[p.name for p in found] or 'none'}")
    return Library(found[0], found[0].name.removeprefix("libonnxruntime.so."))


def server_library_name() -> str:
    from tritonlocal import runtime

    try:
        libs = runtime.find_installation().libs
    except runtime.LauncherError as error:
        raise BuildError(str(error)) from None
    found = sorted(libs.glob("libtritonserver*.so"))
    if len(found) != 1:
        raise BuildError(f"expected one libtritonserver*.so in the nvidia-pytriton wheel, found "
                         f"{[p.name for p in found] or 'none'}")
    return found[0].name


def check_system() -> None:
    missing = [f"{tool} (Debian package {package})" for tool, package in TOOLS.items()
               if shutil.which(tool) is None]
    missing += [f"{path} (Debian package {package})" for path, package in FILES.items()
                if not Path(path).exists()]
    if missing:
        raise BuildError("cannot build: missing " + ", ".join(missing) +
                         "; `scripts/install_system_deps.sh` installs them")


def _download(url: str, target: Path) -> Path:
    _log(f"downloading {url}")
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise BuildError(f"cannot download {url} ({error}); on a machine without GitHub access "
                         "give a directory holding the tarballs: `make ... TRITON_SOURCES=DIR` "
                         "(python -m tritonlocal.backend_build --sources DIR)") from None
    os.replace(partial, target)
    return target


def _cached_download(url: str, cache: Path, name: str) -> Path:
    """``<cache>/downloads/<name>``, downloaded from ``url`` the first time."""
    target = cache / "downloads" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    return target if target.is_file() else _download(url, target)


def find_sources(sources: Path | None, cache: Path) -> dict[str, Path]:
    """repo -> ``<repo>-r24.10.tar.gz``: from ``sources`` if given, else the vendored copy if it
    exists, else GitHub (downloaded once into the cache)."""
    directory = sources if sources is not None else (
        DEFAULT_SOURCES if DEFAULT_SOURCES.is_dir() else None)
    if directory is not None:
        tarballs = {repo: Path(directory) / f"{repo}-{TAG}.tar.gz" for repo in REPOS}
        missing = [str(p) for p in tarballs.values() if not p.is_file()]
        if missing:
            raise BuildError(f"the sources directory {directory} lacks {', '.join(missing)}")
        return tarballs
    return {repo: _cached_download(SOURCE_URL.format(repo=repo), cache, f"{repo}-{TAG}.tar.gz")
            for repo in REPOS}


def find_header(headers: Path | None, library: Library, cache: Path) -> Path:
    """A ``libonnxruntime-dev`` .deb, a directory holding ``onnxruntime_c_api.h``, or ONNX
    Runtime's release tarball of the library's version (downloaded once into the cache)."""
    candidate = headers if headers is not None else (
        DEFAULT_HEADERS if DEFAULT_HEADERS.is_dir() else None)
    if candidate is not None:
        candidate = Path(candidate)
        if candidate.is_file() or (candidate / "onnxruntime_c_api.h").is_file():
            return candidate
        debs = sorted(candidate.glob("libonnxruntime-dev_*.deb")) if candidate.is_dir() else []
        if not debs:
            raise BuildError(f"{candidate} holds neither onnxruntime_c_api.h nor a "
                             "libonnxruntime-dev_*.deb")
        return debs[-1]
    return _cached_download(ORT_RELEASE_URL.format(version=library.version), cache,
                            f"onnxruntime-linux-x64-{library.version}.tgz")


def gather(sources: Path | None, headers: Path | None, cache: Path) -> Inputs:
    library = onnxruntime_library()
    return Inputs(find_sources(sources, cache), find_header(headers, library, cache), library,
                  server_library_name())


# -- the GPU build's inputs: onnxruntime-gpu and CUDA 13 from PyPI --------------------------------
def cpu_onnxruntime_version() -> str:
    """The venv's onnxruntime (pyproject's pin): the GPU build takes onnxruntime-gpu of the same
    version, so CPU and GPU serve the same ONNX Runtime release."""
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError("the onnxruntime wheel is not installed in this environment (the GPU "
                         "build takes onnxruntime-gpu of its version); run `make venv`") from None


def gpu_build_packages() -> tuple[str, ...]:
    return (f"onnxruntime-gpu=={cpu_onnxruntime_version()}", *GPU_BUILD_PACKAGES)


def _pins_key(packages: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(sorted(packages)).encode()).hexdigest()[:12]


def _packages_dir(cache: Path, kind: str, packages: tuple[str, ...]) -> Path:
    return Path(cache) / "packages" / f"{kind}-{_pins_key(packages)}"


def pip_install(packages: tuple[str, ...], cache: Path, kind: str) -> Path:
    """``<cache>/packages/<kind>-<hash of the pins>``: ``packages`` installed there once with pip
    (``--no-deps --target``: exactly these pins, nothing of the venv touched; onnxruntime-gpu
    and the venv's onnxruntime would otherwise overwrite each other's files)."""
    target = _packages_dir(cache, kind, packages)
    if (target / ".installed").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".partial", dir=target.parent))
    log = cache / f"pip-{kind}.log"
    _log(f"installing {len(packages)} package(s) with pip into {target} (once; log {log})")
    try:
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
              "--disable-pip-version-check", "--target", str(partial), *packages], log,
             f"pip install {' '.join(packages)}")
        (partial / ".installed").write_text("\n".join(packages) + "\n")
        try:
            os.rename(partial, target)
        except OSError:  # another build installed the same pins first: keep that one
            if not (target / ".installed").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def cuda_toolkit(packages: Path) -> Path:
    """The CUDA 13 tree the wheels installed, completed where the tools expect a toolkit's layout:
    ``lib/libcudart.so`` (FindCUDAToolkit looks for that name; the wheel ships the SONAME only)
    and ``lib64`` (nvcc links its test programs from ``lib64``, per its nvcc.profile; the wheels
    install ``lib``)."""
    root = packages / GPU_CUDA_ROOT
    for needed in ("bin/nvcc", "nvvm/bin/cicc", "include/cuda_runtime_api.h", "lib/libcudart.so.13"):
        if not (root / needed).exists():
            raise BuildError(f"the CUDA wheels in {packages} lack {GPU_CUDA_ROOT}/{needed}")
    for link, target in ((root / "lib" / "libcudart.so", "libcudart.so.13"), (root / "lib64", "lib")):
        if not link.is_symlink() and not link.exists():
            link.symlink_to(target)
    return root


def gather_gpu(sources: Path | None, headers: Path | None, cache: Path) -> Inputs:
    packages = pip_install(gpu_build_packages(), cache, "build")
    capi = packages / "onnxruntime" / "capi"
    library = library_in(capi)
    providers = tuple(capi / name for name in GPU_PROVIDERS)
    missing = [p.name for p in providers if not p.is_file()]
    if missing:
        raise BuildError(f"onnxruntime-gpu in {packages} lacks {', '.join(missing)}")
    return Inputs(find_sources(sources, cache), find_header(headers, library, cache), library,
                  server_library_name(), cuda=cuda_toolkit(packages), providers=providers)


def install_gpu_runtime(cache: Path) -> Path:
    """The libraries ONNX Runtime's CUDA and TensorRT providers load (``GPU_RUNTIME_PACKAGES``),
    installed once; the launcher puts their directories on the server's LD_LIBRARY_PATH."""
    return pip_install(GPU_RUNTIME_PACKAGES, cache, "runtime")


def gpu_runtime(cache: Path | None = None) -> Path | None:
    """Where ``install_gpu_runtime`` installed the current pins, or None."""
    root = _packages_dir(cache or default_cache(gpu=True), "runtime", GPU_RUNTIME_PACKAGES)
    return root if (root / ".installed").is_file() else None


def gpu_runtime_library_dirs(cache: Path | None = None) -> list[Path]:
    """The directories of the installed GPU runtime libraries (``install_gpu_runtime``), or []."""
    root = gpu_runtime(cache)
    if root is None:
        return []
    return sorted({path.parent for path in root.glob("**/lib*.so*") if path.is_file()})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _output_line(command: list[str], index: int = 0) -> str:
    """Line ``index`` of what ``command`` prints (a tool's version), "missing" or "unknown"."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "missing"
    return out.splitlines()[index] if out else "unknown"


def describe(inputs: Inputs) -> dict:
    """Everything the build depends on, as recorded in build-info.json and hashed into the key."""
    header = inputs.header
    header_id = (_sha256(header) if header.is_file()
                 else _sha256(header / "onnxruntime_c_api.h"))
    return {
        "recipe": RECIPE,
        "tag": TAG,
        "sources": {repo: _sha256(path) for repo, path in sorted(inputs.sources.items())},
        "header": {"from": header.name, "sha256": header_id},
        "library": {"version": inputs.library.version, "sha256": _sha256(inputs.library.path)},
        "server_library": inputs.server_library,
        "cmake_options": list(GPU_OPTIONS if inputs.gpu else CMAKE_OPTIONS),
        "compiler": _output_line(["g++", "--version"]),
        "cmake": _output_line(["cmake", "--version"]),
        # (Only GPU builds have these keys: a CPU build's key is what it was before them.)
        **({"gpu": {"packages": list(gpu_build_packages()),
                    "nvcc": _output_line([str(inputs.cuda / "bin" / "nvcc"), "--version"], -1),
                    "cuda_architectures": CUDA_ARCHITECTURES,
                    "providers": {p.name: _sha256(p) for p in inputs.providers}}}
           if inputs.gpu else {}),
    }


def cache_key(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


# -- the build ----------------------------------------------------------------------------------
def header_api_version(include: Path) -> int:
    match = re.search(r"#define ORT_API_VERSION (\d+)", (include / "onnxruntime_c_api.h").read_text())
    if not match:
        raise BuildError(f"no ORT_API_VERSION in {include / 'onnxruntime_c_api.h'}")
    return int(match.group(1))


def extract_header(header: Path, work: Path) -> Path:
    """The directory holding ``onnxruntime_c_api.h``."""
    if header.is_dir():
        return header
    target = work / "ort-headers"
    target.mkdir()
    if header.suffix == ".deb":
        _run(["dpkg-deb", "-x", str(header), str(target)], work / "extract.log", "extract the header")
        found = sorted(target.rglob("onnxruntime_c_api.h"))
    else:
        with tarfile.open(header) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and "/include/" in m.name]
            archive.extractall(target, members=members, filter="data")
        found = sorted(target.rglob("onnxruntime_c_api.h"))
    if not found:
        raise BuildError(f"{header} has no onnxruntime_c_api.h")
    return found[0].parent


def extract_sources(tarballs: dict[str, Path], work: Path) -> dict[str, Path]:
    """repo -> its extracted tree (the tarball's one top-level directory stripped, so that
    ``git archive --prefix=<repo>/`` and GitHub's ``<repo>-r24.10/`` both work)."""
    trees = {}
    for repo, tarball in tarballs.items():
        target = work / "src" / repo
        target.mkdir(parents=True)
        with tarfile.open(tarball) as archive:
            members = []
            for member in archive.getmembers():
                parts = member.name.split("/", 1)
                if len(parts) == 2 and parts[1]:
                    member.name = parts[1]
                    members.append(member)
            archive.extractall(target, members=members, filter="data")
        if not (target / "CMakeLists.txt").is_file():
            raise BuildError(f"{tarball} does not hold the {repo} sources (no CMakeLists.txt)")
        trees[repo] = target
    return trees


def _run(command: list[str], log: Path, what: str, cwd: Path | None = None,
         progress: bool = False) -> None:
    """Run ``command`` with its output appended to ``log``; with ``progress``, echo CMake's
    ``[ NN%]`` lines. A failure raises with the log's tail."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in process.stdout:
            out.write(line)
            if progress and re.match(r"\[\s*\d+%\]", line):
                print(f"  {line.rstrip()}", flush=True)
        code = process.wait()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {code}); log {log}:\n{tail}")


def gpu_cmake_arguments(cuda: Path, work: Path) -> list[str]:
    """CMake's arguments for the GPU build: ``GPU_OPTIONS``, the toolkit from the wheels, and the
    project include that narrows the backend library's CUDA architectures to CUDA 13's."""
    include = work / "cuda_architectures.cmake"
    include.write_text(ARCHITECTURES_INCLUDE)
    return [*GPU_OPTIONS, f"-DCUDAToolkit_ROOT={cuda}", f"-DCMAKE_CUDA_COMPILER={cuda}/bin/nvcc",
            f"-DCMAKE_PROJECT_tritonbackend_INCLUDE={include}"]


def build(inputs: Inputs, description: dict, target: Path, jobs: int) -> None:
    """Configure, compile and assemble the backend into ``target`` (``<target>/onnxruntime``)."""
    work = target / "work"
    work.mkdir(parents=True)
    log = target / "build.log"
    started = time.monotonic()
    _log("extracting the r24.10 sources and the ONNX Runtime header")
    trees = extract_sources(inputs.sources, work)
    include = extract_header(inputs.header, work)
    header_api, library_api = header_api_version(include), int(inputs.library.version.split(".")[1])
    if header_api > library_api:
        raise BuildError(f"the header {inputs.header.name} has ONNX Runtime API {header_api}, newer "
                         f"than the library's {inputs.library.version}; use an older header")
    lib_dir = work / "ort-lib"
    lib_dir.mkdir()
    shutil.copy2(inputs.library.path, lib_dir / inputs.library.path.name)
    for alias in ("libonnxruntime.so", "libonnxruntime.so.1"):
        (lib_dir / alias).symlink_to(inputs.library.path.name)
    build_dir = work / "build"
    build_dir.mkdir()
    _log(f"configuring (CMake; ONNX Runtime {inputs.library.version}, header API {header_api})")
    _run(["cmake", str(trees["onnxruntime_backend"]),
          *(gpu_cmake_arguments(inputs.cuda, work) if inputs.gpu else CMAKE_OPTIONS),
          f"-DTRITON_ONNXRUNTIME_INCLUDE_PATHS={include}",
          f"-DTRITON_ONNXRUNTIME_LIB_PATHS={lib_dir}",
          *(f"-DFETCHCONTENT_SOURCE_DIR_REPO-{repo.upper()}={trees[repo]}"
            for repo in ("common", "core", "backend"))],
         log, "CMake configure", cwd=build_dir)
    _log(f"compiling {TARGET} with {jobs} job(s)")
    _run(["cmake", "--build", ".", "--target", TARGET, f"-j{jobs}"], log, "the compile",
         cwd=build_dir, progress=True)
    backend = target / "onnxruntime"
    backend.mkdir()
    shutil.copy2(build_dir / BACKEND_LIB, backend / BACKEND_LIB)
    _run(["patchelf", "--replace-needed", "libtritonserver.so", inputs.server_library,
          str(backend / BACKEND_LIB)], log, "patchelf")
    # Under its SONAME, the name the backend's NEEDED entry asks for.
    shutil.copy2(inputs.library.path, backend / "libonnxruntime.so.1")
    for provider in inputs.providers:
        shutil.copy2(provider, backend / provider.name)
    if inputs.gpu:
        # The backend's own CUDA runtime (it NEEDs libcudart.so.13; the server has 12.6's).
        shutil.copy2(inputs.cuda / "lib" / "libcudart.so.13", backend / "libcudart.so.13")
    shutil.rmtree(work)
    seconds = time.monotonic() - started
    (target / "build-info.json").write_text(json.dumps(
        {**description, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "build_seconds": round(seconds, 1), "jobs": jobs}, indent=2) + "\n")
    _log(f"built in {seconds:.0f} s")


def ensure(sources: Path | None = None, headers: Path | None = None, cache: Path | None = None,
           jobs: int | None = None, force: bool = False, gpu: bool = False) -> Path:
    """The built backend directory for the current inputs (``<cache>/<key>/onnxruntime``),
    built first unless the cache holds it. ``<cache>/current`` points at it afterwards. With
    ``gpu``, the GPU build (its own default cache)."""
    cache = Path(cache or default_cache(gpu)).resolve()
    check_system()
    cache.mkdir(parents=True, exist_ok=True)
    inputs = (gather_gpu if gpu else gather)(sources, headers, cache)
    description = describe(inputs)
    key = cache_key(description)
    final = cache / key
    if force and final.exists():
        shutil.rmtree(final)
    if (final / "build-info.json").is_file():
        _log(f"cached: {final} (inputs unchanged)")
    else:
        _log(f"building Triton's onnxruntime backend {TAG}{' for GPUs' if gpu else ''} "
             f"(key {key}) into {final}")
        partial = Path(tempfile.mkdtemp(prefix=f"{key}.", suffix=".partial", dir=cache))
        partial.chmod(0o755)
        try:
            build(inputs, description, partial, jobs or os.cpu_count() or 1)
            try:
                os.rename(partial, final)
            except OSError:  # another build of the same key finished first: keep that one
                if not (final / "build-info.json").is_file():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    link = cache / f"current.{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(key)
    os.replace(link, cache / "current")
    prune(cache, keep=key)
    return final / "onnxruntime"


def prune(cache: Path, keep: str) -> None:
    """Remove builds of other keys (servers run from copies, so none is in use) and partial
    builds whose process is gone."""
    for entry in cache.iterdir():
        if entry.name in (keep, "current", "downloads") or entry.is_symlink():
            continue
        if entry.name.endswith(".partial"):
            continue  # may belong to a build running now; the next prune after it takes it
        if entry.is_dir() and len(entry.name) == 16:
            shutil.rmtree(entry, ignore_errors=True)


def default_cache(gpu: bool = False) -> Path:
    if gpu:
        return Path(os.environ.get(GPU_CACHE_ENV) or DEFAULT_GPU_CACHE)
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def installed(cache: Path | None = None, gpu: bool = False) -> Path | None:
    """The backend directory ``ensure`` built last (``<cache>/current/onnxruntime``), or None."""
    backend = Path(cache or default_cache(gpu)) / "current" / "onnxruntime"
    return backend if (backend / BACKEND_LIB).is_file() else None


def summary(backend: Path) -> str:
    """One line on a built backend, from its build-info.json (for the launcher's banner)."""
    try:
        info = json.loads((Path(backend).parent / "build-info.json").read_text())
    except (OSError, ValueError):
        return f"Triton's onnxruntime backend from {backend}"
    gpu = " for GPUs (CUDA 13, onnxruntime-gpu)" if "gpu" in info else ""
    return (f"Triton's onnxruntime backend {info['tag']}{gpu} (C++, built here in "
            f"{info['build_seconds']:.0f} s, {info['built_at'][:10]}) on ONNX Runtime "
            f"{info['library']['version']}; cache {Path(backend).parent.resolve()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonlocal.backend_build",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=Path,
                        help=f"directory holding <repo>-{TAG}.tar.gz for {', '.join(REPOS)} "
                             f"(default: {DEFAULT_SOURCES} if it exists, else GitHub)")
    parser.add_argument("--headers", type=Path,
                        help="a libonnxruntime-dev .deb or a directory holding one or holding "
                             f"onnxruntime_c_api.h (default: {DEFAULT_HEADERS} if it exists, else "
                             "ONNX Runtime's release of the library's version)")
    parser.add_argument("--cache", type=Path,
                        help=f"cache directory (default: ${CACHE_ENV} or {DEFAULT_CACHE})")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU build: TRITON_ENABLE_GPU=ON against onnxruntime-gpu, CUDA "
                             f"from PyPI (default cache: ${GPU_CACHE_ENV} or {DEFAULT_GPU_CACHE}); "
                             "compiles without a GPU")
    parser.add_argument("--runtime", action="store_true",
                        help="with --gpu: also install the CUDA, cuDNN and TensorRT libraries "
                             "serving needs (GPU_RUNTIME_PACKAGES)")
    args = parser.parse_args(argv)
    if args.runtime and not args.gpu:
        parser.error("--runtime goes with --gpu")
    try:
        path = ensure(args.sources, args.headers, args.cache, args.jobs, args.force, gpu=args.gpu)
        if args.runtime:
            install_gpu_runtime(Path(args.cache or default_cache(gpu=True)).resolve())
    except BuildError as error:
        print(f"error: onnxruntime backend: {error}", file=sys.stderr)
        return 1
    _log(f"ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
