"""Find the tritonserver bundled in the ``nvidia-pytriton`` wheel and check it can run here.

The wheel carries a real Triton Inference Server 2.51.0 (the release of the NGC container
``nvcr.io/nvidia/tritonserver:24.10-py3``), its python backend and one stub per Python minor
version. Each check here turns a failure that would otherwise surface as an obscure stub crash
into one clear sentence that says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tritonlocal import flags

TRITON_VERSION = "2.51.0"  # what nvidia-pytriton 0.7.0 bundles; NGC 24.10 runs the same


class LauncherError(RuntimeError):
    """A problem the user can fix; the message says how."""


@dataclass(frozen=True)
class Installation:
    server: Path          # the tritonserver binary
    python_backend: Path  # libtriton_python.so + triton_python_backend_utils.py
    stubs: Path           # python_backend_stubs/3.X/triton_python_backend_stub
    libs: Path            # nvidia_pytriton.libs: shared libraries the copied stub needs

    def stub(self, python_version: str) -> Path:
        path = self.stubs / python_version / "triton_python_backend_stub"
        if not path.exists():
            available = sorted(p.name for p in self.stubs.iterdir() if p.is_dir())
            raise LauncherError(
                f"the bundled python backend has no stub for Python {python_version} "
                f"(it has {', '.join(available)}); create the venv with one of those")
        return path


def find_installation() -> Installation:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LauncherError(
            "nvidia-pytriton is not installed in this environment (it bundles tritonserver "
            f"{TRITON_VERSION}); run `make venv` or `pip install -e '.[local]'`")
    package = Path(list(spec.submodule_search_locations)[0])
    root = package / "tritonserver"
    install = Installation(
        server=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stubs=root / "python_backend_stubs",
        libs=package.parent / "nvidia_pytriton.libs",
    )
    for path in (install.server, install.python_backend, install.stubs, install.libs):
        if not path.exists():
            raise LauncherError(f"the nvidia-pytriton installation is incomplete: {path} is missing")
    return install


def python_version_of(python: str) -> tuple[str, str]:
    """(``3.X`` minor version, numpy version or '') of the interpreter the stub will use."""
    code = ("import sys\ntry:\n import numpy; v = numpy.__version__\nexcept ImportError:\n v = ''\n"
            "print('%d.%d' % sys.version_info[:2], v)")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                             check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as error:
        raise LauncherError(f"cannot run the server's Python {python}: {error}") from error
    return out[0], (out[1] if len(out) > 1 else "")


def check_numpy(python: str, numpy_version: str) -> None:
    """The r24.10 stub is built against pybind11 2.10: numpy 2 breaks every python-backend output."""
    if not numpy_version:
        raise LauncherError(f"numpy is not installed for {python}, which the python backend uses")
    if int(numpy_version.split(".")[0]) >= 2:
        raise LauncherError(
            f"numpy {numpy_version} is installed for {python}, but the python backend of Triton "
            f"{TRITON_VERSION} needs numpy < 2 (with numpy 2 every output fails with 'output "
            "tensor shape does not match size of output'); install numpy==1.26.4")


def check_stub_libraries(stub: Path, env: dict[str, str]) -> None:
    """Fail early, naming the Debian package, when the stub cannot find a shared library."""
    try:
        out = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, env=env,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return  # no ldd: the server's own error will have to do
    missing = re.findall(r"^\s*(\S+) => not found", out, flags=re.MULTILINE)
    if not missing:
        return
    hints = []
    for lib in missing:
        match = re.match(r"libpython(\d+\.\d+)\.so", lib)
        if match:
            hints.append(f"{lib} (Debian package libpython{match.group(1)}: "
                         f"`apt-get install libpython{match.group(1)}`)")
        else:
            hints.append(lib)
    raise LauncherError(f"the python backend stub {stub} cannot find: {', '.join(hints)}")


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    for role, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as error:
                variable = f"{role.upper()}_PORT"
                raise LauncherError(
                    f"{role} port {port} on {host} is already in use ({error.strerror}); stop "
                    f"what holds it or choose another port, e.g. `make serve {variable}=...`"
                ) from None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports that are free right now (for tests and parallel servers)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def server_environment(install: Installation, python: str) -> dict[str, str]:
    """The server's environment: the stub finds its packages through the first ``python3`` on PATH
    (PYTHONPATH is ignored), and the copied stub needs the wheel's libraries on LD_LIBRARY_PATH.
    Without ``flags.SECRET_VARIABLES``: every python-backend stub (any model's code) inherits it."""
    env = {name: value for name, value in os.environ.items()
           if name not in flags.SECRET_VARIABLES}
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    return env


def default_python() -> str:
    return sys.executable
