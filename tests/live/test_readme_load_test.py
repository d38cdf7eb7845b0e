"""The README's load test ("Load-test it yourself") runs as written against a live server: each
perf_analyzer command succeeds, and the metrics command shows what the orchestrators counted.

Only the ports and the admin credential's file are replaced (the test server's instead of the
defaults), and each perf_analyzer command gets the benchmark smoke runs' short measurement
windows (``bench.perf.QUICK_WINDOWS``) so the suite stays fast. The commands run in bash, as pasted."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.perf import QUICK_WINDOWS

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Load-test it yourself", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def for_server(command: str, server) -> str:
    http, grpc = server.http_url.rsplit(":", 1)[1], server.grpc_url.rsplit(":", 1)[1]
    metrics = server.metrics_url.split(":")[2].split("/")[0]
    return (command.replace("127.0.0.1:8001", f"127.0.0.1:{grpc}")
            .replace("127.0.0.1:8000", f"127.0.0.1:{http}")
            .replace("127.0.0.1:8002", f"127.0.0.1:{metrics}")
            .replace(".triton/admin-8000.header", shlex.quote(str(server.credential_file))))


def test_the_readme_has_a_command_per_orchestrator_and_protocol():
    commands = readme_commands()
    perf = [c for c in commands if c.startswith(".venv/bin/perf_analyzer")]
    assert {re.search(r"-m (\S+)", c).group(1) for c in perf} >= {"pipeline", "tag_pipeline"}
    assert {re.search(r"-i (\S+)", c).group(1) for c in perf} == {"grpc", "http"}
    shm = [c for c in perf if "--shared-memory system" in c]
    # Registering regions is an admin API; perf_analyzer sends headers over HTTP only.
    assert shm and all("-i http" in c and "-H \"$(cat .triton/admin-8000.header)\"" in c
                       for c in shm)
    assert any("/metrics" in c for c in commands)


@pytest.mark.parametrize("index", range(len([c for c in readme_commands()
                                             if c.startswith(".venv/bin/perf_analyzer")])))
def test_each_perf_analyzer_command_runs(server, index):
    command = [c for c in readme_commands() if c.startswith(".venv/bin/perf_analyzer")][index]
    done = subprocess.run(["bash", "-c", f"{for_server(command, server)} {shlex.join(QUICK_WINDOWS)}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert re.search(r"Throughput: [\d.]+ infer/sec", output), output[-3000:]


def test_the_metrics_command_shows_the_orchestrators_counts(server, grpc_client):
    from tests.helpers import eventually, image, metric, timed_infer

    before = metric(server, "bls_requests_total", model="pipeline", code="SUCCESS")
    assert timed_infer(grpc_client, "grpc", "pipeline", image(3)).error is None
    # The runtime publishes counters from a thread of its own every FLUSH_SECONDS: a scrape
    # right after the answer missed the first request of a fresh server once (CI, 2026-11-28).
    assert eventually(server, "bls_requests_total", lambda v: v > before, model="pipeline",
                      code="SUCCESS") > before
    (command,) = [c for c in readme_commands() if "/metrics" in c]
    done = subprocess.run(for_server(command, server), shell=True, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert re.search(r'^bls_requests_total\{.*model="pipeline".*\} [1-9]', done.stdout, re.M), \
        done.stdout[-2000:]
