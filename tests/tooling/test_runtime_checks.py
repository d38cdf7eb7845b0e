"""The launcher's preflight checks give one clear sentence for each common failure."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from tritonlocal import runtime
from tritonlocal.runtime import LauncherError


def fake_python(tmp_path, numpy_version: str):
    script = tmp_path / "python3"
    script.write_text(f"#!/bin/sh\necho 3.11 {numpy_version}\n")
    script.chmod(0o755)
    return str(script)


def test_numpy_2_is_refused_with_the_fix(tmp_path):
    python = fake_python(tmp_path, "2.1.3")
    version, numpy_version = runtime.python_version_of(python)
    assert (version, numpy_version) == ("3.11", "2.1.3")
    with pytest.raises(LauncherError, match=r"numpy 2\.1\.3.*numpy < 2.*numpy==1\.26\.4"):
        runtime.check_numpy(python, numpy_version)


def test_numpy_1_is_accepted_and_missing_numpy_is_refused(tmp_path):
    runtime.check_numpy("python3", "1.26.4")
    with pytest.raises(LauncherError, match="numpy is not installed"):
        runtime.check_numpy("python3", "")


def test_the_real_environment_passes_the_checks():
    install = runtime.find_installation()
    version, numpy_version = runtime.python_version_of(runtime.default_python())
    runtime.check_numpy(runtime.default_python(), numpy_version)
    stub = install.stub(version)
    runtime.check_stub_libraries(stub, runtime.server_environment(install, runtime.default_python()))


def test_a_missing_libpython_names_the_debian_package(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("needs a C compiler to build a binary that links a missing libpython")
    (tmp_path / "lib.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "main.c").write_text("int f(void); int main(void) { return f(); }\n")
    lib = tmp_path / "libpython3.99.so.1.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "lib.c"),
                    "-Wl,-soname,libpython3.99.so.1.0"], check=True)
    binary = tmp_path / "stub"
    subprocess.run(["cc", "-o", str(binary), str(tmp_path / "main.c"), str(lib)], check=True)
    lib.unlink()
    with pytest.raises(LauncherError, match=r"libpython3\.99\.so\.1\.0.*apt-get install libpython3\.99"):
        runtime.check_stub_libraries(binary, {"PATH": "/usr/bin:/bin"})


def test_a_port_in_use_is_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(LauncherError,
                           match=rf"grpc port {port} on 127\.0\.0\.1 is already in use.*GRPC_PORT"):
            runtime.check_ports_free("127.0.0.1", {"http": runtime.free_ports(1)[0], "grpc": port})


def test_free_ports_are_distinct():
    ports = runtime.free_ports(3)
    assert len(set(ports)) == 3


def test_server_environment_puts_the_venv_first_and_drops_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    install = runtime.find_installation()
    env = runtime.server_environment(install, "/opt/venv/bin/python")
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(install.libs)
    assert "PYTHONPATH" not in env
