"""Drain a tritonserver before it stops: its requests in flight are answered, not dropped.

On SIGINT or SIGTERM, Triton 2.51 refuses every new inference at once, a BLS orchestrator's
sub-requests included ("Server not ready"), so the orchestrators' requests in flight fail (seen:
45 of 48). Unloading a model instead is graceful: it refuses new requests (NOT_FOUND) and its
copy stays until the requests it holds are answered. So a drain unloads the models that call
other models (python-backend orchestrators, ensembles) through the repository API, waits until
every one is gone, and only then may the server be stopped: its other models have nothing left
to do. Standard library only: the supervisor, the container's watcher and the Kubernetes
``preStop`` hook run it::

    python3 -m tritonlocal.drain --url localhost:8000      # exit 0 drained, 1 not in time
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

CALLERS = ("python",)   # backends whose models may call others (BLS)
DRAIN_SECONDS = 30.0    # Triton's own exit timeout: what a stop would have waited anyway


def _call(url: str, path: str, headers: dict[str, str], body: dict | None = None,
          timeout: float = 120.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{url}{path}", data=data, headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def callers(url: str, headers: dict[str, str], timeout: float = 10.0) -> list[str]:
    """The loaded models that may call other models: python-backend models and ensembles."""
    status, body = _call(url, "/v2/repository/index", headers, {"ready": True}, timeout)
    if status != 200:
        raise RuntimeError(f"/v2/repository/index answered {status}: {body[:200]!r}")
    names = []
    for entry in json.loads(body):
        status, body = _call(url, f"/v2/models/{urllib.parse.quote(entry['name'])}/config",
                             headers, timeout=timeout)
        config = json.loads(body) if status == 200 else {}
        if config.get("backend") in CALLERS or config.get("platform") == "ensemble":
            names.append(entry["name"])
    return sorted(set(names))


def drain(url: str, headers: dict[str, str], seconds: float = DRAIN_SECONDS, log=print) -> bool:
    """Unload every model that calls others and wait (up to ``seconds``) until none is left;
    True when drained."""
    models = callers(url, headers)
    for model in models:
        status, body = _call(url, f"/v2/repository/models/{urllib.parse.quote(model)}/unload",
                             headers, {}, seconds)
        if status != 200:
            log(f"drain: unloading {model} answered {status}: {body[:200]!r}")
    give_up = time.monotonic() + seconds
    left = models
    while left and time.monotonic() < give_up:
        time.sleep(0.1)
        status, body = _call(url, "/v2/repository/index", headers, {}, 10.0)
        if status == 200:
            states = {e["name"]: e.get("state", "") for e in json.loads(body)}
            left = [m for m in models if states.get(m) in ("READY", "UNLOADING", "LOADING")]
    log(f"drain: {', '.join(models) or 'nothing'} unloaded"
        + (f"; still answering: {', '.join(left)}" if left else ""))
    return not left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tritonlocal.drain",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("TRITON_HTTP_URL", "localhost:8000"))
    parser.add_argument("--header", default=os.environ.get("TRITONLOCAL_ADMIN_HEADER"),
                        metavar="NAME=VALUE", help="the admin credential (default "
                                                   "$TRITONLOCAL_ADMIN_HEADER)")
    parser.add_argument("--seconds", type=float, default=DRAIN_SECONDS)
    args = parser.parse_args(argv)
    if not args.header or "=" not in args.header:
        parser.error("the admin credential is needed (--header NAME=VALUE)")
    name, value = args.header.split("=", 1)
    try:
        drained = drain(args.url, {name: value}, args.seconds,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, RuntimeError, ValueError) as error:
        print(f"drain: {error}", file=sys.stderr)
        return 1
    return 0 if drained else 1


if __name__ == "__main__":
    sys.exit(main())
