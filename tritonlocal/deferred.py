"""Models served later: ``make serve`` answers before every model is made.

A model whose file the project's export deferred (``modelgen.export --defer``: ``digits_large``,
whose training takes minutes on a small host) is left out of the server's start, with every
model that needs it (an ensemble step or a BLS stage naming it). The others serve at once. A
thread then runs the export, echoing its progress, and loads the deferred models and their
dependents through the repository API, in that order, each ready when its load returns.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from tritonlocal import reload

PREFIX = "models:"


def dependents(repository: Path, models: set[str]) -> set[str]:
    """The models of ``repository`` that need one of ``models``, directly or through another:
    an ensemble step, or a parameter naming it (a BLS stage's model)."""
    from bls_models.repository import load_config

    needs = {}
    for path in repository.glob("*/config.pbtxt"):
        config = load_config(path)
        named = {step.model_name for step in config.ensemble_scheduling.step}
        named |= {p.string_value for p in config.parameters.values()}
        needs[path.parent.name] = named
    found: set[str] = set()
    while True:
        more = {name for name, named in needs.items()
                if name not in found and named & (models | found)}
        if not more:
            return found
        found |= more


def pending(repository: Path) -> tuple[list[str], list[str]]:
    """(models whose file is missing, the models that need them), each sorted: what to serve
    later. Empty for a repository with every file."""
    from modelgen.export import missing_model_files

    missing = sorted({path.parent.parent.name for path in missing_model_files(repository)})
    return missing, sorted(dependents(repository, set(missing)) - set(missing))


def make_later(server, missing: list[str], after: list[str], size: str, log=print,
               stop: threading.Event | None = None) -> threading.Thread:
    """Start the thread that exports ``missing`` into ``server``'s repository and then loads
    them and ``after``; each step is one line of ``log``. On success the server's options load
    every model again at a restart."""
    def run() -> None:
        log(f"{PREFIX} {', '.join(missing)} being made; {', '.join(after) or 'nothing else'} "
            "will serve once it is (progress below)")
        command = [sys.executable, "-m", "modelgen.export", "--repository",
                   str(server.options.model_repository), "--size", size]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as process:
            for line in process.stdout:
                log(f"{PREFIX} {line.rstrip()}")
                if stop is not None and stop.is_set():
                    process.kill()
                    return
        if process.returncode != 0:
            log(f"{PREFIX} making {', '.join(missing)} failed (exit {process.returncode}): "
                f"{', '.join(missing + after)} not served")
            return
        for model in missing + after:
            if stop is not None and stop.is_set():
                return
            try:
                reload.load_model(server.http_url, model, server.admin_headers)
            except reload.ReloadError as error:
                log(f"{PREFIX} {model} could not be loaded: {error}")
                return
            log(f"{PREFIX} {model} is ready")
        server.options.deferred = frozenset()

    thread = threading.Thread(target=run, name="tritonlocal-deferred", daemon=True)
    thread.start()
    return thread
