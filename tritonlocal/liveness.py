"""Is every python-backend stub of a tritonserver alive? The check Triton 2.51 does not make.

A python-backend model instance runs in its own stub process. When that process dies (killed by
the OOM killer, a segfault in a native library, ``os._exit``), this Triton build never restarts
it: the instance answers ``Stub process '<instance>' is not healthy.`` to every request routed to
it, while ``/v2/health/live``, ``/v2/health/ready`` and ``/v2/models/<m>/ready`` keep answering
200. This module finds such instances from outside the server:

* **zombies** — a stub is tritonserver's child and the server does not reap a dead one, so a
  killed stub stays in ``/proc`` in state ``Z`` (its command line is gone, its name is not);
* **missing instances** — every loaded model the python backend serves (and any python-based
  backend named with ``--stub-backend``) must have one live stub per instance its config
  declares (``<group name>_<index>``, the stub's argv[8]); an instance without one has died,
  whether or not the server reaped it. Models of C++ backends (onnxruntime, tensorrt, ensembles)
  run inside tritonserver and have no stubs.

It also asks ``/v2/health/live``, so one check covers the server and its stubs. It uses only
the standard library, reads ``/proc`` of the server's PID namespace and calls only endpoints
that need no admin credential (health, statistics, model config), so the same
command serves as the Kubernetes probes inside the container::

    python3 -m tritonlocal.liveness --url localhost:8000          # exit 0 alive, 1 not, 2 unknown
    python3 -m tritonlocal.liveness --url localhost:8000 --ready  # exit 0 ready, 1 not, 2 unknown

A reloader (``tritonlocal.reload``: the launcher's supervisor, or the container's watcher) brings
back a model whose stub died by reloading that model alone, and publishes its state in a file
beside the server. The probes read it:

* **liveness** fails when the server does not answer, when the reloader gave up on a model (its
  reloads did not bring it back), or when a stub is dead and no reloader is watching; a dead stub
  that a watching reloader is about to replace is not a reason to restart the pod;
* **readiness** also fails while any instance lacks a live stub or a model is being reloaded,
  and when Triton's ``/v2/health/ready`` does;
* stubs the reloader *retired* (those of a replaced copy of a model, which r24.10 may keep as
  zombies or running until the server exits) count neither as instances nor as dead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from tritonlocal import procs, reload_state

STUB_BACKENDS = ("python",)
# The most resident memory tritonserver may hold before it is drained and restarted as a whole
# (MiB; $TRITONLOCAL_MAX_SERVER_MEMORY_MIB; 0: no bound). A replaced copy of a model that r24.10
# cannot free grows the server without end; with the orchestrators' answers all given within
# execute there is none, and this bound is the safety net (docs/reliability.md, "Memory").
MAX_SERVER_MEMORY_MIB = 8192

ALIVE, NOT_ALIVE, UNKNOWN = 0, 1, 2   # exit codes of the command


@dataclass(frozen=True)
class Stub:
    pid: int
    state: str            # /proc/<pid>/stat state: R, S, D, Z, ...
    instance: str | None  # "<model>_<group>_<index>"; None once a zombie has lost its argv


@dataclass
class Report:
    server_pid: int
    live: bool                                   # /v2/health/live answered 200
    zombies: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)   # instances with no live stub
    checked_models: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # what could not be checked, and why
    ready: bool | None = None                    # /v2/health/ready answered 200 (if asked)
    watched: bool = False                        # a reloader's fresh state covers this server
    reloading: list[str] = field(default_factory=list)  # models a reloader is reloading now
    failed: dict[str, str] = field(default_factory=dict)  # models a reloader gave up on, why
    memory_mib: float = 0.0                      # tritonserver's resident memory
    max_memory_mib: float = 0.0                  # its bound (0: none)

    @property
    def over_memory(self) -> bool:
        """tritonserver holds more than its bound: drain and restart it as a whole."""
        return bool(self.max_memory_mib) and self.memory_mib > self.max_memory_mib

    @property
    def ok(self) -> bool:
        """Everything is as it should be: live, every instance has its stub, nothing failed."""
        return self.live and not self.zombies and not self.missing and not self.failed

    @property
    def alive(self) -> bool:
        """The liveness probe's answer: no reason to restart the server (or the pod)."""
        if not self.live or self.failed or self.over_memory:
            return False
        return self.watched or not (self.zombies or self.missing)

    @property
    def serving(self) -> bool:
        """The readiness probe's answer: every model served by every instance, now."""
        return self.ok and self.ready is not False and not self.reloading

    @property
    def dead_models(self) -> list[str]:
        return sorted({model_of(instance) for instance in self.missing})

    def summary(self) -> str:
        if self.ok and not self.reloading and not self.over_memory:
            return (f"alive: tritonserver {self.server_pid} is live and every stub of "
                    f"{len(self.checked_models)} stub-backed model(s) is running")
        problems = []
        if self.over_memory:
            problems.append(f"tritonserver holds {self.memory_mib:.0f} MiB, over its bound of "
                            f"{self.max_memory_mib:.0f} MiB: drain and restart it")
        if self.failed:
            problems.append("given up after repeated reloads: " + "; ".join(
                f"{model} ({why})" for model, why in sorted(self.failed.items())))
        if self.reloading:
            problems.append(f"being reloaded: {', '.join(self.reloading)}")
        if not self.live:
            problems.append("/v2/health/live did not answer 200")
        if self.missing:
            problems.append(f"instance(s) without a live stub: {', '.join(self.missing)} "
                            f"(model(s) {', '.join(self.dead_models)})")
        if self.zombies:
            problems.append(f"dead stub process(es) not reaped by the server: "
                            f"{', '.join(map(str, self.zombies))}")
        if self.alive and self.watched and (self.missing or self.zombies or self.reloading):
            head = "alive, a reloader is bringing model(s) back"
        else:
            head = "alive" if self.alive else "NOT alive"
        return f"{head}: tritonserver {self.server_pid}: " + "; ".join(problems)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "server_pid": self.server_pid, "live": self.live,
                "zombies": self.zombies, "missing": self.missing, "dead_models": self.dead_models,
                "checked_models": self.checked_models, "notes": self.notes, "alive": self.alive,
                "ready": self.ready, "serving": self.serving, "watched": self.watched,
                "reloading": self.reloading, "failed": self.failed,
                "memory_mib": round(self.memory_mib, 1), "max_memory_mib": self.max_memory_mib,
                "over_memory": self.over_memory}


class CheckError(RuntimeError):
    """The check itself could not be made (no server found)."""


# -- processes ----------------------------------------------------------------------------------
def server_pids() -> list[int]:
    """Every process named tritonserver in this PID namespace."""
    return sorted(p.pid for p in procs.processes() if p.comm == procs.SERVER_COMM)


def the_server() -> int:
    """The one tritonserver of this PID namespace (CheckError if there are none or several)."""
    servers = server_pids()
    if len(servers) != 1:
        raise CheckError(f"expected one tritonserver process, found {servers or 'none'}; "
                         "pass --server-pid")
    return servers[0]


def stubs_of(server_pid: int) -> list[Stub]:
    """The server's python-backend stub children, dead (zombie) ones included."""
    return sorted((Stub(p.pid, p.state, p.stub.instance if p.stub else None)
                   for p in procs.processes() if p.ppid == server_pid and p.is_stub),
                  key=lambda s: s.pid)


# -- what the server should have ----------------------------------------------------------------
def _get(url: str, path: str, timeout: float, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def is_ready(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> bool:
    """Does Triton's ``/v2/health/ready`` answer 200?"""
    try:
        return _get(url, "/v2/health/ready", timeout, headers or {})[0] == 200
    except (urllib.error.URLError, OSError):
        return False


def instance_names(config: dict) -> list[str]:
    """The instances Triton creates for a (normalised) model config: ``<group name>_<index>``,
    ``count`` per group, times the number of GPUs for a KIND_GPU group."""
    names = []
    for group in config.get("instance_group", []):
        count = int(group.get("count", 1))
        if group.get("kind") == "KIND_GPU":
            count *= max(1, len(group.get("gpus", [])))
        names.extend(f"{group['name']}_{index}" for index in range(count))
    return names


def expected_instances(url: str, stub_backends=STUB_BACKENDS, timeout: float = 5.0,
                       headers: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Model -> instance names, for every loaded model whose backend runs in stubs."""
    headers = headers or {}
    status, body = _get(url, "/v2/models/stats", timeout, headers)
    if status != 200:
        raise CheckError(f"/v2/models/stats answered {status}: {body[:200]!r}")
    models = sorted({entry["name"] for entry in json.loads(body).get("model_stats", [])})
    expected: dict[str, list[str]] = {}
    for model in models:
        status, body = _get(url, f"/v2/models/{urllib.parse.quote(model)}/config", timeout, headers)
        if status != 200:
            raise CheckError(f"/v2/models/{model}/config answered {status}: {body[:200]!r}")
        config = json.loads(body)
        if config.get("backend") in stub_backends:
            expected[model] = instance_names(config)
    return expected


# -- the check ----------------------------------------------------------------------------------
def check(url: str, server_pid: int | None = None, stub_backends=STUB_BACKENDS,
          timeout: float = 5.0, headers: dict[str, str] | None = None,
          expected: dict[str, list[str]] | None = None, retired: set[int] | None = None,
          state=None, ready: bool = False, max_memory_mib: float = 0.0) -> Report:
    """``expected`` (model -> instance names, from ``expected_instances``) saves asking the
    server for every config again (a reload by ``tritonlocal.reload`` keeps them). ``retired``:
    stub pids of replaced copies of a model, ignored. ``state``: a reloader's
    ``tritonlocal.reload_state.State`` for this server (its retired pids, reloads and failures).
    ``ready``: also ask ``/v2/health/ready``. ``max_memory_mib``: tritonserver's bound (0:
    none)."""
    if server_pid is None:
        server_pid = the_server()
    if not procs.alive(server_pid):
        raise CheckError(f"no process {server_pid}")
    notes = []
    try:
        status = _get(url, "/v2/health/live", timeout, headers or {})[0]
        if status != 200:
            notes.append(f"/v2/health/live answered {status}")
    except (urllib.error.URLError, OSError) as error:
        status = None
        notes.append(f"/v2/health/live: {error}")
    live = status == 200
    retired = set(retired or ())
    if state is not None and not state.belongs_to(server_pid):
        state = None  # another server's, which had this pid
    if state is not None:
        retired |= set(state.retired)
    stubs = [s for s in stubs_of(server_pid) if s.pid not in retired]
    report = Report(server_pid=server_pid, live=live, notes=notes,
                    zombies=[s.pid for s in stubs if s.state == "Z"],
                    memory_mib=procs.memory_mib(server_pid).get("VmRSS", 0.0),
                    max_memory_mib=max_memory_mib)
    if state is not None:
        report.watched = state.fresh()
        report.reloading = sorted(state.reloading)
        report.failed = dict(state.failed)
        if not report.watched:
            report.notes.append(f"the reloader's state is {time.time() - state.updated:.0f} s old: "
                                "nobody is reloading dead stubs")
    if ready and live:
        report.ready = is_ready(url, timeout, headers)
    running = {s.instance for s in stubs if s.state != "Z" and s.instance}
    if live:
        try:
            if expected is None:
                expected = expected_instances(url, stub_backends, timeout, headers)
        except (CheckError, urllib.error.URLError, OSError, ValueError) as error:
            report.notes.append(f"instances not checked: {error}")
        else:
            report.checked_models = sorted(expected)
            report.missing = sorted(name for names in expected.values() for name in names
                                    if name not in running)
    return report


def memory_bound_argument(parser: argparse.ArgumentParser) -> None:
    default = float(os.environ.get("TRITONLOCAL_MAX_SERVER_MEMORY_MIB", MAX_SERVER_MEMORY_MIB))
    parser.add_argument("--max-server-memory-mib", type=float, default=default,
                        help="tritonserver's resident memory bound in MiB, past which it is "
                             "not live: drained and restarted as a whole (default "
                             f"$TRITONLOCAL_MAX_SERVER_MEMORY_MIB or {MAX_SERVER_MEMORY_MIB}; "
                             "0: none)")


def model_of(instance: str) -> str:
    """``classifier_0_1`` -> ``classifier``."""
    match = re.fullmatch(r"(.+)_\d+_\d+", instance)
    return match.group(1) if match else instance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tritonlocal.liveness",
        description="Exit 0 if tritonserver is live and every python-backend stub it started is "
                    "running (or a watching reloader is bringing a model back), 1 if not, 2 if "
                    "it cannot tell: the Kubernetes liveness probe; with --ready, the readiness "
                    "probe.")
    parser.add_argument("--url", default=os.environ.get("TRITON_HTTP_URL", "localhost:8000"),
                        help="tritonserver's HTTP endpoint, host:port (default $TRITON_HTTP_URL "
                             "or localhost:8000)")
    parser.add_argument("--server-pid", type=int,
                        help="the tritonserver process (default: the only one in this PID namespace)")
    parser.add_argument("--stub-backend", action="append", default=[],
                        help="a backend whose models run in python stubs, besides 'python' "
                             "(e.g. a python-based backend); repeatable")
    parser.add_argument("--header", action="append", metavar="NAME=VALUE",
                        help="an HTTP header to send, repeatable (default: the admin credential "
                             "in $TRITONLOCAL_ADMIN_HEADER, if set: what the probes read is open, "
                             "but an operator may close statistics or model config)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ready", action="store_true",
                        help="the readiness check instead: also fail while an instance has no "
                             "live stub, a model is being reloaded, or /v2/health/ready fails")
    parser.add_argument("--state-dir", help="where the reloader publishes its state (default "
                                            "$TRITONLOCAL_STATE_DIR or the temporary directory)")
    memory_bound_argument(parser)
    args = parser.parse_args(argv)
    given = args.header if args.header is not None else [os.environ.get(
        "TRITONLOCAL_ADMIN_HEADER", "")]
    headers = dict(h.split("=", 1) for h in given if "=" in h)

    try:
        server_pid = args.server_pid if args.server_pid is not None else the_server()
        state = reload_state.State.read(reload_state.state_path(server_pid, args.state_dir))
        report = check(args.url, server_pid, (*STUB_BACKENDS, *args.stub_backend),
                       args.timeout, headers, state=state, ready=args.ready,
                       max_memory_mib=args.max_server_memory_mib)
    except CheckError as error:
        print(f"unknown: {error}", file=sys.stderr)
        return UNKNOWN
    print(json.dumps(report.as_dict()) if args.json else report.summary())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.ready:
        return ALIVE if report.serving else NOT_ALIVE
    return ALIVE if report.alive else NOT_ALIVE


if __name__ == "__main__":
    sys.exit(main())
