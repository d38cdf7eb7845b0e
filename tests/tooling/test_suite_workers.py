"""How many workers `make test` (`-n auto`) runs the suite on: two only where two session
servers fit and two cores are free."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import (
    WORKERS_MIN_IDLE_CORES,
    WORKERS_MIN_MEMORY_GIB,
    auto_workers,
    host_memory_kib,
    idle_cores,
)

GIB = 2**20  # KiB


@pytest.mark.parametrize("cpus, memory_gib, workers", [
    (2, 24, 2), (8, 64, 2), (2, WORKERS_MIN_MEMORY_GIB, 2),
    (2, WORKERS_MIN_MEMORY_GIB - 0.5, 0), (1, 64, 0), (2, 0, 0),
])
def test_two_workers_only_with_two_cpus_and_the_memory_for_two_session_servers(
        cpus, memory_gib, workers):
    assert auto_workers(cpus, int(memory_gib * GIB)) == workers


def meminfo(tmp_path, total_kib: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total_kib} kB\nMemFree:        1000 kB\n")
    return path


@pytest.mark.parametrize("limit, expected_gib", [
    (None, 24), ("max\n", 24), (f"{16 * 2**30}\n", 16), (f"{32 * 2**30}\n", 24),
], ids=["no-cgroup", "unlimited", "cgroup-below", "cgroup-above"])
def test_the_memory_is_the_hosts_or_a_lower_cgroup_limit(tmp_path, limit, expected_gib):
    cgroup = tmp_path / "memory.max"
    if limit is not None:
        cgroup.write_text(limit)
    assert host_memory_kib(meminfo(tmp_path, 24 * GIB), cgroup) == expected_gib * GIB


def test_an_unreadable_meminfo_counts_as_no_memory(tmp_path):
    assert host_memory_kib(tmp_path / "missing", tmp_path / "memory.max") == 0


@pytest.mark.parametrize("idle, workers", [
    (None, 2), (2.0, 2), (WORKERS_MIN_IDLE_CORES, 2), (1.0, 0), (0.2, 0),
], ids=["unknown", "idle", "at-the-bound", "a-busy-loop", "busy"])
def test_a_busy_host_gets_one_process(idle, workers):
    assert auto_workers(2, 24 * GIB, idle) == workers


def stat_line(tmp_path, name: str, user: int, idle: int, iowait: int):
    path = tmp_path / name
    path.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return path


def test_idle_cores_are_the_idle_share_of_the_hosts_time(tmp_path):
    # Over the sampled second a 2-core host spent 100 ticks busy and 100 idle (90) or waiting (10).
    stat = stat_line(tmp_path, "stat", 1000, 5000, 100)
    later = threading.Timer(0.05, lambda: stat_line(tmp_path, "stat", 1100, 5090, 110))
    later.start()
    assert idle_cores(1.0, stat, cpus=2) == pytest.approx(1.0)


def test_an_unreadable_stat_counts_as_unknown(tmp_path):
    assert idle_cores(0.0, tmp_path / "missing", cpus=2) is None
