"""The onnxruntime backend build's logic: inputs, cache key, caching, failures (no compile here:
`make test` runs the real build first, and every live test serves with its result)."""

from __future__ import annotations

import io
import json
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
