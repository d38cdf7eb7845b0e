"""The launcher against real tritonserver processes: its error paths, clean shutdown, and what
Triton's onnxruntime backend does with a dynamic batch (with test repositories built from the
spec)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bls_models import spec as S
from tests.helpers import PYTHON_MODEL, make_repository, mixed_repository
from tests.helpers import server_options as options
from tritonlocal import LauncherError, TritonServer, launcher, runtime
from tritonlocal.launcher import kill_orphaned_stubs, remove_stale_regions, shm_regions

ROOT = Path(__file__).resolve().parents[2]


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_model_whose_onnx_does_not_match_its_config_names_model_and_tensors(repository, tmp_path):
    # classifier's config over embedder's ONNX file: output EMBEDDING instead of LOGITS.
    repo = make_repository(tmp_path / "repo", repository, S.CLASSIFIER,
                           onnx_from={"classifier": S.EMBEDDER})
    started = time.monotonic()
    with pytest.raises(LauncherError) as failure:
        TritonServer(options(repo, tmp_path)).start()
    message = str(failure.value)
    assert "failed to load" in message and "classifier" in message
    assert "'LOGITS'" in message and "EMBEDDING" in message
    assert "log" in message and "server.log" in message  # the log tail is attached
    assert time.monotonic() - started < 60


def test_a_missing_onnx_file_says_to_run_make_models(repository, tmp_path):
    repo = make_repository(tmp_path / "repo", repository, S.PREPROCESS,
                           onnx_from={"preprocess": None})
    with pytest.raises(LauncherError,
                       match=r"preprocess: .*model\.onnx.*does not exist: run `make models`"):
        TritonServer(options(repo, tmp_path)).start()


LOCK = "boost::interprocess::lock_exception"


def aborting_server(tmp_path: Path, monkeypatch, aborts: int, message: str,
                    death: str = "kill -ABRT $$") -> Path:
    """Make the launcher start a wrapper instead of tritonserver: its first ``aborts`` starts
    print ``message`` and die of SIGABRT, as r24.10 does when its python backend's IPC lock
    throws at start (``death``: how they end instead); later ones exec the real server.
    Returns the file counting the starts."""
    real = runtime.find_installation()
    starts = tmp_path / "starts"
    wrapper = tmp_path / "tritonserver"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"n=$(( $(cat {starts} 2>/dev/null || echo 0) + 1 )); echo $n > {starts}\n"
        f"if [ $n -le {aborts} ]; then\n"
        f"  echo \"terminate called after throwing an instance of '{message}'\"\n"
        f"  {death}\n"
        "fi\n"
        f'exec {real.server} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(runtime, "find_installation",
                        lambda: dataclasses.replace(real, server=wrapper))
    return starts


def test_a_server_aborting_at_start_on_the_ipc_lock_is_started_again(repository, tmp_path,
                                                                      monkeypatch):
    starts = aborting_server(tmp_path, monkeypatch, aborts=1, message=LOCK)
    repo = make_repository(tmp_path / "repo", repository, S.PREPROCESS)
    with TritonServer(options(repo, tmp_path)) as server:
        assert server.is_running()
        assert starts.read_text().split() == ["2"]
        log = server.log_file.read_text()
        assert "aborted before it was ready (boost::interprocess::lock_exception, attempt 1 of 2)" in log
        assert log.count("# /") == 2  # each start's command line
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            assert client.is_model_ready("preprocess")


@pytest.mark.parametrize("aborts, message, death, expected_starts", [
    (launcher.START_ATTEMPTS + 1, LOCK, "kill -ABRT $$", launcher.START_ATTEMPTS),
    (1, "std::bad_alloc", "kill -ABRT $$", 1),
    (1, LOCK, "exit 1", 1),
], ids=["keeps-aborting", "another-abort", "not-an-abort"])
def test_other_exits_and_repeated_aborts_fail_the_start(repository, tmp_path, monkeypatch,
                                                        aborts, message, death, expected_starts):
    starts = aborting_server(tmp_path, monkeypatch, aborts, message, death)
    repo = make_repository(tmp_path / "repo", repository, S.PREPROCESS)
    with pytest.raises(LauncherError, match=r"exited with code -?\d+ before it was ready") as failure:
        TritonServer(options(repo, tmp_path)).start()
    assert message in str(failure.value)  # the log's tail
    assert starts.read_text().split() == [str(expected_starts)]


def test_a_port_in_use_fails_before_starting(server, repository, tmp_path):
    opts = options(repository, tmp_path)
    opts.http_port = server.options.http_port  # held by the session's live server
    launcher = TritonServer(opts)
    with pytest.raises(LauncherError, match=rf"http port {opts.http_port} .* already in use"):
        launcher.start()
    assert launcher.process is None


def test_too_little_dev_shm_fails_before_starting(repository, tmp_path):
    # /dev/shm's real free space, and regions so large that the committed repository's
    # python-backend instances cannot all have one: the launcher must refuse, naming the remedy.
    # Only the python backend's models have stubs (the ONNX models run inside tritonserver).
    stubs = sum(m.instance_count for m in S.ALL_MODELS if m.backend == "python")
    assert stubs >= 2
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    launcher = TritonServer(options(repository, tmp_path, shm_default_bytes=free // 2))
    with pytest.raises(LauncherError, match=rf"/dev/shm has \d+ MiB free, but the {stubs} "
                                            r"python-backend model instances need .*--shm-size"):
        launcher.start()
    assert launcher.process is None


def test_not_ready_in_time_is_reported_and_the_server_is_stopped(repository, tmp_path):
    # A server caught mid-start may not heed SIGINT: a short grace before SIGKILL (20 s else).
    launcher = TritonServer(options(repository, tmp_path, ready_timeout=0.0, stop_grace=2.0))
    with pytest.raises(LauncherError, match=r"not ready within 0 s"):
        launcher.start()
    assert launcher.process is None and not launcher.is_running()


def test_stop_takes_every_stub_with_it(repository, tmp_path):
    python_model = PYTHON_MODEL
    repo = mixed_repository(tmp_path / "repo", repository)
    with TritonServer(options(repo, tmp_path)) as launcher:
        pid = launcher.process.pid
        stubs = subprocess.run(["pgrep", "-g", str(pid), "-f", "triton_python_backend_stub"],
                               capture_output=True, text=True).stdout.split()
        assert len(stubs) == python_model.instance_count
        assert sorted(launcher.liveness().checked_models) == [python_model.name]
        prefix = launcher._shm_prefix
        assert len(shm_regions(prefix)) == python_model.instance_count
    assert not group_alive(pid), "processes of the server's group survived stop()"
    assert shm_regions(prefix) == [], "shared-memory regions left in /dev/shm"


def fake_stub(tmp_path: Path, server_pid: int) -> subprocess.Popen:
    """A process whose argv reads like a python-backend stub of one of our servers
    (argv[2] = its shm region, argv[5] = its server's pid) and that just sleeps."""
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(sys.executable)
    script = tmp_path / "model.py"
    script.write_text("import time\ntime.sleep(120)\n")
    return subprocess.Popen([str(stub), str(script), "tritonlocal_999999999_test_x", "1", "1",
                             str(server_pid), "backends", "0", "m_0_0", "DEFAULT"])


def test_a_launcher_start_kills_stubs_whose_server_is_gone(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists: the orphan's server
    for name in ("orphan", "alive"):
        (tmp_path / name).mkdir()
    orphan = fake_stub(tmp_path / "orphan", dead.pid)
    # One whose "server" is alive and its parent (this test process): not an orphan.
    alive = fake_stub(tmp_path / "alive", os.getpid())
    try:
        time.sleep(0.5)
        killed = kill_orphaned_stubs()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert orphan.pid in killed and alive.pid not in killed
        assert alive.poll() is None
    finally:
        for process in (orphan, alive):
            process.kill()
            process.wait()


def test_the_server_dies_with_its_launcher(serve):
    launcher, _ = serve()
    try:
        for line in launcher.stdout:
            if "is ready" in line:
                break
        server_pid = int(subprocess.run(["pgrep", "-P", str(launcher.pid), "tritonserver"],
                                        capture_output=True, text=True).stdout.split()[0])
        launcher.kill()  # SIGKILL: no chance to clean up
        launcher.wait()
        deadline = time.monotonic() + 30
        while group_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(server_pid), "server or stubs outlived a killed launcher"
        # Whatever /dev/shm regions its stubs left are orphans now; a launcher start removes them.
        remove_stale_regions()
        assert shm_regions(f"tritonlocal_{launcher.pid}_") == []
    finally:
        launcher.kill()


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "sigint-ignored"])
def test_ctrl_c_stops_serve_cleanly(serve, sigint_ignored):
    launcher, (http, grpc, metrics) = serve(sigint_ignored=sigint_ignored)
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if "Ctrl-C" in line:
            break
    banner = "".join(lines)
    assert f"http://127.0.0.1:{http}" in banner and f"127.0.0.1:{grpc}" in banner
    assert f"127.0.0.1:{metrics}/metrics" in banner and "curl" in banner
    server_pid = int(subprocess.run(["pgrep", "-P", str(launcher.pid), "tritonserver"],
                                    capture_output=True, text=True).stdout.split()[0])
    launcher.send_signal(signal.SIGINT)
    rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    assert "tritonserver stopped (exit code 0)" in rest
    assert not group_alive(server_pid)


@pytest.fixture(scope="module")
def batching_server(repository, tmp_path_factory):
    """Classifier and tagger with one instance and a long batching window, so requests sent
    together are deterministically executed together."""
    tmp = tmp_path_factory.mktemp("batching")
    slow_window = S.BatchingSpec(preferred_batch_sizes=(4,), max_queue_delay_us=2_000_000)
    models = [dataclasses.replace(m, batching=slow_window, instance_count=1)
              for m in (S.CLASSIFIER, S.TAGGER)]
    repo = make_repository(tmp / "repo", repository, *models)
    with TritonServer(options(repo, tmp)) as launcher:
        yield launcher


def send_together(url: str, model: str, name: str, batches: list[np.ndarray], dtype: str):
    client = grpcclient.InferenceServerClient(url)
    results = []
    try:
        for data in batches:
            infer_input = grpcclient.InferInput(name, list(data.shape), dtype)
            infer_input.set_data_from_numpy(data)
            client.async_infer(model, [infer_input],
                               callback=lambda result, error: results.append((result, error)))
        deadline = time.monotonic() + 60
        while len(results) < len(batches) and time.monotonic() < deadline:
            time.sleep(0.01)
        return results
    finally:
        client.close()


def execution_stats(url: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) once the execution count is reported: the backend
    reports a batch's statistics after sending its responses, so a read right after the last
    answer can see the inferences and no execution yet (seen as (4, 0) on a loaded host)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        deadline = time.monotonic() + 10
        while True:
            stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
            counts = int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))
            if counts[1] > 0 or time.monotonic() > deadline:
                return counts
            time.sleep(0.05)
    finally:
        client.close()


def test_requests_sent_together_run_as_one_batch(batching_server):
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal((1, 3, 224, 224), dtype=np.float32) for _ in range(4)]
    results = send_together(batching_server.grpc_url, "classifier", "PIXELS", batches, "FP32")
    assert len(results) == 4 and all(error is None for _, error in results)
    inferences, executions = execution_stats(batching_server.grpc_url, "classifier")
    assert (inferences, executions) == (4, 1), "4 requests should have run as one ONNX batch"


def test_one_bad_token_fails_every_request_of_its_tagger_batch(batching_server):
    # Triton's onnxruntime backend runs a dynamic batch as one ONNX Runtime call: a token
    # outside the embedding table fails the call, and with it the three good requests.
    # (tests/live/test_backend_errors.py shows the same through an orchestrator.)
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN), dtype=np.int64)
               for _ in range(4)]
    batches[2][0, 7] = S.TAGGER_VOCAB + 5  # out of the embedding table
    results = send_together(batching_server.grpc_url, "tagger", "TOKENS", batches, "INT64")
    assert len(results) == 4
    errors = [error for _, error in results if error is not None]
    assert len(errors) == 4, [str(e) for e in errors]
    assert {e.status() for e in errors} == {"StatusCode.INTERNAL"}
    assert all(f"idx={S.TAGGER_VOCAB + 5}" in e.message() and "onnx runtime error 2" in e.message()
               for e in errors)


def test_tracing_on_does_not_crash_the_orchestrators(repository, tmp_path):
    """With Triton tracing on, pipeline requests succeed and are traced under their request id.

    (Forwarding request.trace() to sub-requests after execute returned segfaulted Triton 2.51;
    the orchestrator forwards the request id instead. This test keeps it that way.)
    """
    import json

    from tests.helpers import image, timed_infer

    trace_file = tmp_path / "trace.json"
    opts = options(repository, tmp_path, extra_args=[
        f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=1", "--trace-config=log_frequency=1"])
    with TritonServer(opts) as launcher:
        client = grpcclient.InferenceServerClient(launcher.grpc_url)
        try:
            for i in range(3):
                outcome = timed_infer(client, "grpc", "pipeline", image(i), request_id=f"traced-{i}")
                assert outcome.error is None, outcome.error
        finally:
            client.close()
        assert launcher.is_running()
    traced = {entry.get("request_id") for entry in json.loads(trace_file.read_text())
              if entry.get("model_name") == "pipeline"}
    assert traced & {"traced-0", "traced-1", "traced-2"}


def test_shutdown_drains_requests_in_flight(tmp_path):
    """Stopping the server while the orchestrator waits on a sub-model: the request is still
    answered (finalize drains in-flight work), and the server exits. The stop waits until the
    orchestrator reports the sub-request out (its in-flight gauge, published every 0.2 s): on
    a busy host the request may take a while to arrive, and one that arrives after the stop
    began is refused, as it should be."""
    import threading

    from modelgen import variants
    from tests.helpers import eventually, image, timed_infer

    # pipeline_faulty and its three fault stand-ins alone, one instance each: the stop drains
    # the same orchestrator as on the full repository, and the server starts in a few seconds.
    small = tmp_path / "repository"
    for stand_in in ("fault_preprocess", "fault_classifier", "fault_embedder"):
        model = next(m for m in variants.FAULT_MODELS if m.name == stand_in)
        variants.write(small, dataclasses.replace(model, instance_count=1), variants.FAULT_MODEL)
    variants.write(small, variants.variant_named("pipeline_faulty"))
    launcher = TritonServer(options(small, tmp_path))
    launcher.start()
    client = grpcclient.InferenceServerClient(launcher.grpc_url)
    outcome = {}
    request = threading.Thread(target=lambda: outcome.setdefault("value", timed_infer(
        client, "grpc", "pipeline_faulty", image(1), request_id="fault_classifier:delay:1000")))
    try:
        request.start()
        out = eventually(launcher, "bls_inflight_subrequests", lambda value: value >= 1,
                         timeout=10, model="pipeline_faulty")
        assert out >= 1, "the request never reached the classifier"
        launcher.stop()
        request.join(30)
    finally:
        client.close()
        launcher.stop()
    assert not request.is_alive(), "the client is still waiting: the request was lost"
    assert outcome["value"].error is None, outcome["value"].error
    assert outcome["value"].elapsed >= 1.0


def test_an_orchestrator_naming_a_missing_stage_model_fails_to_load(repository, tmp_path):
    from modelgen import variants

    broken = dataclasses.replace(S.PIPELINE, parameters={**S.PIPELINE.parameters,
                                                         "classifier_model": "classifier_v9",
                                                         "embedder_model": "classifier"})
    repo = make_repository(tmp_path / "repo", repository, S.PREPROCESS, S.CLASSIFIER)
    variants.write(repo, broken)
    with pytest.raises(LauncherError) as failure:
        TritonServer(options(repo, tmp_path)).start()
    message = str(failure.value)
    assert "pipeline" in message
    assert "no model 'classifier_v9'" in message
    assert "'classifier' has no tensor 'EMBEDDING'" in message


def test_deferred_models_serve_once_made_and_the_others_at_once(repository, tmp_path):
    """`make serve` on a fresh clone (tritonlocal.deferred): the server starts without
    digits_large and what needs it, and serves them once made. Here their file exists already,
    so making it is the export's up-to-date check: the loads are what is checked."""
    from tritonlocal import deferred

    missing, after = [S.DIGITS_LARGE.name], [S.DIGITS_CASCADE.name, "digits_ensemble"]
    lines: list[str] = []
    server = TritonServer(options(repository, tmp_path, deferred=frozenset(missing + after)))
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_model_ready(S.PIPELINE.name)
        assert not any(client.is_model_ready(m) for m in missing + after)
        deferred.make_later(server, missing, after, "small", log=lines.append).join(300)
        assert all(client.is_model_ready(m) for m in missing + after), lines
        pixels = grpcclient.InferInput("DIGIT_PIXELS", [1, 64], "FP32")
        pixels.set_data_from_numpy(np.full((1, 64), 8, np.float32))
        answer = client.infer(S.DIGITS_CASCADE.name, [pixels])
        assert answer.as_numpy("DIGIT").shape[0] == 1
        assert server.options.deferred == frozenset()  # a restart now loads every model
        client.close()
    assert lines[0].startswith(deferred.PREFIX) and "being made" in lines[0], lines
    assert [line for line in lines if line.endswith("is ready")] == [
        f"{deferred.PREFIX} {m} is ready" for m in missing + after], lines
