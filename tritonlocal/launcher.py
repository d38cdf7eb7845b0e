"""Start, watch and stop a local tritonserver: the one launcher ``make serve`` and the tests use.

``TritonServer`` checks everything that commonly goes wrong before starting (ports, the stub's
shared libraries, numpy < 2), assembles a backend directory (the wheel's python backend with the
stub for the server's Python, and Triton's C++ onnxruntime backend as built by
``tritonlocal.backend_build``), starts the server bound to
127.0.0.1, waits for ``/v2/health/ready`` and stops it with SIGINT, a grace period, then SIGKILL
for its whole process group — the server and every python-backend stub it started. A server
that dies before ready of r24.10's transient IPC-lock abort is started once more. The server
is started with ``PR_SET_PDEATHSIG`` so it dies when the launcher does; its stubs normally exit
when the server is gone, and a launcher start kills any that did not (``kill_orphaned_stubs``)
and removes the shared-memory regions of dead launchers.

``Supervisor`` keeps a server serving: when a python-backend stub dies (this Triton build never
restarts one, and keeps reporting ready: ``tritonlocal.liveness``) it reloads that model alone
through the repository API (``tritonlocal.reload``), while the other models keep serving; it
restarts the whole server only when the server exits, stops answering, or a reload fails.

The server runs in explicit model control mode with every model loaded at start. Every admin API
(model repository, shared memory, logging, trace) answers only the admin credential, unless
``ServerOptions.open_apis`` opens it: the operator's header (``ServerOptions.admin_header``) or,
without one, a random one made for each ``TritonServer`` and written to a file only its user can
read (``TritonServer.credential_file``). It reaches tritonserver on its argv alone (r24.10 takes
it nowhere else; ``tritonlocal.flags``): never in its environment, which its stubs inherit, and
redacted wherever the launcher logs or prints the command line or the log's tail.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tritonlocal import backend_build, drain, flags, liveness, procs, reload, runtime
from tritonlocal.runtime import LauncherError

SHM = Path("/dev/shm")
SHM_PREFIX = "tritonlocal_"  # + launcher pid + "_" + run id + "_" + Triton's UUID
RESTRICTED_APIS = flags.RESTRICTED_APIS  # what the admin credential opens (tritonlocal.flags)
CREDENTIAL_FILE = "admin.header"  # a generated credential's file, in the run directory by default
_PR_SET_PDEATHSIG = 1
# Aborts of r24.10 at start that a second start does not repeat: the python backend's IPC lock
# throws while many stubs start on a loaded host (std::terminate, SIGABRT, 0.7 s into loading
# here; reported upstream at start, triton-inference-server/tensorrtllm_backend#354, and under
# load, server#8882). A server that dies this way before ready is started once more
# (START_ATTEMPTS in all); any other exit fails the start at once.
TRANSIENT_START_ABORTS = ("boost::interprocess::lock_exception",)
START_ATTEMPTS = 2
# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Servers
# are therefore spawned from this one long-lived thread: a server started from a short-lived
# thread (a supervisor restarting it from its own thread) would be SIGKILLed when that thread
# ended, while the launcher lives on. The thread ends with the interpreter, and the servers then.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonlocal-spawn")


@dataclass
class ServerOptions:
    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path | None = None       # default: a file in the run directory, kept after stop
    ready_timeout: float = 180.0       # seconds to wait for /v2/health/ready
    stop_grace: float = 20.0           # seconds between SIGINT and SIGKILL
    python: str = field(default_factory=runtime.default_python)
    log_verbose: int = 0
    # The python backend's region per stub, its growth step and server-side thread pool: the
    # values the container uses too (tritonlocal/flags.py says why).
    shm_default_bytes: int = flags.SHM_DEFAULT_BYTES
    shm_growth_bytes: int = flags.SHM_GROWTH_BYTES
    python_thread_pool: int = flags.PYTHON_THREAD_POOL
    # (header name, value): the RESTRICTED_APIS answer only requests that carry this header, over
    # HTTP and gRPC (Triton's --http-restricted-api / --grpc-restricted-protocol). None: a random
    # one (flags.new_credential), written to ``credential_file``. Left out of repr: options get
    # printed.
    admin_header: tuple[str, str] | None = field(default=None, repr=False)
    # Where a generated credential is written (mode 0600, removed at stop); None: the run
    # directory (a private temporary directory).
    credential_file: Path | None = None
    # RESTRICTED_APIS opened to every client, each an operator's explicit choice (a warning line
    # at start: flags.open_api_warnings).
    open_apis: tuple[str, ...] = ()
    extra_args: list[str] = field(default_factory=list)
    # Triton's onnxruntime backend (libtriton_onnxruntime.so and its libonnxruntime.so.1), as
    # `make backend` builds it; None: the last build in the cache (backend_build.installed()).
    onnxruntime_backend: Path | None = None
    # Serve on GPUs (a GPU profile, `make serve BLS_PROFILE=gpu`): the GPU build of the backend
    # (`make backend-gpu`) with its CUDA libraries on LD_LIBRARY_PATH, GPU metrics, pinned memory
    # and the container's CUDA memory pools. False: the CPU server, as always.
    gpu: bool = False
    # More backends for the backend directory, name -> a directory holding one (e.g. Triton's
    # tensorrt backend for gpu-trt, which the wheel does not ship): copied in like onnxruntime.
    extra_backends: dict[str, Path] = field(default_factory=dict)
    # Models not loaded at start, their files still being made (tritonlocal.deferred); every
    # other model of model_repository is. Empty: all of them (``--load-model=*``).
    deferred: frozenset[str] = frozenset()


def on_free_ports(repository: Path, log_file: Path | None = None, **options) -> ServerOptions:
    """Options for one more server (tests, benchmarks, soak): ``repository`` on three ports that
    are free right now, its log in ``log_file``."""
    http, grpc, metrics = runtime.free_ports(3)
    return ServerOptions(Path(repository), http_port=http, grpc_port=grpc, metrics_port=metrics,
                         log_file=log_file, **options)


def restriction_args(credential: tuple[str, str], open_apis: tuple[str, ...] = ()) -> list[str]:
    """tritonserver flags that restrict RESTRICTED_APIS but ``open_apis`` to requests carrying
    ``credential`` (tritonlocal.flags.admin_restrictions)."""
    try:
        flags.check_header(credential)
        return flags.admin_restrictions(credential, flags.parse_open_apis(list(open_apis)))
    except ValueError as error:
        raise LauncherError(str(error)) from None


def gpu_library_path(ld_library_path: str) -> str:
    """``ld_library_path`` with the CUDA, cuDNN and TensorRT libraries ONNX Runtime's GPU providers
    load (installed by `make backend-gpu GPU_RUNTIME=1`) in front."""
    dirs = backend_build.gpu_runtime_library_dirs()
    if not dirs:
        raise LauncherError("the GPU runtime libraries (CUDA 13, cuDNN, TensorRT from PyPI) are "
                            "not installed; run `make backend-gpu GPU_RUNTIME=1` (python -m "
                            "tritonlocal.backend_build --gpu --runtime), which `make serve "
                            "BLS_PROFILE=gpu` runs")
    return os.pathsep.join([*map(str, dirs), *filter(None, [ld_library_path])])


def profile_repository(profile: str, source: Path, run_dir: Path, cache: Path) -> Path:
    """What serves ``profile``: ``source`` itself for ``portable``; for a GPU profile, a rendering
    by ``modelgen.profiles`` into a directory of its own under ``run_dir`` (as the container's
    entry script does), its engine caches under ``cache``."""
    if profile == "portable":
        return Path(source)
    from modelgen import profiles

    run_dir.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f"repository-{profile}.", dir=run_dir))
    problems = profiles.write(profile, Path(source), target, str(cache))
    if problems:
        raise LauncherError(f"profile {profile}: " + "; ".join(problems))
    return target


class TritonServer:
    """A tritonserver child process. Use as a context manager, or call start()/stop()."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.process: subprocess.Popen | None = None
        self._run_dir: Path | None = None
        self._shm_prefix = ""
        self.log_file: Path | None = None
        self.onnxruntime_backend: Path | None = None  # the build this server loaded, if any
        self._expected: tuple[int, dict[str, list[str]]] | None = None  # (server pid, instances)
        # The admin credential: the operator's, else one made here, kept across restarts.
        self.credential = options.admin_header or flags.new_credential()
        self.credential_file: Path | None = None  # where a generated credential was written

    # -- URLs -----------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        opts = self.options
        repository = Path(opts.model_repository).resolve()
        if not repository.is_dir():
            raise LauncherError(f"model repository {repository} does not exist")
        if opts.admin_header is not None:
            try:
                flags.check_credential(opts.admin_header)
            except ValueError as error:
                raise LauncherError(str(error)) from None
        restrictions = restriction_args(self.credential, opts.open_apis)
        install = runtime.find_installation()
        env = runtime.server_environment(install, opts.python)
        if opts.gpu:
            env["LD_LIBRARY_PATH"] = gpu_library_path(env["LD_LIBRARY_PATH"])
        python_version, numpy_version = runtime.python_version_of(opts.python)
        runtime.check_numpy(opts.python, numpy_version)
        stub = install.stub(python_version)
        runtime.check_stub_libraries(stub, env)
        runtime.check_ports_free(opts.host, {"http": opts.http_port, "grpc": opts.grpc_port,
                                             "metrics": opts.metrics_port})
        repositories = [repository, *(Path(a.split("=", 1)[1]) for a in opts.extra_args
                                      if a.startswith("--model-repository="))]
        models = read_configs(repositories)
        check_shm_space(stub_instances(models), opts.shm_default_bytes)
        onnxruntime = self.onnxruntime_backend = self._onnxruntime_backend(models)

        self._run_dir = Path(tempfile.mkdtemp(prefix="tritonlocal-"))
        kill_orphaned_stubs()
        remove_stale_regions()
        self._shm_prefix = f"{SHM_PREFIX}{os.getpid()}_{self._run_dir.name.removeprefix('tritonlocal-')}_"
        backends = self._assemble_backends(install, stub, onnxruntime,
                                           self._run_dir / "backends")
        self.log_file = Path(opts.log_file) if opts.log_file else self._run_dir / "tritonserver.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        command = self.command(install.server, repository, backends, restrictions)
        try:
            if opts.admin_header is None:
                path = opts.credential_file or self._run_dir / CREDENTIAL_FILE
                self._write_credential(Path(path))
            for attempt in range(1, START_ATTEMPTS + 1):
                start_of_log = self._spawn(command, env)
                try:
                    self._wait_ready(repository)
                    break
                except LauncherError:
                    abort = self._transient_abort(start_of_log)
                    if abort is None or attempt == START_ATTEMPTS:
                        raise
                    self._end_process(grace=0.0)
                    with open(self.log_file, "a") as log:
                        log.write(f"# tritonlocal: tritonserver aborted before it was ready "
                                  f"({abort}, attempt {attempt} of {START_ATTEMPTS}); "
                                  "starting it again\n")
        except BaseException:
            self.stop()  # the credential file and the run directory too
            raise

    def _spawn(self, command: list[str], env: dict[str, str]) -> int:
        """Start tritonserver with its output appended to the log; the log's size before it."""
        with open(self.log_file, "ab") as log:
            # The log is echoed to the terminal and kept: the command line without the header.
            start_of_log = log.tell()
            log.write(f"# {' '.join(flags.redact(command))}\n".encode())
            log.flush()
            self.process = _SPAWNER.submit(
                subprocess.Popen, command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() can reach every stub
                preexec_fn=_die_with_parent,
            ).result()
        return start_of_log

    def _transient_abort(self, start_of_log: int) -> str | None:
        """The known transient abort the server just died of (TRANSIENT_START_ABORTS, SIGABRT
        and its message in this start's part of the log), or None."""
        if self.process is None or self.process.poll() != -signal.SIGABRT:
            return None
        with open(self.log_file, "rb") as log:
            log.seek(start_of_log)
            text = log.read().decode(errors="replace")
        return next((known for known in TRANSIENT_START_ABORTS if known in text), None)

    def command(self, server: Path, repository: Path, backends: Path,
                restrictions: list[str]) -> list[str]:
        """The tritonserver command line for these options."""
        opts = self.options
        return [
            str(server),
            f"--model-repository={repository}",
            f"--backend-directory={backends}",
            f"--http-address={opts.host}", f"--http-port={opts.http_port}",
            f"--grpc-address={opts.host}", f"--grpc-port={opts.grpc_port}",
            f"--metrics-address={opts.host}", f"--metrics-port={opts.metrics_port}",
            "--allow-metrics=true", f"--allow-gpu-metrics={str(opts.gpu).lower()}",
            "--allow-cpu-metrics=true",
            *flags.serving_flags(opts.shm_default_bytes, opts.shm_growth_bytes,
                                 opts.python_thread_pool, load=sorted(
                                     p.parent.name for p in repository.glob("*/config.pbtxt")
                                     if p.parent.name not in opts.deferred)
                                 if opts.deferred else None),
            # On CPU, skip the pinned host pool the CUDA build would try to allocate; on GPUs,
            # Triton's defaults for it and the container's CUDA pools.
            *(flags.cuda_pool_flags() if opts.gpu else ["--pinned-memory-pool-byte-size=0"]),
            f"--log-verbose={opts.log_verbose}",
            # A prefix unique to this server, so stop() can remove exactly its regions if a stub
            # could not (killed stubs leave their /dev/shm files behind).
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            *restrictions,
            *opts.extra_args,
        ]

    def stop(self, grace: float | None = None) -> int | None:
        """SIGINT, wait up to ``grace`` (default ``stop_grace``), then SIGKILL the process group.
        Idempotent."""
        code = self._end_process(self.options.stop_grace if grace is None else grace)
        if self.credential_file is not None:
            self.credential_file.unlink(missing_ok=True)  # it opens nothing any more
            self.credential_file = None
        if self._run_dir is not None:
            backends = self._run_dir / "backends"
            shutil.rmtree(backends, ignore_errors=True)
            if self.log_file is not None and self.log_file.parent != self._run_dir:
                shutil.rmtree(self._run_dir, ignore_errors=True)
        return code

    def _end_process(self, grace: float) -> int | None:
        """SIGINT, ``grace`` seconds, then SIGKILL for the server's process group, and its
        shared-memory regions removed; the server's exit status (None: none was running)."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGINT)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (a server past its grace period, orphaned stubs).
        _signal_group(process.pid, signal.SIGKILL)
        code = process.wait()
        _wait_group_gone(process.pid, timeout=10.0)
        for region in shm_regions(self._shm_prefix):
            region.unlink(missing_ok=True)
        return code

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stub_pids(self, model: str) -> list[int]:
        """The python-backend stub processes of ``model``'s instances."""
        if self.process is None:
            return []
        return sorted(group_stubs(self.process.pid).get(model, []))

    @property
    def admin_headers(self) -> dict[str, str]:
        """The HTTP header the admin APIs answer (over gRPC: ``flags.GRPC_PREFIX`` + its name)."""
        return dict([self.credential])

    def liveness(self, timeout: float = 5.0, retired: set[int] | None = None,
                 max_memory_mib: float = 0.0) -> liveness.Report:
        """Is the server live with every stub running? (``tritonlocal.liveness.check``)

        The instances each model should have are read from the server once per server process:
        only the supervisor's reloads load models, and they keep every config as it was."""
        if self.process is None:
            raise LauncherError("the server is not running")
        headers = self.admin_headers  # what it reads is open; it opens what an operator closed
        pid = self.process.pid
        if self._expected is None or self._expected[0] != pid:
            try:
                self._expected = (pid, liveness.expected_instances(
                    self.http_url, timeout=timeout, headers=headers))
            except (liveness.CheckError, urllib.error.URLError, OSError, ValueError):
                self._expected = None  # not answering yet: check() reports it, and asks again
        expected = self._expected[1] if self._expected else None
        return liveness.check(self.http_url, pid, timeout=timeout, headers=headers,
                              expected=expected, retired=retired, max_memory_mib=max_memory_mib)

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, the repository API's header redacted (error messages quote
        it)."""
        if self.log_file is None or not self.log_file.exists():
            return ""
        tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        return flags.redact_text(tail, self.credential[1])

    def metadata(self) -> dict:
        with urllib.request.urlopen(f"http://{self.http_url}/v2", timeout=5) as response:
            return json.load(response)

    # -- internals ------------------------------------------------------------------------
    def _write_credential(self, path: Path) -> None:
        """The generated credential to ``path`` (mode 0600). A file there that is not one of
        ours (a header of flags.ADMIN_HEADER) is the user's: refused, never overwritten."""
        if path.exists() or path.is_symlink():
            try:
                ours = flags.read_credential(path)[0] == flags.ADMIN_HEADER and path.is_file()
            except (OSError, UnicodeDecodeError, ValueError):
                ours = False
            if not ours:
                raise LauncherError(f"{path} exists and is not an admin credential file; not "
                                    "overwritten (choose another --credential-file)")
        flags.write_credential(path, self.credential)
        self.credential_file = path

    def _onnxruntime_backend(self, models: list) -> Path | None:
        """The built onnxruntime backend, or None if no model needs it; refuses to start
        without it rather than serve ONNX models with anything else."""
        gpu = self.options.gpu
        built = self.options.onnxruntime_backend or backend_build.installed(gpu=gpu)
        needed = sorted(m.name for m in models if uses_onnxruntime(m))
        if built is None or not (Path(built) / backend_build.BACKEND_LIB).is_file():
            if needed:
                target, flag = ("backend-gpu", " --gpu") if gpu else ("backend", "")
                raise LauncherError(
                    f"Triton's onnxruntime backend{' for GPUs' if gpu else ''} is not built "
                    f"({len(needed)} model(s) need it: "
                    f"{', '.join(needed[:4])}{', ...' if len(needed) > 4 else ''}); build it "
                    f"with `make {target}` (python -m tritonlocal.backend_build{flag}), which "
                    f"`make serve{' BLS_PROFILE=gpu' if gpu else ''}` runs")
            return None
        return Path(built)

    def _assemble_backends(self, install: runtime.Installation, stub: Path,
                           onnxruntime: Path | None, target: Path) -> Path:
        return assemble_backends(install, stub, onnxruntime, target, self.options.extra_backends)

    def _wait_ready(self, repository: Path) -> None:
        """Until ``/v2/health/ready`` answers 200 and then the metrics endpoint answers: r24.10
        starts its metrics service after the HTTP one (45 ms later here; a scrape in between is
        refused)."""
        deadline = time.monotonic() + self.options.ready_timeout
        urls = [f"http://{self.http_url}/v2/health/ready", self.metrics_url]
        url = urls[0]
        while True:
            code = self.process.poll()
            if code is not None:
                raise LauncherError(self._startup_failure(code, repository))
            try:
                for url in urls[:]:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        if response.status != 200:
                            break
                    urls.remove(url)
                if not urls:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise LauncherError(
                    f"tritonserver was not ready within {self.options.ready_timeout:.0f} s "
                    f"({url}); log {self.log_file}:\n{self.log_tail()}")
            time.sleep(0.2)

    def _startup_failure(self, code: int, repository: Path) -> str:
        failed = failed_models(self.log_tail(400))
        if failed:
            detail = "\n".join(f"  - {name}: {reason}{load_hint(reason)}"
                               for name, reason in failed.items())
            head = f"tritonserver exited ({code}): model(s) failed to load from {repository}:\n{detail}"
        else:
            head = f"tritonserver exited with code {code} before it was ready"
        return f"{head}\nlog {self.log_file} (last lines):\n{self.log_tail()}"


# How long a drain may take (what tritonserver's own --exit-timeout-secs would have allowed).
DRAIN_GRACE_SECONDS = drain.DRAIN_SECONDS


class Supervisor:
    """Keeps a ``TritonServer`` serving. Every ``interval`` seconds it checks the server
    (``tritonlocal.liveness``) and

    * when a python-backend stub is dead or missing, reloads that model alone (a
      ``tritonlocal.reload.Reloader``: the other models keep serving; more than ``max_reloads``
      reloads of one model within ``window`` seconds and it gives up on that model, which the
      liveness probe then reports, while the others keep serving);
    * restarts the whole server (stop with ``restart_grace``, then start on the same ports) when
      tritonserver has exited, when ``/v2/health/live`` has not answered 200 for
      ``unresponsive_seconds`` (checks in a row), or when a reload failed;
    * drains and restarts it when its resident memory is over ``max_server_memory_mib``: the
      models that call others are unloaded first (``tritonlocal.drain``: they answer what they
      hold, for up to ``drain_grace`` seconds, and refuse the rest), then it is stopped and
      started again.

    A check costs ~3.5 ms of CPU (``/proc`` and two HTTP calls); every 0.5 s, a dead stub is found
    within 0.25 s on average (docs/reliability.md).

    More than ``max_restarts`` whole-server restarts within ``window`` seconds is a crash loop:
    ``run`` raises ``LauncherError`` and leaves the server stopped, as a container's restart
    policy would back off. ``events`` records (monotonic time, what happened) for tests and logs;
    ``reloader.events`` the reloads.
    """

    def __init__(self, server: TritonServer, interval: float = 0.5, restart_grace: float = 10.0,
                 unresponsive_seconds: float = 3.0, max_restarts: int = 5, window: float = 600.0,
                 max_reloads: int = 5, retire_grace: float = 5.0, state_dir: str | None = None,
                 max_server_memory_mib: float = liveness.MAX_SERVER_MEMORY_MIB,
                 drain_grace: float = DRAIN_GRACE_SECONDS, log=print) -> None:
        self.server = server
        self.interval = interval
        self.restart_grace = restart_grace
        self.unresponsive_checks = max(1, round(unresponsive_seconds / interval))
        self.max_restarts = max_restarts
        self.window = window
        self.max_server_memory_mib = max_server_memory_mib
        self.drain_grace = drain_grace
        self.log = log
        self.events: list[tuple[float, str]] = []
        self.restarts: list[float] = []
        self.reloader = reload.Reloader(server.http_url, server.admin_headers, interval,
                                        max_reloads, window, retire_grace, state_dir, log=log)
        self._unresponsive = 0
        self._drain = False  # the next restart drains the server first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def problem(self) -> str | None:
        """Why the server needs a restart now, or None (after reloading any model whose stub
        died)."""
        process = self.server.process
        if process is None or process.poll() is not None:
            code = None if process is None else process.returncode
            return f"tritonserver is not running (exit code {code})"
        reloader = self.reloader
        reloader.attach(process.pid)  # publishes the state: fresh at every check
        reloader.kill_due()
        report = self.server.liveness(retired=reloader.retired,
                                      max_memory_mib=self.max_server_memory_mib)
        if report.over_memory:
            self._drain = True
            return report.summary()
        if not report.live:
            self._unresponsive += 1
            if self._unresponsive >= self.unresponsive_checks:
                return report.summary() + f" ({self._unresponsive} checks in a row)"
            return None
        self._unresponsive = 0
        if report.missing:
            not_back = reloader.handle(report)
            if not_back:
                return (f"{report.summary()}; reloading {', '.join(not_back)} failed "
                        f"({reloader.events[-1][1]})")
            return None
        if report.zombies:  # dead stubs of no known instance: the old way, a restart
            return report.summary()
        return None

    def restart(self, reason: str) -> None:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < self.window] + [now]
        self.events.append((now, f"restart: {reason}"))
        if len(self.restarts) > self.max_restarts:
            self.server.stop(self.restart_grace)
            raise LauncherError(f"tritonserver needed {len(self.restarts)} restarts within "
                                f"{self.window:.0f} s; giving up. Last reason: {reason}")
        self.log(f"supervisor: {reason}; restarting tritonserver "
                 f"(restart {len(self.restarts)} within {self.window:.0f} s)")
        if self._drain:  # a healthy server: let it answer what it holds first
            self._drain = False
            try:
                drain.drain(self.server.http_url, self.server.admin_headers, self.drain_grace,
                            log=lambda line: self.log(f"supervisor: {line}"))
            except (OSError, RuntimeError, ValueError) as error:
                self.log(f"supervisor: drain failed ({error}); stopping all the same")
        self.server.stop(self.restart_grace)
        self.server.start()
        self._unresponsive = 0
        self.events.append((time.monotonic(), "ready"))
        self.log(f"supervisor: tritonserver is ready again after "
                 f"{time.monotonic() - now:.1f} s")

    def check_once(self) -> bool:
        """One check, and a restart if needed. True if the server was restarted."""
        reason = self.problem()
        if reason is None:
            return False
        self.restart(reason)
        return True

    def run(self, stop: threading.Event | None = None) -> None:
        """Check every ``interval`` seconds until ``stop`` (or ``self.stop()``) is set."""
        stop = stop or self._stop
        try:
            while not stop.wait(self.interval) and not self._stop.is_set():
                self.check_once()
        finally:
            self.reloader.forget()

    # -- in a background thread (tests, embedding) ----------------------------------------
    def start(self) -> "Supervisor":
        def guarded() -> None:
            try:
                self.run()
            except BaseException as error:  # noqa: BLE001 - kept for the owner to inspect
                self.error = error
                self.log(f"supervisor stopped: {error}")

        self._thread = threading.Thread(target=guarded, name="tritonserver-supervisor",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def assemble_backends(install: runtime.Installation, stub: Path, onnxruntime: Path | None,
                      target: Path, extra: dict[str, Path] | None = None) -> Path:
    """<target>/python (the wheel's python backend and the stub) and <target>/onnxruntime (a
    copy of the build, so a rebuild never changes what a running server loaded). Also the
    backend directory Model Analyzer's server gets (ops/tune.py)."""
    python_dir = target / "python"
    python_dir.mkdir(parents=True)
    for item in install.python_backend.iterdir():
        if item.is_file():
            shutil.copy2(item, python_dir / item.name)
    shutil.copy2(stub, python_dir / stub.name)
    if onnxruntime is not None:
        shutil.copytree(onnxruntime, target / "onnxruntime")
    for name, directory in (extra or {}).items():
        shutil.copytree(directory, target / name)
    return target


def read_configs(repositories: list[Path]) -> list:
    """The ``ModelConfig`` of every model in the repositories (unparsable ones skipped: Triton
    reports bad configs itself, better)."""
    from bls_models.repository import load_config

    models = []
    for repository in repositories:
        for path in sorted(Path(repository).glob("*/config.pbtxt")):
            try:
                config = load_config(path)
            except Exception:  # noqa: BLE001 - tritonserver reports a broken config itself
                continue
            config.name = config.name or path.parent.name
            models.append(config)
    return models


def uses_onnxruntime(config) -> bool:
    return config.backend == "onnxruntime" or config.platform == "onnxruntime_onnx"


def stub_instances(models: list) -> int:
    """How many python-backend stubs the models start: the instances of every model the python
    backend serves (KIND_GPU groups are not counted: no GPU is used locally)."""
    from tritonclient.grpc import model_config_pb2

    cpu = {model_config_pb2.ModelInstanceGroup.KIND_CPU, model_config_pb2.ModelInstanceGroup.KIND_AUTO}
    count = 0
    for config in models:
        if config.backend in liveness.STUB_BACKENDS:
            groups = config.instance_group or [model_config_pb2.ModelInstanceGroup(count=1)]
            count += sum(max(g.count, 1) for g in groups if g.kind in cpu)
    return count


def check_shm_space(stubs: int, region_bytes: int, shm: Path = SHM) -> None:
    """Every stub maps a shared-memory region of ``region_bytes`` in /dev/shm when it starts, and
    regions only grow. Too little space shows up later as a failed model load or as
    "Failed to increase the shared memory pool size" on requests: refuse to start instead."""
    stat = os.statvfs(shm)
    free = stat.f_bavail * stat.f_frsize
    needed = stubs * region_bytes
    if needed > free:
        mib = 2**20
        raise LauncherError(
            f"{shm} has {free / mib:.0f} MiB free, but the {stubs} python-backend model instances "
            f"need {needed / mib:.0f} MiB for their shared-memory regions at start ({stubs} x "
            f"{region_bytes / mib:.0f} MiB) and more as they grow. Free space in {shm}, lower the "
            "region size (ServerOptions.shm_default_bytes), or give the container more "
            "(docker run --shm-size=..., or a memory-backed emptyDir on /dev/shm in Kubernetes; "
            "docs/operations.md)")


def failed_models(log: str) -> dict[str, str]:
    """Model name -> reason, from Triton's "failed to load" lines and its model status table."""
    failed: dict[str, str] = {}
    for name, reason in re.findall(r"failed to load '([^']+)' version \d+: (.*)", log):
        failed.setdefault(name, reason.strip().removesuffix('"'))
    for name, reason in re.findall(r"^\|\s*(\S+)\s*\|\s*\d+\s*\|\s*UNAVAILABLE: (.*?)\s*\|\s*$",
                                   log, flags=re.MULTILINE):
        failed.setdefault(name, reason.strip())
    return failed


def load_hint(reason: str) -> str:
    """What to do about a model's load failure, where the server's own words do not say it."""
    if re.search(r"(failed to stat file |unable to find ')\S*\.onnx", reason):
        return " (the ONNX file does not exist: run `make models`)"
    return ""


def shm_regions(prefix: str) -> list[Path]:
    return sorted(SHM.glob(f"{prefix}*")) if prefix else []


def remove_stale_regions() -> list[Path]:
    """Remove shared-memory regions left by servers whose launcher no longer exists (a launcher
    killed with SIGKILL cannot clean up, and killed stubs leave their regions behind)."""
    removed = []
    for region in SHM.glob(f"{SHM_PREFIX}*"):
        pid = region.name.removeprefix(SHM_PREFIX).split("_", 1)[0]
        if pid.isdigit() and not procs.alive(int(pid)):
            region.unlink(missing_ok=True)
            removed.append(region)
    return removed


def group_stubs(server_pid: int) -> dict[str, list[int]]:
    """Model name -> pids of the python-backend stubs in the server's process group."""
    stubs: dict[str, list[int]] = {}
    for process in procs.processes():
        stub = process.stub
        if process.pgid == server_pid and stub and stub.model:
            stubs.setdefault(stub.model, []).append(process.pid)
    return stubs


def kill_orphaned_stubs() -> list[int]:
    """SIGKILL python-backend stubs of this launcher's servers whose server is gone.

    A server dies with its launcher (PDEATHSIG), but a stub blocked in a BLS call when that
    happens was seen to outlive it for minutes, reparented to init, holding its memory and
    shared-memory region. A stub's command line names its region (``tritonlocal_<launcher
    pid>_...``) and its server's pid; one whose server no longer exists, or is no longer its
    parent, is an orphan."""
    killed = []
    for process in procs.processes():
        stub = process.stub
        if not stub or not stub.region.startswith(SHM_PREFIX) or stub.server_pid is None:
            continue
        if process.ppid == stub.server_pid and procs.alive(stub.server_pid):
            continue
        if procs.kill(process.pid):
            killed.append(process.pid)
    return killed


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher process dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (stubs exit shortly after SIGKILL)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def tail_to(stream, path: Path, stop: threading.Event) -> threading.Thread:
    """Copy lines appended to ``path`` to ``stream`` until ``stop`` is set (foreground mode)."""

    def follow() -> None:
        with open(path, "r", errors="replace") as handle:
            while not stop.is_set():
                line = handle.readline()
                if line:
                    stream.write(line)
                    stream.flush()
                else:
                    time.sleep(0.1)

    thread = threading.Thread(target=follow, name="tritonserver-log", daemon=True)
    thread.start()
    return thread
