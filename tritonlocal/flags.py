"""The tritonserver flags this repository is served with, locally (the launcher) and in the NGC
container (``scripts/container-serve.sh``): one list, so both places serve it the same way.

    TRITONLOCAL_ADMIN_HEADER=NAME=VALUE python3 -m tritonlocal.flags   # the container's flags
    python3 -m tritonlocal.flags --new-credential FILE   # a credential, to FILE (0600) and stdout
    printf '%s\0' tritonserver ARG... | python3 -m tritonlocal.flags --redact-command

Every admin API (RESTRICTED_APIS) answers only the admin credential, unless an operator opens it.
The credential reaches tritonserver on its command line: r24.10 takes it nowhere else. ``redact``
and ``redact_text`` are what every printed or logged command line and log excerpt goes through,
and ``SECRET_VARIABLES`` are kept out of tritonserver's environment, which every python-backend
stub inherits (docs/operations.md, "Who may call the admin APIs").

Standard library only: it runs inside the container before anything else is known to work.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

MIB = 2**20
# The python backend's shared-memory region per stub: start and growth step. Regions never
# shrink; from Triton's 1 MiB default the orchestrators' regions crept to ~190 MiB in 1 MiB steps
# (docs/orchestrator.md). Sizing /dev/shm: docs/operations.md.
SHM_DEFAULT_BYTES = 32 * MIB
SHM_GROWTH_BYTES = 16 * MIB
# The python backend's per-instance pool of server-side threads (undocumented, default 32). Each
# BLS call in flight holds one until the sub-model answers, and each response a stub sends needs
# one: it must exceed what an orchestrator instance has out at once, its ``subrequest_threads``
# (16 for `pipeline`), or the answers its clock sends at their deadlines wait behind calls to a
# slow model (docs/reliability.md).
# tests/tooling/test_configs.py checks.
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
# The admin APIs: everything that changes what the server serves or reads (model load/unload,
# registering shared-memory regions) or what it logs and traces. Each answers only requests that
# carry the admin credential, unless an operator opens it (OPEN_APIS_VARIABLE). Health,
# metadata, inference, model config, statistics and metrics need nothing.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# The admin credential: one header, the operator's (TRITONLOCAL_ADMIN_HEADER, --admin-header) or,
# without one, ADMIN_HEADER with a random value made at start and written to a file only its user
# can read (write_credential). tritonserver gets it on its argv, which r24.10's
# --http-restricted-api and --grpc-restricted-protocol are the only way to give it: any local
# user who can read that process's /proc/<pid>/cmdline can read it too (docs/operations.md, "Who
# may call the admin APIs"). It is in no log, no printed command line, and not in the environment
# of tritonserver or its stubs. Over gRPC, r24.10 expects the header's name with the prefix
# GRPC_PREFIX.
ADMIN_HEADER = "triton-admin-key"
GRPC_PREFIX = "triton-grpc-protocol-"
# An operator's credential shorter than this is refused: a placeholder (the Kubernetes Secret's
# template) or a guessable word. Generated ones are 64 hex digits.
MIN_CREDENTIAL_CHARS = 32
# Where an operator's admin header is handed in. Never passed on to tritonserver: its
# python-backend stubs (any model's code) inherit its environment.
SECRET_VARIABLES = ("TRITONLOCAL_ADMIN_HEADER",)
# The APIs an operator opens to every client, comma-separated (``python -m tritonlocal serve
# --open-api``, the container's environment). Each prints open_api_warnings at start.
OPEN_APIS_VARIABLE = "TRITONLOCAL_OPEN_APIS"
# The flags whose value carries a header's value (``<apis>:<name>=<value>``), and what is printed
# instead of that value.
RESTRICTION_FLAGS = ("--http-restricted-api", "--grpc-restricted-protocol")
REDACTED = "<redacted>"


def serving_flags(shm_default_bytes: int = SHM_DEFAULT_BYTES,
                  shm_growth_bytes: int = SHM_GROWTH_BYTES,
                  python_thread_pool: int = PYTHON_THREAD_POOL,
                  load: list[str] | None = None) -> list[str]:
    """What every server of this repository runs with, wherever it runs. ``load``: the models
    loaded at start, when not all (tritonlocal.deferred)."""
    return [
        # Every model in the repository is loaded at start, as with mode "none"; explicit control
        # lets the supervisor reload one model whose python stub died (tritonlocal.reload) while
        # the others keep serving. The repository API is restricted (restriction_flags).
        "--model-control-mode=explicit",
        *([f"--load-model={model}" for model in load] if load is not None else ["--load-model=*"]),
        # The configs are complete and committed: load them exactly as written.
        "--disable-auto-complete-config",
        # A model that fails to load stops the server instead of serving without it.
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--backend-config=python,shm-default-byte-size={shm_default_bytes}",
        f"--backend-config=python,shm-growth-byte-size={shm_growth_bytes}",
        f"--backend-config=python,thread-pool-size={python_thread_pool}",
    ]


def new_credential() -> tuple[str, str]:
    """A fresh admin credential: (ADMIN_HEADER, 64 random hex digits)."""
    return ADMIN_HEADER, secrets.token_hex(32)


def parse_header(spec: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (name, value), checked as an operator's credential (check_credential)."""
    name, _, value = spec.partition("=")
    check_credential((name, value))
    return name, value


def check_header(header: tuple[str, str]) -> None:
    """``header`` fits a restriction rule (``<apis>:<name>=<value>``)."""
    name, value = header
    if not re.fullmatch(r"[A-Za-z0-9-]+", name) or not value or any(c in value for c in ",:= "):
        raise ValueError("the admin header needs a name of letters, digits and '-' and a "
                         "non-empty value without ',', ':', '=' or spaces")


def check_credential(header: tuple[str, str]) -> None:
    """check_header, and a value of at least MIN_CREDENTIAL_CHARS characters."""
    check_header(header)
    if len(header[1]) < MIN_CREDENTIAL_CHARS:
        raise ValueError(f"the admin header's value has {len(header[1])} characters; at least "
                         f"{MIN_CREDENTIAL_CHARS} are needed (generate one: python3 -c 'import "
                         "secrets; print(secrets.token_hex(32))')")


def parse_open_apis(spec: str | list[str] | None) -> tuple[str, ...]:
    """``"logging,trace"`` (or a list of names) -> the RESTRICTED_APIS named, in their order."""
    names = spec.split(",") if isinstance(spec, str) else list(spec or [])
    names = {name.strip() for name in names if name.strip()}
    unknown = sorted(names - set(RESTRICTED_APIS))
    if unknown:
        raise ValueError(f"unknown admin API(s) to open: {', '.join(unknown)} (the admin APIs: "
                         f"{', '.join(RESTRICTED_APIS)})")
    return tuple(api for api in RESTRICTED_APIS if api in names)


def open_api_warnings(open_apis: tuple[str, ...]) -> list[str]:
    """One warning line per admin API an operator opened, for the start of the output."""
    return [f"warning: the {api} API is open: every client that reaches the HTTP or gRPC port "
            f"may call it without the admin credential ({OPEN_APIS_VARIABLE} / --open-api)"
            for api in open_apis]


def header_line(header: tuple[str, str]) -> str:
    """``header`` as one HTTP header line (``curl -H @FILE`` reads a file of these)."""
    return f"{header[0]}: {header[1]}"


def write_credential(path: Path, header: tuple[str, str]) -> None:
    """Write ``header`` to ``path`` (header_line), readable and writable by its user alone: made
    beside it with mode 0600, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # whatever the umask, and if the name existed
        os.write(descriptor, f"{header_line(header)}\n".encode())
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


def read_credential(path: Path) -> tuple[str, str]:
    """The header a credential file holds (write_credential's format, or ``NAME=VALUE``)."""
    text = Path(path).read_text().strip()
    name, separator, value = text.partition(":") if ":" in text else text.partition("=")
    if not separator:
        raise ValueError(f"{path} holds no header (NAME: VALUE)")
    header = name.strip(), value.strip()
    check_header(header)
    return header


def restriction_flags(header: tuple[str, str], apis: tuple[str, ...] = RESTRICTED_APIS) -> list[str]:
    """tritonserver flags that answer ``apis`` only for requests carrying ``header``, over HTTP
    and gRPC (Triton's --http-restricted-api / --grpc-restricted-protocol)."""
    check_header(header)
    name, value = header
    rule = f"{','.join(apis)}:{name.lower()}={value}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def admin_restrictions(credential: tuple[str, str],
                       open_apis: tuple[str, ...] = ()) -> list[str]:
    """Every RESTRICTED_APIS but ``open_apis`` answers only requests carrying ``credential``."""
    apis = tuple(api for api in RESTRICTED_APIS if api not in open_apis)
    return restriction_flags(credential, apis) if apis else []


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


def container_flags(credential: tuple[str, str],
                    model_repository: str = CONTAINER_REPOSITORY,
                    open_apis: tuple[str, ...] = ()) -> list[str]:
    """The NGC container's server: all interfaces inside the container (publish the ports to
    127.0.0.1 on the host unless told otherwise), GPU metrics on, a CUDA memory pool per GPU
    sized for the GPU profiles, every admin API but ``open_apis`` restricted to ``credential``
    (admin_restrictions; the entry script hands the same header to the container's reload
    watcher)."""
    return [f"--model-repository={model_repository}", *serving_flags(),
            *admin_restrictions(credential, open_apis),
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
                                                 "admin credential included: for the entry script "
                                                 "to pass on, not to show.")
    parser.add_argument("--model-repository", default=CONTAINER_REPOSITORY)
    parser.add_argument("--admin-header", metavar="NAME=VALUE",
                        default=os.environ.get("TRITONLOCAL_ADMIN_HEADER") or None,
                        help="the admin credential (default $TRITONLOCAL_ADMIN_HEADER); needed")
    parser.add_argument("--open-apis", metavar="API,...",
                        default=os.environ.get(OPEN_APIS_VARIABLE, ""),
                        help=f"admin APIs open to every client (default ${OPEN_APIS_VARIABLE}; "
                             f"of {', '.join(RESTRICTED_APIS)}); a warning line each, on stderr")
    parser.add_argument("--new-credential", metavar="FILE", type=Path,
                        help="instead: make a credential, write it to FILE (mode 0600) and print "
                             "it as NAME=VALUE for the entry script to capture")
    parser.add_argument("--redact-command", action="store_true",
                        help="instead: read a command line from stdin, its arguments each ended "
                             "by a NUL byte, and print it on one line with every restriction "
                             "flag's header value redacted (the entry script's dry run)")
    args = parser.parse_args(argv)
    if args.redact_command:
        command = sys.stdin.buffer.read().decode().split("\0")
        print(" ".join(redact(command[:-1] if command[-1] == "" else command)))
        return 0
    if args.new_credential is not None:
        credential = new_credential()
        write_credential(args.new_credential, credential)
        print("=".join(credential))
        return 0
    try:
        if not args.admin_header:
            raise ValueError("no admin credential: set TRITONLOCAL_ADMIN_HEADER=NAME=VALUE")
        credential = parse_header(args.admin_header)
        open_apis = parse_open_apis(args.open_apis)
    except ValueError as error:
        parser.error(str(error))
    for line in open_api_warnings(open_apis):
        print(line, file=sys.stderr)
    print("\n".join(container_flags(credential, args.model_repository, open_apis)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
