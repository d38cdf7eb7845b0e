"""The one /proc scanner and the stub command-line layout (tritonlocal.procs), on a fake /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonlocal import procs

STUB_ARGV = [b"/tmp/x/backends/python/triton_python_backend_stub", b"/repo/pipeline/1/model.py",
             b"tritonlocal_42_abc_uuid", b"33554432", b"16777216", b"100", b"/tmp/x/backends/python",
             b"336", b"pipeline_0_1", b"DEFAULT"]


def fake(proc: Path, pid: int, comm: str, state: str, ppid: int, pgid: int, argv: list[bytes],
         rss_kib: int = 2048) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    # comm may contain spaces and parentheses: the parser takes the last ')'.
    (entry / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {pgid} 0 0 0 0 0 0 0 0 "
                                f"150 50 0 0 20 0 1 0\n")
    (entry / "cmdline").write_bytes(b"".join(a + b"\0" for a in argv))
    (entry / "status").write_text(f"Name:\t{comm}\nVmRSS:\t{rss_kib} kB\nRssAnon:\t1024 kB\n"
                                  "Threads:\t7\n")


@pytest.fixture
def proc(tmp_path, monkeypatch):
    monkeypatch.setattr(procs, "PROC", tmp_path)
    fake(tmp_path, 100, "tritonserver", "S", 1, 100, [b"tritonserver", b"--model-repository=x"])
    fake(tmp_path, 101, "triton_python_b", "S", 100, 100, STUB_ARGV)
    fake(tmp_path, 102, "triton_python_b", "Z", 100, 100, [])          # a dead stub: no argv
    fake(tmp_path, 103, "odd (name) x", "R", 1, 103, [b"python3"])
    (tmp_path / "self").mkdir()                                          # not a pid
    return tmp_path


def test_a_stubs_command_line_is_parsed_by_its_layout():
    stub = procs.StubArgs.parse(STUB_ARGV)
    assert stub == procs.StubArgs("tritonlocal_42_abc_uuid", 100, "pipeline_0_1")
    assert stub.model == "pipeline"
    assert procs.StubArgs.parse([b"/usr/bin/python3", b"x", b"y"]) is None
    assert procs.StubArgs.parse([]) is None


def test_one_scan_finds_servers_stubs_and_zombies(proc):
    found = {p.pid: p for p in procs.processes()}
    assert set(found) == {100, 101, 102, 103}
    assert found[101].is_stub and found[101].stub.instance == "pipeline_0_1"
    assert found[102].is_stub and found[102].state == "Z" and found[102].stub is None
    assert found[103].comm == "odd (name) x" and found[103].ppid == 1
    assert procs.stat(101) == ("triton_python_b", "S", 100, 100)


def test_cpu_and_memory_come_from_the_same_files(proc):
    assert procs.cpu_seconds(101) == pytest.approx(200 / __import__("os").sysconf("SC_CLK_TCK"))
    assert procs.memory_mib(101)["VmRSS"] == 2.0 and "Threads" not in procs.memory_mib(101)
    assert procs.cpu_seconds(999) == 0.0 and procs.memory_mib(999) == {}
    assert procs.alive(100) and not procs.alive(999)


def test_liveness_and_the_launcher_read_the_same_scan(proc):
    from tritonlocal import liveness
    from tritonlocal.launcher import group_stubs

    assert liveness.server_pids() == [100]
    assert [(s.pid, s.state, s.instance) for s in liveness.stubs_of(100)] == [
        (101, "S", "pipeline_0_1"), (102, "Z", None)]
    assert group_stubs(100) == {"pipeline": [101]}
