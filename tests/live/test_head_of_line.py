"""A slow request holds up no one, with the ensemble as the anchor (issue 47).

``pipeline_park`` and ``pipeline_ensemble_park`` are `pipeline` and its ensemble with the
classifier stage on ``fault_park``, which answers a marked request ``PARK_MS`` late through its
response sender, serving every other request meanwhile (a sub-model slow for one request: it
never blocks its own instance). Every other stage is the real one. ``k`` marked requests are
parked, one after the other as separate batches, then ``OTHERS`` unmarked ones are sent at once,
one client each; their p95 through the orchestrator must stay within
max(2 x the ensemble's, the ensemble's + 250 ms) under the same ``k``, same protocol, same run
(a ``k`` that misses is measured once more, the anchor too, and must meet it then).

The orchestrator's committed config is used: 2 instances, ``max_owed_answers`` 4 each. Up to the
bound a parked request frees its instance after ``OWE_AFTER_SECONDS`` (0.1 s); past it, an
instance holding more keeps its batch until the parked requests end, so k = 8 may hold one
or both instances: the others are then bounded by the parked requests' own time, which the test
states (and the table it prints shows). `pipeline_park_bound0` (the same with
``max_owed_answers`` 0, today's guarantee before issue 47) is measured beside them, not held to
the limit. Its figures are in docs/reliability.md.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bls_models import spec as S
from tests.helpers import image, infer, inference_count

PARK_MS = 1500
OTHERS = 50
SLACK = 0.25  # seconds: the ensemble's p95 + this, or twice it, whichever is more
PARKED_BY = 0.3  # seconds after the last parked request is sent: every one is parked
OUTPUTS = [S.CLASS_IDS.name, S.CLASS_PROBS.name, S.EMBEDDING.name]


def scenario(server, protocol: str, model: str, k: int) -> tuple[float, list]:
    """Park ``k`` requests, then send OTHERS at once: (the others' p95 in seconds, every
    answer's error or None), after the parked ones ended."""
    url = server.http_url if protocol == "http" else server.grpc_url
    module = httpclient if protocol == "http" else grpcclient
    clients = [module.InferenceServerClient(url) for _ in range(OTHERS + k)]
    errors: list = []
    data = image(seed=7)

    def send(index: int, request_id: str) -> float:
        started = time.monotonic()
        try:
            infer(protocol, clients[index], model, "IMAGE", data, "UINT8", OUTPUTS,
                  request_id=request_id)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(f"{request_id}: {error}")
        return time.monotonic() - started

    parked = []
    for i in range(k):
        thread = threading.Thread(target=send, args=(OTHERS + i, f"park{i};fault_park:park:{PARK_MS}"))
        thread.start()
        parked.append(thread)
        time.sleep(0.02)
    time.sleep(PARKED_BY)
    go = threading.Barrier(OTHERS)

    def other(i: int) -> float:
        go.wait()
        return send(i, f"other{i}")

    with ThreadPoolExecutor(OTHERS) as pool:
        latencies = list(pool.map(other, range(OTHERS)))
    for thread in parked:
        thread.join(PARK_MS / 1e3 + 30)
    for client in clients:
        client.close()
    return float(np.percentile(latencies, 95)), errors


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_parked_requests_hold_up_no_one_up_to_the_bound(protocol, server, record_property):
    """k = 1, 2, 4: the others' p95 through `pipeline` within max(2 x, + 250 ms) of the
    ensemble's; k = 8 (past the bound when an instance gets more than 4): within the
    parked requests' own time of it. Every request, parked or not, is answered without error."""
    rows, failures = [], []
    models = ("pipeline_ensemble_park", "pipeline_park", "pipeline_park_bound0")
    for model in models:  # warm: every instance has run
        scenario(server, protocol, model, 0)
    for k in (1, 2, 4, 8):  # 12 measured once (docs/reliability.md): it adds nothing to 8
        for attempt in range(2):
            (ensemble, ensemble_errors), (orchestrated, errors), (held, held_errors) = (
                scenario(server, protocol, model, k) for model in models)
            limit = max(2 * ensemble, ensemble + SLACK) + (PARK_MS / 1e3 if k > 4 else 0)
            rows.append(f"k={k:>2}  ensemble p95 {ensemble * 1e3:7.1f} ms  pipeline p95 "
                        f"{orchestrated * 1e3:7.1f} ms  limit {limit * 1e3:7.1f} ms  (bound 0: "
                        f"{held * 1e3:7.1f} ms)")
            assert [e for e in ensemble_errors + errors + held_errors if e] == [], rows[-1]
            if orchestrated <= limit:
                break
            # One burst's p95 on a loaded host can miss by chance (a second test worker on the
            # same 2 cores: 467 ms against 462 once); an instance held by the parked requests
            # misses by a parked request's time, every time: measured once more.
            rows[-1] += "  (measured again)" if attempt == 0 else ""
        else:
            failures.append(rows[-1])
    table = "\n".join(rows)
    print(f"\nhead-of-line, {protocol}:\n{table}")
    record_property("head_of_line", table)
    assert not failures, f"the others waited on the parked requests:\n{table}"


# A stub SIGKILLed with requests parked (issue 47): r24.10 answers the batch in `execute` ("Stub
# process ... is not healthy", about 1-2 s later) and every request still queued for the instance;
# a request owed through its sender is never answered (its client waits for its own deadline).
PARKED = 6                # parked one after the other on the model's one instance
KILL_DEADLINE = 8.0       # each parked request's client deadline, seconds
ANSWERED_WITHIN = 3.0     # seconds from the kill, for every request not owed
RELOADED_WITHIN = 2.0     # seconds, the per-model reload


@pytest.fixture(scope="module")
def kill_server(repository, fault_repository, tmp_path_factory):
    """A server of its own for the stub kills (the session's is never disturbed), shared by both
    bounds: each kills and reloads its own model's stub."""
    from tests.helpers import server_options
    from tritonlocal import TritonServer

    options = server_options(repository, tmp_path_factory.mktemp("kill"), stop_grace=2.0,
                             extra_args=[f"--model-repository={fault_repository}"])
    with TritonServer(options) as server:
        yield server


@pytest.mark.parametrize("model,bound", [("pipeline_park1", 4), ("pipeline_park1_bound0", 0)])
def test_a_stub_killed_with_requests_parked_strands_at_most_the_bound(model, bound, kill_server):
    """Six requests parked on one instance (each 30 s in fault_park): with the bound at 4, four
    are owed (the gauge says so), the fifth holds ``execute`` and the sixth waits in Triton's
    queue; with the bound at 0 none is owed. After SIGKILL every request not owed is answered
    within 3 s, the owed ones only at their client's deadline (at most the bound), and the
    per-model reload serves again within 2 s."""
    import os
    import signal

    from tests.helpers import metric
    from tritonlocal import reload

    server = kill_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    data, ended = image(seed=3), {}

    def park(i: int) -> None:
        try:
            infer("grpc", client, model, "IMAGE", data, "UINT8", OUTPUTS,
                  request_id=f"k{i};fault_park:park:30000", client_timeout=KILL_DEADLINE)
            ended[i] = (time.monotonic(), "answered")
        except Exception as error:  # noqa: BLE001 - how it ended is what is checked
            ended[i] = (time.monotonic(), str(error).splitlines()[0][:120])

    threads = [threading.Thread(target=park, args=(i,)) for i in range(PARKED)]
    for thread in threads:
        thread.start()
        time.sleep(0.25)  # each its own batch, owed (or held) before the next comes
    time.sleep(0.5)  # the gauge is published every 0.2 s
    owed = metric(server, "bls_owed_answers", model=model)
    (victim,) = server.stub_pids(model)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(KILL_DEADLINE + 10)
    started = time.monotonic()
    reload.reload_model(server.http_url, model, server.admin_headers, "after-kill")
    reloaded = time.monotonic() - started
    after = infer("grpc", client, model, "IMAGE", data, "UINT8", OUTPUTS, request_id="after")
    client.close()
    late = sorted(round(at - killed, 2) for at, _ in ended.values() if at - killed > ANSWERED_WITHIN)
    stranded = [how for at, how in ended.values() if at - killed > ANSWERED_WITHIN]
    print(f"\n{model}: owed {owed:.0f} at the kill; answered within {ANSWERED_WITHIN} s: "
          f"{PARKED - len(late)}; later (stranded until their deadline): {late}; reload "
          f"{reloaded:.2f} s; {sorted(set(how for _, how in ended.values()))}")
    assert owed == bound, f"{owed} owed at the kill, bound {bound}"
    assert len(late) == bound, f"stranded: {late}, bound {bound}"
    assert all("DEADLINE_EXCEEDED" in how for how in stranded), stranded  # the client's own
    assert reloaded <= RELOADED_WITHIN, reloaded
    assert after.as_numpy(S.EMBEDDING.name).shape == (1, S.EMBEDDING.dims[0])





# An answer leaves when it is ready (issue 47). r24.10's batcher gives one `execute` only
# requests of equal shape (a variable-size input without allow_ragged_batch: core
# `backend_model.cc` 808-816, `dynamic_batch_scheduler.cc` 553-560) and at most max_batch_size
# rows (547-550), which is every committed orchestrator's group size: with the committed configs
# a batch is one group, and a short document never shares an execute with a long one (tried: 27
# requests, 27 executions). Live, an answer is decided apart from its batch-mates' in two ways,
# each checked here with a mate parked LONG_MS at the classifier:
# * ``deadline``: one group (`pipeline_park1`); the other request's SHORT_US deadline passes
#   while the group's classifier sub-request is parked, and its deadline error leaves then;
# * ``ready``: a classifier with a batch of 1 (`pipeline_park_single`), so each request is a
#   group of its own; the other one's success leaves when its group is done.
# A first request, parked FIRST_MS, holds the one instance while the pair queues, so Triton hands
# the pair to one `execute` (the execution count says so). The other's answer must come at least
# LONG_MS - READY_SLACK before its parked mate's. With the bound at 0, without answers sent when
# decided, both would leave together. The 20 ms promise itself is the fake's test
# (tests/unit/test_owed.py).
FIRST_MS, LONG_MS, SHORT_US, READY_SLACK, READY_ROUNDS = 150, 1500, 300_000, 0.5, 3
# how -> (model, its classifier, the other request's infer arguments)
DECIDED = {"deadline": ("pipeline_park1", "fault_park", {"timeout": SHORT_US}),
           "ready": ("pipeline_park_single", "fault_park_single", {})}


def _executions(client, model: str) -> tuple[int, int]:
    return inference_count(client, model, "execution_count"), inference_count(client, model)


@pytest.mark.parametrize("bound", ["committed", "0"])
@pytest.mark.parametrize("how", list(DECIDED))
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_answer_decided_apart_leaves_before_its_parked_batch_mate(protocol, how, bound,
                                                                     server):
    model, classifier, kwargs = DECIDED[how]
    model += "_bound0" if bound == "0" else ""
    url = server.http_url if protocol == "http" else server.grpc_url
    module = httpclient if protocol == "http" else grpcclient
    stats = grpcclient.InferenceServerClient(server.grpc_url)
    data = image(seed=11)

    def send(request_id: str, ended: dict, **kwargs) -> None:
        client = module.InferenceServerClient(url)
        try:
            infer(protocol, client, model, "IMAGE", data, "UINT8", OUTPUTS,
                  request_id=request_id, **kwargs)
            ended[request_id.split(";")[0]] = (time.monotonic(), None)
        except Exception as error:  # noqa: BLE001 - a deadline error is expected of one
            ended[request_id.split(";")[0]] = (time.monotonic(), str(error))
        client.close()

    rows = []
    for _attempt in range(3 * READY_ROUNDS):
        before, ended = _executions(stats, model), {}
        first = threading.Thread(target=send, args=(f"first;{classifier}:park:{FIRST_MS}",
                                                       ended))
        first.start()
        time.sleep(0.03)  # the first is in execute: the next two queue together
        sent = time.monotonic()
        pair = [threading.Thread(target=send, args=(f"long;{classifier}:park:{LONG_MS}",
                                                      ended)),
                threading.Thread(target=send, args=("other", ended), kwargs=kwargs)]
        for thread in pair:
            thread.start()
        for thread in (first, *pair):
            thread.join(60)
        after = _executions(stats, model)
        if (after[0] - before[0], after[1] - before[1]) != (2, 3):
            continue  # the pair did not share an execute: this round says nothing
        (other, error), (long, long_error) = ended["other"], ended["long"]
        assert long_error is None and ended["first"][1] is None, ended
        if how == "deadline":
            assert error and "deadline exceeded in stage 'classifier'" in error, ended
        else:
            assert error is None, ended
        rows.append((round(other - sent, 3), round(long - sent, 3)))
        if len(rows) == READY_ROUNDS:
            break
    stats.close()
    print(f"\n{model} {protocol}: (other, parked mate) answered after the pair was sent, s: "
          f"{rows}")
    assert len(rows) == READY_ROUNDS, f"the pair shared an execute in {len(rows)} rounds only"
    assert all(long - other >= LONG_MS / 1e3 - READY_SLACK for other, long in rows), rows
