"""Who may change what the server serves: endpoints bound to 127.0.0.1; the repository API
(load/unload, which explicit model control opens for the supervisor's reloads) refused without
the server's own token; and — with an admin header — the model-repository and shared-memory
APIs refused to any request without it, over HTTP and gRPC, while inference stays open. The
token or header is on tritonserver's argv only: in no log, no launcher output, and not in the
environment of tritonserver or its stubs."""

from __future__ import annotations

import json
import re
import signal
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
from tests.live.support import make_repository, server_options
from tritonlocal import LauncherError, ServerOptions, TritonServer, flags, procs
from tritonlocal.launcher import group_stubs
from tritonlocal.liveness import server_pids

HEADER = ("triton-admin-key", f"k{uuid.uuid4().hex}")


@pytest.fixture(scope="module")
def restricted(repository, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("restricted") / "repo", repository, S.PREPROCESS)
    options = server_options(repo, tmp_path_factory.mktemp("restricted-log"), admin_header=HEADER)
    with TritonServer(options) as server:
        yield server


@pytest.fixture
def region():
    """A 64-byte system shared-memory region, removed afterwards."""
    key = f"/security-test-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("security_test", key, 64)
    yield key
    shm.destroy_shared_memory_region(handle)


def admin(authorised: bool) -> dict[str, str]:
    return {HEADER[0]: HEADER[1]} if authorised else {}


def grpc_admin(authorised: bool) -> dict[str, str]:
    """Triton 2.51 expects the gRPC form of the header with a ``triton-grpc-protocol-`` prefix."""
    return {f"triton-grpc-protocol-{HEADER[0]}": HEADER[1]} if authorised else {}


def http_post(server, path: str, body: dict | None = None, authorised: bool = False):
    return requests.post(f"http://{server.http_url}{path}", data=json.dumps(body or {}),
                         headers=admin(authorised), timeout=30)


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


@pytest.mark.parametrize("action", ["load", "unload"])
def test_without_the_servers_token_load_and_unload_are_refused_over_http(server, action):
    """No admin header given: the repository API answers only the launcher's random token."""
    reply = http_post(server, f"/v2/repository/models/preprocess/{action}")
    assert reply.status_code == 403, reply.text
    assert flags.TOKEN_HEADER in reply.json()["error"]
    assert http_post(server, "/v2/repository/index").status_code == 403
    assert requests.get(f"http://{server.http_url}/v2/models/preprocess/ready",
                        timeout=10).status_code == 200


def test_without_the_servers_token_the_repository_api_is_refused_over_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for call in (lambda h: client.unload_model("preprocess", headers=h),
                     lambda h: client.load_model("preprocess", headers=h),
                     lambda h: client.get_model_repository_index(headers=h)):
            with pytest.raises(InferenceServerException) as refused:
                call({})
            assert "restricted" in str(refused.value), refused.value
        (name, value), = server.repository_headers.items()
        index = client.get_model_repository_index(
            headers={f"triton-grpc-protocol-{name}": value}, as_json=True)
        assert {m["name"] for m in index["models"]} >= {"preprocess", "pipeline"}
        assert client.is_model_ready("preprocess")
    finally:
        client.close()


def test_the_servers_token_loads_a_model_and_opens_nothing_else(server):
    """With the token, load works (a plain load of an unchanged model: Triton keeps it as it is);
    the other admin APIs stay as Triton has them without an admin header."""
    headers = server.repository_headers
    reply = requests.post(f"http://{server.http_url}/v2/repository/models/preprocess/load",
                          headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert requests.get(f"http://{server.http_url}/v2/models/preprocess/ready",
                        timeout=10).status_code == 200
    assert requests.get(f"http://{server.http_url}/v2/systemsharedmemory/status",
                        timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v2/repository/models/preprocess/unload",
                                  "/v2/repository/index"])
def test_unauthenticated_repository_calls_are_refused_over_http(restricted, path):
    reply = http_post(restricted, path)
    assert reply.status_code == 403, reply.text
    assert HEADER[0] in reply.json()["error"]
    assert http_post(restricted, "/v2/repository/index", authorised=True).status_code == 200
    # The admin header opens load too (a plain load of an unchanged model keeps it as it is).
    assert http_post(restricted, "/v2/repository/models/preprocess/load",
                     authorised=True).status_code == 200
    assert requests.get(f"http://{restricted.http_url}/v2/models/preprocess/ready",
                        timeout=10).status_code == 200


def test_unauthenticated_shm_register_is_refused_over_http(restricted, region):
    body = {"key": region, "offset": 0, "byte_size": 64}
    path = "/v2/systemsharedmemory/region/probe/register"
    reply = http_post(restricted, path, body)
    assert reply.status_code == 403, reply.text
    status = requests.get(f"http://{restricted.http_url}/v2/systemsharedmemory/status",
                          headers=admin(True), timeout=10).json()
    assert all(r["name"] != "probe" for r in status)
    # The same call with the header goes through (and is undone).
    assert http_post(restricted, path, body, authorised=True).status_code == 200
    assert http_post(restricted, "/v2/systemsharedmemory/region/probe/unregister",
                     authorised=True).status_code == 200


def test_unauthenticated_calls_are_refused_over_grpc(restricted, region):
    client = grpcclient.InferenceServerClient(restricted.grpc_url)
    try:
        for call in (lambda h: client.unload_model("preprocess", headers=h),
                     lambda h: client.get_model_repository_index(headers=h),
                     lambda h: client.register_system_shared_memory("probe", region, 64,
                                                                    headers=h)):
            for headers in ({}, admin(True)):  # the HTTP form of the header is not enough
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert "restricted" in str(refused.value), refused.value
                assert str(refused.value.status()) == "StatusCode.UNAVAILABLE"
        client.get_model_repository_index(headers=grpc_admin(True))
        client.register_system_shared_memory("probe", region, 64, headers=grpc_admin(True))
        client.unregister_system_shared_memory("probe", headers=grpc_admin(True))
        assert client.is_model_ready("preprocess")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_needs_no_header(restricted, protocol):
    image = np.zeros((1, *S.IMAGE.dims), np.uint8)
    if protocol == "http":
        reply = requests.post(f"http://{restricted.http_url}/v2/models/preprocess/infer",
                              json={"inputs": [{"name": "IMAGE", "shape": list(image.shape),
                                                "datatype": "UINT8",
                                                "data": image.ravel().tolist()}]}, timeout=60)
        assert reply.status_code == 200, reply.text
        return
    client = grpcclient.InferenceServerClient(restricted.grpc_url)
    try:
        tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image)
        assert client.infer("preprocess", [tensor]).as_numpy("PIXELS").shape == (1, *S.PIXELS.dims)
    finally:
        client.close()


@pytest.mark.parametrize("header", [("bad name", "x"), ("key", ""), ("key", "a,b"),
                                    ("key", "a:b")])
def test_a_malformed_admin_header_is_refused_before_start(repository, tmp_path, header):
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


def test_the_servers_token_is_in_no_log_and_no_stubs_environment(server):
    value = server.token[1]
    assert_kept_secret(value, server.process.pid, server.log_file)
    # ... and still opens the repository API, which refuses any request without it.
    assert http_post(server, "/v2/repository/index").status_code == 403
    reply = requests.post(f"http://{server.http_url}/v2/repository/index",
                          headers=server.repository_headers, timeout=30)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("given", ["token", "admin-header"])
def test_make_serve_keeps_the_header_out_of_its_output_the_log_and_the_stubs(serve, tmp_path, given):
    """`python -m tritonlocal serve` with the log echoed: its own token, or an admin header from
    TRITONLOCAL_ADMIN_HEADER. A TRITONLOCAL_RELOAD_TOKEN in its environment is not passed on
    either."""
    planted = f"{flags.TOKEN_HEADER}=planted{uuid.uuid4().hex}"
    env = {"TRITONLOCAL_RELOAD_TOKEN": planted}
    if given == "admin-header":
        env["TRITONLOCAL_ADMIN_HEADER"] = f"{HEADER[0]}={HEADER[1]}"
    launcher, ports = serve("--check-interval", "0.5", quiet=False, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("is ready" in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        (pid,) = [p for p in server_pids() if procs.stat(p)[2] == launcher.pid]
        (rule,) = [a.split("=", 1)[1] for a in proc_text(pid, "cmdline").splitlines()
                   if a.startswith("--http-restricted-api=")]
        name, value = rule.split(":", 1)[1].split("=", 1)
        if given == "admin-header":
            assert (name, value) == HEADER
        else:
            assert name == flags.TOKEN_HEADER and re.fullmatch(r"[0-9a-f]{32}", value), rule
        url = f"http://127.0.0.1:{ports[0]}/v2/repository/index"
        assert requests.post(url, timeout=30).status_code == 403
        assert requests.post(url, headers={name: value}, timeout=30).status_code == 200
        log = tmp_path / "server.log"
        assert_kept_secret(value, pid, log, "".join(lines))
        assert planted.split("=")[1] not in proc_text(pid, "environ")
        assert any(line.startswith("# ") and flags.REDACTED in line for line in lines), \
            "the launcher's output echoes the log, its command line included"
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
        reader.join(10)
    assert launcher.returncode == 0, "".join(lines)
    assert value not in "".join(lines)
