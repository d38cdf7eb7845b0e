"""The liveness check's pure parts: which instances a model config implies, and what a report
says. The check itself runs against real servers in tests/live/test_recovery.py."""

from __future__ import annotations

from tritonlocal.liveness import Report, instance_names, model_of


def test_instance_names_follow_triton_naming_per_group_and_gpu():
    config = {"instance_group": [
        {"name": "orchestrator_0", "kind": "KIND_CPU", "count": 2, "gpus": []},
        {"name": "orchestrator_1", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]},
        {"name": "custom", "kind": "KIND_MODEL", "count": 1},
    ]}
    assert instance_names(config) == [
        "orchestrator_0_0", "orchestrator_0_1",
        "orchestrator_1_0", "orchestrator_1_1", "orchestrator_1_2", "orchestrator_1_3",
        "custom_0"]


def test_a_model_without_instance_groups_expects_no_stub():
    assert instance_names({"name": "ensemble", "platform": "ensemble"}) == []


def test_model_of_an_instance():
    assert model_of("tag_pipeline_0_1") == "tag_pipeline"
    assert model_of("odd") == "odd"


def test_a_report_is_ok_only_if_live_with_no_dead_or_missing_stub():
    assert Report(server_pid=1, live=True).ok
    assert not Report(server_pid=1, live=False).ok
    missing = Report(server_pid=1, live=True, missing=["classifier_0_2"])
    assert not missing.ok and "classifier_0_2" in missing.summary()
    assert missing.dead_models == ["classifier"]
    zombie = Report(server_pid=1, live=True, zombies=[42])
    assert not zombie.ok and "42" in zombie.summary()


def test_the_probe_sends_the_admin_credential_from_its_environment(monkeypatch, capsys):
    """The Kubernetes probes run with the container's environment, the Secret's variable in it;
    ``--header`` replaces it."""
    from tritonlocal import liveness

    sent = []

    def check(url, pid, backends, timeout, headers, **kwargs):
        sent.append(headers)
        return Report(server_pid=pid, live=True)

    monkeypatch.setattr(liveness, "check", check)
    monkeypatch.setattr(liveness, "the_server", lambda: 4242)
    monkeypatch.setenv("TRITONLOCAL_STATE_DIR", "/nonexistent-state-dir")
    monkeypatch.setenv("TRITONLOCAL_ADMIN_HEADER", "triton-admin-key=" + "a" * 64)
    assert liveness.main([]) == liveness.ALIVE
    assert liveness.main(["--header", "x-other=1"]) == liveness.ALIVE
    monkeypatch.delenv("TRITONLOCAL_ADMIN_HEADER")
    assert liveness.main([]) == liveness.ALIVE
    assert sent == [{"triton-admin-key": "a" * 64}, {"x-other": "1"}, {}]
    assert "a" * 64 not in capsys.readouterr().out


def test_a_server_over_its_memory_bound_is_not_alive_and_the_summary_says_why():
    within = Report(server_pid=1, live=True, memory_mib=900.0, max_memory_mib=1024.0)
    assert within.alive and not within.over_memory
    over = Report(server_pid=1, live=True, memory_mib=1100.0, max_memory_mib=1024.0)
    assert over.over_memory and not over.alive
    assert "1100 MiB, over its bound of 1024 MiB" in over.summary()
    assert over.as_dict()["over_memory"] is True
    unbounded = Report(server_pid=1, live=True, memory_mib=10**6, max_memory_mib=0.0)
    assert unbounded.alive


def test_the_probe_takes_the_memory_bound_from_its_environment(monkeypatch):
    """Kubernetes sets TRITONLOCAL_MAX_SERVER_MEMORY_MIB (deploy/kubernetes/deployment.yaml);
    past it the liveness probe fails, so the pod is drained and restarted."""
    from tritonlocal import liveness

    bounds = []

    def check(url, pid, backends, timeout, headers, **kwargs):
        bounds.append(kwargs["max_memory_mib"])
        return Report(server_pid=pid, live=True, memory_mib=3000.0,
                      max_memory_mib=kwargs["max_memory_mib"])

    monkeypatch.setattr(liveness, "check", check)
    monkeypatch.setattr(liveness, "the_server", lambda: 4242)
    monkeypatch.setenv("TRITONLOCAL_STATE_DIR", "/nonexistent-state-dir")
    monkeypatch.setenv("TRITONLOCAL_MAX_SERVER_MEMORY_MIB", "2048")
    assert liveness.main([]) == liveness.NOT_ALIVE
    assert liveness.main(["--max-server-memory-mib", "0"]) == liveness.ALIVE
    monkeypatch.delenv("TRITONLOCAL_MAX_SERVER_MEMORY_MIB")
    assert liveness.main([]) == liveness.ALIVE
    assert bounds == [2048.0, 0.0, float(liveness.MAX_SERVER_MEMORY_MIB)]
