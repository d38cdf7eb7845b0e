"""A tritonserver's processes, from ``/proc``: the one scanner, and the one place that knows how a
python-backend stub's command line is laid out.

The r24.10 python backend starts one stub per model instance as (``stub_launcher.cc``)::

    argv[0]  .../triton_python_backend_stub
    argv[1]  the model's model.py
    argv[2]  its shared-memory region's name      (the launcher sets a prefix: tritonlocal_<pid>_...)
    argv[3]  the region's default size
    argv[4]  its growth step
    argv[5]  the pid of the tritonserver that started it
    argv[6]  the python backend's directory
    argv[7]  the IPC control handle
    argv[8]  the instance, <model>_<group>_<index>
    argv[9]  the runtime model directory (DEFAULT)

A stub that died stays a zombie child of the server: its command line is gone, its ``comm``
(the first 15 bytes of the executable's name) and state ``Z`` remain. Standard library only:
``tritonlocal.liveness`` runs as a Kubernetes exec probe in the container.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PROC = Path("/proc")
STUB_NAME = b"triton_python_backend_stub"
STUB_COMM = STUB_NAME[:15].decode()   # "triton_python_b"
SERVER_COMM = "tritonserver"


@dataclass(frozen=True)
class StubArgs:
    """What a stub's command line says about it."""

    region: str                 # argv[2]
    server_pid: int | None      # argv[5]
    instance: str | None        # argv[8], "<model>_<group>_<index>"

    @property
    def model(self) -> str | None:
        match = re.fullmatch(r"(.+)_\d+_\d+", self.instance or "")
        return match.group(1) if match else None

    @classmethod
    def parse(cls, argv: list[bytes] | tuple[bytes, ...]) -> "StubArgs | None":
        """None unless ``argv`` is a python-backend stub's."""
        if len(argv) < 3 or not argv[0].endswith(STUB_NAME):
            return None
        field = lambda i: argv[i].decode(errors="replace") if len(argv) > i and argv[i] else None  # noqa: E731 - one line per field below
        server = field(5)
        return cls(region=field(2) or "", server_pid=int(server) if server and server.isdigit()
                   else None, instance=field(8))


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    state: str                  # R, S, D, Z, ...
    ppid: int
    pgid: int
    argv: tuple[bytes, ...]     # empty for a zombie

    @property
    def is_stub(self) -> bool:
        return self.comm.startswith(STUB_COMM)

    @property
    def stub(self) -> StubArgs | None:
        return StubArgs.parse(self.argv)


def stat(pid: int) -> tuple[str, str, int, int]:
    """(comm, state, parent pid, process group) of a process, from /proc/<pid>/stat."""
    text = (PROC / str(pid) / "stat").read_text()
    comm = text[text.index("(") + 1:text.rindex(")")]
    state, ppid, pgid = text[text.rindex(")") + 2:].split()[:3]
    return comm, state, int(ppid), int(pgid)


def process(pid: int) -> Process:
    comm, state, ppid, pgid = stat(pid)
    raw = (PROC / str(pid) / "cmdline").read_bytes()
    return Process(pid, comm, state, ppid, pgid, tuple(raw.split(b"\0")[:-1]) if raw else ())


def processes() -> Iterator[Process]:
    """Every process of this PID namespace (those that vanish while read are skipped)."""
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                yield process(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0 if it is gone)."""
    import os

    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_ticks(pid: int) -> int | None:
    """When a process started, in clock ticks since boot (/proc/<pid>/stat field 22): with its
    pid, what tells a process from a later one that got the same pid. None if it is gone."""
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def memory_mib(pid: int) -> dict[str, float]:
    """The ``kB`` fields of /proc/<pid>/status in MiB (``VmRSS``, ``RssAnon``, ...); empty if the
    process is gone."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return {}
    return {name: int(value.split()[0]) / 1024 for name, value in
            (line.split(":", 1) for line in text.splitlines() if ":" in line)
            if value.strip().endswith("kB")}


def alive(pid: int) -> bool:
    return (PROC / str(pid)).exists()


def kill(pid: int) -> bool:
    """SIGKILL ``pid``; False if it could not be signalled (gone, or not ours)."""
    return signal_process(pid, signal.SIGKILL)


def signal_process(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False if it could not be signalled (gone, or not ours)."""
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True
