"""tritonserver over its memory bound is drained and restarted as a whole, by the supervisor (as
by the Kubernetes liveness probe and the container's watcher): requests in flight are answered,
not dropped, and the server serves again afterwards (docs/reliability.md, "Memory")."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import tritonclient.grpc as grpcclient

from tests.helpers import image, server_options, timed_infer
from tritonlocal import TritonServer
from tritonlocal.launcher import Supervisor

CLIENTS = 48
ROWS = 16  # each request a full batch: the drain has seconds of work to finish


def test_a_server_over_its_memory_bound_is_drained_and_restarted(repository, tmp_path):
    with TritonServer(server_options(repository, tmp_path, stop_grace=5.0)) as server:
        events = []
        supervisor = Supervisor(server, interval=0.5, max_server_memory_mib=1.0,
                                drain_grace=40.0, log=events.append)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert timed_infer(client, "grpc", "pipeline", image(0, ROWS)).error is None  # warm
        client.close()
        first_pid = server.process.pid
        started = threading.Event()

        def send(index: int):
            own = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                started.set()
                return timed_infer(own, "grpc", "pipeline", image(index, ROWS),
                                   request_id=f"drain-{index}", client_timeout=60.0)
            finally:
                own.close()

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(send, i) for i in range(CLIENTS)]
            started.wait(10)
            time.sleep(0.5)  # in the server: the drain must answer them
            in_flight = sum(not f.done() for f in futures)
            restarted = supervisor.check_once()
            outcomes = [f.result(timeout=120) for f in futures]
        # A request still on its way when the drain has unloaded `pipeline` is refused with
        # NOT_FOUND, as the drain means it to be (seen once with a second test worker busy: one
        # of 48 had not reached the server 0.5 s after the first was sent); one that reached it
        # is answered.
        errors = [str(o.error) for o in outcomes if o.error is not None]
        refused = [e for e in errors if "NOT_FOUND" in e and "no available versions" in e]
        assert in_flight - len(refused) >= CLIENTS // 4, \
            f"only {in_flight - len(refused)} requests in flight at the drain"
        assert restarted and server.process.pid != first_pid
        assert any("over its bound of 1 MiB: drain and restart it" in line for line in events)
        failed = [e for e in errors if e not in refused]
        assert failed == [], f"{len(failed)} of {CLIENTS} requests in flight were dropped: " \
                             f"{failed[:3]}"
        supervisor.max_server_memory_mib = 0.0
        assert not supervisor.check_once()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert timed_infer(client, "grpc", "pipeline", image(1)).error is None
        client.close()
