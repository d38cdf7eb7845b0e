"""Who may call what: endpoints bound to 127.0.0.1; every admin API (model repository, shared
memory, logging, trace) refused without the admin credential and answered with it, over HTTP and
gRPC, on a server started with the defaults; inference, health, metadata, statistics and metrics
open to all. The credential (generated, or the operator's) is on tritonserver's argv only: in a
file only its user can read, and in no log, no launcher output, and not in the environment of
tritonserver or its stubs. Opening an API is a setting, with a warning."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from tritonlocal import LauncherError, ServerOptions, TritonServer, flags, procs
from tritonlocal.launcher import group_stubs
from tritonlocal.liveness import server_pids

ROOT = Path(__file__).resolve().parents[2]

HEADER = ("triton-admin-key", f"k{uuid.uuid4().hex}{uuid.uuid4().hex}")


@pytest.fixture
def region():
    """A 64-byte system shared-memory region, removed afterwards."""
    key = f"/security-test-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("security_test", key, 64)
    yield key
    shm.destroy_shared_memory_region(handle)


def grpc_form(headers: dict[str, str]) -> dict[str, str]:
    """Triton 2.51 reads a restricted API's header over gRPC with a ``triton-grpc-protocol-``
    prefix."""
    return {f"{flags.GRPC_PREFIX}{name}": value for name, value in headers.items()}


def http_call(server, method: str, path: str, headers: dict[str, str], body: dict | None = None):
    return requests.request(method, f"http://{server.http_url}{path}", headers=headers,
                            data=None if body is None else json.dumps(body), timeout=60)


# Each admin API's calls, over HTTP: (api, method, path, body, safe to make with the credential
# on the session's server). Unload is only ever refused: made, it would unload a model.
HTTP_CALLS = [
    ("model-repository", "POST", "/v2/repository/index", {}, True),
    ("model-repository", "POST", "/v2/repository/models/preprocess/load", {}, True),
    ("model-repository", "POST", "/v2/repository/models/preprocess/unload", {}, False),
    ("shared-memory", "GET", "/v2/systemsharedmemory/status", None, True),
    ("shared-memory", "GET", "/v2/cudasharedmemory/status", None, True),
    ("shared-memory", "POST", "/v2/systemsharedmemory/region/probe/unregister", {}, True),
    ("logging", "GET", "/v2/logging", None, True),
    ("logging", "POST", "/v2/logging", {}, True),
    ("trace", "GET", "/v2/trace/setting", None, True),
    ("trace", "POST", "/v2/trace/setting", {}, True),
]


@pytest.mark.parametrize("api,method,path,body,safe", HTTP_CALLS,
                         ids=[f"{c[1]} {c[2]}" for c in HTTP_CALLS])
def test_every_admin_api_refuses_http_calls_without_the_credential(server, api, method, path,
                                                                   body, safe):
    """The session's server, started with the launcher's defaults: no header of the operator's,
    so the credential is one the launcher made."""
    refused = http_call(server, method, path, {}, body)
    assert refused.status_code == 403, refused.text
    assert flags.ADMIN_HEADER in refused.json()["error"]
    # A wrong value is refused as no value is.
    wrong = http_call(server, method, path, {flags.ADMIN_HEADER: "0" * 64}, body)
    assert wrong.status_code == 403, wrong.text
    if safe:
        accepted = http_call(server, method, path, server.admin_headers, body)
        assert accepted.status_code == 200, (api, accepted.text)
    assert requests.get(f"http://{server.http_url}/v2/models/preprocess/ready",
                        timeout=10).status_code == 200


def test_shared_memory_registration_needs_the_credential_over_http(server, region):
    body = {"key": region, "offset": 0, "byte_size": 64}
    path = "/v2/systemsharedmemory/region/security_probe/register"
    assert http_call(server, "POST", path, {}, body).status_code == 403
    status = http_call(server, "GET", "/v2/systemsharedmemory/status", server.admin_headers).json()
    assert all(r["name"] != "security_probe" for r in status)
    assert http_call(server, "POST", path, server.admin_headers, body).status_code == 200
    status = http_call(server, "GET", "/v2/systemsharedmemory/status", server.admin_headers).json()
    assert any(r["name"] == "security_probe" for r in status)
    assert http_call(server, "POST", "/v2/systemsharedmemory/region/security_probe/unregister",
                     server.admin_headers).status_code == 200


def grpc_calls(client: grpcclient.InferenceServerClient, region: str):
    """Each admin API's calls over gRPC: (api, call(headers), safe to make with the credential)."""
    return [
        ("model-repository", lambda h: client.get_model_repository_index(headers=h), True),
        ("model-repository", lambda h: client.load_model("preprocess", headers=h), True),
        ("model-repository", lambda h: client.unload_model("preprocess", headers=h), False),
        ("shared-memory", lambda h: client.get_system_shared_memory_status(headers=h), True),
        ("shared-memory", lambda h: client.get_cuda_shared_memory_status(headers=h), True),
        ("shared-memory", lambda h: client.register_system_shared_memory(
            "security_probe_grpc", region, 64, headers=h), True),
        ("shared-memory", lambda h: client.unregister_system_shared_memory(
            "security_probe_grpc", headers=h), True),
        ("logging", lambda h: client.get_log_settings(headers=h), True),
        ("logging", lambda h: client.update_log_settings({}, headers=h), True),
        ("trace", lambda h: client.get_trace_settings(headers=h), True),
        ("trace", lambda h: client.update_trace_settings(settings={}, headers=h), True),
    ]


def test_every_admin_api_refuses_grpc_calls_without_the_credential(server, region):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        calls = grpc_calls(client, region)
        for api, call, _safe in calls:
            # Without it, with a wrong value, and with the HTTP form of the right one.
            for headers in ({}, grpc_form({flags.ADMIN_HEADER: "0" * 64}), server.admin_headers):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert "restricted" in str(refused.value), (api, refused.value)
                assert str(refused.value.status()) == "StatusCode.UNAVAILABLE"
        for _api, call, safe in calls:
            if safe:
                call(grpc_form(server.admin_headers))  # raises if refused
        assert client.is_model_ready("preprocess")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_health_metadata_statistics_and_metrics_need_no_credential(server, protocol):
    image = np.zeros((1, *S.IMAGE.dims), np.uint8)
    if protocol == "http":
        base = f"http://{server.http_url}"
        reply = requests.post(f"{base}/v2/models/preprocess/infer",
                              json={"inputs": [{"name": "IMAGE", "shape": list(image.shape),
                                                "datatype": "UINT8",
                                                "data": image.ravel().tolist()}]}, timeout=60)
        assert reply.status_code == 200, reply.text
        for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/preprocess",
                     "/v2/models/preprocess/config", "/v2/models/preprocess/stats"):
            assert requests.get(base + path, timeout=30).status_code == 200, path
        metrics = requests.get(server.metrics_url, timeout=30)
        assert metrics.status_code == 200 and "nv_inference_count" in metrics.text
        return
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image)
        assert client.infer("preprocess", [tensor]).as_numpy("PIXELS").shape == (1, *S.PIXELS.dims)
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata() and client.get_model_metadata("preprocess")
        assert client.get_model_config("preprocess") and client.get_inference_statistics("preprocess")
    finally:
        client.close()


# 127.0.0.1 as /proc/net/tcp writes it, and as an IPv4-mapped IPv6 address in /proc/net/tcp6 (how
# the gRPC endpoint binds). 00000000 / all-zero would be every address.
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_endpoints_listen_on_loopback_only(server):
    for url in (server.http_url, server.grpc_url, server.metrics_url.split("/")[2]):
        port = int(url.rsplit(":", 1)[1])
        found = listening_addresses(port)
        assert found and found <= LOOPBACK, (url, found)



@pytest.mark.parametrize("header", [("bad name", "x" * 40), ("key", ""), ("key", "a,b" * 20),
                                    ("key", "a:b" * 20), ("key", "short")])
def test_a_malformed_or_short_admin_header_is_refused_before_start(repository, header):
    with pytest.raises(LauncherError, match="admin header"):
        TritonServer(ServerOptions(repository, admin_header=header)).start()


def proc_text(pid: int, name: str) -> str:
    """/proc/<pid>/<name> (cmdline, environ), its NUL separators as newlines."""
    return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b"\n").decode(errors="replace")


def assert_kept_secret(value: str, server_pid: int, log: Path, *outputs: str) -> None:
    """``value`` is on tritonserver's argv (r24.10 takes it only there) and nowhere else: not in
    the server log (whose first line is the redacted command), the outputs, or the environment
    of tritonserver or of any of its python-backend stubs."""
    assert value in proc_text(server_pid, "cmdline")
    text = log.read_text(errors="replace")
    assert value not in text
    assert text.startswith("# ") and flags.REDACTED in text.splitlines()[0]
    for output in outputs:
        assert value not in output
    stubs = [pid for pids in group_stubs(server_pid).values() for pid in pids]
    assert stubs, "no python-backend stub to check"
    for pid in [server_pid, *stubs]:
        environ = proc_text(pid, "environ")
        assert value not in environ, f"process {pid}'s environment holds the header"
        assert not any(line.startswith(tuple(f"{v}=" for v in flags.SECRET_VARIABLES))
                       for line in environ.splitlines()), pid


def test_the_generated_credential_is_in_a_private_file_and_no_log_or_stubs_environment(server):
    value = server.credential[1]
    assert_kept_secret(value, server.process.pid, server.log_file)
    path = server.credential_file
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert flags.read_credential(path) == server.credential
    # ... and it opens an admin API, which refuses any request without it.
    assert http_call(server, "POST", "/v2/repository/index", {}).status_code == 403
    assert http_call(server, "POST", "/v2/repository/index", server.admin_headers).status_code == 200


def curl(url: str, *args: str, method: str = "GET") -> int:
    """The HTTP status a plain ``curl`` gets."""
    done = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
                           *args, url], capture_output=True, text=True, timeout=60)
    return int(done.stdout or 0)


ADMIN_PATHS = {"model-repository": ("POST", "/v2/repository/index"),
               "shared-memory": ("GET", "/v2/systemsharedmemory/status"),
               "logging": ("GET", "/v2/logging"),
               "trace": ("GET", "/v2/trace/setting")}


@pytest.mark.parametrize("given", ["generated", "admin-header", "open-logging"])
def test_make_serve_restricts_every_admin_api_and_keeps_the_credential_secret(serve, tmp_path,
                                                                               given):
    """`python -m tritonlocal serve` with the log echoed: a plain curl gets 403 from every admin
    API, and ``curl -H @FILE`` with the file the banner names gets through; or the operator's
    header from TRITONLOCAL_ADMIN_HEADER; or logging opened with --open-api, which warns."""
    env, extra = {}, []
    if given == "admin-header":
        env["TRITONLOCAL_ADMIN_HEADER"] = f"{HEADER[0]}={HEADER[1]}"
    if given == "open-logging":
        extra = ["--open-api", "logging"]
    launcher, ports = serve("--check-interval", "0.5", *extra, quiet=False, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")),
                              daemon=True)
    reader.start()
    credential_file = None
    try:
        deadline = time.monotonic() + 120
        while not any("Press Ctrl-C" in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        (pid,) = [p for p in server_pids() if procs.stat(p)[2] == launcher.pid]
        rules = {a.split("=", 1)[1] for a in proc_text(pid, "cmdline").splitlines()
                 if a.startswith(flags.RESTRICTION_FLAGS)}
        (rule,) = rules  # the same rule over HTTP and gRPC
        apis, header = rule.split(":", 1)
        name, value = header.split("=", 1)
        opened = {"logging"} if given == "open-logging" else set()
        assert set(apis.split(",")) == set(flags.RESTRICTED_APIS) - opened
        (admin_line,) = [line for line in lines if line.strip().startswith("admin ")]
        if given == "admin-header":
            assert (name, value) == HEADER and "--admin-header" in admin_line
        else:
            assert name == flags.ADMIN_HEADER and re.fullmatch(r"[0-9a-f]{64}", value), rule
            credential_file = Path(re.search(r"header in (\S+)", admin_line).group(1))
            assert credential_file == Path(f".triton/admin-{ports[0]}.header")
            credential_file = ROOT / credential_file  # the launcher runs in the checkout
            assert credential_file.stat().st_mode & 0o777 == 0o600
        warnings = [line for line in lines if line.startswith("warning:")]
        assert len(warnings) == len(opened) and all("logging API is open" in w for w in warnings)
        base = f"http://127.0.0.1:{ports[0]}"
        for api, (method, path) in ADMIN_PATHS.items():
            expected = 200 if api in opened else 403
            assert curl(base + path, method=method) == expected, api
            sent = (["-H", f"@{credential_file}"] if credential_file
                    else ["-H", flags.header_line(HEADER)])
            assert curl(base + path, *sent, method=method) == 200, api
        assert curl(f"{base}/v2/health/ready") == 200
        log = tmp_path / "server.log"
        assert_kept_secret(value, pid, log, "".join(lines))
        assert any(line.startswith("# ") and flags.REDACTED in line for line in lines), \
            "the launcher's output echoes the log, its command line included"
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
        reader.join(10)
    assert launcher.returncode == 0, "".join(lines)
    assert value not in "".join(lines)
    if credential_file is not None:
        assert not credential_file.exists(), "the credential file outlived its server"
