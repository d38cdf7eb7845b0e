"""A python stub killed under load. Triton 2.51 never restarts it and keeps answering "ready", so
``tritonlocal.liveness`` (the supervisor's check, and the Kubernetes probes) must see the dead
stub, and the supervisor must reload that model alone while every other model keeps serving:
no request to another model fails, the model answers again within seconds, the replaced copy's
stubs are retired, and nothing hangs past its client's deadline. A server that dies is still
restarted whole; a model whose stub keeps dying is given up on, alone.

Each test here starts its own server over the committed repository (about 4 s); the session
server is never disturbed."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from bls_models import spec as S
from reliability import recovery
from reliability.accounting import owed_bound
from reliability.recovery import kill_under_load
from tests.helpers import PYTHON_MODEL, image, server_options, timed_infer
from tritonlocal import TritonServer, procs, reload
from tritonlocal.launcher import Supervisor
from tritonlocal.liveness import server_pids, stubs_of

ROOT = Path(__file__).resolve().parents[2]
# The promise checked here, with room for a busy 2-core host: the model answers again within
# 10 s of its stub's death (measured: 1.0-1.5 s, docs/reliability.md, `make bench-recovery`).
RECOVERY_LIMIT = 10.0
DEADLINE = 3.0            # each pipeline request's client deadline (and Triton timeout), seconds
SLACK = 1.0               # a request ends within DEADLINE + SLACK, or it hung
# The other models' requests get a deadline long enough that on a busy 2-core host (the suite
# under a busy loop: 3 of 257 missed 3 s there) only an error, not slowness, can fail them.
OTHERS_DEADLINE = 20.0


@pytest.fixture
def fresh(repository, tmp_path):
    # A 2 s grace: Triton 2.51 never unloads a model one of whose stubs was killed, so its
    # clean exit waits out the grace whatever its length; these tests check no exit status.
    with TritonServer(server_options(repository, tmp_path, stop_grace=2.0)) as server:
        yield server


def probe(server: TritonServer, *extra: str, pid: bool = True) -> subprocess.CompletedProcess:
    """The liveness command exactly as a Kubernetes exec probe would run it."""
    command = [sys.executable, "-m", "tritonlocal.liveness", "--url", server.http_url, "--json",
               *extra]
    if pid:
        command += ["--server-pid", str(server.process.pid)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def http_status(server: TritonServer, path: str) -> int:
    with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10) as response:
        return response.status


def instance_of(pid: int) -> str:
    return procs.process(pid).stub.instance


def kill_and_wait_dead(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if procs.stat(pid)[1] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"stub {pid} still alive 10 s after SIGKILL")


def test_the_probe_sees_a_killed_stub_that_triton_still_calls_ready(fresh, server):
    healthy = probe(fresh)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    report = json.loads(healthy.stdout)
    # Only the python backend's models have stubs; the ONNX models run inside tritonserver.
    assert set(report["checked_models"]) == {m.name for m in S.BLS_MODELS}
    assert report["missing"] == [] and report["zombies"] == []

    victim = fresh.stub_pids("pipeline")[0]
    instance = instance_of(victim)
    kill_and_wait_dead(victim)

    # What Triton itself says: still ready, while the instance fails requests routed to it.
    assert http_status(fresh, "/v2/health/ready") == 200
    assert http_status(fresh, "/v2/models/pipeline/ready") == 200
    client = grpcclient.InferenceServerClient(fresh.grpc_url)
    failures = []
    for _ in range(200):
        outcome = timed_infer(client, "grpc", "pipeline", image(0))
        if outcome.error is not None:
            failures.append(str(outcome.error))
            break
    client.close()
    assert failures and f"Stub process '{instance}' is not healthy" in failures[0], failures

    dead = probe(fresh)
    assert dead.returncode == 1, dead.stdout + dead.stderr
    report = json.loads(dead.stdout)
    assert report["missing"] == [instance]
    assert set(report["zombies"]) <= {victim}
    assert report["live"] is True, "Triton's own liveness does not see it"
    # Without --server-pid the probe needs exactly one tritonserver; here there are two.
    unsure = probe(fresh, pid=False)
    assert unsure.returncode == 2 and "--server-pid" in unsure.stderr


def test_a_pipeline_stub_killed_under_mixed_load_costs_only_pipeline_a_moment(fresh):
    """pipeline, tag_pipeline and pipeline_ensemble under load from gRPC and HTTP clients; one
    pipeline stub SIGKILLed; the supervisor reloads pipeline alone."""
    supervisor = Supervisor(fresh, interval=0.5, restart_grace=5.0, retire_grace=3.0,
                            log=lambda line: print(line)).start()
    try:
        run, answers = kill_under_load(fresh, supervisor, "pipeline", before=3.0, after=3.0,
                                       deadline=DEADLINE, others_deadline=OTHERS_DEADLINE,
                                       wait_retired=False)
        retiring, retired = list(supervisor.reloader.to_kill), set(supervisor.reloader.retired)
        switched = max(t for t, what in supervisor.reloader.events
                       if what == "reloaded: pipeline")
        # The probe commands as Kubernetes runs them agree: live and ready again.
        checks = {extra: probe(fresh, *extra) for extra in ((), ("--ready",))}
    finally:
        supervisor.stop()
    assert supervisor.error is None, supervisor.error
    print(f"\n{run}")
    # Nothing but pipeline noticed, and the server was never restarted.
    assert run.server_restarts == 0, run.events
    assert run.others_failed == 0, run.failures
    assert all(answers[m] for m in answers), "a model got no requests: the test tested nothing"
    # pipeline answers again within the bound, and only pipeline's own requests failed.
    assert run.reloaded_s is not None and run.reloaded_s < RECOVERY_LIMIT, run.events
    assert run.answering_s < RECOVERY_LIMIT, run
    assert run.in_flight_failed + run.victim_failed_after_kill > 0, \
        "the kill had no visible effect: the test did not test anything"
    # No pipeline request outlived its deadline: what the dead stub held ended at the client's
    # deadline at the latest (r24.10 never answers it: docs/reliability.md).
    slowest = max(a.seconds for a in answers["pipeline"])
    assert slowest < DEADLINE + SLACK, slowest
    # Afterwards: every pipeline stub that serves is new, the replaced copy's stubs are retired,
    # and the checks agree (in-process, and the probe commands).
    assert run.stubs_all_new and run.alive_after, run
    serving = [p for p in fresh.stub_pids("pipeline") if p not in retired]
    assert len(serving) == S.PIPELINE.instance_count
    # The replaced copy's live stubs stop only once no request they hold can still be within
    # its deadline: max_deadline_ms after the switch, plus the grace.
    longest = int(S.PIPELINE.parameters["max_deadline_ms"]) / 1e3
    assert retiring and all(entry.due >= switched + longest for entry in retiring), retiring
    for extra, checked in checks.items():
        assert checked.returncode == 0, (extra, checked.stdout, checked.stderr)
    assert not reload.state_path(fresh.process.pid).exists(), "the supervisor left its state"
    group = fresh.process.pid
    fresh.stop()
    with pytest.raises(ProcessLookupError):  # no process of the server's group is left
        os.killpg(group, 0)


# Requests in flight at a stub kill (issue 27): the server answers those inside ``execute`` about
# a second later (r24.10's health check); only those owed through response senders are never
# answered: at most ``max_owed_answers`` per killed instance (issue 47).
KILLS = 5                 # within the per-model guard of 5 reloads in 10 minutes
ANSWERED_WITHIN = 2.0     # seconds from the kill
ANSWERED_SHARE = 0.95


def test_requests_in_flight_at_a_stub_kill_are_answered_by_the_server(fresh):
    """16 gRPC clients on ``pipeline`` with 3 s deadlines; a ``pipeline`` stub SIGKILLed five
    times, each once the supervisor has brought the model back: of the requests in flight at
    the kills, all but those the killed instances owed (at most ``max_owed_answers`` per kill)
    are answered by the server (with any status) within 2 s, allowing 5 % for this host."""
    import asyncio

    from tritonlocal.load import closed_loop

    supervisor = Supervisor(fresh, interval=0.5, restart_grace=5.0, retire_grace=3.0,
                            log=lambda line: print(line)).start()
    stop, answers, kills = threading.Event(), [], []
    load = threading.Thread(target=lambda: asyncio.run(closed_loop(
        fresh.grpc_url, "pipeline", 16, image(3), stop, timeout_us=int(DEADLINE * 1e6),
        retry_pause=0.05, answers=answers, client_timeout=DEADLINE)))
    load.start()
    try:
        time.sleep(3.0)
        for _ in range(KILLS):
            reloaded = len([1 for _, what in supervisor.reloader.events
                            if what == "reloaded: pipeline"])
            # a stub that serves: the replaced copy's retired stubs hold nothing new
            victim = min(pid for pid in fresh.stub_pids("pipeline")
                         if pid not in supervisor.reloader.retired)
            kills.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)
            give_up = time.monotonic() + 30
            while (len([1 for _, what in supervisor.reloader.events
                        if what == "reloaded: pipeline"]) == reloaded
                   and time.monotonic() < give_up and supervisor.error is None):
                time.sleep(0.05)
            time.sleep(2.0)
    finally:
        stop.set()
        load.join(DEADLINE + 30)
        supervisor.stop()
    assert supervisor.error is None, supervisor.error
    reloads = [what for _, what in supervisor.reloader.events if what == "reloaded: pipeline"]
    assert len(reloads) == KILLS, f"{KILLS} kills of serving stubs, {len(reloads)} reloads"
    in_flight = [(a, at) for at in kills for a in answers if a.started < at <= a.finished]
    on_time = [a for a, at in in_flight if a.finished - at <= ANSWERED_WITHIN]
    owed = [a for a, at in in_flight if a.finished - at > ANSWERED_WITHIN]
    for n, at in enumerate(kills):
        late = sorted(round(a.finished - at, 2) for a in answers
                      if a.started < at <= a.finished and a.finished - at > ANSWERED_WITHIN)
        print(f"kill {n + 1}: {sum(a.started < at <= a.finished for a in answers)} in flight, "
              f"answered later than {ANSWERED_WITHIN} s after: {late}")
    print(f"\n{KILLS} kills: {len(in_flight)} requests in flight, {len(on_time)} answered within "
          f"{ANSWERED_WITHIN} s, {len(owed)} later (owed through senders: "
          f"{sorted({a.code for a in owed})})")
    assert len(in_flight) >= KILLS, "no request was in flight at the kills: nothing was tested"
    stranded = KILLS * owed_bound("pipeline")
    assert len(owed) <= stranded + (1 - ANSWERED_SHARE) * len(in_flight), \
        (len(owed), stranded, len(in_flight))


def test_the_probes_follow_the_reloader(fresh):
    """While a reloader watches, a dead stub keeps the pod live but not ready; once the model
    is back, both pass; when the reloader has given up on a model, liveness fails."""
    supervisor = Supervisor(fresh, interval=0.5, retire_grace=1.0, max_reloads=1,
                            log=lambda _: None)
    supervisor.check_once()  # publishes the state file
    assert probe(fresh).returncode == 0 and probe(fresh, "--ready").returncode == 0
    victim = fresh.stub_pids("tag_pipeline")[0]
    kill_and_wait_dead(victim)
    # Found but not yet reloaded: live (a reloader is on it), not ready.
    supervisor.reloader.publish()
    live, ready = probe(fresh), probe(fresh, "--ready")
    assert live.returncode == 0, live.stdout + live.stderr
    assert ready.returncode == 1 and "tag_pipeline" in ready.stdout, ready.stdout
    assert supervisor.check_once() is False  # reloaded, not restarted
    assert probe(fresh).returncode == 0 and probe(fresh, "--ready").returncode == 0
    assert victim not in fresh.stub_pids("tag_pipeline")
    # The second death within the window is one too many for max_reloads=1: given up on.
    # (a stub of the new copy: the replaced copy's are retired, and stop after retire_grace)
    kill_and_wait_dead(next(pid for pid in fresh.stub_pids("tag_pipeline")
                            if pid not in supervisor.reloader.retired))
    assert supervisor.check_once() is False
    given_up = probe(fresh)
    assert given_up.returncode == 1 and "tag_pipeline" in given_up.stdout, given_up.stdout
    assert "tag_pipeline" in supervisor.reloader.state.failed
    # ... while the other models keep serving, and the server was never restarted.
    client = grpcclient.InferenceServerClient(fresh.grpc_url)
    try:
        for model in ("pipeline", "pipeline_ensemble"):
            assert timed_infer(client, "grpc", model, image(2)).error is None
    finally:
        client.close()
    assert supervisor.events == [] and fresh.is_running()
    supervisor.reloader.forget()


def test_the_containers_watcher_reloads_a_model_whose_stub_died(fresh):
    """`python3 -m tritonlocal.reload`, the process scripts/container-serve.sh starts beside the
    container's tritonserver, against a real server: it reloads the model, the probes follow,
    and it stops cleanly on SIGTERM, removing its state."""
    (name, value), = fresh.admin_headers.items()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "tritonlocal.reload", "--url", fresh.http_url, "--server-pid",
         str(fresh.process.pid), "--header", f"{name}={value}", "--retire-grace", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = reload.state_path(fresh.process.pid)
    try:
        deadline = time.monotonic() + 30
        while not state.exists():
            assert watcher.poll() is None and time.monotonic() < deadline, watcher.stdout.read()
            time.sleep(0.1)
        assert probe(fresh).returncode == 0 and probe(fresh, "--ready").returncode == 0
        victim = fresh.stub_pids("pipeline")[0]
        killed_at = time.monotonic()
        kill_and_wait_dead(victim)
        while True:  # back: ready, with a new stub per instance beside the retired ones
            # (the replaced copy's live stubs stop only after max_deadline_ms, 120 s)
            published = reload.State.read(state)
            retired = set(published.retired) if published else set()
            stubs = [pid for pid in fresh.stub_pids("pipeline") if pid not in retired]
            if (victim not in stubs and len(stubs) == S.PIPELINE.instance_count
                    and probe(fresh, "--ready").returncode == 0):
                break
            assert time.monotonic() - killed_at < RECOVERY_LIMIT + 5, probe(fresh, "--ready").stdout
            time.sleep(0.2)
        assert probe(fresh).returncode == 0
        client = grpcclient.InferenceServerClient(fresh.grpc_url)
        try:
            assert timed_infer(client, "grpc", "pipeline", image(4)).error is None
        finally:
            client.close()
    finally:
        watcher.send_signal(signal.SIGTERM)
        output = watcher.communicate(timeout=30)[0]
    assert watcher.returncode == 0, output
    assert "reloading 'pipeline' alone" in output and "serving again" in output, output
    assert not state.exists()


def test_the_supervisor_restarts_a_server_that_died(fresh):
    supervisor = Supervisor(fresh, interval=0.5, restart_grace=5.0, log=lambda _: None)
    first = fresh.process.pid
    os.kill(first, signal.SIGKILL)
    fresh.process.wait()
    assert supervisor.check_once() is True
    assert fresh.process.pid != first and fresh.liveness().ok
    assert [what for _, what in supervisor.events][0].startswith("restart: tritonserver is not running")
    with pytest.raises(ProcessLookupError):  # nothing of the dead server's group is left
        os.killpg(first, 0)


def test_a_crash_loop_of_the_server_makes_the_supervisor_give_up(fresh):
    supervisor = Supervisor(fresh, interval=0.5, restart_grace=2.0, max_restarts=0,
                            log=lambda _: None)
    os.kill(fresh.process.pid, signal.SIGKILL)
    fresh.process.wait()
    with pytest.raises(Exception, match="giving up"):
        supervisor.check_once()
    assert not fresh.is_running()


def test_make_serve_reloads_the_model_whose_stub_died(serve):
    """The same recovery through `python -m tritonlocal serve` (what `make serve` runs)."""
    launcher, ports = serve("--check-interval", "0.5")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("is ready" in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        stubs = [s for s in stubs_of(server_pid(launcher.pid)) if s.state != "Z"]
        assert len(stubs) == PYTHON_MODEL.instance_count  # the ONNX model has none
        victim = stubs[0]
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        while not any("serving again" in line for line in lines):
            assert time.monotonic() - killed_at < RECOVERY_LIMIT, "".join(lines)
            time.sleep(0.2)
        reloading = next(line for line in lines if "reloading" in line)
        assert victim.instance in reloading and "without a live stub" in reloading
        assert f"reloading '{PYTHON_MODEL.name}' alone" in reloading
        assert not any("restarting tritonserver" in line for line in lines), "".join(lines)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
        answers = [timed_infer(client, "grpc", model, image(1))
                   for model in (PYTHON_MODEL.name, "preprocess")]
        client.close()
        assert [a.error for a in answers] == [None, None], answers
        assert all(a.result.as_numpy("PIXELS").shape == (1, 3, 224, 224) for a in answers)
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
    assert launcher.returncode == 0, "".join(lines)


def test_the_recovery_benchmark_runs_and_writes_its_results(repository, tmp_path):
    """`make bench-recovery` (reliability/recovery.py) on one short run: a server of its own, a stub
    killed, the CSV, JSON and markdown written with the run's figures."""
    assert recovery.main(["--runs", "1", "--before-s", "2", "--after-s", "1", "--no-wait-retired",
                          "--model-repository", str(repository), "--out", str(tmp_path)]) == 0
    (row,) = list(csv.DictReader((tmp_path / "recovery.csv").open()))
    assert row["victim"] == "pipeline" and float(row["reloaded_s"]) > 0
    assert int(row["others_requests"]) > 0
    (run,) = json.loads((tmp_path / "recovery.json").read_text())
    assert any("reloaded: pipeline" in event for event in run["events"])
    assert "| 1 |" in (tmp_path / "recovery.md").read_text()


def server_pid(launcher_pid: int) -> int:
    """The tritonserver child of a `python -m tritonlocal serve` process."""
    children = [pid for pid in server_pids() if procs.stat(pid)[2] == launcher_pid]
    assert children, "no tritonserver child"
    return children[0]
