"""Local runtime: run this repository on the tritonserver 2.51 bundled in the nvidia-pytriton wheel."""

from tritonlocal.launcher import ServerOptions, TritonServer
from tritonlocal.runtime import LauncherError

__all__ = ["LauncherError", "ServerOptions", "TritonServer"]
