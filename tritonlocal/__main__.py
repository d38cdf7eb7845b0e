"""``python -m tritonlocal serve``: serve a model repository in the foreground (``make serve``).

``--profile`` chooses what is served: ``portable`` (the default: the committed repository, on CPU
here) or a GPU profile rendered by ``modelgen.profiles`` (``gpu``, ``gpu-ort-trt``; ``make serve
BLS_PROFILE=gpu``), which needs an NVIDIA GPU and driver (``tritonlocal.gpu``; a host without
one gets one line saying so, exit 2) and the GPU build of the onnxruntime backend.

A model of the project's repository whose file is still to be made (``make serve`` defers
``digits_large``, trained on first use) is served later, with the models that need it: the
others answer at once, its progress is printed, and each is loaded when made
(``tritonlocal.deferred``).

Ctrl-C (SIGINT) or SIGTERM stops the server cleanly: SIGINT to tritonserver, a grace period,
then SIGKILL for anything left of its process group, stubs included.

A supervisor checks the server every ``--check-interval`` seconds: when a python-backend stub
dies it reloads that model alone while the others keep serving (``tritonlocal.reload``), and it
restarts the whole server if it exits or stops answering (``tritonlocal.liveness``);
``--no-supervise`` turns that off (the server's exit then ends the command with status 1).

Every admin API (model repository, shared memory, logging, trace) answers only the admin
credential: ``--admin-header`` (``$TRITONLOCAL_ADMIN_HEADER``) or, without one, a random one
written to ``--credential-file`` (mode 0600; ``curl -H @FILE`` sends it), which the banner names.
``--open-api API`` opens one to every client, with a warning line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from modelgen.export import is_project_repository, stamped_size
from tritonlocal import backend_build, deferred, flags, gpu
from tritonlocal.launcher import (
    RESTRICTED_APIS,
    ServerOptions,
    Supervisor,
    TritonServer,
    profile_repository,
    tail_to,
)
from tritonlocal.runtime import LauncherError

EXAMPLE_MODEL = "pipeline"
RUN_DIR = Path(".triton") / "run"      # rendered GPU-profile repositories (removed at exit)
ENGINE_CACHE = Path(".triton") / "cache"  # ONNX Runtime's TensorRT engines (gpu-ort-trt)


def example_request(server: TritonServer) -> str:
    """A request to paste into a shell: a grey image through the BLS `pipeline`, over HTTP/JSON."""
    body = ("import json; print(json.dumps({'inputs': [{'name': 'IMAGE', 'shape': [1, 224, 224, 3],"
            " 'datatype': 'UINT8', 'data': [128] * 150528}], 'outputs': [{'name': 'CLASS_IDS'},"
            " {'name': 'CLASS_PROBS'}]}))")
    return (f'python3 -c "{body}" \\\n'
            f"  | curl -s -X POST http://{server.http_url}/v2/models/{EXAMPLE_MODEL}/infer \\\n"
            "      -H 'Content-Type: application/json' --data-binary @-; echo")


def banner(server: TritonServer) -> str:
    return "\n".join([
        "",
        f"tritonserver {server.metadata().get('version', '?')} is ready "
        f"(repository: {server.options.model_repository})",
        f"  HTTP     http://{server.http_url}    (health: /v2/health/ready, a model: "
        f"/v2/models/{EXAMPLE_MODEL})",
        f"  gRPC     {server.grpc_url}",
        f"  metrics  {server.metrics_url}",
        f"  log      {server.log_file}",
        f"  admin    {admin_line(server)}",
        f"  ONNX     {backend_build.summary(server.onnxruntime_backend)}"
        if server.onnxruntime_backend else "  ONNX     (no ONNX model in the repository)",
        "",
        "Example request (paste into another shell):",
        example_request(server),
        "",
        "Press Ctrl-C to stop.",
        "",
    ])


def admin_line(server: TritonServer) -> str:
    """Where the admin credential is, and what it opens (never the credential itself)."""
    closed = [api for api in RESTRICTED_APIS if api not in server.options.open_apis]
    where = (f"header in {server.credential_file} (curl -H @{server.credential_file} ...)"
             if server.credential_file else "your --admin-header")
    if not closed:
        return "every admin API is open (--open-api)"
    return f"{', '.join(closed)} APIs: {where}"


def admin_header(spec: str | None) -> tuple[str, str] | None:
    """``NAME=VALUE`` -> (name, value); checked by the launcher."""
    if not spec:
        return None
    name, sep, value = spec.partition("=")
    if not sep:
        raise SystemExit("error: --admin-header / TRITONLOCAL_ADMIN_HEADER must be NAME=VALUE")
    return name, value


def later(repository: Path) -> tuple[list[str], list[str]]:
    """For the project's own repository, the models whose files are still to be made (``make
    serve`` defers the trained ``digits_large``) and the models that need them: served once made
    (tritonlocal.deferred). A repository the user gave is served as it is."""
    return deferred.pending(repository) if is_project_repository(repository) else ([], [])


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(args: argparse.Namespace) -> int:
    try:
        host = gpu.require(args.profile)
    except gpu.NoGpu as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if host is not None:
        print(f"profile {args.profile} on {host.describe()}", flush=True)
    try:
        repository = profile_repository(args.profile, Path(args.model_repository), RUN_DIR,
                                        ENGINE_CACHE.resolve())
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        return _serve(args, repository, on_gpu=host is not None)
    finally:
        if repository != Path(args.model_repository):
            shutil.rmtree(repository, ignore_errors=True)


def _serve(args: argparse.Namespace, repository: Path, on_gpu: bool) -> int:
    try:
        open_apis = flags.parse_open_apis(args.open_api)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in flags.open_api_warnings(open_apis):
        print(line, flush=True)
    options = ServerOptions(
        model_repository=repository, host=args.host, gpu=on_gpu,
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        log_file=Path(args.log_file or f".triton/tritonserver-{args.http_port}.log"),
        ready_timeout=args.ready_timeout, log_verbose=args.log_verbose,
        admin_header=admin_header(args.admin_header),
        credential_file=Path(args.credential_file or f".triton/admin-{args.http_port}.header"),
        open_apis=open_apis,
        extra_args=args.tritonserver_args,
    )
    missing, after = later(repository)
    options.deferred = frozenset(missing + after)
    server = TritonServer(options)
    stop = threading.Event()
    # SIGTERM (e.g. from a process manager) takes the same clean path as Ctrl-C. SIGINT gets its
    # handler explicitly: a process started in the background by a non-interactive shell
    # (`make serve &`, nohup, some CI wrappers) inherits SIGINT as ignored, and Python then
    # installs no KeyboardInterrupt handler, so Ctrl-C or `kill -INT` would do nothing.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        print(f"starting tritonserver on {args.host} (HTTP {args.http_port}, gRPC "
              f"{args.grpc_port}, metrics {args.metrics_port}) ...", flush=True)
        server.start()
        if not args.quiet:
            tail_to(sys.stdout, server.log_file, stop)
        print(banner(server), flush=True)
        if missing:
            deferred.make_later(server, missing, after, stamped_size(repository),
                                log=lambda line: print(line, flush=True), stop=stop)
        if args.supervise:
            supervisor = Supervisor(server, interval=args.check_interval,
                                    log=lambda line: print(line, flush=True))
            supervisor.run(stop)  # returns only on Ctrl-C/SIGTERM, raises on a crash loop
            return 0
        while server.is_running():
            stop.wait(1.0)
        print(f"tritonserver exited unexpectedly; log {server.log_file}:\n{server.log_tail()}",
              file=sys.stderr)
        return 1
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopping tritonserver ...", flush=True)
        return 0
    finally:
        stop.set()
        code = server.stop()
        if code is not None:
            print(f"tritonserver stopped (exit code {code})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonlocal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a model repository in the foreground")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--profile", default="portable", choices=("portable", "gpu", "gpu-ort-trt", "gpu-trt"),
                   help="portable (default: the repository as committed, CPU here) or a GPU "
                        "profile rendered from it (needs a GPU host; gpu-trt: container only)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind all endpoints to (default 127.0.0.1: local only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", help="server log (default: .triton/tritonserver-<http-port>.log)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--quiet", action="store_true", help="do not echo the server log")
    p.add_argument("--admin-header", default=os.environ.get("TRITONLOCAL_ADMIN_HEADER"),
                   metavar="NAME=VALUE",
                   help="the admin credential: the model-repository, shared-memory, logging and "
                   "trace APIs answer only requests with this header (default: "
                   "$TRITONLOCAL_ADMIN_HEADER, else a random one written to --credential-file; "
                   "the value is visible in the server's command line to local users)")
    p.add_argument("--credential-file", metavar="FILE",
                   help="where a generated credential is written, mode 0600, removed at exit "
                        "(default: .triton/admin-<http-port>.header)")
    p.add_argument("--open-api", action="append", metavar="API", choices=RESTRICTED_APIS,
                   default=[a for a in os.environ.get(flags.OPEN_APIS_VARIABLE, "").split(",")
                            if a.strip()],
                   help="open one admin API to every client, without the credential (repeat "
                        f"for more; default ${flags.OPEN_APIS_VARIABLE}, comma-separated); "
                        "each prints a warning")
    p.add_argument("--no-supervise", dest="supervise", action="store_false",
                   help="do not reload a model whose python stub died, nor restart the server "
                        "when it exits")
    p.add_argument("--check-interval", type=float, default=0.5,
                   help="seconds between the supervisor's liveness checks (default 0.5)")
    p.add_argument("tritonserver_args", nargs="*",
                   help="extra tritonserver flags, after `--` (e.g. -- --log-verbose=1)")
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
