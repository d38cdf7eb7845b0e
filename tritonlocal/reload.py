"""Bring back one model whose python-backend stub died, while every other model keeps serving.

Triton 2.51 never restarts a dead stub: the instance fails every request routed to it while the
server reports ready (``tritonlocal.liveness``). With the server in explicit model control mode,
``Reloader`` reloads just that model through the repository API:

* **How.** ``POST /v2/repository/models/<m>/load`` with the model's own served config as an
  override, marked with a ``tritonlocal.reload`` parameter (the orchestrators ignore the
  ``tritonlocal.`` prefix). A plain load of unchanged files is a no-op in Triton core r24.10, and
  an override that differs only in ``instance_group`` updates instances in place, keeping the dead
  one (``model_lifecycle.cc`` ``ConfigChangeRequiresReload``); any other difference makes Triton
  load a new copy of the model in the background, switch to it when it is ready and retire the
  old one. The old copy's live instances keep answering what they hold.
* **What is left behind.** A request a stub still owed an answer after its ``execute`` had
  returned (through a response sender) would never be answered by r24.10 once the stub died, and
  its response factory would keep the old copy of the model alive, its dead stub a zombie and
  its live stubs running. The project's orchestrators owe nothing past ``execute`` (they answer
  every request before it returns), but any python model may, so the reloader still
  *retires* every stub of the old copy: the liveness check no longer counts
  them, and a live one is SIGKILLed only once no request it may hold can still be within its
  deadline: the model's ``max_deadline_ms`` (the orchestrators cut every client timeout to it)
  plus ``retire_grace`` seconds after the switch, and only if by then the model serves from
  other stubs. A reload that reports failure retires the old copy the same way, since Triton may
  have switched copies all the same (a load call that timed out) (docs/reliability.md).
* **Crash loops.** More than ``max_reloads`` reloads of one model within ``window`` seconds and
  the reloader gives up on that model: it is reported ``failed``, the liveness probe fails (so
  Kubernetes restarts the pod), and the other models keep serving.

The reloader publishes what it is doing in a small JSON state file beside the server
(``state_path``): the liveness and readiness probes (``python -m tritonlocal.liveness``) read it.
The launcher's ``Supervisor`` runs a ``Reloader`` in-process; in the container, where tritonserver
is the main process, ``python3 -m tritonlocal.reload`` runs one beside it. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from tritonlocal import drain, liveness, procs
from tritonlocal.drain import _call
from tritonlocal.reload_state import State, state_path

RELOAD_PARAMETER = "tritonlocal.reload"
# The orchestrators' parameter that caps every request's deadline, and its default
# (bls_models.params.MAX_DEADLINE; this module is standard library only, so the value is written
# here too and a test keeps the two equal). A model without it (not an orchestrator) answers
# what it holds when its execute returns: only retire_grace is waited.
MAX_DEADLINE_PARAMETER = "max_deadline_ms"
DEFAULT_MAX_DEADLINE_MS = 120_000


def longest_deadline(config: dict | None) -> float:
    """Seconds the longest request a model with ``config`` (its served config, as JSON) may
    still hold runs for: its ``max_deadline_ms``; the default cap when the config is unknown."""
    if config is None:
        return DEFAULT_MAX_DEADLINE_MS / 1e3
    value = ((config.get("parameters") or {}).get(MAX_DEADLINE_PARAMETER) or {}).get(
        "string_value")
    if value is None:
        return 0.0
    try:
        return max(0.0, float(value) / 1e3)
    except ValueError:
        return DEFAULT_MAX_DEADLINE_MS / 1e3


class ReloadError(RuntimeError):
    """The server refused or failed a reload."""




def model_config(url: str, model: str, headers: dict[str, str], timeout: float = 120.0) -> dict:
    """``model``'s served config (JSON). Raises ReloadError with the server's words."""
    status, body = _call(url, f"/v2/models/{urllib.parse.quote(model)}/config", headers,
                         timeout=timeout)
    if status != 200:
        raise ReloadError(f"/v2/models/{model}/config answered {status}: {body[:200]!r}")
    return json.loads(body)


def load_model(url: str, model: str, headers: dict[str, str], timeout: float = 300.0) -> None:
    """Load ``model`` from the repository as its files are; returns when it serves. Raises
    ReloadError with the server's words otherwise."""
    status, body = _call(url, f"/v2/repository/models/{urllib.parse.quote(model)}/load",
                         headers, {}, timeout=timeout)
    if status != 200:
        raise ReloadError(f"load of '{model}' answered {status}: {body[:300]!r}")


def reload_model(url: str, model: str, headers: dict[str, str], generation: str,
                 timeout: float = 120.0, config: dict | None = None) -> None:
    """Make Triton load a new copy of ``model`` (every instance new) from ``config`` (its served
    config, fetched when not given) and switch to it; returns when the new copy serves. Raises
    ReloadError with the server's words otherwise."""
    config = json.loads(json.dumps(config if config is not None
                                   else model_config(url, model, headers, timeout)))
    parameters = config.setdefault("parameters", {})
    parameters[RELOAD_PARAMETER] = {"string_value": generation}
    status, body = _call(url, f"/v2/repository/models/{urllib.parse.quote(model)}/load",
                         headers, {"parameters": {"config": json.dumps(config)}},
                         timeout=timeout)
    if status != 200:
        raise ReloadError(f"load of '{model}' answered {status}: {body[:300]!r}")


@dataclass(frozen=True)
class Retiring:
    """A live stub of a replaced copy, to be SIGKILLed at ``due`` (monotonic) if it is still
    that stub (``argv`` names its own shared-memory region: it tells the stub from a later
    process with its pid) and ``model`` serves from stubs other than ``replaced`` by then."""
    due: float
    pid: int
    argv: tuple[bytes, ...]
    model: str
    replaced: frozenset[int]


class Reloader:
    """Reloads the models whose stubs died, one check at a time (``handle``), and publishes its
    state for the probes. ``headers`` (the admin credential) open the repository API."""

    def __init__(self, url: str, headers: dict[str, str], interval: float = 1.0,
                 max_reloads: int = 5, window: float = 600.0, retire_grace: float = 5.0,
                 state_dir: str | None = None, log=print) -> None:
        self.url = url
        self.headers = headers
        self.interval = interval
        self.max_reloads = max_reloads
        self.window = window
        self.retire_grace = retire_grace
        self.state_dir = state_dir
        self.log = log
        self.state: State | None = None
        self.history: dict[str, list[float]] = {}   # model -> monotonic times of its reloads
        # The replaced copies' live stubs, each stopped once its longest request is over.
        self.to_kill: list[Retiring] = []
        self.events: list[tuple[float, str]] = []

    # -- state ----------------------------------------------------------------------------
    @property
    def server_pid(self) -> int | None:
        return self.state.server_pid if self.state else None

    def attach(self, server_pid: int) -> None:
        """Watch tritonserver ``server_pid`` (a new server: what was retired or failed is gone),
        and publish the state: once per check."""
        if self.state is None or not self.state.belongs_to(server_pid):
            self.forget()
            self.state = State(server_pid, procs.start_ticks(server_pid), interval=self.interval)
            self.history.clear()
            self.to_kill.clear()
        self.publish()

    def forget(self) -> None:
        """Remove the state file of the server watched so far."""
        if self.state is not None:
            state_path(self.state.server_pid, self.state_dir).unlink(missing_ok=True)
        self.state = None

    def publish(self) -> None:
        if self.state is None:
            return
        # A retired pid that no longer exists is not needed any more (and could be reused).
        self.state.retired = [pid for pid in self.state.retired if procs.alive(pid)]
        self.state.updated = time.time()
        try:
            self.state.write(state_path(self.state.server_pid, self.state_dir))
        except OSError as error:
            self.log(f"reloader: cannot write its state: {error}")

    @property
    def retired(self) -> set[int]:
        return set(self.state.retired) if self.state else set()

    # -- one check --------------------------------------------------------------------------
    def handle(self, report: liveness.Report) -> list[str]:
        """Reload every model ``report`` finds without a live stub; returns the models it could
        not bring back this time (reload refused or failed; those given up on are in
        ``state.failed``)."""
        assert self.state is not None, "attach() first"
        failed_now = []
        for model in report.dead_models:
            if model in self.state.failed:
                continue
            now = time.monotonic()
            recent = [t for t in self.history.get(model, []) if now - t < self.window]
            if len(recent) >= self.max_reloads:
                reason = (f"{len(recent)} reloads within {self.window:.0f} s and its stub died "
                          f"again ({', '.join(i for i in report.missing if liveness.model_of(i) == model)})")
                self.state.failed[model] = reason
                self.events.append((now, f"gave up: {model}"))
                self.log(f"reloader: giving up on '{model}': {reason}; the liveness probe now "
                         "fails, the other models keep serving")
                continue
            self.history[model] = recent + [now]
            if not self.reload(model, report):
                failed_now.append(model)
        self.publish()
        return failed_now

    def reload(self, model: str, report: liveness.Report) -> bool:
        """Retire the model's current stubs (and the dead ones found), load a new copy, and check
        that every instance of it has a new live stub."""
        state = self.state
        before = set(liveness_stubs(self.server_pid).get(model, []))
        # A stub killed a moment ago may still be exiting (its argv, so its instance, is gone)
        # or have become a zombie since the check. Left out, it is a zombie of no known
        # instance after the reload, which the supervisor restarts the whole server for.
        dying = {stub.pid for stub in liveness.stubs_of(self.server_pid) if not stub.instance}
        state.retired = sorted(set(state.retired) | before | set(report.zombies) | dying)
        state.reloading = sorted(set(state.reloading) | {model})
        self.publish()
        started = time.monotonic()
        self.events.append((started, f"reload: {model}: {report.summary()}"))
        self.log(f"reloader: {report.summary()}; reloading '{model}' alone (reload "
                 f"{len(self.history[model])} of this model within {self.window:.0f} s)")
        state.reloads[model] = state.reloads.get(model, 0) + 1
        config = None
        try:
            config = model_config(self.url, model, self.headers)
            reload_model(self.url, model, self.headers, f"{state.reloads[model]}-{time.time():.3f}",
                         config=config)
            fresh = liveness.check(self.url, self.server_pid, headers=self.headers,
                                   retired=set(state.retired))
            if model in fresh.dead_models:
                raise ReloadError(f"'{model}' still has instance(s) without a live stub after "
                                  f"its reload: {fresh.missing}")
        except (ReloadError, liveness.CheckError, OSError, ValueError) as error:
            self.events.append((time.monotonic(), f"reload failed: {model}: {error}"))
            # Triton may have switched copies all the same (the load call timed out, or the
            # check failed): the old copy's stubs are retired like after a reload, and stopped
            # only if the model serves from other stubs by then.
            wait = self.retire(model, before, config)
            self.log(f"reloader: reloading '{model}' failed: {error}; its earlier stubs "
                     f"{sorted(before)} stop in {wait:.0f} s if another copy serves by then")
            return False
        finally:
            state.reloading = sorted(set(state.reloading) - {model})
        wait = self.retire(model, before, config)
        self.events.append((time.monotonic(), f"reloaded: {model}"))
        self.log(f"reloader: '{model}' is serving again from new stubs after "
                 f"{time.monotonic() - started:.1f} s; the replaced copy's live stubs "
                 f"{sorted(before)} stop in {wait:.0f} s, when no request they hold can still "
                 "be within its deadline")
        return True

    def retire(self, model: str, stubs: set[int], config: dict | None) -> float:
        """Schedule ``model``'s replaced ``stubs`` to stop once the longest request they may
        hold is over (``longest_deadline(config)`` + ``retire_grace``); returns that wait."""
        wait = longest_deadline(config) + self.retire_grace
        due = time.monotonic() + wait
        for pid in sorted(stubs):
            try:
                self.to_kill.append(Retiring(due, pid, procs.process(pid).argv, model,
                                             frozenset(stubs)))
            except (OSError, ValueError, IndexError):
                continue  # already gone
        return wait

    def kill_due(self, now: float | None = None) -> list[int]:
        """SIGKILL retired live stubs whose time has come, if they are still those stubs (same
        argv, still the server's children, not zombies) and their model serves from other
        stubs (a reload that failed without switching copies leaves the old copy serving: its
        stubs are not stopped)."""
        now = time.monotonic() if now is None else now
        due = [entry for entry in self.to_kill if entry.due <= now]
        self.to_kill = [entry for entry in self.to_kill if entry.due > now]
        killed = []
        serving = liveness_stubs(self.server_pid) if due else {}
        for entry in due:
            try:
                process = procs.process(entry.pid)
            except (OSError, ValueError, IndexError):
                continue  # gone
            if (not process.is_stub or process.state == "Z" or process.ppid != self.server_pid
                    or process.argv != entry.argv):
                continue
            if not set(serving.get(entry.model, ())) - entry.replaced:
                self.log(f"reloader: '{entry.model}' has no stubs but {sorted(entry.replaced)}: "
                         f"its copy was not replaced, so stub {entry.pid} keeps serving")
                continue
            if procs.kill(entry.pid):
                killed.append(entry.pid)
        return killed


def liveness_stubs(server_pid: int | None) -> dict[str, list[int]]:
    """Model -> pids of the server's live (not zombie) stubs."""
    found: dict[str, list[int]] = {}
    if server_pid is None:
        return found
    for stub in liveness.stubs_of(server_pid):
        if stub.state != "Z" and stub.instance:
            found.setdefault(liveness.model_of(stub.instance), []).append(stub.pid)
    return found


def main(argv: list[str] | None = None) -> int:
    """The container's watcher: reload models of the one tritonserver here whose stubs die."""
    parser = argparse.ArgumentParser(
        prog="python3 -m tritonlocal.reload",
        description="Watch the tritonserver of this PID namespace and reload, through its "
                    "repository API, any model whose python-backend stub died.")
    parser.add_argument("--url", default=os.environ.get("TRITON_HTTP_URL", "localhost:8000"))
    parser.add_argument("--header", default=os.environ.get("TRITONLOCAL_ADMIN_HEADER"),
                        metavar="NAME=VALUE",
                        help="the admin credential, which the repository API answers (default "
                             "$TRITONLOCAL_ADMIN_HEADER)")
    parser.add_argument("--server-pid", type=int,
                        help="the tritonserver to watch (default: the only one in this PID "
                             "namespace, whichever it is at each check)")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="seconds between checks (default 0.5; ~3.5 ms of CPU each)")
    parser.add_argument("--max-reloads", type=int, default=5)
    parser.add_argument("--window", type=float, default=600.0)
    parser.add_argument("--retire-grace", type=float, default=5.0,
                        help="seconds a replaced copy's stubs live past the longest deadline "
                             "their model allows (its max_deadline_ms; default 5)")
    liveness.memory_bound_argument(parser)
    args = parser.parse_args(argv)
    if not args.header or "=" not in args.header:
        parser.error("the admin credential is needed (--header NAME=VALUE)")
    name, value = args.header.split("=", 1)
    reloader = Reloader(args.url, {name: value}, args.interval, args.max_reloads, args.window,
                        args.retire_grace, log=lambda line: print(line, file=sys.stderr, flush=True))
    stop = False

    def finish(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    expected: tuple[State, dict[str, list[str]]] | None = None  # per server: reloads keep them
    try:
        while not stop:
            time.sleep(args.interval)
            if args.server_pid is not None:
                if not procs.alive(args.server_pid):
                    break  # that server is gone
                servers = [args.server_pid]
            else:
                servers = liveness.server_pids()
            if len(servers) != 1:
                continue  # starting, stopping, or not ours to choose between
            reloader.attach(servers[0])
            reloader.kill_due()
            if expected is None or expected[0] is not reloader.state:
                # Only once the server is ready: before, not every model is loaded yet.
                if not liveness.is_ready(args.url, headers={name: value}):
                    continue
                try:
                    expected = (reloader.state, liveness.expected_instances(
                        args.url, headers={name: value}))
                except (liveness.CheckError, urllib.error.URLError, OSError, ValueError):
                    expected = None  # not answering yet: the check says so
            try:
                report = liveness.check(args.url, servers[0], headers={name: value},
                                        retired=reloader.retired,
                                        expected=expected[1] if expected else None,
                                        max_memory_mib=args.max_server_memory_mib)
            except liveness.CheckError:
                continue
            if report.over_memory:
                # Drained (tritonlocal.drain), then SIGTERM: tritonserver exits and the
                # container's restart policy (or Kubernetes) starts it again.
                print(f"watcher: {report.summary()}", file=sys.stderr, flush=True)
                try:
                    drain.drain(args.url, {name: value},
                                log=lambda line: print(line, file=sys.stderr, flush=True))
                finally:
                    procs.signal_process(servers[0], signal.SIGTERM)
                break
            if report.live:
                reloader.handle(report)
    finally:
        reloader.forget()
    return 0


if __name__ == "__main__":
    sys.exit(main())
