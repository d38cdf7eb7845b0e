"""Shared fixtures. Live tests start one real tritonserver per session through the same launcher
that `make serve` uses, on free ports, with its log in the pytest temp directory.

Inside the NGC container (`make test-container`, scripts/container-test.sh) the server is the
container's own tritonserver, started by that script: ``TRITON_EXTERNAL_SERVER`` names its
endpoints and pid, ``TRITON_EXTERNAL_FAULT_REPOSITORY`` the test-only models it also serves, and
tests that need the local launcher, the wheel or perf_analyzer (marked ``local_only``) skip."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bls_models import spec as S
from tests.helpers import EXTERNAL

ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = Path(os.environ.get("BLS_MODEL_REPOSITORY", ROOT / "model_repository"))
# Need the local launcher (their own servers, the wheel's binary), a loopback-only bind, or
# perf_analyzer, none of which the container's server has: skipped there.
LOCAL_ONLY = ("test_launcher.py", "test_recovery.py", "test_security.py", "test_perf_analyzer.py",
              "test_bench_smoke.py", "test_readme_load_test.py", "test_extending.py",
              "test_chaos.py", "test_cascade_template.py", "test_tune.py")


# Memory decides how `make test`'s two workers (`--dist loadgroup`) share the suite: each worker
# has its own session server (84 python stubs, about 5 GiB at the start, 10 once the heaviest
# tests have grown its arenas and shared-memory regions). Two units of work run one test after
# the other on one worker each: UNIT_HEAVY, the tests that load a session server the most (so no
# two of them run at once), and UNIT_OWN_SERVERS, those that start servers of their own (or `make
# serve`, or Model Analyzer's; so at most one is up, and, as they come first and the ones that
# also need the session server last, before its worker starts a session server). Every other
# test is a unit of its own. Spread freely, two session servers and four more were once up at
# once: 23 GiB of this host's 24, and the OOM killer took a session server.
UNIT_HEAVY = ("test_memory.py", "test_bench_smoke.py", "test_steady_poison.py", "test_soak.py",
              "test_groups.py")
UNIT_OWN_SERVERS = ("test_launcher.py", "test_recovery.py", "test_security.py", "test_chaos.py",
                    "test_cascade_template.py", "test_tune.py", "test_extending.py",
                    "test_memory_bound.py", "test_given_repository.py", "test_failure_paths.py",
                    "test_head_of_line.py")


# `-n auto`, what `make test` passes unless TEST_WORKERS says otherwise: two workers where two
# session servers fit and two cores are free (WORKERS_MIN_MEMORY_GIB, about 21 GiB measured at the
# peak, docs/operations.md; WORKERS_MIN_IDLE_CORES over a second at the start), else one process.
# Two workers beside a busy loop on one core of this 2-core host missed on-time checks; one
# process holds them.
WORKERS_MIN_MEMORY_GIB = 22
WORKERS_MIN_IDLE_CORES = 1.5
_AUTO_WORKERS: list[str] = []  # what `-n auto` chose and why, for the report's header


def host_memory_kib(meminfo: Path = Path("/proc/meminfo"),
                    cgroup_limit: Path = Path("/sys/fs/cgroup/memory.max")) -> int:
    """The memory this process may use: the host's, or its cgroup's limit if lower; 0 if
    unknown."""
    try:
        total = next(int(line.split()[1]) for line in meminfo.read_text().splitlines()
                     if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    try:
        limit = cgroup_limit.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit) // 1024) if limit.isdigit() else total


def idle_cores(seconds: float = 1.0, stat: Path = Path("/proc/stat"),
               cpus: int | None = None) -> float | None:
    """How many of the host's cores were idle over ``seconds`` (the first line of /proc/stat:
    idle and iowait over all time); None if unknown."""
    def sample() -> tuple[int, int]:
        values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
        return values[3] + values[4], sum(values)

    try:
        idle_before, total_before = sample()
        time.sleep(seconds)
        idle_after, total_after = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total_after <= total_before:
        return None
    share = (idle_after - idle_before) / (total_after - total_before)
    return share * (cpus or os.cpu_count() or 1)


def auto_workers(cpus: int, memory_kib: int, idle: float | None = None) -> int:
    """Two workers with two CPUs, WORKERS_MIN_MEMORY_GIB of memory and (if known)
    WORKERS_MIN_IDLE_CORES idle; else 0, one process."""
    if idle is not None and idle < WORKERS_MIN_IDLE_CORES:
        return 0
    return 2 if cpus >= 2 and memory_kib >= WORKERS_MIN_MEMORY_GIB * 2**20 else 0


def pytest_xdist_auto_num_workers(config):
    cpus, memory, idle = len(os.sched_getaffinity(0)), host_memory_kib(), idle_cores()
    workers = auto_workers(cpus, memory, idle)
    _AUTO_WORKERS.append(
        f"-n auto: {workers or 'no'} workers ({cpus} CPUs, {memory / 2**20:.1f} GiB, "
        f"{'?' if idle is None else f'{idle:.1f}'} cores idle; two need "
        f"{WORKERS_MIN_MEMORY_GIB} GiB and {WORKERS_MIN_IDLE_CORES} idle)")
    return workers


def pytest_report_header(config):
    return _AUTO_WORKERS[:1]


def _unit(path: str) -> str | None:
    """The unit of work of the test file at ``path`` (a node id's or an absolute one), if any."""
    if Path(path).parent.name != "live":
        return None
    name = Path(path).name
    return "heavy" if name in UNIT_HEAVY else "own_servers" if name in UNIT_OWN_SERVERS else None


@dataclass
class _Process:
    pid: int


class ExternalServer:
    """A tritonserver this session did not start (the container's), with the attributes the
    tests use of ``tritonlocal.TritonServer``."""

    def __init__(self, spec: str) -> None:
        fields = dict(item.split("=", 1) for item in spec.split(","))
        self.http_url, self.grpc_url = fields["http"], fields["grpc"]
        self.metrics_url = f"http://{fields['metrics']}/metrics"
        self.process = _Process(int(fields["pid"]))

    def stub_pids(self, model: str) -> list[int]:
        from tritonlocal.launcher import group_stubs

        return sorted(group_stubs(self.process.pid).get(model, []))


@pytest.fixture(scope="session")
def repository() -> Path:
    """The project's model repository with its ONNX models exported (a no-op when current)."""
    from modelgen import export

    missing = [m.name for m in S.ONNX_MODELS if not export.onnx_path(MODEL_REPOSITORY, m).exists()]
    if missing:
        export.export_all(MODEL_REPOSITORY, size="small")
    return MODEL_REPOSITORY


@pytest.fixture(scope="session")
def fault_repository(repository, tmp_path_factory) -> Path:
    """Test-only models (fault stand-ins, orchestrator variants wired to them) and the benchmark's
    variants (so the benchmark smoke tests run against the same server)."""
    if EXTERNAL:
        return Path(os.environ["TRITON_EXTERNAL_FAULT_REPOSITORY"])
    from bench.repository import build_test_repository

    return build_test_repository(tmp_path_factory.mktemp("fault_repository"), repository)


@pytest.fixture(scope="session")
def server(repository, fault_repository, tmp_path_factory):
    """One server for the live tests: the real repository as committed, plus the fault models."""
    if EXTERNAL:
        yield ExternalServer(EXTERNAL)
        return
    from tritonlocal import TritonServer, on_free_ports

    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    options = on_free_ports(repository, log, extra_args=[f"--model-repository={fault_repository}"],
                            # The crash test leaves a model whose stub is dead; this Triton build
                            # never unloads it, so a clean exit would wait its full exit timeout.
                            stop_grace=5.0)
    server = TritonServer(options)
    server.start()
    pgid = server.process.pid
    yield server
    server.stop()
    try:
        os.killpg(pgid, 0)
        leftover = True
    except ProcessLookupError:
        leftover = False
    assert not leftover, f"processes of the server's group outlived stop(); log {log}"


@pytest.fixture
def serve(repository, tmp_path):
    """``helpers.spawn_serve`` whose launchers, servers and stubs are all killed at teardown,
    whatever the test did (a launcher that ignored its SIGINT once outlived the suite by an
    hour)."""
    from tests import helpers

    started = []

    def spawn(*extra: str, **kwargs):
        launcher, ports = helpers.spawn_serve(repository, tmp_path, *extra, **kwargs)
        started.append(launcher)
        return launcher, ports

    yield spawn
    for launcher in started:
        helpers.kill_serve(launcher)


@pytest.fixture(scope="session")
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, concurrency=8,
                                              connection_timeout=60, network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup`: the two units above, every other test one of its own. (xdist's
    own loadgroup reads ``xdist_group`` marks by renaming node ids, which pytest 9 no longer lets
    it do.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::", 1)[0]) or nodeid

    return Units(config, log)


def pytest_collection_modifyitems(items):
    """Everything under tests/live talks to a real server; some need the local launcher. The
    units come first (the workers start on them), and within each, the tests that need no
    session server first."""
    order = {"heavy": 0, "own_servers": 1, None: 2}
    items.sort(key=lambda item: (order[_unit(str(item.fspath))], "server" in item.fixturenames))
    skip = pytest.mark.skip(reason="needs the local launcher, a loopback bind or perf_analyzer; "
                                   "not in the container (TRITON_EXTERNAL_SERVER is set)")
    for item in items:
        if "/live/" in str(item.fspath):
            item.add_marker(pytest.mark.live)
        if Path(str(item.fspath)).name in LOCAL_ONLY:
            item.add_marker(pytest.mark.local_only)
            if EXTERNAL:
                item.add_marker(skip)
