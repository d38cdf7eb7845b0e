"""The tritonserver flags this repository is served with, locally (the launcher) and in the NGC
container (``scripts/container-serve.sh``): one list, so both places serve it the same way.

    python3 -m tritonlocal.flags                       # the container's flags, one per line
    python3 -m tritonlocal.flags --model-repository /models
    printf '%s\0' tritonserver ARG... | python3 -m tritonlocal.flags --redact-command

The repository API's header (an admin header, or the supervisor's token) reaches tritonserver on
its command line: r24.10 takes it nowhere else. ``redact`` and ``redact_text`` are what every
printed or logged command line and log excerpt goes through, and ``SECRET_VARIABLES`` are kept
out of tritonserver's environment, which every python-backend stub inherits (docs/operations.md,
"Who may reload").

Standard library only: it runs inside the container before anything else is known to work.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys

MIB = 2**20
# The python backend's shared-memory region per stub: start and growth step. Regions never
# shrink; from Triton's 1 MiB default the orchestrators' regions crept to ~190 MiB in 1 MiB steps
# (docs/orchestrator.md). Sizing /dev/shm: docs/operations.md.
SHM_DEFAULT_BYTES = 32 * MIB
SHM_GROWTH_BYTES = 16 * MIB
# The python backend's per-instance pool of server-side threads (undocumented, default 32). Each
# BLS call in flight holds one until the sub-model answers, and each response a stub sends needs
# one: it must exceed every orchestrator's ``subrequest_threads`` (64), or responses wait behind
# calls to a slow model (docs/reliability.md). tests/unit/test_configs.py checks.
PYTHON_THREAD_POOL = 96
CONTAINER_REPOSITORY = "/opt/bls/model_repository"
# Triton's CUDA memory pool per GPU (--cuda-memory-pool-byte-size; its default is 64 MiB). The GPU
# tensors of BLS requests and responses (gpu_tensors on: PIXELS, 9.6 MB at batch 16) and the
# onnxruntime backend's batch buffers come from it; past it, every tensor falls back to
# cudaMalloc/cudaFree and a CUDA IPC handle of its own. The arithmetic is in docs/production.md
# ("The CUDA memory pool"); modelgen.profiles.cuda_pool_bytes computes it and a test keeps the two
# equal. One flag per GPU id: Triton creates pools only for the GPUs it finds (core r24.10
# cuda_memory_manager.cc), so ids past the host's last GPU are ignored.
CUDA_MEMORY_POOL_BYTES = 256 * MIB
CUDA_POOL_GPUS = 8
# The APIs an admin header restricts: everything that changes what the server serves or reads
# (model load/unload, registering shared-memory regions) or what it logs and traces. Health,
# metadata, inference, model config and statistics stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# Without an admin header of the operator's, the repository API (which explicit model control
# opens, for the supervisor's reloads) answers only a random token of this name, made for each
# server: nothing is open that model control mode "none" kept closed. The supervisor holds it, and
# tritonserver gets it on its argv, which r24.10's --http-restricted-api and
# --grpc-restricted-protocol are the only way to give it: any local user who can read that
# process's /proc/<pid>/cmdline can read it too (docs/operations.md, "Who may reload"). It is in
# no log, no printed command line, and not in the environment of tritonserver or its stubs.
TOKEN_HEADER = "triton-reload-token"
# Where an operator's admin header, or a token chosen for the container, is handed in. Never
# passed on to tritonserver: its python-backend stubs (any model's code) inherit its environment.
SECRET_VARIABLES = ("TRITONLOCAL_ADMIN_HEADER", "TRITONLOCAL_RELOAD_TOKEN")
# The flags whose value carries a header's value (``<apis>:<name>=<value>``), and what is printed
# instead of that value.
RESTRICTION_FLAGS = ("--http-restricted-api", "--grpc-restricted-protocol")
REDACTED = "<redacted>"


def serving_flags(shm_default_bytes: int = SHM_DEFAULT_BYTES,
                  shm_growth_bytes: int = SHM_GROWTH_BYTES,
                  python_thread_pool: int = PYTHON_THREAD_POOL) -> list[str]:
    """What every server of this repository runs with, wherever it runs."""
    return [
        # Every model in the repository is loaded at start, as with mode "none"; explicit control
        # lets the supervisor reload one model whose python stub died (tritonlocal.reload) while
        # the others keep serving. The repository API is restricted (restriction_flags).
        "--model-control-mode=explicit",
        "--load-model=*",
        # The configs are complete and committed: load them exactly as written.
        "--disable-auto-complete-config",
        # A model that fails to load stops the server instead of serving without it.
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--backend-config=python,shm-default-byte-size={shm_default_bytes}",
        f"--backend-config=python,shm-growth-byte-size={shm_growth_bytes}",
        f"--backend-config=python,thread-pool-size={python_thread_pool}",
    ]


def new_token() -> tuple[str, str]:
    """A header only this server's supervisor knows: (TOKEN_HEADER, 32 random hex digits)."""
    return TOKEN_HEADER, secrets.token_hex(16)


def parse_header(spec: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (name, value), checked as restriction_flags needs it."""
    name, _, value = spec.partition("=")
    check_header((name, value))
    return name, value


def check_header(header: tuple[str, str]) -> None:
    name, value = header
    if not re.fullmatch(r"[A-Za-z0-9-]+", name) or not value or any(c in value for c in ",:= "):
        raise ValueError("the admin header needs a name of letters, digits and '-' and a "
                         "non-empty value without ',', ':', '=' or spaces")


def restriction_flags(header: tuple[str, str], apis: tuple[str, ...] = RESTRICTED_APIS) -> list[str]:
    """tritonserver flags that answer ``apis`` only for requests carrying ``header``, over HTTP
    and gRPC (Triton's --http-restricted-api / --grpc-restricted-protocol)."""
    check_header(header)
    name, value = header
    rule = f"{','.join(apis)}:{name.lower()}={value}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def admin_restrictions(admin_header: tuple[str, str] | None,
                       token: tuple[str, str]) -> list[str]:
    """The operator's admin header restricts every RESTRICTED_APIS; without one, the repository
    API alone is restricted to ``token`` (the supervisor's) and the others stay as Triton has
    them."""
    if admin_header is not None:
        return restriction_flags(admin_header)
    return restriction_flags(token, ("model-repository",))


def _is_restriction_flag(name: str) -> bool:
    """``name`` is a restriction flag, or an abbreviation getopt_long would take for one."""
    return any(flag.startswith(name) and len(name) > len("--http-") for flag in RESTRICTION_FLAGS)


def _redact_rule(rule: str) -> str:
    apis, colon, header = rule.partition(":")
    name, equals, _ = header.partition("=")
    if not colon or not equals:
        return REDACTED  # not a rule this module would write: hide all of it
    return f"{apis}:{name}={REDACTED}"


def redact(command: list[str]) -> list[str]:
    """``command`` (tritonserver's argv, or part of it) as it may be printed or logged: the header
    value of every restriction flag (``--flag=RULE`` or ``--flag RULE``) replaced by REDACTED,
    everything else as it is."""
    shown: list[str] = []
    rule_next = False
    for arg in command:
        name, equals, rule = arg.partition("=")
        if rule_next:
            shown.append(_redact_rule(arg))
            rule_next = False
        elif name.startswith("--") and _is_restriction_flag(name):
            if equals:
                shown.append(f"{name}={_redact_rule(rule)}")
            else:
                shown.append(arg)
                rule_next = True
        else:
            shown.append(arg)
    return shown


# A restriction flag's rule in free text; the value ends where check_header forbids a character.
_RULE_IN_TEXT = re.compile(r"(--(?:http|grpc)-restricted[\w-]*[= ][\w,-]*:[\w-]+=)[^\s'\",:]+")


def redact_text(text: str, *values: str) -> str:
    """``text`` (a log excerpt, an error message) with every restriction flag's header value and
    every one of ``values`` (the header values a caller knows) replaced by REDACTED."""
    text = _RULE_IN_TEXT.sub(lambda match: match.group(1) + REDACTED, text)
    for value in values:
        if value:
            text = text.replace(value, REDACTED)
    return text


def container_flags(model_repository: str = CONTAINER_REPOSITORY,
                    admin_header: tuple[str, str] | None = None,
                    token: tuple[str, str] | None = None) -> list[str]:
    """The NGC container's server: all interfaces inside the container (publish the ports to
    127.0.0.1 on the host unless told otherwise), GPU metrics on, a CUDA memory pool per GPU
    sized for the GPU profiles, the repository API restricted (admin_restrictions; the entry
    script hands the same header to the container's reload watcher)."""
    return [f"--model-repository={model_repository}", *serving_flags(),
            *admin_restrictions(admin_header, token or new_token()),
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
            "--allow-metrics=true", "--allow-gpu-metrics=true", "--allow-cpu-metrics=true",
            *cuda_pool_flags()]


def cuda_pool_flags() -> list[str]:
    """A CUDA memory pool per GPU sized for the GPU profiles (the container's server, and the local
    server on a GPU host)."""
    return [f"--cuda-memory-pool-byte-size={gpu}:{CUDA_MEMORY_POOL_BYTES}"
            for gpu in range(CUDA_POOL_GPUS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tritonlocal.flags",
                                     description="Print the container's tritonserver flags, the "
                                                 "restriction header's value included: for the "
                                                 "entry script to pass on, not to show.")
    parser.add_argument("--model-repository", default=CONTAINER_REPOSITORY)
    parser.add_argument("--admin-header", metavar="NAME=VALUE",
                        default=os.environ.get("TRITONLOCAL_ADMIN_HEADER") or None,
                        help="restrict every admin API to this header (default "
                             "$TRITONLOCAL_ADMIN_HEADER)")
    parser.add_argument("--token", metavar="NAME=VALUE",
                        default=os.environ.get("TRITONLOCAL_RELOAD_TOKEN") or None,
                        help="without an admin header, the header the repository API answers "
                             "(default $TRITONLOCAL_RELOAD_TOKEN, else a random one)")
    parser.add_argument("--redact-command", action="store_true",
                        help="instead: read a command line from stdin, its arguments each ended "
                             "by a NUL byte, and print it on one line with every restriction "
                             "flag's header value redacted (the entry script's dry run)")
    args = parser.parse_args(argv)
    if args.redact_command:
        command = sys.stdin.buffer.read().decode().split("\0")
        print(" ".join(redact(command[:-1] if command[-1] == "" else command)))
        return 0
    try:
        admin = parse_header(args.admin_header) if args.admin_header else None
        token = parse_header(args.token) if args.token else None
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(container_flags(args.model_repository, admin, token)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
