#!/usr/bin/env bash
# The test suite inside the container (`make test-container`), against the container's own
# tritonserver: the deployment profile ($BLS_PROFILE, as container-serve.sh prepares it) plus the
# test-only models (fault stand-ins, orchestrator and benchmark variants) in a second repository.
# Tests that need the local launcher, a loopback-only bind or perf_analyzer skip themselves.
# Arguments go to pytest, e.g. `make test-container PYTEST_ARGS="-k orchestrator"`.
set -euo pipefail

home="${BLS_HOME:-/opt/bls}"
cd "$home"
work="$(mktemp -d /tmp/bls-test-XXXXXX)"
fault="$work/fault_repository"
repo="$("$home/scripts/container-serve.sh" --print-repository)"

python3 - "$repo" "$fault" <<'PY'
import sys
from pathlib import Path

from bench.repository import build_test_repository

real, target = Path(sys.argv[1]), Path(sys.argv[2])
target.mkdir(parents=True)
build_test_repository(target, real)
PY

# The admin APIs restricted as container-serve.sh restricts them, to a credential of this run's
# (no test here calls them: the tests of who may call what run on the launcher's servers).
flags_out="$(TRITONLOCAL_ADMIN_HEADER="$(python3 -m tritonlocal.flags --new-credential "$work/admin.header")" \
             python3 -m tritonlocal.flags --model-repository "$repo")"
mapfile -t flags <<<"$flags_out"
unset flags_out
# Its own session (process group = its pid): the memory tests find its stubs by group. Without
# an admin header in its environment, which its stubs would inherit.
env -u TRITONLOCAL_ADMIN_HEADER \
  setsid tritonserver "${flags[@]}" --model-repository="$fault" >"$work/tritonserver.log" 2>&1 &
server=$!
cleanup() { kill -INT "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap cleanup EXIT

for _ in $(seq 1 600); do
  if ! kill -0 "$server" 2>/dev/null; then
    echo "tritonserver exited before it was ready:" >&2; tail -50 "$work/tritonserver.log" >&2; exit 1
  fi
  if python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2).status != 200)" 2>/dev/null; then
    break
  fi
  sleep 1
done

export BLS_MODEL_REPOSITORY="$repo"
export TRITON_EXTERNAL_SERVER="http=127.0.0.1:8000,grpc=127.0.0.1:8001,metrics=127.0.0.1:8002,pid=$server"
export TRITON_EXTERNAL_FAULT_REPOSITORY="$fault"
python3 -m pytest -p no:cacheprovider "$@"
