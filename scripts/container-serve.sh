#!/usr/bin/env bash
# The container's entry point: render the deployment profile, build TensorRT engines if the
# profile has any (cached in $BLS_CACHE, a volume), then exec tritonserver with the flags every
# server of this repository uses (python3 -m tritonlocal.flags). Extra arguments go to
# tritonserver, e.g. `docker run ... IMAGE --log-verbose=1`.
#
#   BLS_PROFILE=portable   the committed repository as is (KIND_AUTO: one group per GPU)
#   BLS_PROFILE=gpu        KIND_GPU counts per model, ONNX Runtime on CUDA (the default)
#   BLS_PROFILE=gpu-ort-trt  + ONNX Runtime's TensorRT accelerator (FP16, engines cached)
#   BLS_PROFILE=gpu-trt    + native TensorRT engines for the CNN stages, built here on first start
#   BLS_DRY_RUN=1          render and check everything, print the tritonserver command (the
#                          header's value redacted), exit
#   BLS_RUN_DIR=DIR        where this container renders its repository (default $TMPDIR or /tmp)
#   BLS_RELOAD=1           run the reload watcher beside the server (the default; 0: none)
#   TRITONLOCAL_ADMIN_HEADER=NAME=VALUE  the admin credential (at least 32 characters of value;
#                          on Kubernetes, from a Secret). Without it, one is made here and
#                          written to $BLS_ADMIN_FILE (default $BLS_RUN_DIR/triton-admin.header,
#                          mode 0600): `docker exec ... cat` it, or `curl -H @FILE` inside.
#   TRITONLOCAL_OPEN_APIS=API,...  admin APIs open to every client (model-repository,
#                          shared-memory, logging, trace); a warning line each
#
# Every admin API (model repository, shared memory, logging, trace) answers only the admin
# credential, over HTTP and gRPC. The server loads every model at start in explicit model control
# mode. Beside it runs `python3 -m tritonlocal.reload`: when a python-backend stub dies (Triton
# never restarts one) it reloads that model alone through the repository API, and the probes
# (python3 -m tritonlocal.liveness [--ready]) read what it is doing (docs/operations.md).
# tritonserver gets the credential on its argv, the only place r24.10 takes it (readable in
# /proc/<pid>/cmdline: docs/operations.md, "Who may call the admin APIs"), and the watcher in its
# own environment; it is never in tritonserver's environment, which every python-backend stub
# inherits, and never printed.
#
# Each start renders the profile into a directory of its own (repository-<profile>.XXXXXX under
# $BLS_RUN_DIR): $BLS_CACHE may be a volume several containers share (engines are worth sharing),
# and a rendering there would be deleted and rewritten under another container's server.
#
# `container-serve.sh --print-repository` prepares the profile and prints its repository's path
# instead of serving (scripts/container-test.sh serves it with the test-only models beside it).
set -euo pipefail

home="${BLS_HOME:-/opt/bls}"
cache="${BLS_CACHE:-/var/cache/bls}"
profile="${BLS_PROFILE:-gpu}"
source_repo="${BLS_MODEL_REPOSITORY:-$home/model_repository}"
dry_run="${BLS_DRY_RUN:-0}"
run_dir="${BLS_RUN_DIR:-${TMPDIR:-/tmp}}"
# The admin credential, taken out of this shell's environment before anything is started:
# tritonserver would inherit it, and every python-backend stub (any model's code) from it. Only
# the two processes that need it get it, each in its own environment: the flags printer and the
# watcher.
admin_header="${TRITONLOCAL_ADMIN_HEADER:-}"
unset TRITONLOCAL_ADMIN_HEADER
admin_file="${BLS_ADMIN_FILE:-$run_dir/triton-admin.header}"

case "$profile" in
  portable)
    repo="$source_repo" ;;
  gpu|gpu-ort-trt|gpu-trt)
    mkdir -p "$run_dir"
    repo="$(mktemp -d "$run_dir/repository-$profile.XXXXXX")"
    python3 -m modelgen.profiles --profile "$profile" --source "$source_repo" --out "$repo" --cache "$cache" >&2
    if [ "$profile" = gpu-trt ]; then
      if [ "$dry_run" = 1 ]; then
        python3 "$home/scripts/build_trt_engines.py" --repository "$repo" --cache "$cache/engines" --dry-run >&2
      else
        python3 "$home/scripts/build_trt_engines.py" --repository "$repo" --cache "$cache/engines" >&2
      fi
    fi ;;
  *)
    echo "error: BLS_PROFILE must be portable, gpu, gpu-ort-trt or gpu-trt (got '$profile')" >&2
    exit 2 ;;
esac

if [ "${1:-}" = --print-repository ]; then
  echo "$repo"
  exit 0
fi
if [ -z "$admin_header" ]; then
  # Printed to stdout only for this shell to capture; the file is its user's alone.
  admin_header="$(python3 -m tritonlocal.flags --new-credential "$admin_file")"
  echo "admin credential: generated, in $admin_file (readable by uid $(id -u) only)" >&2
fi
# The flags printer refuses a malformed or short credential (exit 2, one line why), which ends
# this script here: set -e does not see a process substitution's status, so it is checked.
flags_out="$(TRITONLOCAL_ADMIN_HEADER="$admin_header" python3 -m tritonlocal.flags --model-repository "$repo")"
mapfile -t flags <<<"$flags_out"
unset flags_out
watcher=(python3 -m tritonlocal.reload --url localhost:8000)
if [ "$dry_run" = 1 ]; then
  if [ "${BLS_RELOAD:-1}" = 1 ]; then echo "beside it: ${watcher[*]}" >&2; fi
  # Printed, so without the header's value (CI logs, terminals).
  printf '%s\0' tritonserver "${flags[@]}" "$@" | python3 -m tritonlocal.flags --redact-command
  exit 0
fi
if [ "${BLS_RELOAD:-1}" = 1 ]; then
  # Started before exec, so it outlives this shell; it waits for the server and follows it.
  TRITONLOCAL_ADMIN_HEADER="$admin_header" "${watcher[@]}" &
fi
exec tritonserver "${flags[@]}" "$@"
