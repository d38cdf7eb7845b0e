"""A sub-model that turns slow and then recovers, and more load than the queues admit.

* ``pipeline_slow`` (deadline 1 s, 8 sub-request threads per instance) calls ``fault_slow`` as its
  classifier; the test makes every execution of ``fault_slow`` take 3 s for a while (its
  ``slow_ms`` file) under steady load. Requests must fail with the orchestrator's deadline error
  on time; the sub-requests given up on must stay bounded (each orchestrator instance waits on at
  most ``subrequest_threads`` at once; the rest expire in its pool unsent); once the model
  recovers, latency must return to what it was.
* ``pipeline_admission`` (the real sub-models; 2 instances x 4 requests in flight, a queue of 8)
  gets 96 clients that each send again as soon as answered: the excess must be refused at once
  with UNAVAILABLE, and every admitted request answered, once, within a bounded time.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from modelgen import variants
from tests.live.support import image, metric

SLOW_MS = 3000
DEADLINE = 1.0            # pipeline_slow's default deadline
ON_TIME = 0.05            # the promise: an error within deadline + 50 ms
ORCHESTRATOR_INSTANCES = S.PIPELINE.instance_count


async def _steady_load(url: str, model: str, stop: threading.Event, log: list,
                       concurrency: int, data: np.ndarray) -> None:
    client = grpcaio.InferenceServerClient(url)

    async def worker(index: int) -> None:
        sequence = 0
        while not stop.is_set():
            inputs = [grpcaio.InferInput("IMAGE", data.shape, "UINT8")]
            inputs[0].set_data_from_numpy(data)
            started = time.monotonic()
            try:
                await client.infer(model, inputs, request_id=f"{index}-{sequence}",
                                   client_timeout=30)
                error = None
            except Exception as failure:  # noqa: BLE001 - recorded
                error = failure
            log.append((started, time.monotonic(), error))
            sequence += 1

    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        await client.close()


def _p50(entries) -> float:
    return statistics.median(end - start for start, end, _ in entries)


def test_a_slow_sub_model_fails_on_time_stays_bounded_and_recovers(server, fault_repository):
    slow_file = fault_repository / "fault_slow" / "slow_ms"
    model = "pipeline_slow"
    gauge = {"model": model}
    abandoned_before = metric(server, "bls_abandoned_subrequests_total", model=model, stage="classifier")
    stop, log, peak = threading.Event(), [], [0.0]
    loader = threading.Thread(target=lambda: asyncio.run(
        _steady_load(server.grpc_url, model, stop, log, concurrency=16, data=image(5))))
    loader.start()
    try:
        time.sleep(3.0)
        slow_from = time.monotonic()
        slow_file.write_text(str(SLOW_MS))
        while time.monotonic() - slow_from < 8.0:  # slow for 8 s
            peak[0] = max(peak[0], metric(server, "bls_inflight_subrequests", **gauge))
        slow_file.unlink()
        recovered_from = time.monotonic()
        time.sleep(10.0)
    finally:
        slow_file.unlink(missing_ok=True)
        stop.set()
        loader.join(60)

    baseline = [e for e in log if e[1] < slow_from]
    # Requests that started once every instance was busy with a 3 s execution.
    degraded = [e for e in log if slow_from + DEADLINE < e[0] and e[1] < recovered_from]
    settle = SLOW_MS / 1000 + DEADLINE  # the last slow execution ends; what it held expires
    after = [e for e in log if e[0] > recovered_from + settle]
    assert baseline and degraded and after
    assert all(error is None for *_, error in baseline)

    late = [end - start for start, end, _ in degraded if end - start > DEADLINE + ON_TIME]
    codes = {error.status() if error else "SUCCESS" for *_, error in degraded}
    # The orchestrator's deadline error: UNAVAILABLE (r24.10 has no DEADLINE_EXCEEDED code).
    assert codes == {"StatusCode.UNAVAILABLE"}, codes
    # Mostly the classifier's; once the slow calls hold every thread, a request's preprocess or
    # embedder sub-request can also expire waiting for one.
    assert all("deadline exceeded in stage '" in error.message() for *_, error in degraded)
    assert any("stage 'classifier'" in error.message() for *_, error in degraded)
    assert not late, f"{len(late)} of {len(degraded)} answered late, up to {max(late):.3f} s"

    # Bounded: at most subrequest_threads sub-requests per orchestrator instance wait on the slow
    # model; the others expire in the pool without being sent.
    bound = ORCHESTRATOR_INSTANCES * int(variants.variant_named("pipeline_slow")
                                         .parameters["subrequest_threads"])
    assert peak[0] <= bound, f"{peak[0]} sub-requests in flight, bound {bound}"

    # Recovered: no errors, and latency back to the baseline's (within 2x + 20 ms of noise).
    assert all(error is None for *_, error in after), {str(e[2])[:80] for e in after if e[2]}
    assert _p50(after) <= 2 * _p50(baseline) + 0.02, (_p50(baseline), _p50(after))
    # Every abandoned sub-request finished (or expired); none is left running.
    deadline = time.monotonic() + 10
    while metric(server, "bls_inflight_subrequests", **gauge) > 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert metric(server, "bls_inflight_subrequests", **gauge) == 0
    abandoned = metric(server, "bls_abandoned_subrequests_total", model=model, stage="classifier")
    print(f"\nbaseline p50 {_p50(baseline) * 1e3:.1f} ms ({len(baseline)} requests); slow: "
          f"{len(degraded)} deadline errors, slowest {max(e[1] - e[0] for e in degraded):.3f} s, "
          f"peak {peak[0]:.0f} sub-requests in flight (bound {bound}), "
          f"{abandoned - abandoned_before:.0f} abandoned; after recovery p50 "
          f"{_p50(after) * 1e3:.1f} ms ({len(after)} requests)")


async def _overload(url: str, model: str, stop: threading.Event, log: list, concurrency: int,
                    data: np.ndarray) -> None:
    """``concurrency`` clients, each sending its next request as soon as the last is answered
    (10 ms after a refusal), until ``stop``: (seconds, id sent, id answered, error) to ``log``."""
    client = grpcaio.InferenceServerClient(url)

    async def worker(index: int) -> None:
        sequence = 0
        while not stop.is_set():
            inputs = [grpcaio.InferInput("IMAGE", data.shape, "UINT8")]
            inputs[0].set_data_from_numpy(data)
            request_id, started = f"over-{index}-{sequence}", time.monotonic()
            try:
                result = await client.infer(model, inputs, request_id=request_id,
                                            client_timeout=60)
                log.append((time.monotonic() - started, request_id, result.get_response().id, None))
            except Exception as error:  # noqa: BLE001 - recorded
                log.append((time.monotonic() - started, request_id, None, error))
                await asyncio.sleep(0.01)
            sequence += 1

    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        await client.close()


def _probe_while_full(url: str, model: str, count: int) -> list[tuple[float, str | None]]:
    """Requests sent one at a time while the model is full: (seconds, error code or None)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    data, found = image(7), []
    for i in range(count):
        inputs = [grpcclient.InferInput("IMAGE", data.shape, "UINT8")]
        inputs[0].set_data_from_numpy(data)
        started = time.monotonic()
        try:
            client.infer(model, inputs, request_id=f"probe-{i}", client_timeout=60)
            code = None
        except InferenceServerException as error:
            code = error.status()
        found.append((time.monotonic() - started, code))
    client.close()
    return found


@pytest.mark.parametrize("clients", [96])
def test_overload_is_refused_fast_and_admitted_requests_stay_bounded(server, clients):
    model = "pipeline_admission"
    answered_before = metric(server, "bls_requests_total", model=model, code="SUCCESS")
    stop, log = threading.Event(), []
    sender = threading.Thread(target=lambda: asyncio.run(
        _overload(server.grpc_url, model, stop, log, clients, image(6))))
    sender.start()
    try:
        # Single requests while the clients keep the model full show what a refusal costs
        # without the load's own client-side overhead.
        time.sleep(2.0)
        probes = _probe_while_full(server.grpc_url, model, 20)
        time.sleep(1.0)
    finally:
        stop.set()
        sender.join(120)
    admitted = [(elapsed, sent, answered) for elapsed, sent, answered, error in log if error is None]
    refused = [(elapsed, error) for elapsed, _, _, error in log if error is not None]
    codes = {error.status() for _, error in refused}
    assert codes == {"StatusCode.UNAVAILABLE"}, {str(e)[:100] for _, e in refused}
    assert all("queue" in error.message().lower() for _, error in refused)
    assert admitted and len(refused) > len(admitted), (len(admitted), len(refused))
    # Exactly once: each admitted request answered under its own id, and Triton counted each.
    assert all(sent == answered for _, sent, answered in admitted)
    assert len({sent for _, sent, _ in admitted}) == len(admitted)
    probes_admitted = sum(code is None for _, code in probes)
    assert metric(server, "bls_requests_total", model=model, code="SUCCESS") - answered_before \
        == len(admitted) + probes_admitted
    admitted_p50 = statistics.median(e for e, _, _ in admitted)
    slowest_admitted = max(e for e, _, _ in admitted)
    probes_refused = sorted(e for e, code in probes if code == "StatusCode.UNAVAILABLE")
    assert {code for _, code in probes} <= {None, "StatusCode.UNAVAILABLE"}
    print(f"\n{clients} clients: {len(admitted)} admitted (p50 {admitted_p50 * 1e3:.0f} ms, max "
          f"{slowest_admitted * 1e3:.0f} ms), {len(refused)} refused UNAVAILABLE; single requests "
          f"while full: {len(probes_refused)} of {len(probes)} refused, in "
          f"{', '.join(f'{e * 1e3:.0f}' for e in probes_refused)} ms")
    # Refused without waiting behind the admitted work; admitted work bounded by what was admitted.
    assert probes_refused, "the model was never full while probed"
    assert statistics.median(probes_refused) < admitted_p50 / 4
    assert slowest_admitted < 10.0, "admitted requests waited without bound"
