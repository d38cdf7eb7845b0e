"""What the reloader (``tritonlocal.reload``) publishes for the probes (``tritonlocal.liveness``):
a small JSON file per tritonserver, written whole or not at all. Standard library only."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tritonlocal import procs

STATE_VERSION = 1


def state_path(server_pid: int, directory: str | None = None) -> Path:
    """Where the reloader of tritonserver ``server_pid`` publishes its state."""
    base = directory or os.environ.get("TRITONLOCAL_STATE_DIR") or tempfile.gettempdir()
    return Path(base) / f"tritonlocal-reload-{server_pid}.json"


@dataclass
class State:
    """What the probes need from the reloader. ``updated``: wall-clock time of the last check
    (a state older than ``stale_after`` seconds means no reloader is watching)."""
    server_pid: int
    server_start: int | None = None   # procs.start_ticks(server_pid): the same server, not a
    #                                   later process with its pid (a container's pid 1)
    updated: float = 0.0
    interval: float = 1.0
    reloading: list[str] = field(default_factory=list)   # models being reloaded now
    failed: dict[str, str] = field(default_factory=dict)  # model -> why the reloader gave up
    retired: list[int] = field(default_factory=list)      # stub pids of replaced copies
    reloads: dict[str, int] = field(default_factory=dict)  # model -> reloads so far

    @property
    def stale_after(self) -> float:
        return 3 * self.interval + 5.0

    def belongs_to(self, server_pid: int) -> bool:
        """Is this the state of the tritonserver running now as ``server_pid``?"""
        return self.server_pid == server_pid and self.server_start == procs.start_ticks(server_pid)

    def fresh(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.updated <= self.stale_after

    def write(self, path: Path) -> None:
        body = {"version": STATE_VERSION, "server_pid": self.server_pid,
                "server_start": self.server_start, "updated": self.updated,
                "interval": self.interval, "reloading": sorted(self.reloading),
                "failed": self.failed, "retired": sorted(self.retired), "reloads": self.reloads}
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(body))
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> "State | None":
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        if body.get("version") != STATE_VERSION:
            return None
        return cls(server_pid=int(body["server_pid"]), server_start=body.get("server_start"),
                   updated=float(body["updated"]),
                   interval=float(body["interval"]), reloading=list(body["reloading"]),
                   failed=dict(body["failed"]), retired=[int(p) for p in body["retired"]],
                   reloads=dict(body.get("reloads", {})))
