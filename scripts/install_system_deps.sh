#!/usr/bin/env bash
# Install the Debian packages the local runtime needs, only when they are missing:
#   libpython3.X   - the python backend stub links the shared libpython of the server's Python
#   libb64-0d      - perf_analyzer (also checked by install_perf_analyzer.py)
#   cmake g++ make rapidjson-dev googletest patchelf
#                  - build Triton's onnxruntime backend (tritonlocal/backend_build.py): CMake and
#                    the compiler, RapidJSON for Triton's common library, googletest because
#                    common r24.10 always configures its tests, patchelf to point the backend at
#                    the wheel's renamed libtritonserver
# Usage: scripts/install_system_deps.sh [python]
set -euo pipefail
python="${1:-python3}"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

missing=()
ldconfig -p | grep -q "libpython${version}.so.1.0" || missing+=("libpython${version}")
ldconfig -p | grep -q "libb64.so.0d" || missing+=("libb64-0d")
for package in cmake g++ make rapidjson-dev googletest patchelf; do
  installed "$package" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "error: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "installing Debian packages: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
