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
