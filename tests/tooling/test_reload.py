"""The reloader's logic without a server: the per-model crash-loop guard, what it retires, what
the probes conclude from its state, and the orchestrators ignoring the reload marker. Reloads
against a real server are in tests/live/test_recovery.py."""

from __future__ import annotations

import json
import time

import pytest

from bls_models import params
from tritonlocal import liveness, reload
from tritonlocal.liveness import Report


@pytest.fixture
def reloader(tmp_path, monkeypatch):
    """A Reloader whose server calls are recorded instead of made: reload_model appends the
    model, the post-reload check finds every instance back unless ``still_dead`` names it."""
    calls, still_dead, stubs = [], set(), {"pipeline": [11, 12], "tag_pipeline": [21, 22]}
    configs = {"pipeline": {"parameters": {"max_deadline_ms": {"string_value": "30000"}}},
               "tag_pipeline": {"parameters": {}}}

    def fake_reload(url, model, headers, generation, timeout=120.0, config=None):
        assert config is configs[model]
        if model in still_dead and "refuse" in still_dead:
            raise reload.ReloadError("load of 'x' answered 403")
        calls.append((model, generation))

    def fake_check(url, server_pid, headers=None, retired=None, **kw):
        missing = [f"{m}_0_0" for m in still_dead if m != "refuse"]
        return Report(server_pid, True, missing=missing)

    monkeypatch.setattr(reload, "reload_model", fake_reload)
    monkeypatch.setattr(reload, "model_config", lambda url, model, headers: configs[model])
    monkeypatch.setattr(reload.liveness, "check", fake_check)
    monkeypatch.setattr(reload, "liveness_stubs", lambda pid: stubs)
    monkeypatch.setattr(reload.liveness, "stubs_of", lambda pid: [])
    monkeypatch.setattr(reload.procs, "alive", lambda pid: True)
    monkeypatch.setattr(reload.procs, "process", lambda pid: type("P", (), {
        "argv": (b"stub", str(pid).encode()), "is_stub": False, "state": "S", "ppid": 0})())
    made = reload.Reloader("x:1", {"h": "v"}, max_reloads=2, window=60.0, retire_grace=5.0,
                           state_dir=str(tmp_path), log=lambda _: None)
    made.attach(1234)
    made.calls, made.still_dead, made.stubs = calls, still_dead, stubs
    return made


def dead(*instances: str, zombies=()) -> Report:
    return Report(1234, True, missing=list(instances), zombies=list(zombies))


def test_only_the_model_whose_stub_died_is_reloaded_and_its_old_stubs_retired(reloader):
    assert reloader.handle(dead("pipeline_0_0", zombies=[11])) == []
    assert [model for model, _ in reloader.calls] == ["pipeline"]
    assert set(reloader.retired) == {11, 12}
    assert sorted(entry.pid for entry in reloader.to_kill) == [11, 12]
    state = reload.State.read(reload.state_path(1234, reloader.state_dir))
    assert state.retired == [11, 12] and state.reloading == [] and state.failed == {}
    assert state.reloads == {"pipeline": 1}


def test_each_reload_marks_the_config_with_a_new_generation(reloader):
    reloader.handle(dead("pipeline_0_0"))
    reloader.handle(dead("pipeline_0_1"))
    generations = [generation for _, generation in reloader.calls]
    assert len(set(generations)) == 2


def test_the_guard_gives_up_on_one_model_after_max_reloads_within_the_window(reloader):
    for _ in range(2):
        assert reloader.handle(dead("tag_pipeline_0_1")) == []
    assert reloader.handle(dead("tag_pipeline_0_1", "pipeline_0_0")) == []
    assert "tag_pipeline" in reloader.state.failed and "pipeline" not in reloader.state.failed
    assert [m for m, _ in reloader.calls] == ["tag_pipeline", "tag_pipeline", "pipeline"]
    # Given up on: never reloaded again, whatever happens.
    reloader.handle(dead("tag_pipeline_0_0"))
    assert [m for m, _ in reloader.calls].count("tag_pipeline") == 2


def test_reloads_older_than_the_window_do_not_count(reloader, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(reload.time, "monotonic", lambda: clock[0])
    for _ in range(2):
        reloader.handle(dead("pipeline_0_0"))
        clock[0] += 61.0
    reloader.handle(dead("pipeline_0_0"))
    assert reloader.state.failed == {}
    assert [m for m, _ in reloader.calls] == ["pipeline"] * 3


def test_a_reload_that_does_not_bring_the_model_back_is_reported(reloader):
    reloader.still_dead.add("pipeline")
    assert reloader.handle(dead("pipeline_0_0")) == ["pipeline"]
    assert reloader.state.reloading == []
    reloader.still_dead.add("refuse")
    assert reloader.handle(dead("pipeline_0_0")) == ["pipeline"]
    assert any("failed" in what for _, what in reloader.events)


def test_replaced_stubs_stop_only_once_the_longest_deadline_has_passed(reloader, monkeypatch):
    """An orchestrator's replaced copy lives max_deadline_ms (its served config) plus the grace;
    a model without the parameter, only the grace."""
    clock = [1000.0]
    monkeypatch.setattr(reload.time, "monotonic", lambda: clock[0])
    reloader.handle(dead("pipeline_0_0", "tag_pipeline_0_0"))
    due = {entry.pid: entry.due for entry in reloader.to_kill}
    assert due == {11: 1035.0, 12: 1035.0, 21: 1005.0, 22: 1005.0}
    assert reload.longest_deadline(None) == int(params.MAX_DEADLINE.default) / 1e3


def test_the_stub_cap_is_the_orchestrators_default():
    assert reload.DEFAULT_MAX_DEADLINE_MS == int(params.MAX_DEADLINE.default)
    assert reload.MAX_DEADLINE_PARAMETER == params.MAX_DEADLINE.name


@pytest.mark.parametrize("switched", [True, False])
def test_after_a_failed_reload_the_old_copy_is_retired_and_stopped_only_if_replaced(
        reloader, monkeypatch, switched):
    """A load call that failed may have switched copies all the same (it timed out after
    Triton began): the old stubs are retired and scheduled; at their time they are stopped if
    the model serves from other stubs, and left serving if it does not."""
    class P:
        ppid, state, is_stub = 1234, "S", True

        def __init__(self, pid):
            self.argv = (b"stub", str(pid).encode())

    monkeypatch.setattr(reload.procs, "process", P)
    killed = []
    monkeypatch.setattr(reload.os, "kill", lambda pid, sig: killed.append(pid))
    reloader.still_dead.add("pipeline")  # the check after the load says it is not back
    assert reloader.handle(dead("pipeline_0_0")) == ["pipeline"]
    assert sorted(entry.pid for entry in reloader.to_kill) == [11, 12]
    assert {11, 12} <= reloader.retired
    if switched:
        reloader.stubs["pipeline"] = [11, 12, 31, 32]  # the new copy's stubs came up after all
    due = max(entry.due for entry in reloader.to_kill)
    assert reloader.kill_due(due - 1) == [] and killed == []
    assert reloader.kill_due(due) == ([11, 12] if switched else [])
    assert killed == ([11, 12] if switched else []) and reloader.to_kill == []


def test_only_due_retired_stubs_that_are_still_live_stubs_of_the_server_are_killed(reloader,
                                                                                  monkeypatch):
    class P:
        def __init__(self, ppid, state="S", stub=True, argv=(b"stub",)):
            self.ppid, self.state, self.is_stub, self.argv = ppid, state, stub, argv

    # 11: still the retired stub; 12 a zombie; 13 another parent's; 14 not a stub; 15 gone;
    # 17: the pid now belongs to another stub (another region in its argv).
    table = {11: P(1234), 12: P(1234, "Z"), 13: P(999), 14: P(1234, stub=False),
             17: P(1234, argv=(b"stub", b"other-region"))}

    def process(pid):
        if pid not in table:
            raise FileNotFoundError(pid)
        return table[pid]

    killed = []
    monkeypatch.setattr(reload.procs, "process", process)
    monkeypatch.setattr(reload.os, "kill", lambda pid, sig: killed.append(pid))
    now = time.monotonic()
    reloader.stubs["pipeline"] = [11, 31]  # a new copy serves

    def retiring(due, pid):
        return reload.Retiring(due, pid, (b"stub",), "pipeline", frozenset({11, 12}))

    reloader.to_kill = [retiring(now - 1, pid) for pid in (11, 12, 13, 14, 15, 17)]
    reloader.to_kill.append(retiring(now + 60, 16))
    assert reloader.kill_due(now) == [11] and killed == [11]
    assert reloader.to_kill == [retiring(now + 60, 16)]


def test_a_new_server_starts_with_a_clean_state_and_the_old_file_goes(reloader):
    reloader.handle(dead("pipeline_0_0"))
    old = reload.state_path(1234, reloader.state_dir)
    assert old.exists()
    reloader.attach(5678)
    assert not old.exists() and reloader.retired == set() and reloader.history == {}
    reloader.forget()
    assert not reload.state_path(5678, reloader.state_dir).exists()


def test_state_round_trips_and_goes_stale(tmp_path):
    state = reload.State(7, updated=time.time(), interval=0.5, reloading=["a"],
                         failed={"b": "why"}, retired=[3, 1], reloads={"a": 2})
    path = tmp_path / "s.json"
    state.write(path)
    back = reload.State.read(path)
    assert back.retired == [1, 3] and back.failed == {"b": "why"} and back.reloading == ["a"]
    assert back.fresh() and not back.fresh(time.time() + back.stale_after + 1)
    path.write_text(json.dumps({"version": 99}))
    assert reload.State.read(path) is None
    assert reload.State.read(tmp_path / "absent.json") is None


def test_what_the_probes_conclude():
    healthy = Report(1, True, ready=True)
    assert healthy.alive and healthy.serving
    # A dead stub: not live for the probe unless a reloader is watching; never ready.
    unwatched = Report(1, True, missing=["pipeline_0_0"], ready=True)
    watched = Report(1, True, missing=["pipeline_0_0"], ready=True, watched=True)
    assert not unwatched.alive and not unwatched.serving
    assert watched.alive and not watched.serving
    assert "reloader is bringing" in watched.summary()
    # Being reloaded: live, not ready. Given up on: not live, even with a reloader watching.
    reloading = Report(1, True, ready=True, watched=True, reloading=["pipeline"])
    assert reloading.alive and not reloading.serving and "being reloaded" in reloading.summary()
    failed = Report(1, True, ready=True, watched=True, failed={"tag_pipeline": "6 reloads"})
    assert not failed.alive and not failed.serving and "tag_pipeline" in failed.summary()
    # Triton not ready, or not live at all.
    assert not Report(1, True, ready=False).serving
    assert not Report(1, False, watched=True).alive


def test_the_probe_ignores_what_the_reloader_retired(monkeypatch):
    stubs = [liveness.Stub(11, "Z", None), liveness.Stub(12, "S", "pipeline_0_1"),
             liveness.Stub(31, "S", "pipeline_0_0"), liveness.Stub(32, "S", "pipeline_0_1")]
    monkeypatch.setattr(liveness, "stubs_of", lambda pid: stubs)
    monkeypatch.setattr(liveness.procs, "alive", lambda pid: True)
    monkeypatch.setattr(liveness.procs, "start_ticks", lambda pid: 99)
    monkeypatch.setattr(liveness, "_get", lambda *a: (200, b""))
    expected = {"pipeline": ["pipeline_0_0", "pipeline_0_1"]}
    state = reload.State(1, 99, updated=time.time(), retired=[11, 12])
    report = liveness.check("x:1", 1, expected=expected, state=state)
    assert report.ok and report.zombies == [] and report.watched
    # Without the state, the zombie is dead.
    assert liveness.check("x:1", 1, expected=expected).zombies == [11]
    # Retired stubs do not count as instances: with the new copy's stub of pipeline_0_0 gone,
    # the old copy's stub of that name would not hide it.
    stubs[2] = liveness.Stub(31, "Z", None)
    report = liveness.check("x:1", 1, expected=expected, state=state)
    assert report.missing == ["pipeline_0_0"] and report.zombies == [31]


def test_orchestrators_ignore_the_reload_marker():
    config = {"parameters": {"default_deadline_ms": {"string_value": "100"},
                             reload.RELOAD_PARAMETER: {"string_value": "3-1.0"}}}
    assert params.string_parameters(config) == {"default_deadline_ms": "100"}
    assert reload.RELOAD_PARAMETER.startswith(params.RESERVED_PREFIX)


def test_the_state_of_an_earlier_server_with_the_same_pid_is_ignored(monkeypatch):
    """A container's tritonserver is pid 1 at every start: the state file names the server's
    start time too."""
    monkeypatch.setattr(liveness, "stubs_of", lambda pid: [liveness.Stub(11, "Z", None)])
    monkeypatch.setattr(liveness.procs, "alive", lambda pid: True)
    monkeypatch.setattr(liveness.procs, "start_ticks", lambda pid: 500)
    monkeypatch.setattr(liveness, "_get", lambda *a: (200, b""))
    earlier = reload.State(1, 99, updated=time.time(), retired=[11], failed={"pipeline": "x"})
    report = liveness.check("x:1", 1, expected={}, state=earlier)
    assert report.zombies == [11] and report.failed == {} and not report.watched
    assert not earlier.belongs_to(1) and reload.State(1, 500).belongs_to(1)


def test_a_stub_exiting_or_dead_since_the_check_is_retired_with_the_dead(reloader, monkeypatch):
    """Killed a moment before the check, a stub may have lost its argv (so its instance) without
    being a zombie yet (40), or have become one between the check and the reload (42: the
    check's report does not name it). Both are retired, so neither is taken for an unknown dead
    stub, which the supervisor would restart the whole server for (seen once in the chaos soak:
    51.6 s down)."""
    monkeypatch.setattr(reload.liveness, "stubs_of", lambda pid: [
        liveness.Stub(40, "R", None), liveness.Stub(41, "S", "pipeline_0_1"),
        liveness.Stub(42, "Z", None)])
    report = dead("pipeline_0_0")
    assert 42 not in report.zombies
    reloader.handle(report)
    assert {40, 42} <= set(reloader.retired) and 41 not in reloader.retired
    assert not {40, 42} & {entry.pid for entry in reloader.to_kill}
