"""Local runtime: run this repository on the tritonserver 2.51 bundled in the nvidia-pytriton wheel.

The launcher is imported on first use, so ``python -m tritonlocal.liveness`` and
``python -m tritonlocal.flags`` (which the container runs) load only what they need.
"""

__all__ = ["LauncherError", "ServerOptions", "TritonServer", "on_free_ports"]


def __getattr__(name: str):
    if name in ("ServerOptions", "TritonServer", "on_free_ports"):
        from tritonlocal import launcher

        return getattr(launcher, name)
    if name == "LauncherError":
        from tritonlocal.runtime import LauncherError

        return LauncherError
    raise AttributeError(f"module 'tritonlocal' has no attribute {name!r}")
