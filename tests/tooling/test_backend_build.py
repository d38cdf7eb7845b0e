"""The onnxruntime backend build's logic: inputs, cache key, caching, failures (no compile here:
`make test` runs the real build first, and every live test serves with its result)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from tritonlocal import backend_build as B
from tritonlocal.launcher import ServerOptions, TritonServer, read_configs
from tritonlocal.runtime import LauncherError

ROOT = Path(__file__).resolve().parents[2]


def tarball(path: Path, top: str, files: dict[str, str]) -> Path:
    """A .tar.gz whose members sit under one top-level directory, as git archive and GitHub
    make them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def fake_sources(directory: Path, top=lambda repo: repo) -> Path:
    for repo in B.REPOS:
        tarball(directory / f"{repo}-{B.TAG}.tar.gz", top(repo), {"CMakeLists.txt": f"# {repo}\n"})
    return directory


@pytest.fixture
def inputs(tmp_path) -> B.Inputs:
    sources = fake_sources(tmp_path / "sources")
    header = tmp_path / "include"
    header.mkdir()
    (header / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 21\n")
    library = tmp_path / "libonnxruntime.so.1.31.1"
    library.write_bytes(b"library")
    return B.Inputs(B.find_sources(sources, tmp_path / "cache"), header,
                    B.Library(library, "1.31.1"), "libtritonserver-0.so")


def test_the_vendored_sources_are_found_by_default_and_hold_every_tree():
    if not B.DEFAULT_SOURCES.is_dir():
        pytest.skip("no ../shared/vendor beside this checkout")
    found = B.find_sources(None, Path("/nonexistent-cache"))
    assert set(found) == set(B.REPOS) and all(p.is_file() for p in found.values())


def test_a_sources_directory_without_a_tarball_names_it(tmp_path):
    sources = fake_sources(tmp_path / "sources")
    (sources / f"core-{B.TAG}.tar.gz").unlink()
    with pytest.raises(B.BuildError, match=rf"lacks .*core-{B.TAG}\.tar\.gz"):
        B.find_sources(sources, tmp_path / "cache")


def test_without_a_sources_directory_the_tarballs_are_downloaded_once(tmp_path, monkeypatch):
    # GitHub's archives have a top-level directory <repo>-r24.10/: a file:// origin stands in.
    origin = fake_sources(tmp_path / "origin", top=lambda repo: f"{repo}-{B.TAG}")
    monkeypatch.setattr(B, "DEFAULT_SOURCES", tmp_path / "absent")
    monkeypatch.setattr(B, "SOURCE_URL", f"file://{origin}/{{repo}}-{B.TAG}.tar.gz")
    found = B.find_sources(None, tmp_path / "cache")
    assert all(p.parent == tmp_path / "cache" / "downloads" for p in found.values())
    trees = B.extract_sources(found, tmp_path / "work")
    assert (trees["core"] / "CMakeLists.txt").read_text() == "# core\n"
    monkeypatch.setattr(B, "SOURCE_URL", "file:///nonexistent/{repo}.tar.gz")
    assert B.find_sources(None, tmp_path / "cache") == found  # cached: no second download


def test_an_unreachable_origin_says_how_to_build_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "DEFAULT_SOURCES", tmp_path / "absent")
    monkeypatch.setattr(B, "SOURCE_URL", "file:///nonexistent/{repo}.tar.gz")
    with pytest.raises(B.BuildError, match=r"cannot download .*TRITON_SOURCES=DIR"):
        B.find_sources(None, tmp_path / "cache")


def test_vendored_layout_extracts_to_one_tree_per_repository(inputs, tmp_path):
    trees = B.extract_sources(inputs.sources, tmp_path / "work")
    assert {repo: (tree / "CMakeLists.txt").read_text() for repo, tree in trees.items()} == {
        repo: f"# {repo}\n" for repo in B.REPOS}


def test_a_header_newer_than_the_library_is_refused(inputs, tmp_path, monkeypatch):
    (inputs.header / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 32\n")
    monkeypatch.setattr(B, "_run", lambda *a, **k: None)
    with pytest.raises(B.BuildError, match=r"API 32, newer than the library's 1\.31\.1"):
        B.build(inputs, B.describe(inputs), tmp_path / "out", jobs=1)


def test_the_vendored_debian_header_is_found_and_extracts(tmp_path):
    if not B.DEFAULT_HEADERS.is_dir():
        pytest.skip("no ../shared/vendor beside this checkout")
    deb = B.find_header(None, B.Library(Path("x"), "1.31.1"), tmp_path)
    assert deb.suffix == ".deb"
    work = tmp_path / "work"
    work.mkdir()
    include = B.extract_header(deb, work)
    assert B.header_api_version(include) <= 31


@pytest.mark.parametrize("change", ["source", "header", "library", "server", "recipe"])
def test_every_input_is_in_the_cache_key(inputs, change, monkeypatch, tmp_path):
    key = B.cache_key(B.describe(inputs))
    if change == "source":
        tarball(inputs.sources["core"], "core", {"CMakeLists.txt": "# changed\n"})
    elif change == "header":
        (inputs.header / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 20\n")
    elif change == "library":
        inputs.library.path.write_bytes(b"another build")
    elif change == "server":
        inputs = B.Inputs(inputs.sources, inputs.header, inputs.library, "libtritonserver-1.so")
    else:
        monkeypatch.setattr(B, "RECIPE", B.RECIPE + 1)
    assert B.cache_key(B.describe(inputs)) != key
    assert B.cache_key(B.describe(inputs)) == B.cache_key(B.describe(inputs))


def test_a_missing_tool_is_named_with_its_debian_package(monkeypatch):
    monkeypatch.setattr(B, "TOOLS", {**B.TOOLS, "no-such-compiler-x": "some-package"})
    monkeypatch.setattr(B, "FILES", {**B.FILES, "/nonexistent/rapidjson.h": "rapidjson-dev"})
    with pytest.raises(B.BuildError) as failure:
        B.check_system()
    assert "no-such-compiler-x (Debian package some-package)" in str(failure.value)
    assert "/nonexistent/rapidjson.h (Debian package rapidjson-dev)" in str(failure.value)
    assert "install_system_deps.sh" in str(failure.value)


def test_ensure_builds_once_per_key_points_current_at_it_and_prunes_others(inputs, tmp_path,
                                                                         monkeypatch):
    builds = []

    def fake_build(inputs_, description, target, jobs):
        builds.append(target)
        (target / "onnxruntime").mkdir()
        (target / "onnxruntime" / B.BACKEND_LIB).write_bytes(b"backend")
        (target / "build-info.json").write_text(json.dumps(description))

    monkeypatch.setattr(B, "build", fake_build)
    monkeypatch.setattr(B, "check_system", lambda: None)
    monkeypatch.setattr(B, "gather", lambda sources, headers, cache: inputs)
    cache = tmp_path / "cache"
    first = B.ensure(cache=cache)
    assert B.ensure(cache=cache) == first and len(builds) == 1
    assert B.installed(cache) is not None and B.installed(cache).resolve() == first.resolve()
    inputs.library.path.write_bytes(b"a new onnxruntime")  # a changed input: a new key
    second = B.ensure(cache=cache)
    assert second != first and len(builds) == 2
    assert not first.parent.exists(), "the build of the old key was not pruned"
    assert B.installed(cache).resolve() == second.resolve()
    assert not list(cache.glob("*.partial"))


def test_a_failed_build_leaves_no_partial_build_and_keeps_current(inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(B, "check_system", lambda: None)
    monkeypatch.setattr(B, "gather", lambda sources, headers, cache: inputs)

    def failing_build(*args):
        raise B.BuildError("the compile failed")

    monkeypatch.setattr(B, "build", failing_build)
    with pytest.raises(B.BuildError, match="the compile failed"):
        B.ensure(cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.partial"))
    assert B.installed(tmp_path / "cache") is None


def test_the_launcher_refuses_onnx_models_without_the_backend(tmp_path):
    models = read_configs([ROOT / "model_repository"])
    assert [m.name for m in models if m.backend == "onnxruntime"], "no ONNX model to check"
    empty = tmp_path / "no-backend"
    empty.mkdir()
    server = TritonServer(ServerOptions(ROOT / "model_repository", onnxruntime_backend=empty))
    with pytest.raises(LauncherError, match=r"onnxruntime backend is not built .*`make backend`"):
        server._onnxruntime_backend(models)
    # A repository with only python models needs no backend.
    assert server._onnxruntime_backend([m for m in models if m.backend == "python"]) is None


# -- the GPU build (--gpu) ----------------------------------------------------------------------
@pytest.fixture
def gpu_inputs(inputs, tmp_path) -> B.Inputs:
    """The CPU inputs plus a stand-in CUDA tree and onnxruntime-gpu's provider libraries."""
    cuda = tmp_path / "packages" / B.GPU_CUDA_ROOT
    for name in ("bin/nvcc", "nvvm/bin/cicc", "include/cuda_runtime_api.h", "lib/libcudart.so.13"):
        (cuda / name).parent.mkdir(parents=True, exist_ok=True)
        (cuda / name).write_text("")
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    providers = []
    for name in B.GPU_PROVIDERS:
        providers.append(tmp_path / "capi" / name)
        providers[-1].parent.mkdir(exist_ok=True)
        providers[-1].write_bytes(name.encode())
    return B.Inputs(inputs.sources, inputs.header, inputs.library, inputs.server_library,
                    cuda=B.cuda_toolkit(cuda.parent.parent), providers=tuple(providers))


def test_the_cpu_build_is_unchanged_by_the_gpu_build(inputs):
    # Its options and the keys of its description (hence its cache key) are what they were: a
    # CPU host keeps its cached backend.
    assert B.CMAKE_OPTIONS[1:4] == ("-DTRITON_ENABLE_GPU=OFF", "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=OFF",
                                    "-DTRITON_ENABLE_ONNXRUNTIME_OPENVINO=OFF")
    assert set(B.describe(inputs)) == {"recipe", "tag", "sources", "header", "library",
                                       "server_library", "cmake_options", "compiler", "cmake"}
    assert B.default_cache() != B.default_cache(gpu=True)


def test_the_gpu_options_switch_on_cuda_and_the_tensorrt_provider_and_nothing_else():
    cpu, gpu = set(B.CMAKE_OPTIONS), set(B.GPU_OPTIONS)
    assert gpu - cpu == {"-DTRITON_ENABLE_GPU=ON", "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=ON",
                         "-DTRITON_ENABLE_MEMORY_TRACKER=OFF"}
    assert cpu - gpu == {"-DTRITON_ENABLE_GPU=OFF", "-DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=OFF"}


def test_onnxruntime_gpu_is_the_version_of_the_cpu_pin():
    tomllib = pytest.importorskip("tomllib")
    local = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["local"]
    pin = next(r.split("==")[1].split()[0] for r in local if r.startswith("onnxruntime=="))
    assert B.gpu_build_packages()[0] == f"onnxruntime-gpu=={pin}"
    # Every package is pinned exactly, CUDA 13.0 for the toolkit (what onnxruntime-gpu needs).
    for package in (*B.GPU_BUILD_PACKAGES, *B.GPU_RUNTIME_PACKAGES):
        assert re.fullmatch(r"[a-z0-9-]+==[0-9.]+", package), package
    assert all("==13.0." in p for p in B.GPU_BUILD_PACKAGES)


def test_the_gpu_description_keys_every_gpu_input(gpu_inputs, inputs, monkeypatch):
    description = B.describe(gpu_inputs)
    assert description["cmake_options"] == list(B.GPU_OPTIONS)
    assert description["gpu"]["nvcc"] == "Cuda compilation tools, release 13.0"
    assert set(description["gpu"]["providers"]) == set(B.GPU_PROVIDERS)
    key = B.cache_key(description)
    assert key != B.cache_key(B.describe(inputs))
    gpu_inputs.providers[1].write_bytes(b"another provider")
    assert B.cache_key(B.describe(gpu_inputs)) != key
    monkeypatch.setattr(B, "GPU_BUILD_PACKAGES", (*B.GPU_BUILD_PACKAGES[:-1], "nvidia-cuda-cccl==13.0.99"))
    assert B.cache_key(B.describe(gpu_inputs)) not in (key, B.cache_key(description))


def test_cuda_13_architectures_replace_backend_r24_10s_list_after_it_is_set(tmp_path):
    arguments = B.gpu_cmake_arguments(tmp_path / "cuda", tmp_path)
    include = next(a.split("=", 1)[1] for a in arguments
                   if a.startswith("-DCMAKE_PROJECT_tritonbackend_INCLUDE="))
    text = Path(include).read_text()
    assert "cmake_language(DEFER CALL set_target_properties kernel_library_new" in text
    assert all(int(a.split("-")[0]) >= 75 for a in B.CUDA_ARCHITECTURES.split(";"))
    assert f"-DCMAKE_CUDA_COMPILER={tmp_path / 'cuda'}/bin/nvcc" in arguments
    assert f"-DCUDAToolkit_ROOT={tmp_path / 'cuda'}" in arguments
    if B.DEFAULT_SOURCES.is_dir():  # the include's name is the backend library's project name
        with tarfile.open(B.DEFAULT_SOURCES / f"backend-{B.TAG}.tar.gz") as archive:
            cmake = archive.extractfile("backend/CMakeLists.txt").read().decode()
        assert "project(tritonbackend " in cmake
        assert 'set_target_properties(kernel_library_new PROPERTIES CUDA_ARCHITECTURES' in cmake


def test_the_cuda_tree_gets_the_names_cmake_and_nvcc_look_for(gpu_inputs):
    assert (gpu_inputs.cuda / "lib" / "libcudart.so").resolve().name == "libcudart.so.13"
    assert (gpu_inputs.cuda / "lib64").resolve() == (gpu_inputs.cuda / "lib").resolve()
    assert B.cuda_toolkit(gpu_inputs.cuda.parent.parent) == gpu_inputs.cuda  # idempotent


def test_a_cuda_tree_without_nvcc_is_named(tmp_path):
    (tmp_path / B.GPU_CUDA_ROOT / "lib").mkdir(parents=True)
    with pytest.raises(B.BuildError, match=r"lack nvidia/cu13/bin/nvcc"):
        B.cuda_toolkit(tmp_path)


def test_the_gpu_build_puts_providers_and_cudart_beside_the_backend(gpu_inputs, tmp_path, monkeypatch):
    commands = []

    def fake_run(command, log, what, cwd=None, progress=False):
        commands.append(command)
        if command[:2] == ["cmake", "--build"]:
            (Path(cwd) / B.BACKEND_LIB).write_bytes(b"backend")

    monkeypatch.setattr(B, "_run", fake_run)
    monkeypatch.setattr(B, "extract_sources", lambda tarballs, work: {r: work / r for r in B.REPOS})
    B.build(gpu_inputs, B.describe(gpu_inputs), tmp_path / "out", jobs=2)
    configure = commands[0]
    assert all(option in configure for option in B.GPU_OPTIONS)
    assert "-DTRITON_ENABLE_GPU=OFF" not in configure
    backend = tmp_path / "out" / "onnxruntime"
    assert sorted(p.name for p in backend.iterdir()) == sorted(
        [B.BACKEND_LIB, "libonnxruntime.so.1", "libcudart.so.13", *B.GPU_PROVIDERS])
    assert ["patchelf", "--replace-needed", "libtritonserver.so", gpu_inputs.server_library,
            str(backend / B.BACKEND_LIB)] in commands


def test_pip_installs_each_set_of_pins_once_into_its_own_directory(tmp_path, monkeypatch):
    calls = []

    def fake_pip(command, log, what, cwd=None, progress=False):
        calls.append(command)
        target = Path(command[command.index("--target") + 1])
        (target / "nvidia").mkdir()

    monkeypatch.setattr(B, "_run", fake_pip)
    first = B.pip_install(("a==1",), tmp_path, "build")
    assert B.pip_install(("a==1",), tmp_path, "build") == first and len(calls) == 1
    assert "--no-deps" in calls[0] and calls[0][-1] == "a==1"
    assert B.pip_install(("a==2",), tmp_path, "build") != first
    assert not list((tmp_path / "packages").glob("*.partial"))


def test_a_failed_pip_install_leaves_nothing_half_installed(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise B.BuildError("pip install failed")

    monkeypatch.setattr(B, "_run", failing)
    with pytest.raises(B.BuildError):
        B.pip_install(("a==1",), tmp_path, "runtime")
    assert list((tmp_path / "packages").iterdir()) == []
    assert B.gpu_runtime_library_dirs(tmp_path) == []


def test_runtime_without_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        B.main(["--runtime"])
    assert "--runtime goes with --gpu" in capsys.readouterr().err
